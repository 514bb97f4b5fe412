#!/usr/bin/env bash
# The experiment sweep of benchmarks/EXPERIMENTS.md: short training runs of the GPU recipe that each change one
# thing, on the main job's regenerated data, every one evaluated on held-out GSM8K (24 prompts x 256 tokens, the
# exported drafter, lossless check). Same step count for every run, so the rows compare what a fixed compute budget
# buys. One process at a time by default: on 2026-11-30 four at once starved each other's (and the main job's) batch
# workers of host CPU (benchmarks/EXPERIMENTS.md #4).
#
# Env: SWEEP_GPU (default 0), GPUS (1: wait for the main job to end first), RES (results folder), STEPS (default
# 200), WAVE (processes at once, default 1), MAIN (the main job's repo copy, default $PWD).
set -u
SWEEP_GPU=${SWEEP_GPU:-0}
GPUS=${GPUS:-1}
RES=${RES:-/tmp/results}
STEPS=${STEPS:-200}
WAVE=${WAVE:-1}
MAIN=${MAIN:-$PWD}
SHARDS=$MAIN/data/smollm2-135m-mathmix48k-256
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
# name | overrides (space separated)
VARIANTS=(
  "prompts-1k|data.train_shards=$WORK/data-1000"
  "prompts-10k|data.train_shards=$WORK/data-10000"
  "prompts-44k|data.train_shards=$SHARDS"
  "anchors-256|data.train_shards=$SHARDS data.max_anchors=256"
  "lr-1.5e-3|data.train_shards=$SHARDS optim.lr=1.5e-3"
  "labels-soft|data.train_shards=$SHARDS loss.label_source=soft"
  "noise-uniform-0.1|data.train_shards=$SHARDS noise.type=uniform noise.start=0.1 noise.end=0.0"
  "dpace|data.train_shards=$SHARDS loss.weighting=dpace"
  "fp8-target|data.train_shards=$SHARDS target.fp8=true"
)

run_variant() {  # name, overrides
  local name=$1 overrides=$2 start=$SECONDS
  local args=("${COMMON[@]/run_dir=PLACEHOLDER/run_dir=$WORK/runs/$name}")
  # shellcheck disable=SC2086
  python3 -m dflash_trainer train smollm2-135m-gpu "${args[@]}" $overrides > "$RES/sweep/$name.log" 2>&1
  echo "$name exit $? after $((SECONDS - start)) s"
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

python3 - "$WORK/runs" "$RES/sweep/summary.json" <<'PY'
import json, sys
from pathlib import Path
rows = []
for run in sorted(Path(sys.argv[1]).iterdir()):
    report = run / "eval" / "eval.json"
    metrics = run / "metrics.jsonl"
    row = {"name": run.name}
    if report.is_file():
        data = json.loads(report.read_text())
        for ds in data.get("datasets", []):
            row[f"{ds['name']}_tau"] = ds.get("tau")
            row[f"{ds['name']}_tau_per_prompt"] = ds.get("tau_per_prompt")
    if metrics.is_file():
        last = [json.loads(line) for line in metrics.read_text().splitlines() if '"loss"' in line]
        if last:
            row["train_tau"] = last[-1].get("tau")
            row["loss"] = last[-1].get("loss")
    rows.append(row)
Path(sys.argv[2]).write_text(json.dumps(rows, indent=2))
for row in rows:
    print(row)
PY
