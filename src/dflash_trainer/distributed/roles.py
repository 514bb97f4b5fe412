"""Rank roles and process groups of a placement (DESIGN §4).

Colocated: every rank is `colocated` and gradients all-reduce over the default group.
Disaggregated: `placement.target_ranks` run only the frozen target and send feature batches;
`placement.drafter_ranks` run only the drafter and all-reduce gradients in their own group. Together the two
lists must name every rank of the job exactly once.

Groups made here (`dist.new_group` is collective: every rank creates every group, in the same order):
- `drafter_group`: the drafter ranks, for gradients, metrics and stop agreement.
- `payload_group`: every rank, used only for feature send/recv, so point-to-point traffic never shares a
  communicator with the collectives of the default group. Its timeout is `placement.timeout_s` plus
  `checkpoint.timeout_s`: a target's sends stay posted, unmatched, while the drafters write a checkpoint, and
  NCCL's watchdog holds every work to its group's timeout.
- `header_group`: every rank, gloo. Headers are host data; with NCCL payloads they travel over gloo so the
  receiver learns shapes without a device sync. On CPU it is the payload group itself.
- `checkpoint_group`: the drafter ranks, gloo, `checkpoint.timeout_s`: where they meet the lead drafter after it
  wrote a checkpoint, and each other after reading the one they resume from (`checkpoint_wait_group`).
- `start_group`: every rank, gloo, `placement.timeout_s` plus `checkpoint.timeout_s`: the start's broadcast, which
  the target ranks wait in while the drafters read the checkpoint they resume from.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Literal

import torch.distributed as dist

from ..config import ConfigError, PlacementConfig
from .world import World

Role = Literal["colocated", "target", "drafter"]


class PlacementError(ConfigError):
    """The placement does not fit the job's ranks."""


@dataclass(frozen=True)
class Roles:
    role: Role
    rank: int
    target_ranks: tuple[int, ...]
    drafter_ranks: tuple[int, ...]
    drafter_group: dist.ProcessGroup | None = None
    payload_group: dist.ProcessGroup | None = None
    header_group: dist.ProcessGroup | None = None
    # The drafter ranks on gloo with `checkpoint.timeout_s`: they wait here while the lead drafter writes a
    # checkpoint, and for each other to read the one they resume from.
    checkpoint_group: dist.ProcessGroup | None = None
    # Every rank on gloo: the start's broadcast (`broadcast_start`), after the drafters resumed.
    start_group: dist.ProcessGroup | None = None

    @property
    def num_targets(self) -> int:
        return len(self.target_ranks)

    @property
    def num_drafters(self) -> int:
        return len(self.drafter_ranks)

    @property
    def slot(self) -> int:
        """Index of this rank among the ranks of its role (target slot or drafter slot)."""
        ranks = self.target_ranks if self.role == "target" else self.drafter_ranks
        return ranks.index(self.rank)

    @property
    def is_lead_drafter(self) -> bool:
        """The drafter rank that logs, checkpoints and tells the target ranks where the run starts."""
        return self.role != "target" and self.rank == self.drafter_ranks[0]

    def label(self) -> str:
        return f"{self.role}{self.rank}" if self.role != "colocated" else f"rank{self.rank}"


def check_placement(placement: PlacementConfig, world_size: int) -> None:
    """Refuse rank lists that do not cover the job's ranks exactly once, and settings the placement lacks."""
    if not placement.disaggregated:
        return
    if placement.sharding != "ddp":
        raise PlacementError(
            f"placement.sharding={placement.sharding}: disaggregated drafter ranks sync gradients with one "
            "all-reduce per step; use placement.sharding=ddp (fsdp2 is available with the colocated placement)"
        )
    listed = sorted([*placement.target_ranks, *placement.drafter_ranks])
    if listed != list(range(world_size)):
        raise PlacementError(
            f"placement: target_ranks {placement.target_ranks} + drafter_ranks {placement.drafter_ranks} must "
            f"name every rank 0..{world_size - 1} exactly once; the job has {world_size} rank(s) "
            f"(start {len(listed)} ranks: torchrun --nproc-per-node {len(listed)}, or --nproc {len(listed)})"
        )


def assign_roles(world: World, placement: PlacementConfig, *, checkpoint_timeout_s: float) -> Roles:
    """This rank's role, and the process groups of the placement (created on every rank)."""
    if not placement.disaggregated:
        everyone = tuple(range(world.world_size))
        return Roles(role="colocated", rank=world.rank, target_ranks=everyone, drafter_ranks=everyone)
    check_placement(placement, world.world_size)
    timeout = datetime.timedelta(seconds=placement.timeout_s)
    drafter_ranks = tuple(placement.drafter_ranks)
    drafter_group = dist.new_group(ranks=list(drafter_ranks), timeout=timeout)
    payload_group = dist.new_group(timeout=timeout + datetime.timedelta(seconds=checkpoint_timeout_s))
    header_group = payload_group if world.backend == "gloo" else dist.new_group(timeout=timeout, backend="gloo")
    checkpoint_group = checkpoint_wait_group(list(drafter_ranks), checkpoint_timeout_s)
    start_group = checkpoint_wait_group(None, placement.timeout_s + checkpoint_timeout_s)
    role: Role = "target" if world.rank in placement.target_ranks else "drafter"
    return Roles(
        role=role,
        rank=world.rank,
        target_ranks=tuple(placement.target_ranks),
        drafter_ranks=drafter_ranks,
        drafter_group=drafter_group,
        payload_group=payload_group,
        header_group=header_group,
        checkpoint_group=checkpoint_group,
        start_group=start_group,
    )


def checkpoint_wait_group(ranks: list[int] | None, timeout_s: float) -> dist.ProcessGroup:
    """A gloo group of `ranks` (None: every rank) whose collectives wait up to `timeout_s`: for the waits that may
    span a checkpoint being written or read (the ranks meeting its writer, or each other after resuming; the
    start's broadcast). The training group's timeout (`placement.timeout_s`, about a step's worth) is too short for
    a large checkpoint, and an NCCL group's timeout is fixed when it is made. Created on every rank of the job,
    members or not (`dist.new_group`'s rule)."""
    return dist.new_group(ranks=ranks, timeout=datetime.timedelta(seconds=timeout_s), backend="gloo")
