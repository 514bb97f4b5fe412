"""Property-based tests: arbitrary bytes and JSON give a valid result or the project's own error, never a crash
from deep inside (a KeyError, TypeError, RecursionError... is a bug: the user would get a traceback).

Three readers of user files: the config loader (recipe bytes and overrides), the shard reader (manifest and
shard bytes), the chat-record parser (`normalize_record` and the JSONL reader of `prepare`).
"""

from __future__ import annotations

import contextlib
import json
import string
from pathlib import Path

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dflash_trainer.config import ConfigError, RunConfig, load_config
from dflash_trainer.data.chat import RecordError, normalize_record
from dflash_trainer.data.prepare import PrepareError, read_chat_records
from dflash_trainer.data.shards import MANIFEST_NAME, ShardError, TokenDataset, load_shards

# Few examples per run (the suite runs on 2 shared cores); shrinking still finds a minimal failing input.
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=25,
)


# Bytes biased toward what the parsers care about, plus anything at all; nesting deep enough to exhaust the
# interpreter's recursion limit in a JSON parser.
def structured(max_depth: int) -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.binary(max_size=300),
        json_values.map(lambda value: json.dumps(value).encode()),
        st.text(alphabet=string.printable + "ÿ€[]{}:-", max_size=200).map(str.encode),
        st.integers(1, max_depth).map(lambda depth: b"[" * depth + b"]" * depth),
    )


structured_bytes = structured(3000)


# ------------------------------------------------------------------------------------------- config


config_keys = st.sampled_from(
    ["optim.lr", "train.epochs", "drafter.sliding_layers", "data.packing", "placement", "run_dir", "x", "", "a.b.c"]
)


@FAST
@given(recipe=structured(60))  # the pure-Python YAML parser is slow on deep nesting: one deep case below
@example(recipe=b"[" * 3000 + b"]" * 3000)
def test_config_loader_on_arbitrary_recipe_bytes(tmp_path_factory, recipe):
    path = tmp_path_factory.mktemp("cfg") / "r.yaml"
    path.write_bytes(recipe)
    try:
        assert isinstance(load_config(path), RunConfig)
    except ConfigError as error:
        assert str(error)


@FAST
@given(tree=st.dictionaries(st.sampled_from(["optim", "train", "drafter", "data", "eval", "zz"]), json_values))
def test_config_loader_on_arbitrary_sections(tmp_path_factory, tree):
    path = tmp_path_factory.mktemp("cfg") / "r.yaml"
    path.write_text(json.dumps(tree))  # JSON is YAML
    try:
        load_config(path)
    except ConfigError as error:
        assert str(error)


@FAST
@given(
    overrides=st.lists(st.tuples(config_keys, st.text(max_size=20)).map("=".join) | st.text(max_size=20), max_size=4)
)
def test_config_overrides_on_arbitrary_text(overrides):
    try:
        load_config(None, overrides)
    except ConfigError as error:
        assert str(error)


# ------------------------------------------------------------------------------------------- shards


def valid_manifest(shard_bytes: bytes) -> dict:
    lines = shard_bytes.count(b"\n")
    return {
        "format": "dflash-shards/1",
        "tokenizer": "t",
        "vocab_size": 50,
        "num_samples": lines,
        "num_tokens": 0,
        "num_loss_tokens": 0,
        "shards": [{"file": "shard-00000.jsonl", "num_samples": lines, "num_tokens": 0}],
    }


record_values = st.fixed_dictionaries(
    {"id": json_scalars, "input_ids": json_values, "loss_mask": json_values},
    optional={"extra": json_values},
)
shard_lines = st.lists(
    st.one_of(
        record_values.map(json.dumps),
        st.builds(
            lambda n, k: json.dumps({"id": "s", "input_ids": list(range(n)), "loss_mask": [k % 2] * n}),
            st.integers(0, 60),
            st.integers(0, 3),
        ),
        structured_bytes.map(lambda b: b.decode("utf-8", "replace").replace("\n", " ")),
    ),
    max_size=4,
).map(lambda lines: "".join(line + "\n" for line in lines).encode())


def read_shard_dir(root: Path) -> None:
    try:
        dataset = load_shards(root, max_seq_len=32)
    except ShardError as error:
        assert str(error)
    else:
        assert isinstance(dataset, TokenDataset) and len(dataset) > 0


@FAST
@given(manifest=structured_bytes, shard=structured_bytes)
def test_shard_reader_on_arbitrary_bytes(tmp_path_factory, manifest, shard):
    root = tmp_path_factory.mktemp("shards")
    (root / MANIFEST_NAME).write_bytes(manifest)
    (root / "shard-00000.jsonl").write_bytes(shard)
    read_shard_dir(root)


@FAST
@given(
    shard=shard_lines,
    manifest_edit=st.dictionaries(
        st.sampled_from(["vocab_size", "num_tokens", "shards", "format"]), json_values, max_size=2
    ),
)
def test_shard_reader_on_arbitrary_records(tmp_path_factory, shard, manifest_edit):
    root = tmp_path_factory.mktemp("shards")
    (root / MANIFEST_NAME).write_text(json.dumps(valid_manifest(shard) | manifest_edit))
    (root / "shard-00000.jsonl").write_bytes(shard)
    read_shard_dir(root)


# ------------------------------------------------------------------------------------------- chat records


message = st.fixed_dictionaries(
    {},
    optional={
        "role": st.sampled_from(["user", "assistant", "system", "tool"]) | json_scalars,
        "content": json_values | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": json_scalars})),
        "reasoning_content": json_scalars,
        "from": st.sampled_from(["human", "gpt"]) | json_scalars,
        "value": json_scalars,
    },
)
chat_records = st.one_of(
    json_values,
    st.fixed_dictionaries({"messages": st.lists(message, max_size=4) | json_values}),
    st.fixed_dictionaries({"conversations": st.lists(message, max_size=4) | json_values}),
    st.fixed_dictionaries({"prompt": json_scalars}, optional={"response": json_scalars}),
)


@FAST
@given(record=chat_records, require_assistant=st.booleans())
def test_chat_parser_on_arbitrary_json(record, require_assistant):
    try:
        messages = normalize_record(record, require_assistant=require_assistant)
    except RecordError as error:
        assert str(error) and error.reason
    else:
        assert messages and all(m["role"] in ("system", "user", "assistant") for m in messages)
        assert all(isinstance(m["content"], str) and m["content"].strip() for m in messages)


@FAST
@given(data=structured_bytes)
def test_chat_jsonl_reader_on_arbitrary_bytes(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("chat") / "chats.jsonl"
    path.write_bytes(data)
    skipped = []
    for _, record in read_chat_records(path, on_invalid=skipped.append):
        with contextlib.suppress(RecordError):
            normalize_record(record)
    assert all(isinstance(error, PrepareError) and error.line for error in skipped)
