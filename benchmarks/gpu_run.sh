#!/usr/bin/env bash
# One command: GPU tests, our training-step benchmark, and the peer (speculators 0.9.0) beside it.
# Usage on the GPU machine, from the repo root: bash benchmarks/gpu_run.sh   (results under $OUT)
# Needs .peer/ = shared/peer-bench plus its wheels (bash .peer/get-wheels.sh .peer/whl), copied to the machine.
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
OUT=$OUT PEER_TIMEOUT=200 PEER_BUDGET=180 bash benchmarks/peer_bench.sh  # within 600 s: tests 150 + ours 240
ls -la "$OUT"
