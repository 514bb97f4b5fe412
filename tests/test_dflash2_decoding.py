"""DFlash2 in the decoding engine and the evaluation runner: lossless against plain greedy decoding (float32),
drafts from the selector's walk, tau pooled and per prompt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from decoding_helpers import cpu_target, one_thread, seeded, tiny_qwen3_target  # noqa: F401 (one_thread: autouse fixture)
from dflash_trainer.data.prompts import load_prompt_set
from dflash_trainer.decoding.plain import target_generate
from dflash_trainer.decoding.speculative import SpeculativeDecoder
from dflash_trainer.eval.runner import encode_prompt, evaluate, verify_lossless
from dflash_trainer.model.config import DrafterModelConfig
from dflash_trainer.model.dflash2 import CandidateSelector, DFlash2Drafter, DFlash2ModelConfig
from dflash_trainer.targets.loader import LoadedTarget

VOCAB = 64


def dflash2_drafter(target, *, block_size: int, mask_token_id: int = VOCAB - 1, seed: int = 0) -> DFlash2Drafter:
    base = DrafterModelConfig.from_target(
        target.config, num_layers=2, block_size=block_size, mask_token_id=mask_token_id, num_target_features=3
    )
    config = DFlash2ModelConfig.extend(base, conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=8)

    def build() -> DFlash2Drafter:
        drafter = DFlash2Drafter(config).eval()
        with torch.no_grad():  # away from the identity convolutions and the no-op selector
            for name, parameter in drafter.named_parameters():
                if "conv" in name or "candidate_selector" in name:
                    parameter.add_(0.5 * torch.randn_like(parameter))
        return drafter

    return seeded(build, seed)


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB - 1, (int(8 + 3 * i),), generator=gen).tolist() for i in range(count)]


@pytest.mark.parametrize("block_size", [4, 8])
def test_dflash2_speculative_decoding_equals_greedy_and_drafts_from_the_walk(block_size, monkeypatch):
    target = tiny_qwen3_target(0, VOCAB)
    drafter = dflash2_drafter(target, block_size=block_size)
    walks, departures = [], []
    real_walk = CandidateSelector.walk

    def recording_walk(self, hidden, logits, anchor_tokens):
        drafts = real_walk(self, hidden, logits, anchor_tokens)
        walks.append(drafts)
        departures.append(not torch.equal(drafts, logits.argmax(dim=-1)))
        return drafts

    monkeypatch.setattr(CandidateSelector, "walk", recording_walk)
    batch = prompts(3)
    run = SpeculativeDecoder(target, drafter, batch, max_new_tokens=40, stop_token_ids=[]).run()
    for prompt, result in zip(batch, run.results, strict=True):
        reference = target_generate(target, torch.tensor([prompt]), max_new_tokens=40, stop_token_ids=[])
        assert result.output_ids == reference.output_ids
        assert sum(result.accepted_lengths) == len(result.output_ids) - 1
        assert all(1 <= n <= block_size for n in result.accepted_lengths)
    assert walks and all(w.shape == (3, block_size - 1) for w in walks)  # every proposal is the selector's walk
    assert any(departures)  # and it is not the per-slot argmax


@pytest.fixture
def chat_target(tiny_chat_tokenizer) -> LoadedTarget:
    model = tiny_qwen3_target(seed=5, vocab=len(tiny_chat_tokenizer))
    return cpu_target(model, tiny_chat_tokenizer, "tiny-qwen3")


def test_evaluate_reports_dflash2_tau_pooled_and_per_prompt(chat_target, tmp_path: Path):
    path = tmp_path / "prompts.jsonl"
    lines = [{"id": f"p{i}", "prompt": " ".join(f"w{(7 * i + j) % 200}" for j in range(5 + i))} for i in range(3)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    drafter = dflash2_drafter(chat_target.model, block_size=4, mask_token_id=5)
    report = evaluate(
        chat_target, drafter, [str(path)], num_prompts=3, max_new_tokens=16, out_dir=tmp_path / "eval", progress=False
    )
    (data,) = report.datasets
    assert data.lossless_checked and data.exact_matches == 3
    steps = sum(data.accepted_histogram)
    assert data.tau == pytest.approx((data.new_tokens - 3) / steps)
    per_prompt = []
    for prompt in load_prompt_set(str(path)):
        ids = encode_prompt(chat_target.tokenizer, prompt, chat_target.device)[0].tolist()
        run = SpeculativeDecoder(chat_target.model, drafter, [ids], max_new_tokens=16, stop_token_ids=[2]).run()
        (result,) = run.results
        per_prompt.append(result.tau)
    assert data.tau_per_prompt == pytest.approx(sum(per_prompt) / 3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_dflash2_in_captured_cuda_graphs_is_lossless(dtype, compiled):
    """The walk runs inside the captured decoding step: float32 must equal greedy decoding exactly; bf16 may differ
    only at a near-tie (`verify_lossless`, DESIGN "Lossless check precision"). Also with the drafter's pieces
    compiled by Inductor (`compile_for_decoding`), whose kernels the captured graphs then replay."""
    device = torch.device("cuda")
    target = tiny_qwen3_target(0, VOCAB).to(device=device, dtype=dtype)
    drafter = dflash2_drafter(target, block_size=8).to(device=device, dtype=dtype)
    if compiled:
        drafter.compile_for_decoding()
    batch = prompts(4)
    run = SpeculativeDecoder(target, drafter, batch, max_new_tokens=64, stop_token_ids=[]).run()
    assert run.graphs_captured > 0
    for prompt, result in zip(batch, run.results, strict=True):
        ids = torch.tensor([prompt], device=device)
        reference = target_generate(target, ids, max_new_tokens=64, stop_token_ids=[]).output_ids
        # None when identical; in bf16 a NearTieDivergence is allowed, anything else raises LosslessError.
        verify_lossless(
            target_model=target, input_ids=ids, prompt_id="p", target_ids=reference, speculative_ids=result.output_ids
        )
        if dtype == torch.float32:
            assert result.output_ids == reference


def test_argmax_drafts_decode_losslessly_without_the_walk_and_restore_it(chat_target, tmp_path: Path, monkeypatch):
    """`argmax_drafts`: the drafts are each slot's argmax (the selector is never called), decoding stays lossless,
    the report says so, and the walk drafts again afterwards (also after an error inside)."""
    drafter = dflash2_drafter(chat_target.model, block_size=4, mask_token_id=5)
    walks = []
    real_walk = CandidateSelector.walk

    def recording_walk(self, hidden, logits, anchor_tokens):
        walks.append(1)
        return real_walk(self, hidden, logits, anchor_tokens)

    monkeypatch.setattr(CandidateSelector, "walk", recording_walk)
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"w{i} w{i + 3} w{i + 7}"}) + "\n" for i in range(2)))
    with drafter.argmax_drafts():
        report = evaluate(
            chat_target, drafter, [str(path)], num_prompts=2, max_new_tokens=12, out_dir=tmp_path / "e", progress=False
        )
    assert not walks
    assert report.argmax_drafts and "argmax drafts" in report.format_table()
    (data,) = report.datasets
    assert data.lossless_checked and data.exact_matches == 2
    with pytest.raises(RuntimeError), drafter.argmax_drafts():
        raise RuntimeError("inside")
    hidden, logits = torch.randn(2, 3, drafter.config.hidden_size), torch.randn(2, 3, drafter.config.vocab_size)
    assert drafter.walk_drafts
    drafter.draft_tokens(hidden, logits, torch.tensor([1, 2]))
    assert walks
    with drafter.argmax_drafts():
        assert torch.equal(drafter.draft_tokens(hidden, logits, torch.tensor([1, 2])), logits.argmax(dim=-1))
