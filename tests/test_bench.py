"""`dflash-trainer bench` end to end on the CPU, on a tiny random target standing in for the recipe's shape."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dflash_trainer import bench

REPO = Path(__file__).resolve().parents[1]

ROOT = Path(__file__).resolve().parent.parent
TINY_LLAMA = dict(
    model_type="llama",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    tie_word_embeddings=True,
)


def tiny_documents(rng: np.random.Generator) -> list[tuple[int, int]]:
    return [(int(rng.integers(48, 96)), 16) for _ in range(6)]


@pytest.mark.slow
def test_bench_times_every_phase_and_each_ablations_drafter_step(tmp_path, monkeypatch):
    """Phases in order: the drafter-only and end-to-end baselines, then per ablation its drafter-only step (with
    --drafter-only-ablations) and its end-to-end step; the JSON holds them all, each with its timed steps."""
    monkeypatch.setattr(bench, "setting_for", lambda config, documents: bench.Setting(TINY_LLAMA, tiny_documents))
    out = tmp_path / "bench.json"
    results = bench.run_bench(
        recipe=ROOT / "recipes/bench-smollm2.yaml",
        overrides=[
            "drafter.num_layers=2",
            "drafter.num_target_features=2",
            "data.token_budget=512",
            "data.max_seq_len=256",
            "data.max_anchors=4",
            "loss.chunk_blocks=8",
        ],
        steps=2,
        warmup=1,
        out=out,
        ablations=["small_chunks:loss.chunk_blocks=2", "target_eager:target.compile=false"],
        drafter_only_ablations=True,
        require_cuda=False,
    )
    # A target-only ablation leaves the drafter-only step unchanged: only its end-to-end phase runs.
    names = [
        "drafter_only",
        "end_to_end",
        "drafter_only[small_chunks]",
        "end_to_end[small_chunks]",
        "end_to_end[target_eager]",
    ]
    assert [r.name for r in results] == names
    saved = json.loads(out.read_text())
    assert [r["name"] for r in saved] == names
    assert all(len(r["step_ms"]) == 2 and r["step_ms_median"] > 0 for r in saved)
    # No nvidia-smi on the CPU: no clock; the compile breakdown is a dict of seconds (empty when nothing compiled).
    assert all(r["sm_clock_mhz"] is None and r["power_w"] is None for r in saved)
    assert all(all(s >= 0 for s in r["first_step_compile_stages"].values()) for r in saved)
    assert all(r["data_tokens_per_step"] > 0 for r in saved)
    assert all(len(r["step_tokens"]) == 2 and min(r["step_tokens"]) > 0 for r in saved)


def test_the_recipe_target_picks_the_shape_and_documents_and_documents_override_them():
    from dflash_trainer.config import load_config

    config = load_config(REPO / "recipes/bench-qwen3.6-27b.yaml", [])
    setting = bench.setting_for(config)
    assert setting.architecture is bench.QWEN36_27B and setting.documents is bench.long_reply_documents
    docs = setting.documents(np.random.default_rng(0))
    assert all(4096 <= length <= 8192 and 64 <= prompt <= 512 for length, prompt in docs)
    assert bench.setting_for(config, "smollm2").documents is bench.smollm2_documents
    paper = load_config(REPO / "recipes/bench-qwen3-8b.yaml", [])
    assert bench.setting_for(paper).architecture is bench.QWEN3_8B


def test_compiled_frames_since_lists_each_frame_and_its_second_graph():
    """The first step's compile frame by frame: a frame compiled again for a new shape is a second row, `0/1`."""
    import time

    import torch

    def step(x):
        return x.sin() + 1

    torch._dynamo.reset()
    mark = time.time_ns() // 1000
    compiled = torch.compile(step, backend="eager", dynamic=False)
    compiled(torch.randn(3))
    compiled(torch.randn(4))  # static sizes: the new size compiles the frame's second graph
    frames = bench.compiled_frames_since(mark)
    torch._dynamo.reset()
    assert [frame["compile_id"] for frame in frames] == ["0/0", "0/1"]
    assert frames[0]["frame"].startswith("step (test_bench.py:") and all(f["seconds"] >= 0 for f in frames)
    assert bench.compiled_frames_since(time.time_ns() // 1000) == []
    assert "[0/1]" in bench.describe_frames(frames) and bench.describe_frames([]) == "none"


def test_a_failing_setting_is_recorded_the_next_still_runs_and_the_bench_fails(tmp_path, monkeypatch):
    """An error in one ablation (not out-of-memory, which is a result) is printed and recorded in the JSON, the
    settings after it still run, and the bench raises at the end naming it."""
    monkeypatch.setattr(bench, "setting_for", lambda config, documents: bench.Setting(TINY_LLAMA, tiny_documents))
    timed = bench.time_steps

    def time_steps(trainer, work, **kwargs):
        if kwargs["name"] == "end_to_end[broken]":
            raise ValueError("a kernel that cannot run here")
        return timed(trainer, work, **kwargs)

    monkeypatch.setattr(bench, "time_steps", time_steps)
    out = tmp_path / "bench.json"
    small = ["drafter.num_layers=1", "drafter.num_target_features=1", "data.token_budget=256", "data.max_seq_len=128"]
    with pytest.raises(RuntimeError, match=r"1 phase\(s\) failed .*end_to_end\[broken\]: ValueError: a kernel"):
        bench.run_bench(
            recipe=ROOT / "recipes/bench-smollm2.yaml",
            overrides=[*small, "data.max_anchors=2", "loss.chunk_blocks=8"],
            steps=1,
            warmup=0,
            out=out,
            ablations=["broken:loss.chunk_blocks=4", "after:loss.chunk_blocks=2"],
            require_cuda=False,
        )
    saved = {r["name"]: r for r in json.loads(out.read_text())}
    assert list(saved) == ["drafter_only", "end_to_end", "end_to_end[broken]", "end_to_end[after]"]
    assert "ValueError: a kernel that cannot run here" in saved["end_to_end[broken]"]["error"]
    assert saved["end_to_end[after]"]["step_ms_median"] > 0


def test_each_phase_starts_with_the_previous_phases_trainer_and_compiled_layers_freed(tmp_path, monkeypatch):
    """The drafter's compiled layers are reference cycles (the compiled wrapper stored on the module refers back to
    it): without a full collection between phases, the last phase's layers and their weights stay allocated through
    the next. Automatic collection is off here, so only the bench's own collection can free them."""
    import gc
    import weakref

    monkeypatch.setattr(bench, "setting_for", lambda config, documents: bench.Setting(TINY_LLAMA, tiny_documents))
    drafter_weights: list[list[weakref.ref]] = []  # per trainer, in order of construction

    class CompiledLayersTrainer(bench.Trainer):
        def _setup_drafter(self) -> None:
            super()._setup_drafter()
            self.drafter.compile_layers(backend="eager")  # on CUDA the trainer compiles them; on the CPU, not
            drafter_weights.append([weakref.ref(p) for p in self.drafter.parameters()])

    alive_on_entry: dict[str, list[int]] = {}
    timed = bench.time_steps

    def time_steps(trainer, works, **kwargs):
        earlier = drafter_weights[:-1]
        alive_on_entry[kwargs["name"]] = [sum(ref() is not None for ref in refs) for refs in earlier]
        return timed(trainer, works, **kwargs)

    monkeypatch.setattr(bench, "Trainer", CompiledLayersTrainer)
    monkeypatch.setattr(bench, "time_steps", time_steps)
    small = ["drafter.num_layers=1", "drafter.num_target_features=1", "data.token_budget=256", "data.max_seq_len=128"]
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        bench.run_bench(
            recipe=ROOT / "recipes/bench-smollm2.yaml",
            overrides=[*small, "data.max_anchors=2", "loss.chunk_blocks=8"],
            steps=1,
            warmup=0,
            ablations=["chunks:loss.chunk_blocks=4"],
            require_cuda=False,
        )
    finally:
        if was_enabled:
            gc.enable()
    assert len(drafter_weights) == 3
    assert alive_on_entry == {"drafter_only": [], "end_to_end": [0], "end_to_end[chunks]": [0, 0]}


def test_the_data_tokens_per_step_are_the_epochs_tokens_over_its_steps():
    """Ten documents of 100 tokens, two per 250-token row, one row per step: five steps of 200 tokens each."""
    from types import SimpleNamespace

    from dflash_trainer.data.sampler import TokenBudgetSampler

    sampler = TokenBudgetSampler([100] * 10, token_budget=250, max_seq_len=250, max_batch_size=8, packing=True, seed=0)
    assert len(sampler) == 5
    assert bench.data_tokens_per_step(SimpleNamespace(sampler=sampler)) == 200.0
    # One document per step: each step holds its document only.
    lone = TokenBudgetSampler([100, 300], token_budget=300, max_seq_len=300, max_batch_size=8, packing=True, seed=0)
    assert bench.data_tokens_per_step(SimpleNamespace(sampler=lone)) == 200.0


def test_the_rate_at_the_data_mean_comes_from_a_line_through_the_timed_steps():
    """Steps of 0.8 s fixed + 80 us per token, timed on short steps, give the rate of a step of the data's mean."""
    tokens = [4200, 5100, 4700, 6900, 4400]
    seconds = [0.8 + 80e-6 * n for n in tokens]
    expected = 6248 / (0.8 + 80e-6 * 6248)
    assert bench.rate_at_data_mean(tokens, seconds, 6248.0) == pytest.approx(expected, rel=1e-9)
    # The raw rate of those steps is lower: the fixed part weighs more on short steps.
    assert sum(tokens) / sum(seconds) < 0.95 * expected
    # No line from steps all of one size (a replayed batch), from too few steps, or with a negative part.
    assert bench.rate_at_data_mean([5000] * 5, [1.2] * 5, 6248.0) is None
    assert bench.rate_at_data_mean(tokens[:3], seconds[:3], 6248.0) is None
    assert bench.rate_at_data_mean(tokens, [2.0 - 1e-4 * n for n in tokens], 6248.0) is None
    assert bench.rate_at_data_mean(tokens, seconds, None) is None
    # Steps that compiled (a kernel autotuned for a new length) are left out of the line; the steady steps still fit.
    hit = [*seconds[:2], 7.3, *seconds[2:], 10.1]
    compiling = [False, False, True, False, False, False, True]
    assert bench.rate_at_data_mean([*tokens[:2], 6400, *tokens[2:], 6800], hit, 6248.0, compiling) == pytest.approx(
        expected, rel=1e-9
    )
    assert (
        bench.rate_at_data_mean([*tokens[:3], 6400], [*seconds[:3], 7.3], 6248.0, [False, False, False, True]) is None
    )
