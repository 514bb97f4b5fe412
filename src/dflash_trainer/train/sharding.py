"""How drafter replicas keep their gradients in sync, and how their state is gathered for checkpoints.

- `LocalSync`: one process; nothing to do.
- `DdpSync` (colocated, `placement.sharding: ddp`): DistributedDataParallel; micro-batches before a step's last
  skip the all-reduce (`no_sync`), the last one's backward all-reduces (mean over ranks) while it runs.
- `Fsdp2Sync` (colocated, `placement.sharding: fsdp2`): `fully_shard` on every drafter layer, DFlash2's selector
  and the root, so parameters, gradients and optimizer state are split over the ranks; the gradient
  reduce-scatter runs on the last micro-batch only. Checkpoints gather full tensors onto rank 0 (collective), so a
  checkpoint looks the same whatever the sharding and can be resumed with either.
- `AllReduceSync` (disaggregated drafters): one sum all-reduce of the gradients in the drafter group after the
  step's micro-batches. DDP and FSDP reduce inside backward, which a drafter without a micro-batch in a step
  (possible in the last, short step of an epoch) never runs; an explicit all-reduce has no such case. Losses
  are scaled by 1 / (micro-batches in the whole step), so the sum is the mean over the step.

Optimizer state is always saved in `torch.optim` form (state indexed by parameter position). FSDP2's gathered
form is keyed by parameter name; `_to_indexed` and `_to_named` convert between the two.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..model.drafter import build_drafter

# Elements per all-reduce bucket of AllReduceSync: bounds the extra memory of the flattened copy.
BUCKET_ELEMENTS = 1 << 25


class LocalSync:
    """One process (and the base of the others): the drafter as is, full state without collectives."""

    def __init__(self, drafter: nn.Module) -> None:
        self.drafter = drafter

    @property
    def module(self) -> nn.Module:
        """What the trainer calls forward on."""
        return self.drafter

    def micro_batch(self, *, last: bool) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def after_micro_batches(self) -> None:
        """Runs once per step, after the last micro-batch's backward."""

    def gathered_for_decoding(self) -> contextlib.AbstractContextManager[None]:
        """The drafter's parameters whole for the duration, with no collective inside (`Fsdp2Sync`)."""
        return contextlib.nullcontext()

    def local_norm(self, norm: torch.Tensor) -> torch.Tensor:
        return norm

    def full_state(self, optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Full drafter and optimizer state on the main rank (every rank must call it)."""
        return self.drafter.state_dict(), optimizer.state_dict()

    def load_full_state(
        self, optimizer: torch.optim.Optimizer, model_state: dict[str, torch.Tensor], optimizer_state: dict[str, Any]
    ) -> None:
        self.drafter.load_state_dict(model_state)
        optimizer.load_state_dict(optimizer_state)

    def plain_drafter(self) -> nn.Module:
        """The drafter with ordinary (unsharded) parameters, for export and evaluation on the main rank."""
        return self.drafter


class DdpSync(LocalSync):
    def __init__(self, drafter: nn.Module, group: dist.ProcessGroup | None = None) -> None:
        super().__init__(drafter)
        # Replicas start equal: every rank seeds the same init, and DDP broadcasts rank 0's weights too. No buffer
        # needs broadcasting at every forward (DDP's default): the drafter's are constants (RoPE frequencies) or
        # follow from the parameters on every rank (DFlash2's `embedding` codebooks, [V, r] each).
        self.ddp = DistributedDataParallel(drafter, process_group=group, broadcast_buffers=False)

    @property
    def module(self) -> nn.Module:
        return self.ddp

    def micro_batch(self, *, last: bool) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext() if last else self.ddp.no_sync()


class Fsdp2Sync(LocalSync):
    """FSDP2 gathers a unit's parameters in the pre-forward hook of its module and reduce-scatters their gradients
    in its post-backward (or, for a unit whose forward inputs take no gradient, in the root's end-of-backward
    callback). A parameter must therefore be read inside the forward of the module that owns it:

    - The loss reads the target's LM head outside the drafter's forward: it is no drafter parameter (frozen, the
      target's), so nothing here shards or reduces it. The drafter's final norm is read inside its forward.
    - DFlash2's convolutions live inside the layers: sharded with them.
    - DFlash2's selector term reads the selector's codebooks and projection outside the drafter's forward. It runs
      as the selector's own forward (`CandidateSelector.forward`, called by `SelectorObjective`), and the selector
      is its own unit: the call gathers its parameters, their gradients (formed by the term's autograd Function)
      are reduce-scattered (mean over ranks) after its backward, like every other unit's, and grad accumulation
      (`set_requires_gradient_sync`, recursive) holds them unreduced until the step's last micro-batch. In the
      root unit the parameters would only be gathered because the root keeps its parameters after forward by
      default, an accident. Replicating the selector instead (`ignored_params` plus an explicit all-reduce) would
      mix plain tensors with DTensors in the gradient norm, the fused optimizer and the state dicts, and keep two
      [V, r] codebooks with their Adam state whole on every rank.
    - The selector keeps its parameters gathered from its forward until its post-backward (no second all-gather
      in backward, where the term's Function needs only the gradients it formed in forward): the term already
      holds [V, r] gradient buffers of the same size over that span.
    - Decoding (the periodic evaluation, on every rank) calls the drafter a data-dependent number of times, which
      the ranks need not agree on: a kernel that is not bit-deterministic across GPUs can end one rank's decoding
      a step before another's. So `gathered_for_decoding` gathers every unit once, in the same order on every
      rank, and keeps them gathered while decoding runs collective-free; the selector's `walk` is registered as an
      FSDP forward method, so that it reads the gathered parameters too.
    """

    def __init__(self, drafter: nn.Module) -> None:
        from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

        super().__init__(drafter)
        # Each unit with the reshard_after_forward it trains with (None: the root's, which FSDP2 sets itself).
        self._units: list[tuple[nn.Module, bool | None]] = []
        selector = getattr(drafter, "candidate_selector", None)  # DFlash2 (class docstring)
        if selector is not None:
            fully_shard(selector, reshard_after_forward=False)
            register_fsdp_forward_method(selector, "walk")
            self._units.append((selector, False))
        for layer in drafter.layers:
            fully_shard(layer)
            self._units.append((layer, True))
        fully_shard(drafter)
        self._units.append((drafter, None))
        self._gathered: dict[str, torch.Tensor] | None = None

    @contextlib.contextmanager
    def gathered_for_decoding(self) -> Iterator[None]:
        for unit, _ in self._units:
            unit.set_reshard_after_forward(False, recurse=False)
            unit.unshard()
        try:
            yield
        finally:
            for unit, reshard_after_forward in self._units:
                unit.reshard()
                if reshard_after_forward is not None:
                    unit.set_reshard_after_forward(reshard_after_forward, recurse=False)

    def micro_batch(self, *, last: bool) -> contextlib.AbstractContextManager[None]:
        self.drafter.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def local_norm(self, norm: torch.Tensor) -> torch.Tensor:
        # clip_grad_norm_ over sharded gradients returns a replicated DTensor.
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def full_state(self, optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state = get_model_state_dict(self.drafter, options=options)
        named = get_optimizer_state_dict(self.drafter, optimizer, options=options)
        self._gathered = model_state
        if not model_state:  # not rank 0: cpu_offload gathers onto rank 0 only
            return {}, {}
        return model_state, _to_indexed(named, _parameter_names(self.drafter, optimizer))

    def load_full_state(
        self, optimizer: torch.optim.Optimizer, model_state: dict[str, torch.Tensor], optimizer_state: dict[str, Any]
    ) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        # Every rank read the checkpoint: each keeps its own shard of the full tensors.
        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(self.drafter, model_state, options=options)
        # A resumed run that trains no further step still exports (on rank 0) what it loaded.
        self._gathered = model_state if dist.get_rank() == 0 else None
        named = _to_named(optimizer_state, _parameter_names(self.drafter, optimizer))
        set_optimizer_state_dict(self.drafter, optimizer, named, options=options)

    def plain_drafter(self) -> nn.Module:
        """Rebuilt from the state the last `full_state` gathered (the final checkpoint), on the main rank."""
        if not self._gathered:
            raise RuntimeError("Fsdp2Sync.plain_drafter: only rank 0 holds the gathered state, after a checkpoint")
        plain = build_drafter(self.drafter.config)  # the drafter's own class (DFlash2's has a selector)
        plain.load_state_dict(self._gathered)
        return plain


class AllReduceSync(LocalSync):
    def __init__(self, drafter: nn.Module, group: dist.ProcessGroup | None) -> None:
        super().__init__(drafter)
        self.group = group
        # Replicas must start equal: the first drafter rank's weights win (as DDP's broadcast does).
        for tensor in [*drafter.parameters(), *drafter.buffers()]:
            dist.broadcast(tensor.data, src=dist.get_global_rank(group, 0), group=group)

    def after_micro_batches(self) -> None:
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:  # a drafter without micro-batches this step contributes zeros
                p.grad = torch.zeros_like(p)
        for bucket in _buckets(params):
            flat = torch.cat([p.grad.reshape(-1) for p in bucket])
            dist.all_reduce(flat, group=self.group)
            offset = 0
            for p in bucket:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()


def _buckets(params: list[nn.Parameter]) -> Iterator[list[nn.Parameter]]:
    bucket: list[nn.Parameter] = []
    size = 0
    for p in params:
        if bucket and size + p.numel() > BUCKET_ELEMENTS:
            yield bucket
            bucket, size = [], 0
        bucket.append(p)
        size += p.numel()
    if bucket:
        yield bucket


def _parameter_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Names of the optimizer's parameters in torch.optim's index order."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def _to_indexed(named: dict[str, Any], names: list[str]) -> dict[str, Any]:
    index = {name: i for i, name in enumerate(names)}
    groups = [{**g, "params": [index[name] for name in g["params"]]} for g in named["param_groups"]]
    return {"state": {index[name]: value for name, value in named["state"].items()}, "param_groups": groups}


def _to_named(indexed: dict[str, Any], names: list[str]) -> dict[str, Any]:
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in indexed["param_groups"]]
    return {"state": {names[i]: value for i, value in indexed["state"].items()}, "param_groups": groups}


def make_sync(
    drafter: nn.Module, *, sharding: str, group_size: int, group: dist.ProcessGroup | None, explicit: bool
) -> LocalSync:
    """The sync for a drafter replica among `group_size` (`explicit`: the disaggregated all-reduce)."""
    if explicit:  # placement.sharding was checked against the placement (distributed/roles.py)
        return AllReduceSync(drafter, group) if group_size > 1 else LocalSync(drafter)
    if group_size == 1:
        return LocalSync(drafter)
    return Fsdp2Sync(drafter) if sharding == "fsdp2" else DdpSync(drafter, group)
