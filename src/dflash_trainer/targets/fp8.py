"""FP8 (e4m3) linear layers for the frozen target: weights quantised once, activations per token on the fly.

The target is frozen and only ever runs forward, so the linear layers of its decoder (attention projections, MLP,
linear-attention projections) can multiply in FP8 on GPUs with FP8 tensor cores (compute capability 8.9+: Ada,
Hopper), at up to twice the bf16 rate. Embedding, LM head, norms and everything outside the decoder layers keep
their precision; MoE routers (`gate`/`router` children) stay exact too, since their argmax picks the experts.

Math, for a weight W `[N, K]` and activations x `[M, K]` (M tokens):
- weight, once: `s_w[n] = max_k |W[n, k]| / 448`, `W_q = e4m3(W / s_w)` (per output row: one large row does not
  flatten the others);
- activations, per call: `s_x[m] = max_k |x[m, k]| / 448`, `x_q = e4m3(x / s_x)` (per token);
- `y[m, n] = s_x[m] * s_w[n] * sum_k x_q[m, k] W_q[n, k]` (+ bias), by `torch._scaled_mm` with fp32 accumulation
  and bf16 output.
448 is e4m3's largest finite value, so each row's largest element maps to +-448 exactly and nothing saturates.
Error: e4m3 rounds to nearest with 3 mantissa bits, so an element's relative error is at most 2^-4 in the normal
range (|v| >= 2^-6 after scaling) and its RMS over a binade is 2^-3 / sqrt(24) ~ 2.6%; a product of two quantised
operands carries ~3.6%, and so does a sum of K such products with independent errors (errors and terms add in
quadrature alike). One FP8 linear is thus ~3.6% (RMS, relative) off the exact product, against ~0.3% for bf16;
through a decoder the differences compound with depth (tests: a few % to ~12% for small random models, whose layers
change the residual stream far more than trained ones do).

Rowwise `_scaled_mm` needs K and N multiples of 16 and a bf16 output: other linears are left as they are, and
`quantize_decoder_linears` refuses non-bf16 models.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch
from torch import Tensor, nn

from ..compiling import compile_dynamic
from ..model.fp8 import E4M3, quantize

# Children never quantised: routers pick experts by argmax.
_EXACT_CHILDREN = {"gate", "router"}


def quantize_rowwise(values: Tensor) -> tuple[Tensor, Tensor]:
    """`[M, K]` -> (e4m3 `[M, K]`, float32 scales `[M, 1]`) with `values ~ quantised * scales` row by row (the
    quantiser the drafter's FP8 training shares, `model/fp8.py`)."""
    return quantize(values, E4M3, rowwise=True)


@cache
def _compiled_quantize_rowwise() -> Callable[[Tensor], tuple[Tensor, Tensor]]:
    # Eager runs five passes over the activations (abs, amax, cast, divide, cast); compiled, two.
    return compile_dynamic(quantize_rowwise)


class Fp8Linear(nn.Module):
    """A frozen `nn.Linear` whose matmul runs in FP8 (see the module docstring); forward only."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.out_dtype = linear.weight.dtype
        weight, scale = quantize_rowwise(linear.weight.detach())  # [N, K], [N, 1]
        # A frozen parameter (not a buffer), so that parameter counts (FLOPs, MFU) still see the layer; not named
        # `weight`, so that code reading `.weight.dtype` to pick a compute dtype cannot mistake it.
        self.weight_fp8 = nn.Parameter(weight, requires_grad=False)
        self.register_buffer("weight_scale", scale.t().contiguous())  # [1, N]: _scaled_mm's layout for mat2
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())

    def forward(self, x: Tensor) -> Tensor:
        leading = x.shape[:-1]
        rows = x.reshape(-1, self.in_features)  # [M, K]
        # Inside a compiled graph (the target's compiled layers) the plain quantiser is traced and fused with the
        # ops around it; calling the compiled one there would nest a torch.compile that dynamo only inlines.
        compiled = rows.is_cuda and not torch.compiler.is_compiling()
        quantize = _compiled_quantize_rowwise() if compiled else quantize_rowwise
        x_q, x_scale = quantize(rows)
        out = torch._scaled_mm(  # [M, N]; the weight's transpose is the column-major operand it wants
            x_q, self.weight_fp8.t(), scale_a=x_scale, scale_b=self.weight_scale, out_dtype=self.out_dtype
        )
        if self.bias is not None:
            out = out + self.bias
        return out.view(*leading, self.out_features)

    def dequantized_weight(self) -> Tensor:
        """`[N, K]` float32: what the FP8 weight stands for."""
        return self.weight_fp8.float() * self.weight_scale.t()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, fp8"


def quantizable(name: str, module: nn.Module) -> bool:
    return (
        type(module) is nn.Linear
        and name not in _EXACT_CHILDREN
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
    )


def quantize_decoder_linears(layers: nn.ModuleList) -> int:
    """Replace every quantizable `nn.Linear` inside the decoder `layers` by an `Fp8Linear`; returns how many.

    The replaced bf16 weights are released (nothing else refers to them), so the decoder's linear weights take half
    the memory afterwards.
    """
    count = 0
    for layer in layers:
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if not quantizable(name, child):
                    continue
                if child.weight.dtype != torch.bfloat16:
                    raise ValueError(
                        f"FP8 target: the linear layers must be bfloat16 (rowwise scaled matmuls give bf16), "
                        f"got {child.weight.dtype}; load the target with dtype bfloat16"
                    )
                setattr(parent, name, Fp8Linear(child))
                count += 1
    return count
