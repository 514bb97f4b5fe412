"""Anchor sampling, block inputs, positions and same-position labels."""

from __future__ import annotations

import torch

from dflash_trainer.model.anchors import (
    block_input_ids,
    block_labels,
    block_positions,
    gather_block_states,
    sample_anchors,
    valid_anchor_mask,
)


def packed_row():
    # One row: document 0 = positions 0..9 (response 4..9), document 1 = 10..17 (response 13..17), padding 18..19.
    doc_ids = torch.tensor([[0] * 10 + [1] * 8 + [-1] * 2])
    loss_mask = torch.zeros(1, 20, dtype=torch.bool)
    loss_mask[0, 4:10] = True
    loss_mask[0, 13:18] = True
    position_ids = torch.tensor([list(range(10)) + list(range(8)) + [0, 0]])
    return doc_ids, loss_mask, position_ids


def test_valid_anchors_need_two_response_tokens_of_one_document():
    doc_ids, loss_mask, _ = packed_row()
    valid = valid_anchor_mask(loss_mask, doc_ids)[0].nonzero().flatten().tolist()
    # 9 is the last token of document 0 (its successor is in document 1); 17 is followed by padding.
    assert valid == [4, 5, 6, 7, 8, 13, 14, 15, 16]


def test_sampling_respects_validity_per_document_limit_and_seed():
    doc_ids, loss_mask, _ = packed_row()
    doc_ids, loss_mask = doc_ids.repeat(3, 1), loss_mask.repeat(3, 1)
    anchors, keep = sample_anchors(
        loss_mask=loss_mask, doc_ids=doc_ids, max_anchors=2, generator=torch.Generator().manual_seed(0)
    )
    assert anchors.shape == (3, 4) and keep.all()
    valid = valid_anchor_mask(loss_mask, doc_ids)
    for r in range(3):
        picked = anchors[r].tolist()
        assert picked == sorted(picked) and len(set(picked)) == 4
        assert all(valid[r, a] for a in picked)
        assert sum(doc_ids[r, a] == 0 for a in picked) == 2  # two per document, not four from one
    again, _ = sample_anchors(
        loss_mask=loss_mask, doc_ids=doc_ids, max_anchors=2, generator=torch.Generator().manual_seed(0)
    )
    other, _ = sample_anchors(
        loss_mask=loss_mask, doc_ids=doc_ids, max_anchors=2, generator=torch.Generator().manual_seed(1)
    )
    assert torch.equal(anchors, again)
    assert not torch.equal(anchors, other)


def test_sampling_covers_every_valid_anchor_when_the_limit_allows():
    doc_ids, loss_mask, _ = packed_row()
    anchors, keep = sample_anchors(loss_mask=loss_mask, doc_ids=doc_ids, max_anchors=100)
    assert anchors[keep].tolist() == [4, 5, 6, 7, 8, 13, 14, 15, 16]


def test_fixed_slot_count_pads_with_keep_false():
    doc_ids, loss_mask, _ = packed_row()
    loss_mask = torch.cat([loss_mask, torch.zeros_like(loss_mask)])  # second row has no valid anchor
    anchors, keep = sample_anchors(loss_mask=loss_mask, doc_ids=doc_ids.repeat(2, 1), max_anchors=3, num_slots=8)
    assert anchors.shape == (2, 8)
    assert keep[0].sum() == 6 and not keep[1].any()
    assert (anchors[~keep] == 0).all()


def test_block_inputs_positions_and_same_position_labels():
    doc_ids, loss_mask, position_ids = packed_row()
    input_ids = torch.arange(100, 120).unsqueeze(0)
    anchors = torch.tensor([[7, 15, 0]])
    keep = torch.tensor([[True, True, False]])
    ids = block_input_ids(input_ids=input_ids, anchors=anchors, block_size=4, mask_token_id=1)
    assert ids.tolist() == [[107, 1, 1, 1, 115, 1, 1, 1, 100, 1, 1, 1]]
    pos = block_positions(position_ids=position_ids, anchors=anchors, block_size=4)
    assert pos.tolist() == [[7, 8, 9, 10, 5, 6, 7, 8, 0, 1, 2, 3]]
    labels, valid = block_labels(
        input_ids=input_ids,
        loss_mask=loss_mask,
        doc_ids=doc_ids,
        anchors=anchors,
        anchor_keep=keep,
        block_size=4,
    )
    # Slot k is labelled with x_{a+k}: same position, no shift.
    assert labels[0, 0].tolist() == [107, 108, 109, 110]
    # Anchor 7: slots 8, 9 are in document 0; slot 10 crosses into document 1. Anchor 15: 16, 17 then padding.
    assert valid[0].tolist() == [[False, True, True, False], [False, True, True, False], [False] * 4]


def test_labels_out_of_bounds_are_invalid():
    doc_ids = torch.zeros(1, 6, dtype=torch.long)
    loss_mask = torch.ones(1, 6, dtype=torch.bool)
    anchors = torch.tensor([[4]])
    _, valid = block_labels(
        input_ids=torch.arange(6).unsqueeze(0),
        loss_mask=loss_mask,
        doc_ids=doc_ids,
        anchors=anchors,
        anchor_keep=torch.tensor([[True]]),
        block_size=4,
    )
    assert valid[0, 0].tolist() == [False, True, False, False]


def test_gather_block_states_takes_the_previous_position():
    states = torch.arange(10, dtype=torch.float).view(1, 10, 1)
    out = gather_block_states(states=states, anchors=torch.tensor([[3]]), block_size=4)
    assert out.flatten().tolist() == [2.0, 3.0, 4.0, 5.0]
