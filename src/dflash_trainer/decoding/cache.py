"""A static KV cache with a length per row: rows decode independently, a rejected draft rolls back for free.

Layout: per attention layer one key and one value buffer `[rows, kv_heads, max_len, head_dim]`, allocated once.
The entry of the token at absolute position p of row r lives at index p of row r. Nothing in the cache says how
long a row is: the caller keeps each row's length (the position of its next token) and attends with a mask that
shows query position q the keys at positions <= q (`attention.py`). Hence

- writing T new tokens of a row means scattering their keys/values at that row's positions p..p+T-1;
- rolling a row back after a partly rejected block is only setting its length back: the entries past the
  length are never shown to a query (every query position is below them) and the next write overwrites them;
- a freshly filled row needs no clearing for the same reason, and prompts of different lengths are right-padded:
  the padding's entries sit past the row's length.

Protocol with the Hugging Face attention modules (transformers 5.17, Llama/Qwen2/Qwen3): the decoder layers are
called with this object as `past_key_values`; each attention module calls `update(key, value, layer_idx)` with
the new tokens' keys/values `[k, kv_heads, T, head_dim]` (after RoPE and any k-norm) and attends with whatever
it returns. Before a forward the runner calls `begin(...)`, saying which rows and positions the T tokens go to and
what to return: `prefill` mode returns the new keys/values themselves (rows filled from position 0 attend only to
their own prompt, so the kernel never reads the buffer), `step` mode returns the first `kv_len` entries of every
row (a view, no copy). `update` runs inside CUDA-graph captures: it does in-place index writes only.

Hybrid targets (Qwen3.5-style linear-attention layers) are refused by `check_supported_layer_types`: their
recurrent state after a verified block cannot be rolled back by a length. The place to add them is here: a
per-layer recurrent state `[rows, ...]` beside the KV buffers, with a snapshot before a verify step and a restore
plus re-advance over the accepted tokens (or per-position states from the kernel) after it (issue 11).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..errors import UserError

# Layer types this cache can serve: attention whose past is fully described by keys/values per position.
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


class UnsupportedTargetError(UserError, NotImplementedError):
    """The target has layers the static cache cannot roll back (linear attention) or an unsupported layout."""


def check_supported_layer_types(model_name: str, layer_types: Sequence[str]) -> None:
    unsupported = sorted(set(layer_types) - set(SUPPORTED_LAYER_TYPES))
    if not unsupported:
        return
    if "linear_attention" in unsupported:
        raise UnsupportedTargetError(
            f"{model_name} has linear-attention (recurrent) layers: their state after a verified block cannot be "
            "rolled back to the accepted length, so the decoding engine does not support this target yet "
            "(regeneration falls back to transformers `generate`; speculative evaluation is not available)"
        )
    raise UnsupportedTargetError(f"{model_name}: layer types {unsupported} are not supported by the decoding engine")


class StaticKVCache:
    """Preallocated per-layer keys/values `[rows, kv_heads, max_len, head_dim]`; see the module docstring."""

    def __init__(
        self,
        *,
        num_layers: int,
        rows: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if rows < 1 or max_len < 1:
            raise ValueError(f"StaticKVCache: rows and max_len must be >= 1, got {rows} and {max_len}")
        shape = (rows, kv_heads, max_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.rows = rows
        self.max_len = max_len
        self._row_index: Tensor | None = None  # [k, 1]
        self._positions: Tensor | None = None  # [k, T]
        self._kv_len: int | None = None  # None: prefill mode

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def begin(self, *, rows: Tensor, positions: Tensor, kv_len: int | None) -> None:
        """Where the next forward's tokens go: `rows` [k] cache rows, `positions` [k, T] their absolute positions.

        `kv_len` None: prefill (the rows start at position 0 and attend only to the new tokens); else step mode,
        `update` returns the first `kv_len` entries of every row (then `rows` must be all rows, in order)."""
        if kv_len is not None and not 0 < kv_len <= self.max_len:
            raise ValueError(f"kv_len {kv_len} outside 1..{self.max_len}")
        self._row_index = rows[:, None]
        self._positions = positions
        self._kv_len = kv_len

    def update(
        self, key_states: Tensor, value_states: Tensor, layer_idx: int, cache_kwargs: dict | None = None
    ) -> tuple[Tensor, Tensor]:
        """Write the new keys/values `[k, kv_heads, T, head_dim]`; return what the layer attends to."""
        if self._positions is None or self._row_index is None:
            raise RuntimeError("StaticKVCache.update called outside a forward started with begin()")
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        # Advanced indices on dims 0 and 2 with a slice between them: the indexed view is [k, T, kv_heads, D].
        keys[self._row_index, :, self._positions] = key_states.transpose(1, 2).to(keys.dtype)
        values[self._row_index, :, self._positions] = value_states.transpose(1, 2).to(values.dtype)
        if self._kv_len is None:
            return key_states, value_states
        return keys[:, :, : self._kv_len], values[:, :, : self._kv_len]
