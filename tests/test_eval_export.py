"""The main job's at-end evaluation runs on the exported drafter file (what users serve)."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from safetensors.torch import load_file

from decoding_helpers import one_thread  # noqa: F401 (autouse fixture)
from dflash_trainer.config import load_config
from dflash_trainer.errors import InterruptedAfterTraining
from dflash_trainer.eval import runner
from dflash_trainer.launch import StopFlag
from dflash_trainer.train.pipeline import run_training
from train_helpers import save_tiny_target, write_counting_shards, write_recipe


def tiny_run_with_evaluation(tmp_path, *, drafter: dict | None = None, **evaluation):
    """A 2-step run of a tiny target evaluated at the end on two prompts (`evaluation`: more `eval` keys)."""
    target = save_tiny_target(tmp_path / "target")
    shards = write_counting_shards(tmp_path / "shards", num_samples=16)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"w{i} w{i + 5} w9"}) + "\n" for i in range(2)))
    recipe = write_recipe(
        tmp_path / "recipe.yaml",
        tmp_path / "run",
        target,
        shards,
        drafter=drafter or {},
        train={"max_steps": 2},
        eval={"at_end": True, "datasets": [str(prompts)], "num_prompts": 2, "max_new_tokens": 8, **evaluation},
    )
    return load_config(recipe, [])


def test_at_end_evaluation_reads_the_export(tmp_path, monkeypatch):
    config = tiny_run_with_evaluation(tmp_path)
    seen = []
    real_evaluate = runner.evaluate

    def spy(target, drafter, *args, **kwargs):
        seen.append(drafter)
        return real_evaluate(target, drafter, *args, **kwargs)

    monkeypatch.setattr(runner, "evaluate", spy)
    run_training(config)

    (drafter,) = seen
    exported = load_file(str(tmp_path / "run" / "export" / "model.safetensors"))
    state = drafter.state_dict()
    assert exported and all(
        torch.equal(state[name].cpu(), value.to(state[name].dtype)) for name, value in exported.items()
    )
    # The export is bf16: the evaluated weights are the rounded ones, not the float32 training weights.
    assert all(value.dtype == torch.bfloat16 for value in exported.values())
    report = json.loads((tmp_path / "run" / "eval" / "eval.json").read_text())
    assert report["complete"] and report["datasets"][0]["exact_matches"] == 2


def test_a_stop_signal_in_the_evaluation_ends_the_run_at_once_with_the_export_written(
    tmp_path, monkeypatch, restore_handlers
):
    """Nothing polls the stop flag after the last step: a SIGTERM in the end-of-run evaluation (a scheduler's
    timeout) must end the process, not announce a checkpoint while the evaluation runs on."""
    config = tiny_run_with_evaluation(tmp_path)
    stop = StopFlag().install()

    def terminated(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("the signal should have interrupted the evaluation")

    monkeypatch.setattr(runner, "evaluate", terminated)
    with pytest.raises(InterruptedAfterTraining, match="eval --drafter"):
        run_training(config, should_stop=stop)
    assert (tmp_path / "run" / "export" / "model.safetensors").is_file()
    assert not stop.requested and not (tmp_path / "run" / "eval").exists()


@pytest.mark.parametrize("codebooks", ["free", "embedding"])
def test_a_dflash2_run_with_argmax_drafts_evaluates_the_export_twice(tmp_path, monkeypatch, codebooks):
    """`eval.argmax_drafts` at the end: the export as served (the walk) into eval/ and the model card, then a fresh
    copy drafting by argmax into eval-argmax/, marked so. With `embedding` codebooks also periodic evaluations (the
    training drafter, its embedding bound) and an export in the published layout."""
    sizes = {"conv_group_size": 16, "selector_rank": 16, "selector_top_k": 8, "selector_codebooks": codebooks}
    dflash2 = {"algorithm": "dflash2", "dflash2": sizes}
    periodic = {"every_steps": 1} if codebooks == "embedding" else {}
    config = tiny_run_with_evaluation(tmp_path, drafter=dflash2, argmax_drafts=True, **periodic)
    walks = []
    real_evaluate = runner.evaluate

    def spy(target, drafter, *args, **kwargs):
        walks.append(drafter.walk_drafts)
        return real_evaluate(target, drafter, *args, **kwargs)

    monkeypatch.setattr(runner, "evaluate", spy)
    run_training(config)

    assert walks == [True, False]
    if codebooks == "embedding":
        metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        assert [sorted(k for k in r if k.startswith("eval_tau")) for r in metrics if "eval_tau" in r] == [
            ["eval_tau", "eval_tau/prompts", "eval_tau_argmax"]
        ] * 2  # both periodic evaluations ran, walking (pooled and per set) and by argmax
        exported = load_file(str(tmp_path / "run" / "export" / "model.safetensors"))
        assert "candidate_selector.successor_codebook" in exported and not any("_map" in name for name in exported)
    served = json.loads((tmp_path / "run" / "eval" / "eval.json").read_text())
    argmax = json.loads((tmp_path / "run" / "eval-argmax" / "eval.json").read_text())
    assert not served["argmax_drafts"] and argmax["argmax_drafts"]
    assert served["drafter_digest"] == argmax["drafter_digest"]  # the same weights
    assert argmax["datasets"][0]["exact_matches"] == 2  # lossless drafting by argmax too
    card = (tmp_path / "run" / "export" / "README.md").read_text()
    assert f"{served['datasets'][0]['tau']:.2f}" in card
