"""`model/loss.py::top_k_ids_by_group_max`, DFlash2's candidates on CUDA: the same k values as one `torch.topk` over
the row, highest first, and the same set of ids wherever the k-th value is not tied."""

import pytest
import torch

from dflash_trainer.model.loss import top_k_ids, top_k_ids_by_group_max


def _check_same_values(logits: torch.Tensor, ids: torch.Tensor, k: int) -> None:
    reference = torch.topk(logits, k, dim=-1)
    assert ids.shape == (logits.shape[0], k) and ids.dtype == torch.int64
    assert torch.equal(logits.gather(1, ids), reference.values)  # the same values, highest first


@pytest.mark.parametrize("vocab", [49_152, 151_936, 248_320])  # SmolLM2, Qwen3, Qwen3.5
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_group_max_pruning_keeps_the_top_k(vocab: int, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    logits = (torch.randn(24, vocab) * 4).to(dtype)  # [N, V]
    ids = top_k_ids_by_group_max(logits, 16, 64)  # [N, 16]
    _check_same_values(logits, ids, 16)
    reference_ids = torch.topk(logits, 16, dim=-1).indices
    kth = logits.gather(1, reference_ids[:, -1:])  # [N, 1]
    untied = (logits == kth).sum(dim=1) == 1  # rows whose 16th value occurs once
    assert untied.any()
    # The same set of ids; equal values within the k may come in either order.
    assert torch.equal(ids[untied].sort(dim=1).values, reference_ids[untied].sort(dim=1).values)


def test_group_max_pruning_when_the_largest_logits_share_groups() -> None:
    # The k largest logits in one or two groups: every other group's maximum is smaller, so a pruning that kept
    # one candidate per group would lose them.
    vocab, group, k = 4_096, 64, 16
    logits = torch.randn(3, vocab)
    logits[0, 128:144] = 100 + torch.arange(16.0)  # all 16 in group 2
    logits[1, 60:68] = 50 + torch.arange(8.0)  # straddling groups 0 and 1
    logits[1, 64:72] = 60 + torch.arange(8.0)
    logits[2] = torch.arange(float(vocab)).roll(1_000)  # sorted runs: the largest at the end of a group boundary
    ids = top_k_ids_by_group_max(logits, k, group)
    _check_same_values(logits, ids, k)
    assert set(ids[0].tolist()) == set(range(128, 144))


@pytest.mark.parametrize("k", [1, 16])
def test_group_max_pruning_with_as_many_groups_as_k(k: int) -> None:
    logits = torch.randn(5, k * 32)
    _check_same_values(logits, top_k_ids_by_group_max(logits, k, 32), k)


def test_top_k_ids_on_the_cpu_is_one_topk() -> None:
    logits = torch.randn(7, 49_152)
    assert torch.equal(top_k_ids(logits, 16), torch.topk(logits, 16, dim=-1).indices)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_top_k_ids_on_cuda_eager_and_compiled_as_the_loss_runs_it() -> None:
    # The loss chunk runs `top_k_ids` inside torch.compile(dynamic=False, fullgraph=True): both forms, bf16 logits
    # at SmolLM2's vocabulary, against one torch.topk.
    torch.manual_seed(0)
    logits = (torch.randn(1_920, 49_152, device="cuda") * 4).to(torch.bfloat16)  # [N, V]
    compiled = torch.compile(top_k_ids, dynamic=False, fullgraph=True)
    for ids in (top_k_ids(logits, 16), compiled(logits, 16)):
        _check_same_values(logits, ids, 16)
