"""Training data as every rank that touches batches sees it: the shards, the sampler, and plan -> TrainBatch.

Shared by the trainer (colocated ranks, disaggregated drafter ranks) and the disaggregated target ranks, so
that both sides of a transfer build the same batch list from the same settings.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import RunConfig
from ..data.sampler import BatchPlan, TokenBudgetSampler, collate
from ..data.shards import TokenDataset, load_shards
from ..model.attention import MaskVariant
from ..targets.loader import LoadedTarget
from .batch import TrainBatch, make_train_batch


@dataclass
class TrainingData:
    dataset: TokenDataset
    sampler: TokenBudgetSampler
    pad_token_id: int


def load_training_data(
    config: RunConfig, target: LoadedTarget, *, rank: int, world_size: int, step_batches: int = 1
) -> TrainingData:
    """The shards of `data.train_shards` and a sampler dealing their batches to `rank` of `world_size`, shuffled
    in groups of `step_batches` (one optimizer step's global batches)."""
    data = config.data
    if not data.train_shards:
        raise ValueError("data.train_shards: no shard directory given (run `dflash-trainer prepare` first)")
    dataset = load_shards(
        data.train_shards, vocab_size=target.config.vocab_size, max_seq_len=data.max_seq_len, overlong=data.overlong
    )
    # Every target keeps packed documents apart (targets/capture.py: attention masks or one document per row).
    packing = data.packing
    sampler = TokenBudgetSampler(
        dataset.lengths,
        token_budget=data.token_budget,
        max_seq_len=data.max_seq_len,
        max_batch_size=data.max_batch_size,
        packing=packing,
        seed=data.seed,
        rank=rank,
        world_size=world_size,
        anchor_counts=dataset.anchor_counts(data.max_anchors) if data.balance_anchors else None,
        step_batches=step_batches,
    )
    pad = target.tokenizer.pad_token_id
    return TrainingData(dataset=dataset, sampler=sampler, pad_token_id=0 if pad is None else pad)


# Shape buckets on a GPU: flex attention's 128-token tile for rows, 16 anchors (N*B a multiple of the tile for B=8,
# 16; of 64 for B=4) for blocks: at most ~1% padded block slots at 512 anchors per document.
GPU_SEQ_MULTIPLE = 128
GPU_ANCHOR_MULTIPLE = 16


def bucket_multiples(config: RunConfig, device: torch.device) -> tuple[int, int]:
    """(seq_multiple, anchor_multiple) in force: the configured values, or for 0 the device's default."""
    on_gpu = device.type == "cuda"
    seq = config.data.seq_multiple or (GPU_SEQ_MULTIPLE if on_gpu else 1)
    anchors = config.data.anchor_multiple or (GPU_ANCHOR_MULTIPLE if on_gpu else 1)
    return seq, anchors


def plan_to_host_batch(
    plan: BatchPlan,
    data: TrainingData,
    *,
    block_size: int,
    mask_token_id: int,
    config: RunConfig,
    device: torch.device,
    mask_variants: list[MaskVariant] | None = None,
) -> TrainBatch:
    """The batch of `plan` on the host, pinned when `device` is a GPU: the data stage's work."""
    packed = collate(data.dataset, plan, data.pad_token_id)
    seq_multiple, anchor_multiple = bucket_multiples(config, device)
    return make_train_batch(
        packed,
        block_size=block_size,
        mask_token_id=mask_token_id,
        max_anchors=config.data.max_anchors,
        seed=config.data.seed,
        epoch=plan.epoch,
        # The global batch number (batch i goes to rank i % world_size): anchors do not depend on the rank count.
        index=plan.index * data.sampler.world_size + data.sampler.rank,
        pin_memory=device.type == "cuda",
        seq_multiple=seq_multiple,
        anchor_multiple=anchor_multiple,
        pad_token_id=data.pad_token_id,
        mask_variants=mask_variants,
        mask_tile=config.drafter.flex_tile,
    )
