"""Token shards: round trip, validation messages, atomic and non-destructive writing, over-long samples."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from dflash_trainer.data import shards
from dflash_trainer.data.shards import (
    MANIFEST_NAME,
    SHARD_FORMAT,
    ShardError,
    ShardWriter,
    load_shards,
)

VOCAB = 100

# (id, input_ids, loss_mask)
SAMPLES = [
    ("a", [1, 2, 3, 4], [0, 0, 1, 1]),
    ("b", [5, 6], [0, 1]),
    ("c", [7, 8, 9, 10, 11, 12], [0, 1, 1, 0, 1, 1]),
    ("d", [99, 0, 13], [1, 1, 1]),
    ("e", [14, 15, 16, 17, 18], [0, 0, 0, 0, 1]),
]


def write_samples(out_dir: Path, samples=SAMPLES, samples_per_shard: int = 2, **kwargs) -> dict:
    with ShardWriter(out_dir, "test-tok", VOCAB, samples_per_shard=samples_per_shard, **kwargs) as writer:
        for sample_id, ids, mask in samples:
            writer.add(sample_id, ids, mask)
    assert writer.manifest is not None
    return writer.manifest


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_round_trip(tmp_path: Path) -> None:
    out = tmp_path / "data"
    manifest = write_samples(out, source={"origin": "unit-test"})

    assert sorted(p.name for p in out.iterdir()) == [
        MANIFEST_NAME,
        "shard-00000.jsonl",
        "shard-00001.jsonl",
        "shard-00002.jsonl",
    ]
    assert manifest == json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["format"] == SHARD_FORMAT
    assert manifest["tokenizer"] == "test-tok"
    assert manifest["vocab_size"] == VOCAB
    assert manifest["num_samples"] == 5
    assert manifest["num_tokens"] == 4 + 2 + 6 + 3 + 5
    assert manifest["num_loss_tokens"] == 2 + 1 + 4 + 3 + 1
    assert manifest["shards"] == [
        {"file": "shard-00000.jsonl", "num_samples": 2, "num_tokens": 6},
        {"file": "shard-00001.jsonl", "num_samples": 2, "num_tokens": 9},
        {"file": "shard-00002.jsonl", "num_samples": 1, "num_tokens": 5},
    ]
    assert manifest["source"] == {"origin": "unit-test"}
    # One record per line, in the documented layout.
    first_line = (out / "shard-00000.jsonl").read_text().splitlines()[0]
    assert json.loads(first_line) == {"id": "a", "input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1]}

    dataset = load_shards(out)
    assert len(dataset) == 5
    assert dataset.manifest == manifest
    np.testing.assert_array_equal(dataset.lengths, [4, 2, 6, 3, 5])
    assert dataset.lengths.dtype == np.int64
    for i, (sample_id, ids, mask) in enumerate(SAMPLES):
        sample = dataset[i]
        assert sample.id == sample_id
        assert sample.input_ids.dtype == np.int32
        assert sample.loss_mask.dtype == np.uint8
        np.testing.assert_array_equal(sample.input_ids, ids)
        np.testing.assert_array_equal(sample.loss_mask, mask)
    assert dataset[-1].id == "e"
    with pytest.raises(IndexError):
        dataset[5]
    # Samples are views into the dataset's flat arrays and must not be editable.
    with pytest.raises(ValueError):
        dataset[0].input_ids[0] = 3
    stats = dataset.stats
    assert (stats.samples, stats.tokens, stats.loss_tokens, stats.truncated, stats.skipped) == (5, 20, 11, 0, 0)


def test_writer_accepts_numpy_arrays(tmp_path: Path) -> None:
    write_samples(tmp_path / "data", samples=[("x", np.array([3, 4, 5]), np.array([0, 1, 1], dtype=np.uint8))])
    sample = load_shards(tmp_path / "data")[0]
    np.testing.assert_array_equal(sample.input_ids, [3, 4, 5])
    np.testing.assert_array_equal(sample.loss_mask, [0, 1, 1])


# ----------------------------------------------------------------------------------------------------------
# Malformed shards: each case corrupts a valid directory and names the file, line and field it expects.


def replace_line(directory: Path, file: str, line: int, text: str) -> None:
    path = directory / file
    lines = path.read_text().splitlines()
    lines[line - 1] = text
    path.write_text("\n".join(lines) + "\n")


def replace_record(directory: Path, file: str, line: int, **fields) -> None:
    record = {"id": "z", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}
    record.update(fields)
    replace_line(directory, file, line, json.dumps({k: v for k, v in record.items() if v is not ...}))


def edit_manifest(directory: Path, edit: Callable[[dict], None]) -> None:
    path = directory / MANIFEST_NAME
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


MALFORMED = {
    "missing manifest": (lambda d: (d / MANIFEST_NAME).unlink(), MANIFEST_NAME, None, None, "missing manifest"),
    "manifest invalid JSON": (
        lambda d: (d / MANIFEST_NAME).write_text('{"format": '),
        MANIFEST_NAME,
        1,
        None,
        "invalid JSON",
    ),
    "unknown format": (
        lambda d: edit_manifest(d, lambda m: m.update(format="dflash-shards/9")),
        MANIFEST_NAME,
        None,
        "format",
        "unknown format",
    ),
    "manifest field wrong type": (
        lambda d: edit_manifest(d, lambda m: m.update(vocab_size="100")),
        MANIFEST_NAME,
        None,
        "vocab_size",
        "expected int",
    ),
    "manifest shard path escapes": (
        lambda d: edit_manifest(d, lambda m: m["shards"][1].update(file="../x.jsonl")),
        MANIFEST_NAME,
        None,
        "shards[1].file",
        "not a file name",
    ),
    "shard file missing": (
        lambda d: (d / "shard-00001.jsonl").unlink(),
        "shard-00001.jsonl",
        None,
        None,
        "missing",
    ),
    "invalid JSON": (
        lambda d: replace_line(d, "shard-00001.jsonl", 2, '{"id": "d", "input_ids": [1, 2'),
        "shard-00001.jsonl",
        2,
        None,
        "invalid JSON",
    ),
    "blank line": (
        lambda d: replace_line(d, "shard-00000.jsonl", 2, ""),
        "shard-00000.jsonl",
        2,
        None,
        "empty line",
    ),
    "record not an object": (
        lambda d: replace_line(d, "shard-00000.jsonl", 1, "[1, 2, 3]"),
        "shard-00000.jsonl",
        1,
        None,
        "expected a JSON object",
    ),
    "missing id": (
        lambda d: replace_record(d, "shard-00000.jsonl", 2, id=...),
        "shard-00000.jsonl",
        2,
        "id",
        "missing",
    ),
    "missing input_ids": (
        lambda d: replace_record(d, "shard-00001.jsonl", 1, input_ids=...),
        "shard-00001.jsonl",
        1,
        "input_ids",
        "missing",
    ),
    "missing loss_mask": (
        lambda d: replace_record(d, "shard-00002.jsonl", 1, loss_mask=...),
        "shard-00002.jsonl",
        1,
        "loss_mask",
        "missing",
    ),
    "id not a string": (
        lambda d: replace_record(d, "shard-00000.jsonl", 1, id=7),
        "shard-00000.jsonl",
        1,
        "id",
        "expected a string, got int",
    ),
    "input_ids a string": (
        lambda d: replace_record(d, "shard-00000.jsonl", 2, input_ids="1 2 3"),
        "shard-00000.jsonl",
        2,
        "input_ids",
        "expected a list of integers, got str",
    ),
    "input_ids holds a float": (
        lambda d: replace_record(d, "shard-00001.jsonl", 2, input_ids=[1, 2.5, 3]),
        "shard-00001.jsonl",
        2,
        "input_ids",
        "a list holding float 2.5",
    ),
    "input_ids nested": (
        lambda d: replace_record(d, "shard-00001.jsonl", 2, input_ids=[[1, 2, 3]]),
        "shard-00001.jsonl",
        2,
        "input_ids",
        "expected a list of integers",
    ),
    "loss_mask holds a bool": (
        lambda d: replace_record(d, "shard-00000.jsonl", 1, loss_mask=[False, True, True]),
        "shard-00000.jsonl",
        1,
        "loss_mask",
        "a list holding bool False",
    ),
    "length mismatch": (
        lambda d: replace_record(d, "shard-00001.jsonl", 1, loss_mask=[0, 1]),
        "shard-00001.jsonl",
        1,
        "loss_mask",
        "length 2 differs from the length of input_ids (3)",
    ),
    "token id equal to vocab_size": (
        lambda d: replace_record(d, "shard-00002.jsonl", 1, input_ids=[1, VOCAB, 2]),
        "shard-00002.jsonl",
        1,
        "input_ids",
        f"token id {VOCAB} at position 1 is outside [0, {VOCAB})",
    ),
    "negative token id": (
        lambda d: replace_record(d, "shard-00000.jsonl", 2, input_ids=[-1, 2, 3]),
        "shard-00000.jsonl",
        2,
        "input_ids",
        "token id -1 at position 0",
    ),
    "loss mask value 2": (
        lambda d: replace_record(d, "shard-00001.jsonl", 2, loss_mask=[0, 2, 1]),
        "shard-00001.jsonl",
        2,
        "loss_mask",
        "value 2 at position 1 is not 0 or 1",
    ),
    "all-zero loss mask": (
        lambda d: replace_record(d, "shard-00000.jsonl", 1, loss_mask=[0, 0, 0]),
        "shard-00000.jsonl",
        1,
        "loss_mask",
        "no loss token",
    ),
    "empty sample": (
        lambda d: replace_record(d, "shard-00000.jsonl", 2, input_ids=[], loss_mask=[]),
        "shard-00000.jsonl",
        2,
        "loss_mask",
        "no loss token",
    ),
    "shard num_samples disagrees": (
        lambda d: edit_manifest(d, lambda m: m["shards"][1].update(num_samples=3)),
        "shard-00001.jsonl",
        None,
        "num_samples",
        "says num_samples=3 for this file, but it holds 2",
    ),
    "shard num_tokens disagrees": (
        lambda d: edit_manifest(d, lambda m: m["shards"][0].update(num_tokens=7)),
        "shard-00000.jsonl",
        None,
        "num_tokens",
        "says num_tokens=7 for this file, but it holds 6",
    ),
    "total num_loss_tokens disagrees": (
        lambda d: edit_manifest(d, lambda m: m.update(num_loss_tokens=12)),
        MANIFEST_NAME,
        None,
        "num_loss_tokens",
        "manifest says 12, but the shard files hold 11",
    ),
    "total num_samples disagrees": (
        lambda d: edit_manifest(d, lambda m: m.update(num_samples=4)),
        MANIFEST_NAME,
        None,
        "num_samples",
        "manifest says 4, but the shard files hold 5",
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_shards_name_file_line_and_field(tmp_path: Path, case: str) -> None:
    corrupt, file, line, field, problem = MALFORMED[case]
    out = tmp_path / "data"
    write_samples(out)
    corrupt(out)
    with pytest.raises(ShardError) as caught:
        load_shards(out)
    error = caught.value
    assert isinstance(error, ValueError)
    assert Path(error.file) == out / file
    assert error.line == line
    assert error.field == field
    message = str(error)
    location = f"{out / file}:{line}" if line is not None else str(out / file)
    assert message.startswith(location + ": ")
    if field is not None:
        assert f"field '{field}'" in message
    assert problem in message


def test_vocab_size_argument_overrides_manifest(tmp_path: Path) -> None:
    out = tmp_path / "data"
    write_samples(out)  # sample "d" holds token 99, valid for the manifest's vocab of 100
    assert len(load_shards(out, vocab_size=VOCAB)) == 5
    with pytest.raises(ShardError) as caught:
        load_shards(out, vocab_size=50)
    assert (Path(caught.value.file).name, caught.value.line, caught.value.field) == (
        "shard-00001.jsonl",
        2,
        "input_ids",
    )
    assert "token id 99 at position 0 is outside [0, 50)" in str(caught.value)


# ----------------------------------------------------------------------------------------------------------
# Over-long samples.


def test_overlong_truncate(tmp_path: Path) -> None:
    out = tmp_path / "data"
    write_samples(out)
    dataset = load_shards(out, max_seq_len=4, overlong="truncate")
    # "c" (6 tokens) and "e" (5 tokens) are cut to 4; "e" keeps no loss token (its only one is at position 4).
    assert [dataset[i].id for i in range(len(dataset))] == ["a", "b", "c", "d"]
    np.testing.assert_array_equal(dataset.lengths, [4, 2, 4, 3])
    np.testing.assert_array_equal(dataset[2].input_ids, [7, 8, 9, 10])
    np.testing.assert_array_equal(dataset[2].loss_mask, [0, 1, 1, 0])
    stats = dataset.stats
    assert (stats.samples, stats.tokens, stats.loss_tokens, stats.truncated, stats.skipped) == (4, 13, 8, 1, 1)


def test_overlong_skip(tmp_path: Path) -> None:
    out = tmp_path / "data"
    write_samples(out)
    dataset = load_shards(out, max_seq_len=4, overlong="skip")
    assert [dataset[i].id for i in range(len(dataset))] == ["a", "b", "d"]
    np.testing.assert_array_equal(dataset.lengths, [4, 2, 3])
    np.testing.assert_array_equal(dataset[2].input_ids, [99, 0, 13])
    stats = dataset.stats
    assert (stats.samples, stats.tokens, stats.loss_tokens, stats.truncated, stats.skipped) == (3, 9, 6, 0, 2)


def test_nothing_left_after_skipping_is_an_error(tmp_path: Path) -> None:
    out = tmp_path / "data"
    write_samples(out)
    with pytest.raises(ShardError, match="no samples to train on \\(5 dropped by max_seq_len=1\\)"):
        load_shards(out, max_seq_len=1, overlong="skip")


# ----------------------------------------------------------------------------------------------------------
# Writer: validation, atomicity, never losing existing output.


@pytest.mark.parametrize(
    ("sample_id", "input_ids", "loss_mask", "field", "problem"),
    [
        (3, [1, 2], [1, 1], "id", "expected a string"),
        ("s", [1.5, 2], [1, 1], "input_ids", "expected a list of integers"),
        ("s", np.zeros((2, 2), dtype=np.int64), [1, 1], "input_ids", "an array of shape [2, 2]"),
        ("s", [1, 2], [1], "loss_mask", "length 1 differs"),
        ("s", [1, VOCAB + 5], [1, 1], "input_ids", f"token id {VOCAB + 5} at position 1"),
        ("s", [1, 2], [0, 0], "loss_mask", "no loss token"),
        ("s", [1, 2], [0, 3], "loss_mask", "value 3 at position 1"),
    ],
)
def test_writer_rejects_invalid_samples(tmp_path: Path, sample_id, input_ids, loss_mask, field, problem) -> None:
    writer = ShardWriter(tmp_path / "data", "tok", VOCAB)
    with pytest.raises(ValueError) as caught:
        writer.add(sample_id, input_ids, loss_mask)
    assert f"sample {sample_id!r}: field '{field}'" in str(caught.value)
    assert problem in str(caught.value)
    writer.abort()
    assert list(tmp_path.iterdir()) == []


def test_refuses_to_overwrite_and_leaves_existing_intact(tmp_path: Path) -> None:
    out = tmp_path / "data"
    write_samples(out)
    before = snapshot(out)
    with pytest.raises(FileExistsError, match="not empty; pass overwrite=True"):
        ShardWriter(out, "tok", VOCAB)
    assert snapshot(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["data"]


def test_empty_existing_directory_is_used(tmp_path: Path) -> None:
    out = tmp_path / "data"
    out.mkdir()
    write_samples(out)
    assert len(load_shards(out)) == 5


def test_directory_appearing_during_write_is_not_replaced(tmp_path: Path) -> None:
    out = tmp_path / "data"
    writer = ShardWriter(out, "tok", VOCAB)
    writer.add("x", [1, 2], [0, 1])
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        writer.close()
    assert snapshot(out) == {"precious.txt": b"keep me"}
    assert [p.name for p in tmp_path.iterdir()] == ["data"]


def test_exception_in_writer_block_keeps_existing_output(tmp_path: Path) -> None:
    out = tmp_path / "data"
    write_samples(out)
    before = snapshot(out)
    with pytest.raises(RuntimeError, match="tokenizer crashed"), ShardWriter(out, "tok", VOCAB, overwrite=True) as w:
        w.add("new", [1, 2, 3], [0, 1, 1])
        raise RuntimeError("tokenizer crashed")
    assert snapshot(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["data"]  # the temporary directory is gone


def test_invalid_sample_in_writer_block_keeps_existing_output(tmp_path: Path) -> None:
    out = tmp_path / "data"
    write_samples(out)
    before = snapshot(out)
    with pytest.raises(ValueError, match="field 'loss_mask'"), ShardWriter(out, "tok", VOCAB, overwrite=True) as w:
        w.add("new", [1, 2, 3], [0, 1, 1])
        w.add("bad", [1, 2, 3], [0, 0, 0])
    assert snapshot(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["data"]


def test_overwrite_replaces_existing_output(tmp_path: Path) -> None:
    out = tmp_path / "data"
    write_samples(out)
    manifest = write_samples(out, samples=[("only", [4, 5], [1, 1])], overwrite=True)
    assert manifest["num_samples"] == 1
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST_NAME, "shard-00000.jsonl"]
    dataset = load_shards(out)
    assert [dataset[0].id] == ["only"]
    assert [p.name for p in tmp_path.iterdir()] == ["data"]  # neither temp nor backup left behind


def test_failed_final_rename_restores_existing_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "data"
    write_samples(out)
    before = snapshot(out)
    real_rename = os.rename

    def rename(src, dst):
        # Let the old directory move aside, then fail to move the new one into place.
        if Path(src).name.startswith(".data.tmp-"):
            raise OSError("disk gone")
        real_rename(src, dst)

    monkeypatch.setattr(shards.os, "rename", rename)
    with pytest.raises(OSError, match="disk gone"):
        write_samples(out, overwrite=True)
    assert snapshot(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["data"]


def test_close_without_samples_writes_nothing(tmp_path: Path) -> None:
    writer = ShardWriter(tmp_path / "data", "tok", VOCAB)
    with pytest.raises(ValueError, match="no samples were added"):
        writer.close()
    assert list(tmp_path.iterdir()) == []


def test_closed_writer_refuses_more_samples(tmp_path: Path) -> None:
    writer = ShardWriter(tmp_path / "data", "tok", VOCAB)
    writer.add("x", [1], [1])
    writer.close()
    with pytest.raises(RuntimeError, match="already closed"):
        writer.add("y", [1], [1])
