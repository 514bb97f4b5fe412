"""Which batches make an optimizer step, for every placement, and where a run stands in its data.

The sampler deals an epoch's global batch list (see data/sampler.py). One optimizer step consumes
`batches_per_step` consecutive global batches (M, fewer at an epoch's end):
- one process: M = optim.grad_accum;
- colocated, W ranks: M = W * grad_accum; rank r takes global batches r, r+W, ... of the step's block (the
  sampler pads an epoch to a multiple of W with its first batches, so the last step of an epoch can repeat a few);
- disaggregated, D drafter ranks: M = D * grad_accum, split by `drafter_slot` below, each batch computed on the
  target rank `target_slot` names (no padding: the last step of an epoch is short, as for one process).

`DataPosition` records the position in global terms (the epoch and how many of its global batches are consumed),
so a checkpoint can be resumed with another number of ranks or the other placement as long as M is unchanged:
then every later step consumes the same global batches, and the learning-rate schedule (which counts steps) is
the same. A different M would change both, so `check_resumable` refuses it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from ..data.sampler import BatchPlan, TokenBudgetSampler
from ..errors import UserError


def step_groups(sampler: TokenBudgetSampler, *, epochs: int, micro_batches_per_step: int) -> Iterator[list[BatchPlan]]:
    """The sampler's batches grouped per optimizer step, across epochs, from its (resumable) position. A group
    is yielded once all its batches are handed out, so a sampler state taken then counts the whole group."""
    for epoch in range(sampler.epoch, epochs):
        sampler.set_epoch(epoch)
        plans = iter(sampler)
        while group := list(itertools.islice(plans, micro_batches_per_step)):
            yield group


def count_steps(sampler: TokenBudgetSampler, *, epochs: int, micro_batches_per_step: int, max_steps: int | None) -> int:
    # Epochs are planned one by one (packing makes their sizes differ), and only until `max_steps` is reached:
    # `train.epochs=1000 train.max_steps=200` must not plan a thousand epochs.
    total = 0
    for epoch in range(epochs):
        total += math.ceil(sampler.batches_in_epoch(epoch) / micro_batches_per_step)
        if max_steps is not None and total >= max_steps:
            return max_steps
    return total


def drafter_slot(position: int, num_drafters: int) -> int:
    """Drafter (by slot) that trains micro-batch `position` of a step: round-robin, so each gets grad_accum."""
    return position % num_drafters


def target_slot(run_index: int, num_targets: int) -> int:
    """Target (by slot) that computes the global batch with run-wide index `run_index` (`RunIndex`):
    round-robin over all batches of the run, so targets stay balanced across short steps and epochs."""
    return run_index % num_targets


class RunIndex:
    """Run-wide number of a global batch: the global batches of all earlier epochs plus its index in its epoch.

    `sampler` must deal the global list (world size 1). Epoch sizes vary a little with packing; each earlier
    epoch is planned once (the sampler's planning cost) when a later one is first asked for."""

    def __init__(self, sampler: TokenBudgetSampler) -> None:
        if sampler.world_size != 1:
            raise ValueError("RunIndex needs the global batch list (a sampler with world_size 1)")
        self._sampler = sampler
        self._offsets = {0: 0}

    def __call__(self, epoch: int, index: int) -> int:
        last = max(self._offsets)
        while last < epoch:
            self._offsets[last + 1] = self._offsets[last] + self._sampler.batches_in_epoch(last)
            last += 1
        return self._offsets[epoch] + index


class ResumeError(UserError, ValueError):
    """A checkpoint cannot continue with this run's ranks and settings."""


@dataclass(frozen=True)
class DataPosition:
    epoch: int
    # Global batches of `epoch` already consumed (meaningless once `epoch_done`).
    consumed: int
    epoch_done: bool
    # Global micro-batches per optimizer step of the run that saved the position.
    batches_per_step: int
    # How that M was made, for messages: "2 ranks x grad_accum 2".
    layout: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DataPosition:
        return cls(**data)

    def check_resumable(self, *, batches_per_step: int, layout: str, source: str) -> None:
        if batches_per_step != self.batches_per_step:
            raise ResumeError(
                f"{source}: saved with {self.batches_per_step} micro-batches per optimizer step ({self.layout}); this "
                f"run has {batches_per_step} ({layout}). Resuming would change which batches form a step and the "
                f"learning-rate schedule: choose ranks and optim.grad_accum with the same product "
                f"({self.batches_per_step}), or start a new run_dir"
            )

    def sampler_state(self, saved_sampler_state: dict[str, Any], sampler: TokenBudgetSampler) -> dict[str, Any]:
        """A state for `sampler` (any rank count) at this position. The saved state's other settings are kept, so
        the sampler still refuses a resume on other data or batch settings."""
        if self.epoch_done:
            consumed = sampler.batches_in_epoch(self.epoch)
        elif self.consumed % sampler.world_size:
            raise ResumeError(
                f"resume position {self.consumed} batches into epoch {self.epoch} is not a multiple of "
                f"{sampler.world_size} ranks"
            )
        else:
            consumed = self.consumed // sampler.world_size
        return {**saved_sampler_state, "world_size": sampler.world_size, "epoch": self.epoch, "consumed": consumed}


def position_of(sampler: TokenBudgetSampler, *, batches_per_step: int, layout: str) -> DataPosition:
    """The sampler's position in global batches (a rank's count times the rank count)."""
    state = sampler.state_dict()
    done = state["consumed"] >= sampler.batches_in_epoch(sampler.epoch)
    return DataPosition(
        epoch=sampler.epoch,
        consumed=state["consumed"] * sampler.world_size,
        epoch_done=done,
        batches_per_step=batches_per_step,
        layout=layout,
    )


def epoch_progress(sampler: TokenBudgetSampler) -> float:
    """Fractional epoch of the sampler's position (for the metrics)."""
    state = sampler.state_dict()
    return state["epoch"] + state["consumed"] / max(1, sampler.batches_in_epoch(state["epoch"]))
