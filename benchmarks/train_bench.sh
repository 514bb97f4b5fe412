#!/usr/bin/env bash
# Training-step benchmark, both settings in one command, with an ablation per optimisation (issue 10 goals 1-2).
# Usage on the GPU machine, from the repo root:  bash benchmarks/train_bench.sh    (results under $OUT)
#   paper setting:  random Qwen3-8B-shaped target, packed 8192-token rows (recipes/bench-qwen3-8b.yaml)
#   SmolLM2 setting: random SmolLM2-135M-shaped target, the GPU recipe's batch shape (recipes/bench-smollm2.yaml)
# Each ablation is one more end-to-end phase in the same process with one optimisation switched off.
# STEPS / WARMUP override the step counts; ABLATIONS=0 runs the baselines only, ABLATIONS=new the latest ablations
# (NEW_ABLATIONS for SmolLM2: changes not yet measured; NEW_PAPER_ABLATIONS: the paper setting's; PAPER_EXTRA:
# more, from the command line); RUN_TIMEOUT (s, default 200) bounds each setting's process; KERNELS=N also prints each phase's
# N kernels with the most device time (bench --kernels), and TRACES=1 writes their Chrome traces under
# $OUT/traces-<setting>/ (tens of MB each); SETTINGS=smollm2 (or paper) runs one setting only.
set -u
OUT=${OUT:-/tmp/train_bench}
STEPS=${STEPS:-8}
WARMUP=${WARMUP:-3}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"

SMOLLM2_ABLATIONS=()
PAPER_ABLATIONS=()
# Not yet measured: DFlash2's loss in chunks of 1,024 blocks against 512, both with the target's layers compiled (the
# step the main job would take with `target.compile=true`). Run 2 of 2026-12-04 had 1,024 9 % below 512 in one
# process; this benchmark's spread between processes is ~30 %, so only a pair within one run says anything.
# Then the target's compiled layers replayed as CUDA graphs (`target.compile_mode=reduce-overhead`): the compiled
# target forward took 28.6 ms for ~5 ms of GEMMs, predicted host-bound (KERNELS=N shows each stage's kernels against
# its wall time); predicted 28.6 -> 8-12 ms, the step -15 to -20 ms more.
NEW_ABLATIONS=(
  --ablation "dflash2_tc_chunks512:drafter.algorithm=dflash2,loss.chunk_blocks=512,target.compile=true"
  --ablation "dflash2_tc_chunks1024:drafter.algorithm=dflash2,loss.chunk_blocks=1024,target.compile=true"
  --ablation "dflash2_tc_graphs:drafter.algorithm=dflash2,loss.chunk_blocks=512,target.compile=true,target.compile_mode=reduce-overhead"
)
# Measured on 2026-12-04 (BENCHMARKS.md), in the full list: the DFlash2 drafter with the loss in chunks of 128 and of
# 512 (the DFlash2 recipes), DFlash with chunks of 512 (+6 %: its recipe keeps 128), and DFlash2 with chunks of 512
# and the target's layers compiled (-15 % against eager in the same run).
MEASURED_ABLATIONS=(
  --ablation "dflash2:drafter.algorithm=dflash2"
  --ablation "chunks512:loss.chunk_blocks=512"
  --ablation "dflash2_chunks512:drafter.algorithm=dflash2,loss.chunk_blocks=512"
  --ablation "dflash2_target_compiled:drafter.algorithm=dflash2,loss.chunk_blocks=512,target.compile=true"
)
# In the full list (ABLATIONS=1), their one run lost before it printed (BENCHMARKS.md, 2026-12-01): sorted-by-anchors
# batches (unbalanced = before), the target's layers compiled, Inductor's autotuned kernels, flex tiles of 64 (which
# need the autotuned kernels).
EARLIER_ABLATIONS=(
  --ablation "unbalanced:data.balance_anchors=false"
  --ablation "target_compiled:target.compile=true"
  --ablation "autotune:drafter.compile_mode=max-autotune-no-cudagraphs"
  --ablation "tile64:drafter.flex_tile=64,drafter.compile_mode=max-autotune-no-cudagraphs"
)
# The paper setting, beside the peer: nothing new. Measured and kept in the full list: the target's forward one step
# ahead on a side stream (`lookahead`), the FP8 drafter, target and LM head (`fp8_all`), the same with the drafter's
# backward GEMMs accumulating fast (`fp8_all_fast`) and both (2026-12-06, H100, back to back: 583.0 bf16, 579.3
# lookahead, 458.8 / 454.7 / 455.9 ms; the step runs at the power cap); the FP8 drafter with the FP8 LM head (481.1 ms
# end to end on an H200, 2026-12-04), the FP8 drafter tensorwise and rowwise, alone and beside the FP8 target, and the
# FP8 target alone (2026-12-05, H100: 537.5 / 553.2 / 476.3 / 531.1 ms end to end), the target eager (268 against
# 204 ms compiled) and the loss in chunks of 128 blocks (364.6 against 364.1 ms drafter only: no gain).
# PAPER_EXTRA adds ';'-separated NAME:overrides phases (e.g. flex kernel options from flex_kernel_bench.py --best);
# ABLATION_DRAFTER_ONLY=1 times each ablation's drafter-only step too (bench --drafter-only-ablations).
NEW_PAPER_ABLATIONS=()
MEASURED_PAPER_ABLATIONS=(
  --ablation "lookahead:train.target_lookahead=true"
  --ablation "fp8_all:drafter.fp8=true,loss.fp8_head=true,target.fp8=true"
  --ablation "fp8_all_fast:drafter.fp8=true,drafter.fp8_scaling=tensorwise_fast,loss.fp8_head=true,target.fp8=true"
  --ablation "fp8_all_fast_lookahead:drafter.fp8=true,drafter.fp8_scaling=tensorwise_fast,loss.fp8_head=true,target.fp8=true,train.target_lookahead=true"
  --ablation "fp8_head:drafter.fp8=true,loss.fp8_head=true"
  --ablation "fp8_drafter:drafter.fp8=true"
  --ablation "fp8_drafter_rowwise:drafter.fp8=true,drafter.fp8_scaling=rowwise"
  --ablation "fp8_both:drafter.fp8=true,target.fp8=true"
  --ablation "fp8_target:target.fp8=true"
  --ablation "target_eager:target.compile=false"
  --ablation "loss_chunk128:loss.chunk_blocks=128"
)
if [ "${ABLATIONS:-1}" = new ]; then
  SMOLLM2_ABLATIONS=("${NEW_ABLATIONS[@]}")
  PAPER_ABLATIONS=("${NEW_PAPER_ABLATIONS[@]}")
elif [ "${ABLATIONS:-1}" != 0 ]; then
  SMOLLM2_ABLATIONS=("${NEW_ABLATIONS[@]}" "${MEASURED_ABLATIONS[@]}" "${EARLIER_ABLATIONS[@]}"

    --ablation "no_prefetch:data.prefetch_steps=0"
    --ablation "mask_mod_builder:drafter.mask_builder=mask_mod"
    --ablation "eager_loss:loss.compile=false"
    --ablation "sync_every_step:train.sync_every_step=true"
    --ablation "no_buckets:data.seq_multiple=1,data.anchor_multiple=1"
    --ablation "cuda_graphs:drafter.compile_mode=reduce-overhead"
  )
  PAPER_ABLATIONS=("${NEW_PAPER_ABLATIONS[@]}" "${MEASURED_PAPER_ABLATIONS[@]}"
    --ablation "mask_mod_builder:drafter.mask_builder=mask_mod"
    --ablation "eager_loss:loss.compile=false"
  )
fi

IFS=';' read -r -a extra <<< "${PAPER_EXTRA:-}"
for ablation in ${extra[@]+"${extra[@]}"}; do
  [ -n "$ablation" ] && PAPER_ABLATIONS+=(--ablation "$ablation")
done

run() {  # name, recipe, ablations...
  local name=$1 recipe=$2
  shift 2
  local kernels=()
  if [ "${KERNELS:-0}" != 0 ]; then kernels=(--kernels "$KERNELS"); fi
  if [ "${TRACES:-0}" = 1 ]; then kernels+=(--trace-dir "$OUT/traces-$name"); fi
  if [ "${ABLATION_DRAFTER_ONLY:-0}" = 1 ]; then kernels+=(--drafter-only-ablations); fi
  case ",${SETTINGS:-paper,smollm2}," in *",$name,"*) ;; *) return ;; esac
  echo "=== $name"
  timeout "${RUN_TIMEOUT:-200}" python3 -m dflash_trainer bench "$recipe" --steps "$STEPS" --warmup "$WARMUP" "$@" ${kernels[@]+"${kernels[@]}"} \
    --out "$OUT/$name.json" 2>&1 | grep -v "Loading weights" | tee "$OUT/$name.log" \
    | grep -E "^bench:|ms/step|stages|kernels busy| ms +[0-9.]+ % |Error|error"
}
run paper recipes/bench-qwen3-8b.yaml "${PAPER_ABLATIONS[@]}"
run smollm2 recipes/bench-smollm2.yaml "${SMOLLM2_ABLATIONS[@]}"

python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = []
for setting in ("paper", "smollm2"):
    path = out / f"{setting}.json"
    if not path.is_file():
        print(f"{setting}: no results (see {out / (setting + '.log')})")
        continue
    for r in json.loads(path.read_text()):
        rows.append((setting, r))
print(f"\n{'setting':<8} {'phase':<34} {'ms/step':>8} {'tok/s':>9} {'MFU':>6} {'GiB':>6} {'1st s':>6} {'recomp':>6} {'retry':>5}  top stages (ms)")
for setting, r in rows:
    mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
    top = sorted(r["stages_ms"].items(), key=lambda kv: -kv[1])[:5]
    stages = ", ".join(f"{k} {v:.0f}" for k, v in top)
    print(f"{setting:<8} {r['name']:<34} {r['step_ms_median']:8.1f} {r['tokens_per_s']:9.0f} {mfu:>6} "
          f"{r['peak_mem_gib']:6.1f} {r['first_step_s']:6.1f} {r['recompiles_after_warmup']:>6} {r.get('alloc_retries', 0):>5}  {stages}")
(out / "summary.json").write_text(json.dumps([{"setting": s, **r} for s, r in rows], indent=2))
PY
