"""Regeneration through an OpenAI-compatible server (`engine="openai"`), against a real HTTP server on localhost
that runs the tiny target (tests/chat_server.py): the same output as our engine in-process, bounded concurrency,
retries after 503s, dropped connections and timeouts, resume after a crash, truncation, the server's reasoning
field, rejected requests, and refusals of a wrong model or an absent server."""

from __future__ import annotations

import json
import socket

import pytest

from chat_server import ChatServer
from decoding_helpers import one_thread  # noqa: F401 (autouse fixture)
from dflash_trainer import cli
from dflash_trainer.config import EndpointConfig
from dflash_trainer.data.chat import tokenize_conversation
from dflash_trainer.data.prepare import prepare
from dflash_trainer.data.shards import load_shards
from dflash_trainer.targets import regen_journal
from dflash_trainer.targets.endpoint import EndpointError
from dflash_trainer.targets.loader import LoadedTarget, load_target
from dflash_trainer.targets.regenerate import RegenerateError, regenerate
from regen_helpers import CONVERSATIONS, MAX_NEW_TOKENS, read_output, stopping_target_of

FAST = dict(backoff_s=0.01)


@pytest.fixture
def target(tiny_target_dir) -> LoadedTarget:
    return stopping_target_of(load_target(str(tiny_target_dir), device="cpu"))


def _through_server(target, url, out, *, records=CONVERSATIONS, **settings):
    endpoint = EndpointConfig(**{"base_url": url, "concurrency": 3, **FAST, **settings.pop("endpoint", {})})
    return regenerate(
        records,
        None,
        out,
        max_new_tokens=settings.pop("max_new_tokens", MAX_NEW_TOKENS),
        batch_size=1,
        progress=False,
        engine="openai",
        endpoint=endpoint,
        tokenizer=target.tokenizer,
        **settings,
    )


def _in_process(target, out):
    return regenerate(
        CONVERSATIONS, target, out, max_new_tokens=MAX_NEW_TOKENS, batch_size=2, progress=False, engine="engine"
    )


def test_server_output_equals_the_engine_in_process(target, tmp_path):
    """Multi-turn records, replies that stop, replies cut at max_new_tokens and an empty reply: byte for byte what
    our engine writes in this process; at most `concurrency` requests were in flight, and more than one."""
    reference = _in_process(target, tmp_path / "engine")
    with ChatServer(target, latency_s=0.05) as server:
        summary = _through_server(target, server.url, tmp_path / "server")
    written = (tmp_path / "server" / regen_journal.OUTPUT_FILE).read_bytes()
    assert written == (tmp_path / "engine" / regen_journal.OUTPUT_FILE).read_bytes()
    assert "truncated" in written.decode() and summary.dropped == reference.dropped
    assert reference.dropped["empty_reply"] >= 1
    assert (summary.responses, summary.truncated, summary.new_tokens) == (
        reference.responses,
        reference.truncated,
        reference.new_tokens,
    )
    assert summary.engine == f"the server at {server.url} (tiny-target)"  # the name the server lists
    assert 2 <= server.max_in_flight <= 3
    payload = server.payloads[0]
    assert payload["temperature"] == 0.0 and payload["max_tokens"] == MAX_NEW_TOKENS and "seed" not in payload


@pytest.mark.parametrize(
    ("fault", "fail_first", "timeout_s"),
    [("503", 2, 600.0), ("drop", 2, 600.0), ("slow", 1, 2.0)],
)
def test_failed_attempts_are_retried(target, tmp_path, fault, fail_first, timeout_s):
    """The first attempts of every request fail (HTTP 503, the connection closed without an answer, no answer within
    the timeout); the next one succeeds and the output is as without faults."""
    with ChatServer(target) as server:
        _through_server(target, server.url, tmp_path / "clean")
    with ChatServer(target, fault=fault, fail_first=fail_first, slow_s=2 * timeout_s) as server:
        _through_server(target, server.url, tmp_path / "out", endpoint={"retries": 2, "timeout_s": timeout_s})
    assert read_output(tmp_path / "out") == read_output(tmp_path / "clean")
    assert set(server.attempts.values()) == {fail_first + 1}


def test_a_request_that_keeps_failing_ends_the_run_naming_it(target, tmp_path):
    with ChatServer(target, fault="503", fail_first=5) as server, pytest.raises(EndpointError) as failure:
        _through_server(target, server.url, tmp_path / "out", endpoint={"retries": 1})
    message = str(failure.value)
    assert "no answer after 2 attempt(s)" in message and "HTTP 503: server busy" in message
    assert "record " in message and ", turn 1" in message


class _Crash(Exception):
    pass


def test_killed_run_resumes_asking_only_for_unfinished_records(target, tmp_path, monkeypatch):
    records = [[{"role": "user", "content": f"w{i} w{i + 1}"}] for i in range(7)]
    with ChatServer(target) as server:
        _through_server(target, server.url, tmp_path / "reference", records=records)

    original_write = regen_journal.Journal.write
    written = []

    def crash_after_three(self, entry):
        if len(written) == 3:
            raise _Crash
        written.append(entry["index"])
        original_write(self, entry)

    monkeypatch.setattr(regen_journal.Journal, "write", crash_after_three)
    with ChatServer(target) as server, pytest.raises(_Crash):
        _through_server(target, server.url, tmp_path / "out", records=records)
    monkeypatch.setattr(regen_journal.Journal, "write", original_write)
    with ChatServer(target) as server:
        summary = _through_server(target, server.url, tmp_path / "out", records=records)
    asked = sorted(int(messages[0]["content"].split()[0][1:]) for messages in server.answered)
    assert asked == sorted(set(range(7)) - set(written))
    assert summary.resumed_records == 3 and summary.records + sum(summary.dropped.values()) == 7
    assert read_output(tmp_path / "out") == read_output(tmp_path / "reference")


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_the_servers_reasoning_is_kept_for_keep_reasoning(target, tmp_path, field):
    """A server with a reasoning parser returns the first word apart: it is kept as `reasoning_content`, which
    tokenisation trains on with keep_reasoning and drops without."""
    records = [[{"role": "user", "content": f"w{i} w{i + 1} w{i + 2}"}] for i in range(4)]
    with ChatServer(target, reasoning_field=field) as server:
        _through_server(target, server.url, tmp_path / "out", records=records, max_new_tokens=8)
    replies = [record["messages"][-1] for record in read_output(tmp_path / "out")]
    assert replies and all(
        r["reasoning_content"] and not r["content"].startswith(r["reasoning_content"]) for r in replies
    )
    output = tmp_path / "out" / regen_journal.OUTPUT_FILE
    for keep in (False, True):
        prepare([output], target.tokenizer, target.name, tmp_path / f"shards-{keep}", keep_reasoning=keep)
        dataset = load_shards(tmp_path / f"shards-{keep}")
        for index, record in enumerate(read_output(tmp_path / "out")):
            ids, _ = tokenize_conversation(target.tokenizer, record["messages"], keep_reasoning=keep)
            assert list(dataset[index].input_ids) == ids
    without, with_reasoning = (load_shards(tmp_path / f"shards-{keep}") for keep in (False, True))
    assert len(with_reasoning[0].input_ids) > len(without[0].input_ids)


def test_a_reply_cut_inside_its_reasoning_is_kept_as_written(tiny_target_dir, tmp_path):
    """One token, all of it reasoning, cut at max_new_tokens: content `<think>` + the thinking, truncated."""
    target = load_target(str(tiny_target_dir), device="cpu")  # no extra stop ids: no reply is empty
    records = [[{"role": "user", "content": f"w{i} w{i + 1}"}] for i in range(3)]
    with ChatServer(target, reasoning_field="reasoning") as server:
        summary = _through_server(target, server.url, tmp_path / "out", records=records, max_new_tokens=1)
    for record in read_output(tmp_path / "out"):
        reply = record["messages"][-1]
        assert reply["content"].startswith("<think>\n") and reply["truncated"] is True
        assert "reasoning_content" not in reply
    assert summary.truncated == summary.records == 3


def test_a_rejected_request_fails_the_run_or_is_skipped(target, tmp_path):
    """HTTP 400 for one record (a prompt beyond the server's context): named with its place in the input, or left
    out and counted with the server's message."""
    with ChatServer(target, reject_word="w42") as server:
        with pytest.raises(RegenerateError, match=r"records\[3\]: record 3: the server refused turn 1: HTTP 400: "):
            _through_server(target, server.url, tmp_path / "raise")
        summary = _through_server(target, server.url, tmp_path / "skip", on_error="skip")
    assert summary.dropped["rejected_by_server"] == 1
    assert "prompt too long for this server" in summary.examples["rejected_by_server"]
    assert 3 not in [record["index"] for record in read_output(tmp_path / "skip")]
    assert "first rejected_by_server: records[3]" in summary.format()


def test_wrong_model_or_no_server_is_refused_before_any_work(target, tmp_path):
    with ChatServer(target) as server:
        with pytest.raises(EndpointError, match=r"serves \['tiny-target'\], not 'other'"):
            _through_server(target, server.url, tmp_path / "a", endpoint={"model": "other"})
        # Named explicitly, the served name works as the listed one does.
        _through_server(target, server.url, tmp_path / "b", endpoint={"model": "tiny-target"})
    with socket.socket() as probe:  # a port where nothing listens
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(EndpointError, match=r"listing the models: no answer after 2 attempt\(s\).*Connection"):
        _through_server(target, f"http://127.0.0.1:{port}/v1", tmp_path / "c", endpoint={"retries": 1})
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()


def test_cli_regenerates_through_a_server(target, tiny_target_dir, tmp_path, capsys):
    """`dflash-trainer regenerate --engine openai`: only the target's tokenizer is loaded here."""
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"w{i} w{i + 3}"}) + "\n" for i in range(4)))
    with ChatServer(target) as server:
        base = ["regenerate", "--input", str(path), "--target", str(tiny_target_dir), "--max-new-tokens", "3"]
        status = cli.main([*base, "--out", str(tmp_path / "out"), "--engine", "openai", "--base-url", server.url])
    assert status == 0, capsys.readouterr().err
    assert [record["id"] for record in read_output(tmp_path / "out")] == ["p0", "p1", "p2", "p3"]
    assert "with the server at" in capsys.readouterr().out
    assert cli.main([*base, "--out", str(tmp_path / "x"), "--engine", "openai", "--base-url", "localhost:8000"]) == 2
    assert "--base-url must name the server's http(s) API root" in capsys.readouterr().err


def test_the_recipes_data_step_asks_the_server(tiny_target_dir, tmp_path):
    """`prepare.engine: openai`: the automatic data step regenerates through the server, then tokenises."""
    from dflash_trainer.config import load_config
    from dflash_trainer.train.pipeline import ensure_train_data, load_config_target

    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"w{i} w{i + 2}"}) + "\n" for i in range(3)))
    plain = load_target(str(tiny_target_dir), device="cpu")
    with ChatServer(plain) as server:
        config = load_config(
            None,
            [
                f"target.name_or_path={tiny_target_dir}",
                "target.device=cpu",
                f"data.train_shards={tmp_path / 'shards'}",
                f"prepare.source={path}",
                "prepare.regenerate=true",
                "prepare.max_new_tokens=4",
                "prepare.engine=openai",
                f"prepare.endpoint.base_url={server.url}",
            ],
        )
        ensure_train_data(config, load_config_target(config, device="cpu"))
        assert len(server.answered) == 3
    dataset = load_shards(tmp_path / "shards")
    assert sorted(dataset[i].id for i in range(len(dataset))) == ["q0", "q1", "q2"]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("prepare.engine=openai", r"prepare\.endpoint\.base_url: must name the server"),
        ("prepare.endpoint.base_url=localhost:8000", r"prepare\.endpoint\.base_url: must start with http"),
        ("prepare.endpoint.concurrency=0", r"prepare\.endpoint\.concurrency: must be >= 1"),
        ("prepare.endpoint.timeout_s=0", r"prepare\.endpoint\.timeout_s: must be > 0"),
    ],
)
def test_bad_endpoint_settings_are_refused_naming_the_key(override, message):
    from dflash_trainer.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])
