"""Metric sinks and console output for the trainer: JSONL, TensorBoard, Weights & Biases, one console line, progress
bar.

Weights & Biases (`metrics.wandb.project`, an optional extra: `pip install dflash-trainer[wandb]`) mirrors the JSONL
records into a run whose id is derived from the run directory, so a resumed training continues the same run; its files
go to `run_dir/wandb`. Offline mode (the default) needs no network or account (`wandb sync` uploads later). After a
resume W&B keeps what it already holds for steps past the checkpoint (it accepts only increasing steps), where the JSONL
file and TensorBoard drop them.

Metric names the trainer logs and the console line understands (all optional; values are host numbers, so
converting device counters happens once per log step, the one place the hot loop syncs):

    epoch            fractional epoch
    loss             training loss of the log interval
    acc              mean accuracy over slots (computed from `acc_per_slot` when absent)
    acc_per_slot     list: conditional accuracy of block slots 1..B-1 (slot 0 carries no loss)
    selector_loss, selector_acc, selector_recall, selector_tau, selector_tau_prefix, selector_weight
                     DFlash2's selector term (model/dflash2/objective.py)
    tau              expected acceptance length E[tau] = 1 + sum_k prod_{j<=k} acc_j
    lr, grad_norm    optimiser state
    tokens_per_s     target tokens per second (all ranks), mfu (fraction of peak FLOP/s)
    step_time_s      seconds per optimizer step, peak_mem_gib
    blocks_per_step  blocks the loss kept per optimizer step (all ranks)
    alloc_retries    CUDA caching allocator retries so far (near the memory limit; GPU only)
    compiles, compile_s   frames torch.compile has compiled since training started, and the seconds spent in it
                     (`CompileWatch`; summed over a data-parallel group); a count that still grows after the first
                     log step is a recompile
    inflight         batches in flight to a drafter (disaggregated placement)
    wait_<name>_s    seconds spent waiting on <name> per step (e.g. wait_features_s)
    eval_tau, eval_loss   from periodic speculative-decoding evaluation
    eval_tau/<set>   the same per evaluated prompt set (`eval.datasets`: eval_tau/gsm8k, ...)
    eval_tau_argmax  the same evaluation drafting each slot's argmax (DFlash2 with `eval.argmax_drafts`)
    eta_s            seconds left (`Progress.eta_seconds`)

Accuracies and recall are fractions: the trainer warns once when one reads outside [0, 1] (`fractions_out_of_range`).

List values are per-slot metrics: element i belongs to block slot i+1 and goes to TensorBoard as
`<name>/slot_<i+1>`.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import os
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import torch
from tqdm import tqdm

from ..errors import UserError, is_storage_error, storage_error

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

    from ..config import WandbConfig

MetricValue = float | Sequence[float]

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tb"
# Fields every JSONL record carries; metric names may not reuse them.
RECORD_FIELDS = ("step", "time", "wall")

# bf16 dense peak FLOP/s per device model, as measured on our machines (DESIGN §5); spec sheets overstate it.
MEASURED_PEAK_BF16_FLOPS = {"H200": 790e12}


class MetricsLogger:
    """Appends one JSON line per `log` call to `run_dir/metrics.jsonl` and mirrors scalars to TensorBoard.

    Only the main rank writes: with `is_main=False` every method is a no-op, so all ranks can call it.
    `resume_step` (resuming from a checkpoint taken at that step) drops records with a larger step, so the curves
    of the resumed run carry no duplicates, and continues `wall` from the last kept record. Without it a run
    appends; pass `resume_step=0` to start over in a directory holding records of an attempt that left no
    checkpoint.

    A record the storage refuses (a full disk, a quota) is skipped with a warning and training goes on: the
    training state in memory matters more than a line of its curve (checkpoints defer likewise, checkpoint.py).
    The line after a failed write starts on a line of its own, so a torn line is never glued to the next record.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        tensorboard: bool = True,
        is_main: bool = True,
        resume_step: int | None = None,
        wandb: WandbConfig | None = None,
        run_config: Mapping[str, object] | None = None,
    ) -> None:
        self.path = Path(run_dir) / METRICS_FILE
        self._file: BinaryIO | None = None
        self._failed_since: int | None = None  # the step of the first record the storage refused, while it does
        self._tb_writer: SummaryWriter | None = None
        self._wandb: WandbSink | None = None
        if not is_main:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        wall_offset = 0.0
        if resume_step is not None:
            wall_offset = truncate_metrics(self.path, resume_step)
        # `wall` uses the monotonic clock so that clock adjustments do not bend the time axis.
        self._start = time.monotonic() - wall_offset
        self._file = self.path.open("ab", buffering=0)  # unbuffered: a refused write leaves nothing pending
        if tensorboard:
            purge_step = None if resume_step is None else resume_step + 1
            self._tb_writer = _open_tensorboard(self.path.parent / TENSORBOARD_DIR, purge_step=purge_step)
        if wandb is not None and wandb.project:
            self._wandb = WandbSink(self.path.parent, wandb, run_config=run_config)

    def log(self, step: int, values: Mapping[str, MetricValue]) -> None:
        """Write one record. Values may be numbers, lists of numbers, or host/device scalars and vectors
        (`.tolist()` is applied; on a device tensor that is a sync, so call this on log steps only)."""
        if self._file is None:
            return
        record: dict[str, object] = {
            "step": int(step),
            "time": round(time.time(), 3),
            "wall": round(time.monotonic() - self._start, 3),
        }
        for name, value in values.items():
            if name in RECORD_FIELDS:
                raise ValueError(f"metric name {name!r} is reserved for the record's own field")
            record[name] = _json_value(name, value)
        # Written per line: a crash loses at most the line being written.
        line = (json.dumps(record) + "\n").encode("utf-8")
        try:
            self._append(b"\n" + line if self._failed_since is not None else line)
        except OSError as error:
            if not is_storage_error(error):
                raise
            if self._failed_since is None:
                self._failed_since = int(step)
                print(
                    f"warning: {storage_error('metrics', self.path, error)}; training goes on, and metrics records "
                    "are skipped until there is room",
                    file=sys.stderr,
                )
        else:
            if self._failed_since is not None:
                print(f"metrics: written again from step {step} (records of steps {self._failed_since}.. skipped)")
                self._failed_since = None
        if self._tb_writer is not None:
            for name, value in record.items():
                if name in RECORD_FIELDS:
                    continue
                if isinstance(value, list):
                    for index, item in enumerate(value):
                        self._tb_writer.add_scalar(f"{name}/slot_{index + 1}", item, global_step=step)
                else:
                    self._tb_writer.add_scalar(name, value, global_step=step)
        if self._wandb is not None:
            self._wandb.log(step, record)

    def _append(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[self._file.write(view) :]  # a raw write may take part of the bytes

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None
        if self._tb_writer is not None:
            self._tb_writer.close()
            self._tb_writer = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def truncate_metrics(path: Path, resume_step: int) -> float:
    """Drop records with step > resume_step from a metrics file (atomically); return the last kept `wall`.

    A torn last line (a crash mid-write) is dropped. Other unreadable lines are kept with a warning: their step
    is unknown and nothing already written should be lost.
    """
    if not path.exists():
        return 0.0
    lines = path.read_text(encoding="utf-8").splitlines()
    kept: list[str] = []
    last_wall = 0.0
    for line_number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            step = int(record["step"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            if line_number == len(lines):
                continue
            warnings.warn(f"{path}:{line_number}: unreadable metrics record kept as is", stacklevel=3)
            kept.append(line)
            continue
        if step <= resume_step:
            kept.append(line)
            last_wall = max(last_wall, float(record.get("wall", 0.0)))
    temp_path = path.with_name(path.name + ".tmp")
    temp_path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    os.replace(temp_path, path)
    return last_wall


def _open_tensorboard(log_dir: Path, *, purge_step: int | None) -> SummaryWriter:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:
        raise RuntimeError(
            "metrics.tensorboard is true but the `tensorboard` package is not installed: "
            "`pip install tensorboard`, or set metrics.tensorboard=false"
        ) from error
    # purge_step hides events of the interrupted run past the resume step.
    return SummaryWriter(log_dir=str(log_dir), purge_step=purge_step, flush_secs=30)


class WandbSinkError(UserError, RuntimeError):
    """`metrics.wandb.project` is set but the `wandb` package cannot be imported."""


def import_wandb(project: str) -> Any:
    """The `wandb` module, or a one-line error saying how to install it (checked before a run starts)."""
    try:
        import wandb
    except ImportError as error:
        raise WandbSinkError(
            f"metrics.wandb.project={project!r} needs the `wandb` package: pip install 'dflash-trainer[wandb]' "
            f"(or leave metrics.wandb.project empty); importing it failed: {error}"
        ) from error
    return wandb


def wandb_run_id(run_dir: Path) -> str:
    """The same id for every start of a run (a resume continues its W&B run), different for another run dir."""
    return "dflash-" + hashlib.sha256(str(run_dir.resolve()).encode("utf-8")).hexdigest()[:16]


class WandbSink:
    """Mirrors metrics records to a Weights & Biases run (module docstring): scalars as they are, per-slot lists as
    `<name>/slot_<k>` like TensorBoard."""

    def __init__(self, run_dir: Path, settings: WandbConfig, *, run_config: Mapping[str, object] | None) -> None:
        wandb = import_wandb(settings.project)
        self.run = wandb.init(
            project=settings.project,
            entity=settings.entity or None,
            name=settings.name or run_dir.name,
            mode=settings.mode,
            dir=str(run_dir),
            id=wandb_run_id(run_dir),
            resume="allow",
            config=dict(run_config or {}),
            # The metrics are logged explicitly; W&B's capture of stdout/stderr would only copy the console (and,
            # under a test runner's own capture, lost the records).
            settings=wandb.Settings(console="off"),
        )

    def log(self, step: int, record: Mapping[str, object]) -> None:
        values: dict[str, object] = {}
        for name, value in record.items():
            if name in RECORD_FIELDS:
                continue
            if isinstance(value, list):
                values.update({f"{name}/slot_{index + 1}": item for index, item in enumerate(value)})
            else:
                values[name] = value
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


def _json_value(name: str, value: object) -> int | float | list[int | float]:
    if hasattr(value, "tolist"):  # torch tensors, numpy arrays and numpy scalars
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return [_json_number(name, item) for item in value]
    return _json_number(name, value)


def _json_number(name: str, value: object) -> int | float:
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(f"metric {name!r}: expected a number or a flat list of numbers, got {type(value).__name__}")


def format_console_line(step: int, total_steps: int, values: Mapping[str, MetricValue]) -> str:
    """One compact line for a log step. Missing metrics are left out; names not listed in the module
    docstring are ignored (they still go to JSONL/TensorBoard)."""
    parts = [f"step {step}/{total_steps}"]
    if "epoch" in values:
        parts.append(f"ep {_scalar(values['epoch']):.2f}")
    if "loss" in values:
        parts.append(f"loss {_scalar(values['loss']):.4f}")
    acc_part = _format_accuracy(values)
    if acc_part:
        parts.append(acc_part)
    if "tau" in values:
        parts.append(f"tau {_scalar(values['tau']):.2f}")
    if "lr" in values:
        parts.append(f"lr {_scalar(values['lr']):.2e}")
    if "grad_norm" in values:
        parts.append(f"gnorm {_scalar(values['grad_norm']):.3f}")
    if "tokens_per_s" in values:
        parts.append(f"{_si(_scalar(values['tokens_per_s']))} tok/s")
    if "mfu" in values:
        parts.append(f"mfu {100 * _scalar(values['mfu']):.1f}%")
    if "step_time_s" in values:
        parts.append(f"{_scalar(values['step_time_s']):.3f} s/step")
    if "peak_mem_gib" in values:
        parts.append(f"mem {_scalar(values['peak_mem_gib']):.1f}GiB")
    if "inflight" in values:
        parts.append(f"inflight {_scalar(values['inflight']):g}")
    waits = [
        f"{name[len('wait_') : -len('_s')]} {1000 * _scalar(value):.1f}ms"
        for name, value in values.items()
        if name.startswith("wait_") and name.endswith("_s") and len(name) > len("wait__s")
    ]
    if waits:
        parts.append("wait " + " ".join(waits))
    evals = [f"{label} {_scalar(values[name]):.{digits}f}" for name, label, digits in _EVAL_FIELDS if name in values]
    if evals:
        parts.append("eval " + " ".join(evals))
    if "eta_s" in values:
        parts.append(f"eta {format_duration(_scalar(values['eta_s']))}")
    return " | ".join(parts)


# Metrics that are a count over a count (accuracies, recall): in [0, 1] whenever their device counters are right.
FRACTIONS = ("acc", "acc_per_slot", "selector_acc", "selector_recall")


def fractions_out_of_range(values: Mapping[str, MetricValue]) -> dict[str, float]:
    """The fractions among `values` (`FRACTIONS`, each slot of a per-slot list as `name[slot]`) outside [0, 1].

    Never the case when the counters are right, whatever the training does, so a sign of a wrong reduction: DFlash2's
    selector accuracy read 25.3 and its recall -2.3 on a GPU, from a compiler fusion of its per-slot count sums
    (compiling.py), while the loss stayed right. A NaN counts as out of range."""
    found = {}
    for name in FRACTIONS:
        value = values.get(name)
        if value is None:
            continue
        named = (
            [(f"{name}[{slot}]", v) for slot, v in enumerate(value, start=1)]
            if isinstance(value, Sequence)
            else [(name, value)]
        )
        for key, number in named:
            if not -1e-9 <= float(number) <= 1.0 + 1e-9:  # False for NaN too; the margin is float rounding
                found[key] = float(number)
    return found


_EVAL_FIELDS = (("eval_tau", "tau", 2), ("eval_tau_argmax", "tau_argmax", 2), ("eval_loss", "loss", 4))


def _format_accuracy(values: Mapping[str, MetricValue]) -> str:
    per_slot = values.get("acc_per_slot")
    slots = list(per_slot) if isinstance(per_slot, Sequence) and len(per_slot) > 0 else []
    if "acc" in values:
        mean = _scalar(values["acc"])
    elif slots:
        mean = sum(slots) / len(slots)
    else:
        return ""
    text = f"acc {mean:.3f}"
    if slots:
        text += f" (k1 {slots[0]:.3f} k{len(slots)} {slots[-1]:.3f})"
    return text


def _scalar(value: MetricValue) -> float:
    if isinstance(value, Sequence):
        raise TypeError(f"expected a scalar metric, got a list of {len(value)}")
    return float(value)


def _si(value: float) -> str:
    for threshold, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= threshold:
            return f"{value / threshold:.1f}{suffix}"
    return f"{value:.0f}"


def format_duration(seconds: float | None) -> str:
    """`1:02:03` for an hour or more, `2:03` below; `?` when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    minutes, secs = divmod(round(max(seconds, 0.0)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class Progress:
    """Progress bar over optimizer steps, with console lines that do not break it.

    The bar is drawn only when enabled and stderr is a terminal: in CI logs and redirected output a bar
    writes a new line per refresh and buries the metrics. Console lines (`write`) always go to stdout, so
    non-interactive logs stay readable; put `eta_seconds()` into the line there.
    """

    def __init__(self, total_steps: int, initial: int = 0, enabled: bool = True, desc: str = "train") -> None:
        self.total_steps = total_steps
        self.step = initial
        self._initial = initial
        # The rate is measured from construction, so the time spent before resuming does not skew the ETA.
        self._start = time.monotonic()
        self._bar: tqdm | None = None
        if enabled and sys.stderr.isatty():
            self._bar = tqdm(total=total_steps, initial=initial, desc=desc, dynamic_ncols=True, file=sys.stderr)

    @property
    def shows_bar(self) -> bool:
        return self._bar is not None

    def update(self, n: int = 1) -> None:
        self.step += n
        if self._bar is not None:
            self._bar.update(n)

    def set_postfix(self, values: Mapping[str, object]) -> None:
        if self._bar is not None:
            self._bar.set_postfix(ordered_dict=dict(values), refresh=False)

    def write(self, line: str) -> None:
        if self._bar is not None:
            tqdm.write(line, file=sys.stdout)
        else:
            print(line, file=sys.stdout, flush=True)

    def eta_seconds(self) -> float | None:
        """Seconds left at the average rate since construction; None before the first step."""
        done = self.step - self._initial
        if done <= 0:
            return None
        elapsed = time.monotonic() - self._start
        return elapsed / done * max(self.total_steps - self.step, 0)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class CompileWatch:
    """torch.compile's work since construction, read from dynamo's process-wide host counters (no device sync):
    frames compiled and seconds spent in dynamo's `_compile` (tracing, and the graphs Inductor builds for them;
    a backward graph compiled lazily at the first backward is not in the seconds, only in that step's time).

    `take()` returns (frames, seconds) since construction and the frames compiled since the previous `take`, so a
    training log can say when compilation happened: in the first steps it is the warm-up; later, a new shape or a
    guard that failed, i.e. a recompile (issue 10: none after warm-up)."""

    def __init__(self) -> None:
        self._start_frames, self._start_seconds = self._read()
        self._taken_frames = 0

    @staticmethod
    def _read() -> tuple[int, float]:
        from torch._dynamo.utils import compilation_time_metrics, counters

        return int(counters["frames"]["ok"]), float(sum(compilation_time_metrics.get("_compile.compile_inner", ())))

    def take(self) -> tuple[int, float, int]:
        frames, seconds = self._read()
        # Clamped: torch._dynamo.reset() (tests call it) clears the counters under a running watch.
        frames, seconds = max(0, frames - self._start_frames), max(0.0, seconds - self._start_seconds)
        new, self._taken_frames = max(0, frames - self._taken_frames), frames
        return frames, seconds, new


# Where a compile spends its seconds: dynamo's timers (`compilation_time_metrics`, process-wide) named by what
# they time. They nest: the forward and backward compilers each contain their own lowering, kernel code generation,
# wait for the Triton compile workers and module load, and all of it is inside dynamo's `_compile` (CompileWatch).
COMPILE_STAGES = {
    "dynamo tracing": "bytecode_tracing",
    "AOT autograd trace": "aot_trace_joint_graph",
    "forward graphs": "compile_fx.<locals>.fw_compiler_base",
    "backward graphs": "compile_fx.<locals>.bw_compiler",
    "Inductor lowering": "GraphLowering.run",
    "kernel codegen": "Scheduler.codegen",
    "waiting for Triton compiles": "async_compile.wait",
    "loading compiled modules": "PyCodeCache.load_by_key_path",
}


def compile_times() -> dict[str, float]:
    """Every dynamo/Inductor timer so far: name -> seconds. A snapshot for `compile_stages_since`."""
    from torch._dynamo.utils import compilation_time_metrics

    return {name: float(sum(times)) for name, times in compilation_time_metrics.items()}


def compile_stages_since(before: dict[str, float], *, min_s: float = 0.05) -> dict[str, float]:
    """Seconds per COMPILE_STAGES entry since the snapshot `before`, plus any autotuning or benchmarking timer
    (named as dynamo names it), each left out under `min_s`. For a first step's compile: which stage to attack."""
    now = compile_times()

    def spent(name: str) -> float:
        return max(0.0, now.get(name, 0.0) - before.get(name, 0.0))

    stages = {label: spent(name) for label, name in COMPILE_STAGES.items()}
    stages.update({name: spent(name) for name in now if "autotun" in name.lower() or "benchmark" in name.lower()})
    return {label: round(seconds, 2) for label, seconds in stages.items() if seconds >= min_s}


def describe_compile_stages(stages: dict[str, float]) -> str:
    return ", ".join(f"{label} {seconds:.1f}s" for label, seconds in stages.items()) or "none"


def triton_cache_dir() -> Path:
    """Where Triton writes compiled kernels now: `TRITON_CACHE_DIR`, default ~/.triton/cache. Inductor points the
    variable at its own cache when it first runs a kernel, so read this after warm-up and keep it."""
    return Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


def triton_cache_entries(cache: Path) -> int | None:
    """Entries of Triton's on-disk kernel cache `cache` (triton_cache_dir), None when it does not exist. The count
    grows when a Triton kernel is compiled for the first time on this machine, Inductor's or a JIT compile outside
    dynamo (flash-linear-attention's kernels, specialised per new argument pattern) that CompileWatch does not
    see. Reads one directory listing: call it between timed steps, not inside one."""
    try:
        return sum(1 for _ in os.scandir(cache))
    except OSError:  # no cache yet, or not readable
        return None


def allocator_retries(device: torch.device | str) -> int | None:
    """cudaMalloc retries of the CUDA caching allocator so far (None off CUDA). A retry means an allocation did not
    fit, so the allocator freed its cache and tried again: a synchronising slow path, the sign of a step near the
    memory limit. Reads host counters: no device sync."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))


def peak_memory_gib(device: torch.device | str) -> float:
    """Peak memory of this process in GiB: CUDA max allocated on a GPU, peak RSS on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        # Reads the caching allocator's counters: no device sync.
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is in KiB on Linux and in bytes on macOS.
    peak_bytes = peak if sys.platform == "darwin" else peak * 1024
    return peak_bytes / 2**30


@dataclass(frozen=True)
class ThroughputWindow:
    steps: int
    tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def step_time_s(self) -> float:
        return self.seconds / self.steps if self.steps > 0 else math.nan


class Throughput:
    """Counts optimizer steps and tokens between log steps; `take()` closes the window and starts the next."""

    def __init__(self) -> None:
        self._window_start = time.perf_counter()
        self._steps = 0
        self._tokens = 0

    def record_step(self, tokens: int) -> None:
        # A device tensor here would hide a sync in the hot loop; counts come from the host-side batch plan.
        if not isinstance(tokens, numbers.Integral):
            raise TypeError(f"tokens must be a host integer, got {type(tokens).__name__}")
        self._steps += 1
        self._tokens += int(tokens)

    def take(self) -> ThroughputWindow:
        now = time.perf_counter()
        window = ThroughputWindow(steps=self._steps, tokens=self._tokens, seconds=now - self._window_start)
        self._window_start = now
        self._steps = 0
        self._tokens = 0
        return window


def dflash_flops_per_token(
    *,
    target_params_used: int,
    drafter_params: int,
    blocks_per_token: float,
    block_size: int,
    hidden: int,
    vocab: int,
    attention_flops_per_token: float = 0.0,
) -> float:
    """Training FLOPs per target token (DESIGN §5).

    2*P_target: forward of the target up to the deepest layer used. Per block slot: 6*P_drafter (forward and
    backward) and 4*H*V for the frozen LM head (forward, plus backward to its input only). The drafter's
    context projection runs per target token rather than per block slot, so counting it in P_drafter slightly
    overstates the work when blocks_per_token*block_size > 1; attention is an optional extra term.
    """
    per_block_slot = 6 * drafter_params + 4 * hidden * vocab
    return 2 * target_params_used + blocks_per_token * block_size * per_block_slot + attention_flops_per_token


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved FLOP/s over peak. Use the summed peak of the devices that produced
    `tokens_per_s` (e.g. 8 x per-GPU peak for a job-wide token rate on 8 GPUs)."""
    if peak_flops <= 0:
        raise ValueError(f"peak_flops must be > 0, got {peak_flops}")
    return tokens_per_s * flops_per_token / peak_flops


def measured_peak_flops(device: torch.device | str) -> float | None:
    """bf16 peak FLOP/s of one device when we have measured its model (DESIGN §5), else None (MFU unknown)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for model, peak in MEASURED_PEAK_BF16_FLOPS.items():
        if model in name:
            return peak
    return None
