"""`dflash-trainer` subcommands: parse arguments, dispatch, report errors; nothing else.

Errors. A `UserError` (bad recipe, missing file, full disk, checkpoint of another run...) prints one line,
`error: MESSAGE` (`config error: ...` for the config), and exits with status 2; so does an OSError of the storage
that escaped a writer. Any other exception is a bug: its traceback is printed with a request to report it, and the
exit status is 1. Ctrl-C exits with 130.

`train` and `bench` take options and `key=value` overrides in any order (`train RECIPE --nproc 8 optim.lr=1e-4`):
they are parsed with `parse_intermixed_args`, which argparse cannot apply to the parser with subcommands itself.
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
import sys
import traceback
from pathlib import Path
from typing import NoReturn

from .config import ConfigError, describe_keys, load_config
from .errors import UserError, describe_interrupt, is_storage_error, storage_error

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"
DEFAULT_RECIPE = "smollm2-135m"
# What `train` runs without a recipe on a machine with a CUDA device.
DEFAULT_GPU_RECIPE = "smollm2-135m-gpu-general"
DEFAULT_BENCH_RECIPE = "bench-qwen3-8b"
# `plot RUN_DIR RUN_DIR ...` writes its overlays here unless --out says otherwise.
COMPARE_PLOTS_DIR = "compare-plots"
# Kernels listed per phase when only --trace-dir asks for the kernel profile.
DEFAULT_TOP_KERNELS = 20
# Subcommands whose positionals (recipe, overrides) may come after options.
INTERMIXED = ("train", "bench")
BUG_REPORT = (
    "This is a bug in dflash-trainer, not a problem with your input: please report it with the command you ran "
    "and the traceback above."
)


def resolve_recipe(recipe: str | None) -> Path:
    """A path to a YAML file, or the name of a file in `recipes/` (`smollm2-135m`)."""
    name = recipe or DEFAULT_RECIPE
    path = Path(name)
    if path.suffix in (".yaml", ".yml") or path.exists():
        return path
    candidate = RECIPES_DIR / f"{name}.yaml"
    if not candidate.is_file():
        known = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"recipe {name!r}: not a file and not one of {known} in {RECIPES_DIR}; {hint}".rstrip("; "))
    return candidate


def default_train_recipe(cuda_available: bool) -> tuple[str, str]:
    """(the recipe `train` runs when none is named, the line that says so first): the GPU recipe where there is a
    CUDA device, the 2-core CPU demonstration elsewhere."""
    if cuda_available:
        return DEFAULT_GPU_RECIPE, (
            f"no recipe given and a CUDA device is present: running recipes/{DEFAULT_GPU_RECIPE}.yaml (the main job "
            f"on one GPU; name a recipe to choose another, e.g. `dflash-trainer train {DEFAULT_RECIPE}`)"
        )
    return DEFAULT_RECIPE, (
        f"no recipe given and no CUDA device: running recipes/{DEFAULT_RECIPE}.yaml, a demonstration of the whole "
        f"pipeline sized for 2 CPU cores (a useful drafter needs the GPU recipe {DEFAULT_GPU_RECIPE}; README results)"
    )


def keys_help() -> str:
    rows = describe_keys()
    width = max(len(key) for key, _, _ in rows)
    return "\n".join(f"  {key:<{width}}  {value!r}  ({type_name})" for key, type_name, value in rows)


def split_recipe_and_overrides(items: list[str]) -> tuple[str | None, list[str]]:
    if items and "=" not in items[0]:
        return items[0], items[1:]
    return None, items


def without_option(argv: list[str], option: str) -> list[str]:
    """argv minus `option VALUE` / `option=VALUE` (the child ranks must not start torchrun again)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == option:
            skip = True
        elif not arg.startswith(option + "="):
            out.append(arg)
    return out


def cmd_train(args: argparse.Namespace) -> int:
    recipe, overrides = split_recipe_and_overrides(args.items)
    if recipe is None:
        import torch

        recipe, line = default_train_recipe(torch.cuda.is_available())
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(line, flush=True)
    if args.resume:
        overrides.append(f"checkpoint.resume={args.resume}")
    if args.profile_interval is not None:
        overrides.append(f"metrics.profile_interval={args.profile_interval}")
    config = load_config(resolve_recipe(recipe), overrides)
    if args.nproc and args.nproc > 1 and "LOCAL_RANK" not in os.environ:
        from .devices import check_local_ranks
        from .distributed.roles import check_placement
        from .launch import run_torchrun
        from .train.pipeline import startup_checks
        from .train.run_lock import check_not_in_use

        # Here, not in the ranks: a mistake is one line before torchrun starts (and prints nothing of its own).
        check_placement(config.placement, args.nproc)
        check_local_ranks(config.target.device, args.nproc)
        startup_checks(config)
        check_not_in_use(config.run_dir)
        return run_torchrun(args.nproc, without_option(args.argv, "--nproc"))
    from .launch import train_rank
    from .provenance import portable_command

    # The command for the export's model card (torchrun's ranks see it without --nproc; the card names the ranks).
    return train_rank(config, command=portable_command(["train", *args.argv[1:]]))


def cmd_prepare(args: argparse.Namespace) -> int:
    from .train.pipeline import prepare_command

    prepare_command(
        inputs=args.input,
        target=args.target,
        out_dir=args.out,
        keep_reasoning=args.keep_reasoning,
        max_seq_len=args.max_seq_len,
        on_error=args.on_error,
        overwrite=args.overwrite,
        limit=args.limit,
    )
    return 0


def cmd_regenerate(args: argparse.Namespace) -> int:
    from .config import EndpointConfig

    endpoint = None
    if args.engine == "openai":
        if not args.base_url.startswith(("http://", "https://")):
            raise UserError(
                f"regenerate --engine openai: --base-url must name the server's http(s) API root, e.g. "
                f"http://localhost:8000/v1 (got {args.base_url!r})"
            )
        endpoint = EndpointConfig(
            base_url=args.base_url,
            model=args.model,
            concurrency=args.concurrency,
            retries=args.retries,
            timeout_s=args.timeout,
        )
    elif args.base_url or args.model:
        raise UserError("regenerate: --base-url and --model are for --engine openai")
    if args.nproc > 1 and "LOCAL_RANK" not in os.environ:
        from .launch import run_torchrun

        check_local_ranks(args.nproc, args.engine)
        return run_torchrun(args.nproc, without_option(args.argv, "--nproc"))
    from .launch import run_rank
    from .train.pipeline import regenerate_command

    return run_rank(
        lambda world: regenerate_command(
            source=args.input,
            target=args.target,
            out_dir=args.out,
            max_new_tokens=args.max_new_tokens,
            batch_size=args.batch_size,
            temperature=args.temperature,
            limit=args.limit,
            engine=args.engine,
            endpoint=endpoint,
            on_error=args.on_error,
            world=world,
        ),
        # A server answers: this process needs no GPU (the server's may all be taken).
        device="cpu" if args.engine == "openai" else "auto",
    )


def check_local_ranks(nproc: int, engine: str) -> None:
    """`regenerate --nproc N`: one rank per local GPU, each running the target; refused before torchrun starts."""
    import torch

    if engine == "openai":
        raise UserError(
            "regenerate --nproc: with --engine openai the server answers every request; raise --concurrency instead"
        )
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus and nproc > gpus:
        raise UserError(f"regenerate --nproc {nproc}: this machine has {gpus} GPU(s); one rank runs on each")


def cmd_eval(args: argparse.Namespace) -> int:
    from .train.pipeline import eval_command

    eval_command(
        drafter_path=args.drafter,
        target=args.target,
        datasets=args.datasets,
        num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        out_dir=args.out,
        dtype=args.dtype,
        batch_size=args.batch_size,
        compile_drafter=args.compile_drafter,
        argmax_drafts=args.argmax_drafts,
    )
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from .train.pipeline import export_command

    export_command(
        checkpoint=args.checkpoint,
        out_dir=args.out,
        dtype=args.dtype,
        overwrite=args.overwrite,
    )
    return 0


def cmd_convert_checkpoint(args: argparse.Namespace) -> int:
    from .train.checkpoint import convert_legacy_checkpoint

    for path in args.checkpoints:
        print(f"converted {convert_legacy_checkpoint(path)}")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from .eval.compare import comparison_table
    from .train.plot import PlotError, plot_run, plot_runs

    if len(args.run_dirs) == 1:
        paths = plot_run(args.run_dirs[0], args.out)
        wanted = "loss, acc, tau, lr"
    else:
        out = Path(args.out or COMPARE_PLOTS_DIR)
        paths = plot_runs(args.run_dirs, out)
        wanted = "loss, tau"
        table = comparison_table(args.run_dirs)
        if table is not None:  # the runs' held-out tau beside their curves
            table_path = out / "tau.md"
            table_path.parent.mkdir(parents=True, exist_ok=True)
            table_path.write_text(table + "\n", encoding="utf-8")
            print(table)
            paths = [*paths, table_path]
    if not paths:
        raise PlotError(f"{', '.join(args.run_dirs)}: the metrics hold none of {wanted}: nothing to plot")
    for path in paths:
        print(path)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import run_bench

    recipe, overrides = split_recipe_and_overrides(args.items)
    if args.trace_dir is not None and args.kernels == 0:
        args.kernels = DEFAULT_TOP_KERNELS  # a trace is taken by the kernel profile: it implies one
    run_bench(
        recipe=resolve_recipe(recipe or DEFAULT_BENCH_RECIPE),
        overrides=overrides,
        steps=args.steps,
        warmup=args.warmup,
        out=args.out,
        ablations=args.ablation,
        drafter_only_ablations=args.drafter_only_ablations,
        kernels=args.kernels,
        trace_dir=args.trace_dir,
        documents=args.documents,
    )
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse whose errors follow the CLI's contract: one line `error: ...` on stderr, exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def count_from(minimum: int):
    """An argparse type: an integer >= `minimum` (argparse turns the error into a usage line, exit status 2)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def temperature(text: str) -> float:
    """An argparse type: a finite sampling temperature >= 0 (0 is greedy)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0 (0: greedy), got {text}")
    return value


def positive_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dflash-trainer", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser(
        "train",
        help="train a drafter from a recipe",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="dflash-trainer train [RECIPE] [key.path=value ...]\n\n"
        f"RECIPE is a YAML file or a name in recipes/ (default {DEFAULT_GPU_RECIPE} where a CUDA device is present, "
        f"else {DEFAULT_RECIPE}).\n\nConfig keys and defaults:\n" + keys_help(),
    )
    train.add_argument("items", nargs="*", help="recipe, then overrides like optim.lr=3e-4")
    train.add_argument("--resume", help="resume from this checkpoint directory (default: newest in run_dir)")
    train.add_argument("--profile-interval", type=float, help="seconds between per-stage profiler reports")
    train.add_argument("--nproc", type=count_from(0), default=0, help="start N local ranks through torchrun")
    train.set_defaults(run=cmd_train)

    prepare = sub.add_parser("prepare", help="tokenise chat data into training shards")
    prepare.add_argument("--input", nargs="+", required=True, help="chat JSONL files or saved datasets")
    prepare.add_argument("--target", default="smollm2-135m", help="target whose tokenizer and chat template to use")
    prepare.add_argument("--out", required=True, help="shard directory to write")
    prepare.add_argument("--keep-reasoning", action="store_true", help="keep <think> traces in the responses")
    prepare.add_argument("--max-seq-len", type=int, default=None, help="drop conversations longer than this")
    prepare.add_argument("--on-error", choices=["raise", "skip"], default="raise")
    prepare.add_argument("--overwrite", action="store_true")
    prepare.add_argument("--limit", type=int, default=None)
    prepare.set_defaults(run=cmd_prepare)

    regen = sub.add_parser("regenerate", help="replace assistant turns with the target's own responses")
    regen.add_argument("--input", required=True, help="chat JSONL file, or a prompt set (gsm8k:train, mtbench, ...)")
    regen.add_argument("--target", default="smollm2-135m")
    regen.add_argument("--out", required=True, help="output directory (chat JSONL shards; resumable)")
    regen.add_argument("--max-new-tokens", type=count_from(1), default=256)
    regen.add_argument("--batch-size", type=count_from(1), default=16)
    regen.add_argument("--temperature", type=temperature, default=0.0)
    regen.add_argument("--limit", type=count_from(1), default=None)
    regen.add_argument(
        "--on-error",
        choices=["raise", "skip"],
        default="raise",
        help="a record the tokenizer or the server fails on: stop naming it, or leave it out and count it",
    )
    regen.add_argument("--nproc", type=count_from(0), default=0, help="share the records among N local GPUs")
    regen.add_argument(
        "--engine",
        choices=["auto", "engine", "hf", "vllm", "openai"],
        default="auto",
        help="who answers: our decoding engine (auto), transformers generate, vLLM in-process, or a server (openai)",
    )
    regen.add_argument(
        "--base-url", default="", help="--engine openai: the server's API root, e.g. http://HOST:8000/v1"
    )
    regen.add_argument("--model", default="", help="--engine openai: the served model name (default: the only one)")
    regen.add_argument("--concurrency", type=count_from(1), default=64, help="--engine openai: requests in flight")
    regen.add_argument("--retries", type=count_from(0), default=5, help="--engine openai: retries of a failed request")
    regen.add_argument("--timeout", type=positive_seconds, default=600.0, help="--engine openai: seconds per request")
    regen.set_defaults(run=cmd_regenerate)

    evaluate = sub.add_parser("eval", help="speculative decoding: tau, speedup, lossless check")
    evaluate.add_argument("--drafter", required=True, help="exported drafter, training checkpoint, or run dir")
    evaluate.add_argument("--target", default=None, help="target (default: the one in the checkpoint's config)")
    evaluate.add_argument("--datasets", nargs="+", default=["gsm8k", "mtbench", "humaneval"])
    evaluate.add_argument("--num-prompts", type=count_from(1), default=20)
    evaluate.add_argument("--max-new-tokens", type=count_from(1), default=128)
    evaluate.add_argument("--temperature", type=temperature, default=0.0)
    evaluate.add_argument("--dtype", default="auto", help="target dtype (float32 for the strict lossless check)")
    evaluate.add_argument("--out", default=None, help="where eval.json and the histogram go")
    evaluate.add_argument(
        "--batch-size",
        type=count_from(1),
        default=None,
        help="prompts decoded together when timing (default: both 1, one request at a time, and all of a set)",
    )
    evaluate.add_argument(
        "--compile-drafter",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compile the drafter's norms and MLPs (DFlash2: also its convolutions and walk): fewer kernels per step "
        "(default: on a GPU, not on the CPU)",
    )
    evaluate.add_argument(
        "--argmax-drafts",
        action="store_true",
        help="DFlash2: draft each slot's argmax, the selector unused (what the walk adds; report in eval-argmax/)",
    )
    evaluate.set_defaults(run=cmd_eval)

    export = sub.add_parser("export", help="write a DFlash checkpoint that vLLM / SGLang / z-lab load")
    export.add_argument("checkpoint", help="training checkpoint directory or run dir (newest checkpoint)")
    export.add_argument("--out", required=True)
    export.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    export.add_argument("--overwrite", action="store_true", help="replace an export of another run at --out")
    export.set_defaults(run=cmd_export)

    convert = sub.add_parser(
        "convert-checkpoint",
        help="rewrite checkpoints of earlier versions (trainer.pt, a pickle) in the current format",
        description="Only for checkpoints you trust: trainer.pt is read with PyTorch's restricted loader "
        "(torch.load weights_only=True, numpy arrays allowed) and replaced by JSON + safetensors files.",
    )
    convert.add_argument("checkpoints", nargs="+", help="checkpoint directories (RUN_DIR/checkpoints/step-*)")
    convert.set_defaults(run=cmd_convert_checkpoint)

    plot = sub.add_parser(
        "plot",
        help="draw loss / accuracy / tau curves of a run as PNG, or overlay several runs' loss and tau and table "
        "their held-out tau (eval/eval.json) side by side",
    )
    plot.add_argument("run_dirs", nargs="+", metavar="run_dir")
    plot.add_argument(
        "--out",
        help=f"where the PNGs go (default: RUN_DIR/plots for one run, ./{COMPARE_PLOTS_DIR} for several)",
    )
    plot.set_defaults(run=cmd_plot)

    bench = sub.add_parser(
        "bench",
        help="time training steps on synthetic data (GPU benchmark)",
        description=f"dflash-trainer bench [RECIPE] [key.path=value ...] (default recipe {DEFAULT_BENCH_RECIPE})",
    )
    bench.add_argument("items", nargs="*", help="recipe, then overrides like optim.lr=3e-4")
    bench.add_argument("--steps", type=count_from(1), default=10)
    bench.add_argument("--warmup", type=count_from(0), default=3)
    bench.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    bench.add_argument(
        "--ablation", action="append", default=[], help="NAME:key=value,...: one more end-to-end phase with these"
    )
    bench.add_argument(
        "--drafter-only-ablations",
        action="store_true",
        help="time each ablation's drafter-only step too (the drafter's settings: flex kernels, loss chunks; "
        "not for an ablation of target.* settings alone)",
    )
    bench.add_argument(
        "--kernels",
        type=count_from(0),
        default=0,
        help="print the N kernels with the most device time per phase (torch.profiler)",
    )
    bench.add_argument(
        "--trace-dir",
        type=Path,
        default=None,
        help=f"write each phase's Chrome trace of the kernel profile here (implies --kernels {DEFAULT_TOP_KERNELS})",
    )
    bench.add_argument(
        "--documents",
        choices=["paper", "smollm2", "long"],
        default=None,
        help="the synthetic documents (default: the recipe target's): 3072 + 3072 + 2048 per row; shaped like the "
        "SmolLM2 recipe's data (~66 short replies per 16K tokens); or long replies of 4-8K tokens",
    )
    bench.set_defaults(run=cmd_bench)
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse a command line; `train` and `bench` accept options between and after their positionals."""
    parser = build_parser()
    if argv and argv[0] in INTERMIXED:
        subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        args = subparsers.choices[argv[0]].parse_intermixed_args(argv[1:])
        args.command = argv[0]
    else:
        args = parser.parse_args(argv)
    args.argv = argv  # `train --nproc` starts its ranks with the same command line
    return args


def main(argv: list[str] | None = None) -> int:
    # Weights and data come from local files and installed packages; never reach for a model hub unless the
    # user explicitly allows it (HF_HUB_OFFLINE=0). Importing the package sets the same default.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        args = parse_args(sys.argv[1:] if argv is None else list(argv))
    except SystemExit as exited:  # argparse: --help (0), or a usage error already printed as one line (2)
        return exited.code if isinstance(exited.code, int) else 2
    try:
        return args.run(args)
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as interrupt:
        # A plain Ctrl-C raises KeyboardInterrupt() with no text; launch.StopFlag's carries the signal's name.
        print(describe_interrupt(interrupt), file=sys.stderr)
        return 130
    except OSError as error:
        if not is_storage_error(error):
            return _report_bug()
        print(f"error: {storage_error('output', error.filename or Path.cwd(), error)}", file=sys.stderr)
        return 2
    except Exception:
        return _report_bug()


def _report_bug() -> int:
    traceback.print_exc()
    print(BUG_REPORT, file=sys.stderr)
    return 1
