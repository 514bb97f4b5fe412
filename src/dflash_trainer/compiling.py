"""torch.compile with symbolic sizes, for code that meets a new batch shape every few steps; the process-wide
compiler settings every compile of this project wants.

Contract: `compile_dynamic(fn)` is `torch.compile(fn, dynamic=True)` after `configure_compiler()`. The project's
compiles with symbolic sizes from the first call go through one of the two (the drafter's layers and norms, its
FP8 context projection, the target's decoder layers, the drafter's block-mask builder, the FP8 quantizer);
`flex.py`'s compiled flex attention (`dynamic=None`, symbolic after its first recompile) and the losses' static
per-chunk functions call `configure_compiler()` before their `torch.compile`.
The compiled code then serves later shapes without a recompile whichever sizes happened to be equal in the first
call. Sizes 0 and 1 are still specialised (dynamo always does): a first batch of one row compiles once more at two.

Why `keep_sizes_apart`: by default dynamo "duck-sizes": two sizes that are equal in the first call get one symbol,
and the compiled code guards on their equality. A training batch whose anchor slots happen to equal its row length
(96 and 96 in the GPU recompile test) then compiles again at the first batch where they differ: on the paper
setting a recompile of the drafter costs 10-40 s. With duck sizing off every size is its own symbol; the guards
are a few more integer comparisons. The switch is process-wide (`torch.fx.experimental._config.use_duck_shape`),
which is what a training process wants for all of its compiled code.

Why `keep_compile_workers`: Inductor compiles Triton kernels in a pool of worker processes that a sidecar process
forks. By default (torch 2.11-2.13) the sidecar shuts its pool down after 60 s without a compile ("quiesce") and
forks a new one at the next compile. The old pool's threads outlive the shutdown, so the new workers are forked from a
process with live threads, and one can deadlock in its first import (seen on an H200, torch 2.11: a worker stuck in
the old executor's `weakref_cb`, a futex never released). The compiling process then waits for that worker's kernel
forever: a recompile or a compile of a new piece minutes into a run (the main job's drafter layers at step ~770)
hung the run, no output, GPU idle. Kept alive, the pool is forked once, at the first compile, before any such
thread exists; the price is its idle worker processes for the life of the process. `configure_compiler` sets these
switches and asks dynamo to log why it recompiles a frame (`recompiles`: one line naming the failed guard, only when
it happens; `TORCH_LOGS` overrides it), so a recompile mid-run says what changed.

Why `no_mix_order_fusion`: Inductor fuses two sibling reductions that run along different axes of one tensor (an
RMSNorm's backward: the input grad per row, the weight grad over rows) into one "mix-order" kernel only above a
size (rows x columns >= 5 Mi elements, rows >= 4096, rows >= 2 x columns), and with symbolic sizes it decides by
putting a guard on the first batch's sizes. A later batch on the other side of the line compiles the frame again:
the DFlash2 main job's drafter layers at step ~780 (`192*x.size()[0]*x.size()[1] >= 5242880`, a batch of fewer
block tokens, 26 s), its DFlash layer frame at step ~2,780 (`576*...`), both logged on an H200 with torch 2.11.
The fusion is turned off (`triton.mix_order_reduction`): its check then returns before any size is looked at, so
no guard. Not the "non-strict" switch that skips only the size checks: with it, small static graphs get the fused
kernel too, and DFlash2's selector chunk (float64 sums of [512, 15] per-slot counts beside row reductions) came out
wrong on an H100 with torch 2.11 (selector accuracy 25.3, recall below 0, different in every step) while its loss
stayed right (most likely: the fused kernel keeps its partial sums in a float32 workspace, these sums are float64;
its size checks would never have picked a graph that small). What the fusion saved is one extra read of a norm's
input and output gradient in its backward: by the bytes (2-8 GB per step over the drafter's norms, at 3-5 TB/s)
about 1-2 ms, under 1 % of the main job's and the paper setting's step.
A torch without the switch keeps its fusion and guards.

"Process-wide" holds for the thread that compiles: torch 2.13 keeps these configs per thread (a new thread starts
from the defaults). Every compile of the project runs on the main thread (the batch prefetcher's worker does host
work only), which is where `configure_compiler` runs.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import cache

import torch
import torch._inductor.config as inductor_config
import torch.fx.experimental._config as fx_config


def keep_sizes_apart() -> None:
    """Turns dynamo's duck sizing off for every later compile in this process (module docstring)."""
    fx_config.use_duck_shape = False


def keep_compile_workers() -> None:
    """Keeps Inductor's compile workers alive for the life of the process instead of quiescing them when idle
    (module docstring). Takes effect if called before the process's first Inductor compile creates the pool; a
    `TORCHINDUCTOR_QUIESCE_ASYNC_COMPILE_POOL` in the environment overrides it. A torch without the switch has no
    quiescing."""
    if hasattr(inductor_config, "quiesce_async_compile_pool"):
        inductor_config.quiesce_async_compile_pool = False


def no_mix_order_fusion() -> None:
    """Inductor's mix-order reduction fusion off, and with it its guards on the sizes (module docstring)."""
    triton_config = inductor_config.triton
    if hasattr(triton_config, "mix_order_reduction"):
        triton_config.mix_order_reduction = False


def configure_compiler() -> None:
    """The process-wide settings every compile of this project wants, called before compiling: sizes kept apart,
    compile workers kept alive, no mix-order fusion (nor its size guards), recompiles logged with their reason.
    Idempotent."""
    keep_sizes_apart()
    keep_compile_workers()
    no_mix_order_fusion()
    _log_recompiles()


@cache
def _log_recompiles() -> None:
    """Once per process: `set_logs` resets every other log setting, so a second call would undo a user's own."""
    if "TORCH_LOGS" not in os.environ:  # where it is set, the user's choice wins (set_logs would warn and do nothing)
        torch._logging.set_logs(recompiles=True)


def compile_dynamic(fn: Callable, *, backend: str = "inductor", mode: str | None = None) -> Callable:
    """`fn` compiled with symbolic sizes from the first call, each size its own symbol; `mode` is Inductor's
    (None: its default)."""
    configure_compiler()
    return torch.compile(fn, dynamic=True, backend=backend, mode=mode)
