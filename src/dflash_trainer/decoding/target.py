"""The target's forward over the static cache: its own decoder layers, chosen layer outputs (taps), logits.

`TargetRunner.forward(cache, input_ids [k, T], positions [k, T], ...)` embeds the tokens, computes RoPE from the
per-row positions with the target's own rotary module, and calls each Hugging Face decoder layer with the
static cache as `past_key_values`, the mask of its layer type and `position_embeddings` (see `cache.py` and
`attention.py` for the protocol). Everything the target's layers do (q/k/v biases of Qwen2, q/k norms of Qwen3,
RoPE scaling) is their own code; the engine supplies only the cache and the attention kernel. Two modes:

- prefill: rows `rows` [k] of the cache are filled from position 0 with right-padded prompts; returns the logits
  at `last_index` [k] (each prompt's last token) only, `[k, V]`, and the tapped features `[k, T, K*H]`;
- step: every row of the cache gets T new tokens at its own positions and attends to the first `kv_len` cache
  entries; returns logits `[k, T, V]` and features `[k, T, K*H]`. A step has fixed shapes and no host syncs, so
  it can be captured in a CUDA graph (`graphs.py`).

- verify (step with `verify=True`): as step, but linear-attention layers keep their states until the caller
  says how many tokens each row keeps (`cache.commit(counts)`, `recurrent.py`).

Taps: the outputs of decoder layers `tap_layers` (the drafter's `target_layer_ids`), concatenated in that order,
the same definition as training's `FeatureCapture`. All layers run: the logits are needed in every mode.

Supported targets: Llama (SmolLM2), Qwen2 and Qwen3 layouts with full and sliding-window attention, and Qwen3.5/3.6
hybrids (`qwen3_5_text`: Gated DeltaNet linear-attention layers beside gated full-attention layers, multimodal RoPE
given the text position on every axis) (`SUPPORTED_MODEL_TYPES`, each tested against transformers). Anything else
raises `UnsupportedTargetError` (a layout we have not checked could be silently wrong). The linear-attention
layers run transformers' own code (and with it flash-linear-attention's kernels where transformers found `fla`);
their per-row states live in the cache (`recurrent.py`), and their delta-rule kernels are routed through it for
the duration of a forward (`routed_delta_rules`). On a GPU with flash-linear-attention (`hybrid_kernels.py`) their
short convolution runs fla's Triton kernels too, decode steps and commits advance the states in place, and the
hybrid's RMS norms (zero-centred and gated) run as one fla kernel each, all for the duration of a forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import PreTrainedModel

from ..targets.capture import decoder_module, embedding_module, lm_head_module
from .attention import engine_attention, layer_masks
from .cache import StaticKVCache, UnsupportedTargetError, check_supported_layer_types
from .hybrid_kernels import (
    TRANSFORMERS,
    HybridKernels,
    NormWeights,
    routed_convolutions,
    routed_norms,
    select_hybrid_kernels,
)
from .recurrent import LinearLayerShape, RecurrentStates, delta_rule_modules, routed_delta_rules, state_dtype_for

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_5_text")
# Layouts whose linear-attention layers this engine has been checked against (transformers 5.17).
HYBRID_MODEL_TYPES = ("qwen3_5_text",)
# RoPE variants whose frequencies depend on the longest position seen: a data-dependent host check per call.
_DYNAMIC_ROPE_TYPES = ("dynamic", "longrope")


@dataclass
class ForwardOutput:
    logits: Tensor  # [k, V] (prefill: each row's last token) or [k, T, V] (step)
    features: Tensor | None  # [k, T, K*H] in tap order, None without taps


class TargetRunner:
    """Runs a frozen Hugging Face causal LM over a `StaticKVCache`; see the module docstring. `hybrid_kernels`:
    what a hybrid's layers run besides transformers' own (default: `select_hybrid_kernels`).
    `recurrent_state_dtype`: a hybrid's delta-rule states' dtype (None: float32, float64 for a float64 model;
    bfloat16 halves their memory and traffic, see `recurrent.py` "State dtype")."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        tap_layers: Sequence[int] = (),
        hybrid_kernels: HybridKernels | None = None,
        recurrent_state_dtype: torch.dtype | None = None,
    ) -> None:
        config = model.config.get_text_config(decoder=True)
        name = type(model).__name__
        layers = decoder_module(model).layers
        layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * len(layers))
        check_supported_layer_types(name, layer_types)
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedTargetError(
                f"{name} (model_type {config.model_type!r}): the decoding engine supports "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} layouts"
            )
        linear = [index for index, kind in enumerate(layer_types) if kind == "linear_attention"]
        if linear and config.model_type not in HYBRID_MODEL_TYPES:
            raise UnsupportedTargetError(
                f"{name} (model_type {config.model_type!r}) has linear-attention layers; the decoding engine "
                f"serves those of {', '.join(HYBRID_MODEL_TYPES)} only"
            )
        for layer_id in tap_layers:
            if not 0 <= layer_id < len(layers):
                raise ValueError(f"target_layer_ids: {layer_id} outside 0..{len(layers) - 1} (target layers)")
        self.model = model
        self.decoder = decoder_module(model)
        self.layers = layers
        self.embed = embedding_module(model)
        self.lm_head = lm_head_module(model)
        self.tap_layers = list(tap_layers)
        self.linear_shapes = {index: LinearLayerShape.of(layers[index].linear_attn) for index in linear}
        self.attention_layers = [index for index in range(len(layers)) if index not in self.linear_shapes]
        self.delta_rule_modules = delta_rule_modules([layers[index].linear_attn for index in linear])
        self.attention_modules = [layers[index].self_attn for index in self.attention_layers]
        # Attention window per layer (None: full attention; linear-attention layers take no mask).
        self.layer_windows = [
            None if index in self.linear_shapes else getattr(layer.self_attn, "sliding_window", None)
            for index, layer in enumerate(layers)
        ]
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(self.attention_modules[0].head_dim)
        self.hidden_size = int(config.hidden_size)
        self.vocab_size = int(self.lm_head.weight.shape[0])
        self.dtype = self.embed.weight.dtype
        self.device = self.embed.weight.device
        self.recurrent_state_dtype = state_dtype_for(self.dtype, recurrent_state_dtype)
        self.hybrid_kernels = hybrid_kernels or (select_hybrid_kernels(self.device) if linear else TRANSFORMERS)
        self.norms = NormWeights(self.decoder)  # the norms `hybrid_kernels` may run (hybrid_kernels.py)
        rotary = self.decoder.rotary_emb
        # Multimodal RoPE (Qwen3.5) takes a position per axis; text has the same position on every axis.
        self.rope_axes = len(rotary.mrope_section) if getattr(rotary, "mrope_section", None) is not None else 0
        rope_type = str(getattr(rotary, "rope_type", "default"))
        # Dynamic RoPE re-derives its frequencies from max(position) on the host: no CUDA graphs then.
        self.graph_safe = not any(kind in rope_type for kind in _DYNAMIC_ROPE_TYPES)

    @property
    def hybrid(self) -> bool:
        return bool(self.linear_shapes)

    def new_cache(self, rows: int, max_len: int) -> StaticKVCache:
        recurrent = None
        if self.hybrid:
            recurrent = RecurrentStates(
                self.linear_shapes,
                num_layers=len(self.layers),
                rows=rows,
                dtype=self.dtype,
                device=self.device,
                advance=self.hybrid_kernels.advance,
                state_dtype=self.recurrent_state_dtype,
            )
        return StaticKVCache(
            attention_layers=self.attention_layers,
            num_layers=len(self.layers),
            rows=rows,
            kv_heads=self.kv_heads,
            max_len=max_len,
            head_dim=self.head_dim,
            dtype=self.dtype,
            device=self.device,
            recurrent=recurrent,
        )

    def cache_bytes_per_token(self) -> int:
        """Bytes of keys and values per cached token (all attention layers)."""
        return 2 * len(self.attention_layers) * self.kv_heads * self.head_dim * self.embed.weight.element_size()

    def state_bytes_per_row(self) -> int:
        """Bytes of recurrent state per row (linear-attention layers; independent of the length)."""
        return RecurrentStates.bytes_per_row(self.linear_shapes, self.dtype, self.recurrent_state_dtype)

    @torch.inference_mode()
    def forward(
        self,
        cache: StaticKVCache,
        input_ids: Tensor,  # [k, T]
        positions: Tensor,  # [k, T] absolute positions (prefill: 0..T-1)
        *,
        rows: Tensor | None = None,  # [k] cache rows (prefill); None = every row in order (step)
        kv_len: int | None = None,  # step: cache entries attended to; None = prefill
        last_index: Tensor | None = None,  # [k] prefill: index of each row's last prompt token
        verify: bool = False,  # step: recurrent states wait for `cache.commit`
    ) -> ForwardOutput:
        if (kv_len is None) != (last_index is not None):
            raise ValueError("prefill passes last_index and no kv_len; a step passes kv_len")
        count = input_ids.shape[0]
        if rows is None:
            if count != cache.rows:
                raise ValueError(f"a step covers every cache row: {count} rows given, the cache has {cache.rows}")
            rows = torch.arange(count, device=input_ids.device)
        lengths = last_index + 1 if last_index is not None else None
        cache.begin(rows=rows, positions=positions, kv_len=kv_len, lengths=lengths, verify=verify)
        hidden = self.embed(input_ids)  # [k, T, H]
        rope_positions = positions[None].expand(self.rope_axes, -1, -1) if self.rope_axes else positions
        position_embeddings = self.decoder.rotary_emb(hidden, rope_positions)  # cos, sin [k, T, D]
        windows = [self.layer_windows[index] for index in self.attention_layers]
        masks = layer_masks(windows, positions, kv_len)
        taps: dict[int, Tensor] = {}
        routing = routed_delta_rules(self.delta_rule_modules, cache.recurrent) if self.hybrid else nullcontext()
        convolutions = routed_convolutions(self.delta_rule_modules, self.hybrid_kernels)
        norms = routed_norms(self.norms, self.hybrid_kernels)
        with engine_attention(self.attention_modules), routing, convolutions, norms:
            for index, layer in enumerate(self.layers):
                cache.enter_layer(index)
                linear = index in self.linear_shapes
                output = layer(
                    hidden,
                    attention_mask=None if linear else masks[self.layer_windows[index]],
                    position_ids=positions,
                    past_key_values=cache,
                    use_cache=True,
                    position_embeddings=position_embeddings,
                )
                hidden = output[0] if isinstance(output, tuple) else output
                if index in self.tap_layers:
                    taps[index] = hidden
            if last_index is not None:
                hidden = hidden[torch.arange(count, device=hidden.device), last_index]  # [k, H]
            hidden = self.decoder.norm(hidden)
        features = torch.cat([taps[i] for i in self.tap_layers], dim=-1) if self.tap_layers else None
        logits = self.lm_head(hidden)
        return ForwardOutput(logits=logits, features=features)
