"""GPU-only checks (run with `pytest -m gpu` on a CUDA machine; skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from dflash_trainer.model.attention import build_masks
from dflash_trainer.model.drafter import DFlashDrafter
from model_helpers import random_packed_batch, tiny_drafter_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("sliding", [None, (24, True), (3, False)], ids=["full", "window-24-causal", "window-3"])
@pytest.mark.parametrize("tile", [128, 64])
def test_compiled_flex_matches_dense_sdpa_forward_and_backward(sliding, tile):
    """`drafter.flex_tile` 128 and 64 (fp32: flex's default fp32 kernels are 16-64 wide, so no autotuning needed),
    with a sliding layer whose window is wider or narrower than the block.

    Each case compiles flex anew: its mask functions' closures (window, causal flag) are guarded, so the cases
    before it would otherwise reach dynamo's recompile limit (8) within this parametrisation, and from then on
    flex runs eager, one builder compiled and the other not: not bit-identical. That happened at the sixth case,
    `[64-window-3]` (reproduced on the CPU with compiled flex forward: 4.8e-7 apart at the limit, 0 after a reset)."""
    torch._dynamo.reset()
    config = tiny_drafter_config(
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        layer_types=["sliding_attention", "full_attention"] if sliding else None,
        sliding_window=sliding[0] if sliding else None,
        sliding_causal_in_block=sliding[1] if sliding else False,
    )
    torch.manual_seed(0)
    batch = random_packed_batch(config, rows=2, length=300, max_anchors=16, seed=3)
    device = torch.device("cuda")
    embed = torch.nn.Embedding(config.vocab_size, config.hidden_size, device=device)
    results = {}
    for backend, builder in (("sdpa", "anchors"), ("flex", "anchors"), ("flex", "mask_mod")):
        torch.manual_seed(1)
        drafter = DFlashDrafter(config).to(device)
        masks = build_masks(
            anchors=batch.anchors.to(device),
            anchor_keep=batch.anchor_keep.to(device),
            doc_ids=batch.doc_ids.to(device),
            block_size=config.block_size,
            variants=drafter.mask_variants,
            backend=backend,
            builder=builder,
            tile=tile,
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
        results[backend, builder] = (out.detach(), {n: p.grad.clone() for n, p in drafter.named_parameters()})
    ref_out, ref_grads = results["sdpa", "anchors"]
    # The two flex builders give the same tables (tests/test_attention.py), so the same numbers.
    torch.testing.assert_close(results["flex", "anchors"][0], results["flex", "mask_mod"][0], rtol=0, atol=0)
    out, grads = results["flex", "anchors"]
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


@pytest.mark.parametrize("label_source", ["data", "target_argmax", "soft"])
@pytest.mark.parametrize("weighting", ["exp", "dpace"])
def test_compiled_loss_on_gpu_matches_the_cpu_reference(label_source, weighting):
    """The compiled chunked LM head + loss (bf16 logits on CUDA) against the eager float64 CPU loss."""
    from dflash_trainer.model.loss import dflash_loss

    gen = torch.Generator().manual_seed(0)
    rows, blocks, block, width, vocab = 2, 37, 16, 64, 3000  # 74 blocks: not a whole number of chunks
    hidden = torch.randn(rows, blocks, block, width, generator=gen, dtype=torch.float64)
    weight = torch.randn(vocab, width, generator=gen, dtype=torch.float64) / 4
    labels = torch.randint(0, vocab, (rows, blocks, block), generator=gen)
    valid = torch.rand(rows, blocks, block, generator=gen) < 0.8
    target_hidden = hidden + 0.3 * torch.randn(rows, blocks, block, width, generator=gen, dtype=torch.float64)
    # Argmaxes taken from bf16 logits flip at near-ties, the target's (labels for target_argmax and soft, whose
    # accuracy label is the target's argmax too) and the drafter's (the accepted counts): a flipped label moves its
    # slot's whole gradient (10 of 964 labels flipped gave a relative gradient error of 0.22 on an H200; with soft
    # labels 10 accepted-count flags differed). This test checks the compiled loss, not bf16 near-ties, so each state
    # is pulled towards the head row of its own float64 argmax, once: every argmax stays what it was and leads the
    # runner-up by at least 1.8 logits (bf16 rounds these logits by ~0.05), the softmax stays soft (median top
    # probability 0.76), on the CPU in bf16 no flag flips (gradient error 0.004-0.009), and about half of the target's
    # argmaxes are the drafter's too, so the accepted counts are not all zero.
    hidden = hidden + weight[(hidden @ weight.T).argmax(dim=-1)]
    target_hidden = target_hidden + weight[(target_hidden @ weight.T).argmax(dim=-1)]
    options = dict(gamma=7.0, weighting=weighting, label_source=label_source, chunk_blocks=16)
    results = {}
    for name, device, dtype, compile in (("cpu", "cpu", torch.float64, False), ("gpu", "cuda", torch.bfloat16, True)):
        # detach: on the CPU pass `.to` returns `hidden` itself, which must not become the GPU pass's autograd root.
        h = hidden.to(device, dtype).detach().requires_grad_(True)
        out = dflash_loss(
            h,
            weight.to(device, dtype),
            labels.to(device),
            valid.to(device),
            target_hidden=target_hidden.to(device, dtype),
            compile=compile,
            **options,
        )
        out.loss.backward()
        results[name] = (out.loss.double().cpu(), out.metrics.to_tensor().cpu(), h.grad.double().cpu())
    (ref_loss, ref_metrics, ref_grad), (loss, metrics, grad) = results["cpu"], results["gpu"]
    assert abs(float(loss - ref_loss)) < 2e-2 * abs(float(ref_loss)), (loss, ref_loss)
    # Counts agree exactly where no bf16 near-tie flips the drafter's argmax: allow a few flipped slots.
    counts = slice(4 + block, None)
    torch.testing.assert_close(metrics[counts], ref_metrics[counts], rtol=0, atol=0)
    if label_source != "data":  # random data labels are never the drafter's argmax; the target's are, half the time
        assert float(ref_metrics[4 : 4 + block].sum()) > 0.2 * float(valid.sum())
    assert float((metrics[4 : 4 + block] - ref_metrics[4 : 4 + block]).abs().sum()) <= 0.01 * float(valid.sum())
    grad_error = float((grad - ref_grad).norm() / ref_grad.norm())
    assert grad_error < 3e-2, grad_error


def test_gpu_step_has_no_recompiles_after_the_first_shapes(tmp_path):
    """The real loop on CUDA with shape buckets: new row lengths and anchor counts reuse the compiled code."""
    from torch._dynamo.utils import counters

    from dflash_trainer.config import load_config
    from dflash_trainer.train.trainer import Trainer
    from train_helpers import save_tiny_target, write_counting_shards, write_recipe

    target = save_tiny_target(tmp_path / "target")
    shards = write_counting_shards(tmp_path / "shards", num_samples=96)
    recipe = write_recipe(tmp_path / "r.yaml", tmp_path / "run", target, shards, train={"max_steps": 12})
    # Short documents in rows of up to 96 tokens padded to 128, up to 32 anchors per document in slots of 32 (blocks
    # of 4: 128 queries a bucket), so the batches meet several anchor counts (256 and 384 queries). Real batches
    # have whole flex tiles of queries and keys (GPU defaults: 128 tokens, 16 anchors of 16) and more than one
    # query tile, and so does this case: below 128 queries flex picks its decoding kernel and guards on it, lengths
    # that are whole tiles in one batch and not in another compile each variant once (attend's IS_DIVISIBLE), and a
    # single query tile is a size-1 dimension, which dynamo specialises.
    overrides = [
        "target.device=cuda",
        "data.seq_multiple=128",
        "data.anchor_multiple=32",
        "data.max_anchors=32",
        "data.max_seq_len=96",
    ]
    trainer = Trainer(load_config(recipe, overrides), log=lambda _: None)
    trainer.start_log_window()
    shapes, compiled_at = [], []
    for work in trainer._step_groups():
        before = int(counters["frames"]["ok"])
        trainer._optimizer_step(work.batches, outputs=work.outputs, loss_scale=work.loss_scale)
        shapes.append(tuple(work.batches[0].block_ids.shape) + tuple(work.batches[0].input_ids.shape))
        compiled_at.append(int(counters["frames"]["ok"]) - before)
    rows = shapes[0][0]
    later = [(shape, new) for shape, new in zip(shapes[1:], compiled_at[1:], strict=True) if shape[0] == rows]
    assert len({shape for shape, _ in later}) > 1  # the case meets several shapes
    # Nothing compiled after the first step (a batch of one row may specialise once: dim 1 is never symbolic).
    assert all(new == 0 for _, new in later), list(zip(shapes, compiled_at, strict=True))


def test_a_compiled_norm_crosses_inductors_fusion_size_line_without_a_recompile():
    """Inductor fuses a norm's backward reductions (per row and over rows) only above a size, and with symbolic sizes
    guards on the first call's side of that line unless told not to (compiling.py): the DFlash2 main job recompiled
    its compiled RMSNorm at step ~2,780 for it. Fed a batch above the line (16,384 x 576 elements >= 5 Mi) and then
    one below (6,144 x 576; above 4,096 rows, another size some backends guard on), the norm compiles twice with
    torch's default and once as `configure_compiler` sets it (the fusion off); the gradients are the eager ones."""
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    from dflash_trainer.compiling import configure_compiler
    from dflash_trainer.model.drafter import RMSNorm

    def gradients(norm: RMSNorm, x: Tensor) -> tuple[Tensor, Tensor]:
        norm.zero_grad()
        x = x.detach().requires_grad_()
        norm(x).float().square().sum().backward()
        return x.grad, norm.weight.grad.clone()

    def frames_compiled() -> int:
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        norm = RMSNorm(576, 1e-6).cuda()
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
        eager = RMSNorm(576, 1e-6).cuda()
        eager.load_state_dict(norm.state_dict())
        norm.compile(dynamic=True)
        for tokens in (16384, 6144):
            x = torch.randn(2, tokens // 2, 576, device="cuda", dtype=torch.bfloat16)
            for got, want in zip(gradients(norm, x), gradients(eager, x), strict=True):
                scale = want.float().abs().max()
                assert (got.float() - want.float()).abs().max() <= 2e-2 * scale  # bf16 rounding of fused casts
        return int(counters["frames"]["ok"])

    configure_compiler()
    default = {"triton.mix_order_reduction": True, "triton.mix_order_reduction_non_strict_mode": False}
    with inductor_config.patch(default):
        assert frames_compiled() == 2  # the guard this test is about exists on this torch
    assert frames_compiled() == 1
    torch._dynamo.reset()


def test_compiled_selector_term_on_gpu_matches_its_eager_self_in_bf16():
    """DFlash2's selector term compiled per chunk (the training path on CUDA, whole chunks padded) against the same
    function run eagerly on the same GPU: the same candidates, so the same metrics (counts) exactly, and the loss and
    every gradient within bf16 rounding (Inductor fuses the casts the eager ops round one by one)."""
    from test_dflash2 import selector_inputs, selector_results

    inputs = selector_inputs(dtype=torch.bfloat16, blocks=7, bias=True)
    inputs = {
        **inputs,
        "hidden": inputs["hidden"].detach().cuda().requires_grad_(),
        "selector": inputs["selector"].cuda(),
        **{k: inputs[k].cuda() for k in ("lm_head_weight", "lm_head_bias", "labels", "predecessors", "valid")},
    }
    eager = selector_results(inputs, chunk_blocks=3, compile=False)  # 14 blocks: chunks of 3, the last one padded
    compiled = selector_results(inputs, chunk_blocks=3, compile=True)
    names = ["loss", "metrics", "hidden", "projection", "before", "after"]
    for name, a, b in zip(names, eager, compiled, strict=True):
        if name == "metrics":
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), name  # float64 sums of the same choices
        else:
            scale = a.float().abs().max().clamp_min(1e-6)
            assert (a.float() - b.float()).abs().max() <= 2e-2 * scale, name


def test_embedding_codebooks_on_gpu_match_float64_and_train_through_the_compiled_term():
    """DFlash2's `embedding` codebooks on CUDA: the maps' chunked products (float32) against float64 on the CPU,
    values and map gradients; then the compiled selector term with them against its eager self in bf16."""
    from dflash_trainer.model.dflash2 import CandidateSelector
    from dflash_trainer.model.dflash2 import selector as selector_module
    from test_dflash2 import selector_inputs, selector_results

    torch.manual_seed(0)
    vocab, width, rank = 20_000, 64, 16  # 3 vocabulary chunks of 8,192
    reference = CandidateSelector(width, vocab, rank=rank, top_k=8, codebooks="embedding").double()
    with torch.no_grad():
        reference.successor_map.normal_(std=0.1)
    embedding = torch.randn(vocab, width, dtype=torch.float64)
    reference.bind_token_embedding(embedding)
    gpu = CandidateSelector(width, vocab, rank=rank, top_k=8, codebooks="embedding").cuda()
    gpu.load_state_dict(reference.state_dict())
    gpu.bind_token_embedding(embedding.to("cuda", torch.bfloat16))
    upstream = torch.randn(2, vocab, rank, dtype=torch.float64)
    expected = reference.codebooks()
    torch.autograd.backward(expected, list(upstream))
    got = gpu.codebooks()
    torch.autograd.backward(got, [g.cuda().float() for g in upstream])
    # The GPU's embedding is bf16 (as the target's): compare against float64 of the same rounded rows.
    rounded = CandidateSelector(width, vocab, rank=rank, top_k=8, codebooks="embedding").double()
    rounded.load_state_dict(reference.state_dict())
    rounded.bind_token_embedding(embedding.bfloat16().double())
    wanted = rounded.codebooks()
    for a, b in zip(got, wanted, strict=True):
        torch.testing.assert_close(a.cpu().double(), b.detach(), rtol=1e-4, atol=1e-4)
    torch.autograd.backward(wanted, list(upstream))
    for name in ("predecessor_map", "successor_map"):
        a, b = getattr(gpu, name).grad.cpu().double(), getattr(rounded, name).grad
        assert (a - b).abs().max() <= 1e-4 * b.abs().max(), name
    assert vocab > selector_module._VOCAB_CHUNK

    inputs = selector_inputs(dtype=torch.bfloat16, blocks=7, bias=True)
    selector = CandidateSelector(12, 40, rank=6, top_k=8, codebooks="embedding")
    with torch.no_grad():
        for parameter in selector.parameters():
            parameter.normal_(std=0.5)
    selector = selector.cuda()
    selector.bind_token_embedding(torch.randn(40, 12, device="cuda").bfloat16())
    inputs = {
        **inputs,
        "hidden": inputs["hidden"].detach().cuda().requires_grad_(),
        "selector": selector,
        **{k: inputs[k].cuda() for k in ("lm_head_weight", "lm_head_bias", "labels", "predecessors", "valid")},
    }
    maps = (selector.predecessor_map, selector.successor_map)
    eager = selector_results(inputs, chunk_blocks=3, compile=False)[:4]  # loss, metrics, hidden, projection
    eager += [m.grad.clone() for m in maps]
    compiled = selector_results(inputs, chunk_blocks=3, compile=True)[:4] + [m.grad for m in maps]
    names = ["loss", "metrics", "hidden", "projection", "predecessor map", "successor map"]
    for name, a, b in zip(names, eager, compiled, strict=True):
        if name == "metrics":
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), name
        else:
            scale = a.float().abs().max().clamp_min(1e-6)
            assert scale > 1e-5 and (a.float() - b.float()).abs().max() <= 2e-2 * scale, name


@pytest.mark.parametrize("index", [0, 1], ids=["current-device", "another-device"])
def test_reading_a_steps_flags_waits_for_that_step_only(index):
    """`StepFlags.read` one step later must wait for the step that made the flags (right values) and not for the
    work queued since (the next step's forward and backward), also for flags on a device other than the current
    one (a one-process run on `cuda:1`)."""
    from dflash_trainer.train.trainer import StepFlags

    if index >= torch.cuda.device_count():
        pytest.skip("needs a second GPU")
    device = torch.device("cuda", index)
    values = torch.tensor([0.0, 1.0], device=device)
    with torch.cuda.device(device):
        torch.cuda._sleep(200_000_000)  # the step's own work: the flags exist only after it
        flags = values + 0
        pending = StepFlags.queue(step=1, flags=flags, sample_ids=["a"])
        torch.cuda._sleep(1_000_000_000)  # the next step's work, about half a second of device time
        later = torch.cuda.Event()
        later.record()
    assert pending.read() == (0.0, 1.0)  # waited for the flags
    assert not later.query()  # and returned while the later work still ran
    torch.cuda.synchronize(device)
