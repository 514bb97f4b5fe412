"""The main job on the embedded default (real SmolLM2-135M target, GSM8K prompts), on a small slice."""

from __future__ import annotations

import json

import pytest

from dflash_trainer.cli import resolve_recipe
from dflash_trainer.config import load_config
from dflash_trainer.train.pipeline import run_training


@pytest.mark.slow
def test_default_recipe_on_a_small_slice(tmp_path, capsys):
    config = load_config(
        resolve_recipe(None),
        [
            f"run_dir={tmp_path / 'run'}",
            f"data.train_shards={tmp_path / 'data' / 'gsm8k'}",
            "prepare.limit=12",
            "prepare.max_new_tokens=48",
            "data.token_budget=512",
            "data.max_seq_len=256",
            "train.epochs=4",
            "optim.warmup_ratio=0.1",
            "metrics.log_every=1",
            "metrics.tensorboard=false",
            "eval.datasets=[gsm8k]",
            "eval.num_prompts=1",
            "eval.max_new_tokens=12",
        ],
    )
    summary = run_training(config)
    out = capsys.readouterr().out
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert summary.steps == len(losses) >= 8
    # Real target, regenerated data: the drafter starts far off (random states through a real LM head).
    assert sum(losses[-2:]) / 2 < 0.7 * sum(losses[:2]) / 2, losses
    assert (run / "export" / "config.json").is_file() and (run / "export" / "model.safetensors").is_file()
    report = json.loads((run / "eval" / "eval.json").read_text())
    assert report and "exported drafter" in out and "plots:" in out
    assert list((run / "plots").glob("*.png"))
