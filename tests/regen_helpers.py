"""Shared by the regeneration tests: the records, transformers' greedy reference of a whole conversation, a target
whose extra stop ids make some replies stop midway and one reply empty."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from dflash_trainer.targets import regenerate as regen
from dflash_trainer.targets.loader import LoadedTarget
from dflash_trainer.targets.regenerate import cut_at_stop

MAX_NEW_TOKENS = 5

CONVERSATIONS = [
    [{"role": "user", "content": "w1 w2 w3"}],
    {
        "messages": [
            {"role": "system", "content": "w5"},
            {"role": "user", "content": "w9 w10"},
            {"role": "assistant", "content": "w3"},
        ]
    },
    {
        "id": "multi",
        "messages": [
            {"role": "user", "content": "w1"},
            {"role": "assistant", "content": "w2"},
            {"role": "user", "content": "w3 w4 w5 w6"},
            {"role": "assistant", "content": "w2"},
        ],
    },
    [{"role": "user", "content": "w40 w41 w42 w43 w44 w45 w46"}],
    [{"role": "user", "content": "w7"}, {"role": "assistant", "content": "w8"}, {"role": "user", "content": "w11"}],
]


def greedy_reply(
    target: LoadedTarget, messages: list[dict], max_new_tokens: int = MAX_NEW_TOKENS
) -> tuple[str, list[int], bool]:
    """Reference: one prompt alone through `generate`; (reply text, new ids, whether a stop token ended it)."""
    text = target.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = torch.tensor([target.tokenizer(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        output = target.model.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=target.stop_token_ids,
            pad_token_id=target.tokenizer.pad_token_id,
        )
    new_ids = output[0, prompt.shape[1] :].tolist()
    reply_ids, stopped = cut_at_stop(new_ids, target.stop_token_ids)
    return target.tokenizer.decode(reply_ids, skip_special_tokens=False), new_ids, stopped


def expected_conversation(target: LoadedTarget, messages: list[dict]) -> list[dict] | None:
    """Each assistant turn (and one after a final user turn) replaced in order; a reply cut at max_new_tokens
    is marked truncated and ends the conversation; None when a reply is empty."""
    history: list[dict] = []
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if messages[-1]["role"] != "assistant":
        turns.append(len(messages))
    for index in range(len(messages) + 1):
        if index in turns:
            reply, _, stopped = greedy_reply(target, history)
            if not reply.strip():
                return None
            history.append({"role": "assistant", "content": reply, **({} if stopped else {"truncated": True})})
            if not stopped:
                return history
        elif index < len(messages):
            history.append(dict(messages[index]))
    return history


def messages_of(item) -> list[dict]:
    return item["messages"] if isinstance(item, dict) else item


def read_output(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / regen.OUTPUT_FILE).read_text().splitlines()]


def _first_new_token_index(ids: list[int]) -> int | None:
    """The first position k >= 1 whose token did not occur before it (random tiny models repeat a lot)."""
    return next((k for k in range(1, len(ids)) if ids[k] not in ids[:k]), None)


def stopping_target_of(target: LoadedTarget) -> LoadedTarget:
    """Extra stop ids so that, with a random model, one record's reply is empty (it is left out) and other
    replies stop midway: the first token of conversation 3's reply, and a later token of another reply."""
    empty_stop = greedy_reply(target, messages_of(CONVERSATIONS[3]))[1][0]
    for item in CONVERSATIONS[:3]:
        messages = messages_of(item)
        first_turn = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
        _, new_ids, _ = greedy_reply(target, messages[:first_turn])
        k = _first_new_token_index(new_ids)
        if new_ids[0] != empty_stop and k is not None and empty_stop not in new_ids[:k]:
            return dataclasses.replace(target, stop_token_ids=[*target.stop_token_ids, empty_stop, new_ids[k]])
    raise AssertionError("no reply to stop midway")
