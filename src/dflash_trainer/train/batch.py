"""From a packed token batch to everything the drafter step needs, built on the CPU in the data stage.

Anchors are drawn from a generator seeded by (seed, epoch, batch index), so a resumed run redraws exactly the
anchors the uninterrupted run would have drawn without saving any generator state, and anchors change every
epoch as DESIGN §2 asks.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ..data.sampler import PackedBatch
from ..model.anchors import block_input_ids, block_labels, block_positions, sample_anchors


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
    # Host-side facts, known without a device sync.
    sample_ids: list[str]
    num_tokens: int
    num_blocks: int
    # Some row holds more than one document.
    packed: bool

    def to(self, device: torch.device) -> TrainBatch:
        moved = {}
        for f in fields(self):
            value = getattr(self, f.name)
            moved[f.name] = value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value
        return TrainBatch(**moved)


def anchor_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    # Distinct streams per (seed, epoch, batch); the large odd multipliers keep neighbouring triples apart.
    return torch.Generator().manual_seed((seed * 1_000_003 + epoch * 7_919 + index * 104_729) % (2**63))


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
) -> TrainBatch:
    anchors, keep = sample_anchors(
        loss_mask=packed.loss_mask,
        doc_ids=packed.doc_ids,
        max_anchors=max_anchors,
        generator=anchor_generator(seed, epoch, index),
    )
    labels, valid = block_labels(
        input_ids=packed.input_ids,
        loss_mask=packed.loss_mask,
        doc_ids=packed.doc_ids,
        anchors=anchors,
        anchor_keep=keep,
        block_size=block_size,
    )
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
        sample_ids=packed.sample_ids,
        num_tokens=packed.num_tokens,
        num_blocks=int(keep.sum()),  # CPU tensor: no device sync
        packed=bool((packed.doc_ids > 0).any()),
    )
    if pin_memory:
        for f in fields(batch):
            value = getattr(batch, f.name)
            if isinstance(value, torch.Tensor):
                setattr(batch, f.name, value.pin_memory())
    return batch
