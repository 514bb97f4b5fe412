"""Training data as every rank that touches batches sees it: the shards, the sampler, and plan -> TrainBatch.

Shared by the trainer (colocated ranks, disaggregated drafter ranks) and the disaggregated target ranks, so
that both sides of a transfer build the same batch list from the same settings.

Also the regeneration of the recipe's automatic data step (`regenerate_for_training`), which runs before any of
that: under `train --nproc N` (colocated) every rank holds the target, so every rank answers a share of the
prompts (`targets/regen_ranks.py`) instead of N-1 ranks waiting for the first; the first rank merges the shares
and tokenises, the others wait for the shards. With a server as the engine (`prepare.engine: openai`) the first
rank alone sends the requests: the server, not the ranks, does the work.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import RunConfig
from ..data.sampler import BatchPlan, TokenBudgetSampler, collate
from ..data.shards import TokenDataset, load_shards
from ..decoding.recurrent import STATE_DTYPES
from ..distributed.world import World
from ..model.attention import MaskVariant
from ..targets.loader import LoadedTarget
from ..targets.regen_ranks import RegenTeam
from ..targets.regenerate import RegenerateSummary, regenerate
from .batch import TrainBatch, make_train_batch


def regenerate_for_training(
    records: str | list[dict], target: LoadedTarget, out_dir: Path, config: RunConfig, world: World | None = None
) -> RegenerateSummary | None:
    """The recipe's regeneration on this rank: a share of `records` on every rank of `world` (the target runs in
    these processes), or everything on the first rank (alone, or a server answers). Collective over `world` when
    the ranks share. The whole run's summary on the first rank; this rank's part elsewhere, None if it takes none."""
    prepare = config.prepare
    shared = world is not None and world.distributed and prepare.engine != "openai"
    if world is not None and not world.is_main and not shared:
        return None
    team = RegenTeam.of() if shared else RegenTeam()
    try:
        return regenerate(
            records,
            target,
            out_dir,
            max_new_tokens=prepare.max_new_tokens,
            batch_size=prepare.regenerate_batch_size,
            limit=prepare.limit,
            # A prompt longer than the longest training sample could never be trained on.
            max_prompt_tokens=config.data.max_seq_len,
            engine=prepare.engine,
            endpoint=prepare.endpoint,
            # As the tokenising step after it: one odd record must not end a run over many.
            on_error="skip",
            team=team,
            recurrent_state_dtype=STATE_DTYPES[config.target.recurrent_state_dtype],
        )
    finally:
        team.close()


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
