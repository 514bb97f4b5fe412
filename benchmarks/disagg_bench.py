"""Disaggregated (1 target + 1 drafter rank) against colocated DDP on 2 GPUs and against 1 GPU, by timing real
short training runs (`train.max_steps`) of the trainer on synthetic shards. Driven by `disagg_bench.sh`.

Settings (random targets built on the device, so no weights are needed):
- `smollm2`: a SmolLM2-135M-shaped Llama (hidden 576, 30 layers, 9 heads, 3 kv heads, intermediate 1536, vocab
  49152) with the GPU recipe's batch shape (recipes/smollm2-135m-gpu.yaml: 16384-token batches of rows up to 1024
  tokens, block 16, 5 drafter layers, up to 512 anchors per document); documents of 512 and 256 tokens, the first
  quarter of each a prompt without loss (GSM8K answers are about three quarters of a document);
- `paper`: recipes/bench-qwen3-8b.yaml (a Qwen3-8B-shaped target, packed 8192-token rows of 3072 + 3072 + 2048);
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

from dflash_trainer.bench import QWEN3_8B, random_target
from dflash_trainer.config import load_config
from dflash_trainer.data.shards import ShardWriter
from dflash_trainer.distributed.failure import FailureChannel
from dflash_trainer.distributed.roles import assign_roles
from dflash_trainer.distributed.world import World, init_world, shutdown_world
from dflash_trainer.train.disaggregated import DrafterTrainer, TargetWorker
from dflash_trainer.train.rank_report import pipeline_verdict
from dflash_trainer.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
SMOLLM2_135M = dict(
    model_type="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    tie_word_embeddings=True,
)
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


@dataclass(frozen=True)
class Setting:
    recipe: str
    architecture: dict
    doc_lens: tuple[int, ...]
    # Documents of `doc_lens` per group; groups are shuffled and packed into rows by the sampler.
    groups: int
    steps: int
    log_every: int
    # Log windows dropped before taking medians (start-up and compilation).
    skip: int
    overrides: tuple[str, ...] = ()


SETTINGS = {
    "smollm2": Setting(
        recipe="recipes/smollm2-135m-gpu.yaml",
        architecture=SMOLLM2_135M,
        doc_lens=(512, 256, 256),
        groups=1200,
        steps=24,
        log_every=4,
        skip=2,
    ),
    "paper": Setting(
        recipe="recipes/bench-qwen3-8b.yaml",
        architecture=QWEN3_8B,
        doc_lens=(3072, 3072, 2048),
        groups=40,
        steps=14,
        log_every=2,
        skip=3,
    ),
    "tiny": Setting(
        recipe="recipes/smollm2-135m-gpu.yaml",
        architecture=TINY,
        doc_lens=(64, 32, 32),
        groups=200,
        steps=6,
        log_every=2,
        skip=1,
        overrides=("data.token_budget=512", "data.max_seq_len=128", "data.max_anchors=16", "drafter.num_layers=1"),
    ),
}
LAYOUT_GPUS = {"one": 1, "ddp": 2, "disagg": 2}


def write_shards(out_dir: Path, setting: Setting, seed: int = 0) -> Path:
    """Random tokens; the first quarter of every document is a prompt (no loss), the rest a response."""
    if (out_dir / "manifest.json").is_file():
        return out_dir
    vocab = setting.architecture["vocab_size"]
    rng = np.random.default_rng(seed)
    with ShardWriter(out_dir, tokenizer_name="synthetic", vocab_size=vocab) as writer:
        for group in range(setting.groups):
            for d, length in enumerate(setting.doc_lens):
                ids = rng.integers(32, vocab - vocab // 16, size=length)  # clear of the mask token and the top rows
                mask = np.ones(length, dtype=np.uint8)
                mask[: length // 4] = 0
                writer.add(f"g{group}-d{d}", ids, mask)
    return out_dir


def run_config(
    setting: Setting, *, layout: str, shards: Path, run_dir: Path, device: torch.device, compile_layers: bool
):
    overrides = [
        f"data.train_shards={shards}",
        f"run_dir={run_dir}",
        f"target.device={device.type}",
        f"train.max_steps={setting.steps}",
        "train.epochs=1",
        f"metrics.log_every={setting.log_every}",
        "metrics.tensorboard=false",
        "metrics.progress_bar=false",
        "metrics.plot_at_end=false",
        "checkpoint.every_steps=100000",
        "checkpoint.resume=none",
        "eval.every_steps=0",
        "eval.at_end=false",
        f"drafter.compile={str(device.type == 'cuda' and compile_layers).lower()}",
        *setting.overrides,
    ]
    if layout == "disagg":
        overrides += ["placement.target_ranks=[0]", "placement.drafter_ranks=[1]"]
    return load_config(REPO / setting.recipe, overrides)


def run_one(
    name: str, setting: Setting, *, layout: str, world: World, data_dir: Path, result_dir: Path, compile_layers: bool
) -> None:
    """One training run of `setting` in `layout`; the logging rank writes the result JSON."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"disagg-bench-{layout}-{name}-"))
    config = run_config(
        setting,
        layout=layout,
        shards=data_dir / name,
        run_dir=run_dir,
        device=world.device,
        compile_layers=compile_layers,
    )
    dtype = torch.bfloat16 if world.device.type == "cuda" else torch.float32
    torch.manual_seed(0)  # the same random target on every rank
    target = random_target(world.device, dtype, setting.architecture)
    trainer = None
    if layout == "disagg":
        roles = assign_roles(world, config.placement)
        if roles.role == "target":
            TargetWorker(config, roles=roles, world=world, target=target, should_stop=lambda: False).run()
        else:
            trainer = DrafterTrainer(config, roles=roles, world=world, target=target, should_stop=lambda: False)
    else:
        trainer = Trainer(config, target=target, world=world)
    if trainer is not None:
        trainer.fit()
        if trainer.is_main:
            result = summarize(run_dir / "metrics.jsonl", setting, layout=layout, name=name)
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


def summarize(metrics: Path, setting: Setting, *, layout: str, name: str) -> dict:
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    kept = records[setting.skip :] or records[-1:]
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
    parser.add_argument("--compile", action="store_true", help="compile the drafter layers (slower start)")
    args = parser.parse_args(argv)
    names = args.settings.split(",")
    if args.command == "prepare":
        for name in names:
            write_shards(args.data_dir / name, SETTINGS[name])
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
                SETTINGS[name],
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
