"""Optional noise on the target features the drafter reads, and its linear annealing schedule.

Noise makes the drafter robust to the small differences between the hidden states it sees in training and the
ones the serving engine's target produces (other kernels, precision, batch shapes).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

NoiseKind = Literal["none", "uniform", "gaussian"]


def add_feature_noise(
    features: Tensor,  # [..., F]
    *,
    kind: NoiseKind,
    std: float,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Returns features plus zero-mean noise of standard deviation `std` (a new tensor; the input is untouched).

    "uniform" draws from U(-std*sqrt(3), std*sqrt(3)), whose standard deviation is `std`, so both kinds are
    comparable at the same setting. "none", or std 0, returns `features` itself. The noise is drawn in the
    features' dtype and device; a `generator` must live on that device."""
    if kind not in ("none", "uniform", "gaussian"):
        raise ValueError(f"add_feature_noise: kind must be 'none', 'uniform' or 'gaussian', got {kind!r}")
    if not std >= 0.0:
        raise ValueError(f"add_feature_noise: std must be >= 0, got {std}")
    if kind == "none" or std == 0.0:
        return features
    if not features.is_floating_point():
        raise ValueError(f"add_feature_noise: features must be floating point, got {features.dtype}")
    if kind == "uniform":
        half_width = std * math.sqrt(3.0)
        noise = torch.rand(features.shape, generator=generator, dtype=features.dtype, device=features.device)
        noise = noise.mul_(2.0 * half_width).sub_(half_width)
    else:
        noise = torch.randn(features.shape, generator=generator, dtype=features.dtype, device=features.device)
        noise = noise.mul_(std)
    return noise.add_(features)


def noise_std_at(step: int, total_steps: int, start: float, end: float) -> float:
    """Noise std at an optimizer step, linear from `start` at step 0 to `end` at `total_steps`, then held at
    `end`. With total_steps <= 0 there is no schedule to run and the result is `end`."""
    if total_steps <= 0 or step >= total_steps:
        return end
    fraction = max(step, 0) / total_steps
    return start + (end - start) * fraction
