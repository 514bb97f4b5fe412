"""A rank that raises or dies fails the whole job fast: every rank exits non-zero within 30 s of the failure,
and the original traceback is printed once (distributed/failure.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from train_helpers import save_tiny_target, write_counting_shards, write_recipe

SRC = Path(__file__).resolve().parents[1] / "src"
LIMIT_S = 30.0
# torchrun's summary of the ranks it saw exit: "rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: ...)".
EXIT_PATTERN = re.compile(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("failure")
    return save_tiny_target(root / "target"), write_counting_shards(root / "shards", num_samples=40)


def run_failing(recipe: Path, nproc: int, fault: str, failure_marker: str) -> tuple[str, float, int]:
    """Run the CLI with DFLASH_TEST_FAIL_AT_STEP=`fault`; return (output, seconds from the first output line
    containing `failure_marker` to the launcher's exit, exit status)."""
    env = {
        **os.environ,
        "PYTHONPATH": str(SRC),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "DFLASH_TEST_FAIL_AT_STEP": fault,
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflash_trainer", "train", str(recipe), "--nproc", str(nproc)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    # Ends a hung job (and so the test) instead of waiting forever; the assertions below then fail.
    guard = threading.Timer(180, proc.terminate)
    guard.start()
    lines, failed_at = [], None
    for line in proc.stdout:
        lines.append(line)
        if failed_at is None and failure_marker in line:
            failed_at = time.monotonic()
    status = proc.wait()
    ended_at = time.monotonic()
    guard.cancel()
    out = "".join(lines)
    assert failed_at is not None, out
    return out, ended_at - failed_at, status


def assert_every_rank_failed(out: str, nproc: int) -> None:
    exits = {int(rank): int(code) for rank, code in EXIT_PATTERN.findall(out)}
    assert sorted(exits) == list(range(nproc)), out
    assert all(code != 0 for code in exits.values()), exits


def test_a_raising_target_rank_fails_every_rank_with_one_traceback(tmp_path, data):
    target, shards = data
    placement = {"target_ranks": [0], "drafter_ranks": [1]}
    recipe = write_recipe(tmp_path / "r.yaml", tmp_path / "run", target, shards, placement=placement)
    out, seconds, status = run_failing(recipe, 2, "0:3", "[rank 0] failed")
    assert status != 0
    assert seconds < LIMIT_S, out
    assert_every_rank_failed(out, 2)
    # The original traceback, once; the other ranks name the rank that failed first in one line each.
    assert out.count("RuntimeError: DFLASH_TEST_FAIL_AT_STEP: injected failure on rank 0") == 1, out
    assert "[rank 1] stopping because rank 0 failed" in out


def test_a_killed_drafter_rank_fails_every_rank(tmp_path, data):
    target, shards = data
    placement = {"target_ranks": [0], "drafter_ranks": [1, 2]}
    recipe = write_recipe(tmp_path / "r.yaml", tmp_path / "run", target, shards, placement=placement)
    out, seconds, status = run_failing(recipe, 3, "2:3:kill", "rank 2 kills itself")
    assert status != 0
    assert seconds < LIMIT_S, out
    assert_every_rank_failed(out, 3)
    assert "exitcode  : -9" in out


def test_a_raising_colocated_rank_fails_the_other(tmp_path, data):
    target, shards = data
    recipe = write_recipe(tmp_path / "r.yaml", tmp_path / "run", target, shards)
    out, seconds, status = run_failing(recipe, 2, "0:4", "[rank 0] failed")
    assert status != 0
    assert seconds < LIMIT_S, out
    assert_every_rank_failed(out, 2)
    assert out.count("RuntimeError: DFLASH_TEST_FAIL_AT_STEP: injected failure on rank 0") == 1, out


def test_a_rank_whose_checkpoint_write_fails_fails_the_job_cleanly(tmp_path, data, monkeypatch):
    """Rank 0 writes the checkpoints; a full disk there (DFLASH_TEST_DISK_FULL) must end every rank within
    seconds with one line naming the problem (a user error: no traceback), and leave no `.tmp` behind."""
    target, shards = data
    recipe = write_recipe(tmp_path / "r.yaml", tmp_path / "run", target, shards, checkpoint={"every_steps": 2})
    monkeypatch.setenv("DFLASH_TEST_DISK_FULL", "checkpoint")
    out, seconds, status = run_failing(recipe, 2, "", "[rank 0] error: cannot write checkpoint step-00000002")
    assert status != 0
    assert seconds < LIMIT_S, out
    assert_every_rank_failed(out, 2)
    assert "no space left on the device" in out and "[rank 0] failed; the job stops" not in out, out
    assert "[rank 1] stopping because rank 0 failed" in out
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == []
