"""The loss's LM head in FP8 (`loss.fp8_head`, `model/fp8_head.py`): loss and gradient against float64, the cached
quantised head, the config checks, a tiny training run whose loss falls, and the compiled CUDA path.

CPU torch runs `torch._scaled_mm` as a reference kernel (dequantise, multiply in float32), so all but the GPU test
run here. Sizes are multiples of 16, as the GPU's scaled matmul needs.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from torch.library import opcheck

from dflash_trainer.config import ConfigError, load_config
from dflash_trainer.model import fp8_head as fp8_head_module
from dflash_trainer.model.fp8 import E4M3, fp8_training_problem, quantize
from dflash_trainer.model.fp8_head import cached_fp8_head
from dflash_trainer.model.loss import TargetPositionLogits, _loss_chunk, dflash_loss

VOCAB = 2048
WIDTH = 256


def _inputs(*, seed: int = 0, rows: int = 2, blocks: int = 8, block_size: int = 8, vocab: int = VOCAB):
    """bf16-valued hidden states, head and target states, as training hands them to the loss; the head gives
    logits of a few units (std 3), as real heads do."""
    gen = torch.Generator().manual_seed(seed)
    shape = (rows, blocks, block_size)
    valid = torch.rand(shape, generator=gen) < 0.9
    valid[..., 0] = False
    return {
        "hidden": torch.randn(*shape, WIDTH, generator=gen).bfloat16(),
        "weight": (torch.randn(vocab, WIDTH, generator=gen) * 3.0 / WIDTH**0.5).bfloat16(),
        "labels": torch.randint(0, vocab, shape, generator=gen),
        "valid": valid,
        "target_states": torch.randn(rows * blocks * block_size, WIDTH, generator=gen).bfloat16(),
    }


def _loss_and_grad(inputs, *, dtype: torch.dtype, label_source: str, fp8_head: bool = False, **options):
    """(loss, gradient w.r.t. hidden), both float64, from `dflash_loss` with every tensor cast to `dtype`. Soft labels
    come as the target's logits per position (one per slot here), computed in `dtype`."""
    hidden = inputs["hidden"].to(dtype, copy=True).requires_grad_()
    weight = inputs["weight"].to(dtype)
    target_logits = None
    if label_source == "soft":
        rows = torch.arange(inputs["labels"].numel(), device=inputs["labels"].device).view(inputs["labels"].shape)
        target_logits = TargetPositionLogits(logits=inputs["target_states"].to(dtype) @ weight.t(), slot_rows=rows)
    out = dflash_loss(
        hidden,
        weight,
        inputs["labels"],
        inputs["valid"],
        gamma=None,
        label_source=label_source,
        target_logits=target_logits,
        chunk_blocks=4,
        fp8_head=fp8_head,
        **options,
    )
    out.loss.backward()
    return out.loss.detach().double(), hidden.grad.double()


def _errors(actual, expected) -> tuple[float, float]:
    (loss, grad), (loss_ref, grad_ref) = actual, expected
    return float((loss - loss_ref).abs() / loss_ref.abs()), float((grad - grad_ref).norm() / grad_ref.norm())


# Measured at these sizes (V 2,048, H 256, 112 counted slots) over seeds 0-3: the loss within 0.02-0.32 % for hard
# labels and 0.02-0.08 % for soft ones, the gradient within 3.6-3.9 % and 5.5-6.2 % (p - q cancels, so the error is
# larger relative to it); bf16's gradient within 0.4-0.6 % and 1.1-1.3 %. The loss averages its slots' errors, so
# bf16's is not reliably smaller there; the gradient tells the two apart.
@pytest.mark.parametrize(("label_source", "grad_bound"), [("data", 0.06), ("soft", 0.09)], ids=["hard", "soft"])
def test_fp8_head_loss_and_gradient_are_within_fp8_error_of_float64(label_source, grad_bound):
    inputs = _inputs()
    reference = _loss_and_grad(inputs, dtype=torch.float64, label_source=label_source)
    fp8 = _errors(_loss_and_grad(inputs, dtype=torch.bfloat16, label_source=label_source, fp8_head=True), reference)
    bf16 = _errors(_loss_and_grad(inputs, dtype=torch.bfloat16, label_source=label_source), reference)
    assert fp8[0] < 0.01 and fp8[1] < grad_bound, fp8
    # FP8 actually ran: bf16's gradient is several times closer.
    assert bf16[1] * 3 < fp8[1], (bf16, fp8)


def test_fp8_head_metrics_count_the_same_slots():
    """The weight sums and slot counts do not depend on the logits; the accuracy may differ by a near tie."""
    inputs = _inputs(seed=1)
    hidden, weight = inputs["hidden"], inputs["weight"]
    args = (weight, inputs["labels"], inputs["valid"])
    exact = dflash_loss(hidden, *args, gamma=None).metrics
    fp8 = dflash_loss(hidden, *args, gamma=None, fp8_head=True).metrics
    torch.testing.assert_close(fp8.weight_sum, exact.weight_sum)
    torch.testing.assert_close(fp8.count_per_slot, exact.count_per_slot)


def test_the_quantised_head_is_made_once_per_weight(monkeypatch):
    calls = []
    quantize_rows = fp8_head_module._quantize_rows
    monkeypatch.setattr(
        fp8_head_module, "_quantize_rows", lambda values: calls.append(values.shape) or quantize_rows(values)
    )
    monkeypatch.setattr(fp8_head_module, "_cached", None)
    inputs = _inputs(blocks=2)
    weight = inputs["weight"]
    for _ in range(2):
        _loss_and_grad(inputs | {"weight": weight}, dtype=torch.bfloat16, label_source="data", fp8_head=True)
    assert calls == [(VOCAB, WIDTH), (WIDTH, VOCAB)]  # both layouts, once
    head = cached_fp8_head(weight)
    assert cached_fp8_head(weight) is head
    # Changed in place, or another tensor: quantised again, from the new values.
    with torch.no_grad():
        weight.mul_(2.0)
    doubled = cached_fp8_head(weight)
    assert doubled is not head and len(calls) == 4
    torch.testing.assert_close(doubled.weight_scale, head.weight_scale * 2.0)
    assert cached_fp8_head(weight.clone()) is not doubled and len(calls) == 6


def test_the_scaled_mm_op_is_traceable():
    """`dflash_fp8::scaled_mm`'s fake agrees with its kernel (what the compiled loss chunk relies on). Its inputs are
    FP8, which torch's schema check cannot compare on the CPU (`test_fp8_drafter.py`): a byte comparison instead."""
    head = cached_fp8_head(_inputs(blocks=1)["weight"])
    rows, scale = quantize(torch.randn(32, WIDTH).bfloat16(), E4M3)
    before = rows.view(torch.uint8).clone()
    checks = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    opcheck(
        torch.ops.dflash_fp8.scaled_mm.default, (rows, scale, head.weight, head.weight_scale, True), test_utils=checks
    )
    assert torch.equal(rows.view(torch.uint8), before)


def test_the_fp8_loss_chunk_traces_as_one_graph():
    """Dynamo traces `_loss_chunk` with the FP8 head in one graph (fullgraph, as on CUDA), the scaled matmuls opaque;
    AOT autograd's eager backend gives the eager numbers."""
    inputs = _inputs(blocks=4)
    hidden = inputs["hidden"][:, :, 1:].reshape(-1, 7, WIDTH)  # [C, S, H]
    labels, valid = inputs["labels"][:, :, 1:].reshape(-1, 7), inputs["valid"][:, :, 1:].reshape(-1, 7)
    args = (hidden, inputs["weight"], None, labels, valid, None, None, torch.linspace(1.0, 0.5, 7))
    options = dict(weighting="exp", dpace_alpha=0.5, label_source="data", need_grad=True)
    head = cached_fp8_head(inputs["weight"])
    compiled = torch.compile(_loss_chunk, backend="aot_eager", fullgraph=True, dynamic=False)
    for actual, expected in zip(compiled(*args, head, **options), _loss_chunk(*args, head, **options), strict=True):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def test_fp8_head_refuses_sizes_the_gpu_cannot_take():
    inputs = _inputs(blocks=1, vocab=2040)
    with pytest.raises(ValueError, match=r"fp8_head: the LM head's sizes \[V=2040, H=256\] must be multiples of 16"):
        dflash_loss(inputs["hidden"], inputs["weight"], inputs["labels"], inputs["valid"], gamma=None, fp8_head=True)


def test_training_with_the_fp8_head_on_the_cpu_lowers_the_loss(tmp_path):
    """`loss.fp8_head=true` end to end on the CPU (torch's reference scaled matmul): the loss falls as in bf16."""
    from dflash_trainer.train.trainer import Trainer
    from train_helpers import save_tiny_target, write_counting_shards, write_recipe

    target = save_tiny_target(tmp_path / "target")
    shards = write_counting_shards(tmp_path / "shards")
    recipe = write_recipe(
        tmp_path / "r.yaml", tmp_path / "run", target, shards, train={"max_steps": 24}, loss={"fp8_head": True}
    )
    trainer = Trainer(load_config(recipe))
    trainer.fit()
    cached_weight, _, _ = fp8_head_module._cached  # the loss ran on the FP8 copies of the target's head
    assert cached_weight() is trainer.lm_head.weight
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum(losses[-3:]) / 3 < 0.6 * sum(losses[:3]) / 3, losses


def test_fp8_head_on_a_gpu_without_fp8_is_a_config_error(tmp_path, monkeypatch):
    from dflash_trainer.train import trainer as trainer_module
    from train_helpers import save_tiny_target, write_counting_shards, write_recipe

    problem = "needs a GPU with FP8 tensor cores (compute capability 8.9+), this one has 8.0"
    monkeypatch.setattr(trainer_module, "fp8_training_problem", lambda device: problem)
    target = save_tiny_target(tmp_path / "target")
    shards = write_counting_shards(tmp_path / "shards", num_samples=4)
    recipe = write_recipe(tmp_path / "r.yaml", tmp_path / "run", target, shards, loss={"fp8_head": True})
    with pytest.raises(ConfigError, match=re.escape(f"loss.fp8_head: {problem}; set loss.fp8_head=false")):
        trainer_module.Trainer(load_config(recipe))


# ------------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("label_source", ["data", "soft"], ids=["hard", "soft"])
def test_gpu_compiled_fp8_head_matches_bf16(label_source):
    """The compiled loss chunk (static shapes, fullgraph) with the FP8 head on CUDA (CUTLASS row-wise scaled matmuls)
    against the same compiled chunk in bf16 and float64, at a vocabulary of 32K."""
    if fp8_training_problem(torch.device("cuda")) is not None:
        pytest.skip("needs FP8 tensor cores")
    vocab = 32768
    inputs = {name: value.cuda() for name, value in _inputs(rows=2, blocks=64, block_size=16, vocab=vocab).items()}
    reference = _loss_and_grad(inputs, dtype=torch.float64, label_source=label_source)
    bf16 = _loss_and_grad(inputs, dtype=torch.bfloat16, label_source=label_source, compile=True)
    fp8 = _loss_and_grad(inputs, dtype=torch.bfloat16, label_source=label_source, fp8_head=True, compile=True)
    fp8_errors, bf16_errors = _errors(fp8, reference), _errors(bf16, reference)
    grad_bound = 0.06 if label_source == "data" else 0.09
    assert fp8_errors[0] < 0.01 and fp8_errors[1] < grad_bound, fp8_errors
    assert bf16_errors[1] * 3 < fp8_errors[1], (bf16_errors, fp8_errors)
