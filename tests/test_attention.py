"""The DFlash mask against a brute-force reference and the element-wise oracle, and the flex and dense backends
against each other."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from dflash_trainer.model.anchors import sample_anchors
from dflash_trainer.model.attention import (
    TILE,
    MaskVariant,
    TileTables,
    attend,
    build_masks,
    context_ranges,
    dense_mask,
    dflash_mask_mod,
    mask_from_ranges,
    mask_tables,
    tile_tables,
)
from dflash_trainer.model.drafter import DFlashDrafter
from model_helpers import random_packed_batch, tiny_drafter_config


def reference_mask(anchors, keep, doc_ids, block_size, window, causal_in_block):
    """Explicit loops over (row, query, key): the rule of DESIGN §2 written out from positions. The query of block n
    at slot k sits at position a_n + k; a context key at its row index (positions run on within a document), a key
    of block m at slot j at a_m + j. A sliding layer keeps the keys less than W positions from the query."""
    rows, num_blocks = anchors.shape
    length = doc_ids.shape[1]
    q_len = num_blocks * block_size
    out = torch.zeros(rows, q_len, length + q_len, dtype=torch.bool)
    for r in range(rows):
        for q in range(q_len):
            n, slot = divmod(q, block_size)
            a = int(anchors[r, n])
            query_position = a + slot
            for kv in range(length + q_len):
                if kv < length:
                    key_position = kv
                    ok = bool(keep[r, n]) and kv < a and doc_ids[r, kv] == doc_ids[r, a]
                else:
                    m, kv_slot = divmod(kv - length, block_size)
                    key_position = int(anchors[r, m]) + kv_slot
                    ok = m == n and (not causal_in_block or kv_slot <= slot)
                if window is not None:
                    ok = ok and abs(query_position - key_position) < window
                out[r, q, kv] = ok
    return out


def oracle_mask_mod(*, anchors, anchor_keep, doc_ids, block_size, context_len, window=None, causal_in_block=False):
    """The rule element by element, as production evaluated it before the context ranges: document ids compared per
    key (no contiguity assumed), the anchor's keep flag and the window per element from the query's and the key's
    positions, block membership by division."""
    last_ctx = context_len - 1

    def mask_mod(b, h, q_idx, kv_idx):
        q_block = q_idx // block_size
        anchor = anchors[b, q_block]
        query_position = anchor + q_idx % block_size
        is_ctx = kv_idx < context_len
        ctx_pos = torch.clamp(kv_idx, max=last_ctx)
        same_doc = doc_ids[b, ctx_pos] == doc_ids[b, anchor]
        ctx_ok = is_ctx & (kv_idx < anchor) & same_doc & anchor_keep[b, q_block]
        block_kv = torch.clamp(kv_idx - context_len, min=0)
        in_block = ~is_ctx & (block_kv // block_size == q_block)
        if causal_in_block:
            in_block = in_block & (block_kv % block_size <= q_idx % block_size)
        if window is not None:
            key_position = torch.where(is_ctx, kv_idx, anchor + block_kv % block_size)
            near = (query_position - key_position).abs() < window
            ctx_ok, in_block = ctx_ok & near, in_block & near
        return ctx_ok | in_block

    return mask_mod


def random_mask_inputs(block_size: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    rows, length = 2, 3 * block_size + 7
    doc_ids = torch.full((rows, length), -1, dtype=torch.long)
    doc_ids[0, : length - 2] = 0
    doc_ids[0, length // 2 : length - 2] = 1  # two packed documents and two padding tokens
    doc_ids[1] = 0
    loss_mask = torch.rand(rows, length, generator=gen) > 0.3
    anchors, keep = sample_anchors(loss_mask=loss_mask, doc_ids=doc_ids, max_anchors=4, generator=gen)
    return anchors, keep, doc_ids


@pytest.mark.parametrize("block_size", [4, 8, 16])
@pytest.mark.parametrize("window", [None, 1, 5])
@pytest.mark.parametrize("causal_in_block", [False, True])
def test_mask_mod_matches_brute_force(block_size, window, causal_in_block):
    for seed in range(2):
        anchors, keep, doc_ids = random_mask_inputs(block_size, seed)
        assert (~keep).any() or keep.all()
        expected = reference_mask(anchors, keep, doc_ids, block_size, window, causal_in_block)
        q_len = anchors.shape[1] * block_size
        for make in (dflash_mask_mod, oracle_mask_mod):  # production, and the oracle the random layouts use
            mask_mod = make(
                anchors=anchors,
                anchor_keep=keep,
                doc_ids=doc_ids,
                block_size=block_size,
                context_len=doc_ids.shape[1],
                window=window,
                causal_in_block=causal_in_block,
            )
            dense = dense_mask(mask_mod, rows=2, q_len=q_len, kv_len=doc_ids.shape[1] + q_len, device="cpu")
            assert torch.equal(dense[:, 0], expected)


def random_layout(gen: torch.Generator, block_size: int, min_blocks: int = 1):
    """Rows of contiguous documents of varied lengths (ids 0, 1, ...; 1 to 60 tokens) and trailing padding (-1),
    with anchors at document starts and ends, position 0, in the padding and anywhere, about a quarter dropped,
    and `min_blocks` up to 2 query tiles of blocks."""

    def draw(low: int, high: int, size: tuple[int, ...] = ()) -> torch.Tensor:
        return torch.randint(low, high, size, generator=gen)

    rows, length = 3, int(draw(4, 200))
    doc_ids = torch.full((rows, length), -1, dtype=torch.long)
    for r in range(rows):
        end, start, doc = length - int(draw(0, min(length, 12))), 0, 0
        while start < end:
            size = int(draw(1, 61))
            doc_ids[r, start : min(start + size, end)] = doc
            start, doc = start + size, doc + 1
    num_blocks = int(draw(min_blocks, 2 * TILE // block_size + 2))
    anchors = torch.empty(rows, num_blocks, dtype=torch.long)
    for r in range(rows):
        starts = torch.nonzero(torch.diff(doc_ids[r], prepend=doc_ids[r, :1] - 1)).squeeze(1)
        pool = torch.cat([starts, starts - 1, torch.tensor([0, 0, length - 1]), draw(0, length, (8,))]).clamp(min=0)
        anchors[r] = pool[draw(0, len(pool), (num_blocks,))]
    keep = torch.rand(rows, num_blocks, generator=gen) > 0.25
    return anchors, keep, doc_ids


@pytest.mark.parametrize("block_size", [4, 12, 16])
@pytest.mark.parametrize("window", [None, 1, 5, 30, 1000])
@pytest.mark.parametrize("causal_in_block", [False, True])
def test_mask_from_ranges_equals_element_wise_oracle(block_size, window, causal_in_block):
    """Production's mask (context ranges) is the old element-wise rule on random layouts, and the tile tables
    computed from the same ranges are those of evaluating the (bidirectional) oracle on the whole grid."""
    from torch.nn.attention.flex_attention import create_block_mask

    gen = torch.Generator().manual_seed(block_size * 1000 + (window or 0) * 2 + causal_in_block)
    for i in range(4):
        # The last two span two query tiles (block 12: block 10 straddles the tile boundary at query 128).
        anchors, keep, doc_ids = random_layout(gen, block_size, min_blocks=1 if i < 2 else TILE // block_size + 1)
        rows, context_len = doc_ids.shape
        q_len = anchors.shape[1] * block_size
        grid = dict(rows=rows, q_len=q_len, kv_len=context_len + q_len)
        args = dict(anchors=anchors, anchor_keep=keep, doc_ids=doc_ids, block_size=block_size)
        oracle = oracle_mask_mod(**args, context_len=context_len, window=window, causal_in_block=causal_in_block)
        variant = MaskVariant(window, causal_in_block)
        tables = mask_tables(**args, variants=[variant])[variant]
        assert tables.lo.dtype == tables.hi.dtype == torch.int32 and (tables.lo <= tables.hi).all()
        expected = dense_mask(oracle, **grid, device="cpu")
        for given in (None, {variant: tables}):  # ranges computed by build_masks, and those of the data stage
            produced = build_masks(**args, variants=[variant], backend="sdpa", tables=given).for_variant(variant)
            assert torch.equal(produced, expected)
        # The tables ignore in-block causality (`mask_tables`): they are those of the bidirectional mask, which
        # contains the causal one. (With a causal block straddling two query tiles they list one tile that only
        # holds keys the causal mask hides: a partial tile, so still exact.)
        bidirectional = oracle_mask_mod(**args, context_len=context_len, window=window)
        reference = create_block_mask(bidirectional, B=rows, H=None, Q_LEN=q_len, KV_LEN=grid["kv_len"], device="cpu")
        assert_tables_equal(tables, reference, kv_tiles=-(-grid["kv_len"] // TILE))


@pytest.mark.parametrize("tile", [32, 64])
@pytest.mark.parametrize("block_size", [8, 12, 16])
def test_tile_tables_of_smaller_tiles_equal_create_block_mask(tile, block_size):
    """`drafter.flex_tile` 64 (and 32): the tables computed from the anchors are those `create_block_mask` finds
    with BLOCK_SIZE=tile, including blocks that straddle query tiles (block 12) and blocks of half a tile, and the
    BlockMask built from them has that tile size. (A tile of one block's keys would be full for a bidirectional
    block; the tables keep own-block tiles partial, as the causal variant sharing them needs.)"""
    from torch.nn.attention.flex_attention import create_block_mask

    from dflash_trainer.model.attention import block_mask_from_tables

    gen = torch.Generator().manual_seed(tile * 100 + block_size)
    for window in (None, 7):
        anchors, keep, doc_ids = random_layout(gen, block_size, min_blocks=2 * TILE // block_size)
        rows, context_len = doc_ids.shape
        q_len = anchors.shape[1] * block_size
        kv_len = context_len + q_len
        args = dict(anchors=anchors, anchor_keep=keep, doc_ids=doc_ids, block_size=block_size)
        tables = tile_tables(**args, window=window, tile=tile)
        oracle = oracle_mask_mod(**args, context_len=context_len, window=window)
        reference = create_block_mask(oracle, rows, None, q_len, kv_len, device="cpu", BLOCK_SIZE=tile)
        assert tables.kv_indices.shape == (rows, 1, -(-q_len // tile), -(-kv_len // tile))
        assert_tables_equal(tables, reference, kv_tiles=-(-kv_len // tile))
        mask = block_mask_from_tables(
            tables,
            mask_from_ranges(tables.lo, tables.hi, block_size=block_size, context_len=context_len),
            q_len=q_len,
            kv_len=kv_len,
        )
        assert (tile, tile) == mask.BLOCK_SIZE
        moved = tables.to(torch.device("cpu"))
        assert moved.tile == tile and torch.equal(moved.kv_indices, tables.kv_indices)


def test_mask_mod_stays_int32():
    """Traced on int32 indices (what flex passes), every intermediate of the mask_mod is int32 or bool."""
    from torch.fx.experimental.proxy_tensor import make_fx

    anchors, keep, doc_ids = random_mask_inputs(4, 0)
    for window, causal in ((None, False), (5, True), (2, False)):
        lo, hi = context_ranges(anchors=anchors, anchor_keep=keep, doc_ids=doc_ids, window=window)
        mask_mod = mask_from_ranges(
            lo, hi, block_size=4, context_len=doc_ids.shape[1], window=window, causal_in_block=causal
        )
        graph = make_fx(mask_mod)(*(torch.zeros(1, dtype=torch.int32) for _ in range(4))).graph
        dtypes = {node.meta["val"].dtype for node in graph.nodes if isinstance(node.meta.get("val"), torch.Tensor)}
        assert dtypes == {torch.int32, torch.bool}


@pytest.mark.parametrize("dynamic", [None, True])
def test_compiled_flex_captures_the_window_as_a_bare_symbol(dynamic):
    """Compiled, a window below the block size reaches flex as a SymInt (the layers compile with dynamic=True; a second
    window recompiles the shared flex with it dynamic). What the mask captures must be graph inputs: Inductor's flex
    lowering cannot take an expression computed from one (`-window` broke the H200 GPU test of window 3 after 24)."""
    from torch.nn.attention.flex_attention import flex_attention

    graphs = []

    def record(graph_module, example_inputs):
        graphs.append(graph_module.graph)
        return graph_module.forward

    torch._dynamo.reset()
    compiled = torch.compile(flex_attention, dynamic=dynamic, backend=record)
    config = tiny_drafter_config(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    try:
        # Rows of a new length each call: the context length turns symbolic too, as in training.
        for length, window, causal in ((300, 24, True), (260, 3, False), (340, 2, True)):
            batch = random_packed_batch(config, rows=2, length=length, max_anchors=16, seed=3)
            variant = MaskVariant(window=window, causal_in_block=causal)
            mask = build_masks(
                anchors=batch.anchors,
                anchor_keep=batch.anchor_keep,
                doc_ids=batch.doc_ids,
                block_size=4,
                variants=[variant],
                backend="flex",
                builder="anchors",
                tile=128,
            ).for_variant(variant)
            q_len, kv_len = mask.seq_lengths
            q = torch.randn(2, 4, q_len, 32)
            k, v = torch.randn(2, 2, kv_len, 32), torch.randn(2, 2, kv_len, 32)
            compiled(q, k, v, block_mask=mask, enable_gqa=True)
    finally:
        torch._dynamo.reset()  # the recording backend's cache entries must not outlive the test
    flex_calls = [
        node for graph in graphs for node in graph.nodes if node.target is torch.ops.higher_order.flex_attention
    ]
    assert len(flex_calls) >= 2  # the window-3 call recompiled: the case that matters was traced
    symbolic_captures = 0
    for call in flex_calls:
        for captured in call.args[-1]:  # the mask_mod's captured buffers
            assert isinstance(captured, torch.fx.Node)
            if not isinstance(captured.meta.get("example_value"), torch.Tensor):
                symbolic_captures += 1
                assert captured.op == "placeholder", f"flex captures {captured.format_node()}, computed in the graph"
    assert symbolic_captures >= 1  # the window did become a symbol: the check above checked something


def test_mask_never_leaves_a_query_without_keys():
    anchors, keep, doc_ids = random_mask_inputs(4, 0)
    keep[:, 0] = False
    masks = build_masks(
        anchors=anchors,
        anchor_keep=keep,
        doc_ids=doc_ids,
        block_size=4,
        variants=[MaskVariant()],
        backend="sdpa",
    )
    assert masks.for_variant(MaskVariant()).any(dim=-1).all()


def drafter_forward(drafter, batch, embed, masks, backend):
    """The drafter's output on a random packed batch, without gradients."""
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex warns that it is the unfused reference
        return drafter(
            features=batch.features,
            block_embeds=embed(batch.block_ids),
            ctx_positions=batch.position_ids,
            block_positions=batch.block_pos,
            masks=masks,
            backend=backend,
        )


@pytest.mark.parametrize("sliding", [None, (6, True), (3, False)], ids=["full", "window-6-causal", "window-3"])
@pytest.mark.parametrize("tile", [128, 16])
def test_flex_and_dense_drafter_forward_agree(sliding, tile):
    config = tiny_drafter_config(
        layer_types=["sliding_attention", "full_attention"] if sliding else None,
        sliding_window=sliding[0] if sliding else None,
        sliding_causal_in_block=sliding[1] if sliding else False,
    )
    torch.manual_seed(0)
    drafter = DFlashDrafter(config).eval()
    batch = random_packed_batch(config, length=48)
    embed = torch.nn.Embedding(config.vocab_size, config.hidden_size)
    outputs = {}
    for backend in ("sdpa", "flex"):
        masks = build_masks(
            anchors=batch.anchors,
            anchor_keep=batch.anchor_keep,
            doc_ids=batch.doc_ids,
            block_size=config.block_size,
            variants=drafter.mask_variants,
            backend=backend,
            tile=tile,
        )
        if backend == "flex":
            assert (tile, tile) == masks.for_variant(drafter.mask_variants[0]).BLOCK_SIZE
        outputs[backend] = drafter_forward(drafter, batch, embed, masks, backend)
    torch.testing.assert_close(outputs["flex"], outputs["sdpa"], rtol=1e-5, atol=1e-5)


def per_block_reference(drafter, batch, embed, *, row: int, block: int) -> torch.Tensor:
    """The drafter's final hidden states [B, H] for one block computed as a serving engine does at inference, in
    float64, with no mask machinery of ours: the context is the features of the anchor's document before the anchor
    (the committed prefix), the block sits at positions p = a .. a+B-1 after it, and each layer's attention is a
    dense softmax over [context; block] keys in which a query at position p sees a key at position c when (on
    sliding layers) |p - c| < W, and a block key only at or before its own slot when the layer is causal in-block."""
    config = drafter.config
    size = config.block_size
    anchor = int(batch.anchors[row, block])
    doc = batch.doc_ids[row]
    start = int((doc[:anchor] != doc[anchor]).nonzero().max()) + 1 if (doc[:anchor] != doc[anchor]).any() else 0
    end = anchor if bool(batch.anchor_keep[row, block]) else start  # a dropped block sees no context
    positions = batch.position_ids[row]
    ctx_pos = positions[start:end].double()  # [C]
    block_pos = batch.block_pos[row, block * size : (block + 1) * size].double()  # [B]
    key_pos = torch.cat([ctx_pos, block_pos])  # [C + B]
    inv_freq = drafter._inv_freq_fp32.double()

    def rope(x, pos):  # x [heads, S, D]
        angle = pos[:, None] * inv_freq[None]
        cos, sin = torch.cat([angle, angle], -1).cos(), torch.cat([angle, angle], -1).sin()
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    def heads(x, count):  # [S, count*D] -> [count, S, D]
        return x.view(x.shape[0], count, config.head_dim).transpose(0, 1)

    ctx = drafter.hidden_norm(drafter.fc(batch.features[row, start:end].double()))  # [C, H]
    x = embed(batch.block_ids[row, block * size : (block + 1) * size]).double()  # [B, H]
    slot = torch.arange(size)
    num_ctx = ctx.shape[0]
    for layer_index, layer in enumerate(drafter.layers):
        attn = layer.self_attn
        window = config.layer_window(layer_index)
        visible = torch.ones(size, num_ctx + size, dtype=torch.bool)
        if config.layer_causal_in_block(layer_index):
            visible[:, num_ctx:] = slot[None, :] <= slot[:, None]
        if window is not None:
            visible &= (block_pos[:, None] - key_pos[None, :]).abs() < window
        h = layer.input_layernorm(x)
        q = rope(attn.q_norm(heads(attn.q_proj(h), attn.heads)), block_pos)  # [Hq, B, D]
        kv_in = torch.cat([ctx, h])
        k = rope(attn.k_norm(heads(attn.k_proj(kv_in), attn.kv_heads)), key_pos)  # [Hkv, C + B, D]
        v = heads(attn.v_proj(kv_in), attn.kv_heads)
        groups = attn.heads // attn.kv_heads
        k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
        scores = (q @ k.transpose(-1, -2) * attn.scale).masked_fill(~visible, float("-inf"))
        out = (scores.softmax(-1) @ v).transpose(0, 1).reshape(size, -1)  # [B, Hq*D]
        x = x + attn.o_proj(out)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return drafter.norm(x)


@pytest.mark.parametrize(
    ("block_size", "window", "causal"), [(4, 6, False), (4, 6, True), (8, 3, False), (8, 3, True), (4, 1, False)]
)
def test_sliding_drafter_forward_equals_the_engines_rule_per_block(block_size, window, causal):
    """The training forward over a packed batch (SDPA, dense mask) with a sliding and a full layer gives, for every
    block, what an independent per-block forward at inference gives: the window per query position, counting the
    query itself (windows narrower than the block, and of one token, included)."""
    config = tiny_drafter_config(
        block_size=block_size,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=window,
        sliding_causal_in_block=causal,
    )
    torch.manual_seed(0)
    drafter = DFlashDrafter(config).double().eval()
    batch = random_packed_batch(config, length=48, max_anchors=3, seed=block_size + window)
    batch.features = batch.features.double()
    embed = torch.nn.Embedding(config.vocab_size, config.hidden_size).double()
    masks = build_masks(
        anchors=batch.anchors,
        anchor_keep=batch.anchor_keep,
        doc_ids=batch.doc_ids,
        block_size=block_size,
        variants=drafter.mask_variants,
        backend="sdpa",
    )
    trained = drafter_forward(drafter, batch, embed, masks, "sdpa")  # [R, N*B, H]
    rows, num_blocks = batch.anchors.shape
    with torch.no_grad():
        for row in range(rows):
            for block in range(num_blocks):
                expected = per_block_reference(drafter, batch, embed, row=row, block=block)
                got = trained[row, block * block_size : (block + 1) * block_size]
                torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)  # RoPE angles are float32
    assert batch.anchor_keep.any() and (batch.anchors > window + block_size).any()  # windows that cut the context


def test_attend_tells_flex_the_lengths_are_whole_tiles_only_when_they_are(monkeypatch):
    """IS_DIVISIBLE (no bounds checks in flex's kernels) goes with the caller's options exactly when the query and key
    lengths are multiples of 128; a wrong True would read and write past the tensors."""
    import torch.nn.attention.flex_attention as flex_module

    seen = []
    monkeypatch.setattr(
        flex_module,
        "flex_attention",
        lambda q, *args, kernel_options=None, **kw: seen.append(kernel_options) or torch.zeros_like(q),
    )
    mask = object()  # not read by the recording stand-in
    for q_len, kv_len in ((128, 384), (128, 200), (96, 256)):
        q, k = torch.zeros(1, 4, q_len, 8), torch.zeros(1, 2, kv_len, 8)
        attend(q, k, k, mask, "flex", 1.0, {"bwd_num_warps": 4})
    assert seen == [{"bwd_num_warps": 4, "IS_DIVISIBLE": True}, {"bwd_num_warps": 4}, {"bwd_num_warps": 4}]
    attend(torch.zeros(1, 4, 128, 8), torch.zeros(1, 2, 256, 8), torch.zeros(1, 2, 256, 8), mask, "flex", 1.0)
    assert seen[-1] == {"IS_DIVISIBLE": True}


def test_flex_kernel_options_reach_every_flex_call(monkeypatch):
    """`drafter.flex_kernel_options` (set_flex_kernel_options) is handed to flex_attention in every layer. (Eager
    flex on the CPU ignores kernel options, so the equal outputs only show that the plumbing changes nothing
    else; that the options are speed-only is flex's contract, timed and compared on the GPU by
    benchmarks/flex_kernel_bench.py.)"""
    import torch.nn.attention.flex_attention as flex_module

    config = tiny_drafter_config()
    torch.manual_seed(0)
    drafter = DFlashDrafter(config).eval()
    batch = random_packed_batch(config, length=48)
    embed = torch.nn.Embedding(config.vocab_size, config.hidden_size)
    masks = build_masks(
        anchors=batch.anchors,
        anchor_keep=batch.anchor_keep,
        doc_ids=batch.doc_ids,
        block_size=config.block_size,
        variants=drafter.mask_variants,
        backend="flex",
    )
    seen = []
    real_flex = flex_module.flex_attention

    def recording_flex(*args, kernel_options=None, **kwargs):
        seen.append(kernel_options)
        return real_flex(*args, kernel_options=kernel_options, **kwargs)

    monkeypatch.setattr(flex_module, "flex_attention", recording_flex)
    options = {"bwd_WRITE_DQ": False, "bwd_BLOCK_M1": 32, "bwd_num_warps": 4}
    outputs = []
    for given in ({}, options):
        drafter.set_flex_kernel_options(given)
        outputs.append(drafter_forward(drafter, batch, embed, masks, "flex"))
    assert seen == [None] * config.num_hidden_layers + [options] * config.num_hidden_layers
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=0)


def test_dense_attention_gradients_match_float64_reference():
    anchors, keep, doc_ids = random_mask_inputs(4, 1)
    q_len = anchors.shape[1] * 4
    kv_len = doc_ids.shape[1] + q_len
    mask = reference_mask(anchors, keep, doc_ids, 4, None, False).unsqueeze(1)  # [R, 1, Q, KV]
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, q_len, 8, generator=gen, requires_grad=True)
    k = torch.randn(2, 2, kv_len, 8, generator=gen, requires_grad=True)
    v = torch.randn(2, 2, kv_len, 8, generator=gen, requires_grad=True)
    grad_out = torch.randn(2, 4, q_len, 8, generator=gen)
    out = attend(q, k, v, mask, "sdpa", scale=8**-0.5)
    (out * grad_out).sum().backward()

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    k_rep, v_rep = k64.repeat_interleave(2, dim=1), v64.repeat_interleave(2, dim=1)
    scores = q64 @ k_rep.transpose(-1, -2) / math.sqrt(8)
    scores = scores.masked_fill(~mask, float("-inf"))
    ref = torch.softmax(scores, dim=-1) @ v_rep
    (ref * grad_out.double()).sum().backward()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    for ours, theirs in ((q, q64), (k, k64), (v, v64)):
        torch.testing.assert_close(ours.grad.double(), theirs.grad, rtol=1e-4, atol=1e-5)


def tiles_dense(num_blocks: torch.Tensor, indices: torch.Tensor, kv_tiles: int) -> torch.Tensor:
    """(count [R, 1, Qt], indices [R, 1, Qt, KVt]) -> bool [R, Qt, KVt] of the listed tiles."""
    rows, _, q_tiles = num_blocks.shape
    listed = torch.arange(indices.shape[-1]) < num_blocks[..., None]  # [R, 1, Qt, KVt]
    dense = torch.zeros(rows, 1, q_tiles, kv_tiles + 1, dtype=torch.bool)
    dense.scatter_(-1, torch.where(listed, indices.long(), kv_tiles), True)
    return dense[..., :kv_tiles].squeeze(1)


def assert_tables_equal(tables: TileTables, reference, *, kv_tiles: int) -> torch.Tensor:
    """Same partial and full tiles as the BlockMask `reference`; returns the full tiles [R, Qt, KVt]."""
    partial = tiles_dense(tables.kv_num_blocks, tables.kv_indices, kv_tiles)
    full = tiles_dense(tables.full_kv_num_blocks, tables.full_kv_indices, kv_tiles)
    assert torch.equal(partial, tiles_dense(reference.kv_num_blocks, reference.kv_indices, kv_tiles))
    assert torch.equal(full, tiles_dense(reference.full_kv_num_blocks, reference.full_kv_indices, kv_tiles))
    return full


def long_document_inputs(window_seed: int):
    """Long documents with many anchors far into them: many full context tiles, and padding at a row end."""
    rows, length = 2, 1024
    doc_ids = torch.zeros(rows, length, dtype=torch.long)
    doc_ids[1, 600:] = 1
    doc_ids[1, 1000:] = -1
    loss_mask = torch.zeros(rows, length, dtype=torch.bool)
    loss_mask[:, 300:] = True
    loss_mask[1, 1000:] = False
    gen = torch.Generator().manual_seed(window_seed)
    anchors, keep = sample_anchors(loss_mask=loss_mask, doc_ids=doc_ids, max_anchors=40, generator=gen, num_slots=48)
    return anchors, keep, doc_ids


@pytest.mark.parametrize(
    "case",
    [
        dict(block_size=16, length=300, anchors=16, window=None, causal=False),
        dict(block_size=16, length=700, anchors=40, window=50, causal=True),
        dict(block_size=4, length=256, anchors=32, window=None, causal=False),
        dict(block_size=10, length=300, anchors=20, window=None, causal=False),  # blocks straddle query tiles
        dict(block_size=16, length=1024, anchors=0, window=None, causal=False),
        dict(block_size=16, length=1024, anchors=0, window=200, causal=False),
        dict(block_size=16, length=300, anchors=16, window=6, causal=False),  # a window narrower than the block
    ],
    ids=["b16", "b16-window-causal", "b4", "b10", "long-docs", "long-docs-window", "b16-window-6"],
)
def test_tile_tables_from_anchors_equal_create_block_mask(case):
    """The tables built from the anchors alone are exactly those of evaluating the mask on the whole grid."""
    from torch.nn.attention.flex_attention import create_block_mask

    block_size, window = case["block_size"], case["window"]
    if case["anchors"]:
        config = tiny_drafter_config(block_size=block_size)
        batch = random_packed_batch(config, rows=3, length=case["length"], max_anchors=case["anchors"], seed=block_size)
        anchors, keep, doc_ids = batch.anchors, batch.anchor_keep, batch.doc_ids
    else:
        anchors, keep, doc_ids = long_document_inputs(window or 0)
    rows, num_blocks = anchors.shape
    context_len = doc_ids.shape[1]
    q_len = num_blocks * block_size
    mask_mod = dflash_mask_mod(
        anchors=anchors,
        anchor_keep=keep,
        doc_ids=doc_ids,
        block_size=block_size,
        context_len=context_len,
        window=window,
        causal_in_block=case["causal"],
    )
    reference = create_block_mask(mask_mod, B=rows, H=None, Q_LEN=q_len, KV_LEN=context_len + q_len, device="cpu")
    tables: TileTables = tile_tables(
        anchors=anchors, anchor_keep=keep, doc_ids=doc_ids, block_size=block_size, window=window
    )
    kv_tiles = -(-(context_len + q_len) // TILE)
    assert tables.kv_indices.shape == (rows, 1, -(-q_len // TILE), kv_tiles)
    full = assert_tables_equal(tables, reference, kv_tiles=kv_tiles)
    if case["anchors"] == 0 and window is None:
        assert full.sum() > 10  # the case exercises full tiles
