"""`model/loss.py::top_k_ids`, DFlash2's candidates: the two-stage top-k gives one `torch.topk`'s values, highest
first, and its ids wherever the k-th value is not tied, at the vocabularies of the targets we train (SmolLM2, Qwen3,
Qwen3.5), in bf16 (where ties are common) and float32; small or awkward vocabularies take one top-k over the row."""

from __future__ import annotations

import pytest
import torch

from dflash_trainer.model.loss import _top_k_group, top_k_ids


@pytest.mark.parametrize("vocab", [49152, 151936, 248320])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_two_stages_keep_the_rows_top_k(vocab, dtype):
    generator = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(24, vocab, generator=generator) * 3).to(dtype)  # [N, V]
    logits[0, 7] = logits[0, vocab - 1] = 100.0  # the best in the first and the last group
    assert _top_k_group(vocab, 16) is not None  # the two-stage path
    ids = top_k_ids(logits, 16)  # [N, 16]
    expected_values, expected_ids = torch.topk(logits, 17, dim=-1)
    assert ids.shape == (24, 16) and ids.dtype == torch.int64
    assert torch.equal(logits.gather(1, ids), expected_values[:, :16])  # the same values, highest first
    untied = expected_values[:, 15] > expected_values[:, 16]  # rows whose 16th value is not shared with a 17th
    assert untied.sum() >= 12
    for row in untied.nonzero().flatten().tolist():
        assert set(ids[row].tolist()) == set(expected_ids[row, :16].tolist())
    assert set(ids[0, :2].tolist()) == {7, vocab - 1}


@pytest.mark.parametrize(("vocab", "k"), [(4096, 16), (151665, 16), (49152, 128)])
def test_small_or_indivisible_vocabularies_take_one_top_k(vocab, k):
    assert _top_k_group(vocab, k) is None
    logits = torch.randn(3, vocab)
    assert torch.equal(top_k_ids(logits, k), torch.topk(logits, k, dim=-1).indices)
