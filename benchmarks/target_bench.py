"""Target forward over one packed row: dense-mask SDPA vs document-aware kernels vs plain causal SDPA, bf16 and FP8.

Setting (the paper setting of `recipes/bench-qwen3-8b.yaml`): a random Qwen3-8B-shaped target in bf16 (36 layers,
hidden 4096, 32 heads, 8 KV heads, head dim 128, intermediate 12288, vocab 151936), one packed 8192-token row of
documents 3072 + 3072 + 2048, taps [1, 9, 17, 25, 33] (the capture stops after layer 33: 34 layers run).

Rows of the table (each the median of timed repeats after warm-up, CUDA events around `FeatureCapture.capture`):
- `dense`: SDPA with a dense block-diagonal mask (what packed rows used before; no flash kernel);
- `flex`: compiled flex attention with the document BlockMask;
- `varlen`: torch's varlen flash attention over the documents (skipped where torch lacks it);
- `varlen, layout in step`: the same, the layout built inside the step from device doc_ids (one host sync);
- `causal (no docs)`: plain causal SDPA over the whole row, ignoring documents: the flash kernel on 3x the attention
  work; not a valid packed forward, shown as the reference a flash kernel reaches;
- `fp8 + <best>`: the decoder linears in FP8 (`target/fp8.py`) with the faster document kernel.
FLOPs counted per row: 2 * P * T for the 34 layers run (P: their parameters) plus causal attention per document,
4 * heads * head_dim * L(L+1)/2 per layer: the useful work, the same for every row of the table.
`err vs dense`: relative error (Frobenius) of the features against the dense row's (bf16 kernels differ in
rounding; FP8 by its quantisation).

Run on one GPU (about 1-2 minutes, most of it model init and compilation):
    PYTHONPATH=src python3 benchmarks/target_bench.py [--repeats 10] [--warmup 3]
Prints a table; writes target_bench.json into $OUT when set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import Qwen3ForCausalLM

from dflash_trainer.bench import random_target
from dflash_trainer.shapes import QWEN3_8B
from dflash_trainer.targets.attention import varlen_supported
from dflash_trainer.targets.capture import FeatureCapture
from dflash_trainer.targets.documents import DocumentLayout
from dflash_trainer.targets.fp8 import quantize_decoder_linears

DOCS = [3072, 3072, 2048]
TAPS = [1, 9, 17, 25, 33]


def build_target(device: torch.device) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    return random_target(device, torch.bfloat16, QWEN3_8B).model  # the model `dflash-trainer bench` uses


def packed_row(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, QWEN3_8B["vocab_size"], (1, sum(DOCS)), generator=generator)
    doc_ids = torch.cat([torch.full((n,), d) for d, n in enumerate(DOCS)])[None]
    return input_ids.to(device), doc_ids


def useful_flops(model: Qwen3ForCausalLM) -> float:
    config = model.config
    layers = model.model.layers[: max(TAPS) + 1]
    params = sum(p.numel() for layer in layers for p in layer.parameters())
    tokens = sum(DOCS)
    pairs = sum(n * (n + 1) // 2 for n in DOCS)
    attention = 4 * config.num_attention_heads * config.head_dim * pairs * len(layers)
    return 2 * params * tokens + attention


def time_capture(run, *, warmup: int, repeats: int) -> tuple[list[float], float, torch.Tensor]:
    """(per-repeat ms, first-call seconds, features of the last call)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    features = run()
    torch.cuda.synchronize()
    first_s = time.perf_counter() - start
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        begin.record()
        features = run()
        end.record()
        torch.cuda.synchronize()
        times.append(begin.elapsed_time(end))
    return times, first_s, features


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).norm() / expected.float().norm())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 1
    device = torch.device("cuda")
    started = time.perf_counter()
    model = build_target(device)
    input_ids, doc_ids_host = packed_row(device)
    doc_ids = doc_ids_host.to(device)
    layout = DocumentLayout.from_doc_ids(doc_ids_host, device)  # built ahead, as a prefetcher would
    flops = useful_flops(model)
    print(f"model built in {time.perf_counter() - started:.1f} s; useful work {flops / 1e12:.1f} TFLOP per row")

    def capture_with(backend: str):
        capture = FeatureCapture(model, TAPS, packed_attention=backend)
        return lambda: capture.capture(input_ids, documents=layout).features

    variants: list[tuple[str, object]] = [("dense", capture_with("dense")), ("flex", capture_with("flex"))]
    has_varlen = varlen_supported(torch.bfloat16, QWEN3_8B["head_dim"])
    if has_varlen:
        variants.append(("varlen", capture_with("varlen")))
        in_step = FeatureCapture(model, TAPS, packed_attention="varlen")
        variants.append(("varlen, layout in step", lambda: in_step.capture(input_ids, None, doc_ids).features))
    causal = FeatureCapture(model, TAPS)
    variants.append(("causal (no docs)", lambda: causal.capture(input_ids).features))

    results = []
    reference = None

    def measure(name: str, run) -> None:
        nonlocal reference
        torch.cuda.reset_peak_memory_stats()
        times, first_s, features = time_capture(run, warmup=args.warmup, repeats=args.repeats)
        if reference is None:
            reference = features.clone()
        median = statistics.median(times)
        results.append(
            dict(
                name=name,
                median_ms=median,
                min_ms=min(times),
                max_ms=max(times),
                tflops=flops / (median / 1e3) / 1e12,
                first_call_s=first_s,
                peak_gib=torch.cuda.max_memory_allocated() / 2**30,
                error_vs_dense=relative_error(features, reference),
            )
        )
        print(f"  {name}: {median:.1f} ms (first call {first_s:.1f} s)", flush=True)

    for name, run in variants:
        measure(name, run)

    document_rows = [r for r in results if r["name"] in ("flex", "varlen")]
    best = min(document_rows, key=lambda r: r["median_ms"])["name"]
    quantised = quantize_decoder_linears(model.model.layers)  # irreversible: last
    print(f"  fp8: {quantised} linears quantised")
    measure(f"fp8 + {best}", capture_with(best))

    print(f"\ntarget forward, one packed row of {sum(DOCS)} tokens ({'+'.join(map(str, DOCS))}), taps {TAPS}")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; median of {args.repeats} after {args.warmup}")
    header = (
        f"{'kernel':<24} {'median ms':>10} {'min-max ms':>16} {'TFLOP/s':>8} {'1st s':>6} {'peak GiB':>9} "
        f"{'err vs dense':>13}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        spread = f"{r['min_ms']:.1f}-{r['max_ms']:.1f}"
        print(
            f"{r['name']:<24} {r['median_ms']:>10.1f} {spread:>16} {r['tflops']:>8.0f} {r['first_call_s']:>6.1f} "
            f"{r['peak_gib']:>9.1f} {r['error_vs_dense']:>13.4f}"
        )
    print("(causal ignores the documents: its error is the cross-document leak, not rounding)")
    if not has_varlen:
        print(f"(varlen rows skipped: torch {torch.__version__} has no usable torch.nn.attention.varlen)")
    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"]) / "target_bench.json"
        payload = dict(
            device=torch.cuda.get_device_name(),
            torch=torch.__version__,
            docs=DOCS,
            taps=TAPS,
            useful_tflop=flops / 1e12,
            results=results,
        )
        out.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
