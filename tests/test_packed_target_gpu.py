"""GPU checks of the target's packed-row kernels and FP8 linears (run with `pytest -m gpu` on a CUDA machine).

- varlen flash and compiled flex attention give the features dense SDPA gives, in bf16, on a tiny and a mid-size
  random model (with a sliding-window variant), rows with padding and with many documents;
- both paths of a hybrid (one forward with fla's variable-length kernels; per-document rows) are as accurate, against
  float32, as running each document alone through the plain bf16 forward;
- `Fp8Linear` on the GPU kernel equals the float64 product of its quantised operands, and FP8 features stay within
  the error measured for the same model on CPU.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from dflash_trainer.decoding.hybrid_kernels import fla_available
from dflash_trainer.targets import capture as capture_module
from dflash_trainer.targets.attention import varlen_supported
from dflash_trainer.targets.capture import FeatureCapture
from dflash_trainer.targets.fp8 import Fp8Linear, quantize_decoder_linears, quantize_rowwise

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
DEVICE = torch.device("cuda")
VOCAB = 512
# (hidden, heads, kv heads, head dim, layers)
SIZES = {"tiny": (64, 4, 2, 16, 4), "mid": (1024, 16, 8, 64, 4)}


def random_qwen3(size: str, *, sliding: bool = False, seed: int = 0) -> Qwen3ForCausalLM:
    hidden, heads, kv_heads, head_dim, layers = SIZES[size]
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        num_hidden_layers=layers,
        use_sliding_window=sliding,
        sliding_window=100 if sliding else None,
        layer_types=["full_attention", "sliding_attention"] * (layers // 2) if sliding else None,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    with torch.device(DEVICE):
        return Qwen3ForCausalLM(config).to(torch.bfloat16).eval()


def packed_rows(lengths: list[list[int]], width: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, doc_ids) on the GPU: rows of documents of the given lengths, padded to `width`."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.zeros(len(lengths), width, dtype=torch.long)
    doc_ids = torch.full((len(lengths), width), -1)
    for r, row in enumerate(lengths):
        start = 0
        for d, n in enumerate(row):
            input_ids[r, start : start + n] = torch.randint(1, VOCAB, (n,), generator=generator)
            doc_ids[r, start : start + n] = d
            start += n
    return input_ids.to(DEVICE), doc_ids.to(DEVICE)


# A row with three documents and padding, a full row, a row of many short documents and padding; 1000 tokens is
# not a multiple of the 128-token tiles.
LENGTHS = [[300, 517, 100], [1000], [1, 7, 64, 3, 200, 129, 128, 5, 90, 33, 2, 250, 17]]
WIDTH = 1000


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


@pytest.mark.parametrize("backend", ["varlen", "flex"])
@pytest.mark.parametrize("size,sliding", [("tiny", False), ("mid", False), ("mid", True)])
def test_gpu_backends_give_the_dense_sdpa_features(backend, size, sliding):
    if backend == "varlen" and not varlen_supported(torch.bfloat16, SIZES[size][3]):
        pytest.skip(f"torch {torch.__version__} has no usable torch.nn.attention.varlen")
    model = random_qwen3(size, sliding=sliding)
    layer_ids = [0, 1, 3]
    input_ids, doc_ids = packed_rows(LENGTHS, WIDTH)
    exact = FeatureCapture(copy.deepcopy(model).float(), layer_ids, need_final_hidden=True, packed_attention="dense")
    dense = FeatureCapture(model, layer_ids, need_final_hidden=True, packed_attention="dense")
    fast = FeatureCapture(model, layer_ids, need_final_hidden=True, packed_attention=backend)

    reference = exact.capture(input_ids, None, doc_ids)
    expected = dense.capture(input_ids, None, doc_ids)
    actual = fast.capture(input_ids, None, doc_ids)

    def bound(bf16_dense: torch.Tensor, float32: torch.Tensor) -> float:
        # bf16 kernels with other reduction orders than dense SDPA's: as far from float32 as the dense bf16 path, within
        # 1.5x. At the mid size bf16 itself is ~1.15 % from float32 (the CPU's dense and flex paths alike; flex and
        # dense 1.03 % from each other), so a fixed 1 % bound between the two bf16 paths sat on the noise. A mask
        # that lets documents or windows leak is off by tens of percent.
        return max(1.5 * relative_error(bf16_dense, float32), 1e-2)

    assert torch.isfinite(actual.features).all()
    assert relative_error(actual.features, reference.features) < bound(expected.features, reference.features)
    assert relative_error(actual.final_hidden, reference.final_hidden) < bound(
        expected.final_hidden, reference.final_hidden
    )
    # Per document, against the float32 model on the document alone (real tokens only).
    start = 0
    for n in LENGTHS[2][:6]:
        document = input_ids[2:3, start : start + n]
        alone = exact.capture(document).features[0]
        # The bound from the dense bf16 path on the document alone too: a leak between packed documents shared by
        # both packed paths cannot widen it.
        span = slice(start, start + n)
        assert relative_error(actual.features[2, span], alone) < bound(dense.capture(document).features[0], alone)
        start += n


@pytest.mark.parametrize("backend", ["varlen", "flex"])
def test_gpu_compiled_target_layers_give_the_eager_features_without_recompiling(backend):
    """`target.compile`: the layers compiled by Inductor are as accurate as the eager layers, for packed rows of two
    shapes and plain rows, and a new shape compiles nothing more.

    Accuracy against the same model in float32 (dense masks): compiled and eager bf16 each round differently (fused
    norms keep float32 intermediates), so they differ from each other by about as much as each differs from float32:
    1.2 % between them on an H200, where a direct 1 % bound failed; on the CPU (dense masks, Inductor's C++ kernels)
    eager 1.14 % and compiled 0.98 % from float32, 1.22 % between them. The compiled error must stay within 1.5x the
    eager one.

    "Compiles nothing more" counts the graphs dynamo compiles during the compiled capture's calls only. The eager
    capture with the flex backend calls `flex.compiled_flex_attention` (`dynamic=None`), which compiles for the first
    shape and again, with symbolic sizes, at the second: counted globally, as before, that recompile of the eager
    path failed this test for flex alone (varlen compiles nothing eagerly). The compiled layers call flex attention
    inside their own graph, dynamic from the first call (on the CPU with dynamo's aot_eager backend, three row shapes
    of a sliding-window Qwen3 compile 2 graphs at the first shape, one per window, and none after)."""
    from torch._dynamo.utils import counters

    if backend == "varlen" and not varlen_supported(torch.bfloat16, SIZES["mid"][3]):
        pytest.skip(f"torch {torch.__version__} has no usable torch.nn.attention.varlen")
    torch._dynamo.reset()
    counters.clear()
    model = random_qwen3("mid", sliding=True)
    exact = FeatureCapture(copy.deepcopy(model).float(), [0, 1, 3], need_final_hidden=True, packed_attention="dense")
    eager = FeatureCapture(model, [0, 1, 3], need_final_hidden=True, packed_attention=backend)
    compiled = FeatureCapture(model, [0, 1, 3], need_final_hidden=True, packed_attention=backend, compile_layers=True)
    shapes = [(LENGTHS, WIDTH), ([[200, 311], [640], [5, 80, 300, 9]], 640)]
    compiled_graphs = []  # per shape: graphs dynamo compiled during the compiled capture's calls
    for lengths, width in shapes:
        input_ids, doc_ids = packed_rows(lengths, width)
        new_graphs = 0
        for rows in (doc_ids, None):
            ref, want = exact.capture(input_ids, None, rows), eager.capture(input_ids, None, rows)
            before = counters["stats"]["unique_graphs"]
            got = compiled.capture(input_ids, None, rows)
            new_graphs += counters["stats"]["unique_graphs"] - before
            for field in ("features", "final_hidden"):
                eager_error = relative_error(getattr(want, field), getattr(ref, field))
                compiled_error = relative_error(getattr(got, field), getattr(ref, field))
                where = f"{field}, width {width}, {'packed' if rows is not None else 'plain'} rows"
                assert eager_error < 2e-2, f"{where}: eager error {eager_error:.4f} against float32"
                assert compiled_error < 1.5 * eager_error, (
                    f"{where}: compiled error {compiled_error:.4f} against float32, eager {eager_error:.4f}"
                )
        compiled_graphs.append(new_graphs)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert compiled_graphs[0] > 0 and compiled_graphs[1] == 0, (
        f"graphs compiled by the compiled layers per shape: {compiled_graphs} (the second shape must reuse the "
        f"first's); all graphs {counters['stats']['unique_graphs']}"
    )


def test_gpu_cuda_graph_target_layers_replay_what_the_compiled_layers_compute():
    """`target.compile_mode=reduce-overhead`: the compiled layers replayed as CUDA graphs give the features and final
    states the same compiled layers give launched one by one (the same Inductor kernels, so within bf16 rounding),
    over batches of one shape whose documents differ (the boundaries padded to one size: `fixed_size_boundaries`) and
    whose tokens differ, then a second shape; every capture's outputs are kept to the end and compared then, so a
    replay that overwrote an earlier capture's outputs would fail. Padding the boundaries with empty sequences and
    taking the row length as the longest segment changes nothing in the varlen kernel's result."""
    if not varlen_supported(torch.bfloat16, SIZES["mid"][3]):
        pytest.skip(f"torch {torch.__version__} has no usable torch.nn.attention.varlen")
    torch._dynamo.reset()
    model = random_qwen3("mid", sliding=True)
    launched = FeatureCapture(model, [0, 1, 3], need_final_hidden=True, packed_attention="varlen", compile_layers=True)
    graphs = FeatureCapture(
        model,
        [0, 1, 3],
        need_final_hidden=True,
        packed_attention="varlen",
        compile_layers=True,
        compile_mode="reduce-overhead",
    )
    batches = [
        packed_rows(LENGTHS, WIDTH, seed=0),
        packed_rows([[500, 500], [1000], [3, 300, 600, 97]], WIDTH, seed=1),
        packed_rows([[999], [10, 990], [250, 250, 250, 250]], WIDTH, seed=2),
        packed_rows(LENGTHS, WIDTH, seed=3),
        packed_rows([[200, 311], [640], [5, 80, 300, 9]], 640, seed=4),
        packed_rows([[640], [320, 320], [600, 40]], 640, seed=5),
    ]
    kept = [(graphs.capture(input_ids, None, doc_ids), input_ids, doc_ids) for input_ids, doc_ids in batches]
    for index, (got, input_ids, doc_ids) in enumerate(kept):
        want = launched.capture(input_ids, None, doc_ids)
        for field in ("features", "final_hidden"):
            error = relative_error(getattr(got, field), getattr(want, field))
            assert error < 1e-2, f"{field}, batch {index}: {error:.4f} from the launched layers"


@pytest.mark.parametrize("path", ["varlen_hybrid", "per_document"])
def test_gpu_hybrid_packed_rows_are_as_accurate_as_each_document_alone(path, monkeypatch):
    """Both paths of a hybrid on fla's kernels: one forward with the sequences' boundaries (where fla runs), and the
    per-document rows, each as accurate as running every document alone through the plain bf16 forward.

    The reference is the same model in float32, each document alone. bf16 against bf16 is no reference: the
    one-forward path runs fla's variable-length kernels and the plain forward its fixed-length ones, which round
    differently, so the two differ from each other by about as much as each differs from float32 (1.08 % between them
    on an H200, where a direct 1 % bound failed). The packed capture's error must stay within 1.5x the plain forward's,
    over all documents together, so a wrong boundary (a recurrent state that crosses documents) fails by far: it puts
    the error near 100 % on the documents that follow it."""
    if path == "per_document":
        monkeypatch.setattr(capture_module, "varlen_hybrid_supported", lambda model, device: False)
    elif not fla_available():
        pytest.skip("the one-forward path needs flash-linear-attention")
    config = Qwen3_5TextConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention"] * 2,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = Qwen3_5ForCausalLM(config).to(torch.bfloat16).eval()
    capture = FeatureCapture(model, [0, 2, 3], need_final_hidden=True)
    assert capture.packing_path == path
    lengths = [[70, 130, 50], [3, 200, 17, 9]]
    input_ids, doc_ids = packed_rows(lengths, 256)

    # Each document alone through the plain forward (a row of one document would take the one-forward path too),
    # in bf16 and in float32.
    plain = FeatureCapture(model, [0, 2, 3], need_final_hidden=True)
    plain.packing_path = "per_document"
    exact = FeatureCapture(copy.deepcopy(model).float(), [0, 2, 3], need_final_hidden=True)
    exact.packing_path = "per_document"

    def per_document(fn) -> tuple[torch.Tensor, torch.Tensor]:
        """`fn(row, start, n)` -> (features [n, K*H], final hidden [n, H]) for every document, concatenated."""
        parts = [fn(r, start, n) for r, row in enumerate(lengths) for start, n in zip(offsets(row), row, strict=True)]
        return torch.cat([f for f, _ in parts]), torch.cat([h for _, h in parts])

    def alone(capture: FeatureCapture):
        def run(r: int, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
            out = capture.capture(input_ids[r : r + 1, start : start + n])
            return out.features[0], out.final_hidden[0]

        return run

    packed = capture.capture(input_ids, None, doc_ids)
    got = per_document(
        lambda r, start, n: (packed.features[r, start : start + n], packed.final_hidden[r, start : start + n])
    )
    bf16_alone, want = per_document(alone(plain)), per_document(alone(exact))
    for name, actual, yardstick, reference in zip(["features", "final hidden"], got, bf16_alone, want, strict=True):
        error, plain_error = relative_error(actual, reference), relative_error(yardstick, reference)
        assert error <= 1.5 * plain_error, f"{name}: {error:.4f} from float32, the plain bf16 forward {plain_error:.4f}"
    # Rows without a document layout (one document each): a segment per row on the one-forward path.
    whole_rows, rows_exact, rows_plain = capture.capture(input_ids), exact.capture(input_ids), plain.capture(input_ids)
    for field in ("features", "final_hidden"):
        error = relative_error(getattr(whole_rows, field), getattr(rows_exact, field))
        assert error <= 1.5 * relative_error(getattr(rows_plain, field), getattr(rows_exact, field)), field


def offsets(lengths: list[int]) -> list[int]:
    """Where each document starts in its packed row."""
    return [sum(lengths[:i]) for i in range(len(lengths))]


def test_gpu_fp8_linear_is_the_product_of_the_quantised_operands():
    torch.manual_seed(0)
    linear = torch.nn.Linear(4096, 1024, device=DEVICE, dtype=torch.bfloat16).requires_grad_(False)
    x = torch.randn(3, 700, 4096, device=DEVICE, dtype=torch.bfloat16)
    fp8 = Fp8Linear(linear)

    out = fp8(x)  # compiled activation quantiser, the CUDA scaled matmul

    x_q, x_scale = quantize_rowwise(x.reshape(-1, 4096))  # eager quantiser
    reference = (x_q.double() * x_scale.double()) @ fp8.dequantized_weight().double().T + linear.bias.double()
    torch.testing.assert_close(
        out.reshape(-1, 1024).double(), reference, rtol=2**-7, atol=1e-3 * float(reference.abs().max())
    )
    exact = x.reshape(-1, 4096).double() @ linear.weight.double().T + linear.bias.double()
    assert 0.01 < relative_error(out.reshape(-1, 1024), exact) < 0.05  # ~3.6% expected (fp8.py)


def test_gpu_fp8_features_stay_close_to_bf16():
    model = random_qwen3("mid")
    reference = copy.deepcopy(model)
    assert quantize_decoder_linears(model.model.layers) == 7 * 4
    input_ids, doc_ids = packed_rows(LENGTHS, WIDTH)
    expected = FeatureCapture(reference, [0, 3]).capture(input_ids, None, doc_ids).features
    actual = FeatureCapture(model, [0, 3]).capture(input_ids, None, doc_ids).features
    # Same model on CPU (bf16 vs FP8): 11% after layer 0, 16% after layer 3 (bf16 vs float32: 1.6-2%).
    assert 0.03 < relative_error(actual, expected) < 0.25
