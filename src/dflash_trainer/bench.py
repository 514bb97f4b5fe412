"""`dflash-trainer bench`: time real training steps of the trainer on synthetic data.

The target is a randomly initialised model of a given HF architecture (by default Qwen3-8B's shape, the paper's
setting) built directly on the device, so no weights are needed. Shards of random tokens in documents of the given
lengths are packed into rows by the normal sampler. Two phases, both through `Trainer._optimizer_step`:

- drafter only: the target features of one batch are computed once and replayed (what a disaggregated drafter
  rank does when features arrive for free);
- end to end: target forward + drafter step, the colocated training step.

Timing follows benchmarks/METHOD: warm-up steps first (compilation), then the median of timed steps, each
bracketed by device synchronisation. Results go to stdout and, with `--out`, to a JSON file.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from .config import RunConfig, load_config
from .data.shards import ShardWriter
from .target.loader import LoadedTarget
from .train.metrics import measured_peak_flops
from .train.trainer import Trainer

QWEN3_8B = dict(
    model_type="qwen3",
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    tie_word_embeddings=False,
)


@dataclass
class PhaseResult:
    name: str
    step_ms_median: float
    step_ms_min: float
    step_ms_max: float
    tokens_per_step: float
    tokens_per_s: float
    mfu: float | None
    peak_mem_gib: float
    first_step_s: float


def random_target(device: torch.device, dtype: torch.dtype, architecture: dict) -> LoadedTarget:
    config = AutoConfig.for_model(**architecture)
    config._attn_implementation = "sdpa"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval().requires_grad_(False)
    tokenizer = SimpleNamespace(pad_token_id=0)
    return LoadedTarget(
        model=model,
        tokenizer=tokenizer,
        config=config,
        name=f"random-{architecture.get('model_type', 'model')}",
        stop_token_ids=[],
        device=device,
        dtype=dtype,
        model_dir=None,
    )


def write_synthetic_shards(out_dir: Path, *, doc_lens: list[int], rows: int, vocab: int, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    with ShardWriter(out_dir, tokenizer_name="synthetic", vocab_size=vocab) as writer:
        for row in range(rows):
            for d, length in enumerate(doc_lens):
                ids = rng.integers(0, vocab - vocab // 16, size=length)  # spare the top rows (mask token)
                writer.add(f"r{row}-d{d}", ids, np.ones(length, dtype=np.uint8))
    return out_dir


def time_steps(trainer: Trainer, batches: list, *, warmup: int, steps: int, name: str) -> PhaseResult:
    device = trainer.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    trainer._optimizer_step([batches[0]])
    sync()
    first_step_s = time.perf_counter() - started
    for i in range(1, warmup):
        trainer._optimizer_step([batches[i % len(batches)]])
    sync()
    times, tokens, blocks = [], [], []
    for i in range(steps):
        batch = batches[(warmup + i) % len(batches)]
        sync()
        start = time.perf_counter()
        trainer._optimizer_step([batch])
        sync()
        times.append(time.perf_counter() - start)
        tokens.append(batch.num_tokens)
        blocks.append(batch.num_blocks)
    median = statistics.median(times)
    tokens_per_step = float(np.mean(tokens))
    peak = measured_peak_flops(device)
    mfu = None
    if peak is not None:
        flops = trainer.flops_per_token(float(np.sum(blocks)) / float(np.sum(tokens)))
        if name.startswith("drafter_only"):  # no target forward in this phase
            flops -= trainer.flops_per_token(0.0)
        mfu = tokens_per_step / median * flops / peak
    mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    return PhaseResult(
        name=name,
        step_ms_median=median * 1e3,
        step_ms_min=min(times) * 1e3,
        step_ms_max=max(times) * 1e3,
        tokens_per_step=tokens_per_step,
        tokens_per_s=tokens_per_step / median,
        mfu=mfu,
        peak_mem_gib=mem,
        first_step_s=first_step_s,
    )


def bench_config(recipe: Path | None, overrides: list[str], shards: Path, run_dir: Path) -> RunConfig:
    defaults = [
        f"data.train_shards={shards}",
        f"run_dir={run_dir}",
        "metrics.tensorboard=false",
        "metrics.progress_bar=false",
        "checkpoint.resume=none",
        # Compiled layers are timed as a second phase against the eager ones.
        "drafter.compile=false",
    ]
    return load_config(recipe, [*defaults, *overrides])


def run_bench(
    *,
    recipe: Path | None,
    overrides: list[str],
    steps: int,
    warmup: int,
    doc_lens: tuple[int, ...] = (3072, 3072, 2048),
    architecture: dict | None = None,
    out: Path | None = None,
    compare_compiled: bool = True,
) -> list[PhaseResult]:
    architecture = architecture or QWEN3_8B
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with tempfile.TemporaryDirectory() as tmp:
        shards = write_synthetic_shards(
            Path(tmp) / "shards", doc_lens=list(doc_lens), rows=warmup + steps + 2, vocab=architecture["vocab_size"]
        )
        config = bench_config(recipe, overrides, shards, Path(tmp) / "run")
        target = random_target(device, dtype, architecture)
        trainer = Trainer(config, target=target, log=print)
        trainer.start_log_window()
        plans = list(trainer.sampler)
        batches = [trainer.make_batch(plan) for plan in plans]
        print(
            f"bench: {len(batches)} batches, {np.mean([b.num_tokens for b in batches]):.0f} tokens and "
            f"{np.mean([b.num_blocks for b in batches]):.0f} blocks per step, block {trainer.model_config.block_size}, "
            f"drafter layers {trainer.model_config.num_hidden_layers}, backend {trainer.backend}"
        )
        results = []
        # Drafter only: replay one batch's features.
        cached = trainer.capture.capture(batches[0].input_ids, batches[0].position_ids, batches[0].doc_ids)
        real_capture = trainer.capture.capture
        trainer.capture.capture = lambda *args, **kwargs: cached
        same_batch = [batches[0]]
        results.append(time_steps(trainer, same_batch, warmup=warmup, steps=steps, name="drafter_only"))
        if compare_compiled and device.type == "cuda":
            trainer.drafter.compile_layers()
            name = "drafter_only_compiled"
            results.append(time_steps(trainer, same_batch, warmup=warmup, steps=steps, name=name))
        trainer.capture.capture = real_capture
        results.append(time_steps(trainer, batches, warmup=warmup, steps=steps, name="end_to_end"))
    for r in results:
        mfu = f"{100 * r.mfu:.1f}%" if r.mfu is not None else "n/a"
        print(
            f"{r.name:>22}: {r.step_ms_median:8.1f} ms/step (min {r.step_ms_min:.1f}, max {r.step_ms_max:.1f}) | "
            f"{r.tokens_per_s:9.0f} target tok/s | MFU {mfu} | peak {r.peak_mem_gib:.1f} GiB | "
            f"first step {r.first_step_s:.1f}s"
        )
    if out is not None:
        out.write_text(json.dumps([r.__dict__ for r in results], indent=2))
    return results
