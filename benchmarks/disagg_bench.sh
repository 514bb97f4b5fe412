#!/usr/bin/env bash
# Disaggregated 1 target + 1 drafter rank vs colocated DDP on 2 GPUs vs 1 GPU, for a SmolLM2-shaped target with
# the GPU recipe's batch shape and for the paper setting (recipes/bench-qwen3-8b.yaml): tokens/s, idle per role,
# in-flight depth, verdict. Real short training runs on synthetic shards (benchmarks/disagg_bench.py says how).
#
# Usage on the 2-GPU machine, from the repo root:  bash benchmarks/disagg_bench.sh   (about 4 minutes)
#   SETTINGS=smollm2      only one setting (default smollm2,paper; also hybrid27b: a 27B hybrid target)
#   FLA_SITE=DIR          a directory holding flash-linear-attention (`fla`) for the hybrid's kernels
#                         (benchmarks/hybrid_bench.py installs the .whl/ wheels into /tmp/hybrid_bench_fla)
#   COMPILE=1             compile the drafter layers and the loss as the recipes do (about 30 s more per run)
#   DFLASH_PROFILE_INTERVAL=10   also print the per-stage profile with its verdict (slows the steps)
# Prints one table; JSON per run and summary.json under $OUT (default /tmp/disagg_bench).
set -u
OUT=${OUT:-/tmp/disagg_bench}
SETTINGS=${SETTINGS:-smollm2,paper}
DATA=${DATA:-/tmp/disagg_bench_data}
mkdir -p "$OUT"
# NVLink multicast stays off in every process (see the device notes).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/src${FLA_SITE:+:$FLA_SITE} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 OMP_NUM_THREADS=4
EXTRA=()
if [ "${COMPILE:-0}" = 1 ]; then EXTRA+=(--compile); fi

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | tee "$OUT/gpus.txt"
python3 benchmarks/disagg_bench.py prepare --settings "$SETTINGS" --data-dir "$DATA" || exit 1
rm -f "$OUT"/*-*.json

for layout in one ddp disagg; do
  nproc=2
  if [ "$layout" = one ]; then nproc=1; fi
  echo "=== $layout ($nproc GPU(s))"
  timeout 150 python3 -m torch.distributed.run --standalone --nproc-per-node "$nproc" \
    benchmarks/disagg_bench.py run --layout "$layout" --settings "$SETTINGS" --data-dir "$DATA" \
    --result-dir "$OUT" ${EXTRA[@]+"${EXTRA[@]}"} > "$OUT/$layout.log" 2>&1
  status=$?
  grep -E "^(step |bottleneck|pipeline over)" "$OUT/$layout.log" | cut -c1-200 | tail -6
  if [ "$status" != 0 ]; then echo "$layout: exit status $status (log: $OUT/$layout.log)"; tail -20 "$OUT/$layout.log"; fi
done

echo "=== results"
python3 benchmarks/disagg_bench.py table --result-dir "$OUT" | tee "$OUT/table.txt"
