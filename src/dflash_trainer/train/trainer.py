"""The trainer: target forward (no grad) -> features -> drafter forward -> loss -> backward -> step.

Read `fit` top to bottom: it is the whole loop. Each stage is a small method; the profiler times them when on.

Host work off the critical path. The colocated trainer prepares whole optimizer steps of batches (collation,
anchors, labels, the flex mask's tile tables, pinned memory) on a background thread, `data.prefetch_steps` steps
ahead (`train/prefetch.py`); the training thread only issues their non-blocking copies ("data" stage) and waits
for the next step when the worker is behind ("prefetch_wait" stage, `wait_prefetch_s` per step in the metrics).
The sampler runs ahead with the worker, so each prepared step carries the sampler position after its batches,
and checkpoints save the position of the last step *trained* (what a resume must continue from), never the
sampler's own.

Host syncs. None inside a step; on log steps the metric counters are converted (`_log_step`), and each step
reads the previous step's flags (below) through their own copy to pinned memory and its event (`StepFlags`), a
sync on work the device finished while this step was being queued.
Non-finite steps and stop agreement: after backward, each step computes device flags [non-finite loss or
gradient, stop requested on this rank], MAX-reduced over the ranks of the group (a device-side collective); the
flags' first entry is fused AdamW's `found_inf`, so a non-finite step skips its update on the device (weights
and optimizer state untouched, as GradScaler does) without the host looking. The host reads the flags one step
later, just before queuing that step's update: `on_nonfinite: stop` then raises NonFiniteLossError naming the
bad step and its samples (the weights are those from before it), `skip` counts it; a stop agreed at step s ends
the run after step s+1, on every rank alike. Differences from the former per-step sync: the stop takes effect one
step later; detection is unchanged. Where the device cannot skip (FSDP2's sharded parameters, an optimizer
without `found_inf`) or `train.sync_every_step` is set, the flags are read right away instead (one sync per step,
as before).

`Trainer` is the colocated placement (every rank runs target and drafter; one process is the one-rank case).
The disaggregated placement's drafter ranks run the same loop with the features arriving from target ranks
(`train/disaggregated.py` subclasses the hooks marked "placement hook"). Collectives go to `self.group`: the
default group when colocated, the drafter group when disaggregated.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..config import ConfigError, RunConfig, config_to_dict
from ..data.sampler import BatchPlan
from ..devices import resolve_device
from ..distributed.failure import FaultInjection
from ..distributed.roles import checkpoint_wait_group
from ..distributed.world import World
from ..errors import UserError
from ..model.anchors import block_state_rows, gather_block_states, kept_blocks_only
from ..model.attention import build_masks, resolve_backend
from ..model.config import DrafterModelConfig
from ..model.dflash2 import DFlash2Drafter, DFlash2ModelConfig, SelectorObjective
from ..model.drafter import build_drafter
from ..model.fp8 import fp8_training_problem
from ..model.fp8_head import fp8_head_problem
from ..model.loss import (
    LossMetrics,
    TargetPositionLogits,
    block_slot_tokens,
    default_gamma,
    dflash_loss,
    target_position_logits,
)
from ..model.noise import add_feature_noise, noise_std_at
from ..model.target_init import copy_target_layers, resolve_layer_ids
from ..targets.capture import (
    FeatureCapture,
    TargetOutputs,
    decoder_module,
    embedding_module,
    lm_head_module,
)
from ..targets.loader import LoadedTarget, load_target, resolve_mask_token_id
from ..targets.varlen_hybrid import linear_attention_layers, why_not_varlen_hybrid
from . import checkpoint as ckpt
from .batch import TrainBatch
from .data_setup import load_training_data, plan_to_host_batch
from .lookahead import TargetLookahead
from .metrics import (
    CompileWatch,
    MetricsLogger,
    MetricValue,
    Progress,
    Throughput,
    allocator_retries,
    dflash_flops_per_token,
    format_console_line,
    fractions_out_of_range,
    measured_peak_flops,
    mfu,
    peak_memory_gib,
)
from .optim import build_optimizer, build_scheduler
from .prefetch import Prefetcher
from .profiler import StageProfiler
from .rank_report import RankProfileReport
from .schedule import DataPosition, count_steps, epoch_progress, position_of, step_groups
from .sharding import make_sync
from .stall import StallReport


class NonFiniteLossError(UserError, RuntimeError):
    """The loss or gradients of a step were NaN/inf (and `train.on_nonfinite` is `stop`): the run diverged, a
    matter of its settings or data (one line naming the step and samples, exit status 2), not a bug."""


@dataclass
class TrainSummary:
    run_dir: Path
    steps: int
    interrupted: bool
    last_checkpoint: Path | None
    final_loss: float | None
    final_tau: float | None
    skipped_nonfinite_steps: int
    data_stats: dict


def drafter_model_config(config: RunConfig, target: LoadedTarget) -> DrafterModelConfig:
    """The one place the drafter's architecture is derived from the recipe and the target."""
    drafter = config.drafter
    mask_token_id = resolve_mask_token_id(drafter.mask_token_id, target)
    base = DrafterModelConfig.from_target(
        target.config,
        num_layers=drafter.num_layers,
        block_size=drafter.block_size,
        mask_token_id=mask_token_id,
        target_layer_ids=drafter.target_layer_ids,
        num_target_features=drafter.num_target_features,
        intermediate_size=drafter.intermediate_size,
        sliding_layers=drafter.sliding_layers,
        sliding_window=drafter.sliding_window,
        sliding_causal_in_block=drafter.sliding_causal_in_block,
    )
    if drafter.algorithm == "dflash2":
        try:
            return DFlash2ModelConfig.extend(base, **dataclasses.asdict(drafter.dflash2))
        except ValueError as error:  # a size that does not fit the target (e.g. a group not dividing H)
            raise ConfigError(f"drafter.dflash2: {error}") from None
    return base


@dataclass
class StepWork:
    """The micro-batches of one optimizer step on this rank."""

    batches: list[TrainBatch]
    # Features per micro-batch when another rank computed them; None: run the target here.
    outputs: list[TargetOutputs | None]
    # Multiplies each micro-batch loss so that the synced gradient is the step's mean: 1 / this rank's
    # micro-batches when the sync averages over ranks (DDP, FSDP2), 1 / the whole step's when it sums them.
    loss_scale: float
    # Where the data stands once this step's batches are handed out, when they were prepared ahead of training
    # (the sampler has moved on by then); None: the sampler's own state is this step's.
    sampler_state: dict | None = None
    position: DataPosition | None = None
    epoch_progress: float | None = None

    def to(self, device: torch.device) -> StepWork:
        return dataclasses.replace(self, batches=[batch.to(device) for batch in self.batches])


@dataclass
class StepFlags:
    """One step's device flags [non-finite, stop] (reduced over ranks), read on the host later.

    On CUDA the flags are copied to pinned host memory as soon as they are queued, an event recorded behind the copy:
    `read` waits for that event, i.e. for the step that made them and nothing queued since. A `.tolist()` of the
    device tensor one step later would copy on the current stream, behind the next step's forward and backward,
    so the host would wait for those too and the device would idle while the host queued the optimizer and the step
    after."""

    step: int
    flags: torch.Tensor  # [2] float32, on the device
    sample_ids: list[str]
    host: torch.Tensor  # [2] float32 on the host (pinned on CUDA), filled once `copied` completes
    copied: torch.cuda.Event | None  # None: `host` holds the values already (a CPU run)

    @classmethod
    def queue(cls, step: int, flags: torch.Tensor, sample_ids: list[str]) -> StepFlags:
        if not flags.is_cuda:
            return cls(step, flags, sample_ids, host=flags, copied=None)
        host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
        host.copy_(flags, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(flags.device))  # the copy's stream: flags' device, not the current one
        return cls(step, flags, sample_ids, host=host, copied=copied)

    def read(self) -> tuple[float, float]:
        """(non-finite, stop) on the host: a sync on this step's copy only."""
        if self.copied is not None:
            self.copied.synchronize()
        nonfinite, stop = self.host.tolist()
        return nonfinite, stop


class Trainer:
    def __init__(
        self,
        config: RunConfig,
        *,
        should_stop: Callable[[], bool] = lambda: False,
        log: Callable[[str], object] = print,
        target: LoadedTarget | None = None,
        world: World | None = None,
    ) -> None:
        self.config = config
        self.should_stop = should_stop
        self.world = world or World(device=resolve_device(config.target.device))
        self.group, self.group_size, self.is_main = self._sync_group()
        self.checkpoint_group = self._checkpoint_group() if self.group_size > 1 else None
        self.log = log if self.is_main else (lambda _: None)
        self.run_dir = Path(config.run_dir)
        self.device = self.world.device
        self.faults = FaultInjection.from_env(self.world.rank)
        torch.manual_seed(config.train.seed)
        self.target = target or load_target(
            config.target.name_or_path,
            dtype=config.target.dtype,
            device=str(self.device),
            cache_dir=config.target.cache_dir,
            attn_implementation=config.target.attn_implementation,
            fp8=config.target.fp8,
        )
        self._setup_data()
        self._setup_drafter()
        self._setup_optimizer()
        self.step = 0
        self.skipped_nonfinite = 0
        self._alloc_retries_warned = False
        self._compile_watch = CompileWatch()
        self._compile_logged = False  # the first log step's compilations are the warm-up
        self._fractions_warned = False
        self.stop_agreed = False
        self._pending_flags: StepFlags | None = None
        # The data position of the last trained step, when steps are prepared ahead (see StepWork).
        self._trained: StepWork | None = None
        self._prefetcher: Prefetcher[StepWork] | None = None
        # The target run one step ahead on a side stream (`train.target_lookahead`, `lookahead.py`); None when off.
        self._lookahead: TargetLookahead | None = None
        self._logged_prefetch_wait_s = 0.0
        self.profiler = StageProfiler.from_env(
            config.metrics.profile_interval, self.device, sink=self.log, label=self.rank_label()
        )
        self.rank_report = RankProfileReport(
            self.profiler,
            label=self.rank_label(),
            group=self.group,
            distributed=self.group_size > 1,
            is_main=self.is_main,
            sink=self.log,
        )

    # ------------------------------------------------------------------------------------------ placement hooks

    def _sync_group(self) -> tuple[dist.ProcessGroup | None, int, bool]:
        """(group for gradients, metrics and agreement, its size, whether this rank logs and checkpoints)."""
        return None, self.world.world_size, self.world.is_main

    def _checkpoint_group(self) -> dist.ProcessGroup:
        """Where the ranks wait while the main rank writes a checkpoint (`checkpoint.timeout_s`); made on every rank."""
        return checkpoint_wait_group(None, self.config.checkpoint.timeout_s)

    def rank_label(self) -> str:
        return f"rank{self.world.rank}"

    def _sampler_shard(self) -> tuple[int, int, int]:
        """(sampler rank, sampler world size, sampler batches per optimizer step on this rank)."""
        return self.world.rank, self.world.world_size, self.config.optim.grad_accum

    def layout(self) -> str:
        """How the global micro-batches of a step are made, for messages."""
        return f"{self.group_size} rank(s) x grad_accum {self.config.optim.grad_accum}"

    def _setup_target_side(self) -> None:
        """The target modules this rank uses: the feature capture, and the frozen embedding and LM head."""
        self.capture = FeatureCapture(
            self.target.model,
            self.model_config.target_layer_ids,
            need_final_hidden=self.config.loss.label_source != "data",
            compile_layers=self.config.target.compile and self.device.type == "cuda",
            compile_mode=self.config.target.compile_mode,
        )
        hybrid = bool(linear_attention_layers(self.target.model))
        if hybrid and self.capture.packing_path == "per_document" and self.device.type == "cuda":
            # A hybrid target off its fast path still trains, correctly and much slower: say why, once.
            reason = why_not_varlen_hybrid(self.target.model, self.device) or (
                "its attention layers cannot run document attention over one row of sequences"
            )
            self.log(f"target: linear-attention layers run each document as a row of its own, because {reason}")
        self.embed = embedding_module(self.target.model)
        self.lm_head = lm_head_module(self.target.model)
        deepest = max(self.model_config.target_layer_ids)
        layers = decoder_module(self.target.model).layers[: deepest + 1]
        self.target_params_used = sum(p.numel() for layer in layers for p in layer.parameters())

    def _step_groups(self) -> Iterator[StepWork]:
        """This rank's micro-batches per optimizer step, across epochs, from the sampler's (resumable) position:
        prepared on the prefetch worker, copied to the device here; with `train.target_lookahead`, each with its
        target outputs computed one step ahead (`lookahead.py`)."""
        if not self.config.train.target_lookahead:
            yield from self._device_steps()
            return
        self._lookahead = TargetLookahead(self._device_steps(), self._target_outputs, device=self.device)
        try:
            yield from self._lookahead  # closing this generator closes the lookahead's (it settles, then closes)
        finally:
            self._lookahead = None

    def _device_steps(self) -> Iterator[StepWork]:
        prefetcher = Prefetcher(self._prepared_steps(), depth=self.config.data.prefetch_steps, name="dflash-prefetch")
        self._prefetcher = prefetcher
        try:
            while True:
                with self.profiler.stage("prefetch_wait"):
                    work = next(prefetcher, None)
                if work is None:
                    return
                with self.profiler.stage("data"):
                    work = work.to(self.device)
                yield work
        finally:
            prefetcher.close()

    def _prepared_steps(self) -> Iterator[StepWork]:
        """Host batches of each step with the data position after them (runs on the prefetch worker: it alone
        touches the sampler until the loop ends)."""
        variants = self.drafter.mask_variants if self._tables_in_data_stage else None
        steps_left = self.total_steps - self.step  # resumed at train.max_steps: nothing left
        for plans in step_groups(
            self.sampler, epochs=self.config.train.epochs, micro_batches_per_step=self.sampler_step_batches
        ):
            if steps_left <= 0:
                return
            steps_left -= 1
            batches = [self._make_host_batch(plan, mask_variants=variants) for plan in plans]
            state = self.sampler.state_dict()
            yield StepWork(
                batches=batches,
                outputs=[None] * len(batches),
                loss_scale=1.0 / len(batches),
                sampler_state=state,
                position=position_of(self.sampler, batches_per_step=self.batches_per_step, layout=self.layout()),
                epoch_progress=epoch_progress(self.sampler),
            )

    def _end_of_data(self, *, interrupted: bool) -> None:
        """After the last step, before the final checkpoint."""

    def _placement_log_values(self, steps: int) -> dict[str, float]:
        """Extra metrics of a log step (`steps` optimizer steps since the last one)."""
        return {}

    def _received_profiles(self) -> dict:
        """Stage summaries of other ranks that reached this one since the last log step."""
        return {}

    # ------------------------------------------------------------------------------------------------ setup

    def _setup_data(self) -> None:
        rank, world_size, self.sampler_step_batches = self._sampler_shard()
        # Global micro-batches per optimizer step (what a resume must keep, see train/schedule.py); the sampler
        # shuffles the batches in groups of that many, so one step's batches are of similar size.
        self.batches_per_step = self.group_size * self.config.optim.grad_accum
        self.data = load_training_data(
            self.config, self.target, rank=rank, world_size=world_size, step_batches=self.batches_per_step
        )
        self.dataset, self.sampler = self.data.dataset, self.data.sampler
        self.total_steps = count_steps(
            self.sampler,
            epochs=self.config.train.epochs,
            micro_batches_per_step=self.sampler_step_batches,
            max_steps=self.config.train.max_steps,
        )

    def _setup_drafter(self) -> None:
        self.model_config = drafter_model_config(self.config, self.target)
        if self.config.drafter.init_from:
            from ..export import import_drafter

            self.drafter = import_drafter(self.config.drafter.init_from, device=self.device, dtype=torch.float32)
            self.model_config = self.drafter.config
        else:
            self.drafter = build_drafter(self.model_config).to(self.device)  # fp32 master weights
            if self.config.drafter.init_layers_from_target is not None:
                self._copy_target_layers(self.config.drafter.init_layers_from_target)
        self.drafter.set_flex_kernel_options(self.config.drafter.flex_kernel_options)
        self.drafter.checkpoint_layers = self.config.drafter.activation_checkpointing
        if self.config.drafter.fp8:
            self._use_fp8_drafter()
        if self.config.drafter.compile and self.device.type == "cuda":
            self.drafter.compile_layers(mode=self.config.drafter.compile_mode)
        self.sync = make_sync(
            self.drafter,
            sharding=self.config.placement.sharding,
            group_size=self.group_size,
            group=self.group,
            explicit=self.config.placement.disaggregated,
        )
        self.backend = resolve_backend(self.config.drafter.attention_backend, self.device)
        # flex masks from tile tables: computed by the data stage when it builds the batches here.
        self._tables_in_data_stage = self.backend == "flex" and self.config.drafter.mask_builder == "anchors"
        self._setup_target_side()
        if isinstance(self.drafter, DFlash2Drafter) and self.drafter.config.selector_codebooks == "embedding":
            self.drafter.candidate_selector.bind_token_embedding(self.embed.weight)
        self.gamma = self.config.loss.gamma or default_gamma(self.model_config.block_size)
        if self.config.loss.fp8_head:
            self._check_fp8_head()
        self.selector_objective = self._selector_objective()
        precision = self.config.train.precision
        use_bf16 = precision == "bf16" or (precision == "auto" and self.device.type == "cuda")
        self.autocast_dtype = torch.bfloat16 if use_bf16 else None

    def _use_fp8_drafter(self) -> None:
        problem = fp8_training_problem(self.device)
        if problem is not None:
            raise ConfigError(f"drafter.fp8: {problem}; set drafter.fp8=false")
        scaling = self.config.drafter.fp8_scaling
        converted, kept = self.drafter.use_fp8_training(scaling)
        self.log(f"drafter: {converted} linear layers train in FP8 ({scaling} scales), {kept} in high precision")

    def _check_fp8_head(self) -> None:
        problem = fp8_training_problem(self.device) or fp8_head_problem(self.lm_head.weight)
        if problem is not None:
            raise ConfigError(f"loss.fp8_head: {problem}; set loss.fp8_head=false")

    def _selector_objective(self) -> SelectorObjective | None:
        """DFlash2's selector term beside the base loss (model/dflash2/objective.py); None for DFlash."""
        if not isinstance(self.model_config, DFlash2ModelConfig):
            return None
        selector = self.config.loss.selector
        return SelectorObjective(
            block_size=self.model_config.block_size,
            gamma=self.gamma,
            chunk_blocks=self.config.loss.chunk_blocks,
            weight=selector.weight,
            warmup_ratio=selector.warmup_ratio,
            ramp_ratio=selector.ramp_ratio,
            gold_injection=selector.gold_injection,
            stop_gradient=selector.stop_gradient,
            device=self.device,
            compile=self.config.loss.compile,
        )

    def _copy_target_layers(self, spec: list[int]) -> None:
        layers = decoder_module(self.target.model).layers
        try:
            ids = resolve_layer_ids(spec, len(layers), self.model_config.num_hidden_layers)
            copied = copy_target_layers(self.drafter, layers, ids)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        self.log(f"drafter layers start from target layers {ids} ({len(copied)} tensors each)")

    def _setup_optimizer(self) -> None:
        # Fused AdamW (CUDA and CPU) takes `found_inf`, so a non-finite step is skipped on the device; FSDP2's
        # sharded parameters are DTensors, which it does not take with a plain flag: those read flags at once.
        self.optimizer = build_optimizer(self.drafter, self.config.optim, fused=True)
        self.scheduler = build_scheduler(self.optimizer, self.config.optim, total_steps=self.total_steps)
        sharded = any(isinstance(p, DTensor) for p in self.drafter.parameters())
        self._skip_on_device = not sharded and not self.config.train.sync_every_step

    def flops_per_token(self, blocks_per_token: float) -> float:
        return dflash_flops_per_token(
            target_params_used=self.target_params_used,
            drafter_params=sum(p.numel() for p in self.drafter.parameters()),
            blocks_per_token=blocks_per_token,
            block_size=self.model_config.block_size,
            hidden=self.model_config.hidden_size,
            vocab=self.model_config.vocab_size,
        )

    def exportable_drafter(self) -> nn.Module:
        """The trained drafter with ordinary parameters (main rank, after `fit`), for export and evaluation."""
        return self.sync.plain_drafter()

    # ------------------------------------------------------------------------------------------------ loop

    def start_log_window(self) -> None:
        """Counters of the current log interval; `fit` (and `bench`, which drives steps itself) start them."""
        self.throughput = Throughput()
        self._reset_window_counters()

    def _reset_window_counters(self) -> None:
        self.window_metrics = LossMetrics.zeros(self.model_config.block_size, device=self.device)
        self.window_blocks = 0
        self.window_steps = 0

    def fit(self) -> TrainSummary:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        resumed_from = self.maybe_resume()
        self.logger = MetricsLogger(
            self.run_dir,
            tensorboard=self.config.metrics.tensorboard,
            is_main=self.is_main,
            resume_step=self.step if resumed_from else 0,
            wandb=self.config.metrics.wandb,
            run_config=config_to_dict(self.config),
        )
        self.progress = Progress(
            self.total_steps, initial=self.step, enabled=self.config.metrics.progress_bar and self.is_main
        )
        self.start_log_window()
        last_checkpoint, interrupted, last_values = resumed_from, False, {}
        self.log(
            f"training {self.total_steps} steps on {self.device} | target {self.target.name} | drafter "
            f"{sum(p.numel() for p in self.drafter.parameters()) / 1e6:.2f}M params, "
            f"layers {self.model_config.num_hidden_layers}, "
            f"block {self.model_config.block_size}, taps {self.model_config.target_layer_ids} | "
            f"{self.dataset.stats.samples} samples, {self.dataset.stats.tokens} tokens | {self.layout()} | "
            f"run dir {self.run_dir}"
        )
        stall = StallReport(self.config.train.stall_report_s)
        try:
            stall.start()
            for work in self._step_groups():
                self._optimizer_step(work.batches, outputs=work.outputs, loss_scale=work.loss_scale)
                self._trained = work if work.sampler_state is not None else None
                self.progress.update()
                stall.beat()
                if self.step % self.config.metrics.log_every == 0 or self.step == self.total_steps:
                    last_values = self._log_step()
                if self.config.eval.every_steps and self.step % self.config.eval.every_steps == 0:
                    self._periodic_eval()
                    stall.beat()
                if self.step % self.config.checkpoint.every_steps == 0:
                    last_checkpoint = self.save_checkpoint(final=False) or last_checkpoint
                    stall.beat()
                if self.stop_agreed:
                    interrupted = True
                    break
                if self.step >= self.total_steps:
                    break
            self._settle_flags()
            self._end_of_data(interrupted=interrupted)
            if last_checkpoint is None or not last_checkpoint.name.endswith(f"{self.step:08d}"):
                last_checkpoint = self.save_checkpoint(final=True)
        finally:
            try:  # a hang in closing (the prefetcher's join, a metrics sink) is reported too
                if self._prefetcher is not None:
                    self._prefetcher.close()
                self.progress.close()
                self.logger.close()
            finally:
                stall.stop()
        if interrupted:
            self.log(f"interrupted at step {self.step}: checkpoint {last_checkpoint}")
        return TrainSummary(
            run_dir=self.run_dir,
            steps=self.step,
            interrupted=interrupted,
            last_checkpoint=last_checkpoint,
            final_loss=last_values.get("loss"),
            final_tau=last_values.get("tau"),
            skipped_nonfinite_steps=self.skipped_nonfinite,
            data_stats=dataclasses.asdict(self.dataset.stats),
        )

    def _make_host_batch(self, plan: BatchPlan, *, mask_variants=None) -> TrainBatch:
        return plan_to_host_batch(
            plan,
            self.data,
            block_size=self.model_config.block_size,
            mask_token_id=self.model_config.mask_token_id,
            config=self.config,
            device=self.device,
            mask_variants=mask_variants,
        )

    def make_batch(self, plan: BatchPlan) -> TrainBatch:
        """The batch of `plan` on this rank's device, as the training loop gets it (for benchmarks and tests)."""
        variants = self.drafter.mask_variants if self._tables_in_data_stage else None
        return self._make_host_batch(plan, mask_variants=variants).to(self.device)

    def _optimizer_step(
        self,
        micro_batches: list[TrainBatch],
        *,
        outputs: list[TargetOutputs | None] | None = None,
        loss_scale: float | None = None,
    ) -> None:
        self.faults.at_step(self.step + 1)
        self.drafter.train()
        outputs = outputs or [None] * len(micro_batches)
        scale = 1.0 / len(micro_batches) if loss_scale is None else loss_scale
        step_metrics = LossMetrics.zeros(self.model_config.block_size, device=self.device)
        for i, (batch, target_outputs) in enumerate(zip(micro_batches, outputs, strict=True)):
            # DDP / FSDP2 reduce gradients on the last micro-batch's backward only.
            with self.sync.micro_batch(last=i == len(micro_batches) - 1):
                step_metrics.add_(self._forward_backward(batch, target_outputs, scale=scale))
        with self.profiler.stage("optimizer"):
            self.sync.after_micro_batches()
            grad_norm = self.sync.local_norm(
                # optim.grad_clip 0 or null is off: an infinite bound measures the norm and scales by 1.
                torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.config.optim.grad_clip or math.inf)
            )
            flags = StepFlags.queue(
                step=self.step + 1,
                flags=self._step_flags(grad_norm, step_metrics.loss_sum),
                sample_ids=[sid for batch in micro_batches for sid in batch.sample_ids],
            )
            # The previous step's flags: its copy was done before this step's work began on the device.
            self._settle_flags()
            self._pending_flags = flags
            if self._skip_on_device:
                self.optimizer.found_inf = flags.flags[0]  # fused AdamW skips the whole update when it is 1
                self.optimizer.step()
            elif self._settle_flags():  # sync (FSDP2 / sync_every_step): decide on the host
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
        self.step += 1
        self.window_steps += 1
        # A skipped step's metrics do not count (`where`: a NaN times 0 would still be NaN).
        self.window_metrics.add_(
            LossMetrics.from_tensor(torch.where(flags.flags[0] > 0, 0.0, step_metrics.to_tensor()))
        )
        if self.selector_objective is not None:
            self.selector_objective.end_step(skipped=flags.flags[0])
        self.last_grad_norm = grad_norm
        tokens = sum(b.num_tokens for b in micro_batches)
        self.window_blocks += sum(b.num_blocks for b in micro_batches)
        self.throughput.record_step(tokens)

    def _step_flags(self, grad_norm: torch.Tensor, loss_sum: torch.Tensor) -> torch.Tensor:
        """[2] float32 on the device: (non-finite loss or gradient, stop requested), MAX over the group's ranks.
        Built without host-to-device copies (a copy from pageable memory would be a sync); the all-reduce is
        ordered on the device streams, so nothing here waits on the host."""
        nonfinite = ~(torch.isfinite(grad_norm) & torch.isfinite(loss_sum))
        stop = torch.full((), float(self.should_stop()), device=grad_norm.device)
        flags = torch.stack([nonfinite.to(torch.float32), stop])
        if self.group_size > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        return flags

    def _settle_flags(self) -> bool:
        """Read the pending step's flags on the host (the sync) and act on them; True when that step was finite
        (or none is pending). Raises NonFiniteLossError for a non-finite step under `on_nonfinite: stop`."""
        pending, self._pending_flags = self._pending_flags, None
        if pending is None:
            return True
        nonfinite, stop = pending.read()
        self.stop_agreed = self.stop_agreed or stop > 0
        if nonfinite > 0:
            self._handle_nonfinite(pending)
        return nonfinite == 0

    def _handle_nonfinite(self, pending: StepFlags) -> None:
        message = f"non-finite loss or gradient at step {pending.step}; samples {pending.sample_ids[:20]}"
        if self.config.train.on_nonfinite == "stop":
            raise NonFiniteLossError(
                f"{message}: the run diverged. Lower optim.lr or check those samples, or set "
                "train.on_nonfinite=skip to skip such steps"
            )
        self.skipped_nonfinite += 1
        self.log(f"skipping: {message}")

    def _target_outputs(self, batch: TrainBatch) -> TargetOutputs:
        """The target's outputs for one micro-batch: the tapped features and, for target-argmax labels, the greedy
        next tokens, as a target rank computes them (`disaggregated.py`)."""
        return batch.target_outputs(
            self.capture,
            labels_head=self.lm_head if self.config.loss.label_source == "target_argmax" else None,
            chunk_positions=self.config.loss.chunk_blocks * self.model_config.block_size,
            profiler=self.profiler,
        )

    def _forward_backward(self, batch: TrainBatch, outputs: TargetOutputs | None, *, scale: float) -> LossMetrics:
        if outputs is None:
            outputs = self._target_outputs(batch)
        with self.profiler.stage("feature_pack"):
            features = self._noisy(outputs.features)
            with torch.no_grad():
                block_embeds = self.embed(batch.block_ids)  # [R, N*B, H] frozen target embedding
        with self.profiler.stage("mask_build"):
            masks = build_masks(
                anchors=batch.anchors,
                anchor_keep=batch.anchor_keep,
                doc_ids=batch.doc_ids,
                block_size=self.model_config.block_size,
                variants=self.drafter.mask_variants,
                backend=self.backend,
                builder=self.config.drafter.mask_builder,
                tables=batch.mask_tables,
                tile=self.config.drafter.flex_tile,
            )
        autocast = (
            torch.autocast(self.device.type, dtype=self.autocast_dtype)
            if self.autocast_dtype is not None
            else contextlib.nullcontext()
        )
        rows, num_blocks = batch.anchors.shape
        block = self.model_config.block_size
        with autocast:
            with self.profiler.stage("drafter_forward"):
                hidden = self.sync.module(
                    features=features,
                    block_embeds=block_embeds,
                    ctx_positions=batch.position_ids,
                    block_positions=batch.block_pos,
                    masks=masks,
                    backend=self.backend,
                )
            with self.profiler.stage("loss"):
                loss_config = self.config.loss
                labels, label_source, target_hidden = batch.labels, loss_config.label_source, None
                if label_source == "target_argmax":
                    # The target's greedy next tokens (`_target_outputs`, or a target rank's), gathered per slot;
                    # from the final states here when the outputs came without them (the bench's replayed features).
                    if outputs.next_tokens is None:
                        chunk = loss_config.chunk_blocks * block
                        outputs = outputs.with_next_tokens(self.lm_head, chunk_positions=chunk)
                    labels = block_slot_tokens(outputs.next_tokens, batch.anchors, block_size=block)
                    label_source = "data"
                kept = partial(kept_blocks_only, index=batch.kept_blocks)
                target_logits = None
                if label_source != "data" and outputs.final_hidden is not None:
                    if label_source == "soft":
                        target_logits = self._soft_label_logits(outputs.final_hidden, batch, kept)
                    if target_logits is None:
                        target_hidden = gather_block_states(
                            states=outputs.final_hidden, anchors=batch.anchors, block_size=block
                        )
                # Hand the loss hidden states in the LM head's dtype: an fp32 hidden would copy a bf16 head to fp32.
                hidden = hidden.to(self.lm_head.weight.dtype).view(rows, num_blocks, block, -1)  # [R, N, B, H]
                result = dflash_loss(
                    kept(hidden),
                    self.lm_head.weight,
                    kept(labels),
                    kept(batch.valid),
                    gamma=self.gamma,
                    weighting=loss_config.weighting,
                    dpace_alpha=loss_config.dpace_alpha,
                    label_source=label_source,
                    target_hidden=None if target_hidden is None else kept(target_hidden),
                    chunk_blocks=loss_config.chunk_blocks,
                    lm_head_bias=getattr(self.lm_head, "bias", None),
                    compile=loss_config.compile,
                    target_logits=target_logits,
                    fp8_head=loss_config.fp8_head,
                    # DFlash2: the selector's candidates from these logits (not its own pass of the LM head).
                    candidates_top_k=0 if self.selector_objective is None else self.drafter.candidate_selector.top_k,
                )
                if self.selector_objective is not None:
                    result = self.selector_objective.add_term(
                        result,
                        selector=self.drafter.candidate_selector,
                        hidden=kept(hidden),
                        lm_head_weight=self.lm_head.weight,
                        lm_head_bias=getattr(self.lm_head, "bias", None),
                        block_ids=kept(batch.block_ids.view(rows, num_blocks, block)),
                        labels=kept(labels),
                        valid=kept(batch.valid),
                        step=self.step,
                        total_steps=self.total_steps,
                    )
        with self.profiler.stage("backward"):
            (result.loss * scale).backward()
        return result.metrics

    def _soft_label_logits(
        self, final_hidden: torch.Tensor, batch: TrainBatch, kept: Callable[[torch.Tensor], torch.Tensor]
    ) -> TargetPositionLogits | None:
        """The target's logits once per position (`model/loss.py`), when the batch has fewer positions than the loss
        has block slots (blocks overlap: each position sits in several); None: per slot is less work."""
        rows, length, _ = final_hidden.shape
        if rows * length >= batch.kept_blocks.numel() * self.model_config.block_size:
            return None
        logits = target_position_logits(
            final_hidden, self.lm_head.weight, lm_head_bias=getattr(self.lm_head, "bias", None)
        )  # [R*T, V]
        rows_of_slots = block_state_rows(anchors=batch.anchors, length=length, block_size=self.model_config.block_size)
        return TargetPositionLogits(logits=logits, slot_rows=kept(rows_of_slots))

    def _noisy(self, features: torch.Tensor) -> torch.Tensor:
        noise = self.config.noise
        if noise.type == "none":
            return features
        std = noise_std_at(self.step, self.total_steps, noise.start, noise.end)
        generator = torch.Generator(device=features.device).manual_seed(self.config.train.seed * 1_000_003 + self.step)
        return add_feature_noise(features, kind=noise.type, std=std, generator=generator)

    # ------------------------------------------------------------------------------------------------ logging

    def _log_step(self) -> dict:
        self._settle_flags()  # so the skipped-step count is current (log steps sync anyway)
        window = self.throughput.take()
        metrics = self.window_metrics
        tokens, blocks = window.tokens, self.window_blocks
        # Compilations of every rank: a recompile on one rank stalls the whole group.
        frames, compile_s, new_frames = self._compile_watch.take()
        if self.group_size > 1:
            # Sum/total pairs and counts from every rank in one collective.
            counts = [tokens, blocks, frames, compile_s, new_frames]
            flat = torch.cat([metrics.to_tensor(), torch.tensor(counts, dtype=torch.float64, device=self.device)])
            dist.all_reduce(flat, group=self.group)
            metrics = LossMetrics.from_tensor(flat[: -len(counts)])
            tokens, blocks, frames, compile_s, new_frames = flat[-len(counts) :].tolist()
            tokens, blocks, frames, new_frames = int(tokens), int(blocks), int(frames), int(new_frames)
        # Sync (log steps only): device counters become host numbers here and nowhere else.
        acc_per_slot = metrics.slot_accuracy()[1:].tolist()
        values = {
            "epoch": self._epoch_progress(),
            "loss": float(metrics.mean_loss()),
            "acc": sum(acc_per_slot) / max(1, len(acc_per_slot)),
            "acc_per_slot": acc_per_slot,
            "tau": float(metrics.expected_acceptance()),
            "tau_prefix": float(metrics.prefix_acceptance()),
            "lr": self.scheduler.get_last_lr()[0],
            "grad_norm": float(self.last_grad_norm),
            "tokens_per_s": tokens / window.seconds if window.seconds > 0 else 0.0,
            "step_time_s": window.step_time_s,
            # Kept blocks (all ranks), what the loss works on: with `loss.chunk_blocks`, how full the last chunk is.
            "blocks_per_step": blocks / window.steps if window.steps > 0 else 0.0,
            "peak_mem_gib": peak_memory_gib(self.device),
        }
        peak = measured_peak_flops(self.device)
        if peak is not None and tokens > 0:
            flops = self.flops_per_token(blocks / tokens)
            values["mfu"] = mfu(values["tokens_per_s"], flops, peak * self.world.world_size)
        if self.skipped_nonfinite:
            values["skipped_steps"] = self.skipped_nonfinite
        values["compiles"], values["compile_s"] = frames, compile_s
        values.update(self._slow_path_notes(frames=frames, compile_s=compile_s, new_frames=new_frames))
        if self._prefetcher is not None and self.window_steps:
            values["wait_prefetch_s"] = (self._prefetcher.wait_s - self._logged_prefetch_wait_s) / self.window_steps
            self._logged_prefetch_wait_s = self._prefetcher.wait_s
        values.update(self._placement_log_values(self.window_steps))
        if self.selector_objective is not None:
            values.update(self.selector_objective.log_values(self.group, self.group_size))
        self._check_fractions(values)
        eta = self.progress.eta_seconds()
        if eta is not None:
            values["eta_s"] = eta
        self.logger.log(self.step, values)
        if self.is_main:
            self.progress.write(format_console_line(self.step, self.total_steps, values))
        self.rank_report.on_log_step(self.step, self._received_profiles(), last=self.step == self.total_steps)
        self._reset_window_counters()
        return values

    def _slow_path_notes(self, *, frames: int, compile_s: float, new_frames: int) -> dict[str, int]:
        """Say so, in the log, when steps took a slow path: the caching allocator's first retry (a warning, once),
        and frames compiled after the first log step (a recompile, each time). Returns `alloc_retries` on CUDA."""
        values = {}
        retries = allocator_retries(self.device)
        if retries is not None:
            values["alloc_retries"] = retries
            if retries and not self._alloc_retries_warned:
                self._alloc_retries_warned = True
                self.log(
                    f"warning: the CUDA caching allocator retried {retries} allocation(s) on {self.rank_label()}: "
                    "steps this close to the memory limit slow down (each retry frees the cache and synchronises); "
                    "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True or lower data.token_budget"
                )
        if new_frames and self._compile_logged:
            self.log(
                f"note: torch.compile compiled {new_frames} more frame(s) in the steps up to {self.step} "
                f"({frames} in all, {compile_s:.1f} s in all, summed over ranks): a shape or guard not seen before; "
                "after the first steps that is a recompile (data.seq_multiple / data.anchor_multiple bucket the shapes)"
            )
        self._compile_logged = True
        return values

    def _check_fractions(self, values: Mapping[str, MetricValue]) -> None:
        """Warn once per run when an accuracy or recall reads outside [0, 1]: its counters are wrong (a miscompiled
        reduction, metrics.py), and the run's numbers need checking against an eager run before they are trusted."""
        wrong = fractions_out_of_range(values)
        if wrong and not self._fractions_warned:
            self._fractions_warned = True
            shown = ", ".join(f"{name} {value:.4g}" for name, value in list(wrong.items())[:4])
            self.log(
                f"warning: metrics that are fractions read outside [0, 1] at step {self.step} ({shown}): the device "
                "counters behind them are wrong, most likely a miscompiled reduction; compare a short run with "
                "drafter.compile=false loss.compile=false before trusting this run's metrics"
            )

    def _epoch_progress(self) -> float:
        return self._trained.epoch_progress if self._trained is not None else epoch_progress(self.sampler)

    def _trained_data_state(self) -> tuple[dict, DataPosition]:
        """(sampler state, data position) after the last trained step: what a checkpoint must record."""
        if self._trained is not None:
            return self._trained.sampler_state, self._trained.position
        position = position_of(self.sampler, batches_per_step=self.batches_per_step, layout=self.layout())
        return self.sampler.state_dict(), position

    def _periodic_eval(self) -> None:
        from ..eval.runner import quick_tau

        eval_config = self.config.eval
        decode = partial(
            quick_tau,
            self.target,
            self.drafter,
            datasets=eval_config.datasets,
            num_prompts=eval_config.num_prompts,
            max_new_tokens=eval_config.max_new_tokens,
        )
        if self._lookahead is not None:  # the next step's target forward must not share the device with decoding
            self._lookahead.settle()
        with self.profiler.stage("eval"), self.sync.gathered_for_decoding():
            tau = decode()
            # Per set too: a run cut short still says where each set stood at its last evaluation.
            values = {"eval_tau": tau.pooled, **{f"eval_tau/{key}": value for key, value in tau.per_set.items()}}
            if eval_config.argmax_drafts and isinstance(self.drafter, DFlash2Drafter):
                with self.drafter.argmax_drafts():
                    values["eval_tau_argmax"] = decode().pooled
        self.logger.log(self.step, values)
        if self.is_main:  # every rank evaluates (FSDP2's gathers are collective); one prints
            sets = ", ".join(f"{key} {value:.3f}" for key, value in tau.per_set.items())
            sets = f" ({sets})" if sets else ""
            argmax = f" (argmax drafts {values['eval_tau_argmax']:.3f})" if "eval_tau_argmax" in values else ""
            self.progress.write(f"step {self.step}: eval tau {tau.pooled:.3f}{sets}{argmax}")

    # ------------------------------------------------------------------------------------------------ state

    def save_checkpoint(self, *, final: bool = True) -> Path | None:
        """The main rank writes (replicas are identical; FSDP2 shards are gathered onto it first); the others wait
        so nobody races ahead of a half-written checkpoint. A periodic checkpoint (`final` False) that a full disk
        refuses is skipped with a warning and None (`ckpt.save_or_defer`); the last one must be written."""
        path = ckpt.checkpoint_dir(self.run_dir) / f"step-{self.step:08d}"
        self._settle_flags()  # a non-finite last step under `stop` must raise before anything is written
        written = True
        with self.profiler.stage("checkpoint"):
            drafter_state, optimizer_state = self.sync.full_state(self.optimizer)
            if self.is_main:
                saved = ckpt.save_or_defer(
                    lambda: self._write_checkpoint(drafter_state, optimizer_state),
                    self.run_dir,
                    final=final,
                    warn=self.log,
                )
                written = saved is not None
            if self.group_size > 1:
                # Also the barrier: every rank learns whether the checkpoint was written (they must agree on
                # whether a last one is saved at the end, a collective). On the checkpoint group (gloo, host
                # tensor): the others wait here for as long as the write takes, up to `checkpoint.timeout_s`; on
                # the training group they would fail after `placement.timeout_s`.
                agreed = torch.tensor([float(written)])
                dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.checkpoint_group)
                written = agreed.item() > 0
        return path if written else None

    def _write_checkpoint(self, drafter_state: dict[str, torch.Tensor], optimizer_state: dict) -> Path:
        sampler_state, position = self._trained_data_state()
        trainer_state = {
            "step": self.step,
            "optimizer": optimizer_state,
            "scheduler": self.scheduler.state_dict(),
            "sampler": sampler_state,
            "data_position": position.to_dict(),
            "rng": ckpt.rng_state(),
            "skipped_nonfinite": self.skipped_nonfinite,
            "total_steps": self.total_steps,
        }
        return ckpt.save_checkpoint(
            run_dir=self.run_dir,
            step=self.step,
            drafter_state=drafter_state,
            drafter_config_json=json.dumps(dataclasses.asdict(self.model_config), indent=2),
            trainer_state=trainer_state,
            config=self.config,
            keep_last=self.config.checkpoint.keep_last,
        )

    def maybe_resume(self) -> Path | None:
        """`checkpoint.resume`: `auto` = newest checkpoint of the run dir if any, `none` = never, else a path.

        Every rank reads the checkpoint (a shared filesystem, as for the run directory itself), then they meet on the
        checkpoint group: at the paper's scale the reads take minutes and differ between ranks, and the next
        collective on the training group (FSDP2's shard loading, the first gradients) would time out on the slowest
        one after `placement.timeout_s`."""
        resumed = ckpt.load_for_resume(self.run_dir, self.config, self.model_config, log=self.log)
        if resumed is not None:
            self.faults.at_resume()
        if self.group_size > 1:
            dist.barrier(group=self.checkpoint_group)
        if resumed is None:
            return None
        path, drafter_state, state = resumed
        self.sampler.load_state_dict(self._resumed_sampler_state(state, source=str(path)))
        self.sync.load_full_state(self.optimizer, drafter_state, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        ckpt.restore_rng_state(state["rng"])
        self.step = state["step"]
        self.skipped_nonfinite = state["skipped_nonfinite"]
        self.log(f"resumed from {path} at step {self.step}")
        return path

    def _resumed_sampler_state(self, state: dict, *, source: str) -> dict:
        """The sampler state at the checkpoint's data position, for this run's ranks (see train/schedule.py)."""
        if "data_position" not in state:  # written before positions were global: same ranks only
            return state["sampler"]
        position = DataPosition.from_dict(state["data_position"])
        position.check_resumable(batches_per_step=self.batches_per_step, layout=self.layout(), source=source)
        return position.sampler_state(state["sampler"], self.sampler)
