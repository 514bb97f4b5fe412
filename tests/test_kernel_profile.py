"""The kernel profile of `dflash-trainer bench --kernels`: what it counts, and its wiring into a timed phase (CPU)."""

import json

import pytest
import torch

from dflash_trainer.bench import time_steps
from dflash_trainer.cli import main
from dflash_trainer.config import load_config
from dflash_trainer.kernel_profile import format_profile, profile_kernels
from dflash_trainer.train.trainer import Trainer
from train_helpers import save_tiny_target, write_counting_shards, write_recipe


def test_ops_are_ranked_by_their_own_time_and_counted_per_step():
    big, small = torch.randn(384, 384), torch.randn(8, 8)

    def run():
        with torch.profiler.record_function("a scope, not an op"):
            for _ in range(3):
                big @ big
            small.relu()

    result = profile_kernels(run, steps=2, device=torch.device("cpu"), top=50)
    names = [k.name for k in result.kernels]
    assert "a scope, not an op" not in names  # annotations would count their ops' time again
    assert names[0] == "aten::mm"  # three 384^3 matmuls per call dwarf everything else
    first = result.kernels[0]
    assert first.calls_per_step == 3
    assert first.share > 0.5
    relu = result.kernels[names.index("aten::relu")]
    assert relu.calls_per_step == 1
    # Self times: the shares of all ops add up to the busy time, never more.
    assert sum(k.share for k in result.kernels) <= 1.0 + 1e-9
    assert result.busy_ms_per_step >= sum(k.ms_per_step for k in result.kernels) - 1e-9
    lines = format_profile(result, step_ms=4 * result.busy_ms_per_step)
    assert "device idle 75 %" in lines[0]
    assert lines[1].strip().endswith("aten::mm")


def test_refuses_nothing_to_profile():
    with pytest.raises(ValueError, match="steps and top"):
        profile_kernels(lambda: None, steps=0, device=torch.device("cpu"), top=5)


def test_a_timed_phase_carries_its_kernel_profile_and_trace(tmp_path):
    target = save_tiny_target(tmp_path / "target")
    shards = write_counting_shards(tmp_path / "shards", num_samples=48)
    recipe = write_recipe(tmp_path / "r.yaml", tmp_path / "run", target, shards, train={"max_steps": 12})
    trainer = Trainer(load_config(recipe, []), log=lambda _: None)
    trainer.start_log_window()
    trace = tmp_path / "traces" / "end_to_end.json"
    result = time_steps(trainer, trainer._step_groups(), warmup=1, steps=2, name="e2e", kernels=8, trace_path=trace)
    profile = result.kernel_profile
    assert profile is not None and profile.device == "cpu" and profile.steps == 3
    assert 0 < len(profile.kernels) <= 8
    assert profile.busy_ms_per_step > 0
    # The training step's matmuls are among the ops that take the most time.
    assert any(k.name in {"aten::mm", "aten::addmm", "aten::bmm", "aten::linear"} for k in profile.kernels)
    # The trainer's stages, billed: each one's ops ran inside its wall time (one thread on the CPU).
    stages = {stage.name: stage for stage in profile.stages}
    computing = ("target_forward", "drafter_forward", "loss", "backward", "optimizer")
    assert set(computing) <= set(stages), sorted(stages)
    assert all(0 < stages[name].busy_ms_per_step <= 1.05 * stages[name].wall_ms_per_step for name in computing)
    trace_events = json.loads(trace.read_text())["traceEvents"]
    assert any(event.get("name") == "stage:backward" for event in trace_events)


def test_bench_refuses_a_negative_kernel_count(capsys):
    assert main(["bench", "--kernels", "-1"]) == 2
    assert "--kernels" in capsys.readouterr().err


def test_kernels_are_billed_to_the_annotated_stage_that_ran_them():
    """A stage that only waits (host-bound) reads as idle; a stage of matmuls as busy; work outside any stage is
    billed to none."""
    import time

    from dflash_trainer.kernel_profile import stage_busy
    from dflash_trainer.train.profiler import StageProfiler

    stages = StageProfiler(3600.0, device="cpu", sink=lambda _: None, annotate=True)
    big = torch.randn(256, 256)

    def run():
        with stages.stage("compute"):
            for _ in range(6):
                big @ big
        with stages.stage("host_wait"):
            time.sleep(0.02)
            torch.ones(8).relu()  # tiny: no worker threads to wait for on a busy machine
        big @ big  # outside every stage

    result = profile_kernels(run, steps=2, device=torch.device("cpu"), top=5)
    by_name = {stage.name: stage for stage in result.stages}
    assert set(by_name) == {"compute", "host_wait"}
    compute, waiting = by_name["compute"], by_name["host_wait"]
    assert waiting.wall_ms_per_step >= 20.0  # the sleep
    assert waiting.wall_ms_per_step - waiting.busy_ms_per_step >= 15.0  # ... billed to no op
    assert compute.busy_ms_per_step > 0.5 * compute.wall_ms_per_step
    # Busy time is what ran inside the stages: never more than the ops' total, the unstaged matmul left out.
    assert compute.busy_ms_per_step + waiting.busy_ms_per_step < result.busy_ms_per_step
    lines = format_profile(result, step_ms=30.0)
    assert any(line.strip().startswith("host_wait") and "idle" in line for line in lines)
    # Without annotations there are no stages to bill.
    assert stage_busy([], steps=1, on_cuda=False) == []
    plain = profile_kernels(lambda: big @ big, steps=1, device=torch.device("cpu"), top=3)
    assert plain.stages == []
