"""Process-level concerns above the trainer: stop signals, and starting several ranks through torchrun.

SIGINT/SIGTERM do not kill the process: they set a flag the trainer checks after each optimizer step, so the
step in flight finishes, a checkpoint is written, and the process exits 0. A second signal exits at once.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType


class StopFlag:
    """Set by SIGINT/SIGTERM; `__call__` tells whether a stop was requested."""

    def __init__(self) -> None:
        self.requested = False
        self.signal_name: str | None = None

    def __call__(self) -> bool:
        return self.requested

    def install(self) -> StopFlag:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.requested:
            print(f"{name} again: exiting without a checkpoint", file=sys.stderr, flush=True)
            os._exit(130)
        self.requested = True
        self.signal_name = name
        print(f"{name}: finishing this step, writing a checkpoint, then exiting", file=sys.stderr, flush=True)


def torchrun_command(nproc: int, argv: list[str]) -> list[str]:
    """`dflash-trainer train --nproc N ...` re-executes itself under torchrun with N local ranks."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "dflash_trainer",
        *argv,
    ]
