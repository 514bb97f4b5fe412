"""Who this process is: rank, world size, device, and the process groups of its placement.

Launched by torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT in the environment) or as a plain single
process. NCCL on GPU, gloo on CPU. Collectives get a timeout so that a dead peer turns into an error on every
rank within `timeout_s` instead of a hang.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..devices import local_rank_device, resolve_device


@dataclass
class World:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_world(device: str = "auto", *, timeout_s: float = 60.0) -> World:
    """Join the job's process group when launched by torchrun; otherwise a one-process world."""
    resolved = resolve_device(device)  # a device this machine lacks fails here, on every rank, as one line
    if not launched_by_torchrun():
        return World(device=resolved)
    use_cuda = resolved.type == "cuda"
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        chosen, backend = local_rank_device(local_rank), "nccl"
        torch.cuda.set_device(chosen)
    else:
        chosen, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=chosen if backend == "nccl" else None,
        )
    return World(rank=rank, world_size=world_size, local_rank=local_rank, device=chosen, backend=backend)


def shutdown_world(world: World) -> None:
    if world.distributed and dist.is_initialized():
        dist.destroy_process_group()
