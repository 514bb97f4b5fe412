"""`chitchat`: casual two-person conversations of the Chit-Chat Challenge (pip `chitchat-dataset`, MIT).

The package ships `chitchat_dataset/dataset.json`: about 7,000 conversations, each a list of turns, each turn
one or more messages by one sender. The person who speaks first is the user, the other the assistant; a
turn's messages are joined by newlines. A prompt is the conversation up to its `USER_TURNS`-th user turn (or
its last user turn when shorter): regeneration answers every assistant turn of it with the target, so a
prompt gives up to `USER_TURNS` replies in a real conversational context. Conversations whose prompt is
unusable (see `chat_turns`) or longer than `caps.max_chars` are dropped. There is one sub-task,
`conversations`; ids are `chitchat:<conversation id>` (the dataset's own UUIDs), in file order.
"""

from __future__ import annotations

import json
from pathlib import Path

from .base import Caps, PackageData, Prompt, PromptSetError, Tally, data_file, no_split
from .chat_turns import normalize_turns, unusable_text

NAME = "chitchat"
PACKAGE = PackageData("chitchat-dataset", "chitchat_dataset", "0.9.0")
TASK = "conversations"
USER_TURNS = 3


def load(package_dir: Path, split: str, caps: Caps, tally: Tally) -> list[Prompt]:
    no_split(NAME, split)
    path = data_file(package_dir, "dataset.json", PACKAGE.package)
    try:
        conversations = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise PromptSetError(f"{path}: invalid JSON: {error.msg} (line {error.lineno})") from None
    if not isinstance(conversations, dict):
        raise PromptSetError(f"{path}: expected an object of conversations by id")
    items: list[Prompt] = []
    for conversation_id, conversation in conversations.items():
        prompt = _prompt(f"{NAME}:{conversation_id}", conversation, caps.max_chars)
        if isinstance(prompt, str):
            tally.drop(NAME, TASK, prompt)
        else:
            items.append(prompt)
    kept = caps.sample(NAME, TASK, items)
    tally.drop(NAME, TASK, "over the per-task cap", len(items) - len(kept))
    tally.keep(NAME, TASK, len(kept))
    return kept


def _prompt(prompt_id: str, conversation: object, max_chars: int) -> Prompt | str:
    turns = conversation.get("messages") if isinstance(conversation, dict) else None
    if not isinstance(turns, list):
        return "malformed conversation"
    first_sender = None
    roles_and_texts = []
    for turn in turns:
        if not (isinstance(turn, list) and turn and all(isinstance(m, dict) for m in turn)):
            return "malformed conversation"
        texts = [m.get("text") for m in turn]
        if not all(isinstance(t, str) for t in texts):
            return "malformed conversation"
        first_sender = first_sender or turn[0].get("sender")
        role = "user" if turn[0].get("sender") == first_sender else "assistant"
        roles_and_texts.append((role, "\n".join(texts)))
    user_turns = [i for i, (role, _) in enumerate(roles_and_texts) if role == "user"]
    if not user_turns:
        return "empty"
    last = user_turns[min(USER_TURNS, len(user_turns)) - 1]
    messages = normalize_turns(roles_and_texts[: last + 1])
    if isinstance(messages, str):
        return messages
    text = "\n".join(m["content"] for m in messages)
    if len(text) > max_chars:
        return "too long"
    return unusable_text(text) or Prompt(id=prompt_id, messages=messages)
