#!/usr/bin/env bash
# The experiment sweep of benchmarks/EXPERIMENTS.md: short training runs of the math-first DFlash recipe
# (`smollm2-135m-gpu`) that each change one thing, on that recipe's regenerated data (beside gpu_session.sh's main
# job: give it RECIPE=smollm2-135m-gpu PROMPTS=/tmp/mix-math-48k.jsonl.gz), every one evaluated on held-out GSM8K (24
# prompts x 256 tokens, the exported drafter, lossless check). Same step count for every run, so the rows compare what
# a fixed compute budget buys. One process at a time by default: on 2026-11-30 four at once starved each other's (and
# the main job's) batch workers of host CPU (benchmarks/EXPERIMENTS.md #4).
#
# Env: SWEEP_GPU (default 0), GPUS (1: wait for the main job to end first), RES (results folder), STEPS (default
# 600: about 3 minutes a row on an H200), WAVE (processes at once, default 1), MAIN (the main job's repo copy,
# default $PWD). Each finished row is appended to $RES/sweep/rows.jsonl at once, so a sweep cut short keeps its rows.
# ROWS: the names of the rows to run, comma-separated, in the order given (default: every row in the order below).
set -u
SWEEP_GPU=${SWEEP_GPU:-0}
GPUS=${GPUS:-1}
RES=${RES:-/tmp/results}
STEPS=${STEPS:-600}
WAVE=${WAVE:-1}
MAIN=${MAIN:-$PWD}
SHARDS=${SHARDS:-$MAIN/data/smollm2-135m-mathmix48k-256}  # the main job's shards (set it when MAIN_OVERRIDES moves them)
CHATS=$SHARDS-chat
WORK=/tmp/sweep
mkdir -p "$WORK" "$RES/sweep"
export CUDA_VISIBLE_DEVICES=$SWEEP_GPU

echo "waiting for the main job's shards ($SHARDS)"
until [ -f "$SHARDS/manifest.json" ]; do
  if [ -f "$RES/main.rc" ]; then  # the main job ended without writing its shards: nothing to sweep on
    echo "the main job ended (exit $(cat "$RES/main.rc")) without shards at $SHARDS"
    exit 1
  fi
  sleep 10
done
if [ "$GPUS" -le 1 ]; then
  echo "one GPU: waiting for the main job to end"
  until [ -f "$RES/main.rc" ]; do sleep 10; done
fi

regen=$(ls "$CHATS"/regen-*.jsonl | head -n 1)
for size in 1000 10000; do
  python3 -m dflash_trainer prepare --input "$regen" --target smollm2-135m --out "$WORK/data-$size" \
    --max-seq-len 1024 --on-error skip --limit "$size" > "$RES/sweep/prepare-$size.log" 2>&1
done

# Many epochs: `train.max_steps` ends every run at the same step, also on the 1K-prompt data.
COMMON=(run_dir=PLACEHOLDER "train.max_steps=$STEPS" train.epochs=1000 eval.every_steps=0 "eval.datasets=[gsm8k]" eval.num_prompts=24
  checkpoint.every_steps=100000 metrics.plot_at_end=false metrics.progress_bar=false)
# name | overrides (space separated), each row against the base row, i.e. the recipe as it is now: 64 anchors per
# document and D-PACE slot weights since 2026-12-01 (EXPERIMENTS.md #11). The rows of #10 were measured against the
# recipe before (512 anchors, exponential weights with gamma 7); `anchors-512-exp` is that base, so the two sweeps
# can be read side by side.
VARIANTS=(
  "base|data.train_shards=$SHARDS"
  "labels-soft|data.train_shards=$SHARDS loss.label_source=soft"
  "prompts-10k|data.train_shards=$WORK/data-10000"
  "prompts-1k|data.train_shards=$WORK/data-1000"
  "noise-uniform-0.1|data.train_shards=$SHARDS noise.type=uniform noise.start=0.1 noise.end=0.0"
  "fp8-target|data.train_shards=$SHARDS target.fp8=true"
  "exp-weights|data.train_shards=$SHARDS loss.weighting=exp"
  "anchors-512-exp|data.train_shards=$SHARDS data.max_anchors=512 loss.weighting=exp"
  "anchors-32|data.train_shards=$SHARDS data.max_anchors=32"
  "anchors-128|data.train_shards=$SHARDS data.max_anchors=128"
  "anchors-32-equal-time|data.train_shards=$SHARDS data.max_anchors=32 train.max_steps=$((2 * STEPS))"
  # Batches balanced by anchor count (on since 2026-12-01) make a slot of a small batch weigh a little more in the
  # per-step mean loss; the base row against this one says whether tau notices.
  "unbalanced|data.train_shards=$SHARDS data.balance_anchors=false"
)
if [ -n "${ROWS:-}" ]; then  # keep the named rows, in the order named
  chosen=()
  IFS=, read -r -a names <<< "$ROWS"
  for name in "${names[@]}"; do
    match=""
    for variant in "${VARIANTS[@]}"; do
      [ "${variant%%|*}" = "$name" ] && match=$variant
    done
    if [ -z "$match" ]; then echo "unknown row $name"; exit 2; fi
    chosen+=("$match")
  done
  VARIANTS=("${chosen[@]}")
fi

summarise() {  # name, exit status, seconds: one JSON line into $RES/sweep/rows.jsonl
  python3 - "$WORK/runs/$1" "$1" "$2" "$3" >> "$RES/sweep/rows.jsonl" <<'PY'
import json, sys
from pathlib import Path
run, name = Path(sys.argv[1]), sys.argv[2]
row = {"name": name, "exit": int(sys.argv[3]), "seconds": int(sys.argv[4])}
report = run / "eval" / "eval.json"
if report.is_file():
    for ds in json.loads(report.read_text()).get("datasets", []):
        row[f"{ds['name']}_tau"] = ds.get("tau")
        row[f"{ds['name']}_tau_per_prompt"] = ds.get("tau_per_prompt")
metrics = run / "metrics.jsonl"
if metrics.is_file():
    logged = [json.loads(line) for line in metrics.read_text().splitlines() if '"loss"' in line]
    if logged:
        row.update(step=logged[-1].get("step"), train_tau=logged[-1].get("tau"), loss=logged[-1].get("loss"))
print(json.dumps(row))
PY
}

run_variant() {  # name, overrides
  local name=$1 overrides=$2 start=$SECONDS
  local args=("${COMMON[@]/run_dir=PLACEHOLDER/run_dir=$WORK/runs/$name}")
  # shellcheck disable=SC2086
  python3 -m dflash_trainer train smollm2-135m-gpu "${args[@]}" $overrides > "$RES/sweep/$name.log" 2>&1
  local status=$?
  echo "$name exit $status after $((SECONDS - start)) s"
  summarise "$name" "$status" "$((SECONDS - start))"
}

running=0
for variant in "${VARIANTS[@]}"; do
  run_variant "${variant%%|*}" "${variant#*|}" &
  running=$((running + 1))
  if [ "$running" -ge "$WAVE" ]; then
    wait -n
    running=$((running - 1))
  fi
done
wait

echo "sweep done: $RES/sweep/rows.jsonl"
cat "$RES/sweep/rows.jsonl"
