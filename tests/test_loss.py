"""The DFlash loss against a float64 reference written with explicit loops, plus its metrics."""

from __future__ import annotations

import math

import pytest
import torch

from dflash_trainer.model.loss import (
    LossMetrics,
    TargetPositionLogits,
    block_slot_tokens,
    default_gamma,
    dflash_loss,
    expected_acceptance,
    greedy_next_tokens,
    slot_weights,
    target_position_logits,
)
from model_helpers import force_compiled_chunks

VOCAB = 50
WIDTH = 16


def make_inputs(
    *, rows: int = 2, blocks: int = 3, block_size: int = 8, seed: int = 0, dtype: torch.dtype = torch.float64
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    valid = torch.rand(rows, blocks, block_size, generator=gen) < 0.8
    valid[..., 0] = False
    return {
        "hidden": torch.randn(rows, blocks, block_size, WIDTH, generator=gen, dtype=torch.float64).to(dtype),
        "weight": (torch.randn(VOCAB, WIDTH, generator=gen, dtype=torch.float64) / 2).to(dtype),
        "bias": (torch.randn(VOCAB, generator=gen, dtype=torch.float64) / 4).to(dtype),
        "labels": torch.randint(0, VOCAB, (rows, blocks, block_size), generator=gen),
        "valid": valid,
        "target_hidden": torch.randn(rows, blocks, block_size, WIDTH, generator=gen, dtype=torch.float64).to(dtype),
    }


def reference_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    valid: torch.Tensor,
    *,
    gamma: float,
    weighting: str = "exp",
    alpha: float = 0.5,
    label_source: str = "data",
    target_hidden: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float | list[float]]]:
    """Float64, one slot at a time. Returns the loss and the metrics as Python numbers."""
    hidden = hidden.double()
    weight = weight.double()
    bias = torch.zeros(weight.shape[0], dtype=torch.float64) if bias is None else bias.double()
    rows, blocks, block_size, _ = hidden.shape
    total = torch.zeros((), dtype=torch.float64)
    weight_total = 0.0
    correct = [0.0] * block_size
    count = [0.0] * block_size
    prefix_sum = 0.0
    prefix_blocks = 0.0
    for r in range(rows):
        for n in range(blocks):
            terms, accept_ces, hits = {}, {}, {}
            for k in range(1, block_size):
                if not valid[r, n, k]:
                    continue
                log_p = torch.log_softmax(hidden[r, n, k] @ weight.T + bias, dim=0)
                if label_source == "data":
                    label = int(labels[r, n, k])
                else:
                    target_logits = target_hidden[r, n, k].double() @ weight.T + bias
                    label = int(torch.argmax(target_logits))
                accept_ces[k] = -log_p[label].item()
                hits[k] = torch.argmax(log_p).item() == label
                if label_source == "soft":
                    log_t = torch.log_softmax(target_logits, dim=0)
                    terms[k] = (log_t.exp() * (log_t - log_p)).sum()
                else:
                    terms[k] = -log_p[label]
            slot_weight = {}
            for j in terms:
                if weighting == "exp":
                    slot_weight[j] = math.exp(-(j - 1) / gamma)
                else:
                    w = 0.0
                    for m in range(j, block_size):
                        product = 1.0
                        for i in range(1, m + 1):
                            p_i = (1 - alpha) * math.exp(-accept_ces[i]) + alpha if i in terms else 0.0
                            product *= p_i
                        w += product
                    slot_weight[j] = w
                total = total + slot_weight[j] * terms[j]
                weight_total += slot_weight[j]
                count[j] += 1
                correct[j] += float(hits[j])
            if valid[r, n, 1]:
                prefix_blocks += 1
                k = 1
                while k < block_size and valid[r, n, k] and hits[k]:
                    prefix_sum += 1
                    k += 1
    metrics = {
        "loss_sum": total.item(),
        "weight_sum": weight_total,
        "correct": correct,
        "count": count,
        "prefix_sum": prefix_sum,
        "prefix_blocks": prefix_blocks,
    }
    return total / weight_total, metrics


def run_both(inputs: dict, *, chunk_blocks: int = 64, use_bias: bool = True, **options):
    """(loss, grad) of dflash_loss and of the reference for the same inputs and options."""
    bias = inputs["bias"] if use_bias else None
    hidden = inputs["hidden"].clone().requires_grad_(True)
    out = dflash_loss(
        hidden,
        inputs["weight"],
        inputs["labels"],
        inputs["valid"],
        target_hidden=inputs["target_hidden"],
        chunk_blocks=chunk_blocks,
        lm_head_bias=bias,
        **options,
    )
    out.loss.backward()
    ref_hidden = inputs["hidden"].double().clone().requires_grad_(True)
    ref, ref_metrics = reference_loss(
        ref_hidden,
        inputs["weight"],
        inputs["labels"],
        inputs["valid"],
        gamma=options["gamma"] if options["gamma"] is not None else default_gamma(hidden.shape[2]),
        weighting=options.get("weighting", "exp"),
        alpha=options.get("dpace_alpha", 0.5),
        label_source=options.get("label_source", "data"),
        target_hidden=inputs["target_hidden"],
        bias=bias,
    )
    ref.backward()
    return out, hidden.grad, ref, ref_hidden.grad, ref_metrics


def assert_metrics_equal(metrics: LossMetrics, ref: dict, *, rtol: float = 1e-9) -> None:
    torch.testing.assert_close(metrics.loss_sum, torch.tensor(ref["loss_sum"], dtype=torch.float64), rtol=rtol, atol=0)
    torch.testing.assert_close(
        metrics.weight_sum, torch.tensor(ref["weight_sum"], dtype=torch.float64), rtol=rtol, atol=0
    )
    assert metrics.correct_per_slot.tolist() == ref["correct"]
    assert metrics.count_per_slot.tolist() == ref["count"]
    assert float(metrics.prefix_sum) == ref["prefix_sum"]
    assert float(metrics.prefix_blocks) == ref["prefix_blocks"]


@pytest.mark.parametrize("block_size", [4, 8])
@pytest.mark.parametrize("label_source", ["data", "target_argmax", "soft"])
@pytest.mark.parametrize("weighting", ["exp", "dpace"])
def test_matches_float64_reference(block_size: int, label_source: str, weighting: str) -> None:
    inputs = make_inputs(block_size=block_size, seed=block_size)
    out, grad, ref, ref_grad, ref_metrics = run_both(
        inputs, gamma=2.5, weighting=weighting, dpace_alpha=0.3, label_source=label_source
    )
    assert out.loss.dtype == torch.float64
    torch.testing.assert_close(out.loss, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)
    assert_metrics_equal(out.metrics, ref_metrics)
    assert out.metrics.count_per_slot.sum() > 0  # the case is not vacuous


def test_float32_and_no_bias_match_reference() -> None:
    inputs = make_inputs(dtype=torch.float32, seed=3)
    out, grad, ref, ref_grad, _ = run_both(inputs, gamma=None, use_bias=False)
    assert out.loss.dtype == torch.float32
    torch.testing.assert_close(out.loss.double(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-4, atol=1e-6)


def test_bfloat16_is_close_to_reference() -> None:
    inputs = make_inputs(dtype=torch.bfloat16, seed=4)
    out, grad, ref, ref_grad, _ = run_both(inputs, gamma=4.0)
    assert out.loss.dtype == torch.float32  # fp32 softmax over bf16 logits
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(out.loss.double(), ref, rtol=2e-2, atol=1e-2)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=5e-2, atol=2e-3)


@pytest.mark.parametrize(
    "options",
    [
        {"weighting": "exp", "label_source": "data"},
        {"weighting": "dpace", "label_source": "target_argmax"},
        {"weighting": "dpace", "label_source": "soft"},
    ],
)
def test_chunked_equals_unchunked(options: dict) -> None:
    inputs = make_inputs(rows=3, blocks=5, block_size=8, seed=7)
    results = []
    for chunk_blocks in (1, 2, 1000):
        hidden = inputs["hidden"].clone().requires_grad_(True)
        out = dflash_loss(
            hidden,
            inputs["weight"],
            inputs["labels"],
            inputs["valid"],
            gamma=4.0,
            target_hidden=inputs["target_hidden"],
            chunk_blocks=chunk_blocks,
            **options,
        )
        out.loss.backward()
        results.append((out.loss.detach(), hidden.grad, out.metrics.to_tensor()))
    for loss, grad, metrics in results[:2]:
        torch.testing.assert_close(loss, results[-1][0], rtol=1e-12, atol=0)
        torch.testing.assert_close(grad, results[-1][1], rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(metrics, results[-1][2], rtol=1e-12, atol=0)


def test_slot_weight_values() -> None:
    weights = slot_weights(8, 4.0)
    expected = torch.tensor([0.0] + [math.exp(-(k - 1) / 4.0) for k in range(1, 8)], dtype=torch.float32)
    torch.testing.assert_close(weights, expected)
    assert weights[1] == 1.0


def test_default_gamma() -> None:
    assert [default_gamma(b) for b in (8, 10, 16)] == [4.0, 5.0, 7.0]
    assert default_gamma(32) == pytest.approx(10.0)
    assert default_gamma(12) == pytest.approx(3 * math.log2(12) - 5)
    assert 5.0 < default_gamma(12) < 7.0  # between its paper neighbours
    assert default_gamma(2) == 1.0  # floored
    with pytest.raises(ValueError, match="block_size"):
        default_gamma(1)


def test_default_gamma_is_used_when_gamma_is_none() -> None:
    inputs = make_inputs(block_size=8)
    args = (inputs["hidden"], inputs["weight"], inputs["labels"], inputs["valid"])
    assert dflash_loss(*args, gamma=None).loss == dflash_loss(*args, gamma=4.0).loss
    assert dflash_loss(*args, gamma=None).loss != dflash_loss(*args, gamma=2.0).loss


@pytest.mark.parametrize("label_source", ["data", "soft"])
def test_slot_zero_is_ignored(label_source: str) -> None:
    inputs = make_inputs(seed=11)
    base = dflash_loss(
        inputs["hidden"],
        inputs["weight"],
        inputs["labels"],
        inputs["valid"],
        gamma=4.0,
        label_source=label_source,
        target_hidden=inputs["target_hidden"],
    )
    hidden = inputs["hidden"].clone()
    hidden[..., 0, :] = torch.randn_like(hidden[..., 0, :]) * 10
    labels = inputs["labels"].clone()
    labels[..., 0] = (labels[..., 0] + 1) % VOCAB
    valid = inputs["valid"].clone()
    valid[..., 0] = True  # even when the caller marks slot 0 valid
    target = inputs["target_hidden"].clone()
    target[..., 0, :] = torch.randn_like(target[..., 0, :]) * 10
    hidden.requires_grad_(True)
    changed = dflash_loss(
        hidden, inputs["weight"], labels, valid, gamma=4.0, label_source=label_source, target_hidden=target
    )
    changed.loss.backward()
    torch.testing.assert_close(changed.loss, base.loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(changed.metrics.to_tensor(), base.metrics.to_tensor(), rtol=1e-12, atol=0)
    assert torch.all(hidden.grad[..., 0, :] == 0)
    assert changed.metrics.count_per_slot[0] == 0


def test_same_position_labels_not_shifted() -> None:
    """A drafter whose slot k points at x_{a+k} has near-zero loss; the labels shifted by one are far off."""
    gen = torch.Generator().manual_seed(5)
    rows, blocks, block_size = 2, 3, 8
    weight = torch.nn.functional.normalize(torch.randn(VOCAB, WIDTH, generator=gen, dtype=torch.float64), dim=1)
    tokens = torch.stack([torch.randperm(VOCAB, generator=gen)[: blocks * block_size + 1] for _ in range(rows)])
    labels = tokens[:, :-1].reshape(rows, blocks, block_size)  # x_{a+k}
    shifted = tokens[:, 1:].reshape(rows, blocks, block_size)  # x_{a+k+1}
    hidden = 1000.0 * weight[labels]  # [R, N, B, H]: logit of x_{a+k} beats any other by a wide margin
    valid = torch.ones(rows, blocks, block_size, dtype=torch.bool)
    valid[..., 0] = False
    right = dflash_loss(hidden, weight, labels, valid, gamma=4.0)
    wrong = dflash_loss(hidden, weight, shifted, valid, gamma=4.0)
    assert float(right.loss) < 1e-6
    assert float(wrong.loss) > 20.0
    assert float(right.metrics.prefix_acceptance()) == block_size
    assert float(wrong.metrics.prefix_acceptance()) == 1.0


def test_dpace_slots_after_an_invalid_slot_get_no_weight() -> None:
    inputs = make_inputs(rows=1, blocks=1, block_size=8, seed=2)
    valid = torch.ones(1, 1, 8, dtype=torch.bool)
    valid[..., 0] = False
    valid[..., 4] = False  # slots 5..7 stay valid but sit behind a gap
    hidden = inputs["hidden"].clone().requires_grad_(True)
    out = dflash_loss(hidden, inputs["weight"], inputs["labels"], valid, gamma=4.0, weighting="dpace")
    out.loss.backward()
    assert torch.all(hidden.grad[0, 0, 4:] == 0)
    assert torch.all(hidden.grad[0, 0, 1:4].abs().sum(-1) > 0)
    # With exp weights the slots behind the gap are trained.
    hidden.grad = None
    dflash_loss(hidden, inputs["weight"], inputs["labels"], valid, gamma=4.0).loss.backward()
    assert torch.all(hidden.grad[0, 0, 5:].abs().sum(-1) > 0)


def test_dpace_weights_with_alpha_one_are_a_linear_ramp() -> None:
    """alpha = 1 makes every p_i = 1, so w_j = B - j: a closed form independent of the drafter."""
    inputs = make_inputs(rows=1, blocks=1, block_size=6, seed=9)
    valid = torch.ones(1, 1, 6, dtype=torch.bool)
    valid[..., 0] = False
    out = dflash_loss(
        inputs["hidden"], inputs["weight"], inputs["labels"], valid, gamma=4.0, weighting="dpace", dpace_alpha=1.0
    )
    assert float(out.metrics.weight_sum) == 5 + 4 + 3 + 2 + 1


def test_target_argmax_uses_the_targets_argmax() -> None:
    inputs = make_inputs(seed=13)
    target_labels = torch.argmax(inputs["target_hidden"] @ inputs["weight"].T + inputs["bias"], dim=-1)
    assert not torch.equal(target_labels, inputs["labels"])
    kwargs = {"gamma": 4.0, "lm_head_bias": inputs["bias"]}
    from_target = dflash_loss(
        inputs["hidden"],
        inputs["weight"],
        inputs["labels"],
        inputs["valid"],
        label_source="target_argmax",
        target_hidden=inputs["target_hidden"],
        **kwargs,
    )
    as_data = dflash_loss(inputs["hidden"], inputs["weight"], target_labels, inputs["valid"], **kwargs)
    data_labels = dflash_loss(inputs["hidden"], inputs["weight"], inputs["labels"], inputs["valid"], **kwargs)
    torch.testing.assert_close(from_target.loss, as_data.loss, rtol=1e-12, atol=0)
    assert not torch.allclose(from_target.loss, data_labels.loss)
    torch.testing.assert_close(from_target.metrics.to_tensor(), as_data.metrics.to_tensor(), rtol=1e-12, atol=0)


@pytest.mark.parametrize("chunk_positions", [1, 7, 4096])
def test_target_argmax_labels_per_position_equal_the_per_slot_argmax(chunk_positions: int) -> None:
    """The trainer's target-argmax path: one LM-head pass per position, gathered per block slot, then the data-label
    loss; it must give the per-slot `target_argmax` loss, metrics and gradient (float64), whatever the chunking."""
    from dflash_trainer.model.anchors import gather_block_states

    gen = torch.Generator().manual_seed(21)
    rows, length, width, vocab, block = 2, 40, 8, 50, 4
    final_hidden = torch.randn(rows, length, width, generator=gen, dtype=torch.float64)
    weight = torch.randn(vocab, width, generator=gen, dtype=torch.float64)
    bias = torch.randn(vocab, generator=gen, dtype=torch.float64)
    anchors = torch.tensor([[0, 3, 4, 17, 36, 39], [1, 2, 20, 21, 22, 38]])  # edges of the row included
    hidden = torch.randn(rows, anchors.shape[1], block, width, generator=gen, dtype=torch.float64)
    valid = torch.rand(rows, anchors.shape[1], block, generator=gen) < 0.8
    data_labels = torch.randint(0, vocab, valid.shape, generator=gen)
    results = []
    for per_position in (False, True):
        h = hidden.clone().requires_grad_(True)
        if per_position:
            next_tokens = greedy_next_tokens(final_hidden, weight, lm_head_bias=bias, chunk_positions=chunk_positions)
            labels = block_slot_tokens(next_tokens, anchors, block_size=block)
            out = dflash_loss(h, weight, labels, valid, gamma=3.0, lm_head_bias=bias)
        else:
            target_hidden = gather_block_states(states=final_hidden, anchors=anchors, block_size=block)
            out = dflash_loss(
                h,
                weight,
                data_labels,
                valid,
                gamma=3.0,
                lm_head_bias=bias,
                label_source="target_argmax",
                target_hidden=target_hidden,
            )
        out.loss.backward()
        results.append((out.loss.detach(), out.metrics.to_tensor(), h.grad))
    (ref_loss, ref_metrics, ref_grad), (loss, metrics, grad) = results
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(metrics, ref_metrics, rtol=1e-12, atol=0)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-15)
    assert float(ref_metrics[4:].sum()) > 0  # some slots counted: the comparison covers real work


@pytest.mark.parametrize("chunk_blocks", [1, 5, 64])
@pytest.mark.parametrize("weighting", ["exp", "dpace"])
def test_soft_labels_from_per_position_logits_equal_the_per_slot_path(chunk_blocks: int, weighting: str) -> None:
    """The trainer's soft-label path with overlapping blocks: the target's logits once per position
    (`target_position_logits`), gathered per slot by `block_state_rows`, must give the loss, metrics and gradient of
    the LM head run on each slot's gathered state (float64), whatever the chunking; rows stay apart."""
    from dflash_trainer.model.anchors import block_state_rows, gather_block_states

    gen = torch.Generator().manual_seed(22)
    rows, length, width, vocab, block = 2, 40, 8, 50, 4
    final_hidden = torch.randn(rows, length, width, generator=gen, dtype=torch.float64)
    weight = torch.randn(vocab, width, generator=gen, dtype=torch.float64)
    bias = torch.randn(vocab, generator=gen, dtype=torch.float64)
    anchors = torch.tensor([[0, 3, 4, 17, 36, 39], [1, 2, 20, 21, 22, 38]])  # overlapping, and the row's edges
    hidden = torch.randn(rows, anchors.shape[1], block, width, generator=gen, dtype=torch.float64)
    valid = torch.rand(rows, anchors.shape[1], block, generator=gen) < 0.8
    labels = torch.randint(0, vocab, valid.shape, generator=gen)
    common = dict(gamma=3.0, lm_head_bias=bias, label_source="soft", weighting=weighting, chunk_blocks=chunk_blocks)
    results = []
    for per_position in (False, True):
        h = hidden.clone().requires_grad_(True)
        if per_position:
            target = TargetPositionLogits(
                logits=target_position_logits(final_hidden, weight, lm_head_bias=bias),
                slot_rows=block_state_rows(anchors=anchors, length=length, block_size=block),
            )
            out = dflash_loss(h, weight, labels, valid, target_logits=target, **common)
        else:
            states = gather_block_states(states=final_hidden, anchors=anchors, block_size=block)
            out = dflash_loss(h, weight, labels, valid, target_hidden=states, **common)
        out.loss.backward()
        results.append((out.loss.detach(), out.metrics.to_tensor(), h.grad))
    (ref_loss, ref_metrics, ref_grad), (loss, metrics, grad) = results
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(metrics, ref_metrics, rtol=1e-12, atol=0)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-15)
    assert float(ref_metrics[4:].sum()) > 0 and float(ref_loss) > 0


def test_target_logits_are_checked_and_exclusive_with_target_hidden() -> None:
    inputs = make_inputs()
    rows, blocks, block_size = inputs["labels"].shape
    good = TargetPositionLogits(
        logits=torch.zeros(10, VOCAB, dtype=torch.float64), slot_rows=torch.zeros(rows, blocks, block_size).long()
    )
    args = (inputs["hidden"], inputs["weight"], inputs["labels"], inputs["valid"])
    with pytest.raises(ValueError, match="once"):
        dflash_loss(*args, gamma=4.0, label_source="soft", target_hidden=inputs["target_hidden"], target_logits=good)
    bad = TargetPositionLogits(logits=good.logits[:, :-1], slot_rows=good.slot_rows)
    with pytest.raises(ValueError, match="target_logits must be"):
        dflash_loss(*args, gamma=4.0, label_source="soft", target_logits=bad)


def test_greedy_next_tokens_reject_a_bad_chunk() -> None:
    with pytest.raises(ValueError, match="chunk_positions"):
        greedy_next_tokens(torch.zeros(1, 4, 2), torch.zeros(3, 2), chunk_positions=0)


def test_soft_loss_is_zero_when_drafter_equals_target() -> None:
    inputs = make_inputs(seed=17)
    hidden = inputs["target_hidden"].clone().requires_grad_(True)
    out = dflash_loss(
        hidden,
        inputs["weight"],
        inputs["labels"],
        inputs["valid"],
        gamma=4.0,
        label_source="soft",
        target_hidden=inputs["target_hidden"],
    )
    out.loss.backward()
    assert abs(out.loss.item()) < 1e-12
    assert float(hidden.grad.abs().max()) < 1e-12
    # Every counted slot's argmax agrees with the target's.
    torch.testing.assert_close(out.metrics.correct_per_slot, out.metrics.count_per_slot)
    # A different drafter has a clearly positive KL.
    other = dflash_loss(
        inputs["hidden"],
        inputs["weight"],
        inputs["labels"],
        inputs["valid"],
        gamma=4.0,
        label_source="soft",
        target_hidden=inputs["target_hidden"],
    )
    assert float(other.loss) > 0.1


def test_no_valid_slot_gives_zero_loss_and_gradient() -> None:
    inputs = make_inputs()
    hidden = inputs["hidden"].clone().requires_grad_(True)
    valid = torch.zeros_like(inputs["valid"])
    out = dflash_loss(hidden, inputs["weight"], inputs["labels"], valid, gamma=4.0, weighting="dpace")
    out.loss.backward()
    assert out.loss.item() == 0.0
    assert torch.all(hidden.grad == 0)
    assert float(out.metrics.expected_acceptance()) == 1.0
    assert float(out.metrics.prefix_acceptance()) == 1.0


def test_invalid_slots_may_hold_any_label_or_nan() -> None:
    inputs = make_inputs(seed=21)
    base = dflash_loss(inputs["hidden"], inputs["weight"], inputs["labels"], inputs["valid"], gamma=4.0)
    labels = torch.where(inputs["valid"], inputs["labels"], torch.full_like(inputs["labels"], -100))
    hidden = torch.where(inputs["valid"].unsqueeze(-1), inputs["hidden"], torch.nan)
    hidden.requires_grad_(True)
    out = dflash_loss(hidden, inputs["weight"], labels, inputs["valid"], gamma=4.0)
    out.loss.backward()
    torch.testing.assert_close(out.loss, base.loss, rtol=1e-12, atol=0)
    assert torch.all(torch.isfinite(hidden.grad))
    assert torch.all(hidden.grad[~inputs["valid"]] == 0)


def test_no_grad_mode() -> None:
    inputs = make_inputs()
    hidden = inputs["hidden"].clone().requires_grad_(True)
    with torch.no_grad():
        out = dflash_loss(hidden, inputs["weight"], inputs["labels"], inputs["valid"], gamma=4.0)
    assert not out.loss.requires_grad
    ref, _ = reference_loss(inputs["hidden"], inputs["weight"], inputs["labels"], inputs["valid"], gamma=4.0)
    torch.testing.assert_close(out.loss, ref, rtol=1e-10, atol=0)


def test_the_compiled_chunk_is_one_graph_whether_the_blocks_fill_whole_chunks_or_not(monkeypatch) -> None:
    """On CUDA the per-chunk function runs compiled (static shapes) on blocks padded to whole chunks. Dynamo guards on
    requires_grad: a padded chunk (a copy made under forward's no-grad) and a whole one (a view of the input) must
    look alike, or the graph compiles twice. Here forced on (aot_eager on the CPU), counting compiled graphs."""
    from torch._dynamo.utils import counters

    from dflash_trainer.model import loss as loss_module

    force_compiled_chunks(monkeypatch, loss_module, "_loss_chunk", "_LossSpec")
    torch._dynamo.reset()
    counters.clear()
    for blocks in (8, 7):  # two whole chunks of 4, then a padded last chunk
        inputs = make_inputs(rows=1, blocks=blocks)
        hidden = inputs["hidden"].requires_grad_(True)
        out = dflash_loss(hidden, inputs["weight"], inputs["labels"], inputs["valid"], gamma=4.0, chunk_blocks=4)
        out.loss.backward()
        assert hidden.grad is not None and hidden.grad.abs().sum() > 0
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


def test_loss_sum_normalises_globally_over_micro_batches() -> None:
    """loss_sum over two halves divided by the total weight equals the loss of the whole batch."""
    inputs = make_inputs(rows=4, seed=23)
    hidden = inputs["hidden"].clone().requires_grad_(True)
    whole = dflash_loss(hidden, inputs["weight"], inputs["labels"], inputs["valid"], gamma=4.0)
    halves = [
        dflash_loss(hidden[part], inputs["weight"], inputs["labels"][part], inputs["valid"][part], gamma=4.0)
        for part in (slice(0, 2), slice(2, 4))
    ]
    accumulated = LossMetrics.zeros(8)
    for half in halves:
        accumulated.add_(half.metrics)
    torch.testing.assert_close(accumulated.to_tensor(), whole.metrics.to_tensor(), rtol=1e-12, atol=0)
    global_loss = sum(h.loss_sum for h in halves) / accumulated.weight_sum
    torch.testing.assert_close(global_loss, whole.loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(accumulated.mean_loss(), whole.loss.detach(), rtol=1e-12, atol=0)
    (grad_whole,) = torch.autograd.grad(whole.loss, hidden)
    (grad_global,) = torch.autograd.grad(global_loss, hidden)
    torch.testing.assert_close(grad_global, grad_whole, rtol=1e-12, atol=1e-15)


def test_expected_acceptance_hand_computed() -> None:
    correct = torch.tensor([0.0, 8.0, 6.0, 2.0])
    count = torch.tensor([0.0, 10.0, 8.0, 4.0])
    # acc = 0.8, 0.75, 0.5 -> 1 + 0.8 + 0.6 + 0.3
    assert float(expected_acceptance(correct, count)) == pytest.approx(2.7)
    # A slot that was never counted has accuracy 0 and ends the product.
    count_gap = torch.tensor([0.0, 10.0, 0.0, 4.0])
    assert float(expected_acceptance(correct, count_gap)) == pytest.approx(1.8)


def test_prefix_and_slot_metrics_hand_built() -> None:
    """Blocks whose drafter is right exactly at chosen slots; B = 4 (slots 1..3)."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.nn.functional.normalize(torch.randn(VOCAB, WIDTH, generator=gen, dtype=torch.float64), dim=1)
    right = torch.tensor(
        [[[0, 1, 1, 0], [0, 0, 1, 1], [0, 1, 1, 1], [0, 1, 1, 1], [0, 1, 1, 1]]],
        dtype=torch.bool,
    )
    valid = torch.tensor(
        [[[0, 1, 1, 1], [0, 1, 1, 1], [0, 1, 1, 1], [0, 0, 1, 1], [0, 1, 0, 1]]],
        dtype=torch.bool,
    )
    labels = torch.randint(0, VOCAB, right.shape, generator=gen)
    labels = torch.where(valid, labels, torch.zeros_like(labels))
    predicted = torch.where(right, labels, (labels + 1) % VOCAB)  # right also on some invalid slots
    hidden = 200.0 * weight[predicted]
    metrics = dflash_loss(hidden, weight, labels, valid, gamma=4.0).metrics
    # Prefixes 2, 0, 3, (not counted: slot 1 invalid), 1 (stops at the invalid slot 2).
    assert float(metrics.prefix_sum) == 6.0
    assert float(metrics.prefix_blocks) == 4.0
    assert metrics.count_per_slot.tolist() == [0.0, 4.0, 4.0, 5.0]
    assert metrics.correct_per_slot.tolist() == [0.0, 3.0, 4.0, 4.0]
    assert float(metrics.prefix_acceptance()) == pytest.approx(2.5)
    assert float(metrics.expected_acceptance()) == pytest.approx(1 + 0.75 + 0.75 + 0.75 * 0.8)


def test_metrics_tensor_round_trip() -> None:
    metrics = LossMetrics(
        loss_sum=torch.tensor(3.5, dtype=torch.float64),
        weight_sum=torch.tensor(2.0, dtype=torch.float64),
        correct_per_slot=torch.tensor([0.0, 4.0, 3.0], dtype=torch.float64),
        count_per_slot=torch.tensor([0.0, 5.0, 4.0], dtype=torch.float64),
        prefix_sum=torch.tensor(6.0, dtype=torch.float64),
        prefix_blocks=torch.tensor(5.0, dtype=torch.float64),
    )
    flat = metrics.to_tensor()
    assert flat.dtype == torch.float64
    assert flat.shape == (4 + 2 * 3,)
    back = LossMetrics.from_tensor(flat.clone())
    for name in ("loss_sum", "weight_sum", "correct_per_slot", "count_per_slot", "prefix_sum", "prefix_blocks"):
        torch.testing.assert_close(getattr(back, name), getattr(metrics, name), rtol=0, atol=0)
    back.add_(metrics)
    assert float(back.loss_sum) == 7.0
    assert back.count_per_slot.tolist() == [0.0, 10.0, 8.0]
    with pytest.raises(ValueError, match="block size"):
        back.add_(LossMetrics.zeros(4))
    with pytest.raises(ValueError, match="4 \\+ 2B"):
        LossMetrics.from_tensor(torch.zeros(7, dtype=torch.float64))


def test_bad_inputs_name_the_argument() -> None:
    inputs = make_inputs()
    args = (inputs["hidden"], inputs["weight"], inputs["labels"], inputs["valid"])
    with pytest.raises(ValueError, match="valid must be bool"):
        dflash_loss(*args[:3], inputs["valid"].long(), gamma=4.0)
    with pytest.raises(ValueError, match="labels must be integer"):
        dflash_loss(args[0], args[1], inputs["labels"][:, :2], args[3], gamma=4.0)
    with pytest.raises(ValueError, match="lm_head_weight must be"):
        dflash_loss(args[0], inputs["weight"][:, :4], *args[2:], gamma=4.0)
    with pytest.raises(ValueError, match="needs target_hidden"):
        dflash_loss(*args, gamma=4.0, label_source="soft")
    with pytest.raises(ValueError, match="weighting"):
        dflash_loss(*args, gamma=4.0, weighting="linear")
    with pytest.raises(ValueError, match="chunk_blocks"):
        dflash_loss(*args, gamma=4.0, chunk_blocks=0)


def test_trainable_lm_head_is_refused() -> None:
    inputs = make_inputs()
    hidden = inputs["hidden"].clone().requires_grad_(True)
    weight = inputs["weight"].clone().requires_grad_(True)
    with pytest.raises(ValueError, match="lm_head_weight requires grad"):
        dflash_loss(hidden, weight, inputs["labels"], inputs["valid"], gamma=4.0)
