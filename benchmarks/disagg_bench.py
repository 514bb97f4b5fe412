"""Disaggregated (1 target + 1 drafter rank) against colocated DDP on 2 GPUs and against 1 GPU, by timing real
short training runs (`train.max_steps`) of the trainer on synthetic shards. Driven by `disagg_bench.sh`.

Settings (random targets built on the device, so no weights are needed):
- `smollm2`: a SmolLM2-135M-shaped Llama (hidden 576, 30 layers, 9 heads, 3 kv heads, intermediate 1536, vocab
  49152) with the GPU recipe's batch shape (recipes/bench-smollm2.yaml: 16384-token batches of rows up to 1024
  tokens, block 16, 5 drafter layers, up to 64 anchors per document) on bench.py's documents shaped like the
  recipe's regenerated data (`smollm2_documents`);
- `paper`: recipes/bench-qwen3-8b.yaml (a Qwen3-8B-shaped target, packed 8192-token rows of 3072 + 3072 + 2048);
- `hybrid27b`: the same rows and drafter with a Qwen3.6-27B-shaped hybrid target truncated after its deepest tap
  (hybrid_bench.py: `QWEN36_27B_TRUNCATED`, data labels); its linear-attention layers run flash-linear-attention's
  kernels when `fla` is importable (disagg_bench.sh: `FLA_SITE`), else transformers' PyTorch fallbacks;
- `tiny`: a 12-layer toy for checking this script on CPU (gloo).

Each run writes metrics.jsonl as training does; throughput is the median over log windows after the first
`skip` windows (start-up, compilation). For the disaggregated layout the windows also carry each role's idle
fraction (targets blocked on a full window, drafters waiting for features), the in-flight depth and the
received-ahead depth, and the verdict is `pipeline_verdict` of the mean idle fractions (train/rank_report.py).

    python3 benchmarks/disagg_bench.py prepare --data-dir D [--settings smollm2,paper]
    torchrun --standalone --nproc-per-node N benchmarks/disagg_bench.py run --layout one|ddp|disagg \\
        --data-dir D --result-dir R [--settings ...]
    python3 benchmarks/disagg_bench.py table --result-dir R
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from hybrid_bench import HYBRID_OVERRIDES, QWEN36_27B_TRUNCATED

from dflash_trainer.bench import (
    QWEN3_8B,
    SMOLLM2_135M,
    Setting,
    paper_documents,
    random_target,
    smollm2_documents,
    write_synthetic_shards,
)
from dflash_trainer.config import load_config
from dflash_trainer.distributed.failure import FailureChannel
from dflash_trainer.distributed.roles import assign_roles
from dflash_trainer.distributed.world import World, init_world, shutdown_world
from dflash_trainer.train.disaggregated import DrafterTrainer, TargetWorker
from dflash_trainer.train.rank_report import pipeline_verdict
from dflash_trainer.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
TINY = dict(
    model_type="llama",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=12,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    tie_word_embeddings=True,
)


def tiny_documents(rng: np.random.Generator) -> list[tuple[int, int]]:
    return [(int(length), int(length) // 4) for length in rng.integers(24, 120, size=6)]


@dataclass(frozen=True)
class Run:
    """A setting of this benchmark: recipe, the target's shape and documents (bench.py's), run length."""

    recipe: str
    setting: Setting
    # Document lists to write (bench.py packs each into about one row or one step's worth).
    groups: int
    steps: int
    log_every: int
    # Log windows dropped before taking medians (start-up and compilation).
    skip: int
    overrides: tuple[str, ...] = ()


RUNS = {
    "smollm2": Run(
        recipe="recipes/bench-smollm2.yaml",
        setting=Setting(SMOLLM2_135M, smollm2_documents),
        groups=64,
        steps=24,
        log_every=4,
        skip=2,
    ),
    "paper": Run(
        recipe="recipes/bench-qwen3-8b.yaml",
        setting=Setting(QWEN3_8B, paper_documents),
        groups=40,
        steps=14,
        log_every=2,
        skip=3,
    ),
    "hybrid27b": Run(
        recipe="recipes/bench-qwen3-8b.yaml",
        setting=Setting(QWEN36_27B_TRUNCATED, paper_documents),
        groups=30,
        steps=10,
        log_every=2,
        skip=2,
        overrides=HYBRID_OVERRIDES,
    ),
    "tiny": Run(
        recipe="recipes/bench-smollm2.yaml",
        setting=Setting(TINY, tiny_documents),
        groups=80,
        steps=6,
        log_every=2,
        skip=1,
        overrides=("data.token_budget=512", "data.max_seq_len=128", "data.max_anchors=16", "drafter.num_layers=1"),
    ),
}
LAYOUT_GPUS = {"one": 1, "ddp": 2, "disagg": 2}


def write_shards(out_dir: Path, run: Run) -> Path:
    if not (out_dir / "manifest.json").is_file():
        vocab = run.setting.architecture["vocab_size"]
        write_synthetic_shards(out_dir, setting=run.setting, groups=run.groups, vocab=vocab)
    return out_dir


def run_config(run: Run, *, layout: str, shards: Path, run_dir: Path, device: torch.device, compile_layers: bool):
    overrides = [
        f"data.train_shards={shards}",
        f"run_dir={run_dir}",
        f"target.device={device.type}",
        f"train.max_steps={run.steps}",
        "train.epochs=1",
        f"metrics.log_every={run.log_every}",
        "metrics.tensorboard=false",
        "metrics.progress_bar=false",
        "metrics.plot_at_end=false",
        "checkpoint.every_steps=100000",
        "checkpoint.resume=none",
        "eval.every_steps=0",
        "eval.at_end=false",
        # Eager by default: compiling the drafter layers and the loss costs each run half a minute more.
        f"drafter.compile={str(device.type == 'cuda' and compile_layers).lower()}",
        f"loss.compile={str(device.type == 'cuda' and compile_layers).lower()}",
        *run.overrides,
    ]
    if layout == "disagg":
        overrides += ["placement.target_ranks=[0]", "placement.drafter_ranks=[1]"]
    return load_config(REPO / run.recipe, overrides)


def run_one(
    name: str, run: Run, *, layout: str, world: World, data_dir: Path, result_dir: Path, compile_layers: bool
) -> None:
    """One training run of `run` in `layout`; the logging rank writes the result JSON."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"disagg-bench-{layout}-{name}-"))
    config = run_config(
        run,
        layout=layout,
        shards=data_dir / name,
        run_dir=run_dir,
        device=world.device,
        compile_layers=compile_layers,
    )
    dtype = torch.bfloat16 if world.device.type == "cuda" else torch.float32
    torch.manual_seed(0)  # the same random target on every rank
    target = random_target(world.device, dtype, run.setting.architecture)
    trainer = None
    if layout == "disagg":
        roles = assign_roles(world, config.placement, checkpoint_timeout_s=config.checkpoint.timeout_s)
        if roles.role == "target":
            TargetWorker(config, roles=roles, world=world, target=target, should_stop=lambda: False).run()
        else:
            trainer = DrafterTrainer(config, roles=roles, world=world, target=target, should_stop=lambda: False)
    else:
        trainer = Trainer(config, target=target, world=world)
    if trainer is not None:
        trainer.fit()
        if trainer.is_main:
            result = summarize(run_dir / "metrics.jsonl", run, layout=layout, name=name)
            (result_dir / f"{layout}-{name}.json").write_text(json.dumps(result, indent=2))
            print("result " + json.dumps(result), flush=True)
    del trainer, target
    gc.collect()
    if world.device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(world.device)


def _mean(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if key in r]
    return sum(values) / len(values) if values else None


def summarize(metrics: Path, run: Run, *, layout: str, name: str) -> dict:
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    kept = records[run.skip :] or records[-1:]
    result = {
        "setting": name,
        "layout": layout,
        "gpus": LAYOUT_GPUS[layout],
        "steps": records[-1]["step"],
        "windows": len(kept),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in kept),
        "step_time_s": statistics.median(r["step_time_s"] for r in kept),
        "mfu": statistics.median(r["mfu"] for r in kept) if "mfu" in kept[0] else None,
        "peak_mem_gib": records[-1]["peak_mem_gib"],
        "loss_first": records[0]["loss"],
        "loss_last": records[-1]["loss"],
    }
    for key in ("idle_target", "idle_drafter", "wait_send_s", "wait_recv_s", "inflight", "ahead"):
        result[key] = _mean(kept, key)
    if result["idle_target"] is not None and result["idle_drafter"] is not None:
        result["verdict"] = pipeline_verdict(target_idle=result["idle_target"], drafter_idle=result["idle_drafter"])
    return result


def table(result_dir: Path) -> str:
    results = [json.loads(p.read_text()) for p in sorted(result_dir.glob("*-*.json"))]
    order = {layout: i for i, layout in enumerate(LAYOUT_GPUS)}
    results.sort(key=lambda r: (r["setting"], order[r["layout"]]))
    one = {r["setting"]: r["tokens_per_s"] for r in results if r["layout"] == "one"}

    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    header = (
        f"{'setting':<8} {'layout':<7} {'gpus':>4} {'tok/s':>9} {'per GPU':>8} {'vs 1 GPU':>8} {'s/step':>7} "
        f"{'mfu':>6} {'mem GiB':>7} {'idle T':>6} {'idle D':>6} {'inflight':>8} {'ahead':>6}  verdict"
    )
    lines = [header]
    for r in results:
        base = one.get(r["setting"])
        lines.append(
            f"{r['setting']:<8} {r['layout']:<7} {r['gpus']:>4} {r['tokens_per_s']:>9.0f} "
            f"{r['tokens_per_s'] / r['gpus']:>8.0f} {fmt(r['tokens_per_s'] / base if base else None, '.2f'):>8} "
            f"{r['step_time_s']:>7.3f} {fmt(r['mfu'], '.1%'):>6} {r['peak_mem_gib']:>7.1f} "
            f"{fmt(r['idle_target'], '.0%'):>6} {fmt(r['idle_drafter'], '.0%'):>6} {fmt(r['inflight'], '.2f'):>8} "
            f"{fmt(r['ahead'], '.2f'):>6}  {r.get('verdict', '-')}"
        )
    (result_dir / "summary.json").write_text(json.dumps(results, indent=2))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["prepare", "run", "table"])
    parser.add_argument("--settings", default="smollm2,paper")
    parser.add_argument("--layout", choices=list(LAYOUT_GPUS))
    parser.add_argument("--data-dir", type=Path, default=Path("/tmp/disagg_bench_data"))
    parser.add_argument("--result-dir", type=Path, default=Path("/tmp/disagg_bench"))
    parser.add_argument(
        "--compile",
        action="store_true",
        help="compile the drafter layers and the loss, as the recipes do (slower start)",
    )
    args = parser.parse_args(argv)
    names = args.settings.split(",")
    if args.command == "prepare":
        for name in names:
            write_shards(args.data_dir / name, RUNS[name])
        return 0
    if args.command == "table":
        print(table(args.result_dir))
        return 0
    if args.layout is None:
        parser.error("run needs --layout")
    args.result_dir.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    world = init_world(device, timeout_s=300)
    failures = FailureChannel.connect(world, label=f"rank {world.rank}")

    def run_all() -> None:
        for name in names:
            run_one(
                name,
                RUNS[name],
                layout=args.layout,
                world=world,
                data_dir=args.data_dir,
                result_dir=args.result_dir,
                compile_layers=args.compile,
            )

    failures.run(run_all)
    shutdown_world(world)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
