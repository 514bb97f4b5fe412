"""Capture the outputs of chosen decoder layers of the frozen target, stopping after the deepest one.

The feature of layer i is the output of decoder layer i (what layer i+1 reads); in Hugging Face terms that is
`output_hidden_states[i + 1]`, except for the last layer, whose `hidden_states[L]` transformers replaces by
the output of the final norm (here the last layer's feature is its raw output too). `output_hidden_states`
is not used because it keeps every layer's output alive and runs the whole stack. Instead, forward hooks on
the tapped layers copy each output into its slice of one preallocated `[R, T, K*H]` tensor, and the hook on
the deepest tapped layer raises a private exception that ends the forward right there, unless the final
hidden state (the output of the final norm, what the LM head reads) is wanted. Hooks are registered for one
call and removed in a `finally`, so nothing stays on the model.

Packed rows (several documents in one row, `doc_ids`) get a 4D block-diagonal causal mask so that attention
never crosses documents, and RoPE positions that restart at every document. A dense mask keeps SDPA off its
flash kernel, so batches without packing should pass `doc_ids=None` (plain causal attention).
Linear-attention (recurrent) layers, as in Qwen3.5 hybrids, carry a state along the row that a mask cannot
cut, so models with such layers report `supports_packing = False` and refuse packed rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel

# Layer types whose attention a 4D mask fully controls.
_MASKABLE_LAYER_TYPES = {"full_attention"}
# Attention implementations that read a dense 4D mask as given.
_DENSE_MASK_ATTENTION = {"sdpa": "bool", "eager": "additive"}


@dataclass
class TargetOutputs:
    features: torch.Tensor  # [R, T, K*H] in layer_ids order, model dtype
    final_hidden: torch.Tensor | None  # [R, T, H] output of the final norm, when requested


class _StopAfterDeepestLayer(Exception):
    """Raised by the hook on the deepest tapped layer to end the forward early."""


def decoder_module(model: PreTrainedModel) -> nn.Module:
    """The text decoder stack (the module with `.layers` and `.norm`), also inside multimodal wrappers."""
    decoder = model.get_decoder()
    if not (hasattr(decoder, "layers") and hasattr(decoder, "norm")):
        raise TypeError(f"{type(model).__name__}: cannot find the decoder layers (expected .layers and .norm)")
    return decoder


def num_layers(model: PreTrainedModel) -> int:
    return len(decoder_module(model).layers)


def embedding_module(model: PreTrainedModel) -> nn.Embedding:
    """The target's own input embedding (shared, not copied)."""
    return model.get_input_embeddings()


def lm_head_module(model: PreTrainedModel) -> nn.Linear:
    """The target's own LM head (shared, not copied; tied to the embedding when the model ties them)."""
    return model.get_output_embeddings()


def model_supports_packing(model: PreTrainedModel) -> bool:
    """True when a 4D mask alone keeps documents apart: attention-only layers and a dense-mask attention kernel."""
    config = model.config.get_text_config(decoder=True)
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    if not set(layer_types) <= _MASKABLE_LAYER_TYPES:
        return False
    # A sliding window would be lost: one 4D mask is given to every layer.
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        return False
    return config._attn_implementation in _DENSE_MASK_ATTENTION


class FeatureCapture:
    """Runs the target on token rows and returns the outputs of `layer_ids`, concatenated on the last dim."""

    def __init__(self, model: PreTrainedModel, layer_ids: Sequence[int], need_final_hidden: bool = False) -> None:
        self.model = model
        self.decoder = decoder_module(model)
        total = len(self.decoder.layers)
        if not layer_ids:
            raise ValueError("layer_ids: need at least one target layer")
        for layer_id in layer_ids:
            if not 0 <= layer_id < total:
                raise ValueError(f"layer_ids: {layer_id} outside 0..{total - 1} (the target has {total} layers)")
        if len(set(layer_ids)) != len(layer_ids):
            raise ValueError(f"layer_ids: {list(layer_ids)} repeats a layer")
        self.layer_ids = list(layer_ids)
        self.need_final_hidden = need_final_hidden
        text_config = model.config.get_text_config(decoder=True)
        self.hidden_size = int(text_config.hidden_size)
        self.attn_implementation = text_config._attn_implementation
        self.supports_packing = model_supports_packing(model)

    def capture(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
    ) -> TargetOutputs:
        """Features `[R, T, K*H]` (and the final hidden state `[R, T, H]` if requested) for `input_ids [R, T]`.

        `doc_ids [R, T]`: document index within the row, -1 on padding; None for rows that hold one document
        (padding at the end of a row needs no mask: causal attention never looks ahead). `position_ids`
        default to positions that restart at every document. Gradients are never recorded.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids: expected [R, T], got shape {tuple(input_ids.shape)}")
        for name, tensor in (("position_ids", position_ids), ("doc_ids", doc_ids)):
            if tensor is not None and tensor.shape != input_ids.shape:
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} differs from input_ids {tuple(input_ids.shape)}")

        attention_mask = None
        if doc_ids is not None:
            if self.supports_packing:
                attention_mask = self._packed_mask(doc_ids)  # [R, 1, T, T]
            else:
                self._refuse_packed_rows(doc_ids)
            if position_ids is None:
                position_ids = positions_within_documents(doc_ids)

        rows, length = input_ids.shape
        dtype = embedding_module(self.model).weight.dtype
        features = torch.empty(
            rows, length, len(self.layer_ids) * self.hidden_size, dtype=dtype, device=input_ids.device
        )
        handles = [
            self.decoder.layers[layer_id].register_forward_hook(self._copy_hook(features, slot, layer_id))
            for slot, layer_id in enumerate(self.layer_ids)
        ]
        final_hidden = None
        try:
            with torch.no_grad():
                output = self.decoder(
                    input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
                )
            final_hidden = output.last_hidden_state  # [R, T, H]
        except _StopAfterDeepestLayer:
            pass
        finally:
            for handle in handles:
                handle.remove()
        return TargetOutputs(features=features, final_hidden=final_hidden)

    def _copy_hook(self, features: torch.Tensor, slot: int, layer_id: int) -> Callable[..., None]:
        start, end = slot * self.hidden_size, (slot + 1) * self.hidden_size
        stop_here = not self.need_final_hidden and layer_id == max(self.layer_ids)

        def hook(module: nn.Module, args: tuple, output: torch.Tensor | tuple) -> None:
            hidden = output[0] if isinstance(output, tuple) else output  # [R, T, H]
            features[..., start:end].copy_(hidden)
            if stop_here:
                raise _StopAfterDeepestLayer

        return hook

    def _packed_mask(self, doc_ids: torch.Tensor) -> torch.Tensor:
        allowed = block_causal_mask(doc_ids)  # [R, 1, T, T] bool
        if _DENSE_MASK_ATTENTION[self.attn_implementation] == "bool":
            return allowed
        dtype = embedding_module(self.model).weight.dtype
        blocked = torch.finfo(dtype).min
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, blocked)

    def _refuse_packed_rows(self, doc_ids: torch.Tensor) -> None:
        # One host sync per batch, only for models that cannot pack; the target forward dwarfs it, and a
        # silently wrong recurrent state would be far worse.
        if bool((doc_ids > 0).any()):
            raise ValueError(
                f"{type(self.model).__name__} has layers a 4D mask cannot separate (linear attention, sliding "
                f"window, or attention implementation {self.attn_implementation!r}); packed rows "
                "(doc_ids > 0) are not supported: set data.packing=false"
            )


def block_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """`[R, 1, T, T]` bool, True where query t may attend key s: s <= t within the same document.

    Padding (-1) attends to earlier padding, so no row is fully masked (that would make softmax NaN).
    """
    length = doc_ids.shape[1]
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]  # [R, T, T]
    causal = torch.ones(length, length, dtype=torch.bool, device=doc_ids.device).tril_()
    return (same_doc & causal)[:, None]


def positions_within_documents(doc_ids: torch.Tensor) -> torch.Tensor:
    """`[R, T]` int64 positions that restart at 0 wherever the document id changes."""
    length = doc_ids.shape[1]
    index = torch.arange(length, device=doc_ids.device).expand_as(doc_ids)  # [R, T]
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    start_index = torch.where(starts, index, 0).cummax(dim=1).values  # [R, T]
    return index - start_index
