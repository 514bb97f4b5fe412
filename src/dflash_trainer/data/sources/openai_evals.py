"""`openai-evals`: the chat prompts of the OpenAI Evals registry (pip package `evals`, MIT).

The registry ships about 1M samples in `evals/registry/data/<eval>/**/*.jsonl`; a sample's `input` is a
list of chat messages (or a string, a single user turn) and `ideal` the expected answer (the reference).
Few-shot turns written as system messages named `example_user` / `example_assistant` become user /
assistant turns; then `chat_turns.normalize_turns` makes the conversation template-safe.

Excluded evals and why are in `EXCLUDED_EVALS` (non-commercial data per the package's LICENSE.md; the
framework's own test fixtures). Evals whose samples carry no chat `input` (those driven by custom solvers)
give nothing, and neither do labelled completions kept for model-graded meta-evals (`input` + `completion`
+ `choice`). Samples that are empty, longer than `caps.max_chars`, or carry unprintable characters or
base64/hex blobs are dropped and counted.

Each eval gives at most `caps.cap(eval)` prompts: the first usable ones in a seeded permutation of its
samples, returned in file order (so one large generated eval cannot dominate). Ids are
`openai-evals:<eval>:<index>`, the index counting the eval's non-empty lines over its files in sorted
path order.
"""

from __future__ import annotations

import json
from pathlib import Path

from .base import Caps, PackageData, Prompt, Tally, data_file, no_split
from .chat_turns import normalize_turns, unusable_text

NAME = "openai-evals"
PACKAGE = PackageData("evals", "evals", "3.0.1.post1")
DATA_DIR = "registry/data"

EXCLUDED_EVALS = {
    "steganography": "non-commercial data (CC BY-NC 4.0 parts, package LICENSE.md)",
    "theory_of_mind": "non-commercial data (CC BY-NC 4.0 parts, package LICENSE.md)",
    "test_fuzzy_match": "test fixture of the evals framework",
    "test_metaeval": "test fixture of the evals framework",
    "test_modelgraded": "test fixture of the evals framework",
    "test_multiio": "test fixture of the evals framework",
}
_FEW_SHOT_ROLES = {"example_user": "user", "example_assistant": "assistant"}
_ROLES = ("system", "user", "assistant")


def load(package_dir: Path, split: str, caps: Caps, tally: Tally) -> list[Prompt]:
    no_split(NAME, split)
    data_dir = data_file(package_dir, DATA_DIR, PACKAGE.package, directory=True)
    prompts: list[Prompt] = []
    for eval_dir in sorted(p for p in data_dir.iterdir() if p.is_dir() and p.name != "__pycache__"):
        name = eval_dir.name
        if name in EXCLUDED_EVALS:
            tally.exclude(NAME, name, EXCLUDED_EVALS[name])
            continue
        prompts.extend(_eval_prompts(name, _eval_lines(eval_dir), caps, tally))
    return prompts


def _eval_lines(eval_dir: Path) -> list[bytes]:
    """The eval's non-empty sample lines over all its `.jsonl` files, in sorted path order."""
    lines: list[bytes] = []
    for path in sorted(eval_dir.rglob("*.jsonl")):
        lines.extend(line for line in path.read_bytes().splitlines() if line.strip())
    return lines


def _eval_prompts(name: str, lines: list[bytes], caps: Caps, tally: Tally) -> list[Prompt]:
    order = list(range(len(lines)))
    cap = caps.cap(name)
    if cap is not None and cap < len(lines):
        caps.rng(NAME, name).shuffle(order)
    kept: list[Prompt] = []
    examined = 0
    for index in order:
        if cap is not None and len(kept) == cap:
            break
        examined += 1
        prompt = _sample_prompt(f"{NAME}:{name}:{index}", lines[index], caps.max_chars)
        if isinstance(prompt, str):
            tally.drop(NAME, name, prompt)
        else:
            kept.append(prompt)
    tally.drop(NAME, name, "over the per-task cap (not read)", len(lines) - examined)
    tally.keep(NAME, name, len(kept))
    return sorted(kept, key=lambda p: int(p.id.rsplit(":", 1)[1]))


def _sample_prompt(prompt_id: str, line: bytes, max_chars: int) -> Prompt | str:
    """The sample's prompt, or why it is not usable."""
    try:
        sample = json.loads(line)
    except json.JSONDecodeError:
        return "invalid JSON"
    if not isinstance(sample, dict):
        return "no chat input"
    if "completion" in sample and "choice" in sample:
        return "labelled completion of a model-graded meta-eval"
    raw = sample.get("input")
    if isinstance(raw, str):
        raw = [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        return "no chat input"
    turns = []
    for message in raw:
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            return "malformed message"
        name = message.get("name")
        role = _FEW_SHOT_ROLES[name] if name in _FEW_SHOT_ROLES else message.get("role")
        if role not in _ROLES:
            return "malformed message"
        turns.append((role, message["content"]))
    messages = normalize_turns(turns)
    if isinstance(messages, str):
        return messages
    text = "\n".join(m["content"] for m in messages)
    if len(text) > max_chars:
        return "too long"
    reason = unusable_text(text)
    if reason:
        return reason
    ideal = sample.get("ideal")
    if isinstance(ideal, list):
        ideal = next((item for item in ideal if isinstance(item, str)), None)
    return Prompt(id=prompt_id, messages=messages, reference=ideal if isinstance(ideal, str) else None)
