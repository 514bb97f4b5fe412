"""Process-level concerns above the trainer: stop signals, starting ranks through torchrun, failure propagation.

One rank (`train_rank`): SIGINT/SIGTERM do not kill the process: they set a flag the trainer checks after each
optimizer step, so the step in flight finishes, the ranks agree to stop, a checkpoint is written (drafter rank 0
in the disaggregated placement, rank 0 otherwise) and the process exits 0. A second signal exits at once. An
exception on any rank fails the whole job within seconds with its traceback printed once
(`distributed/failure.py`).

Several local ranks (`run_torchrun`, behind `dflash-trainer train --nproc N`): the command line's checks run
first, here (cli.py: the recipe, run directory, `--resume`, GPUs for N ranks), so a mistake is one line and
torchrun never starts. torchrun then starts N ranks; it runs in its own session so a Ctrl-C in the terminal
reaches only this launcher, which passes the first SIGINT, SIGTERM or SIGHUP (as SIGTERM: a closed terminal
stops the run with a checkpoint) straight to the ranks, torchrun's children: they stop as one process does (a
checkpoint, or at once before training) and torchrun sees them end by themselves, so it prints nothing and
exits 0 (a signal sent to torchrun instead makes it print a SignalException traceback and exit 1 even when every
rank stopped cleanly). A second signal is passed on too: the ranks exit at once, without a checkpoint. Before
the ranks exist the signal goes to torchrun.

Exit status: the launcher's is the job's. The first rank to fail writes its status (2 for a user error, 130
for an interrupt, 1 for a bug; distributed/failure.py) into a file the launcher names in the environment, and
then every rank exits 0, so that torchrun adds no report of its own to the rank's one line; the launcher
returns the recorded status, else torchrun's.
`regenerate --nproc N` starts its ranks the same way; each runs `run_rank`.

Several machines: run torchrun on each with the usual rendezvous, e.g.
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST0:29400 --rdzv-id JOB \\
        -m dflash_trainer train RECIPE [key=value ...]
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from .config import RunConfig
from .errors import InterruptedAfterTraining

if TYPE_CHECKING:
    from .distributed.world import World

# Collective timeout of the process group of `run_rank` (the jobs' long waits use groups of their own).
RANK_TIMEOUT_S = 120.0


class StopFlag:
    """Set by SIGINT/SIGTERM; `__call__` tells whether a stop was requested.

    The flag defers a signal only once the trainer polls it (after each optimizer step). Before that first
    poll (loading the target, regenerating and tokenising data) nobody would ever look at it, so a signal
    interrupts at once with KeyboardInterrupt; those stages resume by themselves when the command is rerun.
    After training (`training_done`: the checkpoint and the export written) nobody polls it either, so a signal
    interrupts at once again, with `InterruptedAfterTraining` naming what is left to run by hand, instead of
    announcing a checkpoint and leaving the end-of-run evaluation to run on for minutes.
    """

    def __init__(self) -> None:
        self.requested = False
        self.signal_name: str | None = None
        self.polled = False
        self.left_to_run: str | None = None  # set by `training_done`

    def training_done(self, left_to_run: str) -> None:
        """From here a signal interrupts at once; `left_to_run` says how to do what the interrupt skips."""
        self.left_to_run = left_to_run

    def __call__(self) -> bool:
        self.polled = True
        return self.requested

    def install(self) -> StopFlag:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.left_to_run is not None:
            raise InterruptedAfterTraining(
                f"{name} after training; the checkpoint and export are written; {self.left_to_run}"
            )
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
    """Run `argv` on `nproc` local ranks under torchrun; pass stop signals to the ranks; return the job's status
    (module docstring)."""
    from .distributed.failure import STATUS_FILE_ENV

    descriptor, status_file = tempfile.mkstemp(prefix="dflash-trainer-status-")
    os.close(descriptor)
    env = {**os.environ, STATUS_FILE_ENV: status_file}
    proc = subprocess.Popen(torchrun_command(nproc, argv), start_new_session=True, env=env)
    forwarded: list[str] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        # The ranks checkpoint on SIGINT/SIGTERM only; SIGHUP would end them without one.
        sent = signal.SIGTERM if signum == signal.SIGHUP else signal.Signals(signum)
        ranks = child_pids(proc.pid)
        if forwarded:
            print(f"launcher: {name} again: the ranks exit now, without a checkpoint", file=sys.stderr, flush=True)
        else:
            print(f"launcher: {name}: passing it to the ranks", file=sys.stderr, flush=True)
        forwarded.append(name)
        for pid in ranks or [proc.pid]:  # no ranks yet: torchrun stops the start
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sent)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        status = proc.wait()
        recorded = Path(status_file).read_text().strip()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        Path(status_file).unlink(missing_ok=True)
    if recorded.isdigit():
        status = int(recorded)
    if forwarded and status == 0:
        print(
            f"launcher: stopped by {forwarded[0]}; the ranks' output above says where the checkpoint is; the same "
            "command resumes from it.",
            file=sys.stderr,
            flush=True,
        )
    return status


def run_rank(main: Callable[[World], object], *, device: str = "auto") -> int:
    """One rank of a job other than training (`regenerate --nproc N`), or the only process: the process group and
    failure propagation as for training. Stop signals interrupt at once (KeyboardInterrupt): such jobs resume from
    what they wrote when rerun."""
    from .distributed.failure import FailureChannel
    from .distributed.world import init_world, shutdown_world

    world = init_world(device, timeout_s=RANK_TIMEOUT_S)
    failures = FailureChannel.connect(world, label=f"rank {world.rank}")
    failures.run(lambda: main(world))
    shutdown_world(world)
    return 0


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is `pid` (torchrun's ranks), from /proc; empty where there is none (not Linux)."""
    children = Path(f"/proc/{pid}/task/{pid}/children")
    with contextlib.suppress(OSError):
        return [int(text) for text in children.read_text().split()]
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # `pid (comm) state ppid ...`: comm may hold spaces and parentheses, so split after its last ')'.
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
    return found


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
