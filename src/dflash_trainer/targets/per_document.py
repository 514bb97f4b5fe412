"""Packed rows for targets whose layers an attention mask cannot separate: every segment runs as a row of its own.

Linear-attention (Gated DeltaNet) layers of hybrid targets (Qwen3.5/3.6, Qwen3-Next) carry a recurrent state and a
short causal convolution along the row; no attention mask stops either at a document start. This path gathers the
segments of the packed batch (`documents.py`: the documents, and each row's padding run) into rows of their own,
right-padded to the longest segment of their group, runs the decoder on those rows with positions from 0, and
scatters each segment's outputs back to its place in the packed layout. The result is, by construction, running
every document alone. Right padding changes nothing before it: attention (causal), the convolution (causal) and the
recurrence only look back, so the padded slots never reach a segment's tokens; their outputs are dropped.

Groups: segments sorted longest first fill a group while (segments x its longest) stays within the packed batch's
own token count, so no forward holds more tokens than the packed one would. On GPU, transformers' Gated DeltaNet
layers run the flash-linear-attention chunk kernels on these rows when that package is installed (the torch
fallback otherwise); see the report in `capture.py` on why the variable-length (`cu_seqlens`) route is not used.

Group sizes are left as the budget makes them, though fla-core 0.5.2's gate cumsum
(`chunk_local_cumsum_scalar_kernel`) takes the row count as a compile-time constant and an autotuner key, so each
row count not met before compiles and times four configurations once, mid-step. On documents shaped like the GPU
recipe's data (8192-token rows, `benchmarks/hybrid_bench.py --documents real`; counted on the CPU) the first 60
steps meet 14 row counts at 2.0 forwards per step. Cutting groups into power-of-two parts would meet 5 at 4.1
forwards per step (3.3 when each group is capped at a power of two and the rest moves on). An eager forward of the
27B hybrid is some 2,500 kernel launches (62 layers of about 40) however few its tokens, tens of milliseconds,
against a few seconds per compile: by that estimate (not measured) a run of more than a few hundred steps would
lose more to the extra forwards than the nine one-time compiles cost.
Index tensors are built on the host from the layout's host boundaries, then copied without blocking.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .documents import DocumentLayout, to_device


@dataclass(frozen=True)
class DocumentGroup:
    """Segments run together as rows `[N, L]`."""

    gather: Tensor  # [N, L] int64 flat packed position of every slot (padded slots repeat the segment's last token)
    source: Tensor  # [V] int64 index into the group's flattened [N*L] outputs of every real (unpadded) slot
    destination: Tensor  # [V] int64 flat packed position of each of those slots

    def scatter(self, outputs: Tensor, packed: Tensor) -> None:
        """Copy `outputs [N, L, C]` of the real slots into `packed [R*T, C]` (a view; written in place)."""
        rows = outputs.reshape(-1, outputs.shape[-1]).index_select(0, self.source)  # [V, C]
        packed.index_copy_(0, self.destination, rows)


def document_groups(layout: DocumentLayout) -> list[DocumentGroup]:
    """The segments of `layout` in groups (see the module docstring), index tensors on the layout's device."""
    budget = layout.rows * layout.length
    spans = sorted(layout.spans(), key=lambda span: span[1], reverse=True)
    groups: list[list[tuple[int, int]]] = []
    for span in spans:
        if groups and (len(groups[-1]) + 1) * groups[-1][0][1] <= budget:
            groups[-1].append(span)
        else:
            groups.append([span])
    return [_group(members, layout.device) for members in groups]


def _group(members: list[tuple[int, int]], device: torch.device) -> DocumentGroup:
    width = members[0][1]
    starts = torch.tensor([start for start, _ in members])  # [N]
    lengths = torch.tensor([length for _, length in members])  # [N]
    offsets = torch.arange(width)  # [L]
    gather = starts[:, None] + torch.minimum(offsets[None, :], lengths[:, None] - 1)  # [N, L]
    real = offsets[None, :] < lengths[:, None]  # [N, L]
    source = real.flatten().nonzero().flatten()  # [V] (host tensors: no device sync)
    destination = gather.flatten()[source]
    return DocumentGroup(*(to_device(t, device) for t in (gather, source, destination)))
