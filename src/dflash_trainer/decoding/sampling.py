"""Choosing the target's token: greedy, or sampling whose randomness is a pure function of (seed, token index).

Greedy (temperature 0) is the argmax. Sampling uses the Gumbel-max trick with counter-based noise:

    token = argmax_v( logits_v / temperature + g(seed, n, v) ),   g = -log(-log(u)),  u = hash(seed, n, v) in (0, 1)

restricted to the top-p nucleus when top_p < 1 (the smallest set of most probable tokens whose probability reaches
top_p; logits outside it are -inf). Gumbel-max with independent uniforms draws exactly from softmax(logits / T)
over the kept tokens. `n` is the index of the token among the request's new tokens and `seed` is the request's
own seed, so the token drawn at new-token index n depends on nothing else: not on the batch a request shares,
the row it sits in, a resume, or how many tokens a verify step covers. Two consequences we rely on:

- regeneration with sampling is reproducible across interruptions and batch compositions;
- speculative decoding that accepts a draft while it equals the target's sample commits, at every index, the
  token plain sampling would have drawn from the same prefix: its output *equals* plain sampling's output for
  the same seed (not only in distribution), so the lossless check works at any temperature.

The hash is a 32-bit integer mixer (xor-shift-multiply, after Wellons' lowbias32) in int64 arithmetic, masked to
32 bits after every multiplication so nothing overflows; it runs on CPU and GPU and inside CUDA graphs. u has
24 bits (exact in float32).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import Tensor

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = SamplingParams()


def derive_seed(*parts: object) -> int:
    """A 63-bit request seed from a run seed and whatever identifies the request (stable across runs)."""
    digest = hashlib.blake2b(":".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer mixer on int64 tensors (any non-negative input; result in [0, 2^32)). The multipliers
    are odd and below 2^31, so no product of a 32-bit value overflows int64."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & _MASK32
    return x ^ (x >> 16)


def seed_key(seeds: Tensor) -> Tensor:
    """[R] int64 request seeds (any 63-bit value) -> [R] 32-bit keys."""
    low = seeds & _MASK32
    high = (seeds >> 32) & _MASK32
    return _mix32(low ^ _mix32(high + _GOLDEN))


def uniform_noise(keys: Tensor, counters: Tensor, vocab: int) -> Tensor:
    """u in (0, 1), float32 `[R, T, V]`, from seed keys `[R]` and new-token indices `[R, T]`."""
    per_token = _mix32(keys[:, None] ^ ((counters * _GOLDEN) & _MASK32))  # [R, T]
    token_ids = torch.arange(vocab, device=keys.device, dtype=torch.int64)  # [V]
    bits = _mix32(per_token[:, :, None] ^ ((token_ids * 0x85EBCA77) & _MASK32)) >> 8  # [R, T, V], 24 bits
    return (bits.to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def choose_tokens(logits: Tensor, params: SamplingParams, keys: Tensor, counters: Tensor) -> Tensor:
    """The target's token at every position: `[R, T, V]` logits -> `[R, T]` int64.

    `keys` [R] from `seed_key`, `counters` [R, T] the new-token index each position's token will have."""
    if params.greedy:
        return logits.argmax(dim=-1)
    scores = logits.float() / params.temperature  # [R, T, V]
    if params.top_p < 1.0:
        scores = _top_p_filter(scores, params.top_p)
    gumbel = -torch.log(-torch.log(uniform_noise(keys, counters, scores.shape[-1])))
    return (scores + gumbel).argmax(dim=-1)


def _top_p_filter(scores: Tensor, top_p: float) -> Tensor:
    """Scores outside the nucleus set to -inf (the most probable token always stays)."""
    sorted_scores, order = scores.sort(dim=-1, descending=True)
    probs = sorted_scores.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked above each one
    drop_sorted = before >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return scores.masked_fill(drop, float("-inf"))
