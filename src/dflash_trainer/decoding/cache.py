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

Hybrid targets (Qwen3.5/3.6: Gated DeltaNet linear-attention layers beside full-attention layers): the KV
buffers exist for the attention layers only; the linear-attention layers keep per-row recurrent states in a
`RecurrentStates` (`recurrent.py`), which this object hands the layers as `layers[i]`, `has_previous_state`,
`update_conv_state` and `update_recurrent_state` (the `cache_params` protocol of transformers' layers). Those
states cannot be rolled back by a length: a verify step (`begin(..., verify=True)`) leaves them as they were and
`commit(counts)` advances every row over the tokens it kept (`recurrent.py` says how, exactly). For targets
without linear-attention layers `commit` does nothing: the lengths kept by the caller are the rollback.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..errors import UserError
from .recurrent import Mode, RecurrentStates

# Layer types this cache can serve: attention (past = keys/values per position) and linear attention (past =
# per-row recurrent states, `recurrent.py`).
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")


class UnsupportedTargetError(UserError, NotImplementedError):
    """The target has layers or a layout the decoding engine does not serve."""


def check_supported_layer_types(model_name: str, layer_types: Sequence[str]) -> None:
    unsupported = sorted(set(layer_types) - set(SUPPORTED_LAYER_TYPES))
    if unsupported:
        raise UnsupportedTargetError(
            f"{model_name}: layer types {unsupported} are not supported by the decoding engine"
        )


class StaticKVCache:
    """Preallocated keys/values `[rows, kv_heads, max_len, head_dim]` of the attention layers (None for others),
    and the recurrent states of linear-attention layers when there are any; see the module docstring."""

    def __init__(
        self,
        *,
        attention_layers: Sequence[int],
        num_layers: int,
        rows: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        recurrent: RecurrentStates | None = None,
    ) -> None:
        if rows < 1 or max_len < 1:
            raise ValueError(f"StaticKVCache: rows and max_len must be >= 1, got {rows} and {max_len}")
        if recurrent is not None and recurrent.rows != rows:
            raise ValueError(f"recurrent states for {recurrent.rows} rows given to a cache of {rows} rows")
        shape = (rows, kv_heads, max_len, head_dim)
        attention = set(attention_layers)
        self.keys: list[Tensor | None] = [
            torch.zeros(shape, dtype=dtype, device=device) if i in attention else None for i in range(num_layers)
        ]
        self.values: list[Tensor | None] = [
            torch.zeros(shape, dtype=dtype, device=device) if i in attention else None for i in range(num_layers)
        ]
        self.recurrent = recurrent
        # What transformers' linear-attention layers read as `cache_params.layers[i]`.
        self.layers = recurrent.layers if recurrent is not None else [None] * num_layers
        self.rows = rows
        self.max_len = max_len
        self._layout = dict(
            attention_layers=sorted(attention),
            num_layers=num_layers,
            kv_heads=kv_heads,
            head_dim=head_dim,
            dtype=dtype,
            device=device,
        )
        self._row_index: Tensor | None = None  # [k, 1]
        self._positions: Tensor | None = None  # [k, T]
        self._kv_len: int | None = None  # None: prefill mode

    def _buffers(self) -> list[Tensor]:
        return [t for t in (*self.keys, *self.values) if t is not None]

    @property
    def nbytes(self) -> int:
        states = self.recurrent.tensors() if self.recurrent is not None else []
        return sum(t.numel() * t.element_size() for t in (*self._buffers(), *states))

    def resized(self, max_len: int) -> StaticKVCache:
        """A cache of `max_len` positions holding this one's entries (and the same recurrent states)."""
        grown = StaticKVCache(rows=self.rows, max_len=max_len, recurrent=self.recurrent, **self._layout)
        kept = min(max_len, self.max_len)
        for old, new in zip(self._buffers(), grown._buffers(), strict=True):
            new[:, :, :kept].copy_(old[:, :, :kept])
        return grown

    def begin(
        self,
        *,
        rows: Tensor,
        positions: Tensor,
        kv_len: int | None,
        lengths: Tensor | None = None,
        verify: bool = False,
    ) -> None:
        """Where the next forward's tokens go: `rows` [k] cache rows, `positions` [k, T] their absolute positions.

        `kv_len` None: prefill (the rows start at position 0 and attend only to the new tokens; `lengths` [k] are
        the prompt lengths, needed by linear-attention layers); else step mode, `update` returns the first
        `kv_len` entries of every row (then `rows` must be all rows, in order). `verify`: a step whose recurrent
        states wait for `commit`."""
        if kv_len is not None and not 0 < kv_len <= self.max_len:
            raise ValueError(f"kv_len {kv_len} outside 1..{self.max_len}")
        if verify and kv_len is None:
            raise ValueError("verify is a step mode: pass kv_len")
        self._row_index = rows[:, None]
        self._positions = positions
        self._kv_len = kv_len
        if self.recurrent is not None:
            if kv_len is None:
                if lengths is None:
                    raise ValueError("prefill of a target with linear-attention layers needs the prompt lengths")
                self.recurrent.begin(Mode.PREFILL, rows=rows, positions=positions, lengths=lengths)
            else:
                self.recurrent.begin(Mode.VERIFY if verify else Mode.ADVANCE)

    def commit(self, counts: Tensor) -> None:
        """After a verify forward: every row r keeps the first `counts[r]` block tokens (`recurrent.py`)."""
        if self.recurrent is not None:
            self.recurrent.commit(counts)

    def update(
        self, key_states: Tensor, value_states: Tensor, layer_idx: int, cache_kwargs: dict | None = None
    ) -> tuple[Tensor, Tensor]:
        """Write the new keys/values `[k, kv_heads, T, head_dim]`; return what the layer attends to."""
        if self._positions is None or self._row_index is None:
            raise RuntimeError("StaticKVCache.update called outside a forward started with begin()")
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if keys is None or values is None:
            raise RuntimeError(f"layer {layer_idx} has no KV buffers (not an attention layer)")
        # Advanced indices on dims 0 and 2 with a slice between them: the indexed view is [k, T, kv_heads, D].
        keys[self._row_index, :, self._positions] = key_states.transpose(1, 2).to(keys.dtype)
        values[self._row_index, :, self._positions] = value_states.transpose(1, 2).to(values.dtype)
        if self._kv_len is None:
            return key_states, value_states
        return keys[:, :, : self._kv_len], values[:, :, : self._kv_len]

    # The linear-attention layers' side of the protocol (`recurrent.py`).

    def _states(self) -> RecurrentStates:
        if self.recurrent is None:
            raise RuntimeError("this cache has no linear-attention layers")
        return self.recurrent

    def enter_layer(self, layer: int) -> None:
        if self.recurrent is not None:
            self.recurrent.enter_layer(layer)

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return self._states().has_previous_state(layer_idx, state_idx)

    def update_conv_state(self, conv_states: Tensor, layer_idx: int, state_idx: int = 0, **kwargs: object) -> Tensor:
        return self._states().update_conv_state(conv_states, layer_idx, state_idx)

    def update_recurrent_state(
        self, recurrent_states: Tensor | None, layer_idx: int, state_idx: int = 0, **kwargs: object
    ) -> Tensor:
        return self._states().update_recurrent_state(recurrent_states, layer_idx, state_idx)
