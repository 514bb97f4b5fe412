"""Token-budget batches: per-epoch shuffle, optional packing, sharding over ranks, mid-epoch resume, collation.

How an epoch's batches are formed (deterministic in `(seed, epoch, lengths)` and the settings, identical on
every rank):

1. Shuffle the sample indices with `numpy.random.default_rng([seed, epoch])`.
2. Rows. Without packing, each sample is a row. With packing, samples are placed first-fit, in shuffled
   order, into up to `PACKING_OPEN_ROWS` open rows of at most `max_seq_len` tokens; a sample that fits none
   opens a new row, closing the fullest open row when all are in use. Bounding the open rows keeps this
   linear in the number of samples.
3. Batches. Rows are taken in windows of about `SORT_WINDOW_BATCHES` steps' batches' worth (rows or tokens), sorted
   by length (longest first) within each window, and cut greedily into batches with at most `max_batch_size`
   rows and `rows * longest_row <= token_budget`. Sorting within a window groups rows of similar length, which
   cuts padding, while the shuffle still decides which samples meet. With packing and `anchor_counts` (the
   anchors the batch stage will draw from each sample), packed rows are sorted by their anchor count instead
   (most first; length breaks ties): the drafter pads every row of a batch to its fullest row's anchor count,
   and packed rows are nearly all close to `max_seq_len` anyway. On the SmolLM2 recipe's data shape that cuts
   the padded anchor slots from about 32 % of a batch to under 10 % (the same samples per epoch, in other
   batches). It also makes batches differ more in size from step to step, and the loss is a mean per step, so a
   slot of a small batch weighs a little more than one of a large batch (on that data shape, slots of short
   replies about 1.10 and of 256-token replies about 0.94, against 1.01 and 1.00 unsorted). A last batch of a
   single row takes a row from the batch before it where that one can spare it (`_no_lone_last_row`: a size of 1
   would compile the drafter again).
4. The batch order is shuffled with the same generator, so long and short batches alternate over the epoch. With
   `step_batches` > 1 (the global batches of one optimizer step: ranks x micro-batches) neighbouring batches of
   the sorted order are shuffled as groups of that many, so the batches of one step, which different ranks train
   at once, are of similar size and no rank waits for a much larger one (a last short group stays last). On the
   recipe's data shape with 8 ranks, the slowest rank of a step then holds about 8.5K anchor slots instead of
   11.3K with the batches shuffled one by one (a single rank: 8.4K).
5. The global batch list is dealt round-robin, batch i to rank i % world_size. When its length is not a
   multiple of world_size, `drop_last=True` drops the last (length % world_size) batches (their samples sit
   this epoch out; a different set every epoch); `drop_last=False` completes the last round with the epoch's
   first batches again (their samples are seen twice). Either way every rank runs the same number of steps,
   which collective operations need.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dflash_trainer.data.shards import TokenDataset

PACKING_OPEN_ROWS = 32
SORT_WINDOW_BATCHES = 8


@dataclass(frozen=True)
class BatchPlan:
    # Sample indices per row, in the order they are laid out in the row.
    rows: list[list[int]]
    epoch: int
    # Position of this batch among this rank's batches of the epoch (0 .. len(sampler) - 1).
    index: int


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # [R, T] int64, pad_token_id on padding
    loss_mask: torch.Tensor  # [R, T] bool, False on padding
    doc_ids: torch.Tensor  # [R, T] int64, document index within the row, -1 on padding
    position_ids: torch.Tensor  # [R, T] int64, position within the document, 0 on padding
    # One per document, in row-major order.
    sample_ids: list[str]
    # Non-padding tokens, known on the host without a device sync.
    num_tokens: int

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        return PackedBatch(
            input_ids=self.input_ids.to(device, non_blocking=non_blocking),
            loss_mask=self.loss_mask.to(device, non_blocking=non_blocking),
            doc_ids=self.doc_ids.to(device, non_blocking=non_blocking),
            position_ids=self.position_ids.to(device, non_blocking=non_blocking),
            sample_ids=self.sample_ids,
            num_tokens=self.num_tokens,
        )


class TokenBudgetSampler:
    """Yields this rank's `BatchPlan`s for the current epoch (see the module docstring for how they are formed).

    Resume: `state_dict()` records the epoch and how many batches this rank's iterator has handed out in it.
    Take it once every batch handed out has been trained on; after `load_state_dict`, iterating yields exactly
    the batches of that epoch not yet handed out. The state is the same on every rank, so rank 0 may save it.
    """

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        token_budget: int,
        max_seq_len: int,
        max_batch_size: int,
        packing: bool,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = False,
        anchor_counts: Sequence[int] | np.ndarray | None = None,
        step_batches: int = 1,
    ):
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.ndim != 1 or lengths.size == 0:
            raise ValueError(f"lengths must be a non-empty 1-D sequence, got shape {list(lengths.shape)}")
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
        if token_budget < max_seq_len:
            raise ValueError(f"token_budget ({token_budget}) must be >= max_seq_len ({max_seq_len}) so every row fits")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if step_batches < 1:
            raise ValueError(f"step_batches must be >= 1, got {step_batches}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        bad = np.flatnonzero((lengths < 1) | (lengths > max_seq_len))
        if bad.size:
            raise ValueError(
                f"sample {int(bad[0])} has length {int(lengths[bad[0]])}, outside [1, max_seq_len={max_seq_len}] "
                f"({bad.size} such samples); load the data with the same max_seq_len"
            )
        if anchor_counts is not None:
            anchor_counts = np.asarray(anchor_counts, dtype=np.int64)
            if anchor_counts.shape != lengths.shape or (anchor_counts < 0).any():
                raise ValueError(
                    f"anchor_counts must be {lengths.size} counts >= 0, one per sample, got shape "
                    f"{list(anchor_counts.shape)}"
                )
        self.lengths = lengths
        self.anchor_counts = anchor_counts
        self.token_budget = token_budget
        self.max_seq_len = max_seq_len
        self.max_batch_size = max_batch_size
        self.packing = packing
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.drop_last = drop_last
        self.step_batches = step_batches
        self.epoch = 0
        self._consumed = 0
        # Planning an epoch walks every sample in Python: done once per epoch, shared by __len__ and __iter__.
        # (epoch, its batches) in one attribute, replaced whole: a reader on another thread (the trainer's
        # prefetch worker iterates while the main thread may ask for an epoch's length) sees a consistent pair.
        self._planned: tuple[int | None, list[list[list[int]]]] = (None, [])

    def set_epoch(self, epoch: int) -> None:
        """Switch to `epoch`; a no-op for the current epoch, so a resumed position survives the usual call."""
        if epoch != self.epoch:
            self.epoch = epoch
            self._consumed = 0

    def __len__(self) -> int:
        return len(self._rank_batches(self.epoch))

    def batches_in_epoch(self, epoch: int) -> int:
        """This rank's batch count in `epoch` (it varies a little with packing), leaving the position alone.

        For schedules that need the total number of steps up front.
        """
        planned_epoch, planned = self._planned
        if epoch == planned_epoch:
            return len(planned)
        return len(self._plan_rank_batches(epoch))

    def __iter__(self) -> Iterator[BatchPlan]:
        epoch = self.epoch
        batches = self._rank_batches(epoch)
        while self._consumed < len(batches) and self.epoch == epoch:
            index = self._consumed
            # Counted when handed out, so a state_dict taken while the batch is trained on already skips it.
            self._consumed += 1
            yield BatchPlan(rows=batches[index], epoch=epoch, index=index)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "consumed": self._consumed, **self._settings()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        differing = [
            f"{key}: saved {state.get(key)!r}, now {value!r}"
            for key, value in self._settings().items()
            if state.get(key) != value
        ]
        if "step_batches" in state and self.step_batches == 1:  # recorded only when > 1
            differing.append(f"step_batches: saved {state['step_batches']!r}, now 1")
        if differing:
            hint = ""
            if state.get("num_anchors") is None and self.packing and self.anchor_counts is not None:
                hint = (
                    " (a checkpoint whose batches were not balanced by anchors: resume with data.balance_anchors=false)"
                )
            elif state.get("num_anchors") != self._settings()["num_anchors"]:
                hint = " (the anchor counts per sample differ: other data, or another data.max_anchors)"
            elif state.get("step_batches", 1) != self.step_batches:
                hint = (
                    " (a checkpoint whose batches were shuffled one by one, not per optimizer step; it resumes with "
                    "one rank and grad_accum 1)"
                )
            raise ValueError(
                "sampler state comes from other data or settings, so the batch order would not continue: "
                + "; ".join(differing)
                + hint
            )
        self.epoch = int(state["epoch"])
        consumed = int(state["consumed"])
        available = len(self._rank_batches(self.epoch))
        if not 0 <= consumed <= available:
            raise ValueError(f"sampler state: consumed={consumed} outside [0, {available}] for epoch {self.epoch}")
        self._consumed = consumed

    def _settings(self) -> dict[str, Any]:
        # What the batch order depends on besides the epoch; a resume with any of these changed would silently
        # train on a different order (rank is excluded: every rank's state is the same).
        return {
            "seed": self.seed,
            "world_size": self.world_size,
            "num_samples": int(self.lengths.size),
            "num_tokens": int(self.lengths.sum()),
            "token_budget": self.token_budget,
            "max_seq_len": self.max_seq_len,
            "max_batch_size": self.max_batch_size,
            "packing": self.packing,
            "drop_last": self.drop_last,
            # Packed rows sorted by anchors: the counts decide the order (their total stands for them).
            "num_anchors": int(self.anchor_counts.sum()) if self.packing and self.anchor_counts is not None else None,
            # Batches shuffled in groups of a step's (recorded when > 1, so states of one-batch steps stay valid).
            **({"step_batches": self.step_batches} if self.step_batches > 1 else {}),
        }

    def _rank_batches(self, epoch: int) -> list[list[list[int]]]:
        planned_epoch, planned = self._planned
        if planned_epoch != epoch:
            planned = self._plan_rank_batches(epoch)
            self._planned = (epoch, planned)
        return planned

    def _plan_rank_batches(self, epoch: int) -> list[list[list[int]]]:
        batches = plan_epoch(
            self.lengths,
            epoch=epoch,
            seed=self.seed,
            token_budget=self.token_budget,
            max_seq_len=self.max_seq_len,
            max_batch_size=self.max_batch_size,
            packing=self.packing,
            anchor_counts=self.anchor_counts,
            step_batches=self.step_batches,
        )
        return _deal(batches, rank=self.rank, world_size=self.world_size, drop_last=self.drop_last)


def plan_epoch(
    lengths: np.ndarray,
    *,
    epoch: int,
    seed: int,
    token_budget: int,
    max_seq_len: int,
    max_batch_size: int,
    packing: bool,
    anchor_counts: np.ndarray | None = None,
    step_batches: int = 1,
) -> list[list[list[int]]]:
    """The epoch's global batch list (before dealing to ranks): batches of rows of sample indices."""
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(lengths.size).tolist()
    length_of = lengths.tolist()
    rows = _pack_rows(order, length_of, max_seq_len) if packing else [[i] for i in order]
    row_lengths = [sum(length_of[i] for i in row) for row in rows]
    # Sort key within a window: length, or (anchors, length) for packed rows when the anchor counts are known.
    row_keys: list[tuple[int, ...]] = [(length,) for length in row_lengths]
    if packing and anchor_counts is not None:
        anchors_of = anchor_counts.tolist()
        row_keys = [(sum(anchors_of[i] for i in row), length) for row, length in zip(rows, row_lengths, strict=True)]
    # A sort window of SORT_WINDOW_BATCHES steps' batches: one step's G batches are then neighbours among 8 G.
    batches = _cut_batches(
        rows,
        row_lengths,
        row_keys,
        token_budget=token_budget,
        max_batch_size=max_batch_size,
        window_batches=SORT_WINDOW_BATCHES * step_batches,
    )
    # Shuffled in groups of a step's batches (neighbours in the sorted order); with one batch per step this is
    # the plain permutation of the batches.
    full = len(batches) // step_batches
    groups = [batches[g * step_batches : (g + 1) * step_batches] for g in range(full)]
    shuffled = [batch for g in rng.permutation(full) for batch in groups[g]]
    return shuffled + batches[full * step_batches :]


def _pack_rows(order: list[int], length_of: list[int], max_seq_len: int) -> list[list[int]]:
    """First-fit packing into a bounded set of open rows, in `order`."""
    closed: list[list[int]] = []
    open_rows: list[list[int]] = []
    open_lengths: list[int] = []
    for index in order:
        length = length_of[index]
        for j, used in enumerate(open_lengths):
            if used + length <= max_seq_len:
                open_rows[j].append(index)
                open_lengths[j] = used + length
                if open_lengths[j] == max_seq_len:
                    closed.append(open_rows.pop(j))
                    open_lengths.pop(j)
                break
        else:
            if len(open_rows) == PACKING_OPEN_ROWS:
                fullest = max(range(len(open_lengths)), key=open_lengths.__getitem__)
                closed.append(open_rows.pop(fullest))
                open_lengths.pop(fullest)
            open_rows.append([index])
            open_lengths.append(length)
    return closed + open_rows


def _cut_batches(
    rows: list[list[int]],
    row_lengths: list[int],
    row_keys: list[tuple[int, ...]],
    *,
    token_budget: int,
    max_batch_size: int,
    window_batches: int = SORT_WINDOW_BATCHES,
) -> list[list[list[int]]]:
    """Sort rows by `row_keys` (largest first) within windows of about `window_batches` batches, then cut them
    greedily into batches within the budget."""
    window_rows = window_batches * max_batch_size
    window_tokens = window_batches * token_budget
    ordered: list[int] = []
    window: list[int] = []
    window_used = 0
    for r, length in enumerate(row_lengths):
        window.append(r)
        window_used += length
        if len(window) == window_rows or window_used >= window_tokens or r == len(rows) - 1:
            ordered.extend(sorted(window, key=lambda w: row_keys[w], reverse=True))
            window, window_used = [], 0

    cut: list[list[int]] = []  # row indices per batch
    current: list[int] = []
    longest = 0
    for r in ordered:
        longest_with_row = max(longest, row_lengths[r])
        if current and (len(current) == max_batch_size or (len(current) + 1) * longest_with_row > token_budget):
            cut.append(current)
            current, longest_with_row = [], row_lengths[r]
        current.append(r)
        longest = longest_with_row
    cut.append(current)
    _no_lone_last_row(cut, row_lengths, token_budget=token_budget)
    return [[rows[r] for r in batch] for batch in cut]


def _no_lone_last_row(cut: list[list[int]], row_lengths: list[int], *, token_budget: int) -> None:
    """In place, on batches of row indices: a last batch of one row takes the last row of the batch before it, where
    that batch keeps two or more rows and the budget holds. Why: compiled code specialises a size of 1 (dynamo always
    does), so a step of one row among steps of many compiles the drafter's layers again (10-40 s, once per run) at a
    random point of the run, the last batch being shuffled into the epoch like every other. On lengths shaped like
    the SmolLM2 main job's data one epoch in six ended in such a batch. Recipes whose every batch holds one row
    (`max_batch_size: 1`, or rows longer than half the budget) keep them."""
    if len(cut) < 2 or len(cut[-1]) != 1 or len(cut[-2]) < 3:
        return
    if 2 * max(row_lengths[cut[-2][-1]], row_lengths[cut[-1][0]]) <= token_budget:
        cut[-1].insert(0, cut[-2].pop())


def _deal(batches: list[list[list[int]]], *, rank: int, world_size: int, drop_last: bool) -> list[list[list[int]]]:
    """Batch i to rank i % world_size, with the same number of batches on every rank."""
    remainder = len(batches) % world_size
    if remainder and drop_last:
        batches = batches[: len(batches) - remainder]
    elif remainder:
        batches = batches + [batches[i % len(batches)] for i in range(world_size - remainder)]
    return batches[rank::world_size]


def collate(dataset: TokenDataset, plan: BatchPlan, pad_token_id: int) -> PackedBatch:
    """Lay out the plan's rows as [R, T] tensors, T = longest row; documents sit back to back in a row."""
    if not plan.rows or not all(plan.rows):
        raise ValueError(f"batch {plan.index} of epoch {plan.epoch}: empty batch or row in {plan.rows}")
    lengths = dataset.lengths
    row_lengths = [int(lengths[row].sum()) for row in plan.rows]
    num_rows, width = len(plan.rows), max(row_lengths)
    input_ids = np.full((num_rows, width), pad_token_id, dtype=np.int64)
    loss_mask = np.zeros((num_rows, width), dtype=bool)
    doc_ids = np.full((num_rows, width), -1, dtype=np.int64)
    position_ids = np.zeros((num_rows, width), dtype=np.int64)
    sample_ids: list[str] = []
    for r, row in enumerate(plan.rows):
        start = 0
        for doc, index in enumerate(row):
            sample = dataset[index]
            end = start + len(sample.input_ids)
            input_ids[r, start:end] = sample.input_ids
            loss_mask[r, start:end] = sample.loss_mask
            doc_ids[r, start:end] = doc
            position_ids[r, start:end] = np.arange(end - start)
            sample_ids.append(sample.id)
            start = end
    return PackedBatch(
        input_ids=torch.from_numpy(input_ids),
        loss_mask=torch.from_numpy(loss_mask),
        doc_ids=torch.from_numpy(doc_ids),
        position_ids=torch.from_numpy(position_ids),
        sample_ids=sample_ids,
        num_tokens=sum(row_lengths),
    )
