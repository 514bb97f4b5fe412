"""FP8 target linears: the quantisation against float64, the scaled matmul against its own math, and the swap.

CPU torch runs `torch._scaled_mm` too (a reference kernel), so the whole `Fp8Linear` path is exercised here; the
GPU kernel is compared with the same references in `test_packed_target_gpu.py`.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dflash_trainer.model.fp8 import E4M3, E4M3_MAX
from dflash_trainer.targets.capture import FeatureCapture
from dflash_trainer.targets.fp8 import Fp8Linear, quantize_decoder_linears, quantize_rowwise

# Every finite e4m3 value, as float64 (the 256 bit patterns, NaNs dropped).
E4M3_VALUES = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(E4M3).double()
E4M3_VALUES = E4M3_VALUES[torch.isfinite(E4M3_VALUES)].unique()


def _bf16(shape, seed, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale).to(
        torch.bfloat16
    )


def test_quantised_values_are_the_nearest_e4m3_to_the_scaled_input():
    # Rows of very different magnitudes, a row with one outlier, an all-zero row.
    values = _bf16((6, 64), seed=0) * torch.tensor([1e-3, 1.0, 30.0, 1.0, 1.0, 0.0], dtype=torch.bfloat16)[:, None]
    values[3, 5] = 500.0
    quantised, scale = quantize_rowwise(values)

    assert quantised.dtype == E4M3 and scale.dtype == torch.float32 and scale.shape == (6, 1)
    exact = values.double()
    amax = exact.abs().amax(dim=-1, keepdim=True)
    torch.testing.assert_close(scale.double()[:5], amax[:5] / E4M3_MAX, rtol=2**-23, atol=0)
    scaled = exact / scale.double()  # what gets rounded, in float64
    distance_to_chosen = (quantised.double() - scaled).abs()
    distance_to_nearest = (scaled[..., None] - E4M3_VALUES).abs().amin(dim=-1)
    # Round to nearest (float32 division may sit a hair off float64 exactly at a tie).
    assert (distance_to_chosen <= distance_to_nearest + 1e-6 * scaled.abs().clamp(min=1)).all()
    # Each row's largest element lands on +-448: the full range is used, nothing saturates.
    assert torch.equal(quantised[:5].double().abs().amax(dim=-1), torch.full((5,), E4M3_MAX, dtype=torch.float64))
    assert (quantised[5].double() == 0).all() and torch.isfinite(scale).all()
    # Relative error bound of 3 mantissa bits in the normal range.
    normal = scaled.abs() >= 2**-6
    dequantised = quantised.double() * scale.double()
    assert ((dequantised - exact).abs() <= 2**-4 * exact.abs())[normal].all()


@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_is_the_product_of_the_quantised_operands(bias):
    torch.manual_seed(0)
    linear = nn.Linear(256, 96, bias=bias).to(torch.bfloat16).requires_grad_(False)
    x = _bf16((3, 11, 256), seed=1, scale=2.0)  # leading dims are kept
    fp8 = Fp8Linear(linear)

    out = fp8(x)

    assert out.shape == (3, 11, 96) and out.dtype == torch.bfloat16
    x_q, x_scale = quantize_rowwise(x.reshape(-1, 256))
    reference = (x_q.double() * x_scale.double()) @ fp8.dequantized_weight().double().T  # float64 of the same math
    if bias:
        reference = reference + linear.bias.double()
    # Only the bf16 output rounding (2^-8 relative) and the fp32 accumulation separate the two.
    torch.testing.assert_close(out.reshape(-1, 96).double(), reference, rtol=2**-7, atol=1e-3 * reference.abs().max())

    # Against the exact bf16 operands: ~3.6% RMS relative error expected (see fp8.py), bounded at 5%.
    exact = x.reshape(-1, 256).double() @ linear.weight.double().T
    if bias:
        exact = exact + linear.bias.double()
    error = (out.reshape(-1, 96).double() - exact).norm() / exact.norm()
    assert 0.01 < error < 0.05


def test_swap_replaces_the_decoder_linears_and_nothing_else(tiny_qwen3):
    model = copy.deepcopy(tiny_qwen3).to(torch.bfloat16)
    reference = copy.deepcopy(model)
    untouched = {
        name: tensor.clone() for name, tensor in model.state_dict().items() if "_proj." not in name
    }  # embedding, LM head, norms (q/k norms included), rotary buffers

    count = quantize_decoder_linears(model.model.layers)

    assert count == 7 * 6  # q, k, v, o, gate, up, down in each of the 6 layers
    for layer in model.model.layers:
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            assert isinstance(getattr(layer.self_attn, name), Fp8Linear)
        for name in ("gate_proj", "up_proj", "down_proj"):
            assert isinstance(getattr(layer.mlp, name), Fp8Linear)
    assert not any(type(m) is nn.Linear for m in model.model.layers.modules())
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight.dtype == torch.bfloat16
    after = model.state_dict()
    for name, tensor in untouched.items():
        assert torch.equal(after[name], tensor), name
    # Parameter counts (FLOPs, MFU) still see the quantised layers.
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in reference.parameters())

    # The quantised target still computes nearly the same features. This tiny model's wide random weights (init
    # range 0.2, sharp attention) amplify rounding: measured 11% after layer 0 to 24% after layer 5, where bf16
    # itself is 1.2-2.2% off float32. A broken quantisation is off by ~100%.
    input_ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    expected = FeatureCapture(reference, [1, 5]).capture(input_ids).features.double()
    features = FeatureCapture(model, [1, 5]).capture(input_ids).features.double()
    error = (features - expected).norm() / expected.norm()
    assert 0.05 < error < 0.3


def test_swap_covers_linear_attention_layers(tiny_qwen3_5):
    model = copy.deepcopy(tiny_qwen3_5).to(torch.bfloat16)
    quantize_decoder_linears(model.model.layers)
    linear_attention = model.model.layers[0].linear_attn
    assert isinstance(linear_attention.in_proj_qkv, Fp8Linear) and isinstance(linear_attention.out_proj, Fp8Linear)
    features = FeatureCapture(model, [3]).capture(torch.randint(0, 256, (1, 16))).features
    assert torch.isfinite(features).all()


def test_routers_and_odd_sizes_stay_exact():
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = nn.Linear(64, 16)  # an MoE router
            self.odd = nn.Linear(64, 24)  # N not a multiple of 16
            self.proj = nn.Linear(64, 32)

    layers = nn.ModuleList([Block()]).to(torch.bfloat16)
    assert quantize_decoder_linears(layers) == 1
    assert type(layers[0].gate) is nn.Linear and type(layers[0].odd) is nn.Linear
    assert isinstance(layers[0].proj, Fp8Linear)


def test_non_bf16_targets_are_refused(tiny_qwen3):
    with pytest.raises(ValueError, match="bfloat16"):
        quantize_decoder_linears(copy.deepcopy(tiny_qwen3).model.layers)
