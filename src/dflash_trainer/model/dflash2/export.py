"""DFlash2's part of the z-lab checkpoint format; `export.py` writes and reads the rest (DFlash's keys, weights).

An export of a DFlash2 drafter is a DFlash export (`export.py`'s docstring) with
  architectures   ["DFlash2DraftModel"]: what vLLM, SGLang, llama.cpp and z-lab's loader dispatch on
  dflash_config   + conv_kernel_size, conv_group_size, selector_rank, selector_top_k, block_size (z-lab's loader
                  reads every draft key from dflash_config first, then from the top level)
  weights         + layers.{i}.attention_conv.base_kernel              [2, T, H]
                    layers.{i}.attention_conv.kernel_projection.weight [2*T*H/g, H]   (and mlp_conv, the same)
                    candidate_selector.hidden_projection.weight        [r, H]
                    candidate_selector.predecessor_codebook            [V, r]
                    candidate_selector.successor_codebook              [V, r]
(T taps, g the group size, r the rank; names and shapes as in z-lab's published DFlash2 checkpoints, whose
safetensors header is the reference.) The weights are the drafter's state dict, so they need no mapping.

Import refuses the draft-side options of z-lab's loader that our drafter does not implement (`output_multiplier`,
`final_logit_softcapping`, `input_embedding_scale`): served with them, the logits would differ from ours.
"""

from __future__ import annotations

from typing import Any

from ..config import DrafterModelConfig
from .config import ARCHITECTURE, DFlash2ModelConfig

_SIZE_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# Key -> the value that leaves the logits as our drafter computes them.
_NEUTRAL_OPTIONS = {"output_multiplier": 1.0, "final_logit_softcapping": None, "input_embedding_scale": 1.0}


def is_dflash2_export(data: dict[str, Any]) -> bool:
    return ARCHITECTURE in (data.get("architectures") or [])


def add_export_keys(data: dict[str, Any], config: DFlash2ModelConfig) -> None:
    """Turn the DFlash `config.json` dict `data` of `config` into DFlash2's, in place."""
    data["architectures"] = [ARCHITECTURE]
    data["dflash_config"] = {**data["dflash_config"], "block_size": config.block_size, **config.dflash2_keys()}


def config_from_export(base: DrafterModelConfig, data: dict[str, Any]) -> DFlash2ModelConfig:
    """The DFlash2 architecture of an export's config.json `data`, whose DFlash part is `base`. ValueError names
    a missing or unsupported key."""
    draft = data.get("dflash_config") or {}

    def value(key: str) -> Any:
        return draft.get(key, data.get(key))

    missing = [key for key in _SIZE_KEYS if value(key) is None]
    if missing:
        raise ValueError(f"dflash_config.{missing[0]}: missing ({ARCHITECTURE} needs {', '.join(_SIZE_KEYS)})")
    for key, neutral in _NEUTRAL_OPTIONS.items():
        given = value(key)
        if given is not None and given != neutral and not (neutral is None and given == 0):
            raise ValueError(f"dflash_config.{key} {given!r}: not supported by this drafter (only {neutral!r})")
    return DFlash2ModelConfig.extend(base, **{key: int(value(key)) for key in _SIZE_KEYS})
