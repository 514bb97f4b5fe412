"""Checkpoint write/read time: the pickle-free format (JSON + safetensors, SHA-256 while writing, verified at load)
against the former torch.save / torch.load of the same state.

A drafter-shaped state: fp32 weights of P parameters plus AdamW's two fp32 moments (what the trainer saves), on
the GPU when there is one (the trainer gathers it from there). Default P = 0.5B (6 GB per checkpoint); the
paper-scale Qwen3-8B drafter (5 layers) is about 1.2B (`--params 1.2e9`, 14 GB: make sure the disk has room).

    PYTHONPATH=src python3 benchmarks/checkpoint_io.py [--params 5e8] [--dir /tmp/ckpt-bench]

Prints a table (seconds, GB/s) and writes JSON to $OUT/checkpoint_io.json when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import torch

from dflash_trainer.config import load_config
from dflash_trainer.train import checkpoint as ckpt


def synthetic_state(params: int, device: torch.device) -> tuple[dict, dict]:
    """Weights in 64M-element tensors, and an AdamW-like state dict with two moments per tensor."""
    chunk = 64 << 20
    sizes = [chunk] * (params // chunk) + ([params % chunk] if params % chunk else [])
    weights = {f"layers.{i}.weight": torch.randn(n, device=device) for i, n in enumerate(sizes)}
    state = {
        i: {
            "step": torch.tensor(10.0),
            "exp_avg": torch.randn(n, device=device),
            "exp_avg_sq": torch.rand(n, device=device),
        }
        for i, n in enumerate(sizes)
    }
    optimizer = {"state": state, "param_groups": [{"lr": 1e-4, "betas": (0.9, 0.95), "params": list(state)}]}
    return weights, {"step": 10, "optimizer": optimizer, "rng": ckpt.rng_state()}


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", type=float, default=5e8)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/dflash-ckpt-bench"))
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    weights, trainer_state = synthetic_state(int(args.params), device)
    total_bytes = 3 * 4 * int(args.params)
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    config = load_config(None, [f"run_dir={args.dir / 'run'}"])

    def save_new() -> None:
        ckpt.save_checkpoint(
            run_dir=args.dir / "run",
            step=1,
            drafter_state=weights,
            drafter_config_json="{}",
            trainer_state=trainer_state,
            config=config,
            keep_last=3,
        )

    rows = {}
    rows["new: save (write + fsync + sha256)"] = timed(save_new)
    os.sync()
    rows["new: load (verify sha256 + read)"] = timed(
        lambda: ckpt.load_checkpoint(args.dir / "run/checkpoints/step-00000001")
    )
    rows["new: verify only"] = timed(lambda: ckpt.verify_checkpoint(args.dir / "run/checkpoints/step-00000001"))
    shutil.rmtree(args.dir / "run")

    def save_old() -> None:
        torch.save({k: v.cpu() for k, v in weights.items()}, args.dir / "drafter.pt")
        torch.save(trainer_state, args.dir / "trainer.pt")
        for name in ("drafter.pt", "trainer.pt"):
            with open(args.dir / name, "rb") as f:
                os.fsync(f.fileno())

    rows["old: torch.save (+ fsync)"] = timed(save_old)
    rows["old: torch.load"] = timed(
        lambda: (torch.load(args.dir / "drafter.pt"), torch.load(args.dir / "trainer.pt", weights_only=False))
    )
    shutil.rmtree(args.dir, ignore_errors=True)

    print(
        f"\ncheckpoint of {args.params / 1e9:.2f}B params + 2 moments = {total_bytes / 1e9:.1f} GB, state on {device}"
    )
    print(f"{'operation':<40} {'seconds':>8} {'GB/s':>7}")
    for name, seconds in rows.items():
        print(f"{name:<40} {seconds:8.2f} {total_bytes / 1e9 / seconds:7.2f}")
    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"]) / "checkpoint_io.json"
        out.write_text(
            json.dumps({"params": args.params, "bytes": total_bytes, "device": str(device), "seconds": rows}, indent=2)
        )


if __name__ == "__main__":
    main()
