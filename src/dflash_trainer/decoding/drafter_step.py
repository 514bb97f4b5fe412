"""The drafter's proposal step over a static context cache (fixed shapes, CUDA-graph capturable).

The drafter (`model/drafter.py`) computes each layer's context keys/values from the fused target features and
hands them to its `cache.append(layer, k, v)`, attending to what that returns followed by the block's own keys.
`StaticDrafterContext` implements that one method over preallocated buffers `[rows, kv_heads, max_len, head_dim]`
per drafter layer, the way `StaticKVCache` does for the target:

- `begin(write_positions [R, t], valid_len [R], kv_len)` before a call says where the t new context entries go
  and how many context positions each row really has: a verify step hands over the features of all B verified
  slots, of which only the committed ones are context; the others lie past `valid_len`, are masked, and are
  overwritten by the next call. So the shapes never depend on how many drafts were accepted.
- `append` scatters the new entries and returns, for a full-attention drafter layer, the first `kv_len` entries
  of every row (masked past `valid_len` by `masks`), and for a sliding-window layer of window W exactly the W - 1
  entries before `valid_len` (gathered; those before position 0 masked): the most a block query can see there.
- `masks(block_size)` are the dense SDPA masks `[R, 1, B, ctx + B]` per layer variant: context entries as above,
  and the block bidirectional or causal, as each layer was trained (`MaskVariant.causal_in_block`). On window layers
  the window runs per query position, as in training and in the serving engines (`model/attention.py`): slot k at
  position n + k sees the context entries at positions > n + k - W, i.e. all but the first k of the W - 1
  gathered, and the block slots j with |j - k| < W.

This is exactly what training shows a block anchored at the row's length n (context positions < n, on window
layers those within W of the query; DESIGN §2), which `tests/test_speculative.py` checks against the training
forward.

`DraftProposer.propose(...)` runs one drafter pass for every row: block `[last, MASK x (B-1)]` at positions
n..n+B-1, context extended by the given features, drafts = the drafter's choice from the target's LM head on slots
1..B-1 (`DFlashDrafter.draft_tokens`: each slot's argmax; DFlash2's selector walks its candidates from the block's
first token, `model/dflash2/selector.py`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..model.attention import DrafterMasks, MaskVariant
from ..model.drafter import DFlashDrafter


class StaticDrafterContext:
    """Static per-layer context keys/values of the drafter, one row per sequence; see the module docstring."""

    def __init__(self, drafter: DFlashDrafter, *, rows: int, max_len: int, device: torch.device) -> None:
        config = drafter.config
        dtype = drafter.fc.weight.dtype
        shape = (rows, config.num_key_value_heads, max_len, config.head_dim)
        self.windows = [layer.self_attn.window for layer in drafter.layers]
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in drafter.layers]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in drafter.layers]
        self.rows = rows
        self.max_len = max_len
        self._row_index = torch.arange(rows, device=device)[:, None]  # [R, 1]
        self._write_positions: Tensor | None = None
        # Context positions of each row in the current call (set by `begin`).
        self.valid_len = torch.zeros(rows, dtype=torch.long, device=device)
        self._kv_len = 0

    def begin(self, *, write_positions: Tensor, valid_len: Tensor, kv_len: int) -> None:
        if not 0 < kv_len <= self.max_len:
            raise ValueError(f"kv_len {kv_len} outside 1..{self.max_len}")
        self._write_positions = write_positions  # [R, t]
        self.valid_len = valid_len  # [R]
        self._kv_len = kv_len

    def append(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """New context keys/values `[R, Hkv, t, D]` in; what layer `layer` attends to out."""
        if self._write_positions is None:
            raise RuntimeError("StaticDrafterContext.append called outside a call started with begin()")
        keys, values = self.keys[layer], self.values[layer]
        keys[self._row_index, :, self._write_positions] = k.transpose(1, 2).to(keys.dtype)
        values[self._row_index, :, self._write_positions] = v.transpose(1, 2).to(values.dtype)
        window = self.windows[layer]
        if window is None:
            return keys[:, :, : self._kv_len], values[:, :, : self._kv_len]
        index = self._window_positions(window).clamp(min=0)  # [R, W-1]
        gather = index[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[3])  # [R, Hkv, W-1, D]
        return keys.gather(2, gather), values.gather(2, gather)

    def _window_positions(self, window: int) -> Tensor:
        """[R, W-1]: the context positions n-W+1 .. n-1 before each row's block (n = `valid_len`), which its first
        slot sees on a window layer (negative ones do not exist and are masked)."""
        return self.valid_len[:, None] - (window - 1) + torch.arange(window - 1, device=self.valid_len.device)

    def masks(self, variants: list[MaskVariant], block_size: int) -> DrafterMasks:
        rows = self.rows
        device = self.valid_len.device
        slot = torch.arange(block_size, device=device)
        causal = slot[None, :] <= slot[:, None]  # [B, B]: key slot j at or before query slot k
        by_variant: dict[MaskVariant, object] = {}
        for variant in variants:
            block = causal if variant.causal_in_block else torch.ones_like(causal)
            if variant.window is None:
                context = torch.arange(self._kv_len, device=device)[None, :] < self.valid_len[:, None]  # [R, S]
                context = context[:, None, :].expand(rows, block_size, self._kv_len)
            else:
                # Gathered entry i sits at position n - W + 1 + i: slot k (position n + k) sees it when i >= k.
                gathered = torch.arange(variant.window - 1, device=device)
                in_window = gathered[None, :] >= slot[:, None]  # [B, W-1]
                context = (self._window_positions(variant.window) >= 0)[:, None, :] & in_window  # [R, B, W-1]
                block = block & ((slot[None, :] - slot[:, None]).abs() < variant.window)
            by_variant[variant] = torch.cat(
                [context[:, None], block[None, None].expand(rows, 1, block_size, block_size)], dim=-1
            )  # [R, 1, B, ctx + B]
        return DrafterMasks(backend="sdpa", by_variant=by_variant)


class DraftProposer:
    """One drafter pass per call for every row; the target's embedding and LM head are shared, not copied."""

    def __init__(
        self, drafter: DFlashDrafter, *, embed: nn.Module, lm_head: nn.Module, rows: int, max_len: int
    ) -> None:
        self.drafter = drafter
        self.block_size = drafter.config.block_size
        self.embed = embed
        self.lm_head = lm_head
        self.dtype = drafter.fc.weight.dtype
        device = drafter.fc.weight.device
        self.context = StaticDrafterContext(drafter, rows=rows, max_len=max_len, device=device)
        self._mask_ids = torch.full(
            (rows, self.block_size - 1), drafter.config.mask_token_id, dtype=torch.long, device=device
        )
        self._offsets = torch.arange(self.block_size, device=device)

    def propose(
        self,
        *,
        features: Tensor,  # [R, t, K*H] target features to add to the context
        feature_positions: Tensor,  # [R, t] their positions
        context_len: Tensor,  # [R] context positions after adding them (the block's first position)
        last_token: Tensor,  # [R] committed token at position context_len
        kv_len: int,  # context entries attended to by full-attention layers (> max context_len)
    ) -> Tensor:
        """Drafts for positions context_len+1 .. context_len+B-1: `[R, B-1]`."""
        self.context.begin(write_positions=feature_positions, valid_len=context_len, kv_len=kv_len)
        block_ids = torch.cat([last_token[:, None], self._mask_ids], dim=1)  # [R, B]
        block_positions = context_len[:, None] + self._offsets  # [R, B]
        hidden = self.drafter(
            features=features.to(self.dtype),
            block_embeds=self.embed(block_ids),
            ctx_positions=feature_positions,
            block_positions=block_positions,
            masks=self.context.masks(self.drafter.mask_variants, self.block_size),
            backend="sdpa",
            cache=self.context,
        )  # [R, B, H]
        logits = self.lm_head(hidden[:, 1:].to(self.lm_head.weight.dtype))  # [R, B-1, V]
        return self.drafter.draft_tokens(hidden[:, 1:], logits, last_token)
