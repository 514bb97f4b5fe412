"""The one-forward path of hybrid targets (`targets/varlen_hybrid.py`) on the CPU: its plumbing.

flash-linear-attention's kernels do not run on the CPU, and transformers' torch references ignore `cu_seqlens`. So
these tests put per-segment references of the two kernels in their place: the convolution and the chunked delta
rule each run transformers' own reference on every sequence the boundaries name. The path must then give every
document what running it alone gives, which holds only if the batch is flattened right, the boundaries reach both
kernels of every linear-attention layer, and the attention layers keep documents apart. The GPU test with fla's
kernels is `test_packed_target_gpu.py::test_gpu_hybrid_packed_rows_equal_each_document_alone`.
"""

from __future__ import annotations

import itertools
import sys
import types

import pytest
import torch
from torch.library import opcheck

from dflash_trainer.compiling import compile_dynamic
from dflash_trainer.decoding.hybrid_kernels import HybridKernels
from dflash_trainer.targets import capture as capture_module
from dflash_trainer.targets import varlen_hybrid
from dflash_trainer.targets.capture import FeatureCapture
from dflash_trainer.targets.documents import DocumentLayout
from dflash_trainer.targets.opaque_kernels import opaque_linear_attention_kernels
from test_packed_target import LENGTHS, WIDTH, assert_equal_to_alone, each_document_alone, packed_batch

MODELING = "transformers.models.qwen3_5.modeling_qwen3_5"


def _segments(cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor) -> list[tuple[int, int]]:
    assert cu_seqlens.dtype == torch.int64 and torch.equal(cu_seqlens.cpu(), cu_seqlens_cpu)
    return list(itertools.pairwise(cu_seqlens_cpu.tolist()))


@pytest.fixture
def reference_kernels(monkeypatch):
    """Per-segment references in place of fla's convolution and chunk rule (transformers' own references where no
    boundaries come, as for a document run alone); returns how often each ran on boundaries."""
    modeling = sys.modules[MODELING]
    conv_reference, chunk_reference = modeling.causal_conv1d_fn, modeling.torch_chunk_gated_delta_rule
    calls = {"conv": 0, "chunk": 0}

    def varlen_conv(x, weight, bias=None, activation=None, *, cu_seq_lens_q=None, cu_seqlens_cpu=None, **_):
        if cu_seq_lens_q is None:  # a row of its own (the documents run alone)
            return conv_reference(x, weight, bias, activation=activation)
        assert x.shape[0] == 1  # [1, C, N]: one row of sequences
        calls["conv"] += 1
        parts = [
            conv_reference(x[..., start:end], weight, bias, activation=activation)
            for start, end in _segments(cu_seq_lens_q, cu_seqlens_cpu)
        ]
        return torch.cat(parts, dim=-1)

    def varlen_chunk(query, key, value, g, beta, *, cu_seqlens=None, cu_seqlens_cpu=None, **kwargs):
        if cu_seqlens is None:
            return chunk_reference(query, key, value, g, beta, **kwargs)
        assert query.shape[0] == 1 and kwargs.pop("initial_state") is None
        calls["chunk"] += 1
        outputs = [
            chunk_reference(*(t[:, start:end] for t in (query, key, value, g, beta)), initial_state=None, **kwargs)[0]
            for start, end in _segments(cu_seqlens, cu_seqlens_cpu)
        ]
        return torch.cat(outputs, dim=1), None

    kernels = HybridKernels("per-segment reference", conv=varlen_conv, conv_update=modeling.causal_conv1d_update)
    monkeypatch.setattr(varlen_hybrid, "FLA", kernels)
    monkeypatch.setattr(modeling, "torch_chunk_gated_delta_rule", varlen_chunk)
    monkeypatch.setattr(capture_module, "varlen_hybrid_supported", lambda model, device: True)
    return calls


@pytest.mark.parametrize("need_final_hidden", [True, False])
def test_one_forward_over_the_flattened_batch_equals_each_document_alone(
    tiny_qwen3_5, reference_kernels, need_final_hidden
):
    input_ids, doc_ids, documents = packed_batch(LENGTHS, WIDTH, seed=3)
    alone = each_document_alone(FeatureCapture(tiny_qwen3_5, [0, 1, 2], need_final_hidden), documents)
    reference_kernels.update(conv=0, chunk=0)  # the documents alone ran without boundaries
    capture = FeatureCapture(tiny_qwen3_5, [0, 1, 2], need_final_hidden)
    assert capture.packing_path == "varlen_hybrid"

    packed = capture.capture(input_ids, None, doc_ids)

    assert_equal_to_alone(packed, alone)
    assert packed.features.shape == (*input_ids.shape, 3 * 64)
    # One forward: each of the two linear-attention layers ran each kernel once (layer 2 is the deepest tap unless
    # the final states are wanted: layers 0 and 2 both run either way).
    assert reference_kernels == {"conv": 2, "chunk": 2}


def test_rows_of_one_document_take_the_same_path_with_a_segment_per_row(tiny_qwen3_5, reference_kernels):
    input_ids = torch.randint(0, 200, (3, WIDTH), generator=torch.Generator().manual_seed(5))
    plain = FeatureCapture(tiny_qwen3_5, [0, 2], need_final_hidden=True)
    plain.packing_path = "per_document"  # the plain forward over whole rows, transformers' kernels
    expected = plain.capture(input_ids)
    reference_kernels.update(conv=0, chunk=0)
    capture = FeatureCapture(tiny_qwen3_5, [0, 2], need_final_hidden=True)

    rows = capture.capture(input_ids)

    # The tolerance of every packed-against-alone comparison (float32): the one row of segments and the batch of
    # rows reach the same sums in another order (1e-5 failed once on 2 cores: 1.03e-5 at one element of 5,376).
    torch.testing.assert_close(rows.features, expected.features, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(rows.final_hidden, expected.final_hidden, rtol=1e-4, atol=1e-4)
    assert reference_kernels == {"conv": 2, "chunk": 2}  # one forward over the rows as segments, not a plain one


def test_a_whole_rows_layout_has_a_segment_per_row():
    layout = DocumentLayout.whole_rows(3, 5, "cpu")
    assert layout.boundaries() == (0, 5, 10, 15)
    assert torch.equal(layout.segment_ids, torch.tensor([[0] * 5, [1] * 5, [2] * 5], dtype=torch.int32))
    assert torch.equal(layout.positions(), torch.arange(5).expand(3, 5))


def test_without_the_boundaries_the_flattened_rows_would_mix_documents(tiny_qwen3_5, reference_kernels):
    # Control: the same flattened forward with every row as one sequence carries state across documents.
    input_ids, doc_ids, documents = packed_batch(LENGTHS, WIDTH, seed=3)
    capture = FeatureCapture(tiny_qwen3_5, [2])
    layout = DocumentLayout.from_doc_ids(doc_ids)
    whole_rows = DocumentLayout(layout.segment_ids, DocumentLayout.whole_rows(3, WIDTH, "cpu").boundaries())
    mixed = capture._capture_varlen_hybrid(input_ids, layout.positions(), whole_rows, torch.empty(3, WIDTH, 64))
    alone = each_document_alone(FeatureCapture(tiny_qwen3_5, [2]), documents)
    r, start = 0, documents[0][1][0]  # row 0's second document
    expected = alone[(r, start)].features[0]
    assert (mixed.features[r, start : start + expected.shape[0]] - expected).abs().max() > 1e-3


def test_the_path_is_chosen_only_where_its_kernels_run(tiny_qwen3_5, tiny_qwen3):
    cpu = torch.device("cpu")
    assert not varlen_hybrid.varlen_hybrid_supported(tiny_qwen3_5, cpu)  # transformers' references: no boundaries
    assert not varlen_hybrid.varlen_hybrid_supported(tiny_qwen3, torch.device("cuda"))  # no linear attention
    assert FeatureCapture(tiny_qwen3_5, [0]).packing_path == "per_document"
    assert varlen_hybrid.modeling_modules(tiny_qwen3_5) == (sys.modules[MODELING],)


def test_the_reason_a_hybrid_is_off_the_path_names_what_is_missing(tiny_qwen3_5, tiny_qwen3, monkeypatch):
    """What the trainer logs for a hybrid target on a GPU off the one-forward path (slower, still correct)."""
    cuda = torch.device("cuda")  # only its type is read
    assert "no linear-attention" in varlen_hybrid.why_not_varlen_hybrid(tiny_qwen3, cuda)
    assert "CUDA only" in varlen_hybrid.why_not_varlen_hybrid(tiny_qwen3_5, torch.device("cpu"))
    monkeypatch.setattr(varlen_hybrid, "causal_conv1d_installed", lambda: False)
    monkeypatch.setattr(varlen_hybrid, "fla_available", lambda: False)
    assert "pip install flash-linear-attention" in varlen_hybrid.why_not_varlen_hybrid(tiny_qwen3_5, cuda)
    monkeypatch.setattr(varlen_hybrid, "fla_available", lambda: True)
    monkeypatch.setattr(varlen_hybrid, "bound_chunk_rule_takes_boundaries", lambda module: True)
    assert varlen_hybrid.why_not_varlen_hybrid(tiny_qwen3_5, cuda) is None
    assert varlen_hybrid.varlen_hybrid_supported(tiny_qwen3_5, cuda)


@pytest.mark.slow  # dynamo traces the hybrid's layers twice: ~11 s on 2 cores
def test_compiled_layers_on_the_one_forward_path_give_the_eager_features(tiny_qwen3_5, reference_kernels, monkeypatch):
    """`target.compile`: the kernels are opaque ops in the compiled layers (`opaque_kernels.py`) and must receive the
    sequences' boundaries there too; a second batch of other boundaries and length compiles nothing new."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr(
        capture_module, "compile_layer_forward", lambda fn, mode="default": compile_dynamic(fn, backend="aot_eager")
    )
    eager = FeatureCapture(tiny_qwen3_5, [0, 1, 2], need_final_hidden=True)
    compiled = FeatureCapture(tiny_qwen3_5, [0, 1, 2], need_final_hidden=True, compile_layers=True)
    graphs = []
    for lengths, width, seed in ((LENGTHS, WIDTH, 3), ([[7, 9], [3, 2, 6], [17]], 17, 4)):
        input_ids, doc_ids, documents = packed_batch(lengths, width, seed=seed)
        expected = eager.capture(input_ids, None, doc_ids)
        before = counters["stats"]["unique_graphs"]
        reference_kernels.update(conv=0, chunk=0)

        actual = compiled.capture(input_ids, None, doc_ids)

        graphs.append(counters["stats"]["unique_graphs"] - before)
        assert reference_kernels == {"conv": 2, "chunk": 2}  # through the ops, with the boundaries
        torch.testing.assert_close(actual.features, expected.features, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(actual.final_hidden, expected.final_hidden, rtol=1e-5, atol=1e-5)
        assert_equal_to_alone(actual, each_document_alone(eager, documents))
    assert graphs[0] > 0 and graphs[1] == 0, f"graphs compiled per batch: {graphs}"
    torch._dynamo.reset()


def test_the_opaque_kernel_ops_pass_torch_opcheck(reference_kernels):
    """The ops the compiled layers call (`opaque_kernels.py`), with and without the sequences' boundaries: schema,
    fakes (shapes, dtypes, strides, symbolic sizes) and AOT dispatch against the real kernels."""
    modeling = sys.modules[MODELING]
    gen = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, 20, 4, 16, generator=gen) for _ in range(3))  # [1, T, HV, K]
    g, beta = -torch.rand(1, 20, 4, generator=gen), torch.rand(1, 20, 4, generator=gen)  # [1, T, HV]
    x, weight = torch.randn(1, 24, 20, generator=gen), torch.randn(24, 4, generator=gen)  # [1, C, T], [C, W]
    bounds = torch.tensor([0, 7, 20])
    with opaque_linear_attention_kernels([modeling]):
        for boundaries in ((None, None), (bounds, bounds)):
            chunk_rule = (f"{MODELING}.torch_chunk_gated_delta_rule", query, key, value, g, beta, True, *boundaries)
            opcheck(torch.ops.dflash_target.chunk_gated_delta_rule.default, chunk_rule)
            convolution = (f"{MODELING}.causal_conv1d_fn", x, weight, None, "silu", *boundaries)
            opcheck(torch.ops.dflash_target.causal_conv1d.default, convolution)
    assert reference_kernels["chunk"] > 0  # the boundaries reached the bound rule


def test_the_path_needs_a_bound_chunk_rule_that_takes_the_boundaries(monkeypatch):
    """transformers' wrapper passes on only the keywords its bound implementation names: its PyTorch reference (what
    it binds when importing fla fails) has no `cu_seqlens` and would drop the boundaries without a word."""
    from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback

    assert not varlen_hybrid.bound_chunk_rule_takes_boundaries(sys.modules[MODELING])  # the CPU's reference

    def chunk_gated_delta_rule(query, key, value, g, beta, cu_seqlens=None, cu_seqlens_cpu=None, **kwargs):
        raise AssertionError("never called")

    package = types.ModuleType("varlen_kernels_stand_in")
    package.chunk_gated_delta_rule = chunk_gated_delta_rule
    monkeypatch.setitem(sys.modules, package.__name__, package)

    @use_kernel_func_from_hub_with_fallback("chunk_gated_delta_rule", package.__name__)
    def reference(query, key, value, g, beta, **kwargs):
        raise AssertionError("never called")

    modeling = types.ModuleType("modeling_stand_in")
    modeling.torch_chunk_gated_delta_rule = reference
    assert varlen_hybrid.bound_chunk_rule_takes_boundaries(modeling)
