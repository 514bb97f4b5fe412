"""AdamW over the drafter's fp32 master weights and a linear-warmup cosine schedule."""

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


def cosine_lr_factor(step: int, *, total_steps: int, warmup_steps: int, min_ratio: float) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based): linear warmup, then cosine to min_ratio."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, config: OptimConfig, *, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    warmup_steps = round(config.warmup_ratio * total_steps)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: cosine_lr_factor(
            step, total_steps=total_steps, warmup_steps=warmup_steps, min_ratio=config.min_lr_ratio
        ),
    )
