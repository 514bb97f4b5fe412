"""Where the documents of packed rows lie: the one description every packed-row path of the target reads.

A packed row `[T]` holds several documents one after another, then padding. A *segment* is a maximal run of equal
`doc_ids` within a row; the padding at the end of a row (doc id -1) is one more segment. So every position belongs
to exactly one segment, and no query is ever left without a key (an all-masked attention row is NaN). The contract
of packed rows: attention and recurrent state never cross a segment boundary, and positions restart at every
segment, so the output at a position equals that of running its segment alone. Features at padding positions are
those of the padding run treated as a document of its own: finite and deterministic, and ignored downstream.

`DocumentLayout` holds
- `segment_ids [R, T]` int32 on the device: a segment index unique over the whole batch (row-major), what the
  attention masks compare (equal id = same segment);
- on the host, the segment boundaries over the flattened `[R*T]` tokens (`boundaries`, S+1 entries from 0 to
  R*T), and on the device the same as `cu_seqlens` int32: what variable-length kernels and the per-document
  path read.
Built from host `doc_ids` (what the batch builder has before the host-to-device copy), nothing waits on the
device: `DocumentLayout.from_doc_ids(doc_ids_on_cpu, device)` can run ahead on a prefetch worker. Built from
device `doc_ids`, the segment ids stay on the device and the host boundaries are fetched only when a path needs
them (one device-to-host copy of `doc_ids`, a host sync).
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor


def segment_starts(doc_ids: Tensor) -> Tensor:
    """`[R, T]` bool, True where a segment starts: the first position of a row and wherever the id changes."""
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return starts


def positions_within_documents(doc_ids: Tensor) -> Tensor:
    """`[R, T]` int64 positions that restart at 0 wherever the document id changes."""
    length = doc_ids.shape[1]
    index = torch.arange(length, device=doc_ids.device).expand_as(doc_ids)  # [R, T]
    start_index = torch.where(segment_starts(doc_ids), index, 0).cummax(dim=1).values  # [R, T]
    return index - start_index


class DocumentLayout:
    """The segments of a batch of packed rows (see the module docstring)."""

    def __init__(self, segment_ids: Tensor, boundaries: tuple[int, ...] | None = None) -> None:
        if segment_ids.dim() != 2:
            raise ValueError(f"segment_ids: expected [R, T], got shape {tuple(segment_ids.shape)}")
        self.segment_ids = segment_ids  # [R, T] int32
        self._boundaries = boundaries
        self._cu_seqlens: Tensor | None = None

    @classmethod
    def from_doc_ids(cls, doc_ids: Tensor, device: torch.device | str | None = None) -> DocumentLayout:
        """The layout of `doc_ids [R, T]` (document index per position, -1 on padding), placed on `device`
        (default: where `doc_ids` is). On CPU `doc_ids`, the host boundaries are computed here as well."""
        if doc_ids.dim() != 2:
            raise ValueError(f"doc_ids: expected [R, T], got shape {tuple(doc_ids.shape)}")
        device = torch.device(device) if device is not None else doc_ids.device
        starts = segment_starts(doc_ids).flatten()  # [R*T]
        segment_ids = (starts.cumsum(0, dtype=torch.int32) - 1).view(doc_ids.shape)  # [R, T]
        boundaries = None
        if doc_ids.device.type == "cpu":
            boundaries = _boundaries_from_starts(starts)
        layout = cls(to_device(segment_ids, device), boundaries)
        if boundaries is not None and device.type != "cpu":
            layout._cu_seqlens = _cu_seqlens(boundaries, device)
        return layout

    @classmethod
    def whole_rows(cls, rows: int, length: int, device: torch.device | str) -> DocumentLayout:
        """Every row one segment (its padding, if any, at the end of it: causal kernels never let it reach the
        document), built without reading anything from the device."""
        flat = torch.arange(rows * length, dtype=torch.int32, device=device)  # [R*T]
        segment_ids = (flat // length).view(rows, length)  # [R, T], contiguous: one row of sequences is a view
        return cls(segment_ids, tuple(range(0, rows * length + 1, length)))

    @classmethod
    def from_device_doc_ids(cls, doc_ids: Tensor, boundaries: tuple[int, ...]) -> DocumentLayout:
        """The layout of device `doc_ids [R, T]` whose host `boundaries` were computed ahead (`host_boundaries` on
        the host copy, in the batch builder): segment ids are computed on the device, nothing waits on it."""
        segment_ids = (segment_starts(doc_ids).flatten().cumsum(0, dtype=torch.int32) - 1).view(doc_ids.shape)
        return cls(segment_ids, boundaries)

    def as_one_row(self) -> DocumentLayout:
        """The same segments over the batch flattened into one row `[1, R*T]` (the boundaries are already over the
        flattened tokens): what kernels that take one row of sequences read."""
        layout = DocumentLayout(self.segment_ids.view(1, -1), self._boundaries)
        layout._cu_seqlens = self._cu_seqlens
        return layout

    @property
    def rows(self) -> int:
        return self.segment_ids.shape[0]

    @property
    def length(self) -> int:
        return self.segment_ids.shape[1]

    @property
    def device(self) -> torch.device:
        return self.segment_ids.device

    def boundaries(self) -> tuple[int, ...]:
        """Segment starts in the flattened `[R*T]` tokens, then R*T (host ints)."""
        if self._boundaries is None:
            # Host sync: only when the layout was built from device doc_ids and a path needs host boundaries.
            # Build the layout from the host doc_ids ahead of the step to avoid it.
            starts = torch.ones(self.rows * self.length, dtype=torch.bool, device=self.device)
            flat = self.segment_ids.flatten()
            starts[1:] = flat[1:] != flat[:-1]
            self._boundaries = _boundaries_from_starts(starts.cpu())
        return self._boundaries

    def cu_seqlens(self) -> Tensor:
        """`[S+1]` int32 on the device: the boundaries for variable-length kernels."""
        if self._cu_seqlens is None:
            self._cu_seqlens = _cu_seqlens(self.boundaries(), self.device)
        return self._cu_seqlens

    def spans(self) -> list[tuple[int, int]]:
        """(start in the flattened tokens, length) of every segment, in order."""
        bounds = self.boundaries()
        return [(start, end - start) for start, end in itertools.pairwise(bounds)]

    def max_seqlen(self) -> int:
        return max(length for _, length in self.spans())

    def positions(self) -> Tensor:
        """`[R, T]` int64 positions restarting at every segment (the default position ids of packed rows)."""
        return positions_within_documents(self.segment_ids)


def host_boundaries(doc_ids: Tensor) -> tuple[int, ...]:
    """The segment boundaries of host `doc_ids [R, T]` over the flattened tokens (see `DocumentLayout`)."""
    return _boundaries_from_starts(segment_starts(doc_ids).flatten())


def _boundaries_from_starts(starts: Tensor) -> tuple[int, ...]:
    """Host boundaries from a host `[R*T]` bool tensor of segment starts."""
    return (*starts.nonzero().flatten().tolist(), starts.numel())


def _cu_seqlens(boundaries: tuple[int, ...], device: torch.device) -> Tensor:
    return to_device(torch.tensor(boundaries, dtype=torch.int32), device)


def to_device(tensor: Tensor, device: torch.device) -> Tensor:
    """Copy to `device` without blocking the host (pinned staging for CUDA); no copy when already there."""
    if tensor.device == device:
        return tensor
    if tensor.device.type == "cpu" and device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)
