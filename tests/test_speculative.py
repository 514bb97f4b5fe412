"""Speculative decoding: lossless against plain greedy decoding, exact accepted lengths, cache rollback,
drafter context bookkeeping, and the evaluation runner (report files, lossless check that can fail)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch import Tensor
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, Qwen3Config, Qwen3ForCausalLM

from decoding_helpers import TINY_TARGET_DIMS, cpu_target, one_thread, seeded  # noqa: F401 (one_thread: autouse fixture)
from dflash_trainer.data.prompts import Prompt, load_prompt_set
from dflash_trainer.decoding.plain import target_generate
from dflash_trainer.decoding.runs import BatchRun, GenerationResult
from dflash_trainer.decoding.sampling import SamplingParams
from dflash_trainer.decoding.speculative import SpeculativeDecoder, speculative_generate
from dflash_trainer.eval.runner import (
    LosslessError,
    NearTieDivergence,
    encode_prompt,
    evaluate,
    quick_tau,
    set_metric_key,
    verify_lossless,
)
from dflash_trainer.model.attention import build_masks
from dflash_trainer.model.config import DrafterModelConfig
from dflash_trainer.model.drafter import DFlashDrafter
from dflash_trainer.targets.capture import FeatureCapture
from dflash_trainer.targets.loader import LoadedTarget

VOCAB = 64
HIDDEN = 64
DIMS = dict(vocab_size=VOCAB, **TINY_TARGET_DIMS)


def qwen3_target(seed: int = 0, **overrides) -> Qwen3ForCausalLM:
    config = Qwen3Config(attn_implementation="sdpa", **{**DIMS, **overrides})
    return seeded(lambda: Qwen3ForCausalLM(config).eval(), seed)


def llama_target(seed: int = 1) -> LlamaForCausalLM:
    config = LlamaConfig(attn_implementation="eager", **DIMS)
    return seeded(lambda: LlamaForCausalLM(config).eval(), seed)


def orthogonal_head_target(seed: int = 0, **overrides) -> Qwen3ForCausalLM:
    """A random target whose LM head is an orthogonal matrix (V == H), so a hidden state Q[t] scores token t
    alone: lets a test drafter propose exactly the tokens it wants."""
    model = qwen3_target(seed, **overrides)
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(seed + 100)
        q, _ = torch.linalg.qr(torch.randn(VOCAB, HIDDEN))
        model.lm_head.weight.copy_(q * 4.0)
    return model


def drafter_for(target: PreTrainedModel, *, block_size: int = 4, seed: int = 0) -> DFlashDrafter:
    config = DrafterModelConfig.from_target(
        target.config, num_layers=2, block_size=block_size, mask_token_id=VOCAB - 1, num_target_features=3
    )
    return seeded(lambda: DFlashDrafter(config).eval(), seed)


def prompt_ids(length: int = 12, seed: int = 0) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB - 1, (1, length), generator=generator)


class OracleDrafter(DFlashDrafter):
    """Knows the target's greedy continuation; at position n it drafts `correct(n)` right tokens, then wrong
    ones. Records what the decoding loop feeds it, to check the context bookkeeping."""

    def __init__(self, config: DrafterModelConfig, *, reference: list[int], head: Tensor, correct) -> None:
        super().__init__(config)
        self.reference = reference  # prompt + greedy output
        self.head = head  # [V, H] orthogonal LM head of the target
        self.correct = correct
        self.calls: list[dict[str, Tensor]] = []

    def forward(self, *, features, block_embeds, ctx_positions, block_positions, masks, backend="sdpa", cache=None):
        self.calls.append(
            {
                "features": features.clone(),
                "ctx_positions": ctx_positions.clone(),
                "block_positions": block_positions.clone(),
                "context_len": cache.valid_len.clone(),
            }
        )
        start = int(block_positions[0, 0])
        hidden = torch.zeros(1, self.config.block_size, HIDDEN)
        for slot in range(1, self.config.block_size):
            token = self.reference[start + slot] if start + slot < len(self.reference) else 0
            if slot > self.correct(start):
                token = (token + 1) % VOCAB  # never what the target picks
            hidden[0, slot] = self.head[token]
        return hidden


def expected_accepted_lengths(*, prompt_len: int, max_new_tokens: int, block_size: int, correct) -> list[int]:
    lengths, position, produced = [], prompt_len, 1
    while produced < max_new_tokens:
        verify_len = min(block_size, max_new_tokens - produced)
        committed = min(correct(position), verify_len - 1) + 1
        lengths.append(committed)
        position += committed
        produced += committed
    return lengths


def _check_consistent(result: GenerationResult, block_size: int) -> None:
    assert sum(result.accepted_lengths) == len(result.output_ids) - 1
    assert result.num_target_forwards == 1 + len(result.accepted_lengths)
    assert all(1 <= length <= block_size for length in result.accepted_lengths)


# ----------------------------------------------------------------------------------------------------------
# Decoding loop


@pytest.mark.parametrize("build_target", [qwen3_target, llama_target], ids=["qwen3", "llama"])
@pytest.mark.parametrize("block_size", [2, 5])
def test_untrained_drafter_is_lossless(build_target, block_size):
    target = build_target()
    drafter = drafter_for(target, block_size=block_size)
    for seed in range(2):
        ids = prompt_ids(seed=seed)
        reference = target_generate(target, ids, max_new_tokens=24, stop_token_ids=[])
        result = speculative_generate(target, drafter, ids, max_new_tokens=24, stop_token_ids=[])
        assert result.output_ids == reference.output_ids
        assert len(result.output_ids) == 24
        assert result.tau >= 1.0
        _check_consistent(result, block_size)


def test_well_predicting_drafter_reaches_tau_above_one():
    """A target that always emits token 7 and a real DFlashDrafter whose output is the normed embedding of its
    block tokens (layer outputs zeroed): the mask token's embedding points at token 7 too, so every draft
    is accepted and every block commits B tokens."""
    block_size, constant = 4, 7
    target = qwen3_target()
    drafter = drafter_for(target, block_size=block_size)
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(3)
        direction = torch.nn.functional.normalize(torch.randn(HIDDEN), dim=0)
        target.model.embed_tokens.weight.copy_(3.0 * direction + 0.1 * torch.randn(VOCAB, HIDDEN))
        target.lm_head.weight.normal_(std=0.02)
        target.lm_head.weight[constant] = direction
        for model in (target.model, drafter):
            for layer in model.layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()

    ids = prompt_ids()
    reference = target_generate(target, ids, max_new_tokens=30, stop_token_ids=[])
    result = speculative_generate(target, drafter, ids, max_new_tokens=30, stop_token_ids=[])
    assert reference.output_ids == [constant] * 30
    assert result.output_ids == reference.output_ids
    assert result.accepted_lengths == [4] * 7 + [1]  # 29 tokens after the prefill's first
    assert result.tau > 1.0


@pytest.mark.parametrize("block_size", [4, 7])
def test_varying_acceptance_rolls_back_the_cache(block_size):
    """Accepted lengths vary step by step (the oracle is right for a position-dependent number of slots): the
    target cache is cropped by a different amount every step, and the output still equals greedy decoding."""
    target = orthogonal_head_target()
    ids = prompt_ids(length=10)
    max_new = 70
    reference = target_generate(target, ids, max_new_tokens=max_new, stop_token_ids=[]).output_ids

    def correct(position: int) -> int:
        return (position * 5 + 3) % block_size

    config = drafter_for(target, block_size=block_size).config
    oracle = OracleDrafter(
        config, reference=ids[0].tolist() + reference, head=target.lm_head.weight / 4.0, correct=correct
    )

    result = speculative_generate(target, oracle, ids, max_new_tokens=max_new, stop_token_ids=[])
    assert result.output_ids == reference
    assert result.accepted_lengths == expected_accepted_lengths(
        prompt_len=10, max_new_tokens=max_new, block_size=block_size, correct=correct
    )
    assert len(set(result.accepted_lengths)) > 1
    _check_consistent(result, block_size)


def test_drafter_context_is_every_target_feature_before_the_block():
    """Each drafter call gets features at consecutive positions starting where the previous call's context
    ended; the ones inside the new context length are the target's layer outputs (as training captures them),
    and together they cover every position before the block."""
    block_size = 4
    target = orthogonal_head_target()
    ids = prompt_ids(length=9)
    reference = target_generate(target, ids, max_new_tokens=30, stop_token_ids=[]).output_ids

    def correct(position: int) -> int:
        return position % block_size

    config = drafter_for(target, block_size=block_size).config
    oracle = OracleDrafter(
        config, reference=ids[0].tolist() + reference, head=target.lm_head.weight / 4.0, correct=correct
    )
    result = speculative_generate(target, oracle, ids, max_new_tokens=30, stop_token_ids=[])
    assert result.output_ids == reference

    full = torch.tensor([ids[0].tolist() + reference])
    expected = FeatureCapture(target, config.target_layer_ids).capture(full).features  # [1, T, K*H]
    seen = 0
    for call in oracle.calls:
        start = int(call["block_positions"][0, 0])
        first = int(call["ctx_positions"][0, 0])
        context_len = int(call["context_len"][0])
        assert first == seen  # new entries continue where the context ended
        assert call["ctx_positions"][0].tolist() == list(range(first, first + call["features"].shape[1]))
        assert context_len == start  # the context ends right before the block's first position
        valid = context_len - first
        assert 1 <= valid <= call["features"].shape[1]
        torch.testing.assert_close(call["features"][:, :valid], expected[:, first:context_len], rtol=1e-4, atol=1e-5)
        seen = context_len
        assert call["block_positions"][0].tolist() == list(range(start, start + block_size))


class RecordingDrafter(DFlashDrafter):
    """A real drafter that records every block it drafts and its output."""

    def __init__(self, config: DrafterModelConfig) -> None:
        super().__init__(config)
        self.records: list[tuple[Tensor, Tensor, Tensor]] = []

    def forward(self, *, features, block_embeds, ctx_positions, block_positions, masks, backend="sdpa", cache=None):
        hidden = super().forward(
            features=features,
            block_embeds=block_embeds,
            ctx_positions=ctx_positions,
            block_positions=block_positions,
            masks=masks,
            backend=backend,
            cache=cache,
        )
        self.records.append((block_embeds, block_positions, hidden))
        return hidden


@pytest.mark.parametrize(
    "layers",
    [
        dict(sliding_layers=()),
        dict(sliding_layers=(0,), sliding_window=5, sliding_causal_in_block=True),
        dict(sliding_layers=(0, 1), sliding_window=6, sliding_causal_in_block=False),
        dict(sliding_layers=(0,), sliding_window=2, sliding_causal_in_block=False),
        dict(sliding_layers=(1,), sliding_window=3, sliding_causal_in_block=True),
        dict(sliding_layers=(0,), sliding_window=1, sliding_causal_in_block=False),
    ],
    ids=["full", "mixed-causal-sliding", "sliding", "window-2", "window-3-causal", "window-1"],
)
def test_cached_drafting_equals_the_training_forward(layers):
    """Each incremental, cached drafter call gives the hidden states of a from-scratch forward over the whole
    context with the training mask of a block anchored there (the window per query position, narrower than the
    block too, and in-block causality included)."""
    target = qwen3_target()
    config = DrafterModelConfig.from_target(
        target.config, num_layers=2, block_size=4, mask_token_id=VOCAB - 1, num_target_features=3, **layers
    )
    drafter = seeded(lambda: RecordingDrafter(config).eval(), 0)
    ids = prompt_ids(length=7)
    result = speculative_generate(target, drafter, ids, max_new_tokens=20, stop_token_ids=[])

    full = torch.cat([ids, torch.tensor([result.output_ids])], dim=1)
    features = FeatureCapture(target, config.target_layer_ids).capture(full).features  # [1, T, K*H]
    assert len(drafter.records) > 3
    for block_embeds, block_positions, hidden in drafter.records:
        start = int(block_positions[0, 0])
        masks = build_masks(
            anchors=torch.tensor([[start]]),
            anchor_keep=torch.tensor([[True]]),
            doc_ids=torch.zeros(1, start + 1, dtype=torch.long),
            block_size=4,
            variants=drafter.mask_variants,
            backend="sdpa",
        )
        with torch.no_grad():
            reference = DFlashDrafter.forward(
                drafter,
                # As in training: the anchor's own features are in the row, masked out (kv < anchor).
                features=features[:, : start + 1],
                block_embeds=block_embeds,
                ctx_positions=torch.arange(start + 1)[None],
                block_positions=block_positions,
                masks=masks,
            )
        torch.testing.assert_close(hidden, reference, rtol=1e-4, atol=1e-5)


def test_stop_token_inside_an_accepted_block_ends_the_output():
    target = orthogonal_head_target()
    ids = prompt_ids(length=10)
    reference = target_generate(target, ids, max_new_tokens=40, stop_token_ids=[]).output_ids
    stop_position = next(i for i in range(5, 40) if reference[i] not in reference[:i])
    stop = reference[stop_position]
    # Always right: the stop token is committed as a draft in the middle of a block.
    config = drafter_for(target, block_size=8).config
    oracle = OracleDrafter(
        config, reference=ids[0].tolist() + reference, head=target.lm_head.weight / 4.0, correct=lambda p: 7
    )
    result = speculative_generate(target, oracle, ids, max_new_tokens=40, stop_token_ids=[stop])
    stopped = target_generate(target, ids, max_new_tokens=40, stop_token_ids=[stop])
    assert result.output_ids == stopped.output_ids == reference[: stop_position + 1]
    _check_consistent(result, 8)


@pytest.mark.parametrize("max_new_tokens", [1, 2, 5, 9])
def test_never_exceeds_max_new_tokens(max_new_tokens):
    target = orthogonal_head_target()
    ids = prompt_ids()
    reference = target_generate(target, ids, max_new_tokens=max_new_tokens, stop_token_ids=[]).output_ids
    config = drafter_for(target, block_size=4).config
    oracle = OracleDrafter(
        config, reference=ids[0].tolist() + reference + [0] * 8, head=target.lm_head.weight / 4.0, correct=lambda p: 3
    )
    result = speculative_generate(target, oracle, ids, max_new_tokens=max_new_tokens, stop_token_ids=[])
    assert result.output_ids == reference and len(reference) == max_new_tokens


def test_sliding_window_target_is_lossless():
    """Layers 3-5 slide over 8 tokens: their cache must be rolled back too, past the window."""
    target = orthogonal_head_target(use_sliding_window=True, sliding_window=8, max_window_layers=3)
    assert target.config.layer_types[2:4] == ["full_attention", "sliding_attention"]
    ids = prompt_ids(length=12)
    reference = target_generate(target, ids, max_new_tokens=40, stop_token_ids=[]).output_ids

    def correct(position: int) -> int:
        return (position * 3) % 4

    config = drafter_for(target, block_size=4).config
    oracle = OracleDrafter(
        config, reference=ids[0].tolist() + reference, head=target.lm_head.weight / 4.0, correct=correct
    )
    result = speculative_generate(target, oracle, ids, max_new_tokens=40, stop_token_ids=[])
    assert result.output_ids == reference
    assert len(set(result.accepted_lengths)) > 1


def test_sampling_is_reproducible_and_equals_plain_sampling():
    target = qwen3_target()
    drafter = drafter_for(target, block_size=4)
    ids = prompt_ids()

    def sample(temperature: float, seed: int, top_p: float = 1.0) -> list[int]:
        sampling = SamplingParams(temperature=temperature, top_p=top_p)
        return speculative_generate(
            target, drafter, ids, max_new_tokens=20, stop_token_ids=[], sampling=sampling, seed=seed
        ).output_ids

    assert sample(1.0, 0) == sample(1.0, 0)
    assert sample(1.0, 0) != sample(1.0, 1)  # fails only if two seeds agree on all 20 tokens
    # The noise of new-token index i depends on (seed, i) alone: speculative sampling commits what plain
    # sampling draws, token for token.
    for top_p in (1.0, 0.8):
        plain = target_generate(
            target, ids, max_new_tokens=20, stop_token_ids=[], sampling=SamplingParams(1.0, top_p), seed=3
        ).output_ids
        assert sample(1.0, 3, top_p) == plain
    greedy = target_generate(target, ids, max_new_tokens=20, stop_token_ids=[]).output_ids
    assert sample(1e-4, 0) == greedy


def test_batch_equals_single_calls():
    target = qwen3_target()
    drafter = drafter_for(target, block_size=3)
    prompts = [prompt_ids(length=length, seed=length) for length in (5, 11, 8)]
    run = SpeculativeDecoder(
        target, drafter, [p[0].tolist() for p in prompts], max_new_tokens=12, stop_token_ids=[]
    ).run()
    assert run.rows == 3
    for ids, result in zip(prompts, run.results, strict=True):
        single = speculative_generate(target, drafter, ids, max_new_tokens=12, stop_token_ids=[])
        assert result.output_ids == single.output_ids
        assert result.accepted_lengths == single.accepted_lengths


def test_bad_requests_are_rejected():
    target = qwen3_target()
    drafter = drafter_for(target)
    with pytest.raises(ValueError, match=r"\[1, P\]"):
        speculative_generate(target, drafter, torch.zeros(2, 4, dtype=torch.long), max_new_tokens=4, stop_token_ids=[])
    with pytest.raises(ValueError, match="max_new_tokens"):
        target_generate(target, prompt_ids(), max_new_tokens=0, stop_token_ids=[])


# ----------------------------------------------------------------------------------------------------------
# Runner


@pytest.fixture
def chat_target(tiny_chat_tokenizer) -> LoadedTarget:
    """A random Qwen3 over the shared tiny chat tokenizer (vocab 256, EOS `<|im_end|>` = 2)."""
    model = qwen3_target(seed=5, vocab_size=len(tiny_chat_tokenizer))
    return cpu_target(model, tiny_chat_tokenizer, "tiny-qwen3")


@pytest.fixture
def prompt_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    lines = [{"id": f"p{i}", "prompt": " ".join(f"w{(7 * i + j) % 200}" for j in range(5 + i))} for i in range(3)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def chat_drafter(target: LoadedTarget, block_size: int = 4) -> DFlashDrafter:
    config = DrafterModelConfig.from_target(
        target.config, num_layers=1, block_size=block_size, mask_token_id=5, num_target_features=2
    )
    return seeded(lambda: DFlashDrafter(config), 0)


def test_evaluate_writes_report_table_and_histogram(chat_target, prompt_file, tmp_path):
    drafter = chat_drafter(chat_target)
    drafter.train()
    report = evaluate(
        chat_target,
        drafter,
        [str(prompt_file)],
        num_prompts=3,
        max_new_tokens=16,
        temperature=0.0,
        out_dir=tmp_path / "eval",
        progress=False,
    )
    assert drafter.training  # mode restored
    (data,) = report.datasets
    assert data.num_prompts == 3 and data.lossless_checked and data.exact_matches == 3 and not data.near_ties
    assert len(data.accepted_histogram) == 4
    steps = sum(data.accepted_histogram)
    assert steps == data.new_tokens - 3  # one decoding forward per token after each prompt's first, or fewer
    assert data.tau == pytest.approx((data.new_tokens - 3) / steps)
    per_prompt = [
        speculative_generate(
            chat_target.model,
            drafter,
            encode_prompt(chat_target.tokenizer, prompt, chat_target.device),
            max_new_tokens=16,
            stop_token_ids=[2],
        ).tau
        for prompt in load_prompt_set(str(prompt_file))
    ]
    assert data.tau_per_prompt == pytest.approx(sum(per_prompt) / 3)
    # Each prompt's record, in the set's order, adds up to the pooled numbers.
    prompt_ids = [prompt.id for prompt in load_prompt_set(str(prompt_file))][:3]
    assert [entry.id for entry in data.prompts] == prompt_ids
    assert [entry.tau for entry in data.prompts] == pytest.approx(per_prompt)
    assert sum(entry.steps for entry in data.prompts) == steps
    assert sum(entry.committed for entry in data.prompts) == data.new_tokens - 3
    saved = json.loads((tmp_path / "eval" / "eval.json").read_text())["datasets"][0]["prompts"]
    assert [entry["id"] for entry in saved] == prompt_ids
    assert "tau by category" not in report.format_table()  # a prompt file has no categories
    one_category = [dataclasses.replace(entry, category="writing") for entry in data.prompts]
    categorised = dataclasses.replace(report, datasets=[dataclasses.replace(data, prompts=one_category)])
    assert f"tau by category {data.name}: writing {data.tau:.2f}" in categorised.format_table()
    assert data.batch_rows == 3 and report.complete
    assert data.baseline_tokens_per_s > 0 and data.speculative_tokens_per_s > 0
    assert data.speedup == pytest.approx(data.speculative_tokens_per_s / data.baseline_tokens_per_s)

    # Timed at batch 3 (the outputs above) and at batch 1, one request at a time; tau is the same computation.
    assert [speed.batch_rows for speed in data.throughput] == [3, 1]
    assert all(speed.speculative_tokens_per_s > 0 and not speed.cuda_graphs for speed in data.throughput)
    assert data.throughput[1].speedup == pytest.approx(
        data.throughput[1].speculative_tokens_per_s / data.throughput[1].baseline_tokens_per_s
    )

    saved = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert saved["datasets"][0]["accepted_histogram"] == data.accepted_histogram
    assert saved["drafter_digest"].startswith("sha256:")
    assert saved["block_size"] == 4 and saved["target"] == "tiny-qwen3"
    assert (tmp_path / "eval" / "accepted_lengths.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = report.format_table()
    assert str(prompt_file) in table and "3/3 identical" in table  # the whole name, however long
    assert len([line for line in table.splitlines() if line.startswith(str(prompt_file))]) == 2  # batch 3, batch 1


def test_evaluate_times_one_batch_size_when_asked(chat_target, prompt_file):
    report = evaluate(
        chat_target,
        chat_drafter(chat_target),
        [str(prompt_file)],
        num_prompts=3,
        max_new_tokens=8,
        progress=False,
        batch_size=1,
    )
    (data,) = report.datasets
    assert [speed.batch_rows for speed in data.throughput] == [1] and data.batch_rows == 1
    assert data.exact_matches == 3  # outputs of the batch-1 runs, checked against plain decoding


def test_evaluate_fails_loudly_when_the_verifier_diverges(chat_target, prompt_file, monkeypatch):
    real = SpeculativeDecoder.run

    def flip_fourth_token(self) -> BatchRun:
        run = real(self)
        for result in run.results:
            result.output_ids[3] = (result.output_ids[3] + 1) % 256
        return run

    monkeypatch.setattr(SpeculativeDecoder, "run", flip_fourth_token)
    with pytest.raises(LosslessError, match=r"prompt p0: .* at new token 3") as caught:
        evaluate(
            chat_target, chat_drafter(chat_target), [str(prompt_file)], num_prompts=1, max_new_tokens=8, progress=False
        )
    assert caught.value.position == 3
    assert caught.value.speculative_token == (caught.value.target_token + 1) % 256


def _flipped_output(target: LoadedTarget) -> tuple[Tensor, list[int], list[int]]:
    ids = encode_prompt(target.tokenizer, Prompt("p", [{"role": "user", "content": "w1 w2"}]), target.device)
    greedy = target_generate(target.model, ids, max_new_tokens=6, stop_token_ids=[]).output_ids
    flipped = [*greedy[:2], (greedy[2] + 1) % 256, *greedy[3:]]
    return ids, greedy, flipped


def test_near_tie_divergence_is_reported_only_in_reduced_precision(chat_target):
    ids, greedy, flipped = _flipped_output(chat_target)
    common = dict(prompt_id="p", input_ids=ids, target_ids=greedy, speculative_ids=flipped)
    with pytest.raises(LosslessError, match="float32"):
        verify_lossless(target_model=chat_target.model, near_tie_ulps=1e9, **common)
    assert (
        verify_lossless(
            target_model=chat_target.model, input_ids=ids, prompt_id="p", target_ids=greedy, speculative_ids=greedy
        )
        is None
    )
    # bf16 recurrent states (a hybrid's) round the outputs as a bf16 model does: its tolerance; float32 ones do not.
    near_tie = verify_lossless(target_model=chat_target.model, near_tie_ulps=1e9, state_dtype=torch.bfloat16, **common)
    assert isinstance(near_tie, NearTieDivergence) and near_tie.position == 2
    with pytest.raises(LosslessError, match="float32"):
        verify_lossless(target_model=chat_target.model, near_tie_ulps=1e9, state_dtype=torch.float32, **common)

    bf16 = chat_target.model.to(torch.bfloat16)
    near_tie = verify_lossless(target_model=bf16, near_tie_ulps=1e9, **common)
    assert isinstance(near_tie, NearTieDivergence) and near_tie.position == 2
    assert near_tie.logit_gap > 0  # the flipped token is not the top one
    with pytest.raises(LosslessError, match="bfloat16"):
        verify_lossless(target_model=bf16, near_tie_ulps=0.0, **common)


def test_quick_tau_matches_the_decoding_loop(chat_target, prompt_file):
    drafter = chat_drafter(chat_target, block_size=3)
    prompts = load_prompt_set(str(prompt_file))
    quick = quick_tau(chat_target, drafter, prompts=prompts, max_new_tokens=10)
    assert quick.per_set == {}
    tau = quick.pooled
    results = [
        speculative_generate(
            chat_target.model,
            drafter,
            encode_prompt(chat_target.tokenizer, p, chat_target.device),
            max_new_tokens=10,
            stop_token_ids=[2],
        )
        for p in prompts
    ]
    lengths = [length for r in results for length in r.accepted_lengths]
    assert tau == pytest.approx(sum(lengths) / len(lengths))
    by_name = quick_tau(chat_target, drafter, datasets=[str(prompt_file)], num_prompts=3, max_new_tokens=10)
    assert by_name.pooled == tau and by_name.per_set == {prompt_file.stem: tau}
    # `NAME:SPLIT`, as `eval.datasets` may name a set (the periodic evaluation read `gsm8k:test` as a name).
    with_split = quick_tau(chat_target, drafter, datasets=[f"{prompt_file}:test"], num_prompts=3, max_new_tokens=10)
    assert with_split.pooled == tau


def test_quick_tau_per_set_is_each_sets_own_steps_pooled(chat_target, prompt_file, tmp_path, monkeypatch):
    """Two sets decoded in one batch (the first `num_prompts` of each): each set's tau pools its own prompts' steps,
    `pooled` every step. The decoder's accepted lengths are set by hand, so every number differs."""
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"id": f"o{i}", "prompt": f"w{i + 1} w2 w{i}"}) + "\n" for i in range(3)))
    lengths = [[1, 2], [3], [4, 4], [2]]  # prompts p0, p1 of the first set, o0, o1 of the second
    decoded = []

    def fixed_run(self):
        decoded.append(len(self.prompts))
        results = [GenerationResult(output_ids=[0] * (1 + sum(steps)), accepted_lengths=steps) for steps in lengths]
        return BatchRun(results=results, prefill_s=0.0, decode_s=1.0, rows=len(results))

    monkeypatch.setattr(SpeculativeDecoder, "run", fixed_run)
    drafter = chat_drafter(chat_target, block_size=3)
    tau = quick_tau(chat_target, drafter, datasets=[str(prompt_file), f"{other}:test"], num_prompts=2, max_new_tokens=8)
    assert decoded == [4]
    assert tau.per_set == {"prompts": pytest.approx(6 / 3), "other": pytest.approx(10 / 3)}
    assert tau.pooled == pytest.approx(16 / 6)


def test_set_metric_keys():
    assert set_metric_key("gsm8k") == set_metric_key("gsm8k:test") == "gsm8k"
    assert set_metric_key("gsm8k:train") == "gsm8k_train"
    assert set_metric_key("/data/My Prompts.jsonl") == "my_prompts"
    assert set_metric_key("mix-general:train") == "mix_general_train"
    assert set_metric_key("gsm8k", taken=["gsm8k", "gsm8k_2"]) == "gsm8k_3"


def test_quick_tau_runs_compiled_training_layers_eagerly(chat_target, prompt_file):
    """The trainer compiles the drafter layers for training shapes; the periodic evaluation must not trace them
    again (on an H200 that was 8 recompiles, dynamo's limit, and a minute per evaluation)."""
    drafter = chat_drafter(chat_target, block_size=3)
    prompts = load_prompt_set(str(prompt_file))
    eager_tau = quick_tau(chat_target, drafter, prompts=prompts, max_new_tokens=10).pooled
    for layer in drafter.layers:
        layer.compile(backend="eager", dynamic=True)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    assert quick_tau(chat_target, drafter, prompts=prompts, max_new_tokens=10).pooled == eager_tau
    assert torch._dynamo.utils.counters["frames"]["total"] == 0
    # The stance is restored: the compiled layers trace again outside the evaluation.
    x = torch.zeros(1, 3, drafter.config.hidden_size)
    with contextlib.suppress(Exception):  # the call's arguments are incomplete; only the tracing attempt matters
        drafter.layers[0](x, x, None, None, None, "sdpa", None)
    assert torch._dynamo.utils.counters["frames"]["total"] > 0
    torch._dynamo.reset()


def test_finished_datasets_survive_a_later_failure(chat_target, tmp_path, monkeypatch):
    paths = [tmp_path / "first.jsonl", tmp_path / "second.jsonl"]
    for path in paths:
        path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"w{i} w3"}) + "\n" for i in range(2)))
    runs = []
    real_run = SpeculativeDecoder.run

    def fail_on_second_dataset(self):
        runs.append(self)
        if len(runs) == 3:  # the warm-up, the first dataset, then the second one
            raise RuntimeError("device lost")
        return real_run(self)

    monkeypatch.setattr(SpeculativeDecoder, "run", fail_on_second_dataset)
    with pytest.raises(RuntimeError, match="device lost"):
        evaluate(
            chat_target,
            chat_drafter(chat_target),
            [str(path) for path in paths],
            num_prompts=2,
            max_new_tokens=6,
            out_dir=tmp_path / "eval",
            progress=False,
            batch_size=2,  # one speculative run per dataset (the default also times batch 1)
        )
    report = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert report["complete"] is False and [data["name"] for data in report["datasets"]] == [str(paths[0])]
    assert report["datasets"][0]["exact_matches"] == 2


def test_tau_by_category_pools_each_categorys_steps():
    from dflash_trainer.eval.runner import PromptTau, tau_by_category

    prompts = [
        PromptTau(id="mtbench-81", category="writing", tau=2.0, committed=20, steps=10),
        PromptTau(id="mtbench-82", category="writing", tau=4.0, committed=8, steps=2),
        PromptTau(id="mtbench-91", category="roleplay", tau=1.5, committed=15, steps=10),
    ]
    assert tau_by_category(prompts) == {"writing": pytest.approx(28 / 12), "roleplay": pytest.approx(1.5)}
    assert tau_by_category([PromptTau(id="p", category=None, tau=1.0, committed=4, steps=4)]) == {}
