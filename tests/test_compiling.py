"""compiling.py: compiles with symbolic sizes do not turn the first call's coincident sizes into guards (CPU)."""

import torch
import torch.fx.experimental._config as fx_config
from torch._dynamo.utils import counters

from dflash_trainer.compiling import compile_dynamic
from dflash_trainer.model.drafter import DFlashDrafter
from model_helpers import tiny_drafter_config


def test_equal_sizes_in_the_first_call_do_not_force_a_recompile_later():
    # The GPU recompile test's case: a first batch whose anchor slots equal its row length (96 and 96), then one
    # where they differ. Duck sizing (torch's default) would give both one symbol and compile again.
    def step(blocks: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return blocks.sum(dim=1) + tokens.sum(dim=1)

    with fx_config.patch(use_duck_shape=True):  # torch's default; restored on exit
        torch._dynamo.reset()
        counters.clear()
        compiled = compile_dynamic(step, backend="eager")
        for slots in (96, 96, 128, 160):
            compiled(torch.randn(2, slots), torch.randn(2, 96))
        assert counters["frames"]["ok"] == 1
    torch._dynamo.reset()


def test_torch_default_duck_sizing_would_recompile():
    # What the test above guards against, so that it cannot pass for a reason other than compile_dynamic's switch.
    def step(blocks: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return blocks.sum(dim=1) + tokens.sum(dim=1)

    with fx_config.patch(use_duck_shape=True):
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(step, dynamic=True, backend="eager")
        for slots in (96, 96, 128):
            compiled(torch.randn(2, slots), torch.randn(2, 96))
        assert counters["frames"]["ok"] == 2
    torch._dynamo.reset()


def test_compiling_the_drafter_layers_keeps_sizes_apart():
    with fx_config.patch(use_duck_shape=True):
        DFlashDrafter(tiny_drafter_config()).compile_layers()  # lazy: nothing compiles until a call
        assert fx_config.use_duck_shape is False
