"""End-to-end learning: a drafter trained through the real `Trainer` reaches the acceptance length the data allows,
on the context-determined task of `progression_task.py` (arithmetic progressions whose step only the context shows).

The test fails when the training labels are shifted (the drafter learns another position), when the training mask
leaks context at or after the anchor (the drafter learns to read features that do not exist at inference), or when
it blocks the context (the step cannot be known): measured with such mutations, held-out tau drops from ~3.8 to
1.0, 1.5, 2.7 (`kv <= a`) and 1.2 of 3.87 allowed.
"""

from __future__ import annotations

import pytest
import torch

from dflash_trainer.config import load_config
from dflash_trainer.train.trainer import Trainer
from progression_task import BLOCK, held_out_documents, held_out_tau, write_progression_shards
from train_helpers import save_tiny_target, write_recipe


@pytest.fixture
def one_thread():
    # Two shared cores: a second intra-op thread makes these tiny matmuls several times slower, not faster.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_drafter_learns_a_rule_that_needs_context_and_reaches_the_allowed_tau(tmp_path, one_thread):
    write_progression_shards(tmp_path / "shards")
    target = save_tiny_target(tmp_path / "target")
    recipe = write_recipe(
        tmp_path / "r.yaml",
        tmp_path / "run",
        target,
        tmp_path / "shards",
        drafter={"num_layers": 1, "block_size": BLOCK},
        data={"token_budget": 512, "max_seq_len": 64, "max_anchors": 16},
        optim={"lr": 5e-3, "warmup_ratio": 0.05},
        train={"max_steps": 100},
        metrics={"log_every": 50},
    )
    trainer = Trainer(load_config(recipe), log=lambda _: None)
    trainer.fit()
    reached, allowed = held_out_tau(trainer.drafter, trainer.target.model, held_out_documents())
    assert allowed > 3.5  # most anchors have a full block of continuation
    assert reached >= 0.85 * allowed, (reached, allowed)
