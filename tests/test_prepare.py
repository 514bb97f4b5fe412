"""prepare(): chat JSONL / datasets directories -> shards, with filters, counted skips and located errors."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from dflash_trainer.data.chat import tokenize_conversation
from dflash_trainer.data.prepare import PrepareError, prepare, read_chat_records
from dflash_trainer.data.shards import load_shards

CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE with ChatML special tokens: every character is encodable, tokens are short."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(["user assistant system question answer"] * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML_TEMPLATE
    return fast


def chat(question: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


def write_jsonl(path: Path, lines: list) -> Path:
    """Write records (dicts) or raw text lines (str) one per line."""
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_prepare_writes_shards_that_load_back(tmp_path, tokenizer):
    data = write_jsonl(
        tmp_path / "data.jsonl",
        [
            chat("What is one plus one?", "It is two."),
            {
                "conversations": [
                    {"from": "human", "value": "Name a color."},
                    {"from": "gpt", "value": "Blue, like the sky."},
                ]
            },
            {"prompt": "Say hello.", "response": "Hello there, friend."},
        ],
    )
    out = tmp_path / "shards"
    summary = prepare([data], tokenizer, "tiny-chatml", out, samples_per_shard=2)

    dataset = load_shards(out)
    assert (summary.records, summary.samples, len(dataset)) == (3, 3, 3)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["tokenizer"] == "tiny-chatml"
    assert manifest["vocab_size"] == len(tokenizer)
    assert len(manifest["shards"]) == 2
    assert manifest["source"]["inputs"] == [str(data)]

    expected = [
        tokenize_conversation(tokenizer, [{"role": "user", "content": q}, {"role": "assistant", "content": a}])
        for q, a in [
            ("What is one plus one?", "It is two."),
            ("Name a color.", "Blue, like the sky."),
            ("Say hello.", "Hello there, friend."),
        ]
    ]
    for index, (ids, mask) in enumerate(expected):
        sample = dataset[index]
        assert sample.id == f"data.jsonl:{index + 1}"
        assert sample.input_ids.tolist() == ids
        assert sample.loss_mask.tolist() == mask
    assert summary.tokens == sum(len(ids) for ids, _ in expected)
    assert summary.loss_tokens == sum(sum(mask) for _, mask in expected)


def test_filters_duplicates_short_and_long_samples(tmp_path, tokenizer):
    long_answer = "word " * 200
    data = write_jsonl(
        tmp_path / "data.jsonl",
        [
            chat("Question one?", "Answer one."),
            chat("Question one?", "Answer one."),  # duplicate
            {"messages": [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "<think>long</think>A"}]},
            chat("Q?", "A"),  # same as the previous one once reasoning is dropped
            chat("Long question?", long_answer),  # too long
            chat("Question two?", "Answer two is longer."),
        ],
    )
    # "A" + <|im_end|> is 2 loss tokens: below 3.
    summary = prepare([data], tokenizer, "t", tmp_path / "out", min_loss_tokens=3, max_seq_len=100)
    assert summary.samples == 2
    assert summary.dropped == {"duplicate": 2, "too_few_loss_tokens": 1, "too_long": 1}
    assert [s.id for s in (load_shards(tmp_path / "out")[i] for i in range(2))] == ["data.jsonl:1", "data.jsonl:6"]

    without_dedup = prepare([data], tokenizer, "t", tmp_path / "out2", dedup=False, max_seq_len=100)
    assert without_dedup.samples == 5
    assert without_dedup.dropped == {"too_long": 1}


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ({"messages": [{"role": "user", "content": "Q"}, {"content": "A"}]}, "messages[1].role: missing"),
        (
            {"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "A"}]},
            "messages[0].content: empty",
        ),
        (
            {"messages": [{"role": "user", "content": ["Q"]}, {"role": "assistant", "content": "A"}]},
            "messages[0].content[0]",
        ),
        (
            {"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "A"}]},
            "messages[0].content: must be a string, got int",
        ),
        ('{"messages": [', "invalid JSON"),
    ],
)
def test_malformed_record_error_names_file_and_line(tmp_path, tokenizer, bad_line, message):
    data = write_jsonl(tmp_path / "data.jsonl", [chat("Question?", "Answer."), "", bad_line])
    out = tmp_path / "out"
    with pytest.raises(PrepareError) as caught:
        prepare([data], tokenizer, "t", out)
    assert str(caught.value).startswith(f"{data}:3: ")
    assert message in str(caught.value)
    assert (caught.value.file, caught.value.line) == (str(data), 3)
    # Nothing half-written is left behind.
    assert not out.exists()
    assert list(tmp_path.iterdir()) == [data]


def test_skip_mode_counts_each_reason(tmp_path, tokenizer):
    first = write_jsonl(
        tmp_path / "a.jsonl",
        [
            chat("Good question?", "Good answer."),
            "not json",
            {"messages": [{"content": "Q"}, {"role": "assistant", "content": "A"}]},
            {"messages": [{"role": "user", "content": "Q"}]},
        ],
    )
    second = write_jsonl(
        tmp_path / "b.jsonl",
        [
            {"messages": [{"role": "wizard", "content": "Q"}, {"role": "assistant", "content": "A"}]},
            {"prompt": "Q", "response": "   "},
        ],
    )
    with second.open("ab") as f:
        f.write(b'{"prompt": "\xff"}\n')  # not UTF-8
        f.write(json.dumps(chat("Another question?", "Another answer.")).encode() + b"\n")
    summary = prepare([first, second], tokenizer, "t", tmp_path / "out", on_error="skip")
    assert summary.samples == 2
    assert summary.records == 8
    assert summary.skipped == {
        "invalid_json": 1,
        "missing_role": 1,
        "no_assistant_turn": 1,
        "unknown_role": 1,
        "empty_content": 1,
        "invalid_utf8": 1,
    }
    text = summary.format()
    assert "prepared 2 samples" in text
    assert "invalid_json 1" in text and "unknown_role 1" in text


def test_limit_stops_after_that_many_samples(tmp_path, tokenizer):
    data = write_jsonl(tmp_path / "data.jsonl", [chat(f"Question {i}?", f"Answer {i}.") for i in range(5)])
    summary = prepare([data], tokenizer, "t", tmp_path / "out", limit=2)
    assert (summary.records, summary.samples, len(load_shards(tmp_path / "out"))) == (2, 2, 2)


@pytest.mark.parametrize("limit", [None, 4])
def test_batch_size_does_not_change_the_result(tmp_path, tokenizer, monkeypatch, limit):
    """Records are tokenised in batches: duplicates, bad records, the limit and the sample order must come out as
    with one record at a time, whatever the batch boundaries."""
    from dflash_trainer.data import prepare as prepare_module

    records = [chat(f"Question {i}?", f"Answer {i}.") for i in range(9)]
    records[3] = records[1]  # duplicate
    records[5] = {"messages": [{"role": "user", "content": "Q"}]}  # no assistant turn
    records[7] = "not json"  # an unreadable line: handled in its place, not before the records ahead of it
    data = write_jsonl(tmp_path / "data.jsonl", records)
    results = []
    for batch in (1, 2, 512):
        monkeypatch.setattr(prepare_module, "TOKENIZE_BATCH", batch)
        out = tmp_path / f"out-{batch}"
        summary = prepare([data], tokenizer, "t", out, on_error="skip", limit=limit)
        dataset = load_shards(out)
        samples = [
            (s.id, s.input_ids.tolist(), s.loss_mask.tolist()) for s in (dataset[i] for i in range(len(dataset)))
        ]
        results.append((summary.records, summary.samples, summary.dropped, summary.skipped, samples))
        # Raising: the first bad line is named (line 6), never a later one read ahead (line 8).
        with pytest.raises(PrepareError, match=r"data\.jsonl:6: "):
            prepare([data], tokenizer, "t", tmp_path / f"raise-{batch}")
    assert results[0] == results[1] == results[2]
    assert results[0][1] == (4 if limit else 6)
    assert results[0][3] == ({} if limit else {"no_assistant_turn": 1, "invalid_json": 1})


def test_existing_output_is_kept_unless_overwrite(tmp_path, tokenizer):
    data = write_jsonl(tmp_path / "data.jsonl", [chat("Question?", "Answer.")])
    out = tmp_path / "out"
    prepare([data], tokenizer, "t", out)
    with pytest.raises(FileExistsError, match="overwrite"):
        prepare([data], tokenizer, "t", out)
    write_jsonl(data, [chat("Question?", "Answer."), chat("Other question?", "Other answer.")])
    assert prepare([data], tokenizer, "t", out, overwrite=True).samples == 2
    assert len(load_shards(out)) == 2


def test_no_surviving_sample_is_an_error_and_writes_nothing(tmp_path, tokenizer):
    data = write_jsonl(tmp_path / "data.jsonl", [chat("Question?", "A")])
    with pytest.raises(PrepareError, match="no sample left to write") as caught:
        prepare([data], tokenizer, "t", tmp_path / "out", min_loss_tokens=5)
    assert "too_few_loss_tokens 1" in str(caught.value)
    assert not (tmp_path / "out").exists()


def test_missing_input_is_named(tmp_path, tokenizer):
    with pytest.raises(PrepareError, match=r"nope\.jsonl: no such file"):
        prepare([tmp_path / "nope.jsonl"], tokenizer, "t", tmp_path / "out")


def test_read_chat_records_reports_invalid_lines_to_callback(tmp_path):
    data = write_jsonl(tmp_path / "data.jsonl", [{"a": 1}, "{oops", "", {"b": 2}])
    problems = []
    records = list(read_chat_records(data, on_invalid=problems.append))
    assert records == [(1, {"a": 1}), (4, {"b": 2})]
    assert [(p.line, p.reason) for p in problems] == [(2, "invalid_json")]


def test_datasets_directory_is_read_with_load_from_disk(tmp_path, tokenizer, monkeypatch):
    saved = tmp_path / "saved"
    saved.mkdir()
    rows = [chat("Question?", "Answer."), chat("Second question?", "Second answer.")]

    class FakeDatasetDict(dict):
        pass

    fake = types.ModuleType("datasets")
    fake.DatasetDict = FakeDatasetDict
    fake.load_from_disk = lambda path: FakeDatasetDict(train=rows, test=[]) if path == str(saved) else None
    monkeypatch.setitem(sys.modules, "datasets", fake)

    summary = prepare([saved], tokenizer, "t", tmp_path / "out")
    dataset = load_shards(tmp_path / "out")
    assert summary.samples == 2
    assert [dataset[i].id for i in range(2)] == ["saved:1", "saved:2"]

    fake.load_from_disk = lambda path: FakeDatasetDict(a=rows, b=rows)
    with pytest.raises(PrepareError, match="none is called 'train'"):
        list(read_chat_records(saved))


def test_datasets_directory_without_the_package_says_what_to_install(tmp_path, monkeypatch):
    saved = tmp_path / "saved"
    saved.mkdir()
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` raise ImportError
    with pytest.raises(PrepareError, match=r"pip install datasets"):
        list(read_chat_records(saved))
