"""Packed rows of a hybrid target in one forward: the linear-attention layers restart at every segment through
variable-length kernels (`cu_seqlens`), the attention layers through document attention.

Contract. For a packed batch `[R, T]` with its `DocumentLayout`, the `varlen_hybrid` path of `capture.py` gives
what `per_document.py` gives: every segment (document, or a row's padding run) computed as if it ran alone, with
positions from 0. It gets there in one decoder forward over all R*T tokens flattened into one row `[1, R*T]` (the
variable-length kernels take one row of sequences), where `per_document.py` runs groups of rows right-padded to
their longest segment: on the GPU recipe's documents about 2 forwards per step, each over up to the batch's own
token count, and each new row count a new autotuning key of flash-linear-attention's kernels.

Why it is exact. In transformers' (5.17) Gated DeltaNet layer (Qwen3.5/3.6, `Qwen3_5GatedDeltaNet`) tokens meet in
two places only; everything else in the layer (projections, gates, norms) and the MLP are per token:
- the short causal convolution `causal_conv1d_fn(x [1, C, N], weight, bias, activation=..., **kwargs)`, which
  receives the decoder's keyword arguments. For the duration of the forward the modeling module's name points at
  flash-linear-attention's Triton convolution (`hybrid_kernels.fla_conv`), which takes the sequences' boundaries
  (`cu_seq_lens_q`) and reads zeros before each sequence's first token, as a row of its own does;
- the chunked gated delta rule, to which transformers hands `cu_seqlens=kwargs.pop("cu_seq_lens_q")` and, by its
  signature, `cu_seqlens_cpu` (the same boundaries on the host: fla plans its chunks from them and copies the plan
  to the device once per capture). Bound to fla's `chunk_gated_delta_rule`, every sequence starts from a zero
  state. transformers' wrapper passes on only the keywords the bound function names, and binds its PyTorch
  reference (no `cu_seqlens`: the boundaries would be dropped without a word) when importing fla's failed, so the
  path checks what was bound (`bound_chunk_rule_takes_boundaries`).
The attention layers read `packed_attention` over the same segments (`attention.py`). A row's padding run is a
segment of its own, so nothing crosses from one row into the next row's first document.

When it applies (`varlen_hybrid_supported`): on CUDA, where `hybrid_kernels.fla_available()` and transformers bound a
chunk rule that takes `cu_seqlens` (fla's), without the `causal-conv1d` package (transformers would
bind its kernel, which restarts only given a `seq_idx`), every linear-attention layer a `Qwen3_5GatedDeltaNet` whose
activation fla's convolution applies, and attention that document attention serves (`capture.py`). transformers'
torch references ignore `cu_seqlens`, so the CPU keeps `per_document.py`; its tests run this path with per-segment
references in place of the two kernels (the plumbing), the GPU tests with fla's kernels against `per_document.py`.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import Tensor, nn

from ..decoding.hybrid_kernels import (
    FLA,
    FLA_CONV_ACTIVATIONS,
    causal_conv1d_installed,
    fla_available,
    routed_convolutions,
)
from .documents import DocumentLayout
from .opaque_kernels import CHUNK_RULE, linear_attention_modules

# The linear-attention layer class whose token mixing this path routes (transformers 5.17).
GATED_DELTA_NET = "Qwen3_5GatedDeltaNet"


def linear_attention_layers(model: nn.Module) -> list[nn.Module]:
    return [module for module in model.modules() if type(module).__name__ == GATED_DELTA_NET]


def varlen_hybrid_supported(model: nn.Module, device: torch.device) -> bool:
    """Whether `model`'s packed rows can take the one-forward path on `device` (module docstring)."""
    return why_not_varlen_hybrid(model, device) is None


def why_not_varlen_hybrid(model: nn.Module, device: torch.device) -> str | None:
    """Why `model`'s packed rows cannot take the one-forward path on `device`, or None when they can: a user training
    a hybrid on a GPU learns here why its target runs slower (on the 27B shape, transformers' PyTorch references took
    803 ms per step where fla's variable-length kernels took 443, BENCHMARKS.md)."""
    layers = linear_attention_layers(model)
    if not layers:
        return "the target has no linear-attention layers"
    if device.type != "cuda":
        return "flash-linear-attention's kernels run on CUDA only"
    if causal_conv1d_installed():
        return "causal-conv1d is installed, and transformers then runs its convolution, which takes no boundaries"
    if not fla_available():
        return "flash-linear-attention is not installed (pip install flash-linear-attention)"
    if not all(bound_chunk_rule_takes_boundaries(module) for module in modeling_modules(model)):
        return "this transformers' chunk rule does not pass the sequences' boundaries on"
    if not all(layer.activation in FLA_CONV_ACTIVATIONS for layer in layers):
        return "a convolution activation fla's kernel does not have"
    return None


def bound_chunk_rule_takes_boundaries(module: ModuleType) -> bool:
    """Whether the chunk rule transformers bound in `module` passes `cu_seqlens` on: its wrapper (5.17,
    `use_kernel_func_from_hub_with_fallback`) keeps the keywords the bound implementation names, in the closure
    variable `applicable_params`. False when that cannot be read (another transformers): the per-document path."""
    rule = getattr(module, CHUNK_RULE, None)
    if rule is None:
        return False
    try:
        names = inspect.getclosurevars(rule).nonlocals.get("applicable_params", ())
    except TypeError:  # not a Python function
        return False
    return "cu_seqlens" in names


@dataclass(frozen=True)
class Sequences:
    """The segments of a flattened batch as the variable-length kernels read them, passed to the decoder as
    keyword arguments that reach every layer."""

    cu_seqlens: Tensor  # [S+1] int64 on the device: segment starts over the flattened tokens, then their count
    cu_seqlens_cpu: Tensor  # [S+1] int64 on the host, the same

    @classmethod
    def of(cls, layout: DocumentLayout) -> Sequences:
        return cls(cu_seqlens=layout.cu_seqlens().long(), cu_seqlens_cpu=torch.tensor(layout.boundaries()))

    def forward_kwargs(self) -> dict[str, Tensor]:
        # `cu_seq_lens_q` is the name transformers' Gated DeltaNet pops for its chunk rule (and hands its
        # convolution with the rest of the keywords); `cu_seqlens_cpu` reaches fla's chunk rule by its signature.
        return {"cu_seq_lens_q": self.cu_seqlens, "cu_seqlens_cpu": self.cu_seqlens_cpu}


def modeling_modules(model: nn.Module) -> tuple[ModuleType, ...]:
    """The modeling modules whose kernels the linear-attention layers of `model` call by name."""
    return linear_attention_modules(linear_attention_layers(model))


@contextmanager
def routed_varlen_convolutions(model: nn.Module) -> Iterator[None]:
    """Inside the block, `model`'s linear-attention layers run fla's convolution, which reads the sequences'
    boundaries from the keyword arguments (`hybrid_kernels.fla_conv`)."""
    with routed_convolutions(modeling_modules(model), FLA):
        yield
