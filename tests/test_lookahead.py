"""The target one step ahead (`train/lookahead.py`): its order on the CPU, and whole runs equal to the plain step."""

from __future__ import annotations

import shutil

import pytest
import torch

from dflash_trainer.config import ConfigError, load_config
from dflash_trainer.train import checkpoint as ckpt
from dflash_trainer.train.lookahead import TargetLookahead
from dflash_trainer.train.trainer import StepWork, Trainer
from train_helpers import final_weights, read_metrics, save_tiny_target, write_counting_shards, write_recipe


def steps_of(events: list[str], count: int):
    for index in range(count):
        events.append(f"made {index}")
        yield StepWork(batches=[f"batch {index}"], outputs=[None], loss_scale=1.0)


def test_the_next_steps_target_runs_before_this_step_is_handed_out():
    events: list[str] = []

    def compute(batch):
        events.append(f"target {batch}")
        return f"outputs of {batch}"

    for work in TargetLookahead(steps_of(events, 3), compute, device=torch.device("cpu")):
        events.append(f"train {work.batches[0]} with {work.outputs[0]}")
    assert events == [
        "made 0",
        "target batch 0",
        "made 1",
        "target batch 1",
        "train batch 0 with outputs of batch 0",
        "made 2",
        "target batch 2",
        "train batch 1 with outputs of batch 1",
        "train batch 2 with outputs of batch 2",
    ]


def test_stopping_early_closes_the_source_and_steps_with_outputs_are_refused():
    events: list[str] = []
    source = steps_of(events, 10)
    lookahead = iter(TargetLookahead(source, lambda batch: batch, device=torch.device("cpu")))
    next(lookahead)
    lookahead.close()
    assert events == ["made 0", "made 1"]  # step 1 prepared ahead; nothing more asked of the source
    with pytest.raises(StopIteration):
        next(source)  # closed with the lookahead

    ready = iter([StepWork(batches=["b"], outputs=["another rank's"], loss_scale=1.0)])
    with pytest.raises(ValueError, match="already"):
        next(iter(TargetLookahead(ready, lambda batch: batch, device=torch.device("cpu"))))


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_counting_shards(tmp_path_factory.mktemp("data") / "shards")


def train_with_and_without_lookahead(tmp_path, shards, *, steps, label_source, overrides=()):
    """The same tiny run without and with `train.target_lookahead`: {lookahead: (losses per step, final weights)};
    checks that each run asked for the target's outputs once per step (none past the last)."""
    target = save_tiny_target(tmp_path / "target")
    runs = {}
    for lookahead in (False, True):
        run_dir = tmp_path / f"run-{lookahead}"
        recipe = write_recipe(
            tmp_path / f"{lookahead}.yaml",
            run_dir,
            target,
            shards,
            train={"max_steps": steps, "target_lookahead": lookahead},
            loss={"label_source": label_source},
            metrics={"log_every": 1},
        )
        trainer = Trainer(load_config(recipe, list(overrides)), log=lambda _: None)
        calls = []
        real = trainer._target_outputs
        trainer._target_outputs = lambda batch, real=real, calls=calls: calls.append(1) or real(batch)
        assert trainer.fit().steps == steps and len(calls) == steps
        weights = final_weights(run_dir)
        runs[lookahead] = ([r["loss"] for r in read_metrics(run_dir)], weights)
    assert len(runs[False][0]) == steps and runs[False][1].keys() == runs[True][1].keys()
    return runs


@pytest.mark.parametrize("label_source", ["data", "target_argmax"])
def test_a_run_with_the_target_one_step_ahead_is_the_run_without_it(tmp_path, shards, label_source):
    """Six steps with and without `train.target_lookahead`: the same losses at every step and the same weights."""
    runs = train_with_and_without_lookahead(tmp_path, shards, steps=6, label_source=label_source)
    (losses, weights), (ahead_losses, ahead_weights) = runs[False], runs[True]
    assert ahead_losses == losses
    for name, tensor in weights.items():
        assert torch.equal(ahead_weights[name], tensor), name


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["target.compile=true", "target.compile_mode=reduce-overhead"], "reduce-overhead"),
        (["placement.target_ranks=[0]", "placement.drafter_ranks=[1]"], "colocated"),
    ],
)
def test_the_lookahead_is_refused_where_it_cannot_run(tmp_path, overrides, message):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("{}\n")
    with pytest.raises(ConfigError, match=message):
        load_config(recipe, ["train.target_lookahead=true", *overrides])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_side_stream_run_trains_as_the_plain_step(tmp_path, shards):
    """The real loop on CUDA (compiled target layers, flex, bf16, target-argmax labels): the target's forward of the
    next step runs on a side stream beside this step, and every step's loss and the final weights are the plain
    run's: the same kernels on the same inputs, only their order on the device differs."""
    runs = train_with_and_without_lookahead(
        tmp_path,
        shards,
        steps=12,
        label_source="target_argmax",
        overrides=["target.device=cuda", "target.compile=true"],
    )
    (losses, weights), (ahead_losses, ahead_weights) = runs[False], runs[True]
    torch.testing.assert_close(torch.tensor(ahead_losses), torch.tensor(losses), rtol=1e-5, atol=1e-6)
    for name, tensor in weights.items():
        torch.testing.assert_close(ahead_weights[name], tensor, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("algorithm", ["dflash", "dflash2"])
def test_a_checkpoint_taken_with_a_step_prepared_ahead_resumes_to_the_uninterrupted_run(tmp_path, shards, algorithm):
    """With the lookahead, step n+1's batch is drawn and its target run before step n's checkpoint is written: the
    checkpoint must name the data position of the steps trained, not of the step prepared; and a periodic evaluation
    between steps waits for the forward in flight. A run resumed from its step-3 checkpoint (the later one removed)
    ends with the uninterrupted run's weights and losses."""
    target = save_tiny_target(tmp_path / "target")
    run_dir = tmp_path / "straight"
    recipe = write_recipe(
        tmp_path / "r.yaml",
        run_dir,
        target,
        shards,
        drafter={"algorithm": algorithm},
        train={"max_steps": 6, "target_lookahead": True},
        checkpoint={"every_steps": 3, "keep_last": 2},
        eval={"every_steps": 3, "datasets": ["gsm8k"], "num_prompts": 1, "max_new_tokens": 6},
    )
    assert Trainer(load_config(recipe), log=lambda _: None).fit().steps == 6
    assert [r["step"] for r in read_metrics(run_dir) if "eval_tau" in r] == [3, 6]  # settled, evaluated, went on
    want_losses = [r["loss"] for r in read_metrics(run_dir) if "loss" in r]
    want_weights = final_weights(run_dir)

    resumed_dir = tmp_path / "resumed"
    shutil.copytree(run_dir, resumed_dir)
    shutil.rmtree(ckpt.latest_checkpoint(resumed_dir))  # as if stopped right after step 3's checkpoint
    assert ckpt.latest_checkpoint(resumed_dir).name == "step-00000003"
    resumed = Trainer(load_config(recipe, [f"run_dir={resumed_dir}"]), log=lambda _: None).fit()
    assert resumed.steps == 6
    assert [r["loss"] for r in read_metrics(resumed_dir) if "loss" in r] == want_losses
    got_weights = final_weights(resumed_dir)
    assert got_weights.keys() == want_weights.keys()
    for name, tensor in want_weights.items():
        assert torch.equal(got_weights[name], tensor), name
