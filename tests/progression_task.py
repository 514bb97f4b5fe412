"""The context-determined task of the learning tests: arithmetic progressions modulo P, and held-out tau on them.

Every document is `BASE + (start + i * step) % PERIOD` with its own start and step. The step is not visible in the
anchor token alone, so a drafter must read it from the context (the target's features of the tokens before the
anchor); the continuation is then fully determined, so a perfect drafter accepts every slot that fits.

`held_out_tau` does not use the training code path: the drafter runs as at inference (context = the target features
of positions < a only, no training mask, block `[x_a, MASK...]`), drafts with its own rule (`draft_tokens`: the
per-slot argmax for DFlash, the selector's walk for DFlash2), and the accepted prefix is counted with the document
itself as the verifier.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dflash_trainer.data.shards import ShardWriter
from dflash_trainer.model.drafter import DFlashDrafter
from dflash_trainer.targets.capture import FeatureCapture, embedding_module, lm_head_module
from train_helpers import VOCAB

PERIOD = 17
BASE = 10
STEPS = (1, 2, 3)
BLOCK = 4
PROMPT = 2  # leading tokens without loss: every anchor has at least two context tokens to read the step from


def progression(gen: torch.Generator) -> list[int]:
    length = int(torch.randint(12, 40, (1,), generator=gen))
    start = int(torch.randint(0, PERIOD, (1,), generator=gen))
    step = STEPS[int(torch.randint(0, len(STEPS), (1,), generator=gen))]
    return [BASE + (start + i * step) % PERIOD for i in range(length)]


def write_progression_shards(out_dir: Path, *, count: int = 200, seed: int = 0) -> Path:
    """`count` training documents, supervised after their first PROMPT tokens."""
    gen = torch.Generator().manual_seed(seed)
    with ShardWriter(out_dir, tokenizer_name="tiny", vocab_size=VOCAB, samples_per_shard=64) as writer:
        for i in range(count):
            doc = progression(gen)
            writer.add(f"prog-{i}", doc, [0] * PROMPT + [1] * (len(doc) - PROMPT))
    return out_dir


def held_out_documents(count: int = 16) -> list[list[int]]:
    return [progression(torch.Generator().manual_seed(1000 + i)) for i in range(count)]


@torch.no_grad()
def held_out_tau(drafter: DFlashDrafter, target_model, docs: list[list[int]]) -> tuple[float, float]:
    """(tau reached, tau the data allows), pooled over every anchor a >= PROMPT with a token after it."""
    drafter.eval()
    capture = FeatureCapture(target_model, drafter.config.target_layer_ids)
    embed, head = embedding_module(target_model), lm_head_module(target_model)
    block_size = drafter.config.block_size  # BLOCK in the tests; benchmarks/dflash2_selector_sweep.py also 8
    reached, allowed = [], []
    for doc in docs:
        ids = torch.tensor([doc])
        features = capture.capture(ids).features  # [1, L, K*H]; causal, so position p only saw tokens <= p
        for anchor in range(PROMPT, len(doc) - 1):
            block = torch.full((1, block_size), drafter.config.mask_token_id)
            block[0, 0] = ids[0, anchor]
            hidden = drafter(
                features=features[:, :anchor],
                block_embeds=embed(block),
                ctx_positions=torch.arange(anchor)[None],
                block_positions=torch.arange(anchor, anchor + block_size)[None],
                masks=None,
            )
            drafts = drafter.draft_tokens(hidden[:, 1:], head(hidden[:, 1:]), ids[:, anchor])[0].tolist()  # [B-1]
            slots = min(block_size - 1, len(doc) - 1 - anchor)
            accepted = 0
            while accepted < slots and drafts[accepted] == doc[anchor + 1 + accepted]:
                accepted += 1
            reached.append(1 + accepted)
            allowed.append(1 + slots)
    return sum(reached) / len(reached), sum(allowed) / len(allowed)
