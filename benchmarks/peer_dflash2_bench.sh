#!/usr/bin/env bash
# The peer's DFlash2 trainer (speculators 0.9.0, speculators.models.dflash2) on this GPU, timed by
# benchmarks/peer_dflash2_bench.py with its own model, compiled forward, loss (unary + selector) and Trainer/AdamW; only
# the data is synthetic. Settings: paper = recipes/bench-qwen3-8b.yaml (Qwen3-8B shape, 5 layers, 8,192-token rows of
# documents 3072 + 3072 + 2048, 1,365 anchors per row, CE, exp slot weights, lr 6e-4); smollm2 = the batch shape of
# recipes/smollm2-135m-gpu-dflash2.yaml (SmolLM2-135M shape, 5 layers, a 16,384-token row of ~65 documents shaped like
# its regenerated data, 64 anchors per document, CE with D-PACE weights, lr 2e-3). Block 8 (DFlash2's) or 16.
# Usage on the GPU machine, from the repo root, with .peer/whl (the wheels of shared/peer-bench's get-wheels.sh) copied in:
#   OUT=... bash benchmarks/peer_dflash2_bench.sh [paper|smollm2] [8|16] [more flags for the Python script]
#   -> $OUT/peer_dflash2-<setting>-b<block>.json and .log
set -u
SETTING=${1:-paper}
BLOCK=${2:-8}
shift $(($# < 2 ? $# : 2))
source benchmarks/peer_site.sh peer_dflash2_bench
NAME=peer_dflash2-$SETTING-b$BLOCK
set -o pipefail
PYTHONPATH=$SITE:src PYTHONUNBUFFERED=1 timeout "${PEER_TIMEOUT:-420}" python3 benchmarks/peer_dflash2_bench.py \
  --setting "$SETTING" --block-size "$BLOCK" --warmup "${PEER_WARMUP:-4}" --steps "${PEER_STEPS:-10}" \
  --e2e-steps "${PEER_E2E_STEPS:-6}" --time-budget "${PEER_BUDGET:-300}" --stack-dump-s 150 \
  --tag "$NAME" --workdir /tmp/peer_dflash2_work --out "$OUT/$NAME.json" "$@" 2>&1 \
  | grep --line-buffered -v "Loading from local directory\|safetensors.index.json" > "$OUT/$NAME.log"
status=$?
tail -n 12 "$OUT/$NAME.log"
exit $status
