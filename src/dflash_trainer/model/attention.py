"""The DFlash attention mask: one `mask_mod`, two backends.

Layout. Queries are the block tokens of a row, `[N*B]` (block n, slot k at n*B + k). Keys are the row's T context
entries followed by the same N*B block tokens: `kv < T` is context position kv, `kv >= T` is block token kv - T.

Rule (DESIGN §2). A query of block n anchored at a, at slot k (position p = a + k), sees
- context positions kv < a (strictly: the anchor's own hidden state does not exist yet at inference), of the same
  document as the anchor;
- every slot of its own block (bidirectional), or only slots <= its own when the layer is causal in-block;
- nothing of any other block.
Sliding-window layers of window W keep of these only the keys within W of the query's own position, counting the
query itself: a key at position c is visible when |p - c| < W. For the context (c < a <= p) that is c > p - W: slot
k sees the W - 1 - k context positions before a (fewer near the document start; none for k >= W - 1), so slot 0
sees W - 1 and the window moves with the query, not with the block. Own-block slot j is visible when |k - j| < W,
which hides nothing unless W < B.
Dropped anchors (`anchor_keep` False) lose their context but keep their own block, so no query row is empty (an
all-masked row is NaN in SDPA); the loss ignores them anyway.

The window as the serving engines apply it at inference (what the rule above reproduces; read 2026-12):
- vLLM (`model_executor/models/qwen3_dflash.py`, `v1/spec_decode/dflash.py`, `v1/attention/backends/
  flash_attn.py`): the drafter's context K/V sit in the paged cache at their positions 0..a-1 and the B block
  tokens are the queries at a..a+B-1 (seq_len a + B, so FlashAttention's bottom-right alignment puts query k on key
  a + k). Each layer passes `sliding_window` W as `per_layer_sliding_window`; the backend turns it into
  FlashAttention's `window_size = (W - 1, 0)`: keys from position p - (W - 1) to p, the query's own key included.
  Layers are causal in-block (`layer_types` sliding layers by default, or all layers with `dflash_config.causal:
  true` / `is_causal: true`) or not (`causal: false`); for non-causal sliding layers vLLM PR #46104 widens the
  window symmetrically to (W - 1, W - 1), so block keys up to p + W - 1 stay visible (with (W - 1, 0), what the
  backends give decoder layers otherwise, FlashAttention hides the later slots: causal in effect).
- SGLang (`srt/models/dflash.py`, `srt/speculative/dflash_utils.py`): `sliding_attention` layers are
  `AttentionType.DECODER` (causal) with `sliding_window_size = sliding_window - 1` ("HF windows include the
  current token; SGLang stores window_left"); its FlashAttention backends pass `window_size = (W - 1, 0)` for every
  sliding layer, so a sliding layer runs causal in-block there whatever the config asks.
- z-lab `dflash/model.py` (the reference `DFlashDraftModel`): a layer listed as `sliding_attention` passes
  `config.sliding_window` to the attention function with no mask and `is_causal=False`; with transformers'
  flash_attention_2 that is window (W - 1, W - 1) around the query (bottom-right aligned: key index = position);
  SDPA and eager ignore the argument (no window at all).
All three count W keys ending at the query itself on the context side (transformers' `sliding_window`: q - kv < W),
which is `p - c < W` above. In-block causality is a per-layer setting of ours (`MaskVariant.causal_in_block`,
`drafter.sliding_causal_in_block`), written into the export for the engines (export.py).

As evaluated (`context_ranges`, `mask_from_ranges`). Documents are contiguous runs of one id (as `collate` lays
them out, trailing padding -1 being one more run), so the context of a kept block anchored at a is the single range
[lo, hi) with hi = a and lo = max(start of a's document, a - W + 1): the context of its slot 0, the widest of its
slots; a dropped block gets an empty range (lo = hi). Slot k adds the bound kv >= a - W + 1 + k. The ranges are
computed once per batch ([R, N] int32), and the `mask_mod` reads two of them per query and does a few int32
compares per element:
    n = q // B;  (lo[n] <= kv < hi[n])  |  (T + n*B <= kv < T + n*B + B)    (kv <= T + q when causal in-block)
and on sliding layers additionally kv - q >= hi[n] - n*B - W + 1 on the context part (p - kv < W with p = hi[n] +
q - n*B) and |kv - T - q| < W on the block part (only when W < B). That is the rule above exactly: kv < hi = a <=
T - 1 keeps the context part to context keys, and the own-block part only ever names block keys. flex passes
`q_idx`/`kv_idx` as int32 scalars and `dense_mask` builds int32 grids; the ranges are int32 and everything else is
a Python int, so no element op runs in int64 (the partial tiles evaluate the mask on all of their elements on CUDA
cores, so that work is on the hot path). `tests/test_attention.py` keeps the element-wise rule (document ids
compared per key, positions per query) as the oracle the ranges must equal.

GPU: flex_attention with a BlockMask built once per batch per layer variant. Default builder ("anchors"): the
tile tables (which query/key tiles, 128 x 128 or `drafter.flex_tile`, are empty, full, or partial) come from the
same context ranges (`tile_tables`), with no pass over the Q x KV grid: a block's context is one contiguous key
range per slot (nested: later slots see a suffix of slot 0's), its own block is one contiguous key range, and
nothing else is visible. The tables and the ranges are small integer tensors ([R, Qt, KVt], [R, N]), computed on
the CPU in the data stage (or on any device) and travel together (`TileTables`), so the step builds the `mask_mod`
without any kernel and the BlockMask with a few small ones (its transposed tables); the kernel evaluates the
`mask_mod` inside partial tiles, so the mask is exactly the rule.
`tests/test_attention.py` checks the tables against `create_block_mask`. The "mask_mod" builder
(`create_block_mask`, compiled) is kept as the reference and ablation.
CPU: SDPA with a dense boolean mask evaluated from the same `mask_mod` on broadcast int32 index tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import lru_cache
from typing import Literal, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from ..compiling import compile_dynamic
from ..flex import TILE, compiled_flex_attention, ordered_tiles

Backend = Literal["flex", "sdpa"]
MaskBuilder = Literal["anchors", "mask_mod"]
MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class MaskVariant:
    """What distinguishes the masks of different drafter layers."""

    window: int | None = None
    causal_in_block: bool = False


def context_ranges(
    *,
    anchors: Tensor,  # [R, N] int64
    anchor_keep: Tensor,  # [R, N] bool
    doc_ids: Tensor,  # [R, T] int64, contiguous runs per document, -1 on padding
    window: int | None = None,
) -> tuple[Tensor, Tensor]:
    """The context keys of each block's slot 0, as a range [lo, hi): (lo, hi) int32 [R, N].

    hi = a and lo = max(start of a's document, a - W + 1) for a kept block anchored at a; lo = hi (empty) for a
    dropped one, and for one with nothing before its anchor in its document. Slot k of a sliding layer sees the
    suffix [max(lo, a - W + 1 + k), a) of it (`mask_from_ranges`). Correct because a document is one contiguous run
    of its id: its positions before a are exactly [start, a). Cost O(R * (T + N))."""
    rows, context_len = doc_ids.shape
    anchors = anchors.long()
    # Start of each position's document: the last index <= t where the document id changed.
    index = torch.arange(context_len, device=doc_ids.device).expand(rows, context_len)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    doc_start = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values  # [R, T]
    lo = torch.gather(doc_start, 1, anchors)
    if window is not None:
        lo = torch.maximum(lo, anchors - (window - 1))  # slot 0 at position a: c > a - W
    hi = torch.where(anchor_keep, anchors, lo)
    return lo.to(torch.int32), hi.to(torch.int32)


def mask_from_ranges(
    lo: Tensor,  # [R, N] int32
    hi: Tensor,  # [R, N] int32
    *,
    block_size: int,
    context_len: int,
    window: int | None = None,
    causal_in_block: bool = False,
) -> MaskMod:
    """The `mask_mod` of the rule given the blocks' context ranges (`context_ranges` with the same `window`): a
    query of block n sees context keys [lo[n], hi[n]) and its own block's keys [T + n*B, T + n*B + B), or
    [T + n*B, T + q] when causal in-block; with a window, only the keys within W of its own position. Tensor ops only
    (it runs on flex's scalar indices and on broadcast grids), all int32 given int32 indices: the ranges are int32
    and the sizes Python ints, so nothing promotes to int64."""
    # Block keys at most B - 1 slots away from the query: only a window narrower than the block hides some.
    block_window = window is not None and window < block_size

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        q_block = q_idx // block_size
        own = q_block * block_size + context_len  # first key of the query's own block
        anchor = hi[b, q_block]  # a for a kept block; a dropped one has lo = hi: no context at all
        context = (kv_idx >= lo[b, q_block]) & (kv_idx < anchor)
        if window is not None:
            # The query sits at position p = a + q - n*B, the context key at kv: visible when p - kv < W. Every
            # term joins a tensor: no arithmetic of two sizes alone, which compiled could become a captured
            # expression of SymInts (see `-window` below).
            context = context & (kv_idx - q_idx + window > anchor - own + context_len)
        own_end = (kv_idx <= q_idx + context_len) if causal_in_block else (kv_idx < own + block_size)
        block = (kv_idx >= own) & own_end
        if block_window:
            slots_apart = kv_idx - context_len - q_idx  # j - k for key slot j, query slot k
            # `+ window > 0`, never `> -window`: compiled, the window may be a SymInt (the layers compile with
            # dynamic=True; a second window recompiles the shared flex), and dynamo would compute `-window` outside
            # the mask's graph and pass the expression in as a captured buffer, which Inductor's flex lowering
            # cannot take ("'ShapeAsConstantBuffer' object has no attribute 'dtype'"). A bare SymInt it can.
            block = block & (slots_apart + window > 0)
            if not causal_in_block:
                block = block & (slots_apart < window)
        return context | block

    return mask_mod


def dflash_mask_mod(
    *,
    anchors: Tensor,  # [R, N] int64
    anchor_keep: Tensor,  # [R, N] bool
    doc_ids: Tensor,  # [R, T] int64, contiguous runs per document, -1 on padding
    block_size: int,
    context_len: int,
    window: int | None = None,
    causal_in_block: bool = False,
) -> MaskMod:
    """The rule's `mask_mod` from the anchors: `mask_from_ranges` over `context_ranges`."""
    lo, hi = context_ranges(anchors=anchors, anchor_keep=anchor_keep, doc_ids=doc_ids, window=window)
    return mask_from_ranges(
        lo, hi, block_size=block_size, context_len=context_len, window=window, causal_in_block=causal_in_block
    )


def dense_mask(mask_mod: MaskMod, *, rows: int, q_len: int, kv_len: int, device: torch.device) -> Tensor:
    """Evaluate `mask_mod` on the full (row, query, key) grid -> bool [R, 1, Q, KV] for SDPA."""
    # int32, as flex passes its indices: the mask_mod is evaluated in the same dtype on both backends.
    b = torch.arange(rows, dtype=torch.int32, device=device).view(rows, 1, 1)
    h = torch.zeros(1, 1, 1, dtype=torch.int32, device=device)
    q = torch.arange(q_len, dtype=torch.int32, device=device).view(1, q_len, 1)
    kv = torch.arange(kv_len, dtype=torch.int32, device=device).view(1, 1, kv_len)
    return mask_mod(b, h, q, kv).unsqueeze(1)


@lru_cache(maxsize=1)
def _compiled_create_block_mask() -> Callable:
    from torch.nn.attention.flex_attention import create_block_mask

    return compile_dynamic(create_block_mask)


def block_mask(mask_mod: MaskMod, *, rows: int, q_len: int, kv_len: int, device: torch.device, tile: int = TILE):
    """flex_attention BlockMask for `mask_mod` by evaluating it on the whole grid (compiled on CUDA: the eager
    builder materialises the grid). The reference builder; `tile_tables` gets the same tables from the anchors."""
    from torch.nn.attention.flex_attention import create_block_mask

    build = _compiled_create_block_mask() if device.type == "cuda" else create_block_mask
    return build(mask_mod, B=rows, H=None, Q_LEN=q_len, KV_LEN=kv_len, device=device, BLOCK_SIZE=tile)


@dataclass
class TileTables:
    """A BlockMask's sparsity in flex_attention's (kv_num_blocks, kv_indices) form, one head dimension of 1:
    per query tile, the key tiles to evaluate with `mask_mod` (partial) and those visible whole (full); and the
    blocks' context ranges (`context_ranges`) that the tables were computed from and the `mask_mod` reads, so the
    two cannot disagree."""

    kv_num_blocks: Tensor  # [R, 1, Qt] int32
    kv_indices: Tensor  # [R, 1, Qt, KVt] int32: partial key tiles first, ascending
    full_kv_num_blocks: Tensor  # [R, 1, Qt] int32
    full_kv_indices: Tensor  # [R, 1, Qt, KVt] int32
    lo: Tensor  # [R, N] int32: slot 0 of block n sees context keys [lo, hi) (`context_ranges`)
    hi: Tensor  # [R, N] int32
    tile: int = TILE  # queries and keys per tile (the BlockMask's BLOCK_SIZE)

    def _map(self, fn: Callable[[Tensor], Tensor]) -> TileTables:
        return TileTables(
            **{f.name: fn(getattr(self, f.name)) for f in fields(self) if f.name != "tile"}, tile=self.tile
        )

    def to(self, device: torch.device, non_blocking: bool = False) -> TileTables:
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> TileTables:
        return self._map(Tensor.pin_memory)


def tile_tables(
    *,
    anchors: Tensor,  # [R, N] int64
    anchor_keep: Tensor,  # [R, N] bool
    doc_ids: Tensor,  # [R, T] int64, contiguous runs per document, -1 on padding
    block_size: int,
    window: int | None = None,
    tile: int = TILE,
) -> TileTables:
    """The tile tables of `dflash_mask_mod` over [N*B queries, T + N*B keys] from the anchors alone, in tiles of
    `tile` queries x `tile` keys, for the bidirectional block (the causal one shares them: `mask_tables`).

    Slot k of block n sees the context [lo_k, hi) with lo_k = lo (`context_ranges`), or on a sliding layer
    max(lo, a - W + 1 + k): nested ranges, the widest at slot 0. A block must fit in a tile (B <= tile): it is
    counted in the query tiles of its first and last query only, with the slots it has there; in each, the key
    tiles its first slot there touches and those its last slot there sees whole (complete context tiles inside its
    range) are counted per query tile with difference arrays over the key tiles. A (query tile, key tile) pair is
    touched when some query of the tile sees some key of the tile, and full when every query of the (complete)
    tile sees every key of the (complete, context-only) tile. The own-block keys of a query tile are one contiguous
    range (with a window: those within W - 1 slots of its first and last query), always partial tiles (they also
    hold other blocks' keys, or a causal in-block mask). Cost: O(R * (N + Qt * KVt)) integer work, no pass over
    queries x keys."""
    rows, num_blocks = anchors.shape
    context_len = doc_ids.shape[1]
    device = anchors.device
    q_len = num_blocks * block_size
    q_tiles = -(-q_len // tile)
    kv_tiles = -(-(context_len + q_len) // tile)
    ranges = context_ranges(anchors=anchors, anchor_keep=anchor_keep, doc_ids=doc_ids, window=window)
    lo, hi = (bound.long() for bound in ranges)  # int64: they become scatter indices below
    q_tile = torch.arange(q_tiles, device=device)
    first = (q_tile * tile) // block_size  # [Qt]: blocks [first, last] hold the queries of query tile i
    last = torch.clamp((q_tile * tile + tile - 1) // block_size, max=num_blocks - 1)
    block_start = torch.arange(num_blocks, device=device) * block_size  # [N]: first query of each block
    # A block belongs to the query tiles of its first and its last query (the same one unless it straddles), with
    # its slots [first_slot, last_slot] there: all B, or those before / from the tile boundary.
    tile_of_block = [block_start // tile, (block_start + block_size - 1) // tile]
    first_slot = [torch.zeros_like(block_start), torch.clamp(tile_of_block[1] * tile - block_start, min=0)]
    last_slot = [
        torch.clamp((tile_of_block[0] + 1) * tile - block_start, max=block_size) - 1,
        torch.full_like(block_start, block_size - 1),
    ]

    def context_start(slot: Tensor) -> Tensor:
        """[N] slots -> [R, N]: the first context key each block's query at that slot sees (hi: none)."""
        if window is None:
            return lo
        return torch.minimum(torch.maximum(lo, hi - (window - 1) + slot), hi)

    def covering(bounds: list[tuple[Tensor, Tensor, Tensor]]) -> Tensor:
        """[R, Qt, KVt] int32: blocks of each query tile whose key-tile range [first_tile, last_tile] (one per query
        tile of the block, in `tile_of_block` order; counted where `present`) covers key tile j."""
        diff = torch.zeros(rows, q_tiles, kv_tiles + 1, dtype=torch.int32, device=device)
        for k, (query_tile, (first_tile, last_tile, present)) in enumerate(zip(tile_of_block, bounds, strict=True)):
            weight = present.to(torch.int32)
            if k == 1:  # count a straddling block in its second query tile too, and no other block twice
                weight = weight * (query_tile != tile_of_block[0]).to(torch.int32)
            base = query_tile * (kv_tiles + 1)  # [N]
            flat = diff.view(rows, -1)
            flat.scatter_add_(1, base + first_tile, weight)
            flat.scatter_add_(1, base + torch.clamp(last_tile + 1, min=0), -weight)
        return diff.cumsum(dim=-1)[..., :kv_tiles]

    touched, whole = [], []
    for k in range(2):
        touch_lo = context_start(first_slot[k])  # the widest range among the block's slots in that query tile
        touched.append((touch_lo // tile, (hi - 1) // tile, touch_lo < hi))
        full_lo = context_start(last_slot[k])  # the narrowest
        full_first, full_last = -(-full_lo // tile), torch.clamp(hi // tile, max=context_len // tile) - 1
        whole.append((full_first, full_last, (full_lo < hi) & (full_first <= full_last)))
    touched_tiles = covering(touched) > 0
    members = (last - first + 1).view(1, q_tiles, 1)
    complete_q = ((q_tile + 1) * tile <= q_len).view(1, q_tiles, 1)
    full_tiles = (covering(whole) == members) & complete_q
    # Own-block keys of query tile i: T + [first * B, (last + 1) * B), with a window those within W - 1 slots of
    # one of its queries [q0, q1] (the union of the queries' ranges is contiguous: each holds the query's own key).
    own_first, own_last = first * block_size, (last + 1) * block_size - 1  # [Qt], block-key indices
    if window is not None:
        own_first = torch.maximum(own_first, q_tile * tile - (window - 1))
        own_last = torch.minimum(own_last, torch.clamp(q_tile * tile + tile, max=q_len) - 1 + (window - 1))
    own_lo, own_hi = (context_len + own_first) // tile, (context_len + own_last) // tile
    kv_tile = torch.arange(kv_tiles, device=device)
    own = (kv_tile >= own_lo.unsqueeze(-1)) & (kv_tile <= own_hi.unsqueeze(-1))  # [Qt, KVt]
    partial = (touched_tiles | own) & ~full_tiles
    kv_num_blocks, kv_indices = ordered_tiles(partial)
    full_kv_num_blocks, full_kv_indices = ordered_tiles(full_tiles)
    return TileTables(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, *ranges, tile=tile)


def mask_tables(
    *,
    anchors: Tensor,
    anchor_keep: Tensor,
    doc_ids: Tensor,
    block_size: int,
    variants: list[MaskVariant] | tuple[MaskVariant, ...],
    tile: int = TILE,
) -> dict[MaskVariant, TileTables]:
    """`tile_tables` per layer variant. Variants of one window share them: they are the tables of the
    bidirectional block, which contains the causal one. The in-block causality empties no tile, except where a
    block straddles two query tiles: a key tile holding only its later slots may then be empty for the earlier
    query tile, and stays listed as partial (correct, the `mask_mod` hides it; never when B divides the tile)."""
    by_window: dict[int | None, TileTables] = {}
    for variant in dict.fromkeys(variants):
        if variant.window not in by_window:
            by_window[variant.window] = tile_tables(
                anchors=anchors,
                anchor_keep=anchor_keep,
                doc_ids=doc_ids,
                block_size=block_size,
                window=variant.window,
                tile=tile,
            )
    return {variant: by_window[variant.window] for variant in dict.fromkeys(variants)}


def block_mask_from_tables(tables: TileTables, mask_mod: MaskMod, *, q_len: int, kv_len: int):
    """A flex BlockMask from precomputed tables (a few small device ops for the transposed tables; no sync)."""
    from torch.nn.attention.flex_attention import BlockMask

    return BlockMask.from_kv_blocks(
        tables.kv_num_blocks,
        tables.kv_indices,
        tables.full_kv_num_blocks,
        tables.full_kv_indices,
        BLOCK_SIZE=tables.tile,
        mask_mod=mask_mod,
        seq_lengths=(q_len, kv_len),
    )


@dataclass
class DrafterMasks:
    """Masks for one batch, one per layer variant, shared by all layers of that variant."""

    backend: Backend
    by_variant: dict[MaskVariant, object]

    def for_variant(self, variant: MaskVariant) -> object:
        return self.by_variant[variant]


def build_masks(
    *,
    anchors: Tensor,
    anchor_keep: Tensor,
    doc_ids: Tensor,
    block_size: int,
    variants: list[MaskVariant] | tuple[MaskVariant, ...],
    backend: Backend,
    builder: MaskBuilder = "anchors",
    tables: dict[MaskVariant, TileTables] | None = None,
    tile: int = TILE,
) -> DrafterMasks:
    """One mask per variant. flex: from `tables` (precomputed by the data stage) or tables computed here from
    the anchors (`builder` "anchors"), or by `create_block_mask` ("mask_mod"), in tiles of `tile` (precomputed
    tables carry their own); sdpa: dense. The `mask_mod` reads the context ranges of `tables` when given (no kernel
    on the step's hot path), else computes them here (the dense path, tests, decoding)."""
    rows, num_blocks = anchors.shape
    context_len = doc_ids.shape[1]
    q_len = num_blocks * block_size
    kv_len = context_len + q_len
    if backend == "flex" and builder == "anchors" and tables is None:
        tables = mask_tables(
            anchors=anchors,
            anchor_keep=anchor_keep,
            doc_ids=doc_ids,
            block_size=block_size,
            variants=variants,
            tile=tile,
        )
    ranges: dict[int | None, tuple[Tensor, Tensor]] = {}
    built: dict[MaskVariant, object] = {}
    for variant in dict.fromkeys(variants):
        if tables is not None:
            ranges[variant.window] = tables[variant].lo, tables[variant].hi
        elif variant.window not in ranges:
            ranges[variant.window] = context_ranges(
                anchors=anchors, anchor_keep=anchor_keep, doc_ids=doc_ids, window=variant.window
            )
        mask_mod = mask_from_ranges(
            *ranges[variant.window],
            block_size=block_size,
            context_len=context_len,
            window=variant.window,
            causal_in_block=variant.causal_in_block,
        )
        if backend == "sdpa":
            built[variant] = dense_mask(mask_mod, rows=rows, q_len=q_len, kv_len=kv_len, device=anchors.device)
        elif builder == "anchors":
            assert tables is not None
            built[variant] = block_mask_from_tables(tables[variant], mask_mod, q_len=q_len, kv_len=kv_len)
        else:
            built[variant] = block_mask(
                mask_mod, rows=rows, q_len=q_len, kv_len=kv_len, device=anchors.device, tile=tile
            )
    return DrafterMasks(backend=backend, by_variant=built)


# Query and key lengths that flex's kernels may take as whole tiles: Inductor tests lengths against 128 to set the
# kernels' IS_DIVISIBLE (no bounds check on any load or store), which it can only prove for static sizes. The
# compiled layers run with symbolic sizes, so flex bounds-checked everything: 48.6 against 33.8 ms per step of
# five layers at the paper shape, forward and backward (benchmarks/flex_kernel_bench.py --layouts, 2026-12-01).
# The data stage pads rows and anchor slots to whole buckets (GPU defaults: 128 tokens, 16 anchors), so with blocks
# of 8 or 16 the lengths are multiples of 128 (other block sizes keep the checked kernels); `attend` checks it per
# call, which under dynamo is one guard on the symbolic sizes (a batch that breaks it compiles the checked variant
# once, never runs the unchecked one).
WHOLE_TILES = 128


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: object | None,
    backend: Backend,
    scale: float,
    kernel_options: dict[str, int | bool] | None = None,
) -> Tensor:
    """q [R, Hq, Q, D], k/v [R, Hkv, KV, D] -> [R, Hq, Q, D]. `mask` None means every query sees every key.
    `kernel_options` go to flex_attention's kernels (tiles, warps, stages: speed only); SDPA has none."""
    enable_gqa = q.shape[1] != k.shape[1]
    # Under autocast the projections give bf16 while norms/rope may give fp32: attend in the value dtype.
    q, k = q.to(v.dtype), k.to(v.dtype)
    if backend == "flex" and mask is not None:
        from torch.nn.attention.flex_attention import flex_attention

        # Eager flex_attention is a slow reference implementation: compile it on CUDA, unless we already are
        # inside a compiled region (compiled drafter layers), which compiles it with the rest.
        compile_here = q.device.type == "cuda" and not torch.compiler.is_compiling()
        fn = compiled_flex_attention() if compile_here else flex_attention
        options = dict(kernel_options or {})
        if q.shape[-2] % WHOLE_TILES == 0 and k.shape[-2] % WHOLE_TILES == 0:
            options["IS_DIVISIBLE"] = True
        return fn(q, k, v, block_mask=mask, scale=scale, enable_gqa=enable_gqa, kernel_options=options or None)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)


def resolve_backend(requested: str, device: torch.device) -> Backend:
    """`auto` -> flex on CUDA, SDPA elsewhere (flex has no backward on CPU)."""
    if requested == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    if requested not in ("flex", "sdpa"):
        raise ValueError(f"unknown attention backend {requested!r}")
    return cast(Backend, requested)
