"""DFlash2's candidate top-k over the vocabulary: one `torch.topk` per row against the group-max pruning.

Run from the repository root on the GPU machine (seconds on one H200):

    PYTHONPATH=src python3 benchmarks/topk_bench.py [--rows 7680] [--vocab 49152] [--k 16] [--chunks 7]

Why: the DFlash2 loss takes each slot's top-16 logits as the selector's candidates (`model/loss.py::top_k_ids`), one
row of the vocabulary per slot. At the SmolLM2 main job's block 16 a step holds about 50K such rows of 49,152 bf16
logits (~4.9 GB): 7 chunks of 512 blocks x 15 slots = 7,680 rows since the recipes took chunks of 512 (2026-12-04);
26 chunks of 1,920 rows (128 blocks) when the numbers below were measured (`--rows 1920 --chunks 26`). One
`torch.topk` over the row runs a multi-pass radix select: 20.0 ms per step on an H200 (2026-12-04), 245 GB/s
against the 4.8 TB/s of one read.

The candidates timed here, all exact (the same k values as `torch.topk`; the same set of ids wherever no two logits
tie at the k-th value): `group-max` per group size g (`model/loss.py::top_k_ids_by_group_max`, on CUDA at
`TOP_K_GROUP`): each group's maximum (one read of the logits, like `argmax`), the k groups with the largest maxima,
then the top-k of those k*g logits. Predicted at g=64 (768 maxima, then 1,024 logits per row): about 3 ms for the
maxima, 1-2 ms for the two small top-ks, so 4-6 ms per step; measured (2026-12-04, BENCHMARKS.md) 5.86 ms compiled,
16.8 ms eager. Measured before: a top-k within groups of 1,024, then of the survivors, 46.7 ms.
Each also compiled, as the loss runs it. Also timed: `argmax` (the loss takes it beside the top-k; the top-k's first
id is the argmax up to ties).

Prints, per variant, the median of `--repeats` CUDA-event timings of `--chunks` calls after warm-up, in ms per step,
the effective read bandwidth, and whether the values equal the reference's. Without CUDA it checks every candidate's
values on the CPU at a small shape and exits with an error.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable

import torch
from torch import Tensor

from dflash_trainer.model.loss import TOP_K_GROUP, top_k_ids_by_group_max


def topk_full(logits: Tensor, k: int) -> Tensor:
    return torch.topk(logits, k, dim=-1).indices  # [N, k]


def candidates(vocab: int, k: int) -> dict[str, Callable[[Tensor], Tensor]]:
    """Each exact candidate whose group size divides the vocabulary (no padding copy)."""
    forms: dict[str, Callable[[Tensor], Tensor]] = {"topk over the row": lambda x: topk_full(x, k)}
    for group in (32, 64, 128, 256):
        if vocab % group == 0 and vocab // group >= k:
            production = " (top_k_ids)" if group == TOP_K_GROUP else ""
            forms[f"group-max, g={group}{production}"] = lambda x, g=group: top_k_ids_by_group_max(x, k, g)
    return forms


def time_ms(fn: Callable[[], object], repeats: int, chunks: int) -> float:
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(chunks):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def same_values(logits: Tensor, ids: Tensor, reference: Tensor) -> bool:
    return torch.equal(logits.gather(1, ids), logits.gather(1, reference))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=7680, help="slots per loss chunk (512 blocks x 15 slots)")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--chunks", type=int, default=7, help="loss chunks per step")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    forms = candidates(args.vocab, args.k)

    if not torch.cuda.is_available():
        # Random rows, and rows whose largest logits all sit in one group (the case a wrong pruning would miss).
        clustered = torch.arange(args.vocab, dtype=torch.float32).roll(args.vocab // 3).expand(4, -1)
        for logits in (torch.randn(64, args.vocab).to(torch.bfloat16), clustered.contiguous()):
            reference = topk_full(logits, args.k)
            for name, fn in forms.items():
                equal = same_values(logits, fn(logits), reference)
                print(f"no CUDA: {name}: values equal at {list(logits.shape)} {logits.dtype}: {equal}")
        return 1

    logits = torch.randn(args.rows, args.vocab, device="cuda").to(torch.bfloat16)  # [N, V]
    reference = topk_full(logits, args.k)
    variants = {name: (lambda fn=fn: fn(logits)) for name, fn in forms.items()}
    # Production runs inside the loss chunk's compiled graph (`_compiled_loss_chunk`, static shapes): time that too.
    for name in ("topk over the row", f"group-max, g={TOP_K_GROUP} (top_k_ids)"):
        compiled = torch.compile(forms[name], dynamic=False, fullgraph=True)
        forms[f"{name}, compiled"] = compiled
        variants[f"{name}, compiled"] = lambda fn=compiled: fn(logits)
    variants["argmax (a separate pass today)"] = lambda: logits.argmax(dim=-1)
    for fn in variants.values():  # warm-up: kernels loaded, allocator primed
        fn()
    torch.cuda.synchronize()
    step_bytes = logits.numel() * logits.element_size() * args.chunks
    print(f"{args.rows} rows x {args.vocab} bf16 logits, k={args.k}, {args.chunks} chunks per step")
    for name, fn in variants.items():
        ms = time_ms(fn, args.repeats, args.chunks)
        check = ""
        if name in forms:
            ids = forms[name](logits)
            agree = (ids == reference).float().mean().item()
            check = f"values equal: {same_values(logits, ids, reference)}, ids equal at {agree:.2%}"
        print(f"{name:44s} {ms:8.2f} ms per step  {step_bytes / ms / 1e6:8.1f} GB/s read once  {check}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
