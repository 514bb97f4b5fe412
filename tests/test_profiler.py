"""Per-stage profiler: accumulation, periodic report, free when off, env switch, CUDA sync, torch.profiler window."""

from __future__ import annotations

import json
import time
import types

import pytest
import torch

from dflash_trainer.train import profiler as profiler_module
from dflash_trainer.train.profiler import (
    COVERED_STAGE,
    PROFILE_INTERVAL_ENV,
    StageProfiler,
    StageStats,
    format_report,
    torch_profiler_window,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


def test_enabled_stages_accumulate_count_sum_and_max():
    profiler = StageProfiler(interval_s=1000.0, device="cpu")
    for seconds in (0.002, 0.006, 0.004):
        with profiler.stage("target_forward"):
            time.sleep(seconds)
    with profiler.stage("loss"):
        time.sleep(0.003)
    summary = profiler.summary()
    assert set(summary) == {"target_forward", "loss"}
    forward = summary["target_forward"]
    assert forward.count == 3
    # Sleeps last at least as long as asked; the slack covers a busy 2-core machine.
    assert 0.012 <= forward.sum_s < 0.012 + 0.05
    assert 0.006 <= forward.max_s < forward.sum_s - 0.005
    assert summary["loss"].count == 1 and summary["loss"].max_s == summary["loss"].sum_s >= 0.003


def test_report_appears_after_the_interval_with_exact_shares(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(profiler_module, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    printed: list[str] = []
    profiler = StageProfiler(interval_s=10.0, device="cpu", sink=printed.append, label="rank0")
    for seconds in (1.0, 3.0):
        with profiler.stage("drafter_forward"):
            clock.now += seconds
    with profiler.stage("data"):
        clock.now += 0.5
    clock.now += 1.0  # outside any stage
    assert profiler.maybe_report(step=3) is None and printed == []
    clock.now += 4.5  # interval now 10 s
    report = profiler.maybe_report(step=4)
    assert report == {
        "step": 4,
        "interval_s": 10.0,
        "stages": {"drafter_forward": StageStats(2, 4.0, 3.0), "data": StageStats(1, 0.5, 0.5)},
    }
    (table,) = printed
    assert "step 4" in table
    assert "rank0      drafter_forward        2   2000.00   3000.00   40.0%" in table
    assert "rank0      data                   1    500.00    500.00    5.0%" in table
    assert "(untracked)" in table and "55.0%" in table
    assert table.splitlines()[-1] == "largest share: drafter_forward on rank0 (40.0%)"
    # The report starts a new interval.
    assert profiler.summary() == {}
    assert profiler.maybe_report(step=5) is None


def test_disabled_profiler_is_a_shared_null_context_that_reads_no_clock(monkeypatch):
    printed: list[str] = []
    profiler = StageProfiler(interval_s=0.0, device="cpu", sink=printed.append)

    def no_clock() -> float:
        raise AssertionError("a disabled profiler must not read the clock")

    monkeypatch.setattr(profiler_module, "time", types.SimpleNamespace(perf_counter=no_clock))
    assert not profiler.enabled
    first = profiler.stage("target_forward")
    assert first is profiler.stage("backward")
    assert first is StageProfiler(interval_s=-1.0, device="cpu").stage("loss")
    with first:
        pass
    assert profiler.summary() == {}
    assert profiler.maybe_report(step=1) is None and printed == []


def test_environment_variable_overrides_the_configured_interval(monkeypatch):
    monkeypatch.delenv(PROFILE_INTERVAL_ENV, raising=False)
    assert not StageProfiler.from_env(0.0, device="cpu").enabled
    assert StageProfiler.from_env(30.0, device="cpu").interval_s == 30.0
    monkeypatch.setenv(PROFILE_INTERVAL_ENV, "2.5")
    switched_on = StageProfiler.from_env(0.0, device="cpu")
    assert switched_on.enabled and switched_on.interval_s == 2.5
    monkeypatch.setenv(PROFILE_INTERVAL_ENV, "0")
    assert not StageProfiler.from_env(30.0, device="cpu").enabled
    monkeypatch.setenv(PROFILE_INTERVAL_ENV, "often")
    with pytest.raises(ValueError, match=PROFILE_INTERVAL_ENV):
        StageProfiler.from_env(0.0, device="cpu")


def test_cuda_stages_wait_for_their_own_stream_once_at_stage_end(monkeypatch):
    """Only the current stream is waited for: a device-wide sync would also wait for sends posted on NCCL's
    stream, i.e. for the receiver, and make every profiled send a blocking one."""
    synced: list[torch.device] = []

    class FakeStream:
        def __init__(self, device: torch.device) -> None:
            self.device = device

        def synchronize(self) -> None:
            synced.append(self.device)

    def whole_device(*_: object) -> None:
        raise AssertionError("a stage must not wait for the whole device")

    monkeypatch.setattr(torch.cuda, "current_stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "synchronize", whole_device)
    cuda = torch.device("cuda", 1)
    profiler = StageProfiler(interval_s=60.0, device=cuda)
    for stages_done in range(3):
        with profiler.stage("backward"):
            assert len(synced) == stages_done  # no sync when a stage starts
    assert synced == [cuda, cuda, cuda]
    for quiet in (
        StageProfiler(interval_s=60.0, device=cuda, sync=False),
        StageProfiler(interval_s=60.0, device="cpu"),
        StageProfiler(interval_s=0.0, device=cuda),
    ):
        with quiet.stage("backward"):
            pass
    assert len(synced) == 3


def test_format_report_for_several_ranks_names_the_largest_share():
    merged = {
        "target0": {"target_forward": StageStats(10, 4.0, 0.5), "data": StageStats(10, 0.2, 0.05)},
        "drafter0": {"drafter_forward": StageStats(20, 6.0, 0.4), "backward": StageStats(20, 3.0, 0.2)},
    }
    table = format_report(merged, interval_s=10.0)
    assert "target0    target_forward        10    400.00    500.00   40.0%" in table
    assert "drafter0   drafter_forward       20    300.00    400.00   60.0%" in table
    assert "drafter0   backward              20    150.00    200.00   30.0%" in table
    untracked = [line for line in table.splitlines() if "(untracked)" in line]
    assert [line.split()[0] for line in untracked] == ["target0", "drafter0"]
    assert untracked[0].endswith("58.0%") and untracked[1].endswith("10.0%")
    assert table.splitlines()[-1] == "largest share: drafter_forward on drafter0 (60.0%)"


def test_a_summary_covering_its_own_time_gets_shares_of_that_time(monkeypatch):
    """A target rank's stages reach the report in batch headers, at other moments than the report's interval: the
    time they cover travels with them, so their shares stay fractions of that rank's own time."""
    clock = FakeClock()
    monkeypatch.setattr(profiler_module, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    target = StageProfiler(interval_s=1.0, device="cpu", label="target0")
    with target.stage("send_wait"):
        clock.now += 3.0
    clock.now += 1.0
    sent = target.summary(covered=True)
    assert sent[COVERED_STAGE] == StageStats(1, 4.0, 4.0)
    table = format_report({"target0": sent, "drafter1": {"recv_wait": StageStats(1, 0.5, 0.5)}}, interval_s=2.0)
    assert "target0    send_wait              1   3000.00   3000.00   75.0%" in table
    assert "drafter1   recv_wait              1    500.00    500.00   25.0%" in table
    assert COVERED_STAGE not in table
    assert [line.split()[-1] for line in table.splitlines() if "(untracked)" in line] == ["25.0%", "75.0%"]


def test_torch_profiler_window_writes_a_chrome_trace_for_the_requested_steps(tmp_path):
    weights = torch.randn(32, 32)
    with torch_profiler_window(tmp_path, start_step=12, num_steps=2, current_step=10, rank=3) as window:
        for _ in range(5):  # steps 10..14
            (weights @ weights).sum()
            window.step()
    traces = list((tmp_path / "trace").iterdir())
    assert [trace.name for trace in traces] == ["rank3_steps12-13.json"]
    events = json.loads(traces[0].read_text())["traceEvents"]
    assert any("aten::mm" in str(event.get("name", "")) for event in events)


def test_annotated_stages_need_synchronised_stages():
    """Kernels are billed to the stage whose range they start in: unsynchronised stages would end before their
    kernels, so annotating them is refused."""
    with pytest.raises(ValueError, match="annotate=True needs sync=True"):
        StageProfiler(1.0, device="cpu", annotate=True, sync=False)
    assert not StageProfiler(0.0, device="cpu", annotate=True, sync=False).annotate  # off: nothing to bill
