"""The drafter module: layer taps, checkpoint names, no information leakage, and that it can learn."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3Config

from dflash_trainer.model.anchors import block_labels
from dflash_trainer.model.attention import build_masks
from dflash_trainer.model.config import DrafterModelConfig, default_target_layer_ids
from dflash_trainer.model.drafter import DFlashDrafter
from model_helpers import random_packed_batch, tiny_drafter_config


def test_default_target_layer_ids():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert default_target_layer_ids(30, 5) == [1, 8, 14, 20, 27]


def test_from_target_copies_shapes_and_rope():
    target = Qwen3Config(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        num_hidden_layers=12,
        vocab_size=300,
        rope_parameters={"rope_type": "default", "rope_theta": 5e5},
    )
    config = DrafterModelConfig.from_target(
        target, num_layers=3, block_size=8, mask_token_id=299, sliding_layers=[0], sliding_window=32
    )
    assert config.target_layer_ids == [1, 3, 5, 7, 9]
    assert (config.hidden_size, config.head_dim, config.num_key_value_heads) == (64, 16, 2)
    assert config.rope_parameters["rope_theta"] == 5e5
    assert config.layer_types == ["sliding_attention", "full_attention", "full_attention"]
    hf = config.to_hf_config()
    assert hf.dflash_config == {
        "mask_token_id": 299,
        "target_layer_ids": [1, 3, 5, 7, 9],
        "sliding_causal_in_block": False,
    }
    assert hf.architectures == ["DFlashDraftModel"] and hf.block_size == 8 and hf.num_target_layers == 12


def test_state_dict_uses_checkpoint_names_and_excludes_embedding_and_head():
    drafter = DFlashDrafter(tiny_drafter_config(num_hidden_layers=1))
    names = set(drafter.state_dict())
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.0.{name}.weight"
        for name in [
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "self_attn.q_norm",
            "self_attn.k_norm",
            "input_layernorm",
            "post_attention_layernorm",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        ]
    }
    assert names == expected


def run_drafter(drafter, batch, features=None, block_ids=None, embed=None):
    config = drafter.config
    masks = build_masks(
        anchors=batch.anchors,
        anchor_keep=batch.anchor_keep,
        doc_ids=batch.doc_ids,
        block_size=config.block_size,
        variants=drafter.mask_variants,
        backend="sdpa",
    )
    return drafter(
        features=batch.features if features is None else features,
        block_embeds=embed(batch.block_ids if block_ids is None else block_ids),
        ctx_positions=batch.position_ids,
        block_positions=batch.block_pos,
        masks=masks,
    ).view(*batch.anchors.shape, config.block_size, -1)  # [R, N, B, H]


@pytest.fixture(scope="module")
def leak_setup():
    torch.manual_seed(0)
    config = tiny_drafter_config(layer_types=["sliding_attention", "full_attention"], sliding_window=6)
    drafter = DFlashDrafter(config).double().eval()
    batch = random_packed_batch(config, rows=2, length=48, max_anchors=4, seed=5)
    batch.features = batch.features.double()
    embed = torch.nn.Embedding(config.vocab_size, config.hidden_size).double()
    with torch.no_grad():
        base = run_drafter(drafter, batch, embed=embed)
    return drafter, batch, embed, base


def changed_blocks(out, base):
    return (out - base).abs().amax(dim=(-1, -2)) > 1e-9  # [R, N]


def test_other_blocks_tokens_do_not_leak(leak_setup):
    drafter, batch, embed, base = leak_setup
    r, n, block = 1, 1, drafter.config.block_size
    block_ids = batch.block_ids.clone()
    block_ids[r, n * block : (n + 1) * block] = (block_ids[r, n * block : (n + 1) * block] + 7) % 60
    with torch.no_grad():
        out = run_drafter(drafter, batch, block_ids=block_ids, embed=embed)
    changed = changed_blocks(out, base)
    assert changed[r, n]
    assert changed.sum() == 1


def test_context_at_or_after_anchor_and_other_documents_do_not_leak(leak_setup):
    drafter, batch, embed, base = leak_setup
    for r in range(batch.anchors.shape[0]):
        for n in range(batch.anchors.shape[1]):
            if not batch.anchor_keep[r, n]:
                continue
            a = int(batch.anchors[r, n])
            doc = batch.doc_ids[r, a]
            forbidden = torch.ones(batch.features.shape[1], dtype=torch.bool)
            forbidden[:a] = batch.doc_ids[r, :a] != doc  # earlier positions of other documents are forbidden too
            features = batch.features.clone()
            features[r, forbidden] += torch.randn_like(features[r, forbidden])
            with torch.no_grad():
                out = run_drafter(drafter, batch, features=features, embed=embed)
            assert not changed_blocks(out, base)[r, n], (r, n, a)


def test_allowed_context_changes_the_block(leak_setup):
    drafter, batch, embed, base = leak_setup
    r = 0
    n = int(torch.nonzero(batch.anchor_keep[r] & (batch.position_ids[r, batch.anchors[r]] > 0))[0])
    a = int(batch.anchors[r, n])
    features = batch.features.clone()
    features[r, a - 1] += 1.0  # the token just before the anchor: inside every window
    with torch.no_grad():
        out = run_drafter(drafter, batch, features=features, embed=embed)
    assert changed_blocks(out, base)[r, n]


def test_sliding_window_hides_old_context(leak_setup):
    drafter, batch, _, _ = leak_setup
    window = drafter.config.sliding_window
    # With the full-attention layer second, old context still reaches the output; check the first layer alone.
    first = drafter.layers[0]
    assert first.variant.window == window
    r = 0
    n = int(torch.argmax(batch.anchors[r]))
    a = int(batch.anchors[r, n])
    assert a - window > 0
    masks = build_masks(
        anchors=batch.anchors,
        anchor_keep=batch.anchor_keep,
        doc_ids=batch.doc_ids,
        block_size=drafter.config.block_size,
        variants=drafter.mask_variants,
        backend="sdpa",
    )
    mask = masks.for_variant(first.variant)[r, 0]  # [Q, KV]
    for slot, row in enumerate(mask[n * 4 : (n + 1) * 4]):
        # The window counts back from the query's own position a + slot, the query included (as engines serve it).
        oldest = a + slot - (window - 1)
        assert not row[:oldest].any() and row[oldest:a].all()


def test_tiny_drafter_overfits_fixed_blocks():
    torch.manual_seed(0)
    config = tiny_drafter_config(num_hidden_layers=1, vocab_size=32, mask_token_id=31)
    drafter = DFlashDrafter(config)
    batch = random_packed_batch(config, rows=2, length=24, max_anchors=3, seed=1)
    embed = torch.nn.Embedding(config.vocab_size, config.hidden_size).requires_grad_(False)
    lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False).requires_grad_(False)
    labels, valid = block_labels(
        input_ids=batch.input_ids,
        loss_mask=batch.loss_mask,
        doc_ids=batch.doc_ids,
        anchors=batch.anchors,
        anchor_keep=batch.anchor_keep,
        block_size=config.block_size,
    )
    assert valid.sum() >= 10
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    for _ in range(300):
        logits = lm_head(run_drafter(drafter, batch, embed=embed))
        loss = F.cross_entropy(logits[valid], labels[valid])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    accuracy = (logits.argmax(-1)[valid] == labels[valid]).float().mean()
    assert accuracy >= 0.95, accuracy


def test_forward_and_backward_under_bf16_autocast():
    """The GPU recipe's precision (fp32 master weights, bf16 compute), here on CPU with SDPA."""
    torch.manual_seed(0)
    config = tiny_drafter_config()
    drafter = DFlashDrafter(config)
    batch = random_packed_batch(config, length=32)
    embed = torch.nn.Embedding(config.vocab_size, config.hidden_size).requires_grad_(False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = run_drafter(drafter, batch, embed=embed)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    out.float().square().mean().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in drafter.parameters())


def test_activation_checkpointing_gives_the_same_loss_and_gradients():
    """Recomputing each layer in the backward (`drafter.activation_checkpointing`) changes what is kept, never the
    result: same output and, in float32 on the CPU (deterministic kernels), the same gradients to rounding."""
    torch.manual_seed(0)
    config = tiny_drafter_config()
    batch = random_packed_batch(config, length=32)
    embed = torch.nn.Embedding(config.vocab_size, config.hidden_size).requires_grad_(False)
    results = []
    for recompute in (False, True):
        torch.manual_seed(1)
        drafter = DFlashDrafter(config).train()
        drafter.checkpoint_layers = recompute
        saved: list[int] = []  # sizes of the tensors autograd keeps for the backward (outside the checkpoints' own)

        def pack(tensor: torch.Tensor, saved: list[int] = saved) -> torch.Tensor:
            saved.append(tensor.numel())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            out = run_drafter(drafter, batch, embed=embed)
        out.square().mean().backward()
        results.append((out.detach(), {name: p.grad for name, p in drafter.named_parameters()}, sum(saved)))
    (out_kept, grads_kept, saved_kept), (out_recomputed, grads_recomputed, saved_recomputed) = results
    assert saved_recomputed < saved_kept / 2, (saved_recomputed, saved_kept)
    torch.testing.assert_close(out_recomputed, out_kept, rtol=0, atol=0)
    for name, grad in grads_kept.items():
        torch.testing.assert_close(grads_recomputed[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_half_precision_features_meet_an_fp32_drafter_outside_autocast():
    """A bf16 target beside the fp32 drafter on the CPU (`target.dtype=bfloat16`, no autocast): the features are
    cast to the drafter's dtype, so the forward equals one on the same features given in float32."""
    torch.manual_seed(0)
    config = tiny_drafter_config()
    drafter = DFlashDrafter(config)
    batch = random_packed_batch(config, length=32)
    batch.features = batch.features.bfloat16()
    embed = torch.nn.Embedding(config.vocab_size, config.hidden_size).requires_grad_(False)
    out = run_drafter(drafter, batch, embed=embed)
    batch.features = batch.features.float()
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, run_drafter(drafter, batch, embed=embed), rtol=0, atol=0)


def test_rope_frequencies_stay_float32_when_the_drafter_is_cast():
    drafter = DFlashDrafter(tiny_drafter_config())
    exact = drafter.rotary_emb.inv_freq.clone()
    drafter = drafter.to(torch.bfloat16)
    assert drafter.fc.weight.dtype == torch.bfloat16
    assert drafter.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.equal(drafter.rotary_emb.inv_freq, exact)


def test_the_drafter_keeps_only_the_rope_settings_its_layers_implement():
    """A Qwen3.5 target's partial-rotary and M-RoPE settings must not reach the drafter (or its export, where a
    serving engine would apply them to layers trained with full 1-D RoPE)."""
    from transformers import Qwen3_5TextConfig

    target = Qwen3_5TextConfig(
        hidden_size=64,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=256,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e7,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
    )
    config = DrafterModelConfig.from_target(target, num_layers=1, block_size=4, mask_token_id=255)
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 1e7}
