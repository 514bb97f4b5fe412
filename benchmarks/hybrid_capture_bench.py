"""The 27B hybrid target's feature capture over packed rows whose length changes from call to call, as in training:
the time of every call, on the path the target takes (with fla on CUDA the one-forward path,
`targets/varlen_hybrid.py`), then on the per-document path, over the same sequence of lengths.

`hybrid_bench.py --phases forward` times one layout over and over; a training step meets a new row length and a new
set of document lengths every time, and a call that meets new shapes may compile or tune kernels (fla's Triton
autotuner, the per-document path's size groups). This says which calls do and how long they take.

    PYTHONPATH=src:/tmp/site python3 benchmarks/hybrid_capture_bench.py    # fla installed in /tmp/site

Rows: one row of `--lengths` tokens each (default 5504, 5504, 5440, 5632, 5376, 5504, 5568, 5440), filled with
documents of 30-488 tokens (the seed's data without its long replies: many per row). Target: Qwen3.6-27B's shape
truncated after the deepest tap (`hybrid_bench.QWEN36_27B_TRUNCATED`), random weights, FP8 linear layers. The third
call of the first path runs under the PyTorch profiler (host time per operator: where a slow call spends it).
A path stops after a call over 40 s once three have run.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import time
from pathlib import Path

import torch

from dflash_trainer.bench import random_target
from dflash_trainer.targets.capture import FeatureCapture
from dflash_trainer.targets.documents import DocumentLayout
from dflash_trainer.targets.loader import quantize_target_to_fp8

PROFILED_CALL = 2
SLOW_S = 40.0


def packed_layout(length: int, rng: random.Random, device: torch.device) -> tuple[DocumentLayout, int]:
    """One row of `length` tokens holding documents of 30-488 tokens; (layout, number of documents)."""
    lengths: list[int] = []
    while sum(lengths) < length - 30:
        lengths.append(min(rng.randint(30, 488), length - sum(lengths)))
    lengths[-1] += length - sum(lengths)
    doc_ids = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])[None]  # [1, T]
    return DocumentLayout.from_doc_ids(doc_ids, device), len(lengths)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="5504,5504,5440,5632,5376,5504,5568,5440")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).parent))  # the sibling script's shape of the 27B target
    from hybrid_bench import QWEN36_27B_TRUNCATED, TAPS

    device = torch.device("cuda")
    target = random_target(device, torch.bfloat16, QWEN36_27B_TRUNCATED)
    quantize_target_to_fp8(target)
    capture = FeatureCapture(target.model, TAPS)
    print(f"path {capture.packing_path}, attention backend {capture.backend}", flush=True)
    lengths = [int(x) for x in args.lengths.split(",")]
    first_path = capture.packing_path
    for path in dict.fromkeys([first_path, "per_document"]):
        capture.packing_path = path
        rng = random.Random(0)
        for index, length in enumerate(lengths):
            layout, documents = packed_layout(length, rng, device)
            ids = torch.randint(0, 200_000, (1, length), device=device)
            profile = path == first_path and index == PROFILED_CALL
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if profile else None
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            with profiler or contextlib.nullcontext():
                capture.capture(ids, documents=layout)
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - start
            print(f"{path} T={length} documents={documents}: {seconds * 1e3:.0f} ms", flush=True)
            if profiler is not None:
                print(profiler.key_averages().table(sort_by="cpu_time_total", row_limit=12), flush=True)
            if seconds > SLOW_S and index >= 3:
                print(f"{path}: a call over {SLOW_S:.0f} s, the path stops here", flush=True)
                break
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
