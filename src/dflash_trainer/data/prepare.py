"""Chat data -> token shards: read records, normalise, tokenise with loss masks, filter, write atomically.

Inputs are JSONL files (one chat record per line, see `chat.normalize_record` for the accepted layouts) or
directories written by `datasets.Dataset.save_to_disk` (the `datasets` package is imported only then). A sample's
id is its record's own `id` when it has one (a prompt set's `HumanEval/0`, which regeneration keeps), else
`FILE:LINE` (the row number for a datasets directory).

Filters, each counted in the summary:
- `duplicate`: the same conversation (after the reasoning policy) seen before in any input;
- `too_long`: more tokens than `max_seq_len`;
- `too_few_loss_tokens`: fewer assistant tokens than `min_loss_tokens` (an anchor needs loss_mask[a] and
  loss_mask[a+1], so below 2 a sample cannot hold a single training block).
Malformed records raise `PrepareError` naming the file, the line and the field (`on_error="raise"`), or are
skipped and counted per reason (`on_error="skip"`), the first message of each reason kept for the summary. A
record the tokenizer or its chat template fails on is such a record too (`tokenizer_error`, with the
tokenizer's own message): one odd conversation must not end a run over millions. What no record can fix (a
slow tokenizer, no chat template) is refused before the first record. The output directory appears only when
everything succeeded (ShardWriter writes to a temporary directory and renames it); a full disk is a
`StorageError` naming the directory, and the temporary directory is removed.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from transformers import PreTrainedTokenizerBase

from dflash_trainer.data.chat import (
    RecordError,
    apply_reasoning_policy,
    normalize_record,
    tokenize_conversations,
)
from dflash_trainer.data.shards import ShardWriter, tokenizer_fingerprint
from dflash_trainer.errors import UserError

DEFAULT_MIN_LOSS_TOKENS = 2
DEFAULT_SAMPLES_PER_SHARD = 10000
# Records tokenised per batched encode (the Rust tokenizer spreads a batch over the cores).
TOKENIZE_BATCH = 512


class PrepareError(UserError, ValueError):
    """Bad input for `prepare`. `file` and `line` locate it (line is the row number for a datasets directory)."""

    def __init__(self, problem: str, *, file: str | Path | None = None, line: int | None = None, reason: str = ""):
        self.file = None if file is None else str(file)
        self.line = line
        self.problem = problem
        self.reason = reason
        super().__init__(f"{_location(file, line)}: {problem}" if file is not None else problem)


# What a line of input leaves for the batch: messages to tokenise, the record's error, the error of a line that
# could not be read, or None for a duplicate.
Pending = list[dict[str, str]] | RecordError | PrepareError | None


def _location(file: str | Path | None, line: int | None) -> str:
    if line is None:
        return str(file)
    if file is not None and Path(file).is_dir():
        return f"{file}, row {line}"
    return f"{file}:{line}"


@dataclass
class PrepareSummary:
    out_dir: str
    records: int = 0
    samples: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    # Well-formed records removed by a filter: duplicate, too_long, too_few_loss_tokens.
    dropped: dict[str, int] = field(default_factory=dict)
    # Malformed records skipped with on_error="skip", per reason (invalid_json, missing_role, ...).
    skipped: dict[str, int] = field(default_factory=dict)
    # The first skipped record of each reason: "file:line: problem".
    examples: dict[str, str] = field(default_factory=dict)

    def format(self) -> str:
        lines = [
            f"prepared {self.samples:,} samples ({self.tokens:,} tokens, {self.loss_tokens:,} loss tokens) "
            f"from {self.records:,} records -> {self.out_dir}"
        ]
        if self.dropped:
            lines.append(f"  dropped: {_counts(self.dropped)}")
        if self.skipped:
            lines.append(f"  skipped malformed: {_counts(self.skipped)}")
            lines += [f"    first {reason}: {example}" for reason, example in sorted(self.examples.items())]
        return "\n".join(lines)


def _counts(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{reason} {count:,}" for reason, count in sorted(counts.items()))


# ----------------------------------------------------------------------------------------------------------
# Reading records


def read_chat_records(
    path: str | Path, *, on_invalid: Callable[[PrepareError], None] | None = None
) -> Iterator[tuple[int, Any]]:
    """Yield `(line_no, record)` for every record of a JSONL file or a saved `datasets` directory.

    `line_no` is 1-based (the row number for a datasets directory); blank lines are skipped. A line that is
    not valid UTF-8 JSON raises `PrepareError` naming the file and line, or, when `on_invalid` is given, is
    passed to it and skipped. Records are returned as parsed; `normalize_record` validates them.
    """
    path = Path(path)
    if path.is_dir():
        yield from _dataset_records(path)
    elif path.is_file():
        yield from _jsonl_records(path, on_invalid=on_invalid)
    else:
        raise PrepareError("no such file or directory", file=path, reason="missing_input")


def _jsonl_records(path: Path, *, on_invalid: Callable[[PrepareError], None] | None) -> Iterator[tuple[int, Any]]:
    # Lines are decoded one by one so that a bad byte is reported with its line instead of ending the file.
    with gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8")
                if not text.strip():
                    continue
                record = json.loads(text)
            except UnicodeDecodeError as error:
                problem = PrepareError(
                    f"not UTF-8 text: {error.reason}", file=path, line=line_no, reason="invalid_utf8"
                )
            except json.JSONDecodeError as error:
                problem = PrepareError(
                    f"invalid JSON: {error.msg} (column {error.colno})", file=path, line=line_no, reason="invalid_json"
                )
            except RecursionError:
                problem = PrepareError(
                    "invalid JSON: nested too deeply", file=path, line=line_no, reason="invalid_json"
                )
            else:
                yield line_no, record
                continue
            if on_invalid is None:
                raise problem
            on_invalid(problem)


def _dataset_records(path: Path) -> Iterator[tuple[int, Any]]:
    try:
        import datasets
    except ImportError:
        raise PrepareError(
            "is a directory, read as a `datasets` dataset saved with save_to_disk, but the `datasets` package "
            "is not installed (pip install datasets)",
            file=path,
            reason="missing_package",
        ) from None
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        splits = list(loaded)
        if "train" in loaded:
            loaded = loaded["train"]
        elif len(splits) == 1:
            loaded = loaded[splits[0]]
        else:
            raise PrepareError(
                f"holds the splits {splits} and none is called 'train'; save the split to use on its own",
                file=path,
                reason="ambiguous_split",
            )
    yield from enumerate(loaded, start=1)


# ----------------------------------------------------------------------------------------------------------
# prepare


def prepare(
    inputs: Sequence[str | Path],
    tokenizer: PreTrainedTokenizerBase,
    tokenizer_name: str,
    out_dir: str | Path,
    *,
    keep_reasoning: bool = False,
    min_loss_tokens: int = DEFAULT_MIN_LOSS_TOKENS,
    max_seq_len: int | None = None,
    dedup: bool = True,
    on_error: Literal["raise", "skip"] = "raise",
    overwrite: bool = False,
    limit: int | None = None,
    samples_per_shard: int = DEFAULT_SAMPLES_PER_SHARD,
) -> PrepareSummary:
    """Tokenise chat records from `inputs` into a shard directory at `out_dir` and return what happened.

    `tokenizer_name` is recorded in the manifest (the target's name, so a run can check it trains on matching
    tokens). `limit` stops after that many samples have been written. An existing non-empty `out_dir` is
    refused unless `overwrite=True`; it is replaced only after the new shards are complete.
    """
    # Arguments come from the command line (`prepare --max-seq-len 0`): user errors, one line each.
    if on_error not in ("raise", "skip"):
        raise PrepareError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    if min_loss_tokens < 1:
        raise PrepareError(
            f"min_loss_tokens must be >= 1 (a sample without loss tokens trains nothing), got {min_loss_tokens}"
        )
    if max_seq_len is not None and max_seq_len < 1:
        raise PrepareError(f"--max-seq-len must be >= 1, got {max_seq_len}")
    if limit is not None and limit < 1:
        raise PrepareError(f"--limit must be >= 1, got {limit}")
    paths = [Path(p) for p in inputs]
    if not paths:
        raise PrepareError("prepare needs at least one input")
    _check_tokenizer_usable(tokenizer, tokenizer_name)
    for path in paths:
        if not path.exists():
            raise PrepareError("no such file or directory", file=path, reason="missing_input")

    summary = PrepareSummary(out_dir=str(out_dir))
    dropped: Counter[str] = Counter()
    skipped: Counter[str] = Counter()
    seen: set[bytes] = set()
    labels = _input_labels(paths)
    source = {
        "inputs": [str(p) for p in paths],
        "keep_reasoning": keep_reasoning,
        "min_loss_tokens": min_loss_tokens,
        "max_seq_len": max_seq_len,
        "dedup": dedup,
    }

    def skip(error: PrepareError) -> None:
        skipped[error.reason] += 1
        summary.examples.setdefault(error.reason, str(error))

    with ShardWriter(
        out_dir,
        tokenizer_name,
        len(tokenizer),
        samples_per_shard=samples_per_shard,
        source=source,
        overwrite=overwrite,
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
    ) as writer:

        def write(label: str, line_no: int, input_ids: list[int], loss_mask: list[int]) -> None:
            num_loss_tokens = sum(loss_mask)
            if max_seq_len is not None and len(input_ids) > max_seq_len:
                dropped["too_long"] += 1
            elif num_loss_tokens < min_loss_tokens:
                dropped["too_few_loss_tokens"] += 1
            else:
                writer.add(record_ids.get(line_no) or f"{label}:{line_no}", input_ids, loss_mask)
                summary.samples += 1
                summary.tokens += len(input_ids)
                summary.loss_tokens += num_loss_tokens

        def flush(path: Path, label: str, pending: list[tuple[int, Pending]]) -> bool:
            """Tokenise the pending records in one batch and handle everything pending in input order (unreadable
            lines too, so an error is raised for the first bad line, never a later one); True once `limit` is
            reached (records after it are neither counted nor written, as if never read)."""
            batch = [messages for _, messages in pending if isinstance(messages, list)]
            tokenized = iter(_tokenize_many(tokenizer, batch, keep_reasoning=keep_reasoning))
            for line_no, messages in pending:
                summary.records += 1
                if messages is None:
                    dropped["duplicate"] += 1
                    continue
                if isinstance(messages, PrepareError):  # an unreadable line (invalid UTF-8 or JSON)
                    if on_error == "raise":
                        raise messages
                    skip(messages)
                    continue
                result = next(tokenized) if isinstance(messages, list) else messages
                if isinstance(result, RecordError):
                    problem = PrepareError(str(result), file=path, line=line_no, reason=result.reason)
                    if on_error == "raise":
                        raise problem from result
                    skip(problem)
                    continue
                write(label, line_no, *result)
                if limit is not None and summary.samples >= limit:
                    return True
            return False

        done = False
        # (line, what is pending there), tokenised and handled in batches; see `Pending`. One list for the run:
        # the reader's callback appends unreadable lines to it.
        pending: list[tuple[int, Pending]] = []
        # The records' own ids (`HumanEval/0`, a regenerated record's source) by line of the pending ones: the
        # sample ids; FILE:LINE for a record without one.
        record_ids: dict[int, str] = {}

        def queue_unreadable(problem: PrepareError) -> None:
            pending.append((problem.line or 0, problem))

        for path, label in zip(paths, labels, strict=True):
            records = read_chat_records(path, on_invalid=queue_unreadable)
            for line_no, record in records:
                record_id = record.get("id") if isinstance(record, Mapping) else None
                if isinstance(record_id, (str, int)) and not isinstance(record_id, bool) and str(record_id):
                    record_ids[line_no] = str(record_id)
                try:
                    messages = normalize_record(record)
                    key = _conversation_key(messages, keep_reasoning=keep_reasoning) if dedup else None
                    if key is not None and key in seen:
                        pending.append((line_no, None))
                    else:
                        if key is not None:
                            seen.add(key)
                        pending.append((line_no, messages))
                except RecordError as error:
                    pending.append((line_no, error))
                if len(pending) >= TOKENIZE_BATCH:
                    done = flush(path, label, pending)
                    pending.clear()
                    record_ids.clear()
                    if done:
                        break
            if not done and pending:
                done = flush(path, label, pending)
            pending.clear()
            record_ids.clear()
            if done:
                break
        summary.dropped = dict(dropped)
        summary.skipped = dict(skipped)
        if summary.samples == 0:
            # Raised inside the writer's block so the empty temporary directory is discarded.
            if summary.records == 0:
                raise PrepareError(
                    f"{', '.join(str(p) for p in paths)}: no records to prepare (empty input); give chat records, "
                    "one JSON object per line"
                )
            raise PrepareError(f"no sample left to write; {summary.format()}")
    return summary


def _check_tokenizer_usable(tokenizer: PreTrainedTokenizerBase, name: str) -> None:
    """What no single record can fix, refused before the first one (tokenize_conversation's requirements)."""
    if not getattr(tokenizer, "is_fast", False):
        raise PrepareError(f"tokenizer of {name!r} is not a fast tokenizer; its character offsets locate the loss mask")
    if not tokenizer.chat_template:
        raise PrepareError(f"tokenizer of {name!r} has no chat template; use the target's instruct/chat variant")


def _tokenize_many(
    tokenizer: PreTrainedTokenizerBase, conversations: list[list[dict[str, str]]], *, keep_reasoning: bool
) -> list[tuple[list[int], list[int]] | RecordError]:
    """`tokenize_conversations`, with anything the tokenizer or its template raised on a conversation turned into
    a RecordError (`tokenizer_error`), so that it is reported with its file and line, or skipped."""
    results: list[tuple[list[int], list[int]] | RecordError] = []
    for result in tokenize_conversations(tokenizer, conversations, keep_reasoning=keep_reasoning):
        if isinstance(result, Exception) and not isinstance(result, RecordError):
            # tokenizers and jinja templates raise many types (Rust panics arrive as RuntimeError)
            error = RecordError("tokenizer_error", f"the tokenizer failed: {type(result).__name__}: {result}")
            error.__cause__ = result
            result = error
        results.append(result)
    return results


def _input_labels(paths: list[Path]) -> list[str]:
    """Sample-id prefixes: the file names, or the full paths when two inputs share a name."""
    names = [p.name for p in paths]
    if len(set(names)) == len(names):
        return names
    return [str(p) for p in paths]


def _conversation_key(messages: list[dict[str, str]], *, keep_reasoning: bool) -> bytes:
    # Keyed on what gets tokenised: two records differing only in dropped reasoning are duplicates.
    turns = apply_reasoning_policy(messages, keep_reasoning=keep_reasoning)
    encoded = json.dumps(turns, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return hashlib.blake2b(encoded, digest_size=16).digest()
