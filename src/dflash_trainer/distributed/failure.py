"""Failure propagation: one rank's exception fails the whole job within seconds, its traceback printed once.

- Each rank runs its main through `FailureChannel.run`. An exception claims the job's failure slot in the
  rendezvous store (compare-and-set, so exactly one rank wins even when several fail at once). The winner
  prints its full traceback; a rank that finds the slot taken prints one line naming the rank that failed
  first. Either way the process ends with `os._exit(1)`: no atexit handlers and no process-group teardown,
  which could block on a dead peer.
- A rank killed outright (SIGKILL, OOM killer) claims nothing; its peers' next send, receive or collective with
  it fails at once (gloo and NCCL notice the closed connection), and the first of them claims the slot.
- A watcher thread polls the slot every `POLL_S` seconds, so a rank blocked in an operation with a healthy but
  waiting peer also leaves within seconds. It gives the failing rank `GRACE_S` to print and exit first, so that
  torchrun names the right rank as the root cause.
- An operation blocked on a peer that vanished without closing its connections (a dead machine) fails after
  `placement.timeout_s`, the timeout of the process groups, except where the wait may span a checkpoint being
  written or read: the ranks meeting its writer, or each other after reading the one they resume from, wait up to
  `checkpoint.timeout_s`; a disaggregated job's feature sends and start broadcast up to the sum of the two.
  torchrun stops the remaining ranks as well (SIGTERM, then SIGKILL after its shutdown timeout, 30 s by default).

Test hooks, read from the environment once per rank (used by tests/test_failure.py and
tests/test_disaggregated.py; both are no-ops when unset):
  DFLASH_TEST_FAIL_AT_STEP=RANK:STEP[:kill]  rank RANK raises (`:kill`: SIGKILLs itself) when it first handles
                                             a batch of optimizer step STEP or later (steps count from 1)
  DFLASH_TEST_SLOW_RANK=RANK:SECONDS         rank RANK sleeps SECONDS per batch (target ranks) or per
                                             optimizer step (training ranks)
  DFLASH_TEST_DISK_FULL=WHAT                 writing WHAT (`checkpoint`) raises OSError(ENOSPC) after its first
                                             file, as a full disk does (`injected_write_fault`)
  DFLASH_TEST_SLOW_WRITE=WHAT:SECONDS        writing WHAT (`checkpoint`) takes SECONDS longer after its first file,
                                             as slow network storage does (`injected_write_fault`)
  DFLASH_TEST_SLOW_RESUME=RANK:SECONDS       rank RANK reads the checkpoint it resumes from SECONDS slower

What a failure prints and the exit status, per kind (the slot records the first failure's rank and kind, so the
other ranks say accurately what happened): a user error (`errors.UserError`: a full disk, a bad checkpoint...)
is one line, `[rank R] error: MESSAGE`, exit status 2; an interrupt before training started (Ctrl-C while the
target loads) is one line, status 130; anything else is a bug: its traceback, status 1. The other ranks print
one line naming the first failure and exit with its status.

Under `dflash-trainer train --nproc` (launch.py) the launcher reports the job's status itself: it names a file
in DFLASH_LAUNCH_STATUS_FILE, the first failing rank writes its exit status there, and every rank then exits 0 so
that torchrun adds no failure report of its own (a traceback of its ChildFailedError) to the one line above; a
rank that cannot write the file exits with the real status. Under a plain torchrun the ranks exit with their
real status (torchrun then reports the job as failed, status 1).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn, TypeVar

import torch.distributed as dist

from ..errors import UserError, describe_interrupt, is_storage_error
from .world import World

POLL_S = 1.0
GRACE_S = 2.0
# Store errors in a row before the watcher takes the store as gone: one slow answer from a busy store (a timeout)
# must not end the watching for the rest of the job.
STORE_ERRORS_TO_STOP = 5
# How long a rank stopping for another's failure waits for that rank to record the job's status (`_exit_after`).
STATUS_WAIT_S = 10.0
# Store operations on the failure path must not hold up the exit for long.
STORE_TIMEOUT_S = 10.0
FAIL_ENV = "DFLASH_TEST_FAIL_AT_STEP"
SLOW_ENV = "DFLASH_TEST_SLOW_RANK"
DISK_FULL_ENV = "DFLASH_TEST_DISK_FULL"
SLOW_WRITE_ENV = "DFLASH_TEST_SLOW_WRITE"
SLOW_RESUME_ENV = "DFLASH_TEST_SLOW_RESUME"
# Set by launch.run_torchrun: where the first failing rank writes the job's exit status.
STATUS_FILE_ENV = "DFLASH_LAUNCH_STATUS_FILE"
_SLOT = "first_failed_rank"
# Exit status and what the other ranks say, per kind of failure.
EXIT_STATUS = {"user": 2, "interrupt": 130, "bug": 1}
_WHAT_HAPPENED = {
    "user": "failed (its error is above)",
    "interrupt": "was interrupted",
    "bug": "failed (its traceback is above)",
}

T = TypeVar("T")


class FailureChannel:
    """The job's failure slot (a key in the rendezvous store) as seen from one rank."""

    def __init__(self, store: dist.Store | None, rank: int, label: str) -> None:
        self.store = store
        self.rank = rank
        self.label = label
        self._stop_watching = threading.Event()

    @classmethod
    def connect(cls, world: World, label: str) -> FailureChannel:
        """A client of the store torchrun's rendezvous set up (MASTER_ADDR:MASTER_PORT); none for one process.

        Keys are scoped by torchrun's restart count, so a restarted job does not see the last attempt's failure.
        """
        if not world.distributed:
            return cls(None, world.rank, label)
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S),
            wait_for_workers=False,
        )
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return cls(dist.PrefixStore(f"dflash/failure/{attempt}/", store), world.rank, label)

    def first_failure(self) -> tuple[int, str] | None:
        """(rank, kind) of the job's first failure, None while there is none."""
        if self.store is None or not self.store.check([_SLOT]):
            return None
        return _parse_slot(self.store.get(_SLOT))

    def claim(self, kind: str) -> tuple[int, str] | None:
        """Record this rank's failure of `kind` as the first unless another rank was first; return the first
        failure's (rank, kind) (None when the store cannot be reached)."""
        if self.store is None:
            return self.rank, kind
        try:
            return _parse_slot(self.store.compare_set(_SLOT, "", f"{self.rank}:{kind}"))
        except (RuntimeError, dist.DistError):
            return None

    def run(self, main: Callable[[], T]) -> T:
        """`main()`, with any exception turned into a job failure (one process: the exception propagates)."""
        if self.store is None:
            return main()
        self.start_watching()
        try:
            return main()
        except BaseException as error:
            self.fail(error)
        finally:
            self._stop_watching.set()

    def fail(self, error: BaseException) -> NoReturn:
        kind = failure_kind(error)
        first = self.claim(kind)
        if first is None or first[0] == self.rank:
            if kind == "user":
                print(f"[{self.label}] error: {error}", file=sys.stderr)
            elif kind == "interrupt":
                assert isinstance(error, KeyboardInterrupt)
                print(f"[{self.label}] {describe_interrupt(error)}", file=sys.stderr)
            else:
                print(f"[{self.label}] failed; the job stops:", file=sys.stderr)
                traceback.print_exception(error, file=sys.stderr)
            status = EXIT_STATUS[kind]
            _exit_now(0 if _record_job_status(status) else status)
        first_rank, first_kind = first
        if not (kind == "interrupt" and first_kind == "interrupt"):  # every rank got the same Ctrl-C: nothing to add
            summary = f"{type(error).__name__}: {error}".splitlines()[0][:300]
            print(
                f"[{self.label}] stopping because rank {first_rank} {_WHAT_HAPPENED[first_kind]}; here: {summary}",
                file=sys.stderr,
            )
        _exit_after(first_kind)

    def start_watching(self, poll_s: float = POLL_S) -> None:
        threading.Thread(target=self._watch, args=(poll_s,), name="dflash-failure-watch", daemon=True).start()

    def _watch(self, poll_s: float) -> None:
        errors_in_a_row = 0
        while not self._stop_watching.wait(poll_s):
            try:
                first = self.first_failure()
            except (RuntimeError, dist.DistError):
                # Several in a row: the store's host is gone (a normal end on a job without an agent store), nothing
                # left to watch. Fewer: a busy store answered late; keep watching.
                errors_in_a_row += 1
                if errors_in_a_row >= STORE_ERRORS_TO_STOP:
                    return
                continue
            errors_in_a_row = 0
            if first is not None and first[0] != self.rank:
                time.sleep(GRACE_S)
                print(f"[{self.label}] stopping because rank {first[0]} {_WHAT_HAPPENED[first[1]]}", file=sys.stderr)
                _exit_after(first[1])


def failure_kind(error: BaseException) -> str:
    """`user` (a UserError or a storage fault: one line), `interrupt` (Ctrl-C before training), or `bug`."""
    if isinstance(error, UserError) or is_storage_error(error):
        return "user"
    if isinstance(error, KeyboardInterrupt):
        return "interrupt"
    return "bug"


def _parse_slot(value: bytes) -> tuple[int, str]:
    rank, _, kind = value.decode().partition(":")
    return int(rank), kind if kind in EXIT_STATUS else "bug"


def _record_job_status(status: int) -> bool:
    """Under the launcher, write the job's exit status for it (module docstring); True when written."""
    path = os.environ.get(STATUS_FILE_ENV)
    if not path:
        return False
    try:
        with open(path, "w") as file:
            file.write(f"{status}\n")
    except OSError:
        return False
    return True


def _exit_after(first_kind: str) -> NoReturn:
    """A rank stopping for another rank's failure: 0 under the launcher once the status is recorded, else the
    first failure's status.

    The first failing rank claims the slot before it prints its error and writes the status, so a rank that read
    the claim can get here first: it waits for the status (at most STATUS_WAIT_S; milliseconds in practice). Exiting
    with the real status instead made torchrun print its own report and traceback under the launcher's one line."""
    path = os.environ.get(STATUS_FILE_ENV)
    recorded = bool(path) and _status_recorded(Path(path), STATUS_WAIT_S)
    _exit_now(0 if recorded else EXIT_STATUS[first_kind])


def _status_recorded(path: Path, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(OSError):
            if path.read_text().strip():
                return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def injected_write_fault(what: str) -> None:
    """Test hooks, for `what` named by its first word (`checkpoint`): raise the OSError of a full disk when
    DFLASH_TEST_DISK_FULL names it; sleep when DFLASH_TEST_SLOW_WRITE names it (`checkpoint:SECONDS`)."""
    kind = what.split()[0]
    if os.environ.get(DISK_FULL_ENV) and kind == os.environ[DISK_FULL_ENV]:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    slow_kind, _, seconds = os.environ.get(SLOW_WRITE_ENV, "").partition(":")
    if slow_kind == kind:
        time.sleep(float(seconds))


def _exit_now(code: int) -> NoReturn:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _seconds_for_rank(name: str, rank: int) -> float:
    """SECONDS from the environment variable `name` set to RANK:SECONDS when RANK is `rank`, else 0."""
    value = os.environ.get(name, "")
    if not value:
        return 0.0
    named_rank, _, seconds = value.partition(":")
    return float(seconds) if int(named_rank) == rank else 0.0


@dataclass(frozen=True)
class FaultInjection:
    """Test hooks from the environment (see the module docstring)."""

    rank: int
    fail_step: int | None = None
    kill: bool = False
    slow_s: float = 0.0
    slow_resume_s: float = 0.0

    @classmethod
    def from_env(cls, rank: int) -> FaultInjection:
        fail_step, kill = None, False
        fail = os.environ.get(FAIL_ENV, "")
        if fail:
            parts = fail.split(":")
            if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "kill"):
                raise ValueError(f"{FAIL_ENV}={fail!r}: expected RANK:STEP or RANK:STEP:kill")
            if int(parts[0]) == rank:
                fail_step, kill = int(parts[1]), len(parts) == 3
        return cls(
            rank=rank,
            fail_step=fail_step,
            kill=kill,
            slow_s=_seconds_for_rank(SLOW_ENV, rank),
            slow_resume_s=_seconds_for_rank(SLOW_RESUME_ENV, rank),
        )

    def at_resume(self) -> None:
        """Called once a rank has read the checkpoint it resumes from."""
        if self.slow_resume_s:
            time.sleep(self.slow_resume_s)

    def at_step(self, step: int) -> None:
        """Called for every batch a rank handles, with the (1-based) optimizer step the batch belongs to."""
        if self.slow_s:
            time.sleep(self.slow_s)
        if self.fail_step is not None and step >= self.fail_step:
            if self.kill:
                print(f"{FAIL_ENV}: rank {self.rank} kills itself at step {step}", file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"{FAIL_ENV}: injected failure on rank {self.rank} at step {step}")
