"""Attention over the static cache: position masks, and the attention function the target's layers call.

Masks. Query of row r at absolute position q sees key index j (= position j, see `cache.py`) iff j <= q, and on
sliding-window layers also q - j < window (transformers' rule: the window counts the query itself). Built once
per forward from the query positions `[k, T]`, `[k, 1, T, kv_len]` bool, one per layer type. Stale entries past a
row's length sit at indices above every query position of that row, so the same rule hides them.

Prefill (rows filled from position 0, attending only to their own new tokens): full-attention layers get no
mask and run SDPA's causal kernel; sliding layers get the mask above over the new tokens.

The attention function (`ENGINE_ATTENTION`, registered with transformers' `AttentionInterface`) receives the
module's queries `[k, Hq, T, D]` and what `StaticKVCache.update` returned, `[k, Hkv, S, D]`. For grouped-query
attention with a mask (decode and verify steps) it folds the G = Hq / Hkv query heads that share a KV head into
the query length, `[k, Hkv, G*T, D]`, and repeats the mask G times along the queries: SDPA then reads each KV
head once instead of materialising the KV buffers G times (`repeat_kv`), and the mask stays `[k, 1, G*T, S]`.
transformers orders query heads by KV group (head h uses KV head h // G), which is what the fold assumes.

`engine_attention(modules)` switches the attention modules' config to this function for the duration of a forward (or a
CUDA-graph capture: replays run no Python) and restores the previous implementation afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface

ENGINE_ATTENTION = "dflash_static_cache"


def static_cache_attention(
    module: nn.Module,
    query: Tensor,  # [k, Hq, T, D]
    key: Tensor,  # [k, Hkv, S, D]
    value: Tensor,  # [k, Hkv, S, D]
    attention_mask: Tensor | None,  # [k, 1, T, S] bool, or None for causal self-attention over the new tokens
    scaling: float,
    dropout: float = 0.0,
    **kwargs: object,
) -> tuple[Tensor, None]:
    """Returns the attention output as transformers' attention functions do: `[k, T, Hq, D]`."""
    rows, q_heads, length, dim = query.shape
    kv_heads = key.shape[1]
    grouped = q_heads != kv_heads
    if attention_mask is None:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=grouped)
        return out.transpose(1, 2).contiguous(), None
    if not grouped or length == key.shape[2]:
        # Prefill of a sliding layer (queries as long as keys): folding would repeat a square mask G times.
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=grouped
        )
        return out.transpose(1, 2).contiguous(), None
    groups = q_heads // kv_heads
    folded_query = query.reshape(rows, kv_heads, groups * length, dim)  # [k, Hkv, G*T, D]
    keys_per_row = attention_mask.shape[-1]
    folded_mask = attention_mask.unsqueeze(2).expand(rows, 1, groups, length, keys_per_row)
    folded_mask = folded_mask.reshape(rows, 1, groups * length, keys_per_row)  # [k, 1, G*T, S]
    out = F.scaled_dot_product_attention(folded_query, key, value, attn_mask=folded_mask, scale=scaling)
    # reshape, not view: the CUDA kernels may return the folded output with other strides than CPU SDPA does.
    out = out.reshape(rows, q_heads, length, dim)  # [k, Hq, T, D]
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ENGINE_ATTENTION, static_cache_attention)


def position_mask(q_positions: Tensor, kv_len: int, window: int | None) -> Tensor:
    """`[k, 1, T, kv_len]` bool: key j visible to the query at position q iff j <= q (and q - j < window)."""
    keys = torch.arange(kv_len, device=q_positions.device)  # [S]
    distance = q_positions[:, :, None] - keys  # [k, T, S]
    visible = distance >= 0
    if window is not None:
        visible = visible & (distance < window)
    return visible[:, None]


def layer_masks(
    layer_windows: Sequence[int | None], q_positions: Tensor, kv_len: int | None
) -> dict[int | None, Tensor | None]:
    """One mask per distinct window (None = full attention). `kv_len` None: prefill over the new tokens."""
    masks: dict[int | None, Tensor | None] = {}
    for window in dict.fromkeys(layer_windows):
        if kv_len is None and window is None:
            masks[window] = None  # the causal kernel
        else:
            masks[window] = position_mask(q_positions, kv_len or q_positions.shape[1], window)
    return masks


@contextmanager
def engine_attention(modules: Sequence[nn.Module]) -> Iterator[None]:
    """Route the attention modules' attention through `static_cache_attention` inside the block."""
    configs = list({id(module.config): module.config for module in modules}.values())
    previous = [config._attn_implementation for config in configs]
    for config in configs:
        config._attn_implementation = ENGINE_ATTENTION
    try:
        yield
    finally:
        for config, implementation in zip(configs, previous, strict=True):
            config._attn_implementation = implementation
