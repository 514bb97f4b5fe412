#!/usr/bin/env bash
# One short command that checks every GPU path before a long run: the GPU tests, then each benchmark with few
# steps (numbers only indicative; the recorded numbers come from the full scripts). Results under $OUT.
# Needs .whl/ copied in (gguf + the evaluation-set packages): benchmarks/BENCHMARKS.md, "offline GPU machine".
# Usage on the GPU machine, from the repo root: bash benchmarks/gpu_check.sh
set -u
OUT=${OUT:-/tmp/gpu_check}
RAW=/tmp/gpu_check_raw  # the benchmarks' own JSON and logs, packed into $OUT/raw.tgz at the end
mkdir -p "$OUT" "$RAW"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"

step() {  # name, timeout, command...
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  OUT=$RAW timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "=== $name: exit $rc in $((SECONDS - start)) s"
  grep -v "Loading weights\|^$" "$OUT/$name.log" | tail -n "${TAIL:-14}"
}

TAIL=25 step gpu_tests "${T_TESTS:-200}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/
step target_bench "${T_TARGET:-100}" python3 benchmarks/target_bench.py --repeats 5 --warmup 2
step decode_bench "${T_DECODE:-130}" python3 benchmarks/decode_bench.py --random --num-prompts 1024 \
  --max-new-tokens 256 --rows 512 --eval-prompts 24 --eval-tokens 256
STEPS=4 WARMUP=2 ABLATIONS=0 step train_bench "${T_TRAIN:-190}" bash benchmarks/train_bench.sh
tar czf "$OUT/raw.tgz" -C "$RAW" .
