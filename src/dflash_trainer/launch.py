"""Process-level concerns above the trainer: stop signals, starting ranks through torchrun, failure propagation.

One rank (`train_rank`): SIGINT/SIGTERM do not kill the process: they set a flag the trainer checks after each
optimizer step, so the step in flight finishes, the ranks agree to stop, a checkpoint is written (drafter rank 0
in the disaggregated placement, rank 0 otherwise) and the process exits 0. A second signal exits at once. An
exception on any rank fails the whole job within seconds with its traceback printed once
(`distributed/failure.py`).

Several local ranks (`run_torchrun`, behind `dflash-trainer train --nproc N`): torchrun starts N ranks; it runs
in its own session so a Ctrl-C in the terminal reaches only this launcher, which forwards the first SIGINT,
SIGTERM or SIGHUP (as SIGTERM: a closed terminal stops the run with a checkpoint) to torchrun exactly once
(torchrun passes it on to every rank; a second signal sent to torchrun itself would abort its shutdown and leave
the ranks behind). torchrun gives the ranks its shutdown timeout (30 s,
`--shutdown-timeout` / TORCH_ELASTIC_SHUTDOWN_TIMEOUT) to finish the step and write the checkpoint before it
kills them; raise it for drafters whose checkpoint takes longer. torchrun reports its own stop signal as a
failure (exit status 1 and a SignalException traceback) even when every rank stopped cleanly.

Several machines: run torchrun on each with the usual rendezvous, e.g.
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST0:29400 --rdzv-id JOB \\
        -m dflash_trainer train RECIPE [key=value ...]
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from types import FrameType

from .config import RunConfig


class StopFlag:
    """Set by SIGINT/SIGTERM; `__call__` tells whether a stop was requested.

    The flag defers a signal only once the trainer polls it (after each optimizer step). Before that first
    poll (loading the target, regenerating and tokenising data) nobody would ever look at it, so a signal
    interrupts at once with KeyboardInterrupt; those stages resume by themselves when the command is rerun.
    """

    def __init__(self) -> None:
        self.requested = False
        self.signal_name: str | None = None
        self.polled = False

    def __call__(self) -> bool:
        self.polled = True
        return self.requested

    def install(self) -> StopFlag:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if not self.polled:
            raise KeyboardInterrupt(f"{name} before training started")
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


def run_torchrun(nproc: int, argv: list[str]) -> int:
    """Run `argv` on `nproc` local ranks under torchrun; forward the first stop signal; return its status."""
    proc = subprocess.Popen(torchrun_command(nproc, argv), start_new_session=True)
    forwarded: list[str] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if forwarded:
            print(
                f"launcher: {name} again: already stopping (torchrun kills ranks still running after its "
                "shutdown timeout)",
                file=sys.stderr,
                flush=True,
            )
            return
        forwarded.append(name)
        print(f"launcher: {name}: passing it to the ranks through torchrun", file=sys.stderr, flush=True)
        # The ranks checkpoint on SIGINT/SIGTERM only; SIGHUP would end them without one.
        proc.send_signal(signal.SIGTERM if signum == signal.SIGHUP else signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        status = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if forwarded:
        print(
            f"launcher: stopped by {forwarded[0]}; torchrun exit status {status}. The ranks' output above says "
            "where the checkpoint is; the same command resumes from it.",
            file=sys.stderr,
            flush=True,
        )
    return status


def train_rank(config: RunConfig, command: str | None = None) -> int:
    """One rank's whole training job: stop signals, the process group, failure propagation, the pipeline.
    `command`: the command line, recorded in the export's model card."""
    from .distributed.failure import FailureChannel
    from .distributed.world import init_world, shutdown_world
    from .train.pipeline import run_training

    stop = StopFlag().install()
    world = init_world(config.target.device, timeout_s=config.placement.timeout_s)
    failures = FailureChannel.connect(world, label=f"rank {world.rank}")
    failures.run(lambda: run_training(config, should_stop=stop, world=world, command=command))
    # Only reached when every rank's training returned: a failure ends the process inside `run`.
    shutdown_world(world)
    return 0
