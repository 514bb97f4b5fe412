"""train/stall.py: a training process that stops making progress prints every thread's stack (CPU, ~4 s)."""

import time

import pytest

from dflash_trainer.train.stall import StallReport


def test_a_stall_prints_every_threads_stack_and_goes_on(capfd):
    with StallReport(1.0):
        time.sleep(1.6)  # no beat: the dump is due after 1 s
    err = capfd.readouterr().err
    assert "stall: no training progress for" in err
    assert "most recent call first" in err and "test_stall.py" in err  # the stuck frame is named
    assert err.index("most recent call first") < err.index("stall:")  # named once the stacks are out


def test_beats_keep_it_quiet_and_leaving_the_block_disarms_it(capfd):
    with StallReport(1.0) as stall:
        for _ in range(6):  # 1.8 s in all, never 1 s without a beat
            time.sleep(0.3)
            stall.beat()
    time.sleep(1.3)  # past the last beat's deadline, outside the block
    assert capfd.readouterr().err == ""


def test_zero_turns_it_off(capfd):
    with StallReport(0.0):
        time.sleep(0.3)
    assert capfd.readouterr().err == ""
    for bad in (-1.0, 0.5):
        with pytest.raises(ValueError, match="timeout_s"):
            StallReport(bad)
