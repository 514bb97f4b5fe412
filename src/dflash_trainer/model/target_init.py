"""Start the drafter's decoder layers from copies of the target's (`drafter.init_layers_from_target`).

Contract: `copy_target_layers(drafter, target_layers, layer_ids)` copies, for drafter layer i, the weights of
target layer `layer_ids[i]`: the attention projections (q, k, v, o and their biases), the SwiGLU MLP (gate, up,
down) and the two RMSNorm weights. Shapes must match exactly (the drafter takes the target's hidden, head and
intermediate sizes by default); a mismatch is refused, naming the parameter, and so is a target layer that
stores a projection otherwise (FP8 weights, a fused gate_up_proj): never half a copy. Left as `reset_parameters`
made them: the per-head q/k norms when the target has none (Llama-style targets such as SmolLM2: they start at 1),
the context projection `fc` and the fused-context and final norms.

Why: the training objective is unchanged (this is only a starting point), but a drafter trained for minutes
starts from layers that already map residual-stream states to what the target's final norm and LM head read,
instead of from noise. It is the usual warm start for small draft models; whether it pays off for a given
target and budget is measured (benchmarks/EXPERIMENTS.md), so the default stays random.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .drafter import DFlashDrafter

# Parameters copied: the drafter layer's names are those of a Llama/Qwen-style HF decoder layer.
_COPIED = (
    "self_attn.q_proj.weight",
    "self_attn.q_proj.bias",
    "self_attn.k_proj.weight",
    "self_attn.k_proj.bias",
    "self_attn.v_proj.weight",
    "self_attn.v_proj.bias",
    "self_attn.o_proj.weight",
    "self_attn.o_proj.bias",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
)
# What a target may lack: Llama-style layers have no per-head q/k norms.
_OPTIONAL = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")


def resolve_layer_ids(spec: Sequence[int], num_target_layers: int, num_drafter_layers: int) -> list[int]:
    """Target layer ids from the config: one per drafter layer; negative ids count from the end."""
    if len(spec) != num_drafter_layers:
        raise ValueError(
            f"drafter.init_layers_from_target: {len(spec)} ids for {num_drafter_layers} drafter layers "
            "(one target layer per drafter layer)"
        )
    ids = [i + num_target_layers if i < 0 else i for i in spec]
    bad = [spec[k] for k, i in enumerate(ids) if not 0 <= i < num_target_layers]
    if bad:
        raise ValueError(
            f"drafter.init_layers_from_target: {bad} outside the target's {num_target_layers} layers "
            f"(0..{num_target_layers - 1}, or -1..-{num_target_layers})"
        )
    return ids


@torch.no_grad()
def copy_target_layers(drafter: DFlashDrafter, target_layers: nn.ModuleList, layer_ids: Sequence[int]) -> list[str]:
    """Copies target layer `layer_ids[i]` into drafter layer i (see the module docstring); returns the drafter
    parameter names (of layer 0) that were copied, for the run log."""
    copied: list[str] = []
    for drafter_index, target_index in enumerate(layer_ids):
        source = dict(target_layers[target_index].named_parameters())
        own = dict(drafter.layers[drafter_index].named_parameters())
        # Every projection and norm must come from the target (only the per-head q/k norms may be missing): a
        # target whose layers store them otherwise (FP8 weights, a fused gate_up_proj) is refused, not half-copied.
        missing = [name for name in _COPIED if name in own and name not in source and name not in _OPTIONAL]
        if missing:
            raise ValueError(
                f"drafter.init_layers_from_target: target layer {target_index} "
                f"({type(target_layers[target_index]).__name__}) has no {', '.join(missing)}: its weights are not "
                "stored as the drafter's are (an FP8 target? fused projections?)"
            )
        for name, param in own.items():
            if name not in _COPIED or name not in source:
                continue
            weight = source[name]
            if weight.shape != param.shape:
                raise ValueError(
                    f"drafter.init_layers_from_target: layers.{drafter_index}.{name} is {tuple(param.shape)}, "
                    f"target layer {target_index} has {tuple(weight.shape)}: the drafter must keep the target's sizes"
                )
            param.copy_(weight.to(device=param.device, dtype=param.dtype))
            if drafter_index == 0:
                copied.append(name)
    return copied
