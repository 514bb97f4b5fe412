"""flex_attention with the drafter's mask: the old int64 element-wise mask_mod against the lean int32 context ranges.

Run from the repository root on the GPU machine (about a minute on one H200, most of it compiling):

    PYTHONPATH=src python3 benchmarks/flex_mask_bench.py [--rows 16] [--anchors-per-doc 64] [--tiles 128,64]
        [--dynamic] [--max-autotune]

One drafter layer's attention in the SmolLM2-135M training step: hidden 576 -> 9 query heads, 3 KV heads, head dim
64, bf16; `--rows` rows of T=1024 context tokens packed from documents shaped like the recipe's regenerated data
(`bench.smollm2_documents`: about 250 tokens, about 117 supervised), every valid response position an anchor (at the
defaults about 435 kept blocks of 16 per row, 656 with the padding to the fullest of the 16 rows) or
`--anchors-per-doc` random ones per document. Both masks share the BlockMask tables of `tile_tables` (the
production ones); only the mask_mod the kernel evaluates inside partial tiles differs:
(a) "int64 rule": the element-wise rule as production evaluated it before (document ids compared per key, int64
captured tensors); (b) "int32 ranges": production's `mask_from_ranges`. Times compiled flex_attention forward and
forward+backward with CUDA events after warm-up (median of `--repeats`), prints ms and the effective TFLOP/s of the
visited tiles (4 * tile * tile * 64 per (query tile, key tile, head) forward, 2.5x that backward), a 5-layer
step estimate, and the largest difference of every row from (a) at the first tile (outputs and gradients; 0 for
(b) at that tile, bf16 rounding at another tile, whose kernel sums in another order).
`--tiles 128,64`: each mask in tiles of 128 and of 64 queries x keys (`drafter.flex_tile`; the production tables
of `tile_tables` for each). Hopper's default flex kernels at head dim 64 are 128 wide and do not fit tiles of 64
(that row then fails); `--max-autotune` compiles with mode max-autotune-no-cudagraphs, whose kernel choices include
64-wide ones (and autotunes the 128 tiles too: compare like with like). No flex forward kernel fits tiles of 32.
Without CUDA it builds the layout and the tables on the CPU, prints their summary and exits with an error.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from functools import partial

import numpy as np
import torch
from torch.nn.attention.flex_attention import flex_attention

from dflash_trainer.bench import smollm2_documents
from dflash_trainer.flex import TILE
from dflash_trainer.model.anchors import sample_anchors
from dflash_trainer.model.attention import block_mask_from_tables, mask_from_ranges, tile_tables
from dflash_trainer.train.batch import pad_anchors

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 9, 3, 64, 5


def int64_rule(*, anchors, anchor_keep, doc_ids, block_size, context_len, causal_in_block):
    """The element-wise rule as production evaluated it before the context ranges (no window: SmolLM2's layers)."""

    def mask_mod(b, h, q_idx, kv_idx):
        q_block = q_idx // block_size
        anchor = anchors[b, q_block]
        is_ctx = kv_idx < context_len
        same_doc = doc_ids[b, torch.clamp(kv_idx, max=context_len - 1)] == doc_ids[b, anchor]
        ctx_ok = is_ctx & (kv_idx < anchor) & same_doc & anchor_keep[b, q_block]
        block_kv = torch.clamp(kv_idx - context_len, min=0)
        in_block = ~is_ctx & (block_kv // block_size == q_block)
        if causal_in_block:
            in_block = in_block & (block_kv % block_size <= q_idx % block_size)
        return ctx_ok | in_block

    return mask_mod


def layout(
    rows: int, length: int, anchors_per_doc: int | None, block_size: int, seed: int, documents=smollm2_documents
):
    """Rows packed first-fit with whole documents (`documents(rng)` -> [(length, prompt length)]: prompt
    unsupervised, reply supervised), padding -1 at the end; the anchors (padded to a multiple of 16 with dropped
    ones, as the recipes do) and their keep flags."""
    rng = np.random.default_rng(seed)
    doc_ids = torch.full((rows, length), -1, dtype=torch.long)
    loss_mask = torch.zeros(rows, length, dtype=torch.bool)
    pending: list[tuple[int, int]] = []  # (length, prompt length), first fit into each row
    for r in range(rows):
        start, doc = 0, 0
        while True:
            pending += documents(rng) if len(pending) < 66 else []
            fit = next((i for i, (size, _) in enumerate(pending) if start + size <= length), None)
            if fit is None:
                break
            size, prompt = pending.pop(fit)
            doc_ids[r, start : start + size] = doc
            loss_mask[r, start + prompt : start + size] = True
            start, doc = start + size, doc + 1
    generator = torch.Generator().manual_seed(seed)
    anchors, keep = sample_anchors(
        loss_mask=loss_mask, doc_ids=doc_ids, max_anchors=anchors_per_doc or length, generator=generator
    )
    anchors, keep = pad_anchors(anchors, keep, multiple=16)
    return anchors, keep, doc_ids


def median_ms(fn, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--length", type=int, default=1024, help="context tokens per row (T)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--anchors-per-doc", type=int, default=None, help="default: every valid position")
    parser.add_argument("--causal-in-block", action="store_true")
    parser.add_argument("--tiles", default=str(TILE), help="comma-separated flex tile sizes (16, 32, 64, 128)")
    parser.add_argument("--max-autotune", action="store_true", help="compile mode max-autotune-no-cudagraphs")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dynamic", action="store_true", help="compile with dynamic shapes, as the trainer's compiled layers are"
    )
    args = parser.parse_args()

    block, length = args.block_size, args.length
    tiles = [int(t) for t in args.tiles.split(",")]
    anchors, keep, doc_ids = layout(args.rows, length, args.anchors_per_doc, block, args.seed)
    tables = {
        tile: tile_tables(anchors=anchors, anchor_keep=keep, doc_ids=doc_ids, block_size=block, tile=tile)
        for tile in tiles
    }
    rows, num_blocks = anchors.shape
    q_len, kv_len = num_blocks * block, length + num_blocks * block
    print(
        f"rows {rows}, T {length}, blocks per row {num_blocks} ({int(keep.sum()) / rows:.0f} kept), "
        f"Q {q_len}, KV {kv_len}"
    )
    for tile, table in tables.items():
        n_partial, n_full = int(table.kv_num_blocks.sum()), int(table.full_kv_num_blocks.sum())
        print(
            f"  tile {tile}: {n_partial + n_full} tiles visited per head ({n_partial} partial), "
            f"{(n_partial + n_full) * tile * tile / 1e6:.1f}M elements"
        )
    if not torch.cuda.is_available():
        sys.exit("flex_mask_bench: needs a CUDA device (flex_attention's Triton kernels); none found")

    torch._dynamo.config.cache_size_limit = 64
    device = torch.device("cuda")
    tables = {tile: table.to(device) for tile, table in tables.items()}
    anchors, keep, doc_ids = (t.to(device) for t in (anchors, keep, doc_ids))
    common = dict(block_size=block, context_len=length, causal_in_block=args.causal_in_block)
    any_table = next(iter(tables.values()))  # the ranges are the same for every tile
    mods = {
        "int64 rule": int64_rule(anchors=anchors, anchor_keep=keep, doc_ids=doc_ids, **common),
        "int32 ranges": mask_from_ranges(any_table.lo, any_table.hi, **common),
    }
    gen = torch.Generator(device=device).manual_seed(args.seed)
    q, k, v = (
        torch.randn(rows, heads, n, HEAD_DIM, generator=gen, device=device, dtype=torch.bfloat16)
        for heads, n in ((HEADS, q_len), (KV_HEADS, kv_len), (KV_HEADS, kv_len))
    )
    grad_out = torch.randn_like(q)
    mode = "max-autotune-no-cudagraphs" if args.max_autotune else None
    flex = torch.compile(flex_attention, dynamic=args.dynamic, mode=mode)  # static: one kernel per mask
    masks = {
        (name, tile): block_mask_from_tables(table, mod, q_len=q_len, kv_len=kv_len)
        for tile, table in tables.items()
        for name, mod in mods.items()
    }

    def run(bm, backward: bool) -> list[torch.Tensor]:
        leaves = [t.detach().requires_grad_(backward) for t in (q, k, v)]
        out = flex(*leaves, block_mask=bm, scale=HEAD_DIM**-0.5, enable_gqa=True)
        return [out, *torch.autograd.grad(out, leaves, grad_out)] if backward else [out]

    results = {}
    for (name, tile), bm in masks.items():
        visited = int(bm.kv_num_blocks.sum() + bm.full_kv_num_blocks.sum()) * HEADS
        fwd_flop = visited * 4 * tile * tile * HEAD_DIM
        try:
            with torch.no_grad():
                fwd_ms = median_ms(partial(run, bm, False), args.warmup, args.repeats)
            both_ms = median_ms(partial(run, bm, True), args.warmup, args.repeats)
        except Exception as error:  # e.g. a backward without a kernel that fits tiles of 64
            print(f"{name:>12} tile {tile:>3}: failed: {type(error).__name__}: {str(error)[:300]}")
            continue
        results[name, tile] = run(bm, True)
        print(
            f"{name:>12} tile {tile:>3}: fwd {fwd_ms:7.3f} ms {fwd_flop / fwd_ms / 1e9:6.1f} TFLOP/s | "
            f"fwd+bwd {both_ms:7.3f} ms {3.5 * fwd_flop / both_ms / 1e9:6.1f} TFLOP/s | "
            f"{LAYERS} layers {LAYERS * both_ms:6.1f} ms per step"
        )
    reference = results.get(("int64 rule", tiles[0]))
    for (name, tile), result in results.items():
        if reference is not None and (name, tile) != ("int64 rule", tiles[0]):
            diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(reference, result, strict=True))
            print(f"{name} tile {tile} vs int64 rule tile {tiles[0]}: max abs diff (out, dq, dk, dv) {diff:.3g}")


if __name__ == "__main__":
    main()
