"""Continuous batching: a fixed number of cache rows decode one token per step; finished rows take new prompts.

    queue (priority, then shortest prompt) --refill: batched prefill of newcomers--> rows --decode steps--> completions

- Rows. `rows` cache rows of `max_len` positions. A row holds one request: its prompt from position 0, then one
  new token per step. Rows decode independently (own position, own seed); a finished row is frozen (the step
  still computes it but changes nothing) until it is refilled.
- Steps. One decode step (`_decode_step`) feeds every row's last token at its position, chooses the next token
  (`sampling.py`), appends it to the row's output buffer and marks rows that produced a stop token or reached
  `max_new_tokens`. Fixed shapes, all state on the device: captured as a CUDA graph per attended length
  (`kv_len`, a multiple of `KV_BUCKET` covering the longest row), eager on CPU.
- Host syncs: one per `sync_every` steps, reading the `[rows]` active flags; rows that finished are then read
  back (their tokens) and handed out as `Completion`s. A row that finishes mid-interval idles for the rest of it
  (at most `sync_every - 1` steps of one row).
- Refill. When at least `refill_min` rows are free (or the waiting requests fit in the free rows), the requests
  first in the queue's order (priority, then shortest prompt) are prefilled together (right-padded, in chunks of at
  most `prefill_tokens` tokens), their first token chosen, and their rows armed. Prefill runs eagerly: prompts vary.
  An eager prefill forward costs tens of milliseconds of host work whatever its size (SmolLM2-135M on an H200:
  97 ms per refill of ~5K tokens at rows // 16, 67 ms per ~8K at rows // 8; benchmarks/BENCHMARKS.md), so the
  default `refill_min` (rows // 8) waits for a larger group of free rows: fewer, larger prefills at the price of
  rows idling a few steps longer.
  Requests may be pushed while `generate` runs (a follow-up turn after its previous turn completed).
- Capacity. `max_len` grows (a new cache, contents copied, graphs recaptured) when a request needs more than
  `prompt + max_new_tokens` positions than the cache has; `memory_budget` bounds rows x max_len on the GPU
  (with the per-row recurrent states of a hybrid target, twice when CUDA graphs are captured).
- Hybrid targets (linear-attention layers): a prefill writes the refilled rows' recurrent states from zero
  (`recurrent.py`), so a row never inherits its previous request's state; decode steps advance every row's state.

Output contract: for each request, the new tokens up to and including the first stop token (or exactly
`max_new_tokens` tokens without one), and whether a stop token ended it. Greedy output equals transformers'
`generate` token for token (float32; tested); sampled output depends only on (request seed, token index).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch

from ..errors import UserError
from .graphs import StepGraphs
from .sampling import GREEDY, SamplingParams, choose_tokens, seed_key
from .target import TargetRunner

KV_BUCKET = 128


class CacheBudgetError(UserError, MemoryError):
    """The KV cache for the requested rows and prompt lengths does not fit the memory budget."""


@dataclass(frozen=True)
class Request:
    key: Hashable
    prompt: list[int]
    seed: int = 0
    # Served before requests of a larger priority (ties: shortest prompt first). A caller whose requests depend on
    # each other (a conversation's next turn waits for its previous one) puts those chains first, so they finish
    # while independent requests keep the rows full instead of trailing at the end at low occupancy.
    priority: int = 0


@dataclass
class Completion:
    key: Hashable
    tokens: list[int]  # new tokens, ending with the stop token when `stopped`
    stopped: bool  # False: cut at max_new_tokens


class RequestQueue:
    """Requests waiting for a row, served by `priority`, then shortest prompt first (ties in push order)."""

    def __init__(self, requests: Sequence[Request] = ()) -> None:
        self._heap: list[tuple[int, int, int, Request]] = []
        self._order = itertools.count()
        for request in requests:
            self.push(request)

    def push(self, request: Request) -> None:
        if not request.prompt:
            raise ValueError(f"request {request.key!r}: empty prompt")
        heapq.heappush(self._heap, (request.priority, len(request.prompt), next(self._order), request))

    def longest_prompt(self) -> int:
        return max((length for _, length, _, _ in self._heap), default=0)

    def pop(self, count: int) -> list[Request]:
        return [heapq.heappop(self._heap)[-1] for _ in range(min(count, len(self._heap)))]

    def __len__(self) -> int:
        return len(self._heap)


@dataclass
class DecodeStats:
    steps: int = 0
    prefills: int = 0
    prefill_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0  # steps and host syncs, CUDA-graph captures excluded
    capture_s: float = 0.0
    max_len_growths: list[int] = field(default_factory=list)


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def synchronized_time(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class BatchDecoder:
    """Continuous-batching decoder over a `TargetRunner`; see the module docstring."""

    def __init__(
        self,
        runner: TargetRunner,
        *,
        rows: int,
        max_new_tokens: int,
        stop_token_ids: Sequence[int],
        sampling: SamplingParams = GREEDY,
        max_len: int = KV_BUCKET,
        use_graphs: bool = True,
        sync_every: int | None = None,
        refill_min: int | None = None,
        prefill_tokens: int = 16384,
        memory_budget: int | None = None,
    ) -> None:
        if rows < 1 or max_new_tokens < 1:
            raise ValueError(f"rows and max_new_tokens must be >= 1, got {rows} and {max_new_tokens}")
        self.runner = runner
        self.rows = rows
        self.max_new_tokens = max_new_tokens
        self.sampling = sampling
        self.device = runner.device
        on_gpu = self.device.type == "cuda"
        self.sync_every = sync_every or (4 if on_gpu else 1)
        self.refill_min = refill_min or max(1, rows // 8)
        self.prefill_tokens = prefill_tokens
        self.memory_budget = memory_budget
        self.stats = DecodeStats()
        self.graphs = StepGraphs(self.device, enabled=use_graphs and runner.graph_safe)
        self.cache = runner.new_cache(rows, self._checked_len(max_len))

        device = self.device
        self.stop_ids = torch.tensor(list(stop_token_ids), dtype=torch.long, device=device)  # [S]
        self._stop_set = set(stop_token_ids)
        # Per-row decoding state, updated in place by the step (static for CUDA graphs).
        self.last = torch.zeros(rows, dtype=torch.long, device=device)  # last token, fed next step
        self.position = torch.zeros(rows, dtype=torch.long, device=device)  # where the last token goes
        self.count = torch.zeros(rows, dtype=torch.long, device=device)  # new tokens so far
        self.active = torch.zeros(rows, dtype=torch.bool, device=device)
        self.keys = torch.zeros(rows, dtype=torch.long, device=device)  # sampling seed keys
        self.output = torch.zeros(rows, max_new_tokens, dtype=torch.long, device=device)  # new tokens
        self._state = [self.last, self.position, self.count, self.active]
        # Host view: the request of each row and an upper bound on its position.
        self._row_request: list[Request | None] = [None] * rows
        self._position_bound = [0] * rows

    # ------------------------------------------------------------------------------------------------------
    # Capacity

    def _checked_len(self, max_len: int) -> int:
        max_len = round_up(max(max_len, 1), KV_BUCKET)
        if self.memory_budget is not None:
            # Recurrent states (hybrid targets) are per row; a CUDA-graph capture holds a second copy of them.
            state_copies = 2 if self.graphs.enabled else 1
            per_row = max_len * self.runner.cache_bytes_per_token() + state_copies * self.runner.state_bytes_per_row()
            needed = self.rows * per_row
            if needed > self.memory_budget:
                raise CacheBudgetError(
                    f"a KV cache of {self.rows} rows x {max_len} positions needs {needed / 2**30:.1f} GiB, over the "
                    f"budget of {self.memory_budget / 2**30:.1f} GiB: use fewer rows or shorter prompts"
                )
        return max_len

    def _ensure_capacity(self, needed: int) -> None:
        """Grow the cache to hold `needed` positions per row (rare: copies the cache, recaptures graphs)."""
        if needed <= self.cache.max_len:
            return
        fresh = self.stats.prefills == 0  # nothing cached yet: size it, nothing to copy
        new_len = self._checked_len(needed if fresh else max(needed, self.cache.max_len * 3 // 2))
        if fresh:
            self.cache = self.runner.new_cache(self.rows, new_len)
        else:
            self.cache = self.cache.resized(new_len)
            self.stats.max_len_growths.append(new_len)
        self.graphs = StepGraphs(self.device, enabled=self.graphs.enabled)

    # ------------------------------------------------------------------------------------------------------
    # The step

    def _decode_step(self, kv_len: int) -> None:
        """One token for every row (fixed shapes, no host syncs)."""
        out = self.runner.forward(self.cache, self.last[:, None], self.position[:, None], kv_len=kv_len)
        token = choose_tokens(out.logits, self.sampling, self.keys, self.count[:, None])[:, 0]  # [R]
        active = self.active
        slot = self.count.clamp(max=self.max_new_tokens - 1)[:, None]  # [R, 1]
        kept = torch.where(active, token, self.output.gather(1, slot)[:, 0])
        self.output.scatter_(1, slot, kept[:, None])
        self.count.add_(active.long())
        self.position.add_(active.long())
        self.last.copy_(torch.where(active, token, self.last))
        stopped = (token[:, None] == self.stop_ids[None, :]).any(dim=-1)
        self.active.copy_(active & ~(stopped | (self.count >= self.max_new_tokens)))

    # ------------------------------------------------------------------------------------------------------
    # Refill

    @torch.inference_mode()
    def _prefill(self, rows: list[int], requests: list[Request]) -> None:
        """Prefill `requests` into cache `rows` and arm them with their first token."""
        device = self.device
        lengths = [len(r.prompt) for r in requests]
        width = max(lengths)
        self._ensure_capacity(width + self.max_new_tokens)
        ids = torch.zeros(len(requests), width, dtype=torch.long)
        for index, request in enumerate(requests):
            ids[index, : len(request.prompt)] = torch.tensor(request.prompt, dtype=torch.long)
        ids = ids.to(device)
        row_index = torch.tensor(rows, dtype=torch.long, device=device)
        length = torch.tensor(lengths, dtype=torch.long, device=device)
        positions = torch.arange(width, device=device).expand(len(requests), width)
        out = self.runner.forward(self.cache, ids, positions, rows=row_index, last_index=length - 1)  # logits [k, V]
        keys = seed_key(torch.tensor([r.seed for r in requests], dtype=torch.long, device=device))
        zeros = torch.zeros(len(requests), 1, dtype=torch.long, device=device)
        first = choose_tokens(out.logits[:, None], self.sampling, keys, zeros)[:, 0]  # [k]
        stopped = (first[:, None] == self.stop_ids[None, :]).any(dim=-1)
        self.keys.index_copy_(0, row_index, keys)
        self.last.index_copy_(0, row_index, first)
        self.position.index_copy_(0, row_index, length)
        self.count.index_fill_(0, row_index, 1)
        self.active.index_copy_(0, row_index, ~stopped & (self.max_new_tokens > 1))
        self.output[row_index, 0] = first
        for row, request in zip(rows, requests, strict=True):
            self._row_request[row] = request
            self._position_bound[row] = len(request.prompt)
        self.stats.prefills += 1
        self.stats.prefill_tokens += sum(lengths)

    def _refill(self, queue: RequestQueue) -> None:
        free = [row for row, request in enumerate(self._row_request) if request is None]
        # Wait for more free rows (fewer, larger prefills) unless the waiting requests fit or all rows are free.
        if not queue or len(free) < min(self.refill_min, len(queue), self.rows):
            return
        start = synchronized_time(self.device)
        # The queue's order picks who comes in; rows are interchangeable, so chunk them by length (prefill pads a
        # chunk to its longest prompt: newcomers of several priorities would otherwise mix short and long).
        newcomers = sorted(queue.pop(len(free)), key=lambda request: len(request.prompt))
        chunk_rows: list[int] = []
        chunk: list[Request] = []
        for row, request in zip(free, newcomers, strict=False):
            width = max([len(request.prompt), *(len(r.prompt) for r in chunk)])
            if chunk and width * (len(chunk) + 1) > self.prefill_tokens:
                self._prefill(chunk_rows, chunk)
                chunk_rows, chunk = [], []
            chunk_rows.append(row)
            chunk.append(request)
        if chunk:
            self._prefill(chunk_rows, chunk)
        self.stats.prefill_s += synchronized_time(self.device) - start

    # ------------------------------------------------------------------------------------------------------
    # The loop

    @torch.inference_mode()
    def generate(self, queue: RequestQueue) -> Iterator[Completion]:
        """Decode every request in `queue` (including ones pushed while this runs); yields as rows finish."""
        self._ensure_capacity(queue.longest_prompt() + self.max_new_tokens)
        while True:
            self._refill(queue)
            occupied = [row for row, request in enumerate(self._row_request) if request is not None]
            if not occupied:
                return
            start = time.perf_counter()
            capture_before = self.graphs.capture_s
            # The steps of this interval attend up to the longest row's position after them.
            longest = max(self._position_bound[row] for row in occupied) + self.sync_every
            kv_len = min(round_up(longest, KV_BUCKET), self.cache.max_len)
            for _ in range(self.sync_every):
                self.graphs.run(
                    ("decode", kv_len), partial(self._decode_step, kv_len), [*self._state, *self.cache.state_tensors()]
                )
            for row in occupied:
                self._position_bound[row] += self.sync_every
            self.stats.steps += self.sync_every
            # Host sync: which rows are still running.
            active = self.active.tolist()
            done = [row for row in occupied if not active[row]]
            captured = self.graphs.capture_s - capture_before
            self.stats.capture_s += captured
            self.stats.decode_s += time.perf_counter() - start - captured
            if done:
                yield from self._collect(done)

    def _collect(self, rows: list[int]) -> Iterator[Completion]:
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        # One device-to-host copy: each finished row's count, then its output buffer.
        finished = torch.cat([self.count[index, None], self.output[index]], dim=1).tolist()  # [k, 1 + max_new]
        completions = []
        for row, (count, *tokens) in zip(rows, finished, strict=True):
            request = self._row_request[row]
            assert request is not None
            self._row_request[row] = None
            new = tokens[:count]
            self.stats.new_tokens += count
            completions.append(Completion(request.key, new, stopped=bool(new) and new[-1] in self._stop_set))
        # Handed out after the rows are free, so follow-up requests pushed by the caller can take them.
        yield from completions
