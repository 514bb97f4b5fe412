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
walks the blocks in chunks; per chunk it scores the candidates and right away forms the gradients with respect to
the hidden states and the selector's parameters (written out as autograd would form them, the same products and
casts; the codebook rows it touched are added into dense [V, r] buffers); backward scales them by the incoming
scalar. With `embedding` codebooks (`selector.py`) the [V, r] codebooks are the maps applied to the vocabulary once
per call, and autograd takes those [V, r] gradients on to the maps. The candidates come from the base loss, which
ranks the logits it computes anyway (`dflash_loss`'s `candidates_top_k`), so DFlash2 runs the LM head once per
slot as DFlash does; only with the FP8 head (whose logits are not the bf16 ones the engines rank) or when called
alone does a chunk run the head for its top-k itself.
On CUDA the per-chunk function is compiled (`compile`, static shapes on blocks padded to whole chunks, as the base
loss): eager, its ~80 small ops and an autograd call per chunk left the GPU idle about two thirds of a SmolLM2 step
(benchmarks/BENCHMARKS.md, 2026-12-03).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from ...compiling import configure_compiler
from ..loss import default_gamma, expected_acceptance, slot_weights, top_k_ids
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
        """E[tau] with the selector: 1 + sum_k prod_{j<=k} acc_j of its per-slot accuracies (`selector_tau`).

        Not comparable with the base loss's E[tau] (`tau`, DFlash's argmax drafts): acc_j here is teacher-forced
        over all valid slots, so it counts slot j right after an earlier miss of the same block (the gold predecessor
        lets the selector recover), which the walk never gets to use; the product treats the slots as independent,
        and the argmax drafter's misses, strongly correlated within a block, make its product fall further below its
        exact tau than the selector's does. Compare `prefix_acceptance` (exact: the walk's accepted length on these
        blocks, `tests/test_dflash2_consistency.py`) with the base's `tau_prefix`: on the GPU main job the first
        ratio read 1.35x against DFlash, the exact one 1.13x, held out 1.14-1.17x (benchmarks/EXPERIMENTS.md)."""
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
    compile: bool  # the per-chunk function compiled (CUDA), on whole chunks


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
    candidates: Tensor | None = None,  # [R, N, B-1, K] int64
    compile: bool = False,
) -> SelectorOutput:
    """L_sel and the selector's metrics (module docstring). Logits in hidden's dtype, scores in float32 (float64
    for float64 inputs). `candidates`: the top-k ids of slots 1..B-1 already taken from these logits (the base
    loss's, `dflash_loss(candidates_top_k=K)`), so that the LM head runs once per slot; None: computed here.
    `compile`: the per-chunk function compiled (CUDA only; elsewhere it is ignored)."""
    rows, num_blocks, block_size, width = hidden.shape
    for name, tensor in (("labels", labels), ("predecessors", predecessors), ("valid", valid)):
        if tensor.shape != hidden.shape[:3]:
            raise ValueError(f"selector_loss: {name} must be [R, N, B]={tuple(hidden.shape[:3])}, got {tensor.shape}")
    expected = (rows, num_blocks, block_size - 1, selector.top_k)
    if candidates is not None and tuple(candidates.shape) != expected:
        raise ValueError(f"selector_loss: candidates must be [R, N, B-1, K]={expected}, got {tuple(candidates.shape)}")
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
        compile=compile and hidden.device.type == "cuda",
    )
    blocks = rows * num_blocks
    predecessor_codebook, successor_codebook = selector.codebooks()  # [V, r] each (maps of the embedding, or free)
    loss_sum, weight_sum, flat_metrics = _ChunkedSelectorLoss.apply(
        hidden.reshape(blocks, block_size, width),
        projection,
        predecessor_codebook,
        successor_codebook,
        lm_head_weight,
        lm_head_bias,
        labels.reshape(blocks, block_size),
        predecessors.reshape(blocks, block_size),
        valid.reshape(blocks, block_size),
        None if candidates is None else candidates.reshape(blocks, block_size - 1, selector.top_k),
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
        candidates: Tensor | None,  # [M, B-1, K]
        spec: _Spec,
    ) -> tuple[Tensor, Tensor, Tensor]:
        hidden = hidden.detach()  # one requires_grad state for the compiled chunk (as the base loss: model/loss.py)
        blocks, block_size, _ = hidden.shape
        device = hidden.device
        grads = _Grads.empty(hidden, projection, predecessor_codebook, successor_codebook, spec)
        totals = torch.zeros(4, dtype=torch.float64, device=device)  # loss, weight, prefix sums, prefix blocks
        per_slot = torch.zeros(3, block_size - 1, dtype=torch.float64, device=device)  # correct, recall, count
        chunk_fn = _compiled_selector_chunk() if spec.compile else _selector_chunk
        step = spec.chunk_blocks
        if spec.compile and blocks % step:
            # Whole chunks only, so the compiled function sees one shape: pad with invalid blocks (dropped below).
            extra = step - blocks % step
            hidden = F.pad(hidden, (0, 0, 0, 0, 0, extra))
            labels, predecessors = F.pad(labels, (0, 0, 0, extra)), F.pad(predecessors, (0, 0, 0, extra))
            valid = F.pad(valid, (0, 0, 0, extra), value=False)
            candidates = None if candidates is None else F.pad(candidates, (0, 0, 0, 0, 0, extra))
        rank = projection.shape[0]
        with torch.autocast(device_type=device.type, enabled=False):
            weight = lm_head_weight.to(hidden.dtype)
            bias = None if lm_head_bias is None else lm_head_bias.to(hidden.dtype)
            for start in range(0, blocks, step):
                chunk = slice(start, start + step)
                kept = min(step, blocks - start)  # the chunk's real blocks (the rest is padding)
                # Slot 0 carries no term (the anchor); slots 1..B-1 of the chunk's blocks.
                out = chunk_fn(
                    hidden[chunk, 1:],
                    None if candidates is None else candidates[chunk],
                    weight,
                    bias,
                    projection,
                    predecessor_codebook,
                    successor_codebook,
                    labels[chunk, 1:],
                    predecessors[chunk, 1:],
                    valid[chunk, 1:],
                    spec.slot_weight,
                    top_k=spec.top_k,
                    gold_injection=spec.gold_injection,
                    grad_hidden=spec.grad_hidden,
                    grad_selector=spec.grad_selector,
                )
                totals += out.totals
                per_slot += out.per_slot
                if spec.grad_hidden:
                    grads.hidden[start : start + kept, 1:] = out.grad_hidden[:kept].to(grads.hidden.dtype)
                if spec.grad_selector:
                    # The codebook rows the chunk read get their gradients added at their ids.
                    grads.projection.add_(out.grad_projection.to(grads.projection.dtype))
                    before_ids = predecessors[start : start + kept, 1:].reshape(-1)
                    grads.predecessor.index_add_(0, before_ids, out.grad_before[:kept].reshape(-1, rank))
                    after_ids = out.ids[:kept].reshape(-1)
                    grads.successor.index_add_(0, after_ids, out.grad_after[:kept].reshape(-1, rank))
        zero = per_slot.new_zeros(3, 1)  # slot 0 carries no term
        correct, recall, count = torch.cat([zero, per_slot], dim=1)
        metrics = SelectorMetrics(
            loss_sum=totals[0],
            weight_sum=totals[1],
            prefix_sum=totals[2],
            prefix_blocks=totals[3],
            correct_per_slot=correct,
            recall_per_slot=recall,
            count_per_slot=count,
        )
        loss_sum, weight_sum = totals[0].to(spec.score_dtype), totals[1].to(spec.score_dtype)
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
        return hidden, projection, predecessor, successor, None, None, None, None, None, None, None


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


class _ChunkResult(NamedTuple):
    """What `_selector_chunk` returns for a chunk of C blocks (S = B-1 slots, K candidates, rank r)."""

    totals: Tensor  # [4] float64: loss sum, weight sum, accepted-prefix sum, blocks whose slot 1 is valid
    per_slot: Tensor  # [3, S] float64: correct, recall (label among the candidates), valid
    ids: Tensor  # [C, S, K] the candidates scored (after gold injection)
    grad_hidden: Tensor | None  # [C, S, H] in hidden's dtype
    grad_projection: Tensor | None  # [r, H] in the score dtype
    grad_before: Tensor | None  # [C, S, r]: of the predecessor codebook rows, in the codebook's dtype
    grad_after: Tensor | None  # [C, S, K, r]: of the successor codebook rows, in the codebook's dtype


@lru_cache(maxsize=1)
def _compiled_selector_chunk():
    # Static shapes (the caller pads to whole chunks): one graph per setting, whatever the batch.
    configure_compiler()
    return torch.compile(_selector_chunk, dynamic=False, fullgraph=True)


def _selector_chunk(
    hidden: Tensor,  # [C, S, H] slots 1..B-1
    candidates: Tensor | None,  # [C, S, K] the slots' top-k ids, highest logit first; None: from hidden here
    weight: Tensor,  # [V, H] in hidden's dtype
    bias: Tensor | None,  # [V]
    projection: Tensor,  # [r, H]
    predecessor_codebook: Tensor,  # [V, r]
    successor_codebook: Tensor,  # [V, r]
    labels: Tensor,  # [C, S]
    predecessors: Tensor,  # [C, S]
    valid: Tensor,  # [C, S]
    slot_weight: Tensor,  # [S] in the score dtype
    *,
    top_k: int,
    gold_injection: bool,
    grad_hidden: bool,
    grad_selector: bool,
) -> _ChunkResult:
    """One chunk's term, metrics and gradients (of the loss sum), with no autograd and no in-place ops, so that it
    compiles as one graph (CUDA). The gradients are written out as autograd forms them for the scores below
    (the same products and casts in the same dtypes): d/d scores = w * softmax - w at the label's index, back
    through the unary bf16 product and the float32 transition and gate."""
    chunk, slots, width = hidden.shape
    dtype = slot_weight.dtype
    if candidates is None:
        logits = F.linear(hidden.reshape(chunk * slots, width), weight, bias)  # [C*S, V]
        # The top-k of the logits as computed (bf16 on a GPU, as the engines rank them), highest first.
        candidates = top_k_ids(logits, top_k).view(chunk, slots, top_k)
    ids = candidates
    hit = ids == labels.unsqueeze(-1)  # [C, S, K]
    present = hit.any(dim=-1)  # [C, S]: the label is among the served candidates
    if gold_injection:
        # The label replaces the weakest candidate where it is missing (loss only; metrics use `present`).
        last = torch.arange(top_k, device=ids.device) == top_k - 1
        inject = ~present.unsqueeze(-1) & last
        ids = torch.where(inject, labels.unsqueeze(-1), ids)
        hit = hit | inject
    target = hit.to(torch.int64).argmax(dim=-1)  # [C, S]: the label's index (0 where absent and not injected)
    counted = valid & (present | gold_injection)
    weights = torch.where(counted, slot_weight, 0.0)  # [C, S]

    head_rows = F.embedding(ids, weight)  # [C, S, K, H]
    unary = (head_rows @ hidden.unsqueeze(-1)).squeeze(-1).to(dtype)  # [C, S, K]
    if bias is not None:
        unary = unary + bias[ids].to(dtype)
    hidden_wide = hidden.to(dtype)  # [C, S, H]
    gate = F.linear(hidden_wide, projection.to(dtype))  # [C, S, r]
    before = F.embedding(predecessors, predecessor_codebook).to(dtype)  # [C, S, r]
    after = F.embedding(ids, successor_codebook).to(dtype)  # [C, S, K, r]
    left = before * gate  # [C, S, r]
    transition = (left.unsqueeze(-2) @ after.transpose(-1, -2)).squeeze(-2)  # [C, S, K]
    scores = unary + transition  # [C, S, K]
    normaliser = torch.logsumexp(scores, dim=-1)  # [C, S]
    ce = normaliser - scores.gather(-1, target.unsqueeze(-1)).squeeze(-1)  # [C, S]
    loss = (torch.where(counted, ce, 0.0) * weights).sum()

    grad_wrt_hidden = grad_projection = grad_before = grad_after = None
    if grad_hidden or grad_selector:
        # d loss / d ce is `weights` (0 where not counted); logsumexp gives w * softmax, the gather -w at the target.
        at_target = torch.arange(ids.shape[-1], device=ids.device) == target.unsqueeze(-1)  # [C, S, K]
        step = weights.unsqueeze(-1)  # [C, S, 1]
        grad_scores = step * torch.exp(scores - normaliser.unsqueeze(-1)) + torch.where(at_target, -step, 0.0)
        grad_left = (grad_scores.unsqueeze(-2) @ after).squeeze(-2)  # [C, S, r]
        grad_gate = grad_left * before  # [C, S, r]
        if grad_hidden:
            # The unary product ran in hidden's dtype: its gradient comes back in it, as does the gate's.
            from_unary = (head_rows.transpose(-1, -2) @ grad_scores.to(hidden.dtype).unsqueeze(-1)).squeeze(-1)
            from_gate = (grad_gate @ projection.to(dtype)).to(hidden.dtype)  # [C, S, H]
            grad_wrt_hidden = from_unary + from_gate
        if grad_selector:
            rank = gate.shape[-1]
            grad_projection = grad_gate.reshape(-1, rank).t() @ hidden_wide.reshape(-1, width)  # [r, H]
            grad_before = (grad_left * gate).to(predecessor_codebook.dtype)
            grad_after = (grad_scores.unsqueeze(-1) * left.unsqueeze(-2)).to(successor_codebook.dtype)

    correct = valid & present & (scores.argmax(dim=-1) == target)  # [C, S]
    prefix = torch.cumprod(correct.to(torch.int64), dim=1).sum(dim=1)  # [C]
    totals = torch.stack([loss.double(), weights.sum().double(), prefix.sum().double(), valid[:, 0].sum().double()])
    per_slot = torch.stack([correct.sum(dim=0), (valid & present).sum(dim=0), valid.sum(dim=0)]).double()
    return _ChunkResult(totals, per_slot, ids, grad_wrt_hidden, grad_projection, grad_before, grad_after)
