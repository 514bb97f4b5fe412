"""Training checkpoints: atomic, numbered by optimizer step, the last K kept.

Layout of `RUN_DIR/checkpoints/step-00001234/`:
  drafter.safetensors   drafter weights (fp32 master copy)
  drafter_config.json   the drafter architecture (DrafterModelConfig)
  trainer.pt            optimizer, scheduler, sampler position, RNG states, step, epoch, counters
  config.yaml           the resolved run config
A checkpoint is written into `step-XXXXXXXX.tmp` and renamed when complete, so a crash mid-write never leaves a
directory that looks finished; stale `.tmp` directories are removed on the next save.
"""

from __future__ import annotations

import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from ..config import RunConfig, save_config

CHECKPOINT_PATTERN = re.compile(r"^step-(\d{8})$")


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Completed checkpoints, oldest first."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and CHECKPOINT_PATTERN.match(p.name)]
    return sorted(found, key=lambda p: int(CHECKPOINT_PATTERN.match(p.name).group(1)))


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


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
    root = checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob("*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    final = root / f"step-{step:08d}"
    tmp = root / f"step-{step:08d}.tmp"
    tmp.mkdir()
    save_file({k: v.detach().contiguous().cpu() for k, v in drafter_state.items()}, str(tmp / "drafter.safetensors"))
    (tmp / "drafter_config.json").write_text(drafter_config_json)
    torch.save(trainer_state, tmp / "trainer.pt")
    save_config(config, tmp / "config.yaml")
    if final.exists():  # the same step saved twice (e.g. interrupt right after a periodic save)
        shutil.rmtree(final)
    tmp.rename(final)
    for old in list_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    path = Path(path)
    if not (path / "trainer.pt").is_file():
        raise FileNotFoundError(f"{path}: not a training checkpoint (no trainer.pt)")
    drafter_state = load_file(str(path / "drafter.safetensors"))
    trainer_state = torch.load(path / "trainer.pt", map_location="cpu", weights_only=False)
    return drafter_state, trainer_state
