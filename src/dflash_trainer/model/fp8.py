"""FP8 training of the drafter's linear layers (`drafter.fp8`): the forward and both backward GEMMs in FP8.

For a linear layer `y = x Wᵀ` with x `[M, K]` (M tokens) and W `[N, K]`, one training step runs three GEMMs:
    forward        y  = x  Wᵀ     [M, N]   contracts K
    input grad     dx = dy W      [M, K]   contracts N
    weight grad    dW = dyᵀ x     [N, K]   contracts M
Each runs as `torch._scaled_mm` on FP8 operands `a ~ a_q * s_a`, `b ~ b_q * s_b` with float32 accumulation:
`a @ bᵀ = s_a * s_b * (a_q @ b_qᵀ)`, where a scale may vary along the operand's rows (one per output row or column
of the GEMM) but never along the contracted dimension. Quantising a tensor: `s = amax(|v|) / max(dtype)`,
`v_q = round_to_nearest(v / s)`, so the largest element lands on the format's largest finite value and nothing
saturates. The master weights stay float32 and the optimizer is untouched: the weight is quantised from its
float32 value at every step, and its gradient comes back in float32 like the bf16 path's.

Three scalings (`drafter.fp8_scaling`):
- `tensorwise` (default): one scale per tensor. x and W are quantised once in the forward, each cast in two
  layouts: the forward GEMM's, and the transposed one the backward GEMM that reads it contracts over, which is kept
  for the backward (the bytes of one FP8 copy, half of bf16); dy is quantised once for both backward GEMMs, in both
  layouts. Casting a second layout straight from the bf16 values is one tiled pass when compiled, where transposing
  the FP8 copy afterwards was a byte copy of its own. Gradients in **e5m2**: one scale has to cover a gradient whose
  rows differ by orders of magnitude (slot weights from 1 to e^-2, confident slots near 0, padded slots exactly
  0), and e5m2 keeps full relative precision over 2^30 of magnitudes below its scale where e4m3 keeps it over 2^15
  (and flushes to zero below 2^-18 of its largest value); e4m3 for x and W, which RMSNorm and the weight's own
  spread keep within a narrow range. The fast path: cuBLAS's FP8 GEMM, and the fewest quantisation passes.
- `rowwise`: one scale per row of each operand along the contracted dimension: per token for the forward and the
  input grad, per feature (over tokens) for the weight grad. Every operand, gradients included, in **e4m3**: with
  a scale per row the range is no problem, and e4m3's extra mantissa bit halves the rounding error. The backward
  quantises x and dy again along the other axis, so x is kept in bf16. More accurate, more passes.
- `tensorwise_fast`: `tensorwise` with its two backward GEMMs accumulating fast too (below); the same operands.
Accumulation (as torchao's recipes): the forward GEMM accumulates fast (Hopper's FP8 accumulator without periodic
promotion to float32); the tensorwise backward GEMMs accumulate in float32, since the weight grad sums over every
token of the batch; rowwise accumulates fast in all three, the only fast setting of its CUTLASS kernel.
`tensorwise_fast` trades the float32 promotion of the backward for speed: the accumulator keeps fewer mantissa
bits than float32, so a long sum (the weight grad's, over every token) drifts further from the exact one, on top
of the operands' own rounding. On the CPU the reference kernel always accumulates in float32 (the flag reaches it
and changes nothing there); the GPU tests bound the drift.

Error: e4m3 rounds to 3 mantissa bits (2^-4 relative at most, ~2.6 % RMS over a binade), e5m2 to 2 bits (2^-3,
~5.1 % RMS). A GEMM of two e4m3 operands is ~3.6 % (RMS, relative) off the exact product of its inputs, one with an
e5m2 operand ~5.7 % (errors add in quadrature), against ~0.3 % for bf16. The formats are floating point, so a row
far below the tensor's maximum keeps its relative precision under one tensorwise scale, down to where the format's
normal range ends (2^-15 of the maximum for e4m3, 2^-30 for e5m2; below it subnormals, then zero). The tests bound
each GEMM against a float64 product of the same inputs (`tests/test_fp8_drafter.py`).

Where it applies: every `nn.Linear` of the drafter whose sizes are multiples of 16 (`torch._scaled_mm` needs it
on the GPU): q/k/v/o and gate/up/down of every layer and the context projection `fc`, never the norms. The weight
grad contracts over tokens, so the token count is padded to a multiple of 16 there (with zeros, which add nothing)
when it is not one already; the data stage's buckets make it one on the GPU. In eval mode the layers compute
exactly (`F.linear`): evaluation and export see the float32 weights, as a server will.

Under torch.compile the FP8 GEMMs are opaque: the forward (`dflash_fp8::linear`, which returns the output and the
e4m3 operands with their scales) and each scaling's backward (`dflash_fp8::tensorwise_linear_backward`,
`dflash_fp8::rowwise_linear_backward`, both gradients at once) are custom ops, tied together by
`torch.library.register_autograd`; each has a fake that gives its outputs' shapes and dtypes, symbolic sizes
included. Dynamo, AOT autograd and Inductor see one call per op and run the eager code inside the compiled graph,
so the compiled gradients are by construction the eager ones. Traced into the graph instead (as an
`autograd.Function` whose quantisation and `torch._scaled_mm` calls Inductor compiled), the weight gradients came
out zero on CUDA with torch 2.11. The cost: the quantisation no longer fuses with the ops around it. On CUDA the
ops call separately compiled quantisers (`op_quantize_per_row`: a per-row amax reduction and one scale-and-cast
pass; `op_quantize_both_layouts`: PyTorch's own whole-tensor amax, then one scale-and-cast pass per layout;
forward-only, so no graph that autograd differentiates ever contains FP8 code); eagerly it would be several passes,
half of them in float32. One more op, forward only,
`dflash_fp8::scaled_mm`, is the bare GEMM, for callers whose quantisation stays traced (the loss's FP8 LM head,
`model/fp8_head.py`). Inductor's on-disk graph cache keys a graph by the ops it calls, not by their fakes: an op
whose outputs change shape or meaning gets a new name (as when the tensorwise forward began to return the backward's
layouts), or a cache left by the old code would run with the new kernels' outputs misread.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cache
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..compiling import compile_dynamic

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
E4M3_MAX = torch.finfo(E4M3).max  # 448
# torch._scaled_mm's alignment on the GPU: both sizes of the second operand and the contracted size.
ALIGNMENT = 16

Fp8Scaling = Literal["tensorwise", "tensorwise_fast", "rowwise"]
FP8_SCALINGS: tuple[Fp8Scaling, ...] = get_args(Fp8Scaling)


def quantize(values: Tensor, dtype: torch.dtype = E4M3, *, rowwise: bool = True) -> tuple[Tensor, Tensor]:
    """`[M, K]` in any layout -> (`dtype` `[M, K]` contiguous, float32 scales `[M, 1]` (rowwise) or `[]`) with
    `values ~ quantised * scales`: each row's (or the tensor's) largest magnitude maps to the format's largest
    finite value, the rest rounds to nearest."""
    # The largest magnitude in one read (no |values| copy first); a maximum is exact in any dtype.
    amax = torch.linalg.vector_norm(values, ord=math.inf, dim=-1, keepdim=True) if rowwise else tensor_amax(values)
    scale = scale_from_amax(amax, dtype)
    return cast(values, scale if rowwise else scale.view(1, 1), dtype), scale


def tensor_amax(values: Tensor) -> Tensor:
    """The largest magnitude of `values`, `[]` in their dtype: one reduction kernel, which PyTorch sizes for each
    call. (Compiled with symbolic sizes, Inductor fixes a whole-tensor reduction's split from the first call's
    sizes: one first compiled for a small tensor reduced a 22016 x 24576 gradient at 173 GB/s, 6 ms.)"""
    return torch.linalg.vector_norm(values, ord=math.inf)


def scale_from_amax(amax: Tensor, dtype: torch.dtype) -> Tensor:
    """float32 scales that map `amax` (any shape) onto `dtype`'s largest finite value."""
    # An all-zero tensor or row would give scale 0 and 0/0; its quantised values are 0 whatever the (tiny) scale.
    return amax.float().clamp(min=1e-12) / torch.finfo(dtype).max


def cast(values: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """`values` `[M, K]` / `scale` (`[M, 1]` or `[1, 1]`, float32), rounded to `dtype` -> `[M, K]` contiguous: the
    second half of `quantize`, also for a second layout of the same values with the same scale."""
    largest = torch.finfo(dtype).max
    # Half-precision values divided by a float32 scale with dimensions divide in float32 without a float32 copy of
    # the values first (a 0-dim scale would not promote them, hence [1, 1]); the same numbers as float(v) / s.
    source = values if values.dtype in (torch.bfloat16, torch.float16, torch.float32) else values.float()
    scaled = torch.div(source, scale)  # [M, K] float32
    return scaled.clamp_(-largest, largest).to(dtype).contiguous()


def quantize_both_layouts(values: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """`[M, K]` -> (`dtype` `[M, K]`, float32 scale `[]`, `dtype` `[K, M']`): one tensorwise scale, and the values
    in both layouts, the second transposed with zero columns up to M' (M rounded up to ALIGNMENT) for a GEMM that
    contracts over M. Both are cast from `values` with the same arithmetic, so one is exactly the other's transpose;
    compiled, the transposed cast is one tiled pass over `values` instead of a byte transpose of the first."""
    return cast_both_layouts(values, tensor_amax(values), dtype)


def cast_both_layouts(values: Tensor, amax: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """`quantize_both_layouts` given the tensor's `amax` `[]`: the part the CUDA path compiles (two pointwise
    passes, each tiled for the layout it writes)."""
    scale = scale_from_amax(amax, dtype)  # []
    return cast(values, scale.view(1, 1), dtype), scale, cast(pad_rows(values).t(), scale.view(1, 1), dtype)


def scaled_matmul(
    a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, out_dtype: torch.dtype, *, fast_accum: bool = False
) -> Tensor:
    """`(a * a_scale) @ (b * b_scale)ᵀ` -> `[M, N]` in `out_dtype`, from FP8 `a` `[M, K]` and `b` `[N, K]`, both
    row-major, with scales `[M, 1]` / `[N, 1]` or one each. (`b`'s transpose is the column-major operand
    `torch._scaled_mm` wants.) Row-wise scaling on CUDA gives bf16 only: other dtypes are cast from it; one scale
    each writes any of bf16, float16 and float32 directly."""
    mm_dtype = torch.bfloat16 if a.is_cuda and a_scale.dim() else out_dtype
    b_scale = b_scale.t().contiguous() if b_scale.dim() else b_scale  # [1, N]
    out = torch._scaled_mm(a, b.t(), scale_a=a_scale, scale_b=b_scale, out_dtype=mm_dtype, use_fast_accum=fast_accum)
    return out.to(out_dtype)


def pad_rows(values: Tensor) -> Tensor:
    """`[M, C]` -> `[M', C]` with zero rows up to a multiple of ALIGNMENT (a no-op when M is one)."""
    rows = values.shape[0]
    return values if rows % ALIGNMENT == 0 else F.pad(values, (0, 0, 0, (-rows) % ALIGNMENT))


# ------------------------------------------------------------------------------------------ the opaque GEMM ops
# The forward and one backward per scaling, each with a fake (shapes and dtypes only, symbolic sizes included) for
# tracing, tied together by `register_autograd` (module docstring: why opaque). Every output is a fresh tensor: no
# op aliases or mutates its inputs.


def op_quantize_per_row(values: Tensor) -> tuple[Tensor, Tensor]:
    """`quantize(values, E4M3, rowwise=True)` as the rowwise ops run it: on CUDA compiled on its own (the amax
    reduction and one scale-and-cast pass instead of several eager passes, half of them in float32), on the CPU
    eagerly (Inductor's CPU compile costs seconds per shape class and the CPU path is for tests). Called at run time
    inside an op, so a compiled quantiser is a forward-only graph of its own, never part of a graph that autograd
    differentiates.

    One compiled function per kind of quantisation (format x scaling x layouts), each its own code object: dynamo
    keeps its graphs per code object and falls back to eager for good once one has 8 (its recompile limit). One
    `quantize` compiled for every kind reached that limit within the first 27B step (kinds x input dtypes x layouts
    x `nn.Parameter` or plain tensor), and every later kind ran eagerly. Detached, a weight comes in as a plain
    tensor (the same graph as the activations' in its dtype); what is left per function is input dtype and layout."""
    if compiled_quantisers_on(values.device):
        return _compiled_per_row()(values.detach())
    return quantize(values, E4M3, rowwise=True)


def op_quantize_both_layouts(values: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """`quantize_both_layouts` as the tensorwise ops run it: on CUDA the amax eagerly (`tensor_amax`: why) and the
    casts compiled, one function per format (`op_quantize_per_row`); eagerly on the CPU."""
    if compiled_quantisers_on(values.device):
        values = values.detach()
        return _compiled_both_layouts(dtype)(values, tensor_amax(values))
    return quantize_both_layouts(values, dtype)


def compiled_quantisers_on(device: torch.device) -> bool:
    return device.type == "cuda"


def _e4m3_per_row(values: Tensor) -> tuple[Tensor, Tensor]:
    return quantize(values, E4M3, rowwise=True)


def _e4m3_both_layouts(values: Tensor, amax: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return cast_both_layouts(values, amax, E4M3)


def _e5m2_both_layouts(values: Tensor, amax: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return cast_both_layouts(values, amax, E5M2)


_BOTH_LAYOUTS = {E4M3: _e4m3_both_layouts, E5M2: _e5m2_both_layouts}


@cache
def _compiled_per_row() -> Callable[[Tensor], tuple[Tensor, Tensor]]:
    return compile_dynamic(_e4m3_per_row)


@cache
def _compiled_both_layouts(dtype: torch.dtype) -> Callable[[Tensor, Tensor], tuple[Tensor, Tensor, Tensor]]:
    return compile_dynamic(_BOTH_LAYOUTS[dtype])


def _scale_shape(count: int, rowwise: bool) -> tuple[int, ...]:
    return (count, 1) if rowwise else ()


@torch.library.custom_op("dflash_fp8::linear", mutates_args=())
def _matmul(
    rows: Tensor, weight: Tensor, rowwise: bool, out_dtype: torch.dtype, fast_backward: bool = False
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """`rows [M, K] @ weight [N, K]ᵀ` in FP8 -> (out `[M, N]` in `out_dtype`; then what the backward reuses:
    tensorwise, the e4m3 operands in the layouts the backward GEMMs contract them in, xᵀ_q `[K, M']` (M' = M rounded
    up to ALIGNMENT), x_scale `[]`, Wᵀ_q `[K, N]`, w_scale `[]`; rowwise, x_q `[M, K]`, `[M, 1]`, w_q `[N, K]`,
    `[N, 1]`, which its backward does not use: it quantises x and W again along the other axis). `fast_backward`
    is read by the tensorwise backward only (its default keeps the op's calls from before it existed valid)."""
    with torch.autocast(rows.device.type, enabled=False):  # the dtypes here are chosen explicitly
        if rowwise:
            x_q, x_scale = op_quantize_per_row(rows)  # [M, K], [M, 1]
            w_q, w_scale = op_quantize_per_row(weight)  # [N, K], [N, 1]
            kept = x_q, w_q
        else:
            x_q, x_scale, xt_q = op_quantize_both_layouts(rows, E4M3)  # [M, K], [], [K, M']
            w_q, w_scale, wt_q = op_quantize_both_layouts(weight, E4M3)  # [N, K], [], [K, N]
            kept = xt_q, wt_q
        out = scaled_matmul(x_q, x_scale, w_q, w_scale, out_dtype, fast_accum=True)  # [M, N]
    return out, kept[0], x_scale, kept[1], w_scale


@_matmul.register_fake
def _matmul_fake(rows: Tensor, weight: Tensor, rowwise: bool, out_dtype: torch.dtype, fast_backward: bool = False):
    (tokens, features), outputs = rows.shape, weight.shape[0]
    if rowwise:
        x_shape, w_shape = (tokens, features), (outputs, features)
    else:
        x_shape, w_shape = (features, (tokens + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT), (features, outputs)
    return (
        rows.new_empty((tokens, outputs), dtype=out_dtype),
        rows.new_empty(x_shape, dtype=E4M3),
        rows.new_empty(_scale_shape(tokens, rowwise), dtype=torch.float32),
        rows.new_empty(w_shape, dtype=E4M3),
        rows.new_empty(_scale_shape(outputs, rowwise), dtype=torch.float32),
    )


@torch.library.custom_op("dflash_fp8::tensorwise_linear_backward", mutates_args=())
def _tensorwise_backward(
    grad_out: Tensor,
    xt_q: Tensor,
    x_scale: Tensor,
    wt_q: Tensor,
    w_scale: Tensor,
    rows_dtype: torch.dtype,
    weight_dtype: torch.dtype,
    fast_accum: bool = False,
) -> tuple[Tensor, Tensor]:
    """dy `[M, N]` and the forward's e4m3 xᵀ_q `[K, M']`, Wᵀ_q `[K, N]` with their scales -> (dx `[M, K]` in
    `rows_dtype`, dW `[N, K]` in `weight_dtype`), each written in its dtype by its GEMM (one scale each: no cast);
    both accumulate in float32, or fast with `fast_accum` (`tensorwise_fast`)."""
    with torch.autocast(grad_out.device.type, enabled=False):
        g_q, g_scale, gt_q = op_quantize_both_layouts(grad_out, E5M2)  # [M, N], [], [N, M']
        grad_rows = scaled_matmul(g_q, g_scale, wt_q, w_scale, rows_dtype, fast_accum=fast_accum)  # [M, K], contracts N
        grad_weight = scaled_matmul(gt_q, g_scale, xt_q, x_scale, weight_dtype, fast_accum=fast_accum)  # [N, K]
    return grad_rows, grad_weight


@_tensorwise_backward.register_fake
def _tensorwise_backward_fake(grad_out, xt_q, x_scale, wt_q, w_scale, rows_dtype, weight_dtype, fast_accum=False):
    (tokens, outputs), features = grad_out.shape, xt_q.shape[0]
    return grad_out.new_empty((tokens, features), dtype=rows_dtype), grad_out.new_empty(
        (outputs, features), dtype=weight_dtype
    )


@torch.library.custom_op("dflash_fp8::rowwise_linear_backward", mutates_args=())
def _rowwise_backward(grad_out: Tensor, rows: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """dy `[M, N]`, x `[M, K]`, W `[N, K]` -> (dx `[M, K]` in x's dtype, dW `[N, K]` in W's); x and W are quantised
    again, along the axis each GEMM keeps; the GEMMs write dy's dtype (the forward's output dtype)."""
    out_dtype = grad_out.dtype
    with torch.autocast(grad_out.device.type, enabled=False):
        g_q, g_scale = op_quantize_per_row(grad_out)  # [M, N], per token
        wt_q, wt_scale = op_quantize_per_row(weight.t())  # [K, N], per input feature
        grad_rows = scaled_matmul(g_q, g_scale, wt_q, wt_scale, out_dtype, fast_accum=True)  # [M, K]
        gt_q, gt_scale = op_quantize_per_row(pad_rows(grad_out).t())  # [N, M'], per output
        xt_q, xt_scale = op_quantize_per_row(pad_rows(rows).t())  # [K, M'], per input
        grad_weight = scaled_matmul(gt_q, gt_scale, xt_q, xt_scale, out_dtype, fast_accum=True)  # [N, K]
    return grad_rows.to(rows.dtype), grad_weight.to(weight.dtype)


@_rowwise_backward.register_fake
def _rowwise_backward_fake(grad_out, rows, weight):
    return rows.new_empty(rows.shape), weight.new_empty(weight.shape)


def _matmul_setup_context(ctx, inputs, output) -> None:
    rows, weight, rowwise, _, fast_backward = inputs
    _, x_q, x_scale, w_q, w_scale = output
    ctx.mark_non_differentiable(x_q, x_scale, w_q, w_scale)
    ctx.set_materialize_grads(False)  # no zero gradients for the four outputs above
    if rowwise:  # quantised again along the other axis in the backward
        ctx.save_for_backward(rows, weight)
    else:  # the FP8 copies, already in the backward's layouts, serve it as they are
        ctx.save_for_backward(x_q, x_scale, w_q, w_scale)
    ctx.rowwise, ctx.rows_dtype, ctx.weight_dtype = rowwise, rows.dtype, weight.dtype
    ctx.fast_backward = fast_backward


def _matmul_backward(ctx, grad_out: Tensor, *_unused: Tensor | None) -> tuple[Tensor, Tensor, None, None, None]:
    # Both gradients always (autograd drops one nothing needs): one op computes them, whatever
    # `ctx.needs_input_grad` says. The cost where nothing needs one: the context projection's input gradient.
    if ctx.rowwise:
        grad_rows, grad_weight = _rowwise_backward(grad_out, *ctx.saved_tensors)
    else:
        grad_rows, grad_weight = _tensorwise_backward(
            grad_out, *ctx.saved_tensors, ctx.rows_dtype, ctx.weight_dtype, ctx.fast_backward
        )
    return grad_rows, grad_weight, None, None, None


_matmul.register_autograd(_matmul_backward, setup_context=_matmul_setup_context)


@torch.library.custom_op("dflash_fp8::scaled_mm", mutates_args=())
def scaled_mm(a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, fast_accum: bool) -> Tensor:
    """`scaled_matmul` to bf16, forward only (no autograd: its FP8 operands are constants to it): the GEMMs of the
    loss's frozen LM head (`model/fp8_head.py`), opaque inside the compiled loss chunk whose quantisation stays
    traced. `a` `[M, K]`, `b` `[N, K]` e4m3 with scales `[M, 1]`, `[N, 1]` -> `[M, N]` bf16."""
    with torch.autocast(a.device.type, enabled=False):
        return scaled_matmul(a, a_scale, b, b_scale, torch.bfloat16, fast_accum=fast_accum)


@scaled_mm.register_fake
def _scaled_mm_fake(a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, fast_accum: bool) -> Tensor:
    return a.new_empty((a.shape[0], b.shape[0]), dtype=torch.bfloat16)


def fp8_linear(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, *, rowwise: bool = False, fast_backward: bool = False
) -> Tensor:
    """`F.linear(x, weight, bias)` for training with its three GEMMs in FP8. x `[..., K]`, weight `[N, K]` (the
    float32 master weight, or any float dtype) -> `[..., N]` in autocast's dtype under autocast, else x's.
    `fast_backward`: tensorwise's backward GEMMs accumulate fast (`tensorwise_fast`; rowwise's always do)."""
    device = x.device.type
    out_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    rows = x.reshape(-1, x.shape[-1])  # [M, K]
    out = _matmul(rows, weight, rowwise, out_dtype, fast_backward)[0]  # [M, N]
    if bias is not None:
        out = out + bias.to(out_dtype)
    return out.view(*x.shape[:-1], weight.shape[0])


class Fp8TrainingLinear(nn.Linear):
    """An `nn.Linear` whose matmul runs in FP8 while training (`fp8_linear`) and exactly in eval mode. It adopts the
    replaced layer's parameters, so names, state dict, optimizer and export are those of the `nn.Linear`."""

    def __init__(self, linear: nn.Linear, *, scaling: Fp8Scaling = "tensorwise") -> None:
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate weights of its own
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.register_parameter("bias", linear.bias)
        self.scaling = check_scaling(scaling)

    @property
    def rowwise(self) -> bool:
        return self.scaling == "rowwise"

    @property
    def fast_backward(self) -> bool:
        return self.scaling == "tensorwise_fast"

    def forward(self, x: Tensor) -> Tensor:
        if not self.training:
            return F.linear(x, self.weight, self.bias)
        return fp8_linear(x, self.weight, self.bias, rowwise=self.rowwise, fast_backward=self.fast_backward)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8 {self.scaling}"


def fp8_eligible(linear: nn.Module) -> bool:
    """A plain `nn.Linear` whose sizes the GPU's scaled matmul takes."""
    return type(linear) is nn.Linear and linear.in_features % ALIGNMENT == 0 and linear.out_features % ALIGNMENT == 0


def convert_to_fp8_training(module: nn.Module, *, scaling: Fp8Scaling = "tensorwise") -> tuple[int, int]:
    """Swap every `nn.Linear` inside `module` whose sizes allow it for an `Fp8TrainingLinear` with the same
    parameters. Returns (converted, left in high precision). Call before building the optimizer or compiling."""
    check_scaling(scaling)
    converted = skipped = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if fp8_eligible(child):
                setattr(parent, name, Fp8TrainingLinear(child, scaling=scaling))
                converted += 1
            elif type(child) is nn.Linear:
                skipped += 1
    return converted, skipped


def check_scaling(scaling: str) -> Fp8Scaling:
    if scaling not in FP8_SCALINGS:
        raise ValueError(f"fp8 scaling must be one of {', '.join(FP8_SCALINGS)}, got {scaling!r}")
    return scaling


def fp8_training_problem(device: torch.device) -> str | None:
    """Why FP8 training cannot run on `device` (None: it can). CUDA needs FP8 tensor cores (compute capability 8.9+:
    Ada, Hopper, Blackwell); the CPU runs torch's reference scaled matmul (slow, for tests)."""
    if device.type == "cpu":
        return None
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability >= (8, 9):
            return None
        return (
            f"needs a GPU with FP8 tensor cores (compute capability 8.9+), this one has {capability[0]}.{capability[1]}"
        )
    return f"runs on CUDA GPUs with FP8 tensor cores or on the CPU, not on {device.type}"
