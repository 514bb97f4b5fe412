"""One training per run directory: an exclusive lock held by the job for as long as it runs.

Two trainings into one `run_dir` would interleave their checkpoints and metrics and both name the same export,
each exiting 0. So a job takes `RUN_DIR/.dflash-trainer.lock` before it loads anything, and a second job is
refused with one line naming the holder.

Contract.
- The lock is `flock(LOCK_EX | LOCK_NB)` on that file, never the file's existence: the kernel drops it when the
  holding process ends, however it ends (SIGKILL, the OOM killer, a crash), so no lock is ever stale and nobody
  has to delete anything after a kill. The file holds who took it (host, pid, time, command) for the message.
- One holder per job: global rank 0 takes it; under torchrun every rank then meets at a barrier, so no rank of a
  refused job touches the directory (the refused rank 0 fails the job, distributed/failure.py). Ranks on other
  machines see the run directory through a shared filesystem, where flock works too (NFSv4, Lustre, GPFS); on a
  filesystem that has no locks the run goes on with a warning.
- A run directory this job created and that holds nothing but the lock file (and empty files or directories)
  when the job fails, a refusal after start-up for example, is removed: a failed start leaves nothing behind.
  The lock file is unlinked while the lock is still held; a process that opened it just before and locks the
  unlinked file notices (the path no longer names the file it locked) and starts over.
- `check_not_in_use` only looks (takes the lock and releases it at once): for the launcher, before torchrun.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch.distributed as dist

from ..distributed.world import World
from ..errors import UserError

LOCK_NAME = ".dflash-trainer.lock"
# flock is not offered here (some NFS mounts): the run proceeds unlocked, with a warning.
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)


class RunDirInUseError(UserError):
    """Another training holds the run directory."""


def _refusal(run_dir: Path, lock_path: Path) -> RunDirInUseError:
    holder = ""
    with contextlib.suppress(OSError, ValueError):
        info = json.loads(lock_path.read_text())
        holder = f" (pid {info['pid']} on {info['host']} since {info['since']}: {info['command']})"
    return RunDirInUseError(
        f"run_dir {run_dir} is in use by another training{holder}; two trainings into one run_dir would mix their "
        "checkpoints and metrics: wait for it to end, or give this one another run_dir"
    )


def _try_lock(run_dir: Path) -> int | None:
    """A descriptor of the lock file holding the lock; None where the filesystem has no locks. Raises
    RunDirInUseError when another process holds it."""
    lock_path = run_dir / LOCK_NAME
    for _ in range(100):  # starts over only when the file was replaced under us, which a few tries outlast
        run_dir.mkdir(parents=True, exist_ok=True)
        try:
            descriptor = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:  # the directory was removed by a failing holder in between
            continue
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            os.close(descriptor)
            if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise _refusal(run_dir, lock_path) from None
            if error.errno in _NO_LOCKS:
                print(
                    f"warning: {run_dir}: this filesystem offers no file locks; nothing stops a second training "
                    "from writing into this run_dir at the same time",
                    file=sys.stderr,
                )
                return None
            raise
        try:
            same_file = os.stat(lock_path).st_ino == os.fstat(descriptor).st_ino
        except FileNotFoundError:
            same_file = False
        if same_file:
            return descriptor
        os.close(descriptor)
    raise RunDirInUseError(f"run_dir {run_dir}: its lock file keeps changing; is another training starting there?")


def check_not_in_use(run_dir: str | Path) -> None:
    """Refuse a run directory another training holds, creating nothing (the launcher's check before torchrun)."""
    run_dir = Path(run_dir)
    if not (run_dir / LOCK_NAME).is_file():
        return
    descriptor = _try_lock(run_dir)
    if descriptor is not None:
        os.close(descriptor)


@contextlib.contextmanager
def hold_run_dir(run_dir: str | Path, world: World) -> Iterator[None]:
    """Hold `run_dir` for this job (global rank 0) for the duration of the block; see the module docstring."""
    run_dir = Path(run_dir)
    descriptor, created = None, False
    if world.rank == 0:
        created = not run_dir.exists()
        descriptor = _try_lock(run_dir)
        if descriptor is not None:
            record = {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "since": time.strftime("%Y-%m-%d %H:%M:%S"),
                "command": " ".join(sys.argv),
            }
            os.ftruncate(descriptor, 0)
            os.pwrite(descriptor, (json.dumps(record) + "\n").encode(), 0)
    try:
        if world.distributed:
            dist.barrier()  # nobody starts before the lock is held (a refused rank 0 fails the job instead)
        yield
    except BaseException:
        if created:
            _remove_if_empty(run_dir)
        raise
    finally:
        if descriptor is not None:
            os.close(descriptor)  # releases the lock


def _remove_if_empty(run_dir: Path) -> None:
    """Remove `run_dir` when it holds nothing but the lock file, empty files and empty directories."""
    entries = sorted(run_dir.rglob("*"), key=lambda path: len(path.parts), reverse=True)
    if any(path.is_file() and path.name != LOCK_NAME and path.stat().st_size > 0 for path in entries):
        return
    if any(path.is_symlink() or not (path.is_file() or path.is_dir()) for path in entries):
        return
    for path in entries:  # deepest first
        with contextlib.suppress(OSError):
            path.rmdir() if path.is_dir() else path.unlink()
    with contextlib.suppress(OSError):
        run_dir.rmdir()
