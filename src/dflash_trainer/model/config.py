"""The drafter's architecture: a typed config, derived from the target's HF config, convertible to the
Qwen3-style `config.json` that z-lab/dflash, vLLM and SGLang read."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from transformers import Qwen3Config

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


def default_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """K taps spread evenly from layer 1 to L-3 (0-indexed decoder layers; a tap reads the layer's output)."""
    if num_target_layers < 4:
        raise ValueError(f"need a target with at least 4 layers to spread taps over 1..L-3, got {num_target_layers}")
    if num_features == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_features - 1)) for i in range(num_features)]


# Rope settings of a target that the drafter's layers do not implement (see `from_target`).
TARGET_ONLY_ROPE_KEYS = frozenset({"partial_rotary_factor", "mrope_section", "mrope_interleaved"})


@dataclass
class DrafterModelConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    num_hidden_layers: int
    vocab_size: int
    target_layer_ids: list[int]
    num_target_layers: int
    block_size: int
    mask_token_id: int
    rms_norm_eps: float = 1e-6
    # HF rope description, e.g. {"rope_type": "default", "rope_theta": 1e6}; copied from the target.
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 1e6})
    max_position_embeddings: int = 40960
    # One entry per drafter layer: FULL_ATTENTION or SLIDING_ATTENTION.
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    # Whether sliding layers are causal inside the block (what the serving engine runs).
    sliding_causal_in_block: bool = False
    attention_bias: bool = False

    def __post_init__(self) -> None:
        if self.layer_types is None:
            self.layer_types = [FULL_ATTENTION] * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        if SLIDING_ATTENTION in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_attention layers need a positive sliding_window")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} outside the vocabulary [0, {self.vocab_size})")
        last = self.num_target_layers - 1
        if len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            # The default spread repeats layers when K exceeds the L-3 layers from 1 to L-3 (K=2 on 4 layers).
            raise ValueError(
                f"target_layer_ids {self.target_layer_ids} repeat a layer: the {self.num_target_layers}-layer "
                f"target has {max(1, self.num_target_layers - 3)} layers to spread taps over (1..L-3); set "
                "drafter.num_target_features to at most that, or name distinct drafter.target_layer_ids"
            )
        if sorted(self.target_layer_ids) != self.target_layer_ids:
            raise ValueError(
                f"target_layer_ids {self.target_layer_ids} are not in layer order: serving engines collect the tapped "
                "layers' outputs in layer order, so the context projection would read them permuted"
            )
        if not self.target_layer_ids or max(self.target_layer_ids) >= last or min(self.target_layer_ids) < 0:
            # Engines capture a layer's output as the input of the next one; the last layer has none (DESIGN §2).
            raise ValueError(
                f"target_layer_ids {self.target_layer_ids}: taps must lie in 0..{last - 1}; layer {last} is the "
                "target's last, whose output serving engines do not capture"
            )

    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    def layer_window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == SLIDING_ATTENTION else None

    def layer_causal_in_block(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING_ATTENTION and self.sliding_causal_in_block

    @classmethod
    def from_target(
        cls,
        target_config: Any,
        *,
        num_layers: int,
        block_size: int,
        mask_token_id: int,
        target_layer_ids: list[int] | None = None,
        num_target_features: int = 5,
        intermediate_size: int | None = None,
        sliding_layers: list[int] | tuple[int, ...] = (),
        sliding_window: int | None = None,
        sliding_causal_in_block: bool = False,
    ) -> DrafterModelConfig:
        """Size the drafter like the target's layers (hidden size, heads, rope) so its layers are Qwen3-shaped."""
        text = getattr(target_config, "text_config", None) or target_config
        num_target_layers = text.num_hidden_layers
        heads = text.num_attention_heads
        rope = getattr(text, "rope_parameters", None)
        if not rope:
            rope = {"rope_type": "default", "rope_theta": float(getattr(text, "rope_theta", 1e4))}
        # The drafter's layers rotate the whole head with 1-D positions: drop the target's partial-rotary and
        # multimodal (M-RoPE) settings, which a serving engine would otherwise apply to the exported drafter.
        rope = {k: v for k, v in dict(rope).items() if k not in TARGET_ONLY_ROPE_KEYS}
        layer_types = [SLIDING_ATTENTION if i in sliding_layers else FULL_ATTENTION for i in range(num_layers)]
        return cls(
            hidden_size=text.hidden_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
            intermediate_size=intermediate_size or text.intermediate_size,
            num_hidden_layers=num_layers,
            vocab_size=text.vocab_size,
            target_layer_ids=list(target_layer_ids or default_target_layer_ids(num_target_layers, num_target_features)),
            num_target_layers=num_target_layers,
            block_size=block_size,
            mask_token_id=mask_token_id,
            rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-6)),
            rope_parameters=rope,
            max_position_embeddings=getattr(text, "max_position_embeddings", 40960),
            layer_types=layer_types,
            sliding_window=sliding_window if sliding_layers else None,
            sliding_causal_in_block=sliding_causal_in_block,
        )

    def to_hf_config(self) -> Qwen3Config:
        """The Qwen3-style config of the exported checkpoint (`DFlashDraftModel`)."""
        config = Qwen3Config(
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters=copy.deepcopy(self.rope_parameters),
            max_position_embeddings=self.max_position_embeddings,
            attention_bias=self.attention_bias,
            layer_types=list(self.layer_types),
            sliding_window=self.sliding_window,
            use_sliding_window=self.sliding_window is not None,
            tie_word_embeddings=False,
        )
        config.architectures = ["DFlashDraftModel"]
        config.block_size = self.block_size
        config.num_target_layers = self.num_target_layers
        config.dflash_config = {
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layer_ids),
            "sliding_causal_in_block": self.sliding_causal_in_block,
        }
        return config
