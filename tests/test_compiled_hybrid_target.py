"""Compiled decoder layers of a hybrid target (`target.compile` on Gated DeltaNet layers, `targets/opaque_kernels.py`).

Dynamo with the aot_eager backend (the same tracing and guards as on a GPU, without Inductor) on a tiny Qwen3.5
hybrid with Qwen3.6-27B's layer pattern (three linear-attention layers, then a full-attention one). The delta rule
is either transformers' PyTorch reference (what the CPU binds: a loop over 64-token chunks) or that reference behind
`torch.compiler.disable`, as fla-core binds its Triton kernels on the GPU. Either way: the compiled layers give the
eager features, in one graph per layer type whatever the row count, length and chunk count, with no graph break,
and the modeling module is left as loaded. The GPU test (`-m gpu`) does the same with Inductor, bf16 and FP8
linears, fla's kernels when fla-core is importable.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig
from transformers.models.qwen3_5 import modeling_qwen3_5 as modeling

from conftest import _TINY_DIMS
from dflash_trainer.compiling import compile_dynamic
from dflash_trainer.targets import capture as capture_module
from dflash_trainer.targets.capture import FeatureCapture
from test_packed_target import packed_batch

LAYER_TYPES = (["linear_attention"] * 3 + ["full_attention"]) * 2


@pytest.fixture
def tiny_hybrid() -> Qwen3_5ForCausalLM:
    config = Qwen3_5TextConfig(
        num_hidden_layers=len(LAYER_TYPES),
        layer_types=LAYER_TYPES,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        attn_implementation="sdpa",
        **_TINY_DIMS,
    )
    with torch.random.fork_rng():
        torch.manual_seed(5)
        return Qwen3_5ForCausalLM(config).eval()


@pytest.mark.parametrize(
    "delta_rule,packed",
    [
        pytest.param("compiler_disabled", False, marks=pytest.mark.slow),  # ~11 s on 2 cores: two layer graphs
        pytest.param("reference", True, marks=pytest.mark.slow),  # ~15 s: a third graph for packed rows
    ],
)
def test_compiled_hybrid_layers_give_the_eager_features_in_one_graph_per_layer_type(
    tiny_hybrid, delta_rule, packed, monkeypatch
):
    """Compiled layers equal eager ones, and compile nothing past the first shape (for packed rows, once more)."""
    from torch._dynamo.utils import counters

    bound = {name: getattr(modeling, name) for name in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn")}
    if delta_rule == "compiler_disabled":
        monkeypatch.setattr(
            modeling, "torch_chunk_gated_delta_rule", torch.compiler.disable(bound["torch_chunk_gated_delta_rule"])
        )
        bound["torch_chunk_gated_delta_rule"] = modeling.torch_chunk_gated_delta_rule
    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr(
        capture_module, "compile_layer_forward", lambda fn, mode="default": compile_dynamic(fn, backend="aot_eager")
    )
    eager = FeatureCapture(tiny_hybrid, [1, 5], True)
    compiled = FeatureCapture(tiny_hybrid, [1, 5], True, compile_layers=True)
    generator = torch.Generator().manual_seed(0)
    # Plain rows of 2 and 3 chunks of 64; packed rows, run as per-document groups [2, 50] and [2, 30] (one chunk
    # each), then [2, 100] and [4, 40].
    batches = [
        (torch.randint(4, 256, (2, 70), generator=generator), None),
        (torch.randint(4, 256, (3, 150), generator=generator), None),
    ]
    if packed:
        batches += [
            packed_batch([[40, 30], [50, 20]], 70)[:2],
            packed_batch([[60, 40, 20], [100, 10]], 120, seed=1)[:2],
        ]

    new_graphs = []
    for input_ids, doc_ids in batches:
        want = eager.capture(input_ids, None, doc_ids)
        before = counters["stats"]["unique_graphs"]
        got = compiled.capture(input_ids, None, doc_ids)
        new_graphs.append(counters["stats"]["unique_graphs"] - before)
        torch.testing.assert_close(got.features, want.features, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.final_hidden, want.final_hidden, rtol=1e-5, atol=1e-5)

    assert not counters["graph_break"], dict(counters["graph_break"])
    # One graph per layer type (linear, full attention) at the first shape, none for later lengths or chunk counts;
    # the full-attention layers compile once more for packed rows, where they get a causal mask (explicit positions)
    # instead of none.
    assert new_graphs == [2, 0, 1, 0][: len(batches)], new_graphs
    assert all(getattr(modeling, name) is function for name, function in bound.items())
    assert all("forward" not in vars(layer) for layer in tiny_hybrid.model.layers)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_compiled_hybrid_layers_are_as_accurate_as_eager_without_recompiling(fp8):
    """`target.compile` on a hybrid with Inductor, in bf16 (and with FP8 linears): as close to the float32 model as
    the eager layers (within 1.5x their error, as for dense targets in `test_packed_target_gpu.py`), no graph break,
    and nothing compiled after the first shape of each row kind. With fla-core importable the delta rule is its
    Triton kernel (`torch.compiler.disable`d), else transformers' reference: opaque either way."""
    from torch._dynamo.utils import counters

    from dflash_trainer.targets.fp8 import quantize_decoder_linears

    config = Qwen3_5TextConfig(
        vocab_size=512,
        hidden_size=512,
        intermediate_size=1024,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,
        num_hidden_layers=len(LAYER_TYPES),
        layer_types=LAYER_TYPES,
        linear_key_head_dim=128,  # Qwen3.6-27B's head dims and its 1:3 key to value heads
        linear_value_head_dim=128,
        linear_num_key_heads=2,
        linear_num_value_heads=6,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3_5ForCausalLM(config).to(torch.bfloat16).eval()
    exact = FeatureCapture(copy.deepcopy(model).float(), [1, 5], True)
    if fp8:
        quantize_decoder_linears(model.model.layers)
    torch._dynamo.reset()
    counters.clear()
    eager = FeatureCapture(model, [1, 5], True)
    compiled = FeatureCapture(model, [1, 5], True, compile_layers=True)
    generator = torch.Generator().manual_seed(0)
    plain = [torch.randint(4, 512, shape, generator=generator).cuda() for shape in ((2, 1000), (3, 1500))]
    packed = [packed_batch(lengths, width, seed=seed)[:2] for seed, (lengths, width) in enumerate(PACKED)]
    batches = [(ids, None) for ids in plain] + [(ids.cuda(), doc_ids.cuda()) for ids, doc_ids in packed]

    new_graphs = []
    for input_ids, doc_ids in batches:
        ref, want = exact.capture(input_ids, None, doc_ids), eager.capture(input_ids, None, doc_ids)
        before = counters["stats"]["unique_graphs"]
        got = compiled.capture(input_ids, None, doc_ids)
        new_graphs.append(counters["stats"]["unique_graphs"] - before)
        for field in ("features", "final_hidden"):
            eager_error = relative_error(getattr(want, field), getattr(ref, field))
            compiled_error = relative_error(getattr(got, field), getattr(ref, field))
            where = f"{field}, rows {tuple(input_ids.shape)}, {'packed' if doc_ids is not None else 'plain'}"
            assert compiled_error < 1.5 * eager_error + 1e-3, (
                f"{where}: compiled {compiled_error:.4f}, eager {eager_error:.4f}"
            )

    assert not counters["graph_break"], dict(counters["graph_break"])
    assert new_graphs[0] > 0 and new_graphs[1] == 0 and new_graphs[3] == 0, new_graphs


# Packed rows for the GPU test: with fla one row of sequences each ([1, 2000], then [1, 2200]), without it per
# document (groups [2, 1000] + [3, 300], then [2, 800] + [3, 300]).
PACKED = [([[300, 517, 100], [1000]], 1000), ([[800, 300], [700, 300]], 1100)]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm())
