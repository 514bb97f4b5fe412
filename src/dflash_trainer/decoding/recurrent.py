"""Per-row states of linear-attention (Gated DeltaNet) layers, and their rollback after a verified block.

A Gated DeltaNet layer (Qwen3.5/3.6 hybrids) carries two states per sequence instead of keys/values per position:
the last `kernel` inputs of its short causal convolution, `conv [rows, conv_dim, kernel]` (model dtype), and the
delta-rule memory `recurrent [rows, Hv, Dk, Dv]` (by default float32 as transformers keeps it, float64 for a
float64 model; bfloat16 when asked: see "State dtype" below). Both summarise the whole prefix, so unlike the KV
cache (`cache.py`) they cannot be rolled back by setting a length: after a verify step that kept c of the T block
tokens of a row, the state must be the one after exactly c tokens.

How the states are rolled back (exactly, and cheaply): a verify step leaves both states as they were before the
block (the snapshot) and records, per layer, what the layer computed from the block: the convolution window
`[conv ; block inputs]` `[rows, conv_dim, kernel + T]` and the inputs of the delta-rule kernel (queries, keys,
values, log-decays g, betas; `[rows, T, heads, ...]`); the verify forward's kernel is asked for no final state
(nothing would read it). `commit(counts [rows])` then, per layer,
- sets `conv` to the `kernel` window entries ending at the row's last kept token (window[c : c + kernel]);
- re-runs the delta rule over the block from the snapshot with the slots past c *neutralised*: key 0 and
  g 0. A slot with key 0 adds nothing to the memory (the delta update is the outer product key x (v - S^T key))
  and g 0 decays nothing (exp(0) = 1), so the final state is exactly the state after the first c slots.
  That is one extra kernel call over T tokens per layer (no projections, no other layer), a small fraction of the
  verify forward. c = 0 (a finished row) keeps the snapshot.

Prefill uses the same trick for right-padded prompts of different lengths: the padding slots (positions at or
past the row's length) get key 0 and g 0, so each row's final state is its state after its own prompt, and the
convolution state is the `kernel` inputs ending at the row's last prompt token (zeros before position 0). The
outputs at real positions are untouched (everything here is causal). A refilled row therefore starts from a
zero state, whatever the row held before.

In place (`advance`, `hybrid_kernels.py`: flash-linear-attention's fused recurrent kernel on a GPU): plain decode
steps and the commit advance `recurrent` in place with one kernel call, instead of the layer's kernel returning a
fresh final state that is then copied into `recurrent`. The state is most of a hybrid's decoding memory traffic
at many rows (38.6 GB at 256 rows of the Qwen3.6-27B shape), so that halves it. Without `advance` (CPU, a GPU
without fla) the layer's own kernel and a copy run, as transformers does.

Protocol with transformers' (5.17) Gated DeltaNet layers (`Qwen3_5GatedDeltaNet.forward`), which receive this
object's owner (`StaticKVCache`) as `cache_params` and call, in order:
- `has_previous_state(layer)`: False in prefill (no initial state, zero-padded convolution), else True;
- with T == 1 and `layers[layer].record_past` False (plain decoding): `causal_conv1d_update` on
  `layers[layer].conv_states[0]` in place; otherwise `update_conv_state(inputs [k, conv_dim, T], layer)`, which
  returns what the convolution runs over (prefill: the inputs; else the window above) and keeps the states as
  the mode says. `record_past` is True in verify mode, so a verify step always takes the second path;
- the delta-rule kernel (`torch_chunk_gated_delta_rule`, or `torch_recurrent_gated_delta_rule` for one token:
  transformers binds flash-linear-attention's kernels to these names when `fla` is importable, its PyTorch
  fallbacks otherwise) with `initial_state = layers[layer].recurrent_states[0]`;
- `update_recurrent_state(final, layer)`: written (prefill: into the prefilled rows; plain decoding: all rows,
  nothing to do when `advance` already advanced the state in place and returned it as `final`), ignored in verify
  mode (the commit writes it).
The layer calls the kernels by their module-level names, so `routed_delta_rules` rebinds those two names in the
layer's modeling module to `RecurrentStates.delta_rule` for the duration of one engine forward (as
`attention.engine_attention` switches the attention implementation) and restores them afterwards; the runner
says which layer runs (`enter_layer`) and `has_previous_state` checks that the layer agrees. Everything is
in-place index work on static tensors with no host syncs, so the steps can be captured as CUDA graphs (the capture
runs a key's first step for real and then only records it, so the states advance once: `graphs.py`).

Modes (`begin`): `prefill` (rows given, from position 0), `advance` (every row keeps all T tokens: plain
decoding), `verify` (every row; states kept until `commit`).

State dtype (`state_dtype`, `target.recurrent_state_dtype`): `auto` (None) is float32 (float64 for a float64
model), the lossless reference and the default; `bfloat16` halves the memory and the traffic of the states (the
dominant term of a hybrid's decode step at many rows: 77 GB read and written per step at 256 rows of the
Qwen3.6-27B shape in float32), as serving engines keep them by default (vLLM's `mamba_ssm_cache_dtype="auto"` is
the model dtype). Every kernel that reads a state computes in float32 from it and only the store rounds: fla's
kernels load the initial state as float32 and store the final one in its tensor's dtype (the in-place `advance`:
rounded once per call), transformers' PyTorch fallbacks convert the initial state to float32 and return a float32
final state, which `update_recurrent_state` / `commit` round into the bf16 state. So a bf16 state rounds the
memory to 8 mantissa bits after every stored update; the outputs of the tokens inside one call see the unrounded
float32 memory. Plain decoding stores after every token, speculative decoding's commit once per accepted block (the
verify forward reads the rounded state of the previous commit), so with a bf16 state speculative output equals
plain output only up to that rounding: near-ties may part, as in serving engines that keep bf16 states. The
convolution states stay in the model dtype whatever this says.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from functools import partial
from types import ModuleType

import torch
from torch import Tensor, nn

from .hybrid_kernels import Advance

# The module-level names transformers' Gated DeltaNet layers call their delta-rule kernels by.
DELTA_RULE_KERNELS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")


# `target.recurrent_state_dtype` values -> the state dtype (None: `state_dtype_for`'s default).
STATE_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}


def state_dtype_for(dtype: torch.dtype, state_dtype: torch.dtype | None = None) -> torch.dtype:
    """The recurrent memory's dtype for a model in `dtype`: `state_dtype`, or by default (None) float32 (float64
    for a float64 model)."""
    if state_dtype is not None:
        if not state_dtype.is_floating_point:
            raise ValueError(f"recurrent state dtype: {state_dtype} is not a floating-point dtype")
        return state_dtype
    return torch.float64 if dtype == torch.float64 else torch.float32


class Mode(Enum):
    PREFILL = "prefill"
    ADVANCE = "advance"
    VERIFY = "verify"


@dataclass(frozen=True)
class LinearLayerShape:
    """The state dimensions of one Gated DeltaNet layer (from the module itself)."""

    conv_dim: int
    kernel: int
    value_heads: int
    key_dim: int
    value_dim: int

    @classmethod
    def of(cls, module: nn.Module) -> LinearLayerShape:
        return cls(
            conv_dim=int(module.conv_dim),
            kernel=int(module.conv_kernel_size),
            value_heads=int(module.num_v_heads),
            key_dim=int(module.head_k_dim),
            value_dim=int(module.head_v_dim),
        )


class LinearLayerState:
    """What a Gated DeltaNet layer reads as `cache_params.layers[layer]`."""

    def __init__(self, owner: RecurrentStates, conv: Tensor, recurrent: Tensor) -> None:
        # A weak reference: a strong one closes a cycle (states -> layer state -> states) that only the garbage
        # collector frees, so a dropped cache's states (38.6 GB at 256 rows of the Qwen3.6-27B shape) would stay
        # on the GPU until some later collection.
        self._owner = weakref.ref(owner)
        self.conv_states = [conv]  # [0]: [rows, conv_dim, kernel]
        self.recurrent_states = [recurrent]  # [0]: [rows, Hv, Dk, Dv]

    @property
    def record_past(self) -> bool:
        """True sends even a one-token forward through `update_conv_state` (verify mode needs the window)."""
        return self._owner().mode is Mode.VERIFY


@dataclass(frozen=True)
class _KernelCall:
    """The delta-rule kernel call of one layer in a verify forward, kept until `commit`."""

    kernel: Callable[..., tuple[Tensor, Tensor | None]]
    query: Tensor  # [R, T, H, Dk]
    key: Tensor  # [R, T, H, Dk]
    value: Tensor  # [R, T, Hv, Dv]
    g: Tensor  # [R, T, Hv] log-decay
    beta: Tensor  # [R, T, Hv]
    kwargs: dict


class RecurrentStates:
    """Static conv and recurrent states of the linear-attention layers, one row per sequence; see the module
    docstring."""

    def __init__(
        self,
        shapes: dict[int, LinearLayerShape],
        *,
        num_layers: int,
        rows: int,
        dtype: torch.dtype,
        device: torch.device,
        advance: Advance | None = None,
        state_dtype: torch.dtype | None = None,  # the delta-rule memory's; None: `state_dtype_for`'s default
    ) -> None:
        self.rows = rows
        self._advance = advance  # in-place delta rule (module docstring), None: the layer's kernel and a copy
        self.shapes = shapes
        self.layers: list[LinearLayerState | None] = [None] * num_layers
        self.state_dtype = state_dtype_for(dtype, state_dtype)
        for index, shape in shapes.items():
            conv = torch.zeros(rows, shape.conv_dim, shape.kernel, dtype=dtype, device=device)
            recurrent = torch.zeros(
                rows, shape.value_heads, shape.key_dim, shape.value_dim, dtype=self.state_dtype, device=device
            )
            self.layers[index] = LinearLayerState(self, conv, recurrent)
        self.mode = Mode.ADVANCE
        self._rows: Tensor | None = None  # [k] prefill rows
        self._valid: Tensor | None = None  # [k, T] prefill: slot holds a prompt token
        self._lengths: Tensor | None = None  # [k] prefill lengths
        self._layer: int | None = None
        # Verify mode, per layer: the convolution window [R, C, K + T] and the kernel call.
        self._windows: dict[int, Tensor] = {}
        self._calls: dict[int, _KernelCall] = {}

    @staticmethod
    def bytes_per_row(
        shapes: dict[int, LinearLayerShape], dtype: torch.dtype, state_dtype: torch.dtype | None = None
    ) -> int:
        element = dtype.itemsize
        state = state_dtype_for(dtype, state_dtype).itemsize
        return sum(
            s.conv_dim * s.kernel * element + s.value_heads * s.key_dim * s.value_dim * state for s in shapes.values()
        )

    def tensors(self) -> list[Tensor]:
        """Every state tensor (changed in place by prefill, decode and commit)."""
        return [t for state in self.layers if state is not None for t in (*state.conv_states, *state.recurrent_states)]

    def _state(self, layer: int) -> LinearLayerState:
        state = self.layers[layer]
        if state is None:
            raise RuntimeError(f"layer {layer} is not a linear-attention layer")
        return state

    # ------------------------------------------------------------------------------------------------------
    # Forward bookkeeping

    def begin(
        self, mode: Mode, *, rows: Tensor | None = None, positions: Tensor | None = None, lengths: Tensor | None = None
    ) -> None:
        """Prefill: `rows` [k] filled from position 0, `positions` [k, T], `lengths` [k] prompt lengths."""
        if self._windows or self._calls:
            raise RuntimeError("a verify forward was not committed before the next forward")
        self.mode = mode
        self._layer = None
        if mode is Mode.PREFILL:
            if rows is None or positions is None or lengths is None:
                raise ValueError("prefill needs rows, positions and lengths")
            self._rows = rows
            self._lengths = lengths
            self._valid = positions < lengths[:, None]  # [k, T]

    def enter_layer(self, layer: int) -> None:
        self._layer = layer

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        if layer_idx != self._layer:
            raise RuntimeError(f"linear-attention layer {layer_idx} ran while the engine ran layer {self._layer}")
        return self.mode is not Mode.PREFILL

    def update_conv_state(self, inputs: Tensor, layer_idx: int, state_idx: int = 0, **kwargs: object) -> Tensor:
        """`inputs` [k, conv_dim, T] (before the convolution) -> what the convolution runs over."""
        conv = self._state(layer_idx).conv_states[0]  # [R, C, K]
        kernel = conv.shape[-1]
        if self.mode is Mode.PREFILL:
            assert self._rows is not None and self._lengths is not None
            padded = torch.nn.functional.pad(inputs, (kernel, 0))  # [k, C, K + T], zeros before position 0
            index = self._lengths[:, None] + torch.arange(kernel, device=inputs.device)  # [k, K]: L-K..L-1, shifted
            last = padded.gather(2, index[:, None, :].expand(-1, inputs.shape[1], -1))  # [k, C, K]
            conv.index_copy_(0, self._rows, last.to(conv.dtype))
            return inputs
        # [R, C, K + T], laid out as [R, K + T, C] in memory: what fla's convolution reads fastest (as its inputs).
        window = torch.cat([conv.transpose(1, 2), inputs.transpose(1, 2).to(conv.dtype)], dim=1).transpose(1, 2)
        if self.mode is Mode.ADVANCE:
            conv.copy_(window[..., -kernel:])
        else:
            self._windows[layer_idx] = window
        return window

    def delta_rule(
        self,
        kernel: Callable[..., tuple[Tensor, Tensor | None]],
        query: Tensor,  # [k, T, H, Dk]
        key: Tensor,  # [k, T, H, Dk]
        value: Tensor,  # [k, T, Hv, Dv]
        g: Tensor,  # [k, T, Hv]
        beta: Tensor,  # [k, T, Hv]
        **kwargs: object,
    ) -> tuple[Tensor, Tensor | None]:
        """Stands in for the layer's delta-rule kernel `kernel` (see `routed_delta_rules`)."""
        if self.mode is Mode.PREFILL:
            assert self._valid is not None
            key, g = _neutralise(key, g, self._valid)
        elif self.mode is Mode.VERIFY:
            if self._layer is None:
                raise RuntimeError("delta rule called outside a linear-attention layer")
            self._calls[self._layer] = _KernelCall(kernel, query, key, value, g, beta, dict(kwargs))
            kwargs = {**kwargs, "output_final_state": False}  # the commit computes the state
        else:
            state = self._state(self._layer).recurrent_states[0] if self._layer is not None else None
            if state is not None and kwargs.get("initial_state") is state and self._advances(kwargs):
                return self._advance_in_place(query, key, value, g, beta, state, kwargs), state
        return kernel(query, key, value, g=g, beta=beta, **kwargs)

    def _advances(self, kwargs: dict) -> bool:
        """Whether `advance` computes what the layer's kernel would with these arguments (it knows no custom
        scale and no packed rows)."""
        return self._advance is not None and kwargs.get("scale") is None and kwargs.get("cu_seqlens") is None

    def _advance_in_place(
        self, query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor, state: Tensor, kwargs: dict
    ) -> Tensor:
        assert self._advance is not None
        return self._advance(query, key, value, g, beta, state, bool(kwargs.get("use_qk_l2norm_in_kernel", False)))

    def update_recurrent_state(self, final: Tensor | None, layer_idx: int, state_idx: int = 0, **kwargs) -> Tensor:
        recurrent = self._state(layer_idx).recurrent_states[0]
        if self.mode is Mode.VERIFY:
            return recurrent  # written by `commit`
        if final is None:
            raise RuntimeError(f"linear-attention layer {layer_idx} returned no final state")
        if final is recurrent:  # advanced in place
            return recurrent
        if self.mode is Mode.PREFILL:
            assert self._rows is not None
            recurrent.index_copy_(0, self._rows, final.to(recurrent.dtype))
        else:
            recurrent.copy_(final)
        return recurrent

    # ------------------------------------------------------------------------------------------------------
    # Rollback

    def commit(self, counts: Tensor) -> None:
        """After a verify forward: keep the first `counts[r]` (0..T) block tokens of every row r."""
        if self.mode is not Mode.VERIFY:
            raise RuntimeError("commit follows a verify forward")
        recorded = set(self._windows) & set(self._calls)
        if recorded != set(self.shapes):
            raise RuntimeError(
                f"verify forward did not record linear-attention layers {sorted(set(self.shapes) - recorded)}"
            )
        for layer, call in self._calls.items():
            state = self._state(layer)
            conv, recurrent = state.conv_states[0], state.recurrent_states[0]
            keep = torch.arange(call.key.shape[1], device=counts.device)[None, :] < counts[:, None]  # [R, T]
            key, g = _neutralise(call.key, call.g, keep)
            if self._advances(call.kwargs):
                self._advance_in_place(call.query, key, call.value, g, call.beta, recurrent, call.kwargs)
            else:
                kwargs = {**call.kwargs, "initial_state": recurrent, "output_final_state": True}
                _, final = call.kernel(call.query, key, call.value, g=g, beta=call.beta, **kwargs)
                if final is None:
                    raise RuntimeError(f"linear-attention layer {layer}: the kernel returned no final state")
                recurrent.copy_(final)
            index = counts[:, None] + torch.arange(conv.shape[-1], device=counts.device)  # [R, K]: window[c : c + K]
            conv.copy_(self._windows[layer].gather(2, index[:, None, :].expand(-1, conv.shape[1], -1)))
        self._windows.clear()
        self._calls.clear()
        self.mode = Mode.ADVANCE


def _neutralise(key: Tensor, g: Tensor, keep: Tensor) -> tuple[Tensor, Tensor]:
    """Key 0 and log-decay 0 where `keep` [k, T] is False: those slots leave the memory as it is."""
    return key.masked_fill(~keep[:, :, None, None], 0.0), g.masked_fill(~keep[:, :, None], 0.0)


def delta_rule_modules(modules: Sequence[nn.Module]) -> list[ModuleType]:
    """The modeling modules that define `modules`' classes (where their kernels are looked up by name)."""
    names = sorted({type(module).__module__ for module in modules})
    found = [sys.modules[name] for name in names]
    for module in found:
        for kernel in DELTA_RULE_KERNELS:
            if not callable(getattr(module, kernel, None)):
                raise TypeError(f"{module.__name__} has no {kernel}: not the Gated DeltaNet layout this engine knows")
    return found


@contextmanager
def routed_delta_rules(modules: Sequence[ModuleType], states: RecurrentStates) -> Iterator[None]:
    """Inside the block, the layers of `modules` call their delta-rule kernels through `states.delta_rule`."""
    saved = [(module, name, getattr(module, name)) for module in modules for name in DELTA_RULE_KERNELS]
    for module, name, kernel in saved:
        setattr(module, name, partial(states.delta_rule, kernel))
    try:
        yield
    finally:
        for module, name, kernel in saved:
            setattr(module, name, kernel)
