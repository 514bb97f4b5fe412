"""FP8 training of the drafter's linear layers (`model/fp8.py`): each GEMM against float64, the drafter swap, the
compiled regions, and a tiny training run whose loss falls.

CPU torch runs `torch._scaled_mm` as a reference kernel (dequantise, multiply in float32), so every piece runs here;
`test_gpu_fp8_drafter_gradients_match_bf16` checks the CUDA kernels under torch.compile against bf16.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.fx.experimental._config as fx_config
from torch import nn
from torch._dynamo.utils import counters
from torch.library import opcheck

from dflash_trainer.config import ConfigError, load_config
from dflash_trainer.model import fp8
from dflash_trainer.model.attention import build_masks
from dflash_trainer.model.drafter import DFlashDrafter
from dflash_trainer.model.fp8 import (
    E4M3,
    E5M2,
    Fp8TrainingLinear,
    convert_to_fp8_training,
    fp8_linear,
    fp8_training_problem,
    quantize,
)
from model_helpers import random_packed_batch, tiny_drafter_config


def _finite_values(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of an FP8 format, as float64 (its 256 bit patterns, NaNs and infinities dropped)."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).double()
    return values[torch.isfinite(values)].unique()


def _dequantized(values: torch.Tensor, dtype: torch.dtype, *, rowwise: bool) -> torch.Tensor:
    quantised, scale = quantize(values, dtype, rowwise=rowwise)
    return quantised.double() * scale.double()


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.detach().double() - expected).norm() / expected.norm())


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("rowwise", [True, False], ids=["rowwise", "tensorwise"])
def test_quantised_values_are_the_nearest_values_of_the_format(dtype, rowwise):
    gen = torch.Generator().manual_seed(0)
    magnitudes = torch.tensor([1e-3, 1.0, 30.0, 1.0, 0.0], dtype=torch.float64)[:, None]  # a zero row too
    values = (torch.randn(5, 64, generator=gen, dtype=torch.float64) * magnitudes).float()
    values[3, 5] = 500.0  # one outlier
    quantised, scale = quantize(values, dtype, rowwise=rowwise)

    largest = torch.finfo(dtype).max
    assert quantised.dtype == dtype and quantised.is_contiguous() and scale.dtype == torch.float32
    amax = values.double().abs().amax(dim=-1, keepdim=True) if rowwise else values.double().abs().amax()
    assert scale.shape == ((5, 1) if rowwise else ())
    nonzero = amax > 0
    torch.testing.assert_close(scale.double()[nonzero], (amax / largest)[nonzero], rtol=2**-22, atol=0)
    scaled = values.double() / scale.double()  # what gets rounded
    distance_to_chosen = (quantised.double() - scaled).abs()
    distance_to_nearest = (scaled[..., None] - _finite_values(dtype)).abs().amin(dim=-1)
    assert (distance_to_chosen <= distance_to_nearest + 1e-6 * scaled.abs().clamp(min=1)).all()
    # The largest magnitude lands on the format's largest value: the whole range is used, nothing saturates.
    peaks = quantised.double().abs().amax(dim=-1) if rowwise else quantised.double().abs().amax()
    expected_peaks = torch.tensor([largest] * 4 + [0.0], dtype=torch.float64) if rowwise else largest
    torch.testing.assert_close(peaks, torch.as_tensor(expected_peaks, dtype=torch.float64))
    assert torch.isfinite(scale).all() and (quantised[4].double() == 0).all()


def _gemms(scaling: str, tokens: int, *, bias: bool = False):
    """x [tokens, 64] -> y [tokens, 48] through fp8_linear on float32 inputs (no autocast: the CPU's float32
    output), backward from a random output gradient. Returns the float64 inputs and the three results."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, 64, generator=gen, dtype=torch.float64)
    weight = torch.randn(48, 64, generator=gen, dtype=torch.float64) * 0.05
    grad_out = torch.randn(tokens, 48, generator=gen, dtype=torch.float64)
    x32 = x.float().requires_grad_()
    w32 = weight.float().requires_grad_()
    b32 = torch.randn(48, generator=gen).requires_grad_() if bias else None
    out = fp8_linear(x32, w32, b32, rowwise=scaling == "rowwise")
    out.backward(grad_out.float())
    return x, weight, grad_out, out, x32.grad, w32.grad, b32


@pytest.mark.parametrize("dtype", [fp8.E4M3, fp8.E5M2], ids=["e4m3", "e5m2"])
def test_the_second_layout_is_the_exact_transpose_padded_with_zeros(dtype):
    """The tensorwise ops keep the transposed cast for the backward (`quantize_both_layouts`): bit for bit the
    transpose of the first layout, then zero columns up to a multiple of 16 tokens."""
    values = torch.randn(40, 32, generator=torch.Generator().manual_seed(9)).bfloat16() * 3
    quantised, scale, transposed = fp8.quantize_both_layouts(values, dtype)
    reference, reference_scale = fp8.quantize(values, dtype, rowwise=False)
    assert torch.equal(scale, reference_scale) and torch.equal(quantised.view(torch.uint8), reference.view(torch.uint8))
    assert transposed.shape == (32, 48) and transposed.is_contiguous()
    assert torch.equal(transposed[:, :40].view(torch.uint8), quantised.t().view(torch.uint8))
    assert not transposed[:, 40:].view(torch.uint8).any()


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("tokens", [48, 40], ids=["aligned", "padded"])  # 40: the weight grad pads to 48 tokens
def test_each_gemm_is_the_float64_product_of_its_quantised_operands(scaling, tokens):
    """Forward, input grad and weight grad each equal the float64 product of the operands as the recipe quantises
    them (module docstring), up to float32 accumulation: the layouts, transposes, scales and padding are right."""
    x, weight, grad_out, out, grad_x, grad_w, _ = _gemms(scaling, tokens)
    x32, w32, g32 = x.float(), weight.float(), grad_out.float()
    if scaling == "tensorwise":
        forward = _dequantized(x32, E4M3, rowwise=False) @ _dequantized(w32, E4M3, rowwise=False).T
        grad = _dequantized(g32, E5M2, rowwise=False)
        input_grad = grad @ _dequantized(w32, E4M3, rowwise=False)
        weight_grad = grad.T @ _dequantized(x32, E4M3, rowwise=False)
    else:
        forward = _dequantized(x32, E4M3, rowwise=True) @ _dequantized(w32, E4M3, rowwise=True).T
        input_grad = _dequantized(g32, E4M3, rowwise=True) @ _dequantized(w32.t(), E4M3, rowwise=True).T
        weight_grad = _dequantized(g32.t(), E4M3, rowwise=True) @ _dequantized(x32.t(), E4M3, rowwise=True).T
    for actual, expected in ((out, forward), (grad_x, input_grad), (grad_w, weight_grad)):
        assert actual.shape == expected.shape and actual.dtype == torch.float32
        torch.testing.assert_close(actual.double(), expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


# Documented RMS errors (model/fp8.py): ~3.6 % for two e4m3 operands, ~5.7 % with an e5m2 gradient. The lower bounds
# make sure the GEMMs did run in FP8 (bf16 would be ~0.3 %, float32 ~0).
FP8_ERROR = {
    ("tensorwise", "forward"): (0.02, 0.05),
    ("tensorwise", "backward"): (0.035, 0.08),
    ("rowwise", "forward"): (0.02, 0.05),
    ("rowwise", "backward"): (0.02, 0.05),
}


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_fp8_gemms_are_within_the_documented_error_of_the_exact_float64_gemms(scaling):
    x, weight, grad_out, out, grad_x, grad_w, _ = _gemms(scaling, 256)
    low, high = FP8_ERROR[scaling, "forward"]
    assert low < _relative_error(out, x @ weight.T) < high
    low, high = FP8_ERROR[scaling, "backward"]
    assert low < _relative_error(grad_x, grad_out @ weight) < high
    assert low < _relative_error(grad_w, grad_out.T @ x) < high


def test_fp8_linear_under_bf16_autocast_keeps_the_master_dtypes_and_the_bias():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 24, 64, generator=gen).requires_grad_()  # leading dims are kept
    weight = (0.05 * torch.randn(48, 64, generator=gen)).requires_grad_()  # float32 master weight
    bias = torch.randn(48, generator=gen).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fp8_linear(x, weight, bias)
    assert out.shape == (2, 24, 48) and out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert x.grad.dtype == weight.grad.dtype == torch.float32
    torch.testing.assert_close(bias.grad, torch.full((48,), 48.0))  # sum over the 48 tokens
    exact = x.detach().double() @ weight.detach().double().T + bias.detach().double()
    assert 0.01 < _relative_error(out, exact) < 0.05


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_several_fp8_linears_in_one_compiled_graph_compute_what_eager_does(scaling):
    """Each FP8 matmul is one opaque op call in the graph; a layer holds several. Token counts of 40 and 24 take the
    weight grad's padding path."""
    from dflash_trainer.compiling import compile_dynamic

    def two_projections(x, ctx, w1, w2):
        rowwise = scaling == "rowwise"
        return fp8_linear(x, w1, rowwise=rowwise).square().sum() + fp8_linear(ctx, w2, rowwise=rowwise).sum()

    gen = torch.Generator().manual_seed(4)
    inputs = [torch.randn(*shape, generator=gen) for shape in ((1, 40, 64), (1, 24, 64), (48, 64), (32, 64))]
    grads = []
    for fn in (two_projections, compile_dynamic(two_projections, backend="eager")):
        leaves = [t.clone().requires_grad_() for t in inputs]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            fn(*leaves).backward()
        grads.append([leaf.grad for leaf in leaves])
    torch._dynamo.reset()
    for eager, compiled in zip(*grads, strict=True):
        torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


def test_the_fp8_ops_pass_torch_opcheck():
    """Schema (no input mutated), fake kernels (shapes, dtypes, strides) and the autograd registration, against the
    real kernels. torch's harness sums and compares every tensor it meets, which the CPU cannot do for FP8 tensors:
    the forward's mutation check and AOT autograd replay, and the tensorwise backward's mutation check (its inputs
    are FP8), are left to the two tests below and a byte comparison here."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(48, 64, generator=gen).requires_grad_()
    weight = (0.05 * torch.randn(32, 64, generator=gen)).requires_grad_()
    grad_out = torch.randn(48, 32, generator=gen).bfloat16()
    for rowwise, fast_backward in ((False, False), (False, True), (True, False)):
        forward = (x, weight, rowwise, torch.bfloat16, fast_backward)
        opcheck(torch.ops.dflash_fp8.linear.default, forward, test_utils=("test_schema", *OPCHECK_TRACING))
    _, x_q, x_scale, w_q, w_scale = torch.ops.dflash_fp8.linear(x.detach(), weight.detach(), False, torch.bfloat16)
    fp8_inputs = [t.view(torch.uint8).clone() for t in (x_q, w_q)]
    tracing_and_replay = (*OPCHECK_TRACING, "test_aot_dispatch_dynamic")
    for fast_accum in (False, True):
        tensorwise = (grad_out, x_q, x_scale, w_q, w_scale, torch.float32, torch.float32, fast_accum)
        opcheck(torch.ops.dflash_fp8.tensorwise_linear_backward.default, tensorwise, test_utils=tracing_and_replay)
    assert all(torch.equal(t.view(torch.uint8), before) for t, before in zip((x_q, w_q), fp8_inputs, strict=True))
    rowwise = (grad_out, x.detach(), weight.detach())
    opcheck(torch.ops.dflash_fp8.rowwise_linear_backward.default, rowwise)  # every check, AOT autograd replay included


OPCHECK_TRACING = ("test_faketensor", "test_autograd_registration")


def _stacked_linears(x, w1, w2, w3, rowwise: bool):
    """Two FP8 linears in a row (SiLU between them) and a third reading the same input, as in a layer."""
    hidden = fp8_linear(x, w1, rowwise=rowwise)
    out = fp8_linear(torch.nn.functional.silu(hidden), w2, rowwise=rowwise)
    return out.float().square().mean() + fp8_linear(x, w3, rowwise=rowwise).float().mean()


def _stacked_grads(fn, scaling: str) -> list[list[torch.Tensor]]:
    """The gradients of x, w1, w2, w3 under bf16 autocast for 40 tokens (the weight grad pads) and 64 (no padding,
    a second shape the symbolic sizes serve)."""
    gen = torch.Generator().manual_seed(6)
    weights = [0.1 * torch.randn(*shape, generator=gen) for shape in ((96, 64), (48, 96), (32, 64))]
    grads = []
    for tokens in (40, 64):
        x = torch.randn(2, tokens // 2, 64, generator=gen)
        leaves = [t.clone().requires_grad_() for t in (x, *weights)]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            fn(*leaves, scaling == "rowwise").backward()
        grads.append([leaf.grad for leaf in leaves])
    return grads


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_compiled_graphs_call_the_fp8_ops_and_compute_what_eager_does(scaling):
    """AOT autograd's forward and backward graphs hold one call of the opaque ops per linear and no traced scaled
    matmul: the compiled step runs the eager kernels (module docstring), so its gradients are bitwise the eager ones."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    targets: list[list[str]] = []

    def record(gm, example_inputs):
        targets.append([str(node.target) for node in gm.graph.nodes if node.op == "call_function"])
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    compiled = torch.compile(
        _stacked_linears, dynamic=True, backend=aot_autograd(fw_compiler=record, bw_compiler=record)
    )
    compiled_grads = _stacked_grads(compiled, scaling)
    torch._dynamo.reset()
    assert len(targets) == 2, targets  # one forward and one backward graph serve both shapes
    forward, backward = targets
    assert forward.count("dflash_fp8.linear.default") == 3
    assert backward.count(f"dflash_fp8.{scaling}_linear_backward.default") == 3
    assert not any("scaled_mm" in target for target in forward + backward)
    for eager, actual in zip(_stacked_grads(_stacked_linears, scaling), compiled_grads, strict=True):
        for expected, grad in zip(eager, actual, strict=True):
            torch.testing.assert_close(grad, expected, rtol=0, atol=0)


def _record_accumulation(monkeypatch) -> list[bool]:
    """Every scaled matmul's `fast_accum` from now on, in call order (the ops look `scaled_matmul` up at run time)."""
    calls: list[bool] = []
    original = fp8.scaled_matmul

    def recording(*args, fast_accum=False, **kwargs):
        calls.append(fast_accum)
        return original(*args, fast_accum=fast_accum, **kwargs)

    monkeypatch.setattr(fp8, "scaled_matmul", recording)
    return calls


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_tensorwise_fast_accumulates_its_backward_fast_and_is_tensorwise_otherwise(compiled, monkeypatch):
    """`tensorwise_fast` changes one thing against `tensorwise`: its two backward GEMMs ask the scaled matmul for
    fast accumulation (the forward always does), eagerly and through AOT autograd's graphs. The CPU's reference
    kernel accumulates in float32 either way, so the gradients here are bitwise tensorwise's."""
    calls = _record_accumulation(monkeypatch)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(40, 64, generator=gen)
    linear = nn.Linear(64, 32, bias=False)
    grads, accumulation = {}, {}
    for scaling in ("tensorwise", "tensorwise_fast"):
        layer = Fp8TrainingLinear(linear, scaling=scaling)
        assert repr(layer).endswith(f"fp8 {scaling})")
        step = torch.compile(layer, dynamic=True, backend="aot_eager") if compiled else layer
        torch._dynamo.reset()
        leaf = x.clone().requires_grad_()
        linear.weight.grad = None
        calls.clear()
        step(leaf).square().mean().backward()
        accumulation[scaling] = list(calls)
        grads[scaling] = (leaf.grad, linear.weight.grad.clone())
    torch._dynamo.reset()
    assert accumulation == {"tensorwise": [True, False, False], "tensorwise_fast": [True, True, True]}
    for fast, exact in zip(grads["tensorwise_fast"], grads["tensorwise"], strict=True):
        assert torch.equal(fast, exact)


@pytest.mark.slow  # Inductor's C++ compile: ~20 s on 2 shared cores for both scalings (~40 s with the quantiser)
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("quantiser", ["eager", "compiled"])
def test_inductor_compiled_fp8_gradients_equal_the_eager_ones(scaling, quantiser, monkeypatch):
    """As the layers compile for training (Inductor, symbolic sizes): every gradient within 1e-6 of eager's (the
    FP8 GEMMs are the eager ones; Inductor's own kernels for SiLU and the loss may round differently). `compiled`:
    the ops quantise with the separately compiled quantiser, CUDA's path, forced here on the CPU: it runs nested
    inside the compiled graph's opaque ops and must give the same gradients."""
    if quantiser == "compiled":
        monkeypatch.setattr(fp8, "compiled_quantisers_on", lambda device: True)
    torch._dynamo.reset()
    compiled_grads = _stacked_grads(torch.compile(_stacked_linears, dynamic=True, backend="inductor"), scaling)
    torch._dynamo.reset()
    for eager, actual in zip(_stacked_grads(_stacked_linears, scaling), compiled_grads, strict=True):
        for expected, grad in zip(eager, actual, strict=True):
            assert grad.abs().sum() > 0 and _relative_error(grad, expected.double()) < 1e-6


@pytest.mark.slow  # Inductor's C++ compile of the quantisers: ~30 s on 2 shared cores
def test_the_compiled_quantisers_stay_within_dynamos_recompile_limit(monkeypatch):
    """Every kind of quantisation the ops make (both scalings; activations in bf16, float32 master weights as
    `nn.Parameter`s and detached, contiguous and transposed; eager and compiled callers; two token counts) runs
    compiled: none of the quantisers reaches dynamo's recompile limit, past which it would run eagerly."""
    monkeypatch.setattr(fp8, "compiled_quantisers_on", lambda device: True)
    torch._dynamo.reset()
    # The config's own patch: monkeypatch's undo deletes a torch config key (torch 2.13), breaking later compiles.
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        compiled = torch.compile(_stacked_linears, dynamic=True, backend="inductor")
        for scaling in ("tensorwise", "rowwise"):
            _stacked_grads(_stacked_linears, scaling)  # eager callers
            _stacked_grads(compiled, scaling)
            layer = Fp8TrainingLinear(nn.Linear(64, 32), scaling=scaling)  # a Parameter weight
            with torch.autocast("cpu", dtype=torch.bfloat16):
                layer(torch.randn(48, 64, requires_grad=True)).float().sum().backward()
            assert layer.weight.grad.abs().sum() > 0
    torch._dynamo.reset()


# --------------------------------------------------------------------------------------------- the drafter


def _drafter_output(drafter: DFlashDrafter, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The drafter's output on a random packed batch (SDPA, dense masks; the same embedding for a given seed)."""
    config = drafter.config
    batch = random_packed_batch(config, rows=2, length=48, max_anchors=4, seed=seed)
    torch.manual_seed(seed)
    embed = nn.Embedding(config.vocab_size, config.hidden_size).to(dtype).requires_grad_(False)
    masks = build_masks(
        anchors=batch.anchors,
        anchor_keep=batch.anchor_keep,
        doc_ids=batch.doc_ids,
        block_size=config.block_size,
        variants=drafter.mask_variants,
        backend="sdpa",
    )
    return drafter(
        features=batch.features.to(dtype),
        block_embeds=embed(batch.block_ids),
        ctx_positions=batch.position_ids,
        block_positions=batch.block_pos,
        masks=masks,
        backend="sdpa",
    )


def _drafter_step(drafter: DFlashDrafter, *, seed: int = 0, dtype: torch.dtype = torch.float32):
    """One forward and backward (of a loss that weighs every hidden unit differently): (output, grads)."""
    drafter.zero_grad(set_to_none=True)
    out = _drafter_output(drafter, seed=seed, dtype=dtype)
    (out.double() * torch.linspace(-1, 1, out.shape[-1], dtype=torch.float64)).square().mean().backward()
    return out.detach(), {name: p.grad.clone() for name, p in drafter.named_parameters()}


def _fp8_copy(scaling: str, **config) -> tuple[DFlashDrafter, DFlashDrafter]:
    torch.manual_seed(0)
    reference = DFlashDrafter(tiny_drafter_config(**config))
    drafter = DFlashDrafter(tiny_drafter_config(**config))
    drafter.load_state_dict(reference.state_dict())
    assert drafter.use_fp8_training(scaling) == (7 * reference.config.num_hidden_layers + 1, 0)
    return reference, drafter


@pytest.mark.parametrize("scaling", ["tensorwise", "tensorwise_fast"])
def test_every_backward_gemm_of_the_drafter_accumulates_as_its_scaling_says(scaling, monkeypatch):
    """The drafter's fused q/k/v and gate/up GEMMs (`fused_linear`) and its single linears: with `tensorwise_fast`
    every scaled matmul accumulates fast, with `tensorwise` the forward ones only (one per FP8 linear call)."""
    calls = _record_accumulation(monkeypatch)
    _, drafter = _fp8_copy(scaling, num_hidden_layers=1)
    _drafter_step(drafter)
    # Per layer: fused q/k/v, o, fused gate/up, down; then fc: 5 FP8 linears, each one forward and two backward GEMMs.
    assert len(calls) == 15, calls
    assert calls.count(True) == (15 if scaling == "tensorwise_fast" else 5), calls


def test_the_swap_converts_every_projection_and_keeps_names_and_parameters():
    drafter = DFlashDrafter(tiny_drafter_config(num_hidden_layers=2))
    names = list(drafter.state_dict())
    parameters = dict(drafter.named_parameters())
    assert drafter.use_fp8_training("rowwise") == (15, 0)  # 7 per layer and fc
    assert list(drafter.state_dict()) == names
    assert all(p is parameters[name] for name, p in drafter.named_parameters())  # the optimizer's tensors
    linears = [m for m in drafter.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 15 and all(isinstance(m, Fp8TrainingLinear) and m.rowwise for m in linears)
    assert "fp8 rowwise" in repr(drafter.fc)
    fast = DFlashDrafter(tiny_drafter_config(num_hidden_layers=2))
    assert fast.use_fp8_training("tensorwise_fast") == (15, 0)
    linears = [m for m in fast.modules() if isinstance(m, Fp8TrainingLinear)]
    assert len(linears) == 15 and all(m.fast_backward and not m.rowwise for m in linears)
    with pytest.raises(ValueError, match="tensorwise_fast"):
        DFlashDrafter(tiny_drafter_config(num_hidden_layers=1)).use_fp8_training("columnwise")


def test_the_context_keys_and_values_stay_out_of_fp8(monkeypatch):
    """Every FP8 GEMM of a layer reads the block (its q/k/v, o, gate/up, down), none the context: the context's
    k/v projection is narrow and over many rows, slower in FP8 than in bf16 (`DrafterAttention.forward`)."""
    from dflash_trainer.model import drafter as drafter_module

    rows_seen = []
    original = drafter_module.fp8_linear

    def recording(x, weight, bias=None, *, rowwise, fast_backward):
        rows_seen.append((x.shape[:-1].numel(), weight.shape[0]))
        return original(x, weight, bias, rowwise=rowwise, fast_backward=fast_backward)

    monkeypatch.setattr(drafter_module, "fp8_linear", recording)
    drafter = DFlashDrafter(tiny_drafter_config(num_hidden_layers=1))
    drafter.use_fp8_training("tensorwise")
    _drafter_output(drafter)
    attention = drafter.layers[0].self_attn
    kv_width = attention.k_proj.out_features + attention.v_proj.out_features
    q_width = attention.q_proj.out_features + kv_width
    widths = sorted(width for _, width in rows_seen)
    assert kv_width not in widths and q_width in widths  # fused q/k/v on the block in FP8, context k/v not
    assert len(rows_seen) == 2  # fused q/k/v and gate/up here; o, down and fc in Fp8TrainingLinear.forward


def test_sizes_that_are_not_multiples_of_16_stay_in_high_precision():
    block = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 24), nn.LayerNorm(24))
    assert convert_to_fp8_training(block) == (1, 1)
    assert isinstance(block[0], Fp8TrainingLinear) and type(block[1]) is nn.Linear
    with pytest.raises(ValueError, match="scaling"):
        convert_to_fp8_training(block, scaling="columnwise")


def _projection_grad_errors(grads: dict, exact: dict) -> dict[str, float]:
    """Relative error of each quantised weight's gradient (the norms' weights and the final norm, which dominates
    a flat comparison, are left out)."""
    return {
        name: _relative_error(grad, exact[name].double())
        for name, grad in grads.items()
        if name.endswith("proj.weight") or name == "fc.weight"
    }


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_fp8_drafter_gradients_are_close_to_float64_and_eval_mode_is_exact(scaling):
    reference, drafter = _fp8_copy(scaling)
    _, exact_grads = _drafter_step(reference.double(), dtype=torch.float64)
    _, grads = _drafter_step(drafter)
    errors = _projection_grad_errors(grads, exact_grads)
    # Measured: tensorwise 5.5-14 % per weight (median 7 %), rowwise 3.9-10 % (median 4.7 %); the gradients reaching
    # the first layer and fc have passed the most FP8 GEMMs. A wrong layout or scale is off by ~100 %.
    median = sorted(errors.values())[len(errors) // 2]
    assert len(errors) == 15 and max(errors.values()) < 0.2 and 0.02 < median < 0.1, errors
    # Evaluation and export see the float32 weights: eval mode computes exactly what the plain drafter does.
    drafter.eval()
    reference.float().eval()
    with torch.no_grad():
        torch.testing.assert_close(_drafter_output(drafter), _drafter_output(reference), rtol=0, atol=0)


@pytest.mark.slow  # dynamo traces the layers: 15-25 s on 2 shared cores
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_the_layers_compile_as_one_region_shared_by_every_layer(fp8):
    """Regional compilation: the layers share one code object and read no per-layer value in training, so three
    layers compile one frame; the two norms share another; an FP8 context projection is one more region."""
    torch.manual_seed(0)
    drafter = DFlashDrafter(tiny_drafter_config(num_hidden_layers=3))
    twin = DFlashDrafter(tiny_drafter_config(num_hidden_layers=3))
    twin.load_state_dict(drafter.state_dict())
    if fp8:
        drafter.use_fp8_training()
        twin.use_fp8_training()
    with fx_config.patch(use_duck_shape=True):  # compile_layers switches it off; restored on exit
        torch._dynamo.reset()
        counters.clear()
        drafter.compile_layers(backend="eager")
        _drafter_step(drafter)
        _, grads = _drafter_step(drafter, seed=1)  # other shapes: served by the same frames
        assert counters["frames"]["ok"] == (3 if fp8 else 2)
    torch._dynamo.reset()
    # The first layer's input made a leaf that requires grad (DFlashDrafter.forward) changes no gradient.
    _, eager_grads = _drafter_step(twin, seed=1)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], rtol=0, atol=0)


def test_config_keys_and_where_fp8_runs(monkeypatch):
    config = load_config(None, ["drafter.fp8=true", "drafter.fp8_scaling=rowwise"])
    assert config.drafter.fp8 and config.drafter.fp8_scaling == "rowwise"
    assert load_config(None, ["drafter.fp8_scaling=tensorwise_fast"]).drafter.fp8_scaling == "tensorwise_fast"
    assert not load_config(None, []).drafter.fp8  # off by default
    with pytest.raises(ConfigError, match=r"drafter\.fp8_scaling"):
        load_config(None, ["drafter.fp8_scaling=columnwise"])
    assert fp8_training_problem(torch.device("cpu")) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert "8.9" in fp8_training_problem(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fp8_training_problem(torch.device("cuda")) is None


@pytest.mark.slow
def test_training_with_the_fp8_drafter_on_the_cpu_lowers_the_loss(tmp_path):
    """`drafter.fp8=true` end to end on the CPU (torch's reference scaled matmul): the loss falls as in bf16."""
    from dflash_trainer.train.trainer import Trainer
    from train_helpers import save_tiny_target, write_counting_shards, write_recipe

    target = save_tiny_target(tmp_path / "target")
    shards = write_counting_shards(tmp_path / "shards")
    recipe = write_recipe(
        tmp_path / "r.yaml", tmp_path / "run", target, shards, train={"max_steps": 24}, drafter={"fp8": True}
    )
    logged: list[str] = []
    trainer = Trainer(load_config(recipe), log=logged.append)
    assert isinstance(trainer.drafter.fc, Fp8TrainingLinear)
    assert any("8 linear layers train in FP8 (tensorwise scales), 0 in high precision" in line for line in logged)
    trainer.fit()
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum(losses[-3:]) / 3 < 0.6 * sum(losses[:3]) / 3, losses


# ------------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("scaling", ["tensorwise", "tensorwise_fast", "rowwise"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_gpu_fp8_drafter_gradients_match_bf16(scaling, compiled):
    """The FP8 drafter on CUDA (cuBLAS / CUTLASS scaled matmuls, flex attention, bf16 autocast over float32 master
    weights; compiled with symbolic sizes as in training) against the same drafter in bf16 and a float32 reference:
    the gradient of every quantised weight must be within FP8's error of the reference."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs FP8 tensor cores")
    device = torch.device("cuda")
    config = tiny_drafter_config(
        hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=512
    )
    batch = random_packed_batch(config, rows=2, length=512, max_anchors=32, seed=3)
    torch.manual_seed(0)
    embed = nn.Embedding(config.vocab_size, config.hidden_size, device=device).requires_grad_(False)
    weights = DFlashDrafter(config).state_dict()
    results = {}
    for name, precision in (("float32", None), ("bf16", torch.bfloat16), ("fp8", torch.bfloat16)):
        drafter = DFlashDrafter(config).to(device)
        drafter.load_state_dict(weights)
        if name == "fp8":
            drafter.use_fp8_training(scaling)
        if compiled and name != "float32":
            torch._dynamo.reset()
            drafter.compile_layers()
        masks = build_masks(
            anchors=batch.anchors.to(device),
            anchor_keep=batch.anchor_keep.to(device),
            doc_ids=batch.doc_ids.to(device),
            block_size=config.block_size,
            variants=drafter.mask_variants,
            backend="flex",
        )
        with torch.autocast("cuda", dtype=precision or torch.bfloat16, enabled=precision is not None):
            out = drafter(
                features=batch.features.to(device),
                block_embeds=embed(batch.block_ids.to(device)),
                ctx_positions=batch.position_ids.to(device),
                block_positions=batch.block_pos.to(device),
                masks=masks,
                backend="flex",
            )
        (out.float() * torch.linspace(-1, 1, out.shape[-1], device=device)).square().mean().backward()
        results[name] = {n: p.grad.float().cpu() for n, p in drafter.named_parameters()}
    torch._dynamo.reset()
    errors = {name: _projection_grad_errors(results[name], results["float32"]) for name in ("bf16", "fp8")}
    median = {name: sorted(e.values())[len(e) // 2] for name, e in errors.items()}
    # As on the CPU (test_fp8_drafter_gradients_are_close_to_float64...): a few % per weight for FP8, several times
    # less for bf16. A wrong layout or scale is off by ~100 %.
    assert max(errors["fp8"].values()) < 0.25 and median["fp8"] < 0.12, errors
    assert median["bf16"] < 0.03 and median["fp8"] > median["bf16"], median  # FP8 did run


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tokens", [4096, 65536])
def test_gpu_fast_accumulation_of_the_backward_drifts_little_from_float32(tokens):
    """`tensorwise_fast` against `tensorwise` on the same FP8 operands (the GEMMs differ in accumulation only),
    the weight grad contracting over `tokens` (65,536: the SmolLM2 main job's slot count per step) and both against
    float64: the fast accumulator's drift must stay well under the operands' own FP8 error (~5.7 %)."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs FP8 tensor cores")
    gen = torch.Generator(device="cuda").manual_seed(8)
    x = torch.randn(tokens, 512, device="cuda", generator=gen)
    weight = 0.05 * torch.randn(1024, 512, device="cuda", generator=gen)
    grad_out = torch.randn(tokens, 1024, device="cuda", generator=gen) / tokens**0.5
    grads = {}
    for fast in (False, True):
        leaf, w = x.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = fp8_linear(leaf, w, fast_backward=fast)
        out.backward(grad_out.bfloat16())
        grads[fast] = (leaf.grad.double(), w.grad.double())
    exact = (grad_out.double() @ weight.double(), grad_out.double().T @ x.double())
    for index in range(2):
        drift = _relative_error(grads[True][index], grads[False][index])
        errors = [_relative_error(grads[fast][index], exact[index]) for fast in (False, True)]
        assert drift < 0.02 and max(errors) < 0.08, (index, drift, errors)
    # The weight grad's long sum must show the accumulator at all: zero drift would mean the flag never reached it.
    assert _relative_error(grads[True][1], grads[False][1]) > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_training_loop_with_the_fp8_drafter_lowers_the_loss(tmp_path):
    """The real `fit` loop on CUDA with `drafter.fp8=true` (compiled layers, flex, bf16 autocast, fused AdamW): the
    loss must fall as in bf16 (tests/test_gpu.py: halved in 30 steps)."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs FP8 tensor cores")
    from dflash_trainer.train.trainer import Trainer
    from train_helpers import save_tiny_target, write_counting_shards, write_recipe

    target = save_tiny_target(tmp_path / "target")
    shards = write_counting_shards(tmp_path / "shards")
    recipe = write_recipe(tmp_path / "r.yaml", tmp_path / "run", target, shards, train={"max_steps": 30})
    trainer = Trainer(load_config(recipe, ["target.device=cuda", "drafter.fp8=true"]), log=lambda _: None)
    assert isinstance(trainer.drafter.fc, Fp8TrainingLinear) and trainer.backend == "flex"
    trainer.fit()
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum(losses[-3:]) / 3 < 0.5 * sum(losses[:3]) / 3, losses
