"""Typed run configuration: one dataclass per component, YAML recipes, dotted overrides.

A recipe is a YAML mapping whose top-level keys are the sections of `RunConfig`. Command-line overrides are
`section.key=value` strings parsed as YAML scalars (`optim.lr=3e-4`, `drafter.sliding_layers=[0,2]`). Every
value is checked against the field's annotation when the config is built, and an unknown key or a bad value
fails before any work with the full dotted key in the message. The resolved tree is saved next to every
checkpoint (`config.yaml`) so a run can be reproduced from its directory alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

from .errors import UserError


class ConfigError(UserError, ValueError):
    """A recipe or override names an unknown key or gives a value of the wrong type or range."""


@dataclass
class TargetConfig:
    # A built-in name (`smollm2-135m`), a Hugging Face model directory, or a `.gguf` file.
    name_or_path: str = "smollm2-135m"
    # `auto`: bfloat16 on GPU, float32 on CPU.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = "auto"
    # Where converted GGUF targets are cached; default ~/.cache/dflash-trainer.
    cache_dir: str | None = None
    attn_implementation: str = "sdpa"
    # The decoder's linear layers in FP8 for feature capture in training (bf16 target, GPU with FP8 tensor cores);
    # evaluation and regeneration load the target unquantised.
    fp8: bool = False
    # torch.compile the decoder layers for feature capture in training on CUDA (targets/capture.py): fuses the eager
    # layers' norms, RoPE and activations (Qwen3-8B shape: 268 -> 204 ms per 8,192-token row; on in
    # recipes/bench-qwen3-8b.yaml); a hybrid's linear-attention kernels stay opaque ops in the compiled layers
    # (targets/opaque_kernels.py). Evaluation and regeneration run the layers as loaded. Off by default until
    # measured in the SmolLM2 main job (its step benchmark: target forward 42.0 -> 28.6 ms, BENCHMARKS.md 2026-12-04).
    compile: bool = False
    # Inductor's mode for those layers. `reduce-overhead` replays each layer's kernels as a CUDA graph (recorded per
    # batch shape), for a target bound by the host launching them; `default` launches them one by one. Speed only.
    compile_mode: Literal["default", "reduce-overhead", "max-autotune-no-cudagraphs"] = "default"
    # The decoding engine's delta-rule states of a hybrid target (Qwen3.5/3.6) in regeneration and evaluation:
    # `auto` float32 (the lossless reference); `bfloat16` halves their memory and traffic, most of a decode step at
    # many rows, as serving engines keep them (speculative output then equals plain only up to near-ties;
    # decoding/recurrent.py "State dtype").
    recurrent_state_dtype: Literal["auto", "float32", "bfloat16"] = "auto"

    def validate(self) -> None:
        _require(
            self.compile or self.compile_mode == "default",
            "target.compile_mode",
            f"{self.compile_mode!r} applies to the compiled layers only: set target.compile=true too",
        )


# flex_attention's kernel options (torch's `FlexKernelOptions`) that `drafter.flex_kernel_options` may set: those
# that change how fast the kernels run and never what they compute: tiles (powers of two, at most the flex tile:
# model/attention.py tells flex that lengths in multiples of 128 are whole tiles), warps, pipeline stages, and
# flags that move work between loops or load differently. Left out on purpose: PRESCALE_QK (rounds differently);
# ROWS_GUARANTEED_SAFE, which needs a visible key in the first key chunk each query row visits, not only somewhere
# (the drafter's rows of dropped anchors, of tile-aligned anchors and of a tile's second document start with a
# masked chunk: NaN); BLOCKS_ARE_CONTIGUOUS (false here); the backend switches.
FLEX_TILE_OPTIONS = ("BLOCK_M", "BLOCK_N", "BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2")
FLEX_COUNT_OPTIONS = ("num_warps", "num_stages")
FLEX_FLAG_OPTIONS = ("WRITE_DQ", "USE_TMA")
FLEX_KERNEL_OPTIONS = FLEX_TILE_OPTIONS + FLEX_COUNT_OPTIONS + FLEX_FLAG_OPTIONS


def flex_kernel_option_problem(name: str, value: object, *, tile: int = 128) -> str | None:
    """What is wrong with kernel option `name` = `value` for BlockMasks of `tile` (None: nothing). A name may
    carry one of torch's prefixes `fwd_` or `bwd_`, which apply it to one direction only."""
    base = name.split("_", 1)[1] if name.startswith(("fwd_", "bwd_")) else name
    if base not in FLEX_KERNEL_OPTIONS:
        known = ", ".join(FLEX_KERNEL_OPTIONS)
        return f"unknown or unsupported flex kernel option (known, optionally fwd_/bwd_-prefixed: {known})"
    if base in FLEX_FLAG_OPTIONS:
        return None if isinstance(value, bool) else f"must be true or false, got {value!r}"
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return f"must be a positive integer, got {value!r}"
    if base in FLEX_TILE_OPTIONS and (not 16 <= value <= tile or value & (value - 1)):
        return f"must be a power of two from 16 to the flex tile ({tile}), got {value}"
    return None


@dataclass
class DFlash2Config:
    """DFlash2's additions to the drafter (`drafter.algorithm: dflash2`, model/dflash2/); defaults as in z-lab's
    published DFlash2 checkpoints."""

    # Taps of the grouped dynamic causal convolution around each sublayer.
    conv_kernel_size: int = 2
    # Hidden channels that share one dynamic kernel coefficient (must divide the hidden size).
    conv_group_size: int = 16
    # Rank of the path selector's transition score.
    selector_rank: int = 256
    # Candidates per slot (the unary top-k) the selector chooses among.
    selector_top_k: int = 16
    # The selector's codebooks as trained: `free` [V, rank] tensors (the published layout), or `embedding`: maps of the
    # target's token embedding, [rank, H] each (model/dflash2/selector.py). Exports hold the codebooks either way.
    # On the GPU main job the maps trained a weaker selector than free codebooks (EXPERIMENTS.md #24): free stays.
    selector_codebooks: Literal["free", "embedding"] = "free"

    def validate(self) -> None:
        _require(self.conv_kernel_size >= 1, "drafter.dflash2.conv_kernel_size", "must be >= 1")
        _require(self.conv_group_size >= 1, "drafter.dflash2.conv_group_size", "must be >= 1")
        _require(self.selector_rank >= 1, "drafter.dflash2.selector_rank", "must be >= 1")
        _require(self.selector_top_k >= 1, "drafter.dflash2.selector_top_k", "must be >= 1")


@dataclass
class DrafterConfig:
    # The block drafter: DFlash, or DFlash2 (DFlash plus in-block convolutions and a path selector, `dflash2`).
    algorithm: Literal["dflash", "dflash2"] = "dflash"
    dflash2: DFlash2Config = field(default_factory=DFlash2Config)
    num_layers: int = 5
    # Number of target layers tapped when target_layer_ids is not given (spread evenly, DESIGN §2).
    num_target_features: int = 5
    target_layer_ids: list[int] | None = None
    block_size: int = 16
    # Must be a real vocabulary id that chat text never produces and that is no stop token.
    mask_token_id: int | None = None
    # Defaults to the target's intermediate size.
    intermediate_size: int | None = None
    # Sliding-window layers: indices into the drafter's layers, and their window in tokens.
    sliding_layers: list[int] = field(default_factory=list)
    sliding_window: int | None = None
    # The window applies per query position, as the serving engines apply it (model/attention.py). Whether sliding
    # layers are causal inside the block: SGLang always runs them causal, vLLM follows the export's flag.
    sliding_causal_in_block: bool = False
    # `auto`: flex_attention on CUDA, SDPA with a dense mask elsewhere (flex has no CPU backward).
    attention_backend: Literal["auto", "flex", "sdpa"] = "auto"
    # Start from an exported DFlash checkpoint (directory) instead of random weights.
    init_from: str | None = None
    # Start drafter layer i from a copy of target layer ids[i] (negative ids count from the end, e.g. the last
    # five: [-5, -4, -3, -2, -1]); null: random. Needs the target's sizes (model/target_init.py).
    init_layers_from_target: list[int] | None = None
    # torch.compile each drafter layer on CUDA (fuses norms, RoPE, SwiGLU; ~16% faster steps, less memory).
    compile: bool = True
    # Recompute each drafter layer's activations in the backward (torch.utils.checkpoint) instead of keeping them:
    # a layer then keeps only its [rows, blocks*B, hidden] input, for one more forward of the layers per step. For
    # wide drafters with many anchors (a 27B target's drafter at block 32), where activations outgrow the GPU.
    activation_checkpointing: bool = False
    # torch.compile mode of the drafter layers ("reduce-overhead" adds CUDA graphs, one per shape bucket).
    compile_mode: Literal["default", "max-autotune-no-cudagraphs", "reduce-overhead"] = "default"
    # flex BlockMasks from tile tables computed from the anchors in the data stage ("anchors"), or by
    # evaluating the mask on the whole grid with create_block_mask ("mask_mod", the reference).
    mask_builder: Literal["anchors", "mask_mod"] = "anchors"
    # flex tile (queries x keys) of the drafter's BlockMasks: 128, or 64, which visits about 0.7x the elements on
    # the SmolLM2 recipe's data but runs smaller kernels. Hopper's default flex kernels at head dim 64 are 128 wide
    # (forward and backward), so 64 needs the compiled layers with compile_mode max-autotune-no-cudagraphs, whose
    # kernel choices include 64-wide ones.
    flex_tile: int = 128  # flex.TILE
    # Tiles, warps and stages of the drafter's flex_attention kernels (torch's `FlexKernelOptions`, names as there,
    # `fwd_`/`bwd_` prefixes for one direction: `bwd_BLOCK_M1=32`); empty: Inductor's choice for the GPU (Hopper,
    # head dim 128: forward 128 x 64, backward 64/128/128/64 in 3 stages of 8 warps). Only options that change
    # speed, never results (FLEX_KERNEL_OPTIONS); benchmarks/flex_kernel_bench.py measures candidates (2026-12-01,
    # paper setting: none beat the default).
    flex_kernel_options: dict[str, int | bool] = field(default_factory=dict)
    # Train the drafter's linear layers (q/k/v/o, gate/up/down, fc) with their forward and both backward GEMMs in
    # FP8 (model/fp8.py; GPUs with FP8 tensor cores, or the CPU's reference kernel); fp32 master weights, the
    # optimizer and evaluation unchanged. fp8_scaling: one scale per tensor (e5m2 gradients; fastest),
    # tensorwise_fast (its backward GEMMs accumulating in the FP8 tensor cores' fast accumulator instead of float32;
    # not yet measured in training) or per row (e4m3 everywhere; more accurate, more quantisation passes). Off until
    # measured in training.
    fp8: bool = False
    fp8_scaling: Literal["tensorwise", "tensorwise_fast", "rowwise"] = "tensorwise"

    def validate(self) -> None:
        _require(self.num_layers >= 1, "drafter.num_layers", "must be >= 1")
        _require(self.block_size >= 2, "drafter.block_size", "must be >= 2")
        _require(self.num_target_features >= 1, "drafter.num_target_features", "must be >= 1")
        _require(
            self.dflash2.conv_kernel_size <= self.block_size,
            "drafter.dflash2.conv_kernel_size",
            f"must be <= drafter.block_size ({self.block_size}): the convolution stays inside a block",
        )
        if self.target_layer_ids is not None:
            _require(bool(self.target_layer_ids), "drafter.target_layer_ids", "must name at least one layer")
            _require(min(self.target_layer_ids) >= 0, "drafter.target_layer_ids", "layer ids must be >= 0")
            _require(
                sorted(set(self.target_layer_ids)) == self.target_layer_ids,
                "drafter.target_layer_ids",
                f"{self.target_layer_ids} must be strictly increasing: serving engines collect each tapped layer's "
                "output once, in layer order, and the context projection reads them in this list's order",
            )
        _require(self.mask_token_id is None or self.mask_token_id >= 0, "drafter.mask_token_id", "must be >= 0")
        _require(self.flex_tile in (64, 128), "drafter.flex_tile", f"must be 64 or 128, got {self.flex_tile}")
        _require(
            self.flex_tile == 128 or (self.compile and self.compile_mode == "max-autotune-no-cudagraphs"),
            "drafter.flex_tile",
            "64 needs flex kernels 64 wide, which only autotuning offers: set drafter.compile=true and "
            "drafter.compile_mode=max-autotune-no-cudagraphs",
        )
        for name, value in self.flex_kernel_options.items():
            problem = flex_kernel_option_problem(name, value, tile=self.flex_tile)
            _require(problem is None, f"drafter.flex_kernel_options.{name}", problem or "")
        # A block must fit in a query tile: the tile tables count each block in the tiles of its first and last
        # query only (model/attention.py: tile_tables).
        _require(
            self.block_size <= self.flex_tile,
            "drafter.block_size",
            f"must be <= drafter.flex_tile ({self.flex_tile})",
        )
        _require(
            self.init_layers_from_target is None or len(self.init_layers_from_target) == self.num_layers,
            "drafter.init_layers_from_target",
            "needs one target layer id per drafter layer",
        )
        _require(
            self.init_from is None or self.init_layers_from_target is None,
            "drafter.init_layers_from_target",
            "cannot be combined with drafter.init_from (which already sets every weight)",
        )
        _require(
            self.intermediate_size is None or self.intermediate_size >= 1, "drafter.intermediate_size", "must be >= 1"
        )
        if self.sliding_layers:
            _require(
                self.sliding_window is not None and self.sliding_window > 0,
                "drafter.sliding_window",
                "must be a positive window when drafter.sliding_layers is set",
            )
            for i in self.sliding_layers:
                _require(
                    0 <= i < self.num_layers,
                    "drafter.sliding_layers",
                    f"index {i} outside 0..{self.num_layers - 1}",
                )


@dataclass
class DataConfig:
    # Directory of token shards written by `prepare` (manifest.json + shard files).
    train_shards: str = ""
    token_budget: int = 8192
    max_seq_len: int = 2048
    max_batch_size: int = 64
    # Pack several documents into one row (document ids keep them apart in attention).
    packing: bool = True
    # What to do with samples longer than max_seq_len.
    overlong: Literal["truncate", "skip"] = "truncate"
    max_anchors: int = 512
    # Sort packed rows by their anchor count when cutting batches, so a batch's rows pad to a similar count
    # (data/sampler.py); false sorts them by length only.
    balance_anchors: bool = True
    seed: int = 0
    # Refuse shards whose manifest records another tokenizer (vocabulary fingerprint) than the target's.
    check_tokenizer: bool = True
    # Shape buckets: row length padded to a multiple of seq_multiple, anchors per row to a multiple of
    # anchor_multiple (padding is masked out), so compiled code meets few shapes. 1 = no padding; 0 = auto:
    # 128 and 16 on a GPU (flex attention's tile), no padding on the CPU (nothing compiled there).
    seq_multiple: int = 0
    anchor_multiple: int = 0
    # Optimizer steps of batches prepared ahead on a background thread (0: on the training thread).
    prefetch_steps: int = 2

    def validate(self) -> None:
        _require(self.max_seq_len >= 1, "data.max_seq_len", "must be >= 1")
        _require(
            self.token_budget >= self.max_seq_len,
            "data.token_budget",
            f"must be >= data.max_seq_len ({self.max_seq_len}) so that every row fits in a batch",
        )
        _require(self.max_batch_size >= 1, "data.max_batch_size", "must be >= 1")
        _require(self.max_anchors >= 1, "data.max_anchors", "must be >= 1")
        _require(self.seed >= 0, "data.seed", "must be >= 0")
        _require(self.seq_multiple >= 0, "data.seq_multiple", "must be >= 0")
        _require(self.anchor_multiple >= 0, "data.anchor_multiple", "must be >= 0")
        _require(self.prefetch_steps >= 0, "data.prefetch_steps", "must be >= 0")


@dataclass
class SelectorLossConfig:
    """DFlash2's selector term (model/dflash2/loss.py): L = L_base + alpha * L_sel, alpha scheduled."""

    # alpha after the warmup and ramp.
    weight: float = 1.0
    # Fractions of the run's optimizer steps with alpha 0, then rising linearly to `weight`.
    warmup_ratio: float = 0.0
    ramp_ratio: float = 0.0
    # A label missing from the candidates replaces the weakest one in the term (speculators); false: such slots
    # have no selector term (SpecForge), as the served selector cannot choose them.
    gold_injection: bool = False
    # The term trains the selector's parameters only, not the drafter's hidden states (SpecForge's option).
    stop_gradient: bool = False

    def validate(self) -> None:
        _require(self.weight >= 0, "loss.selector.weight", "must be >= 0")
        _require(0.0 <= self.warmup_ratio <= 1.0, "loss.selector.warmup_ratio", "must be in [0, 1]")
        _require(0.0 <= self.ramp_ratio <= 1.0, "loss.selector.ramp_ratio", "must be in [0, 1]")


@dataclass
class LossConfig:
    # Slot-weight decay; null picks the paper's value for the block size (7 for 16, 5 for 10, 4 for 8).
    gamma: float | None = None
    weighting: Literal["exp", "dpace"] = "exp"
    dpace_alpha: float = 0.5
    label_source: Literal["data", "target_argmax", "soft"] = "data"
    # Blocks per loss chunk: bounds the [chunk * block, vocab] logits that exist at once.
    chunk_blocks: int = 64
    # torch.compile the per-chunk LM head + loss on CUDA (fuses the softmax, CE, argmax and gradient passes), and
    # DFlash2's selector term per chunk (one graph instead of ~80 small launches and an autograd call).
    compile: bool = True
    # The drafter slots' two LM-head GEMMs (logits, and their gradient times the head) in FP8, e4m3 with row-wise
    # scales (model/fp8_head.py); a GPU with FP8 tensor cores. Off: the logits' precision matters for soft labels;
    # measure tau against bf16 first.
    fp8_head: bool = False
    # DFlash2's selector term (used with drafter.algorithm dflash2 only).
    selector: SelectorLossConfig = field(default_factory=SelectorLossConfig)

    def validate(self) -> None:
        _require(self.gamma is None or self.gamma > 0, "loss.gamma", "must be > 0")
        _require(0.0 <= self.dpace_alpha <= 1.0, "loss.dpace_alpha", "must be in [0, 1]")
        _require(self.chunk_blocks >= 1, "loss.chunk_blocks", "must be >= 1")


@dataclass
class NoiseConfig:
    type: Literal["none", "uniform", "gaussian"] = "none"
    start: float = 0.0
    end: float = 0.0

    def validate(self) -> None:
        _require(self.start >= 0 and self.end >= 0, "noise", "start and end must be >= 0")


@dataclass
class OptimConfig:
    lr: float = 6e-4
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    warmup_ratio: float = 0.04
    min_lr_ratio: float = 0.0
    # After the warmup: `cosine` to min_lr_ratio, or `wsd` (warmup-stable-decay: the peak held, then a linear decay
    # to min_lr_ratio over the last `decay_ratio` of the steps; train/optim.py).
    schedule: Literal["cosine", "wsd"] = "cosine"
    decay_ratio: float = 0.2
    # Clip the gradient's global norm to this; 0 or null: no clipping (the norm is still measured and logged).
    grad_clip: float | None = 1.0
    grad_accum: int = 1

    def validate(self) -> None:
        _require(self.lr > 0, "optim.lr", "must be > 0")
        _require(self.weight_decay >= 0, "optim.weight_decay", "must be >= 0")
        _require(self.eps > 0, "optim.eps", "must be > 0")
        _require(self.grad_clip is None or self.grad_clip >= 0, "optim.grad_clip", "must be >= 0 (0 or null: off)")
        _require(0.0 <= self.min_lr_ratio <= 1.0, "optim.min_lr_ratio", "must be in [0, 1]")
        _require(all(0.0 <= beta < 1.0 for beta in self.betas), "optim.betas", "must be in [0, 1)")
        _require(0.0 <= self.warmup_ratio < 1.0, "optim.warmup_ratio", "must be in [0, 1)")
        _require(0.0 < self.decay_ratio <= 1.0, "optim.decay_ratio", "must be in (0, 1]")
        _require(self.grad_accum >= 1, "optim.grad_accum", "must be >= 1")
        _require(len(self.betas) == 2, "optim.betas", "must have two values")


@dataclass
class TrainConfig:
    epochs: int = 6
    # Stop after this many optimizer steps (null: run all epochs).
    max_steps: int | None = None
    seed: int = 0
    # `auto`: bf16 autocast on GPU (fp32 master weights), fp32 on CPU.
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    # On NaN/inf loss: stop with the step and sample ids, or skip the step and count it.
    on_nonfinite: Literal["stop", "skip"] = "stop"
    # Read each step's finiteness and stop flags on the host right away (one sync per step) instead of one
    # step later, while the next step runs; the skip itself happens on the device either way.
    sync_every_step: bool = False
    # Seconds without an optimizer step (or a periodic evaluation, or a checkpoint) after which every thread's stack
    # is printed to stderr, and again while nothing moves; the run goes on (train/stall.py). 0: never; else >= 1.
    stall_report_s: float = 900.0
    # Run the target's forward for the next optimizer step on a side CUDA stream while this step trains the drafter
    # (train/lookahead.py): the same values, the target's GEMMs filling the drafter step's idle tensor cores; one
    # step's target outputs more in memory. Colocated placement only (a target rank already runs ahead); on the CPU
    # the same order on one stream (no gain).
    target_lookahead: bool = False

    def validate(self) -> None:
        _require(self.epochs >= 1, "train.epochs", "must be >= 1")
        _require(
            self.stall_report_s == 0 or self.stall_report_s >= 1, "train.stall_report_s", "must be 0 (off) or >= 1"
        )
        _require(self.max_steps is None or self.max_steps >= 1, "train.max_steps", "must be >= 1")
        _require(self.seed >= 0, "train.seed", "must be >= 0")


@dataclass
class CheckpointConfig:
    every_steps: int = 500
    keep_last: int = 3
    # `auto`: resume from the newest intact checkpoint in the run directory if one exists; `none`; or a path.
    resume: str = "auto"
    # Resume although the checkpoint names another target.name_or_path (the same model moved elsewhere).
    allow_target_change: bool = False
    # Seconds the other ranks wait for the main rank to write a checkpoint before failing the job. Writing takes
    # longer than a step: the 27B seed job's drafter state is 27 GiB, minutes on network storage, past
    # placement.timeout_s (the bound of every other wait between ranks).
    timeout_s: float = 1800.0

    def validate(self) -> None:
        _require(self.every_steps >= 1, "checkpoint.every_steps", "must be >= 1")
        _require(self.keep_last >= 1, "checkpoint.keep_last", "must be >= 1")
        _require(self.timeout_s > 0, "checkpoint.timeout_s", "must be > 0")


@dataclass
class WandbConfig:
    # Weights & Biases project to mirror every metrics record to (empty: off; `pip install dflash-trainer[wandb]`).
    project: str = ""
    # Run name (empty: the run directory's name) and team or user (empty: the account's default).
    name: str = ""
    entity: str = ""
    # offline: written under run_dir/wandb without network (`wandb sync` uploads it later); online: streamed.
    mode: Literal["offline", "online"] = "offline"


@dataclass
class MetricsConfig:
    log_every: int = 10
    tensorboard: bool = True
    wandb: WandbConfig = field(default_factory=WandbConfig)
    progress_bar: bool = True
    # Seconds between per-stage profiler reports; 0 = off (DFLASH_PROFILE_INTERVAL also switches it on).
    profile_interval: float = 0.0
    plot_at_end: bool = True

    def validate(self) -> None:
        _require(self.log_every >= 1, "metrics.log_every", "must be >= 1")
        _require(self.profile_interval >= 0, "metrics.profile_interval", "must be >= 0 (0 = off)")


@dataclass
class EvalConfig:
    # Speculative-decoding evaluation every N optimizer steps during training (0 = off).
    every_steps: int = 0
    # Prompt sets by name (gsm8k, mtbench, humaneval) or paths to prompt files.
    datasets: list[str] = field(default_factory=lambda: ["gsm8k"])
    num_prompts: int = 8
    max_new_tokens: int = 64
    temperature: float = 0.0
    # Run an evaluation after training ends (used by the main command).
    at_end: bool = False
    # Prompts decoded together when the end evaluation times decoding; null: at batch 1 (latency) and all at once.
    batch_size: int | None = None
    # Compile the exported drafter's norms and MLPs (DFlash2: also its convolutions and walk) for the end
    # evaluation: fewer kernels per decoding step (`DFlashDrafter.compile_for_decoding`); null: on a GPU (measured
    # +19-20 % speed-up at batch 1 on an H200, equal tau), not on the CPU (where compiling costs more than it saves).
    compile_drafter: bool | None = None
    # DFlash2: every periodic evaluation decodes its prompts a second time drafting each slot's argmax (the selector
    # unused), logged as `eval_tau_argmax` beside `eval_tau`, and the end evaluation too (per set, into
    # run_dir/eval-argmax): what the walk adds on held-out prompts (on the training blocks: `selector_tau_prefix`
    # against `tau_prefix`). Doubles the evaluations' time.
    argmax_drafts: bool = False

    def validate(self) -> None:
        _require(self.every_steps >= 0, "eval.every_steps", "must be >= 0 (0 = off)")
        _require(self.num_prompts >= 1, "eval.num_prompts", "must be >= 1")
        _require(self.max_new_tokens >= 1, "eval.max_new_tokens", "must be >= 1")
        _require(self.temperature >= 0, "eval.temperature", "must be >= 0")
        _require(bool(self.datasets), "eval.datasets", "must name at least one prompt set (e.g. [gsm8k])")
        _require(self.batch_size is None or self.batch_size >= 1, "eval.batch_size", "must be >= 1 (or null)")


@dataclass
class EndpointConfig:
    """An OpenAI-compatible server (vLLM, SGLang) serving the target, for `prepare.engine: openai`."""

    # The API root, e.g. http://localhost:8000/v1 (`/chat/completions` is appended).
    base_url: str = ""
    # The served model's name; empty: the one model the server lists at `/models`.
    model: str = ""
    # Requests in flight at once (the server batches them).
    concurrency: int = 64
    # Further attempts of a request after a connection error, a timeout or HTTP 408/429/5xx.
    retries: int = 5
    # Seconds before the first retry, doubled for each further one (at most 60).
    backoff_s: float = 1.0
    # Seconds a request may wait for its answer before it counts as failed.
    timeout_s: float = 600.0

    def validate(self) -> None:
        _require(
            not self.base_url or self.base_url.startswith(("http://", "https://")),
            "prepare.endpoint.base_url",
            f"must start with http:// or https://, got {self.base_url!r}",
        )
        _require(self.concurrency >= 1, "prepare.endpoint.concurrency", "must be >= 1")
        _require(self.retries >= 0, "prepare.endpoint.retries", "must be >= 0")
        _require(self.backoff_s >= 0, "prepare.endpoint.backoff_s", "must be >= 0")
        _require(self.timeout_s > 0, "prepare.endpoint.timeout_s", "must be > 0")


@dataclass
class PrepareConfig:
    # Prompt source for the recipe's automatic data step: a prompt-set name or a chat JSONL path.
    source: str = ""
    # Replace assistant turns with the target's own greedy responses before tokenising.
    regenerate: bool = False
    max_new_tokens: int = 256
    regenerate_batch_size: int = 16
    limit: int | None = None
    keep_reasoning: bool = False
    # Who answers the prompts: `auto` (vLLM in-process when installed, else our decoding engine), `engine`, `hf`
    # (transformers generate), `vllm`, or `openai` (a server at `endpoint.base_url`; the run's GPUs stay free).
    engine: Literal["auto", "engine", "hf", "vllm", "openai"] = "auto"
    endpoint: EndpointConfig = field(default_factory=EndpointConfig)
    # Category shares of a `mix-general` source (empty: its default, {dialogue: 0.1, chat: 0.35, code: 0.25,
    # math: 0.25, puzzle: 0.05}): every prefix of the mixture holds the categories in these proportions.
    shares: dict[str, float] = field(default_factory=dict)

    def validate(self) -> None:
        _require(self.max_new_tokens >= 1, "prepare.max_new_tokens", "must be >= 1")
        if self.shares:
            from .data.sources.categories import shares_problem

            problem = shares_problem(self.shares)
            _require(problem is None, "prepare.shares", problem or "")
            _require(
                self.source.partition(":")[0] == "mix-general",
                "prepare.shares",
                f"category shares apply to a mix-general source, not {self.source!r}",
            )
        _require(self.regenerate_batch_size >= 1, "prepare.regenerate_batch_size", "must be >= 1")
        _require(self.limit is None or self.limit >= 1, "prepare.limit", "must be >= 1")
        _require(
            self.engine != "openai" or bool(self.endpoint.base_url),
            "prepare.endpoint.base_url",
            "must name the server for prepare.engine=openai (e.g. http://localhost:8000/v1)",
        )

    def check_source_holds_no_evaluation_prompts(self) -> None:
        """Refuse a training source that holds held-out evaluation prompts. Checked where a recipe is loaded to
        train (`load_config`), not in `validate`: the saved config of a run from before this rule (e.g.
        `prepare.source: gsm8k`) must still rebuild for `eval` and `export`."""
        problem = _held_out_source_problem(self.source)
        _require(problem is None, "prepare.source", problem or "")


# The built-in prompt sets that evaluation reads (data/prompts.py): GSM8K's last 200 questions (its `test` split, and
# part of a bare `gsm8k`, which is split `all`), and MT-Bench and HumanEval whole (they have no training part).
_EVALUATION_ONLY_SETS = ("mtbench", "humaneval")


def _held_out_source_problem(source: str) -> str | None:
    """Why a training prompt source would train on held-out evaluation prompts (None: it does not). A path that
    exists is a file of the user's own."""
    if not source or Path(source).exists():
        return None
    name, _, split = source.partition(":")
    if name in _EVALUATION_ONLY_SETS:
        return f"{source!r} is an evaluation set: training on it makes its held-out tau meaningless"
    if name == "gsm8k" and split != "train":
        return (
            f"{source!r} holds the 200 held-out GSM8K test questions that evaluation reads; train on gsm8k:train "
            "(the first 1,119)"
        )
    return None


@dataclass
class PlacementConfig:
    """How ranks share the work (DESIGN §4). Empty rank lists = colocated: every rank runs target and drafter."""

    # Disaggregated: global ranks that run only the target, and ranks that run only the drafter.
    target_ranks: list[int] = field(default_factory=list)
    drafter_ranks: list[int] = field(default_factory=list)
    # Feature batches in flight per drafter rank (sent, not yet consumed).
    queue_depth: int = 4
    # Send the K tapped layers as K tensors and concatenate on the drafter side.
    split_features: bool = False
    # Gradient sync of drafter replicas: DDP, or FSDP2 (sharded parameters) for large drafters.
    sharding: Literal["ddp", "fsdp2"] = "ddp"
    # Seconds before a blocked collective / send / receive fails the job instead of hanging.
    timeout_s: float = 120.0

    @property
    def disaggregated(self) -> bool:
        return bool(self.target_ranks or self.drafter_ranks)

    def validate(self) -> None:
        _require(self.queue_depth >= 1, "placement.queue_depth", "must be >= 1")
        _require(self.timeout_s > 0, "placement.timeout_s", "must be > 0")
        if self.disaggregated:
            _require(
                bool(self.target_ranks) and bool(self.drafter_ranks),
                "placement",
                "disaggregated placement needs both target_ranks and drafter_ranks",
            )
            overlap = set(self.target_ranks) & set(self.drafter_ranks)
            _require(not overlap, "placement.drafter_ranks", f"ranks {sorted(overlap)} are also target ranks")


@dataclass
class RunConfig:
    # Where checkpoints, metrics and plots go.
    run_dir: str = "runs/default"
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    noise: NoiseConfig = field(default_factory=NoiseConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)

    def validate(self) -> None:
        _require(
            bool(self.run_dir.strip()),
            "run_dir",
            "must name a directory (empty, the run would write its checkpoints into the current one)",
        )
        _require(
            not self.eval.argmax_drafts or self.drafter.algorithm == "dflash2",
            "eval.argmax_drafts",
            "needs drafter.algorithm: dflash2 (a DFlash drafter drafts each slot's argmax already)",
        )
        _require(
            not self.train.target_lookahead or self.target.compile_mode != "reduce-overhead",
            "train.target_lookahead",
            "not with target.compile_mode: reduce-overhead (CUDA graph trees on a second stream: not supported)",
        )
        _require(
            not self.train.target_lookahead or not self.placement.disaggregated,
            "train.target_lookahead",
            "colocated placement only: with target ranks the target already runs ahead of the drafters",
        )
        drafter = self.drafter
        embedding_codebooks = drafter.algorithm == "dflash2" and drafter.dflash2.selector_codebooks == "embedding"
        _require(
            not embedding_codebooks or self.placement.sharding != "fsdp2",
            "drafter.dflash2.selector_codebooks",
            "'embedding' is not supported with placement.sharding: fsdp2 (its codebooks are refreshed from the whole "
            "maps when a state dict is taken); use ddp or free codebooks",
        )
        _require(
            not embedding_codebooks or not drafter.init_from,
            "drafter.dflash2.selector_codebooks",
            "'embedding' cannot start from drafter.init_from (an export holds codebooks, not their maps)",
        )


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


# ----------------------------------------------------------------------------------------------------------
# Building a dataclass tree from plain data, with a type check per field.


def _check_value(value: Any, annotation: Any, key: str) -> Any:
    """Return `value` converted to `annotation` (int -> float only), or raise ConfigError naming `key`."""
    origin = get_origin(annotation)
    if annotation is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        options = get_args(annotation)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _check_value(value, option, key)
            except ConfigError as error:
                errors.append(str(error))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: {value!r} matches none of {annotation}")
    if origin is Literal:
        if value not in get_args(annotation):
            raise ConfigError(f"{key}: {value!r} is not one of {list(get_args(annotation))}")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__} {value!r}")
        key_type, value_type = get_args(annotation)
        return {
            _check_value(k, key_type, f"{key} key {k!r}"): _check_value(v, value_type, f"{key}.{k}")
            for k, v in value.items()
        }
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        (item_type,) = get_args(annotation)
        return [_check_value(v, item_type, f"{key}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(annotation):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__}")
        return _build(annotation, value, key)
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            raise ConfigError(f"{key}: {value} is too large for a float") from None
    if annotation is float and isinstance(value, str):
        # YAML 1.1 reads `3e-4` (no dot) as a string; accept what Python reads as a number.
        with contextlib.suppress(ValueError):
            value = float(value)
    if annotation in (int, float) and isinstance(value, bool):
        raise ConfigError(f"{key}: expected {annotation.__name__}, got bool {value!r}")
    if not isinstance(value, annotation):
        raise ConfigError(f"{key}: expected {annotation.__name__}, got {type(value).__name__} {value!r}")
    if annotation is float and not math.isfinite(value):
        # No setting means anything at inf or nan (YAML's `.inf`, `.nan`); `optim.lr=inf` trained NaN weights.
        raise ConfigError(f"{key}: must be a finite number, got {value}")
    return value


# Keys of earlier versions that no longer set anything, and why: a recipe or a run's saved config.yaml (read back by
# `eval` and resume) that still has one loads, with a warning, instead of failing as an unknown key.
RETIRED_KEYS = {
    "drafter.accept_sliding_window_mismatch": "sliding-window layers now train with the window per query position, "
    "as vLLM and SGLang apply it, and export without it (runs saved with it trained them with the window anchored "
    "at the block start)",
}


def _build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        where = f"{prefix}.{key}" if prefix else key
        if key in names:
            kwargs[key] = _check_value(value, hints[key], where)
        elif where in RETIRED_KEYS:
            warnings.warn(f"{where}: ignored: {RETIRED_KEYS[where]}", UserWarning, stacklevel=2)
        else:
            raise ConfigError(f"{where}: unknown key (known: {', '.join(sorted(names))})")
    built = cls(**kwargs)
    if hasattr(built, "validate"):
        built.validate()
    return built


def _parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key.path=value")
    key, raw = text.split("=", 1)
    if not key.strip():
        raise ConfigError(f"override {text!r}: no key before '='")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except (yaml.YAMLError, RecursionError) as error:
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ConfigError(f"{key}: cannot parse value {raw!r} as YAML: {problem}") from None
    return key.strip().split("."), value


def _set_dotted(tree: dict[str, Any], path: list[str], value: Any) -> None:
    node = tree
    for i, part in enumerate(path[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(path[: i + 1])}: is a value, not a section")
        node = child
    node[path[-1]] = value


def load_config(recipe: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Build a RunConfig from a YAML recipe (or the defaults) plus dotted overrides, to run it (a saved config is
    rebuilt with `config_from_dict`, which skips the rules for new runs)."""
    tree: dict[str, Any] = {}
    if recipe is not None:
        tree = _read_recipe_with_bases(Path(recipe))
    for text in overrides:
        path_parts, value = _parse_override(text)
        if path_parts == ["base"]:
            raise ConfigError("base: a recipe file names its base recipe; on the command line name the recipe itself")
        _set_dotted(tree, path_parts, value)
    config = _build(RunConfig, tree)
    config.prepare.check_source_holds_no_evaluation_prompts()
    return config


def _read_recipe_with_bases(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The recipe's mapping with its `base:` applied: `base: NAME` (a file beside it, `.yaml` optional) is read first
    and this recipe's keys are merged over it, section by section, so a variant names only what it changes (a run
    config is then the same as if the base's keys had been copied in; the saved config holds no `base`). Bases may
    have bases; a cycle is a ConfigError."""
    path = path.resolve()
    if path in seen:
        chain = " -> ".join(p.name for p in (*seen, path))
        raise ConfigError(f"recipe {path}: its bases form a cycle ({chain})")
    tree = _read_recipe(path)
    if "base" not in tree:
        return tree
    base = tree.pop("base")
    if not isinstance(base, str) or not base:
        raise ConfigError(f"recipe {path}: base must be the name of another recipe, got {base!r}")
    base_path = path.parent / (base if base.endswith((".yaml", ".yml")) else f"{base}.yaml")
    if not base_path.is_file():
        raise ConfigError(f"recipe {path}: its base {base!r} is not a file ({base_path})")
    return _merged(_read_recipe_with_bases(base_path, (*seen, path)), tree)


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` on top of `base`: mappings merge key by key, anything else (values, lists) replaces."""
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merged(merged[key], value)
        else:
            merged[key] = value
    return merged


def _read_recipe(path: Path) -> dict[str, Any]:
    """The recipe's YAML mapping; any problem reading or parsing it is a ConfigError naming the place."""
    if not path.is_file():
        raise ConfigError(f"recipe {path}: file not found")
    try:
        loaded = yaml.safe_load(path.read_bytes())
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "somewhere"
        problem = error.problem or error.context or "invalid YAML"
        raise ConfigError(f"recipe {path}: YAML syntax error at {where}: {problem}") from None
    except (yaml.YAMLError, RecursionError) as error:
        raise ConfigError(f"recipe {path}: not valid YAML: {str(error).splitlines()[0]}") from None
    except OSError as error:
        raise ConfigError(f"recipe {path}: cannot read: {error.strerror or error}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"recipe {path}: top level must be a mapping of sections, got {type(loaded).__name__}")
    return loaded


def config_to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)


def config_from_dict(data: dict[str, Any]) -> RunConfig:
    return _build(RunConfig, data)


def save_config(config: RunConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False))


def describe_keys(cls: type = RunConfig, prefix: str = "") -> list[tuple[str, str, Any]]:
    """(dotted key, type, default) for every leaf field, for `--help`."""
    rows = []
    hints = typing.get_type_hints(cls)
    defaults = cls()
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        value = getattr(defaults, f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            rows.extend(describe_keys(hints[f.name], prefix=f"{key}."))
        else:
            hint = hints[f.name]
            type_name = hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")
            rows.append((key, type_name, value))
    return rows
