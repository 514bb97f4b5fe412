"""flex_attention's kernel options (`drafter.flex_kernel_options`) on the drafter's real mask, paper or 27B setting.

Run from the repository root on the GPU machine (a few minutes on one H200, most of it compiling the backward
kernels):

    PYTHONPATH=src python3 benchmarks/flex_kernel_bench.py [--out flex_kernels.json] [--best best.overrides]
        [--candidates candidates.json] [--autotune] [--layouts] [--repeats 20] [--setting paper|27b]

One drafter layer's attention in `recipes/bench-qwen3-8b.yaml`: Qwen3-8B's heads (32 query, 8 key/value, head dim
128), bf16, one packed row of 8,192 context tokens from documents 3072 + 3072 + 2048, 455 anchors per document,
blocks of 16 (1,365 anchors in 1,376 slots: 22,016 queries, 30,208 keys), production's mask (`tile_tables` +
`mask_from_ranges`, tiles of 128). Each candidate is a dict of kernel options, compiled with static sizes (one
mask); prints forward and forward+backward ms (CUDA events, median of `--repeats` after warm-up), the five-layer
estimate, and the largest difference of its outputs and gradients from the first candidate's (bf16 rounding: the
tiles change the order of the sums; a candidate further off, or NaN, is never picked). `--autotune` adds
Inductor's own choice (max-autotune for this graph alone; its log, "AUTOTUNE flex_attention_backward", names the
configs it timed, on a mask it fills in itself, so its pick is then timed here on the real one). `--layouts` adds
the default compiled as the trainer's layers run it: symbolic sizes, strided inputs, with and without the
IS_DIVISIBLE that `attend` passes. Each row also reports the median SM clock and power during its timing
(`gpu_monitor.py`), to compare with the training step's (`dflash-trainer bench` prints them per phase).
`--layouts training` adds only the layers' layout with IS_DIVISIBLE. `--best` writes the fastest candidate as
dotted overrides (`drafter.flex_kernel_options.KEY=VALUE,...`, empty when the default wins) for a bench
ablation. A candidate that does not compile (shared memory) is reported and skipped.

`--setting 27b`: the seed's drafter on Qwen3.6-27B (`recipes/bench-qwen3.6-27b.yaml`): 24 query heads, 4 key/value
heads, head dim 256, blocks of 32, up to 1,024 anchors per document, every layer sliding (window 2,048, causal in
the block), one 8,192-token row of the bench's long-reply documents (`bench.long_reply_documents`), with candidates
around Inductor's Hopper default for head dim 256 (`backward_tiles(64, 64, 64, 64, 2, 4)`). There, on 2026-12-02,
flex's backward took 38.6 ms per layer against 5.9 ms for its forward (BENCHMARKS.md), 23.7 % of the drafter step.

2026-12-01 (BENCHMARKS.md, commit 32537ae): no candidate beat Inductor's default; `--layouts` showed the training
step's flex 1.44x slower than static sizes, fixed by telling flex its lengths are whole tiles (model/attention.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from flex_mask_bench import layout, median_ms  # benchmarks/ is on sys.path when run as a script
from torch.nn.attention.flex_attention import flex_attention

from dflash_trainer.bench import long_reply_documents, paper_documents
from dflash_trainer.config import flex_kernel_option_problem
from dflash_trainer.flex import TILE
from dflash_trainer.gpu_monitor import GpuMonitor, describe
from dflash_trainer.model.attention import block_mask_from_tables, mask_from_ranges, tile_tables

LENGTH, LAYERS = 8192, 5


@dataclass(frozen=True)
class FlexSetting:
    """One drafter layer's attention: heads, the mask's block, anchors and window, the documents of the row."""

    heads: int
    kv_heads: int
    head_dim: int
    block: int
    anchors_per_doc: int
    window: int | None
    causal_in_block: bool
    documents: Callable
    candidates: list[dict[str, int | bool]]


def backward_tiles(m1: int, n1: int, m2: int, n2: int, stages: int, warps: int) -> dict[str, int]:
    return {
        "bwd_BLOCK_M1": m1,
        "bwd_BLOCK_N1": n1,
        "bwd_BLOCK_M2": m2,
        "bwd_BLOCK_N2": n2,
        "bwd_num_stages": stages,
        "bwd_num_warps": warps,
    }


# Inductor's default on Hopper at head dim 128 is backward_tiles(64, 128, 128, 64, 3, 8) (template_heuristics);
# around it: fewer stages or warps, narrower query tiles, the square 64 tiles, and the dQ writes moved.
PAPER_CANDIDATES: list[dict[str, int | bool]] = [
    {},
    backward_tiles(64, 128, 128, 64, 2, 8),
    backward_tiles(64, 128, 128, 64, 3, 4),
    backward_tiles(32, 128, 128, 32, 3, 4),
    backward_tiles(64, 64, 64, 64, 3, 4),
    backward_tiles(32, 64, 64, 32, 3, 4),
    {"bwd_WRITE_DQ": False},
]
# At head dim 256 Inductor's Hopper default is backward_tiles(64, 64, 64, 64, 2, 4): a 64 x 256 bf16 tile is 32 KiB,
# so K and V of 64 keys plus two stages of Q and dO take 192 KiB of the 227 KiB of shared memory. Around it: twice
# the warps (the tile's dot products are 4x those at head dim 64 per warp), one stage with wider key tiles,
# narrower query tiles with more stages, the small square tiles (the fastest that fit on sm_12x at head dim 256,
# pytorch/pytorch#198228), and the dQ writes moved. One that does not fit fails and is skipped.
HEAD_DIM_256_CANDIDATES: list[dict[str, int | bool]] = [
    {},
    backward_tiles(64, 64, 64, 64, 2, 8),
    backward_tiles(64, 64, 64, 64, 1, 8),
    backward_tiles(64, 64, 64, 64, 1, 4),
    backward_tiles(32, 64, 64, 32, 2, 4),
    backward_tiles(32, 64, 64, 32, 3, 4),
    backward_tiles(32, 32, 32, 32, 2, 4),
    backward_tiles(32, 128, 128, 32, 1, 8),
    backward_tiles(64, 128, 128, 64, 1, 8),
    {"bwd_WRITE_DQ": False},
]
SETTINGS = {
    "paper": FlexSetting(32, 8, 128, 16, 455, None, False, paper_documents, PAPER_CANDIDATES),
    "27b": FlexSetting(24, 4, 256, 32, 1024, 2048, True, long_reply_documents, HEAD_DIM_256_CANDIDATES),
}


# Largest difference from the first candidate's outputs and gradients that is still bf16 rounding (tiles sum in
# another order; measured 0.008-0.016 across layouts on 2026-12-01).
SAME_RESULT = 0.05


def candidate_name(options: dict) -> str:
    return json.dumps(options) if options else "default"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--setting", choices=sorted(SETTINGS), default="paper", help="the drafter's attention shape")
    parser.add_argument("--candidates", type=Path, help="JSON list of kernel-option dicts (default: built in)")
    parser.add_argument("--autotune", action="store_true", help="also time Inductor's max-autotune pick")
    parser.add_argument(
        "--layouts",
        nargs="?",
        const="all",
        choices=["all", "training"],
        help="also the default with symbolic sizes and strided inputs (all: with and without IS_DIVISIBLE, and "
        "each difference alone; training: only the layout the trainer's layers run)",
    )
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("flex_kernels.json"))
    parser.add_argument("--best", type=Path, help="write the fastest candidate as dotted overrides here")
    args = parser.parse_args()

    setting = SETTINGS[args.setting]
    heads, kv_heads, head_dim, block = setting.heads, setting.kv_heads, setting.head_dim, setting.block
    candidates = json.loads(args.candidates.read_text()) if args.candidates else setting.candidates
    for options in candidates:
        problems = [f"{k}: {p}" for k, v in options.items() if (p := flex_kernel_option_problem(k, v))]
        if problems:
            sys.exit(f"flex_kernel_bench: candidate {options}: {'; '.join(problems)}")
    anchors, keep, doc_ids = layout(1, LENGTH, setting.anchors_per_doc, block, args.seed, documents=setting.documents)
    table = tile_tables(
        anchors=anchors, anchor_keep=keep, doc_ids=doc_ids, block_size=block, window=setting.window, tile=TILE
    )
    q_len, kv_len = anchors.shape[1] * block, LENGTH + anchors.shape[1] * block
    visited = int(table.kv_num_blocks.sum() + table.full_kv_num_blocks.sum())
    print(
        f"Q {q_len} ({int(keep.sum())} anchors kept), KV {kv_len}, {visited} tiles of {TILE}x{TILE} visited per head "
        f"({int(table.kv_num_blocks.sum())} partial)"
    )
    if not torch.cuda.is_available():
        sys.exit("flex_kernel_bench: needs a CUDA device (flex_attention's Triton kernels); none found")

    device = torch.device("cuda")
    table = table.to(device)
    mask = block_mask_from_tables(
        table,
        mask_from_ranges(
            table.lo,
            table.hi,
            block_size=block,
            context_len=LENGTH,
            window=setting.window,
            causal_in_block=setting.causal_in_block,
        ),
        q_len=q_len,
        kv_len=kv_len,
    )
    gen = torch.Generator(device=device).manual_seed(args.seed)
    q, k, v = (
        torch.randn(1, h, n, head_dim, generator=gen, device=device, dtype=torch.bfloat16)
        for h, n in ((heads, q_len), (kv_heads, kv_len), (kv_heads, kv_len))
    )
    grad_out = torch.randn_like(q)
    # The layouts the drafter's layers hand flex: heads transposed out of [R, S, H, D] projections (strided views).
    strided = {
        name: t.transpose(1, 2).contiguous().transpose(1, 2)
        for name, t in zip("qkvg", (q, k, v, grad_out), strict=True)
    }
    fwd_flop = visited * heads * 4 * TILE * TILE * head_dim  # of the visited tiles; backward 2.5x

    def timed(name: str, options: dict, flex, layout: str = "contiguous") -> dict:
        inputs = (q, k, v, grad_out) if layout == "contiguous" else tuple(strided[n] for n in "qkvg")

        def run(backward: bool) -> list[torch.Tensor]:
            leaves = [t.detach().requires_grad_(backward) for t in inputs[:3]]
            out = flex(*leaves, block_mask=mask, scale=head_dim**-0.5, enable_gqa=True, kernel_options=options or None)
            return [out, *torch.autograd.grad(out, leaves, inputs[3])] if backward else [out]

        started = time.perf_counter()
        try:
            with torch.no_grad():
                fwd_ms = median_ms(lambda: run(False), args.warmup, args.repeats)
            with GpuMonitor(device) as monitor:  # the clock flex runs at alone, against the training step's
                both_ms = median_ms(lambda: run(True), args.warmup, args.repeats)
        except Exception as error:  # e.g. a tile set whose shared memory does not fit
            print(f"{name}: failed: {type(error).__name__}: {str(error)[:300]}", flush=True)
            return {"name": name, "options": options, "error": f"{type(error).__name__}: {str(error)[:300]}"}
        result = {
            "name": name,
            "options": options,
            "fwd_ms": fwd_ms,
            "bwd_ms": both_ms - fwd_ms,
            "fwd_bwd_ms": both_ms,
            "step_ms": LAYERS * both_ms,
            "fwd_tflops": fwd_flop / fwd_ms / 1e9,
            "bwd_tflops": 2.5 * fwd_flop / (both_ms - fwd_ms) / 1e9,
            "compile_and_time_s": time.perf_counter() - started,
            "sm_clock_mhz": monitor.reading.sm_clock_mhz if monitor.reading else None,
            "power_w": monitor.reading.power_w if monitor.reading else None,
            "outputs": run(True),
        }
        print(
            f"{name}: fwd {fwd_ms:.3f} ms ({result['fwd_tflops']:.0f} TFLOP/s), bwd {result['bwd_ms']:.3f} ms "
            f"({result['bwd_tflops']:.0f} TFLOP/s), {LAYERS} layers {result['step_ms']:.1f} ms per step "
            f"[{result['compile_and_time_s']:.0f} s; {describe(result['sm_clock_mhz'], result['power_w'])}]",
            flush=True,
        )
        return result

    results = []
    for options in candidates:
        torch._dynamo.reset()  # each candidate compiles its own graph, as a trainer process would
        name = candidate_name(options)
        results.append(timed(name, options, torch.compile(flex_attention, dynamic=False)))
    if args.layouts:
        # What the trainer's compiled layers differ in from the candidates above: symbolic sizes (dynamic=True) and
        # strided q/k/v/grad layouts (2026-12-01: the step's flex took 55 ms per 5 layers, ~1.6x this bench's).
        # The last row is what the layers run since a3c844a: `attend` passes IS_DIVISIBLE for whole-tile lengths.
        layouts = [(True, "contiguous", {}), (False, "strided", {}), (True, "strided", {})]
        layouts = [*(layouts if args.layouts == "all" else []), (True, "strided", {"IS_DIVISIBLE": True})]
        for dynamic, arrangement, options in layouts:
            torch._dynamo.reset()
            name = f"default, dynamic={dynamic}, {arrangement}" + (", IS_DIVISIBLE" if options else "")
            results.append(timed(name, options, torch.compile(flex_attention, dynamic=dynamic), arrangement))
    if args.autotune:
        torch._dynamo.reset()
        import torch._inductor.config as inductor_config

        with inductor_config.patch(max_autotune=True):  # only flex is in this graph: no GEMM is autotuned
            results.append(timed("autotune", {}, torch.compile(flex_attention, dynamic=False)))

    reference = next((r["outputs"] for r in results if "outputs" in r), None)
    for r in results:
        if "outputs" in r:
            # One max over all four tensors: a NaN anywhere (a kernel that skipped a row's safety) propagates.
            diffs = [
                (a.detach().float() - b.detach().float()).abs().max()
                for a, b in zip(reference, r.pop("outputs"), strict=True)
            ]
            r["max_abs_diff"] = float(torch.stack(diffs).max())
    # Timed and computing what the default computes (bf16 rounding apart): the only ones --best may pick.
    timed_ok = [r for r in results if "fwd_bwd_ms" in r and r["max_abs_diff"] <= SAME_RESULT]
    print(f"\n{'candidate':<100} {'fwd ms':>7} {'bwd ms':>7} {'x5 ms':>7} {'diff':>8}")
    for r in results:
        if "fwd_bwd_ms" in r:
            print(
                f"{r['name']:<100} {r['fwd_ms']:7.3f} {r['bwd_ms']:7.3f} {r['step_ms']:7.1f} {r['max_abs_diff']:8.2g}"
            )
        else:
            print(f"{r['name']:<100} failed")
    for r in results:
        if "fwd_bwd_ms" in r and not r["max_abs_diff"] <= SAME_RESULT:
            print(f"{r['name']}: differs from the default by {r['max_abs_diff']:.3g} (> {SAME_RESULT}): never the best")
    summary = {"gpu": torch.cuda.get_device_name(), "setting": args.setting, "q_len": q_len, "results": results}
    args.out.write_text(json.dumps(summary, indent=2))
    if args.best and timed_ok:
        # Only the candidates the config accepts (the autotuned one is Inductor's choice, named in its log).
        best = min((r for r in timed_ok if r["name"] in map(candidate_name, candidates)), key=lambda r: r["fwd_bwd_ms"])
        overrides = ",".join(
            f"drafter.flex_kernel_options.{k}={str(v).lower() if isinstance(v, bool) else v}"
            for k, v in best["options"].items()
        )
        args.best.write_text(overrides + "\n")
        print(f"fastest: {best['name']} ({best['fwd_bwd_ms']:.3f} ms) -> {args.best}: {overrides or '(default)'}")


if __name__ == "__main__":
    main()
