"""`dflash-trainer bench`: time real training steps of the trainer on synthetic data.

The target is a randomly initialised model of the recipe's target shape, built directly on the device, so no
weights are needed: Qwen3-8B's shape (the paper's setting, `recipes/bench-qwen3-8b.yaml`) or, when the recipe
names SmolLM2, SmolLM2-135M's (Llama: hidden 576, 30 layers, 9 heads, 3 KV heads, intermediate 1536,
vocab 49152, tied embeddings; `recipes/bench-smollm2.yaml`). Documents of random tokens are packed into rows by
the normal sampler: the paper's fixed 3072 + 3072 + 2048 fully supervised documents, or for SmolLM2 documents shaped
like the math-first GPU recipe's regenerated data (an unsupervised prompt of 30-232 tokens, a reply of 4-114 tokens
or cut at 256; `smollm2_documents`).

Phases, each through the trainer's own step (`Trainer._optimizer_step`):
- drafter_only: the target features of one batch are computed once and replayed (what a disaggregated drafter
  rank does when features arrive for free);
- end_to_end: the colocated training step fed by the real data path (`Trainer._step_groups`: the prefetch
  worker, non-blocking copies), target forward included;
- one end_to_end phase per `--ablation NAME:key=value,...`: a new trainer with those overrides (same target; with
  `target.fp8` a random target of the same shape quantized to FP8), so
  the effect of each optimisation is measured in the same call.
Every phase starts from a reset dynamo state (`fresh_compile_state`): it compiles its own code, cold in-process;
and with the previous phase's trainer freed (`release_previous_phase`): its memory numbers are its own.

Per phase: median step time, target tokens/s, MFU, peak memory, the first step's time (compilation; with the frames
dynamo compiled in it, its seconds in dynamo's compile by stage and frame by frame), the number of dynamo
compilations after warm-up (any is a recompile), and the per-stage profile of a few more steps run with the stage
profiler on (it synchronises after every stage, so those steps are slower; the shares are what count),
and with `--kernels N` the N kernels that take the most device time over a few more steps, run under
`torch.profiler` (`kernel_profile.py`: busy time against step time, then ms, share and calls per kernel, then per
stage its synchronised wall time against its kernels' busy time; `--trace-dir` also writes each phase's Chrome
trace, the stages in it as `stage:NAME` ranges: steps whose stages wait for their kernels, so the trace shows no
overlap of host and GPU across stages).
Timing follows benchmarks/METHOD: warm-up steps first, then the median of timed steps, each bracketed by device
synchronisation; then as many steps back to back, each timed from the previous step's end to its own by CUDA events
(`back_to_back_steps`: the period a training loop runs at, host launches overlapping the device's work). A phase that
runs the target one step ahead on a side stream (`train.target_lookahead`) is timed back to back only: bracketing its
steps by synchronisations would leave the next step's target forward outside every timer. Compare such a phase with
the others' back-to-back medians. Results go to stdout and, with `--out`, to a JSON file.
"""

from __future__ import annotations

import gc
import itertools
import json
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from .config import ConfigError, RunConfig, load_config
from .data.shards import ShardWriter
from .errors import UserError
from .gpu_monitor import GpuMonitor
from .gpu_monitor import describe as describe_clock
from .kernel_profile import KernelProfile, format_profile, profile_kernels
from .shapes import QWEN3_8B, QWEN36_27B, SMOLLM2_135M
from .targets.loader import LoadedTarget, quantize_target_to_fp8
from .train.metrics import (
    CompileWatch,
    allocator_retries,
    compile_stages_since,
    compile_times,
    describe_compile_stages,
    measured_peak_flops,
    triton_cache_dir,
    triton_cache_entries,
)
from .train.profiler import StageProfiler
from .train.trainer import StepWork, Trainer

# Steps of the profiled pass after the timed ones.
PROFILED_STEPS = 3


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
    # Of the first step: frames dynamo compiled and the seconds in its `_compile` (tracing and the forward graphs
    # Inductor builds; backward graphs are compiled lazily in the backward and count only in first_step_s).
    first_step_compiles: int
    first_step_compile_s: float
    recompiles_after_warmup: int
    # cudaMalloc retries of the caching allocator during the timed steps (it frees its cache and retries when a
    # request does not fit: a synchronising, slow path that makes a step near the memory limit erratic).
    alloc_retries: int
    # Where the first step's compile went (train/metrics.py COMPILE_STAGES, nested: the graphs' seconds contain the
    # lowering, codegen and Triton waits below them), for the cold first step (issue 10: <= 30 s).
    first_step_compile_stages: dict[str, float] = field(default_factory=dict)
    # The same compile frame by frame (`compiled_frames_since`): which region costs what, and a region compiled
    # twice (a second graph of one frame, compile id `1/1`) shows as a second row.
    first_step_frames: list[dict] = field(default_factory=list)
    # Median SM clock (MHz) and board power (W) over the timed steps (gpu_monitor.py; None without nvidia-smi): a
    # step that holds the power limit runs every kernel at a lower clock than a kernel timed alone.
    sm_clock_mhz: float | None = None
    power_w: float | None = None
    # Every timed step, in order: its ms, the frames dynamo compiled in it, and the new entries of Triton's disk
    # cache after it (None without one): a slow step that compiled says so.
    step_ms: list[float] = field(default_factory=list)
    step_compiles: list[int] = field(default_factory=list)
    step_triton_compiles: list[int | None] = field(default_factory=list)
    # Every timed step's target tokens: with the step's ms, the split of a step into a per-token and a fixed part.
    step_tokens: list[int] = field(default_factory=list)
    # Stage -> average ms per step over the profiled steps.
    stages_ms: dict[str, float] = field(default_factory=dict)
    # Where the device memory goes (CUDA): GiB held across steps by owner (`resident_memory`), and per stage of the
    # profiled steps the GiB allocated on entering it and its peak (`StageProfiler(track_memory=True)`).
    resident_gib: dict[str, float] = field(default_factory=dict)
    stage_memory_gib: dict[str, tuple[float, float]] = field(default_factory=dict)
    # The top kernels over PROFILED_STEPS more steps (`--kernels`), None when not asked for.
    kernel_profile: KernelProfile | None = None

    # Mean tokens per step over the whole epoch the sampler planned (None when unknown): tokens/s comes from the
    # timed steps only, and with documents of 4-8K tokens, one per step, 4 timed steps held 19 % fewer tokens than
    # the data does. Where the drafter's work is fixed per document (1,024 anchors each), fewer tokens per step is a
    # lower rate, so a reader compares the two before comparing runs that timed different steps.
    data_tokens_per_step: float | None = None
    # Tokens/s at the data's mean step, from a least-squares line through the timed steps' (tokens, ms)
    # (`rate_at_data_mean`): the rate a whole epoch would run at, free of which steps happened to be timed. None when
    # the timed steps are too few or too alike in size to fit a line (the drafter-only phase replays one batch).
    tokens_per_s_at_data_mean: float | None = None

    # Median time between the ends of consecutive steps run back to back (`steps` more steps, no synchronisation
    # between them: `back_to_back_steps`): the step a training loop runs at, host launches overlapping the device's
    # work.
    # Phases with the target run one step ahead (`train.target_lookahead`) are timed this way only (`pipelined`):
    # bracketing each step by synchronisations would move the next step's target forward outside the timer.
    step_ms_period: float | None = None
    pipelined: bool = False

    # Why the phase has no numbers (it ran out of device memory); None when it ran.
    error: str | None = None

    @classmethod
    def failed(cls, name: str, error: str, peak_mem_gib: float) -> PhaseResult:
        nan = float("nan")
        return cls(
            name=name,
            step_ms_median=nan,
            step_ms_min=nan,
            step_ms_max=nan,
            tokens_per_step=nan,
            tokens_per_s=nan,
            mfu=None,
            peak_mem_gib=peak_mem_gib,
            first_step_s=nan,
            first_step_compiles=0,
            first_step_compile_s=nan,
            recompiles_after_warmup=0,
            alloc_retries=0,
            error=error,
        )

    def describe_steps(self) -> str:
        """Every timed step: `812 (2 frames compiled, 14 new Triton kernels), 640, ...`."""
        steps = zip(self.step_ms, self.step_compiles, self.step_triton_compiles, strict=True)
        return ", ".join(describe_step(*step) for step in steps)


@dataclass
class Setting:
    architecture: dict
    # One document list per packed row source: (length, supervised from this position on).
    documents: Callable[[np.random.Generator], list[tuple[int, int]]]


def paper_documents(rng: np.random.Generator) -> list[tuple[int, int]]:
    return [(3072, 0), (3072, 0), (2048, 0)]


def smollm2_documents(rng: np.random.Generator) -> list[tuple[int, int]]:
    """About 66 documents (one 16K-token step) shaped like the math-first GPU recipe's regenerated data (measured
    2026-12-01: 47,066 samples of 248 tokens on average, 117 of them supervised; 28 % of the replies cut at 256 new
    tokens, the rest 59 tokens on average): a prompt of 30-232 tokens (chat template included), then a reply of 256
    tokens for 28 % of the documents and of 4-114 tokens otherwise."""
    docs = []
    for _ in range(66):
        prompt = int(rng.integers(30, 233))
        reply = 256 if rng.random() < 0.28 else int(rng.integers(4, 115))
        docs.append((prompt + reply, prompt))
    return docs


def long_reply_documents(rng: np.random.Generator) -> list[tuple[int, int]]:
    """Documents shaped like a reasoning model's regenerated replies, the data of the seed's 27B job: a prompt of
    64-512 tokens, then a long reply, 4,096 to 8,192 tokens in all (one or two documents per 8,192-token row).

    Why this shape: the system this project replaces trained at 14.5K target tokens/s with 3 drafter GPUs, and a
    5-layer 27B-wide drafter costs about 16 GFLOP per block slot (6 x 1.8B parameters + 4 x H x V for the LM head),
    so even at 50 % of three H200s' bf16 peak its data held at most ~0.16 blocks per token; with its 1,024 anchors
    per document, block 32, that means documents of about 6,000 tokens or more. Short documents (`smollm2`) put an
    anchor on every reply position, about 3x the drafter work per target token."""
    docs = []
    for _ in range(2):
        total = int(rng.integers(4096, 8193))
        docs.append((total, int(rng.integers(64, 513))))
    return docs


# `bench --documents NAME`: the documents packed into the bench's rows.
DOCUMENTS: dict[str, Callable[[np.random.Generator], list[tuple[int, int]]]] = {
    "paper": paper_documents,
    "smollm2": smollm2_documents,
    "long": long_reply_documents,
}


def setting_for(config: RunConfig, documents: str | None = None) -> Setting:
    """The recipe's target name picks the shape (the target itself is never loaded) and, unless `documents` names
    others, the documents: SmolLM2 with its recipe's data shape, Qwen3.6-27B with long replies, else the paper's."""
    name = config.target.name_or_path.lower()
    if "smollm2" in name:
        setting = Setting(SMOLLM2_135M, smollm2_documents)
    elif "qwen3.6-27b" in name:
        setting = Setting(QWEN36_27B, long_reply_documents)
    else:
        setting = Setting(QWEN3_8B, paper_documents)
    return setting if documents is None else Setting(setting.architecture, DOCUMENTS[documents])


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


def write_synthetic_shards(out_dir: Path, *, setting: Setting, groups: int, vocab: int, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    with ShardWriter(out_dir, tokenizer_name="synthetic", vocab_size=vocab) as writer:
        for group in range(groups):
            for d, (length, supervised_from) in enumerate(setting.documents(rng)):
                ids = rng.integers(0, vocab - vocab // 16, size=length)  # spare the top rows (mask token)
                mask = (np.arange(length) >= supervised_from).astype(np.uint8)
                writer.add(f"g{group}-d{d}", ids, mask)
    return out_dir


def time_steps(
    trainer: Trainer,
    works: Iterator[StepWork],
    *,
    warmup: int,
    steps: int,
    name: str,
    drafter_only: bool = False,
    kernels: int = 0,
    trace_path: Path | None = None,
) -> PhaseResult:
    device = trainer.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def run(work: StepWork) -> None:
        trainer._optimizer_step(work.batches, outputs=work.outputs, loss_scale=work.loss_scale)

    pipelined = trainer.config.train.target_lookahead and not drafter_only

    started, first_compiles, compile_snapshot = time.perf_counter(), CompileWatch(), compile_times()
    frames_mark = time.time_ns() // 1000
    run(next(works))
    sync()
    first_step_s = time.perf_counter() - started
    first_step_compiles, first_step_compile_s, _ = first_compiles.take()
    first_step_compile_stages = compile_stages_since(compile_snapshot)
    first_step_frames = compiled_frames_since(frames_mark)
    for _ in range(1, warmup):
        run(next(works))
    sync()
    compiles, retries = CompileWatch(), allocator_retries(device) or 0
    times, tokens, blocks, step_compiles, step_triton = [], [], [], [], []
    triton_cache = triton_cache_dir()  # after warm-up: where Inductor pointed Triton, if it ran a kernel
    with GpuMonitor(device) as monitor:
        for _ in range(0 if pipelined else steps):
            work = next(works)
            sync()
            triton_before = triton_cache_entries(triton_cache)
            start = time.perf_counter()
            run(work)
            sync()
            times.append(time.perf_counter() - start)
            step_compiles.append(compiles.take()[2])
            triton_after = triton_cache_entries(triton_cache)
            step_triton.append(None if triton_before is None or triton_after is None else triton_after - triton_before)
            tokens.append(sum(b.num_tokens for b in work.batches))
            blocks.append(sum(b.num_blocks for b in work.batches))
        window = back_to_back_steps(run, works, steps=steps, device=device)
        if pipelined:
            times, tokens, blocks = window.seconds, window.tokens, window.blocks
            step_compiles = [compiles.take()[2]] + [0] * (steps - 1)  # counted over the window: no per-step sync
            step_triton = [None] * steps
    recompiles, clock = sum(step_compiles), monitor.reading
    retries = (allocator_retries(device) or 0) - retries
    trainer._settle_flags()
    median = statistics.median(times)
    tokens_per_step = float(np.mean(tokens))
    peak = measured_peak_flops(device)
    mfu = None
    if peak is not None:
        flops = trainer.flops_per_token(float(np.sum(blocks)) / float(np.sum(tokens)))
        if drafter_only:  # no target forward in this phase
            flops -= trainer.flops_per_token(0.0)
        mfu = tokens_per_step / median * flops / peak
    mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    # A few more steps with the stage profiler on (it synchronises after every stage, and tracks memory per stage).
    real_profiler = trainer.profiler
    trainer.profiler = StageProfiler(3600.0, device=device, sink=lambda _: None, track_memory=True)
    for _ in range(PROFILED_STEPS):
        run(next(works))
    trainer._settle_flags()
    stages = {stage: 1e3 * stats.sum_s / PROFILED_STEPS for stage, stats in trainer.profiler.summary().items()}
    stage_memory = {
        stage: (memory.entry_bytes / 2**30, memory.peak_bytes / 2**30)
        for stage, memory in trainer.profiler.memory().items()
    }
    kernel_profile = None
    if kernels > 0:
        # The stages again, each a profiler range, so the kernels can be billed to the stage that launched them.
        trainer.profiler = StageProfiler(3600.0, device=device, sink=lambda _: None, annotate=True)
        kernel_profile = profile_kernels(
            lambda: run(next(works)), steps=PROFILED_STEPS, device=device, top=kernels, trace_path=trace_path
        )
        trainer._settle_flags()
    trainer.profiler = real_profiler
    return PhaseResult(
        name=name,
        step_ms_median=median * 1e3,
        step_ms_period=statistics.median(window.seconds) * 1e3,
        pipelined=pipelined,
        step_ms_min=min(times) * 1e3,
        step_ms_max=max(times) * 1e3,
        tokens_per_step=tokens_per_step,
        tokens_per_s=tokens_per_step / median,
        mfu=mfu,
        peak_mem_gib=mem,
        first_step_s=first_step_s,
        first_step_compiles=first_step_compiles,
        first_step_compile_s=first_step_compile_s,
        recompiles_after_warmup=recompiles,
        first_step_compile_stages=first_step_compile_stages,
        first_step_frames=first_step_frames,
        sm_clock_mhz=clock.sm_clock_mhz if clock else None,
        power_w=clock.power_w if clock else None,
        alloc_retries=retries,
        step_ms=[1e3 * t for t in times],
        step_compiles=step_compiles,
        step_triton_compiles=step_triton,
        step_tokens=tokens,
        stages_ms=stages,
        resident_gib=resident_memory(trainer) if device.type == "cuda" else {},
        stage_memory_gib=stage_memory,
        kernel_profile=kernel_profile,
        data_tokens_per_step=data_tokens_per_step(trainer),
        tokens_per_s_at_data_mean=rate_at_data_mean(
            tokens,
            times,
            data_tokens_per_step(trainer),
            [bool(c) or bool(t) for c, t in zip(step_compiles, step_triton, strict=True)],
        ),
    )


@dataclass
class StepWindow:
    seconds: list[float]  # per step: from the previous step's end to its own
    tokens: list[int]
    blocks: list[int]


def back_to_back_steps(run: Callable[[StepWork], None], works: Iterator[StepWork], *, steps: int, device) -> StepWindow:
    """`steps` steps run back to back, with no synchronisation between them, each timed from the previous step's end
    to its own: on CUDA by events recorded on the current stream after each step (the device's clock; the host may
    run ahead), on the CPU by the host's clock (its ops run as they are issued)."""
    tokens, blocks = [], []

    def one_step() -> None:
        work = next(works)
        run(work)
        tokens.append(sum(b.num_tokens for b in work.batches))
        blocks.append(sum(b.num_blocks for b in work.batches))

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        ends = [torch.cuda.Event(enable_timing=True)]
        ends[0].record()
        for _ in range(steps):
            one_step()
            ends.append(torch.cuda.Event(enable_timing=True))
            ends[-1].record()
        torch.cuda.synchronize(device)
        seconds = [start.elapsed_time(end) / 1e3 for start, end in itertools.pairwise(ends)]
    else:
        marks = [time.perf_counter()]
        for _ in range(steps):
            one_step()
            marks.append(time.perf_counter())
        seconds = [end - start for start, end in itertools.pairwise(marks)]
    return StepWindow(seconds=seconds, tokens=tokens, blocks=blocks)


def data_tokens_per_step(trainer: Trainer) -> float | None:
    """The epoch's tokens over its steps on this rank (one rank: every document once)."""
    steps = len(trainer.sampler)
    return float(trainer.sampler.lengths.sum()) / steps if steps else None


def rate_at_data_mean(
    tokens: list[int], seconds: list[float], data_mean: float | None, compiling: list[bool] | None = None
) -> float | None:
    """Tokens/s of a step holding `data_mean` tokens, from the line `seconds = fixed + per_token * tokens` fitted to
    the timed steps by least squares. Why a line: a step's target forward grows with its tokens while the drafter's
    work is set by its documents' anchors (1,024 each at the seed's setting), so a step is a fixed part plus a
    per-token part; and the epoch's rate is its tokens over its time, which for a line is the rate at the mean step.
    None with fewer than 4 steps, with steps whose sizes spread less than 10 %, or with a fit that is not a cost
    (a negative part: noise larger than the size effect).

    Steps flagged in `compiling` (a frame or a Triton kernel compiled during the step) are left out of the fit: a
    hybrid target's flash-linear-attention kernels autotune once per new length bucket, 6-9 s on a ~1.2 s step at the
    seed's setting, a one-time cost that a line through the steady steps must not absorb."""
    if compiling is not None:
        steady = [i for i, hit in enumerate(compiling) if not hit]
        tokens, seconds = [tokens[i] for i in steady], [seconds[i] for i in steady]
    if data_mean is None or len(tokens) < 4 or max(tokens) < 1.1 * min(tokens):
        return None
    per_token, fixed = np.polyfit(np.asarray(tokens, dtype=np.float64), np.asarray(seconds, dtype=np.float64), 1)
    if per_token < 0 or fixed < 0:
        return None
    return float(data_mean / (fixed + per_token * data_mean))


def resident_memory(trainer: Trainer) -> dict[str, float]:
    """GiB held from step to step, by owner: the target's weights and buffers, the drafter's master weights, its
    gradients (alive from the first backward of a step to the optimizer's zero_grad: the master weights' size) and
    the optimizer's state. The rest of a step's peak is what the stages allocate (activations, logits, features)."""

    def gib(tensors: Iterator[torch.Tensor]) -> float:
        return sum(t.numel() * t.element_size() for t in tensors) / 2**30

    model = trainer.target.model
    drafter = list(trainer.drafter.parameters())
    state = (v for per_param in trainer.optimizer.state.values() for v in per_param.values() if torch.is_tensor(v))
    return {
        "target_weights": gib(itertools.chain(model.parameters(), model.buffers())),
        "drafter_weights": gib(iter(drafter)),
        "drafter_grads": gib(p for p in drafter if p.requires_grad),
        "optimizer_state": gib(state),
    }


# Per compiled frame, dynamo's CompilationMetrics fields (microseconds) worth printing, by label. Nested like the
# stages: the total holds dynamo's tracing, which holds AOT autograd, which holds Inductor (forward and backward
# graphs: with symbolic sizes the backward compiles with its forward), which holds code generation and Triton.
FRAME_PARTS = {
    "dynamo": "dynamo_cumulative_compile_time_us",
    "AOT": "aot_autograd_cumulative_compile_time_us",
    "Inductor": "inductor_cumulative_compile_time_us",
    "codegen": "inductor_code_gen_cumulative_compile_time_us",
    "Triton": "triton_compile_time_us",
}


def compiled_frames_since(start_us: int) -> list[dict]:
    """The frames dynamo compiled since `start_us` (`time.time_ns() // 1000`), in order: where each is in the code,
    its compile id (`1/1`: the frame's second graph, a recompile), its seconds in all and per FRAME_PARTS part (a
    part torch does not report is left out), and its graph's op count. From `torch._dynamo.utils`' last 64."""
    from torch._dynamo.utils import get_compilation_metrics

    frames = []
    for metrics in get_compilation_metrics():
        if (getattr(metrics, "start_time_us", None) or 0) < start_us:
            continue
        filename = Path(getattr(metrics, "co_filename", None) or "?").name
        frame = {
            "frame": f"{metrics.co_name} ({filename}:{metrics.co_firstlineno})",
            "compile_id": str(metrics.compile_id),
            "seconds": round((getattr(metrics, "duration_us", None) or 0) / 1e6, 2),
            "ops": getattr(metrics, "graph_op_count", None),
        }
        for label, name in FRAME_PARTS.items():
            value = getattr(metrics, name, None)
            if value:
                frame[label] = round(value / 1e6, 2)
        frames.append(frame)
    return frames


def describe_frames(frames: list[dict]) -> str:
    """`forward (drafter.py:176) [1/0] 14.2s: dynamo 14.2s, AOT 12.9s, ...; ...` for the first step's frames."""
    described = []
    for frame in frames:
        parts = ", ".join(f"{label} {frame[label]:.1f}s" for label in FRAME_PARTS if label in frame)
        described.append(
            f"{frame['frame']} [{frame['compile_id']}] {frame['seconds']:.1f}s ({frame['ops']} ops: {parts})"
        )
    return "; ".join(described) or "none"


def fresh_compile_state() -> None:
    """Each phase compiles from scratch, as a new run would (Inductor's on-disk cache still serves kernels it
    has built), so its first step is comparable across phases and no phase runs code compiled for another.
    Why: on 2026-12-01 a second trainer in one bench process recompiled the shared layer code with every GEMM
    and flex kernel autotuned, which a default compile never does; the flags printed here say which compile
    mode Inductor's global config held when the phase started."""
    torch._dynamo.reset()
    from torch._inductor import config as inductor_config

    print(
        f"bench: compile state reset; inductor max_autotune={inductor_config.max_autotune} "
        f"max_autotune_gemm={inductor_config.max_autotune_gemm}"
    )


def release_previous_phase(device: torch.device) -> None:
    """Frees what the phase that just ended still holds, before the next one builds its trainer: each phase starts
    with the target and its own trainer only, so its memory numbers are its own. Why a full collection: the drafter's
    compiled layers are reference cycles (`nn.Module.compile` stores the compiled wrapper on the module, and the
    wrapper refers back to it), which reference counting never frees; Python's full collection runs only after
    enough new objects, which a phase may never make (on 2026-12-02 the 27B bench's third phase, an ablation, ran with
    22.6 GiB more allocated between steps than the two before it)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def bench_config(recipe: Path | None, overrides: list[str], shards: Path, run_dir: Path) -> RunConfig:
    defaults = [
        f"data.train_shards={shards}",
        f"run_dir={run_dir}",
        "metrics.tensorboard=false",
        "metrics.progress_bar=false",
        "checkpoint.resume=none",
    ]
    return load_config(recipe, [*defaults, *overrides])


def replay(work: StepWork, features) -> Iterator[StepWork]:
    """The same step forever, with its target features precomputed."""
    while True:
        yield StepWork(batches=work.batches, outputs=[features], loss_scale=1.0)


def live_steps(trainer: Trainer) -> Iterator[StepWork]:
    """The trainer's own data path (prefetch worker, non-blocking copies); the profiler times its stages."""
    yield from trainer._step_groups()


def parse_ablation(text: str) -> tuple[str, list[str]]:
    """`name:key=value,key=value` -> (name, overrides); a malformed one is the user's error, named."""
    name, _, rest = text.partition(":")
    overrides = rest.split(",")
    if not name or not rest or not all("=" in override for override in overrides):
        raise ConfigError(f"--ablation {text!r}: expected NAME:key=value[,key=value...]")
    return name, overrides


def run_bench(
    *,
    recipe: Path | None,
    overrides: list[str],
    steps: int,
    warmup: int,
    out: Path | None = None,
    ablations: list[str] = (),
    drafter_only_ablations: bool = False,
    kernels: int = 0,
    trace_dir: Path | None = None,
    documents: str | None = None,
    require_cuda: bool = True,
) -> list[PhaseResult]:
    """Time the recipe's training steps, phase by phase. `require_cuda=False` lets a test run a tiny setting on the
    CPU; a user's full-size recipe there only exhausts the memory (bench-smollm2 was killed at 24 GiB)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    parsed = [parse_ablation(text) for text in ablations]
    with tempfile.TemporaryDirectory() as tmp:
        probe = bench_config(recipe, overrides, Path(tmp) / "shards", Path(tmp) / "run")
        for _, extra in parsed:  # a bad ablation fails here, not after the phases before it have run
            bench_config(recipe, [*overrides, *extra], Path(tmp) / "shards", Path(tmp) / "run")
        if require_cuda and device.type != "cuda":
            raise UserError(
                "bench times GPU training steps at the recipe's full size, and this machine has no CUDA device"
            )
        setting = setting_for(probe, documents)
        # Enough steps for the end-to-end phases: warm-up, timed (twice: one at a time, then back to back), stage- and
        # kernel-profiled steps, one more prepared ahead (`train.target_lookahead`), and some slack.
        groups = 2 * (warmup + 2 * steps + 2 * PROFILED_STEPS + 2)
        shards = write_synthetic_shards(
            Path(tmp) / "shards", setting=setting, groups=groups, vocab=setting.architecture["vocab_size"]
        )
        # One random target at a time, rebuilt when a phase's precision differs from the last one's: FP8 is
        # irreversible and the Trainer does not quantize a target it is handed, so a phase with `target.fp8` gets a
        # random target of its own (other weights, same shape: these phases time steps, they do not compare
        # features), and the previous target is freed first so that the phase's peak memory is its own.
        current: dict[bool, LoadedTarget] = {}

        def target_for(config: RunConfig) -> LoadedTarget:
            fp8 = config.target.fp8
            if fp8 not in current:
                current.clear()
                gc.collect()  # the last trainer's reference cycles
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                current[fp8] = random_target(device, dtype, setting.architecture)
                if fp8:
                    quantize_target_to_fp8(current[fp8])
            return current[fp8]

        results: list[PhaseResult] = []

        def record(result: PhaseResult) -> None:
            # Each phase's numbers are printed and saved as soon as it ends: a run cut short (a time limit, a
            # killed process) keeps the phases it finished.
            results.append(result)
            print_phase(result)
            if out is not None:
                out.write_text(json.dumps([asdict(r) for r in results], indent=2))

        running = [""]  # the phase in progress, to name one that runs out of memory

        def run_phases(index: int, name: str, extra: list[str], config: RunConfig) -> None:
            """The drafter-only phase (first setting, or each with --drafter-only-ablations) and the end-to-end one."""
            running[0] = ("end_to_end" + (f"[{name}]" if name else "")) if index else "drafter_only"
            if index:  # the previous setting's trainer is gone with its call; its compiled layers need a collection
                fresh_compile_state()
                release_previous_phase(device)
            target = target_for(config)
            trainer = Trainer(config, target=target, log=print)
            trainer.start_log_window()
            suffix = f"[{name}]" if name else ""
            # An ablation of the target alone (`target.*`, or when it runs: `train.target_lookahead`) leaves the
            # drafter-only step as it was: not timed again.
            target_only = bool(extra) and all(
                override.startswith(("target.", "train.target_lookahead")) for override in extra
            )
            if index == 0 or (drafter_only_ablations and not target_only):
                batch = trainer.make_batch(next(iter(trainer.sampler)))
                if index == 0:
                    print(
                        f"bench: {trainer.total_steps} steps available, {batch.num_tokens} tokens and "
                        f"{batch.num_blocks} blocks in the first batch (shape {tuple(batch.input_ids.shape)}, "
                        f"{batch.anchors.shape[1]} anchor slots per row), block {trainer.model_config.block_size}, "
                        f"drafter layers {trainer.model_config.num_hidden_layers}, backend {trainer.backend}"
                    )
                started, watch, snapshot = time.perf_counter(), CompileWatch(), compile_times()
                features = trainer.capture.capture(batch.input_ids, batch.position_ids, batch.doc_ids)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                frames, compile_s, _ = watch.take()
                # A run's first step is this (the target's layers compile here when target.compile is on) plus the
                # drafter-only phase's first step.
                print(
                    f"bench: the target's first forward {time.perf_counter() - started:.1f}s ({frames} frames "
                    f"compiled, {compile_s:.1f}s in dynamo's compile: "
                    f"{describe_compile_stages(compile_stages_since(snapshot))})"
                )
                work = StepWork(batches=[batch], outputs=[None], loss_scale=1.0)
                running[0] = "drafter_only" + suffix
                record(
                    time_steps(
                        trainer,
                        replay(work, features),
                        warmup=warmup,
                        steps=steps,
                        name=running[0],
                        drafter_only=True,
                        kernels=kernels,
                        trace_path=trace_dir / f"drafter_only{name and '_' + name}.json" if trace_dir else None,
                    )
                )
                # The drafter-only trainer and its replayed features go before the end-to-end trainer is built.
                del trainer, batch, features, work
                fresh_compile_state()
                release_previous_phase(device)
                trainer = Trainer(config, target=target, log=print)
                trainer.start_log_window()
            running[0] = phase = "end_to_end" + suffix
            steps_iter = live_steps(trainer)
            trace_path = trace_dir / f"{name or 'end_to_end'}.json" if trace_dir else None
            try:
                record(
                    time_steps(
                        trainer,
                        steps_iter,
                        warmup=warmup,
                        steps=steps,
                        name=phase,
                        kernels=kernels,
                        trace_path=trace_path,
                    )
                )
            finally:
                steps_iter.close()  # stops the prefetch worker, also when a step ran out of memory

        errors: list[str] = []
        for index, (name, extra) in enumerate([("", []), *parsed]):
            config = bench_config(recipe, [*overrides, *extra], shards, Path(tmp) / f"run{index}")
            failure = None
            try:
                run_phases(index, name, extra, config)
            except torch.cuda.OutOfMemoryError as error:
                # A setting that does not fit is a result too (the next phases may fit): say so and go on.
                first_line = str(error).splitlines()[0] if str(error) else "out of memory"
                failure = f"out of device memory: {first_line}"
            except Exception as error:
                # A setting that fails is recorded and the other settings still run; the bench then fails below.
                traceback.print_exc()
                failure = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"
                errors.append(f"{running[0]}: {failure}")
            if failure is not None:  # out of the except block: the traceback no longer holds the phase's trainer
                release_previous_phase(device)
                peak = torch.cuda.max_memory_allocated(device) / 2**30  # the failed phase's (not reset by a release)
                record(PhaseResult.failed(running[0], failure, peak))
    print(f"bench: {len(results)} phases done")
    if errors:
        raise RuntimeError(f"bench: {len(errors)} phase(s) failed (tracebacks above): " + "; ".join(errors))
    return results


def describe_step(ms: float, frames: int, kernels: int | None) -> str:
    """`812 (2 frames compiled, 14 new Triton kernels)` for one timed step."""
    notes = ([f"{frames} frames compiled"] if frames else []) + ([f"{kernels} new Triton kernels"] if kernels else [])
    return f"{ms:.0f}" + (f" ({', '.join(notes)})" if notes else "")


def print_phase(r: PhaseResult) -> None:
    if r.error is not None:
        print(f"{r.name:>32}: {r.error} (peak {r.peak_mem_gib:.1f} GiB allocated)")
        return
    mfu = f"{100 * r.mfu:.1f}%" if r.mfu is not None else "n/a"
    period = ""
    if r.pipelined:
        period = "; back to back: the target one step ahead"
    elif r.step_ms_period is not None:
        period = f"; back to back {r.step_ms_period:.1f}"
    print(
        f"{r.name:>32}: {r.step_ms_median:8.1f} ms/step (min {r.step_ms_min:.1f}, max {r.step_ms_max:.1f}{period}) | "
        f"{r.tokens_per_s:9.0f} target tok/s | MFU {mfu} | peak {r.peak_mem_gib:.1f} GiB | "
        f"first step {r.first_step_s:.1f}s ({r.first_step_compiles} frames compiled, {r.first_step_compile_s:.1f}s in "
        f"dynamo's compile) | recompiles {r.recompiles_after_warmup} | "
        f"alloc retries {r.alloc_retries}"
    )
    print(
        f"{'':>32}  first step's compile: {describe_compile_stages(r.first_step_compile_stages)}; timed steps at "
        f"{describe_clock(r.sm_clock_mhz, r.power_w)}"
    )
    if r.first_step_frames:
        print(f"{'':>32}  first step's frames: {describe_frames(r.first_step_frames)}")
    if r.data_tokens_per_step and abs(r.tokens_per_step / r.data_tokens_per_step - 1) > 0.05:
        at_mean = (
            f"; fitted over the timed steps, {r.tokens_per_s_at_data_mean:.0f} tokens/s at the data's mean"
            if r.tokens_per_s_at_data_mean
            else ": time more steps (--steps) before comparing tokens/s"
        )
        print(
            f"{'':>32}  the timed steps hold {r.tokens_per_step:.0f} tokens on average, the data "
            f"{r.data_tokens_per_step:.0f} per step{at_mean}"
        )
    if r.step_ms and (max(r.step_ms) > 1.2 * min(r.step_ms) or any(r.step_compiles) or any(r.step_triton_compiles)):
        # Uneven or compiling steps: each one, to tell a slow steady state from a few hit steps.
        print(f"{'':>32}  timed steps (ms): {r.describe_steps()}")
    stages = " ".join(f"{stage} {ms:.1f}" for stage, ms in sorted(r.stages_ms.items(), key=lambda kv: -kv[1]))
    print(f"{'':>32}  stages (ms/step, profiled): {stages}")
    if r.resident_gib:
        resident = ", ".join(f"{owner} {value:.1f}" for owner, value in r.resident_gib.items())
        by_stage = ", ".join(
            f"{stage} {entry:.1f} -> {peak:.1f}" for stage, (entry, peak) in r.stage_memory_gib.items()
        )
        print(f"{'':>32}  memory (GiB): held across steps: {resident}; per stage, on entry -> peak: {by_stage}")
    if r.kernel_profile is not None:
        for line in format_profile(r.kernel_profile, r.step_ms_median):
            print(f"{'':>32}  {line}")
