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

Taps: the outputs of decoder layers `tap_layers` (the drafter's `target_layer_ids`), concatenated in that order,
the same definition as training's `FeatureCapture`. All layers run: the logits are needed in every mode.

Supported targets: Llama (SmolLM2), Qwen2 and Qwen3 layouts with full and sliding-window attention
(`SUPPORTED_MODEL_TYPES`, each tested against transformers). Anything else raises `UnsupportedTargetError`
(a layout we have not checked could be silently wrong); linear-attention hybrids see `cache.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import PreTrainedModel

from ..target.capture import decoder_module, embedding_module, lm_head_module
from .attention import engine_attention, layer_masks
from .cache import StaticKVCache, UnsupportedTargetError, check_supported_layer_types

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
# RoPE variants whose frequencies depend on the longest position seen: a data-dependent host check per call.
_DYNAMIC_ROPE_TYPES = ("dynamic", "longrope")


@dataclass
class ForwardOutput:
    logits: Tensor  # [k, V] (prefill: each row's last token) or [k, T, V] (step)
    features: Tensor | None  # [k, T, K*H] in tap order, None without taps


class TargetRunner:
    """Runs a frozen Hugging Face causal LM over a `StaticKVCache`; see the module docstring."""

    def __init__(self, model: PreTrainedModel, *, tap_layers: Sequence[int] = ()) -> None:
        config = model.config.get_text_config(decoder=True)
        name = type(model).__name__
        layers = decoder_module(model).layers
        check_supported_layer_types(name, getattr(config, "layer_types", None) or ["full_attention"] * len(layers))
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedTargetError(
                f"{name} (model_type {config.model_type!r}): the decoding engine supports "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} layouts"
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
        self.layer_windows = [getattr(layer.self_attn, "sliding_window", None) for layer in layers]
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(layers[0].self_attn.head_dim)
        self.hidden_size = int(config.hidden_size)
        self.vocab_size = int(self.lm_head.weight.shape[0])
        self.dtype = self.embed.weight.dtype
        self.device = self.embed.weight.device
        rope_type = str(getattr(self.decoder.rotary_emb, "rope_type", "default"))
        # Dynamic RoPE re-derives its frequencies from max(position) on the host: no CUDA graphs then.
        self.graph_safe = not any(kind in rope_type for kind in _DYNAMIC_ROPE_TYPES)

    def new_cache(self, rows: int, max_len: int) -> StaticKVCache:
        return StaticKVCache(
            num_layers=len(self.layers),
            rows=rows,
            kv_heads=self.kv_heads,
            max_len=max_len,
            head_dim=self.head_dim,
            dtype=self.dtype,
            device=self.device,
        )

    def cache_bytes_per_token(self) -> int:
        """Bytes of keys and values per cached token (all layers)."""
        return 2 * len(self.layers) * self.kv_heads * self.head_dim * self.embed.weight.element_size()

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
    ) -> ForwardOutput:
        if (kv_len is None) != (last_index is not None):
            raise ValueError("prefill passes last_index and no kv_len; a step passes kv_len")
        count = input_ids.shape[0]
        if rows is None:
            if count != cache.rows:
                raise ValueError(f"a step covers every cache row: {count} rows given, the cache has {cache.rows}")
            rows = torch.arange(count, device=input_ids.device)
        cache.begin(rows=rows, positions=positions, kv_len=kv_len)
        hidden = self.embed(input_ids)  # [k, T, H]
        position_embeddings = self.decoder.rotary_emb(hidden, positions)  # cos, sin [k, T, D]
        masks = layer_masks(self.layer_windows, positions, kv_len)
        taps: dict[int, Tensor] = {}
        with engine_attention(self.layers):
            for index, layer in enumerate(self.layers):
                output = layer(
                    hidden,
                    attention_mask=masks[self.layer_windows[index]],
                    position_ids=positions,
                    past_key_values=cache,
                    use_cache=True,
                    position_embeddings=position_embeddings,
                )
                hidden = output[0] if isinstance(output, tuple) else output
                if index in self.tap_layers:
                    taps[index] = hidden
        features = torch.cat([taps[i] for i in self.tap_layers], dim=-1) if self.tap_layers else None
        if last_index is not None:
            hidden = hidden[torch.arange(count, device=hidden.device), last_index]  # [k, H]
        logits = self.lm_head(self.decoder.norm(hidden))
        return ForwardOutput(logits=logits, features=features)
