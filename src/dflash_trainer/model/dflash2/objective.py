"""The trainer's side of DFlash2's selector term: its inputs from a batch, its schedule, its metrics window.

`Trainer` (train/trainer.py) holds one `SelectorObjective` when `drafter.algorithm` is dflash2 and calls
`add_term` after the base loss of every micro-batch, `end_step` after every optimizer step and `log_values` on log
steps. The selector learns the labels the base loss trains on: the data tokens (`label_source` data, and soft,
whose targets are distributions), or the target's greedy tokens (target_argmax). The predecessors follow from the
blocks: slot 1's is the block's slot-0 token (the anchor), slot k's the label of slot k-1 (`loss.py`, teacher
forcing).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..loss import LossOutput
from .loss import SelectorMetrics, selector_weight_at
from .selector import CandidateSelector


class SelectorObjective:
    def __init__(
        self,
        *,
        block_size: int,
        gamma: float,
        chunk_blocks: int,
        weight: float,
        warmup_ratio: float,
        ramp_ratio: float,
        gold_injection: bool,
        stop_gradient: bool,
        device: torch.device,
        compile: bool = False,
    ) -> None:
        self.block_size = block_size
        self.gamma = gamma
        self.chunk_blocks = chunk_blocks
        self.weight = weight
        self.warmup_ratio = warmup_ratio
        self.ramp_ratio = ramp_ratio
        self.gold_injection = gold_injection
        self.stop_gradient = stop_gradient
        self.device = device
        self.compile = compile  # the term's per-chunk function compiled (CUDA), as `loss.compile` does the base's
        self._step = SelectorMetrics.zeros(block_size, device=device)
        self._window = SelectorMetrics.zeros(block_size, device=device)
        self._alpha = 0.0

    def add_term(
        self,
        base: LossOutput,
        *,
        selector: CandidateSelector,
        hidden: Tensor,  # [R, N, B, H]
        lm_head_weight: Tensor,
        lm_head_bias: Tensor | None,
        block_ids: Tensor,  # [R, N, B]: slot 0 holds the anchor token
        labels: Tensor,  # [R, N, B]
        valid: Tensor,  # [R, N, B]
        step: int,
        total_steps: int,
    ) -> LossOutput:
        """`base` with alpha(step) * L_sel added to its loss (its metrics stay the base's). The candidates are
        `base.candidates` where the base loss ranked them (`dflash_loss(candidates_top_k=K)`: one LM head per slot
        for both terms), else the selector runs the LM head itself."""
        predecessors = torch.cat([block_ids[..., :1], labels[..., :-1]], dim=-1)  # [R, N, B]
        # Through the selector's forward (`selector_loss` inside), not `selector_loss` directly: under FSDP2 the
        # call is what gathers the selector's parameters and has their gradients reduce-scattered.
        out = selector(
            hidden,
            lm_head_weight,
            labels,
            predecessors,
            valid,
            gamma=self.gamma,
            gold_injection=self.gold_injection,
            stop_gradient=self.stop_gradient,
            chunk_blocks=self.chunk_blocks,
            lm_head_bias=lm_head_bias,
            candidates=base.candidates,
            compile=self.compile,
        )
        self._alpha = selector_weight_at(
            step, total_steps, weight=self.weight, warmup_ratio=self.warmup_ratio, ramp_ratio=self.ramp_ratio
        )
        self._step.add_(out.metrics)
        return LossOutput(loss=base.loss + self._alpha * out.loss, loss_sum=base.loss_sum, metrics=base.metrics)

    def end_step(self, skipped: Tensor) -> None:
        """After an optimizer step; `skipped` (a 0-dim device flag): the step was non-finite and does not count."""
        self._window.add_(SelectorMetrics.from_tensor(torch.where(skipped > 0, 0.0, self._step.to_tensor())))
        self._step = SelectorMetrics.zeros(self.block_size, device=self.device)

    def log_values(self, group: dist.ProcessGroup | None, group_size: int) -> dict[str, float]:
        """The window's selector metrics (summed over the group's ranks) as host numbers; resets the window."""
        flat = self._window.to_tensor()
        if group_size > 1:
            dist.all_reduce(flat, group=group)
        metrics = SelectorMetrics.from_tensor(flat)
        values = torch.stack(
            [
                metrics.mean_loss(),
                metrics.accuracy(),
                metrics.recall(),
                metrics.expected_acceptance(),
                metrics.prefix_acceptance(),
            ]
        ).tolist()  # sync (log steps only)
        self._window = SelectorMetrics.zeros(self.block_size, device=self.device)
        names = ("selector_loss", "selector_acc", "selector_recall", "selector_tau", "selector_tau_prefix")
        return {**dict(zip(names, values, strict=True)), "selector_weight": self._alpha}
