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
    # fp32 inputs, but the kernels accumulate differently (TF32 matmuls on Hopper): outputs agree to ~1e-7 with
    # identical masks (benchmarks/gpu_mask_diag.py); gradients of parameters whose gradient is tiny (the q/k
    # norms of a sliding layer) differ by up to ~8% relative on the H200, so gradients are compared as a whole.
    out_error = float((out - ref_out).norm() / ref_out.norm())
    flat = torch.cat([g.flatten() for g in grads.values()])
    ref_flat = torch.cat([ref_grads[n].flatten() for n in grads])
    grad_error = float((flat - ref_flat).norm() / ref_flat.norm())
    assert out_error < 5e-3, out_error
    assert grad_error < 2e-2, grad_error


def test_training_loop_on_gpu_with_bf16_flex_and_compiled_layers(tmp_path):
    """The real `fit` loop on CUDA: bf16 autocast over fp32 master weights, flex attention, compiled layers,
    fused AdamW, checkpoint; the loss must fall as on the CPU."""
    import json

    from dflash_trainer.config import load_config
    from dflash_trainer.train.trainer import Trainer
    from train_helpers import save_tiny_target, write_counting_shards, write_recipe

    target = save_tiny_target(tmp_path / "target")
    shards = write_counting_shards(tmp_path / "shards")
    recipe = write_recipe(tmp_path / "r.yaml", tmp_path / "run", target, shards, train={"max_steps": 30})
    config = load_config(recipe, ["target.device=cuda"])
    trainer = Trainer(config, log=lambda _: None)
    assert trainer.backend == "flex" and trainer.autocast_dtype == torch.bfloat16
    summary = trainer.fit()
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert summary.steps == 30
    assert sum(losses[-3:]) / 3 < 0.5 * sum(losses[:3]) / 3, losses
