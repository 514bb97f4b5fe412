"""From a packed token batch to everything the drafter step needs, built on the CPU in the data stage.

Anchors are drawn from a generator seeded by (seed, epoch, batch index), so a resumed run redraws exactly the
anchors the uninterrupted run would have drawn without saving any generator state, and anchors change every
epoch as DESIGN §2 asks.

Shape buckets. Compiled code and CUDA graphs are reused only for shapes they have seen, so the row length T is
padded up to a multiple of `seq_multiple` and the anchor count N to a multiple of `anchor_multiple`. Padding
never changes the loss: padded positions belong to no document (doc id -1, no loss), so no anchor is drawn there
and no block sees them; padded anchors are dropped anchors (`anchor_keep` False), whose slots are never valid.
Causal attention in the target never looks ahead, so padding a row's end leaves its real features unchanged.

When `mask_variants` are given, the flex tile tables of the drafter's masks (`model/attention.py`) and the blocks'
context ranges their `mask_mod` reads are computed here too, so the training step builds its BlockMasks without
any pass over the attention grid, and their `mask_mod` without any kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from ..data.sampler import PackedBatch
from ..flex import TILE
from ..model.anchors import block_input_ids, block_labels, block_positions, sample_anchors
from ..model.attention import MaskVariant, TileTables, mask_tables
from ..targets.capture import FeatureCapture, TargetOutputs
from ..targets.documents import DocumentLayout, host_boundaries
from .profiler import StageProfiler


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # [R, T]
    position_ids: torch.Tensor  # [R, T]
    doc_ids: torch.Tensor  # [R, T]
    anchors: torch.Tensor  # [R, N]
    anchor_keep: torch.Tensor  # [R, N]
    block_ids: torch.Tensor  # [R, N*B]
    block_pos: torch.Tensor  # [R, N*B]
    labels: torch.Tensor  # [R, N, B]
    valid: torch.Tensor  # [R, N, B]
    # [K] int64: flat indices r * N + n of the kept anchors. Dropped ones (bucket padding, rows with fewer anchors
    # than the longest) have no valid slot, so the loss skips them: same sums, less LM-head work.
    kept_blocks: torch.Tensor
    # Host-side facts, known without a device sync.
    sample_ids: list[str]
    num_tokens: int
    num_blocks: int
    # Some row holds more than one document.
    packed: bool
    # Flex tile tables and context ranges per mask variant, prepared with the batch; None: the step builds them
    # from the anchors.
    mask_tables: dict[MaskVariant, TileTables] | None = None
    # Host segment boundaries of the packed rows (`targets/documents.py`), computed with the batch so that the
    # target's variable-length attention needs no device-to-host copy in the step; None when not packed.
    segment_boundaries: tuple[int, ...] | None = None

    def to(self, device: torch.device) -> TrainBatch:
        """Non-blocking copies (asynchronous from pinned memory, ordered on the current stream)."""
        moved = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                value = value.to(device, non_blocking=True)
            elif f.name == "mask_tables" and value is not None:
                value = {variant: tables.to(device, non_blocking=True) for variant, tables in value.items()}
            moved[f.name] = value
        return TrainBatch(**moved)

    def capture_target(self, capture: FeatureCapture) -> TargetOutputs:
        """The target's features for this (device) batch. Packed rows get their document layout from the host
        boundaries computed with the batch (no device-to-host copy); rows of one document need no document mask,
        which keeps the target on its plain causal kernel."""
        doc_ids, layout = None, None
        if self.packed:
            doc_ids = self.doc_ids
            if self.segment_boundaries is not None:
                layout = DocumentLayout.from_device_doc_ids(self.doc_ids, self.segment_boundaries)
        return capture.capture(self.input_ids, self.position_ids, doc_ids, documents=layout)

    def target_outputs(
        self, capture: FeatureCapture, *, labels_head: nn.Module | None, chunk_positions: int, profiler: StageProfiler
    ) -> TargetOutputs:
        """`capture_target` and, with `labels_head` (target-argmax labels), the target's greedy next tokens under it
        (one LM-head pass per position instead of per block slot: blocks overlap; the loss gathers them per slot).
        What a colocated step, the lookahead and a target rank compute alike, timed as their two stages."""
        with profiler.stage("target_forward"):
            outputs = self.capture_target(capture)
        if labels_head is not None:
            with profiler.stage("target_labels"):
                outputs = outputs.with_next_tokens(labels_head, chunk_positions=chunk_positions)
        return outputs

    def pin_memory(self) -> TrainBatch:
        pinned = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                value = value.pin_memory()
            elif f.name == "mask_tables" and value is not None:
                value = {variant: tables.pin_memory() for variant, tables in value.items()}
            pinned[f.name] = value
        return TrainBatch(**pinned)


def anchor_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    # Distinct streams per (seed, epoch, batch); the large odd multipliers keep neighbouring triples apart.
    return torch.Generator().manual_seed((seed * 1_000_003 + epoch * 7_919 + index * 104_729) % (2**63))


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def pad_rows(packed: PackedBatch, *, multiple: int, pad_token_id: int) -> PackedBatch:
    """Pad every row at its end to a length that is a multiple of `multiple` (padding: no document, no loss)."""
    extra = round_up(packed.input_ids.shape[1], multiple) - packed.input_ids.shape[1]
    if extra == 0:
        return packed
    return PackedBatch(
        input_ids=F.pad(packed.input_ids, (0, extra), value=pad_token_id),
        loss_mask=F.pad(packed.loss_mask, (0, extra), value=False),
        doc_ids=F.pad(packed.doc_ids, (0, extra), value=-1),
        position_ids=F.pad(packed.position_ids, (0, extra), value=0),
        sample_ids=packed.sample_ids,
        num_tokens=packed.num_tokens,
    )


def pad_anchors(anchors: torch.Tensor, keep: torch.Tensor, *, multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, N] -> [R, round_up(N, multiple)] with dropped anchors (position 0, keep False) appended."""
    extra = round_up(anchors.shape[1], multiple) - anchors.shape[1]
    if extra == 0:
        return anchors, keep
    return F.pad(anchors, (0, extra), value=0), F.pad(keep, (0, extra), value=False)


def make_train_batch(
    packed: PackedBatch,
    *,
    block_size: int,
    mask_token_id: int,
    max_anchors: int,
    seed: int,
    epoch: int,
    index: int,
    pin_memory: bool = False,
    seq_multiple: int = 1,
    anchor_multiple: int = 1,
    pad_token_id: int = 0,
    mask_variants: list[MaskVariant] | None = None,
    mask_tile: int = TILE,
) -> TrainBatch:
    # Anchors are drawn before the rows are padded: the draw depends on the row length, and padding must not
    # change which anchors a batch gets.
    anchors, keep = sample_anchors(
        loss_mask=packed.loss_mask,
        doc_ids=packed.doc_ids,
        max_anchors=max_anchors,
        generator=anchor_generator(seed, epoch, index),
    )
    anchors, keep = pad_anchors(anchors, keep, multiple=anchor_multiple)
    packed = pad_rows(packed, multiple=seq_multiple, pad_token_id=pad_token_id)
    labels, valid = block_labels(
        input_ids=packed.input_ids,
        loss_mask=packed.loss_mask,
        doc_ids=packed.doc_ids,
        anchors=anchors,
        anchor_keep=keep,
        block_size=block_size,
    )
    tables = None
    if mask_variants:
        tables = mask_tables(
            anchors=anchors,
            anchor_keep=keep,
            doc_ids=packed.doc_ids,
            block_size=block_size,
            variants=mask_variants,
            tile=mask_tile,
        )
    is_packed = bool((packed.doc_ids > 0).any())  # CPU tensor: no device sync
    batch = TrainBatch(
        input_ids=packed.input_ids,
        position_ids=packed.position_ids,
        doc_ids=packed.doc_ids,
        anchors=anchors,
        anchor_keep=keep,
        block_ids=block_input_ids(
            input_ids=packed.input_ids, anchors=anchors, block_size=block_size, mask_token_id=mask_token_id
        ),
        block_pos=block_positions(position_ids=packed.position_ids, anchors=anchors, block_size=block_size),
        labels=labels,
        valid=valid,
        kept_blocks=keep.flatten().nonzero().squeeze(1),  # CPU tensor: no device sync
        sample_ids=packed.sample_ids,
        num_tokens=packed.num_tokens,
        num_blocks=int(keep.sum()),  # CPU tensor: no device sync
        packed=is_packed,
        mask_tables=tables,
        segment_boundaries=host_boundaries(packed.doc_ids) if is_packed else None,
    )
    return batch.pin_memory() if pin_memory else batch
