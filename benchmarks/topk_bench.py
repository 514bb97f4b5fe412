"""DFlash2's candidate top-k over the vocabulary: one `torch.topk` per row against a two-stage top-k over groups.

Run from the repository root on the GPU machine (seconds on one H200):

    PYTHONPATH=src python3 benchmarks/topk_bench.py [--rows 1920] [--vocab 49152] [--k 16] [--chunks 26]

Why: the DFlash2 loss takes each slot's top-16 logits as the selector's candidates (`model/loss.py::_loss_chunk`,
`top_k`), one row of the vocabulary per slot. At the SmolLM2 main job's block 16 that is 26 chunks of 128 blocks x 15
slots = 1,920 rows of 49,152 bf16 logits each per step (~4.9 GB of logits read per pass over the step). The
2026-12-03 kernel profile at block 8 put the top-k kernels (radix select over the whole row: `gatherTopK`,
`computeBlockDigitCounts`) at 9.3 ms per step; scaled to block 16, about 20 ms of the step's 134.
The two-stage variant (production's `top_k_ids`) takes the top-k within each group of about 1,024 logits (one
block-sized slice each), then the top-k of those G*k survivors: the same k values (the top-k of a row lies within the
union of its groups' top-k), and the same ids wherever no two logits tie at the k-th value. Predicted: 3-5 ms per step
against about 20 (one read of the logits from memory instead of a multi-pass select). Also timed: `argmax` beside the
top-k (the loss takes both today; the top-k's first id is the argmax up to ties), to see what dropping that pass
would save.

Prints, per variant, the median of `--repeats` CUDA-event timings of `--chunks` calls after warm-up, in ms per step,
the effective read bandwidth, and checks that the values equal the reference's. Without CUDA it checks the
equivalence on the CPU at a small shape and exits with an error.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from dflash_trainer.model.loss import _top_k_group, top_k_ids, top_k_ids_in_groups


def topk_full(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, ids = torch.topk(logits, k, dim=-1)  # [N, k]
    return values, ids


def time_ms(fn, repeats: int, chunks: int) -> float:
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1920, help="slots per loss chunk (128 blocks x 15 slots)")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--chunks", type=int, default=26, help="loss chunks per step")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()

    if not torch.cuda.is_available():
        logits = torch.randn(64, args.vocab).to(torch.bfloat16)
        grouped = top_k_ids_in_groups(logits, args.k, _top_k_group(args.vocab, args.k) or args.vocab)
        same = torch.equal(logits.gather(1, grouped), topk_full(logits, args.k)[0])
        print(f"no CUDA: checked on the CPU at [64, {args.vocab}]: values equal: {same}")
        return 1

    logits = torch.randn(args.rows, args.vocab, device="cuda").to(torch.bfloat16)  # [N, V]
    reference = topk_full(logits, args.k)
    grouped = top_k_ids(logits, args.k)
    values_equal = torch.equal(reference[0], logits.gather(1, grouped))
    ids_equal = (reference[1] == grouped).float().mean().item()
    group = _top_k_group(args.vocab, args.k) or "none: one top-k"
    variants = {
        "topk over the row": lambda: topk_full(logits, args.k),
        f"top_k_ids (groups of {group}, then the survivors)": lambda: top_k_ids(logits, args.k),
        "argmax (a separate pass today)": lambda: logits.argmax(dim=-1),
    }
    for fn in variants.values():  # warm-up: kernels loaded, allocator primed
        fn()
    torch.cuda.synchronize()
    step_bytes = logits.numel() * logits.element_size() * args.chunks
    print(f"{args.rows} rows x {args.vocab} bf16 logits, k={args.k}, {args.chunks} chunks per step")
    for name, fn in variants.items():
        ms = time_ms(fn, args.repeats, args.chunks)
        print(f"{name:55s} {ms:8.2f} ms per step  {step_bytes / ms / 1e6:8.1f} GB/s read once")
    print(f"grouped values equal the reference's: {values_equal}; ids equal at {ids_equal:.4%} of places (ties aside)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
