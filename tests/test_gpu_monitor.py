"""gpu_monitor: nvidia-smi's samples parsed and summarised, and the sampling child started and stopped around a
block (a fake nvidia-smi stands in on the CPU)."""

from __future__ import annotations

import stat

import torch

from dflash_trainer import gpu_monitor
from dflash_trainer.gpu_monitor import ClockReading, GpuMonitor, parse_samples, summarize


def test_parse_skips_unreadable_lines_and_summarize_takes_medians():
    text = "1980, 350.5\n[N/A], 12\n1755, 690.1\n1830, 701.0\ngarbage\n1830,"
    samples = parse_samples(text)
    assert samples == [(1980.0, 350.5), (1755.0, 690.1), (1830.0, 701.0)]
    assert summarize(samples) == ClockReading(sm_clock_mhz=1830.0, power_w=690.1, samples=3)
    assert summarize(samples[:2]) is None  # too few to say anything about a phase


def test_monitor_reads_none_without_a_cuda_device():
    with GpuMonitor(torch.device("cpu")) as monitor:
        pass
    assert monitor.reading is None


def test_monitor_samples_from_a_child_process_until_the_block_ends(tmp_path, monkeypatch):
    fake = tmp_path / "nvidia-smi"
    # Prints a sample every 10 ms until terminated, as `nvidia-smi --loop-ms` does; checks the query it is given.
    fake.write_text(
        "#!/bin/sh\n"
        'case "$*" in *--id=GPU-test*--query-gpu=clocks.sm,power.draw*) ;; *) echo "bad args: $*" >&2; exit 2;; esac\n'
        "while true; do echo '1700, 650.0'; sleep 0.01; done\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(gpu_monitor, "device_selector", lambda device: "GPU-test")
    with GpuMonitor(torch.device("cpu"), command=str(fake)) as monitor:
        import time

        time.sleep(0.3)
    assert monitor.reading is not None
    assert monitor.reading.sm_clock_mhz == 1700.0 and monitor.reading.power_w == 650.0
    assert monitor.reading.samples >= 3
