"""What the subcommands run: the main job (data if missing -> train -> evaluate -> plot) and the tools around it.

The README's main command is `dflash-trainer train`: with the default recipe it regenerates the GSM8K training
prompts with the target and tokenises them (both cached on disk, skipped on later runs), trains, evaluates tau on
held-out prompts, exports the drafter and draws the curves.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from ..config import ConfigError, EndpointConfig, RunConfig, config_from_dict
from ..data.prepare import prepare
from ..data.prompts import check_prompt_set_name, load_prompt_set, split_set_name
from ..data.shards import check_shards_tokenizer
from ..decoding.recurrent import STATE_DTYPES
from ..distributed.world import World, init_world, shutdown_world
from ..durable_io import check_safetensors_file
from ..errors import UserError, refuse_file_as_directory
from ..launch import StopFlag
from ..model.dflash2 import DFlash2Drafter
from ..targets.loader import LoadedTarget, TargetLoadError, load_target, quantize_target_to_fp8
from . import checkpoint as ckpt
from .data_setup import regenerate_for_training
from .run_lock import hold_run_dir
from .trainer import Trainer, TrainSummary, drafter_model_config


def parse_prompt_source(source: str) -> tuple[str, str]:
    """`gsm8k:train` -> ("gsm8k", "train"); a bare name or path uses split `all`."""
    return split_set_name(source, "all")


def write_prompt_chats(
    source: str, out_file: Path, *, limit: int | None, shares: dict[str, float] | None = None
) -> Path:
    """Prompt set -> chat JSONL whose assistant turn is the set's reference answer (no regeneration)."""
    name, split = parse_prompt_source(source)
    prompts = load_prompt_set(name, split=split, limit=limit, shares=shares or None)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_file.with_suffix(".tmp")
    with tmp.open("w") as f:
        for prompt in prompts:
            if prompt.reference is None:
                raise ConfigError(
                    f"prompt set {source}: prompt {prompt.id} has no reference answer; set prepare.regenerate=true"
                )
            messages = [*prompt.messages, {"role": "assistant", "content": prompt.reference}]
            f.write(json.dumps({"id": prompt.id, "messages": messages}) + "\n")
    tmp.rename(out_file)
    return out_file


def regeneration_records(source: str, limit: int | None, shares: dict[str, float] | None = None) -> str | list[dict]:
    """A chat JSONL path as is, or the prompts of a prompt set (`gsm8k:train`) as records to answer. `shares`:
    category shares of a `mix-general` source."""
    if Path(source).exists():
        return source
    name, split = parse_prompt_source(source)
    prompts = load_prompt_set(name, split=split, limit=limit, shares=shares or None)
    return [{"id": p.id, "messages": list(p.messages)} for p in prompts]


def regenerated_chats(
    source: str, target: LoadedTarget, out_dir: Path, config: RunConfig, world: World | None = None
) -> list[Path]:
    summary = regenerate_for_training(
        regeneration_records(source, config.prepare.limit, config.prepare.shares), target, out_dir, config, world
    )
    if summary is not None and (world is None or world.is_main):
        print(summary.format())
    return sorted(out_dir.glob("regen-*.jsonl"))


def ensure_train_data(
    config: RunConfig, target: LoadedTarget, log: Callable[[str], object] = print, world: World | None = None
) -> Path:
    """Build `data.train_shards` from `prepare.source` when it does not exist yet (cached afterwards). Called by
    every rank of `world` (regeneration shares the records among them; the first rank tokenises, the others wait),
    or by one process alone when `world` is None."""
    shards = Path(config.data.train_shards)
    is_main = world is None or world.is_main
    if (shards / "manifest.json").is_file():
        if config.data.check_tokenizer and is_main:
            check_shards_tokenizer(shards, target.tokenizer, target.name)
        return shards
    source = config.prepare.source
    if not source:
        raise ConfigError(
            f"data.train_shards={shards}: no shards there and no prepare.source to build them from "
            "(run `dflash-trainer prepare` or set prepare.source)"
        )
    if config.prepare.regenerate:
        if is_main:
            log(f"regenerating responses for {source} with the target (cached in {shards}-chat)")
        inputs = regenerated_chats(source, target, Path(f"{shards}-chat"), config, world)
    if not is_main:
        wait_for_shards(shards)
        return shards
    if not config.prepare.regenerate:
        inputs = [
            write_prompt_chats(
                source, Path(f"{shards}-chat") / "chats.jsonl", limit=config.prepare.limit, shares=config.prepare.shares
            )
        ]
    summary = prepare(
        inputs,
        target.tokenizer,
        target.name,
        shards,
        keep_reasoning=config.prepare.keep_reasoning,
        max_seq_len=config.data.max_seq_len,
        on_error="skip",
    )
    log(summary.format())
    return shards


def validate_drafter_settings(config: RunConfig, target: LoadedTarget) -> None:
    """The drafter's settings against the loaded target (mask token, taps, block size, an `init_from` drafter),
    right after the target loads and before any data work: a bad value must not surface after regeneration."""
    try:
        drafter_model_config(config, target)
    except UserError:
        raise
    except ValueError as error:
        raise ConfigError(f"drafter: {error}") from error
    if config.drafter.init_from:
        from ..export import check_drafter_fits_target, read_drafter_config

        initial = read_drafter_config(config.drafter.init_from)
        # The weights load only when training starts, after the data work: a damaged file must be named now.
        for weights in sorted(Path(config.drafter.init_from).glob("*.safetensors")):
            check_safetensors_file(weights, what="a weight file of drafter.init_from")
        check_drafter_fits_target(
            initial, target.config, drafter_source=config.drafter.init_from, target_name=target.name
        )


def prepare_for_training(config: RunConfig, target: LoadedTarget) -> Path:
    """What the rank holding the target does before training: check the drafter settings, then the data."""
    validate_drafter_settings(config, target)
    return ensure_train_data(config, target)


def load_config_target(config: RunConfig, device: str | None = None) -> LoadedTarget:
    return load_target(
        config.target.name_or_path,
        dtype=config.target.dtype,
        device=device or config.target.device,
        cache_dir=config.target.cache_dir,
        attn_implementation=config.target.attn_implementation,
    )


def wait_for_shards(shards: Path, poll_s: float = 2.0) -> None:
    """Non-main ranks wait while rank 0 builds the data (minutes: longer than any collective timeout).
    If rank 0 dies, torchrun ends this process."""
    while not (shards / "manifest.json").is_file():
        time.sleep(poll_s)


def startup_checks(config: RunConfig) -> None:
    """What every rank of a run checks before anything loads: the run directory (writable, room for a
    checkpoint), `checkpoint.resume` and the checkpoint's settings, and the evaluation sets (a misspelt or empty
    one must not surface after training). `train --nproc` runs them before torchrun starts, with
    `check_not_in_use` (in a run, rank 0 taking the run directory is that check)."""
    ckpt.preflight(config)
    if config.metrics.wandb.project:  # the optional sink's package, before any work
        from .metrics import import_wandb

        import_wandb(config.metrics.wandb.project)
    if config.eval.at_end or config.eval.every_steps:
        for name in config.eval.datasets:
            check_prompt_set_name(name, "test")


def run_training(
    config: RunConfig,
    *,
    should_stop: Callable[[], bool] = lambda: False,
    world: World | None = None,
    command: str | None = None,
) -> TrainSummary:
    """Train (colocated or disaggregated, per `placement`), then export, evaluate and plot on the main rank.
    Joins and leaves the process group itself unless given the `world` (launch.py gives it). The job holds the
    run directory throughout (train/run_lock.py). `command`: the command line that started the run, for the
    export's model card."""
    startup_checks(config)
    if world is not None:
        with hold_run_dir(config.run_dir, world):
            return _run_training(config, world, should_stop, command)
    world = init_world(config.target.device, timeout_s=config.placement.timeout_s)
    try:
        with hold_run_dir(config.run_dir, world):
            return _run_training(config, world, should_stop, command)
    finally:
        shutdown_world(world)


def _run_training(
    config: RunConfig, world: World, should_stop: Callable[[], bool], command: str | None
) -> TrainSummary:
    target = None
    if config.placement.disaggregated:
        from .disaggregated import run_disaggregated

        summary, trainer = run_disaggregated(
            config,
            world,
            should_stop=should_stop,
            prepare_data=prepare_for_training,
            wait_for_data=lambda: wait_for_shards(Path(config.data.train_shards)),
        )
        if trainer is None or not trainer.is_main:
            return summary
    else:
        target = load_config_target(config, device=str(world.device))
        validate_drafter_settings(config, target)
        ensure_train_data(config, target, world=world)  # every rank regenerates a share; the first tokenises
        if config.target.fp8:  # after any regeneration: the data comes from the real target
            quantize_target_to_fp8(target)
        trainer = Trainer(config, should_stop=should_stop, target=target, world=world)
        summary = trainer.fit()
        if not world.is_main:
            return summary
    run_dir = Path(config.run_dir)
    if summary.interrupted:
        print(f"stopped at step {summary.steps}; resume with the same command. checkpoint: {summary.last_checkpoint}")
        return summary
    export_dir = run_dir / "export"
    from ..export import export_drafter, refresh_model_card
    from ..provenance import TargetRecord, run_source, training_record

    drafter = trainer.exportable_drafter()
    export_drafter(
        drafter,
        export_dir,
        source=run_source(run_dir, config),
        target=TargetRecord.of(trainer.target, config.target.name_or_path),
        training=training_record(config, command=command, ranks=world.world_size, steps=summary.steps),
        # The run's own directory (possibly copied from another machine, under another path): always its export.
        overwrite=True,
    )
    if isinstance(should_stop, StopFlag):
        # Nothing polls the flag after the last step: a signal from here on stops the process at once rather than
        # announcing a checkpoint and letting the evaluation run on for minutes past a scheduler's grace period.
        evaluate_later = f"evaluate with `dflash-trainer eval --drafter {export_dir}`"
        should_stop.training_done(evaluate_later)
        if should_stop():  # a signal after the last step's poll: in the final checkpoint's writing or the export
            print(
                f"stopped after training; checkpoint {summary.last_checkpoint}, export {export_dir}; {evaluate_later}"
            )
            return summary
    if config.eval.at_end:
        from ..eval.runner import evaluate
        from ..export import import_drafter

        # Disaggregated drafter ranks hold no decoder layers, and an FP8 target is not the real one: load the whole
        # target, as it is, for the evaluation.
        if target is None or config.target.fp8:
            target = load_config_target(config, device=str(world.device))
        # Evaluate what users serve: the exported file, read back in the target's dtype.
        evaluate_export = partial(
            evaluate,
            target,
            datasets=config.eval.datasets,
            num_prompts=config.eval.num_prompts,
            max_new_tokens=config.eval.max_new_tokens,
            temperature=config.eval.temperature,
            batch_size=config.eval.batch_size,
            recurrent_state_dtype=STATE_DTYPES[config.target.recurrent_state_dtype],
            compile_drafter=config.eval.compile_drafter,
        )
        exported = import_drafter(export_dir, device=target.device, dtype=target.dtype)
        report = evaluate_export(exported, out_dir=run_dir / "eval")
        print(report.format_table())
        refresh_model_card(export_dir, report.to_dict())  # the card shows the held-out tau of these weights
        if config.eval.argmax_drafts:  # DFlash2 (the config refuses it otherwise): what the walk adds, per set
            # A fresh copy: the one above is compiled for decoding, and compiling its walk again would wrap it twice.
            again = import_drafter(export_dir, device=target.device, dtype=target.dtype)
            with again.argmax_drafts():
                print(evaluate_export(again, out_dir=run_dir / "eval-argmax").format_table())
    plots = []
    if config.metrics.plot_at_end:
        from .plot import plot_run

        plots = plot_run(run_dir)
    print(f"checkpoint: {summary.last_checkpoint}")
    print(f"exported drafter (vLLM / SGLang format): {export_dir}")
    print(f"metrics: {run_dir / 'metrics.jsonl'} (TensorBoard: {run_dir / 'tb'})")
    if plots:
        print(f"plots: {', '.join(str(p) for p in plots)}")
    if config.eval.at_end:
        print(f"evaluation: {run_dir / 'eval'}")
    return summary


# ---------------------------------------------------------------------------------------------- subcommands


def prepare_command(
    *,
    inputs: list[str],
    target: str,
    out_dir: str,
    keep_reasoning: bool,
    max_seq_len: int | None,
    on_error: str,
    overwrite: bool,
    limit: int | None,
) -> None:
    loaded = load_target(target, device="cpu")
    summary = prepare(
        inputs,
        loaded.tokenizer,
        loaded.name,
        out_dir,
        keep_reasoning=keep_reasoning,
        max_seq_len=max_seq_len,
        on_error=on_error,
        overwrite=overwrite,
        limit=limit,
    )
    print(summary.format())


def regenerate_command(
    *,
    source: str,
    target: str,
    out_dir: str,
    max_new_tokens: int,
    batch_size: int,
    temperature: float,
    limit: int | None,
    engine: str = "auto",
    endpoint: EndpointConfig | None = None,
    on_error: str = "raise",
    world: World | None = None,
) -> None:
    """`dflash-trainer regenerate` on this rank of `world` (its share of the records) or alone."""
    from ..targets.regen_ranks import RegenTeam
    from ..targets.regenerate import regenerate

    records = regeneration_records(source, limit)  # a missing prompt file fails before the target loads
    if engine == "openai":  # the server runs the target: only its tokenizer is read here, to measure prompts
        loaded, tokenizer = None, load_prompt_tokenizer(target)
    else:
        loaded, tokenizer = load_target(target, device=str(world.device) if world else "auto"), None
    team = RegenTeam.of() if world is not None and world.distributed else RegenTeam()
    try:
        summary = regenerate(
            records,
            loaded,
            out_dir,
            max_new_tokens=max_new_tokens,
            batch_size=batch_size,
            temperature=temperature,
            limit=limit,
            engine=engine,
            endpoint=endpoint,
            tokenizer=tokenizer,
            on_error=on_error,
            team=team,
        )
    finally:
        team.close()
    if team.rank == 0:
        print(summary.format())


def load_prompt_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """The target's tokenizer alone (a model directory or hub id); a GGUF file or built-in name loads the target on
    the CPU for it (it is converted first)."""
    from transformers import AutoTokenizer

    from ..targets.loader import BUILTIN_GGUF_TARGETS, TargetLoadError

    if name_or_path in BUILTIN_GGUF_TARGETS or name_or_path.endswith(".gguf"):
        return load_target(name_or_path, device="cpu").tokenizer
    try:
        return AutoTokenizer.from_pretrained(name_or_path)
    except (OSError, ValueError) as error:
        raise TargetLoadError(f"target {name_or_path!r}: cannot load its tokenizer: {error}") from error


def resolve_checkpoint(path: str | Path) -> Path:
    """A run dir (newest checkpoint), a training checkpoint, or an exported drafter directory."""
    path = Path(path)
    if (path / "checkpoints").is_dir():
        newest = ckpt.newest_intact_checkpoint(path, drafter_only=True)
        if newest is None:
            raise ckpt.CheckpointError(f"{path}: run directory without checkpoints")
        return newest
    if not path.is_dir():
        raise ckpt.CheckpointError(f"{path}: no such checkpoint directory")
    if (path / ckpt.MANIFEST).is_file():
        ckpt.verify_checkpoint(path)
    return path


def load_drafter_any(path: str | Path, device: torch.device | str = "cpu"):
    """Drafter from a training checkpoint (drafter.safetensors) or an exported DFlash checkpoint (config.json)."""
    from ..export import import_drafter, load_training_drafter

    path = resolve_checkpoint(path)
    if (path / "drafter.safetensors").is_file():
        return load_training_drafter(path, device=device), path
    return import_drafter(path, device=device), path


def export_command(*, checkpoint: str, out_dir: str, dtype: str, overwrite: bool = False) -> None:
    from ..eval.compare import read_report
    from ..export import export_drafter, read_export_config
    from ..provenance import (
        SOURCE_KEY,
        TRAINING_KEY,
        TargetRecord,
        drafter_digest,
        read_target_record,
        run_source,
        training_record,
    )

    drafter, source = load_drafter_any(checkpoint)
    # A checkpoint's run directory is the export's source: later checkpoints of the run may replace it.
    run = source.parent.parent if source.parent.name == "checkpoints" else source
    config = run_config_of(source) if (source / "config.yaml").is_file() else None
    exported_from = run_source(run, config)
    # What an earlier export of the same run (or the export being exported again) already records: the target
    # and the command that trained it, which a checkpoint does not hold.
    again = read_export_config(source)  # an export exported again (another dtype, another place)
    if again is not None:
        earlier = again
        exported_from = again.get(SOURCE_KEY) or exported_from
    else:
        previous = read_export_config(run / "export") or {}
        earlier = previous if previous.get(SOURCE_KEY) == exported_from else {}
    target = read_target_record(earlier)
    if target is None and config is not None:
        try:
            target = TargetRecord.read(config.target.name_or_path, cache_dir=config.target.cache_dir)
        except TargetLoadError as error:  # exporting needs no target: say what the export will lack
            print(f"warning: the export records no target ({error}); `eval --drafter` of it will need --target")
    known = earlier.get(TRAINING_KEY) or {}
    training = training_record(config, command=known.get("command"), ranks=known.get("ranks"), steps=None)
    if config is None and known:
        training["data"] = known.get("data")
    digest = drafter_digest(drafter.export_state_dict())
    evaluations = [read_report(path / "eval" / "eval.json") for path in (source, run)]
    evaluation = next(
        (r for r in evaluations if r.get("drafter_digest") == digest and not r.get("argmax_drafts")), None
    )
    export_drafter(
        drafter,
        out_dir,
        dtype=getattr(torch, dtype),
        source=exported_from,
        target=target,
        training=training,
        evaluation=evaluation,
        overwrite=overwrite,
    )
    print(f"exported {source} -> {out_dir}")


def run_config_of(checkpoint: Path) -> RunConfig:
    """The run config saved in a training checkpoint (`config.yaml`)."""
    import yaml

    path = checkpoint / "config.yaml"
    try:
        return config_from_dict(yaml.safe_load(path.read_text(encoding="utf-8")) or {})
    except (OSError, yaml.YAMLError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path}: unreadable: {error}") from error


def eval_command(
    *,
    drafter_path: str,
    target: str | None,
    datasets: list[str],
    num_prompts: int,
    max_new_tokens: int,
    temperature: float,
    out_dir: str | None,
    dtype: str,
    batch_size: int | None = None,
    compile_drafter: bool | None = None,
    argmax_drafts: bool = False,
) -> None:
    from ..eval.runner import evaluate
    from ..export import cast_keeping_rope_fp32, check_drafter_fits_target, read_export_config, refresh_model_card
    from ..provenance import TargetMismatchError, check_target, locate_target, read_target_record

    if out_dir:
        refuse_file_as_directory(Path(out_dir))  # before decoding, not when the report is written
    for name in datasets:  # a misspelt, missing or empty set before the target loads
        check_prompt_set_name(name, "test")
    drafter, source = load_drafter_any(drafter_path)
    if argmax_drafts and not isinstance(drafter, DFlash2Drafter):
        raise ConfigError(f"--argmax-drafts: {source} is a DFlash drafter, which drafts each slot's argmax already")
    if argmax_drafts and out_dir is None:
        # Not `eval/` beside the export: the model card shows that report, and this one is not what is served.
        out_dir = str(source / "eval-argmax")
    if argmax_drafts and Path(out_dir).resolve() == (source / "eval").resolve():
        raise ConfigError(f"--argmax-drafts --out {out_dir}: that is the drafter's own evaluation; choose another")
    target_config = run_config_of(source).target if (source / "config.yaml").is_file() else None
    export_config = read_export_config(source)
    # An export records its target: found here by its name, recorded path or the cache, and checked after loading.
    record = read_target_record(export_config) if export_config is not None else None
    name_or_path = target or (target_config.name_or_path if target_config else None)
    if name_or_path is None and record is not None:
        name_or_path = locate_target(record)
        if name_or_path is None:
            raise TargetMismatchError(
                f"{source}: drafts for target {record.describe()}, which is not on this machine (not a built-in "
                f"name, {record.name_or_path or 'no portable path'} is not here, no converted copy in the target "
                "cache); pass it with --target"
            )
    if name_or_path is None:
        raise ConfigError(f"{source}: no config.yaml to read the target from; pass --target")
    loaded = load_target(
        name_or_path,
        dtype=dtype,
        # The checkpoint's cache of a converted GGUF target (no second conversion) and attention kernel.
        cache_dir=target_config.cache_dir if target_config else None,
        attn_implementation=target_config.attn_implementation if target_config else "sdpa",
    )
    if record is not None:
        check_target(record, loaded, name_or_path, drafter_source=source)
    check_drafter_fits_target(drafter.config, loaded.config, drafter_source=source, target_name=loaded.name)
    # In the target's dtype, as a server runs it (RoPE frequencies stay float32).
    drafter = cast_keeping_rope_fp32(drafter.to(loaded.device), loaded.dtype).eval()
    drafts = drafter.argmax_drafts() if argmax_drafts else contextlib.nullcontext()
    with drafts:
        report = evaluate(
            loaded,
            drafter,
            datasets,
            num_prompts=num_prompts,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            out_dir=Path(out_dir) if out_dir else source / "eval",
            batch_size=batch_size,
            # As the run that trained the drafter decoded (an export without its run config: auto).
            recurrent_state_dtype=STATE_DTYPES[target_config.recurrent_state_dtype] if target_config else None,
            compile_drafter=compile_drafter,
        )
    print(report.format_table())
    # The card of an export shows the evaluation kept beside it (the default --out, `eval/` in the export).
    if export_config is not None and out_dir is None and refresh_model_card(source, report.to_dict()):
        print(f"model card with these results: {source / 'README.md'}")
