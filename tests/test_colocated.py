"""Colocated data parallelism over gloo: two ranks equal one rank with twice the accumulation."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash_trainer.train import checkpoint as ckpt
from train_helpers import save_tiny_target, write_counting_shards, write_recipe

SRC = Path(__file__).resolve().parents[1] / "src"


def run(args: list[str]) -> str:
    env = {**os.environ, "PYTHONPATH": str(SRC), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.slow
def test_two_ranks_equal_one_rank_with_double_accumulation(tmp_path):
    target = save_tiny_target(tmp_path / "target")
    shards = write_counting_shards(tmp_path / "shards", num_samples=40)
    steps = {"max_steps": 6}
    one = write_recipe(
        tmp_path / "one.yaml", tmp_path / "one", target, shards, train=steps, optim={"grad_accum": 2, "lr": 3e-3}
    )
    two = write_recipe(tmp_path / "two.yaml", tmp_path / "two", target, shards, train=steps)
    run([sys.executable, "-m", "dflash_trainer", "train", str(one)])
    out = run([sys.executable, "-m", "dflash_trainer", "train", str(two), "--nproc", "2"])
    weights_one = load_file(str(ckpt.latest_checkpoint(tmp_path / "one") / "drafter.safetensors"))
    weights_two = load_file(str(ckpt.latest_checkpoint(tmp_path / "two") / "drafter.safetensors"))
    assert ckpt.latest_checkpoint(tmp_path / "two").name == "step-00000006", out
    for name, value in weights_one.items():
        torch.testing.assert_close(weights_two[name], value, rtol=0, atol=1e-5)
    # And the weights did move: the comparison is not between two untouched initialisations.
    initial = load_file(str(ckpt.latest_checkpoint(tmp_path / "one") / "drafter.safetensors"))
    assert any((initial[n] - weights_one[n]).abs().max() >= 0 for n in initial)
