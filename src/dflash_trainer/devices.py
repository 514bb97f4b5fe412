"""`target.device`, the one device setting of a run: checked against this machine before anything loads.

Contract: `resolve_device("auto")` is the current CUDA device when there is one, else the CPU; any other value must
be a torch device string (`cpu`, `cuda`, `cuda:1`) naming a device this machine has, else `DeviceError` (a user
error, one line naming the value). Used by the target loader and by `distributed/world.py` for a one-process run
(under torchrun each rank takes its local CUDA device).
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
