"""The model card (`README.md`) of an export: what the drafter is, how to serve it, what it was trained on.

Written from the export's own `config.json` (the keys the engines read plus the records of `provenance.py`) and,
when there is one, an evaluation report of these very weights (`eval.json` whose `drafter_digest` equals the
export's): the same export always gets the same card, and no card shows numbers measured on other weights. The
layout follows the drafter cards published with DFlash checkpoints: what it is and which target it pairs with,
serving commands for vLLM and SGLang, the drafter's settings, held-out acceptance, the training data with the
licences of its sources, and how it was made. Nothing in it is a path of the training machine.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .provenance import SOURCE_KEY, TARGET_KEY, TRAINING_KEY, portable_path

CARD_FILE = "README.md"
# Built-in targets (`targets/loader.py`), named here without importing transformers.
_BUILTIN_NAMES = ("smollm2-135m",)


def has_training_record(config: Mapping[str, Any]) -> bool:
    """An export this package wrote with its records (z-lab's and older ones have none: no card for them)."""
    return isinstance(config.get(TRAINING_KEY), Mapping)


def matching_evaluation(config: Mapping[str, Any], evaluation: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """`evaluation` when it is a complete report of the export's own weights drafting as served, else None (a DFlash2
    report with `argmax_drafts` is a diagnostic of the same weights, not their result)."""
    training = config.get(TRAINING_KEY) or {}
    digest = training.get("weights_digest")
    if not evaluation or not digest or evaluation.get("drafter_digest") != digest or evaluation.get("argmax_drafts"):
        return None
    return evaluation if evaluation.get("datasets") else None


def render(config: Mapping[str, Any], evaluation: Mapping[str, Any] | None = None) -> str:
    """The card's Markdown."""
    target = config.get(TARGET_KEY) or {}
    training = config.get(TRAINING_KEY) or {}
    source = config.get(SOURCE_KEY) if isinstance(config.get(SOURCE_KEY), Mapping) else {}
    dflash = config.get("dflash_config") or {}
    block = int(config["block_size"])
    target_name = target.get("name") or "the target it was trained with"
    serve_target = _serve_name(target)
    evaluation = matching_evaluation(config, evaluation)
    lines = [
        "---",
        "tags:",
        "- dflash",
        "- speculative-decoding",
        "- dflash-trainer",
        "---",
        "",
        f"# DFlash drafter for {target_name} (block {block}{_run_suffix(source)})",
        "",
        f"A [DFlash](https://arxiv.org/abs/2602.06036) drafter for **{target_name}**, trained with dflash-trainer. "
        "DFlash is speculative decoding with a small block-diffusion model: the drafter reads hidden states of a "
        f"few target layers and drafts a block of {block - 1} tokens in one forward pass; the target verifies the "
        "block in one pass, so the output is exactly the target's own.",
        "",
        f"This is the drafter only. It must be served together with its target, {_describe_target(target)}.",
        "",
        "## Serving",
        "",
        (
            f"Replace `{serve_target}` with the target (a Hugging Face id or a local copy) and "
            if serve_target == "TARGET"
            else "Replace "
        )
        + "`DRAFTER` with the path of this directory.",
        "",
        "vLLM:",
        "",
        "```bash",
        f"vllm serve {serve_target} \\",
        f'  --speculative-config \'{{"method": "dflash", "model": "DRAFTER", "num_speculative_tokens": {block - 1}}}\'',
        "```",
        "",
        "SGLang:",
        "",
        "```bash",
        "python -m sglang.launch_server \\",
        f"    --model-path {serve_target} \\",
        "    --speculative-algorithm DFLASH \\",
        "    --speculative-draft-model-path DRAFTER \\",
        f"    --speculative-num-draft-tokens {block}",
        "```",
        "",
        "These follow the engines' documented DFlash options; dflash-trainer checks the checkpoint format these "
        "engines read and evaluates the drafter with its own decoding engine (below), not with a running server.",
        "",
        "## Drafter",
        "",
        "| setting | value |",
        "|---|---|",
        f"| block size | {block} ({block - 1} drafted tokens per step) |",
        f"| target layers read (taps, 0-indexed) | {list(dflash.get('target_layer_ids') or [])} of "
        f"{config.get('num_target_layers')} |",
        f"| drafter layers | {config.get('num_hidden_layers')} ({_layer_kinds(config)}) |",
        f"| hidden size, heads, MLP size | {config.get('hidden_size')}, {config.get('num_attention_heads')} "
        f"({config.get('num_key_value_heads')} KV), {config.get('intermediate_size')} |",
        f"| mask token id | {dflash.get('mask_token_id')} |",
        f"| weights | `model.safetensors` ({config.get('dtype')}); embedding and LM head are the target's |",
        "",
    ]
    lines += _evaluation_section(evaluation, block)
    lines += _data_section(training.get("data"))
    lines += _provenance_section(training, source, target)
    return "\n".join(lines).rstrip() + "\n"


def _run_suffix(source: Mapping[str, Any]) -> str:
    return f", run {source['run']}" if source.get("run") else ""


def _serve_name(target: Mapping[str, Any]) -> str:
    recorded = target.get("name_or_path")
    if recorded and recorded.count("/") == 1 and not recorded.startswith((".", "/", "~")):
        return recorded  # a hub id
    return "TARGET"


def _describe_target(target: Mapping[str, Any]) -> str:
    if not target:
        return "the target model it was trained for (not recorded in this export)"
    recorded = target.get("name_or_path")
    how = f" (loaded by dflash-trainer as `{recorded}`)" if recorded and recorded != target.get("name") else ""
    return (
        f"**{target.get('name')}**{how}: {target.get('architecture')}, {target.get('num_hidden_layers')} layers, "
        f"hidden size {target.get('hidden_size')}, {target.get('vocab_size')} vocabulary rows, tokenizer vocabulary "
        f"`{str(target.get('tokenizer_fingerprint'))[:23]}...` (`target_record` in config.json); "
        "`dflash-trainer eval --drafter` checks a target against this record"
        + (
            f". A local copy of the built-in `{recorded}` is the safetensors directory dflash-trainer converts it to, "
            f"`targets/{recorded}` in its cache (`~/.cache/dflash-trainer` unless `$DFLASH_TRAINER_CACHE` is set)"
            if recorded in _BUILTIN_NAMES
            else ""
        )
    )


def _layer_kinds(config: Mapping[str, Any]) -> str:
    kinds = list(config.get("layer_types") or [])
    sliding = kinds.count("sliding_attention")
    if not sliding:
        return "full attention"
    return f"{sliding} sliding-window ({config.get('sliding_window')}), {len(kinds) - sliding} full attention"


def _evaluation_section(evaluation: Mapping[str, Any] | None, block: int) -> list[str]:
    lines = ["## Acceptance on held-out prompts", ""]
    if evaluation is None:
        return [
            *lines,
            "No evaluation of these weights was recorded when this card was written; "
            "`dflash-trainer eval --drafter path/to/this/directory` measures one and updates this card.",
            "",
        ]
    lines += [
        f"Greedy decoding, at most {evaluation.get('max_new_tokens')} new tokens per prompt, target in "
        f"{evaluation.get('dtype')}, block {evaluation.get('block_size', block)}, measured by "
        "`dflash-trainer eval` (its own decoding engine). tau: tokens committed per target forward, pooled over all "
        "steps (and the mean over prompts). Speed-up: decode tokens/s with the drafter over without, at the batch "
        "shown (an indication; a serving engine measures what users get).",
        "",
        "| prompt set | prompts | tau pooled (per prompt) | speed-up | lossless |",
        "|---|---|---|---|---|",
    ]
    for data in evaluation.get("datasets") or []:
        speeds = data.get("throughput") or [
            {"batch_rows": data.get("batch_rows"), "speedup": data.get("speedup"), "cuda_graphs": False}
        ]
        speed_text = ", ".join(f"{s['speedup']:.2f}x at batch {s['batch_rows']}" for s in speeds)
        lossless = (
            f"{data.get('exact_matches')}/{data.get('num_prompts')} identical"
            if data.get("lossless_checked")
            else "not checked"
        )
        lines.append(
            f"| {portable_path(str(data.get('name')))} | {data.get('num_prompts')} | {data.get('tau', 0.0):.2f} "
            f"({data.get('tau_per_prompt', 0.0):.2f}) | {speed_text} | {lossless} |"
        )
    return [*lines, ""]


def _data_section(data: Mapping[str, Any] | None) -> list[str]:
    lines = ["## Training data", ""]
    if not data or not data.get("source"):
        return [*lines, "Shards prepared outside the run (`data.train_shards`); their source is not recorded.", ""]
    limit = f"the first {data['limit']:,} prompts of " if data.get("limit") else ""
    answered = (
        f", answered by the target itself (greedy, at most {data.get('max_new_tokens')} new tokens per reply)"
        if data.get("answered_by_target")
        else ", with the replies the prompt set gives"
    )
    lines.append(f"{limit.capitalize() or 'Prompts of '}`{data['source']}`{answered}.")
    if data.get("num_tokens"):
        lines.append(
            f"Tokenised: {data.get('num_samples', 0):,} samples, {data['num_tokens']:,} tokens, "
            f"{data.get('num_loss_tokens', 0):,} of them in replies (trained on)."
        )
    sets = data.get("sets") or []
    if sets:
        lines += ["", "| prompt set | pip package | licence |", "|---|---|---|"]
        lines += [f"| {s['name']} | `{s['package']}` | {s['licence']} |" for s in sets]
        lines += ["", "Sub-sets may carry their own licences (dflash-trainer's README, Prompt sets)."]
    else:
        lines.append("A prompt file of the user's own: its licence is the user's to state.")
    return [*lines, ""]


def _provenance_section(training: Mapping[str, Any], source: Mapping[str, Any], target: Mapping[str, Any]) -> list[str]:
    lines = ["## How it was made", ""]
    command = training.get("command")
    if command:
        ranks = training.get("ranks") or 1
        on = f"{ranks} ranks (`--nproc {ranks}`)" if ranks > 1 else "one process"
        lines += ["```bash", command, "```", "", f"On {on}, dflash-trainer {training.get('dflash_trainer_version')}."]
    else:
        lines.append(f"Exported by dflash-trainer {training.get('dflash_trainer_version')}.")
    if source:
        lines.append(
            f"Run `{source.get('run')}`; training config digest `{source.get('config_sha256') or 'not recorded'}` "
            "(of the resolved config saved as `config.yaml` in the run's checkpoints)."
        )
    if training.get("steps"):
        lines.append(f"{training['steps']:,} optimizer steps.")
    return [*lines, ""]
