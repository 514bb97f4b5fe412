"""A 27B hybrid target (Qwen3.6-27B's shape, random weights) on one GPU, with flash-linear-attention's kernels and
with transformers' PyTorch fallbacks: the target forward over packed rows, a training step, the decoding engine.

Run from the repository root on the GPU machine (about 3 minutes on one H200):

    PYTHONPATH=src python3 benchmarks/hybrid_bench.py        # table on stdout, JSON to $OUT/hybrid_bench.json

flash-linear-attention: transformers 5.17 binds `fla.ops.gated_delta_rule.{chunk,fused_recurrent}_gated_delta_rule`
when it imports its Qwen3.5 modeling module, if `import fla` succeeds then (no version check there; no hub, no
`kernels` package needed), and its PyTorch fallbacks otherwise, silently except for a logged warning. So the two
runs are two child processes: `fla` with the wheels installed into a private directory on its path (`fla-core` and
`einops` from `--wheels`, default `.whl/`, installed with pip `--no-deps --no-index` when `fla` is not importable
already), `torch` with `fla` made unimportable. Each child checks which implementation transformers bound. (So
torch, transformers and this package are imported inside the child's functions, after that choice.)

Target: Qwen3.6-27B's text decoder (`QWEN36_27B`; the same layout as Qwen3.5-27B): 64 layers, three Gated DeltaNet
layers then one gated full-attention layer, repeated (48 + 16); hidden 5120, MLP 17408, vocab 248320; attention
24 heads, 4 KV heads, head dim 256, partial RoPE 0.25, theta 1e7; linear attention 16 key heads and 48 value heads
of 128, convolution kernel 4. Sources: the `text_config` of Qwen/Qwen3.6-27B's config.json (as embedded verbatim
in a public repository's test file, found through code search), and the Qwen3.5-27B model cards that give the same
numbers (64 layers, 3:1 pattern, 24 Q / 4 KV heads, head dim 256, MLP 17408, hidden 5120, vocab 248K). Taps
[1, 16, 31, 46, 61] (the default spread over 64 layers); the model is truncated after the deepest tap: layers
0..62 are built (26.5B parameters in bf16, 53 GB); layer 62 never runs in training (the drafter config refuses a
tap on a target's last layer, hence one layer beyond the tap).

Phases (each child):
- `forward`: `FeatureCapture.capture` of one packed 8192-token row of documents 3072 + 3072 + 2048, stopping after
  layer 61, median of timed calls: target tokens/s, on the path the target takes (with fla on CUDA the one-forward
  path, `targets/varlen_hybrid.py`) and on the per-document path (every document a row of its own);
- `train`: the trainer's end-to-end step in the paper setting (`recipes/bench-qwen3-8b.yaml`: drafter 5 layers, block
  16, 455 anchors per document; `--documents real`: rows of about 33 documents shaped like the math-first GPU
  recipe's data instead, whose per-document groups take many sizes, and fla's gate cumsum compiles once per size: see
  `targets/per_document.py`; the timed steps' Triton kernel counts show whether those compiles make the slow steps)
  with data labels (the LM head is not needed, so the target stops after the deepest tap) through `bench.time_steps`:
  step time min / median / max over the timed steps, and each timed step with the frames dynamo compiled in it and the
  kernels Triton added to its disk cache (fla's JIT compiles: on 2026-12-01 the median was 5.5 s against a minimum of
  1.3 s, with one recompile, unexplained), the caching allocator's cudaMalloc retries in the timed steps (near the
  memory limit it frees its cache and retries, a slow synchronising path: run with
  `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` when they are not 0), target tokens/s, MFU, peak memory. The
  drafter layers and the loss run eagerly (compiling them costs each child about 25 s of the 3 minutes; `--compile` to
  do it);
- `decode`: the decoding engine at each of `--rows` row counts (`--rows 8,64,256`), one prompt of 512 random tokens
  per row, 48 new tokens: plain decoding's ms per step (the steps after the prefill, without each CUDA graph's first
  step, which runs eagerly before its capture) and tokens/s (rows x 1000 / ms), with CUDA graphs and eagerly, and at
  every row count with bf16 recurrent states too (`target.recurrent_state_dtype: bfloat16`: half the state traffic;
  its peak memory and the rows whose output equals the float32 states' are reported); one eager step under the
  profiler: kernel time by class (GEMMs, delta rule, convolution, attention, other) against
  the step time (the rest is launch overhead), the number of kernels, the top ones; the linear layers' recurrent
  state update alone (in place, and the public fla kernel plus a copy, in GB/s of state read and written); and up to
  64 rows speculative decoding with a random 5-layer block-16 drafter (tau about 1): ms per verify step and whether
  its output equals the plain one. bf16 near-ties may differ: a verify block and a one-token step round differently
  (with fla also different kernels, chunked vs fused recurrent), and a random target's logits are nearly flat, so
  per row the common prefix of the two outputs (= the new-token index where they first part) is reported, and at
  that index the evaluation's lossless check (`eval.runner.verify_lossless`: the target's own forward over the
  common prefix) says whether the two tokens are a near-tie (both logits within 4 bf16 rounding steps of the top
  one; their gap to the top logit is reported) or not. Parting within the first few tokens on every row (token 2 is
  the first a rollback touches) with no near-ties points at the recurrent-state rollback; parting late at near-ties
  is rounding drift. Above 64 rows only the engine's own decoding (float32 and bf16 states), the profile and the
  state update run. Measurements other than the engine's own with graphs that fail (out of memory) are recorded as
  errors and the rest still run;
- `decode_fp8`: after the target's decoder linears are quantised to FP8 in place (`target.fp8`, `targets/fp8.py`),
  plain decoding with CUDA graphs at each row count, with float32 and with bf16 recurrent states: half the weight
  bytes per step, twice the GEMM rate. Last, since it changes the target. The decode phase alone at the three row
  counts (about 4 minutes after the target is built):

      PYTHONPATH=src python3 benchmarks/hybrid_bench.py --wheels .fla --kernels fla --phases decode \\
          --rows 8,64,256 --child-timeout 900
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from dflash_trainer.shapes import QWEN36_27B  # plain data: loads neither torch nor transformers

REPO = Path(__file__).resolve().parents[1]
TAPS = [1, 16, 31, 46, 61]
QWEN36_27B_TRUNCATED = {**QWEN36_27B, "num_hidden_layers": 63, "layer_types": QWEN36_27B["layer_types"][:63]}
# Recipe overrides of the paper setting for this target: data labels (no LM head, early exit), its taps, and a mask
# token above the synthetic documents' ids.
HYBRID_OVERRIDES = (
    # The paper recipe compiles the target's layers (since e03dadb); with fla inside and the per-document path
    # (documents of 3072 and 2048 tokens) that is untested, and on 2026-12-01 (commit a3c844a) the training phase
    # then ran past its 380 s limit. Eager, as the hybrid numbers before it were measured.
    "target.compile=false",
    "loss.label_source=data",
    f"drafter.target_layer_ids=[{','.join(map(str, TAPS))}]",
    "drafter.mask_token_id=248319",
)
DOCUMENTS = (3072, 3072, 2048)


# ----------------------------------------------------------------------------------------------------------
# Parent: install the wheels, run both children, print the table


def fla_site(wheels: Path) -> str | None:
    """A directory holding `fla` (and einops), or None when neither an installed `fla` nor the wheels exist."""
    probe = subprocess.run([sys.executable, "-c", "import fla.ops.gated_delta_rule"], capture_output=True)
    if probe.returncode == 0:
        return ""  # importable as installed
    found = sorted(wheels.glob("fla_core-*.whl")) + sorted(wheels.glob("einops-*.whl"))
    if not any(p.name.startswith("fla_core") for p in found):
        return None
    site = Path(tempfile.gettempdir()) / "hybrid_bench_fla"
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--upgrade", "--target"]
    subprocess.run([*command, str(site), *map(str, found)], check=True)
    return str(site)


def run_children(args: argparse.Namespace) -> int:
    import torch  # the parent never imports transformers: each child picks its kernels before that

    if not torch.cuda.is_available():
        print("hybrid_bench: needs a CUDA device (a 27B-parameter target)", file=sys.stderr)
        return 2
    site = fla_site(args.wheels)
    results = {}
    for kernels in args.kernels.split(","):
        if kernels == "fla" and site is None:
            results[kernels] = {
                "error": f"flash-linear-attention not importable and no fla_core wheel in {args.wheels}"
            }
            continue
        env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
        paths = [str(REPO / "src"), *([site] if kernels == "fla" and site else []), env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            rows = ",".join(map(str, args.rows))
            command = [sys.executable, __file__, "--child", kernels, "--child-out", out.name, "--rows", rows]
            command += ["--phases", ",".join(args.phases)]
            command += ["--documents", args.documents, *(["--compile"] if args.compile else [])]
            print(f"=== {kernels} kernels", flush=True)
            try:
                subprocess.run(command, env=env, timeout=args.child_timeout, check=False)
            except subprocess.TimeoutExpired:
                print(f"{kernels}: over {args.child_timeout} s", flush=True)
            text = Path(out.name).read_text()
            results[kernels] = json.loads(text) if text else {"error": "the child wrote no result"}
    print_table(results)
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "hybrid_bench.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2))
        print(f"wrote {path}")
    return 0 if all("error" not in r and not r.get("errors") for r in results.values()) else 1


def print_table(results: dict) -> None:
    print(f"\n{'kernels':<8} {'phase':<8} result")
    for kernels, result in results.items():
        if "error" in result:
            print(f"{kernels:<8} {'-':<8} ERROR {result['error']}")
            continue
        print(f"{kernels:<8} {'bound':<8} chunk: {result['bound']['chunk']}, recurrent: {result['bound']['recurrent']}")
        for phase, value in result.get("phases", {}).items():
            print(f"{kernels:<8} {phase:<8} {value['summary']}")
        for phase, error in result.get("errors", {}).items():
            print(f"{kernels:<8} {phase:<8} ERROR {error}")


# ----------------------------------------------------------------------------------------------------------
# Child: one set of kernels


def bound_implementation(function: object) -> str:
    """The module of what transformers bound behind one of its kernel wrappers (its closure's `implementation`)."""
    implementation = inspect.getclosurevars(function).nonlocals.get("implementation")
    return getattr(implementation, "__module__", "unknown")


def run_child(
    kernels: str, out: Path, *, rows: list[int], compile_drafter: bool, documents: str, only: list[str]
) -> None:
    if kernels == "torch":
        sys.modules["fla"] = None  # `import fla` raises: transformers binds its PyTorch fallbacks
    import torch
    import transformers.models.qwen3_5.modeling_qwen3_5 as modeling

    from dflash_trainer.bench import random_target

    result: dict = {
        "kernels": kernels,
        "bound": {
            "chunk": bound_implementation(modeling.torch_chunk_gated_delta_rule),
            "recurrent": bound_implementation(modeling.torch_recurrent_gated_delta_rule),
        },
        "gpu": torch.cuda.get_device_name(),
        "phases": {},
        "errors": {},
    }
    print(f"bound: {result['bound']}", flush=True)
    if kernels == "fla" and not result["bound"]["chunk"].startswith("fla"):
        result["errors"]["bound"] = "transformers did not bind flash-linear-attention's kernels"
    device = torch.device("cuda")
    started = time.perf_counter()
    torch.manual_seed(0)
    target = random_target(device, torch.bfloat16, QWEN36_27B_TRUNCATED)
    result["build_s"] = time.perf_counter() - started
    fast = kernels == "fla"
    phases = [
        ("forward", lambda: forward_phase(target, iters=5 if fast else 2)),
        (
            "train",
            lambda: train_phase(target, steps=6 if fast else 2, compile_drafter=compile_drafter, documents=documents),
        ),
        # 4k + 1 new tokens: 4k steps after the prefill, whole intervals of 4 steps between host syncs.
        ("decode", lambda: decode_phase(target, rows=rows, new_tokens=49 if fast else 25)),
        # Last: it quantises the target in place.
        ("decode_fp8", lambda: decode_fp8_phase(target, rows=rows, new_tokens=49 if fast else 25)),
    ]
    phases = [(name, phase) for name, phase in phases if name in only]
    for name, phase in phases:
        try:
            result["phases"][name] = phase()
            print(f"{name}: {result['phases'][name]['summary']}", flush=True)
        except Exception as error:  # reported in the table and the exit status; the other phases still run
            result["errors"][name] = f"{type(error).__name__}: {error}"
            print(f"{name}: ERROR {result['errors'][name]}", flush=True)
        torch.cuda.empty_cache()
        out.write_text(json.dumps(result, indent=2))


def forward_phase(target, *, iters: int) -> dict:
    """The capture on the path the target takes on this device and, when that is the one-forward path
    (`targets/varlen_hybrid.py`), on the per-document path too, over the same row."""
    import torch

    from dflash_trainer.targets.capture import FeatureCapture
    from dflash_trainer.targets.documents import DocumentLayout

    device = target.device
    doc_ids = torch.cat([torch.full((n,), d) for d, n in enumerate(DOCUMENTS)])[None]  # [1, T]
    layout = DocumentLayout.from_doc_ids(doc_ids, device)
    ids = torch.randint(0, QWEN36_27B["vocab_size"] - 4096, doc_ids.shape, device=device)
    tokens = int(doc_ids.numel())
    capture = FeatureCapture(target.model, TAPS)
    paths = [capture.packing_path] + (["per_document"] if capture.packing_path != "per_document" else [])
    result: dict = {"path": capture.packing_path, "tokens": tokens, "paths": {}}
    for path in paths:
        capture.packing_path = path
        capture.capture(ids, documents=layout)  # warm-up (Triton autotuning, cuBLAS)
        torch.cuda.reset_peak_memory_stats(device)
        times = []
        for _ in range(iters):
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            capture.capture(ids, documents=layout)
            torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        median = statistics.median(times)
        peak = torch.cuda.max_memory_allocated(device) / 2**30
        result["paths"][path] = {"ms": median * 1e3, "tokens_per_s": tokens / median, "peak_gib": peak}
    first = result["paths"][paths[0]]
    result.update(ms=first["ms"], tokens_per_s=first["tokens_per_s"], peak_gib=first["peak_gib"])
    result["summary"] = f"{tokens} tokens: " + "; ".join(
        f"{path} path {r['ms']:.0f} ms, {r['tokens_per_s']:,.0f} target tok/s (peak {r['peak_gib']:.1f} GiB)"
        for path, r in result["paths"].items()
    )
    return result


def train_phase(target, *, steps: int, compile_drafter: bool, documents: str) -> dict:
    from dataclasses import asdict

    from dflash_trainer.bench import (
        Setting,
        bench_config,
        live_steps,
        paper_documents,
        smollm2_documents,
        time_steps,
        write_synthetic_shards,
    )
    from dflash_trainer.train.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        setting = Setting(QWEN36_27B_TRUNCATED, paper_documents if documents == "paper" else smollm2_documents)
        shards = write_synthetic_shards(
            Path(tmp) / "shards", setting=setting, groups=2 * (steps + 8), vocab=QWEN36_27B["vocab_size"]
        )
        compile_flag = str(compile_drafter).lower()
        overrides = [*HYBRID_OVERRIDES, f"drafter.compile={compile_flag}", f"loss.compile={compile_flag}"]
        config = bench_config(REPO / "recipes/bench-qwen3-8b.yaml", overrides, shards, Path(tmp) / "run")
        trainer = Trainer(config, target=target, log=print)
        trainer.start_log_window()
        steps_iter = live_steps(trainer)
        phase = time_steps(trainer, steps_iter, warmup=2, steps=steps, name="end_to_end")
        steps_iter.close()
    result = asdict(phase)
    mfu = f"{100 * phase.mfu:.1f}%" if phase.mfu is not None else "n/a"
    result["summary"] = (
        f"step ms min/median/max {phase.step_ms_min:.0f}/{phase.step_ms_median:.0f}/{phase.step_ms_max:.0f} over "
        f"{steps} steps ({phase.recompiles_after_warmup} recompiles after warm-up, {phase.alloc_retries} allocator "
        f"retries), {phase.tokens_per_s:,.0f} "
        f"target tok/s at the median, MFU {mfu}, peak {phase.peak_mem_gib:.1f} GiB, first step "
        f"{phase.first_step_s:.0f} s; stages (ms): "
        + " ".join(f"{k} {v:.0f}" for k, v in sorted(phase.stages_ms.items(), key=lambda kv: -kv[1])[:4])
        + f"; timed steps (ms): {phase.describe_steps()}"
    )
    return result


def decode_phase(target, *, rows: list[int], new_tokens: int) -> dict:
    """Per row count: plain decoding's ms per step with CUDA graphs (the engine's kernels; with bf16 recurrent
    states; without its fused norms; with transformers' kernels only, as before) and eagerly, and tokens/s; where an
    eager step's kernel time goes; the recurrent-state update alone; speculative == plain where rows <=
    SPECULATIVE_ROWS."""
    import dataclasses

    import torch

    from dflash_trainer.decoding.hybrid_kernels import TRANSFORMERS
    from dflash_trainer.decoding.target import TargetRunner

    generator = torch_generator(1)
    prompts = [random_prompt(generator) for _ in range(max(rows))]
    runner = TargetRunner(target.model)  # the engine's choice: fla's kernels where fla is importable
    variants = {"graphs": runner, BF16_STATES: TargetRunner(target.model, recurrent_state_dtype=torch.bfloat16)}
    if runner.hybrid_kernels.rms_norm is not None:
        unfused = dataclasses.replace(runner.hybrid_kernels, name="no fused norms", rms_norm=None, gated_rms_norm=None)
        variants["graphs, transformers' norms"] = TargetRunner(target.model, hybrid_kernels=unfused)
    if runner.hybrid_kernels is not TRANSFORMERS:
        variants["graphs, transformers' kernels"] = TargetRunner(target.model, hybrid_kernels=TRANSFORMERS)
    for variant in variants.values():  # warm-up: Triton compiles and autotunes, cuBLAS
        plain_steps(variant, prompts[:1], new_tokens=5, use_graphs=True)
    result: dict = {"kernels": runner.hybrid_kernels.name, "new_tokens": new_tokens, "by_rows": {}}
    lines = []
    for count in rows:
        torch.cuda.empty_cache()
        try:
            entry, line = decode_rows(target, runner, variants, prompts[:count], new_tokens=new_tokens)
        except Exception as error:  # out of memory at the largest row count, say: the others are still reported
            traceback.print_exc()
            entry, line = {"error": f"{type(error).__name__}: {error}"}, f"{count} rows: ERROR {type(error).__name__}"
        result["by_rows"][count] = entry
        print(f"decode: {line}", flush=True)
        lines.append(line)
    result["summary"] = " | ".join(lines)
    return result


def decode_fp8_phase(target, *, rows: list[int], new_tokens: int) -> dict:
    """Plain decoding with CUDA graphs after the target's decoder linears are quantised to FP8 (`target.fp8`: e4m3
    weights per output row, activations per token; `targets/fp8.py`), per row count: half the weight bytes each step
    reads, twice the GEMM rate; and with bf16 recurrent states besides (`BF16_STATES`). Quantises `target` in place:
    run it after every bf16 phase."""
    import torch

    from dflash_trainer.decoding.target import TargetRunner
    from dflash_trainer.targets.capture import decoder_module
    from dflash_trainer.targets.fp8 import quantize_decoder_linears

    quantized = quantize_decoder_linears(decoder_module(target.model).layers)
    runner = TargetRunner(target.model)
    bf16_states = TargetRunner(target.model, recurrent_state_dtype=torch.bfloat16)
    generator = torch_generator(1)
    prompts = [random_prompt(generator) for _ in range(max(rows))]
    for variant in (runner, bf16_states):  # warm-up: compiles, autotunes, cuBLAS
        plain_steps(variant, prompts[:1], new_tokens=5, use_graphs=True)
    result: dict = {"quantized_linears": quantized, "new_tokens": new_tokens, "by_rows": {}}
    lines = []
    for count in rows:
        entry = attempt(plain_steps, runner, prompts[:count], new_tokens=new_tokens, use_graphs=True)
        entry[BF16_STATES] = attempt(plain_steps, bf16_states, prompts[:count], new_tokens=new_tokens, use_graphs=True)
        compare_outputs(entry[BF16_STATES], entry.pop("outputs", None))
        result["by_rows"][count] = entry
        line = f"{count} rows: " + (
            f"{entry['ms_per_step']:.1f} ms/step = {entry['tokens_per_s']:,.0f} tok/s with CUDA graphs, FP8 target,"
            f" peak {entry['peak_gib']:.1f} GiB"
            if "error" not in entry
            else f"ERROR {entry['error']}"
        )
        line += f"; bf16 states {rate_and_peak(entry[BF16_STATES])}"
        print(f"decode_fp8: {line}", flush=True)
        lines.append(line)
    result["summary"] = " | ".join(lines)
    return result


def torch_generator(seed: int):
    import torch

    return torch.Generator().manual_seed(seed)


def random_prompt(generator) -> list[int]:
    import torch

    return torch.randint(0, PROMPT_VOCAB, (PROMPT_TOKENS,), generator=generator).tolist()


def decode_rows(target, runner, variants: dict, prompts: list[list[int]], *, new_tokens: int) -> tuple[dict, str]:
    """The decode phase at one row count (`len(prompts)` rows): its JSON entry and its summary line. The engine's own
    variant (graphs) runs first and must succeed; every other measurement that fails (out of memory at the largest
    row count, say) is recorded as its error and the rest still run."""
    count = len(prompts)
    entry = {"graphs": plain_steps(runner, prompts, new_tokens=new_tokens, use_graphs=True)}
    others = {
        name: variant
        for name, variant in variants.items()
        if name != "graphs" and (count <= COMPARISON_ROWS or name == BF16_STATES)
    }
    for name, variant in others.items():
        entry[name] = attempt(plain_steps, variant, prompts, new_tokens=new_tokens, use_graphs=True)
    if count <= COMPARISON_ROWS:
        entry["eager"] = attempt(plain_steps, runner, prompts, new_tokens=new_tokens, use_graphs=False)
    entry["profile"] = attempt(profile_decode_step, runner, count)
    entry["state_update"] = attempt(state_update_bandwidth, runner, count)
    if count <= SPECULATIVE_ROWS:
        entry["speculative"] = attempt(speculative_check, target, prompts, entry["graphs"]["outputs"])
    reference = entry["graphs"]["outputs"]
    for name in (*variants, "eager"):  # rows whose output equals the engine's with graphs (bf16: near-ties part)
        if name in entry and name != "graphs":
            compare_outputs(entry[name], reference)
    del entry["graphs"]["outputs"]  # the reference itself: not kept in the results
    graphs, profile = entry["graphs"], entry["profile"]
    compared = [name for name in (*others, "eager") if name in entry]
    timings = ", ".join(
        f"bf16 states {rate_and_peak(entry[name])}"
        if name == BF16_STATES
        else f"{ms_or_error(entry[name])} {name.removeprefix('graphs, ')}"
        for name in compared
    )
    line = (
        f"{count} rows: {graphs['ms_per_step']:.1f} ms/step = {graphs['tokens_per_s']:,.0f} tok/s with CUDA graphs,"
        f" peak {graphs['peak_gib']:.1f} GiB" + (f" ({timings})" if timings else "")
    )
    if "error" in profile:
        line += f"; profile {profile['error']}"
    else:
        line += (
            f"; an eager step's kernels busy {profile['busy_ms']:.1f} ms in {profile['kernel_launches']:.0f} kernels ("
            + ", ".join(f"{name} {ms:.1f}" for name, ms in profile["classes_ms"].items())
            + ")"
        )
    line += f"; state update {summary_or_error(entry['state_update'])}"
    if "speculative" in entry:
        line += f"; {summary_or_error(entry['speculative'])}"
    return entry, line


def attempt(measure, *args, **kwargs) -> dict:
    """`measure(*args, **kwargs)`, or {"error": ...} when it raises (its memory released first)."""
    import gc

    import torch

    try:
        return measure(*args, **kwargs)
    except Exception as error:  # recorded in the results; the remaining measurements still run
        gc.collect()
        torch.cuda.empty_cache()
        return {"error": f"{type(error).__name__}: {str(error)[:200]}"}


def summary_or_error(measurement: dict) -> str:
    return measurement.get("error") or measurement.get("summary", "")


def ms_or_error(measurement: dict) -> str:
    return f"{measurement['ms_per_step']:.1f} ms/step" if "error" not in measurement else measurement["error"][:40]


def rate_and_peak(measurement: dict) -> str:
    """ms per step, tokens/s, peak memory and the rows whose output equals the float32 states' (or the error)."""
    if "error" in measurement:
        return measurement["error"][:80]
    text = (
        f"{measurement['ms_per_step']:.1f} ms/step = {measurement['tokens_per_s']:,.0f} tok/s, peak "
        f"{measurement['peak_gib']:.1f} GiB"
    )
    if "rows_equal_to_graphs" in measurement:
        text += f", {measurement['rows_equal_to_graphs']}/{measurement['rows']} rows as with float32 states"
    return text


def compare_outputs(measurement: dict, reference: list[list[int]] | None) -> None:
    """Replaces a measurement's outputs by the number of rows equal to `reference` (the engine's own outputs with
    graphs; bf16 near-ties may part them)."""
    outputs = measurement.pop("outputs", None)
    if outputs is not None and reference is not None:
        measurement["rows_equal_to_graphs"] = sum(a == b for a, b in zip(outputs, reference, strict=True))


# Prompt length of the decode phase (the 2026-12-02 measurement: 25.5 ms per step at 8 rows, 512-token prompts),
# and the ids prompts are drawn from (the top rows spared: the drafter's mask token is the last).
PROMPT_TOKENS = 512
PROMPT_VOCAB = QWEN36_27B["vocab_size"] - 4096
# Row counts up to which the decode phase also times the other kernel variants and eager decoding (each one more
# prefill of every row: ~15 s at 256 rows of this shape; measured at 8 and 64 rows on 2026-12-02).
COMPARISON_ROWS = 64
# The decode variant timed at every row count (the others up to COMPARISON_ROWS): the engine with bf16 recurrent
# states (`target.recurrent_state_dtype`), half the state traffic that dominates a step at many rows.
BF16_STATES = "graphs, bf16 states"
# Row counts up to which the decode phase also runs speculative decoding (its verify step keeps each linear layer's
# block inputs until the commit: about 12 GB more at 256 rows of this shape).
SPECULATIVE_ROWS = 64
# Kernel classes of the eager step's profile, by a piece of the kernel's name (first match; the rest: "other").
# Attention before convolution: cuDNN's attention kernels are named `cudnn_generated_fort_native_sdpa_..._flash_...`.
KERNEL_CLASSES = (
    ("gemm", ("gemm", "gemv", "cutlass", "sm90_xmma", "nvjet", "splitk")),
    ("delta rule", ("gated_delta_rule", "fused_recurrent", "chunk_")),
    ("attention", ("sdpa", "fmha", "flash", "attention", "efficient")),
    ("conv", ("causal_conv1d", "conv_depthwise", "depthwise", "conv1d", "cudnn")),
)


def plain_steps(runner, prompts: list[list[int]], *, new_tokens: int, use_graphs: bool) -> dict:
    """Plain greedy decoding of `prompts` as the rows of one batch: ms per decode step over the steps after the
    prefill, leaving out each CUDA graph's first step (eager, with its capture)."""
    import torch

    from dflash_trainer.decoding.batch import BatchDecoder, Request, RequestQueue

    decoder = BatchDecoder(
        runner,
        rows=len(prompts),
        max_new_tokens=new_tokens,
        stop_token_ids=[],
        max_len=PROMPT_TOKENS + new_tokens,
        use_graphs=use_graphs,
        refill_min=len(prompts),
    )
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    queue = RequestQueue([Request(index, prompt) for index, prompt in enumerate(prompts)])
    outputs = {completion.key: completion.tokens for completion in decoder.generate(queue)}
    stats = decoder.stats
    peak_gib = torch.cuda.max_memory_allocated() / 2**30
    timed = stats.steps - decoder.graphs.captured
    ms = 1e3 * stats.decode_s / timed
    return {
        "rows": len(prompts),
        "ms_per_step": ms,
        "tokens_per_s": len(prompts) * 1e3 / ms,
        "steps": stats.steps,
        "timed_steps": timed,
        "graphs_captured": decoder.graphs.captured,
        "capture_s": stats.capture_s,
        "prefill_s": stats.prefill_s,
        "peak_gib": peak_gib,
        "outputs": [outputs[index] for index in range(len(prompts))],
    }


def profile_decode_step(runner, rows: int) -> dict:
    """One eager decode forward at `rows` rows over 512 cached positions (zero states and cache: kernel times do not
    depend on the values), kernel time by class (`KERNEL_CLASSES`) and the top kernels."""
    import torch

    from dflash_trainer.kernel_profile import profile_kernels

    kv_len = PROMPT_TOKENS + 128
    cache = runner.new_cache(rows, kv_len)
    tokens = torch.zeros(rows, 1, dtype=torch.long, device=runner.device)
    positions = torch.full((rows, 1), PROMPT_TOKENS, dtype=torch.long, device=runner.device)

    def step() -> None:
        runner.forward(cache, tokens, positions, kv_len=kv_len)

    step()  # warm-up
    profile = profile_kernels(step, steps=2, device=runner.device, top=400)
    classes = {name: 0.0 for name, _ in KERNEL_CLASSES} | {"other": 0.0}
    for kernel in profile.kernels:
        name = kernel.name.lower()
        kind = next((kind for kind, keys in KERNEL_CLASSES if any(key in name for key in keys)), "other")
        classes[kind] += kernel.ms_per_step
    launches = sum(kernel.calls_per_step for kernel in profile.kernels)
    return {
        "busy_ms": profile.busy_ms_per_step,
        "kernel_launches": launches,
        "classes_ms": classes,
        "top": [(k.name, round(k.ms_per_step, 3), k.calls_per_step) for k in profile.kernels[:12]],
    }


def state_update_bandwidth(runner, rows: int) -> dict:
    """The linear layers' one-token delta-rule update at `rows` rows, alone: the engine's (in place with fla) and
    the public fused recurrent kernel plus a copy into the static state (what the engine did before), in GB/s of
    state read and written; in place on a bf16 state too (half the bytes); and fla's kernel with other tiles
    (columns per program x warps, `hybrid_kernels.AdvanceTile`) on both state dtypes, the best of each named."""
    from functools import partial

    import torch

    from dflash_trainer.decoding.hybrid_kernels import AdvanceTile, fla_advance

    tile_sweep = [
        AdvanceTile(*tile) for tile in ((8, 1), (16, 1), (16, 2), (32, 1), (32, 2), (32, 4), (64, 2), (64, 4))
    ]
    dtype_names = {torch.float32: "float32", torch.bfloat16: "bf16"}

    shape = next(iter(runner.linear_shapes.values()))
    layers = len(runner.linear_shapes)
    device = runner.device
    state = torch.zeros(rows, shape.value_heads, shape.key_dim, shape.value_dim, device=device)
    q, k, v = (torch.randn(rows, 1, shape.value_heads, shape.key_dim, device=device, dtype=runner.dtype) for _ in "qkv")
    g = -torch.rand(rows, 1, shape.value_heads, device=device)
    beta = torch.rand(rows, 1, shape.value_heads, device=device, dtype=runner.dtype)
    bf16_state = state.to(torch.bfloat16)
    runs = {}  # name -> (update, the state it reads and writes)
    if runner.hybrid_kernels.advance is not None:
        runs["in_place"] = (lambda: runner.hybrid_kernels.advance(q, k, v, g, beta, state, True), state)
        runs["in_place_bf16"] = (lambda: runner.hybrid_kernels.advance(q, k, v, g, beta, bf16_state, True), bf16_state)
    if runner.hybrid_kernels.advance is fla_advance:  # other tiles of the same kernel, on both state dtypes
        for tile in tile_sweep:
            for updated in (state, bf16_state):
                name = f"tile_{dtype_names[updated.dtype]}_{tile.block_v}x{tile.num_warps}"
                runs[name] = (partial(fla_advance, q, k, v, g, beta, updated, True, tile), updated)
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

        def public_and_copy() -> None:
            _, final = fused_recurrent_gated_delta_rule(
                q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
            )
            state.copy_(final)

        runs["public_and_copy"] = (public_and_copy, state)
    except ImportError:
        pass
    result: dict = {"state_gb_per_layer": state.numel() * 4 / 1e9}
    for name, (run, updated) in runs.items():
        run()
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(10):
            run()
        torch.cuda.synchronize(device)
        ms = (time.perf_counter() - start) * 1e3 / 10
        result[name] = {"ms_per_layer": ms, "ms_per_step": ms * layers, "gb_per_s": 2 * updated.nbytes / ms / 1e6}
    measured = {name: value for name, value in result.items() if isinstance(value, dict)}
    result["summary"] = ", ".join(
        f"{name} {value['ms_per_step']:.1f} ms/step ({value['gb_per_s']:,.0f} GB/s of state read+written)"
        for name, value in measured.items()
        if not name.startswith("tile_")
    )
    for dtype_name in dtype_names.values():
        tiles = {name: value for name, value in measured.items() if name.startswith(f"tile_{dtype_name}_")}
        if tiles:
            best = min(tiles, key=lambda name: tiles[name]["ms_per_step"])
            result["summary"] += (
                f"; best {dtype_name} tile {best.rsplit('_', 1)[1]} {tiles[best]['ms_per_step']:.1f} ms/step"
            )
    return result


def speculative_check(target, prompts: list[list[int]], plain: list[list[int]]) -> dict:
    """Speculative decoding with a random 5-layer block-16 drafter (tau about 1) of the same prompts: ms per verify
    step and whether its output equals the plain one. bf16 near-ties may differ: a verify block and a one-token
    step round differently (with fla also different kernels, chunked vs fused recurrent), and a random target's
    logits are nearly flat, so per row the common prefix of the two outputs (= the new-token index where they
    first part) is reported, and at that index the evaluation's lossless check (`eval.runner.verify_lossless`: the
    target's own forward over the common prefix) says whether the two tokens are a near-tie (both logits within 4
    bf16 rounding steps of the top one; their gap to the top logit is reported) or not. Parting within the first
    few tokens on every row (token 2 is the first a rollback touches) with no near-ties points at the
    recurrent-state rollback; parting late at near-ties is rounding drift."""
    import torch

    from dflash_trainer.decoding.speculative import SpeculativeDecoder
    from dflash_trainer.model.config import DrafterModelConfig
    from dflash_trainer.model.drafter import DFlashDrafter

    new_tokens = len(plain[0])
    mask = target.model.config.vocab_size - 1
    config = DrafterModelConfig.from_target(
        target.model.config, num_layers=5, block_size=16, mask_token_id=mask, target_layer_ids=TAPS
    )
    torch.manual_seed(0)
    drafter = DFlashDrafter(config).to(target.device, torch.bfloat16).eval()
    run = SpeculativeDecoder(target.model, drafter, prompts, max_new_tokens=new_tokens, stop_token_ids=[]).run()
    verify_steps = max(len(r.accepted_lengths) for r in run.results)
    verify_ms = 1e3 * run.decode_s / max(1, verify_steps - run.graphs_captured)
    same = sum(p == s.output_ids for p, s in zip(plain, run.results, strict=True))
    tau = statistics.mean(r.tau for r in run.results)
    partings = [
        parting(target.model, index, prompt, p, s.output_ids)
        for index, (prompt, p, s) in enumerate(zip(prompts, plain, run.results, strict=True))
    ]
    prefixes = [row["common_prefix"] for row in partings]
    parted = [row for row in partings if row["first_divergence"] is not None]
    ties = [row for row in parted if row["near_tie"]]
    gaps = f" (gaps to the top logit up to {max(row['logit_gap'] for row in ties):.3g})" if ties else ""
    rows = len(prompts)
    return {
        "verify_ms_per_step": verify_ms,
        "tau": tau,
        "identical_outputs": same,
        "common_prefix": {"min": min(prefixes), "median": statistics.median(prefixes), "max": max(prefixes)},
        "near_tie_partings": len(ties),
        "rows_detail": partings,
        "summary": f"verify step (block 16 + commit + draft) {verify_ms:.1f} ms, random drafter tau {tau:.2f}, "
        f"speculative == plain on {same}/{rows} rows, common prefix (= first divergence) min/median/max "
        f"{min(prefixes)}/{statistics.median(prefixes):g}/{max(prefixes)} of {new_tokens} new tokens, "
        f"{len(ties)}/{len(parted)} partings near-ties{gaps}",
    }


def parting(model, index: int, prompt: list[int], plain: list[int], speculative: list[int]) -> dict:
    """Where one row's speculative output parts from its plain one and, if it does, whether the two tokens are a
    near-tie there by the evaluation's lossless check (its LosslessError message says by how much they are not)."""
    import torch

    from dflash_trainer.eval.runner import LosslessError, first_difference, verify_lossless

    position = first_difference(plain, speculative)
    if position is None:
        return {"first_divergence": None, "common_prefix": len(plain)}
    row = {"first_divergence": position, "common_prefix": position}
    try:
        tie = verify_lossless(
            prompt_id=str(index),
            target_model=model,
            input_ids=torch.tensor([prompt], device=model.device),
            target_ids=plain,
            speculative_ids=speculative,
        )
    except LosslessError as error:
        return {**row, "near_tie": False, "detail": str(error)}
    return {**row, "near_tie": True, "logit_gap": tie.logit_gap, "tolerance": tie.tolerance}


PHASES = ("forward", "train", "decode", "decode_fp8")


def row_counts(text: str) -> list[int]:
    counts = [int(part) for part in text.split(",")]
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"row counts must be positive integers, got {text!r}")
    return counts


def phase_names(text: str) -> list[str]:
    names = text.split(",")
    unknown = sorted(set(names) - set(PHASES))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown phases {unknown}; expected some of {','.join(PHASES)}")
    return names


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheels", type=Path, default=REPO / ".whl", help="where fla_core-*.whl and einops-*.whl are")
    parser.add_argument(
        "--rows",
        type=row_counts,
        default=[8],
        help="prompts decoded together in the decode phase, one or several comma-separated row counts (8,64,256)",
    )
    parser.add_argument("--phases", type=phase_names, default=list(PHASES), help=f"some of {','.join(PHASES)}")
    parser.add_argument(
        "--child-timeout",
        type=int,
        default=110,
        help="seconds per child (on 2026-11-30 fla's first forward, with Triton's autotuning, used up 110 s)",
    )
    parser.add_argument(
        "--kernels", default="fla,torch", choices=["fla,torch", "fla", "torch"], help="which children to run"
    )
    parser.add_argument("--compile", action="store_true", help="compile the drafter layers and the loss (slower start)")
    parser.add_argument(
        "--documents",
        default="paper",
        choices=["paper", "real"],
        help="the train phase's documents: 3072 + 3072 + 2048 per row, or shaped like the math-first GPU recipe's "
        "data (about 33 of 30-488 tokens per 8192-token row: per-document groups of many sizes)",
    )
    parser.add_argument("--child", choices=["fla", "torch"], help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        run_child(
            args.child,
            args.child_out,
            rows=args.rows,
            compile_drafter=args.compile,
            documents=args.documents,
            only=args.phases,
        )
        return 0
    return run_children(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
