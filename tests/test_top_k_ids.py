"""`model/loss.py::top_k_ids`, DFlash2's candidates: the two-stage top-k gives one `torch.topk`'s values, highest
first, and its ids wherever the k-th value is not tied, at the vocabularies of the targets we train (SmolLM2, Qwen3,
Qwen3.5), in bf16 (where ties are common) and float32; small or awkward vocabularies, and CPU tensors, take one
top-k over the row."""

from __future__ import annotations

import pytest
import torch

from dflash_trainer.model.loss import _top_k_group, top_k_ids, top_k_ids_in_groups


@pytest.mark.parametrize("vocab", [49152, 151936, 248320])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_two_stages_keep_the_rows_top_k(vocab, dtype):
    generator = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(24, vocab, generator=generator) * 3).to(dtype)  # [N, V]
    logits[0, 7] = logits[0, vocab - 1] = 100.0  # the best in the first and the last group
    group = _top_k_group(vocab, 16)  # the two stages' group size on a GPU
    assert group is not None and vocab % group == 0
    ids = top_k_ids_in_groups(logits, 16, group)  # [N, 16]
    expected_values, expected_ids = torch.topk(logits, 17, dim=-1)
    assert ids.shape == (24, 16) and ids.dtype == torch.int64
    assert torch.equal(logits.gather(1, ids), expected_values[:, :16])  # the same values, highest first
    untied = expected_values[:, 15] > expected_values[:, 16]  # rows whose 16th value is not shared with a 17th
    assert untied.sum() >= 12
    for row in untied.nonzero().flatten().tolist():
        assert set(ids[row].tolist()) == set(expected_ids[row, :16].tolist())
    assert set(ids[0, :2].tolist()) == {7, vocab - 1}


def test_one_row_and_k_1():
    logits = torch.randn(1, 49152).to(torch.bfloat16)
    ids = top_k_ids_in_groups(logits, 1, 1024)  # [1, 1]
    assert ids.shape == (1, 1) and logits[0, ids[0, 0]] == logits.max()  # the maximum (ties: any of them)


@pytest.mark.parametrize(("vocab", "k"), [(4096, 16), (151665, 16), (49152, 128)])
def test_small_or_indivisible_vocabularies_take_one_top_k(vocab, k):
    assert _top_k_group(vocab, k) is None


def test_on_the_cpu_one_top_k_over_the_row():  # faster there than the two stages
    logits = torch.randn(3, 49152)
    assert torch.equal(top_k_ids(logits, 16), torch.topk(logits, 16, dim=-1).indices)
