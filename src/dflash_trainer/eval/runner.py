"""Evaluate a drafter against its target: tau, accepted-length histogram, speedup, lossless check.

For every dataset (a prompt-set name or a JSONL path, `data/prompts.py`), the chat template is applied to each
prompt with the generation prompt; then the target decodes the prompts alone (baseline) and with the drafter,
both through the decoding engine (`decoding/`: static KV cache, CUDA graphs on a GPU), the prompts of a dataset
decoded together as the rows of one batch (and, for timing, one prompt at a time too; see below).

Per dataset the report gives
- tau, two ways: pooled over every decoding step of every prompt (tokens committed / target forwards after the
  prefill) and the mean over prompts of each prompt's own tau (z-lab's benchmark headline). A step's committed
  count is what was kept: cut after a stop token and at `max_new_tokens` (the last block of a prompt often
  commits fewer tokens than were accepted);
- the histogram of committed lengths 1..B over all steps;
- decode throughput with and without the drafter and their ratio (the speedup), per batch size: by default at
  batch 1 (one request at a time: the latency a single user sees, where speculative decoding gains most) and
  with all prompts of the set as one batch; `batch_size` picks one. tau, the histogram and the lossless check
  come from the largest batch. Throughput is over the decoding phase only (tokens after each prompt's first /
  time after the prefill; CUDA graph captures excluded): the prefill is the same computation in both runs. On a
  GPU every step replays a CUDA graph (`cuda_graphs` in the report). This is an indication: a serving engine
  (vLLM, SGLang) measures the speed-up users get;
- the lossless check (temperature 0 only). Every speculative output must equal the target-only greedy output.
  On a difference the target is run on the common prefix and its logits at the divergence point are inspected
  (DESIGN "Lossless check precision"): in float32 any difference raises `LosslessError`; in bf16/fp16 a
  difference where both tokens are within `near_tie_ulps` rounding steps of the target's top logit is a
  *near-tie divergence* (one-token decoding and block verification use different kernel shapes, which may
  round a near-tie either way) and is reported, anything else raises `LosslessError`. With bf16 recurrent states
  (`recurrent_state_dtype`, a hybrid target) the check is that of a bf16 target: the states round differently in
  the two runs (`decoding/recurrent.py` "State dtype").

Outputs in `out_dir`: `eval.json` (the report) and `accepted_lengths.png` (the histograms), rewritten after every
dataset, so a failure in a later dataset keeps the finished ones (`complete` says whether all ran).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from matplotlib.figure import Figure
from torch import Tensor
from tqdm import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..data.chat import generation_prompt_ids
from ..data.prompts import Prompt, load_prompt_set, split_set_name
from ..decoding.batch import synchronized_time
from ..decoding.plain import target_generate_batch
from ..decoding.runs import BatchRun, GenerationResult
from ..decoding.sampling import SamplingParams, derive_seed
from ..decoding.speculative import SpeculativeDecoder
from ..model.drafter import DFlashDrafter
from ..provenance import drafter_digest
from ..targets.loader import LoadedTarget

REPORT_FILE = "eval.json"
HISTOGRAM_FILE = "accepted_lengths.png"
# A divergence counts as a near-tie when both tokens' logits are within this many rounding steps (machine
# epsilon of the target dtype, scaled by the top logit's magnitude) of the target's top logit.
NEAR_TIE_ULPS = 4.0
WARMUP_TOKENS = 8
_EXACT_DTYPES = (torch.float32, torch.float64)


class LosslessError(AssertionError):
    """Speculative decoding produced a token the target's greedy decoding would not have produced."""

    def __init__(
        self, message: str, *, prompt_id: str, position: int, target_token: int | None, speculative_token: int | None
    ) -> None:
        super().__init__(message)
        self.prompt_id = prompt_id
        self.position = position
        self.target_token = target_token
        self.speculative_token = speculative_token


@dataclass
class NearTieDivergence:
    prompt_id: str
    position: int  # index among the new tokens where the outputs first differ
    target_token: int
    speculative_token: int
    # Target's top logit minus the lower of the two tokens' logits, and the tolerance it was held to.
    logit_gap: float
    tolerance: float


@dataclass
class Throughput:
    """Decode speed of one batch size: prompts decoded together, tokens/s without and with the drafter."""

    batch_rows: int
    baseline_tokens_per_s: float
    speculative_tokens_per_s: float
    speedup: float
    cuda_graphs: bool  # the decoding steps replayed CUDA graphs (GPU)


@dataclass
class PromptTau:
    """One prompt's speculative decoding, so that a report can be cut by prompt or category after the fact."""

    id: str
    category: str | None  # the set's own category (MT-Bench's eight), None where it has none
    tau: float  # committed / steps
    committed: int  # tokens committed by the target forwards (the output less the prefill's first token)
    steps: int  # target forwards


@dataclass
class DatasetReport:
    name: str
    num_prompts: int
    new_tokens: int  # speculative outputs, all prompts
    tau: float  # pooled: committed tokens / decoding forwards, over all steps of all prompts
    tau_per_prompt: float  # mean over prompts of each prompt's tau
    # accepted_histogram[k-1]: target forwards that committed k tokens (k = 1..B).
    accepted_histogram: list[int]
    batch_rows: int  # prompts decoded together (the throughput below is at this batch size)
    baseline_tokens_per_s: float
    speculative_tokens_per_s: float
    speedup: float
    lossless_checked: bool
    exact_matches: int
    near_ties: list[NearTieDivergence] = field(default_factory=list)
    # Wall seconds of the two runs (prefill, decode and CUDA-graph captures) and of the lossless check.
    baseline_s: float = 0.0
    speculative_s: float = 0.0
    check_s: float = 0.0
    # One entry per batch size timed, largest first (the fields above repeat the first).
    throughput: list[Throughput] = field(default_factory=list)
    prompts: list[PromptTau] = field(default_factory=list)  # in the set's order


@dataclass
class EvalReport:
    target: str
    dtype: str
    block_size: int
    temperature: float
    max_new_tokens: int
    datasets: list[DatasetReport]
    complete: bool = True  # False while datasets remain (a report written after each dataset)
    # `provenance.drafter_digest` of the weights evaluated: a model card shows only reports of its own weights.
    drafter_digest: str = ""
    # The drafter's norms, MLPs (and DFlash2's convolutions and walk) compiled for decoding (`compile_drafter`).
    compiled_drafter: bool = False
    # A DFlash2 drafter drafting each slot's argmax, its selector unused (`DFlash2Drafter.argmax_drafts`): a
    # diagnostic, not what the engines serve.
    argmax_drafts: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def format_table(self) -> str:
        return format_table(self)


# ----------------------------------------------------------------------------------------------------------
# Lossless check


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or of the end of the shorter list), None when equal."""
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.inference_mode()
def verify_lossless(
    *,
    prompt_id: str,
    target_model: PreTrainedModel,
    input_ids: Tensor,  # [1, P]
    target_ids: list[int],
    speculative_ids: list[int],
    tokenizer: PreTrainedTokenizerBase | None = None,
    near_tie_ulps: float = NEAR_TIE_ULPS,
    state_dtype: torch.dtype | None = None,
) -> NearTieDivergence | None:
    """None when the outputs are identical; a near-tie record in reduced precision; else raises LosslessError.
    `state_dtype`: the decoders' recurrent states of a hybrid target, when coarser than the model dtype the
    precision the near-tie tolerance is taken in (None: the model dtype alone)."""
    position = first_difference(target_ids, speculative_ids)
    if position is None:
        return None
    target_token = target_ids[position] if position < len(target_ids) else None
    speculative_token = speculative_ids[position] if position < len(speculative_ids) else None
    dtype = target_model.get_input_embeddings().weight.dtype
    if state_dtype is not None and torch.finfo(state_dtype).eps > torch.finfo(dtype).eps:
        dtype = state_dtype  # the coarser of the two rounds the outputs apart
    detail = f"in {dtype}"
    if target_token is not None and speculative_token is not None:
        prefix = torch.tensor([target_ids[:position]], dtype=input_ids.dtype, device=input_ids.device)
        logits = target_model(input_ids=torch.cat([input_ids, prefix], dim=1), logits_to_keep=1).logits[0, -1].float()
        top = float(logits.max())
        gap = top - min(float(logits[target_token]), float(logits[speculative_token]))
        tolerance = 0.0 if dtype in _EXACT_DTYPES else near_tie_ulps * torch.finfo(dtype).eps * max(abs(top), 1.0)
        if gap <= tolerance and dtype not in _EXACT_DTYPES:
            return NearTieDivergence(prompt_id, position, target_token, speculative_token, gap, tolerance)
        detail = f"logit gap {gap:.4g} to the top logit, tolerance {tolerance:.4g} in {dtype}"
    raise LosslessError(
        f"prompt {prompt_id}: speculative output differs from the target's greedy output at new token {position}: "
        f"target {_describe(target_token, tokenizer)}, speculative {_describe(speculative_token, tokenizer)} "
        f"({detail})",
        prompt_id=prompt_id,
        position=position,
        target_token=target_token,
        speculative_token=speculative_token,
    )


def _describe(token: int | None, tokenizer: PreTrainedTokenizerBase | None) -> str:
    if token is None:
        return "<end of output>"
    if tokenizer is None:
        return str(token)
    return f"{token} {tokenizer.decode([token])!r}"


# ----------------------------------------------------------------------------------------------------------
# Evaluation


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: Prompt, device: torch.device) -> Tensor:
    """The prompt's messages through the chat template, with the assistant generation prompt: [1, P]."""
    return torch.tensor([prompt_token_ids(tokenizer, prompt)], dtype=torch.long, device=device)


def prompt_token_ids(tokenizer: PreTrainedTokenizerBase, prompt: Prompt) -> list[int]:
    (ids,) = generation_prompt_ids(tokenizer, [prompt.messages])
    if not ids:
        raise ValueError(f"prompt {prompt.id}: the chat template produced no tokens")
    return ids


def evaluate(
    target: LoadedTarget,
    drafter: DFlashDrafter,
    datasets: list[str],
    *,
    num_prompts: int,
    max_new_tokens: int,
    temperature: float = 0.0,
    out_dir: str | Path | None = None,
    check_lossless: bool = True,
    progress: bool = True,
    seed: int = 0,
    batch_size: int | None = None,
    recurrent_state_dtype: torch.dtype | None = None,
    compile_drafter: bool | None = None,
) -> EvalReport:
    """Run the evaluation described in the module docstring; write `eval.json` and the PNG to `out_dir` after
    every dataset. `batch_size`: prompts decoded together (None: timed at batch 1 and with all prompts of a
    dataset at once). `recurrent_state_dtype`: the decoders' delta-rule states of a hybrid target (None:
    float32). `compile_drafter`: compile the drafter's cache-free pieces first (`compile_for_decoding`: fewer
    kernels per decoding step; the drafter stays compiled, so pass one that is not trained further; None: on a GPU
    target only)."""
    if not datasets:
        raise ValueError("datasets: need at least one prompt set")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if compile_drafter is None:
        compile_drafter = target.device.type == "cuda"
    # `gsm8k` is its held-out test split; `NAME:SPLIT` names another split.
    prompt_sets = {name: load_prompt_set(*split_set_name(name, "test"), limit=num_prompts) for name in datasets}
    report = EvalReport(
        target=target.name,
        dtype=str(target.dtype).removeprefix("torch."),
        block_size=drafter.config.block_size,
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        datasets=[],
        complete=False,
        drafter_digest=drafter_digest(drafter.export_state_dict()),
        compiled_drafter=compile_drafter,
        argmax_drafts=not getattr(drafter, "walk_drafts", True),
    )
    if compile_drafter:
        # Compiled at each new shape's first eager run (the warm-up, a batch's prefill, a graph key's first step),
        # never while a CUDA graph is captured (`decoding/graphs.py`).
        drafter.compile_for_decoding()
    sampling = SamplingParams(temperature=temperature)
    was_training = drafter.training
    drafter.eval()
    try:
        _warm_up(target, drafter, next(iter(prompt_sets.values())), recurrent_state_dtype)
        for name, prompts in tqdm(
            prompt_sets.items(), desc="eval", unit="dataset", disable=not progress, dynamic_ncols=True
        ):
            report.datasets.append(
                _evaluate_dataset(
                    target,
                    drafter,
                    name,
                    prompts,
                    max_new_tokens=max_new_tokens,
                    sampling=sampling,
                    seed=seed,
                    check=check_lossless and sampling.greedy,
                    batch_sizes=[batch_size] if batch_size else [1, len(prompts)],
                    recurrent_state_dtype=recurrent_state_dtype,
                )
            )
            report.complete = len(report.datasets) == len(prompt_sets)
            if out_dir is not None:
                write_report(report, out_dir)
    finally:
        drafter.train(was_training)
    return report


def _warm_up(
    target: LoadedTarget, drafter: DFlashDrafter, prompts: list[Prompt], state_dtype: torch.dtype | None
) -> None:
    """One short run of each kind (library initialisation on the device is not timed)."""
    if not prompts:
        return
    ids = [prompt_token_ids(target.tokenizer, prompts[0])]
    common = dict(
        max_new_tokens=WARMUP_TOKENS,
        stop_token_ids=target.stop_token_ids,
        use_graphs=False,
        recurrent_state_dtype=state_dtype,
    )
    target_generate_batch(target.model, ids, **common)
    SpeculativeDecoder(target.model, drafter, ids, **common).run()


def _evaluate_dataset(
    target: LoadedTarget,
    drafter: DFlashDrafter,
    name: str,
    prompts: list[Prompt],
    *,
    max_new_tokens: int,
    sampling: SamplingParams,
    seed: int,
    check: bool,
    batch_sizes: list[int],
    recurrent_state_dtype: torch.dtype | None,
) -> DatasetReport:
    if not prompts:
        raise ValueError(f"prompt set {name!r}: no prompts")
    ids = [prompt_token_ids(target.tokenizer, prompt) for prompt in prompts]
    seeds = [derive_seed(seed, name, prompt.id) for prompt in prompts]
    common = dict(
        max_new_tokens=max_new_tokens,
        stop_token_ids=target.stop_token_ids,
        sampling=sampling,
        recurrent_state_dtype=recurrent_state_dtype,
    )
    sizes = sorted({min(size, len(prompts)) for size in batch_sizes}, reverse=True)
    # The largest batch gives the outputs (tau, lossless check); smaller ones are timed only.
    baseline_runs, speculative_runs = _decode(target, drafter, ids, seeds, common, sizes[0])
    throughput = [_throughput(baseline_runs, speculative_runs)]
    throughput += [_throughput(*_decode(target, drafter, ids, seeds, common, size)) for size in sizes[1:]]
    baselines = [result for run in baseline_runs for result in run.results]
    speculative = [result for run in speculative_runs for result in run.results]

    near_ties: list[NearTieDivergence] = []
    exact = 0
    check_s = 0.0
    if check:
        start_time = synchronized_time(target.device)
        for prompt, prompt_ids, baseline, result in zip(prompts, ids, baselines, speculative, strict=True):
            near_tie = verify_lossless(
                prompt_id=prompt.id,
                target_model=target.model,
                input_ids=torch.tensor([prompt_ids], device=target.device),
                target_ids=baseline.output_ids,
                speculative_ids=result.output_ids,
                tokenizer=target.tokenizer,
                state_dtype=recurrent_state_dtype,
            )
            if near_tie is None:
                exact += 1
            else:
                near_ties.append(near_tie)
        check_s = synchronized_time(target.device) - start_time

    histogram = [0] * drafter.config.block_size
    for result in speculative:
        for length in result.accepted_lengths:
            histogram[length - 1] += 1
    steps = sum(histogram)
    committed = sum(length * count for length, count in enumerate(histogram, start=1))
    per_prompt = [result.tau for result in speculative if result.accepted_lengths]
    return DatasetReport(
        name=name,
        num_prompts=len(prompts),
        new_tokens=sum(len(result.output_ids) for result in speculative),
        tau=committed / steps if steps else 0.0,
        tau_per_prompt=sum(per_prompt) / len(per_prompt) if per_prompt else 0.0,
        accepted_histogram=histogram,
        batch_rows=throughput[0].batch_rows,
        baseline_tokens_per_s=throughput[0].baseline_tokens_per_s,
        speculative_tokens_per_s=throughput[0].speculative_tokens_per_s,
        speedup=throughput[0].speedup,
        lossless_checked=check,
        exact_matches=exact,
        near_ties=near_ties,
        baseline_s=sum(run.wall_s for run in baseline_runs),
        speculative_s=sum(run.wall_s for run in speculative_runs),
        check_s=check_s,
        throughput=throughput,
        prompts=[
            PromptTau(
                id=prompt.id,
                category=prompt.category,
                tau=result.tau,
                committed=sum(result.accepted_lengths),
                steps=len(result.accepted_lengths),
            )
            for prompt, result in zip(prompts, speculative, strict=True)
        ],
    )


def _decode(
    target: LoadedTarget,
    drafter: DFlashDrafter,
    ids: list[list[int]],
    seeds: list[int],
    common: dict[str, Any],
    batch_size: int,
) -> tuple[list[BatchRun], list[BatchRun]]:
    """The prompts decoded `batch_size` at a time, by the target alone and with the drafter."""
    baseline_runs: list[BatchRun] = []
    speculative_runs: list[BatchRun] = []
    for start in range(0, len(ids), batch_size):
        chunk, chunk_seeds = ids[start : start + batch_size], seeds[start : start + batch_size]
        baseline_runs.append(target_generate_batch(target.model, chunk, seeds=chunk_seeds, **common))
        speculative_runs.append(SpeculativeDecoder(target.model, drafter, chunk, seeds=chunk_seeds, **common).run())
    return baseline_runs, speculative_runs


def _throughput(baseline_runs: list[BatchRun], speculative_runs: list[BatchRun]) -> Throughput:
    baseline_rate = _decode_rate(baseline_runs)
    speculative_rate = _decode_rate(speculative_runs)
    return Throughput(
        batch_rows=max(run.rows for run in speculative_runs),
        baseline_tokens_per_s=baseline_rate,
        speculative_tokens_per_s=speculative_rate,
        speedup=speculative_rate / baseline_rate if baseline_rate > 0 else 0.0,
        cuda_graphs=any(run.graphs_captured > 0 for run in [*baseline_runs, *speculative_runs]),
    )


def _decode_rate(runs: list[BatchRun]) -> float:
    """Tokens per second of the decoding phase: tokens after each prompt's first over time after the prefill."""
    tokens = sum(len(result.output_ids) - 1 for run in runs for result in run.results)
    seconds = sum(run.decode_s for run in runs)
    return tokens / seconds if seconds > 0 else 0.0


@dataclass(frozen=True)
class QuickTau:
    """Greedy tau of one quick evaluation: over every decoding step of every prompt, and per prompt set (each set's
    own steps, pooled the same way; keys from `set_metric_key`, in the order the sets were named; empty when the
    prompts were given directly)."""

    pooled: float
    per_set: dict[str, float]


def quick_tau(
    target: LoadedTarget,
    drafter: DFlashDrafter,
    *,
    datasets: list[str] | None = None,
    prompts: list[Prompt] | None = None,
    num_prompts: int = 8,
    max_new_tokens: int = 64,
) -> QuickTau:
    """Greedy tau pooled over a few prompts (given, or the first `num_prompts` of each dataset), decoded as one
    batch without a baseline run: for periodic evaluation during training. Eager (no CUDA graphs: the
    training drafter may be compiled). The drafter's train/eval mode is restored afterwards."""
    sets: list[tuple[str, int]] = []  # (metric key, prompts) in decoding order
    if prompts is None:
        if not datasets:
            raise ValueError("quick_tau: pass prompts or datasets")
        prompts = []
        for name in datasets:
            # `NAME:SPLIT` as `evaluate` and the pre-training check read it (`gsm8k` alone is its held-out test split).
            loaded = load_prompt_set(*split_set_name(name, "test"), limit=num_prompts)
            sets.append((set_metric_key(name, taken=[key for key, _ in sets]), len(loaded)))
            prompts.extend(loaded)
    was_training = drafter.training
    drafter.eval()
    # The training drafter's layers may be compiled for training shapes; decoding calls them with a cache and
    # other shapes, which would recompile per layer until dynamo's limit (a minute lost per evaluation on an
    # H200 with 5 layers). Eager here, hooks (FSDP2's) kept.
    try:
        with torch.compiler.set_stance("force_eager"):
            run = SpeculativeDecoder(
                target.model,
                drafter,
                [prompt_token_ids(target.tokenizer, prompt) for prompt in prompts],
                max_new_tokens=max_new_tokens,
                stop_token_ids=target.stop_token_ids,
                use_graphs=False,
            ).run()
    finally:
        drafter.train(was_training)
    per_set, start = {}, 0
    for key, count in sets:  # results come back in prompt order
        per_set[key] = _pooled_tau(run.results[start : start + count])
        start += count
    return QuickTau(pooled=_pooled_tau(run.results), per_set=per_set)


def _pooled_tau(results: list[GenerationResult]) -> float:
    lengths = [length for result in results for length in result.accepted_lengths]
    return sum(lengths) / len(lengths) if lengths else 0.0


def set_metric_key(name: str, *, taken: Sequence[str] = ()) -> str:
    """A prompt set's name as a metric-name suffix: `gsm8k` and `gsm8k:test` -> `gsm8k`, `gsm8k:train` ->
    `gsm8k_train`, a file -> its stem, other characters -> `_`; `_2`, `_3`... when `taken` has it already."""
    base, split = split_set_name(name, "test")
    stem = Path(base).stem if Path(base).suffix or "/" in base else base
    key = re.sub(r"[^0-9a-z]+", "_", (stem if split == "test" else f"{stem}_{split}").lower()).strip("_") or "set"
    candidate, number = key, 1
    while candidate in taken:
        number += 1
        candidate = f"{key}_{number}"
    return candidate


# ----------------------------------------------------------------------------------------------------------
# Report output


def format_table(report: EvalReport) -> str:
    """The console table: one row per dataset, then each dataset's accepted-length distribution."""
    # As wide as the longest name: a prompt file's path must show whole, not as a fragment.
    width = max([16, *(len(data.name) + 2 for data in report.datasets)])
    header = (
        f"{'dataset':<{width}}{'prompts':>8}{'tokens':>8}{'tau':>7}{'tau/pr':>8}{'batch':>6}{'base tok/s':>12}"
        f"{'spec tok/s':>12}{'speedup':>9}  lossless"
    )
    lines = [
        f"target {report.target} ({report.dtype}), block {report.block_size}, temperature {report.temperature}, "
        f"max {report.max_new_tokens} new tokens{', drafter compiled' if report.compiled_drafter else ''}"
        f"{', argmax drafts (the selector unused)' if report.argmax_drafts else ''}; "
        "tau pooled over steps and tau/pr the mean over prompts; "
        "tok/s at the batch shown (an indication: a serving engine measures deployable speed-up)",
        header,
        "-" * len(header),
    ]
    for data in report.datasets:
        lines.append(
            f"{data.name:<{width}}{data.num_prompts:>8}{data.new_tokens:>8}{data.tau:>7.2f}{data.tau_per_prompt:>8.2f}"
            f"{data.batch_rows:>6}{data.baseline_tokens_per_s:>12.1f}{data.speculative_tokens_per_s:>12.1f}"
            f"{data.speedup:>8.2f}x  {_lossless_summary(data)}"
        )
    for data in report.datasets:
        for speed in data.throughput[1:]:  # the smaller batches timed (batch 1: one request at a time)
            lines.append(
                f"{data.name:<{width}}{'':>8}{'':>8}{'':>7}{'':>8}{speed.batch_rows:>6}"
                f"{speed.baseline_tokens_per_s:>12.1f}{speed.speculative_tokens_per_s:>12.1f}{speed.speedup:>8.2f}x"
                + ("  CUDA graphs" if speed.cuda_graphs else "")
            )
    for data in report.datasets:
        steps = sum(data.accepted_histogram) or 1
        shares = " ".join(
            f"{length}:{100 * count / steps:.0f}%" for length, count in enumerate(data.accepted_histogram, start=1)
        )
        lines.append(f"accepted lengths {data.name}: {shares}")
    for data in report.datasets:
        by_category = tau_by_category(data.prompts)
        if by_category:
            tau = ", ".join(f"{category} {value:.2f}" for category, value in by_category.items())
            lines.append(f"tau by category {data.name}: {tau}")
    return "\n".join(lines)


def tau_by_category(prompts: list[PromptTau]) -> dict[str, float]:
    """Tau pooled over the steps of each category's prompts, in order of first appearance; empty when the set has
    no categories. Pooled as the set's tau is: committed tokens over target forwards."""
    totals: dict[str, list[int]] = {}  # category -> [committed, steps]
    for prompt in prompts:
        if prompt.category is not None:
            total = totals.setdefault(prompt.category, [0, 0])
            total[0] += prompt.committed
            total[1] += prompt.steps
    return {category: committed / steps if steps else 0.0 for category, (committed, steps) in totals.items()}


def _lossless_summary(data: DatasetReport) -> str:
    if not data.lossless_checked:
        return "not checked"
    text = f"{data.exact_matches}/{data.num_prompts} identical"
    if data.near_ties:
        text += f", {len(data.near_ties)} near-tie divergence(s)"
    return text


def write_report(report: EvalReport, out_dir: str | Path) -> tuple[Path, Path]:
    """`eval.json` and `accepted_lengths.png` in `out_dir`; returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / REPORT_FILE
    json_path.write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    png_path = out_dir / HISTOGRAM_FILE
    histogram_figure(report).savefig(png_path, dpi=110)
    return json_path, png_path


def histogram_figure(report: EvalReport) -> Figure:
    """Share of target forwards committing k tokens, k = 1..B, one bar group per dataset."""
    figure = Figure(figsize=(max(6.0, 0.45 * report.block_size + 2), 4.0))
    axes = figure.add_subplot()
    count = len(report.datasets)
    width = 0.8 / count
    lengths = range(1, report.block_size + 1)
    for index, data in enumerate(report.datasets):
        steps = sum(data.accepted_histogram) or 1
        offsets = [k - 0.4 + width * (index + 0.5) for k in lengths]
        shares = [c / steps for c in data.accepted_histogram]
        axes.bar(offsets, shares, width=width, label=f"{data.name} (tau {data.tau:.2f})")
    axes.set_xticks(list(lengths))
    axes.set_xlabel("tokens committed per target forward")
    axes.set_ylabel("share of target forwards")
    axes.set_title(f"{report.target}: accepted lengths (block {report.block_size}, T={report.temperature})")
    axes.legend()
    figure.tight_layout()
    return figure
