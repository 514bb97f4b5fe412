"""`target.device`, the one device setting of a run: checked against this machine before anything loads.

Contract: `resolve_device("auto")` is the current CUDA device when there is one, else the CPU; any other value must
be a torch device string (`cpu`, `cuda`, `cuda:1`) naming a device this machine has, else `DeviceError` (a user
error, one line naming the value). Used by the target loader and by `distributed/world.py` for a one-process run.
Under torchrun each rank takes the CUDA device of its local rank (`local_rank_device`), one rank per device:
`check_local_ranks` refuses more ranks than devices before torchrun starts (`train --nproc`), and a rank
without a device of its own fails as one line naming both counts (CUDA's own error is "invalid device ordinal").
"""

from __future__ import annotations

import torch

from .errors import UserError


class DeviceError(UserError, ValueError):
    """`target.device` names no device of this machine."""


def resolve_device(device: str) -> torch.device:
    """`target.device`: auto (the current CUDA device, else the CPU), or a torch device string (`cpu`, `cuda:1`)
    naming a device this machine has."""
    if device == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise DeviceError(f"target.device {device!r}: not a device name (auto, cpu, cuda, cuda:N)") from None
    if resolved.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (resolved.index is not None and resolved.index >= count):
            raise DeviceError(
                f"target.device {device!r}: this machine has {count} CUDA device(s); use auto, cpu or an index "
                f"below {count}"
            )
    return resolved


def _cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_local_ranks(device: str, nproc: int) -> None:
    """`train --nproc N` on this machine: N ranks need N CUDA devices when the run uses CUDA (`target.device`)."""
    if resolve_device(device).type == "cuda" and nproc > (count := _cuda_count()):
        raise DeviceError(
            f"--nproc {nproc}: this machine has {count} CUDA device(s) and each rank takes one; use --nproc {count} "
            "or fewer (or target.device=cpu for CPU ranks)"
        )


def local_rank_device(local_rank: int) -> torch.device:
    """The CUDA device of a rank with LOCAL_RANK `local_rank` (one rank per device of its machine)."""
    if local_rank >= (count := _cuda_count()):
        raise DeviceError(
            f"rank with LOCAL_RANK {local_rank}: this machine has {count} CUDA device(s) and each rank takes one; "
            f"start at most {count} ranks on it (--nproc, torchrun --nproc-per-node)"
        )
    return torch.device("cuda", local_rank)
