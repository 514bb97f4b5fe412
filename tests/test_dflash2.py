"""DFlash2 (model/dflash2/): the convolution and selector against their formulas, the selector's loss and gradients
against a dense float64 reference, its metrics against the walk, and the export against an independent
implementation of the engines' forward (tests/dflash2_reference.py)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from dflash2_reference import ReferenceDFlash2
from dflash_trainer.config import ConfigError, load_config
from dflash_trainer.export import (
    CheckpointFormatError,
    export_drafter,
    import_drafter,
    load_drafter_config,
    save_drafter_config,
)
from dflash_trainer.model.attention import build_masks
from dflash_trainer.model.dflash2 import (
    CandidateSelector,
    DFlash2Drafter,
    DFlash2ModelConfig,
    GroupedDynamicCausalConv,
    selector_loss,
    selector_weight_at,
)
from dflash_trainer.model.drafter import DFlashDrafter, build_drafter
from dflash_trainer.model.loss import _loss_chunk, dflash_loss, slot_weights
from model_helpers import force_compiled_chunks, random_packed_batch, tiny_drafter_config

DFLASH2_SIZES = dict(conv_kernel_size=2, conv_group_size=8, selector_rank=8, selector_top_k=6)


def dflash2_config(**overrides) -> DFlash2ModelConfig:
    sizes = {**DFLASH2_SIZES, **{k: overrides.pop(k) for k in list(overrides) if k in DFLASH2_SIZES}}
    return DFlash2ModelConfig.extend(tiny_drafter_config(**overrides), **sizes)


def randomise(drafter: DFlash2Drafter, seed: int = 0, *, everything: bool = False) -> DFlash2Drafter:
    """Move the convolutions and the selector away from their identity / no-op initialisation (`everything`: all
    weights, so that the slots of a block differ as much as a trained drafter's do)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in drafter.named_parameters():
            if everything or "conv" in name or "candidate_selector" in name:
                noise = torch.randn(parameter.shape, generator=gen, dtype=torch.float64).to(parameter.dtype)
                parameter.add_(0.3 * noise)
    return drafter


# ----------------------------------------------------------------------------------------------------------
# Convolution


def naive_conv(x, delta, base, *, block_size, group):
    """out[i, c] = sum_t (base[t, c] + delta[i, t, c // group]) * x[i - t, c], i and i - t in the same block."""
    out = torch.zeros_like(x)
    for row in range(x.shape[0]):
        for i in range(x.shape[1]):
            for t in range(base.shape[0]):
                if (i % block_size) - t >= 0:
                    out[row, i] += (base[t] + delta[row, i, t].repeat_interleave(group)) * x[row, i - t]
    return out


@pytest.mark.parametrize("taps", [1, 2, 3])
def test_convolution_is_the_grouped_dynamic_causal_formula_within_each_block(taps):
    torch.manual_seed(0)
    conv = GroupedDynamicCausalConv(16, taps=taps, group_size=4, block_size=4).double()
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_()
    x = torch.randn(2, 12, 16, dtype=torch.float64)  # three blocks per row
    y = torch.randn(2, 12, 16, dtype=torch.float64)
    prepared, kernel = conv.prepare(x)
    delta = (x @ conv.kernel_projection.weight.T).view(2, 12, 2, taps, 4)
    base = conv.base_kernel.detach()
    torch.testing.assert_close(prepared, naive_conv(x, delta[:, :, 0], base[0], block_size=4, group=4))
    torch.testing.assert_close(conv.finish(y, kernel), naive_conv(y, delta[:, :, 1], base[1], block_size=4, group=4))


def test_new_dflash2_drafter_computes_what_dflash_computes_with_the_same_weights():
    config = dflash2_config()
    base_config = tiny_drafter_config()
    dflash = DFlashDrafter(base_config).double()
    dflash2 = DFlash2Drafter(config).double()
    result = dflash2.load_state_dict(dflash.state_dict(), strict=False)
    assert result.unexpected_keys == []
    assert all("conv" in key or "candidate_selector" in key for key in result.missing_keys)
    batch = random_packed_batch(base_config)
    hidden = {name: run_training_forward(model, batch) for name, model in (("dflash", dflash), ("dflash2", dflash2))}
    torch.testing.assert_close(hidden["dflash2"], hidden["dflash"], rtol=0, atol=0)
    # And the untrained selector drafts each slot's argmax.
    logits = torch.randn(3, 5, config.vocab_size, dtype=torch.float64)
    hidden_states = torch.randn(3, 5, config.hidden_size, dtype=torch.float64)
    drafts = dflash2.draft_tokens(hidden_states, logits, torch.tensor([1, 2, 3]))
    assert torch.equal(drafts, logits.argmax(dim=-1))


@pytest.mark.slow  # dynamo traces the layers with symbolic shapes: ~10 s on 2 shared cores
def test_the_dflash2_layers_compile_once_for_every_layer_and_batch_shape():
    """The convolution adds no per-layer value and no shape guard to the compiled layer: three layers and two batch
    shapes (other rows, lengths and anchors) run on the frames of the first call, as DFlash's do."""
    from torch._dynamo.utils import counters
    from torch.fx.experimental import _config as fx_config

    torch.manual_seed(0)
    drafter = randomise(DFlash2Drafter(dflash2_config(num_hidden_layers=3)))
    eager = randomise(DFlash2Drafter(dflash2_config(num_hidden_layers=3)))
    eager.load_state_dict(drafter.state_dict())
    batches = [
        random_packed_batch(drafter.config, rows=2, length=48, max_anchors=4, seed=0),
        random_packed_batch(drafter.config, rows=3, length=40, max_anchors=3, seed=1),
    ]
    assert batches[0].block_ids.shape != batches[1].block_ids.shape
    with fx_config.patch(use_duck_shape=True):  # compile_layers switches it off; restored on exit
        torch._dynamo.reset()
        counters.clear()
        drafter.compile_layers(backend="eager")
        outputs = [run_training_forward(drafter, batch) for batch in batches]
        assert counters["frames"]["ok"] == 2  # the layer (shared by the three) and the norms
    torch._dynamo.reset()
    for output, batch in zip(outputs, batches, strict=True):
        torch.testing.assert_close(output, run_training_forward(eager, batch), rtol=0, atol=0)


def run_training_forward(drafter, batch, embed=None):
    config = drafter.config
    embed = torch.randn(config.vocab_size, config.hidden_size, generator=torch.Generator().manual_seed(5))
    masks = build_masks(
        anchors=batch.anchors,
        anchor_keep=batch.anchor_keep,
        doc_ids=batch.doc_ids,
        block_size=config.block_size,
        variants=drafter.mask_variants,
        backend="sdpa",
    )
    dtype = drafter.fc.weight.dtype
    return drafter(
        features=batch.features.to(dtype),
        block_embeds=embed[batch.block_ids].to(dtype),
        ctx_positions=batch.position_ids,
        block_positions=batch.block_pos,
        masks=masks,
    )


def test_the_convolution_never_mixes_neighbouring_blocks():
    """A block's outputs do not change when another block of the same row changes its tokens."""
    config = dflash2_config()
    drafter = randomise(DFlash2Drafter(config).double())
    batch = random_packed_batch(config, rows=1, length=40, max_anchors=4)
    assert batch.anchors.shape[1] >= 2
    before = run_training_forward(drafter, batch)
    batch.block_ids[0, config.block_size :] = (batch.block_ids[0, config.block_size :] + 7) % config.vocab_size
    after = run_training_forward(drafter, batch)
    torch.testing.assert_close(after[0, : config.block_size], before[0, : config.block_size], rtol=0, atol=0)
    assert not torch.allclose(after[0, config.block_size :], before[0, config.block_size :])


# ----------------------------------------------------------------------------------------------------------
# Selector


def loop_walk(selector: CandidateSelector, hidden, logits, anchor):
    """z-lab's reading: slot by slot, score the k candidates from the previous choice."""
    gate = hidden @ selector.hidden_projection.weight.T
    rows = []
    for r in range(hidden.shape[0]):
        previous, drafts = int(anchor[r]), []
        for slot in range(hidden.shape[1]):
            unary, ids = torch.topk(logits[r, slot], selector.top_k)
            left = selector.predecessor_codebook[previous] * gate[r, slot]
            previous = int(ids[int(torch.argmax(unary + selector.successor_codebook[ids] @ left))])
            drafts.append(previous)
        rows.append(drafts)
    return torch.tensor(rows)


def test_walk_follows_the_previous_choice_like_the_engines():
    torch.manual_seed(0)
    selector = CandidateSelector(16, 40, rank=8, top_k=5).double()
    with torch.no_grad():  # strong transitions: the walk departs from the argmax
        for parameter in selector.parameters():
            parameter.normal_()
    hidden = torch.randn(4, 7, 16, dtype=torch.float64)
    logits = torch.randn(4, 7, 40, dtype=torch.float64)
    anchor = torch.tensor([0, 5, 9, 39])
    drafts = selector.walk(hidden, logits, anchor)
    assert torch.equal(drafts, loop_walk(selector, hidden, logits, anchor))
    assert not torch.equal(drafts, logits.argmax(dim=-1))


def reference_selector_loss(hidden, head, selector, labels, predecessors, valid, *, gamma, gold, stop, codebooks=None):
    """Dense float64 autograd version of model/dflash2/loss.py (full logits, no chunks, no custom Function).
    `codebooks`: (A, C) [V, r] to score with; None: the selector's own (free) codebooks."""
    block = hidden.shape[2]
    h = hidden[:, :, 1:]
    target_tokens = labels[:, :, 1:]
    ids = torch.topk(h.detach() @ head.T, selector.top_k, dim=-1).indices
    present = (ids == target_tokens[..., None]).any(-1)
    if gold:
        ids = ids.clone()
        ids[..., -1] = torch.where(present, ids[..., -1], target_tokens)
    source = h.detach() if stop else h
    unary = (source @ head.T).gather(-1, ids)
    gate = source @ selector.hidden_projection.weight.T
    before, after = codebooks or (selector.predecessor_codebook, selector.successor_codebook)
    left = before[predecessors[:, :, 1:]] * gate
    scores = unary + torch.einsum("rnsq,rnskq->rnsk", left, after[ids])
    target = (ids == target_tokens[..., None]).double().argmax(-1)
    ce = torch.logsumexp(scores, -1) - scores.gather(-1, target[..., None])[..., 0]
    counted = valid[:, :, 1:] & (present | gold)
    weights = slot_weights(block, gamma, dtype=torch.float64)[1:] * counted
    return (weights * torch.where(counted, ce, 0.0)).sum() / weights.sum()


def reference_codebooks(selector: CandidateSelector, embedding):
    """`embedding` codebooks in float64 from their definition: unit-RMS embedding rows times each map."""
    features = embedding / embedding.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
    return features @ selector.predecessor_map.T, features @ selector.successor_map.T


@pytest.mark.parametrize("codebooks", ["free", "embedding"])
@pytest.mark.parametrize(("gold", "stop", "chunk"), [(False, False, 1), (True, False, 2), (False, True, 64)])
def test_selector_loss_and_gradients_match_a_dense_reference(monkeypatch, codebooks, gold, stop, chunk):
    """With `embedding` codebooks the parameters are the two maps; the maps' function walks the vocabulary of 30 in
    chunks of 7 rows here (five, the last one short)."""
    from dflash_trainer.model.dflash2 import selector as selector_module

    monkeypatch.setattr(selector_module, "_VOCAB_CHUNK", 7)
    torch.manual_seed(0)
    rows, blocks, block, width, vocab = 2, 3, 5, 12, 30
    selector = CandidateSelector(width, vocab, rank=6, top_k=8, codebooks=codebooks).double()
    with torch.no_grad():
        for parameter in selector.parameters():
            parameter.normal_(std=0.5)
    head = torch.randn(vocab, width, dtype=torch.float64)
    hidden = torch.randn(rows, blocks, block, width, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, vocab, (rows, blocks, block))
    # Make about half the labels candidates, so both the counted and the missing cases occur.
    best = (hidden.detach() @ head.T).argmax(-1)
    labels = torch.where(torch.rand(rows, blocks, block) < 0.5, best, labels)
    predecessors = torch.randint(0, vocab, (rows, blocks, block))
    valid = torch.rand(rows, blocks, block) < 0.8
    valid[..., 0] = False
    if codebooks == "embedding":
        # Rows of mixed scales, as a real embedding's: the unit-RMS scaling matters.
        embedding = torch.randn(vocab, width, dtype=torch.float64) * torch.rand(vocab, 1, dtype=torch.float64).add(0.1)
        selector.bind_token_embedding(embedding)
        scored = reference_codebooks(selector, embedding)
        params = [selector.hidden_projection.weight, selector.predecessor_map, selector.successor_map]
    else:
        scored = None
        params = [selector.hidden_projection.weight, selector.predecessor_codebook, selector.successor_codebook]

    out = selector_loss(
        hidden,
        head,
        selector,
        labels,
        predecessors,
        valid,
        gamma=2.0,
        gold_injection=gold,
        stop_gradient=stop,
        chunk_blocks=chunk,
    )
    got = torch.autograd.grad(out.loss, [hidden, *params], allow_unused=True)
    expected_loss = reference_selector_loss(
        hidden, head, selector, labels, predecessors, valid, gamma=2.0, gold=gold, stop=stop, codebooks=scored
    )
    expected = torch.autograd.grad(expected_loss, [hidden, *params], allow_unused=True)
    torch.testing.assert_close(out.loss, expected_loss)
    for name, a, b in zip(["hidden", "projection", "predecessor", "successor"], got, expected, strict=True):
        if b is None:  # stop_gradient: nothing reaches the hidden states
            assert a is None or torch.count_nonzero(a) == 0, name
        else:
            torch.testing.assert_close(a, b, msg=name)


def selector_inputs(*, dtype=torch.float32, blocks=7, bias=False, seed=0):
    """A selector of strong weights, a head, and a batch [R=2, N=blocks, B=5] of which about half the labels are
    among the candidates."""
    torch.manual_seed(seed)
    rows, block, width, vocab = 2, 5, 12, 40
    selector = CandidateSelector(width, vocab, rank=6, top_k=8)
    with torch.no_grad():
        for parameter in selector.parameters():
            parameter.normal_(std=0.5)
    head = torch.randn(vocab, width).to(dtype)
    hidden = torch.randn(rows, blocks, block, width).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (rows, blocks, block))
    best = (hidden.detach().float() @ head.float().T).argmax(-1)
    labels = torch.where(torch.rand(rows, blocks, block) < 0.5, best, labels)
    predecessors = torch.randint(0, vocab, (rows, blocks, block))
    valid = torch.rand(rows, blocks, block) < 0.8
    valid[..., 0] = False
    return dict(
        hidden=hidden,
        lm_head_weight=head,
        selector=selector,
        labels=labels,
        predecessors=predecessors,
        valid=valid,
        lm_head_bias=torch.randn(vocab).to(dtype) if bias else None,
    )


def selector_results(inputs, **options):
    """(loss, flat metrics, gradients of hidden, projection and both codebooks) of one `selector_loss` call."""
    selector, hidden = inputs["selector"], inputs["hidden"]
    hidden.grad = None
    selector.zero_grad(set_to_none=True)
    out = selector_loss(**inputs, gamma=None, **options)
    out.loss.backward()
    params = [selector.hidden_projection.weight, selector.predecessor_codebook, selector.successor_codebook]
    return [out.loss.detach(), out.metrics.to_tensor(), hidden.grad, *(p.grad for p in params)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selector_takes_the_base_losss_candidates_and_computes_what_it_computes_alone(dtype):
    """`dflash_loss(candidates_top_k=K)` ranks each drafted slot's logits (those of the selector's own pass: the same
    products), so the selector given them computes the same loss, metrics and gradients, without its LM head."""
    inputs = selector_inputs(dtype=dtype, bias=True)
    base = dflash_loss(
        inputs["hidden"],
        inputs["lm_head_weight"],
        inputs["labels"],
        inputs["valid"],
        gamma=None,
        chunk_blocks=3,
        lm_head_bias=inputs["lm_head_bias"],
        candidates_top_k=8,
    )
    # The logits of each chunk of 3 blocks (a bf16 GEMM's rounding depends on its shape), ranked.
    slots = inputs["hidden"].detach()[:, :, 1:].reshape(14, 4, 12)
    head, bias = inputs["lm_head_weight"], inputs["lm_head_bias"]
    logits = torch.cat([F.linear(slots[i : i + 3].reshape(-1, 12), head, bias) for i in range(0, 14, 3)])
    assert torch.equal(base.candidates.reshape(-1, 8), torch.topk(logits, 8, dim=-1).indices)  # [R, N, B-1, K]
    alone = selector_results(inputs, chunk_blocks=3)
    given = selector_results(inputs, chunk_blocks=3, candidates=base.candidates)
    for name, a, b in zip(["loss", "metrics", "hidden", "projection", "before", "after"], alone, given, strict=True):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match=r"candidates must be \[R, N, B-1, K\]"):
        selector_loss(**inputs, gamma=None, candidates=base.candidates[..., :4])


def test_the_base_loss_chunk_ranks_the_candidates_in_its_one_graph():
    """With `top_k` the base loss's chunk (compiled on CUDA: fullgraph, static shapes) still traces as one graph, the
    top-k an op of it; AOT autograd's eager backend gives the eager numbers."""
    inputs = selector_inputs()
    hidden = inputs["hidden"].detach()[:, :, 1:].reshape(-1, 4, 12)  # [C, S, H]
    labels, valid = inputs["labels"][:, :, 1:].reshape(-1, 4), inputs["valid"][:, :, 1:].reshape(-1, 4)
    args = (hidden, inputs["lm_head_weight"], None, labels, valid, None, None, torch.linspace(1.0, 0.5, 4), None)
    options = dict(weighting="dpace", dpace_alpha=0.5, label_source="data", need_grad=True, top_k=8)
    compiled = torch.compile(_loss_chunk, backend="aot_eager", fullgraph=True, dynamic=False)
    expected = _loss_chunk(*args, **options)
    assert expected[-1].shape == (14, 4, 8)
    for actual, wanted in zip(compiled(*args, **options), expected, strict=True):
        torch.testing.assert_close(actual, wanted, rtol=0, atol=0)


@pytest.mark.parametrize("given", [False, True])
def test_the_selector_chunk_traces_as_one_graph_and_whole_chunks_give_the_eager_numbers(monkeypatch, given):
    """On CUDA the per-chunk function runs compiled (fullgraph, static shapes) on blocks padded to whole chunks: here
    dynamo with the aot_eager backend, forced on, against the eager chunks of the same blocks."""
    from dflash_trainer.model.dflash2 import loss as loss_module

    inputs = selector_inputs(bias=True)
    candidates = None
    if given:
        logits = F.linear(inputs["hidden"].detach()[:, :, 1:], inputs["lm_head_weight"], inputs["lm_head_bias"])
        candidates = torch.topk(logits, 8, dim=-1).indices
    eager = selector_results(inputs, chunk_blocks=4, candidates=candidates)  # 14 blocks: 3 chunks and a part
    force_compiled_chunks(monkeypatch, loss_module, "_selector_chunk", "_Spec")
    padded = selector_results(inputs, chunk_blocks=4, candidates=candidates, compile=True)
    for name, a, b in zip(["loss", "metrics", "hidden", "projection", "before", "after"], eager, padded, strict=True):
        torch.testing.assert_close(a, b, msg=name)


def test_the_compiled_selector_chunk_is_one_graph_whether_the_blocks_fill_whole_chunks_or_not(monkeypatch):
    """Dynamo guards on requires_grad: a padded chunk (a copy made under forward's no-grad) and a whole one (a view of
    the input) must look alike to the compiled chunk, or it compiles twice (as the base loss's, test_loss.py)."""
    from torch._dynamo.utils import counters

    from dflash_trainer.model.dflash2 import loss as loss_module

    force_compiled_chunks(monkeypatch, loss_module, "_selector_chunk", "_Spec")
    torch._dynamo.reset()
    counters.clear()
    for blocks in (8, 7):  # 16 blocks: whole chunks of 4; 14: a padded last chunk
        selector_results(selector_inputs(blocks=blocks), chunk_blocks=4, compile=True)
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


def test_selector_prefix_metric_is_the_accepted_length_of_the_walk():
    """With the walk's own inputs, the teacher-forced leading run of correct choices is exactly how many of the
    walk's drafts match the labels (the verifier's tokens)."""
    torch.manual_seed(1)
    rows, blocks, block, width, vocab = 1, 40, 5, 12, 12
    selector = CandidateSelector(width, vocab, rank=6, top_k=4).double()
    with torch.no_grad():
        for parameter in selector.parameters():
            parameter.normal_(std=0.7)
    head = torch.randn(vocab, width, dtype=torch.float64)
    hidden = torch.randn(rows, blocks, block, width, dtype=torch.float64)
    anchors = torch.randint(0, vocab, (rows, blocks))
    flat_hidden = hidden[0, :, 1:]
    drafts = selector.walk(flat_hidden, flat_hidden @ head.T, anchors[0])  # [N, B-1]
    # Labels agree with the drafts for a random number of leading slots, then differ.
    agree = torch.randint(0, block, (blocks,))
    slot = torch.arange(block - 1)
    labels_tail = torch.where(slot < agree[:, None], drafts, (drafts + 1) % vocab)
    labels = torch.cat([anchors[0, :, None], labels_tail], dim=1)[None]
    predecessors = torch.cat([anchors[0, :, None], labels[0, :, :-1]], dim=1)[None]
    valid = torch.ones(rows, blocks, block, dtype=torch.bool)
    valid[..., 0] = False
    out = selector_loss(hidden, head, selector, labels, predecessors, valid, gamma=None)
    accepted = (labels_tail == drafts).long().cumprod(dim=1).sum(dim=1)
    assert torch.equal(accepted, agree.clamp(max=block - 1))
    assert out.metrics.prefix_sum.item() == accepted.sum().item()
    assert out.metrics.prefix_acceptance().item() == pytest.approx(1 + accepted.double().mean().item())


def test_selector_weight_schedule():
    at = [selector_weight_at(s, 100, weight=2.0, warmup_ratio=0.1, ramp_ratio=0.1) for s in range(100)]
    assert at[:10] == [0.0] * 10
    assert 0 < at[10] < at[15] < at[19] < 2.0
    assert at[20:] == [2.0] * 80
    assert selector_weight_at(0, 100, weight=1.0, warmup_ratio=0.0, ramp_ratio=0.0) == 1.0


# ----------------------------------------------------------------------------------------------------------
# Export and import


def trained_looking_drafter(config: DFlash2ModelConfig | None = None) -> DFlash2Drafter:
    torch.manual_seed(3)
    return randomise(DFlash2Drafter(config or dflash2_config(block_size=5)).eval(), everything=True)


def test_export_has_the_zlab_dflash2_layout(tmp_path):
    drafter = trained_looking_drafter()
    config = drafter.config
    export_drafter(drafter, tmp_path / "out")
    data = json.loads((tmp_path / "out" / "config.json").read_text())
    assert data["architectures"] == ["DFlash2DraftModel"]
    draft = data["dflash_config"]
    assert {key: draft[key] for key in DFLASH2_SIZES} == DFLASH2_SIZES
    assert draft["block_size"] == data["block_size"] == 5
    weights = load_file(str(tmp_path / "out" / "model.safetensors"))
    hidden, vocab, groups = config.hidden_size, config.vocab_size, config.hidden_size // config.conv_group_size
    for i in range(config.num_hidden_layers):
        for conv in ("attention_conv", "mlp_conv"):
            assert weights[f"layers.{i}.{conv}.base_kernel"].shape == (2, 2, hidden)
            assert weights[f"layers.{i}.{conv}.kernel_projection.weight"].shape == (2 * 2 * groups, hidden)
    assert weights["candidate_selector.hidden_projection.weight"].shape == (8, hidden)
    assert weights["candidate_selector.predecessor_codebook"].shape == (vocab, 8)
    assert weights["candidate_selector.successor_codebook"].shape == (vocab, 8)
    assert all(t.dtype == torch.bfloat16 for t in weights.values())


def test_export_runs_in_an_independent_implementation_of_the_engines_forward(tmp_path):
    """Our float32 export, read by tests/dflash2_reference.py, drafts the same block as our drafter."""
    drafter = trained_looking_drafter()
    config = drafter.config
    export_drafter(drafter, tmp_path / "out", dtype=torch.float32)
    reference = ReferenceDFlash2(tmp_path / "out")
    gen = torch.Generator().manual_seed(9)
    embed = torch.randn(config.vocab_size, config.hidden_size, generator=gen)
    # Logits about as large as the selector's transition scores, so the walk departs from the argmax.
    head = torch.randn(config.vocab_size, config.hidden_size, generator=gen) * 0.1
    departed = 0
    for context, last in ((6, 17), (11, 3), (3, 40)):
        features = torch.randn(context, config.num_features * config.hidden_size, generator=gen)
        block = torch.tensor([[last] + [config.mask_token_id] * (config.block_size - 1)])
        with torch.no_grad():
            hidden = drafter(
                features=features[None],
                block_embeds=embed[block],
                ctx_positions=torch.arange(context)[None],
                block_positions=torch.arange(context, context + config.block_size)[None],
                masks=None,
            )[0]
            drafts = drafter.draft_tokens(hidden[None, 1:], (hidden[1:] @ head.T)[None], torch.tensor([last]))
        expected_hidden, expected_drafts = reference.propose(features, last, embed, head)
        torch.testing.assert_close(hidden, expected_hidden, rtol=1e-4, atol=1e-4)
        assert drafts[0].tolist() == expected_drafts
        departed += int(drafts[0].tolist() != (hidden[1:] @ head.T).argmax(-1).tolist())
    assert departed > 0


def test_import_rebuilds_the_dflash2_drafter(tmp_path):
    drafter = trained_looking_drafter()
    export_drafter(drafter, tmp_path / "out", dtype=torch.float32)
    loaded = import_drafter(tmp_path / "out")
    assert isinstance(loaded, DFlash2Drafter)
    assert loaded.config == drafter.config
    for name, tensor in drafter.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, rtol=0, atol=0, msg=name)


def test_training_checkpoint_config_round_trips_the_algorithm(tmp_path):
    config = dflash2_config()
    save_drafter_config(config, tmp_path / "drafter_config.json")
    loaded = load_drafter_config(tmp_path / "drafter_config.json")
    assert isinstance(loaded, DFlash2ModelConfig) and loaded == config
    assert isinstance(build_drafter(loaded), DFlash2Drafter)
    assert type(build_drafter(tiny_drafter_config())) is DFlashDrafter


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda draft: draft.pop("selector_top_k"), "selector_top_k: missing"),
        (lambda draft: draft.update(output_multiplier=0.5), "output_multiplier"),
        (lambda draft: draft.update(final_logit_softcapping=20.0), "final_logit_softcapping"),
        (lambda draft: draft.update(conv_group_size=7), "conv_group_size 7 must divide"),
    ],
)
def test_import_refuses_dflash2_configs_it_cannot_run(tmp_path, change, message):
    export_drafter(trained_looking_drafter(), tmp_path / "out")
    path = tmp_path / "out" / "config.json"
    data = json.loads(path.read_text())
    change(data["dflash_config"])
    path.write_text(json.dumps(data))
    with pytest.raises(CheckpointFormatError, match=message):
        import_drafter(tmp_path / "out")


# ----------------------------------------------------------------------------------------------------------
# Recipe keys


def test_recipe_keys_select_and_size_dflash2():
    config = load_config(
        None,
        [
            "drafter.algorithm=dflash2",
            "drafter.block_size=8",
            "drafter.dflash2.selector_top_k=8",
            "loss.selector.gold_injection=true",
            "loss.selector.ramp_ratio=0.1",
        ],
    )
    assert config.drafter.algorithm == "dflash2"
    assert config.drafter.dflash2.selector_top_k == 8 and config.drafter.dflash2.conv_kernel_size == 2
    assert config.loss.selector.gold_injection and config.loss.selector.ramp_ratio == 0.1


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["drafter.algorithm=dflash3"], "drafter.algorithm"),
        (["drafter.dflash2.selector_top_k=0"], "drafter.dflash2.selector_top_k"),
        (["drafter.block_size=2", "drafter.dflash2.conv_kernel_size=3"], "drafter.dflash2.conv_kernel_size"),
        (["loss.selector.warmup_ratio=1.5"], "loss.selector.warmup_ratio"),
    ],
)
def test_bad_dflash2_keys_fail_at_load_naming_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, overrides)


def test_weight_decay_skips_the_convolution_kernels():
    """AdamW decays matrices only: DFlash2's [2, taps, H] base kernels start as the identity and stay undecayed."""
    from dflash_trainer.config import OptimConfig
    from dflash_trainer.train.optim import build_optimizer

    drafter = build_drafter(dflash2_config())
    optimizer = build_optimizer(drafter, OptimConfig(weight_decay=0.1))
    decayed = {id(p) for group in optimizer.param_groups if group["weight_decay"] > 0 for p in group["params"]}
    names = {id(p): name for name, p in drafter.named_parameters()}
    kernels = [name for name in names.values() if name.endswith("base_kernel")]
    assert kernels and not any(id(p) in decayed for name, p in drafter.named_parameters() if name in kernels)
    assert any(names[i].endswith("q_proj.weight") for i in decayed)
