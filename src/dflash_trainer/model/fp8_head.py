"""The loss's two LM-head GEMMs in FP8 (`loss.fp8_head`): the drafter slots' logits and their gradient's product with
the head, with row-wise e4m3 scales.

Per chunk of M drafter slots, with the frozen head W `[V, H]`:
    logits         z  = h W̃ᵀ      [M, V]   contracts H    h `[M, H]`: a scale per slot, W: one per vocabulary row
    input grad     dh = g W       [M, H]   contracts V    g `[M, V]`: a scale per slot, Wᵀ `[H, V]`: one per feature
A scale may vary along a GEMM's output rows or columns, never along the dimension it contracts (`model/fp8.py`), so
the input grad needs W quantised along the other axis: the head is kept twice in e4m3 (`Fp8Head`, 2 V H bytes, as
much as the bf16 head: 2.5 GB at V 248,320 x H 5,120). W is frozen, so both copies are made once and cached
(`cached_fp8_head`); a new weight tensor, or an in-place change of it (its version counter), makes them again.

h and g are quantised per chunk, by traced code (Inductor fuses g's with the softmax gradient pass that makes it);
the GEMMs are the opaque op `dflash_fp8::scaled_mm`, so the compiled chunk keeps one graph. The logits GEMM
accumulates fast (Hopper's FP8 accumulator, as the drafter's FP8 forward); the input grad sums over the whole
vocabulary, so it accumulates with float32 promotion.

Error: e4m3 keeps 3 mantissa bits, so each product is ~3.6 % (RMS, relative) off the exact product of its inputs.
Row-wise scales make g's range no problem where it matters: the entries of a row are relative to its largest
(the label's p - 1, or the largest of p - q), and those more than ~2^17 below it, which add nothing the bf16 GEMM
would keep either, flush to zero.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch
from torch import Tensor

from .fp8 import ALIGNMENT, E4M3, quantize, scaled_mm

# Rows quantised at a time when the head is cached: bounds the float32 temporary of `quantize` (V x H x 4 bytes, 5 GB
# for the 27B head, at once) to this many rows. Row-wise scales are per row, so slicing changes nothing.
_QUANTISE_ROWS = 4096


class Fp8Head(NamedTuple):
    """A frozen LM head W `[V, H]` in e4m3, in the two layouts its GEMMs take (a NamedTuple: dynamo traces it)."""

    weight: Tensor  # [V, H] e4m3, a scale per vocabulary row
    weight_scale: Tensor  # [V, 1] float32
    transposed: Tensor  # [H, V] e4m3, a scale per hidden feature
    transposed_scale: Tensor  # [H, 1] float32


def fp8_head_problem(weight: Tensor) -> str | None:
    """Why `weight` `[V, H]` cannot run in FP8 (None: it can): the GPU's scaled matmul needs both sizes to be
    multiples of 16; the CPU is held to the same, so a recipe that runs here runs there."""
    vocab, width = weight.shape
    if vocab % ALIGNMENT or width % ALIGNMENT:
        return f"the LM head's sizes [V={vocab}, H={width}] must be multiples of {ALIGNMENT}"
    return None


# One head per process: (the weight, its version counter when quantised, the FP8 copies).
_cached: tuple[weakref.ref[Tensor], int, Fp8Head] | None = None


def cached_fp8_head(weight: Tensor) -> Fp8Head:
    """The e4m3 copies of `weight` `[V, H]`, quantised on the first call and again only when the weight is another
    tensor or was changed in place since."""
    global _cached
    version = _version(weight)
    if _cached is not None:
        cached_weight, cached_version, head = _cached
        if cached_weight() is weight and cached_version == version:
            return head
    _cached = None  # free the old copies before making new ones
    with torch.no_grad():
        head = Fp8Head(*_quantize_rows(weight), *_quantize_rows(weight.t().contiguous()))
    _cached = (weakref.ref(weight), version, head)
    return head


def head_logits(rows: Tensor, head: Fp8Head, bias: Tensor | None) -> Tensor:
    """`rows [M, H] @ Wᵀ (+ bias)` -> `[M, V]` bf16, each row quantised with its own scale."""
    rows_q, rows_scale = quantize(rows, E4M3, rowwise=True)  # [M, H], [M, 1]
    logits = scaled_mm(rows_q, rows_scale, head.weight, head.weight_scale, True)  # [M, V]
    return logits if bias is None else logits + bias.to(logits.dtype)


def head_input_grad(grad_logits: Tensor, head: Fp8Head) -> Tensor:
    """`grad_logits [M, V] @ W` -> `[M, H]` bf16, each row of the gradient quantised with its own scale."""
    grad_q, grad_scale = quantize(grad_logits, E4M3, rowwise=True)  # [M, V], [M, 1]
    return scaled_mm(grad_q, grad_scale, head.transposed, head.transposed_scale, False)  # [M, H]


def _quantize_rows(values: Tensor) -> tuple[Tensor, Tensor]:
    """Row-wise e4m3 of `[N, K]`, `_QUANTISE_ROWS` rows at a time."""
    parts = [quantize(values[start : start + _QUANTISE_ROWS]) for start in range(0, values.shape[0], _QUANTISE_ROWS)]
    return torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts])


def _version(weight: Tensor) -> int:
    # Inference tensors have no version counter; outside inference mode they cannot change in place.
    return -1 if weight.is_inference() else weight._version
