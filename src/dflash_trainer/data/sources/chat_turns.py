"""Turn a source's raw chat turns into messages every chat template accepts, or say why they are unusable.

Templates differ in what they allow (several of them reject two user turns in a row, or a system message
after the first turn), so prompts are normalised to: an optional system message first, then user and
assistant turns alternating, starting with user and ending with user (the turn the target answers). Two
turns of the same role in a row are joined with a blank line; a system message after the first turn is an
instruction in the conversation and becomes a user turn. Text that a tokenizer would choke on or that is no
prompt (control characters, private-use or hidden tag characters, long base64/hex runs, a benchmark canary
asking not to be trained on) makes the prompt unusable.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # not at run time: chat.py imports transformers, which these loaders do not need
    from dflash_trainer.data.chat import ChatMessage

# Control characters other than tab/newline/carriage return, surrogates, private use, Unicode tag characters
# and variation-selector supplements (used to hide text in emoji), unassigned planes.
_UNPRINTABLE = re.compile(
    "[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff\ue000-\uf8ff\U000e0000-\U000e01ef\U000f0000-\U0010ffff]"
)
# An image or binary blob written as base64 or hex: 200 characters of that alphabet without a break.
_BLOB = re.compile(r"[A-Za-z0-9+/=]{200,}")
# Benchmark canaries (BIG-bench style): their authors ask that the data never appear in training corpora.
_CANARY = re.compile(r"canary GUID|NEVER APPEAR IN TRAINING CORPORA", re.IGNORECASE)


def unusable_text(text: str) -> str | None:
    """Why `text` is not a usable prompt text, or None."""
    if _UNPRINTABLE.search(text):
        return "unprintable characters"
    if _BLOB.search(text):
        return "base64/hex blob"
    if _CANARY.search(text):
        return "training-data canary"
    return None


def normalize_turns(turns: Sequence[tuple[str, str]]) -> list[ChatMessage] | str:
    """(role, content) turns -> template-safe messages, or the reason they cannot be a prompt."""
    messages: list[ChatMessage] = []
    for position, (role, content) in enumerate(turns):
        if not content.strip():
            continue
        if role == "system" and position > 0 and messages:
            role = "user"
        if messages and messages[-1]["role"] == role:
            messages[-1] = {"role": role, "content": f"{messages[-1]['content']}\n\n{content}"}
        else:
            messages.append({"role": role, "content": content})
    if not messages:
        return "empty"
    if messages[-1]["role"] == "system":
        # A lone instruction is what the model answers (evals writes completion-style prompts this way).
        messages[-1] = {"role": "user", "content": messages[-1]["content"]}
    if messages[-1]["role"] != "user":
        return "does not end with a user turn"
    first_turn = 1 if messages[0]["role"] == "system" else 0
    if messages[first_turn]["role"] != "user":
        return "starts with an assistant turn"
    return messages
