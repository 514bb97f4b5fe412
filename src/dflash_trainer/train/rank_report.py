"""One stage-profile report for all ranks: per-stage averages and maxima merged on the main rank, with the
bottleneck role named.

Every log step, each rank of the trainer's group hands its stage summary since the last log step to the main
rank (one small gather; log steps already sync) and resets its profiler; target ranks of the disaggregated
placement send theirs in the batch headers, and the drafter that received them adds them. The main rank merges
the summaries and prints one table per `interval_s`. The last line names the bottleneck:
- disaggregated (`pipeline_verdict`): each role's idle fraction is the share of its time spent blocked on the
  other. A target blocked on a full in-flight window (`send_wait`) waits for drafters; a drafter waiting for the
  next batch (`recv_wait`) waits for targets. The role the other waits for more is the bottleneck:
  `target-bound` when drafters idle more than targets, `drafter-bound` otherwise, `balanced` when neither idles
  more than `BALANCED_IDLE`. The line adds the in-flight depth (how full the targets' windows were after a
  send, against `queue_depth`) and how many batches drafters held received ahead: a drafter-bound pipeline runs
  with full windows and full receive queues, a target-bound one with about one batch in flight and none ahead;
- colocated: each rank runs both roles one after the other, so the line compares the time spent in the target
  forward with the time spent in drafter stages.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch.distributed as dist

from .profiler import StageProfiler, StageStats, StageSummary, covered_seconds, format_report

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
    covered_s = covered_seconds(summary, interval_s)
    return sum(summary[s].sum_s for s in stages if s in summary) / covered_s if covered_s > 0 else 0.0


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


# Below this idle fraction on both sides, neither role holds the other up.
BALANCED_IDLE = 0.05


@dataclass
class PipelineDepth:
    """Counters of the disaggregated pipeline over an interval, summed over ranks."""

    queue_depth: int
    # Target sends, and the sum over them of the messages outstanding to that drafter right after posting.
    sends: int = 0
    inflight_sum: int = 0
    # Drafter takes, and the sum over them of the messages the drafter had received ahead at that moment.
    takes: int = 0
    ahead_sum: int = 0

    def add(self, other: PipelineDepth) -> None:
        self.sends += other.sends
        self.inflight_sum += other.inflight_sum
        self.takes += other.takes
        self.ahead_sum += other.ahead_sum

    @property
    def inflight(self) -> float:
        return self.inflight_sum / self.sends if self.sends else 0.0

    @property
    def ahead(self) -> float:
        return self.ahead_sum / self.takes if self.takes else 0.0


def pipeline_verdict(*, target_idle: float, drafter_idle: float) -> str:
    """`target-bound`, `drafter-bound` or `balanced` from each role's idle fraction (see the module docstring)."""
    if max(target_idle, drafter_idle) < BALANCED_IDLE:
        return "balanced"
    return "target-bound" if drafter_idle > target_idle else "drafter-bound"


_ADVICE = {
    "target-bound": "more target ranks (or fewer drafter ranks) would raise throughput",
    "drafter-bound": "more drafter ranks (or fewer target ranks) would raise throughput",
    "balanced": "the split fits this workload",
}


def pipeline_line(*, target_idle: float, drafter_idle: float, depth: PipelineDepth | None = None) -> str:
    verdict = pipeline_verdict(target_idle=target_idle, drafter_idle=drafter_idle)
    text = (
        f"bottleneck: {verdict} (idle: target ranks {target_idle:.0%} blocked on a full window, waiting for "
        f"drafters; drafter ranks {drafter_idle:.0%} waiting for features"
    )
    if depth is not None and depth.sends:
        text += (
            f"; in flight after a send {depth.inflight:.1f} of queue_depth {depth.queue_depth}, "
            f"received ahead {depth.ahead:.1f}"
        )
    return f"{text}): {_ADVICE[verdict]}"


def bottleneck_line(
    merged: Mapping[str, StageSummary], *, interval_s: float, depth: PipelineDepth | None = None
) -> str:
    drafter_idle = [_share(s, (RECEIVE_WAIT_STAGE,), interval_s) for r, s in merged.items() if r.startswith("drafter")]
    target_idle = [_share(s, (SEND_WAIT_STAGE,), interval_s) for r, s in merged.items() if r.startswith("target")]
    if drafter_idle and target_idle:
        return pipeline_line(target_idle=_mean(target_idle), drafter_idle=_mean(drafter_idle), depth=depth)
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
        self._depth: PipelineDepth | None = None
        self._started = time.perf_counter()

    def add_pipeline_depth(self, depth: PipelineDepth) -> None:
        """Main rank of a disaggregated run: in-flight counters of a log window, for the next report's verdict."""
        if self._depth is None:
            self._depth = PipelineDepth(queue_depth=depth.queue_depth)
        self._depth.add(depth)

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
            + bottleneck_line(ordered, interval_s=interval_s, depth=self._depth)
        )
        self.sink(report)
        self._merged = {}
        self._depth = None
        self._started = time.perf_counter()
        return report


def _rank_order(label: str) -> tuple[int, str]:
    digits = "".join(ch for ch in label if ch.isdigit())
    return (int(digits) if digits else -1, label)
