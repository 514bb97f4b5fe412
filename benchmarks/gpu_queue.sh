#!/usr/bin/env bash
# A queue of GPU benchmarks run one after another in the background, for a GPU machine reached only through short
# commands (an offline or batch-scheduled node): `start` returns at once, the queue survives it, `wait` reports and
# returns when the queue is done or after S seconds, `collect` packs every log and result into $OUT.
#
#   bash benchmarks/gpu_queue.sh start benchmarks/queues/NAME.txt   # one job per line: `name: command`
#   bash benchmarks/gpu_queue.sh wait 540                            # a line per job every POLL seconds (60); when the
#                                                                    queue is done and $OUT is set, `collect` into it
#   OUT=/tmp/out bash benchmarks/gpu_queue.sh collect                 # $OUT/queue-logs.tgz (+ the JSON files)
#
# Jobs run from a copy of the repository root (/tmp/queue-repo-K for the K-th `start`) with PYTHONPATH=src, in the
# order written; a job that fails does not stop the next. A `start` while a queue runs appends its jobs: they run
# after it, from the tree as it was at this `start`. Each job's output is $RES/NAME.log, its exit status
# $RES/NAME.rc, and $RES/NAME is its own folder (exported as JOB_OUT: write JSON there). Wheels in .whl/ (the
# package's own dependencies the machine lacks) and .fla/ (flash-linear-attention, for hybrid targets) are installed
# into /tmp/site first.
set -u
STAGE=${1:?usage: gpu_queue.sh start QUEUE_FILE | wait SECONDS | collect}
RES=/tmp/queue-results
REPO=/tmp/queue-repo
SITE=/tmp/site
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1

case "$STAGE" in
  start)
    queue=${2:?start needs the queue file}
    mkdir -p "$RES"
    part=$(ls "$RES"/run-queue-*.sh 2>/dev/null | wc -l)
    repo=$REPO-$part
    rm -rf "$repo" && mkdir -p "$repo" && cp -r . "$repo"/
    for wheels in .whl .fla; do
      if ls "$wheels"/*.whl > /dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$wheels"/*.whl
      fi
    done
    runner="$RES/run-queue-$part.sh"
    {
      # After the queue started before this one, if any.
      [ "$part" -gt 0 ] && echo "while [ ! -f $RES/queue-$((part - 1)).done ]; do sleep 5; done"
      echo "cd $repo && export PYTHONPATH=$repo/src:$SITE OMP_NUM_THREADS=8"
      grep -v '^\s*\(#\|$\)' "$queue" | while IFS= read -r line; do
        name=${line%%:*} command=${line#*:}
        echo "mkdir -p $RES/$name; echo \$(date +%s) > $RES/$name.start; (export JOB_OUT=$RES/$name; $command) > $RES/$name.log 2>&1; echo \$? > $RES/$name.rc"
      done
      echo "touch $RES/queue-$part.done"
    } > "$runner"
    rm -f "$RES/queue.done"
    setsid bash -c "bash $runner; touch $RES/queue.done" < /dev/null > "$RES/queue-$part.out" 2>&1 &
    nvidia-smi --query-gpu=index,name,memory.used --format=csv,noheader
    echo "started: $(grep -c '^mkdir' "$runner") jobs from $queue"
    ;;
  wait)
    if ! ls "$RES"/run-queue-*.sh > /dev/null 2>&1; then
      # A machine that lost its /tmp (reclaimed while idle, then started afresh) has no queue to wait for: say so at
      # once rather than poll an empty folder until the deadline.
      echo "no queue on this machine ($RES holds none): start one first"
      exit 3
    fi
    deadline=$((SECONDS + ${2:-540}))
    while [ $SECONDS -lt $deadline ]; do
      echo "--- $(date +%T)"
      for log in "$RES"/*.log; do
        [ -f "$log" ] || continue
        name=$(basename "$log" .log)
        state=running
        [ -f "$RES/$name.rc" ] && state="exit $(cat "$RES/$name.rc")"
        echo "$name ($state): $(tr '\r' '\n' < "$log" | grep -v '^\s*$' | tail -n 1 | cut -c1-200)"
      done
      if [ -f "$RES/queue.done" ]; then
        echo "queue done"
        # Collect at once: the results live in this machine's /tmp, and a machine can be lost before the next command.
        [ -n "${OUT:-}" ] && bash "$0" collect > /dev/null && echo "collected into $OUT"
        break
      fi
      # Never sleep past the deadline: the caller's own time limit is set from it.
      left=$((deadline - SECONDS))
      [ "$left" -gt 0 ] && sleep $((left < ${POLL:-60} ? left : ${POLL:-60}))
    done
    ;;
  collect)
    OUT=${OUT:-/tmp/out}
    mkdir -p "$OUT"
    tar czf "$OUT/queue-logs.tgz" -C "$RES" .
    # Each job's JSON results beside the archive, readable without unpacking it: JOB-NAME.json.
    for result in "$RES"/*/*.json; do
      [ -f "$result" ] && cp "$result" "$OUT/$(basename "$(dirname "$result")")-$(basename "$result")"
    done
    ls -la "$OUT"
    ;;
  *) echo "unknown stage $STAGE"; exit 2 ;;
esac
