"""Plain decoding (the target alone) of a batch of prompts: the baseline and the lossless reference.

The prompts run as the rows of one `BatchDecoder` (every prompt gets a row at once, no refill), so the baseline
uses the same cache, attention, sampling and CUDA graphs as regeneration and as speculative verification.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from transformers import PreTrainedModel

from .batch import BatchDecoder, Request, RequestQueue
from .runs import BatchRun, GenerationResult, check_prompts, single_prompt
from .sampling import GREEDY, SamplingParams
from .target import TargetRunner


@torch.inference_mode()
def target_generate_batch(
    target_model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    stop_token_ids: Sequence[int],
    sampling: SamplingParams = GREEDY,
    seeds: Sequence[int] | None = None,
    use_graphs: bool = True,
    recurrent_state_dtype: torch.dtype | None = None,
) -> BatchRun:
    """Decode `prompts` (token id lists) together; stops a row after a stop token (kept) or `max_new_tokens`.
    `recurrent_state_dtype`: a hybrid target's delta-rule states (`TargetRunner`; None: float32)."""
    check_prompts(prompts, max_new_tokens)
    seeds = list(seeds) if seeds is not None else [0] * len(prompts)
    runner = TargetRunner(target_model, recurrent_state_dtype=recurrent_state_dtype)
    decoder = BatchDecoder(
        runner,
        rows=len(prompts),
        max_new_tokens=max_new_tokens,
        stop_token_ids=stop_token_ids,
        sampling=sampling,
        max_len=max(len(p) for p in prompts) + max_new_tokens,
        use_graphs=use_graphs,
        refill_min=len(prompts),
    )
    queue = RequestQueue(
        [Request(index, list(prompt), seed) for index, (prompt, seed) in enumerate(zip(prompts, seeds, strict=True))]
    )
    tokens = {completion.key: completion.tokens for completion in decoder.generate(queue)}
    results = [
        GenerationResult(output_ids=tokens[index], accepted_lengths=[1] * (len(tokens[index]) - 1))
        for index in range(len(prompts))
    ]
    return BatchRun(
        results=results,
        prefill_s=decoder.stats.prefill_s,
        decode_s=decoder.stats.decode_s,
        rows=len(prompts),
        capture_s=decoder.stats.capture_s,
        graphs_captured=decoder.graphs.captured,
    )


def target_generate(
    target_model: PreTrainedModel,
    input_ids: Tensor,
    *,
    max_new_tokens: int,
    stop_token_ids: Sequence[int],
    sampling: SamplingParams = GREEDY,
    seed: int = 0,
) -> GenerationResult:
    """One prompt `input_ids` [1, P]."""
    return target_generate_batch(
        target_model,
        [single_prompt(input_ids)],
        max_new_tokens=max_new_tokens,
        stop_token_ids=stop_token_ids,
        sampling=sampling,
        seeds=[seed],
    ).results[0]
