"""The DFlash attention mask: one `mask_mod`, two backends.

Layout. Queries are the block tokens of a row, `[N*B]` (block n, slot k at n*B + k). Keys are the row's T context
entries followed by the same N*B block tokens: `kv < T` is context position kv, `kv >= T` is block token kv - T.

Rule (DESIGN §2). A query of block n anchored at a sees
- context positions kv < a (strictly: the anchor's own hidden state does not exist yet at inference), of the same
  document as the anchor, and for sliding-window layers only the last W of them (kv >= a - W);
- every slot of its own block (bidirectional), or only slots <= its own when the layer is causal in-block;
- nothing of any other block.
Dropped anchors (`anchor_keep` False) lose their context but keep their own block, so no query row is empty (an
all-masked row is NaN in SDPA); the loss ignores them anyway.

GPU: flex_attention with a BlockMask from `create_block_mask` (compiled), built once per batch per layer variant.
CPU: SDPA with a dense boolean mask evaluated from the same `mask_mod` on broadcast index tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal, cast

import torch
import torch.nn.functional as F
from torch import Tensor

Backend = Literal["flex", "sdpa"]
MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class MaskVariant:
    """What distinguishes the masks of different drafter layers."""

    window: int | None = None
    causal_in_block: bool = False


def dflash_mask_mod(
    *,
    anchors: Tensor,  # [R, N] int64
    anchor_keep: Tensor,  # [R, N] bool
    doc_ids: Tensor,  # [R, T] int64, -1 on padding
    block_size: int,
    context_len: int,
    window: int | None = None,
    causal_in_block: bool = False,
) -> MaskMod:
    """The single definition of who sees what. Works on scalar index tensors (flex) and on broadcast
    index grids (dense), so it must use tensor ops only: no Python branching on values."""
    last_ctx = context_len - 1

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        q_block = q_idx // block_size
        anchor = anchors[b, q_block]
        is_ctx = kv_idx < context_len
        ctx_pos = torch.clamp(kv_idx, max=last_ctx)
        same_doc = doc_ids[b, ctx_pos] == doc_ids[b, anchor]
        ctx_ok = is_ctx & (kv_idx < anchor) & same_doc & anchor_keep[b, q_block]
        if window is not None:
            ctx_ok = ctx_ok & (kv_idx >= anchor - window)
        block_kv = torch.clamp(kv_idx - context_len, min=0)
        in_block = ~is_ctx & (block_kv // block_size == q_block)
        if causal_in_block:
            in_block = in_block & (block_kv % block_size <= q_idx % block_size)
        return ctx_ok | in_block

    return mask_mod


def dense_mask(mask_mod: MaskMod, *, rows: int, q_len: int, kv_len: int, device: torch.device) -> Tensor:
    """Evaluate `mask_mod` on the full (row, query, key) grid -> bool [R, 1, Q, KV] for SDPA."""
    b = torch.arange(rows, device=device).view(rows, 1, 1)
    h = torch.zeros(1, 1, 1, dtype=torch.long, device=device)
    q = torch.arange(q_len, device=device).view(1, q_len, 1)
    kv = torch.arange(kv_len, device=device).view(1, 1, kv_len)
    return mask_mod(b, h, q, kv).unsqueeze(1)


@lru_cache(maxsize=1)
def _compiled_create_block_mask() -> Callable:
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask, dynamic=True)


def block_mask(mask_mod: MaskMod, *, rows: int, q_len: int, kv_len: int, device: torch.device):
    """flex_attention BlockMask for `mask_mod` (compiled on CUDA: the eager builder materialises the grid)."""
    from torch.nn.attention.flex_attention import create_block_mask

    build = _compiled_create_block_mask() if device.type == "cuda" else create_block_mask
    return build(mask_mod, B=rows, H=None, Q_LEN=q_len, KV_LEN=kv_len, device=device)


@dataclass
class DrafterMasks:
    """Masks for one batch, one per layer variant, shared by all layers of that variant."""

    backend: Backend
    by_variant: dict[MaskVariant, object]

    def for_variant(self, variant: MaskVariant) -> object:
        return self.by_variant[variant]


def build_masks(
    *,
    anchors: Tensor,
    anchor_keep: Tensor,
    doc_ids: Tensor,
    block_size: int,
    variants: list[MaskVariant] | tuple[MaskVariant, ...],
    backend: Backend,
) -> DrafterMasks:
    rows, num_blocks = anchors.shape
    context_len = doc_ids.shape[1]
    q_len = num_blocks * block_size
    kv_len = context_len + q_len
    built: dict[MaskVariant, object] = {}
    for variant in dict.fromkeys(variants):
        mask_mod = dflash_mask_mod(
            anchors=anchors,
            anchor_keep=anchor_keep,
            doc_ids=doc_ids,
            block_size=block_size,
            context_len=context_len,
            window=variant.window,
            causal_in_block=variant.causal_in_block,
        )
        make = block_mask if backend == "flex" else dense_mask
        built[variant] = make(mask_mod, rows=rows, q_len=q_len, kv_len=kv_len, device=anchors.device)
    return DrafterMasks(backend=backend, by_variant=built)


@lru_cache(maxsize=1)
def _compiled_flex_attention() -> Callable:
    from torch.nn.attention.flex_attention import flex_attention

    # dynamic=None: the first shape change recompiles with symbolic sizes instead of once per shape.
    return torch.compile(flex_attention, dynamic=None)


def attend(q: Tensor, k: Tensor, v: Tensor, mask: object | None, backend: Backend, scale: float) -> Tensor:
    """q [R, Hq, Q, D], k/v [R, Hkv, KV, D] -> [R, Hq, Q, D]. `mask` None means every query sees every key."""
    enable_gqa = q.shape[1] != k.shape[1]
    # Under autocast the projections give bf16 while norms/rope may give fp32: attend in the value dtype.
    q, k = q.to(v.dtype), k.to(v.dtype)
    if backend == "flex" and mask is not None:
        from torch.nn.attention.flex_attention import flex_attention

        # Eager flex_attention is a slow reference implementation: compile it on CUDA, unless we already are
        # inside a compiled region (compiled drafter layers), which compiles it with the rest.
        compile_here = q.device.type == "cuda" and not torch.compiler.is_compiling()
        fn = _compiled_flex_attention() if compile_here else flex_attention
        return fn(q, k, v, block_mask=mask, scale=scale, enable_gqa=enable_gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)


def resolve_backend(requested: str, device: torch.device) -> Backend:
    """`auto` -> flex on CUDA, SDPA elsewhere (flex has no backward on CPU)."""
    if requested == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    if requested not in ("flex", "sdpa"):
        raise ValueError(f"unknown attention backend {requested!r}")
    return cast(Backend, requested)
