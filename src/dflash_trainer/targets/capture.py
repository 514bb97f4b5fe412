"""Capture the outputs of chosen decoder layers of the frozen target, stopping after the deepest one.

The feature of layer i is the output of decoder layer i (what layer i+1 reads); in Hugging Face terms that is
`output_hidden_states[i + 1]`, except for the last layer, whose `hidden_states[L]` transformers replaces by
the output of the final norm (here the last layer's feature is its raw output too). `output_hidden_states`
is not used because it keeps every layer's output alive and runs the whole stack. Instead, forward hooks on
the tapped layers copy each output into its slice of one preallocated `[R, T, K*H]` tensor, and the hook on
the deepest tapped layer raises a private exception that ends the forward right there: no later layer, no final
norm, no LM head (the decoder is called, never the LM head), unless the final hidden state (the output of the final
norm, what the LM head reads) is wanted. Hooks are registered for one call and removed in a `finally`.

Packed rows (several documents per row, `doc_ids`, described by a `DocumentLayout`) take one of three paths, chosen
per model by `packing_path` (and `varlen_hybrid_supported` on the device); all give each document exactly what
running it alone gives, with positions that restart at every document:
- `attention`: models whose token mixing is attention only (full and sliding-window layers). The decoder runs on
  the packed rows with document-aware attention (`attention.py`): varlen flash or flex attention on CUDA, SDPA
  with a dense mask on CPU.
- `per_document`: everything a mask cannot separate: linear-attention (recurrent) layers of hybrids (Qwen3.5/3.6,
  Qwen3-Next), chunked attention, attention sinks, soft-capping, models outside transformers' attention
  interface. Each document runs as a row of its own (`per_document.py`) and its outputs go back to their place.
  On GPU, transformers' (5.17) Gated DeltaNet could instead take the rows flattened into one `[1, R*T]` row with
  `cu_seq_lens_q` in the forward kwargs: it pops them and hands them to flash-linear-attention's chunk kernel as
  `cu_seqlens`, which restarts the state per document (its torch fallback drops them silently). But the layer's
  short causal convolution restarts only with the separate `causal_conv1d` package installed and a `seq_idx` kwarg;
  its torch fallback ignores both and mixes the last kernel-1 tokens of one document into the next. So that route
  is not taken as transformers binds it; the per-document rows are exact with either set of kernels.
- `varlen_hybrid`: hybrids whose linear-attention layers can restart at every document by variable-length kernels
  (CUDA with flash-linear-attention, `varlen_hybrid.py`): the batch runs as one row of sequences, in one forward,
  with fla's convolution routed in for the duration and document attention in the attention layers.
Rows of one document each (`doc_ids=None`) need no document mask: causal attention never looks past a row's end
padding. On the `varlen_hybrid` path they still run as one row of sequences, a row each, so that every batch
takes the same kernels.

Compiled layers (`compile_layers=True`, `target.compile`, CUDA training). An eager forward runs each norm, RoPE
and activation as several unfused elementwise kernels: a small target is host-bound on them (SmolLM2-135M: 30
layers of about 50 kernels each, ~33 ms for ~6 ms of FLOPs at 16K tokens), and even an 8B one spends ~75 ms of a
268 ms forward over 8,192 tokens in them (2026-12-01: 204 ms compiled). So the decoder layers up to the deepest tap
can run through one `torch.compile`d function of their class's `forward`
(dynamic sizes): the layers share one code object and, modules being inputs to compiled code, one compiled graph.
Only during `capture` is each layer's `forward` pointed at it, so the hooks stay eager around it (the copy and the
early stop) and every other user of the model (evaluation, regeneration: the decoding engine) runs it as loaded.
With `compile_mode="reduce-overhead"` Inductor also records each layer's kernels as a CUDA graph (per batch shape;
cudagraph trees chain the layers of one capture) and replays it, so the host launches one graph per layer instead
of its kernels one by one; each capture starts a new cudagraph step. A graph is recorded per set of integer inputs,
so the varlen boundaries are padded to a bucketed length and the longest segment taken as the row length
(`attention.fixed_size_boundaries`): batches of one row shape then replay one graph whatever their documents. The
hybrid paths hand host tensors to the layers and refuse this mode.
Packed attention prepares its inputs before the forward (`PackedAttention`), so the compiled layers read tensors
and one integer. A hybrid's layers branch on their type, so its class compiles one graph per layer type (linear and
full attention; every layer of a type shares it). The linear-attention layers' delta rule and short convolution
are opaque custom ops in that graph, for the duration of the capture (`opaque_kernels.py`): traced, fla's
`torch.compiler.disable`d kernel broke each such layer into four graphs, and the PyTorch reference unrolled
its chunk loop and compiled again for every new chunk count.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Literal

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from ..compiling import compile_dynamic
from ..model.loss import greedy_next_tokens
from .attention import BACKENDS, PackedAttention, documents_attention_implementation, layer_windows, resolve_backend
from .documents import DocumentLayout
from .opaque_kernels import linear_attention_modules, opaque_linear_attention_kernels
from .per_document import document_groups
from .varlen_hybrid import Sequences, routed_varlen_convolutions, varlen_hybrid_supported

PackingPath = Literal["attention", "per_document", "varlen_hybrid"]
# Layer types whose token mixing document attention fully controls.
_ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention"}
# Writes one tapped layer's output `[rows, length, H]` into the feature slot of index `slot`.
_Writer = Callable[[int, Tensor], None]


@dataclass
class TargetOutputs:
    features: Tensor  # [R, T, K*H] in layer_ids order, model dtype
    final_hidden: Tensor | None  # [R, T, H] output of the final norm, when requested
    # [R, T] int64: the target's greedy token after each position (`model/loss.py: greedy_next_tokens`), what
    # target-argmax labels need, in place of final_hidden (a disaggregated target sends these: 8 bytes a position
    # instead of 2H, and the LM head runs on the target rank).
    next_tokens: Tensor | None = None

    def with_next_tokens(self, lm_head: nn.Module, *, chunk_positions: int) -> TargetOutputs:
        """These outputs with the greedy next tokens under `lm_head` in place of the final states. The one place
        they are computed, on a target rank or in one process alike, so both get the same labels."""
        if self.final_hidden is None:
            raise ValueError("with_next_tokens: the capture kept no final states (need_final_hidden=False)")
        bias = getattr(lm_head, "bias", None)
        tokens = greedy_next_tokens(
            self.final_hidden, lm_head.weight, lm_head_bias=bias, chunk_positions=chunk_positions
        )
        return TargetOutputs(features=self.features, final_hidden=None, next_tokens=tokens)


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


def packing_path(model: PreTrainedModel) -> PackingPath:
    """How packed rows of `model` keep documents apart (see the module docstring)."""
    config = model.config.get_text_config(decoder=True)
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if layer_types <= _ATTENTION_LAYER_TYPES and document_attention_serves(model):
        return "attention"
    return "per_document"


def document_attention_serves(model: PreTrainedModel) -> bool:
    """Whether `model`'s attention layers can run document attention (`attention.py`) in place of their own."""
    config = model.config.get_text_config(decoder=True)
    # Sinks (gpt-oss) and soft-capping (Gemma 2) change the softmax; document attention does not apply them.
    plain_softmax = getattr(config, "attn_logit_softcapping", None) is None and not any(
        hasattr(module, "sinks") for module in decoder_module(model).modules()
    )
    return plain_softmax and type(model)._can_set_attn_implementation()


class FeatureCapture:
    """Runs the target on token rows and returns the outputs of `layer_ids`, concatenated on the last dim.

    `packed_attention`: the kernel of the `attention` path (`auto`, `varlen`, `flex`, `dense`; see `attention.py`).
    `compile_layers`: run the decoder layers up to the deepest tap compiled (module docstring), in Inductor's
    `compile_mode`.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        layer_ids: Sequence[int],
        need_final_hidden: bool = False,
        *,
        packed_attention: str = "auto",
        compile_layers: bool = False,
        compile_mode: str = "default",
    ) -> None:
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
        if packed_attention not in BACKENDS:
            raise ValueError(f"packed_attention {packed_attention!r}: expected one of {', '.join(BACKENDS)}")
        self.layer_ids = list(layer_ids)
        self.need_final_hidden = need_final_hidden
        text_config = model.config.get_text_config(decoder=True)
        self.hidden_size = int(text_config.hidden_size)
        self.dtype = embedding_module(model).weight.dtype
        device = embedding_module(model).weight.device
        head_dim = int(getattr(text_config, "head_dim", None) or self.hidden_size // text_config.num_attention_heads)
        self.packing_path = packing_path(model)
        self.backend = None
        self.windows = layer_windows(text_config)
        if self.packing_path == "attention":
            self.backend = resolve_backend(packed_attention, device, self.dtype, head_dim)
        elif varlen_hybrid_supported(model, device) and document_attention_serves(model):
            # A dense mask over the batch as one row is [R*T, R*T]: on CUDA, where batches are large, the path
            # needs varlen or flex attention. (On the CPU, SDPA with a dense mask is the tests' reference.)
            backend = resolve_backend(packed_attention, device, self.dtype, head_dim)
            if backend != "dense" or device.type == "cpu":
                self.packing_path, self.backend = "varlen_hybrid", backend
        self._compiled_forward = None
        # The layers a capture runs: up to the deepest tap, or all of them for the final hidden state.
        self._layers_run = len(self.decoder.layers) if need_final_hidden else max(self.layer_ids) + 1
        self._kernel_modules = ()
        if compile_layers:
            layers = self.decoder.layers[: self._layers_run]
            self._compiled_forward = {
                kind: compile_layer_forward(kind.forward, mode=compile_mode) for kind in {type(x) for x in layers}
            }
            self._kernel_modules = linear_attention_modules(layers)
        # CUDA graphs (`reduce-overhead`): each capture is a new step of the graphs' memory (cudagraph trees), the
        # previous capture's layer outputs dead by then (the hooks copied what they keep).
        self._graph_steps = compile_layers and compile_mode == "reduce-overhead"
        if self._graph_steps and self.packing_path != "attention":
            # The hybrid paths hand host tensors (sequence boundaries) to the layers: no CUDA graph can hold them.
            raise ValueError(
                f"target.compile_mode=reduce-overhead: the {self.packing_path} path of this target cannot run as CUDA "
                "graphs; use compile_mode=default"
            )

    def capture(
        self,
        input_ids: Tensor,
        position_ids: Tensor | None = None,
        doc_ids: Tensor | None = None,
        *,
        documents: DocumentLayout | None = None,
    ) -> TargetOutputs:
        """Features `[R, T, K*H]` (and the final hidden state `[R, T, H]` if requested) for `input_ids [R, T]`.

        `doc_ids [R, T]`: document index within the row, -1 on padding; None for rows that hold one document
        (padding at the end of a row needs no mask: causal attention never looks ahead). `documents`: the same
        as a `DocumentLayout`, built ahead (`DocumentLayout.from_doc_ids` on the host batch saves a host sync);
        it takes the place of `doc_ids`. `position_ids` default to positions that restart at every document.
        Gradients are never recorded.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids: expected [R, T], got shape {tuple(input_ids.shape)}")
        for name, tensor in (("position_ids", position_ids), ("doc_ids", doc_ids)):
            if tensor is not None and tensor.shape != input_ids.shape:
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} differs from input_ids {tuple(input_ids.shape)}")

        rows, length = input_ids.shape
        features = torch.empty(
            rows, length, len(self.layer_ids) * self.hidden_size, dtype=self.dtype, device=input_ids.device
        )
        if doc_ids is None and documents is None:
            if self.packing_path == "varlen_hybrid":
                # Rows of one document take the packed rows' kernels too. Otherwise transformers runs its reference
                # convolution here and fla tunes a second set of kernels for calls without boundaries (fla keys its
                # tuning on IS_VARLEN): on the 27B bench (2026-12-02), where a row holds one or two documents, the
                # target forward took 696 ms per step with such rows mixed in, against ~440 ms per 5.5K tokens for
                # packed rows alone, and a step that met the other kernels first took 11 s.
                layout = DocumentLayout.whole_rows(rows, length, input_ids.device)
                positions = position_ids if position_ids is not None else layout.positions()
                return self._capture_varlen_hybrid(input_ids, positions, layout, features)
            final_hidden = self._run(input_ids, position_ids, self._slot_writer(features))
            return TargetOutputs(features=features, final_hidden=final_hidden)

        layout = documents if documents is not None else DocumentLayout.from_doc_ids(doc_ids)
        if layout.segment_ids.shape != input_ids.shape:
            raise ValueError(
                f"documents: layout of shape {tuple(layout.segment_ids.shape)} for input_ids {tuple(input_ids.shape)}"
            )
        if position_ids is None:
            position_ids = layout.positions()
        if self.packing_path == "attention":
            attention = PackedAttention(layout, self.backend, self.windows, fixed_sizes=self._graph_steps)
            packed = {"packed_attention": attention}
            with documents_attention_implementation(self.decoder.config):
                final_hidden = self._run(input_ids, position_ids, self._slot_writer(features), packed)
            return TargetOutputs(features=features, final_hidden=final_hidden)
        if self.packing_path == "varlen_hybrid":
            return self._capture_varlen_hybrid(input_ids, position_ids, layout, features)
        return self._capture_per_document(input_ids, position_ids, layout, features)

    def _capture_varlen_hybrid(
        self, input_ids: Tensor, position_ids: Tensor, layout: DocumentLayout, features: Tensor
    ) -> TargetOutputs:
        """The batch as one row of sequences `[1, R*T]` (`varlen_hybrid.py`), outputs viewed back as `[R, T, ...]`."""
        rows, length = input_ids.shape
        one_row = layout.as_one_row()
        forward_kwargs = {
            "packed_attention": PackedAttention(one_row, self.backend, self.windows),
            **Sequences.of(one_row).forward_kwargs(),
        }
        write = self._slot_writer(features.view(1, rows * length, -1))
        with documents_attention_implementation(self.decoder.config), routed_varlen_convolutions(self.model):
            final_hidden = self._run(input_ids.reshape(1, -1), position_ids.reshape(1, -1), write, forward_kwargs)
        final_hidden = None if final_hidden is None else final_hidden.view(rows, length, -1)
        return TargetOutputs(features=features, final_hidden=final_hidden)

    def _capture_per_document(
        self, input_ids: Tensor, position_ids: Tensor, layout: DocumentLayout, features: Tensor
    ) -> TargetOutputs:
        rows, length = input_ids.shape
        flat_features = features.view(rows * length, -1)  # [R*T, K*H]
        final_hidden = None
        if self.need_final_hidden:
            final_hidden = torch.empty(rows, length, self.hidden_size, dtype=self.dtype, device=input_ids.device)
        for group in document_groups(layout):
            ids = input_ids.flatten()[group.gather]  # [N, L]
            positions = position_ids.flatten()[group.gather]  # [N, L]

            def write(slot: int, hidden: Tensor, group=group) -> None:
                group.scatter(hidden, flat_features[:, slot * self.hidden_size : (slot + 1) * self.hidden_size])

            group_final = self._run(ids, positions, write)
            if final_hidden is not None and group_final is not None:
                group.scatter(group_final, final_hidden.view(rows * length, -1))
        return TargetOutputs(features=features, final_hidden=final_hidden)

    def _slot_writer(self, features: Tensor) -> _Writer:
        def write(slot: int, hidden: Tensor) -> None:
            features[..., slot * self.hidden_size : (slot + 1) * self.hidden_size].copy_(hidden)

        return write

    def _run(
        self,
        input_ids: Tensor,
        position_ids: Tensor | None,
        write: _Writer,
        forward_kwargs: dict[str, object] | None = None,
    ) -> Tensor | None:
        """One decoder forward with the copy hooks; the final hidden state `[rows, length, H]` if it ran that far.
        `forward_kwargs` (`packed_attention`, the sequences' boundaries) travel to every layer: transformers hands
        unknown keywords through to the attention calls and the linear-attention layers."""
        deepest = max(self.layer_ids)
        handles = [
            self.decoder.layers[layer_id].register_forward_hook(
                self._copy_hook(write, slot, stop_here=not self.need_final_hidden and layer_id == deepest)
            )
            for slot, layer_id in enumerate(self.layer_ids)
        ]
        try:
            with torch.no_grad(), self._layers_compiled():
                output = self.decoder(
                    input_ids=input_ids, position_ids=position_ids, use_cache=False, **(forward_kwargs or {})
                )
            return output.last_hidden_state  # [rows, length, H]
        except _StopAfterDeepestLayer:
            return None
        finally:
            for handle in handles:
                handle.remove()

    @contextmanager
    def _layers_compiled(self) -> Iterator[None]:
        """Each decoder layer's `forward` is the compiled one of its class for the duration (module docstring)."""
        if self._compiled_forward is None:
            yield
            return
        layers = list(self.decoder.layers[: self._layers_run])
        if self._graph_steps:
            torch.compiler.cudagraph_mark_step_begin()
        for layer in layers:
            layer.forward = partial(self._compiled_forward[type(layer)], layer)
        try:
            with opaque_linear_attention_kernels(self._kernel_modules):
                yield
        finally:
            for layer in layers:
                del layer.forward  # the class's forward again

    @staticmethod
    def _copy_hook(write: _Writer, slot: int, *, stop_here: bool) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, output: Tensor | tuple) -> None:
            write(slot, output[0] if isinstance(output, tuple) else output)  # [rows, length, H]
            if stop_here:
                raise _StopAfterDeepestLayer

        return hook


def compile_layer_forward(forward: Callable, mode: str = "default") -> Callable:
    """A decoder layer class's `forward`, compiled with dynamic sizes (rows and row lengths change per batch)."""
    return compile_dynamic(forward, mode=None if mode == "default" else mode)
