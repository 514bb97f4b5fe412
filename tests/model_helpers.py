"""Small builders shared by the model tests: a tiny drafter config, a random packed batch, a loss's per-chunk function
compiled on the CPU as on CUDA."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from dflash_trainer.model.anchors import block_input_ids, block_positions, sample_anchors
from dflash_trainer.model.config import DrafterModelConfig


def tiny_drafter_config(**overrides) -> DrafterModelConfig:
    values = dict(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        num_hidden_layers=2,
        vocab_size=64,
        target_layer_ids=[1, 2, 3],
        num_target_layers=6,
        block_size=4,
        mask_token_id=63,
    )
    values.update(overrides)
    return DrafterModelConfig(**values)


@dataclass
class RandomBatch:
    input_ids: torch.Tensor  # [R, T]
    loss_mask: torch.Tensor  # [R, T]
    doc_ids: torch.Tensor  # [R, T]
    position_ids: torch.Tensor  # [R, T]
    features: torch.Tensor  # [R, T, K*H]
    anchors: torch.Tensor  # [R, N]
    anchor_keep: torch.Tensor  # [R, N]
    block_ids: torch.Tensor  # [R, N*B]
    block_pos: torch.Tensor  # [R, N*B]


def random_packed_batch(
    config: DrafterModelConfig, *, rows: int = 2, length: int = 40, max_anchors: int = 3, seed: int = 0
) -> RandomBatch:
    """Rows of 1-3 documents with a prompt part (loss 0) and a response part (loss 1), and a padded tail."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, config.vocab_size - 1, (rows, length), generator=gen)
    doc_ids = torch.full((rows, length), -1, dtype=torch.long)
    position_ids = torch.zeros((rows, length), dtype=torch.long)
    loss_mask = torch.zeros((rows, length), dtype=torch.bool)
    for r in range(rows):
        used = length - 3 * r  # rows end in a few padding tokens
        cuts = sorted(torch.randperm(used - 8, generator=gen)[:r].add(4).tolist())
        bounds = [0, *cuts, used]
        for d, (start, end) in enumerate(itertools.pairwise(bounds)):
            doc_ids[r, start:end] = d
            position_ids[r, start:end] = torch.arange(end - start)
            prompt = max(1, (end - start) // 3)
            loss_mask[r, start + prompt : end] = True
    features = torch.randn(rows, length, config.num_features * config.hidden_size, generator=gen)
    anchors, keep = sample_anchors(loss_mask=loss_mask, doc_ids=doc_ids, max_anchors=max_anchors, generator=gen)
    block_ids = block_input_ids(
        input_ids=input_ids, anchors=anchors, block_size=config.block_size, mask_token_id=config.mask_token_id
    )
    block_pos = block_positions(position_ids=position_ids, anchors=anchors, block_size=config.block_size)
    return RandomBatch(input_ids, loss_mask, doc_ids, position_ids, features, anchors, keep, block_ids, block_pos)


def force_compiled_chunks(monkeypatch, module, chunk: str, spec: str) -> None:
    """Make the loss in `module` run its per-chunk function `chunk` compiled, as it does on CUDA only (static shapes,
    blocks padded to whole chunks): dynamo with the aot_eager backend, and the loss's spec class `spec` built with
    `compile=True` whatever the device."""
    compiled = torch.compile(getattr(module, chunk), backend="aot_eager", fullgraph=True, dynamic=False)
    monkeypatch.setattr(module, f"_compiled{chunk}", lambda: compiled)
    spec_class = getattr(module, spec)
    monkeypatch.setattr(module, spec, lambda **fields: spec_class(**{**fields, "compile": True}))
