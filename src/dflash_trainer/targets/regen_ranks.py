"""Regeneration over the local GPUs: which records each rank answers, and where the ranks meet.

`dflash-trainer regenerate --nproc N` and the recipe's automatic data step under `train --nproc N` run one
regeneration on N ranks (torchrun). Every rank reads the same records with the same settings and calls
`regenerate(..., team=...)`:

1. Claim (`RegenTeam.settle`): team rank 0 creates or checks the output directory; the others learn the outcome
   (go on, already complete, or the same one-line error on every rank).
2. Answer: each rank answers its share (`share`) of the records, minus those that a journal already holds, into
   its own journal (`regen_journal.py`), with its own engine on its own device. No rank waits for another.
3. Merge (`RegenTeam.gather`): team rank 0 collects the ranks' counters and merges the journals into one file in
   input order.

Equal to a one-rank run for greedy decoding, byte for byte: a reply depends on its record alone (the engine's rows
decode independently; a sampled reply depends on (seed, the record's index in the whole input, turn, token
index)), every journal line carries that index, and the merge orders the lines by it.

Shares. Records differ in work by orders of magnitude (a one-line question against an eight-turn conversation whose
every turn is a reply to a growing prompt), and the order of an input file is arbitrary: dealing by index (record
i to rank i mod N) sends every heavy record to the same ranks when kinds alternate with a period that divides N (a
mixture that interleaves its sources, question and long-context pairs). So the share depends on the records, not on
their order: they are sorted by estimated work (replies to generate, then characters of the conversation) and dealt
in snake order (ranks 0..N-1, then N-1..0, ...). Every rank gets the same number of records within one and, for
each number of replies, the same number within two, whose characters add up to within twice the largest such
record's of each other (in a sorted run dealt in snake order, what a rank gains in one round it gives back in the
next). Reply lengths are unknown in advance; over thousands of records per rank they even out. The share depends
only on the records and N (not on what is done), so the ranks need not agree on it.

Meeting points run on a gloo process group of the team whose timeout is `TEAM_TIMEOUT` (days): ranks reach the
merge minutes or hours apart, far beyond the job's collective timeout. A rank that dies does not leave the others
waiting: collectives with it fail once its connections close, and torchrun and the failure channel
(`distributed/failure.py`) stop the job.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch.distributed as dist

from ..errors import UserError
from .regen_journal import RegenerateError

TEAM_TIMEOUT = datetime.timedelta(days=7)
T = TypeVar("T")


def share(work: Sequence[tuple[int, int]], rank: int, size: int) -> list[int]:
    """The indices (ascending) of the records that `rank` of `size` answers, given each record's estimated work
    (replies to generate, characters): sorted by work, largest first (ties by index), dealt in snake order."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} outside a team of {size}")
    order = sorted(range(len(work)), key=lambda i: (-work[i][0], -work[i][1], i))
    mine = []
    for position, index in enumerate(order):
        round_, slot = divmod(position, size)
        if (slot if round_ % 2 == 0 else size - 1 - slot) == rank:
            mine.append(index)
    return sorted(mine)


@dataclass(frozen=True)
class RegenTeam:
    """The ranks that regenerate one set of records together; one process by default."""

    rank: int = 0
    size: int = 1
    group: Any = None  # the team's gloo ProcessGroup when size > 1
    leader: int = 0  # the global rank of team rank 0

    @classmethod
    def of(cls, members: Sequence[int] | None = None) -> RegenTeam:
        """The team of global ranks `members` (default: every rank) of the job's process group, a one-process team
        when there is no process group. Collective: every member calls it (every rank when `members` is None)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return cls()
        world = dist.get_world_size()
        ranks = sorted(range(world) if members is None else set(members))
        me = dist.get_rank()
        if me not in ranks:
            raise ValueError(f"rank {me} is not one of the regeneration ranks {ranks}")
        if len(ranks) == 1:
            return cls()
        group = dist.new_group(
            ranks, timeout=TEAM_TIMEOUT, backend="gloo", use_local_synchronization=len(ranks) < world
        )
        return cls(rank=ranks.index(me), size=len(ranks), group=group, leader=ranks[0])

    def close(self) -> None:
        if self.group is not None:
            dist.destroy_process_group(self.group)

    def settle(self, decide: Callable[[], T]) -> T:
        """`decide()` on team rank 0, its result on every rank; its error raised on every rank (a user error as
        the same one line)."""
        if self.size == 1:
            return decide()
        outcome: list[Any] = [None]
        error: Exception | None = None
        if self.rank == 0:
            try:
                outcome[0] = ("done", decide())
            except Exception as caught:
                error = caught
                outcome[0] = ("user_error" if isinstance(caught, UserError) else "failed", str(caught))
        dist.broadcast_object_list(outcome, src=self.leader, group=self.group)
        if error is not None:
            raise error
        kind, value = outcome[0]
        if kind == "user_error":
            raise RegenerateError(value)
        if kind == "failed":
            raise RuntimeError(f"regeneration rank 0 failed: {value}")
        return value

    def gather(self, value: T) -> list[T] | None:
        """Every rank's `value` in team rank order on team rank 0; None elsewhere."""
        if self.size == 1:
            return [value]
        gathered: list[Any] | None = [None] * self.size if self.rank == 0 else None
        dist.gather_object(value, gathered, dst=self.leader, group=self.group)
        return gathered
