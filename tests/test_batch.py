"""Shape buckets: padding rows and anchor slots changes no label, mask decision, loss or gradient."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from dflash_trainer.data.sampler import PackedBatch
from dflash_trainer.model.anchors import kept_blocks_only
from dflash_trainer.model.attention import build_masks
from dflash_trainer.model.drafter import DFlashDrafter
from dflash_trainer.model.loss import dflash_loss
from dflash_trainer.train.batch import make_train_batch
from model_helpers import random_packed_batch, tiny_drafter_config


def packed_rows(config) -> PackedBatch:
    """Three random packed rows of 45 tokens, as the sampler hands them to `make_train_batch`."""
    source = random_packed_batch(config, rows=3, length=45, max_anchors=5, seed=7)
    return PackedBatch(
        input_ids=source.input_ids,
        loss_mask=source.loss_mask,
        doc_ids=source.doc_ids,
        position_ids=source.position_ids,
        sample_ids=["a", "b", "c"],
        num_tokens=int((source.doc_ids >= 0).sum()),
    )


def test_padded_batch_trains_exactly_like_the_unpadded_one():
    config = tiny_drafter_config(block_size=4)
    packed = packed_rows(config)
    common = dict(block_size=4, mask_token_id=config.mask_token_id, max_anchors=5, seed=3, epoch=1, index=2)
    plain = make_train_batch(packed, **common)
    padded = make_train_batch(packed, **common, seq_multiple=32, anchor_multiple=8)
    rows, length = plain.input_ids.shape
    assert padded.input_ids.shape == (rows, 64) and padded.anchors.shape[1] % 8 == 0
    assert padded.anchors.shape[1] > plain.anchors.shape[1]  # the case pads anchors too
    assert (padded.num_blocks, padded.num_tokens) == (plain.num_blocks, plain.num_tokens)
    n = plain.anchors.shape[1]
    assert torch.equal(padded.anchors[:, :n], plain.anchors) and not padded.anchor_keep[:, n:].any()
    assert not padded.valid[:, n:].any() and (padded.doc_ids[:, length:] == -1).all()

    features = torch.randn(
        rows, 64, config.num_features * config.hidden_size, generator=torch.Generator().manual_seed(0)
    )
    embed = torch.nn.Embedding(config.vocab_size, config.hidden_size)
    head = torch.randn(config.vocab_size, config.hidden_size) / 4
    results = []
    for batch in (plain, padded):
        torch.manual_seed(1)
        drafter = DFlashDrafter(config).double()
        masks = build_masks(
            anchors=batch.anchors,
            anchor_keep=batch.anchor_keep,
            doc_ids=batch.doc_ids,
            block_size=4,
            variants=drafter.mask_variants,
            backend="sdpa",
        )
        hidden = drafter(
            features=features[:, : batch.input_ids.shape[1]].double(),
            block_embeds=embed(batch.block_ids).detach().double(),
            ctx_positions=batch.position_ids,
            block_positions=batch.block_pos,
            masks=masks,
        )
        blocks = batch.anchors.shape[1]
        out = dflash_loss(hidden.view(rows, blocks, 4, -1), head.double(), batch.labels, batch.valid, gamma=None)
        out.loss.backward()
        grads = torch.cat([p.grad.flatten() for p in drafter.parameters()])
        results.append((out.loss.detach(), out.metrics.to_tensor(), grads))
    (loss_a, metrics_a, grads_a), (loss_b, metrics_b, grads_b) = results
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-12, atol=0)
    torch.testing.assert_close(metrics_b, metrics_a, rtol=1e-12, atol=0)
    torch.testing.assert_close(grads_b, grads_a, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(("weighting", "label_source"), [("exp", "data"), ("dpace", "data"), ("exp", "soft")])
def test_loss_over_the_kept_blocks_equals_the_loss_over_all_blocks(weighting, label_source):
    """The trainer hands the loss only the kept anchors' blocks (`kept_blocks`): loss, metrics and the gradient
    of every block (zero for the dropped ones) are those of the loss over all blocks, padding included."""
    config = tiny_drafter_config(block_size=4)
    packed = packed_rows(config)
    batch = make_train_batch(
        packed,
        block_size=4,
        mask_token_id=config.mask_token_id,
        max_anchors=5,
        seed=3,
        epoch=1,
        index=2,
        anchor_multiple=8,
    )
    rows, blocks = batch.anchors.shape
    assert batch.kept_blocks.numel() == batch.num_blocks < rows * blocks  # the case has dropped anchors
    assert torch.equal(batch.anchor_keep.flatten().nonzero().squeeze(1), batch.kept_blocks)
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(rows, blocks, 4, config.hidden_size, generator=gen, dtype=torch.float64)
    target_hidden = hidden + 0.3 * torch.randn(hidden.shape, generator=gen, dtype=torch.float64)
    head = torch.randn(config.vocab_size, config.hidden_size, generator=gen, dtype=torch.float64) / 4
    options = dict(gamma=None, weighting=weighting, label_source=label_source, chunk_blocks=3)
    results = []
    for select in (lambda t: t, partial(kept_blocks_only, index=batch.kept_blocks)):
        leaf = hidden.clone().requires_grad_(True)
        out = dflash_loss(
            select(leaf),
            head,
            select(batch.labels),
            select(batch.valid),
            target_hidden=select(target_hidden),
            **options,
        )
        out.loss.backward()
        results.append((out.loss.detach(), out.metrics.to_tensor(), leaf.grad))
    (loss_all, metrics_all, grad_all), (loss_kept, metrics_kept, grad_kept) = results
    torch.testing.assert_close(loss_kept, loss_all, rtol=1e-12, atol=0)
    torch.testing.assert_close(metrics_kept, metrics_all, rtol=1e-12, atol=0)  # loss sum: another summation order
    torch.testing.assert_close(grad_kept, grad_all, rtol=1e-12, atol=1e-15)
    assert grad_all.abs().sum() > 0
