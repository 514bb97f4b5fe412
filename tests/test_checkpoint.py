"""Checkpoints: no pickle, exact round trip, checksums with fallback, disk faults, pruning, resume compatibility.

Faults are injected by patching the writers (tests run as root here, so permission bits would not stop a write;
a read-only or full filesystem is simulated by raising the OSError the kernel would raise).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from dflash_trainer import errors as errors_module
from dflash_trainer.config import load_config
from dflash_trainer.durable_io import write_safetensors
from dflash_trainer.errors import StorageError, UserError
from dflash_trainer.model.config import DrafterModelConfig
from dflash_trainer.train import checkpoint as ckpt
from dflash_trainer.train.state_codec import decode_state, encode_state
from model_helpers import tiny_drafter_config


def optimizer_state() -> tuple[dict, dict]:
    """AdamW and LambdaLR state after two steps on a small model (int keys, tuples, tensors, floats)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    for _ in range(2):
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        scheduler.step()
    return optimizer.state_dict(), scheduler.state_dict()


def trainer_state(step: int = 3) -> dict:
    optimizer, scheduler = optimizer_state()
    return {
        "step": step,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "sampler": {"epoch": 1, "consumed": 5, "seed": 0},
        "rng": ckpt.rng_state(),
        "skipped_nonfinite": 0,
        "odd": {"nan": math.nan, "inf": -math.inf, "__dunder": (1, "x")},
    }


def assert_same(a, b, where="state"):
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), where
    else:
        assert a == b, where


def save(run_dir: Path, step: int, *, keep_last: int = 3, config=None) -> Path:
    drafter = {"w": torch.randn(8, 8), "b": torch.zeros(8)}
    return ckpt.save_checkpoint(
        run_dir=run_dir,
        step=step,
        drafter_state=drafter,
        drafter_config_json=json.dumps({"block_size": 4}),
        trainer_state=trainer_state(step),
        config=config or load_config(None, [f"run_dir={run_dir}"]),
        keep_last=keep_last,
    )


# ------------------------------------------------------------------------------------------- format and codec


def test_trainer_state_round_trips_exactly_without_pickle():
    state = trainer_state()
    tree, tensors = encode_state(state)
    text = json.dumps(tree)  # plain JSON: no code, nothing to unpickle
    assert_same(decode_state(json.loads(text), tensors), state)


def test_restored_rng_continues_the_same_streams(tmp_path):
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    path = save(tmp_path / "run", 1)
    expected = (random.random(), np.random.rand(), torch.rand(1))
    ckpt.restore_rng_state(ckpt.load_checkpoint(path).trainer_state["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected


def test_codec_refuses_objects_it_cannot_store():
    with pytest.raises(TypeError, match="cannot store object"):
        encode_state({"x": object()})


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool, torch.uint32]
)
def test_safetensors_writer_is_read_by_the_reference_parser(tmp_path, dtype):
    tensors = {
        "a": (torch.randn(3, 5) * 10).to(dtype),
        "scalar": torch.tensor(7).to(dtype),
        "empty": torch.zeros(0, 4, dtype=dtype),
        "z": torch.arange(6, dtype=torch.int8).view(2, 3),
    }
    digest = write_safetensors(tmp_path / "t.safetensors", tensors)
    loaded = load_file(str(tmp_path / "t.safetensors"))
    assert digest.bytes == (tmp_path / "t.safetensors").stat().st_size
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name


def test_checkpoint_files_are_fsynced_before_the_rename(tmp_path, monkeypatch):
    synced, real_fsync = [], os.fsync

    def recording_fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    path = save(tmp_path / "run", 2)
    tmp = str(path) + ".tmp"
    for name in ckpt.load_checkpoint(path).path.iterdir():
        assert f"{tmp}/{name.name}" in synced, name
    assert tmp in synced and str(path.parent) in synced  # the directory entries too, then the rename


# ------------------------------------------------------------------------------------------- no code execution


class _Payload:
    def __reduce__(self):
        return (Path.write_text, (Path(os.environ["DFLASH_TEST_MARKER"]), "pwned"))


def plant_pickle(checkpoint: Path, marker: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A crafted trainer.pt: unpickling it writes `marker`."""
    checkpoint.mkdir(parents=True)
    # Through monkeypatch: the variable must not outlive the test (later tests and their subprocesses inherit it).
    monkeypatch.setenv("DFLASH_TEST_MARKER", str(marker))
    (checkpoint / "trainer.pt").write_bytes(pickle.dumps({"step": _Payload()}, protocol=2))
    for name in ("drafter.safetensors", "drafter_config.json", "config.yaml"):
        (checkpoint / name).write_text("")


def test_a_crafted_pickle_in_the_run_dir_is_refused_and_never_run(tmp_path, monkeypatch):
    run_dir, marker = tmp_path / "run", tmp_path / "marker"
    plant_pickle(ckpt.checkpoint_dir(run_dir) / "step-00000005", marker, monkeypatch)
    config = load_config(None, [f"run_dir={run_dir}"])
    model_config = tiny_drafter_config()
    with pytest.raises(ckpt.LegacyCheckpointError, match=r"pickle file, which can run arbitrary code") as caught:
        ckpt.preflight(config)
    assert "convert-checkpoint" in str(caught.value) and "drafter.init_from" in str(caught.value)
    with pytest.raises(ckpt.LegacyCheckpointError):
        ckpt.load_for_resume(run_dir, config, model_config)
    # Also converting only uses the restricted loader: the payload is refused, not run.
    with pytest.raises(ckpt.CheckpointError, match="restricted loader"):
        ckpt.convert_legacy_checkpoint(ckpt.checkpoint_dir(run_dir) / "step-00000005")
    assert not marker.exists()


def test_export_and_eval_still_read_the_drafter_of_a_legacy_checkpoint(tmp_path, monkeypatch):
    from dflash_trainer.train.pipeline import resolve_checkpoint

    run_dir = tmp_path / "run"
    plant_pickle(ckpt.checkpoint_dir(run_dir) / "step-00000005", tmp_path / "marker", monkeypatch)
    assert resolve_checkpoint(run_dir).name == "step-00000005"  # drafter files only; trainer.pt is never read
    assert not (tmp_path / "marker").exists()


def test_a_trusted_legacy_checkpoint_converts_and_loads(tmp_path):
    path = save(tmp_path / "run", 4)
    state = ckpt.load_checkpoint(path).trainer_state
    for name in ("manifest.json", "trainer_state.json", "trainer_state.safetensors"):
        (path / name).unlink()
    torch.save(state, path / "trainer.pt")  # what earlier versions wrote (numpy RNG state included)
    ckpt.convert_legacy_checkpoint(path)
    assert not (path / "trainer.pt").exists()
    assert_same(ckpt.load_checkpoint(path).trainer_state, state)


@pytest.mark.parametrize("payload", [[1, 2], {"a": 1}])
def test_a_trainer_pt_that_is_no_training_state_is_refused_and_left_as_it_was(tmp_path, payload):
    path = save(tmp_path / "run", 4)
    for name in ("manifest.json", "trainer_state.json", "trainer_state.safetensors"):
        (path / name).unlink()
    torch.save(payload, path / "trainer.pt")
    with pytest.raises(ckpt.CheckpointError, match=r"not a dflash-trainer training state \(it lacks step, "):
        ckpt.convert_legacy_checkpoint(path)
    assert (path / "trainer.pt").is_file() and not (path / "manifest.json").exists()


# ------------------------------------------------------------------------------------------- checksums


def test_a_damaged_newest_checkpoint_falls_back_to_the_newest_intact_one(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    older, newest = save(run_dir, 2), save(run_dir, 4)
    data = bytearray((newest / "drafter.safetensors").read_bytes())
    data[-1] ^= 0xFF  # one flipped bit in the weights: still a valid safetensors file
    (newest / "drafter.safetensors").write_bytes(bytes(data))
    warnings = []
    config = load_config(None, [f"run_dir={run_dir}"])
    model_config = DrafterModelConfig(**{**tiny_drafter_config().__dict__})
    monkeypatch.setattr(ckpt, "check_resume_compatible", lambda *args: None)  # tested below
    resumed = ckpt.load_for_resume(run_dir, config, model_config, log=warnings.append)
    assert resumed[0] == older
    assert len(warnings) == 1 and "drafter.safetensors: does not match the manifest" in warnings[0]
    # Named explicitly, the damaged checkpoint is refused rather than replaced by another.
    with pytest.raises(ckpt.CheckpointError, match="does not match the manifest"):
        ckpt.load_checkpoint(newest)


def test_no_intact_checkpoint_is_an_error_not_a_fresh_start(tmp_path):
    run_dir = tmp_path / "run"
    path = save(run_dir, 2)
    (path / "trainer_state.json").write_text("{}")
    with pytest.raises(ckpt.CheckpointError, match=r"no intact checkpoint .*checkpoint\.resume=none"):
        ckpt.newest_intact_checkpoint(run_dir, warn=lambda _: None)


# ------------------------------------------------------------------------------------------- disk faults


def test_a_full_disk_mid_checkpoint_says_so_and_leaves_no_tmp(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    before = save(run_dir, 2)
    real = ckpt.write_bytes

    def full_after_weights(path, data):
        if path.name == "trainer_state.json":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, data)

    monkeypatch.setattr(ckpt, "write_bytes", full_after_weights)
    with pytest.raises(StorageError, match=r"cannot write checkpoint step-00000004 to .* no space left on the device"):
        save(run_dir, 4)
    assert [p.name for p in ckpt.checkpoint_dir(run_dir).iterdir()] == [before.name]
    ckpt.verify_checkpoint(before)


def test_too_little_free_space_is_refused_before_writing(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    monkeypatch.setattr(ckpt, "free_bytes", lambda path: 1000)
    with pytest.raises(StorageError, match=r"needs .* 1000 B free"):
        save(run_dir, 1)
    assert list(ckpt.checkpoint_dir(run_dir).iterdir()) == []


def test_the_free_space_check_uses_the_checkpoints_real_size(tmp_path, monkeypatch):
    """A fixed 16 MiB slack refused a 9.9 MB checkpoint that fitted, and the run stopped. The check now asks for
    the files' exact sizes (in whole filesystem blocks) and no more."""
    written = save(tmp_path / "measure", 1)
    block = os.statvfs(written).f_frsize
    needed = sum(-(-p.stat().st_size // block) * block for p in written.iterdir()) + block
    real_manifest = (written / ckpt.MANIFEST).stat().st_size
    needed += -(-ckpt.MANIFEST_BYTES // block) * block - (-(-real_manifest // block) * block)  # the bound used
    assert needed < 1 << 20  # far below the old slack
    monkeypatch.setattr(ckpt, "free_bytes", lambda path: needed)
    ckpt.verify_checkpoint(save(tmp_path / "run", 1))
    monkeypatch.setattr(ckpt, "free_bytes", lambda path: needed - 1)
    with pytest.raises(StorageError, match=r"no space left on the device"):
        save(tmp_path / "run", 2)


def test_a_full_disk_at_a_periodic_checkpoint_does_not_stop_the_run(tmp_path, capsys):
    """A periodic checkpoint the disk refuses is a warning (training goes on with its state in memory, and the
    next checkpoint tries again); the last one must be written, and its error names the checkpoint to resume from."""
    run_dir = tmp_path / "run"
    save(run_dir, 2)

    def full():
        raise StorageError(errno.ENOSPC, "cannot write checkpoint step-00000004: no space left on the device")

    warnings = []
    assert ckpt.save_or_defer(full, run_dir, final=False, warn=warnings.append) is None
    assert warnings == [
        "warning: cannot write checkpoint step-00000004: no space left on the device; training goes on (the newest "
        "checkpoint is step-00000002; the next checkpoint tries again)"
    ]
    with pytest.raises(StorageError, match=r"the newest checkpoint is step-00000002, and the same command resumes"):
        ckpt.save_or_defer(full, run_dir, final=True)


def test_a_trainer_goes_on_through_a_full_disk_and_writes_once_there_is_room(tmp_path, monkeypatch):
    """End to end: the disk is full at steps 2 and 4 (checkpoints and metrics), has room again at 6."""
    from dflash_trainer.train import metrics
    from dflash_trainer.train.trainer import Trainer
    from train_helpers import save_tiny_target, write_counting_shards, write_recipe

    target = save_tiny_target(tmp_path / "target")
    shards = write_counting_shards(tmp_path / "shards", num_samples=8)
    recipe = write_recipe(
        tmp_path / "r.yaml", tmp_path / "run", target, shards, train={"max_steps": 6}, checkpoint={"every_steps": 2}
    )
    trainer = Trainer(load_config(recipe), log=lambda _: None)
    full = {"on": True}
    monkeypatch.setattr(ckpt, "free_bytes", lambda path: 0 if full["on"] else None)
    real_append = metrics.MetricsLogger._append

    def append(self, data):
        if full["on"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_append(self, data)

    monkeypatch.setattr(metrics.MetricsLogger, "_append", append)
    real_step = trainer._optimizer_step

    def step(*args, **kwargs):
        real_step(*args, **kwargs)
        full["on"] = trainer.step < 5  # space is freed during step 5

    trainer._optimizer_step = step
    summary = trainer.fit()
    assert summary.steps == 6 and summary.last_checkpoint.name == "step-00000006"
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "run")] == ["step-00000006"]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if line]
    assert [record["step"] for record in records] == [5, 6]


@pytest.mark.parametrize(("keep_last", "at_most"), [(3, 3), (2, 2), (1, 2)])
def test_pruning_happens_before_writing(tmp_path, monkeypatch, keep_last, at_most):
    """keep_last K: at most K checkpoint directories exist while one is written (K=1: the old one stays until the
    new one is complete, so 2)."""
    run_dir = tmp_path / "run"
    seen = []
    real = ckpt.write_bytes

    def counting(path, data):
        seen.append(len(list(ckpt.checkpoint_dir(run_dir).iterdir())))
        return real(path, data)

    monkeypatch.setattr(ckpt, "write_bytes", counting)
    for step in range(1, 6):
        save(run_dir, step, keep_last=keep_last)
    assert max(seen) == at_most
    assert [p.name for p in ckpt.list_checkpoints(run_dir)] == [f"step-{s:08d}" for s in range(6 - keep_last, 6)]


def test_a_read_only_run_dir_is_found_up_front(tmp_path, monkeypatch):
    real_open = Path.open

    def read_only(self, mode="r", *args, **kwargs):
        if self.name.startswith(".dflash-write-probe"):
            raise OSError(errno.EROFS, "Read-only file system")
        return real_open(self, mode, *args, **kwargs)

    monkeypatch.setattr(Path, "open", read_only)
    config = load_config(None, [f"run_dir={tmp_path / 'run'}"])
    with pytest.raises(StorageError, match=r"cannot write the run directory .* the filesystem is read-only"):
        ckpt.preflight(config)


def test_preflight_refuses_when_the_next_checkpoint_cannot_fit(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    save(run_dir, 2, keep_last=1)
    monkeypatch.setattr(ckpt, "free_bytes", lambda path: 10)
    config = load_config(None, [f"run_dir={run_dir}", "checkpoint.keep_last=1"])
    with pytest.raises(StorageError, match=r"the next checkpoint needs about"):
        ckpt.preflight(config)


# ------------------------------------------------------------------------------------------- resume settings


def test_resume_path_that_does_not_exist_is_refused(tmp_path):
    config = load_config(None, [f"run_dir={tmp_path / 'run'}", f"checkpoint.resume={tmp_path / 'nope'}"])
    with pytest.raises(ckpt.CheckpointError, match=r"checkpoint\.resume=.*nope: no such directory"):
        ckpt.preflight(config)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"block_size": 8}, r"drafter\.block_size: 4 in the checkpoint, 8 now"),
        (
            {"target_layer_ids": [1, 2, 4]},
            r"drafter\.target_layer_ids .*: \[1, 2, 3\] in the checkpoint, \[1, 2, 4\] now",
        ),
        ({"mask_token_id": 62}, r"drafter\.mask_token_id: 63 in the checkpoint, 62 now"),
        ({"num_hidden_layers": 3}, r"drafter\.num_layers: 2 in the checkpoint, 3 now"),
        ({"hidden_size": 64, "head_dim": 16}, r"target shape \(hidden_size\): 32 in the checkpoint, 64 now"),
    ],
)
def test_resuming_with_another_drafter_is_refused_naming_both_sides(tmp_path, change, named):
    saved = tiny_drafter_config()
    loaded = ckpt.LoadedCheckpoint(
        path=tmp_path / "step-00000002",
        drafter_state={},
        trainer_state={},
        drafter_config=json.loads(json.dumps(saved.__dict__)),
        run_config={"target": {"name_or_path": "t"}},
    )
    config = load_config(None, ["target.name_or_path=t"])
    ckpt.check_resume_compatible(loaded, config, saved)  # the same settings resume
    with pytest.raises(ckpt.CheckpointError, match=named):
        ckpt.check_resume_compatible(loaded, config, tiny_drafter_config(**change))


def test_a_checkpoint_written_before_a_drafter_field_existed_resumes_with_its_default(tmp_path):
    """A field added to the drafter's config since (here DFlash2's `selector_codebooks`) is absent from an older
    checkpoint's drafter_config.json: it reads as its default, and a run that changes it is refused by its key."""
    from dflash_trainer.model.dflash2 import DFlash2ModelConfig

    current = DFlash2ModelConfig.extend(
        tiny_drafter_config(), conv_kernel_size=2, conv_group_size=8, selector_rank=8, selector_top_k=6
    )
    older = {key: value for key, value in dataclasses.asdict(current).items() if key != "selector_codebooks"}
    loaded = ckpt.LoadedCheckpoint(
        path=tmp_path / "step-00000002",
        drafter_state={},
        trainer_state={},
        drafter_config=older,
        run_config={"target": {"name_or_path": "t"}},
    )
    config = load_config(None, ["target.name_or_path=t"])
    ckpt.check_resume_compatible(loaded, config, current)
    # Not across drafter families: a DFlash checkpoint (no `algorithm` key) does not take DFlash2's defaults.
    dflash = ckpt.LoadedCheckpoint(
        path=tmp_path / "step-00000002",
        drafter_state={},
        trainer_state={},
        drafter_config=dataclasses.asdict(tiny_drafter_config()),
        run_config={"target": {"name_or_path": "t"}},
    )
    with pytest.raises(ckpt.CheckpointError, match=r"drafter\.algorithm: 'dflash' in the checkpoint, 'dflash2' now"):
        ckpt.check_resume_compatible(dflash, config, current)
    changed = dataclasses.replace(current, selector_codebooks="embedding")
    with pytest.raises(ckpt.CheckpointError, match=r"drafter\.dflash2\.selector_codebooks: 'free' in the checkpoint"):
        ckpt.check_resume_compatible(loaded, config, changed)


def test_resuming_with_another_target_needs_the_flag(tmp_path):
    run_dir = tmp_path / "run"
    save(run_dir, 2, config=load_config(None, [f"run_dir={run_dir}", "target.name_or_path=/models/a"]))
    config = load_config(None, [f"run_dir={run_dir}", "target.name_or_path=/models/b"])
    with pytest.raises(ckpt.CheckpointError, match=r"'/models/a' in the checkpoint, '/models/b' now"):
        ckpt.preflight(config)
    ckpt.preflight(
        load_config(
            None, [f"run_dir={run_dir}", "target.name_or_path=/models/b", "checkpoint.allow_target_change=true"]
        )
    )


def test_config_level_mismatch_is_refused_before_the_target_loads(tmp_path):
    run_dir = tmp_path / "run"
    save(run_dir, 2, config=load_config(None, [f"run_dir={run_dir}", "drafter.block_size=16"]))
    with pytest.raises(ckpt.CheckpointError, match=r"drafter\.block_size: 16 in the checkpoint, 8 now"):
        ckpt.preflight(load_config(None, [f"run_dir={run_dir}", "drafter.block_size=8"]))
    with pytest.raises(ckpt.CheckpointError, match=r"drafter\.algorithm: 'dflash' in the checkpoint, 'dflash2' now"):
        ckpt.preflight(load_config(None, [f"run_dir={run_dir}", "drafter.block_size=16", "drafter.algorithm=dflash2"]))
    # Auto values (unset mask token) are compared after the target loads, not here.
    ckpt.preflight(load_config(None, [f"run_dir={run_dir}", "drafter.block_size=16", "drafter.mask_token_id=5"]))


def test_resuming_with_another_batch_order_is_refused_before_any_work(tmp_path):
    run_dir = tmp_path / "run"
    save(run_dir, 2, config=load_config(None, [f"run_dir={run_dir}", "data.seed=1"]))
    with pytest.raises(ckpt.CheckpointError, match=r"data\.seed: 1 in the checkpoint, 2 now \(the batch order"):
        ckpt.preflight(load_config(None, [f"run_dir={run_dir}", "data.seed=2"]))


def test_every_checkpoint_error_is_a_user_error():
    assert issubclass(ckpt.CheckpointError, UserError) and issubclass(StorageError, UserError)
    assert errors_module.is_storage_error(OSError(errno.ENOSPC, "x"))


def test_the_trainer_refuses_to_resume_with_other_taps(tmp_path):
    """End to end through Trainer.maybe_resume (no preflight): 2 steps with 3 taps, then a resume with 2."""
    from dflash_trainer.train.trainer import Trainer
    from train_helpers import save_tiny_target, write_counting_shards, write_recipe

    target = save_tiny_target(tmp_path / "target")
    shards = write_counting_shards(tmp_path / "shards", num_samples=8)
    recipe = write_recipe(tmp_path / "r.yaml", tmp_path / "run", target, shards, train={"max_steps": 2})
    Trainer(load_config(recipe), log=lambda _: None).fit()
    changed = load_config(recipe, ["drafter.num_target_features=2", "train.max_steps=4"])
    with pytest.raises(
        ckpt.CheckpointError, match=r"drafter\.target_layer_ids .*: \[1, 2, 3\] in the checkpoint, \[1, 3\] now"
    ):
        Trainer(changed, log=lambda _: None).fit()
    resumed = Trainer(load_config(recipe, ["train.max_steps=4"]), log=lambda _: None).fit()
    assert resumed.steps == 4
