"""Lossless speculative decoding with a DFlash drafter, for a batch of prompts at once (one row each).

Per row, with n the position of the last committed token (DESIGN §2 "Inference"):

    prefill   target over the prompt (positions 0..n-1): first token t (position n), features of 0..n-1;
              drafter: context = those features, block [t, MASK x (B-1)] at n..n+B-1 -> drafts d_1..d_{B-1}
    step      target verifies [t, d_1..d_{B-1}] at n..n+B-1 in one forward, choosing its own token c_k after
              every slot k (argmax, or a sample: `sampling.py`);
              accept a = the longest prefix with d_k == c_{k-1}, capped so that no more than max_new_tokens
              are produced; commit c_0..c_a (= d_1..d_a, c_a), cut after a stop token;
              n += committed; the target cache keeps the entries of n.. as written: the rejected ones lie past
              the row's new length (`cache.py`), no rollback work; the recurrent states of a hybrid target's
              linear-attention layers were left at n by the verify forward and are advanced over the committed
              tokens (`cache.commit`, `recurrent.py`: one delta-rule kernel call per layer);
              drafter: context += features of the committed slots (all B are handed over, the rest masked),
              block [c_a, MASK...] at the new n -> next drafts
    done      when a stop token was committed or max_new_tokens reached; a done row is frozen.

Every step has fixed shapes and keeps all state in device tensors, so `_step` (verify, accept, propose) is one
CUDA graph per attended length on a GPU; the prefill and first proposal run eagerly. The host reads the rows'
active flags once per `sync_every` steps (every step on CPU) to stop when all rows are done.

At temperature 0 each committed token is the target's argmax given the committed prefix, so the output equals
plain greedy decoding (in float32; in bf16 a verify block and a one-token step round differently, see the
near-tie check in `eval/runner.py`; with bf16 recurrent states of a hybrid target the commit rounds the state once
per block where plain decoding rounds it per token: `recurrent.py` "State dtype"). At temperature > 0 the token
chosen at new-token index i uses the noise of (request seed, i), exactly as plain sampling does, so the output
equals plain sampling with the same seed.

The drafter runs in its own parameter dtype (load it in the target's dtype to measure speed).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch
from torch import Tensor
from transformers import PreTrainedModel

from ..model.drafter import DFlashDrafter
from .batch import KV_BUCKET, round_up, synchronized_time
from .drafter_step import DraftProposer
from .graphs import StepGraphs
from .runs import BatchRun, GenerationResult, check_prompts, single_prompt
from .sampling import GREEDY, SamplingParams, choose_tokens, seed_key
from .target import TargetRunner


class SpeculativeDecoder:
    """Speculative decoding of one batch of prompts (token id lists): `SpeculativeDecoder(...).run()` returns
    the results in prompt order. Construct one per batch (its buffers are sized to it)."""

    def __init__(
        self,
        target_model: PreTrainedModel,
        drafter: DFlashDrafter,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        stop_token_ids: Sequence[int],
        sampling: SamplingParams = GREEDY,
        seeds: Sequence[int] | None = None,
        use_graphs: bool = True,
        sync_every: int | None = None,
        recurrent_state_dtype: torch.dtype | None = None,  # a hybrid target's delta-rule states (None: float32)
    ) -> None:
        check_prompts(prompts, max_new_tokens)
        self.runner = TargetRunner(
            target_model, tap_layers=drafter.config.target_layer_ids, recurrent_state_dtype=recurrent_state_dtype
        )
        self.block_size = block = drafter.config.block_size
        self.max_new_tokens = max_new_tokens
        self.sampling = sampling
        self.prompts = [list(p) for p in prompts]
        rows = len(prompts)
        device = self.runner.device
        self.device = device
        self.sync_every = sync_every or (4 if device.type == "cuda" else 1)
        max_len = round_up(max(len(p) for p in prompts) + max_new_tokens + block, KV_BUCKET)
        self.cache = self.runner.new_cache(rows, max_len)
        self.proposer = DraftProposer(
            drafter, embed=self.runner.embed, lm_head=self.runner.lm_head, rows=rows, max_len=max_len
        )
        self.graphs = StepGraphs(device, enabled=use_graphs and self.runner.graph_safe)
        self.stop_ids = torch.tensor(list(stop_token_ids), dtype=torch.long, device=device)  # [S]
        seeds = list(seeds) if seeds is not None else [0] * rows
        self.keys = seed_key(torch.tensor(seeds, dtype=torch.long, device=device))  # [R]
        self.offsets = torch.arange(block, device=device)  # [B]
        # Per-row state, updated in place by the step.
        self.last = torch.zeros(rows, dtype=torch.long, device=device)  # committed token at `position`
        self.position = torch.zeros(rows, dtype=torch.long, device=device)
        self.drafts = torch.zeros(rows, block - 1, dtype=torch.long, device=device)
        self.count = torch.zeros(rows, dtype=torch.long, device=device)  # new tokens committed
        self.steps = torch.zeros(rows, dtype=torch.long, device=device)  # verify forwards
        self.active = torch.zeros(rows, dtype=torch.bool, device=device)
        self.output = torch.zeros(rows, max_new_tokens + block, dtype=torch.long, device=device)
        self.accepted = torch.zeros(rows, max_new_tokens, dtype=torch.long, device=device)  # per step

    @torch.inference_mode()
    def run(self) -> BatchRun:
        start = synchronized_time(self.device)
        self._prefill()
        prefill_end = synchronized_time(self.device)
        bound = max(len(p) for p in self.prompts)  # upper bound on every row's position
        while True:
            kv_len = min(round_up(bound + self.sync_every * self.block_size, KV_BUCKET), self.cache.max_len)
            for _ in range(self.sync_every):
                self.graphs.run(("verify", kv_len), partial(self._step, kv_len))
            # Host sync (one copy): stop once every row is done; else tighten the position bound.
            any_active, bound = torch.stack([self.active.any().long(), self.position.max()]).tolist()
            if not any_active:
                break
        decode_end = synchronized_time(self.device)
        return BatchRun(
            results=self._results(),
            prefill_s=prefill_end - start,
            decode_s=decode_end - prefill_end - self.graphs.capture_s,
            rows=len(self.prompts),
            capture_s=self.graphs.capture_s,
            graphs_captured=self.graphs.captured,
        )

    def _prefill(self) -> None:
        device = self.device
        rows = len(self.prompts)
        lengths = torch.tensor([len(p) for p in self.prompts], dtype=torch.long, device=device)
        width = int(max(len(p) for p in self.prompts))
        ids = torch.zeros(rows, width, dtype=torch.long)
        for row, prompt in enumerate(self.prompts):
            ids[row, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        positions = torch.arange(width, device=device).expand(rows, width)
        out = self.runner.forward(
            self.cache,
            ids.to(device),
            positions,
            rows=torch.arange(rows, device=device),
            last_index=lengths - 1,
        )
        first = choose_tokens(out.logits[:, None], self.sampling, self.keys, self.count[:, None])[:, 0]  # [R]
        stopped = (first[:, None] == self.stop_ids[None, :]).any(dim=-1)
        self.last.copy_(first)
        self.position.copy_(lengths)
        self.output[:, 0] = first
        self.count.fill_(1)
        self.active.copy_(~stopped & (self.max_new_tokens > 1))
        assert out.features is not None
        self.drafts.copy_(
            self.proposer.propose(
                features=out.features,
                feature_positions=positions,
                context_len=lengths,
                last_token=first,
                kv_len=min(round_up(width, KV_BUCKET), self.cache.max_len),
            )
        )

    def _step(self, kv_len: int) -> None:
        """Verify the drafts, commit, propose the next block (fixed shapes, no host syncs)."""
        block = self.block_size
        active = self.active
        positions = self.position[:, None] + self.offsets  # [R, B]
        tokens = torch.cat([self.last[:, None], self.drafts], dim=1)  # [R, B]
        out = self.runner.forward(self.cache, tokens, positions, kv_len=kv_len, verify=True)  # logits [R, B, V]
        counters = self.count[:, None] + self.offsets  # new-token index of each slot's choice
        chosen = choose_tokens(out.logits, self.sampling, self.keys, counters)  # [R, B]

        matches = (self.drafts == chosen[:, :-1]).long().cumprod(dim=1).sum(dim=1)  # [R]
        room = (self.max_new_tokens - self.count - 1).clamp(min=0)
        committed = torch.minimum(matches, room) + 1  # [R] in 1..B
        is_stop = (chosen[:, :, None] == self.stop_ids[None, None, :]).any(dim=-1)  # [R, B]
        first_stop = torch.where(is_stop, self.offsets, block).min(dim=1).values  # [R], B when none
        stopped = first_stop < committed
        committed = torch.minimum(committed, first_stop + 1) * active  # 0 for done rows
        self.cache.commit(committed)  # recurrent states (hybrid targets) advance over the committed tokens

        self.output.scatter_(1, counters, torch.where(active[:, None], chosen, self.output.gather(1, counters)))
        step_slot = self.steps.clamp(max=self.max_new_tokens - 1)[:, None]
        self.accepted.scatter_(
            1, step_slot, torch.where(active, committed, self.accepted.gather(1, step_slot)[:, 0])[:, None]
        )
        new_last = chosen.gather(1, (committed - 1).clamp(min=0)[:, None])[:, 0]
        self.last.copy_(torch.where(active, new_last, self.last))
        self.count.add_(committed)
        self.steps.add_(active.long())
        self.position.add_(committed)
        self.active.copy_(active & ~(stopped | (self.count >= self.max_new_tokens)))
        assert out.features is not None
        self.drafts.copy_(
            self.proposer.propose(
                features=out.features,
                feature_positions=positions,
                context_len=self.position,
                last_token=self.last,
                kv_len=kv_len,
            )
        )

    def _results(self) -> list[GenerationResult]:
        counts = self.count.tolist()
        steps = self.steps.tolist()
        outputs = self.output.tolist()
        accepted = self.accepted.tolist()
        return [
            GenerationResult(output_ids=outputs[row][: counts[row]], accepted_lengths=accepted[row][: steps[row]])
            for row in range(len(self.prompts))
        ]


def speculative_generate(
    target_model: PreTrainedModel,
    drafter: DFlashDrafter,
    input_ids: Tensor,
    *,
    max_new_tokens: int,
    stop_token_ids: Sequence[int],
    sampling: SamplingParams = GREEDY,
    seed: int = 0,
) -> GenerationResult:
    """One prompt `input_ids` [1, P]; same stopping rule and output as `target_generate`."""
    decoder = SpeculativeDecoder(
        target_model,
        drafter,
        [single_prompt(input_ids)],
        max_new_tokens=max_new_tokens,
        stop_token_ids=stop_token_ids,
        sampling=sampling,
        seeds=[seed],
    )
    return decoder.run().results[0]
