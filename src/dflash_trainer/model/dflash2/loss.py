"""The selector's training term and its metrics (the base token loss is DFlash's, `model/loss.py`, unchanged).

z-lab published DFlash2's forward but not its objective; this is our reading, with the choices the public trainers
made as options (`loss.selector` in the recipe, `SelectorLossConfig`):

    term_i = CE over the k candidates of slot i of  score_i(c) = u_i(c) + < A[p_i] * (P h_i), C[c] >
             p_i = the *label* of slot i-1 (teacher forcing; slot 1: the block's slot-0 token),
             target = the index of slot i's label among the candidates
    L_sel  = sum_i m_i w_i term_i / sum_i m_i w_i          (w_i: DFlash's exponential slot weights)
    L      = L_base + alpha(step) * L_sel

- Teacher forcing is exact where it matters: along a block's accepted prefix every earlier draft equals its
  label, so the predecessor the engines' walk (`selector.py`) conditions on is the label. The leading run of
  teacher-forced correct choices is therefore the exact number of drafts the walk gets accepted (with labels from
  the target, i.e. regenerated data or `label_source: target_argmax`): `prefix_acceptance` below is the tau of
  the selector on the training blocks, not an estimate.
- A label outside the candidates cannot be chosen when served. Default: the slot has no selector term (SpecForge,
  NeMo); `gold_injection` instead puts the label in place of the weakest candidate, for the loss only
  (speculators). Metrics always use the candidates as served.
- `stop_gradient` detaches the drafter's hidden state inside this term (SpecForge's option), so only the selector's
  own parameters learn from it; default off: the term also sharpens the unary ranking among the candidates and
  teaches the hidden state what the selector's gate reads.
- alpha(step): 0 for `warmup_ratio` of the run, then linear over `ramp_ratio`, then `weight` (SpecForge).
- Normalised by its own weight sum (counted slots only), so its scale does not move with the candidate recall.

Memory and compute, as in `model/loss.py`: [slots, V] logits never exist for the whole batch. An autograd Function
walks the blocks in chunks; per chunk it computes the logits (for the top-k only), the candidates' scores in a
small local graph, and right away the gradients with respect to the hidden states and the selector's parameters
(the codebook rows it touched, added into dense [V, r] buffers); backward scales them by the incoming scalar. The
extra cost over DFlash is one more LM-head matmul per slot (the top-k; the base loss computes its own logits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from ..loss import default_gamma, expected_acceptance, slot_weights
from .selector import CandidateSelector


def selector_weight_at(step: int, total_steps: int, *, weight: float, warmup_ratio: float, ramp_ratio: float) -> float:
    """alpha at optimizer step `step` (0-based) of `total_steps`: 0 in the warmup, a linear ramp, then `weight`."""
    warmup = warmup_ratio * total_steps
    ramp = ramp_ratio * total_steps
    if step < warmup:
        return 0.0
    if step < warmup + ramp:
        return weight * (step - warmup + 1) / (ramp + 1)
    return weight


@dataclass
class SelectorMetrics:
    """Sum/total pairs (float64 device tensors, reducible over micro-batches and ranks like `LossMetrics`)."""

    loss_sum: Tensor  # []: sum of m * w * CE
    weight_sum: Tensor  # []: sum of m * w over counted slots
    correct_per_slot: Tensor  # [B]: valid slots where the selector picks the label among the served candidates
    recall_per_slot: Tensor  # [B]: valid slots whose label is among the candidates
    count_per_slot: Tensor  # [B]: valid slots
    prefix_sum: Tensor  # []: per block, the leading run of correct choices (= drafts the walk gets accepted)
    prefix_blocks: Tensor  # []: blocks whose slot 1 is valid

    @classmethod
    def zeros(cls, block_size: int, *, device: torch.device | str | None = None) -> SelectorMetrics:
        return cls.from_tensor(torch.zeros(4 + 3 * block_size, dtype=torch.float64, device=device))

    @property
    def block_size(self) -> int:
        return self.count_per_slot.shape[0]

    def to_tensor(self) -> Tensor:
        scalars = torch.stack([self.loss_sum, self.weight_sum, self.prefix_sum, self.prefix_blocks])
        return torch.cat([scalars, self.correct_per_slot, self.recall_per_slot, self.count_per_slot]).double()

    @classmethod
    def from_tensor(cls, flat: Tensor) -> SelectorMetrics:
        block = (flat.shape[0] - 4) // 3
        return cls(
            loss_sum=flat[0],
            weight_sum=flat[1],
            prefix_sum=flat[2],
            prefix_blocks=flat[3],
            correct_per_slot=flat[4 : 4 + block],
            recall_per_slot=flat[4 + block : 4 + 2 * block],
            count_per_slot=flat[4 + 2 * block :],
        )

    def add_(self, other: SelectorMetrics) -> SelectorMetrics:
        if other.block_size != self.block_size:
            raise ValueError(f"SelectorMetrics.add_: block size {other.block_size} is not {self.block_size}")
        for name in ("loss_sum", "weight_sum", "prefix_sum", "prefix_blocks"):
            getattr(self, name).add_(getattr(other, name))
        for name in ("correct_per_slot", "recall_per_slot", "count_per_slot"):
            getattr(self, name).add_(getattr(other, name))
        return self

    def mean_loss(self) -> Tensor:
        return torch.where(self.weight_sum > 0, self.loss_sum / self.weight_sum.clamp_min(1e-30), 0.0)

    def accuracy(self) -> Tensor:
        """Pooled over slots 1..B-1: the selector's choice (teacher-forced) is the label."""
        return self.correct_per_slot.sum() / self.count_per_slot.sum().clamp_min(1.0)

    def recall(self) -> Tensor:
        """Pooled over slots 1..B-1: the label is among the candidates (the selector's ceiling)."""
        return self.recall_per_slot.sum() / self.count_per_slot.sum().clamp_min(1.0)

    def expected_acceptance(self) -> Tensor:
        """E[tau] with the selector: 1 + sum_k prod_{j<=k} acc_j of its per-slot accuracies."""
        return expected_acceptance(self.correct_per_slot, self.count_per_slot)

    def prefix_acceptance(self) -> Tensor:
        """tau of the selector's walk on the training blocks: 1 + mean accepted prefix (module docstring)."""
        return 1.0 + torch.where(self.prefix_blocks > 0, self.prefix_sum / self.prefix_blocks.clamp_min(1.0), 0.0)


@dataclass
class SelectorOutput:
    loss: Tensor  # []: L_sel, differentiable w.r.t. hidden (unless stop_gradient) and the selector's parameters
    metrics: SelectorMetrics


@dataclass(frozen=True)
class _Spec:
    slot_weight: Tensor  # [B-1] in the score dtype
    score_dtype: torch.dtype  # float32 (float64 for float64 inputs)
    top_k: int
    chunk_blocks: int
    gold_injection: bool
    grad_hidden: bool
    grad_selector: bool


def selector_loss(
    hidden: Tensor,  # [R, N, B, H] drafter output after its final norm
    lm_head_weight: Tensor,  # [V, H] the target's frozen LM head
    selector: CandidateSelector,
    labels: Tensor,  # [R, N, B] int64: slot k's label
    predecessors: Tensor,  # [R, N, B] int64: the token before slot k (slot 1: the block's slot-0 token)
    valid: Tensor,  # [R, N, B] bool
    *,
    gamma: float | None,
    gold_injection: bool = False,
    stop_gradient: bool = False,
    chunk_blocks: int = 64,
    lm_head_bias: Tensor | None = None,  # [V]
) -> SelectorOutput:
    """L_sel and the selector's metrics (module docstring). Logits in hidden's dtype, scores in float32 (float64
    for float64 inputs)."""
    rows, num_blocks, block_size, width = hidden.shape
    for name, tensor in (("labels", labels), ("predecessors", predecessors), ("valid", valid)):
        if tensor.shape != hidden.shape[:3]:
            raise ValueError(f"selector_loss: {name} must be [R, N, B]={tuple(hidden.shape[:3])}, got {tensor.shape}")
    if chunk_blocks < 1:
        raise ValueError(f"selector_loss: chunk_blocks must be >= 1, got {chunk_blocks}")
    gamma = default_gamma(block_size) if gamma is None else gamma
    projection = selector.hidden_projection.weight
    grad_enabled = torch.is_grad_enabled()
    score_dtype = torch.promote_types(hidden.dtype, torch.float32)
    spec = _Spec(
        slot_weight=slot_weights(block_size, gamma, device=hidden.device, dtype=score_dtype)[1:],
        score_dtype=score_dtype,
        top_k=selector.top_k,
        chunk_blocks=chunk_blocks,
        gold_injection=gold_injection,
        grad_hidden=grad_enabled and hidden.requires_grad and not stop_gradient,
        grad_selector=grad_enabled and projection.requires_grad,
    )
    blocks = rows * num_blocks
    loss_sum, weight_sum, flat_metrics = _ChunkedSelectorLoss.apply(
        hidden.reshape(blocks, block_size, width),
        projection,
        selector.predecessor_codebook,
        selector.successor_codebook,
        lm_head_weight,
        lm_head_bias,
        labels.reshape(blocks, block_size),
        predecessors.reshape(blocks, block_size),
        valid.reshape(blocks, block_size),
        spec,
    )
    safe_weight = torch.where(weight_sum > 0, weight_sum, torch.ones_like(weight_sum))
    return SelectorOutput(loss=loss_sum / safe_weight, metrics=SelectorMetrics.from_tensor(flat_metrics))


class _ChunkedSelectorLoss(torch.autograd.Function):
    """Outputs: loss_sum (differentiable), weight_sum and the flat metrics [4 + 3B] (not differentiable)."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        hidden: Tensor,  # [M, B, H]
        projection: Tensor,  # [r, H]
        predecessor_codebook: Tensor,  # [V, r]
        successor_codebook: Tensor,  # [V, r]
        lm_head_weight: Tensor,  # [V, H]
        lm_head_bias: Tensor | None,  # [V]
        labels: Tensor,  # [M, B]
        predecessors: Tensor,  # [M, B]
        valid: Tensor,  # [M, B]
        spec: _Spec,
    ) -> tuple[Tensor, Tensor, Tensor]:
        blocks, block_size, _ = hidden.shape
        device = hidden.device
        grads = _Grads.empty(hidden, projection, predecessor_codebook, successor_codebook, spec)
        metrics = SelectorMetrics.zeros(block_size, device=device)
        with torch.autocast(device_type=device.type, enabled=False):
            weight = lm_head_weight.to(hidden.dtype)
            bias = None if lm_head_bias is None else lm_head_bias.to(hidden.dtype)
            for start in range(0, blocks, spec.chunk_blocks):
                chunk = slice(start, start + spec.chunk_blocks)
                # Slot 0 carries no term (the anchor); slots 1..B-1 of the chunk's blocks.
                part = _ChunkInputs(
                    blocks=chunk,
                    hidden=hidden[chunk, 1:],
                    labels=labels[chunk, 1:],
                    predecessors=predecessors[chunk, 1:],
                    valid=valid[chunk, 1:],
                )
                _chunk(part, weight, bias, projection, predecessor_codebook, successor_codebook, spec, grads, metrics)
        loss_sum, weight_sum = metrics.loss_sum.to(spec.score_dtype), metrics.weight_sum.to(spec.score_dtype)
        ctx.save_for_backward(*grads.tensors())
        ctx.grad_hidden, ctx.grad_selector = spec.grad_hidden, spec.grad_selector
        flat = metrics.to_tensor()
        ctx.mark_non_differentiable(weight_sum, flat)
        return loss_sum, weight_sum, flat

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_loss_sum: Tensor, *_: Tensor) -> tuple[Tensor | None, ...]:
        hidden, projection, predecessor, successor = (
            None if tensor.numel() == 0 else tensor * grad_loss_sum.to(tensor.dtype) for tensor in ctx.saved_tensors
        )
        return hidden, projection, predecessor, successor, None, None, None, None, None, None


@dataclass
class _ChunkInputs:
    blocks: slice  # which of the M blocks
    hidden: Tensor  # [C, S, H]
    labels: Tensor  # [C, S]
    predecessors: Tensor  # [C, S]
    valid: Tensor  # [C, S]


@dataclass
class _Grads:
    """Gradients of the loss sum, filled chunk by chunk (empty tensors where none is needed)."""

    hidden: Tensor  # [M, B, H]
    projection: Tensor  # [r, H]
    predecessor: Tensor  # [V, r]
    successor: Tensor  # [V, r]

    @classmethod
    def empty(cls, hidden: Tensor, projection: Tensor, predecessor: Tensor, successor: Tensor, spec: _Spec) -> _Grads:
        def buffer(like: Tensor, needed: bool) -> Tensor:
            return torch.zeros_like(like) if needed else like.new_empty(0)

        return cls(
            hidden=buffer(hidden, spec.grad_hidden),
            projection=buffer(projection, spec.grad_selector),
            predecessor=buffer(predecessor, spec.grad_selector),
            successor=buffer(successor, spec.grad_selector),
        )

    def tensors(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return self.hidden, self.projection, self.predecessor, self.successor


def _chunk(
    part: _ChunkInputs,
    weight: Tensor,  # [V, H] in hidden's dtype
    bias: Tensor | None,
    projection: Tensor,
    predecessor_codebook: Tensor,
    successor_codebook: Tensor,
    spec: _Spec,
    grads: _Grads,
    metrics: SelectorMetrics,
) -> None:
    chunk, slots, width = part.hidden.shape
    with torch.no_grad():
        logits = F.linear(part.hidden.reshape(chunk * slots, width), weight, bias)  # [C*S, V]
        # The top-k of the logits as computed (bf16 on a GPU, as the engines rank them), highest first.
        ids = torch.topk(logits, spec.top_k, dim=-1).indices.view(chunk, slots, spec.top_k)
        del logits
        hit = ids == part.labels.unsqueeze(-1)  # [C, S, K]
        present = hit.any(dim=-1)  # [C, S]: the label is among the served candidates
        if spec.gold_injection:
            # The label replaces the weakest candidate where it is missing (loss only; metrics use `present`).
            last = torch.arange(spec.top_k, device=ids.device) == spec.top_k - 1
            inject = ~present.unsqueeze(-1) & last
            ids = torch.where(inject, part.labels.unsqueeze(-1), ids)
            hit = hit | inject
        target = hit.to(torch.int64).argmax(dim=-1)  # [C, S]: the label's index (0 where absent and not injected)
        counted = part.valid & (present | spec.gold_injection)
        slot_weight = torch.where(counted, spec.slot_weight, 0.0)  # [C, S]

    leaves = []
    with torch.enable_grad():
        hidden = part.hidden.detach().requires_grad_(spec.grad_hidden)
        gate_weight = projection.detach().requires_grad_(spec.grad_selector)
        # Codebook rows as leaves: their gradients are added into the dense buffers at the rows' ids.
        before = F.embedding(part.predecessors, predecessor_codebook).detach().requires_grad_(spec.grad_selector)
        after = F.embedding(ids, successor_codebook).detach().requires_grad_(spec.grad_selector)
        head_rows = F.embedding(ids, weight)  # [C, S, K, H], constant
        dtype = spec.score_dtype
        unary = (head_rows @ hidden.unsqueeze(-1)).squeeze(-1).to(dtype)  # [C, S, K]
        if bias is not None:
            unary = unary + bias[ids].to(dtype)
        gate = F.linear(hidden.to(dtype), gate_weight.to(dtype))  # [C, S, r]
        transition = ((before.to(dtype) * gate).unsqueeze(-2) @ after.to(dtype).transpose(-1, -2)).squeeze(-2)
        scores = unary + transition  # [C, S, K]
        ce = torch.logsumexp(scores, dim=-1) - scores.gather(-1, target.unsqueeze(-1)).squeeze(-1)  # [C, S]
        chunk_loss = (torch.where(counted, ce, 0.0) * slot_weight).sum()
        if spec.grad_hidden:
            leaves.append(hidden)
        if spec.grad_selector:
            leaves += [gate_weight, before, after]
        chunk_grads = torch.autograd.grad(chunk_loss, leaves) if leaves else ()

    with torch.no_grad():
        chunk_grads = list(chunk_grads)
        if spec.grad_hidden:
            grads.hidden[part.blocks, 1:] = chunk_grads.pop(0).to(grads.hidden.dtype)
        if spec.grad_selector:
            grad_gate, grad_before, grad_after = chunk_grads
            grads.projection.add_(grad_gate.to(grads.projection.dtype))
            rank = grads.predecessor.shape[1]
            grad_before = grad_before.reshape(-1, rank).to(grads.predecessor.dtype)
            grads.predecessor.index_add_(0, part.predecessors.reshape(-1), grad_before)
            grads.successor.index_add_(0, ids.reshape(-1), grad_after.reshape(-1, rank).to(grads.successor.dtype))
        correct = part.valid & present & (scores.argmax(dim=-1) == target)  # [C, S]
        prefix = torch.cumprod(correct.to(torch.int64), dim=1).sum(dim=1)  # [C]
        metrics.loss_sum.add_(chunk_loss.detach().double())
        metrics.weight_sum.add_(slot_weight.sum().double())
        metrics.prefix_sum.add_(prefix.sum().double())
        metrics.prefix_blocks.add_(part.valid[:, 0].sum().double())
        metrics.correct_per_slot[1:].add_(correct.sum(dim=0).double())
        metrics.recall_per_slot[1:].add_((part.valid & present).sum(dim=0).double())
        metrics.count_per_slot[1:].add_(part.valid.sum(dim=0).double())
