"""What the drafter's block masks (`model/attention.py`) and the target's document masks (`targets/attention.py`)
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

from .compiling import configure_compiler

# flex_attention's sparse tile (queries x keys) of a BlockMask.
TILE = 128


def ordered_tiles(selected: Tensor) -> tuple[Tensor, Tensor]:
    """bool `[R, Qt, KVt]` -> (count `[R, 1, Qt]` int32, key-tile indices `[R, 1, Qt, KVt]` int32 with the selected
    tiles first, ascending)."""
    count = selected.sum(dim=-1, dtype=torch.int32)
    order = torch.argsort(selected.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return count.unsqueeze(1), order.unsqueeze(1)


@cache
def compiled_flex_attention() -> Callable:
    """flex_attention compiled once per process (eager flex is a slow reference implementation). dynamic=None: the
    first shape change recompiles with symbolic sizes instead of once per shape."""
    from torch.nn.attention.flex_attention import flex_attention

    configure_compiler()
    return torch.compile(flex_attention, dynamic=None)
