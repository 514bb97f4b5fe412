"""One stage-profile report for all ranks: per-stage averages and maxima merged on the main rank, with the
bottleneck role named.

Every log step, each rank of the trainer's group hands its stage summary since the last log step to the main
rank (one small gather; log steps already sync) and resets its profiler; target ranks of the disaggregated
placement send theirs in the batch headers, and the drafter that received them adds them. The main rank merges
the summaries and prints one table per `interval_s`. The last line names the bottleneck:
- disaggregated: `target-bound` when drafter ranks idle (waiting to receive features) a larger fraction of the
  interval than target ranks idle (waiting for room in the in-flight window), else `drafter-bound`;
- colocated: each rank runs both roles one after the other, so the line compares the time spent in the target
  forward with the time spent in drafter stages.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import torch.distributed as dist

from .profiler import StageProfiler, StageStats, StageSummary, format_report

TARGET_STAGES = ("data", "target_forward")
DRAFTER_STAGES = ("feature_pack", "mask_build", "drafter_forward", "loss", "backward", "optimizer")
# Stages that are idle time: a drafter waiting for features, a target waiting for window room.
RECEIVE_WAIT_STAGE = "recv_wait"
SEND_WAIT_STAGE = "send_wait"


def merge_summaries(into: StageSummary, other: Mapping[str, StageStats | list | tuple]) -> StageSummary:
    """Sum counts and seconds, keep the larger maximum (`other` may come from JSON as lists)."""
    for stage, stats in other.items():
        count, sum_s, max_s = stats
        old = into.get(stage, StageStats(0, 0.0, 0.0))
        into[stage] = StageStats(old.count + int(count), old.sum_s + float(sum_s), max(old.max_s, float(max_s)))
    return into


def _share(summary: StageSummary, stages: tuple[str, ...], interval_s: float) -> float:
    return sum(summary[s].sum_s for s in stages if s in summary) / interval_s if interval_s > 0 else 0.0


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def bottleneck_line(merged: Mapping[str, StageSummary], *, interval_s: float) -> str:
    drafter_idle = [_share(s, (RECEIVE_WAIT_STAGE,), interval_s) for r, s in merged.items() if r.startswith("drafter")]
    target_idle = [_share(s, (SEND_WAIT_STAGE,), interval_s) for r, s in merged.items() if r.startswith("target")]
    if drafter_idle and target_idle:
        drafters, targets = _mean(drafter_idle), _mean(target_idle)
        role = "target-bound" if drafters > targets else "drafter-bound"
        return (
            f"bottleneck: {role} (idle fraction: drafter ranks {drafters:.0%} waiting for features, "
            f"target ranks {targets:.0%} waiting for window room)"
        )
    target = _mean([_share(s, TARGET_STAGES, interval_s) for s in merged.values()])
    drafter = _mean([_share(s, DRAFTER_STAGES, interval_s) for s in merged.values()])
    role = "target-bound" if target > drafter else "drafter-bound"
    return f"bottleneck: {role} (colocated: target stages {target:.0%} of the time, drafter stages {drafter:.0%})"


class RankProfileReport:
    def __init__(
        self,
        profiler: StageProfiler,
        *,
        label: str,
        group: dist.ProcessGroup | None,
        distributed: bool,
        is_main: bool,
        sink: Callable[[str], object],
    ) -> None:
        self.profiler = profiler
        self.label = label
        self.group = group
        self.distributed = distributed
        self.is_main = is_main
        self.sink = sink
        self._merged: dict[str, StageSummary] = {}
        self._started = time.perf_counter()

    def on_log_step(
        self, step: int, received: Mapping[str, StageSummary] | None = None, *, last: bool = False
    ) -> str | None:
        """Collect this rank's summary (and `received` ones of other ranks); on the main rank, return and print
        the merged report when the interval has elapsed, or at the `last` log step of the run."""
        if not self.profiler.enabled:
            return None
        local = {self.label: self.profiler.summary(), **(received or {})}
        self.profiler.reset()
        gathered: list[dict[str, StageSummary] | None] = [local]
        if self.distributed:
            gathered = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(gathered, local, group=self.group)
        if not self.is_main:
            return None
        for summaries in gathered:
            for rank_label, summary in (summaries or {}).items():
                merge_summaries(self._merged.setdefault(rank_label, {}), summary)
        interval_s = time.perf_counter() - self._started
        if interval_s < self.profiler.interval_s and not (last and self._merged):
            return None
        ordered = dict(sorted(self._merged.items(), key=lambda item: _rank_order(item[0])))
        report = (
            format_report(ordered, interval_s=interval_s, step=step)
            + "\n"
            + bottleneck_line(ordered, interval_s=interval_s)
        )
        self.sink(report)
        self._merged = {}
        self._started = time.perf_counter()
        return report


def _rank_order(label: str) -> tuple[int, str]:
    digits = "".join(ch for ch in label if ch.isdigit())
    return (int(digits) if digits else -1, label)
