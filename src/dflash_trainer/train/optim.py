"""AdamW over the drafter's fp32 master weights and the learning-rate schedule: a linear warmup, then either a cosine
to `min_lr_ratio` over the remaining steps (`optim.schedule: cosine`) or warmup-stable-decay (`wsd`: the peak held
until the last `decay_ratio` of the steps, then a linear decay to `min_lr_ratio`). Why WSD: the drafter is far from
converged within a main job's budget (DFlash2 at 3 epochs is behind the 6-epoch run at equal steps, while its cosine
has already decayed: benchmarks/EXPERIMENTS.md #15), and a schedule that keeps the peak longer spends more of the
steps learning at it. Both are functions of the step alone, so a resumed run continues the same curve."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..config import OptimConfig


def build_optimizer(model: nn.Module, config: OptimConfig, *, fused: bool = False) -> torch.optim.AdamW:
    """Weight decay on matrices only: norms (1-D weights) and biases are not decayed, as in most LLM recipes; nor are
    DFlash2's convolution kernels ([2, taps, H], identity at the start: decay would pull them off it)."""
    decay, no_decay = [], []
    for parameter in model.parameters():
        if not parameter.requires_grad:
            continue
        (decay if parameter.ndim == 2 else no_decay).append(parameter)
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=config.lr, betas=tuple(config.betas), eps=config.eps, fused=fused)


def lr_factor(
    step: int, *, total_steps: int, warmup_steps: int, min_ratio: float, schedule: str = "cosine", decay_steps: int = 0
) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based): linear warmup over `warmup_steps`, then
    `cosine` to `min_ratio` at `total_steps`, or `wsd`: 1 until the last `decay_steps` steps, then linear down to
    `min_ratio` at the last step."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "cosine":
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "wsd":
        decay_start = total_steps - decay_steps
        if step < decay_start:
            return 1.0
        # The decay's first step is already below the peak and its last (total_steps - 1) at min_ratio.
        progress = min(1.0, (step - decay_start + 1) / max(1, decay_steps))
        return min_ratio + (1.0 - min_ratio) * (1.0 - progress)
    raise ValueError(f"unknown lr schedule {schedule!r} (cosine or wsd)")


def build_scheduler(
    optimizer: torch.optim.Optimizer, config: OptimConfig, *, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    warmup_steps = round(config.warmup_ratio * total_steps)
    # WSD's decay never reaches into the warmup: at most the steps after it.
    decay_steps = min(round(config.decay_ratio * total_steps), total_steps - warmup_steps)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_factor(
            step,
            total_steps=total_steps,
            warmup_steps=warmup_steps,
            min_ratio=config.min_lr_ratio,
            schedule=config.schedule,
            decay_steps=decay_steps,
        ),
    )
