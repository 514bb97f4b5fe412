"""The drafter's linear layers with their three GEMMs in FP8 (`model/fp8.py`) against bf16, one linear at a time,
and the pieces of the FP8 path timed apart, to say where an FP8 step's time goes beside its GEMMs.

Run from the repository root on the GPU machine (about a minute on one H200):

    PYTHONPATH=src python3 benchmarks/fp8_linear_bench.py [--setting paper|27b] [--repeats 20] [--out fp8.json]
        [--kernels 12]

The linears of one drafter layer, and the context projections, at a setting's shapes: `paper` is the Qwen3-8B
drafter of `recipes/bench-qwen3-8b.yaml` (22,016 block queries, 8,192 context tokens), `27b` the seed's drafter of
`recipes/bench-qwen3.6-27b.yaml` (1,024 blocks of 32: 32,768 queries; 5,920 context tokens). Each row, with CUDA
events (median of `--repeats` after warm-up), on random inputs under bf16 autocast with a float32 master weight as
the drafter trains:
- `bf16`: `F.linear` forward + backward (autocast casts the weight to bf16 each call, as in training);
- `fp8 tensorwise`, `fp8 tensorwise_fast`, `fp8 rowwise`: `fp8_linear` forward + backward, the custom ops as the
  compiled drafter runs them (their quantisers compiled on their own; `tensorwise_fast`: the backward GEMMs
  accumulating fast);
- the tensorwise path's pieces: the three GEMMs alone (`torch._scaled_mm` on ready FP8 operands: the forward with
  fast accumulation, the backward ones without, as `fp8.py` runs them, and with), quantising dy in both layouts
  (`op_quantize_both_layouts`: PyTorch's amax, then the compiled casts) and its amax alone, and what it replaced
  (one layout, then a byte transpose of the FP8 copy).
FLOPs: 6 M K N per linear (2 M K N per GEMM). The sum over the layer is scaled to the drafter's layers and printed
beside the training step's backward + forward stages, so a gap between the two is work outside the linears.
`--kernels N` prints the N kernels with the most device time in one tensorwise forward + backward of the largest
linear (torch.profiler).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from flex_mask_bench import median_ms  # benchmarks/ is on sys.path when run as a script

from dflash_trainer.model import fp8
from dflash_trainer.shapes import QWEN3_8B, QWEN36_27B


@dataclass(frozen=True)
class Linear:
    name: str
    tokens: int  # M
    features: int  # K (in)
    outputs: int  # N (out)

    @property
    def flops(self) -> float:  # forward + both backward GEMMs
        return 6.0 * self.tokens * self.features * self.outputs


def layer_linears(shape: dict, queries: int, context: int) -> list[Linear]:
    """One drafter layer's linears as `model/drafter.py` runs them (q/k/v and gate/up fused), its context keys and
    values, and the context projection `fc` (5 taps), which runs once for all layers."""
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    q, kv = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    return [
        Linear("qkv", queries, hidden, q + 2 * kv),
        Linear("o", queries, q, hidden),
        Linear("gate_up", queries, hidden, 2 * inter),
        Linear("down", queries, inter, hidden),
        Linear("ctx_kv", context, hidden, 2 * kv),
        Linear("fc", context, 5 * hidden, hidden),
    ]


SETTINGS = {
    "paper": (QWEN3_8B, 22016, 8192, 5),
    "27b": (QWEN36_27B, 32768, 5920, 5),
}


def training_pass(linear: Linear, kind: str, device: torch.device):
    """A closure running one forward + backward of `linear` the way `kind` trains it, on fresh random inputs."""
    x = torch.randn(linear.tokens, linear.features, device=device, dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(linear.outputs, linear.features, device=device) / linear.features**0.5).requires_grad_()
    grad = torch.randn(linear.tokens, linear.outputs, device=device, dtype=torch.bfloat16)

    def run() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            rowwise, fast_backward = kind == "fp8 rowwise", kind == "fp8 tensorwise_fast"
            out = (
                F.linear(x, weight)
                if kind == "bf16"
                else fp8.fp8_linear(x, weight, rowwise=rowwise, fast_backward=fast_backward)
            )
        out.backward(grad)
        x.grad = weight.grad = None

    return run


def pieces(linear: Linear, device: torch.device, warmup: int, repeats: int) -> dict[str, float]:
    """The tensorwise path's parts alone, ms each (module docstring)."""
    m, k, n = linear.tokens, linear.features, linear.outputs
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    weight = torch.randn(n, k, device=device) / k**0.5
    grad = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    x_q, x_scale, xt_q = fp8.op_quantize_both_layouts(x, fp8.E4M3)
    w_q, w_scale, wt_q = fp8.op_quantize_both_layouts(weight, fp8.E4M3)
    g_q, g_scale, gt_q = fp8.op_quantize_both_layouts(grad, fp8.E5M2)
    f32 = torch.float32
    bf16 = torch.bfloat16
    one_layout = torch.compile(lambda values: fp8.quantize(values, fp8.E5M2, rowwise=False), dynamic=True)
    timed = {
        "gemm forward (fast accumulation)": lambda: fp8.scaled_matmul(
            x_q, x_scale, w_q, w_scale, bf16, fast_accum=True
        ),
        "gemm input grad": lambda: fp8.scaled_matmul(g_q, g_scale, wt_q, w_scale, bf16),
        "gemm input grad (fast accumulation)": lambda: fp8.scaled_matmul(
            g_q, g_scale, wt_q, w_scale, bf16, fast_accum=True
        ),
        "gemm weight grad (float32 out)": lambda: fp8.scaled_matmul(gt_q, g_scale, xt_q, x_scale, f32),
        "gemm weight grad (fast accumulation)": lambda: fp8.scaled_matmul(
            gt_q, g_scale, xt_q, x_scale, f32, fast_accum=True
        ),
        "bf16 gemm forward": lambda: x @ weight.to(bf16).t(),
        "quantise dy, both layouts": lambda: fp8.op_quantize_both_layouts(grad, fp8.E5M2),
        "amax of dy (PyTorch's reduction)": lambda: fp8.tensor_amax(grad),
        "quantise dy, one layout (compiled)": lambda: one_layout(grad),
        "byte transpose of the FP8 dy": lambda: g_q.t().contiguous(),
        "quantise the weight, both layouts": lambda: fp8.op_quantize_both_layouts(weight, fp8.E4M3),
    }
    return {name: median_ms(fn, warmup, repeats) for name, fn in timed.items()}


def kernel_table(linear: Linear, device: torch.device, top: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    run = training_pass(linear, "fp8 tensorwise", device)
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=top)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setting", choices=sorted(SETTINGS), default="paper")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--kernels", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    shape, queries, context, layers = SETTINGS[args.setting]
    linears = layer_linears(shape, queries, context)
    kinds = ("bf16", "fp8 tensorwise", "fp8 tensorwise_fast", "fp8 rowwise")
    rows = []
    for linear in linears:
        times = {kind: median_ms(training_pass(linear, kind, device), args.warmup, args.repeats) for kind in kinds}
        rows.append({**asdict(linear), "ms": times, "pieces": pieces(linear, device, args.warmup, args.repeats)})
        cells = "  ".join(f"{kind} {ms:7.2f} ms {linear.flops / ms / 1e9:5.0f} TF/s" for kind, ms in times.items())
        print(
            f"{linear.name:8s} M={linear.tokens:6d} K={linear.features:6d} N={linear.outputs:6d}  {cells}", flush=True
        )
    # The step: every linear but fc once per layer, fc once.
    totals = {kind: sum(row["ms"][kind] * (1 if row["name"] == "fc" else layers) for row in rows) for kind in kinds}
    print(
        f"\n{args.setting}: the drafter's linears, forward + backward, {layers} layers: "
        + ", ".join(f"{kind} {ms:.1f} ms" for kind, ms in totals.items())
    )
    print("\npieces of the tensorwise path (ms):")
    names = list(rows[0]["pieces"])
    print(f"{'':40s}" + "".join(f"{row['name']:>10s}" for row in rows))
    for name in names:
        print(f"{name:40s}" + "".join(f"{row['pieces'][name]:10.3f}" for row in rows))
    if args.kernels:
        largest = max(linears, key=lambda linear: linear.flops)
        print(f"\nkernels of one tensorwise forward + backward of {largest.name}:")
        print(kernel_table(largest, device, args.kernels))
    if args.out:
        args.out.write_text(json.dumps({"setting": args.setting, "linears": rows, "totals_ms": totals}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
