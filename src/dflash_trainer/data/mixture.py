"""Named prompt mixtures: many built-in prompt sets combined with fixed caps and seed, de-duplicated, cached.

A `MixtureSpec` lists its shares in priority order: a built-in prompt set and split, a cap per sub-task (an
eval, a task, a generator) and per-sub-task overrides; that is how the mixture is weighted. Building it:

1. every share's prompts are loaded with its caps, the mixture's seed and prompt length cap (`sources/`);
2. prompts that overlap an evaluation set are removed (`EvaluationIndex`): same normalised text
   (`normalize_text`: NFKC, case-folded, only words of letters and digits, single spaces) as a GSM8K test question
   (our held-out 200), an MT-Bench question or a HumanEval problem, or containing one, or contained in one
   (the latter two for texts of at least `min_containment_chars` normalised characters, so that "hello" is
   not "contained" in a HumanEval docstring);
3. exact duplicates are removed: prompts whose normalised text equals an earlier prompt's; the earlier
   share keeps its copy;
4. the prompts are shuffled with the seed, so the first N of a mixture are a uniform sample of it: a named
   size (`mix-10k`) or a `limit` takes a deterministic, representative subset. The prompts of an `appended` share
   are shuffled apart and follow all the others: a share added to a mixture whose prompts were already answered
   leaves their order, and so every prefix of them, as it was.

`MixtureSummary` counts, per share, what its sources kept and dropped and why, the duplicates and the
evaluation overlaps removed, and what is left; it is printed when a mixture is built.

Building the full `mix` reads about a gigabyte of package data (tens of seconds), so the result is cached in
`<cache>/prompt-mixtures/` (`$DFLASH_TRAINER_CACHE`, else `~/.cache/dflash-trainer`) under a key made of
the spec, the installed versions of every package it reads and the source code of the loaders: a change to
any of them builds the mixture again. Loading from the cache takes a few seconds.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import os
import random
import re
import unicodedata
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .sources.base import MAX_PROMPT_CHARS, Caps, Prompt, Tally, task_of
from .sources.benchmarks import EVALUATION_SETS, evaluation_texts

# A word: letters and digits, with a trailing + or # kept so that C, C++ and C# stay apart.
_WORD = re.compile(r"[^\W_]+[+#]*")
CACHE_ENV = "DFLASH_TRAINER_CACHE"
# Bump when the cache file layout changes.
_CACHE_FORMAT = 2


def normalize_text(text: str) -> str:
    """Case, width, punctuation and whitespace removed: what two copies of one question have in common.

    Words are runs of letters and digits (any script), with a trailing `+`/`#` kept (C++, C#); everything
    else separates words, which are joined by single spaces.
    """
    return " ".join(_WORD.findall(unicodedata.normalize("NFKC", text).casefold()))


@dataclass(frozen=True)
class Share:
    """One built-in prompt set in a mixture, with its caps."""

    set_name: str
    split: str = "all"
    per_task: int | None = None  # at most this many prompts per sub-task (None: all)
    overrides: tuple[tuple[str, int], ...] = ()  # (sub-task, cap) pairs that replace `per_task`
    # Shuffled apart, after the other shares' prompts (see the module docstring, step 4).
    appended: bool = False


@dataclass(frozen=True)
class MixtureSpec:
    name: str
    seed: int
    shares: tuple[Share, ...]  # priority order: an earlier share keeps a prompt that two shares have
    max_prompt_chars: int = MAX_PROMPT_CHARS
    min_containment_chars: int = 40

    def __post_init__(self) -> None:
        # An appended share in the middle would take the duplicates of the shares after it, changing them.
        flags = [share.appended for share in self.shares]
        if flags != sorted(flags):
            raise ValueError(f"mixture {self.name!r}: appended shares must come after all the others")

    def caps(self, share: Share) -> Caps:
        return Caps(share.per_task, dict(share.overrides), self.seed, self.max_prompt_chars)


@dataclass
class ShareCount:
    set_name: str
    loaded: int = 0  # what the source gave (after its own exclusions, filters and caps)
    duplicates: int = 0
    evaluation_overlap: Counter[str] = field(default_factory=Counter)  # evaluation set -> prompts removed
    final: int = 0
    final_by_task: Counter[str] = field(default_factory=Counter)  # sub-task (`task_of`) -> prompts in the mixture


@dataclass
class MixtureSummary:
    name: str
    rows: list[ShareCount]
    tally: Tally

    @property
    def total(self) -> int:
        return sum(row.final for row in self.rows)

    def format(self) -> str:
        """A table of counts per share, then what each source dropped before the mixture, by reason."""
        eval_names = [name for name, _ in EVALUATION_SETS]
        header = ["source", "loaded", "duplicates", *(f"vs {n}" for n in eval_names), "in mix"]
        lines = [header]
        for row in self.rows:
            overlap = [f"{row.evaluation_overlap[n]:,}" for n in eval_names]
            lines.append([row.set_name, f"{row.loaded:,}", f"{row.duplicates:,}", *overlap, f"{row.final:,}"])
        total = [sum(r.loaded for r in self.rows), sum(r.duplicates for r in self.rows)]
        overlaps = [sum(r.evaluation_overlap[n] for r in self.rows) for n in eval_names]
        lines.append(["total", *(f"{n:,}" for n in [*total, *overlaps, self.total])])
        widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
        table = [
            "  ".join(
                cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(line, widths, strict=True))
            )
            for line in lines
        ]
        notes = []
        for row in self.rows:
            excluded = sorted(task for (src, task) in self.tally.excluded if src == row.set_name)
            reasons = self.tally.dropped_by_reason(row.set_name)
            parts = [f"{reason} {count:,}" for reason, count in reasons.most_common()]
            if excluded:
                parts.insert(0, f"{len(excluded)} sub-tasks excluded ({', '.join(excluded)})")
            if parts:
                notes.append(f"  {row.set_name}: " + "; ".join(parts))
        dropped = ["dropped by the sources before mixing:", *notes] if notes else []
        return "\n".join([f"prompt mixture {self.name!r}: {self.total:,} prompts", *table, *dropped])

    def format_tasks(self) -> str:
        """Prompts in the mixture per source and sub-task, largest first."""
        lines = [f"prompt mixture {self.name!r} by sub-task (source, sub-task, prompts in the mixture):"]
        for row in self.rows:
            lines.extend(f"  {row.set_name:15} {task:45} {n:>7,}" for task, n in row.final_by_task.most_common())
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "rows": [
                {
                    **dataclasses.asdict(row),
                    "evaluation_overlap": dict(row.evaluation_overlap),
                    "final_by_task": dict(row.final_by_task),
                }
                for row in self.rows
            ],
            "kept": [[src, task, n] for (src, task), n in sorted(self.tally.kept.items())],
            "dropped": [[src, task, reason, n] for (src, task, reason), n in sorted(self.tally.dropped.items())],
            "excluded": [[src, task, reason] for (src, task), reason in sorted(self.tally.excluded.items())],
        }

    @classmethod
    def from_json(cls, data: dict) -> MixtureSummary:
        rows = [
            ShareCount(
                set_name=row["set_name"],
                loaded=row["loaded"],
                duplicates=row["duplicates"],
                evaluation_overlap=Counter(row["evaluation_overlap"]),
                final=row["final"],
                final_by_task=Counter(row["final_by_task"]),
            )
            for row in data["rows"]
        ]
        tally = Tally()
        for src, task, n in data["kept"]:
            tally.kept[src, task] = n
        for src, task, reason, n in data["dropped"]:
            tally.dropped[src, task, reason] = n
        for src, task, reason in data["excluded"]:
            tally.excluded[src, task] = reason
        return cls(name=data["name"], rows=rows, tally=tally)


class EvaluationIndex:
    """Finds the evaluation set a prompt overlaps: equal normalised text, or one containing the other.

    Containment is checked on whole words (`" a b "` in `" x a b y "`). To stay fast over 100K+ prompts,
    candidates come from a word each side must share: an evaluation text contained in a prompt has its
    longest word in the prompt's words; a prompt contained in an evaluation text has its longest word in
    that text's words. Only candidates are compared as strings.
    """

    def __init__(self, texts: Iterable[tuple[str, str]], min_containment_chars: int) -> None:
        self.min_chars = min_containment_chars
        self.exact: dict[str, str] = {}
        self.needles: list[tuple[str, str]] = []  # (evaluation set, normalised text padded with spaces)
        self.by_longest_word: dict[str, list[int]] = {}
        self.by_any_word: dict[str, list[int]] = {}
        for set_name, text in texts:
            normalized = normalize_text(text)
            if not normalized:
                continue
            self.exact.setdefault(normalized, set_name)
            index = len(self.needles)
            self.needles.append((set_name, f" {normalized} "))
            words = normalized.split()
            for word in set(words):
                self.by_any_word.setdefault(word, []).append(index)
            if len(normalized) >= min_containment_chars:
                self.by_longest_word.setdefault(max(words, key=len), []).append(index)
        self.longest_needle = max((len(text) for _, text in self.needles), default=0)

    def overlap(self, normalized: str) -> str | None:
        """The evaluation set `normalized` (a `normalize_text` result) overlaps, or None."""
        if normalized in self.exact:
            return self.exact[normalized]
        words = normalized.split()
        if not words:
            return None
        padded = f" {normalized} "
        # Sorted: a prompt that overlaps two evaluation sets is counted against the same one on every run.
        for word in sorted(self.by_longest_word.keys() & set(words)):
            for index in self.by_longest_word[word]:
                set_name, needle = self.needles[index]
                if needle in padded:
                    return set_name
        if self.min_chars <= len(normalized) < self.longest_needle:
            for index in self.by_any_word.get(max(words, key=len), ()):
                set_name, needle = self.needles[index]
                if padded in needle:
                    return set_name
        return None


LoadSet = Callable[[str, str, Caps, Tally], list[Prompt]]


def build_mixture(
    spec: MixtureSpec, load_set: LoadSet, evaluation_prompts: Callable[[str, str], list[Prompt]]
) -> tuple[list[Prompt], MixtureSummary]:
    """The spec's prompts (de-duplicated, without evaluation overlaps, shuffled with its seed) and their counts.

    `load_set(name, split, caps, tally)` loads a built-in set; `evaluation_prompts(name, split)` an
    evaluation set (`EVALUATION_SETS`).
    """
    index = EvaluationIndex(
        (
            (name, text)
            for name, split in EVALUATION_SETS
            for prompt in evaluation_prompts(name, split)
            for text in evaluation_texts(name, prompt)
        ),
        spec.min_containment_chars,
    )
    tally = Tally()
    seen: set[str] = set()
    rows: list[ShareCount] = []
    kept: list[Prompt] = []
    appended: list[tuple[Share, list[Prompt]]] = []
    for share in spec.shares:
        row = ShareCount(share.set_name)
        rows.append(row)
        share_kept = kept
        if share.appended:
            share_kept = []
            appended.append((share, share_kept))
        for prompt in load_set(share.set_name, share.split, spec.caps(share), tally):
            row.loaded += 1
            normalized = normalize_text(prompt.text())
            # Overlap first, so that every share's count of evaluation overlaps is complete.
            overlap = index.overlap(normalized)
            if overlap is not None:
                row.evaluation_overlap[overlap] += 1
                continue
            if normalized in seen:
                row.duplicates += 1
                continue
            seen.add(normalized)
            row.final += 1
            row.final_by_task[task_of(prompt.id)] += 1
            share_kept.append(prompt)
    random.Random(f"{spec.seed}:{spec.name}:order").shuffle(kept)
    for share, prompts in appended:
        random.Random(f"{spec.seed}:{spec.name}:{share.set_name}:order").shuffle(prompts)
        kept.extend(prompts)
    return kept, MixtureSummary(spec.name, rows, tally)


def emphasise(prompts: Sequence[Prompt], weight_of: Callable[[Prompt], float], seed: str) -> list[Prompt]:
    """The same prompts in a weighted random order: the first N are a weighted sample without replacement.

    Each prompt draws u in (0, 1) from a hash of (`seed`, its id) and sorts by u ** (1 / weight),
    largest first (Efraimidis and Spirakis): a prompt of weight 4 is about four times as likely as one of
    weight 1 to be in any prefix. The order depends only on the seed and the ids, not on the input order, so a
    mixture's weighted view is stable when an unrelated share changes. Weights must be > 0.
    """

    def key(prompt: Prompt) -> float:
        weight = weight_of(prompt)
        if not weight > 0:
            raise ValueError(f"weight of {prompt.id!r} must be > 0, got {weight}")
        digest = hashlib.blake2b(f"{seed}:{prompt.id}".encode(), digest_size=8).digest()
        u = (int.from_bytes(digest, "little") + 1) / (2**64 + 1)  # in (0, 1): 0 ** (1/w) would tie
        return u ** (1.0 / weight)

    return sorted(prompts, key=key, reverse=True)


def stratify(
    prompts: Sequence[Prompt], category_of: Callable[[Prompt], str], shares: Mapping[str, float]
) -> list[Prompt]:
    """The same prompts ordered so that every prefix holds the categories in `shares` as nearly as whole prompts
    allow; within a category the input order is kept (a seeded shuffle: each category's first k are a uniform
    sample of it).

    Position n takes the next prompt of the category furthest behind its share, `share * (n + 1) - taken`
    (ties: the order of `shares`). A category that runs out leaves its place to the others in equal parts, not in
    the ratio of their shares: every category left keeps the same lead over its share (with shares 0.5 / 0.3 / 0.2
    and the third run out, the others go on at 0.6 / 0.4). A change of this rule reorders every exported prefix.
    Categories with share 0, or not named, come after all the others. Shares are weights (they need not sum to 1);
    at least one must be > 0.
    """
    if any(not share >= 0 for share in shares.values()) or not any(share > 0 for share in shares.values()):
        raise ValueError(f"shares {dict(shares)}: need values >= 0, at least one > 0")
    total = sum(shares.values())
    weights = {name: share / total for name, share in shares.items() if share > 0}
    queues: dict[str, list[Prompt]] = {name: [] for name in weights}
    rest: list[Prompt] = []
    for prompt in prompts:
        queue = queues.get(category_of(prompt))
        (queue if queue is not None else rest).append(prompt)
    taken = dict.fromkeys(weights, 0)
    ordered: list[Prompt] = []
    live = [name for name in weights if queues[name]]
    while live:
        position = len(ordered) + 1
        name = max(live, key=lambda c: weights[c] * position - taken[c])
        ordered.append(queues[name][taken[name]])
        taken[name] += 1
        if taken[name] == len(queues[name]):
            live.remove(name)
    return ordered + rest


# ----------------------------------------------------------------------------------------------------------
# Cache


def cache_dir() -> Path:
    root = Path(os.environ[CACHE_ENV]).expanduser() if os.environ.get(CACHE_ENV) else None
    return (root or Path.home() / ".cache" / "dflash-trainer") / "prompt-mixtures"


def cache_key(spec: MixtureSpec, package_versions: dict[str, str | None], code_files: Sequence[Path]) -> str:
    digest = hashlib.sha256()
    digest.update(json.dumps([_CACHE_FORMAT, dataclasses.asdict(spec), package_versions], sort_keys=True).encode())
    for path in sorted(code_files):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def write_cache(path: Path, prompts: list[Prompt], summary: MixtureSummary) -> None:
    """Write the mixture to `path` atomically, removing older builds of the same mixture beside it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    own_builds = re.compile(rf"{re.escape(summary.name)}-[0-9a-f]{{16}}\.jsonl\.gz")
    for stale in path.parent.iterdir():
        if stale != path and own_builds.fullmatch(stale.name):
            stale.unlink(missing_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with gzip.open(tmp, "wt", encoding="utf-8", compresslevel=1) as f:
        f.write(json.dumps({"summary": summary.to_json()}) + "\n")
        for prompt in prompts:
            f.write(json.dumps({"id": prompt.id, "messages": prompt.messages, "reference": prompt.reference}) + "\n")
    tmp.replace(path)


def read_summary(path: Path) -> MixtureSummary | None:
    """The summary of a cached mixture, read from its first line only (the prompts stay unread), or None."""
    if not path.is_file():
        return None
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return MixtureSummary.from_json(json.loads(f.readline())["summary"])
    except (OSError, EOFError, ValueError, KeyError, TypeError):
        return None


def read_cache(path: Path) -> tuple[list[Prompt], MixtureSummary] | None:
    """The cached mixture, or None when there is none (or it is unreadable: it is then built again)."""
    if not path.is_file():
        return None
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            summary = MixtureSummary.from_json(json.loads(f.readline())["summary"])
            prompts = [Prompt(**json.loads(line)) for line in f]
    except (OSError, EOFError, ValueError, KeyError, TypeError):
        return None
    if len(prompts) != summary.total:
        return None
    return prompts, summary
