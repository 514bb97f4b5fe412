"""Diagnose flex vs dense disagreement on GPU per mask variant (window / causal-in-block / both)."""

import sys

import torch

sys.path.insert(0, "tests")
from dflash_trainer.model.attention import (
    MaskVariant,
    attend,
    build_masks,
    dense_mask,
    dflash_mask_mod,
)
from model_helpers import random_packed_batch, tiny_drafter_config

device = torch.device("cuda")
config = tiny_drafter_config(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
batch = random_packed_batch(config, rows=2, length=300, max_anchors=16, seed=3)
anchors, keep, doc = (t.to(device) for t in (batch.anchors, batch.anchor_keep, batch.doc_ids))
q_len = anchors.shape[1] * 4
kv_len = doc.shape[1] + q_len
for variant in [MaskVariant(), MaskVariant(24, False), MaskVariant(None, True), MaskVariant(24, True)]:
    masks = build_masks(
        anchors=anchors, anchor_keep=keep, doc_ids=doc, block_size=4, variants=[variant], backend="flex"
    )
    bm = masks.for_variant(variant)
    mod = dflash_mask_mod(
        anchors=anchors,
        anchor_keep=keep,
        doc_ids=doc,
        block_size=4,
        context_len=doc.shape[1],
        window=variant.window,
        causal_in_block=variant.causal_in_block,
    )
    dense = dense_mask(mod, rows=2, q_len=q_len, kv_len=kv_len, device=device)
    q = torch.randn(2, 4, q_len, 32, device=device)
    k = torch.randn(2, 2, kv_len, 32, device=device)
    v = torch.randn(2, 2, kv_len, 32, device=device)
    a = attend(q, k, v, bm, "flex", 32**-0.5)
    b = attend(q, k, v, dense, "sdpa", 32**-0.5)
    err = ((a - b).norm() / b.norm()).item()
    # materialise the block mask back to dense to compare the masks themselves
    from torch.nn.attention.flex_attention import create_block_mask

    eager = create_block_mask(mod, B=2, H=None, Q_LEN=q_len, KV_LEN=kv_len, device=device)
    a2 = attend(q, k, v, eager, "flex", 32**-0.5)
    err2 = ((a2 - b).norm() / b.norm()).item()
    print(f"{variant}: compiled-mask flex vs dense {err:.2e} | eager-mask flex vs dense {err2:.2e}", flush=True)
