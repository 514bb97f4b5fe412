"""Every thread's stack, printed when a training process stops making progress.

`StallReport(timeout_s)` is armed by `start()` (or by entering it as a context manager) and disarmed by `stop()`;
in between, the trainer calls `beat()` after each unit of progress (an optimizer step, a periodic evaluation, a
checkpoint). When no beat has come for `timeout_s` seconds, every thread's Python stack goes to stderr, followed
the first time by a line naming the stall, and again every `timeout_s` seconds while nothing moves. The process goes
on: a long compile or a slow checkpoint is slow, not dead, and the stacks tell the user which. `timeout_s` 0
(`train.stall_report_s: 0`) turns it off.

Contract:
- The dump comes from `faulthandler.dump_traceback_later`, whose watchdog is a C thread: it fires while the main
  thread is blocked without the GIL (a lock, a CUDA sync, a collective, a child process that never answers), where
  a Python thread could not run. The line naming the stall comes from a daemon thread that looks at the time a
  few times a second, once the dump is due (so it is printed only when the stacks are): best effort (a thread
  holding the GIL forever silences it), the stacks are not.
- One timer per process: faulthandler keeps a single pending dump, so a second report armed inside another (or
  pytest's `faulthandler_timeout`) replaces the first one's timer; the trainer arms one per `fit`.
- While a dump is pending, a child forked without exec hangs at its exit (faulthandler's timer state is not
  fork-safe): nothing inside `fit` forks without exec (worker pools are started by exec, or exit by `os._exit`).
- `beat()` is cheap and takes no device sync: it records the time, and re-arms faulthandler's timer (which starts a
  thread) at most once per `REARM_S` (1 s, or a tenth of `timeout_s`), so a dump may come up to that much early.

Why: on 2026-12-05 the GPU main job stopped at step ~770 with no output and the GPU idle for minutes; only an
outside tool (py-spy) showed the main thread waiting for an Inductor compile worker that had deadlocked
(compiling.py). With this, the run's own log names the stuck frame.
"""

from __future__ import annotations

import faulthandler
import sys
import threading
import time
from types import TracebackType
from typing import TextIO

REARM_S = 1.0  # at most this often (or a tenth of the timeout, if shorter) `beat()` re-arms faulthandler's timer
POLL_S = 0.25  # how often the watcher thread looks at the time


class StallReport:
    def __init__(self, timeout_s: float) -> None:
        if timeout_s != 0 and timeout_s < 1:
            raise ValueError(f"StallReport: timeout_s must be 0 (off) or >= 1, got {timeout_s}")
        self.timeout_s = timeout_s
        self._rearm_s = min(REARM_S, timeout_s / 10)
        self._last_beat = self._armed_at = time.monotonic()
        self._stopped = threading.Event()
        self._watcher: threading.Thread | None = None

    def start(self) -> None:
        """Armed from now (unless `timeout_s` is 0): the first dump is due `timeout_s` seconds from now."""
        if self.timeout_s == 0 or self._watcher is not None:
            return
        self._stopped.clear()
        self._arm(time.monotonic())
        self._watcher = threading.Thread(target=self._watch, name="stall-report", daemon=True)
        self._watcher.start()

    def stop(self) -> None:
        """Disarmed: no dump after this, whatever the time since the last beat."""
        if self._watcher is None:
            return
        faulthandler.cancel_dump_traceback_later()
        self._stopped.set()
        self._watcher.join()
        self._watcher = None

    def __enter__(self) -> StallReport:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def beat(self) -> None:
        """Progress: the next dump is due about `timeout_s` seconds from now."""
        now = time.monotonic()
        self._last_beat = now
        if self._watcher is not None and now - self._armed_at >= self._rearm_s:
            self._arm(now)

    def _arm(self, now: float) -> None:
        self._armed_at = now
        faulthandler.dump_traceback_later(self.timeout_s, repeat=True, file=_stderr())

    def _watch(self) -> None:
        reported = None  # the arming whose stall has been named
        while not self._stopped.wait(POLL_S):
            armed_at = self._armed_at
            if armed_at != reported and time.monotonic() - armed_at >= self.timeout_s:
                reported = armed_at
                print(
                    f"stall: no training progress for {time.monotonic() - self._last_beat:.0f} s "
                    f"(train.stall_report_s {self.timeout_s:g}); every thread's stack is above, and comes again every "
                    f"{self.timeout_s:g} s while it lasts",
                    file=_stderr(),
                    flush=True,
                )


def _stderr() -> TextIO:
    """sys.stderr where it is a real file (faulthandler writes to its descriptor), else the process's own."""
    try:
        sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return sys.__stderr__
    return sys.stderr
