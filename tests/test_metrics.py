"""Metric sinks: JSONL records and resume truncation, TensorBoard scalars, console line, progress, throughput."""

from __future__ import annotations

import io
import json
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_trainer.train import metrics
from dflash_trainer.train.metrics import (
    MetricsLogger,
    Progress,
    Throughput,
    dflash_flops_per_token,
    format_console_line,
    format_duration,
    mfu,
    peak_memory_gib,
)


class FakeClock:
    """Stands in for the `time` module inside `metrics`, so durations are exact."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def monotonic(self) -> float:
        return self.now

    perf_counter = monotonic
    time = monotonic


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_log_writes_one_json_line_per_call_with_lists_kept(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(5, {"loss": 2.5, "acc_per_slot": [0.75, 0.5, 0.25], "tokens": np.int64(4096)})
        logger.log(6, {"loss": torch.tensor(1.25), "acc_per_slot": torch.tensor([0.5, 0.125])})
    first, second = read_records(tmp_path / "metrics.jsonl")
    assert first["step"] == 5 and first["loss"] == 2.5
    assert first["acc_per_slot"] == [0.75, 0.5, 0.25]
    assert first["tokens"] == 4096 and isinstance(first["tokens"], int)
    assert abs(first["time"] - time.time()) < 60 and 0 <= first["wall"] <= second["wall"]
    assert second["step"] == 6 and second["loss"] == 1.25 and second["acc_per_slot"] == [0.5, 0.125]


def test_log_rejects_reserved_names_and_non_numbers(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        with pytest.raises(ValueError, match="'wall'"):
            logger.log(1, {"wall": 3.0})
        with pytest.raises(TypeError, match="'note'"):
            logger.log(1, {"note": "text"})


def test_resume_drops_later_records_and_torn_line_and_continues_wall(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": step, "time": 0.0, "wall": 10.0 * step, "loss": 1.0 / step}) for step in (1, 2, 3, 4)]
    path.write_text("\n".join(lines) + '\n{"step": 5, "lo')  # killed mid-write
    with MetricsLogger(tmp_path, tensorboard=False, resume_step=2) as logger:
        logger.log(3, {"loss": 0.125})
    records = read_records(path)
    assert [record["step"] for record in records] == [1, 2, 3]
    assert records[1]["loss"] == 0.5  # the old step 2
    assert records[2]["loss"] == 0.125  # the resumed run's step 3, not the old one
    # Wall time continues from the last kept record (20 s), not from zero.
    assert 20.0 <= records[2]["wall"] < 30.0


def test_resume_keeps_an_unreadable_middle_line_with_a_warning(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "wall": 1.0}\nnot json\n{"step": 2, "wall": 2.0}\n{"step": 3, "wall": 3.0}\n')
    with pytest.warns(UserWarning, match=r"metrics\.jsonl:2"):
        MetricsLogger(tmp_path, tensorboard=False, resume_step=2).close()
    assert path.read_text().splitlines() == ['{"step": 1, "wall": 1.0}', "not json", '{"step": 2, "wall": 2.0}']


def test_non_main_rank_writes_nothing(tmp_path):
    logger = MetricsLogger(tmp_path / "run", tensorboard=True, is_main=False)
    logger.log(1, {"loss": 1.0})
    logger.close()
    assert not (tmp_path / "run").exists()


def test_tensorboard_scalars_and_per_slot_tags(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path, tensorboard=True) as logger:
        logger.log(10, {"loss": 2.0, "acc_per_slot": [0.5, 0.25]})
        logger.log(20, {"loss": 1.5, "acc_per_slot": [0.75, 0.375]})
    event_files = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert len(event_files) == 1 and event_files[0].stat().st_size > 0
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert {"loss", "acc_per_slot/slot_1", "acc_per_slot/slot_2"} <= set(events.Tags()["scalars"])
    assert [(event.step, event.value) for event in events.Scalars("loss")] == [(10, 2.0), (20, 1.5)]
    assert [(event.step, event.value) for event in events.Scalars("acc_per_slot/slot_2")] == [(10, 0.25), (20, 0.375)]


def test_console_line_shows_the_values():
    values = {
        "epoch": 1.25,
        "loss": 3.14159,
        "acc_per_slot": [0.8, 0.5, 0.2],
        "tau": 2.345,
        "lr": 0.0006,
        "grad_norm": 0.875,
        "tokens_per_s": 14500.0,
        "mfu": 0.152,
        "step_time_s": 0.84,
        "peak_mem_gib": 31.25,
        "inflight": 3,
        "wait_features_s": 0.012,
        "eval_tau": 3.1,
        "eta_s": 3723.0,
        "some_unknown_metric": 99.0,
    }
    line = format_console_line(120, 3000, values)
    assert "\n" not in line
    for expected in (
        "step 120/3000",
        "ep 1.25",
        "loss 3.1416",
        "acc 0.500 (k1 0.800 k3 0.200)",
        "tau 2.35",
        "lr 6.00e-04",
        "gnorm 0.875",
        "14.5k tok/s",
        "mfu 15.2%",
        "0.840 s/step",
        "mem 31.2GiB",
        "inflight 3",
        "wait features 12.0ms",
        "eval tau 3.10",
        "eta 1:02:03",
    ):
        assert expected in line, expected
    assert "99" not in line and "unknown" not in line


def test_console_line_omits_missing_values_and_prefers_logged_mean_accuracy():
    line = format_console_line(7, 10, {"loss": 1.0, "acc": 0.25, "acc_per_slot": [0.5, 0.0, 1.0]})
    assert line == "step 7/10 | loss 1.0000 | acc 0.250 (k1 0.500 k3 1.000)"
    assert format_console_line(1, 2, {}) == "step 1/2"


def test_format_duration():
    assert format_duration(59.6) == "1:00"
    assert format_duration(3723) == "1:02:03"
    assert format_duration(None) == "?"
    assert format_duration(float("inf")) == "?"


def test_progress_without_terminal_prints_lines_and_estimates_eta(monkeypatch, capsys):
    clock = FakeClock()
    monkeypatch.setattr(metrics, "time", types.SimpleNamespace(monotonic=clock.monotonic))
    progress = Progress(total_steps=110, initial=10)
    assert not progress.shows_bar  # pytest's captured stderr is not a terminal
    assert progress.eta_seconds() is None
    clock.now += 40.0
    progress.update(20)
    # 20 steps in 40 s -> 2 s/step, 80 steps left.
    assert progress.eta_seconds() == pytest.approx(160.0)
    progress.write("step 30/110 | loss 1.0")
    progress.close()
    assert capsys.readouterr().out == "step 30/110 | loss 1.0\n"


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_with_terminal_draws_a_bar_and_keeps_lines_on_stdout(monkeypatch, capsys):
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    progress = Progress(total_steps=4, desc="train")
    assert progress.shows_bar
    progress.update(2)
    progress.set_postfix({"loss": 1.5})
    progress.write("a console line")
    progress.close()
    assert "a console line\n" in capsys.readouterr().out
    assert "2/4" in terminal.getvalue() and "train" in terminal.getvalue()


def test_peak_memory_on_cpu_matches_the_kernel_high_water_mark():
    status = Path("/proc/self/status")
    if not status.exists():
        pytest.skip("needs /proc (Linux)")
    peak = peak_memory_gib("cpu")
    vm_hwm_kib = next(int(line.split()[1]) for line in status.read_text().splitlines() if line.startswith("VmHWM"))
    assert peak == pytest.approx(vm_hwm_kib / 2**20, rel=0.05)
    assert 0.01 < peak < 64


def test_throughput_windows(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(metrics, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    throughput = Throughput()
    for tokens in (1000, 3000, 2000):
        clock.now += 0.5
        throughput.record_step(tokens)
    window = throughput.take()
    assert (window.steps, window.tokens, window.seconds) == (3, 6000, 1.5)
    assert window.tokens_per_s == pytest.approx(4000.0)
    assert window.step_time_s == pytest.approx(0.5)
    clock.now += 2.0
    throughput.record_step(np.int64(500))
    window = throughput.take()
    assert (window.steps, window.tokens, window.tokens_per_s) == (1, 500, 250.0)
    with pytest.raises(TypeError, match="host integer"):
        throughput.record_step(torch.tensor(5))


def test_flops_per_token_and_mfu():
    flops = dflash_flops_per_token(
        target_params_used=8_000_000_000,
        drafter_params=1_000_000_000,
        blocks_per_token=0.25,
        block_size=16,
        hidden=4096,
        vocab=151936,
    )
    # 2*8e9 + 0.25*16*(6e9 + 4*4096*151936) = 16e9 + 4*(6e9 + 2_489_319_424)
    assert flops == pytest.approx(16e9 + 4 * (6e9 + 2_489_319_424))
    with_attention = dflash_flops_per_token(
        target_params_used=10,
        drafter_params=1,
        blocks_per_token=1.0,
        block_size=2,
        hidden=3,
        vocab=5,
        attention_flops_per_token=7.0,
    )
    assert with_attention == 2 * 10 + 2 * (6 + 60) + 7
    assert mfu(tokens_per_s=1000.0, flops_per_token=2e9, peak_flops=8e12) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="peak_flops"):
        mfu(tokens_per_s=1.0, flops_per_token=1.0, peak_flops=0.0)


# ----------------------------------------------------------------------------------------------------------
# Weights & Biases


class FakeWandb:
    """Stands in for the `wandb` module: records `init`, `log` and `finish`."""

    Settings = dict

    def __init__(self) -> None:
        self.init_kwargs: dict = {}
        self.logged: list[tuple[dict, int]] = []
        self.finished = False

    def init(self, **kwargs):
        self.init_kwargs = kwargs
        return self

    def log(self, values, step):
        self.logged.append((values, step))

    def finish(self):
        self.finished = True


def _wandb_settings(**values):
    from dflash_trainer.config import WandbConfig

    return WandbConfig(**{"project": "drafters", **values})


def test_wandb_sink_mirrors_records_into_one_run_per_run_dir(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    with MetricsLogger(
        tmp_path / "run", tensorboard=False, wandb=_wandb_settings(), run_config={"optim": {"lr": 1e-3}}
    ) as logger:
        logger.log(3, {"loss": 2.5, "acc_per_slot": [0.5, 0.25]})
    assert fake.finished
    assert fake.logged == [({"loss": 2.5, "acc_per_slot/slot_1": 0.5, "acc_per_slot/slot_2": 0.25}, 3)]
    kwargs = fake.init_kwargs
    assert (kwargs["project"], kwargs["name"], kwargs["mode"], kwargs["resume"]) == (
        "drafters",
        "run",
        "offline",
        "allow",
    )
    assert kwargs["dir"] == str(tmp_path / "run") and kwargs["config"] == {"optim": {"lr": 1e-3}}
    assert kwargs["id"] == metrics.wandb_run_id(tmp_path / "run") != metrics.wandb_run_id(tmp_path / "other")
    # Off without a project; never on other ranks.
    other = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", other)
    MetricsLogger(tmp_path / "a", tensorboard=False, wandb=_wandb_settings(project="")).close()
    MetricsLogger(tmp_path / "b", tensorboard=False, is_main=False, wandb=_wandb_settings()).close()
    assert other.init_kwargs == {}


def test_a_missing_wandb_package_is_one_line_before_training(tmp_path, monkeypatch):
    from dflash_trainer.errors import UserError
    from dflash_trainer.train.pipeline import run_training

    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(UserError, match=r"metrics.wandb.project='p' needs the `wandb` package: pip install"):
        metrics.import_wandb("p")
    from dflash_trainer.config import load_config

    config = load_config(None, [f"run_dir={tmp_path / 'run'}", "metrics.wandb.project=p", "target.device=cpu"])
    with pytest.raises(UserError, match="needs the `wandb` package"):
        run_training(config)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_wandb_offline_run_is_written_without_network(tmp_path, monkeypatch):
    """With the real package (when installed): an offline run under run_dir/wandb that holds the logged values."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for variable in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR"):
        monkeypatch.delenv(variable, raising=False)
    with MetricsLogger(tmp_path / "run", tensorboard=False, wandb=_wandb_settings(mode="offline")) as logger:
        logger.log(1, {"loss": 0.8125, "acc_per_slot": [0.375]})
        logger.log(2, {"loss": 0.6875})
    (run_file,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    assert run_file.name == f"run-{metrics.wandb_run_id(tmp_path / 'run')}.wandb"
    # W&B's record log holds the keys and JSON values as written; its service process may still be flushing it.
    tokens = (b"loss", b"0.8125", b"0.6875", b"acc_per_slot/slot_1", b"0.375")
    deadline = time.monotonic() + 30
    while [token for token in tokens if token not in run_file.read_bytes()] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [token for token in tokens if token not in run_file.read_bytes()] == []


def test_fractions_out_of_range_names_each_wrong_accuracy_and_recall():
    from dflash_trainer.train.metrics import fractions_out_of_range

    right = {"acc": 0.5, "acc_per_slot": [1.0, 0.0, 0.25], "selector_acc": 0.7, "selector_recall": 1.0, "tau": 3.2}
    assert fractions_out_of_range(right) == {}
    assert fractions_out_of_range({"tau": 3.2, "loss": 7.0}) == {}  # not fractions
    wrong = {**right, "acc_per_slot": [0.5, -0.1, 1.0], "selector_acc": 25.3, "selector_recall": float("nan")}
    found = fractions_out_of_range(wrong)
    assert list(found) == ["acc_per_slot[2]", "selector_acc", "selector_recall"]
    assert found["acc_per_slot[2]"] == -0.1 and found["selector_acc"] == 25.3
