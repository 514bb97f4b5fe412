"""DFlash2's architecture config: DFlash's (`model/config.py`) plus the convolution's and the selector's sizes.

The four added fields are the four keys z-lab's `DFlash2DraftModel` reads from `dflash_config` (and vLLM, SGLang and
llama.cpp with it); their defaults are those of the published checkpoints (`z-lab/Qwen3.8-27B-DFlash2`): a two-tap
convolution whose dynamic part is shared by groups of 16 channels, and a rank-256 selector over the top 16
candidates. `algorithm` names the drafter family in a training checkpoint's `drafter_config.json`, where nothing
else says which class to rebuild.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from transformers import Qwen3Config

from ..config import DrafterModelConfig

ARCHITECTURE = "DFlash2DraftModel"


@dataclass
class DFlash2ModelConfig(DrafterModelConfig):
    # Taps of the causal convolution (2: a slot and the one before it).
    conv_kernel_size: int = 2
    # Channels that share one dynamic kernel coefficient; divides hidden_size.
    conv_group_size: int = 16
    # Rank of the selector's transition score (codebooks [V, rank], projection [rank, H]).
    selector_rank: int = 256
    # Candidates per slot: the unary (LM head) top-k the selector chooses among.
    selector_top_k: int = 16
    # How training parameterises the codebooks (`selector.py`): free [V, rank] tensors, or maps of the target's
    # token embedding. Not an export key: an export holds the codebooks themselves either way.
    selector_codebooks: Literal["free", "embedding"] = "free"
    algorithm: Literal["dflash2"] = "dflash2"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.algorithm != "dflash2":
            raise ValueError(f"algorithm {self.algorithm!r}: a DFlash2ModelConfig is 'dflash2'")
        if not 1 <= self.conv_kernel_size <= self.block_size:
            raise ValueError(f"conv_kernel_size {self.conv_kernel_size} outside 1..block_size ({self.block_size})")
        if self.conv_group_size < 1 or self.hidden_size % self.conv_group_size:
            raise ValueError(f"conv_group_size {self.conv_group_size} must divide hidden_size {self.hidden_size}")
        if self.selector_rank < 1:
            raise ValueError(f"selector_rank {self.selector_rank} must be >= 1")
        if not 1 <= self.selector_top_k <= self.vocab_size:
            raise ValueError(f"selector_top_k {self.selector_top_k} outside 1..vocab_size ({self.vocab_size})")
        if self.selector_codebooks not in ("free", "embedding"):
            raise ValueError(f"selector_codebooks {self.selector_codebooks!r}: 'free' or 'embedding'")

    @property
    def conv_groups(self) -> int:
        return self.hidden_size // self.conv_group_size

    @classmethod
    def extend(
        cls,
        base: DrafterModelConfig,
        *,
        conv_kernel_size: int,
        conv_group_size: int,
        selector_rank: int,
        selector_top_k: int,
        selector_codebooks: Literal["free", "embedding"] = "free",
    ) -> DFlash2ModelConfig:
        """`base` (a DFlash architecture, e.g. `DrafterModelConfig.from_target`) with DFlash2's additions."""
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(DrafterModelConfig)}
        return cls(
            **fields,
            conv_kernel_size=conv_kernel_size,
            conv_group_size=conv_group_size,
            selector_rank=selector_rank,
            selector_top_k=selector_top_k,
            selector_codebooks=selector_codebooks,
        )

    def dflash2_keys(self) -> dict[str, int]:
        """The `dflash_config` entries the engines read to build the convolution and the selector."""
        return {
            "conv_kernel_size": self.conv_kernel_size,
            "conv_group_size": self.conv_group_size,
            "selector_rank": self.selector_rank,
            "selector_top_k": self.selector_top_k,
        }

    def to_hf_config(self) -> Qwen3Config:
        config = super().to_hf_config()
        config.architectures = [ARCHITECTURE]
        config.dflash_config = {**config.dflash_config, "block_size": self.block_size, **self.dflash2_keys()}
        return config
