"""compiling.py: compiles with symbolic sizes do not turn the first call's coincident sizes into guards; the compile
workers stay alive; a recompile says why (CPU)."""

import logging

import torch
import torch._inductor.config as inductor_config
import torch.fx.experimental._config as fx_config
from torch._dynamo.utils import counters

from dflash_trainer.compiling import _log_recompiles, compile_dynamic
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


def test_compiling_keeps_the_compile_workers_alive(monkeypatch):
    # Inductor's default quiesces its compile workers when idle and forks new ones at the next compile, which can
    # deadlock (compiling.py); every compile path of the project turns that off before its first compile.
    monkeypatch.delenv("TORCHINDUCTOR_QUIESCE_ASYNC_COMPILE_POOL", raising=False)  # it would override the setting
    with inductor_config.patch(quiesce_async_compile_pool=True):  # torch's default; restored on exit
        DFlashDrafter(tiny_drafter_config()).compile_layers()
        assert inductor_config.quiesce_async_compile_pool is False
    with inductor_config.patch(quiesce_async_compile_pool=True):
        compile_dynamic(torch.sin, backend="eager")
        assert inductor_config.quiesce_async_compile_pool is False


def test_compiling_turns_the_fusion_with_size_guards_off():
    # Inductor's mix-order reduction fusion otherwise guards on the first batch's sizes, and a later batch across its
    # size line recompiles the drafter's layers (compiling.py: seen at steps ~780 and ~2,780 of a GPU main job); its
    # non-strict mode, without the guards, summed the selector's metrics wrong on a GPU, so the fusion is off.
    default = {"triton.mix_order_reduction": True, "triton.mix_order_reduction_non_strict_mode": False}
    with inductor_config.patch(default):
        DFlashDrafter(tiny_drafter_config()).compile_layers()
        assert inductor_config.triton.mix_order_reduction is False
        assert inductor_config.triton.mix_order_reduction_non_strict_mode is False
    with inductor_config.patch(default):
        compile_dynamic(torch.sin, backend="eager")
        assert inductor_config.triton.mix_order_reduction is False


def test_a_recompile_is_logged_with_the_guard_that_failed(caplog, monkeypatch):
    # caplog, not capfd: the handlers set_logs makes keep the stream they were made with, which capfd closes.
    monkeypatch.delenv("TORCH_LOGS", raising=False)
    _log_recompiles.cache_clear()  # set_logs runs again, in this test
    torch._dynamo.reset()
    try:
        compiled = compile_dynamic(lambda x: x * 2, backend="eager")
        with caplog.at_level(logging.DEBUG):
            compiled(torch.ones(3))
            assert "Recompiling" not in caplog.text  # a first compile is not a recompile
            compiled(torch.ones(3, dtype=torch.float64))  # a dtype guard fails: compiled again
        assert "Recompiling function" in caplog.text and "dtype" in caplog.text
    finally:
        torch._dynamo.reset()
