"""End-to-end training on CPU: the loss falls, and an interrupted run resumes to the same result."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash_trainer.config import load_config
from dflash_trainer.train import checkpoint as ckpt
from dflash_trainer.train.trainer import Trainer
from train_helpers import read_metrics, save_tiny_target, write_counting_shards, write_recipe

SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_counting_shards(tmp_path_factory.mktemp("data") / "shards")


@pytest.mark.parametrize("hybrid", [False, True], ids=["qwen3", "qwen3_5-hybrid"])
def test_loss_falls(tmp_path, shards, hybrid):
    target = save_tiny_target(tmp_path / "target", hybrid=hybrid)
    recipe = write_recipe(tmp_path / "r.yaml", tmp_path / "run", target, shards, train={"max_steps": 30})
    summary = Trainer(load_config(recipe), log=lambda _: None).fit()
    assert summary.steps == 30
    losses = [r["loss"] for r in read_metrics(tmp_path / "run")]
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    # The cycling pattern is learnable from the anchor token: require the loss to halve and slot 1 to be learnt.
    assert last < 0.5 * first, (first, last)
    records = read_metrics(tmp_path / "run")
    assert records[-1]["acc_per_slot"][0] > 0.8
    # Every step keeps blocks, each at a distinct position of the step's 256-token budget.
    assert all(0 < r["blocks_per_step"] <= 256 for r in records), [r["blocks_per_step"] for r in records]
    assert (summary.last_checkpoint / "drafter.safetensors").is_file()


def test_target_argmax_labels_in_the_trainer_are_the_targets_greedy_tokens(tmp_path, shards, monkeypatch):
    """With `loss.label_source=target_argmax` the trainer labels slot k of anchor a with the target's argmax after
    position a+k-1, computed once per position: checked against the per-slot definition at every step."""
    from dflash_trainer.model.anchors import gather_block_states
    from dflash_trainer.targets.capture import TargetOutputs
    from dflash_trainer.train import trainer as trainer_module

    real_next_tokens, real_slot_tokens = TargetOutputs.with_next_tokens, trainer_module.block_slot_tokens
    seen, checked = [], []

    def recording(outputs, lm_head, **options):  # what the labels come from: the final states and the head
        seen.append((outputs.final_hidden, lm_head))
        return real_next_tokens(outputs, lm_head, **options)

    def checking(next_tokens, anchors, *, block_size):
        labels = real_slot_tokens(next_tokens, anchors, block_size=block_size)
        final_hidden, head = seen[-1]
        weight, bias = head.weight, getattr(head, "bias", None)
        states = gather_block_states(states=final_hidden, anchors=anchors, block_size=block_size).to(weight.dtype)
        logits = states @ weight.T + (0 if bias is None else bias)
        checked.append(torch.equal(labels, logits.argmax(dim=-1)))
        return labels

    monkeypatch.setattr(TargetOutputs, "with_next_tokens", recording)
    monkeypatch.setattr(trainer_module, "block_slot_tokens", checking)
    target = save_tiny_target(tmp_path / "target")
    recipe = write_recipe(
        tmp_path / "r.yaml",
        tmp_path / "run",
        target,
        shards,
        train={"max_steps": 3},
        loss={"label_source": "target_argmax"},
    )
    summary = Trainer(load_config(recipe), log=lambda _: None).fit()
    assert summary.steps == 3
    assert checked and all(checked), checked
    assert all(math.isfinite(r["loss"]) for r in read_metrics(tmp_path / "run"))


def test_soft_labels_per_position_train_as_per_slot(tmp_path, shards, monkeypatch):
    """With soft labels and overlapping blocks the trainer computes the target's logits once per position; three steps
    give the losses of the per-slot path (the same products, gathered), and the per-position path was taken."""
    from dflash_trainer.train import trainer as trainer_module

    target = save_tiny_target(tmp_path / "target")
    real = trainer_module.Trainer._soft_label_logits
    taken = []

    def spying(self, *args):
        result = real(self, *args)
        taken.append(result is not None)
        return result

    losses = []
    for per_position in (True, False):
        run = tmp_path / f"run-{per_position}"
        monkeypatch.setattr(trainer_module.Trainer, "_soft_label_logits", spying if per_position else lambda *a: None)
        recipe = write_recipe(
            tmp_path / f"{per_position}.yaml",
            run,
            target,
            shards,
            train={"max_steps": 3},
            loss={"label_source": "soft"},
            metrics={"log_every": 1},
        )
        Trainer(load_config(recipe), log=lambda _: None).fit()
        losses.append([r["loss"] for r in read_metrics(run)])
    assert any(taken), taken  # chosen per batch: when it has fewer positions than block slots
    assert len(losses[0]) == 3 and all(math.isfinite(x) for x in losses[0])
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


def run_cli(recipe: Path, *extra: str, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(SRC), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(extra_env or {})}
    return subprocess.Popen(
        [sys.executable, "-m", "dflash_trainer", "train", str(recipe), *extra],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_sigterm_then_resume_reproduces_the_uninterrupted_run(tmp_path, shards):
    target = save_tiny_target(tmp_path / "target")
    steps = {"max_steps": 20}
    straight = write_recipe(tmp_path / "a.yaml", tmp_path / "straight", target, shards, train=steps)
    resumed = write_recipe(tmp_path / "b.yaml", tmp_path / "resumed", target, shards, train=steps)

    proc = run_cli(straight)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out

    # Steps of ~10 ms would finish the run between a poll and the signal on a loaded machine: each step of the
    # interrupted run sleeps 0.2 s (distributed/failure.py's test hook), leaving the signal 2 s to land before step 20.
    proc = run_cli(resumed, extra_env={"DFLASH_TEST_SLOW_RANK": "0:0.2"})
    metrics = tmp_path / "resumed" / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 10:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    interrupted_at = ckpt.latest_checkpoint(tmp_path / "resumed")
    stopped_step = int(interrupted_at.name.split("-")[1])
    assert 10 <= stopped_step < 20, out

    proc = run_cli(resumed)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert f"resumed from {interrupted_at}" in out

    final_a = load_file(str(ckpt.latest_checkpoint(tmp_path / "straight") / "drafter.safetensors"))
    final_b = load_file(str(ckpt.latest_checkpoint(tmp_path / "resumed") / "drafter.safetensors"))
    assert final_a.keys() == final_b.keys()
    for name in final_a:
        torch.testing.assert_close(final_b[name], final_a[name], rtol=0, atol=1e-6)
    curve_a = [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "straight")]
    curve_b = [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "resumed")]
    assert [s for s, _ in curve_b] == list(range(1, 21))
    for (step_a, loss_a), (step_b, loss_b) in zip(curve_a, curve_b, strict=True):
        assert step_a == step_b and abs(loss_a - loss_b) < 1e-6


def test_the_data_stage_builds_flex_tables_of_the_configured_tile(tmp_path):
    """`drafter.flex_tile` reaches the tables the data stage computes (and the BlockMasks built from them), and
    `drafter.flex_kernel_options` every drafter layer; a tile flex has no kernels for, or a kernel option that is
    unknown, not speed-only or of the wrong type, is refused when the recipe loads."""
    from dflash_trainer.config import ConfigError
    from dflash_trainer.model.attention import build_masks

    target = save_tiny_target(tmp_path / "target")
    shards = write_counting_shards(tmp_path / "shards", num_samples=48)
    recipe = write_recipe(tmp_path / "r.yaml", tmp_path / "run", target, shards, train={"max_steps": 2})
    with pytest.raises(ConfigError, match=r"drafter\.flex_tile: must be 64 or 128"):
        load_config(recipe, ["drafter.flex_tile=48"])
    with pytest.raises(ConfigError, match="max-autotune-no-cudagraphs"):
        load_config(recipe, ["drafter.flex_tile=64"])
    with pytest.raises(ConfigError, match=r"drafter\.block_size: must be <= drafter\.flex_tile"):
        load_config(recipe, ["drafter.block_size=130"])
    with pytest.raises(
        ConfigError,
        match=r"drafter\.flex_kernel_options\.bwd_BLOCK_N1: must be a power of two from 16 to the flex tile",
    ):
        load_config(recipe, ["drafter.flex_kernel_options.bwd_BLOCK_N1=96"])
    with pytest.raises(ConfigError, match=r"drafter\.flex_kernel_options\.PRESCALE_QK: unknown or unsupported"):
        load_config(recipe, ["drafter.flex_kernel_options.PRESCALE_QK=true"])  # rounds differently: not offered
    with pytest.raises(ConfigError, match=r"drafter\.flex_kernel_options\.USE_TMA: must be true or false"):
        load_config(recipe, ["drafter.flex_kernel_options.USE_TMA=1"])
    # Needs a visible key in each row's first visited chunk, which the drafter's mask does not give (NaN rows).
    with pytest.raises(ConfigError, match=r"ROWS_GUARANTEED_SAFE: unknown or unsupported"):
        load_config(recipe, ["drafter.flex_kernel_options.ROWS_GUARANTEED_SAFE=true"])
    with pytest.raises(ConfigError, match=r"fwd_bwd_num_warps: unknown or unsupported"):
        load_config(recipe, ["drafter.flex_kernel_options.fwd_bwd_num_warps=4"])
    with pytest.raises(ConfigError, match=r"BLOCK_N: must be a power of two from 16 to the flex tile \(64\)"):
        load_config(
            recipe,
            [
                "drafter.flex_tile=64",
                "drafter.compile_mode=max-autotune-no-cudagraphs",
                "drafter.flex_kernel_options.BLOCK_N=128",
            ],
        )
    tile64 = ["drafter.flex_tile=64", "drafter.compile_mode=max-autotune-no-cudagraphs"]
    options = ["drafter.flex_kernel_options.bwd_BLOCK_M1=32", "drafter.flex_kernel_options.bwd_WRITE_DQ=false"]
    trainer = Trainer(load_config(recipe, ["drafter.attention_backend=flex", *tile64, *options]), log=print)
    expected_options = {"bwd_BLOCK_M1": 32, "bwd_WRITE_DQ": False}
    assert all(layer.self_attn.flex_kernel_options == expected_options for layer in trainer.drafter.layers)
    plan = next(iter(trainer.sampler))
    batch = trainer.make_batch(plan)
    assert {tables.tile for tables in batch.mask_tables.values()} == {64}
    masks = build_masks(
        anchors=batch.anchors,
        anchor_keep=batch.anchor_keep,
        doc_ids=batch.doc_ids,
        block_size=trainer.model_config.block_size,
        variants=trainer.drafter.mask_variants,
        backend="flex",
        tables=batch.mask_tables,
    )
    assert {mask.BLOCK_SIZE for mask in masks.by_variant.values()} == {(64, 64)}


def test_compile_watch_counts_frames_and_new_ones_per_take():
    """CompileWatch reads dynamo's counters: a first call compiles (the warm-up), the same shape reuses the code, a
    static function called with a new shape compiles again (the recompile training must report)."""
    from dflash_trainer.train.metrics import CompileWatch

    watch = CompileWatch()  # counts from here: earlier tests' compilations are not this watch's
    assert watch.take() == (0, 0.0, 0)
    double = torch.compile(lambda x: 2 * x + 1, backend="aot_eager", dynamic=False)
    double(torch.ones(3))
    frames, seconds, new = watch.take()
    assert (frames, new) == (1, 1) and seconds > 0
    double(torch.ones(3))
    assert watch.take()[::2] == (1, 0)
    double(torch.ones(5))  # dynamic=False: a new shape is a new compilation
    assert watch.take()[::2] == (2, 1)


def test_triton_cache_entries_counts_the_kernel_cache(tmp_path, monkeypatch):
    from dflash_trainer.train.metrics import triton_cache_dir, triton_cache_entries

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    assert triton_cache_dir() == tmp_path
    assert triton_cache_entries(tmp_path / "absent") is None
    assert triton_cache_entries(tmp_path) == 0
    for name in ("AB12", "CD34"):  # Triton writes one directory per compiled kernel
        (tmp_path / name).mkdir()
    assert triton_cache_entries(tmp_path) == 2


def test_compile_stages_since_reports_the_seconds_each_stage_gained(monkeypatch):
    """The breakdown of a first step's compile: per named stage, the seconds dynamo's timers gained since the
    snapshot (scripted timers here: compiling for real costs tens of seconds on the CPU), autotuning timers by
    their own name, stages under the floor left out."""
    from torch._dynamo.utils import compilation_time_metrics

    from dflash_trainer.train.metrics import compile_stages_since, compile_times, describe_compile_stages

    monkeypatch.setitem(compilation_time_metrics, "compile_fx.<locals>.bw_compiler", [4.0])
    monkeypatch.setitem(compilation_time_metrics, "async_compile.wait", [1.0])
    before = compile_times()
    compilation_time_metrics["compile_fx.<locals>.bw_compiler"].append(12.5)
    compilation_time_metrics["async_compile.wait"].append(0.01)  # under the floor
    monkeypatch.setitem(compilation_time_metrics, "AlgorithmSelectorCache.autotune", [3.0])
    stages = compile_stages_since(before)
    assert stages == {"backward graphs": 12.5, "AlgorithmSelectorCache.autotune": 3.0}
    assert describe_compile_stages(stages) == "backward graphs 12.5s, AlgorithmSelectorCache.autotune 3.0s"
    assert describe_compile_stages({}) == "none"


def test_bench_phase_keeps_every_timed_step_and_what_compiled_in_it(tmp_path, shards, monkeypatch, capsys):
    """`time_steps` keeps each timed step's ms, the frames dynamo compiled in it and the kernels Triton added to its
    cache (scripted here: 4 in the second step), sums the frames into `recompiles_after_warmup`, and prints the
    steps when one of them compiled."""
    from dflash_trainer import bench

    target = save_tiny_target(tmp_path / "target")
    recipe = write_recipe(tmp_path / "r.yaml", tmp_path / "run", target, shards, train={"max_steps": 8})
    trainer = Trainer(load_config(recipe), log=print)
    trainer.start_log_window()
    readings = iter([10, 10, 10, 14])  # before and after each of the two timed steps
    monkeypatch.setattr(bench, "triton_cache_entries", lambda cache: next(readings))
    steps = bench.live_steps(trainer)
    phase = bench.time_steps(trainer, steps, warmup=1, steps=2, name="end_to_end")
    steps.close()
    assert len(phase.step_ms) == 2 and all(ms > 0 for ms in phase.step_ms)
    assert phase.step_triton_compiles == [0, 4]
    assert phase.recompiles_after_warmup == sum(phase.step_compiles) == 0  # eager on the CPU
    assert phase.step_ms_min == min(phase.step_ms) and phase.step_ms_max == max(phase.step_ms)
    bench.print_phase(phase)
    assert "(4 new Triton kernels)" in capsys.readouterr().out
    assert bench.describe_step(812.4, 2, 14) == "812 (2 frames compiled, 14 new Triton kernels)"
    assert bench.describe_step(700.0, 0, None) == "700"


def fit_four_logged_steps(tmp_path, shards, *, before_fit=None) -> list[str]:
    """Trains a tiny run 4 steps, logging every step; returns the trainer's log lines (`before_fit(trainer)` first)."""
    target = save_tiny_target(tmp_path / "target")
    recipe = write_recipe(
        tmp_path / "r.yaml", tmp_path / "run", target, shards, train={"max_steps": 4}, metrics={"log_every": 1}
    )
    lines: list[str] = []
    trainer = Trainer(load_config(recipe), log=lines.append)
    if before_fit is not None:
        before_fit(trainer)
    trainer.fit()
    return lines


def test_compilations_after_the_first_log_step_are_logged_and_noted(tmp_path, shards):
    """Training logs compiles / compile_s at every log step; frames compiled after the first log step (the
    warm-up) print a note naming the step, the count and the shape buckets. (CPU run: the counts are scripted; the
    real watch is tested above.)"""
    readings = iter([(3, 20.0, 3), (3, 20.0, 0), (5, 35.5, 2), (5, 35.5, 0)])

    def script_the_watch(trainer):
        trainer._compile_watch = type("ScriptedWatch", (), {"take": lambda self: next(readings)})()

    lines = fit_four_logged_steps(tmp_path, shards, before_fit=script_the_watch)
    logged = [(r["compiles"], r["compile_s"]) for r in read_metrics(tmp_path / "run") if "compiles" in r]
    assert logged == [(3, 20.0), (3, 20.0), (5, 35.5), (5, 35.5)]
    notes = [line for line in lines if "torch.compile compiled" in line]
    assert len(notes) == 1 and "2 more frame(s) in the steps up to 3" in notes[0] and "35.5 s in all" in notes[0]


def test_accuracies_outside_zero_to_one_are_warned_about_once(tmp_path, shards, monkeypatch):
    """A fraction metric outside [0, 1] means its device counters are wrong (a miscompiled reduction: DFlash2's selector
    accuracy read 25.3 on a GPU while its loss was right): the run still logs it as it reads, and warns once, naming
    the metric and the step. (CPU run: the per-slot accuracies are corrupted from the second log step on.)"""
    from dflash_trainer.model.loss import LossMetrics

    right = LossMetrics.slot_accuracy
    calls = iter(range(100))

    def corrupted(self):
        accuracy = right(self)
        return accuracy if next(calls) == 0 else accuracy + 25.0

    monkeypatch.setattr(LossMetrics, "slot_accuracy", corrupted)
    lines = fit_four_logged_steps(tmp_path, shards)
    logged = [r["acc"] for r in read_metrics(tmp_path / "run") if "acc" in r]
    assert len(logged) == 4 and 0 <= logged[0] <= 1 and all(acc > 25 for acc in logged[1:])
    warnings = [line for line in lines if "outside [0, 1]" in line]
    assert len(warnings) == 1 and "at step 2 (acc 25." in warnings[0] and "loss.compile=false" in warnings[0]


def test_allocator_retries_are_logged_and_warned_about_once(tmp_path, shards, monkeypatch):
    """Near the memory limit the CUDA caching allocator retries allocations (a slow, synchronising path): the count
    goes to the metrics and the first retry prints one warning naming the remedies. (CPU run: the counter is
    simulated; on a GPU it is `torch.cuda.memory_stats`.)"""
    from dflash_trainer.train import trainer as trainer_module

    readings = iter([0, 2, 5, 5, 5, 5, 5, 5])
    monkeypatch.setattr(trainer_module, "allocator_retries", lambda device: next(readings))
    lines = fit_four_logged_steps(tmp_path, shards)
    logged = [r["alloc_retries"] for r in read_metrics(tmp_path / "run") if "alloc_retries" in r]
    assert logged == [0, 2, 5, 5]
    warnings = [line for line in lines if "allocator retried" in line]
    assert len(warnings) == 1 and "expandable_segments:True" in warnings[0] and "retried 2 " in warnings[0]
