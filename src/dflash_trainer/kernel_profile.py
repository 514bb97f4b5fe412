"""Where a few training steps spend their time, kernel by kernel: `torch.profiler` over `steps` calls.

Contract: `profile_kernels(run, steps=S, device=D, top=N)` calls `run()` S times under the profiler (after the
caller's warm-up: nothing here compiles or warms up) and returns a `KernelProfile`:
- on CUDA, the device kernels (events whose device type is CUDA: GEMMs, Triton kernels, flex attention, copies)
  ranked by their own device time, with `busy_ms_per_step` the sum over every kernel. Only kernel events are
  counted: never the CPU ops that launched them, nor the spans the profiler draws on the device timeline for
  `record_function` scopes (`Optimizer.step#AdamW.step`, compiled regions; `is_user_annotation`), whose device time
  is the same kernels' time seen again. Kernels on different streams that overlap count twice (a sum, not the union
  of their intervals), so with overlapping copies the busy time is an upper bound;
- on CPU, the aten ops ranked by their own CPU time (the CPU is the device there; `record_function` scopes are left
  out there too).

`busy_ms_per_step` against the step's wall time is the first thing to read: a step of 227 ms whose kernels are
busy for 120 ms is host- or launch-bound for the rest, and no faster kernel fixes that. Per entry: calls and
milliseconds per step, and the share of the busy time. `trace_path` also writes the Chrome trace (open it in
Perfetto) for the timeline the table cannot show.

Per stage (`stages`), when `run` enters the trainer's stages under an annotating, synchronising `StageProfiler`
(`annotate=True`: each stage a `record_function` range that closes after the stage's sync): the range's wall time
and the device time of the kernels that start inside it (CPU: the own time of the ops that start inside it). A
kernel starts after the launch that queued it, and a synchronised stage ends only when its kernels have, so each
kernel falls in the range of the stage that launched it; stages do not nest. (A few small kernels launched between
stages, such as the metrics' accumulations, start in the next stage's range and are billed to it.) A stage whose
kernels fill a small part of its wall time is bound by the host (launches, Python, guards), which is what the step
table alone cannot say.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from .train.profiler import STAGE_ANNOTATION

# Kernel names of GEMMs and Triton kernels run to hundreds of characters; the start identifies them.
NAME_CHARS = 96


@dataclass
class KernelTime:
    name: str
    calls_per_step: float
    ms_per_step: float
    share: float  # of busy_ms_per_step


@dataclass
class StageBusy:
    name: str
    wall_ms_per_step: float  # the synchronised stage's wall time
    busy_ms_per_step: float  # its kernels' device time (CPU: its ops' own time)


@dataclass
class KernelProfile:
    device: str
    steps: int
    busy_ms_per_step: float
    kernels: list[KernelTime] = field(default_factory=list)
    stages: list[StageBusy] = field(default_factory=list)  # empty unless the steps ran annotated stages


def profile_kernels(
    run: Callable[[], None],
    *,
    steps: int,
    device: torch.device,
    top: int,
    trace_path: Path | None = None,
) -> KernelProfile:
    if steps < 1 or top < 1:
        raise ValueError(f"profile_kernels: steps and top must be >= 1, got {steps} and {top}")
    on_cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if on_cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        for _ in range(steps):
            run()
        if on_cuda:
            torch.cuda.synchronize(device)
    if trace_path is not None:
        trace_path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace_path))
    if on_cuda:
        # Microseconds of each kernel's own device time.
        timed = [(e, e.self_device_time_total) for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
    else:
        timed = [(e, e.self_cpu_time_total) for e in prof.key_averages()]
    timed = [(event, us) for event, us in timed if us > 0 and not event.is_user_annotation]
    busy_us = sum(us for _, us in timed)
    timed.sort(key=lambda pair: -pair[1])
    kernels = [
        KernelTime(
            name=event.key[:NAME_CHARS],
            calls_per_step=event.count / steps,
            ms_per_step=us / 1e3 / steps,
            share=us / busy_us,
        )
        for event, us in timed[:top]
    ]
    return KernelProfile(
        device=device.type,
        steps=steps,
        busy_ms_per_step=busy_us / 1e3 / steps,
        kernels=kernels,
        stages=stage_busy(prof.events(), steps=steps, on_cuda=on_cuda),
    )


def stage_busy(events: list, *, steps: int, on_cuda: bool) -> list[StageBusy]:
    """Wall and busy milliseconds per step of every annotated stage (module docstring), longest first."""
    ranges = sorted(
        (event.time_range.start, event.time_range.end, event.name[len(STAGE_ANNOTATION) :])
        for event in events
        if event.device_type == DeviceType.CPU and event.name.startswith(STAGE_ANNOTATION)
    )
    wall_us: dict[str, float] = {}
    busy_us: dict[str, float] = {}
    for start, end, name in ranges:
        wall_us[name] = wall_us.get(name, 0.0) + (end - start)
        busy_us.setdefault(name, 0.0)
    starts = [start for start, _, _ in ranges]
    kind = DeviceType.CUDA if on_cuda else DeviceType.CPU
    for event in events:
        if event.device_type != kind or event.is_user_annotation or event.name.startswith(STAGE_ANNOTATION):
            continue
        begin = event.time_range.start
        index = bisect.bisect_right(starts, begin) - 1  # the last stage that began before this work
        if index < 0 or begin > ranges[index][1]:
            continue  # outside every stage
        name = ranges[index][2]
        busy_us[name] += event.time_range.elapsed_us() if on_cuda else event.self_cpu_time_total
    return sorted(
        (StageBusy(name, wall_us[name] / 1e3 / steps, busy_us[name] / 1e3 / steps) for name in wall_us),
        key=lambda stage: -stage.wall_ms_per_step,
    )


def format_profile(result: KernelProfile, step_ms: float) -> list[str]:
    """Lines of a table: the busy time against the step time, then one line per kernel."""
    idle = max(0.0, 1.0 - result.busy_ms_per_step / step_ms) if step_ms > 0 else float("nan")
    what = "kernels" if result.device == "cuda" else "CPU ops"
    lines = [
        f"{what} busy {result.busy_ms_per_step:.1f} ms per step of {step_ms:.1f} ms (device idle {100 * idle:.0f} %), "
        f"over {result.steps} profiled steps; top {len(result.kernels)}:"
    ]
    lines += [
        f"  {k.ms_per_step:8.2f} ms {100 * k.share:5.1f} % {k.calls_per_step:7.1f} calls  {k.name}"
        for k in result.kernels
    ]
    if result.stages:
        lines.append(f"per stage (synchronised; wall, then the {what} inside it):")
        lines += [
            f"  {stage.name:<16} {stage.wall_ms_per_step:8.2f} ms wall, {what} {stage.busy_ms_per_step:8.2f} ms "
            f"({_idle_percent(stage.busy_ms_per_step, stage.wall_ms_per_step)} idle)"
            for stage in result.stages
        ]
    return lines


def _idle_percent(busy_ms: float, wall_ms: float) -> str:
    return f"{100 * max(0.0, 1.0 - busy_ms / wall_ms):.0f} %" if wall_ms > 0 else "n/a"
