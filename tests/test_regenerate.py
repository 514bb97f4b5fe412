"""Regenerating assistant turns with the target: exact greedy replies, multi-turn order, replies cut at
max_new_tokens kept open or dropped, resume after a crash mid-batch, the transformers fallback, a hybrid (linear
attention) target through the engine."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from decoding_helpers import cpu_target, one_thread  # noqa: F401 (one_thread: autouse fixture)
from dflash_trainer.data.chat import generation_prompt_ids, tokenize_conversation
from dflash_trainer.data.prepare import prepare
from dflash_trainer.data.shards import load_shards
from dflash_trainer.decoding.batch import BatchDecoder
from dflash_trainer.targets import regen_journal
from dflash_trainer.targets import regenerate as regen
from dflash_trainer.targets.loader import LoadedTarget, load_target
from dflash_trainer.targets.regenerate import RegenerateError, cut_at_stop, regenerate
from regen_helpers import (
    CONVERSATIONS,
    MAX_NEW_TOKENS,
    expected_conversation,
    messages_of,
    read_output,
    stopping_target_of,
)


@pytest.fixture
def target(tiny_target_dir) -> LoadedTarget:
    return load_target(str(tiny_target_dir), device="cpu")


@pytest.fixture
def stopping_target(target) -> LoadedTarget:
    return stopping_target_of(target)


def test_cut_at_stop():
    assert cut_at_stop([5, 6, 2, 7, 2], [2]) == ([5, 6], True)
    assert cut_at_stop([5, 6, 7], [2, 9]) == ([5, 6, 7], False)
    assert cut_at_stop([9], [2, 9]) == ([], True)


@pytest.mark.parametrize("engine", ["engine", "hf"])
def test_replies_are_exactly_the_targets_greedy_replies(stopping_target, tmp_path, engine):
    target = stopping_target
    summary = regenerate(
        CONVERSATIONS,
        target,
        tmp_path / "out",
        max_new_tokens=MAX_NEW_TOKENS,
        batch_size=2,
        progress=False,
        engine=engine,
    )

    expected = {}
    for index, item in enumerate(CONVERSATIONS):
        record_id = item.get("id", str(index)) if isinstance(item, dict) else str(index)
        expected[record_id] = expected_conversation(target, messages_of(item))
    assert expected["3"] is None
    replies = [m for c in expected.values() if c for m in c if m["role"] == "assistant"]
    assert {"truncated" in m for m in replies} == {True, False}  # some replies stopped, some were cut
    written = read_output(tmp_path / "out")
    assert [r["id"] for r in written] == [key for key, value in expected.items() if value is not None]
    assert [r["index"] for r in written] == [i for i, value in enumerate(expected.values()) if value is not None]
    for record in written:
        assert record["messages"] == expected[record["id"]]
    assert summary.records == len(written)
    assert summary.dropped == {"empty_reply": len(expected) - len(written)}
    assert summary.truncated == sum("truncated" in m for m in replies)
    assert not (tmp_path / "out" / regen_journal.JOURNAL_FILE).exists()


def test_prompt_batches_change_nothing(stopping_target, tmp_path, monkeypatch):
    """First-turn prompts are tokenised in batches of PROMPT_BATCH: batches of 2 (boundaries inside the list, a
    too-long prompt among them) write what one batch writes, and each prompt is what it is tokenised alone."""
    prefixes = [m[: regen._assistant_slots(m)[0]] for m in map(messages_of, CONVERSATIONS)]
    tokenizer = stopping_target.tokenizer
    alone = [generation_prompt_ids(tokenizer, [messages])[0] for messages in prefixes]
    assert generation_prompt_ids(tokenizer, prefixes) == alone
    longest = max(len(ids) for ids in alone)
    settings = dict(max_new_tokens=MAX_NEW_TOKENS, batch_size=2, progress=False, max_prompt_tokens=longest - 1)
    whole = regenerate(CONVERSATIONS, stopping_target, tmp_path / "whole", **settings)
    monkeypatch.setattr(regen, "PROMPT_BATCH", 2)
    pairs = regenerate(CONVERSATIONS, stopping_target, tmp_path / "pairs", **settings)
    assert read_output(tmp_path / "pairs") == read_output(tmp_path / "whole")
    assert pairs.dropped == whole.dropped and whole.dropped["prompt_too_long"] >= 1


def test_multi_turn_chains_are_served_before_single_turn_prompts(target, tmp_path, monkeypatch):
    """Turns of multi-turn conversations (a chain: each waits for the previous reply) go before every single-turn
    prompt, the longest chain first, so chains do not trail at the end with the rows idle; single-turn prompts
    keep shortest first. A one-row engine stand-in records the order it serves and answers every turn "w5"."""
    from dflash_trainer.decoding.batch import Completion

    reply = [*target.tokenizer("w5", add_special_tokens=False)["input_ids"], target.stop_token_ids[0]]
    served: list[tuple[int, int]] = []

    class OneRow(regen.Engine):
        name = "one row"

        def generate(self, queue):
            while queue:
                (request,) = queue.pop(1)
                served.append(request.key)
                yield Completion(request.key, reply, stopped=True)

    monkeypatch.setattr(regen, "make_engine", lambda *args, **kwargs: OneRow())
    three_turns = [
        {"role": "user", "content": "w1"},
        {"role": "assistant", "content": "w2"},
        {"role": "user", "content": "w3"},
        {"role": "assistant", "content": "w2"},
        {"role": "user", "content": "w4"},
    ]
    records = [*CONVERSATIONS, three_turns]  # 0, 1, 3: one turn; 2 and 4: two turns; 5: three turns
    summary = regenerate(records, target, tmp_path / "out", max_new_tokens=MAX_NEW_TOKENS, batch_size=1, progress=False)
    assert summary.records == 6 and summary.responses == 10
    chains, singles = served[:7], served[7:]
    assert chains[0] == (5, 0) and sorted(chains) == [(2, 0), (2, 1), (4, 0), (4, 1), (5, 0), (5, 1), (5, 2)]
    first_prompts = {
        index: messages_of(records[index])[: regen._assistant_slots(messages_of(records[index]))[0]]
        for index in (0, 1, 3)
    }
    lengths = {index: len(generation_prompt_ids(target.tokenizer, [p])[0]) for index, p in first_prompts.items()}
    assert [index for index, _ in singles] == sorted((0, 1, 3), key=lambda index: lengths[index])
    assert all(turn["content"] == "w5" for turn in read_output(tmp_path / "out")[5]["messages"][1::2])


def test_progress_in_a_log_is_not_redrawn_per_reply(stopping_target, tmp_path, capsys):
    """stderr is not a terminal here (captured, as in a log file): the bar draws its start and end, not a line per
    reply (the GPU main job's log held 50K regeneration lines)."""
    many = [[{"role": "user", "content": f"w{i} w{i + 1}"}] for i in range(30)]
    regenerate(many, stopping_target, tmp_path / "out", max_new_tokens=MAX_NEW_TOKENS, batch_size=4, progress=True)
    redraws = [line for line in capsys.readouterr().err.replace("\r", "\n").splitlines() if "regenerate" in line]
    assert 1 <= len(redraws) <= 3, redraws
    assert "30/30" in redraws[-1]


def test_cut_replies_are_dropped_on_request(stopping_target, tmp_path):
    summary = regenerate(
        CONVERSATIONS,
        stopping_target,
        tmp_path / "out",
        max_new_tokens=MAX_NEW_TOKENS,
        batch_size=3,
        progress=False,
        truncated="drop",
    )
    written = read_output(tmp_path / "out")
    assert written and all("truncated" not in m for r in written for m in r["messages"])
    assert summary.dropped["truncated"] == summary.truncated > 0
    assert summary.records + sum(summary.dropped.values()) == len(CONVERSATIONS)


def test_a_cut_turn_ends_the_conversation_and_trains_without_end_of_turn(target, tmp_path):
    """Multi-turn record whose first reply is cut: later turns are not generated, and tokenisation ends the
    sample with the cut reply's content (no <|im_end|>)."""
    record = {
        "messages": [
            {"role": "user", "content": "w1 w2"},
            {"role": "assistant", "content": "w3"},
            {"role": "user", "content": "w4"},
            {"role": "assistant", "content": "w5"},
        ]
    }
    summary = regenerate([record], target, tmp_path / "out", max_new_tokens=2, batch_size=2, progress=False)
    (written,) = read_output(tmp_path / "out")
    messages = written["messages"]
    assert summary.responses == 1 and summary.truncated == 1
    assert [m["role"] for m in messages] == ["user", "assistant"] and messages[1]["truncated"] is True
    ids, mask = tokenize_conversation(target.tokenizer, messages)
    reply_ids = target.tokenizer(messages[1]["content"], add_special_tokens=False)["input_ids"]
    assert ids[-len(reply_ids) :] == reply_ids and mask[-len(reply_ids) :] == [1] * len(reply_ids)
    assert sum(mask) == len(reply_ids) and target.tokenizer.convert_tokens_to_ids("<|im_end|>") not in ids[-3:]
    # `prepare` reads the output as it is and writes that sample.
    prepare([tmp_path / "out" / regen.OUTPUT_FILE], target.tokenizer, target.name, tmp_path / "shards")
    dataset = load_shards(tmp_path / "shards")
    assert len(dataset) == 1
    assert list(dataset[0].input_ids) == ids and list(dataset[0].loss_mask) == mask


class _Crash(Exception):
    pass


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_killed_run_resumes_and_writes_what_an_uninterrupted_run_writes(target, tmp_path, monkeypatch, temperature):
    """Crash after 3 of 7 records were written, with rows still in flight, plus a journal line cut short by
    the kill; the rerun regenerates only the 4 unfinished records and the output equals an uninterrupted run's."""
    records = [[{"role": "user", "content": f"w{i} w{i + 1}"}] for i in range(7)]
    settings = dict(max_new_tokens=MAX_NEW_TOKENS, batch_size=3, temperature=temperature, progress=False)
    regenerate(records, target, tmp_path / "reference", **settings)

    original_write = regen_journal.Journal.write
    written = []

    def crash_after_three(self, entry):
        if len(written) == 3:
            raise _Crash
        written.append(entry["index"])
        original_write(self, entry)

    monkeypatch.setattr(regen_journal.Journal, "write", crash_after_three)
    with pytest.raises(_Crash):
        regenerate(records, target, tmp_path / "out", **settings)
    monkeypatch.setattr(regen_journal.Journal, "write", original_write)
    assert not (tmp_path / "out" / regen.OUTPUT_FILE).exists()
    with (tmp_path / "out" / regen_journal.JOURNAL_FILE).open("a") as f:
        f.write('{"index": 6, "id": "6", "mess')  # a write cut short by the kill

    prompts = []
    original_prefill = BatchDecoder._prefill

    def counting_prefill(self, rows, requests):
        prompts.extend(request.key for request in requests)
        original_prefill(self, rows, requests)

    monkeypatch.setattr(BatchDecoder, "_prefill", counting_prefill)
    summary = regenerate(records, target, tmp_path / "out", **settings)

    assert sorted(index for index, _ in prompts) == sorted(set(range(7)) - set(written))
    assert summary.resumed_records == 3 and summary.records == 7
    assert read_output(tmp_path / "out") == read_output(tmp_path / "reference")
    assert json.loads((tmp_path / "out" / regen.SETTINGS_FILE).read_text())["complete"] is True
    # A finished directory is not regenerated again.
    prompts.clear()
    again = regenerate(records, target, tmp_path / "out", **settings)
    assert not prompts and again.records == 7


def test_rerun_with_other_settings_or_input_is_refused(target, tmp_path):
    records = [[{"role": "user", "content": "w1"}], [{"role": "user", "content": "w2"}]]
    regenerate(records, target, tmp_path / "out", max_new_tokens=2, batch_size=2, progress=False)
    with pytest.raises(RegenerateError, match=r"max_new_tokens: 2 -> 3"):
        regenerate(records, target, tmp_path / "out", max_new_tokens=3, batch_size=2, progress=False)
    other = [{"id": "x", "messages": records[0]}, {"id": "y", "messages": records[1]}]
    with pytest.raises(RegenerateError, match="input records changed"):
        regenerate(other, target, tmp_path / "out", max_new_tokens=2, batch_size=2, progress=False)
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "regen-00000.jsonl").write_text("{}\n")
    with pytest.raises(RegenerateError, match=r"no regen\.json"):
        regenerate(records, target, tmp_path / "old", max_new_tokens=2, batch_size=2, progress=False)


def test_long_prompts_are_left_out_and_counted(target, tmp_path):
    records = [[{"role": "user", "content": "w1"}], [{"role": "user", "content": " ".join(["w2"] * 30)}]]
    summary = regenerate(
        records, target, tmp_path / "out", max_new_tokens=2, batch_size=2, progress=False, max_prompt_tokens=20
    )
    assert summary.dropped == {"prompt_too_long": 1} and [r["index"] for r in read_output(tmp_path / "out")] == [0]


def test_hybrid_target_regenerates_through_the_engine(tiny_qwen3_5, tiny_chat_tokenizer, tmp_path):
    """Linear-attention layers keep per-row recurrent states in the engine: with two rows, refilled as replies
    finish, every reply equals the hybrid's own greedy `generate`."""
    target = cpu_target(tiny_qwen3_5, tiny_chat_tokenizer, "tiny-hybrid")
    summary = regenerate(
        CONVERSATIONS, target, tmp_path / "out", max_new_tokens=MAX_NEW_TOKENS, batch_size=2, progress=False
    )
    assert summary.engine == "the decoding engine"
    expected = [expected_conversation(target, messages_of(item)) for item in CONVERSATIONS]
    written = read_output(tmp_path / "out")
    assert [record["index"] for record in written] == [i for i, value in enumerate(expected) if value is not None]
    assert [record["messages"] for record in written] == [value for value in expected if value is not None]


def test_jsonl_input_layouts_and_errors(target, tmp_path):
    path = tmp_path / "data.jsonl"
    lines = [
        {"messages": [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2"}]},
        {"id": "sharegpt-7", "conversations": [{"from": "human", "value": "w3"}, {"from": "gpt", "value": "w4"}]},
        {"prompt": "w5 w6"},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary = regenerate(path, target, tmp_path / "out", max_new_tokens=2, batch_size=4, progress=False, limit=2)
    written = read_output(tmp_path / "out")
    assert [r["id"] for r in written] == ["data.jsonl:1", "sharegpt-7"]
    assert written[1]["messages"][0] == {"role": "user", "content": "w3"}
    assert written[1]["messages"][1]["content"] != "w4"
    assert summary.records == 2

    path.write_text(json.dumps(lines[0]) + "\n" + json.dumps({"messages": [{"role": "robot", "content": "w1"}]}) + "\n")
    with pytest.raises(RegenerateError, match=r"data\.jsonl:2: .*role"):
        regenerate(path, target, tmp_path / "out2", max_new_tokens=2, batch_size=4, progress=False)
    # A reply to no prompt: a system message alone, or an assistant turn before any user turn.
    for messages in ([{"role": "system", "content": "w1"}], [{"role": "assistant", "content": "w1"}]):
        path.write_text(json.dumps({"messages": messages}) + "\n")
        with pytest.raises(RegenerateError, match=r"data\.jsonl:1: the conversation has no user turn"):
            regenerate(path, target, tmp_path / "out3", max_new_tokens=2, batch_size=4, progress=False)


# ---------------------------------------------------------------------------------------------- bad records


def _failing_on(word: str, tokenizer):
    """The tokenizer's `__call__`, raising as a Rust panic would (pyo3's PanicException is a BaseException) on any
    text that holds `word`."""
    original = type(tokenizer).__call__

    def call(self, text, *args, **kwargs):
        texts = [text] if isinstance(text, str) else text
        if any(word in t for t in texts):
            raise BaseException(f"tokenizer panicked on {word}")
        return original(self, text, *args, **kwargs)

    return call


def test_a_record_the_tokenizer_fails_on_is_named_or_skipped(target, tmp_path, monkeypatch):
    """Record 1's first prompt and record 2's second-turn prompt (after its first reply) make the tokenizer fail:
    the run stops naming the first (`on_error="raise"`), or leaves both out and counts them (`skip`)."""
    records = [
        [{"role": "user", "content": "w1 w2"}],
        {"id": "bad-first", "messages": [{"role": "user", "content": "w3 w77"}]},
        {
            "id": "bad-second",
            "messages": [
                {"role": "user", "content": "w4"},
                {"role": "assistant", "content": "w5"},
                {"role": "user", "content": "w77 w6"},
            ],
        },
        [{"role": "user", "content": "w8 w9"}],
    ]
    from dflash_trainer.decoding.batch import Completion

    reply = [*target.tokenizer("w5", add_special_tokens=False)["input_ids"], target.stop_token_ids[0]]

    class Answering(regen.Engine):  # every turn answered "w5", so that record 2 reaches its second turn
        name = "answering"

        def generate(self, queue):
            while queue:
                (request,) = queue.pop(1)
                yield Completion(request.key, reply, stopped=True)

    monkeypatch.setattr(regen, "make_engine", lambda *args, **kwargs: Answering())
    monkeypatch.setattr(type(target.tokenizer), "__call__", _failing_on("w77", target.tokenizer))
    settings = dict(max_new_tokens=MAX_NEW_TOKENS, batch_size=2, progress=False)
    with pytest.raises(RegenerateError, match=r"^records\[1\]: record bad-first: the tokenizer failed on turn 1"):
        regenerate(records, target, tmp_path / "raise", **settings)
    summary = regenerate(records, target, tmp_path / "skip", on_error="skip", **settings)
    assert summary.dropped["tokenizer_error"] == 2
    assert "tokenizer panicked on w77" in summary.examples["tokenizer_error"]
    assert [record["id"] for record in read_output(tmp_path / "skip")] == ["0", "3"]


def test_cli_names_the_file_and_line_of_a_record_the_chat_template_rejects(tiny_target_dir, tmp_path, capsys):
    """The chat template raises on line 2's record: one line naming data.jsonl:2 and exit status 2, no traceback;
    `--on-error skip` leaves it out and says why in the summary."""
    from transformers import AutoTokenizer

    from dflash_trainer import cli

    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    refusal = "{% if 'w77' in message['content'] %}{{ raise_exception('no w77 here') }}{% endif %}"
    tokenizer.chat_template = tokenizer.chat_template.replace(
        "{% for message in messages %}", "{% for message in messages %}" + refusal
    )
    tokenizer.save_pretrained(tiny_target_dir)
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["w1 w2", "w3 w77", "w4"]))
    base = ["regenerate", "--input", str(path), "--target", str(tiny_target_dir), "--max-new-tokens", "2"]
    assert cli.main([*base, "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("error: ") and "Traceback" not in err
    assert f"{path}:2: record data.jsonl:2: the tokenizer failed on turn 1's prompt: " in err
    assert "no w77 here" in err
    assert cli.main([*base, "--out", str(tmp_path / "b"), "--on-error", "skip"]) == 0
    out = capsys.readouterr().out
    assert "left out: template_error 1" in out and f"first template_error: {path}:2" in out
    assert [record["id"] for record in read_output(tmp_path / "b")] == ["data.jsonl:1", "data.jsonl:3"]


def test_shard_sample_ids_are_the_records_own_ids(target, tmp_path):
    """Through regeneration and `prepare`: a prompt set's id (`HumanEval/0`) names its sample, and a record without
    one is named by its place in the original input, not in the regenerated file."""
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"id": "HumanEval/0", "prompt": "w1 w2"}) + "\n" + json.dumps({"prompt": "w3"}) + "\n")
    regenerate(path, target, tmp_path / "regen", max_new_tokens=MAX_NEW_TOKENS, batch_size=2, progress=False)
    prepare([tmp_path / "regen" / regen.OUTPUT_FILE], target.tokenizer, target.name, tmp_path / "shards")
    dataset = load_shards(tmp_path / "shards")
    assert [dataset[i].id for i in range(len(dataset))] == ["HumanEval/0", "data.jsonl:2"]


# A conversation as `mix-general`'s dialogues give it (chitchat: up to the third user turn, earlier replies there).
DIALOGUE = {
    "id": "chitchat:d1",
    "messages": [
        {"role": "user", "content": "w1 w2"},
        {"role": "assistant", "content": "w60"},
        {"role": "user", "content": "w3 w4 w5"},
        {"role": "assistant", "content": "w61"},
        {"role": "user", "content": "w6"},
    ],
}


def test_a_dialogue_is_answered_turn_by_turn_and_trains_on_every_reply(target, tmp_path):
    """Multi-turn regeneration: each of the three assistant turns is the target's greedy reply to the conversation
    so far, with its own earlier replies in place of the source's; the shard trains on the three replies only."""
    vocab = len(target.tokenizer)
    finished = None
    for modulus, residue in ((m, r) for m in (3, 4, 5, 6) for r in range(m)):
        # Extra stop ids (a residue class of the vocabulary) so that the random model's replies end within
        # MAX_NEW_TOKENS: a cut reply would end the conversation before its third turn.
        stops = [*target.stop_token_ids, *(i for i in range(3, vocab) if i % modulus == residue)]
        candidate = replace(target, stop_token_ids=stops)
        expected = expected_conversation(candidate, DIALOGUE["messages"])
        replies = [m for m in expected or [] if m["role"] == "assistant"]
        if len(replies) == 3 and not any("truncated" in m for m in replies):
            finished = candidate
            break
    assert finished is not None, "no stop set lets all three replies finish"
    summary = regenerate(
        [DIALOGUE], finished, tmp_path / "out", max_new_tokens=MAX_NEW_TOKENS, batch_size=2, progress=False
    )
    (written,) = read_output(tmp_path / "out")
    assert written["messages"] == expected and summary.responses == 3
    assert [m["content"] for m in written["messages"] if m["role"] == "user"] == ["w1 w2", "w3 w4 w5", "w6"]
    assert all(m["content"] not in ("w60", "w61") for m in replies)  # the source's replies were replaced

    prepare([tmp_path / "out" / regen.OUTPUT_FILE], target.tokenizer, target.name, tmp_path / "shards")
    (sample,) = load_shards(tmp_path / "shards")
    ids, mask = tokenize_conversation(target.tokenizer, written["messages"])
    assert list(sample.input_ids) == ids and list(sample.loss_mask) == mask
    spans = [k for k in range(len(mask)) if mask[k] and (k == 0 or not mask[k - 1])]
    assert len(spans) == 3  # one trained span per reply, none on the user turns
    for start, reply in zip(spans, replies, strict=True):
        reply_ids = target.tokenizer(reply["content"], add_special_tokens=False)["input_ids"]
        assert ids[start : start + len(reply_ids)] == reply_ids
