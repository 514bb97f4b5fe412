"""Packed rows through the frozen target: every path equals running each document alone.

CPU covers the dense SDPA backend, flex attention (its eager reference implementation), the varlen plumbing (the
flash kernel replaced by a per-segment SDPA reference: flattening, `cu_seqlens`, window convention), the
per-document path of hybrids, the mask rules themselves, and the layout. The real varlen and compiled flex kernels
are compared with dense SDPA in `test_packed_target_gpu.py`.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3Config, Qwen3ForCausalLM

from conftest import _TINY_DIMS, PAD_ID, TINY_VOCAB
from dflash_trainer.compiling import compile_dynamic
from dflash_trainer.targets import attention as doc_attention
from dflash_trainer.targets.attention import (
    PackedAttention,
    dense_document_mask,
    document_attention,
    document_block_mask,
    layer_windows,
    resolve_backend,
)
from dflash_trainer.targets.capture import FeatureCapture, packing_path
from dflash_trainer.targets.documents import DocumentLayout, positions_within_documents
from dflash_trainer.targets.per_document import document_groups

SLIDING_WINDOW = 3


@pytest.fixture
def tiny_sliding_qwen3() -> Qwen3ForCausalLM:
    """`tiny_qwen3` with every other layer a sliding-window layer of window 3."""
    config = Qwen3Config(
        num_hidden_layers=6,
        use_sliding_window=True,
        sliding_window=SLIDING_WINDOW,
        layer_types=["full_attention", "sliding_attention"] * 3,
        attn_implementation="sdpa",
        **_TINY_DIMS,
    )
    with torch.random.fork_rng():
        torch.manual_seed(3)
        return Qwen3ForCausalLM(config).eval()


def packed_batch(lengths: list[list[int]], width: int, seed: int = 0):
    """Rows of documents of the given lengths, padded to `width`: (input_ids, doc_ids, documents per row)."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.full((len(lengths), width), PAD_ID)
    doc_ids = torch.full((len(lengths), width), -1)
    documents = []
    for r, row in enumerate(lengths):
        start, row_docs = 0, []
        for d, n in enumerate(row):
            tokens = torch.randint(4, TINY_VOCAB, (n,), generator=generator)
            input_ids[r, start : start + n] = tokens
            doc_ids[r, start : start + n] = d
            row_docs.append((start, tokens))
            start += n
        documents.append(row_docs)
    return input_ids, doc_ids, documents


# Row 0: three documents and 2 padding tokens; row 1: one document filling the row; row 2: many short documents.
LENGTHS = [[5, 3, 4], [14], [1, 2, 1, 3, 2, 1]]
WIDTH = 14


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
    """What torch's varlen flash kernel computes, per segment with SDPA (flash convention: query i sees key j iff
    i - left <= j <= i + right, -1 meaning unbounded)."""
    assert torch.equal(cu_q, cu_k) and max_q == max_k == int((cu_q[1:] - cu_q[:-1]).max())
    left, right = window_size
    out = torch.empty_like(q)
    for start, end in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), strict=True):
        i = torch.arange(end - start)[:, None]
        j = torch.arange(end - start)[None, :]
        allowed = torch.ones(end - start, end - start, dtype=torch.bool)
        if left >= 0:
            allowed &= j >= i - left
        if right >= 0:
            allowed &= j <= i + right
        segment = [t[start:end].transpose(0, 1) for t in (q, k, v)]  # [H, L, D]
        result = F.scaled_dot_product_attention(*segment, attn_mask=allowed, scale=scale, enable_gqa=True)
        out[start:end] = result.transpose(0, 1)
    return out


def packed_capture(model, backend: str, monkeypatch, layer_ids, need_final_hidden=True) -> FeatureCapture:
    """A capture on the given backend; `varlen` on CPU runs `reference_varlen` in place of the flash kernel."""
    if backend != "varlen":
        return FeatureCapture(model, layer_ids, need_final_hidden, packed_attention=backend)
    monkeypatch.setattr("torch.nn.attention.varlen.varlen_attn", reference_varlen)
    capture = FeatureCapture(model, layer_ids, need_final_hidden, packed_attention="dense")
    capture.backend = "varlen"
    return capture


def each_document_alone(capture, documents) -> dict[tuple[int, int], object]:
    """(row, start) -> the capture's outputs for that document run alone, as a row of its own (no doc_ids)."""
    return {(r, start): capture.capture(tokens[None]) for r, row in enumerate(documents) for start, tokens in row}


def assert_equal_to_alone(packed, alone, tol=1e-4):
    """Features (and final hidden state) of every document equal its own run, and padding stays finite."""
    assert torch.isfinite(packed.features).all()
    for (r, start), outputs in alone.items():
        span = slice(start, start + outputs.features.shape[1])
        torch.testing.assert_close(packed.features[r, span], outputs.features[0], rtol=tol, atol=tol)
        if packed.final_hidden is not None:
            torch.testing.assert_close(packed.final_hidden[r, span], outputs.final_hidden[0], rtol=tol, atol=tol)


# ----------------------------------------------------------------------------------------------------------
# Every path equals each document alone (float32)


@pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning")
@pytest.mark.parametrize("model_name", ["tiny_qwen3", "tiny_llama", "tiny_sliding_qwen3"])
def test_packed_rows_equal_each_document_alone(model_name, request, monkeypatch):
    model = request.getfixturevalue(model_name)
    input_ids, doc_ids, documents = packed_batch(LENGTHS, WIDTH)
    alone = each_document_alone(FeatureCapture(model, [1, 4], need_final_hidden=True), documents)
    for backend in ("dense", "flex", "varlen"):
        capture = packed_capture(model, backend, monkeypatch, [1, 4])
        assert capture.packing_path == "attention"

        packed = capture.capture(input_ids, None, doc_ids)

        assert_equal_to_alone(packed, alone)
        # The model's own attention implementation is back for everything else (generation, evaluation).
        assert model.config._attn_implementation == ("eager" if model_name == "tiny_llama" else "sdpa")


def test_layout_built_ahead_and_explicit_positions_give_the_same_features(tiny_sliding_qwen3):
    capture = FeatureCapture(tiny_sliding_qwen3, [0, 3], need_final_hidden=True)
    input_ids, doc_ids, _ = packed_batch(LENGTHS, WIDTH, seed=1)
    reference = capture.capture(input_ids, None, doc_ids)
    ahead = capture.capture(
        input_ids, positions_within_documents(doc_ids), documents=DocumentLayout.from_doc_ids(doc_ids)
    )
    torch.testing.assert_close(ahead.features, reference.features, rtol=0, atol=0)
    torch.testing.assert_close(ahead.final_hidden, reference.final_hidden, rtol=0, atol=0)


def test_hybrid_packed_rows_equal_each_document_alone(tiny_qwen3_5):
    # Linear-attention layers: the recurrent state and the causal convolution restart at every document.
    capture = FeatureCapture(tiny_qwen3_5, [0, 1, 2], need_final_hidden=True)
    assert capture.packing_path == "per_document"
    input_ids, doc_ids, documents = packed_batch(LENGTHS, WIDTH, seed=2)

    packed = capture.capture(input_ids, None, doc_ids)

    assert_equal_to_alone(packed, each_document_alone(capture, documents))


def test_hybrid_packing_without_restart_would_mix_documents(tiny_qwen3_5):
    # Control for the test above: the recurrent layers carry state from one document into the next.
    first, second = torch.randint(4, TINY_VOCAB, (1, 5)), torch.randint(4, TINY_VOCAB, (1, 4))
    capture = FeatureCapture(tiny_qwen3_5, [0])  # layer 0 is a linear-attention layer
    mixed = capture.capture(torch.cat([first, second], dim=1)).features[0, 5:]
    alone = capture.capture(second).features[0]
    assert (mixed - alone).abs().max() > 1e-3


def test_hybrid_early_exit_stops_every_group(tiny_qwen3_5):
    calls = []
    handles = [
        layer.register_forward_pre_hook(lambda m, a, i=i: calls.append(i))
        for i, layer in enumerate(tiny_qwen3_5.model.layers)
    ]
    handles.append(tiny_qwen3_5.model.norm.register_forward_pre_hook(lambda m, a: calls.append("norm")))
    input_ids, doc_ids, _ = packed_batch(LENGTHS, WIDTH)
    FeatureCapture(tiny_qwen3_5, [1]).capture(input_ids, None, doc_ids)
    for handle in handles:
        handle.remove()
    groups = len(document_groups(DocumentLayout.from_doc_ids(doc_ids)))
    assert calls == [0, 1] * groups


def test_packing_paths():
    assert packing_path(Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=1, **_TINY_DIMS))) == "attention"


# ----------------------------------------------------------------------------------------------------------
# The mask rules


def _rule(segment_ids: torch.Tensor, window: int | None) -> torch.Tensor:
    """The contract spelled out element by element: [R, T, T] bool."""
    rows, length = segment_ids.shape
    allowed = torch.zeros(rows, length, length, dtype=torch.bool)
    for b in range(rows):
        for t in range(length):
            for s in range(length):
                in_window = window is None or t - s < window
                allowed[b, t, s] = bool(segment_ids[b, t] == segment_ids[b, s]) and s <= t and in_window
    return allowed


@pytest.mark.parametrize("window", [None, 3, 9])
def test_dense_mask_follows_the_rule(window):
    layout = DocumentLayout.from_doc_ids(packed_batch(LENGTHS, WIDTH)[1])
    mask = dense_document_mask(layout.segment_ids, window)
    assert mask.shape == (3, 1, WIDTH, WIDTH)
    assert torch.equal(mask[:, 0], _rule(layout.segment_ids, window))
    # Padding sees earlier padding only, and no query row is empty.
    assert not mask[0, 0, 12, :12].any() and mask[0, 0, 13, 12:14].all()
    assert mask.any(dim=-1).all()


def _tiles(counts: torch.Tensor, indices: torch.Tensor) -> set[tuple[int, int, int]]:
    return {
        (b, i, int(indices[b, 0, i, n]))
        for b in range(counts.shape[0])
        for i in range(counts.shape[2])
        for n in range(int(counts[b, 0, i]))
    }


@pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning")
@pytest.mark.parametrize("window", [None, 3, 9])
@pytest.mark.parametrize("block", [4, 8])
def test_block_mask_tiles_are_sound_and_tight(window, block):
    lengths = [[5, 3, 9, 1, 4], [22], [2] * 11]
    width = 23  # not a multiple of the block: the last tile is cut
    layout = DocumentLayout.from_doc_ids(packed_batch(lengths, width)[1])
    block_mask = document_block_mask(layout.segment_ids, window, block=block)
    rule = _rule(layout.segment_ids, window)  # [R, T, T]

    partial = _tiles(block_mask.kv_num_blocks, block_mask.kv_indices)
    full = _tiles(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
    assert not partial & full
    blocks = -(-width // block)
    for b in range(len(lengths)):
        for i in range(blocks):
            for j in range(blocks):
                tile = rule[b, i * block : (i + 1) * block, j * block : (j + 1) * block]
                cut = tile.shape != (block, block)
                if tile.any():  # sound: no tile holding an allowed pair is skipped
                    assert (b, i, j) in partial | full
                if (b, i, j) in full:  # full tiles are really full (and never the cut last tile)
                    assert tile.all() and not cut
                elif tile.all() and not cut and j < i:  # tight: wholly allowed tiles below the diagonal run unmasked
                    assert (b, i, j) in full
                if not tile.any() and window is None:  # tight: tiles without an allowed pair are skipped
                    assert (b, i, j) not in partial

    # The consumer: flex attention with this mask equals SDPA with the dense one.
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, width, 8, generator=generator)
    k, v = (torch.randn(3, 2, width, 8, generator=generator) for _ in range(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.nn.attention.flex_attention import flex_attention

        out = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=rule[:, None], enable_gqa=True)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------------------
# Layout, groups, windows, backend choice, guards


def test_layout_of_packed_rows():
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 2, -1, -1], [0, 0, 0, 0, 0, 0, 0, -1]])
    layout = DocumentLayout.from_doc_ids(doc_ids)
    assert layout.segment_ids.tolist() == [[0, 0, 0, 1, 1, 2, 3, 3], [4, 4, 4, 4, 4, 4, 4, 5]]
    assert layout.boundaries() == (0, 3, 5, 6, 8, 15, 16)
    assert layout.cu_seqlens().tolist() == [0, 3, 5, 6, 8, 15, 16]
    assert layout.cu_seqlens().dtype == torch.int32
    assert layout.spans() == [(0, 3), (3, 2), (5, 1), (6, 2), (8, 7), (15, 1)]
    assert layout.max_seqlen() == 7
    assert layout.positions().tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], [0, 1, 2, 3, 4, 5, 6, 0]]
    # Without host boundaries (a layout built on the device), they are recovered from the segment ids.
    assert DocumentLayout(layout.segment_ids).boundaries() == layout.boundaries()


def test_document_groups_cover_every_position_once_within_the_budget():
    doc_ids = packed_batch([[9, 1, 1, 1], [3, 3, 3, 3, 2], [14]], WIDTH)[1]
    layout = DocumentLayout.from_doc_ids(doc_ids)
    groups = document_groups(layout)
    covered = torch.cat([group.destination for group in groups])
    assert sorted(covered.tolist()) == list(range(3 * WIDTH))
    for group in groups:
        assert group.gather.numel() <= 3 * WIDTH
        # Every slot reads its own segment: the same segment id along a group row.
        segments = layout.segment_ids.flatten()[group.gather]
        assert (segments == segments[:, :1]).all()
    assert len(groups) < len(layout.spans())  # short segments share a forward


def test_layer_windows_follow_the_config(tiny_sliding_qwen3, tiny_qwen3):
    assert layer_windows(tiny_sliding_qwen3.config) == [None, 3] * 3
    assert layer_windows(tiny_qwen3.config) == [None] * 6


def test_backend_choice():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert resolve_backend("auto", cpu, torch.float32, 16) == "dense"
    assert resolve_backend("auto", cuda, torch.float32, 128) == "flex"  # the flash kernel has no fp32
    assert resolve_backend("auto", cuda, torch.bfloat16, 128) == (
        "varlen" if doc_attention._varlen_parameters() is not None else "flex"
    )
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_backend("varlen", cpu, torch.bfloat16, 128)
    with pytest.raises(ValueError, match="expected one of"):
        resolve_backend("fast", cpu, torch.float32, 16)


def test_sliding_layer_that_does_not_pass_its_window_is_refused(tiny_sliding_qwen3):
    tiny_sliding_qwen3.model.layers[1].self_attn.sliding_window = None
    input_ids, doc_ids, _ = packed_batch(LENGTHS, WIDTH)
    with pytest.raises(NotImplementedError, match="layer 1"):
        FeatureCapture(tiny_sliding_qwen3, [2]).capture(input_ids, None, doc_ids)
    assert tiny_sliding_qwen3.config._attn_implementation == "sdpa"  # restored after the failure too


def test_document_attention_only_runs_inside_a_packed_forward(tiny_qwen3):
    q = torch.randn(1, 4, 5, 16)
    k = v = torch.randn(1, 2, 5, 16)
    attention = tiny_qwen3.model.layers[0].self_attn
    with pytest.raises(RuntimeError, match="only valid inside a packed target forward"):
        document_attention(attention, q, k, v, None)
    packed = PackedAttention(DocumentLayout.from_doc_ids(torch.zeros(1, 5, dtype=torch.long)), "dense", [None] * 6)
    with pytest.raises(NotImplementedError, match="s_aux"):
        document_attention(attention, q, k, v, None, packed_attention=packed, s_aux=torch.zeros(4))


@pytest.mark.parametrize(("model_name", "layer_kinds"), [("tiny_sliding_qwen3", 2), ("tiny_llama", 1)])
def test_compiled_layers_capture_what_eager_layers_capture_without_recompiling(
    model_name, layer_kinds, request, monkeypatch
):
    """`compile_layers=True` (here dynamo with the aot_eager backend: the same tracing and guards as on a GPU,
    without Inductor; packed rows on the CPU's dense backend): the same features and final states as the eager
    layers, for plain and packed rows of two shapes; the six layers (two window kinds for the sliding Qwen3; Llama,
    SmolLM2's architecture, one) share compiled code, no graph break, no recompile per shape; the model is left as
    loaded."""
    from torch._dynamo.utils import counters

    from dflash_trainer.targets import capture as capture_module

    model = request.getfixturevalue(model_name)
    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr(
        capture_module, "compile_layer_forward", lambda fn, mode="default": compile_dynamic(fn, backend="aot_eager")
    )
    eager = FeatureCapture(model, [1, 4], True, packed_attention="dense")
    compiled_capture = FeatureCapture(model, [1, 4], True, packed_attention="dense", compile_layers=True)
    batches = [packed_batch(LENGTHS, WIDTH), packed_batch([[7, 9], [16], [4, 4, 4, 4]], 16, seed=1)]
    for input_ids, doc_ids, _ in batches:
        for rows in (doc_ids, None):  # packed rows, and rows of one document each
            want = eager.capture(input_ids, None, rows)
            got = compiled_capture.capture(input_ids, None, rows)
            torch.testing.assert_close(got.features, want.features, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got.final_hidden, want.final_hidden, rtol=1e-5, atol=1e-5)
    assert not counters["graph_break"], dict(counters["graph_break"])
    # One graph per layer kind (full, sliding) and row kind (packed, plain), whatever the shapes and layer count.
    assert counters["stats"]["unique_graphs"] <= 2 * layer_kinds, dict(counters["stats"])
    assert all("forward" not in vars(layer) for layer in model.model.layers)


def test_cuda_graph_layers_start_a_new_graph_step_at_every_capture(tiny_llama, monkeypatch):
    """`target.compile_mode=reduce-overhead`: the mode reaches the compiled layers, and every capture marks a new
    cudagraph step (the previous capture's layer outputs may be overwritten: the hooks copied what they keep);
    the default mode marks none. (CUDA graphs themselves need a GPU: `--ablation` in benchmarks/train_bench.sh.)"""
    from dflash_trainer.targets import capture as capture_module

    modes, steps = [], []
    monkeypatch.setattr(
        capture_module,
        "compile_layer_forward",
        lambda fn, mode="default": modes.append(mode) or compile_dynamic(fn, backend="aot_eager"),
    )
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: steps.append(1))
    input_ids, doc_ids, _ = packed_batch(LENGTHS, WIDTH)
    plain = FeatureCapture(tiny_llama, [1, 4], packed_attention="dense", compile_layers=True)
    plain.capture(input_ids, None, doc_ids)
    assert modes == ["default"] and steps == []
    graphs = FeatureCapture(
        tiny_llama, [1, 4], packed_attention="dense", compile_layers=True, compile_mode="reduce-overhead"
    )
    want = plain.capture(input_ids, None, doc_ids)
    for _ in range(2):
        got = graphs.capture(input_ids, None, doc_ids)
        torch.testing.assert_close(got.features, want.features)
    assert modes == ["default", "reduce-overhead"] and len(steps) == 2


def test_fixed_size_boundaries_only_add_empty_sequences():
    """CUDA-graph captures (`target.compile_mode=reduce-overhead`) see varlen boundaries of a bucketed length and the
    row length as the longest segment: the padding repeats the total (empty sequences), the real boundaries stay."""
    doc_ids = torch.tensor([[0, 0, 1, 1, 1, 2, -1, -1], [0, 0, 0, 0, 0, 0, 0, 1]])
    layout = DocumentLayout.from_doc_ids(doc_ids)
    real = layout.cu_seqlens()
    padded, longest = doc_attention.fixed_size_boundaries(real, doc_ids.shape)
    assert padded.numel() == doc_attention.BOUNDARY_BUCKET and padded.dtype == real.dtype
    assert torch.equal(padded[: real.numel()], real)
    assert torch.equal(padded[real.numel() :], torch.full((padded.numel() - real.numel(),), 16, dtype=real.dtype))
    assert longest == 8 >= layout.max_seqlen()
    # One bucket more only past a whole bucket.
    many = torch.arange(doc_attention.BOUNDARY_BUCKET + 1, dtype=torch.int32)
    padded, _ = doc_attention.fixed_size_boundaries(many, torch.Size([1, doc_attention.BOUNDARY_BUCKET]))
    assert padded.numel() == 2 * doc_attention.BOUNDARY_BUCKET


def test_cuda_graph_layers_refuse_the_hybrid_paths(tiny_qwen3, monkeypatch):
    """The hybrid paths hand host tensors to the layers, which no CUDA graph can hold: refused by name."""
    from dflash_trainer.targets import capture as capture_module

    monkeypatch.setattr(capture_module, "packing_path", lambda model: "per_document")
    with pytest.raises(ValueError, match="per_document path of this target cannot run as CUDA graphs"):
        FeatureCapture(tiny_qwen3, [1], compile_layers=True, compile_mode="reduce-overhead")
