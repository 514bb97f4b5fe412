"""Chat records to token ids with a loss mask on exactly the assistant tokens.

Two steps:

1. `normalize_record` turns one input record (OpenAI `messages`, ShareGPT `conversations`, or a
   `prompt`/`response` pair) into a list of `{"role", "content"}` messages, or raises `RecordError` naming the
   field and the problem.
2. `tokenize_conversation` renders the messages with the tokenizer's own chat template, tokenises the text once
   (so token boundaries are the ones the target sees at inference) and marks the assistant tokens;
   `tokenize_conversations` does the same for many conversations with one batched encode.

How the assistant tokens are found, without relying on `{% generation %}` support in the template:
- the span of assistant message i starts where the rendering of messages[:i] with the generation prompt ends
  (so the `<|im_start|>assistant\\n` header, which the serving engine writes, is never trained on);
- it ends at the template's end-of-turn token (e.g. `<|im_end|>`, which the model must learn to emit), found
  as the first special token the template writes after an assistant message's content, or at the end of the
  content when the template writes no special token there;
- a reply marked `"truncated": true` (cut at a token limit by regeneration, not ended by the model) ends at
  the end of its content, and so does the sample: no end-of-turn token, no later messages.
Token positions come from the fast tokenizer's character offsets. Templates that rewrite earlier turns when
more messages follow (Qwen3 drops the reasoning of past turns) still work: only the rendering of the
conversation *before* an assistant turn has to be a prefix of the full rendering, and that is checked.

Reasoning traces (`<think>...</think>` in the content or a `reasoning_content` field) are dropped by default;
with `keep_reasoning=True` they are written into the content as `<think>\\n...\\n</think>\\n\\n` so that every
template sees them, and they are trained on as part of the assistant turn.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Mapping, Sequence
from typing import Any

from jinja2.exceptions import TemplateError
from transformers import PreTrainedTokenizerBase

from ..errors import UserError

# {"role", "content"}, and on assistant messages optionally "reasoning_content" and "truncated": True.
ChatMessage = dict[str, Any]

ROLES = ("system", "user", "assistant")
# ShareGPT speaker names -> chat roles.
_SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
}
_THINK_BLOCK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)
_THINK_END = "</think>"
# A string no template rewrites and no tokenizer treats specially; used to find what follows an assistant turn.
_PROBE_CONTENT = "dflash probe reply"


class RecordError(UserError, ValueError):
    """A chat record is malformed. `reason` is a short key used to count skipped records per cause."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class ChatTemplateError(RecordError):
    """The chat template rejects the conversation or renders it so the assistant turns cannot be located."""

    def __init__(self, message: str) -> None:
        super().__init__("template_error", message)


# ----------------------------------------------------------------------------------------------------------
# Records -> messages


def normalize_record(record: Any, *, require_assistant: bool = True) -> list[ChatMessage]:
    """Return the conversation of one record as `[{"role", "content"}, ...]`.

    Accepted layouts, tried in this order: `{"messages": [{"role", "content"}]}` (OpenAI; `content` may also
    be a list of `{"type": "text", "text"}` parts; an assistant message may carry `reasoning_content`, which
    is kept under that key, and `truncated: true`, kept too: a reply cut before the model ended its turn),
    `{"conversations": [{"from", "value"}]}` (ShareGPT, `from` in human/gpt/system),
    `{"prompt": str, "response": str}`. With `require_assistant=False` a conversation without assistant turn
    (a prompt) is accepted, and `{"prompt": str}` alone is enough.
    """
    if not isinstance(record, Mapping):
        raise RecordError("wrong_type", f"record must be a JSON object, got {type(record).__name__}")
    if "messages" in record:
        messages = _openai_messages(record["messages"])
    elif "conversations" in record:
        messages = _sharegpt_messages(record["conversations"])
    elif "prompt" in record:
        messages = _prompt_response_messages(record, require_response=require_assistant)
    else:
        raise RecordError(
            "missing_field", "record has none of the fields 'messages', 'conversations' or 'prompt'/'response'"
        )
    if not messages:
        raise RecordError("empty_conversation", "conversation has no messages")
    if require_assistant and not any(m["role"] == "assistant" for m in messages):
        raise RecordError("no_assistant_turn", "conversation has no assistant turn to train on")
    return messages


def _openai_messages(raw: Any) -> list[ChatMessage]:
    if not isinstance(raw, list):
        raise RecordError("wrong_type", f"messages: must be a list, got {type(raw).__name__}")
    messages = []
    for index, item in enumerate(raw):
        where = f"messages[{index}]"
        if not isinstance(item, Mapping):
            raise RecordError("wrong_type", f"{where}: must be an object, got {type(item).__name__}")
        role = _required_str(item, "role", where)
        if role not in ROLES:
            raise RecordError("unknown_role", f"{where}.role: unknown role {role!r}, expected one of {ROLES}")
        message = {"role": role, "content": _content_text(item, where)}
        reasoning = item.get("reasoning_content")
        if reasoning is not None:
            if role != "assistant" or not isinstance(reasoning, str):
                raise RecordError("wrong_type", f"{where}.reasoning_content: must be a string on an assistant message")
            if reasoning.strip():
                message["reasoning_content"] = reasoning
        truncated = item.get("truncated")
        if truncated is not None:
            if role != "assistant" or not isinstance(truncated, bool):
                raise RecordError("wrong_type", f"{where}.truncated: must be true or false on an assistant message")
            if truncated:
                message["truncated"] = True
        messages.append(message)
    return messages


def _content_text(item: Mapping[str, Any], where: str) -> str:
    if "content" not in item:
        raise RecordError("missing_content", f"{where}.content: missing")
    content = item["content"]
    if isinstance(content, list):
        # OpenAI content parts: only text parts can be tokenised.
        texts = []
        for part_index, part in enumerate(content):
            if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise RecordError(
                    "wrong_type",
                    f"{where}.content[{part_index}]: only {{'type': 'text', 'text': str}} parts are supported",
                )
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise RecordError("wrong_type", f"{where}.content: must be a string, got {type(content).__name__}")
    if not content.strip():
        raise RecordError("empty_content", f"{where}.content: empty")
    return content


def _sharegpt_messages(raw: Any) -> list[ChatMessage]:
    if not isinstance(raw, list):
        raise RecordError("wrong_type", f"conversations: must be a list, got {type(raw).__name__}")
    messages = []
    for index, item in enumerate(raw):
        where = f"conversations[{index}]"
        if not isinstance(item, Mapping):
            raise RecordError("wrong_type", f"{where}: must be an object, got {type(item).__name__}")
        speaker = _required_str(item, "from", where)
        if speaker not in _SHAREGPT_ROLES:
            raise RecordError(
                "unknown_role", f"{where}.from: unknown speaker {speaker!r}, expected one of {tuple(_SHAREGPT_ROLES)}"
            )
        value = _required_str(item, "value", where)
        if not value.strip():
            raise RecordError("empty_content", f"{where}.value: empty")
        messages.append({"role": _SHAREGPT_ROLES[speaker], "content": value})
    return messages


def _prompt_response_messages(record: Mapping[str, Any], *, require_response: bool) -> list[ChatMessage]:
    prompt = _required_str(record, "prompt", "record")
    if not prompt.strip():
        raise RecordError("empty_content", "prompt: empty")
    messages = [{"role": "user", "content": prompt}]
    if "response" in record or require_response:
        response = _required_str(record, "response", "record")
        if not response.strip():
            raise RecordError("empty_content", "response: empty")
        messages.append({"role": "assistant", "content": response})
    return messages


def _required_str(item: Mapping[str, Any], key: str, where: str) -> str:
    field_name = key if where == "record" else f"{where}.{key}"
    if key not in item:
        reason = "missing_role" if key in ("role", "from") else "missing_field"
        raise RecordError(reason, f"{field_name}: missing")
    value = item[key]
    if not isinstance(value, str):
        raise RecordError("wrong_type", f"{field_name}: must be a string, got {type(value).__name__}")
    return value


# ----------------------------------------------------------------------------------------------------------
# Reasoning traces


def apply_reasoning_policy(messages: Sequence[Mapping[str, str]], *, keep_reasoning: bool) -> list[ChatMessage]:
    """Return `{"role", "content"}` messages with assistant reasoning dropped or inlined as `<think>` text."""
    result = []
    for message in messages:
        content = message["content"]
        if message["role"] == "assistant":
            if keep_reasoning:
                reasoning = message.get("reasoning_content") or ""
                if reasoning.strip():
                    content = f"<think>\n{reasoning.strip()}\n</think>\n\n{content.lstrip()}"
            else:
                content = strip_reasoning(content)
        result.append({"role": message["role"], "content": content})
    return result


def strip_reasoning(content: str) -> str:
    """Remove `<think>...</think>` blocks, and a reasoning prefix whose opening tag was left out."""
    content = _THINK_BLOCK.sub("", content)
    if _THINK_END in content:
        # R1-style data: the template opened `<think>` in the generation prompt, the content only closes it.
        content = content.rsplit(_THINK_END, 1)[1]
    return content.lstrip()


def _answer_text(content: str) -> str:
    """The part of assistant content that every template writes verbatim: the text after any reasoning."""
    return content.rsplit(_THINK_END, 1)[-1].strip()


# ----------------------------------------------------------------------------------------------------------
# Tokenisation with the loss mask


def tokenize_conversation(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, str]],
    keep_reasoning: bool = False,
    max_length: int | None = None,
) -> tuple[list[int], list[int]]:
    """Render `messages` with the chat template and return `(input_ids, loss_mask)`.

    `loss_mask[t]` is 1 on the tokens of every assistant message (its content, reasoning when kept, and the
    template's end-of-turn token) and 0 on everything else (system and user turns, role headers, the newline
    after the end-of-turn token). An assistant message marked `truncated` (a reply cut at a token limit, not
    ended by the model) is left open: the sample ends with its content, without the end-of-turn token or
    anything after it (later messages are dropped), so the drafter never learns a stop the model did not make.
    `max_length` truncates both lists. Raises `ChatTemplateError` when the
    template rejects the conversation or the assistant turns cannot be located in its rendering.
    """
    (result,) = tokenize_conversations(tokenizer, [messages], keep_reasoning=keep_reasoning, max_length=max_length)
    if isinstance(result, Exception):
        raise result
    return result


def tokenize_conversations(
    tokenizer: PreTrainedTokenizerBase,
    conversations: Sequence[Sequence[Mapping[str, str]]],
    keep_reasoning: bool = False,
    max_length: int | None = None,
) -> list[tuple[list[int], list[int]] | Exception]:
    """`tokenize_conversation` of many conversations, each result in its place: `(input_ids, loss_mask)`, or
    the exception that conversation raised (so one bad record does not fail the others).

    The texts are encoded in one batch call, which the Rust tokenizer spreads over the host's cores (`prepare`
    spent most of its time in one-text encodes); the tokens are the same as one call per text. If the batch
    call itself fails (an exception or a Rust panic), each text is encoded alone so the error lands on its own
    conversation. The template's end-of-turn token is found once per call.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError("tokenize_conversation needs a fast tokenizer (character offsets locate the assistant tokens)")
    if not tokenizer.chat_template:
        raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no chat template")
    results: list[tuple[list[int], list[int]] | Exception | None] = [None] * len(conversations)
    rendered: list[tuple[int, list[ChatMessage], int | None, str]] = []  # (index, turns, open turn, text)
    for index, messages in enumerate(conversations):
        try:
            turns = apply_reasoning_policy(messages, keep_reasoning=keep_reasoning)
            open_turn = _first_truncated_turn(messages)
            if open_turn is not None:
                turns = turns[: open_turn + 1]  # the conversation ends inside that reply
            rendered.append((index, turns, open_turn, _render(tokenizer, turns, add_generation_prompt=False)))
        except Exception as error:  # templates raise many types; the caller decides what a bad record means
            results[index] = error
    if rendered:
        try:
            # Once per call (a render and an encode): `prepare` calls with 512 conversations at a time.
            end_of_turn_id = end_of_turn_token_id(tokenizer)
        except Exception as error:  # the template rejects the probe conversation: every record says so
            for index, *_ in rendered:
                results[index] = error
            return results
        encodings = _encode_each(tokenizer, [text for *_, text in rendered])
        for (index, turns, open_turn, text), encoding in zip(rendered, encodings, strict=True):
            if isinstance(encoding, Exception):
                results[index] = encoding
                continue
            try:
                results[index] = _mark_assistant_tokens(
                    tokenizer, turns, open_turn, text, *encoding, end_of_turn_id, max_length
                )
            except Exception as error:
                results[index] = error
    return results  # every slot is filled above


def _encode_each(
    tokenizer: PreTrainedTokenizerBase, texts: list[str]
) -> list[tuple[list[int], list[tuple[int, int]]] | Exception]:
    """Token ids and character offsets of each text: one batch call, or one call per text if the batch fails."""
    try:
        batch = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        return list(zip(batch["input_ids"], batch["offset_mapping"], strict=True))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException:  # an error (or a Rust panic: pyo3's PanicException) on one text fails the whole batch
        encoded: list[tuple[list[int], list[tuple[int, int]]] | Exception] = []
        for text in texts:
            try:
                one = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
                encoded.append((one["input_ids"], one["offset_mapping"]))
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as error:
                encoded.append(
                    error if isinstance(error, Exception) else RuntimeError(f"{type(error).__name__}: {error}")
                )
        return encoded


def generation_prompt_ids(
    tokenizer: PreTrainedTokenizerBase, conversations: Sequence[Sequence[Mapping[str, str]]]
) -> list[list[int]]:
    """Token ids of each conversation rendered with the chat template and the assistant generation prompt: what the
    target reads before it answers (regeneration, evaluation). Tokenised as training data is (no extra special
    tokens), in one encode call: the Rust tokenizer spreads a batch over the cores (the math-first GPU recipe's 48,000
    first turns on 2 cores: 21 s one call per prompt, 11 s in calls of 1,024)."""
    texts = [_render(tokenizer, list(messages), add_generation_prompt=True) for messages in conversations]
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def _mark_assistant_tokens(
    tokenizer: PreTrainedTokenizerBase,
    turns: list[ChatMessage],
    open_turn: int | None,
    text: str,
    input_ids: Sequence[int],
    offsets: Sequence[tuple[int, int]],
    end_of_turn_id: int | None,
    max_length: int | None,
) -> tuple[list[int], list[int]]:
    """The loss mask of one rendered, encoded conversation (see `tokenize_conversation`)."""
    input_ids = list(input_ids)
    token_starts = [start for start, _ in offsets]
    loss_mask = [0] * len(input_ids)
    for index, turn in enumerate(turns):
        if turn["role"] != "assistant":
            continue
        is_open = index == open_turn
        first, last = _assistant_token_span(
            tokenizer, turns, index, text, input_ids, token_starts, None if is_open else end_of_turn_id
        )
        loss_mask[first : last + 1] = [1] * (last + 1 - first)
        if is_open:
            # Nothing the template writes after an unfinished reply belongs to the sample.
            input_ids, loss_mask = input_ids[: last + 1], loss_mask[: last + 1]

    if max_length is not None:
        input_ids, loss_mask = input_ids[:max_length], loss_mask[:max_length]
    return input_ids, loss_mask


def _assistant_token_span(
    tokenizer: PreTrainedTokenizerBase,
    turns: list[ChatMessage],
    index: int,
    text: str,
    input_ids: list[int],
    token_starts: list[int],
    end_of_turn_id: int | None,
) -> tuple[int, int]:
    """First and last token index (inclusive) of assistant message `index` in the rendered `text`."""
    header = _render(tokenizer, turns[:index], add_generation_prompt=True) if index else None
    if header is None or not text.startswith(header):
        raise ChatTemplateError(
            f"messages[{index}] (assistant): the chat template renders the conversation before this turn "
            "differently from the start of the whole conversation, so the turn cannot be located "
            "(does the conversation start with an assistant message?)"
        )
    body_start = len(header)
    answer = _answer_text(turns[index]["content"])
    answer_start = text.find(answer, body_start) if answer else body_start
    if answer_start < 0:
        raise ChatTemplateError(f"messages[{index}] (assistant): content not found in the rendered conversation")
    answer_end = answer_start + len(answer)

    first = bisect.bisect_left(token_starts, body_start)
    after_answer = bisect.bisect_left(token_starts, answer_end)
    if end_of_turn_id is None:
        return first, after_answer - 1
    for position in range(after_answer, len(input_ids)):
        if input_ids[position] == end_of_turn_id:
            return first, position
    raise ChatTemplateError(f"messages[{index}] (assistant): no end-of-turn token after its content")


def _first_truncated_turn(messages: Sequence[Mapping[str, Any]]) -> int | None:
    return next((i for i, m in enumerate(messages) if m["role"] == "assistant" and m.get("truncated") is True), None)


def end_of_turn_token_id(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The special token the chat template writes right after an assistant message, or None if there is none."""
    probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE_CONTENT}]
    rendered = _render(tokenizer, probe, add_generation_prompt=False)
    tail = rendered[rendered.rfind(_PROBE_CONTENT) + len(_PROBE_CONTENT) :]
    special_ids = _special_token_ids(tokenizer)
    for token_id in tokenizer(tail, add_special_tokens=False)["input_ids"]:
        if token_id in special_ids:
            return token_id
    return None


def _special_token_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    # Chat control tokens such as <|im_end|> are often added special tokens without a named role (eos, pad...).
    added = {token_id for token_id, token in tokenizer.added_tokens_decoder.items() if token.special}
    return added | set(tokenizer.all_special_ids)


def _render(tokenizer: PreTrainedTokenizerBase, turns: list[ChatMessage], *, add_generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=add_generation_prompt)
    except TemplateError as error:
        raise ChatTemplateError(f"chat template rejected the conversation: {error}") from error
