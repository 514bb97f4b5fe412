"""Regenerating assistant turns with the target: exact greedy replies, multi-turn order, resume after a crash."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from dflash_trainer.target import regenerate as regen
from dflash_trainer.target.loader import LoadedTarget, load_target
from dflash_trainer.target.regenerate import RegenerateError, cut_at_stop, regenerate

MAX_NEW_TOKENS = 5

CONVERSATIONS = [
    [{"role": "user", "content": "w1 w2 w3"}],
    {
        "messages": [
            {"role": "system", "content": "w5"},
            {"role": "user", "content": "w9 w10"},
            {"role": "assistant", "content": "w3"},
        ]
    },
    {
        "id": "multi",
        "messages": [
            {"role": "user", "content": "w1"},
            {"role": "assistant", "content": "w2"},
            {"role": "user", "content": "w3 w4 w5 w6"},
            {"role": "assistant", "content": "w2"},
        ],
    },
    [{"role": "user", "content": "w40 w41 w42 w43 w44 w45 w46"}],
    [{"role": "user", "content": "w7"}, {"role": "assistant", "content": "w8"}, {"role": "user", "content": "w11"}],
]


@pytest.fixture
def target(tiny_target_dir) -> LoadedTarget:
    return load_target(str(tiny_target_dir), device="cpu")


def _greedy_reply(target: LoadedTarget, messages: list[dict]) -> tuple[str, list[int]]:
    """Reference: one prompt alone through `generate`, cut at the first stop id, decoded as is."""
    text = target.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = torch.tensor([target.tokenizer(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        output = target.model.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=MAX_NEW_TOKENS,
            do_sample=False,
            eos_token_id=target.stop_token_ids,
            pad_token_id=target.tokenizer.pad_token_id,
        )
    new_ids = output[0, prompt.shape[1] :].tolist()
    reply_ids, _ = cut_at_stop(new_ids, target.stop_token_ids)
    return target.tokenizer.decode(reply_ids, skip_special_tokens=False), new_ids


def _expected_conversation(target: LoadedTarget, messages: list[dict]) -> list[dict] | None:
    """Each assistant turn (and one after a final user turn) replaced in order; None when a reply is empty."""
    history: list[dict] = []
    for message in messages:
        if message["role"] == "assistant":
            reply, _ = _greedy_reply(target, history)
            if not reply.strip():
                return None
            history.append({"role": "assistant", "content": reply})
        else:
            history.append(dict(message))
    if history[-1]["role"] != "assistant":
        reply, _ = _greedy_reply(target, history)
        if not reply.strip():
            return None
        history.append({"role": "assistant", "content": reply})
    return history


def _messages(item) -> list[dict]:
    return item["messages"] if isinstance(item, dict) else item


def _read_output(out_dir: Path) -> list[dict]:
    return [
        json.loads(line) for path in sorted(out_dir.glob("regen-*.jsonl")) for line in path.read_text().splitlines()
    ]


def test_cut_at_stop():
    assert cut_at_stop([5, 6, 2, 7, 2], [2]) == ([5, 6], True)
    assert cut_at_stop([5, 6, 7], [2, 9]) == ([5, 6, 7], False)
    assert cut_at_stop([9], [2, 9]) == ([], True)


def _first_new_token_index(ids: list[int]) -> int | None:
    """The first position k >= 1 whose token did not occur before it (random tiny models repeat a lot)."""
    return next((k for k in range(1, len(ids)) if ids[k] not in ids[:k]), None)


def test_replies_are_exactly_the_targets_greedy_replies(target, tmp_path):
    # Extra stop ids so that, with a random model, one record's reply is empty (it is left out) and another
    # reply stops midway: the first token of conversation 3's reply, and a later token of another reply.
    empty_stop = _greedy_reply(target, _messages(CONVERSATIONS[3]))[1][0]
    early_stop = None
    for item in CONVERSATIONS[:3]:
        messages = _messages(item)
        first_turn = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
        _, new_ids = _greedy_reply(target, messages[:first_turn])
        k = _first_new_token_index(new_ids)
        if new_ids[0] != empty_stop and k is not None and empty_stop not in new_ids[:k]:
            early_stop = new_ids[k]
            break
    assert early_stop is not None
    target = dataclasses.replace(target, stop_token_ids=[*target.stop_token_ids, empty_stop, early_stop])

    summary = regenerate(
        CONVERSATIONS,
        target,
        tmp_path / "out",
        max_new_tokens=MAX_NEW_TOKENS,
        batch_size=2,
        shard_size=3,
        progress=False,
    )

    expected = {}
    for index, item in enumerate(CONVERSATIONS):
        record_id = item.get("id", str(index)) if isinstance(item, dict) else str(index)
        expected[record_id] = _expected_conversation(target, _messages(item))
    assert expected["3"] is None
    replies = [m["content"] for c in expected.values() if c for m in c if m["role"] == "assistant"]
    assert any(len(reply.split()) < MAX_NEW_TOKENS for reply in replies)  # some reply stopped early
    written = _read_output(tmp_path / "out")
    assert [r["id"] for r in written] == [key for key, value in expected.items() if value is not None]
    for record in written:
        assert record["messages"] == expected[record["id"]]
    assert summary.records == len(written)
    assert summary.empty_responses == len(expected) - len(written)
    assert len(summary.files) == 2


class _Crash(Exception):
    pass


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_interrupted_run_resumes_without_repeating_or_losing_records(target, tmp_path, monkeypatch, temperature):
    records = [[{"role": "user", "content": f"w{i} w{i + 1}"}] for i in range(7)]
    settings = dict(max_new_tokens=MAX_NEW_TOKENS, batch_size=2, shard_size=3, temperature=temperature, progress=False)
    regenerate(records, target, tmp_path / "reference", **settings)

    original = regen.HFEngine._generate_batch
    calls = []

    def crash_on_fourth_batch(self, prompts, *, seed):
        calls.append(len(prompts))
        if len(calls) == 4:  # shard 0 is two batches, shard 1 is in progress
            raise _Crash
        return original(self, prompts, seed=seed)

    monkeypatch.setattr(regen.HFEngine, "_generate_batch", crash_on_fourth_batch)
    with pytest.raises(_Crash):
        regenerate(records, target, tmp_path / "out", **settings)
    assert sorted(p.name for p in (tmp_path / "out").glob("regen-*")) == ["regen-00000.jsonl"]

    (tmp_path / "out" / ".regen-00001.jsonl.tmp").write_text('{"id": "junk"}\n')  # a write cut short
    calls.clear()
    summary = regenerate(records, target, tmp_path / "out", **settings)

    assert calls == [2, 1, 1]  # shards 1 and 2 only
    assert summary.resumed_records == 3 and summary.records == 7
    assert [r["id"] for r in _read_output(tmp_path / "out")] == [str(i) for i in range(7)]
    assert _read_output(tmp_path / "out") == _read_output(tmp_path / "reference")
    assert not list((tmp_path / "out").glob(".*.tmp"))
    assert json.loads((tmp_path / "out" / regen.SETTINGS_FILE).read_text())["complete"] is True


def test_rerun_with_other_settings_or_input_is_refused(target, tmp_path):
    records = [[{"role": "user", "content": "w1"}], [{"role": "user", "content": "w2"}]]
    regenerate(records, target, tmp_path / "out", max_new_tokens=2, batch_size=2, shard_size=1, progress=False)
    with pytest.raises(RegenerateError, match=r"max_new_tokens: 2 -> 3"):
        regenerate(records, target, tmp_path / "out", max_new_tokens=3, batch_size=2, shard_size=1, progress=False)
    other = [{"id": "x", "messages": records[0]}, {"id": "y", "messages": records[1]}]
    with pytest.raises(RegenerateError, match="input changed"):
        regenerate(other, target, tmp_path / "out", max_new_tokens=2, batch_size=2, shard_size=1, progress=False)


def test_jsonl_input_layouts_and_errors(target, tmp_path):
    path = tmp_path / "data.jsonl"
    lines = [
        {"messages": [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2"}]},
        {"id": "sharegpt-7", "conversations": [{"from": "human", "value": "w3"}, {"from": "gpt", "value": "w4"}]},
        {"prompt": "w5 w6"},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary = regenerate(path, target, tmp_path / "out", max_new_tokens=2, batch_size=4, progress=False, limit=2)
    written = _read_output(tmp_path / "out")
    assert [r["id"] for r in written] == ["data.jsonl:1", "sharegpt-7"]
    assert written[1]["messages"][0] == {"role": "user", "content": "w3"}
    assert written[1]["messages"][1]["content"] != "w4"
    assert summary.records == 2

    path.write_text(json.dumps(lines[0]) + "\n" + json.dumps({"messages": [{"role": "robot", "content": "w1"}]}) + "\n")
    with pytest.raises(RegenerateError, match=r"data\.jsonl:2: .*role"):
        regenerate(path, target, tmp_path / "out2", max_new_tokens=2, batch_size=4, progress=False)
