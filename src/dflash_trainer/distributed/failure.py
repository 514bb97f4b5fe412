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
  `placement.timeout_s`, the timeout of every process group. torchrun stops the remaining ranks as well (SIGTERM,
  then SIGKILL after its shutdown timeout, 30 s by default).

Test hooks, read from the environment once per rank (used by tests/test_failure.py and
tests/test_disaggregated.py; both are no-ops when unset):
  DFLASH_TEST_FAIL_AT_STEP=RANK:STEP[:kill]  rank RANK raises (`:kill`: SIGKILLs itself) when it first handles
                                             a batch of optimizer step STEP or later (steps count from 1)
  DFLASH_TEST_SLOW_RANK=RANK:SECONDS         rank RANK sleeps SECONDS per batch (target ranks) or per
                                             optimizer step (training ranks)
  DFLASH_TEST_DISK_FULL=WHAT                 writing WHAT (`checkpoint`) raises OSError(ENOSPC) after its first
                                             file, as a full disk does (`injected_write_fault`)

A user error (`errors.UserError`: a full disk, a bad checkpoint...) is printed as one line, `[rank R] error:
MESSAGE`, instead of a traceback; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

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
from typing import NoReturn, TypeVar

import torch.distributed as dist

from ..errors import UserError, is_storage_error
from .world import World

POLL_S = 1.0
GRACE_S = 2.0
# Store operations on the failure path must not hold up the exit for long.
STORE_TIMEOUT_S = 10.0
FAIL_ENV = "DFLASH_TEST_FAIL_AT_STEP"
SLOW_ENV = "DFLASH_TEST_SLOW_RANK"
DISK_FULL_ENV = "DFLASH_TEST_DISK_FULL"
_SLOT = "first_failed_rank"

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

    def first_failed_rank(self) -> int | None:
        if self.store is None or not self.store.check([_SLOT]):
            return None
        return int(self.store.get(_SLOT))

    def claim(self) -> int | None:
        """Record this rank as the first failure unless another rank was first; return the first failed rank
        (None when the store cannot be reached)."""
        if self.store is None:
            return self.rank
        try:
            return int(self.store.compare_set(_SLOT, "", str(self.rank)))
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
        first = self.claim()
        if first is None or first == self.rank:
            if isinstance(error, UserError) or is_storage_error(error):
                print(f"[{self.label}] error: {error}", file=sys.stderr)
            else:
                print(f"[{self.label}] failed; the job stops:", file=sys.stderr)
                traceback.print_exception(error, file=sys.stderr)
        else:
            summary = f"{type(error).__name__}: {error}".splitlines()[0][:300]
            print(
                f"[{self.label}] stopping because rank {first} failed (its traceback is above); here: {summary}",
                file=sys.stderr,
            )
        _exit_now(1)

    def start_watching(self, poll_s: float = POLL_S) -> None:
        threading.Thread(target=self._watch, args=(poll_s,), name="dflash-failure-watch", daemon=True).start()

    def _watch(self, poll_s: float) -> None:
        while not self._stop_watching.wait(poll_s):
            try:
                first = self.first_failed_rank()
            except (RuntimeError, dist.DistError):
                # The store's host is gone (a normal end on a job without an agent store): nothing left to watch.
                return
            if first is not None and first != self.rank:
                time.sleep(GRACE_S)
                print(f"[{self.label}] stopping because rank {first} failed (its traceback is above)", file=sys.stderr)
                _exit_now(1)


def injected_write_fault(what: str) -> None:
    """Test hook: raise the OSError of a full disk while writing `what` when DFLASH_TEST_DISK_FULL names its
    first word (`checkpoint`)."""
    if os.environ.get(DISK_FULL_ENV) and what.split()[0] == os.environ[DISK_FULL_ENV]:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _exit_now(code: int) -> NoReturn:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@dataclass(frozen=True)
class FaultInjection:
    """Test hooks from the environment (see the module docstring)."""

    rank: int
    fail_step: int | None = None
    kill: bool = False
    slow_s: float = 0.0

    @classmethod
    def from_env(cls, rank: int) -> FaultInjection:
        fail_step, kill, slow_s = None, False, 0.0
        fail = os.environ.get(FAIL_ENV, "")
        if fail:
            parts = fail.split(":")
            if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "kill"):
                raise ValueError(f"{FAIL_ENV}={fail!r}: expected RANK:STEP or RANK:STEP:kill")
            if int(parts[0]) == rank:
                fail_step, kill = int(parts[1]), len(parts) == 3
        slow = os.environ.get(SLOW_ENV, "")
        if slow:
            slow_rank, _, seconds = slow.partition(":")
            if int(slow_rank) == rank:
                slow_s = float(seconds)
        return cls(rank=rank, fail_step=fail_step, kill=kill, slow_s=slow_s)

    def at_step(self, step: int) -> None:
        """Called for every batch a rank handles, with the (1-based) optimizer step the batch belongs to."""
        if self.slow_s:
            time.sleep(self.slow_s)
        if self.fail_step is not None and step >= self.fail_step:
            if self.kill:
                print(f"{FAIL_ENV}: rank {self.rank} kills itself at step {step}", file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"{FAIL_ENV}: injected failure on rank {self.rank} at step {step}")
