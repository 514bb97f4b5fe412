"""DFlash2 under FSDP2 (train/sharding.py, `Fsdp2Sync`): the selector's term reads its parameters outside the
drafter's forward, so the selector is its own FSDP unit called through its forward. Two ranks over gloo with
FSDP2 must train exactly as two DDP ranks on the same data and seed (loss curve and final weights, the selector's
included: its gradients are averaged over the ranks), with grad accumulation and the periodic evaluation (decoding
walks the selector on the sharded drafter), and a checkpoint FSDP2 wrote resumes to the same weights.

The runs go through the CLI (`--nproc 2`, i.e. torchrun) and are cached per module."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dflash_trainer.export import import_drafter
from dflash_trainer.model.dflash2 import DFlash2Drafter
from train_helpers import (
    assert_same_weights,
    final_weights,
    read_metrics,
    save_tiny_target,
    write_counting_shards,
    write_recipe,
)

SRC = Path(__file__).resolve().parents[1] / "src"
STEPS = 4
# Sizes for the tiny target (hidden 64): 4 groups of 16 channels, a rank-16 selector over 8 candidates.
DFLASH2 = {"algorithm": "dflash2", "dflash2": {"conv_group_size": 16, "selector_rank": 16, "selector_top_k": 8}}
SELECTOR = ("candidate_selector.hidden_projection.weight", "candidate_selector.successor_codebook")


class Runs:
    """Two-rank runs of one tiny DFlash2 recipe, by sharding, cached for the module."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.target = save_tiny_target(root / "target")
        self.shards = write_counting_shards(root / "shards", num_samples=40)
        self._done: dict[str, Path] = {}

    def run(self, sharding: str) -> Path:
        if sharding not in self._done:
            self._done[sharding] = self.train(sharding, sharding)
        return self._done[sharding]

    def train(self, name: str, sharding: str) -> Path:
        """A run of STEPS steps with grad_accum 2 (a checkpoint at step 2) on 2 ranks; returns its run dir."""
        recipe = write_recipe(
            self.root / f"{name}.yaml",
            self.root / name,
            self.target,
            self.shards,
            drafter={**DFLASH2, "num_layers": 2, "block_size": 4},
            optim={"grad_accum": 2, "lr": 3e-3},
            # No warmup: the selector term counts from the first step.
            loss={"selector": {"warmup_ratio": 0.0, "ramp_ratio": 0.0}},
            train={"max_steps": STEPS},
            checkpoint={"every_steps": 2},
            placement={"sharding": sharding},
            # Decoding on the sharded drafter: the selector's walk gathers its parameters too.
            # And again drafting each slot's argmax (the walk's held-out gain): twice the collective gathers.
            eval={
                "every_steps": 2,
                "datasets": ["gsm8k"],
                "num_prompts": 1,
                "max_new_tokens": 6,
                "argmax_drafts": True,
            },
        )
        env = {**os.environ, "PYTHONPATH": str(SRC), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        command = [sys.executable, "-m", "dflash_trainer", "train", str(recipe), "--nproc", "2"]
        proc = subprocess.run(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240
        )
        assert proc.returncode == 0, proc.stdout
        return self.root / name


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("dflash2-fsdp2"))


def step_records(run_dir: Path) -> list[dict]:
    """The training steps' records (the periodic evaluation's `eval_tau` records left out)."""
    return [record for record in read_metrics(run_dir) if "loss" in record]


@pytest.mark.slow
def test_fsdp2_trains_dflash2_as_ddp_selector_included(runs):
    ddp, fsdp2 = runs.run("ddp"), runs.run("fsdp2")
    want, got = step_records(ddp), step_records(fsdp2)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for key in ("loss", "selector_loss"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in want], abs=1e-5), key
    # Evaluated on the sharded drafter (weights equal to DDP's up to rounding, so a near tie may decide otherwise).
    taus = {r["step"]: r["eval_tau"] for r in read_metrics(fsdp2) if "eval_tau" in r}
    want_taus = {r["step"]: r["eval_tau"] for r in read_metrics(ddp) if "eval_tau" in r}
    assert list(taus) == list(want_taus) == [2, 4] and all(tau >= 1.0 for tau in taus.values())
    assert list(taus.values()) == pytest.approx(list(want_taus.values()), abs=0.5)
    argmax_taus = {r["step"]: r["eval_tau_argmax"] for r in read_metrics(fsdp2) if "eval_tau" in r}
    want_argmax = {r["step"]: r["eval_tau_argmax"] for r in read_metrics(ddp) if "eval_tau" in r}
    assert list(argmax_taus) == [2, 4] and all(tau >= 1.0 for tau in argmax_taus.values())
    assert list(argmax_taus.values()) == pytest.approx(list(want_argmax.values()), abs=0.5)
    # Summed in another order (per shard, then over ranks): float32 rounding apart.
    assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in want], rel=1e-6)
    weights = final_weights(fsdp2)
    # The selector trained (its successor codebook starts at zero) and equals DDP's: its gradients were averaged.
    assert all(weights[name].abs().sum() > 0 for name in SELECTOR)
    assert_same_weights(weights, final_weights(ddp))
    # The export (rank 0, from the gathered state) is a DFlash2 drafter with the trained selector, in bf16.
    exported = import_drafter(fsdp2 / "export")
    assert isinstance(exported, DFlash2Drafter)
    for name in SELECTOR:
        want = weights[name].to(torch.bfloat16).float()
        torch.testing.assert_close(exported.state_dict()[name], want, rtol=0, atol=0, msg=name)


@pytest.mark.slow
def test_a_dflash2_checkpoint_written_under_fsdp2_resumes_to_the_same_weights(runs):
    source = runs.run("fsdp2")
    run_dir = runs.root / "resumed"
    shutil.copytree(source / "checkpoints" / "step-00000002", run_dir / "checkpoints" / "step-00000002")
    runs.train("resumed", "fsdp2")
    assert [r["step"] for r in step_records(run_dir)] == [3, 4]
    assert_same_weights(final_weights(run_dir), final_weights(source))


def _decoding_rank(rank: int, store_file: str, out_dir: str) -> None:
    """Speculative decoding with a DFlash2 drafter under FSDP2: its gathers counted inside and outside
    `gathered_for_decoding`, and its outputs against the unsharded drafter's."""
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as param_group

    from decoding_helpers import tiny_qwen3_target
    from dflash_trainer.decoding.speculative import SpeculativeDecoder
    from dflash_trainer.train.sharding import Fsdp2Sync
    from test_dflash2_decoding import dflash2_drafter, prompts

    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    target = tiny_qwen3_target()
    drafter = dflash2_drafter(target, block_size=4, seed=1)

    def decode() -> list[list[int]]:
        decoder = SpeculativeDecoder(target, drafter, prompts(2), max_new_tokens=12, stop_token_ids=[])
        return [result.output_ids for result in decoder.run().results]

    reference = decode()
    sync = Fsdp2Sync(drafter)
    gathers = []
    all_gather = param_group.foreach_all_gather  # FSDP2's one all-gather per unit and gather (torch 2.13)

    def counted(*args, **kwargs):
        gathers.append(1)
        return all_gather(*args, **kwargs)

    param_group.foreach_all_gather = counted
    with sync.gathered_for_decoding():
        at_entry = len(gathers)
        inside = decode()
        during = len(gathers) - at_entry
    outside_start = len(gathers)
    decode()
    result = {"at_entry": at_entry, "during": during, "outside": len(gathers) - outside_start}
    result["same"] = inside == reference
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


@pytest.mark.slow
def test_decoding_on_the_sharded_drafter_gathers_once_then_runs_collective_free(tmp_path):
    """The periodic evaluation's decoding calls the drafter a data-dependent number of times: inside
    `gathered_for_decoding` every unit (the selector, two layers, the root) is gathered once at entry and decoding
    issues no collective, so ranks that stop decoding at different steps cannot desynchronise; outside it, decoding
    gathers per call."""
    mp.spawn(_decoding_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["same"]  # the sharded drafter, gathered, drafts what the plain one drafts
        assert result["at_entry"] == 4 and result["during"] == 0 and result["outside"] > 4
