"""Token-budget sampler: coverage per epoch, budgets, determinism, rank sharding, resume, and collation."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from dflash_trainer.data.sampler import (
    SORT_WINDOW_BATCHES,
    BatchPlan,
    TokenBudgetSampler,
    _no_lone_last_row,
    collate,
    plan_epoch,
)
from dflash_trainer.data.shards import TokenDataset

MAX_SEQ_LEN = 64
BUDGET = 256
MAX_ROWS = 6


def random_lengths(n: int = 300, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    # Mostly short samples with some long ones, as in chat data.
    return np.where(rng.random(n) < 0.8, rng.integers(1, 16, n), rng.integers(16, MAX_SEQ_LEN + 1, n))


def make_sampler(lengths: np.ndarray, packing: bool, seed: int = 0, **kwargs) -> TokenBudgetSampler:
    return TokenBudgetSampler(
        lengths,
        token_budget=BUDGET,
        max_seq_len=MAX_SEQ_LEN,
        max_batch_size=MAX_ROWS,
        packing=packing,
        seed=seed,
        **kwargs,
    )


def flat_samples(plans: list[BatchPlan]) -> list[int]:
    return [i for plan in plans for row in plan.rows for i in row]


def global_batches(lengths: np.ndarray, packing: bool, epoch: int, seed: int = 0) -> list[list[list[int]]]:
    return plan_epoch(
        lengths,
        epoch=epoch,
        seed=seed,
        token_budget=BUDGET,
        max_seq_len=MAX_SEQ_LEN,
        max_batch_size=MAX_ROWS,
        packing=packing,
    )


@pytest.mark.parametrize("packing", [False, True])
def test_single_rank_sees_every_sample_once_per_epoch(packing: bool) -> None:
    lengths = random_lengths()
    sampler = make_sampler(lengths, packing)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        plans = list(sampler)
        assert len(plans) == len(sampler)
        assert [p.index for p in plans] == list(range(len(plans)))
        assert all(p.epoch == epoch for p in plans)
        assert sorted(flat_samples(plans)) == list(range(len(lengths)))


@pytest.mark.parametrize("packing", [False, True])
def test_budget_max_rows_and_row_length_hold(packing: bool) -> None:
    lengths = random_lengths()
    sampler = make_sampler(lengths, packing)
    for plan in sampler:
        row_lengths = [int(lengths[row].sum()) for row in plan.rows]
        assert 1 <= len(plan.rows) <= MAX_ROWS
        assert len(plan.rows) * max(row_lengths) <= BUDGET
        assert max(row_lengths) <= MAX_SEQ_LEN
        if not packing:
            assert all(len(row) == 1 for row in plan.rows)


def test_packing_reduces_padding() -> None:
    lengths = random_lengths()
    padded = {}
    for packing in (False, True):
        plans = list(make_sampler(lengths, packing))
        padded[packing] = sum(len(p.rows) * max(int(lengths[r].sum()) for r in p.rows) for p in plans)
        if packing:
            assert max(len(row) for p in plans for row in p.rows) > 1
    real = int(lengths.sum())
    assert padded[True] < padded[False]
    # First-fit packing of mostly short samples leaves little padding.
    assert real / padded[True] > 0.9


def test_budget_equal_to_max_seq_len_gives_one_row_per_long_batch() -> None:
    lengths = np.array([64, 64, 10, 20, 30])
    sampler = TokenBudgetSampler(lengths, token_budget=64, max_seq_len=64, max_batch_size=8, packing=True, seed=0)
    plans = list(sampler)
    assert sorted(flat_samples(plans)) == [0, 1, 2, 3, 4]
    assert all(len(p.rows) == 1 for p in plans)
    assert len(plans) == 3  # [64], [64], and the three short ones packed into one row of 60


@pytest.mark.parametrize("packing", [False, True])
def test_order_changes_with_epoch_and_is_reproducible(packing: bool) -> None:
    lengths = random_lengths()
    first = make_sampler(lengths, packing, seed=5)
    again = make_sampler(lengths, packing, seed=5)
    other_seed = make_sampler(lengths, packing, seed=6)
    epoch0 = [p.rows for p in first]
    assert epoch0 == [p.rows for p in again]
    assert epoch0 != [p.rows for p in other_seed]
    first.set_epoch(1)
    epoch1 = [p.rows for p in first]
    assert flat_samples([BatchPlan(r, 1, 0) for r in epoch1]) != flat_samples([BatchPlan(r, 0, 0) for r in epoch0])
    again.set_epoch(1)
    assert epoch1 == [p.rows for p in again]


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_split_the_epoch(world_size: int, drop_last: bool) -> None:
    lengths = random_lengths()
    epoch = 2
    reference = global_batches(lengths, packing=True, epoch=epoch)
    remainder = len(reference) % world_size
    per_rank = []
    for rank in range(world_size):
        sampler = make_sampler(lengths, True, rank=rank, world_size=world_size, drop_last=drop_last)
        sampler.set_epoch(epoch)
        per_rank.append([p.rows for p in sampler])
    assert len({len(batches) for batches in per_rank}) == 1, "every rank must run the same number of steps"
    for rank, batches in enumerate(per_rank):
        assert batches[: len(reference[rank::world_size])] == reference[rank::world_size][: len(batches)]

    seen = Counter(i for batches in per_rank for batch in batches for row in batch for i in row)
    expected = Counter(range(len(lengths)))
    if drop_last:
        dropped = reference[len(reference) - remainder :] if remainder else []
        expected.subtract(i for batch in dropped for row in batch for i in row)
    else:
        repeated = reference[: (world_size - remainder) % world_size]
        expected.update(i for batch in repeated for row in batch for i in row)
    assert seen == +expected
    if remainder == 0:
        assert seen == Counter(range(len(lengths))), "exactly once across ranks"


def test_ranks_cover_each_sample_exactly_once_when_batches_divide() -> None:
    # 12 samples of the maximum length, one per row and two rows per batch: 6 batches over 3 ranks.
    lengths = np.full(12, MAX_SEQ_LEN)
    seen: list[int] = []
    for rank in range(3):
        sampler = TokenBudgetSampler(
            lengths,
            token_budget=128,
            max_seq_len=MAX_SEQ_LEN,
            max_batch_size=8,
            packing=True,
            seed=3,
            rank=rank,
            world_size=3,
        )
        assert len(sampler) == 2
        seen += flat_samples(list(sampler))
    assert sorted(seen) == list(range(12))


@pytest.mark.parametrize("world_size", [1, 3])
def test_mid_epoch_resume_yields_exactly_the_remaining_batches(world_size: int) -> None:
    lengths = random_lengths()
    rank = world_size - 1
    original = make_sampler(lengths, True, seed=9, rank=rank, world_size=world_size)
    original.set_epoch(1)
    reference = make_sampler(lengths, True, seed=9, rank=rank, world_size=world_size)
    reference.set_epoch(1)
    full_epoch = [(p.rows, p.index) for p in reference]

    iterator = iter(original)
    taken = [next(iterator) for _ in range(5)]
    state = original.state_dict()
    assert state["epoch"] == 1 and state["consumed"] == 5

    resumed = make_sampler(lengths, True, seed=9, rank=rank, world_size=world_size)
    resumed.load_state_dict(state)
    resumed.set_epoch(1)  # the trainer's usual call must not restart the epoch
    assert len(resumed) == len(full_epoch)
    rest = [(p.rows, p.index) for p in resumed]
    assert [(p.rows, p.index) for p in taken] + rest == full_epoch
    assert rest[0][1] == 5

    # At the end of the epoch, the state says "nothing left" and the next epoch starts from its beginning.
    finished = resumed.state_dict()
    assert finished["consumed"] == len(full_epoch)
    after_end = make_sampler(lengths, True, seed=9, rank=rank, world_size=world_size)
    after_end.load_state_dict(finished)
    assert list(after_end) == []
    after_end.set_epoch(2)
    reference.set_epoch(2)
    assert [p.rows for p in after_end] == [p.rows for p in reference]


def test_batches_in_epoch_matches_iteration_and_keeps_the_position() -> None:
    lengths = random_lengths()
    sampler = make_sampler(lengths, True, rank=1, world_size=2)
    counts = []
    for epoch in range(3):
        probe = make_sampler(lengths, True, rank=1, world_size=2)
        probe.set_epoch(epoch)
        counts.append(len(list(probe)))
    iterator = iter(sampler)
    next(iterator)
    assert [sampler.batches_in_epoch(e) for e in range(3)] == counts
    assert sampler.state_dict()["consumed"] == 1
    assert len(list(iterator)) == counts[0] - 1


def test_resume_with_other_settings_is_refused() -> None:
    lengths = random_lengths()
    state = make_sampler(lengths, True, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed: saved 1, now 2"):
        make_sampler(lengths, True, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="num_samples"):
        make_sampler(lengths[:-1], True, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="consumed=10000"):
        make_sampler(lengths, True, seed=1).load_state_dict({**state, "consumed": 10000})


def test_rejects_samples_longer_than_max_seq_len_and_small_budgets() -> None:
    with pytest.raises(ValueError, match="sample 1 has length 65"):
        make_sampler(np.array([3, MAX_SEQ_LEN + 1, 5]), True)
    with pytest.raises(ValueError, match="token_budget"):
        TokenBudgetSampler([3], token_budget=32, max_seq_len=64, max_batch_size=4, packing=True, seed=0)
    with pytest.raises(ValueError, match="rank"):
        make_sampler(np.array([3]), True, rank=2, world_size=2)


# ----------------------------------------------------------------------------------------------------------
# Collation.


def dataset_from(samples: list[tuple[str, list[int], list[int]]]) -> TokenDataset:
    offsets = np.cumsum([0] + [len(ids) for _, ids, _ in samples])
    return TokenDataset(
        sample_ids=[s[0] for s in samples],
        tokens=np.concatenate([s[1] for s in samples]),
        loss_mask=np.concatenate([s[2] for s in samples]),
        offsets=offsets,
        manifest={},
    )


def test_collate_hand_built_batch() -> None:
    dataset = dataset_from(
        [
            ("s0", [11, 12, 13], [0, 1, 1]),
            ("s1", [21, 22], [1, 0]),
            ("s2", [31, 32, 33, 34], [0, 0, 1, 1]),
            ("s3", [41], [1]),
        ]
    )
    plan = BatchPlan(rows=[[0, 1], [2], [3, 1]], epoch=0, index=0)
    batch = collate(dataset, plan, pad_token_id=-7)
    pad = -7
    expected_ids = [
        [11, 12, 13, 21, 22],
        [31, 32, 33, 34, pad],
        [41, 21, 22, pad, pad],
    ]
    expected_mask = [
        [0, 1, 1, 1, 0],
        [0, 0, 1, 1, 0],
        [1, 1, 0, 0, 0],
    ]
    expected_docs = [
        [0, 0, 0, 1, 1],
        [0, 0, 0, 0, -1],
        [0, 1, 1, -1, -1],
    ]
    expected_positions = [
        [0, 1, 2, 0, 1],
        [0, 1, 2, 3, 0],
        [0, 0, 1, 0, 0],
    ]
    assert batch.input_ids.dtype == torch.int64
    assert batch.loss_mask.dtype == torch.bool
    assert batch.doc_ids.dtype == torch.int64
    assert batch.position_ids.dtype == torch.int64
    assert batch.input_ids.tolist() == expected_ids
    assert batch.loss_mask.int().tolist() == expected_mask
    assert batch.doc_ids.tolist() == expected_docs
    assert batch.position_ids.tolist() == expected_positions
    assert batch.sample_ids == ["s0", "s1", "s2", "s3", "s1"]
    assert batch.num_tokens == 5 + 4 + 3

    moved = batch.to("cpu")
    assert torch.equal(moved.doc_ids, batch.doc_ids) and moved.num_tokens == batch.num_tokens


def test_collate_rejects_empty_rows() -> None:
    dataset = dataset_from([("s0", [1], [1])])
    with pytest.raises(ValueError, match="empty batch or row"):
        collate(dataset, BatchPlan(rows=[[0], []], epoch=3, index=4), pad_token_id=0)


def test_sampler_and_collate_on_a_dataset_cover_all_tokens() -> None:
    rng = np.random.default_rng(0)
    samples = []
    for i in range(40):
        length = int(rng.integers(2, 30))
        mask = rng.integers(0, 2, length)
        mask[-1] = 1
        samples.append((f"s{i}", rng.integers(0, 1000, length).tolist(), mask.tolist()))
    dataset = dataset_from(samples)
    sampler = TokenBudgetSampler(
        dataset.lengths, token_budget=96, max_seq_len=32, max_batch_size=4, packing=True, seed=0
    )
    total_tokens = 0
    total_loss = 0
    for plan in sampler:
        batch = collate(dataset, plan, pad_token_id=0)
        rows, width = batch.input_ids.shape
        assert rows * width <= 96
        assert batch.num_tokens == int((batch.doc_ids >= 0).sum())
        total_tokens += batch.num_tokens
        total_loss += int(batch.loss_mask.sum())
    assert total_tokens == dataset.stats.tokens
    assert total_loss == dataset.stats.loss_tokens


def test_count_steps_plans_only_the_epochs_max_steps_needs() -> None:
    from dflash_trainer.train.schedule import count_steps

    class CountingSampler:
        def __init__(self) -> None:
            self.planned: list[int] = []

        def batches_in_epoch(self, epoch: int) -> int:
            self.planned.append(epoch)
            return 10 + epoch % 2  # packing makes epoch sizes differ

    sampler = CountingSampler()
    assert count_steps(sampler, epochs=1000, micro_batches_per_step=2, max_steps=12) == 12
    assert sampler.planned == [0, 1, 2]  # 5 + 6 steps, then 5 more reach 12
    assert count_steps(CountingSampler(), epochs=3, micro_batches_per_step=2, max_steps=None) == 16
    assert count_steps(CountingSampler(), epochs=3, micro_batches_per_step=2, max_steps=100) == 16


def skewed_dataset(n: int = 400, seed: int = 0) -> TokenDataset:
    """Chat-like samples: a prompt without loss, then a reply with loss that is long for some and short for others
    (as the SmolLM2 recipe's data: replies cut at the cap beside short ones), so rows differ in anchors."""
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(n):
        prompt = int(rng.integers(2, 12))
        reply = 16 if rng.random() < 0.3 else int(rng.integers(1, 6))
        samples.append((f"s{i}", rng.integers(0, 1000, prompt + reply).tolist(), [0] * prompt + [1] * reply))
    return dataset_from(samples)


def test_anchor_counts_are_what_the_batch_stage_draws() -> None:
    """The per-sample counts the sampler balances equal the anchors `make_train_batch` draws, row by row."""
    from dflash_trainer.train.batch import make_train_batch

    dataset = skewed_dataset(120)
    for max_anchors in (3, 512):
        counts = dataset.anchor_counts(max_anchors)
        sampler = TokenBudgetSampler(
            dataset.lengths, token_budget=96, max_seq_len=32, max_batch_size=4, packing=True, seed=0
        )
        for plan in sampler:
            batch = make_train_batch(
                collate(dataset, plan, pad_token_id=0),
                block_size=4,
                mask_token_id=1,
                max_anchors=max_anchors,
                seed=0,
                epoch=0,
                index=plan.index,
            )
            drawn = batch.anchor_keep.sum(dim=1).tolist()
            assert drawn == [int(sum(counts[i] for i in row)) for row in plan.rows]


def padded_anchor_share(dataset: TokenDataset, counts: np.ndarray | None) -> float:
    """The share of anchor slots that are padding when every row pads to its batch's fullest row."""
    sampler = TokenBudgetSampler(
        dataset.lengths, token_budget=128, max_seq_len=32, max_batch_size=4, packing=True, seed=0, anchor_counts=counts
    )
    real = slots = 0
    per_sample = dataset.anchor_counts(512)
    for plan in sampler:
        per_row = [int(sum(per_sample[i] for i in row)) for row in plan.rows]
        real += sum(per_row)
        slots += len(per_row) * max(per_row)
    return 1 - real / slots


def test_balanced_rows_cut_anchor_padding_and_keep_every_sample_once() -> None:
    dataset = skewed_dataset()
    counts = dataset.anchor_counts(512)
    plain, balanced = padded_anchor_share(dataset, None), padded_anchor_share(dataset, counts)
    assert balanced < 0.5 * plain, (plain, balanced)
    sampler = TokenBudgetSampler(
        dataset.lengths, token_budget=128, max_seq_len=32, max_batch_size=4, packing=True, seed=0, anchor_counts=counts
    )
    for epoch in range(2):
        sampler.set_epoch(epoch)
        plans = list(sampler)
        assert sorted(flat_samples(plans)) == list(range(len(dataset)))
        for plan in plans:
            assert len(plan.rows) <= 4
            assert len(plan.rows) * max(int(dataset.lengths[row].sum()) for row in plan.rows) <= 128


def test_rows_of_a_batch_follow_the_sort_key() -> None:
    """Batches are cut from windows sorted largest first: by length, or for packed rows by anchor count when the
    counts are given; unpacked rows stay sorted by length whatever the counts. (Few samples: one sort window, so
    no batch straddles two windows.)"""
    lengths = random_lengths(40)
    assert lengths.sum() < SORT_WINDOW_BATCHES * BUDGET and lengths.size < SORT_WINDOW_BATCHES * MAX_ROWS
    counts = np.random.default_rng(3).integers(0, 50, lengths.size)
    settings = dict(epoch=1, seed=0, token_budget=BUDGET, max_seq_len=MAX_SEQ_LEN, max_batch_size=MAX_ROWS)

    def keys(batches, key_of) -> list[list[int]]:
        return [[key_of(row) for row in batch] for batch in batches]

    def length(row) -> int:
        return int(lengths[row].sum())

    def anchors(row) -> int:
        return int(counts[row].sum())

    for packing, counts_given, key_of in [
        (True, False, length),
        (False, False, length),
        (False, True, length),
        (True, True, anchors),
    ]:
        batches = plan_epoch(lengths, packing=packing, anchor_counts=counts if counts_given else None, **settings)
        assert sum(len(batch) for batch in batches) > 2 * len(batches)  # batches of several rows: a real check
        for row_keys in keys(batches, key_of):
            assert row_keys == sorted(row_keys, reverse=True), (packing, counts_given, row_keys)
    # And the key matters: sorted by anchors, the packed rows are not all in length order any more.
    packed = plan_epoch(lengths, packing=True, anchor_counts=counts, **settings)
    assert any(row_keys != sorted(row_keys, reverse=True) for row_keys in keys(packed, length))


def test_resume_with_other_anchor_counts_is_refused() -> None:
    lengths = random_lengths()
    counts = np.ones(lengths.size, dtype=np.int64)
    state = make_sampler(lengths, packing=True, anchor_counts=counts).state_dict()
    with pytest.raises(ValueError, match="num_anchors"):
        make_sampler(lengths, packing=True, anchor_counts=2 * counts).load_state_dict(state)
    with pytest.raises(ValueError, match="num_anchors"):
        make_sampler(lengths, packing=True).load_state_dict(state)
    # A state from before the balancing (no such key) names the way back.
    unbalanced = make_sampler(lengths, packing=True).state_dict()
    del unbalanced["num_anchors"]
    with pytest.raises(ValueError, match=r"data\.balance_anchors=false"):
        make_sampler(lengths, packing=True, anchor_counts=counts).load_state_dict(unbalanced)
    with pytest.raises(ValueError, match="anchor_counts"):
        make_sampler(lengths, packing=True, anchor_counts=counts[:-1])


def test_anchor_counts_pair_only_within_a_sample_and_skip_empty_ones() -> None:
    """Anchors need two loss tokens in a row of one sample: never across samples, nothing for an empty one."""
    dataset = TokenDataset(
        sample_ids=["a", "b", "c", "d", "e"],
        tokens=np.arange(10),
        loss_mask=np.array([0, 1, 1, 1, 0, 1, 1, 1, 1, 1]),
        offsets=np.array([0, 4, 4, 7, 10, 10]),
        manifest={},
    )
    assert dataset.anchor_counts(512).tolist() == [2, 0, 1, 2, 0]
    assert dataset.anchor_counts(1).tolist() == [1, 0, 1, 1, 0]


def test_batches_of_one_step_are_neighbours_of_the_sorted_order() -> None:
    """`step_batches` G > 1: rows are sorted in windows of 8 G batches and the global list is shuffled in groups of
    G neighbouring batches (each group the batches of one optimizer step), so one step's batches are of similar
    size; G = 1 is the plain plan; every sample once per epoch either way."""
    lengths = random_lengths(n=3000)
    counts = np.random.default_rng(5).integers(0, 60, lengths.size)
    settings = dict(
        epoch=2, seed=1, token_budget=BUDGET, max_seq_len=MAX_SEQ_LEN, max_batch_size=MAX_ROWS, packing=True
    )
    plain = plan_epoch(lengths, anchor_counts=counts, **settings)
    assert plan_epoch(lengths, anchor_counts=counts, step_batches=1, **settings) == plain

    def anchor_slots(batch) -> int:  # what the drafter computes: rows x the fullest row's anchors
        return len(batch) * max(int(counts[row].sum()) for row in batch)

    for group in (2, 4):
        grouped = plan_epoch(lengths, anchor_counts=counts, step_batches=group, **settings)
        assert sorted(i for batch in grouped for row in batch for i in row) == list(range(lengths.size))
        steps = [grouped[i : i + group] for i in range(0, len(grouped) - group + 1, group)]
        plain_steps = [plain[i : i + group] for i in range(0, len(plain) - group + 1, group)]

        def waste(step_list, size) -> float:  # slots the ranks of a step wait for, beyond their own
            return sum(size * max(map(anchor_slots, s)) - sum(map(anchor_slots, s)) for s in step_list)

        grouped_waste, plain_waste = waste(steps, group), waste(plain_steps, group)
        assert grouped_waste < 0.5 * plain_waste, (group, grouped_waste, plain_waste)
    for world_size in (1, 2):
        samplers = [
            make_sampler(lengths, packing=True, anchor_counts=counts, rank=r, world_size=world_size, step_batches=4)
            for r in range(world_size)
        ]
        seen = sorted(i for s in samplers for i in flat_samples(list(s)))
        assert seen == list(range(lengths.size))


def test_resume_across_step_groupings_is_refused_and_names_why() -> None:
    lengths = random_lengths()
    counts = np.ones(lengths.size, dtype=np.int64)
    one = make_sampler(lengths, packing=True, anchor_counts=counts)
    assert "step_batches" not in one.state_dict()  # states of one-batch steps read as before
    four = make_sampler(lengths, packing=True, anchor_counts=counts, step_batches=4).state_dict()
    with pytest.raises(ValueError, match="shuffled one by one"):
        make_sampler(lengths, packing=True, anchor_counts=counts, step_batches=4).load_state_dict(one.state_dict())
    with pytest.raises(ValueError, match="step_batches"):
        one.load_state_dict(four)
    # Without packing the anchor counts do not decide the order and are not recorded.
    unpacked = make_sampler(lengths, packing=False, anchor_counts=counts).state_dict()
    assert unpacked["num_anchors"] is None
    make_sampler(lengths, packing=False).load_state_dict(unpacked)
    with pytest.raises(ValueError, match=r"data\.max_anchors"):
        make_sampler(lengths, packing=True, anchor_counts=2 * counts).load_state_dict(
            make_sampler(lengths, packing=True, anchor_counts=counts).state_dict()
        )


def test_no_batch_of_one_row_where_its_neighbour_can_spare_one():
    # 49 rows of equal length, 16 per batch: the greedy cut leaves a last batch of one row, which a compiled drafter
    # would compile again for (dynamo specialises a size of 1). It takes a row from the batch before it instead.
    lengths = np.full(49, 100)
    settings = dict(seed=0, token_budget=1600, max_seq_len=100, max_batch_size=16, packing=False)
    for epoch in range(4):
        batches = plan_epoch(lengths, epoch=epoch, **settings)
        assert sorted(len(batch) for batch in batches) == [2, 15, 16, 16]
        assert sorted(i for batch in batches for row in batch for i in row) == list(range(49))
    # Where every batch holds one row anyway (rows longer than half the budget), nothing moves.
    lone = plan_epoch(np.full(5, 900), epoch=0, **settings)
    assert [len(batch) for batch in lone] == [1] * 5


def test_a_lone_last_row_stays_alone_where_two_would_break_the_budget():
    fits = [[0, 1, 2], [3]]
    _no_lone_last_row(fits, [100, 100, 100, 100], token_budget=1600)
    assert fits == [[0, 1], [2, 3]]
    too_long = [[0, 1, 2], [3]]  # row 3 and any other row: 2 x 900 > 1600
    _no_lone_last_row(too_long, [100, 100, 100, 900], token_budget=1600)
    assert too_long == [[0, 1, 2], [3]]
    spare_none = [[0, 1], [2]]  # the batch before would be left with one row itself
    _no_lone_last_row(spare_none, [100, 100, 100], token_budget=1600)
    assert spare_none == [[0, 1], [2]]
