"""Per-stage wall-time profiler (avg/max per stage every N seconds) and an optional torch.profiler window.

The old system was optimised by guessing until a profiler like this measured each stage (DESIGN §3). Use:

    profiler = StageProfiler.from_env(config.metrics.profile_interval, device=device)
    with profiler.stage("target_forward"):
        features = capture(...)
    profiler.maybe_report(step)

Intrusive by design: when enabled on CUDA, each stage ends by waiting for the current stream (the stream the
stage queued its work on), so that the GPU work a stage queued is billed to that stage rather than to whichever
later stage happens to wait for it. That sync removes the CPU/GPU overlap the trainer normally has, so steps are
slower while profiling; the shares are still the right guide to what dominates. GPU work queued outside any
stage is billed to the next stage. Only the current stream is waited for, never the whole device: work on other
streams that the compute stream does not depend on, such as a point-to-point send on NCCL's stream that waits
for its receiver, is not billed to the stage that posted it (a device-wide sync would turn every posted send
into a blocking one and keep a profiled target from running ahead of its drafters). Communication the compute
stream does wait for (a DDP all-reduce at the end of backward, a received payload) is billed as usual. When disabled
(`interval_s <= 0`) it costs nothing: `stage()` returns one shared no-op context manager and reads no clock.

With `annotate=True` each stage is also a `torch.profiler.record_function` range (`stage:NAME`), closed after the
stage's sync, so that `kernel_profile.py` can bill the kernels of a torch.profiler trace to the stages (bench
`--kernels`); off, it records nothing.

Stage names used by the trainer: data, target_forward, feature_pack, mask_build, drafter_forward, loss,
backward, optimizer, checkpoint, eval; with the disaggregated placement also recv_wait (drafters), send_wait
and send (targets). Stages do not nest.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NamedTuple

import torch

PROFILE_INTERVAL_ENV = "DFLASH_PROFILE_INTERVAL"
UNTRACKED_STAGE = "(untracked)"
# A summary that reaches the report from another rank at other moments than the report's own interval (a target
# rank's, sent in batch headers) carries the time it covers under this name; that rank's shares are taken
# against it instead of the report's interval.
COVERED_STAGE = "(covered)"
# The prefix of a stage's `record_function` range when the profiler annotates (`StageProfiler(annotate=True)`).
STAGE_ANNOTATION = "stage:"


class StageStats(NamedTuple):
    count: int
    sum_s: float
    max_s: float


# One summary per rank or role, e.g. {"rank0": {...}} or {"target": {...}, "drafter": {...}}.
StageSummary = dict[str, StageStats]


class StageMemory(NamedTuple):
    """Device memory of one stage over its entries, in bytes: the most allocated on entering it (what earlier
    stages left alive), and the peak while it ran (entry plus what the stage itself allocated at most)."""

    entry_bytes: int
    peak_bytes: int


class _StageTimer:
    """Accumulates the timings of one stage (and, when the profiler tracks memory, its memory); it is its own
    context manager, reused for every entry."""

    __slots__ = (
        "_annotation",
        "_name",
        "_profiler",
        "_started",
        "count",
        "entry_bytes",
        "max_s",
        "peak_bytes",
        "sum_s",
    )

    def __init__(self, profiler: StageProfiler, name: str) -> None:
        self._profiler = profiler
        self._name = name
        self._annotation: torch.profiler.record_function | None = None
        self._started = 0.0
        self.count = 0
        self.sum_s = 0.0
        self.max_s = 0.0
        self.entry_bytes = 0
        self.peak_bytes = 0

    def __enter__(self) -> None:
        memory_device = self._profiler.memory_device
        if memory_device is not None:
            # The caching allocator's own counters, kept on the host: reading and resetting them waits for nothing.
            self.entry_bytes = max(self.entry_bytes, torch.cuda.memory_allocated(memory_device))
            torch.cuda.reset_peak_memory_stats(memory_device)
        if self._profiler.annotate:
            self._annotation = torch.profiler.record_function(STAGE_ANNOTATION + self._name)
            self._annotation.__enter__()
        self._started = time.perf_counter()

    def __exit__(self, *exc_info: object) -> None:
        try:
            if self._profiler.sync_device is not None:
                # The profiler's one sync (see the module docstring): wait for this stage's GPU work, on its stream.
                torch.cuda.current_stream(self._profiler.sync_device).synchronize()
        finally:
            if self._annotation is not None:
                # Closed after the sync (the range spans the stage's kernels too, `kernel_profile.stage_busy`), and
                # closed even when the sync raises (where an asynchronous CUDA error surfaces).
                self._annotation.__exit__(None, None, None)
                self._annotation = None
        elapsed = time.perf_counter() - self._started
        self.count += 1
        self.sum_s += elapsed
        self.max_s = max(self.max_s, elapsed)
        if self._profiler.memory_device is not None:
            self.peak_bytes = max(self.peak_bytes, torch.cuda.max_memory_allocated(self._profiler.memory_device))


_NULL_STAGE = contextlib.nullcontext()


class StageProfiler:
    """Wall time per named stage, reported every `interval_s` seconds through `sink`."""

    def __init__(
        self,
        interval_s: float,
        device: torch.device | str,
        sink: Callable[[str], object] = print,
        sync: bool = True,
        label: str = "local",
        track_memory: bool = False,
        annotate: bool = False,
    ) -> None:
        self.interval_s = float(interval_s)
        self.enabled = self.interval_s > 0
        device = torch.device(device)
        self.sync_device = device if (self.enabled and sync and device.type == "cuda") else None
        # `track_memory` (CUDA, synchronised stages): each stage's entry and peak allocation (`memory()`). It resets
        # the allocator's peak counter at every stage, so a caller reading the run's peak must read it before.
        self.memory_device = self.sync_device if track_memory else None
        # `annotate`: each stage is also a `torch.profiler.record_function` range named STAGE_ANNOTATION + stage, so a
        # torch.profiler trace shows the stages and `kernel_profile` can bill kernels to them (bench --kernels).
        self.annotate = annotate and self.enabled
        if self.annotate and not sync:
            # Unsynchronised stages end before their kernels: the kernels would be billed to later stages.
            raise ValueError("StageProfiler: annotate=True needs sync=True")
        self.label = label
        self._sink = sink
        self._timers: dict[str, _StageTimer] = {}
        self._interval_start = time.perf_counter() if self.enabled else 0.0

    @classmethod
    def from_env(
        cls,
        default_interval: float,
        device: torch.device | str,
        sink: Callable[[str], object] = print,
        sync: bool = True,
        label: str = "local",
    ) -> StageProfiler:
        """`DFLASH_PROFILE_INTERVAL` (seconds), when set, overrides `default_interval` (0 switches it off)."""
        raw = os.environ.get(PROFILE_INTERVAL_ENV, "").strip()
        interval = default_interval
        if raw:
            try:
                interval = float(raw)
            except ValueError as error:
                raise ValueError(f"{PROFILE_INTERVAL_ENV}={raw!r}: expected a number of seconds") from error
        return cls(interval, device=device, sink=sink, sync=sync, label=label)

    def stage(self, name: str) -> contextlib.AbstractContextManager[None]:
        if not self.enabled:
            return _NULL_STAGE
        timer = self._timers.get(name)
        if timer is None:
            timer = self._timers[name] = _StageTimer(self, name)
        return timer

    def summary(self, *, covered: bool = False) -> StageSummary:
        """Stages entered since the last reset: (count, total seconds, max seconds); `covered`: with the time
        since the last reset as `COVERED_STAGE`."""
        stages = {
            name: StageStats(timer.count, timer.sum_s, timer.max_s)
            for name, timer in self._timers.items()
            if timer.count > 0
        }
        if covered:
            elapsed = self.seconds_since_reset()
            stages[COVERED_STAGE] = StageStats(1, elapsed, elapsed)
        return stages

    def memory(self) -> dict[str, StageMemory]:
        """Per stage entered with memory tracking on: the largest entry allocation and peak seen."""
        return {
            name: StageMemory(timer.entry_bytes, timer.peak_bytes)
            for name, timer in self._timers.items()
            if timer.count > 0 and self.memory_device is not None
        }

    def seconds_since_reset(self) -> float:
        return time.perf_counter() - self._interval_start

    def report_due(self) -> bool:
        return self.enabled and self.seconds_since_reset() >= self.interval_s

    def reset(self) -> None:
        for timer in self._timers.values():
            timer.count = 0
            timer.sum_s = 0.0
            timer.max_s = 0.0
        self._interval_start = time.perf_counter()

    def maybe_report(self, step: int) -> dict | None:
        """Every `interval_s`: emit this rank's table, start a new interval and return
        `{"step", "interval_s", "stages": StageSummary}`; otherwise None.

        The interval elapses at different steps on different ranks, so a trainer gathering reports across ranks
        must agree on the step first (e.g. rank 0's `report_due()` broadcast on a log step), then call
        `summary()`/`reset()` on every rank and print `format_report` of the merged summaries.
        """
        if not self.report_due():
            return None
        report = {"step": step, "interval_s": self.seconds_since_reset(), "stages": self.summary()}
        self._sink(format_report({self.label: report["stages"]}, interval_s=report["interval_s"], step=step))
        self.reset()
        return report


def covered_seconds(summary: StageSummary, interval_s: float) -> float:
    """The time `summary` covers: its `COVERED_STAGE` when it has one, else the report's interval."""
    covered = summary.get(COVERED_STAGE)
    return covered.sum_s if covered is not None else interval_s


def format_report(merged: Mapping[str, StageSummary], *, interval_s: float, step: int | None = None) -> str:
    """One table for one or more ranks/roles: per stage count, avg ms, max ms and share of the time covered
    (the interval, or the rank's `COVERED_STAGE`), with the untracked remainder, and a last line naming the
    stage with the largest share."""
    heading = f"stage profile over {interval_s:.1f}s" + (f" at step {step}" if step is not None else "")
    lines = [heading, f"{'rank':<10} {'stage':<16} {'count':>7} {'avg ms':>9} {'max ms':>9} {'share':>7}"]
    largest: tuple[float, str, str] | None = None
    for role, summary in merged.items():
        covered_s = covered_seconds(summary, interval_s)
        tracked_s = 0.0
        stages = [(stage, stats) for stage, stats in summary.items() if stage != COVERED_STAGE]
        for stage, stats in sorted(stages, key=lambda item: -item[1].sum_s):
            share = stats.sum_s / covered_s if covered_s > 0 else 0.0
            avg_ms = 1000 * stats.sum_s / stats.count if stats.count else 0.0
            lines.append(
                f"{role:<10} {stage:<16} {stats.count:>7} {avg_ms:>9.2f} {1000 * stats.max_s:>9.2f} {share:>7.1%}"
            )
            tracked_s += stats.sum_s
            if largest is None or share > largest[0]:
                largest = (share, role, stage)
        untracked_share = max(covered_s - tracked_s, 0.0) / covered_s if covered_s > 0 else 0.0
        lines.append(f"{role:<10} {UNTRACKED_STAGE:<16} {'':>7} {'':>9} {'':>9} {untracked_share:>7.1%}")
    if largest is not None:
        share, role, stage = largest
        lines.append(f"largest share: {stage} on {role} ({share:.1%})")
    return "\n".join(lines)


def torch_profiler_window(
    run_dir: str | Path, *, start_step: int, num_steps: int, current_step: int = 0, rank: int = 0
) -> torch.profiler.profile:
    """A torch.profiler that records `num_steps` optimizer steps from `start_step` and writes a chrome trace
    to `run_dir/trace/rank{rank}_steps{start}-{end}.json` (open in Perfetto or chrome://tracing).

    Enter it around the loop and call its `.step()` after every optimizer step. `current_step` is the number of
    the first step the loop runs (non-zero after a resume), so `start_step` stays an absolute step number; a
    `start_step` already behind starts the window at once.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    trace_dir = Path(run_dir) / "trace"
    steps_before = max(start_step - current_step, 0)
    # One warmup step when there is room for it: the first profiled step carries the profiler's own setup cost.
    warmup = 1 if steps_before >= 1 else 0
    schedule = torch.profiler.schedule(wait=steps_before - warmup, warmup=warmup, active=num_steps, repeat=1)
    first_step = current_step + steps_before
    trace_path = trace_dir / f"rank{rank}_steps{first_step}-{first_step + num_steps - 1}.json"

    def write_trace(profile: torch.profiler.profile) -> None:
        trace_dir.mkdir(parents=True, exist_ok=True)
        profile.export_chrome_trace(str(trace_path))

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=write_trace)
