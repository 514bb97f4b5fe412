"""What a decoding run takes (prompts as token id lists) and returns (per prompt its tokens and accepted
lengths, per batch its wall times)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor


@dataclass
class GenerationResult:
    # New tokens only (the prompt is not repeated); ends with a stop token when one was produced.
    output_ids: list[int]
    # Tokens committed by each decoding forward of the target (1..B; all 1 for plain decoding). The prefill's
    # first token is not in it, so sum(accepted_lengths) == len(output_ids) - 1.
    accepted_lengths: list[int]

    @property
    def num_target_forwards(self) -> int:
        """Target forwards including the prefill."""
        return 1 + len(self.accepted_lengths)

    @property
    def tau(self) -> float:
        """Mean tokens committed per decoding forward of the target (1.0 for plain decoding)."""
        return sum(self.accepted_lengths) / len(self.accepted_lengths) if self.accepted_lengths else 0.0


@dataclass
class BatchRun:
    """Prompts decoded together (rows of one batch): results in prompt order and the batch's wall times."""

    results: list[GenerationResult]
    prefill_s: float  # the prompts' prefill (and the first draft)
    # Every step after it until the last row finished, except each attended length's first step (run eagerly,
    # then captured as a CUDA graph: `capture_s`), so tokens/s over it are high by about one step per length.
    decode_s: float
    rows: int  # prompts decoded at once
    capture_s: float = 0.0  # first steps of each attended length with their CUDA-graph captures
    graphs_captured: int = 0

    @property
    def wall_s(self) -> float:
        return self.prefill_s + self.decode_s + self.capture_s

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after each prompt's first, over the decoding time: what a drafter changes."""
        tokens = sum(len(result.output_ids) - 1 for result in self.results)
        return tokens / self.decode_s if self.decode_s > 0 else 0.0


def check_prompts(prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts: need at least one prompt, none empty")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")


def single_prompt(input_ids: Tensor) -> list[int]:
    """`[1, P]` token ids -> a list, or ValueError."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids: expected one non-empty prompt [1, P], got shape {tuple(input_ids.shape)}")
    return input_ids[0].tolist()
