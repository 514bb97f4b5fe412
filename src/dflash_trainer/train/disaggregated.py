"""Disaggregated placement: target ranks compute features, drafter ranks train on them (DESIGN §4).

Equivalence. With D drafter ranks, T target ranks and optim.grad_accum A, let M = D * A. Drafter step s
consumes exactly the global batches that step s of ONE process with grad_accum M consumes: the next M batches
of the epoch's global batch list (fewer at the end of an epoch; `train/schedule.py`). Micro-batch p of the step
is trained by drafter slot p % D and computed by target slot g % T, g the batch's run-wide number (the global
batches of all earlier epochs plus its index in its epoch); every loss is scaled by 1 / (the
step's micro-batch count) and the drafters sum their gradients (`AllReduceSync`), so the gradient of a step is
the one process's mean over the same micro-batches, up to floating-point summation order. Anchors are seeded by
(seed, epoch, global batch index) and feature noise by the step, so the batches themselves are identical too.
The number of target ranks changes nothing but speed.

Schedule and messages. Every rank derives the schedule from the same sampler (one global view, world size 1)
and the start position the first drafter rank broadcasts once (after its resume). A target walks the steps in
order and computes only its own micro-batches (their host batches made ahead on a prefetch worker,
`data.prefetch_steps` steps of its share), sending each (header, then tensors: `distributed/transport.py`) to
its drafter without blocking, at most `placement.queue_depth` outstanding per drafter. A drafter receives its
micro-batches in the same order, ahead of use on a receive thread that walks the schedule on a copy of the
sampler (`drafter_schedule`), at most `queue_depth` received ahead; the header's step, epoch and batch index are
checked against the schedule. Deadlock freedom: every sender posts and every receiver receives in one global
order, a sender only waits on its own oldest message and a receive thread only on its consumer; the earliest
message not yet received has been posted (its sender waits only on earlier, received ones), and its receiver's
queue holds only messages of steps its drafter has yet to train, which the drafters' per-step all-reduce cannot
hold up, as every message of the current step is earlier still and so received.

End and stop. The end of the data (or train.max_steps) is known to all from the schedule. A stop (SIGINT /
SIGTERM, possibly reaching only some ranks: a target passes its request on in its next header) is agreed by the
drafters in their per-step all-reduce; they then send every target a notice, and each target, seeing it before
its next batch, sends END after what it already posted. The drafters drain every target up to its END (dropping
batches of steps that will not run), drafter rank 0 writes the checkpoint, and all ranks exit. A rank that dies
fails the job (`distributed/failure.py`): a receive thread blocked on it gets the broken connection's error and
its drafter raises it; the process then exits without waiting for anything posted.

Labels. With `loss.label_source: target_argmax` a target sends its greedy next token per position ([R, T] int64,
from its own LM head, as one process computes them) instead of its final states ([R, T, H]); the drafter gathers
each block slot's label from them. Soft labels need the states, which travel then.

Memory. Drafter ranks keep only the target's embedding and LM head: the target is loaded on the CPU (in the
dtype the target ranks use), those two modules move to the drafter's device, and the decoder layers are
dropped. Target ranks never build a drafter. Feature batches at once, at most: on a target rank, the one being
computed plus `queue_depth` per drafter (sent, not yet received); on a drafter rank, the micro-batches of the
step it trains plus `queue_depth` received ahead.

Metrics (per rank, logged by drafter rank 0): `rank{r}/idle` (fraction of wall time waiting on the other role:
a drafter for features, a target blocked on a full window), `rank{r}/recv_wait_s` (drafter) or
`rank{r}/send_wait_s` (target): seconds of that per optimizer step, `rank{r}/inflight` (target: mean messages
outstanding to a drafter right after a send), `rank{r}/ahead` (drafter: mean batches already received when it
asked for one), and the means `idle_target`, `idle_drafter`, `wait_send_s`, `wait_recv_s`, `inflight`, `ahead`.
Target counters travel in the headers, so they lag the drafters' by up to a window and a receive queue. The
verdict (`train/rank_report.py`) names the role the other waits for; drafter rank 0 prints it for the whole run
at the end, and per interval in the stage profile.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..config import RunConfig
from ..data.sampler import BatchPlan, TokenBudgetSampler
from ..distributed.failure import FaultInjection
from ..distributed.roles import Roles, assign_roles
from ..distributed.transport import (
    NOTICE_DONE,
    NOTICE_STOP,
    FeatureReceiver,
    FeatureSender,
    NoticeBoard,
    Received,
    send_notices,
)
from ..distributed.world import World
from ..targets.capture import FeatureCapture, TargetOutputs, decoder_module, embedding_module, lm_head_module
from ..targets.loader import LoadedTarget, load_target, quantize_target_to_fp8, resolve_dtype
from .batch import TrainBatch
from .data_setup import TrainingData, load_training_data, plan_to_host_batch
from .prefetch import Prefetcher
from .profiler import StageProfiler, StageSummary
from .rank_report import PipelineDepth, merge_summaries, pipeline_line
from .schedule import RunIndex, drafter_slot, step_groups, target_slot
from .trainer import StepWork, Trainer, TrainSummary


def pack_batch(
    batch: TrainBatch, outputs: TargetOutputs, *, num_features: int, split: bool
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(host fields for the header, tensors) of one feature batch: every TrainBatch field travels, tensors as
    tensors; `split`: the K tapped layers as K tensors [R, T, H] instead of one [R, T, K*H]."""
    values = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    tensors = {name: value for name, value in values.items() if isinstance(value, torch.Tensor)}
    host = {name: value for name, value in values.items() if name not in tensors}
    if split:
        tensors |= {f"features.{k}": part for k, part in enumerate(outputs.features.chunk(num_features, dim=-1))}
    else:
        tensors["features"] = outputs.features  # [R, T, K*H]
    if outputs.final_hidden is not None:
        tensors["final_hidden"] = outputs.final_hidden  # [R, T, H]
    if outputs.next_tokens is not None:
        tensors["next_tokens"] = outputs.next_tokens  # [R, T] int64
    return host, tensors


def unpack_batch(host: dict[str, Any], tensors: dict[str, torch.Tensor]) -> tuple[TrainBatch, TargetOutputs]:
    split = sorted((name for name in tensors if name.startswith("features.")), key=lambda n: int(n.split(".")[1]))
    features = torch.cat([tensors[name] for name in split], dim=-1) if split else tensors["features"]  # [R, T, K*H]
    batch = TrainBatch(**{f.name: tensors.get(f.name, host.get(f.name)) for f in dataclasses.fields(TrainBatch)})
    if batch.segment_boundaries is not None:  # JSON made the tuple a list
        batch = dataclasses.replace(batch, segment_boundaries=tuple(batch.segment_boundaries))
    outputs = TargetOutputs(
        features=features, final_hidden=tensors.get("final_hidden"), next_tokens=tensors.get("next_tokens")
    )
    return batch, outputs


def _stats_window(old: dict[str, float] | None, new: dict[str, float]) -> dict[str, float]:
    return {key: value - (old or {}).get(key, 0.0) for key, value in new.items()}


def drafter_schedule(
    sampler: TokenBudgetSampler,
    *,
    epochs: int,
    batches_per_step: int,
    first_step: int,
    total_steps: int,
    slot: int,
    num_drafters: int,
    target_ranks: tuple[int, ...],
) -> Iterator[tuple[int, list[tuple[BatchPlan, int]]]]:
    """Per optimizer step from the sampler's position (step `first_step`) to `total_steps`: (the step's
    micro-batch count over all drafters, [(plan, target rank that computes it)] of drafter `slot`'s share)."""
    run_index = RunIndex(sampler)
    groups = step_groups(sampler, epochs=epochs, micro_batches_per_step=batches_per_step)
    # The step range comes first: zip stops on it without taking (and consuming) a group past `total_steps`.
    for _, plans in zip(range(first_step, total_steps), groups, strict=False):
        mine = [plan for position, plan in enumerate(plans) if drafter_slot(position, num_drafters) == slot]
        targets = [target_ranks[target_slot(run_index(p.epoch, p.index), len(target_ranks))] for p in mine]
        yield len(plans), list(zip(mine, targets, strict=True))


class DrafterTrainer(Trainer):
    """A drafter rank: the trainer loop, with features received from target ranks and the drafter group."""

    def __init__(
        self,
        config: RunConfig,
        *,
        roles: Roles,
        world: World,
        target: LoadedTarget,
        should_stop: Callable[[], bool],
        log: Callable[[str], object] = print,
    ) -> None:
        if config.eval.every_steps:
            raise ValueError(
                "eval.every_steps: periodic evaluation needs the whole target on a drafter rank; with the "
                "disaggregated placement use eval.at_end (the target is loaded again after training)"
            )
        self.roles = roles
        self.receiver = FeatureReceiver(
            sources=list(roles.target_ranks),
            queue_depth=config.placement.queue_depth,
            header_group=roles.header_group,
            payload_group=roles.payload_group,
            device=world.device,
            timeout_s=config.placement.timeout_s,
        )
        self._target_stop_requested = False
        self._target_stats: dict[int, dict[str, float]] = {}
        self._target_profiles: dict[str, StageSummary] = {}
        self._logged_stats: dict[str, dict[str, float]] = {}
        # Over the logged windows of the run, for `pipeline_summary`: role -> [wait seconds, wall seconds].
        self._run_waits: dict[str, list[float]] = {"target": [0.0, 0.0], "drafter": [0.0, 0.0]}
        self._run_depth = PipelineDepth(queue_depth=config.placement.queue_depth)
        self._started = time.perf_counter()
        super().__init__(config, should_stop=should_stop, log=log, target=target, world=world)
        outer_stop = self.should_stop
        self.should_stop = lambda: outer_stop() or self._target_stop_requested

    # placement hooks -------------------------------------------------------------------------------------------

    def _sync_group(self) -> tuple[dist.ProcessGroup | None, int, bool]:
        return self.roles.drafter_group, self.roles.num_drafters, self.roles.is_lead_drafter

    def _checkpoint_group(self) -> dist.ProcessGroup | None:
        return self.roles.checkpoint_group  # made with the others in `assign_roles`, on every rank

    def rank_label(self) -> str:
        return self.roles.label()

    def _sampler_shard(self) -> tuple[int, int, int]:
        # The global batch list; the schedule splits each step's M batches over drafters and targets.
        return 0, 1, self.roles.num_drafters * self.config.optim.grad_accum

    def layout(self) -> str:
        return (
            f"{self.roles.num_drafters} drafter rank(s) x grad_accum {self.config.optim.grad_accum}, "
            f"{self.roles.num_targets} target rank(s)"
        )

    def _setup_target_side(self) -> None:
        """Keep the embedding and LM head (on this rank's device); drop the decoder layers."""
        model = self.target.model
        decoder = decoder_module(model)
        deepest = max(self.model_config.target_layer_ids)
        self.target_params_used = sum(p.numel() for layer in decoder.layers[: deepest + 1] for p in layer.parameters())
        self.num_target_layers = len(decoder.layers)
        decoder.layers = torch.nn.ModuleList()
        self.embed = embedding_module(model).to(self.device)
        self.lm_head = lm_head_module(model).to(self.device)

    def _step_groups(self) -> Iterator[StepWork]:
        self._announce_start()
        # The receive thread walks the same schedule on a copy of the sampler (this one's position is what a
        # checkpoint saves, so only the consumer may advance it).
        order = (source for _, work in self._my_steps(copy.copy(self.sampler)) for _, source in work)
        self.receiver.start(order)
        for step_size, work in self._my_steps(self.sampler):
            batches, outputs = [], []
            for plan, source in work:
                with self.profiler.stage("recv_wait"):
                    received = self.receiver.recv(source)
                batch, target_outputs = self._accept(received, source=source, plan=plan)
                batches.append(batch)
                outputs.append(target_outputs)
            yield StepWork(batches=batches, outputs=outputs, loss_scale=1.0 / step_size)

    def _my_steps(self, sampler: TokenBudgetSampler) -> Iterator[tuple[int, list[tuple[BatchPlan, int]]]]:
        return drafter_schedule(
            sampler,
            epochs=self.config.train.epochs,
            batches_per_step=self.sampler_step_batches,
            first_step=self.step,
            total_steps=self.total_steps,
            slot=self.roles.slot,
            num_drafters=self.roles.num_drafters,
            target_ranks=self.roles.target_ranks,
        )

    def _end_of_data(self, *, interrupted: bool) -> None:
        notices = send_notices(
            list(self.roles.target_ranks), NOTICE_STOP if interrupted else NOTICE_DONE, self.roles.header_group
        )
        dropped = self.receiver.drain()
        notices.wait()
        if dropped:
            self.log(f"dropped {dropped} feature batch(es) sent ahead for steps that will not run")
        summary = self.pipeline_summary() if self.is_main else None
        if summary:
            self.log(summary)

    def _placement_log_values(self, steps: int) -> dict[str, float]:
        stats = self.receiver.settle()
        mine = {"wait_s": stats.wait_s, "wall_s": self._wall(), "takes": stats.received, "ahead_sum": stats.ahead_sum}
        local = {"drafters": {self.world.rank: mine}, "targets": self._target_stats}
        gathered: list[dict | None] = [local]
        if self.group_size > 1:
            gathered = [None] * self.group_size
            dist.all_gather_object(gathered, local, group=self.group)
        if not self.is_main:
            return {}
        drafters: dict[int, dict[str, float]] = {}
        targets: dict[int, dict[str, float]] = {}
        for part in gathered:
            drafters.update(part["drafters"])
            for rank, stats in part["targets"].items():
                # Cumulative counters: the newest copy (largest wall time) wins.
                if stats["wall_s"] >= targets.get(rank, {"wall_s": -1.0})["wall_s"]:
                    targets[rank] = stats
        return self._transport_metrics(drafters, targets, steps=max(steps, 1))

    def _transport_metrics(
        self, drafters: dict[int, dict[str, float]], targets: dict[int, dict[str, float]], *, steps: int
    ) -> dict[str, float]:
        """Per-rank and mean waiting metrics since the last log step, from cumulative counters; the window's
        depth counters also go to the profile report and the run's totals."""
        values: dict[str, float] = {}
        idle: dict[str, list[float]] = {"drafter": [], "target": []}
        waits: dict[str, list[float]] = {"drafter": [], "target": []}
        depth = PipelineDepth(queue_depth=self.config.placement.queue_depth)
        for role, ranks in (("drafter", drafters), ("target", targets)):
            for rank, stats in sorted(ranks.items()):
                delta = _stats_window(self._logged_stats.get(f"{role}{rank}"), stats)
                if delta["wall_s"] <= 0:  # no header from this target since the last log step
                    continue
                self._logged_stats[f"{role}{rank}"] = stats
                self._run_waits[role][0] += delta["wait_s"]
                self._run_waits[role][1] += delta["wall_s"]
                idle[role].append(delta["wait_s"] / delta["wall_s"])
                waits[role].append(delta["wait_s"] / steps)
                values[f"rank{rank}/idle"] = idle[role][-1]
                values[f"rank{rank}/{'recv' if role == 'drafter' else 'send'}_wait_s"] = waits[role][-1]
                if role == "target" and delta["sends"] > 0:
                    values[f"rank{rank}/inflight"] = delta["inflight_sum"] / delta["sends"]
                    depth.sends += int(delta["sends"])
                    depth.inflight_sum += int(delta["inflight_sum"])
                if role == "drafter" and delta["takes"] > 0:
                    values[f"rank{rank}/ahead"] = delta["ahead_sum"] / delta["takes"]
                    depth.takes += int(delta["takes"])
                    depth.ahead_sum += int(delta["ahead_sum"])
        for role, name in (("drafter", "recv"), ("target", "send")):
            if idle[role]:
                values[f"idle_{role}"] = sum(idle[role]) / len(idle[role])
                values[f"wait_{name}_s"] = sum(waits[role]) / len(waits[role])
        if depth.sends:
            values["inflight"] = depth.inflight
        if depth.takes:
            values["ahead"] = depth.ahead
        self._run_depth.add(depth)
        self.rank_report.add_pipeline_depth(depth)
        return values

    def pipeline_summary(self) -> str | None:
        """Main rank: the verdict over every logged window of the run (None when nothing was logged)."""
        (target_wait, target_wall), (drafter_wait, drafter_wall) = self._run_waits["target"], self._run_waits["drafter"]
        if not (target_wall and drafter_wall):
            return None
        line = pipeline_line(
            target_idle=target_wait / target_wall, drafter_idle=drafter_wait / drafter_wall, depth=self._run_depth
        )
        return f"pipeline over the run: {line}"

    def _received_profiles(self) -> dict[str, StageSummary]:
        profiles, self._target_profiles = self._target_profiles, {}
        return profiles

    # receiving -------------------------------------------------------------------------------------------------

    def _announce_start(self) -> None:
        """Tell every rank where the run starts (after this rank's resume) and what the targets must compute."""
        start = {
            "step": self.step,
            "total_steps": self.total_steps,
            "sampler": self.sampler.state_dict(),
            "layer_ids": list(self.model_config.target_layer_ids),
            "block_size": self.model_config.block_size,
            "mask_token_id": self.model_config.mask_token_id,
            "num_target_layers": self.num_target_layers,
        }
        broadcast_start(start, roles=self.roles)

    def _accept(self, received: Received | None, *, source: int, plan: BatchPlan) -> tuple[TrainBatch, TargetOutputs]:
        expected = {"step": self.step, "epoch": plan.epoch, "index": plan.index}
        if received is None:
            raise RuntimeError(f"target rank {source} ended its stream before step {self.step + 1} ({expected})")
        meta = received.meta
        got = {key: meta[key] for key in expected}
        if got != expected:
            raise RuntimeError(f"schedule mismatch: target rank {source} sent {got}, drafter expected {expected}")
        self._target_stop_requested |= bool(meta["stop_requested"])
        self._target_stats[source] = meta["stats"]
        if meta.get("profile"):
            merge_summaries(self._target_profiles.setdefault(f"target{source}", {}), meta["profile"])
        return unpack_batch(meta["batch"], received.tensors)

    def _wall(self) -> float:
        return time.perf_counter() - self._started


def broadcast_start(start: dict[str, Any] | None, *, roles: Roles) -> dict[str, Any]:
    """The first drafter rank's start description, on every rank (one collective on the start group, gloo: the
    target ranks wait in it while the drafters read the checkpoint they resume from, which can outlast
    `placement.timeout_s`)."""
    holder = [start]
    dist.broadcast_object_list(holder, src=roles.drafter_ranks[0], group=roles.start_group)
    return holder[0]


class TargetWorker:
    """A target rank: its share of each step's micro-batches -> features -> the drafter the schedule names."""

    def __init__(
        self,
        config: RunConfig,
        *,
        roles: Roles,
        world: World,
        target: LoadedTarget,
        should_stop: Callable[[], bool],
    ) -> None:
        self.config = config
        self.roles = roles
        self.world = world
        self.target = target
        self.should_stop = should_stop
        self.faults = FaultInjection.from_env(world.rank)
        self.batches_per_step = roles.num_drafters * config.optim.grad_accum
        # The global batch list, as the drafters see it.
        self.data: TrainingData = load_training_data(
            config, target, rank=0, world_size=1, step_batches=self.batches_per_step
        )
        # The drafters stop taking batches while the lead writes a checkpoint (the others wait for it), so a
        # sender's wait for room, and for the end-of-run notices after the last checkpoint, may last that long too.
        # A drafter that fails or dies fails this rank within seconds anyway (distributed/failure.py); the bound
        # is for a machine that vanished.
        self.wait_s = config.placement.timeout_s + config.checkpoint.timeout_s
        self.sender = FeatureSender(
            queue_depth=config.placement.queue_depth,
            header_group=roles.header_group,
            payload_group=roles.payload_group,
            timeout_s=self.wait_s,
        )
        self.profiler = StageProfiler.from_env(
            config.metrics.profile_interval, world.device, sink=lambda _: None, label=roles.label()
        )
        self._started = time.perf_counter()

    def run(self) -> TrainSummary:
        start = broadcast_start(None, roles=self.roles)
        if start["num_target_layers"] != len(decoder_module(self.target.model).layers):
            raise RuntimeError(
                f"target rank {self.world.rank} loaded a target with {len(decoder_module(self.target.model).layers)}"
                f" layers, the drafters one with {start['num_target_layers']}: all ranks must load the same target"
            )
        # Refuses (naming the setting) when this rank's data or batch settings differ from the drafters'.
        self.data.sampler.load_state_dict(start["sampler"])
        capture = FeatureCapture(
            self.target.model,
            start["layer_ids"],
            need_final_hidden=self.config.loss.label_source != "data",
            compile_layers=self.config.target.compile and self.world.device.type == "cuda",
            compile_mode=self.config.target.compile_mode,
        )
        notices = NoticeBoard(list(self.roles.drafter_ranks), self.roles.header_group, timeout_s=self.wait_s)
        # Host batches (collation, anchors, labels, pinned memory) are made ahead on a worker thread.
        prefetcher = Prefetcher(self._my_batches(start), depth=self._prefetch_depth(), name="dflash-target-prefetch")
        steps = start["step"]
        try:
            for step, position, plan, host_batch in prefetcher:
                if notices.arrived():  # the drafters ended (a stop): END follows what was sent
                    break
                self.faults.at_step(step + 1)
                self._produce(plan, host_batch, step=step, position=position, capture=capture, start=start)
                steps = step + 1
        finally:
            prefetcher.close()
        for rank in self.roles.drafter_ranks:
            self.sender.end(rank)
        self.sender.finish()
        codes = notices.wait_all()
        return TrainSummary(
            run_dir=Path(self.config.run_dir),
            steps=steps,
            interrupted=NOTICE_STOP in codes.values(),
            last_checkpoint=None,
            final_loss=None,
            final_tau=None,
            skipped_nonfinite_steps=0,
            data_stats=dataclasses.asdict(self.data.dataset.stats),
        )

    def _my_batches(self, start: dict[str, Any]) -> Iterator[tuple[int, int, BatchPlan, TrainBatch]]:
        """(step, position in the step, plan, host batch) of every micro-batch this rank computes, in schedule
        order (runs on the prefetch worker, which alone touches the sampler)."""
        run_index = RunIndex(self.data.sampler)
        groups = step_groups(
            self.data.sampler, epochs=self.config.train.epochs, micro_batches_per_step=self.batches_per_step
        )
        # The step range comes first: zip stops on it without taking a group past `total_steps`.
        for step, plans in zip(range(start["step"], start["total_steps"]), groups, strict=False):
            for position, plan in enumerate(plans):
                if target_slot(run_index(plan.epoch, plan.index), self.roles.num_targets) != self.roles.slot:
                    continue
                batch = plan_to_host_batch(
                    plan,
                    self.data,
                    block_size=start["block_size"],
                    mask_token_id=start["mask_token_id"],
                    config=self.config,
                    device=self.world.device,
                )
                yield step, position, plan, batch

    def _prefetch_depth(self) -> int:
        """`data.prefetch_steps` optimizer steps of this rank's share of micro-batches (0: made inline)."""
        share = -(-self.batches_per_step // self.roles.num_targets)
        return self.config.data.prefetch_steps * share

    def _produce(
        self,
        plan: BatchPlan,
        host_batch: TrainBatch,
        *,
        step: int,
        position: int,
        capture: FeatureCapture,
        start: dict[str, Any],
    ) -> None:
        with self.profiler.stage("data"):
            batch = host_batch.to(self.world.device)
        argmax_labels = self.config.loss.label_source == "target_argmax"  # the LM head runs here, on the target rank
        outputs = batch.target_outputs(
            capture,
            labels_head=lm_head_module(self.target.model) if argmax_labels else None,
            chunk_positions=self.config.loss.chunk_blocks * start["block_size"],
            profiler=self.profiler,
        )
        host, tensors = pack_batch(
            batch, outputs, num_features=len(start["layer_ids"]), split=self.config.placement.split_features
        )
        destination = self.roles.drafter_ranks[drafter_slot(position, self.roles.num_drafters)]
        with self.profiler.stage("send_wait"):
            self.sender.wait_for_room(destination)
        meta = {
            "step": step,
            "epoch": plan.epoch,
            "index": plan.index,
            "batch": host,
            "stop_requested": self.should_stop(),
            "stats": {
                "wait_s": self.sender.stats.wait_s,
                "wall_s": time.perf_counter() - self._started,
                "sends": self.sender.stats.sends,
                "inflight_sum": self.sender.stats.inflight_sum,
            },
        }
        if self.profiler.enabled:
            # This rank's stages since its previous header, and the time that covers (the header reaches the
            # report later, by up to the window and the drafter's receive queue); the drafter adds them.
            summary = self.profiler.summary(covered=True)
            meta["profile"] = {stage: list(stats) for stage, stats in summary.items()}
            self.profiler.reset()
        with self.profiler.stage("send"):
            self.sender.send(destination, meta=meta, tensors=tensors)


def load_target_for_role(config: RunConfig, *, roles: Roles, world: World) -> LoadedTarget:
    """Target ranks load the target on their device; drafter ranks on the CPU, in the dtype the target ranks
    use, so that only the embedding and LM head ever reach the drafter's device."""
    dtype = str(resolve_dtype(config.target.dtype, world.device)).removeprefix("torch.")
    device = str(world.device) if roles.role == "target" else "cpu"
    return load_target(
        config.target.name_or_path,
        dtype=dtype,
        device=device,
        cache_dir=config.target.cache_dir,
        attn_implementation=config.target.attn_implementation,
    )


def run_disaggregated(
    config: RunConfig,
    world: World,
    *,
    should_stop: Callable[[], bool],
    prepare_data: Callable[[RunConfig, LoadedTarget], object],
    wait_for_data: Callable[[], None],
) -> tuple[TrainSummary, DrafterTrainer | None]:
    """This rank's part of a disaggregated run: (its summary, the trainer on drafter ranks, None on targets).

    The first target rank builds missing training data (it holds the target on its device); the others wait."""
    roles = assign_roles(world, config.placement, checkpoint_timeout_s=config.checkpoint.timeout_s)
    target = load_target_for_role(config, roles=roles, world=world)
    if roles.role == "target" and roles.slot == 0:
        prepare_data(config, target)
    else:
        wait_for_data()
    if roles.role == "target":
        if config.target.fp8:  # after any regeneration: the data comes from the real target
            quantize_target_to_fp8(target)
        worker = TargetWorker(config, roles=roles, world=world, target=target, should_stop=should_stop)
        return worker.run(), None
    trainer = DrafterTrainer(config, roles=roles, world=world, target=target, should_stop=should_stop)
    return trainer.fit(), trainer
