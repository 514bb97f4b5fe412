"""Token shards: the on-disk training data, its atomic writer and its validating loader.

A shard directory holds `manifest.json` and `shard-00000.jsonl`, `shard-00001.jsonl`, ... with one JSON
record per line: `{"id": str, "input_ids": [int], "loss_mask": [0|1]}` (docs/shard-format.md is the
user-facing description).

Loading validates every record: a token id outside the vocabulary or a sample with nothing to learn would
otherwise surface hours into a run as a device-side index error or a NaN loss, with no hint of where it came
from. Every error names the file, the line and the field.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import operator
import os
import shutil
import tempfile
import uuid
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Literal

import numpy as np

from ..errors import (
    OutputExistsError,
    StorageError,
    UserError,
    is_storage_error,
    refuse_file_as_directory,
    storage_error,
)

SHARD_FORMAT = "dflash-shards/1"
MANIFEST_NAME = "manifest.json"
# Token ids live in an int32 array in memory.
MAX_VOCAB_SIZE = 2**31 - 1


class ShardError(UserError, ValueError):
    """A malformed shard directory, manifest or record. `file`, `line` and `field` locate the problem."""

    def __init__(self, problem: str, *, file: str | Path, line: int | None = None, field: str | None = None):
        self.file = str(file)
        self.line = line
        self.field = field
        self.problem = problem
        where = self.file if line is None else f"{self.file}:{line}"
        super().__init__(f"{where}: {problem}" if field is None else f"{where}: field '{field}': {problem}")


def shard_file_name(index: int) -> str:
    return f"shard-{index:05d}.jsonl"


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A digest of a tokenizer's vocabulary (token -> id, added tokens included): equal for the same tokenizer
    however it was loaded, different for any other vocabulary."""
    items = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    encoded = json.dumps(items, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return "sha256:" + hashlib.sha256(encoded).hexdigest()


def check_shards_tokenizer(path: str | Path, tokenizer: Any, target_name: str) -> None:
    """Refuse shards tokenised with another tokenizer than the target's (names both sides). Manifests written
    before fingerprints existed are compared by name, with a warning only."""
    manifest_path = Path(path) / MANIFEST_NAME
    manifest = _read_manifest(manifest_path)
    recorded = manifest.get("tokenizer_fingerprint")
    if recorded is None:
        if manifest["tokenizer"] != target_name:
            warnings.warn(
                f"{path}: tokenised with {manifest['tokenizer']!r} (no vocabulary fingerprint recorded), the "
                f"target is {target_name!r}: make sure they share a tokenizer",
                stacklevel=2,
            )
        return
    if recorded != tokenizer_fingerprint(tokenizer):
        raise ShardError(
            f"tokenised with {manifest['tokenizer']!r}, whose vocabulary differs from the target {target_name!r}'s "
            "(tokenizer_fingerprint); ids of another tokenizer would train the drafter on the wrong tokens. "
            "Run `dflash-trainer prepare` with this target, or set data.check_tokenizer=false if they match",
            file=manifest_path,
            field="tokenizer_fingerprint",
        )


# ----------------------------------------------------------------------------------------------------------
# One sample's checks, shared by the writer (fail before writing) and the loader (fail before training).


class _FieldProblem(Exception):
    def __init__(self, field: str, problem: str):
        super().__init__(problem)
        self.field = field
        self.problem = problem


def _integer_array(value: Any) -> np.ndarray | None:
    """`value` as a 1-D integer array, or None when it is not a flat sequence of integers."""
    if isinstance(value, (str, bytes, dict)):
        return None
    try:
        array = np.asarray(value)
    except (ValueError, OverflowError):  # ragged nesting, integers beyond 64 bits
        return None
    if array.ndim != 1:
        return None
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    # Kind "b" (bool) is rejected on purpose: JSON true/false is no token id or mask value.
    return array if array.dtype.kind in "iu" else None


def _describe(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"an array of shape {list(value.shape)} and dtype {value.dtype}"
    if isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, bool) or not isinstance(item, (int, np.integer)):
                return f"a list holding {type(item).__name__} {item!r:.40}"
        return "a list of integers too large for 64 bits"
    return type(value).__name__


def _validate_sample(sample_id: Any, input_ids: Any, loss_mask: Any, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Return (input_ids int32 [L], loss_mask uint8 [L]) or raise _FieldProblem."""
    if not isinstance(sample_id, str):
        raise _FieldProblem("id", f"expected a string, got {type(sample_id).__name__}")
    ids = _integer_array(input_ids)
    if ids is None:
        raise _FieldProblem("input_ids", f"expected a list of integers, got {_describe(input_ids)}")
    mask = _integer_array(loss_mask)
    if mask is None:
        raise _FieldProblem("loss_mask", f"expected a list of 0/1 integers, got {_describe(loss_mask)}")
    if len(mask) != len(ids):
        raise _FieldProblem("loss_mask", f"length {len(mask)} differs from the length of input_ids ({len(ids)})")
    out_of_range = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    if out_of_range.size:
        position = int(out_of_range[0])
        raise _FieldProblem(
            "input_ids",
            f"token id {int(ids[position])} at position {position} is outside [0, {vocab_size}) "
            f"({out_of_range.size} out-of-range ids in this record)",
        )
    not_binary = np.flatnonzero((mask != 0) & (mask != 1))
    if not_binary.size:
        position = int(not_binary[0])
        raise _FieldProblem("loss_mask", f"value {int(mask[position])} at position {position} is not 0 or 1")
    if not mask.any():
        raise _FieldProblem("loss_mask", "no loss token (empty or all zeros): the sample would train nothing")
    return ids.astype(np.int32), mask.astype(np.uint8)


# ----------------------------------------------------------------------------------------------------------
# In-memory dataset.


@dataclass(frozen=True)
class Sample:
    id: str
    input_ids: np.ndarray  # [L] int32, a read-only view into the dataset
    loss_mask: np.ndarray  # [L] uint8 (0/1), a read-only view into the dataset


@dataclass(frozen=True)
class DatasetStats:
    samples: int
    tokens: int
    loss_tokens: int
    # Over-long samples cut to max_seq_len.
    truncated: int
    # Samples dropped: over-long with overlong="skip", or left without a loss token by truncation.
    skipped: int


class TokenDataset:
    """All samples of a shard directory in three flat arrays.

    Sample i is `tokens[offsets[i]:offsets[i+1]]`. Flat arrays instead of per-sample Python lists keep
    millions of samples at 5 bytes per token and make `lengths` a free array for the sampler.
    """

    def __init__(
        self,
        *,
        sample_ids: list[str],
        tokens: np.ndarray,
        loss_mask: np.ndarray,
        offsets: np.ndarray,
        manifest: dict[str, Any],
        truncated: int = 0,
        skipped: int = 0,
    ):
        tokens = np.asarray(tokens, dtype=np.int32)
        loss_mask = np.asarray(loss_mask, dtype=np.uint8)
        offsets = np.asarray(offsets, dtype=np.int64)
        if tokens.ndim != 1 or loss_mask.shape != tokens.shape:
            raise ValueError(f"tokens {tokens.shape} and loss_mask {loss_mask.shape} must be equal 1-D shapes")
        if offsets.shape != (len(sample_ids) + 1,) or offsets[0] != 0 or offsets[-1] != len(tokens):
            raise ValueError(f"offsets must have {len(sample_ids) + 1} entries (samples + 1) from 0 to {len(tokens)}")
        lengths = np.diff(offsets)
        if (lengths < 0).any():
            raise ValueError("offsets must be non-decreasing")
        self._sample_ids = list(sample_ids)
        # Read-only views: samples handed out are views into these arrays, and must not be edited in place.
        self._tokens = _read_only(tokens)
        self._loss_mask = _read_only(loss_mask)
        self._offsets = _read_only(offsets)
        self._lengths = _read_only(lengths)
        self._manifest = manifest
        self._stats = DatasetStats(
            samples=len(self._sample_ids),
            tokens=len(tokens),
            loss_tokens=int(loss_mask.sum(dtype=np.int64)),
            truncated=truncated,
            skipped=skipped,
        )

    def __len__(self) -> int:
        return len(self._sample_ids)

    def __getitem__(self, index: int) -> Sample:
        i = operator.index(index)
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample index {index} out of range for {len(self)} samples")
        i %= len(self)
        start, end = self._offsets[i], self._offsets[i + 1]
        return Sample(id=self._sample_ids[i], input_ids=self._tokens[start:end], loss_mask=self._loss_mask[start:end])

    @property
    def lengths(self) -> np.ndarray:
        """[N] int64 tokens per sample."""
        return self._lengths

    def anchor_counts(self, max_anchors: int) -> np.ndarray:
        """[N] int64: the anchors the batch stage draws from each sample, min(valid positions, `max_anchors`).

        A position t is valid when tokens t and t + 1 of the sample both carry loss (`model.anchors`'s rule, with
        a sample as one document); the batch stage draws up to `max_anchors` of them per document. Computed from
        the loss masks alone, so the sampler can balance anchors across rows before any batch is built."""
        loss = self._loss_mask.astype(bool)
        pair = np.zeros(len(loss), dtype=np.uint8)  # a few bytes per token: datasets may hold billions
        pair[:-1] = loss[:-1] & loss[1:]
        nonempty = self._lengths > 0
        pair[self._offsets[1:][nonempty] - 1] = 0  # a sample's last token pairs with the next one's first
        counts = np.zeros(len(self), dtype=np.int64)
        if nonempty.any():  # segments between consecutive starts of non-empty samples (empty ones hold nothing)
            counts[nonempty] = np.add.reduceat(pair, self._offsets[:-1][nonempty], dtype=np.int64)
        return np.minimum(counts, max_anchors)

    @property
    def stats(self) -> DatasetStats:
        return self._stats

    @property
    def manifest(self) -> dict[str, Any]:
        return self._manifest


def _read_only(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.flags.writeable = False
    return view


# ----------------------------------------------------------------------------------------------------------
# Writer.


class ShardWriter:
    """Write samples into a new shard directory, atomically.

    Everything goes to a hidden temporary sibling of `out_dir` that is renamed into place by `close()`, so a
    crash or an exception never leaves a half-written `out_dir`. An existing non-empty `out_dir` is refused
    unless `overwrite=True`, and even then it is only removed after the new directory has taken its place.
    As a context manager, an exception inside the block discards the temporary directory and leaves any
    existing output untouched; a clean exit closes the writer (the manifest is then in `.manifest`).
    """

    def __init__(
        self,
        out_dir: str | Path,
        tokenizer_name: str,
        vocab_size: int,
        samples_per_shard: int = 10000,
        source: dict[str, Any] | None = None,
        overwrite: bool = False,
        tokenizer_fingerprint: str | None = None,
    ):
        if not 1 <= vocab_size <= MAX_VOCAB_SIZE:
            raise ValueError(f"vocab_size must be in [1, {MAX_VOCAB_SIZE}], got {vocab_size}")
        if samples_per_shard < 1:
            raise ValueError(f"samples_per_shard must be >= 1, got {samples_per_shard}")
        if source is not None and not isinstance(source, dict):
            raise ValueError(f"source must be a dict or None, got {type(source).__name__}")
        # Fail now rather than at close(), after all the tokenising work.
        json.dumps(source)
        self.out_dir = Path(out_dir)
        self.tokenizer_name = tokenizer_name
        self.vocab_size = vocab_size
        self.samples_per_shard = samples_per_shard
        self.source = source
        self.overwrite = overwrite
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.manifest: dict[str, Any] | None = None
        # Refuse before any work is done; checked again at close in case the directory appeared meanwhile.
        _check_destination(self.out_dir, overwrite=overwrite)
        try:
            self.out_dir.parent.mkdir(parents=True, exist_ok=True)
            self._tmp_dir = Path(tempfile.mkdtemp(prefix=f".{self.out_dir.name}.tmp-", dir=self.out_dir.parent))
        except OSError as error:
            raise self._storage_error(error) from error
        self._file: BinaryIO | None = None
        self._shards: list[dict[str, Any]] = []
        self._num_samples = 0
        self._num_tokens = 0
        self._num_loss_tokens = 0
        self._closed = False

    def add(self, sample_id: str, input_ids: Sequence[int] | np.ndarray, loss_mask: Sequence[int] | np.ndarray) -> None:
        """Validate and append one sample; raises ValueError naming the sample and field if it is invalid."""
        if self._closed:
            raise RuntimeError(f"ShardWriter for {self.out_dir} is already closed")
        try:
            ids, mask = _validate_sample(sample_id, input_ids, loss_mask, self.vocab_size)
        except _FieldProblem as problem:
            raise ValueError(f"sample {sample_id!r}: field '{problem.field}': {problem.problem}") from None
        record = {"id": sample_id, "input_ids": ids.tolist(), "loss_mask": mask.tolist()}
        try:
            if self._file is None:
                name = shard_file_name(len(self._shards))
                self._file = (self._tmp_dir / name).open("wb")
                self._shards.append({"file": name, "num_samples": 0, "num_tokens": 0})
            self._file.write(json.dumps(record, separators=(",", ":")).encode("utf-8") + b"\n")
        except OSError as error:
            raise self._storage_error(error) from error
        shard = self._shards[-1]
        shard["num_samples"] += 1
        shard["num_tokens"] += len(ids)
        self._num_samples += 1
        self._num_tokens += len(ids)
        self._num_loss_tokens += int(mask.sum())
        if shard["num_samples"] == self.samples_per_shard:
            try:
                self._finish_shard()
            except OSError as error:
                raise self._storage_error(error) from error

    def _storage_error(self, error: OSError) -> OSError:
        """A StorageError for a write that failed because of the storage; any other OSError unchanged."""
        if is_storage_error(error) and not isinstance(error, StorageError):
            return storage_error("token shards", self.out_dir.parent, error)
        return error

    def close(self) -> dict[str, Any]:
        """Write the manifest, move the directory into place and return the manifest."""
        if self._closed:
            raise RuntimeError(f"ShardWriter for {self.out_dir} is already closed")
        self._closed = True
        try:
            self._finish_shard()
            if self._num_samples == 0:
                raise ValueError(f"{self.out_dir}: no samples were added; nothing was written")
            manifest: dict[str, Any] = {
                "format": SHARD_FORMAT,
                "tokenizer": self.tokenizer_name,
                "vocab_size": self.vocab_size,
                "num_samples": self._num_samples,
                "num_tokens": self._num_tokens,
                "num_loss_tokens": self._num_loss_tokens,
                "shards": self._shards,
            }
            if self.tokenizer_fingerprint is not None:
                manifest["tokenizer_fingerprint"] = self.tokenizer_fingerprint
            if self.source is not None:
                manifest["source"] = self.source
            with (self._tmp_dir / MANIFEST_NAME).open("w", encoding="utf-8") as f:
                json.dump(manifest, f, indent=2)
                f.write("\n")
                _sync(f)
            _check_destination(self.out_dir, overwrite=self.overwrite)
            _move_into_place(self._tmp_dir, self.out_dir)
        except OSError as error:
            self._discard()
            raise self._storage_error(error) from error
        except BaseException:
            self._discard()
            raise
        self.manifest = manifest
        return manifest

    def abort(self) -> None:
        """Discard everything written so far; existing output is left as it was."""
        if self._closed:
            return
        self._closed = True
        self._discard()

    def _discard(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            # Closing flushes: on a full disk that fails again, and the data is discarded anyway.
            with contextlib.suppress(OSError):
                file.close()
        shutil.rmtree(self._tmp_dir, ignore_errors=True)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._closed:
            self.close()

    def _finish_shard(self) -> None:
        if self._file is not None:
            _sync(self._file)
            self._file.close()
            self._file = None


def _sync(f: Any) -> None:
    # The rename is only atomic for readers if the data it publishes has reached the disk first.
    f.flush()
    os.fsync(f.fileno())


def _check_destination(out_dir: Path, *, overwrite: bool) -> None:
    refuse_file_as_directory(out_dir)
    if not out_dir.exists():
        return
    if not overwrite and any(out_dir.iterdir()):
        raise OutputExistsError(
            f"{out_dir}: directory exists and is not empty; pass overwrite=True (--overwrite) to replace it"
        )


def _move_into_place(new_dir: Path, out_dir: Path) -> None:
    """Rename `new_dir` to `out_dir`; an existing `out_dir` is removed only once `new_dir` has replaced it."""
    if not out_dir.exists():
        os.rename(new_dir, out_dir)
        return
    if not any(out_dir.iterdir()):
        out_dir.rmdir()
        os.rename(new_dir, out_dir)
        return
    backup = out_dir.with_name(f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}")
    os.rename(out_dir, backup)
    try:
        os.rename(new_dir, out_dir)
    except BaseException:
        os.rename(backup, out_dir)
        raise
    try:
        shutil.rmtree(backup)
    except OSError as error:
        warnings.warn(f"replaced {out_dir}, but could not remove its previous copy {backup}: {error}", stacklevel=3)


# ----------------------------------------------------------------------------------------------------------
# Loader.


def load_shards(
    path: str | Path,
    vocab_size: int | None = None,
    max_seq_len: int | None = None,
    overlong: Literal["truncate", "skip"] = "truncate",
) -> TokenDataset:
    """Load and validate a shard directory.

    `vocab_size` (for example the target's embedding rows) overrides the manifest's in the token-id range
    check. Samples longer than `max_seq_len` are cut to it (`overlong="truncate"`; dropped if no loss token is
    left) or dropped (`"skip"`); both are counted in `TokenDataset.stats`.
    """
    if overlong not in ("truncate", "skip"):
        raise ValueError(f"overlong must be 'truncate' or 'skip', got {overlong!r}")
    if max_seq_len is not None and max_seq_len < 1:
        raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
    root = Path(path)
    manifest_path = root / MANIFEST_NAME
    _refuse_link_outside(manifest_path, root)
    manifest = _read_manifest(manifest_path)
    vocab = manifest["vocab_size"] if vocab_size is None else vocab_size
    if not 1 <= vocab <= MAX_VOCAB_SIZE:
        raise ShardError(f"must be in [1, {MAX_VOCAB_SIZE}], got {vocab}", file=manifest_path, field="vocab_size")

    collector = _SampleCollector(max_seq_len=max_seq_len, overlong=overlong)
    totals = {"num_samples": 0, "num_tokens": 0, "num_loss_tokens": 0}
    for entry in manifest["shards"]:
        shard_path = root / entry["file"]
        _refuse_link_outside(shard_path, root)
        counts = _read_shard(shard_path, vocab_size=vocab, collector=collector)
        for key in ("num_samples", "num_tokens"):
            if counts[key] != entry[key]:
                raise ShardError(
                    f"manifest.json says {key}={entry[key]} for this file, but it holds {counts[key]}",
                    file=shard_path,
                    field=key,
                )
        for key in totals:
            totals[key] += counts[key]
    for key, found in totals.items():
        if manifest[key] != found:
            raise ShardError(
                f"manifest says {manifest[key]}, but the shard files hold {found}",
                file=manifest_path,
                field=key,
            )
    if not collector.sample_ids:
        why = f"{collector.skipped} dropped by max_seq_len={max_seq_len}" if collector.skipped else "it holds none"
        raise ShardError(f"no samples to train on ({why})", file=root)
    return collector.build(manifest)


def _refuse_link_outside(shard_path: Path, root: Path) -> None:
    """A shard file must lie in its directory: a symbolic link that leads elsewhere would have the loader read (and
    a later error message quote) a file the manifest does not own. Links within the directory are fine."""
    if not shard_path.is_symlink():
        return
    resolved, home = shard_path.resolve(), root.resolve()
    if not resolved.is_relative_to(home):
        raise ShardError(
            f"is a symbolic link to {resolved}, outside the shard directory; copy the file in instead of linking it",
            file=shard_path,
        )


def _read_manifest(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ShardError("missing manifest: not a shard directory (write one with `prepare` or ShardWriter)", file=path)
    try:
        manifest = json.loads(path.read_bytes())
    except json.JSONDecodeError as error:
        raise ShardError(f"invalid JSON: {error.msg} (column {error.colno})", file=path, line=error.lineno) from None
    except UnicodeDecodeError as error:
        raise ShardError(f"not UTF-8 text: {error}", file=path) from None
    except RecursionError:
        raise ShardError("JSON nested too deeply", file=path) from None
    except OSError as error:
        raise ShardError(f"cannot read: {error.strerror or error}", file=path) from None
    if not isinstance(manifest, dict):
        raise ShardError(f"expected a JSON object, got {type(manifest).__name__}", file=path)
    if "format" not in manifest:
        raise ShardError("missing", file=path, field="format")
    if manifest["format"] != SHARD_FORMAT:
        raise ShardError(
            f"unknown format {manifest['format']!r} (this version reads {SHARD_FORMAT!r})",
            file=path,
            field="format",
        )
    _require(manifest, "tokenizer", str, path)
    if "tokenizer_fingerprint" in manifest:
        _require(manifest, "tokenizer_fingerprint", str, path)
    _require(manifest, "vocab_size", int, path, minimum=1)
    for key in ("num_samples", "num_tokens", "num_loss_tokens"):
        _require(manifest, key, int, path, minimum=0)
    shards = _require(manifest, "shards", list, path)
    for i, entry in enumerate(shards):
        if not isinstance(entry, dict):
            raise ShardError(f"expected an object, got {type(entry).__name__}", file=path, field=f"shards[{i}]")
        name = _require(entry, "file", str, path, prefix=f"shards[{i}].")
        # A plain file name inside the directory: a manifest must not point readers elsewhere on disk.
        if Path(name).name != name or name in ("", ".", ".."):
            raise ShardError(
                f"{name!r} is not a file name inside the shard directory",
                file=path,
                field=f"shards[{i}].file",
            )
        _require(entry, "num_samples", int, path, minimum=0, prefix=f"shards[{i}].")
        _require(entry, "num_tokens", int, path, minimum=0, prefix=f"shards[{i}].")
    if "source" in manifest:
        _require(manifest, "source", dict, path)
    return manifest


def _require(
    mapping: dict[str, Any], key: str, kind: type, path: Path, minimum: int | None = None, prefix: str = ""
) -> Any:
    if key not in mapping:
        raise ShardError("missing", file=path, field=prefix + key)
    value = mapping[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ShardError(f"expected {kind.__name__}, got {type(value).__name__}", file=path, field=prefix + key)
    if minimum is not None and value < minimum:
        raise ShardError(f"must be >= {minimum}, got {value}", file=path, field=prefix + key)
    return value


def _read_shard(shard_path: Path, *, vocab_size: int, collector: _SampleCollector) -> dict[str, int]:
    """Validate every record of one shard file into `collector`; return its counts as stored (untruncated)."""
    if not shard_path.is_file():
        raise ShardError("listed in manifest.json but missing", file=shard_path)
    counts = {"num_samples": 0, "num_tokens": 0, "num_loss_tokens": 0}
    with shard_path.open("rb") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                raise ShardError("empty line (one record per line, no blank lines)", file=shard_path, line=line_number)
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ShardError(
                    f"invalid JSON: {error.msg} (column {error.colno})", file=shard_path, line=line_number
                ) from None
            except UnicodeDecodeError as error:
                raise ShardError(f"not UTF-8 text: {error}", file=shard_path, line=line_number) from None
            except RecursionError:
                raise ShardError("JSON nested too deeply", file=shard_path, line=line_number) from None
            if not isinstance(record, dict):
                raise ShardError(
                    f"expected a JSON object, got {type(record).__name__}", file=shard_path, line=line_number
                )
            for field in ("id", "input_ids", "loss_mask"):
                if field not in record:
                    raise ShardError("missing", file=shard_path, line=line_number, field=field)
            try:
                ids, mask = _validate_sample(record["id"], record["input_ids"], record["loss_mask"], vocab_size)
            except _FieldProblem as problem:
                raise ShardError(problem.problem, file=shard_path, line=line_number, field=problem.field) from None
            counts["num_samples"] += 1
            counts["num_tokens"] += len(ids)
            counts["num_loss_tokens"] += int(mask.sum())
            collector.add(record["id"], ids, mask)
    return counts


class _SampleCollector:
    """Applies the over-long policy and gathers samples until they are joined into a TokenDataset."""

    def __init__(self, *, max_seq_len: int | None, overlong: str):
        self.max_seq_len = max_seq_len
        self.overlong = overlong
        self.sample_ids: list[str] = []
        self._tokens: list[np.ndarray] = []
        self._masks: list[np.ndarray] = []
        self.truncated = 0
        self.skipped = 0

    def add(self, sample_id: str, ids: np.ndarray, mask: np.ndarray) -> None:
        if self.max_seq_len is not None and len(ids) > self.max_seq_len:
            if self.overlong == "skip":
                self.skipped += 1
                return
            ids, mask = ids[: self.max_seq_len], mask[: self.max_seq_len]
            if not mask.any():
                self.skipped += 1
                return
            self.truncated += 1
        self.sample_ids.append(sample_id)
        self._tokens.append(ids)
        self._masks.append(mask)

    def build(self, manifest: dict[str, Any]) -> TokenDataset:
        offsets = np.zeros(len(self._tokens) + 1, dtype=np.int64)
        np.cumsum([len(t) for t in self._tokens], out=offsets[1:])
        return TokenDataset(
            sample_ids=self.sample_ids,
            tokens=np.concatenate(self._tokens),
            loss_mask=np.concatenate(self._masks),
            offsets=offsets,
            manifest=manifest,
            truncated=self.truncated,
            skipped=self.skipped,
        )
