#!/usr/bin/env bash
# One device call: GPU tests, our training-step benchmark, and the peer (speculators 0.9.0) beside it.
# Usage on the GPU machine, from the repo root: bash benchmarks/gpu_run.sh   (results under $OUT)
# Needs .peer/ = shared/peer-bench plus its wheels (bash .peer/get-wheels.sh .peer/whl), carried to the machine.
set -u
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/nvidia-smi.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

echo "=== GPU tests"
timeout 150 python3 -m pytest -q -x --tb=short -m gpu tests/test_gpu.py 2>&1 | tail -25 | tee "$OUT/gpu_tests.txt"

echo "=== ours: dflash-trainer bench (paper setting)"
timeout 240 python3 -m dflash_trainer bench recipes/bench-qwen3-8b.yaml --steps 10 --warmup 4 \
  --out "$OUT/ours.json" 2>&1 | grep -v "Loading weights" | tee "$OUT/ours.log" | tail -8

echo "=== peer: speculators 0.9.0 (same setting)"
if [ -d .peer/whl ]; then
  SITE=/tmp/peer_site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .peer/whl/*.whl
  (cd .peer && PYTHONPATH=$SITE timeout 200 python3 bench_speculators.py --num-layers 5 --block-size 16 \
    --target-layer-ids 1,9,17,25,33 --attn simple_flex_attention --full-attention --loss-fn ce --loss-impl fused \
    --per-position-loss-weight fixed-exp-decay --gamma 7 --optimizer adamw --lr 6e-4 --total-seq-len 8192 \
    --doc-lens 3072,3072,2048 --max-anchors 1365 --warmup 4 --steps 10 --e2e-steps 6 --time-budget 180 \
    --tag packed8192_paper --workdir /tmp/pb_work --out "$OUT/peer.json" 2>&1 | tail -15 | tee "$OUT/peer.log")
fi
ls -la "$OUT"
