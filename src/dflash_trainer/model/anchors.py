"""Anchor sampling and the block inputs, positions and labels built from anchors.

An anchor a is valid when tokens a and a+1 are both response tokens (loss_mask) of the same document: the block
then has at least one supervised slot. Up to `max_anchors` anchors are drawn per *document* (packed rows carry
several), without replacement, from a seeded generator, and sorted by position so neighbouring queries share
context ranges (denser flex blocks). Rows are padded to a common anchor count with `anchor_keep` False.

These functions run wherever their inputs live; the trainer calls them on the CPU batch in its data stage, so
the data-dependent anchor count costs no device sync.
"""

from __future__ import annotations

import torch
from torch import Tensor


def valid_anchor_mask(loss_mask: Tensor, doc_ids: Tensor) -> Tensor:
    """[R, T] bool: positions that may anchor a block."""
    valid = torch.zeros_like(loss_mask, dtype=torch.bool)
    valid[:, :-1] = loss_mask[:, :-1] & loss_mask[:, 1:] & (doc_ids[:, :-1] == doc_ids[:, 1:]) & (doc_ids[:, :-1] >= 0)
    return valid


def sample_anchors(
    *,
    loss_mask: Tensor,  # [R, T] bool
    doc_ids: Tensor,  # [R, T] int64
    max_anchors: int,
    generator: torch.Generator | None = None,
    num_slots: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Returns anchors [R, N] int64 (sorted, 0 where padded) and anchor_keep [R, N] bool.

    N is `num_slots` when given (anchors beyond it are dropped, lowest random score first), else the largest
    number of anchors any row received."""
    rows, length = loss_mask.shape
    valid = valid_anchor_mask(loss_mask.bool(), doc_ids)
    # Rank valid positions of each document by a random score; keep the best `max_anchors` per document.
    score = torch.rand(rows, length, generator=generator, device=loss_mask.device, dtype=torch.float64)
    score = torch.where(valid, score, torch.full_like(score, 2.0))  # invalid positions sort last
    doc_key = torch.where(doc_ids >= 0, doc_ids, torch.full_like(doc_ids, length)).to(score.dtype)
    order = torch.argsort(doc_key * 4.0 + score, dim=1, stable=True)  # [R, T]: by document, then by score
    sorted_doc = torch.gather(doc_key, 1, order)
    # Rank within the document: index in the sorted row minus the index where this document starts.
    index = torch.arange(length, device=loss_mask.device).expand(rows, length)
    starts = torch.ones_like(sorted_doc, dtype=torch.bool)
    starts[:, 1:] = sorted_doc[:, 1:] != sorted_doc[:, :-1]
    start_index = torch.cummax(torch.where(starts, index, torch.zeros_like(index)), dim=1).values
    rank_sorted = index - start_index
    rank = torch.empty_like(rank_sorted).scatter_(1, order, rank_sorted)  # [R, T] rank back at each position
    chosen = valid & (rank < max_anchors)
    if num_slots is not None:
        # Keep the num_slots chosen positions with the smallest score in the row.
        masked_score = torch.where(chosen, score, torch.full_like(score, 2.0))
        cutoff_order = torch.argsort(masked_score, dim=1, stable=True)[:, :num_slots]
        limited = torch.zeros_like(chosen).scatter_(1, cutoff_order, True)
        chosen = chosen & limited
    counts = chosen.sum(dim=1)
    slots = num_slots if num_slots is not None else int(counts.max().item()) if rows else 0
    slots = max(slots, 1)
    # Chosen positions first, in increasing position order.
    position_key = torch.where(chosen, index, index + length)
    picked = torch.sort(position_key, dim=1).values[:, :slots]  # [R, slots]
    if picked.shape[1] < slots:
        picked = torch.cat([picked, picked.new_full((rows, slots - picked.shape[1]), 2 * length)], dim=1)
    keep = picked < length
    anchors = torch.where(keep, picked, torch.zeros_like(picked))
    return anchors, keep


def _slot_offsets(block_size: int, device: torch.device) -> Tensor:
    return torch.arange(block_size, device=device)


def block_input_ids(*, input_ids: Tensor, anchors: Tensor, block_size: int, mask_token_id: int) -> Tensor:
    """[R, N*B]: `[x_a, MASK, ..., MASK]` per block."""
    rows, num_blocks = anchors.shape
    blocks = torch.full((rows, num_blocks, block_size), mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
    blocks[:, :, 0] = torch.gather(input_ids, 1, anchors)
    return blocks.view(rows, num_blocks * block_size)


def block_positions(*, position_ids: Tensor, anchors: Tensor, block_size: int) -> Tensor:
    """[R, N*B]: RoPE positions a_pos .. a_pos+B-1 (document-relative, like the target's)."""
    rows, num_blocks = anchors.shape
    start = torch.gather(position_ids, 1, anchors)  # [R, N]
    positions = start.unsqueeze(-1) + _slot_offsets(block_size, anchors.device)  # [R, N, B]
    return positions.view(rows, num_blocks * block_size)


def block_token_index(*, anchors: Tensor, block_size: int, length: int) -> tuple[Tensor, Tensor]:
    """Row index a+k of each slot, clamped into the row, and whether it was in bounds. Both [R, N, B]."""
    index = anchors.unsqueeze(-1) + _slot_offsets(block_size, anchors.device)
    in_bounds = index < length
    return torch.clamp(index, max=length - 1), in_bounds


def block_labels(
    *,
    input_ids: Tensor,  # [R, T]
    loss_mask: Tensor,  # [R, T] bool
    doc_ids: Tensor,  # [R, T]
    anchors: Tensor,  # [R, N]
    anchor_keep: Tensor,  # [R, N]
    block_size: int,
) -> tuple[Tensor, Tensor]:
    """Labels [R, N, B]: slot k predicts x_{a+k} (same position, no shift). Valid [R, N, B]: kept block, in
    bounds, same document as the anchor, a response token; slot 0 is never valid."""
    rows, num_blocks = anchors.shape
    index, in_bounds = block_token_index(anchors=anchors, block_size=block_size, length=input_ids.shape[1])
    flat = index.view(rows, -1)
    labels = torch.gather(input_ids, 1, flat).view(rows, num_blocks, block_size)
    same_doc = torch.gather(doc_ids, 1, flat).view_as(index) == torch.gather(doc_ids, 1, anchors).unsqueeze(-1)
    supervised = torch.gather(loss_mask.bool(), 1, flat).view_as(index)
    not_anchor_slot = _slot_offsets(block_size, anchors.device) >= 1
    valid = anchor_keep.unsqueeze(-1) & in_bounds & same_doc & supervised & not_anchor_slot
    return labels, valid


def block_state_rows(*, anchors: Tensor, length: int, block_size: int, shift: int = -1) -> Tensor:
    """[R, N] anchors -> [R, N, B] int64: for slot k of the block anchored at a in row r, the index
    r * T + clamp(a + k + shift) of the position it reads in per-position values flattened to [R*T, ...]."""
    rows = anchors.shape[0]
    index = anchors.unsqueeze(-1) + _slot_offsets(block_size, anchors.device) + shift  # [R, N, B]
    index = torch.clamp(index, min=0, max=length - 1)
    return index + (torch.arange(rows, device=anchors.device) * length).view(rows, 1, 1)


def gather_block_states(*, states: Tensor, anchors: Tensor, block_size: int, shift: int = -1) -> Tensor:
    """states [R, T, H] -> [R, N, B, H] taken at a+k+shift (clamped). With shift -1 this is the target state whose
    LM-head output is the target's distribution for the token at a+k."""
    rows, length, hidden = states.shape
    index = block_state_rows(anchors=anchors, length=length, block_size=block_size, shift=shift)
    return states.reshape(rows * length, hidden)[index]  # [R, N, B, H]


def kept_blocks_only(per_block: Tensor, *, index: Tensor) -> Tensor:
    """[R, N, B, ...] -> [1, K, B, ...]: the blocks of the kept anchors, `index` [K] holding their flat indices
    r * N + n (`TrainBatch.kept_blocks`). The loss takes only these: a dropped anchor's block has no valid slot,
    and every loss term depends on its own block alone, so the sums and metrics are those of all blocks while the
    LM head skips the padding (13 % of the blocks on the SmolLM2 bench's rows)."""
    rows, num_blocks = per_block.shape[:2]
    flat = per_block.reshape(rows * num_blocks, *per_block.shape[2:])
    return flat.index_select(0, index)[None]
