"""torch.compile with symbolic sizes, for code that meets a new batch shape every few steps.

Contract: `compile_dynamic(fn)` is `torch.compile(fn, dynamic=True)` after `keep_sizes_apart()`. The project's
compiles with symbolic sizes from the first call go through one of the two (the drafter's layers and norms, its
FP8 context projection, the target's decoder layers, the drafter's block-mask builder, the FP8 quantizer);
`flex.py`'s compiled flex attention (`dynamic=None`, symbolic after its first recompile) is covered by the
process-wide switch once either has run.
The compiled code then serves later shapes without a recompile whichever sizes happened to be equal in the first
call. Sizes 0 and 1 are still specialised (dynamo always does): a first batch of one row compiles once more at two.

Why `keep_sizes_apart`: by default dynamo "duck-sizes": two sizes that are equal in the first call get one symbol,
and the compiled code guards on their equality. A training batch whose anchor slots happen to equal its row length
(96 and 96 in the GPU recompile test) then compiles again at the first batch where they differ: on the paper
setting a recompile of the drafter costs 10-40 s. With duck sizing off every size is its own symbol; the guards
are a few more integer comparisons. The switch is process-wide (`torch.fx.experimental._config.use_duck_shape`),
which is what a training process wants for all of its compiled code.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx.experimental._config as fx_config


def keep_sizes_apart() -> None:
    """Turns dynamo's duck sizing off for every later compile in this process (module docstring)."""
    fx_config.use_duck_shape = False


def compile_dynamic(fn: Callable, *, backend: str = "inductor", mode: str | None = None) -> Callable:
    """`fn` compiled with symbolic sizes from the first call, each size its own symbol; `mode` is Inductor's
    (None: its default)."""
    keep_sizes_apart()
    return torch.compile(fn, dynamic=True, backend=backend, mode=mode)
