"""Shared fixtures: tiny random targets (Qwen3, Llama, a Qwen3.5 hybrid) and a tiny chat tokenizer.

The models are built from configs with random weights (nothing is downloaded) and are small enough that a
forward pass on a few dozen tokens takes milliseconds on a CPU.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

# Tests never reach a model hub; set before transformers / huggingface_hub read it at import.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig

TINY_VOCAB = 256
# Token ids of the tiny chat tokenizer's special tokens.
PAD_ID, IM_START_ID, IM_END_ID, UNK_ID = 0, 1, 2, 3
# Added special tokens the chat template never writes (candidates for the drafter's mask token).
UNUSED_SPECIALS = ("<repo_name>", "<empty_output>")
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_TINY_DIMS = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    # Wider than the default 0.02 so that random models give varied, well-separated logits.
    initializer_range=0.2,
    bos_token_id=IM_START_ID,
    eos_token_id=IM_END_ID,
    pad_token_id=PAD_ID,
)


def _build(model_class: type[PreTrainedModel], config, seed: int) -> PreTrainedModel:
    # A private RNG stream: building a fixture must not shift the random numbers of the test using it.
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = model_class(config)
    return model.eval()


@pytest.fixture
def tiny_qwen3() -> Qwen3ForCausalLM:
    """6-layer Qwen3 (H=64, 4 heads, 2 KV heads, head_dim 16, vocab 256), float32, SDPA."""
    config = Qwen3Config(num_hidden_layers=6, attn_implementation="sdpa", **_TINY_DIMS)
    return _build(Qwen3ForCausalLM, config, seed=0)


@pytest.fixture
def tiny_llama() -> LlamaForCausalLM:
    """6-layer Llama with the same dimensions as `tiny_qwen3`, eager attention (additive masks)."""
    config = LlamaConfig(num_hidden_layers=6, attn_implementation="eager", **_TINY_DIMS)
    return _build(LlamaForCausalLM, config, seed=1)


@pytest.fixture
def tiny_qwen3_5() -> Qwen3_5ForCausalLM:
    """4-layer Qwen3.5 hybrid: linear-attention layers 0 and 2, full attention 1 and 3 (torch fallback on CPU)."""
    config = Qwen3_5TextConfig(
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        attn_implementation="sdpa",
        **_TINY_DIMS,
    )
    return _build(Qwen3_5ForCausalLM, config, seed=2)


@pytest.fixture(scope="session")
def tiny_chat_tokenizer() -> PreTrainedTokenizerFast:
    """Word-level tokenizer with exactly 256 tokens and a ChatML template.

    Ids: 0 `<|endoftext|>` (pad), 1 `<|im_start|>`, 2 `<|im_end|>` (EOS), 3 `<unk>`, 4 `<repo_name>`,
    5 `<empty_output>`, then `system`, `user`, `assistant` and the words `w0`, `w1`, ... Text is split on
    whitespace and punctuation; decoding joins tokens with spaces.
    """
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>", *UNUSED_SPECIALS]
    words = ["system", "user", "assistant"]
    words += [f"w{i}" for i in range(TINY_VOCAB - len(specials) - len(words))]
    vocab = {token: index for index, token in enumerate(specials + words)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        additional_special_tokens=list(UNUSED_SPECIALS),
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    assert len(tokenizer) == TINY_VOCAB
    return tokenizer


@pytest.fixture
def tiny_target_dir(tmp_path: Path, tiny_qwen3: Qwen3ForCausalLM, tiny_chat_tokenizer) -> Path:
    """`tiny_qwen3` and `tiny_chat_tokenizer` saved as a Hugging Face model directory (EOS = `<|im_end|>`)."""
    path = tmp_path / "tiny-target"
    tiny_qwen3.save_pretrained(path)
    tiny_chat_tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def restore_handlers():
    """The SIGINT/SIGTERM handlers as they were before the test (a test installs launch.StopFlag's)."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)
