"""What the trainer does when something is wrong, and the periodic evaluation hook."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from dflash_trainer.config import load_config
from dflash_trainer.data.shards import ShardError
from dflash_trainer.train.trainer import NonFiniteLossError, Trainer
from train_helpers import save_tiny_target, write_counting_shards, write_recipe


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("guards")
    return save_tiny_target(root / "target"), write_counting_shards(root / "shards", num_samples=24)


def poison_step(trainer: Trainer, bad_step: int) -> None:
    """Features become NaN while the trainer works on optimizer step `bad_step` (1-based)."""
    real = trainer._noisy

    def noisy(features):
        out = real(features)
        return out * float("nan") if trainer.step + 1 == bad_step else out

    trainer._noisy = noisy


def test_nonfinite_loss_stops_with_the_step_and_sample_ids(tmp_path, setup):
    target, shards = setup
    recipe = write_recipe(tmp_path / "r.yaml", tmp_path / "run", target, shards, train={"max_steps": 6})
    trainer = Trainer(load_config(recipe), log=lambda _: None)
    poison_step(trainer, 3)
    with pytest.raises(NonFiniteLossError, match=r"at step 3; samples \['sample-"):
        trainer.fit()


def test_nonfinite_loss_can_be_skipped_and_counted(tmp_path, setup):
    target, shards = setup
    recipe = write_recipe(
        tmp_path / "r.yaml", tmp_path / "run", target, shards, train={"max_steps": 6, "on_nonfinite": "skip"}
    )
    trainer = Trainer(load_config(recipe), log=lambda _: None)
    poison_step(trainer, 3)
    summary = trainer.fit()
    assert summary.steps == 6 and summary.skipped_nonfinite_steps == 1
    assert all(torch.isfinite(p).all() for p in trainer.drafter.parameters())


def test_malformed_shards_fail_before_touching_an_existing_run(tmp_path, setup):
    target, shards = setup
    bad = tmp_path / "bad"
    shutil.copytree(shards, bad)
    shard = bad / "shard-00000.jsonl"
    lines = shard.read_text().splitlines()
    record = json.loads(lines[1])
    record["loss_mask"] = record["loss_mask"][:-1]
    shard.write_text("\n".join([lines[0], json.dumps(record), *lines[2:]]) + "\n")
    run = tmp_path / "run"
    recipe = write_recipe(tmp_path / "good.yaml", run, target, shards, train={"max_steps": 2})
    Trainer(load_config(recipe), log=lambda _: None).fit()
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    recipe = write_recipe(tmp_path / "bad.yaml", run, target, bad, train={"max_steps": 4})
    with pytest.raises(ShardError, match=r"shard-00000\.jsonl:2: field 'loss_mask'"):
        Trainer(load_config(recipe), log=lambda _: None).fit()
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == before


def test_periodic_eval_logs_tau(tmp_path, setup):
    target, shards = setup
    recipe = write_recipe(
        tmp_path / "r.yaml",
        tmp_path / "run",
        target,
        shards,
        train={"max_steps": 4},
        eval={"every_steps": 2, "datasets": ["gsm8k"], "num_prompts": 1, "max_new_tokens": 6},
    )
    Trainer(load_config(recipe), log=lambda _: None).fit()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    taus = [(r["step"], r["eval_tau"]) for r in records if "eval_tau" in r]
    assert [step for step, _ in taus] == [2, 4]
    assert all(tau >= 1.0 for _, tau in taus)


def test_step_flags_on_the_cpu_read_their_values_without_a_copy():
    from dflash_trainer.train.trainer import StepFlags

    pending = StepFlags.queue(step=3, flags=torch.tensor([1.0, 0.0]), sample_ids=["s"])
    assert pending.copied is None and pending.read() == (1.0, 0.0)
