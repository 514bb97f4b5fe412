"""Stop signals: deferred to the end of the step while training, immediate before it."""

from __future__ import annotations

import os
import signal

import pytest

from dflash_trainer.errors import InterruptedAfterTraining, describe_interrupt
from dflash_trainer.launch import StopFlag


def test_signal_before_training_interrupts_at_once(restore_handlers):
    stop = StopFlag().install()
    with pytest.raises(KeyboardInterrupt, match="SIGTERM before training"):
        os.kill(os.getpid(), signal.SIGTERM)
    assert not stop.requested


def test_signal_during_training_sets_the_flag(restore_handlers):
    stop = StopFlag().install()
    assert stop() is False  # the trainer's first poll arms the flag
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop() is True and stop.signal_name == "SIGTERM"


def test_signal_after_training_interrupts_at_once_and_says_what_is_left(restore_handlers):
    stop = StopFlag().install()
    assert stop() is False
    stop.training_done("evaluate with `dflash-trainer eval --drafter runs/x/export`")
    with pytest.raises(InterruptedAfterTraining, match="SIGTERM after training") as raised:
        os.kill(os.getpid(), signal.SIGTERM)
    assert not stop.requested
    line = describe_interrupt(raised.value)
    assert "dflash-trainer eval --drafter runs/x/export" in line and "run the same command" not in line
    assert "run the same command again" in describe_interrupt(KeyboardInterrupt())
