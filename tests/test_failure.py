"""A rank that raises or dies fails the whole job fast: every rank exits within 30 s of the failure, the original
traceback (a bug) or one line (a user error) is printed once, and the job's exit status says which
(distributed/failure.py). Under `train --nproc` the launcher reports that status and torchrun adds no failure
report of its own; under a plain torchrun every rank exits with it. A Ctrl-C reaches the ranks, not torchrun."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dflash_trainer.train import checkpoint as ckpt
from train_helpers import save_tiny_target, write_counting_shards, write_recipe

SRC = Path(__file__).resolve().parents[1] / "src"
LIMIT_S = 30.0
# The slow-storage tests: a rank timeout (placement.timeout_s) short enough that the slow write or read below outlasts
# it, long enough for the start-up collectives of two ranks starting unevenly on a loaded 2-core machine.
SHORT_RANK_TIMEOUT_S = 6
SLOW_STORAGE_S = 12
# torchrun's summary of the ranks it saw exit: "rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: ...)".
EXIT_PATTERN = re.compile(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("failure")
    return save_tiny_target(root / "target"), write_counting_shards(root / "shards", num_samples=40)


def run_job(
    command: list[str], marker: str, *, env: dict[str, str] | None = None, on_marker=None
) -> tuple[str, float, int]:
    """Run `command`; return (output, seconds from the first output line containing `marker` to the exit, exit
    status). `on_marker(proc)` is called once, when that line appears."""
    env = {**os.environ, "PYTHONPATH": str(SRC), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # Ends a hung job (and so the test) instead of waiting forever; the assertions below then fail.
    guard = threading.Timer(180, proc.terminate)
    guard.start()
    lines, marked_at = [], None
    for line in proc.stdout:
        lines.append(line)
        if marked_at is None and marker in line:
            marked_at = time.monotonic()
            if on_marker is not None:
                on_marker(proc)
    status = proc.wait()
    ended_at = time.monotonic()
    guard.cancel()
    out = "".join(lines)
    assert marked_at is not None, out
    return out, ended_at - marked_at, status


def launcher(recipe: Path, nproc: int) -> list[str]:
    return [sys.executable, "-m", "dflash_trainer", "train", str(recipe), "--nproc", str(nproc)]


def run_failing(recipe: Path, nproc: int, fault: str, failure_marker: str) -> tuple[str, float, int]:
    """`train --nproc` with DFLASH_TEST_FAIL_AT_STEP=`fault` (see `run_job`)."""
    return run_job(launcher(recipe, nproc), failure_marker, env={"DFLASH_TEST_FAIL_AT_STEP": fault})


def assert_killed(out: str, rank: int) -> None:
    """torchrun reports `rank` killed (SIGKILL); the other ranks ended by themselves (failure.py)."""
    exits = {int(found): int(code) for found, code in EXIT_PATTERN.findall(out)}
    assert exits.get(rank) == -9, out


def assert_no_torchrun_report(out: str) -> None:
    """The launcher reported the failure; torchrun added no ChildFailedError traceback."""
    assert "ChildFailedError" not in out and "Root Cause" not in out, out


@pytest.mark.slow
def test_a_raising_target_rank_fails_every_rank_with_one_traceback(tmp_path, data):
    target, shards = data
    placement = {"target_ranks": [0], "drafter_ranks": [1]}
    recipe = write_recipe(tmp_path / "r.yaml", tmp_path / "run", target, shards, placement=placement)
    out, seconds, status = run_failing(recipe, 2, "0:3", "[rank 0] failed")
    assert status == 1, out  # a bug
    assert seconds < LIMIT_S, out
    assert_no_torchrun_report(out)
    # The original traceback, once; the other ranks name the rank that failed first in one line each.
    assert out.count("RuntimeError: DFLASH_TEST_FAIL_AT_STEP: injected failure on rank 0") == 1, out
    assert "[rank 1] stopping because rank 0 failed (its traceback is above)" in out


@pytest.mark.slow
def test_a_killed_drafter_rank_fails_every_rank(tmp_path, data):
    target, shards = data
    placement = {"target_ranks": [0], "drafter_ranks": [1, 2]}
    recipe = write_recipe(tmp_path / "r.yaml", tmp_path / "run", target, shards, placement=placement)
    out, seconds, status = run_failing(recipe, 3, "2:3:kill", "rank 2 kills itself")
    assert status != 0
    assert seconds < LIMIT_S, out
    assert_killed(out, 2)


def test_a_raising_colocated_rank_fails_the_other(tmp_path, data):
    target, shards = data
    recipe = write_recipe(tmp_path / "r.yaml", tmp_path / "run", target, shards)
    out, seconds, status = run_failing(recipe, 2, "0:4", "[rank 0] failed")
    assert status == 1, out
    assert seconds < LIMIT_S, out
    assert_no_torchrun_report(out)
    assert out.count("RuntimeError: DFLASH_TEST_FAIL_AT_STEP: injected failure on rank 0") == 1, out


@pytest.mark.slow
def test_a_rank_whose_checkpoint_write_fails_fails_the_job_cleanly(tmp_path, data, monkeypatch):
    """Rank 0 writes the checkpoints; a full disk there (DFLASH_TEST_DISK_FULL) must end every rank within
    seconds with one line naming the problem (a user error: no traceback), and leave no `.tmp` behind."""
    target, shards = data
    recipe = write_recipe(
        tmp_path / "r.yaml", tmp_path / "run", target, shards, checkpoint={"every_steps": 2}, train={"max_steps": 5}
    )
    monkeypatch.setenv("DFLASH_TEST_DISK_FULL", "checkpoint")
    out, seconds, status = run_failing(recipe, 2, "", "[rank 0] error: cannot write checkpoint step-00000")
    assert status == 2, out  # a user error
    assert seconds < LIMIT_S, out
    assert_no_torchrun_report(out)
    assert "no space left on the device" in out and "Traceback" not in out, out
    assert "[rank 1] stopping because rank 0 failed (its error is above)" in out
    # The periodic checkpoints were skipped with a warning; the last one had to be written.
    assert "warning: cannot write checkpoint step-00000002" in out
    assert "no checkpoint is written yet, and the same command resumes from it" in out
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == []


@pytest.mark.parametrize("launched_by", ["launcher", pytest.param("torchrun", marks=pytest.mark.slow)])
def test_a_user_error_on_every_rank_is_one_line_and_exit_status_2(tmp_path, data, launched_by):
    """The mask token is refused once the target has loaded, on every rank. Through `train --nproc`: status 2, no
    traceback, no report of torchrun's; through a plain torchrun: every rank exits 2."""
    target, shards = data
    recipe = write_recipe(tmp_path / "r.yaml", tmp_path / "run", target, shards, drafter={"mask_token_id": 126})
    command = launcher(recipe, 2)
    if launched_by == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        command += ["-m", "dflash_trainer", "train", str(recipe)]
    out, seconds, status = run_job(command, "error: drafter.mask_token_id=126")
    assert seconds < LIMIT_S, out
    assert out.count("error: drafter.mask_token_id=126 is the target's stop token") == 1, out
    assert re.search(r"\[rank [01]\] stopping because rank [01] failed \(its error is above\)", out), out
    if launched_by == "launcher":
        assert status == 2, out
        assert "Traceback" not in out, out
        assert_no_torchrun_report(out)
    else:
        exits = {int(rank): int(code) for rank, code in EXIT_PATTERN.findall(out)}
        assert exits and set(exits.values()) == {2}, out
    assert not (tmp_path / "run").exists()  # refused after start-up: nothing left behind


@pytest.mark.slow
def test_ctrl_c_under_nproc_stops_the_ranks_cleanly(tmp_path, data):
    """The launcher passes Ctrl-C to the ranks: they finish the step, write a checkpoint and exit 0, and torchrun
    (which saw no signal) prints no SignalException traceback."""
    target, shards = data
    recipe = write_recipe(tmp_path / "r.yaml", tmp_path / "run", target, shards)
    out, seconds, status = run_job(
        launcher(recipe, 2),
        "step 2/",
        env={"DFLASH_TEST_SLOW_RANK": "0:0.3"},
        on_marker=lambda proc: proc.send_signal(signal.SIGINT),
    )
    assert status == 0, out
    assert seconds < LIMIT_S, out
    assert "Traceback" not in out and "SignalException" not in out, out
    assert "SIGINT: finishing this step, writing a checkpoint" in out
    assert "launcher: stopped by SIGINT" in out
    assert len(list((tmp_path / "run" / "checkpoints").glob("step-*"))) == 1


def test_a_rank_stopping_for_anothers_failure_waits_for_its_recorded_status(tmp_path):
    # The first failing rank claims the slot, then prints and writes the job's status: a rank that read the claim
    # and gets to its exit first must wait for the status (else it exits non-zero and torchrun adds a traceback).
    from dflash_trainer.distributed.failure import _status_recorded

    status = tmp_path / "status"
    status.write_text("")  # the launcher creates it empty
    writer = threading.Timer(0.3, lambda: status.write_text("2\n"))
    writer.start()
    started = time.monotonic()
    assert _status_recorded(status, timeout_s=5.0)
    assert 0.2 < time.monotonic() - started < 5.0
    writer.join()
    never = tmp_path / "never"
    never.write_text("")
    assert not _status_recorded(never, timeout_s=0.2)  # a first rank that could not write: the real status


def test_the_watcher_outlasts_a_busy_store_and_stops_when_it_is_gone(monkeypatch):
    """A few store errors in a row (a busy store's timeouts) keep the watcher polling, so a failure recorded after
    them still stops this rank; STORE_ERRORS_TO_STOP in a row (the store's host gone) end it."""
    from dflash_trainer.distributed import failure

    class FlakyStore:
        def __init__(self, answers):
            self.answers = list(answers)

        def check(self, keys):
            answer = self.answers.pop(0) if self.answers else RuntimeError("gone")
            if isinstance(answer, Exception):
                raise answer
            return answer

        def get(self, key):
            return b"1:bug"

    stops = []
    monkeypatch.setattr(failure, "GRACE_S", 0.0)
    monkeypatch.setattr(failure, "_exit_after", stops.append)

    def watch(answers):
        stops.clear()
        watcher = threading.Thread(
            target=failure.FailureChannel(FlakyStore(answers), rank=0, label="rank 0")._watch, args=(0.0,)
        )
        watcher.start()
        watcher.join(timeout=10)
        assert not watcher.is_alive()  # a store that stays gone ends the watching
        return list(stops)

    timeouts = [RuntimeError("timeout")] * (failure.STORE_ERRORS_TO_STOP - 1)
    assert watch([*timeouts, False, True]) == ["bug"]  # rank 1's failure, seen once the store answered again
    assert watch([*timeouts, RuntimeError("timeout"), True]) == []  # one more error in a row: the store is gone


@pytest.mark.parametrize(
    "placement",
    [
        pytest.param({}, id="colocated"),
        pytest.param({"target_ranks": [0], "drafter_ranks": [1, 2]}, id="disaggregated", marks=pytest.mark.slow),
    ],
)
def test_a_checkpoint_written_slower_than_the_rank_timeout_does_not_fail_the_job(tmp_path, data, placement):
    """The other ranks wait for the main rank's checkpoint up to `checkpoint.timeout_s`, not `placement.timeout_s`
    (a 27 GiB drafter state takes minutes on network storage): with a 6 s rank timeout, checkpoints that take 12 s
    more to write (DFLASH_TEST_SLOW_WRITE) must not fail the job, colocated (the ranks' agreement after the write)
    or disaggregated (the other drafter at the agreement; the target waiting for room and for the end notices)."""
    target, shards = data
    recipe = write_recipe(
        tmp_path / "r.yaml",
        tmp_path / "run",
        target,
        shards,
        checkpoint={"every_steps": 2},
        train={"max_steps": 3},
        placement={"timeout_s": SHORT_RANK_TIMEOUT_S, **placement},
    )
    nproc = 3 if placement else 2
    out, _, status = run_job(
        launcher(recipe, nproc), "step", env={"DFLASH_TEST_SLOW_WRITE": f"checkpoint:{SLOW_STORAGE_S}"}
    )
    assert status == 0, out
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "run")] == ["step-00000002", "step-00000003"], out


@pytest.mark.parametrize(
    ("placement", "nproc", "slow_rank"),
    [
        pytest.param({}, 2, 1, id="colocated"),
        pytest.param({"sharding": "fsdp2"}, 2, 1, id="colocated-fsdp2", marks=pytest.mark.slow),
        pytest.param({"target_ranks": [0], "drafter_ranks": [1]}, 2, 1, id="disaggregated", marks=pytest.mark.slow),
        pytest.param(
            {"target_ranks": [0], "drafter_ranks": [1, 2]}, 3, 2, id="disaggregated-2-drafters", marks=pytest.mark.slow
        ),
    ],
)
def test_a_resume_read_slower_than_the_rank_timeout_does_not_fail_the_job(tmp_path, data, placement, nproc, slow_rank):
    """Every rank reads the checkpoint it resumes from; one rank reading 12 s slower than the others (a 6 s rank
    timeout, DFLASH_TEST_SLOW_RESUME) must not fail the job: the ranks meet on the checkpoint group after the reads,
    and target ranks wait for the drafters' start on the start group."""
    target, shards = data
    run = tmp_path / "run"
    sections = dict(checkpoint={"every_steps": 2}, placement={"timeout_s": SHORT_RANK_TIMEOUT_S, **placement})
    first = write_recipe(tmp_path / "first.yaml", run, target, shards, train={"max_steps": 2}, **sections)
    out, _, status = run_job(launcher(first, nproc), "step")
    assert status == 0, out
    resumed = write_recipe(tmp_path / "resumed.yaml", run, target, shards, train={"max_steps": 4}, **sections)
    out, _, status = run_job(
        launcher(resumed, nproc), "step", env={"DFLASH_TEST_SLOW_RESUME": f"{slow_rank}:{SLOW_STORAGE_S}"}
    )
    assert status == 0, out
    assert "resumed from" in out and ckpt.list_checkpoints(run)[-1].name == "step-00000004", out
