"""Stop signals: deferred to the end of the step while training, immediate before it."""

from __future__ import annotations

import os
import signal

import pytest

from dflash_trainer.launch import StopFlag


@pytest.fixture
def restore_handlers():
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


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
