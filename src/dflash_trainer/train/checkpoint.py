"""Training checkpoints: atomic, durable, verified when loaded, never unpickled; numbered by step, the last K kept.

Layout of `RUN_DIR/checkpoints/step-00001234/`:
  drafter.safetensors        drafter weights (fp32 master copy)
  drafter_config.json        the drafter architecture (DrafterModelConfig)
  trainer_state.json         step, scheduler, sampler position, data position, RNG states, counters
  trainer_state.safetensors  the tensors trainer_state.json refers to (optimizer moments, RNG states)
  config.yaml                the resolved run config
  manifest.json              format, step and {file: {bytes, sha256}} of every file above; written last
Nothing is unpickled: JSON, YAML (safe loader) and safetensors are parsed, and `train/state_codec.py` maps the
nested trainer state onto them exactly. Checkpoints of earlier versions hold `trainer.pt` (a pickle, which can run
code when loaded); they are refused with a message, and `dflash-trainer convert-checkpoint` converts one the user
trusts (`convert_legacy_checkpoint`).

Writing (`save_checkpoint`, main rank only):
1. stale `*.tmp` directories are removed, and old checkpoints are pruned *before* the new one is written, so that
   at most `keep_last` checkpoints exist at any time, the one being written included (`keep_last: 3` needs room
   for 3). With `keep_last: 1` the previous checkpoint is kept until the new one is complete (room for 2):
   pruning first would leave no checkpoint at all if the write failed.
2. the free space is compared with the size of the state; too little is refused before anything is written.
3. every file is written into `step-XXXXXXXX.tmp` and fsync'd, the manifest last; the directory is fsync'd,
   renamed to `step-XXXXXXXX`, and the rename made durable (fsync of `checkpoints/`). A crash at any point
   leaves either the complete checkpoint or a `.tmp` that the next save removes.
4. an OSError removes the `.tmp`; a storage fault (no space, read-only, quota) becomes a `StorageError` naming
   the checkpoint and the free space.

Loading (`load_checkpoint`) checks every file against the manifest (size, SHA-256) first. Resuming with
`checkpoint.resume: auto` falls back, with a warning, to the newest checkpoint that passes; a checkpoint named
explicitly must pass itself. `check_resume_compatible` refuses a checkpoint whose drafter (block size, taps,
mask token, layers, dimensions) or target differs from the run's, naming both values; `preflight` does the
config-level part of that, the run directory's writability and the resume path, before any work.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import random
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..config import RunConfig, config_to_dict
from ..distributed.failure import injected_write_fault
from ..durable_io import (
    FileDigest,
    file_digest,
    fsync_dir,
    safetensors_file_size,
    write_bytes,
    write_safetensors,
)
from ..errors import (
    StorageError,
    UserError,
    check_writable,
    format_bytes,
    free_bytes,
    is_storage_error,
    storage_error,
)
from ..model.config import DrafterModelConfig
from .state_codec import decode_state, encode_state

CHECKPOINT_PATTERN = re.compile(r"^step-(\d{8})$")
FORMAT = "dflash-checkpoint/2"
MANIFEST = "manifest.json"
DRAFTER_WEIGHTS = "drafter.safetensors"
DRAFTER_CONFIG = "drafter_config.json"
STATE_JSON = "trainer_state.json"
STATE_TENSORS = "trainer_state.safetensors"
RUN_CONFIG = "config.yaml"
LEGACY_STATE = "trainer.pt"
# An upper bound of manifest.json's size (six file names with sizes and SHA-256 digests), for the free-space check.
MANIFEST_BYTES = 4096

# DrafterModelConfig fields -> the recipe key that sets them, for resume-mismatch messages.
_RECIPE_KEYS = {
    "block_size": "drafter.block_size",
    "target_layer_ids": "drafter.target_layer_ids / drafter.num_target_features",
    "mask_token_id": "drafter.mask_token_id",
    "num_hidden_layers": "drafter.num_layers",
    "intermediate_size": "drafter.intermediate_size",
    "layer_types": "drafter.sliding_layers",
    "sliding_window": "drafter.sliding_window",
    "sliding_causal_in_block": "drafter.sliding_causal_in_block",
    "conv_kernel_size": "drafter.dflash2.conv_kernel_size",
    "conv_group_size": "drafter.dflash2.conv_group_size",
    "selector_rank": "drafter.dflash2.selector_rank",
    "selector_top_k": "drafter.dflash2.selector_top_k",
    "selector_codebooks": "drafter.dflash2.selector_codebooks",
}
# Recipe keys the batch order depends on (the sampler refuses a resume that changes them).
_DATA_ORDER_KEYS = ("seed", "token_budget", "max_seq_len", "max_batch_size", "packing")
# Recipe keys that shape the drafter; compared before any work when both sides set them explicitly.
_ARCHITECTURE_RECIPE_KEYS = (
    "algorithm",
    "num_layers",
    "num_target_features",
    "target_layer_ids",
    "block_size",
    "mask_token_id",
    "intermediate_size",
    "sliding_layers",
    "sliding_window",
    "sliding_causal_in_block",
)


class CheckpointError(UserError):
    """A checkpoint is missing, incomplete, corrupt, of an older format, or does not fit this run."""


class LegacyCheckpointError(CheckpointError):
    """A checkpoint of an earlier version (trainer.pt, a pickle): refused unless converted explicitly."""


@dataclass
class LoadedCheckpoint:
    path: Path
    drafter_state: dict[str, torch.Tensor]
    trainer_state: dict[str, Any]
    drafter_config: dict[str, Any]
    run_config: dict[str, Any]


# ----------------------------------------------------------------------------------------------------------
# Finding checkpoints


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Completed checkpoints (by name: verify with `verify_checkpoint`), oldest first."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and CHECKPOINT_PATTERN.match(p.name)]
    return sorted(found, key=lambda p: int(CHECKPOINT_PATTERN.match(p.name).group(1)))


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def newest_intact_checkpoint(
    run_dir: str | Path, warn: Callable[[str], object] = print, *, drafter_only: bool = False
) -> Path | None:
    """The newest checkpoint of `run_dir` whose files match its manifest; newer broken ones are reported
    through `warn`. None when the run has no checkpoint; CheckpointError when none is intact.

    `drafter_only` (export, eval): a checkpoint of an earlier version counts too, since its drafter files
    (safetensors + JSON) are safe to read; only its trainer.pt is not, and that is not read."""
    problems = []
    for path in reversed(list_checkpoints(run_dir)):
        try:
            verify_checkpoint(path)
        except LegacyCheckpointError:
            if drafter_only:
                return path
            raise
        except CheckpointError as error:
            problems.append(str(error))
            warn(f"warning: skipping unreadable checkpoint: {error}")
            continue
        return path
    if problems:
        raise CheckpointError(
            f"{checkpoint_dir(run_dir)}: no intact checkpoint ({len(problems)} unreadable); "
            "set checkpoint.resume=none to start over"
        )
    return None


# ----------------------------------------------------------------------------------------------------------
# RNG state


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ----------------------------------------------------------------------------------------------------------
# Writing


def save_checkpoint(
    *,
    run_dir: str | Path,
    step: int,
    drafter_state: dict[str, torch.Tensor],
    drafter_config_json: str,
    trainer_state: dict[str, Any],
    config: RunConfig,
    keep_last: int,
) -> Path:
    """Write checkpoint `step` of `run_dir` (see the module docstring); return its directory."""
    root = checkpoint_dir(run_dir)
    final = root / f"step-{step:08d}"
    tmp = root / f"step-{step:08d}.tmp"
    what = f"checkpoint {final.name}"
    state_tree, state_tensors = encode_state(trainer_state)
    # The small files as bytes first: with the tensor files' exact sizes they size the free-space check.
    small_files = {
        STATE_JSON: json.dumps(state_tree).encode("utf-8"),
        DRAFTER_CONFIG: drafter_config_json.encode("utf-8"),
        RUN_CONFIG: yaml.safe_dump(config_to_dict(config), sort_keys=False).encode("utf-8"),
    }
    sizes = [safetensors_file_size(drafter_state), safetensors_file_size(state_tensors)]
    sizes += [len(data) for data in small_files.values()] + [MANIFEST_BYTES]
    try:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob("*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        if keep_last >= 2:
            _prune(run_dir, keep=keep_last - 1, exclude=final)
        _check_free_space(root, what, sizes)
        tmp.mkdir()
        files: dict[str, FileDigest] = {}
        files[DRAFTER_WEIGHTS] = write_safetensors(tmp / DRAFTER_WEIGHTS, drafter_state)
        injected_write_fault(what)
        files[STATE_TENSORS] = write_safetensors(tmp / STATE_TENSORS, state_tensors)
        for name, data in small_files.items():
            files[name] = write_bytes(tmp / name, data)
        _write_manifest(tmp, step, files)
        _move_into_place(tmp, final)
    except OSError as error:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_storage_error(error) and not isinstance(error, StorageError):
            raise storage_error(what, root, error) from error
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep_last < 2:
        _prune(run_dir, keep=keep_last, exclude=None)
    return final


def save_or_defer(
    save: Callable[[], Path], run_dir: str | Path, *, final: bool, warn: Callable[[str], object] = print
) -> Path | None:
    """`save()`, where a full disk (a StorageError) does not cost the run its work so far:
    - a periodic checkpoint (`final` False) that cannot be written is a warning: training goes on with its state
      in memory, and the next checkpoint tries again (space freed meanwhile is used); returns None;
    - the last checkpoint (end of training, stop signal) cannot wait: a StorageError naming the newest checkpoint
      on disk, from which the same command resumes once there is room (older checkpoints are always intact:
      a failed write leaves only a `.tmp`, removed at once)."""
    try:
        return save()
    except StorageError as error:
        newest = latest_checkpoint(run_dir)
        where = f"the newest checkpoint is {newest.name}" if newest else "no checkpoint is written yet"
        if final:
            raise StorageError(
                error.errno, f"{error}; {where}, and the same command resumes from it once there is room"
            ) from error
        warn(f"warning: {error}; training goes on ({where}; the next checkpoint tries again)")
        return None


def _prune(run_dir: str | Path, *, keep: int, exclude: Path | None) -> None:
    """Delete all but the newest `keep` checkpoints (never `exclude`, the step being rewritten)."""
    existing = [path for path in list_checkpoints(run_dir) if path != exclude]
    for old in existing[: max(0, len(existing) - keep)]:
        shutil.rmtree(old, ignore_errors=True)


def _check_free_space(root: Path, what: str, file_sizes: list[int]) -> None:
    """Refuse before writing when the files (exact sizes) cannot fit: each takes whole filesystem blocks, and the
    checkpoint's directory one more. No fixed slack: a checkpoint that fits is written (a 16 MiB slack refused a
    9.9 MB checkpoint on a disk with room for it, and the run stopped)."""
    block = _block_size(root)
    needed = sum(-(-size // block) * block for size in file_sizes) + block
    free = free_bytes(root)
    if free is not None and free < needed:
        raise StorageError(
            errno.ENOSPC,
            f"cannot write {what} to {root}: no space left on the device (needs {format_bytes(needed)}, "
            f"{format_bytes(free)} free); free some space, lower checkpoint.keep_last, or move run_dir",
        )


def _block_size(path: Path) -> int:
    try:
        return os.statvfs(path).f_frsize or 4096
    except OSError:
        return 4096


def _write_manifest(directory: Path, step: int, files: dict[str, FileDigest]) -> None:
    manifest = {"format": FORMAT, "step": step, "files": {name: digest.to_dict() for name, digest in files.items()}}
    write_bytes(directory / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode("utf-8"))
    fsync_dir(directory)


def _move_into_place(tmp: Path, final: Path) -> None:
    """Rename `tmp` to `final`; an existing `final` (the same step saved twice, e.g. an interrupt right after a
    periodic save) is moved aside first and deleted once the new one is in place."""
    old = None
    if final.exists():
        old = final.with_name(final.name + ".old.tmp")
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ----------------------------------------------------------------------------------------------------------
# Reading


def _legacy_message(path: Path) -> str:
    return (
        f"{path}: checkpoint of an earlier dflash-trainer version ({LEGACY_STATE}, a pickle file, which can run "
        "arbitrary code when loaded) is not loaded. If you trust its origin, convert it once with "
        f"`dflash-trainer convert-checkpoint {path}`; otherwise start a new run from its weights only with "
        f"drafter.init_from={path} (fresh optimizer state)"
    )


def _read_manifest(path: Path) -> dict[str, Any]:
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        if (path / LEGACY_STATE).is_file():
            raise LegacyCheckpointError(_legacy_message(path))
        if not path.is_dir():
            raise CheckpointError(f"{path}: no such checkpoint directory")
        raise CheckpointError(f"{path}: not a training checkpoint (no {MANIFEST})")
    try:
        manifest = json.loads(manifest_path.read_bytes())
    except (OSError, ValueError, RecursionError) as error:
        raise CheckpointError(f"{manifest_path}: unreadable: {error}") from error
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{manifest_path}: not a {FORMAT} manifest")
    return manifest


def verify_checkpoint(path: str | Path) -> dict[str, Any]:
    """Check every file of checkpoint `path` against its manifest (presence, size, SHA-256); return the manifest.
    Raises CheckpointError naming the first file that does not match."""
    path = Path(path)
    manifest = _read_manifest(path)
    for name in (DRAFTER_WEIGHTS, DRAFTER_CONFIG, STATE_JSON, STATE_TENSORS, RUN_CONFIG):
        expected = manifest["files"].get(name)
        if not isinstance(expected, dict):
            raise CheckpointError(f"{path}: manifest lists no {name}")
        try:
            found = file_digest(path / name)
        except OSError as error:
            raise CheckpointError(f"{path / name}: unreadable: {error.strerror or error}") from error
        if found.bytes != expected.get("bytes") or found.sha256 != expected.get("sha256"):
            raise CheckpointError(
                f"{path / name}: does not match the manifest ({found.bytes} bytes, expected {expected.get('bytes')};"
                " checksum differs): the file is damaged or was changed"
            )
    return manifest


def load_checkpoint(path: str | Path) -> LoadedCheckpoint:
    """Verify and read checkpoint `path`."""
    path = Path(path)
    verify_checkpoint(path)
    try:
        drafter_state = load_file(str(path / DRAFTER_WEIGHTS))
        tensors = load_file(str(path / STATE_TENSORS))
        trainer_state = decode_state(json.loads((path / STATE_JSON).read_bytes()), tensors)
        drafter_config = json.loads((path / DRAFTER_CONFIG).read_bytes())
        run_config = yaml.safe_load((path / RUN_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError, SafetensorError, yaml.YAMLError, RecursionError) as error:
        raise CheckpointError(f"{path}: cannot read: {error}") from error
    if not isinstance(trainer_state, dict) or not isinstance(drafter_config, dict) or not isinstance(run_config, dict):
        raise CheckpointError(f"{path}: trainer state, drafter config or run config is not a mapping")
    return LoadedCheckpoint(path, drafter_state, trainer_state, drafter_config, run_config)


def _is_checkpoint(path: Path) -> bool:
    return (path / MANIFEST).is_file() or (path / LEGACY_STATE).is_file()


def resume_source(run_dir: str | Path, choice: str) -> Path | None:
    """The checkpoint directory `checkpoint.resume` names, unverified: None for `none` or a run without
    checkpoints; the newest checkpoint for `auto` or a run directory; else the named checkpoint, which must exist."""
    if choice == "none":
        return None
    if choice == "auto":
        return latest_checkpoint(run_dir)
    path = Path(choice)
    if _is_checkpoint(path):
        return path
    if checkpoint_dir(path).is_dir():
        newest = latest_checkpoint(path)
        if newest is None:
            raise CheckpointError(f"checkpoint.resume={choice}: run directory without checkpoints")
        return newest
    if not path.exists():
        raise CheckpointError(
            f"checkpoint.resume={choice}: no such directory; give a checkpoint (RUN_DIR/checkpoints/step-XXXXXXXX) "
            "or a run directory"
        )
    raise CheckpointError(f"checkpoint.resume={choice}: not a training checkpoint or run directory")


def load_for_resume(
    run_dir: str | Path,
    config: RunConfig,
    model_config: DrafterModelConfig,
    *,
    log: Callable[[str], object] = print,
) -> tuple[Path, dict[str, torch.Tensor], dict[str, Any]] | None:
    """(checkpoint, drafter state, trainer state) to resume from per `config.checkpoint.resume`, checked against
    this run's config and drafter; None when there is nothing to resume.

    `auto` or a run directory: the newest intact checkpoint, with a warning for each broken newer one. A
    checkpoint named explicitly must be intact itself."""
    path = resume_source(run_dir, config.checkpoint.resume)
    if path is None:
        return None
    if not _is_checkpoint(Path(config.checkpoint.resume)):
        path = newest_intact_checkpoint(path.parent.parent, warn=log)
    loaded = load_checkpoint(path)
    check_resume_compatible(loaded, config, model_config)
    return loaded.path, loaded.drafter_state, loaded.trainer_state


# ----------------------------------------------------------------------------------------------------------
# Resume compatibility


def _differences(saved: dict[str, Any], now: dict[str, Any], keys: list[str] | tuple[str, ...]) -> list[tuple]:
    return [(key, saved.get(key), now.get(key)) for key in keys if saved.get(key) != now.get(key)]


def _refuse(source: Path, rows: list[str]) -> CheckpointError:
    return CheckpointError(
        f"cannot resume from {source}: it was trained with other settings ({'; '.join(rows)}). Resume with the "
        "checkpoint's values (its config.yaml), or train these settings in a new run_dir"
    )


def check_resume_compatible(loaded: LoadedCheckpoint, config: RunConfig, model_config: DrafterModelConfig) -> None:
    """Refuse a checkpoint whose drafter architecture or target differs from this run's (both values named)."""
    now = dataclasses.asdict(model_config)
    # The drafter family first (a DFlash checkpoint has no `algorithm` key): the defaults below are this family's.
    saved_algorithm = loaded.drafter_config.get("algorithm", "dflash")
    current_algorithm = now.get("algorithm", "dflash")
    if saved_algorithm != current_algorithm:
        raise _refuse(
            loaded.path, [f"drafter.algorithm: {saved_algorithm!r} in the checkpoint, {current_algorithm!r} now"]
        )
    # A field added since the checkpoint was written reads as its default (which keeps the older behaviour).
    defaults = {f.name: f.default for f in dataclasses.fields(model_config) if f.default is not dataclasses.MISSING}
    saved = {**defaults, **loaded.drafter_config}
    rows = [
        f"{_RECIPE_KEYS.get(key, f'target shape ({key})')}: {before!r} in the checkpoint, {current!r} now"
        for key, before, current in _differences(saved, now, list(now))
    ]
    rows += _target_differences(loaded.run_config, config)
    if rows:
        raise _refuse(loaded.path, rows)


def _target_differences(saved_config: dict[str, Any], config: RunConfig) -> list[str]:
    if config.checkpoint.allow_target_change:
        return []
    saved_target = (saved_config.get("target") or {}).get("name_or_path")
    if saved_target is None or saved_target == config.target.name_or_path:
        return []
    return [
        f"target.name_or_path: {saved_target!r} in the checkpoint, {config.target.name_or_path!r} now "
        "(if only its location changed, set checkpoint.allow_target_change=true)"
    ]


def check_resume_config(source: Path, saved_config: dict[str, Any], config: RunConfig) -> None:
    """The config-level part of `check_resume_compatible`, before the target is loaded: drafter keys both
    configs set explicitly, the data settings the batch order depends on, and the target."""
    saved_drafter = saved_config.get("drafter") or {}
    now = config_to_dict(config)["drafter"]
    rows = [
        f"drafter.{key}: {saved!r} in the checkpoint, {current!r} now"
        for key, saved, current in _differences(saved_drafter, now, _ARCHITECTURE_RECIPE_KEYS)
        if saved is not None and current is not None
    ]
    saved_data = saved_config.get("data") or {}
    now_data = config_to_dict(config)["data"]
    rows += [
        f"data.{key}: {saved!r} in the checkpoint, {current!r} now (the batch order would not continue)"
        for key, saved, current in _differences(saved_data, now_data, _DATA_ORDER_KEYS)
        if key in saved_data
    ]
    rows += _target_differences(saved_config, config)
    if rows:
        raise _refuse(source, rows)


# ----------------------------------------------------------------------------------------------------------
# Before any work


def preflight(config: RunConfig) -> None:
    """Checks that need neither the target nor the data, run before both are loaded: the run directory can be
    written, `checkpoint.resume` names a checkpoint (of this version), its config fits this run, and the disk
    holds another checkpoint of the size of the newest one."""
    check_writable(config.run_dir, "the run directory (run_dir)")
    source = resume_source(config.run_dir, config.checkpoint.resume)
    if source is None:
        return
    try:
        manifest = _read_manifest(source)
    except LegacyCheckpointError:
        raise
    except CheckpointError:
        if config.checkpoint.resume != "auto":
            raise
        return  # `auto` falls back to an older intact checkpoint when training starts
    try:
        saved_config = yaml.safe_load((source / RUN_CONFIG).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        saved_config = None
    if isinstance(saved_config, dict):
        check_resume_config(source, saved_config, config)
    _check_room_for_next(config, manifest)


def _check_room_for_next(config: RunConfig, newest_manifest: dict[str, Any]) -> None:
    size = sum(int(entry.get("bytes", 0)) for entry in newest_manifest["files"].values() if isinstance(entry, dict))
    existing = list_checkpoints(config.run_dir)
    keep = config.checkpoint.keep_last
    pruned = existing[: max(0, len(existing) - (keep - 1))] if keep >= 2 else []
    freed = sum(_directory_bytes(path) for path in pruned)
    free = free_bytes(checkpoint_dir(config.run_dir))
    if free is not None and free + freed < size:
        raise StorageError(
            errno.ENOSPC,
            f"run_dir {config.run_dir}: the next checkpoint needs about {format_bytes(size)} and the disk has "
            f"{format_bytes(free)} free (+{format_bytes(freed)} from pruning old ones); free some space first",
        )


def _directory_bytes(path: Path) -> int:
    return sum(entry.stat().st_size for entry in path.iterdir() if entry.is_file())


# ----------------------------------------------------------------------------------------------------------
# Converting checkpoints of earlier versions


# What every version's training state holds, and resume reads.
LEGACY_STATE_KEYS = ("step", "optimizer", "scheduler", "sampler", "rng")


def convert_legacy_checkpoint(path: str | Path) -> Path:
    """Rewrite an earlier version's checkpoint (`trainer.pt`) in the current format, in place.

    Only for files the user trusts: `trainer.pt` is read with `torch.load(weights_only=True)` (PyTorch's
    restricted unpickler) with numpy's array reconstruction allowed (the numpy RNG state needs it). The new files
    and the manifest are written first; `trainer.pt` is deleted last."""
    path = Path(path)
    legacy = path / LEGACY_STATE
    if (path / MANIFEST).is_file():
        raise CheckpointError(f"{path}: already in the current format")
    if not legacy.is_file():
        raise CheckpointError(f"{path}: no {LEGACY_STATE} to convert")
    try:
        with torch.serialization.safe_globals(_numpy_array_globals()):
            state = torch.load(legacy, map_location="cpu", weights_only=True)
    except Exception as error:  # the unpickler raises several types for a refused or damaged file
        # torch's message goes on for lines, advising weights_only=False (running the file's code): its first line.
        first_line = next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)
        raise CheckpointError(f"{legacy}: cannot be read with the restricted loader: {first_line}") from error
    missing = [key for key in LEGACY_STATE_KEYS if not isinstance(state, dict) or key not in state]
    if missing:
        raise CheckpointError(
            f"{legacy}: not a dflash-trainer training state (it lacks {', '.join(missing)}); nothing converted"
        )
    state_tree, tensors = encode_state(state)
    files = {
        STATE_TENSORS: write_safetensors(path / STATE_TENSORS, tensors),
        STATE_JSON: write_bytes(path / STATE_JSON, json.dumps(state_tree).encode("utf-8")),
    }
    for name in (DRAFTER_WEIGHTS, DRAFTER_CONFIG, RUN_CONFIG):
        if not (path / name).is_file():
            raise CheckpointError(f"{path}: no {name}; not a complete checkpoint")
        files[name] = file_digest(path / name)
    match = CHECKPOINT_PATTERN.match(path.name)
    _write_manifest(path, int(match.group(1)) if match else int(state.get("step", 0)), files)
    legacy.unlink()
    return path


def _numpy_array_globals() -> list[Any]:
    import numpy.core.multiarray as multiarray  # numpy 2 keeps this alias for unpickling old files

    return [multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
