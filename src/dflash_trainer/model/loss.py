"""The DFlash training objective: a weighted per-slot loss over draft blocks, and the metrics that predict tau.

Slot k (1..B-1) of a block anchored at a predicts token x_{a+k} (same position, no shift); slot 0 holds the
anchor token itself and never carries loss, whatever `valid` says. The loss is the normalised weighted mean
`sum(m * w * term) / sum(m * w)`, where `term` is the cross-entropy against the label (or the KL divergence to
the target's distribution for soft labels) and `w` is either the paper's exponential slot decay or D-PACE's
acceptance-aware weight.

Memory: V can be ~150K and a batch ~100K slots, so [slots, V] logits must never exist for the whole batch.
The LM head and the loss are fused into one autograd Function that walks the blocks in chunks of
`chunk_blocks`: for each chunk it computes the logits, the loss terms and, when a gradient is needed, the
gradient with respect to the chunk's hidden states, then drops the logits. Backward only scales the stored
[slots, H] gradient by the incoming scalar, so at most one chunk's logits are alive at any time and the LM head
matmul is not recomputed. This works because every weight is detached (constant to autograd) and the loss is
linear in the per-slot terms.

Soft labels need the target's distribution at every slot's position. Neighbouring blocks share all but one
position (at the 27B seed setting each position sits in about 5 blocks), so the target's logits are best computed
once per position (`target_position_logits`, [P, V] in the head's dtype, the same products the per-slot path takes)
and gathered per chunk by each slot's row (`TargetPositionLogits.slot_rows`): the target's LM head then costs
P instead of R*N*B rows, for [P, V] of memory (13.8K positions x 248K vocabulary = 6.9 GB in bf16).

Fusion. On CUDA the per-chunk function is compiled (`compile=True`, static shapes: the blocks are padded with
invalid ones to a whole number of chunks, so one graph serves every chunk and batch). It is written without
in-place ops so that Inductor keeps only the [C*S, V] logits (written by the LM head matmul) and the bf16
gradient of the logits (read by the second matmul) in memory: the log-sum-exp, argmax, label gather and the
softmax-minus-label gradient are one reduction and one pointwise pass over the logits instead of about ten
fp32 passes. Eager (CPU, or `compile=False`) runs the same function, so both paths compute the same math.

FP8 head (`fp8_head=True`, `model/fp8_head.py`). The two GEMMs of the drafter slots, logits = h Wᵀ and the input
gradient (softmax - q) W, run in e4m3 with row-wise scales (per slot for h and the logits' gradient, per vocabulary
row and per hidden feature for the two cached copies of the frozen head), the logits coming out in bf16 and feeding
the same softmax, loss and gradient code. The target's logits (the soft labels and the target's argmax) stay in the
head's dtype: they are the labels, not a product the drafter learns through. Each FP8 product is ~3.6 % (RMS,
relative) off the exact one (e4m3's 3 mantissa bits on both operands, against ~0.3 % in bf16). Over a softmax of
V entries and the slots of a batch those errors average rather than add; against float64 (`tests/test_fp8_head.py`,
V 2,048) the loss came within 0.3 % and the gradient w.r.t. hidden within 3.9 % (relative norm) for hard labels,
6.2 % for soft ones (p - q cancels), where bf16's gradient is within 0.6 % and 1.3 %. Off by default: the logits'
precision matters most for soft labels, and its effect on tau is unmeasured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from ..compiling import configure_compiler
from .fp8_head import Fp8Head, cached_fp8_head, fp8_head_problem, head_input_grad, head_logits

Weighting = Literal["exp", "dpace"]
LabelSource = Literal["data", "target_argmax", "soft"]

# Paper (DFlash, App. A.1) values of gamma per block size.
_PAPER_GAMMA = {8: 4.0, 10: 5.0, 16: 7.0}
_MIN_GAMMA = 1.0


# Logits per group in `top_k_ids`'s pruning on CUDA; `benchmarks/topk_bench.py` times the sizes that divide the
# vocabulary. 64: SmolLM2's 49,152 logits per slot are 768 groups, and the final top-k reads 16 x 64 = 1,024 of them.
TOP_K_GROUP = 64


def top_k_ids(logits: Tensor, k: int) -> Tensor:
    """The ids of each row's `k` largest logits, highest first: [N, V] -> [N, k] int64 (DFlash2's candidates).

    On CUDA, when `TOP_K_GROUP` divides the vocabulary into at least k groups: `top_k_ids_by_group_max`, the same k
    values as one `torch.topk` over the row, and the same set of ids wherever no two logits tie at the k-th value
    (which of tied ids is kept, and the order of equal values, are unspecified either way). Why: one `torch.topk`
    over a ~50K-wide row runs a multi-pass radix select, 20.0 ms per step at the SmolLM2 DFlash2 main job's shape on
    an H200 (245 GB/s; 2026-12-04), where one read of the logits takes about 1 ms; this pruning, compiled as the loss
    runs it, 5.9 ms. A top-k within groups of 1,024, then of the survivors, measured 46.7 ms. On the CPU one
    `torch.topk`."""
    groups = logits.shape[-1] // TOP_K_GROUP
    if logits.is_cuda and logits.shape[-1] % TOP_K_GROUP == 0 and groups >= k:
        return top_k_ids_by_group_max(logits, k, TOP_K_GROUP)
    return torch.topk(logits, k, dim=-1).indices


def top_k_ids_by_group_max(logits: Tensor, k: int, group: int) -> Tensor:
    """`top_k_ids` by pruning: each group's maximum (one read of the logits), the k groups with the largest maxima,
    then the top-k of those k*group logits. [N, V] -> [N, k], `group` a divisor of V with V / group >= k.

    Exact: a logit x in a group outside the k kept ones has k kept groups whose maxima are >= x, k logits >= x
    besides itself, so the k largest values are found among the kept groups (ties at the k-th value aside)."""
    rows, vocab = logits.shape
    group_max = logits.view(rows, vocab // group, group).amax(dim=-1)  # [N, G]
    best_groups = torch.topk(group_max, k, dim=-1).indices  # [N, k]
    offsets = torch.arange(group, device=logits.device)  # [g]
    pool_ids = (best_groups.unsqueeze(-1) * group + offsets).view(rows, k * group)  # [N, k*g] vocabulary ids
    picked = torch.topk(logits.gather(1, pool_ids), k, dim=-1).indices  # [N, k] positions in the pool
    return pool_ids.gather(1, picked)


def default_gamma(block_size: int) -> float:
    """Slot-weight decay for a block size: the paper's values for 8, 10 and 16 (4, 5, 7), otherwise
    `3 * log2(B) - 5`, floored at 1.

    The log curve passes exactly through the paper's points for 8 and 16 and gives 4.97 for 10, so it is the
    natural interpolation; it also gives 10 for B=32, the value the earlier production system used there. The
    floor keeps gamma positive for tiny blocks (B <= 4), where the decay hardly matters."""
    if block_size < 2:
        raise ValueError(f"default_gamma: block_size must be >= 2, got {block_size}")
    if block_size in _PAPER_GAMMA:
        return _PAPER_GAMMA[block_size]
    return max(_MIN_GAMMA, 3.0 * math.log2(block_size) - 5.0)


def slot_weights(
    block_size: int,
    gamma: float,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """[B]: w_0 = 0 (the anchor slot has no loss), w_k = exp(-(k-1)/gamma) for k >= 1."""
    if block_size < 2:
        raise ValueError(f"slot_weights: block_size must be >= 2, got {block_size}")
    if gamma <= 0:
        raise ValueError(f"slot_weights: gamma must be > 0, got {gamma}")
    k = torch.arange(block_size, dtype=dtype, device=device)
    weights = torch.exp(-(k - 1.0) / gamma)
    weights[0] = 0.0
    return weights


def expected_acceptance(correct_per_slot: Tensor, count_per_slot: Tensor) -> Tensor:
    """E[tau] = 1 + sum_{k=1}^{B-1} prod_{j<=k} acc_j with the teacher-forced per-slot accuracies acc_j = correct_j /
    count_j (0 where a slot was never counted, which ends the product). Unconditional: slot j counts whether or not
    an earlier slot of its block missed, so the product is exact only for independent slots; misses correlated within
    a block put it below the exact accepted length (`tau_prefix`). Both inputs [B]; slot 0 is ignored. Returns a
    0-dim tensor on the inputs' device (no host sync)."""
    correct = correct_per_slot[1:].double()
    count = count_per_slot[1:].double()
    accuracy = torch.where(count > 0, correct / count.clamp_min(1.0), torch.zeros_like(correct))  # [B-1]
    return 1.0 + torch.cumprod(accuracy, dim=0).sum()


@dataclass
class LossMetrics:
    """Sum/total pairs of one or more loss calls, as float64 device tensors, so that accumulating over
    micro-batches and all-reducing over ranks gives exact global ratios.

    The accuracy label of a slot is the label greedy verification would accept: the data token for
    label_source "data", the target's argmax for "target_argmax" and "soft"."""

    loss_sum: Tensor  # []: sum of m * w * term
    weight_sum: Tensor  # []: sum of m * w
    correct_per_slot: Tensor  # [B]: valid slots whose drafter argmax equals the accuracy label
    count_per_slot: Tensor  # [B]: valid slots
    prefix_sum: Tensor  # []: sum over blocks of the number of leading valid and correct slots 1..B-1
    prefix_blocks: Tensor  # []: blocks whose slot 1 is valid (the blocks prefix_sum averages over)

    @classmethod
    def zeros(cls, block_size: int, *, device: torch.device | str | None = None) -> LossMetrics:
        return cls.from_tensor(torch.zeros(4 + 2 * block_size, dtype=torch.float64, device=device))

    @property
    def block_size(self) -> int:
        return self.count_per_slot.shape[0]

    def add_(self, other: LossMetrics) -> LossMetrics:
        """Accumulates `other` into self in place and returns self."""
        if other.block_size != self.block_size:
            raise ValueError(
                f"LossMetrics.add_: block size {other.block_size} does not match this accumulator's {self.block_size}"
            )
        self.loss_sum.add_(other.loss_sum)
        self.weight_sum.add_(other.weight_sum)
        self.correct_per_slot.add_(other.correct_per_slot)
        self.count_per_slot.add_(other.count_per_slot)
        self.prefix_sum.add_(other.prefix_sum)
        self.prefix_blocks.add_(other.prefix_blocks)
        return self

    def to_tensor(self) -> Tensor:
        """[4 + 2B] float64: loss_sum, weight_sum, prefix_sum, prefix_blocks, correct_per_slot, count_per_slot;
        one tensor so that ranks reduce every pair in a single collective."""
        scalars = torch.stack([self.loss_sum, self.weight_sum, self.prefix_sum, self.prefix_blocks])
        return torch.cat([scalars, self.correct_per_slot, self.count_per_slot]).double()

    @classmethod
    def from_tensor(cls, flat: Tensor) -> LossMetrics:
        """Inverse of to_tensor. The fields are views into `flat`."""
        size = flat.numel()
        if flat.dim() != 1 or size < 8 or size % 2 != 0:
            raise ValueError(
                f"LossMetrics.from_tensor: expected a flat tensor of 4 + 2B elements (B >= 2), got shape "
                f"{tuple(flat.shape)}"
            )
        flat = flat.double()
        block_size = (size - 4) // 2
        return cls(
            loss_sum=flat[0],
            weight_sum=flat[1],
            prefix_sum=flat[2],
            prefix_blocks=flat[3],
            correct_per_slot=flat[4 : 4 + block_size],
            count_per_slot=flat[4 + block_size :],
        )

    def mean_loss(self) -> Tensor:
        """sum(m*w*term) / sum(m*w), 0 when nothing was counted."""
        return torch.where(self.weight_sum > 0, self.loss_sum / self.weight_sum.clamp_min(1e-30), 0.0)

    def slot_accuracy(self) -> Tensor:
        """[B] conditional accuracy per slot (0 where not counted; slot 0 is always 0)."""
        return torch.where(self.count_per_slot > 0, self.correct_per_slot / self.count_per_slot.clamp_min(1.0), 0.0)

    def expected_acceptance(self) -> Tensor:
        """E[tau] from the per-slot accuracies (see the module-level function)."""
        return expected_acceptance(self.correct_per_slot, self.count_per_slot)

    def prefix_acceptance(self) -> Tensor:
        """Empirical tau: 1 + mean accepted prefix per block (1 when no block was counted). Unlike E[tau] it keeps
        the correlation between slots of the same block."""
        return 1.0 + torch.where(self.prefix_blocks > 0, self.prefix_sum / self.prefix_blocks.clamp_min(1.0), 0.0)


@dataclass
class LossOutput:
    loss: Tensor  # []: normalised weighted mean, differentiable w.r.t. hidden (0 when no slot is valid)
    # []: the unnormalised sum(m * w * term), differentiable; divide by a weight sum gathered over several
    # micro-batches or ranks to normalise globally instead of per call.
    loss_sum: Tensor
    metrics: LossMetrics
    # [R, N, B-1, K] int64: each drafted slot's top-k token ids of these logits, highest first (`dflash_loss`'s
    # `candidates_top_k`; DFlash2's selector chooses among them); None when not asked for or with the FP8 head.
    candidates: Tensor | None = None


@dataclass(frozen=True)
class TargetPositionLogits:
    """The target's logits at every position of a batch, and for every block slot the row holding its position's.

    logits [P, V] in the LM head's dtype (`target_position_logits`); slot_rows [R, N, B] int64 into its rows (for
    slot k of the block anchored at a: the position a + k - 1, whose LM-head output is the target's distribution for
    the token at a + k; `anchors.block_state_rows`)."""

    logits: Tensor
    slot_rows: Tensor


def target_position_logits(
    final_hidden: Tensor,  # [R, T, H] the target's final state (after its final norm)
    lm_head_weight: Tensor,  # [V, H]
    *,
    lm_head_bias: Tensor | None = None,  # [V]
    dtype: torch.dtype | None = None,
) -> Tensor:
    """[R*T, V] logits of every position in `dtype` (default the head's): the products `dflash_loss` takes per slot
    with `target_hidden` (the same vectors and head in the same dtype), once per position."""
    rows, length, width = final_hidden.shape
    dtype = lm_head_weight.dtype if dtype is None else dtype
    with torch.no_grad(), torch.autocast(device_type=final_hidden.device.type, enabled=False):
        bias = None if lm_head_bias is None else lm_head_bias.to(dtype)
        return F.linear(final_hidden.reshape(rows * length, width).to(dtype), lm_head_weight.to(dtype), bias)


@dataclass(frozen=True)
class _LossSpec:
    """Everything about the loss that is not a tensor input of the autograd Function."""

    weighting: Weighting
    slot_weight: Tensor  # [B-1] float64: exp weights of slots 1..B-1 (used by "exp")
    dpace_alpha: float
    label_source: LabelSource
    chunk_blocks: int
    need_grad: bool
    compile: bool
    fp8_head: Fp8Head | None  # the head in e4m3 for the drafter slots' two GEMMs (`model/fp8_head.py`)
    top_k: int  # candidates per drafted slot from the logits (0: none)


def dflash_loss(
    hidden: Tensor,  # [R, N, B, H] drafter output after its final norm
    lm_head_weight: Tensor,  # [V, H] the target's frozen LM head
    labels: Tensor,  # [R, N, B] int64: x_{a+k} for slot k
    valid: Tensor,  # [R, N, B] bool
    *,
    gamma: float | None,
    weighting: Weighting = "exp",
    dpace_alpha: float = 0.5,
    label_source: LabelSource = "data",
    target_hidden: Tensor | None = None,  # [R, N, B, H] target final state at a+k-1 (after its final norm)
    chunk_blocks: int = 64,
    lm_head_bias: Tensor | None = None,  # [V]
    compile: bool = False,
    target_logits: TargetPositionLogits | None = None,
    fp8_head: bool = False,
    candidates_top_k: int = 0,
) -> LossOutput:
    """The weighted DFlash loss and its metrics. `gamma` None picks `default_gamma(B)`. `compile`: run the
    per-chunk function compiled (CUDA only; elsewhere it is ignored). Labels other than `data` take the target's
    distribution from `target_hidden` (its LM head per slot) or `target_logits` (computed once per position).

    Logits are computed in hidden's dtype (the LM head weight is cast to it once), the softmax in float32 (or
    float64 for float64 inputs). Gradients flow to `hidden` only: the LM head is frozen, and the target's
    hidden states are treated as constants. `fp8_head`: the drafter slots' logits and their gradient's product with
    the head in FP8 (see the module docstring); the target's logits stay in the head's dtype. `candidates_top_k` K:
    also return each drafted slot's top-K ids of the logits as computed (`LossOutput.candidates`, for DFlash2's
    selector, which would otherwise run the LM head again); not with the FP8 head, whose logits are not those."""
    _check_inputs(hidden, lm_head_weight, labels, valid, target_hidden, target_logits, lm_head_bias, label_source)
    rows, num_blocks, block_size, width = hidden.shape
    if block_size < 2:
        raise ValueError(f"dflash_loss: block size (hidden.shape[2]) must be >= 2, got {block_size}")
    if weighting not in ("exp", "dpace"):
        raise ValueError(f"dflash_loss: weighting must be 'exp' or 'dpace', got {weighting!r}")
    if not 0.0 <= dpace_alpha <= 1.0:
        raise ValueError(f"dflash_loss: dpace_alpha must be in [0, 1], got {dpace_alpha}")
    if chunk_blocks < 1:
        raise ValueError(f"dflash_loss: chunk_blocks must be >= 1, got {chunk_blocks}")
    if not 0 <= candidates_top_k <= lm_head_weight.shape[0]:
        raise ValueError(
            f"dflash_loss: candidates_top_k must be in [0, V={lm_head_weight.shape[0]}], got {candidates_top_k}"
        )
    need_grad = torch.is_grad_enabled() and hidden.requires_grad
    frozen_head = [("lm_head_weight", lm_head_weight), ("lm_head_bias", lm_head_bias)]
    for name, tensor in frozen_head:
        if need_grad and tensor is not None and tensor.requires_grad:
            raise ValueError(
                f"dflash_loss: {name} requires grad, but the LM head is frozen and gets no gradient here; "
                "call requires_grad_(False) on it"
            )
    if fp8_head and (problem := fp8_head_problem(lm_head_weight)) is not None:
        raise ValueError(f"dflash_loss: fp8_head: {problem}")
    gamma = default_gamma(block_size) if gamma is None else gamma
    spec = _LossSpec(
        weighting=weighting,
        # float64 so float64 inputs get exact weights; each chunk casts them to its softmax dtype.
        slot_weight=slot_weights(block_size, gamma, device=hidden.device, dtype=torch.float64)[1:],
        dpace_alpha=dpace_alpha,
        label_source=label_source,
        chunk_blocks=chunk_blocks,
        need_grad=need_grad,
        compile=compile and hidden.device.type == "cuda",
        fp8_head=cached_fp8_head(lm_head_weight) if fp8_head else None,
        top_k=0 if fp8_head else candidates_top_k,
    )
    blocks = rows * num_blocks
    flat_target = None if target_hidden is None else target_hidden.reshape(blocks, block_size, width)
    position_logits = None if target_logits is None else target_logits.logits
    slot_rows = None if target_logits is None else target_logits.slot_rows.reshape(blocks, block_size)
    loss_sum, weight_sum, correct, count, prefix_sum, prefix_blocks, candidates = _ChunkedBlockLoss.apply(
        hidden.reshape(blocks, block_size, width),
        lm_head_weight,
        lm_head_bias,
        labels.reshape(blocks, block_size),
        valid.reshape(blocks, block_size),
        flat_target,
        position_logits,
        slot_rows,
        spec,
    )
    # The weight sum is a constant to autograd, so dividing by it only scales the gradient.
    safe_weight = torch.where(weight_sum > 0, weight_sum, torch.ones_like(weight_sum))
    metrics = LossMetrics(
        loss_sum=loss_sum.detach().double(),
        weight_sum=weight_sum.double(),
        correct_per_slot=correct,
        count_per_slot=count,
        prefix_sum=prefix_sum,
        prefix_blocks=prefix_blocks,
    )
    if candidates is not None:
        candidates = candidates.view(rows, num_blocks, block_size - 1, -1)  # [R, N, B-1, K]
    return LossOutput(loss=loss_sum / safe_weight, loss_sum=loss_sum, metrics=metrics, candidates=candidates)


def greedy_next_tokens(
    final_hidden: Tensor,  # [R, T, H] the target's final state (after its final norm) at every position
    lm_head_weight: Tensor,  # [V, H]
    *,
    lm_head_bias: Tensor | None = None,  # [V]
    dtype: torch.dtype | None = None,
    chunk_positions: int = 2048,
) -> Tensor:
    """[R, T] int64: the target's greedy token after every position, argmax(W h_t + b), with the head and the
    states in `dtype` (default the head's) and `chunk_positions` rows of logits at a time ([chunk, V] at most).

    The labels of `label_source="target_argmax"` are these, gathered per block slot (`block_slot_tokens`): the LM
    head runs once per *position*, where `dflash_loss` with `target_argmax` runs it per slot (R*N*B rows; 2.7x more
    at the paper setting: 21,840 slots against 8,192 positions, as neighbouring blocks share all but one). The
    products are those `dflash_loss` takes (same vectors and head in `dtype`), so these labels with
    `label_source="data"` give its `target_argmax` loss, metrics and gradient. Deterministic given its inputs: a
    disaggregated target rank computes them and the drafter gets the labels one process would."""
    if chunk_positions < 1:
        raise ValueError(f"greedy_next_tokens: chunk_positions must be >= 1, got {chunk_positions}")
    rows, length, width = final_hidden.shape
    dtype = lm_head_weight.dtype if dtype is None else dtype
    with torch.no_grad(), torch.autocast(device_type=final_hidden.device.type, enabled=False):
        weight = lm_head_weight.to(dtype)
        bias = None if lm_head_bias is None else lm_head_bias.to(dtype)
        flat = final_hidden.reshape(rows * length, width).to(dtype)  # [R*T, H]
        best = torch.cat(
            [
                F.linear(flat[start : start + chunk_positions], weight, bias).argmax(dim=-1)
                for start in range(0, rows * length, chunk_positions)
            ]
        )  # [R*T]
    return best.view(rows, length)


def block_slot_tokens(next_tokens: Tensor, anchors: Tensor, *, block_size: int) -> Tensor:
    """[R, T] next tokens (`greedy_next_tokens`), [R, N] anchors -> [R, N, B]: slot k of the block anchored at a
    gets next_tokens[a + k - 1], the index clamped into the row as `gather_block_states` clamps it (such slots
    and slot 0 are never valid)."""
    rows, length = next_tokens.shape
    index = anchors.unsqueeze(-1) + torch.arange(block_size, device=anchors.device) - 1  # [R, N, B]: a + k - 1
    index = torch.clamp(index, min=0, max=length - 1).view(rows, -1)
    return torch.gather(next_tokens, 1, index).view(rows, -1, block_size)


def _check_inputs(
    hidden: Tensor,
    lm_head_weight: Tensor,
    labels: Tensor,
    valid: Tensor,
    target_hidden: Tensor | None,
    target_logits: TargetPositionLogits | None,
    lm_head_bias: Tensor | None,
    label_source: str,
) -> None:
    if hidden.dim() != 4:
        raise ValueError(f"dflash_loss: hidden must be [R, N, B, H], got shape {tuple(hidden.shape)}")
    if not hidden.is_floating_point():
        raise ValueError(f"dflash_loss: hidden must be floating point, got {hidden.dtype}")
    block_shape = hidden.shape[:3]
    if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != hidden.shape[3]:
        raise ValueError(
            f"dflash_loss: lm_head_weight must be [V, H={hidden.shape[3]}], got {tuple(lm_head_weight.shape)}"
        )
    if lm_head_bias is not None and tuple(lm_head_bias.shape) != (lm_head_weight.shape[0],):
        raise ValueError(
            f"dflash_loss: lm_head_bias must be [V={lm_head_weight.shape[0]}], got {tuple(lm_head_bias.shape)}"
        )
    if labels.shape != block_shape or labels.is_floating_point() or labels.dtype == torch.bool:
        raise ValueError(
            f"dflash_loss: labels must be integer [R, N, B]={tuple(block_shape)}, got {labels.dtype} "
            f"{tuple(labels.shape)}"
        )
    if valid.shape != block_shape or valid.dtype != torch.bool:
        raise ValueError(
            f"dflash_loss: valid must be bool [R, N, B]={tuple(block_shape)}, got {valid.dtype} {tuple(valid.shape)}"
        )
    if label_source not in ("data", "target_argmax", "soft"):
        raise ValueError(f"dflash_loss: label_source must be 'data', 'target_argmax' or 'soft', got {label_source!r}")
    if target_hidden is not None and target_logits is not None:
        raise ValueError("dflash_loss: give the target's distribution once: target_hidden or target_logits")
    if target_logits is not None:
        logits, slot_rows = target_logits.logits, target_logits.slot_rows
        if logits.dim() != 2 or logits.shape[1] != lm_head_weight.shape[0] or slot_rows.shape != block_shape:
            raise ValueError(
                f"dflash_loss: target_logits must be [P, V={lm_head_weight.shape[0]}] with slot_rows "
                f"[R, N, B]={tuple(block_shape)}, got {tuple(logits.shape)} and {tuple(slot_rows.shape)}"
            )
    elif label_source != "data" and (target_hidden is None or target_hidden.shape != hidden.shape):
        got = None if target_hidden is None else tuple(target_hidden.shape)
        raise ValueError(
            f"dflash_loss: label_source {label_source!r} needs target_hidden of hidden's shape "
            f"{tuple(hidden.shape)} or target_logits, got {got}"
        )


class _ChunkedBlockLoss(torch.autograd.Function):
    """Fused LM head + weighted loss over [blocks, B, H], chunk by chunk (see the module docstring).

    Outputs: loss_sum (differentiable w.r.t. hidden), then the non-differentiable weight_sum, correct [B],
    count [B], prefix_sum, prefix_blocks, and the candidates [M, B-1, K] (None unless `spec.top_k`)."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        hidden: Tensor,  # [M, B, H]
        lm_head_weight: Tensor,  # [V, H]
        lm_head_bias: Tensor | None,  # [V]
        labels: Tensor,  # [M, B]
        valid: Tensor,  # [M, B]
        target_hidden: Tensor | None,  # [M, B, H]
        position_logits: Tensor | None,  # [P, V]
        slot_rows: Tensor | None,  # [M, B] int64 rows of position_logits
        spec: _LossSpec,
    ) -> tuple[Tensor, ...]:
        # The chunks' gradient is computed here, not by autograd. Detached, every chunk has one requires_grad state:
        # a view of the input would require grad, the padded copy (made under forward's no-grad) would not, and the
        # compiled chunk guards on it (two graphs for one shape, seen on an H200 in a main job's first steps).
        hidden = hidden.detach()
        blocks, block_size, _ = hidden.shape
        compute_dtype = hidden.dtype
        softmax_dtype = torch.promote_types(compute_dtype, torch.float32)
        device = hidden.device
        chunk_fn = _compiled_loss_chunk() if spec.compile else _loss_chunk
        step = spec.chunk_blocks
        if spec.compile and blocks % step:
            # Whole chunks only, so the compiled function sees one shape: pad with invalid blocks.
            extra = step - blocks % step
            hidden = F.pad(hidden, (0, 0, 0, 0, 0, extra))
            labels = F.pad(labels, (0, 0, 0, extra))
            valid = F.pad(valid, (0, 0, 0, extra), value=False)
            target_hidden = None if target_hidden is None else F.pad(target_hidden, (0, 0, 0, 0, 0, extra))
            slot_rows = None if slot_rows is None else F.pad(slot_rows, (0, 0, 0, extra))
        # Autocast would pick its own matmul dtype; the dtypes here are chosen explicitly.
        with torch.autocast(device_type=device.type, enabled=False):
            weight = lm_head_weight.to(compute_dtype)  # [V, H]
            bias = None if lm_head_bias is None else lm_head_bias.to(compute_dtype)
            totals = torch.zeros(4, dtype=torch.float64, device=device)  # loss, weight, prefix sums, blocks
            correct = torch.zeros(block_size, dtype=torch.float64, device=device)
            count = torch.zeros(block_size, dtype=torch.float64, device=device)
            grad_hidden = torch.zeros_like(hidden) if spec.need_grad else None
            shape = (hidden.shape[0], block_size - 1, spec.top_k)
            candidates = torch.empty(shape, dtype=torch.int64, device=device) if spec.top_k else None
            slot_weight = spec.slot_weight.to(softmax_dtype)
            for start in range(0, blocks, step):
                chunk = slice(start, min(start + step, hidden.shape[0]))
                # Slot 0 is dropped here, statically: it never has loss, and skipping it saves 1/B of the
                # LM head work.
                chunk_target_logits = None
                if slot_rows is not None:
                    rows_of_chunk = slot_rows[chunk, 1:].reshape(-1)
                    chunk_target_logits = position_logits.index_select(0, rows_of_chunk).to(compute_dtype)
                chunk_totals, chunk_correct, chunk_count, chunk_grad, chunk_candidates = chunk_fn(
                    hidden[chunk, 1:],
                    weight,
                    bias,
                    labels[chunk, 1:],
                    valid[chunk, 1:],
                    None if target_hidden is None else target_hidden[chunk, 1:].to(compute_dtype),
                    chunk_target_logits,
                    slot_weight,
                    spec.fp8_head,
                    weighting=spec.weighting,
                    dpace_alpha=spec.dpace_alpha,
                    label_source=spec.label_source,
                    need_grad=spec.need_grad,
                    top_k=spec.top_k,
                )
                totals += chunk_totals
                correct[1:] += chunk_correct
                count[1:] += chunk_count
                if grad_hidden is not None:
                    grad_hidden[chunk, 1:] = chunk_grad
                if candidates is not None:
                    candidates[chunk] = chunk_candidates
        loss_sum, weight_sum = totals[0].to(softmax_dtype), totals[1].to(softmax_dtype)
        prefix_sum, prefix_blocks = totals[2], totals[3]
        if grad_hidden is not None:
            grad_hidden = grad_hidden[:blocks]
        if candidates is not None:
            candidates = candidates[:blocks]
            ctx.mark_non_differentiable(candidates)
        ctx.save_for_backward(grad_hidden)
        ctx.mark_non_differentiable(weight_sum, correct, count, prefix_sum, prefix_blocks)
        return loss_sum, weight_sum, correct, count, prefix_sum, prefix_blocks, candidates

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_loss_sum: Tensor, *_: Tensor) -> tuple[Tensor | None, ...]:
        (grad_hidden,) = ctx.saved_tensors
        grad = None if grad_hidden is None else grad_hidden * grad_loss_sum.to(grad_hidden.dtype)
        return grad, None, None, None, None, None, None, None, None


@lru_cache(maxsize=1)
def _compiled_loss_chunk():
    # Static shapes (the caller pads to whole chunks) and one graph per loss setting.
    configure_compiler()
    return torch.compile(_loss_chunk, dynamic=False, fullgraph=True)


def _loss_chunk(
    hidden: Tensor,  # [C, S, H] with S = B-1 (slots 1..B-1)
    weight: Tensor,  # [V, H]
    bias: Tensor | None,  # [V]
    labels: Tensor,  # [C, S]
    valid: Tensor,  # [C, S]
    target_hidden: Tensor | None,  # [C, S, H]
    target_logits: Tensor | None,  # [C*S, V] the target's logits per slot, when computed per position already
    slot_weight: Tensor,  # [S] exp weights in the softmax dtype
    fp8_head: Fp8Head | None,  # the head in e4m3: the drafter's logits and their gradient's GEMM in FP8
    *,
    weighting: Weighting,
    dpace_alpha: float,
    label_source: LabelSource,
    need_grad: bool,
    top_k: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
    """One chunk: (totals [4] float64 = loss sum, weight sum, accepted-prefix sum, counted blocks; correct [S];
    valid [S]; gradient w.r.t. hidden [C, S, H] or None; the top-`top_k` ids of the logits [C, S, K] or None).
    No in-place ops (see the module docstring)."""
    chunk, slots, width = hidden.shape
    softmax_dtype = slot_weight.dtype
    flat_hidden = hidden.reshape(chunk * slots, width)  # [C*S, H]
    # [C*S, V]: bf16 from the FP8 head
    logits = F.linear(flat_hidden, weight, bias) if fp8_head is None else head_logits(flat_hidden, fp8_head, bias)
    drafter_choice = logits.argmax(dim=-1).view(chunk, slots)
    # Ranked on the logits as computed (bf16 on a GPU, as the engines rank them), highest first.
    candidates = top_k_ids(logits, top_k).view(chunk, slots, top_k) if top_k else None
    logits = logits.to(softmax_dtype)
    log_normaliser = torch.logsumexp(logits, dim=-1, keepdim=True)  # [C*S, 1]

    target_log_probs = None  # [C*S, V], soft labels only
    if label_source == "data":
        accept_labels = labels
    else:
        if target_logits is None:
            target_logits = F.linear(target_hidden.reshape(chunk * slots, width), weight, bias)  # [C*S, V]
        accept_labels = target_logits.argmax(dim=-1).view(chunk, slots)
        if label_source == "soft":
            target_log_probs = torch.log_softmax(target_logits, dim=-1, dtype=softmax_dtype)
    # Invalid slots may carry any label (padding, out of the row); point them at token 0 so gathers are safe.
    accept_labels = torch.where(valid, accept_labels, torch.zeros_like(accept_labels))
    flat_labels = accept_labels.reshape(-1, 1)  # [C*S, 1]
    accept_ce = (log_normaliser - logits.gather(1, flat_labels)).view(chunk, slots)  # [C, S]

    if target_log_probs is None:
        term = accept_ce
    else:
        # KL(target || drafter) per slot.
        log_probs = logits - log_normaliser
        term = (target_log_probs.exp() * (target_log_probs - log_probs)).sum(dim=-1).view(chunk, slots)
    # `where`, not a product: a non-finite term in an invalid slot must not leak into the sum.
    term = torch.where(valid, term, torch.zeros_like(term))
    weights = _slot_loss_weights(
        accept_ce=accept_ce, valid=valid, weighting=weighting, dpace_alpha=dpace_alpha, slot_weight=slot_weight
    ).to(term.dtype)  # [C, S]

    correct = valid & (drafter_choice == accept_labels)
    # Leading run of correct slots: cumprod turns 0 at the first wrong or invalid slot.
    prefix = torch.cumprod(correct.to(torch.int64), dim=1).sum(dim=1)  # [C]
    totals = torch.stack(
        [(weights * term).sum().double(), weights.sum().double(), prefix.sum().double(), valid[:, 0].sum().double()]
    )

    grad_hidden = None
    if need_grad:
        # d(w * term)/d logits = w * (softmax - q): q is the one-hot label or the target distribution.
        probs = torch.exp(logits - log_normaliser)  # [C*S, V]
        if target_log_probs is not None:
            grad_logits = probs - target_log_probs.exp()
        else:
            vocab = torch.arange(logits.shape[1], device=logits.device)
            grad_logits = torch.where(vocab == flat_labels, probs - 1.0, probs)
        grad_logits = grad_logits * weights.reshape(-1, 1)
        if fp8_head is None:
            grad_rows = grad_logits.to(weight.dtype) @ weight  # [C*S, H]
        else:
            grad_rows = head_input_grad(grad_logits, fp8_head).to(hidden.dtype)  # [C*S, H]
        # Invalid rows are already 0 unless their logits were not finite (0 * nan); masking [C*S, H] here is
        # cheaper than masking [C*S, V] above, and matmul rows are independent.
        grad_rows = torch.where(valid.reshape(-1, 1), grad_rows, torch.zeros_like(grad_rows))
        grad_hidden = grad_rows.view(chunk, slots, width)
    return totals, correct.sum(dim=0).double(), valid.sum(dim=0).double(), grad_hidden, candidates


def _slot_loss_weights(
    *, accept_ce: Tensor, valid: Tensor, weighting: Weighting, dpace_alpha: float, slot_weight: Tensor
) -> Tensor:
    """[C, S] detached weights of slots 1..B-1, zero on invalid slots."""
    if weighting == "exp":
        weights = slot_weight.to(accept_ce.dtype).expand_as(accept_ce)
    else:
        # D-PACE: p_i approximates the chance that slot i is accepted (from the CE against the label greedy
        # verification checks, so soft labels use the target's argmax). w_j = sum_{m>=j} prod_{i<=m} p_i is how
        # much the expected acceptance length gains from slot j.
        # An invalid slot gets p_i = 0: acceptance can never pass it (the document or the response ends, or the
        # block runs off the row), so the slots behind it add nothing to the acceptance length and get no weight,
        # even when they are valid again (e.g. the next assistant turn), and the slots before it do not count
        # acceptance beyond it.
        alpha = dpace_alpha
        accept_prob = (1.0 - alpha) * torch.exp(-accept_ce) + alpha  # [C, S]
        accept_prob = torch.where(valid, accept_prob, torch.zeros_like(accept_prob))
        reach = torch.cumprod(accept_prob, dim=1)  # P(slots 1..m all accepted)
        weights = reach.flip(1).cumsum(dim=1).flip(1)  # [C, S] sum over m >= j
    return torch.where(valid, weights, torch.zeros_like(weights))
