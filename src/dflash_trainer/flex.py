"""What the drafter's block masks (`model/attention.py`) and the target's document masks (`target/attention.py`)
share about flex_attention: its tile size, tile tables in the order a `BlockMask` wants, and the compiled kernel.

A `BlockMask` describes, per query tile of `TILE` queries, which key tiles to evaluate (partial: the `mask_mod` is
applied inside) and which are visible whole (full: no `mask_mod`): a count per query tile and the key-tile indices,
the selected ones first in ascending order. Both mask builders compute a bool `[R, Qt, KVt]` selection with tensor
ops (no pass over queries x keys, no host sync) and turn it into that form with `ordered_tiles`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch
from torch import Tensor

# flex_attention's sparse tile (queries x keys) of a BlockMask.
TILE = 128


def ordered_tiles(selected: Tensor) -> tuple[Tensor, Tensor]:
    """bool `[R, Qt, KVt]` -> (count `[R, 1, Qt]` int32, key-tile indices `[R, 1, Qt, KVt]` int32 with the selected
    tiles first, ascending)."""
    count = selected.sum(dim=-1, dtype=torch.int32)
    order = torch.argsort(selected.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return count.unsqueeze(1), order.unsqueeze(1)


# flex_attention's kernel options (torch's `FlexKernelOptions`) that change how fast its kernels run and never what
# they compute: tiles (powers of two), warps, pipeline stages, and flags that are true of every drafter mask or
# move work between loops. Left out on purpose: PRESCALE_QK (rounds differently), BLOCKS_ARE_CONTIGUOUS (false
# here: a query tile visits its context tiles and, far from them, its own block's), the backend switches.
_TILE_OPTIONS = ("BLOCK_M", "BLOCK_N", "BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2")
_COUNT_OPTIONS = ("num_warps", "num_stages")
# Every drafter query sees at least its own block slot (mask_from_ranges), so no row is fully masked.
_FLAG_OPTIONS = ("ROWS_GUARANTEED_SAFE", "WRITE_DQ", "USE_TMA")
KERNEL_OPTIONS = _TILE_OPTIONS + _COUNT_OPTIONS + _FLAG_OPTIONS


def flex_kernel_option_problem(name: str, value: object) -> str | None:
    """What is wrong with kernel option `name` = `value` (None: nothing). Names may carry torch's `fwd_` or `bwd_`
    prefix, which applies them to one direction only."""
    base = name.removeprefix("fwd_").removeprefix("bwd_")
    if base not in KERNEL_OPTIONS:
        known = ", ".join(KERNEL_OPTIONS)
        return f"unknown or unsupported flex kernel option (known, optionally fwd_/bwd_-prefixed: {known})"
    if base in _FLAG_OPTIONS:
        return None if isinstance(value, bool) else f"must be true or false, got {value!r}"
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return f"must be a positive integer, got {value!r}"
    # At most 128: lengths that are multiples of 128 are whole tiles (model/attention.py: WHOLE_TILES).
    if base in _TILE_OPTIONS and (not 16 <= value <= 128 or value & (value - 1)):
        return f"must be a power of two from 16 to 128, got {value}"
    return None


@cache
def compiled_flex_attention() -> Callable:
    """flex_attention compiled once per process (eager flex is a slow reference implementation). dynamic=None: the
    first shape change recompiles with symbolic sizes instead of once per shape."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=None)
