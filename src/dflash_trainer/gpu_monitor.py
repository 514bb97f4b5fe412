"""The GPU's SM clock and board power while a benchmark runs, sampled by `nvidia-smi` in a child process.

Contract: `with GpuMonitor(device) as monitor: ...` samples every `interval_ms` from entering to leaving; afterwards
`monitor.reading` is a `ClockReading` (median SM clock in MHz, median power in W, the sample count) or None when
nothing could be sampled (no CUDA device, no `nvidia-smi`, or fewer than `MIN_SAMPLES` samples). Sampling never
fails the benchmark it watches: a monitor that cannot run says so once and reads None.

Why: a kernel timed alone and the same kernel inside a training step can run at different clocks. A step that
keeps the tensor cores busy draws the board's power limit and the SM clock drops below its maximum, so every kernel
of the step, GEMM or flex attention, is slower than in a bench that times it alone at a lower power (2026-12-01:
the step's flex backward took 7.0 ms per layer against 5.4 ms alone, unexplained without the clocks). The child
process samples the device from outside, so the measured code is unchanged (no sync, no host work in the step).
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
from dataclasses import dataclass

import torch

# Fewer samples than this say nothing about a phase's clock (the first sample can precede the work).
MIN_SAMPLES = 3


@dataclass(frozen=True)
class ClockReading:
    sm_clock_mhz: float
    power_w: float
    samples: int


def parse_samples(text: str) -> list[tuple[float, float]]:
    """(SM clock MHz, power W) per line of `nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv,noheader,
    nounits` output; lines that do not parse (a `[N/A]`, a partial last line) are skipped."""
    samples = []
    for line in text.splitlines():
        fields = [field.strip() for field in line.split(",")]
        if len(fields) != 2:
            continue
        try:
            samples.append((float(fields[0]), float(fields[1])))
        except ValueError:
            continue
    return samples


def summarize(samples: list[tuple[float, float]]) -> ClockReading | None:
    if len(samples) < MIN_SAMPLES:
        return None
    return ClockReading(
        sm_clock_mhz=statistics.median(clock for clock, _ in samples),
        power_w=statistics.median(power for _, power in samples),
        samples=len(samples),
    )


def device_selector(device: torch.device) -> str | None:
    """`nvidia-smi --id` value for a CUDA device: its UUID (the index differs under CUDA_VISIBLE_DEVICES)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    uuid = str(getattr(torch.cuda.get_device_properties(device), "uuid", "") or "")
    if not uuid:
        return None
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"


class GpuMonitor:
    def __init__(self, device: torch.device, *, interval_ms: int = 100, command: str = "nvidia-smi") -> None:
        self.interval_ms = interval_ms
        self.reading: ClockReading | None = None
        self._selector = device_selector(device)
        self._command = shutil.which(command)
        self._process: subprocess.Popen[str] | None = None

    def __enter__(self) -> GpuMonitor:
        if self._selector is None or self._command is None:
            return self
        try:
            self._process = subprocess.Popen(
                [
                    self._command,
                    f"--id={self._selector}",
                    "--query-gpu=clocks.sm,power.draw",
                    "--format=csv,noheader,nounits",
                    f"--loop-ms={self.interval_ms}",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
        except OSError as error:
            print(f"gpu monitor: could not start {self._command}: {error}")
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._process is None:
            return
        self._process.terminate()
        try:
            output, _ = self._process.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            output, _ = self._process.communicate()
        self._process = None
        self.reading = summarize(parse_samples(output))


def describe(sm_clock_mhz: float | None, power_w: float | None) -> str:
    if sm_clock_mhz is None or power_w is None:
        return "SM clock n/a"
    return f"SM clock {sm_clock_mhz:.0f} MHz, {power_w:.0f} W (medians)"
