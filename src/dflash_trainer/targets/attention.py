"""Document-aware attention for the frozen target over packed rows, plugged into transformers' attention interface.

Contract. Query t of a packed row attends to key s iff s <= t, both lie in the same segment (`documents.py`:
documents, and the padding run as one more), and, on a sliding-window layer of window W, t - s < W (transformers'
convention: the last W positions, the query's own included). That is exactly what running every segment alone
computes, which the tests check for every backend.

How it is plugged in. `document_attention` is registered in transformers' `AttentionInterface` under
`DOCUMENT_ATTENTION`. For one packed forward, `documents_attention_implementation` points the decoder's config at
that name (and back afterwards, so generation and evaluation keep the model's own implementation) and the decoder
is called with `packed_attention=PackedAttention(...)`, a keyword argument transformers hands unchanged to every
attention call. Under a name transformers has no mask function for, it builds no mask at all (no [T, T] tensor
anywhere on the fast paths). Each call receives the layer's `sliding_window`, which is checked against the window
the config declares for that layer, so a model that does not pass it fails loudly instead of attending too far.

Backends (`resolve_backend`):
- `varlen` (CUDA, fp16/bf16): `torch.nn.attention.varlen.varlen_attn`, the flash kernel over the flattened rows with
  the segments as sequences (`cu_seqlens`): only attention inside segments is computed; no mask, no compilation.
- `flex` (CUDA, any dtype): compiled `flex_attention` with a `BlockMask` built from the segment ids by tensor ops
  (`document_block_mask`: no compilation, no host sync, cost O((T/128)^2)). Tiles that share no segment are
  skipped, tiles inside one segment strictly below the diagonal (and inside the window) run unmasked.
- `dense` (CPU, the reference): SDPA with a dense `[R, 1, T, T]` bool mask. Flex attention on CPU is a slow
  reference implementation (and the target needs no backward), so CPU stays on SDPA.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import flex_attention
from transformers import AttentionInterface, PretrainedConfig

from ..flex import TILE, compiled_flex_attention, ordered_tiles
from .documents import DocumentLayout

Backend = Literal["varlen", "flex", "dense"]
BACKENDS: tuple[str, ...] = ("auto", "varlen", "flex", "dense")
DOCUMENT_ATTENTION = "dflash_documents"
# Keyword arguments of transformers' attention calls that would change the result and that no backend here applies.
_UNSUPPORTED_ARGUMENTS = ("s_aux", "softcap", "position_bias")


def layer_windows(config: PretrainedConfig) -> list[int | None]:
    """The sliding window of every decoder layer (None: full attention), as the config declares it."""
    num = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return [window if kind == "sliding_attention" else None for kind in layer_types]
    if window is not None and getattr(config, "use_sliding_window", True):
        return [window] * num
    return [None] * num


class PackedAttention:
    """One packed forward's attention: the layout, the backend, and what the backend reads, built once before the
    forward (`cu_seqlens` and the longest segment for varlen, one mask per window of the model for flex and
    dense). The layers then only read prepared values: nothing is built or cached inside them, which also keeps
    compiled layers (`FeatureCapture(compile_layers=True)`) free of host work and of guards on the layout."""

    def __init__(
        self, layout: DocumentLayout, backend: Backend, windows: list[int | None], *, fixed_sizes: bool = False
    ) -> None:
        self.layout = layout
        self.backend = backend
        self.windows = windows
        self.masks: dict[int | None, Any] = {}
        self.cu_seqlens: Tensor | None = None
        self.max_seqlen = 0
        self.varlen_gqa_keyword = False
        if backend == "varlen":
            if fixed_sizes:
                self.cu_seqlens, self.max_seqlen = fixed_size_boundaries(layout.cu_seqlens(), layout.segment_ids.shape)
            else:
                self.cu_seqlens, self.max_seqlen = layout.cu_seqlens(), layout.max_seqlen()
            # torch >= 2.12 asks for GQA explicitly; 2.10/2.11 pass the KV heads straight to the kernel.
            self.varlen_gqa_keyword = "enable_gqa" in (_varlen_parameters() or ())
        else:
            build = document_block_mask if backend == "flex" else dense_document_mask
            self.masks = {window: build(layout.segment_ids, window) for window in dict.fromkeys(windows)}

    def attend(self, query: Tensor, key: Tensor, value: Tensor, *, scale: float | None, window: int | None) -> Tensor:
        """q `[R, Hq, T, D]`, k/v `[R, Hkv, T, D]` -> `[R, T, Hq, D]` (the layout transformers' modules expect)."""
        if self.backend == "varlen":
            assert self.cu_seqlens is not None
            return varlen_documents(
                query,
                key,
                value,
                self.cu_seqlens,
                self.max_seqlen,
                scale=scale,
                window=window,
                gqa_keyword=self.varlen_gqa_keyword,
            )
        enable_gqa = query.shape[1] != key.shape[1]
        if self.backend == "flex":
            compile_here = query.device.type == "cuda" and not torch.compiler.is_compiling()
            flex = compiled_flex_attention() if compile_here else flex_attention
            out = flex(query, key, value, block_mask=self.masks[window], scale=scale, enable_gqa=enable_gqa)
        else:
            mask = self.masks[window]
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
        return out.transpose(1, 2)  # [R, T, Hq, D]


# `fixed_sizes`: the boundaries' length is rounded up to a multiple of this (varlen), so that batches with a few more or
# fewer documents share one size.
BOUNDARY_BUCKET = 64


def fixed_size_boundaries(cu_seqlens: Tensor, shape: torch.Size) -> tuple[Tensor, int]:
    """`[S+1]` boundaries of rows `shape = [R, T]` -> boundaries padded to a multiple of `BOUNDARY_BUCKET` entries
    by repeating the total (empty sequences, which the varlen kernel skips) and the longest segment taken as T (a
    segment never crosses a row; the kernel only sizes its grid from it). The integers a compiled layer sees then
    change only with R, T and the bucket, not with each batch's documents: what CUDA graphs (`target.compile_mode
    =reduce-overhead`), which record one graph per set of integer inputs, need to replay rather than record."""
    rows, length = shape
    size = -(-cu_seqlens.numel() // BOUNDARY_BUCKET) * BOUNDARY_BUCKET
    return F.pad(cu_seqlens, (0, size - cu_seqlens.numel()), value=rows * length), length


def document_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    packed_attention: PackedAttention | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers attention function (same signature as its `sdpa_attention_forward`) for packed rows."""
    if packed_attention is None:
        raise RuntimeError(
            f"attention implementation {DOCUMENT_ATTENTION!r} is only valid inside a packed target forward "
            "(FeatureCapture); it was called without `packed_attention`"
        )
    if attention_mask is not None:
        raise RuntimeError(f"{type(module).__name__}: a packed forward must not carry an attention mask as well")
    unsupported = [name for name in _UNSUPPORTED_ARGUMENTS if kwargs.get(name) is not None]
    if unsupported or dropout > 0:
        raise NotImplementedError(
            f"{type(module).__name__} uses {unsupported or ['dropout']}, which document attention does not apply"
        )
    # Compiled layers skip this check: reading the layer index would specialise the compiled code per layer. Every
    # model the tests run eagerly passes it.
    layer_idx = None if torch.compiler.is_compiling() else getattr(module, "layer_idx", None)
    if layer_idx is not None and sliding_window != packed_attention.windows[layer_idx]:
        raise NotImplementedError(
            f"layer {layer_idx} ({type(module).__name__}): the config declares sliding window "
            f"{packed_attention.windows[layer_idx]}, the attention call passed {sliding_window}; packed rows would "
            "attend wrongly"
        )
    output = packed_attention.attend(query, key, value, scale=scaling, window=sliding_window)
    return output, None


AttentionInterface.register(DOCUMENT_ATTENTION, document_attention)


@contextmanager
def documents_attention_implementation(config: PretrainedConfig) -> Iterator[None]:
    """Route the attention of every module reading `config` to `document_attention` for the duration."""
    previous = config._attn_implementation_internal
    # The internal field, not the property: its setter would also rewrite sub-configs.
    config._attn_implementation_internal = DOCUMENT_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation_internal = previous


# ----------------------------------------------------------------------------------------------------------
# Backends


def resolve_backend(requested: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> Backend:
    """`auto`: varlen flash on CUDA when torch has it and the dtype/head size suit the kernel, else flex; dense
    SDPA on CPU."""
    if requested not in BACKENDS:
        raise ValueError(f"packed attention backend {requested!r}: expected one of {', '.join(BACKENDS)}")
    if requested != "auto":
        # Explicit flex on CPU runs flex's eager reference implementation (tests); auto never picks it there.
        if requested == "varlen" and device.type != "cuda":
            raise ValueError(f"packed attention backend 'varlen' needs a CUDA device, the target is on {device}")
        if requested == "varlen" and not varlen_supported(dtype, head_dim):
            raise ValueError(
                f"packed attention backend 'varlen': needs torch.nn.attention.varlen (torch >= 2.10), fp16/bf16 "
                f"and a head size that is a multiple of 8 up to 256 (have torch {torch.__version__}, {dtype}, "
                f"head size {head_dim})"
            )
        return cast(Backend, requested)
    if device.type != "cuda":
        return "dense"
    return "varlen" if varlen_supported(dtype, head_dim) else "flex"


@cache
def _varlen_parameters() -> frozenset[str] | None:
    """Keyword parameters of torch's `varlen_attn`, None when this torch has none (or an older signature without
    sliding windows, torch 2.9)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    parameters = frozenset(inspect.signature(varlen_attn).parameters)
    return parameters if "window_size" in parameters else None


def varlen_supported(dtype: torch.dtype, head_dim: int) -> bool:
    """The flash kernel's limits: fp16/bf16, head size a multiple of 8 up to 256."""
    return (
        _varlen_parameters() is not None
        and dtype in (torch.float16, torch.bfloat16)
        and head_dim % 8 == 0
        and head_dim <= 256
    )


def varlen_documents(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    cu_seqlens: Tensor,  # [S+1] int32: segment boundaries in the flattened [R*T] tokens
    max_seqlen: int,
    *,
    scale: float | None,
    window: int | None,
    gqa_keyword: bool = False,
) -> Tensor:
    """Flash attention over the flattened rows, one sequence per segment -> `[R, T, Hq, D]`. `gqa_keyword`: this
    torch's `varlen_attn` takes `enable_gqa` (>= 2.12; 2.10/2.11 share the KV heads without it)."""
    from torch.nn.attention.varlen import varlen_attn

    rows, heads, length, head_dim = query.shape
    kv_heads = key.shape[1]
    q = query.transpose(1, 2).reshape(rows * length, heads, head_dim)  # [R*T, Hq, D]
    k = key.transpose(1, 2).reshape(rows * length, kv_heads, head_dim)  # [R*T, Hkv, D]
    v = value.transpose(1, 2).reshape(rows * length, kv_heads, head_dim)
    # (left, right) window: (-1, 0) is causal; (W - 1, 0) keeps the last W keys, the query's own included.
    window_size = (-1, 0) if window is None else (window - 1, 0)
    extra: dict[str, Any] = {}
    if kv_heads != heads and gqa_keyword:
        extra["enable_gqa"] = True
    out = varlen_attn(
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale=scale, window_size=window_size, **extra
    )
    return out.view(rows, length, heads, head_dim)


def dense_document_mask(segment_ids: Tensor, window: int | None) -> Tensor:
    """`[R, 1, T, T]` bool, True where query t may attend key s (see the module docstring)."""
    length = segment_ids.shape[1]
    position = torch.arange(length, device=segment_ids.device)
    distance = position[:, None] - position[None, :]  # [T, T] query minus key
    allowed = (distance >= 0) if window is None else (distance >= 0) & (distance < window)
    same_segment = segment_ids[:, :, None] == segment_ids[:, None, :]  # [R, T, T]
    return (same_segment & allowed)[:, None]


def document_block_mask(segment_ids: Tensor, window: int | None, block: int = TILE):
    """flex_attention `BlockMask` for `segment_ids [R, T]`, built from per-tile segment ranges.

    Tile (i, j) (query block i, key block j) can hold an allowed pair only if it is on or below the diagonal, within
    the window, and the segment ranges [min, max] of the two blocks overlap (necessary for a shared segment, and
    without a window also sufficient: segment ids increase along a row). It is full (every pair allowed) only strictly
    below the diagonal, when both blocks lie inside one and the same segment and every pair is inside the window.
    Everything else that can hold a pair is partial and evaluated by the mask_mod, which is the exact rule.
    """
    from torch.nn.attention.flex_attention import BlockMask

    rows, length = segment_ids.shape
    blocks = -(-length // block)
    tail = blocks * block - length
    # Ranges over real positions only: the positions past T in the last block are padded out of min and max.
    low = F.pad(segment_ids, (0, tail), value=torch.iinfo(segment_ids.dtype).max).view(rows, blocks, block).amin(-1)
    high = F.pad(segment_ids, (0, tail), value=-1).view(rows, blocks, block).amax(-1)  # [R, NB]
    q_low, q_high = low[:, :, None], high[:, :, None]  # [R, NB, 1]
    kv_low, kv_high = low[:, None, :], high[:, None, :]  # [R, 1, NB]
    index = torch.arange(blocks, device=segment_ids.device)
    q_block, kv_block = index[:, None], index[None, :]  # [NB, 1], [1, NB]
    # A block cut by the end of the row is never full: its missing positions are left to the kernel's bounds checks
    # inside partial tiles.
    whole = index < length // block  # [NB]
    reachable = kv_block <= q_block
    everywhere = kv_block < q_block
    if window is not None:
        # Closest pair: first query of block i, last key of block j; farthest: last query, first key.
        reachable = reachable & (q_block * block - (kv_block * block + block - 1) < window)
        everywhere = everywhere & ((q_block * block + block - 1) - kv_block * block < window)
    overlap = (q_low <= kv_high) & (kv_low <= q_high)  # [R, NB, NB]
    one_segment = (q_low == q_high) & (kv_low == kv_high) & (q_low == kv_low)
    full = everywhere & one_segment & whole[:, None] & whole[None, :]
    partial = reachable & overlap & ~full

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        allowed = (segment_ids[b, q_idx] == segment_ids[b, kv_idx]) & (kv_idx <= q_idx)
        if window is not None:
            allowed = allowed & (q_idx - kv_idx < window)
        return allowed

    partial_count, partial_index = ordered_tiles(partial)
    full_count, full_index = ordered_tiles(full)
    return BlockMask.from_kv_blocks(
        partial_count,
        partial_index,
        full_count,
        full_index,
        BLOCK_SIZE=block,
        mask_mod=mask_mod,
        seq_lengths=(length, length),
    )
