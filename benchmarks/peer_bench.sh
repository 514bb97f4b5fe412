#!/usr/bin/env bash
# The peer (speculators 0.9.0, shared/peer-bench) in the paper setting of recipes/bench-qwen3-8b.yaml, on this GPU:
# packed 8192-token rows of documents 3072 + 3072 + 2048, 1365 anchors per row, 5 layers, block 16, taps
# [1, 9, 17, 25, 33], CE against the verifier's argmax with exp decay gamma 7, AdamW lr 6e-4, flex attention.
# Usage on the GPU machine, from the repo root, with .peer/ = shared/peer-bench plus its wheels
# (bash .peer/get-wheels.sh .peer/whl) copied in:  OUT=... bash benchmarks/peer_bench.sh   -> $OUT/peer.json, peer.log
# The peer allocates ~71 GiB at this setting (H200, 2026-12-04) and ran out of memory within its first three steps on
# an 80 GB H100 (2026-12-05): under PEER_MIN_GIB (90) of GPU memory it is skipped, saying so (PEER_MIN_GIB=0 runs it).
set -u
source benchmarks/peer_site.sh peer_bench
set -o pipefail
total_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i "${CUDA_VISIBLE_DEVICES:-0}" | head -1)
if [ "${total_mib:-0}" -lt $(( ${PEER_MIN_GIB:-90} * 1024 )) ]; then
  echo "peer_bench: skipped: the peer's paper setting needs more than this GPU's ${total_mib} MiB (PEER_MIN_GIB=0: run it anyway)" \
    | tee "$OUT/peer.log"
  exit 3
fi
cd .peer && PYTHONPATH=$SITE PYTHONUNBUFFERED=1 timeout "${PEER_TIMEOUT:-300}" python3 bench_speculators.py \
  --num-layers 5 --block-size 16 --target-layer-ids 1,9,17,25,33 --attn simple_flex_attention --full-attention \
  --loss-fn ce --loss-impl fused --per-position-loss-weight fixed-exp-decay --gamma 7 --optimizer adamw --lr 6e-4 \
  --total-seq-len 8192 --doc-lens 3072,3072,2048 --max-anchors 1365 --warmup "${PEER_WARMUP:-4}" \
  --steps "${PEER_STEPS:-10}" --e2e-steps "${PEER_E2E_STEPS:-6}" --profile-steps 2 --time-budget "${PEER_BUDGET:-240}" \
  --tag packed8192_paper --workdir /tmp/pb_work --out "$OUT/peer.json" 2>&1 \
  | grep --line-buffered -v "Loading from local directory\|safetensors.index.json" > "$OUT/peer.log"
status=$?
tail -n 15 "$OUT/peer.log"
exit $status
