"""GPU-only checks (run with `pytest -m gpu` on a CUDA machine; skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch

from dflash_trainer.model.attention import build_masks
from dflash_trainer.model.drafter import DFlashDrafter
from model_helpers import random_packed_batch, tiny_drafter_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("sliding", [False, True])
def test_compiled_flex_matches_dense_sdpa_forward_and_backward(sliding):
    config = tiny_drafter_config(
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        layer_types=["sliding_attention", "full_attention"] if sliding else None,
        sliding_window=24 if sliding else None,
        sliding_causal_in_block=sliding,
    )
    torch.manual_seed(0)
    batch = random_packed_batch(config, rows=2, length=300, max_anchors=16, seed=3)
    device = torch.device("cuda")
    embed = torch.nn.Embedding(config.vocab_size, config.hidden_size, device=device)
    results = {}
    for backend in ("sdpa", "flex"):
        torch.manual_seed(1)
        drafter = DFlashDrafter(config).to(device)
        masks = build_masks(
            anchors=batch.anchors.to(device),
            anchor_keep=batch.anchor_keep.to(device),
            doc_ids=batch.doc_ids.to(device),
            block_size=config.block_size,
            variants=drafter.mask_variants,
            backend=backend,
        )
        out = drafter(
            features=batch.features.to(device),
            block_embeds=embed(batch.block_ids.to(device)).detach(),
            ctx_positions=batch.position_ids.to(device),
            block_positions=batch.block_pos.to(device),
            masks=masks,
            backend=backend,
        )
        out.square().mean().backward()
        results[backend] = (out.detach(), {n: p.grad.clone() for n, p in drafter.named_parameters()})
    ref_out, ref_grads = results["sdpa"]
    out, grads = results["flex"]
    assert (out - ref_out).norm() / ref_out.norm() < 1e-3
    for name, grad in grads.items():
        assert (grad - ref_grads[name]).norm() / ref_grads[name].norm().clamp_min(1e-12) < 1e-2, name
