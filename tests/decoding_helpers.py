"""Shared by the decoding tests (engine, speculative decoding, regeneration): seeded builds, a tiny hybrid target,
transformers' greedy reference, a CPU stand-in for CUDA-graph capture."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase, Qwen3Config, Qwen3ForCausalLM
from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from dflash_trainer.targets.loader import LoadedTarget

T = TypeVar("T")


def seeded(build: Callable[[], T], seed: int) -> T:
    """`build()` under its own RNG stream: building a model must not shift the test's random numbers."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return build()


# The tiny targets' shape (6 layers of width 64), the vocabulary aside: the decoding and training tests' verifiers.
TINY_TARGET_DIMS = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


def tiny_qwen3_target(seed: int = 0, vocab: int = 64) -> Qwen3ForCausalLM:
    """A random Qwen3 target of `TINY_TARGET_DIMS` in eval mode, the DFlash2 decoding tests' verifier."""
    config = Qwen3Config(vocab_size=vocab, attn_implementation="sdpa", **TINY_TARGET_DIMS)
    return seeded(lambda: Qwen3ForCausalLM(config).eval(), seed)


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Tiny matmuls are dominated by thread hand-off on a busy 2-core machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def cpu_target(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, name: str) -> LoadedTarget:
    """`model` (float32, on the CPU) as a loaded target whose stop token is `<|im_end|>` (id 2)."""
    return LoadedTarget(
        model=model,
        tokenizer=tokenizer,
        config=model.config,
        name=name,
        stop_token_ids=[2],
        device=torch.device("cpu"),
        dtype=torch.float32,
    )


def hf_greedy(model: PreTrainedModel, prompt: list[int], max_new_tokens: int, stops: list[int]) -> list[int]:
    """transformers' greedy `generate` of one prompt: its new tokens, cut after the first stop token."""
    with torch.no_grad():
        output = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=stops,
            pad_token_id=0,
        )
    new = output[0, len(prompt) :].tolist()
    return next((new[: i + 1] for i, token in enumerate(new) if token in stops), new)


def run_then_capture(graphs: object, key: object, step: Callable[[], None]) -> None:
    """Stands in for `StepGraphs.run` on CPU as if every call were a key's first: the step runs, then the capture
    runs its Python again and records its kernels without running them. Simulated by running it again and then
    restoring the tensors of its decoder and the recurrent states of its cache; the KV and drafter-context entries
    the second run wrote lie past every row's length and are rewritten before they are read. A test sees whether
    that changes anything."""
    step()
    decoder = step.func.__self__  # `step` is a partial of a decoder's step method
    recurrent = decoder.cache.recurrent
    state = [value for value in vars(decoder).values() if isinstance(value, torch.Tensor)]
    state += recurrent.tensors() if recurrent is not None else []
    saved = [tensor.clone() for tensor in state]
    step()
    for tensor, value in zip(state, saved, strict=True):
        tensor.copy_(value)


# A tiny Qwen3.5-style hybrid: 5 layers (linear, full, linear, linear, full attention), vocab == hidden.
HYBRID_DIMS = dict(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=5,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    max_position_embeddings=512,
    initializer_range=0.2,  # varied, well-separated logits
    tie_word_embeddings=False,
    attn_implementation="sdpa",
)


def hybrid_target(seed: int = 2, *, orthogonal_head: bool = False) -> Qwen3_5ForCausalLM:
    """The tiny hybrid in float32. `orthogonal_head`: the LM head is an orthogonal matrix x 4 (V == H), so the
    hidden state head[t] / 4 scores token t alone (a test drafter can propose the tokens it wants)."""
    config = Qwen3_5TextConfig(**HYBRID_DIMS)
    model = seeded(lambda: Qwen3_5ForCausalLM(config).eval(), seed)
    if orthogonal_head:
        with torch.no_grad(), torch.random.fork_rng():
            torch.manual_seed(seed + 100)
            q, _ = torch.linalg.qr(torch.randn(config.vocab_size, config.hidden_size))
            model.lm_head.weight.copy_(q * 4.0)
    return model
