"""DFlash2's selector-loss options against each other on the synthetic context-determined target (CPU proxy).

What it measures: held-out tau of a DFlash2 drafter trained with each `loss.selector` variant the public trainers
chose between, beside a DFlash drafter trained identically, over several training seeds:

    default     no gold-token injection, gradient into the drafter, full weight from the first step (the recipe)
    gold        `gold_injection: true`  (a label missing from the top-k replaces the weakest candidate; speculators)
    stopgrad    `stop_gradient: true`   (the term trains the selector's own parameters only; SpecForge)
    warmup      `warmup_ratio: 0.1, ramp_ratio: 0.2` (alpha 0 for 10 % of the steps, then a linear ramp; SpecForge)
    embedding   `drafter.dflash2.selector_codebooks: embedding` (the codebooks as maps of the target's embedding)
    embedding-warmup, embedding-stopgrad: the two together
    embedding-weight2, embedding-weight05: embedding codebooks, the selector term at weight 2 or 0.5
                (`loss.selector.weight`)
    dflash      `drafter.algorithm: dflash`, the baseline (per-slot argmax, no selector)

How: the task of `tests/test_dflash2_train.py` (tests/progression_task.py): arithmetic progressions modulo 17 whose
step (1, 2 or 3) is visible only in the context, the tiny random 6-layer target of tests/train_helpers.py, the real
`Trainer`, then `held_out_tau` on 16 held-out documents: the drafter drafts as at inference (the selector's walk for
DFlash2) and the document is the verifier. One target, one training set and one data order (`data.seed`) for all;
`train.seed`, the drafter's initialisation, varies. Beside tau, the selector's metrics of the last logged window of
training (metrics.jsonl): `selector_acc` (teacher-forced choice == label), `selector_recall` (label among the
candidates) and `selector_tau_prefix` (the walk's tau on the training blocks).

Three settings (same data, target, lr 5e-3; `train.max_steps` sets the length of the whole schedule):
    test        the test's: block 4, 100 steps. Every DFlash2 variant ends at the ceiling (3.87), so it shows only
                that no variant breaks the task.
    block8-80   block 8 (the GPU DFlash2 recipe's), 80 steps: mid-learning, off both floor and ceiling, where the
                variants can differ in how fast the drafter and the selector learn (and seed noise is largest).
    block8-120  block 8, 120 steps: near the ceiling (7.08); what each variant converges to.
Block 8 calibrated with the default and DFlash, seed 0: tau 1.2-1.4 at 40 steps, 1.9-2.7 at 60, 3.5-4.3 at 80,
6.0-6.7 at 100, 7.04-7.08 at 200.

The table gives, per variant, tau's mean +- sample sd over seeds and its difference to the default paired by seed
(the DFlash2 variants of one seed start from the same weights), mean +- standard error, with the count of seeds where
it is higher. `tau_argmax`: the same DFlash2 drafter drafting each slot's argmax, i.e. without its selector.

Commands (13 minutes on one shared CPU core for 5 seeds; the block-8 settings' seeds 5-9 another 9.5 minutes;
`--report` prints the tables of sweeps run separately, merged: training is deterministic on the CPU):

    PYTHONPATH=src nice python benchmarks/dflash2_selector_sweep.py --out /tmp/sweep.json
    PYTHONPATH=src nice python benchmarks/dflash2_selector_sweep.py --settings block8-80,block8-120 \
        --seeds 5,6,7,8,9 --out /tmp/sweep-more.json
    PYTHONPATH=src python benchmarks/dflash2_selector_sweep.py --report /tmp/sweep.json /tmp/sweep-more.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the synthetic task's builders
from dflash_trainer.config import load_config
from dflash_trainer.model.drafter import DFlashDrafter
from dflash_trainer.train.trainer import Trainer
from progression_task import held_out_documents, held_out_tau, write_progression_shards
from train_helpers import save_tiny_target, write_recipe

# The test's DFlash2 sizes for the hidden-64 target: 4 conv groups of 16 channels, a rank-16 selector over 8 candidates.
DFLASH2 = {"algorithm": "dflash2", "dflash2": {"conv_group_size": 16, "selector_rank": 16, "selector_top_k": 8}}
# The same with the selector's codebooks as maps of the target's embedding.
EMBEDDING = {**DFLASH2, "dflash2": {**DFLASH2["dflash2"], "selector_codebooks": "embedding"}}
VARIANTS: dict[str, tuple[dict, dict]] = {  # name: (drafter keys, loss.selector keys)
    "default": (DFLASH2, {}),
    "gold": (DFLASH2, {"gold_injection": True}),
    "stopgrad": (DFLASH2, {"stop_gradient": True}),
    "warmup": (DFLASH2, {"warmup_ratio": 0.1, "ramp_ratio": 0.2}),
    "embedding": (EMBEDDING, {}),
    "embedding-warmup": (EMBEDDING, {"warmup_ratio": 0.1, "ramp_ratio": 0.2}),
    "embedding-stopgrad": (EMBEDDING, {"stop_gradient": True}),
    "embedding-weight2": (EMBEDDING, {"weight": 2.0}),
    "embedding-weight05": (EMBEDDING, {"weight": 0.5}),
    "dflash": ({}, {}),
}
SELECTOR_METRICS = ("selector_acc", "selector_recall", "selector_tau_prefix")
COLUMNS = ("tau_argmax", *SELECTOR_METRICS)  # beside tau: DFlash2's drafter without its walk, the selector's own


@dataclass(frozen=True)
class Setting:
    block_size: int
    max_steps: int
    log_every: int


SETTINGS = {
    "test": Setting(block_size=4, max_steps=100, log_every=10),
    "block8-80": Setting(block_size=8, max_steps=80, log_every=10),
    "block8-120": Setting(block_size=8, max_steps=120, log_every=10),
}


def train_once(work: Path, setting: Setting, variant: str, seed: int, target: Path, shards: Path) -> Trainer:
    drafter, selector = VARIANTS[variant]
    work.mkdir(parents=True, exist_ok=True)
    run = work / f"{variant}-{seed}"
    recipe = write_recipe(
        work / f"{variant}-{seed}.yaml",
        run,
        target,
        shards,
        drafter={**drafter, "num_layers": 1, "block_size": setting.block_size},
        data={"token_budget": 512, "max_seq_len": 64, "max_anchors": 16},
        optim={"lr": 5e-3, "warmup_ratio": 0.05},
        loss={"selector": selector},
        train={"max_steps": setting.max_steps, "seed": seed},
        metrics={"log_every": setting.log_every},
    )
    trainer = Trainer(load_config(recipe), log=lambda _: None)
    with contextlib.redirect_stdout(io.StringIO()):  # the trainer's console lines; metrics.jsonl has them
        trainer.fit()
    return trainer


def argmax_tau(drafter: DFlashDrafter, target_model, docs: list[list[int]]) -> float:
    """Held-out tau of the same drafter drafting each slot's argmax, its selector unused: with `tau` it separates
    what the selector's walk adds from what the selector's term did to the drafter's own predictions."""
    drafter.draft_tokens = functools.partial(DFlashDrafter.draft_tokens, drafter)  # shadows DFlash2's walk
    try:
        return held_out_tau(drafter, target_model, docs)[0]
    finally:
        del drafter.draft_tokens


def last_logged(run_dir: Path) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "loss" in r][-1]


def spread(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} +- {sd:.3f}"


def paired(values: dict[int, float], base: dict[int, float]) -> str:
    """Mean difference to `base` over the seeds both have, +- its standard error, and the seeds where it is higher:
    the DFlash2 variants of one seed start from the same weights, so the pairs cancel part of the seed noise."""
    diffs = [values[seed] - base[seed] for seed in values if seed in base]
    if len(diffs) < 2:
        return "-"
    error = statistics.stdev(diffs) / len(diffs) ** 0.5
    return f"{statistics.mean(diffs):+.3f} +- {error:.3f} ({sum(d > 0 for d in diffs)}/{len(diffs)} higher)"


def report(setting_name: str, rows: list[dict], allowed: float) -> None:
    seeds = sorted({r["seed"] for r in rows})
    print(f"\n{setting_name}: held-out tau (the data allows {allowed:.2f}), seeds {seeds}: mean +- sample sd")
    print(f"{'variant':<9} {'tau':>15}  {'vs default, paired':<31} " + " ".join(f"{m:>19}" for m in COLUMNS))
    base = {r["seed"]: r["tau"] for r in rows if r["variant"] == "default"}
    for variant in VARIANTS:
        mine = [r for r in rows if r["variant"] == variant]
        if not mine:
            continue
        taus = [r["tau"] for r in mine]
        versus = "" if variant == "default" else paired({r["seed"]: r["tau"] for r in mine}, base)
        cells = []
        for name in COLUMNS:
            values = [r[name] for r in mine if r.get(name) is not None]
            cells.append(f"{spread(values):>19}" if values else f"{'-':>19}")
        print(f"{variant:<9} {spread(taus):>15}  {versus:<31} " + " ".join(cells))


def run_sweep(settings: list[str], variants: list[str], seeds: list[int]) -> dict:
    torch.set_num_threads(1)  # the tests' setting; a tiny model gains nothing from more
    hf_logging.disable_progress_bar()  # the target's save and every run's load
    results = {}
    held_out = held_out_documents()
    with tempfile.TemporaryDirectory(prefix="selector-sweep-") as tmp:
        work = Path(tmp)
        shards = write_progression_shards(work / "shards")
        target = save_tiny_target(work / "target")
        for setting_name in settings:
            setting = SETTINGS[setting_name]
            rows, allowed = [], 0.0
            for variant in variants:
                for seed in seeds:
                    start = time.perf_counter()
                    trainer = train_once(work / setting_name, setting, variant, seed, target, shards)
                    tau, allowed = held_out_tau(trainer.drafter, trainer.target.model, held_out)
                    logged = last_logged(Path(trainer.config.run_dir))
                    row = {"variant": variant, "seed": seed, "tau": tau, "loss": logged["loss"]}
                    if variant != "dflash":
                        row["tau_argmax"] = argmax_tau(trainer.drafter, trainer.target.model, held_out)
                    row |= {name: logged.get(name) for name in SELECTOR_METRICS}
                    row["seconds"] = round(time.perf_counter() - start, 1)
                    rows.append(row)
                    print(f"{setting_name} {variant} seed {seed}: tau {tau:.3f} ({row['seconds']} s)", flush=True)
            results[setting_name] = {"setting": vars(setting), "tau_allowed": allowed, "runs": rows}
    return results


def merge(paths: list[Path]) -> dict:
    """The runs of several sweeps' JSON, setting by setting (e.g. more seeds run later; training is deterministic
    on the CPU, so a seed run twice gives the same numbers and is kept once)."""
    merged: dict = {}
    for path in paths:
        for name, result in json.loads(path.read_text()).items():
            into = merged.setdefault(name, {**result, "runs": []})
            seen = {(r["variant"], r["seed"]) for r in into["runs"]}
            into["runs"] += [r for r in result["runs"] if (r["variant"], r["seed"]) not in seen]
    return merged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated, of: " + ", ".join(SETTINGS))
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of: " + ", ".join(VARIANTS))
    parser.add_argument("--seeds", default="0,1,2,3,4", help="train.seed values, comma-separated")
    parser.add_argument("--out", type=Path, default=None, help="write every run's numbers here as JSON")
    parser.add_argument("--report", type=Path, nargs="+", help="train nothing: the tables of these JSON files, merged")
    args = parser.parse_args()
    if args.report:
        results = merge(args.report)
    else:
        settings, variants = args.settings.split(","), args.variants.split(",")
        for name in settings:
            if name not in SETTINGS:
                parser.error(f"unknown setting {name!r}")
        for name in variants:
            if name not in VARIANTS:
                parser.error(f"unknown variant {name!r}")
        results = run_sweep(settings, variants, [int(s) for s in args.seeds.split(",")])
    for name, result in results.items():
        report(name, result["runs"], result["tau_allowed"])
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
