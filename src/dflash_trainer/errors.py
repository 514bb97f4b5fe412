"""User errors: the one base class for problems the user can fix, and the storage-fault wrapper.

Contract. An exception deriving from `UserError` means the input, the files or the machine are not what the
command needs (a bad recipe, a target that is not there, a full disk, a checkpoint of another run). Its message
is one line (or a short paragraph) that names the thing at fault and says what to do; `dflash-trainer` prints it
as `error: MESSAGE` and exits with status 2, without a traceback (`cli.py`; `distributed/failure.py` does the same
for a failing rank). Every other exception is a bug of this package and keeps its traceback.

The project's own error types derive from `UserError` (often also from the built-in type they used to be, such
as ValueError, so existing `except ValueError` code keeps working): `ConfigError`, `TargetLoadError`,
`PrepareError`, `RecordError`, `ShardError`, `CheckpointFormatError`, `CheckpointError`, `StorageError`,
`CorruptFileError`, ...

`StorageError` turns an OSError from writing (no space left, read-only filesystem, permission, quota) into a
message that names what was being written and where: the raw OSError of a full disk reaches the user as
`[Errno 28] No space left on device` with no path, or worse as a container-format error from a native writer.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

# OSError numbers that mean "the storage cannot take this write", as opposed to a bug in the caller.
STORAGE_ERRNOS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "the filesystem is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EFBIG: "file too large for this filesystem or process limit",
}


class UserError(Exception):
    """A problem the user can fix; the message names it and says what to do (printed without a traceback)."""


class InterruptedAfterTraining(KeyboardInterrupt):
    """A stop signal once training has ended and its checkpoint and export are written (in the evaluation or the
    plots): rerunning the command is not the remedy, so the message says what is."""


def describe_interrupt(interrupt: KeyboardInterrupt) -> str:
    """The one line printed for an interrupt: its text (a plain Ctrl-C has none) and what to do next."""
    text = str(interrupt) or "SIGINT"
    if isinstance(interrupt, InterruptedAfterTraining):
        return f"interrupted ({text})"
    return f"interrupted ({text}); run the same command again to resume"


class OutputExistsError(UserError, FileExistsError):
    """A command would replace output it must not replace (another run's export, a non-empty directory)."""


def refuse_file_as_directory(out_dir: Path) -> None:
    """An output directory that is an existing file is refused before any work (mkdir would fail after it)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise OutputExistsError(f"{out_dir}: exists and is not a directory")


class CorruptFileError(UserError, ValueError):
    """A file the command reads is damaged or incomplete (a truncated copy, overwritten bytes); the message names
    it. Raised by the readers of `durable_io` for safetensors files: target weights, exports, checkpoints."""


class StorageError(UserError, OSError):
    """Writing to disk failed for a reason of the storage (full, read-only, no permission, quota).
    Built as `StorageError(errno, message)`; prints as the message alone."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


def is_storage_error(error: BaseException) -> bool:
    return isinstance(error, OSError) and error.errno in STORAGE_ERRNOS


def free_bytes(path: str | Path) -> int | None:
    """Free bytes on the filesystem holding `path` (or its nearest existing parent); None when unknown."""
    probe = Path(path).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return shutil.disk_usage(probe).free
    except OSError:
        return None


def format_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"


def storage_error(what: str, path: str | Path, error: OSError, *, advice: str = "") -> StorageError:
    """A StorageError for `error` raised while writing `what` to `path`: the cause in words, the free space
    where it is known, and `advice` (what the user can do) or a default."""
    cause = STORAGE_ERRNOS.get(error.errno, error.strerror or str(error))
    free = free_bytes(path)
    where = f"{path}" + (f" ({format_bytes(free)} free)" if free is not None else "")
    if not advice:
        advice = {
            errno.ENOSPC: "free some space or point the output elsewhere",
            errno.EDQUOT: "free some space or point the output elsewhere",
            errno.EROFS: "choose a writable directory",
            errno.EACCES: "choose a directory you can write to",
            errno.EPERM: "choose a directory you can write to",
        }.get(error.errno, "check the filesystem")
    result = StorageError(error.errno, f"cannot write {what} to {where}: {cause}; {advice}")
    result.filename = str(path)
    return result


def check_writable(directory: str | Path, what: str) -> None:
    """Fail now, with a StorageError, when files cannot be created in `directory` (or, when it does not exist
    yet, in its nearest existing parent): a read-only run directory must be found before hours of work.

    A probe file is created and removed; permission bits alone would not do (root ignores them), a read-only
    mount or a full quota only shows on a real write."""
    directory = Path(directory)
    probe_dir = directory
    while not probe_dir.exists() and probe_dir != probe_dir.parent:
        probe_dir = probe_dir.parent
    probe = probe_dir / f".dflash-write-probe-{os.getpid()}"
    try:
        with probe.open("wb") as f:
            f.write(b"probe")
    except OSError as error:
        raise storage_error(what, directory, error) from error
    finally:
        probe.unlink(missing_ok=True)
