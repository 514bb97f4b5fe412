"""The output directory of a regeneration run: its settings, the journals of finished records, the merged file.

Files (one directory per run; `regenerate.py` says what goes into the records):
- `regen.json`: the run's settings (a rerun with other settings or other input records is refused) and, once
  done, `complete: true` and the summary. Written by the first rank of the run only.
- Journals, one per rank: `regen.partial.jsonl` (rank 0, and the only one of a one-rank run) and
  `regen.partial.rank-RRRRR.jsonl` (rank R > 0). One line per finished input record, appended and flushed as
  the record finishes (fsync at most every `FSYNC_SECONDS`): `{"index", "id", "messages"}` for a kept record,
  `{"index", "id", "dropped": reason}` for one left out. `index` is the record's place in the whole input, on
  every rank.
- `regen-00000.jsonl`, written when every record is done (then the journals are removed): the journals' lines of
  the kept records in input order, byte for byte; what `prepare` reads.

Resuming. A rank reads every journal in the directory, whatever the number of ranks that wrote them (a run may
resume on fewer or more GPUs), and skips the records found there. Its own journal's last line, when a kill cut it
short, is removed before it appends; another rank's cut line is only ignored (that rank may be appending to it).
Why this cannot finish a record twice: a rank answers only the records of its own share (`regen_ranks.py`), and
only it appends them in this run; a record of its share found in any journal was written by an earlier run.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from ..errors import UserError

OUTPUT_FILE = "regen-00000.jsonl"
JOURNAL_FILE = "regen.partial.jsonl"
JOURNAL_GLOB = "regen.partial*.jsonl"
SETTINGS_FILE = "regen.json"
FORMAT = "dflash-regen/2"
FSYNC_SECONDS = 5.0


class RegenerateError(UserError, ValueError):
    """Bad input records, or an output directory that holds a different run."""


def journal_path(out_path: Path, rank: int) -> Path:
    """Rank 0's journal keeps the one-rank name, so one-rank directories look as they always did."""
    return out_path / (JOURNAL_FILE if rank == 0 else f"regen.partial.rank-{rank:05d}.jsonl")


def claim_out_dir(out_path: Path, settings: dict[str, Any]) -> bool:
    """Create `out_path` or check that the run found there has the same settings; True if it is complete."""
    out_path.mkdir(parents=True, exist_ok=True)
    settings_path = out_path / SETTINGS_FILE
    if settings_path.is_file():
        previous = read_settings(out_path)
        changed = [key for key in settings if previous.get(key) != settings[key]]
        if changed:
            details = ", ".join(f"{key}: {previous.get(key)!r} -> {settings[key]!r}" for key in changed)
            hint = " (the input records changed)" if "input_fingerprint" in changed else ""
            raise RegenerateError(
                f"{out_path} holds a regeneration run with other settings{hint} ({details}); "
                "use another output directory or delete it"
            )
        return bool(previous.get("complete"))
    if any(out_path.glob("regen-*.jsonl")) or any(out_path.glob(JOURNAL_GLOB)):
        raise RegenerateError(
            f"{out_path} holds regenerated records but no {SETTINGS_FILE}; delete them or pick another directory"
        )
    write_json_atomically(settings_path, {**settings, "complete": False})
    return False


def read_settings(out_path: Path) -> dict[str, Any]:
    path = out_path / SETTINGS_FILE
    try:
        settings = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise RegenerateError(f"{path}: unreadable ({error}); delete the directory or pick another") from error
    if not isinstance(settings, dict):
        raise RegenerateError(f"{path}: not the settings of a regeneration run; delete it or pick another directory")
    return settings


@dataclass(frozen=True)
class JournalEntry:
    path: Path  # the journal that holds it
    offset: int  # byte offset of its line there
    dropped: str | None  # the reason, or None for a kept record


def read_journals(out_path: Path, *, num_records: int, own: Path | None = None) -> dict[int, JournalEntry]:
    """Where each finished input record's line is, over every journal in `out_path` (only offsets and drop reasons
    are kept in memory). `own`'s cut last line is removed from the file; other journals' are ignored. A record
    found in two journals (not written by this code) counts once, from the first journal in name order."""
    entries: dict[int, JournalEntry] = {}
    for path in sorted(out_path.glob(JOURNAL_GLOB)):
        for index, entry in _read_journal(path, num_records=num_records, repair=path == own).items():
            entries.setdefault(index, entry)
    return entries


def _read_journal(path: Path, *, num_records: int, repair: bool) -> dict[int, JournalEntry]:
    entries: dict[int, JournalEntry] = {}
    with path.open("r+b" if repair else "rb") as f:
        offset = 0
        for line_no, line in enumerate(f, start=1):
            if not line.endswith(b"\n"):
                if repair:
                    f.truncate(offset)  # the write in progress when the run was killed
                break
            try:
                entry = json.loads(line)
                index = entry["index"]
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as error:
                raise RegenerateError(f"{path}:{line_no}: not a regeneration journal entry ({error})") from error
            if not isinstance(index, int) or not 0 <= index < num_records:
                raise RegenerateError(f"{path}:{line_no}: index {index!r} outside the {num_records} input records")
            entries[index] = JournalEntry(path=path, offset=offset, dropped=entry.get("dropped"))
            offset += len(line)
    return entries


class Journal:
    """Append-only record journal: every line flushed at once, fsync at most every FSYNC_SECONDS."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: TextIO | None = None
        self._last_sync = 0.0

    def __enter__(self) -> Journal:
        self._file = self.path.open("a", encoding="utf-8")
        self._last_sync = time.monotonic()
        return self

    def write(self, entry: dict[str, Any]) -> None:
        assert self._file is not None
        self._file.write(json.dumps(entry, ensure_ascii=False) + "\n")
        self._file.flush()  # in the OS: survives the process being killed
        if time.monotonic() - self._last_sync > FSYNC_SECONDS:
            os.fsync(self._file.fileno())  # on disk: survives the machine going down
            self._last_sync = time.monotonic()

    def __exit__(self, *exc_info: object) -> None:
        assert self._file is not None
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()


def write_output(out_path: Path, *, num_records: int) -> tuple[int, dict[str, int]]:
    """The journals' kept records in input order into `regen-00000.jsonl` (atomically, line by line); returns
    (records kept, records left out per reason)."""
    entries = read_journals(out_path, num_records=num_records)
    missing = num_records - len(entries)
    if missing:
        raise RegenerateError(f"{out_path}: {missing} input records unfinished at the end of the run")
    kept, dropped = 0, {}
    output = out_path / OUTPUT_FILE
    temp = output.with_name(f".{output.name}.tmp")
    sources: dict[Path, Any] = {}
    try:
        with temp.open("wb") as f:
            for index in range(num_records):
                entry = entries[index]
                if entry.dropped is not None:
                    dropped[entry.dropped] = dropped.get(entry.dropped, 0) + 1
                    continue
                if entry.path not in sources:
                    sources[entry.path] = entry.path.open("rb")
                source = sources[entry.path]
                source.seek(entry.offset)
                f.write(source.readline())
                kept += 1
            f.flush()
            os.fsync(f.fileno())
    finally:
        for source in sources.values():
            source.close()
    os.replace(temp, output)
    return kept, dropped


def remove_journals(out_path: Path) -> None:
    for path in out_path.glob(JOURNAL_GLOB):
        path.unlink()


def write_json_atomically(path: Path, data: dict[str, Any]) -> None:
    temp = path.with_name(f".{path.name}.tmp")
    temp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(temp, path)
