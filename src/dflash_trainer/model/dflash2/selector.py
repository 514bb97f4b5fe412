"""DFlash2's path selector: chooses one token per block slot among the unary top-k, conditioned on the slot before.

For the drafts of one block (slots 1..B-1, hidden states h_i after the final norm, unary logits z_i = the target's
LM head on h_i), with codebooks A (predecessor) and C (successor), both [V, r], and a projection P [r, H]:

    candidates_i = top-k of z_i (k = `selector_top_k`), u_i = their logits            (the unary scores)
    edge_i(p -> c) = u_i[c] + < A[p] * (P h_i), C[c] >                                  (p: the token at slot i-1)

The engines walk the block greedily from the verified anchor: p_1 = the block's slot-0 token (the last committed
token), then at each slot the candidate with the highest edge score from the token chosen at the slot before,
which becomes the next predecessor (ties: the lower candidate index, i.e. the higher unary logit, since the top-k
is sorted). One drafter pass still proposes the whole block: the scores of every (predecessor, candidate) pair of
adjacent slots are computed in parallel, and only the k-wide walk is sequential. (At temperature > 0 the engines
sample the walk with a Gumbel draw and hand the walk's distribution over the k candidates to rejection sampling;
our verifier matches drafts against the target's own seeded choices, so drafts only need to be good guesses and
the greedy walk serves every temperature.)

The score uses the unary logits exactly as the LM head gives them (z-lab's optional `output_multiplier` and
`final_logit_softcapping` are not used by our drafters, whose head is the target's). Initialised with the
successor codebook at zero, so a new selector reproduces the unary argmax.

Codebooks (`codebooks`, a training choice; the checkpoint format is the same either way):
- `free` (default): A and C are free [V, r] parameters, as the published checkpoints store them and speculators
  trains them. A token's rows learn only from the blocks it appears in, as predecessor or candidate.
- `embedding`: A = n(E) M_A^T and C = n(E) M_C^T, with E the target's frozen token embedding [V, H], n() each row
  scaled to unit RMS, and M_A, M_C [r, H] the parameters: 2rH instead of 2Vr (SmolLM2: 0.3M against 25M). Why: the
  published parameter count of the selector (2.0M for a Qwen3-4B drafter: 3 x 2560 x 256, where two free codebooks
  would be 78M) says z-lab trained three [r, H] maps and materialised the codebooks for the checkpoint; and tokens
  with similar embeddings then share their transition scores, which a held-out prompt's rare pairs need. The
  embedding is bound by the trainer (`bind_token_embedding`); the codebooks are kept materialised in buffers of the
  free layout's names, refreshed from the maps whenever a state dict is taken, so checkpoints, exports and a
  drafter loaded without the target walk with them as with free codebooks. Successor map at zero, as above.

Sources (read, not copied): z-lab/dflash `dflash/model.py` (`CandidateSelector.select`), vLLM
`model_executor/models/qwen3_dflash2.py` (`_score_edges`, `compute_candidates`) and
`v1/worker/gpu/spec_decode/dflash2/speculator.py` (`_selector_walk_kernel`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import FunctionCtx, once_differentiable

if TYPE_CHECKING:
    from .loss import SelectorOutput

Codebooks = Literal["free", "embedding"]
# Added to the mean square of an embedding row before its RMS scaling (`token_features`).
_RMS_EPS = 1e-6


def token_features(embedding: Tensor) -> Tensor:
    """Each row of `embedding` [..., H] scaled to unit RMS, in float32 (float64 for float64 input): the input of the
    `embedding` codebooks' maps, so that their scale does not depend on the target's embedding norms."""
    rows = embedding.to(torch.promote_types(embedding.dtype, torch.float32))
    return rows * torch.rsqrt(rows.pow(2).mean(dim=-1, keepdim=True) + _RMS_EPS)


class CandidateSelector(nn.Module):
    def __init__(
        self, hidden_size: int, vocab_size: int, *, rank: int, top_k: int, codebooks: Codebooks = "free"
    ) -> None:
        super().__init__()
        if codebooks not in ("free", "embedding"):
            raise ValueError(f"codebooks must be 'free' or 'embedding', got {codebooks!r}")
        self.top_k = top_k
        self.codebooks_from = codebooks
        # Names and shapes as in the published checkpoints (codebooks are bare tensors there, no `.weight`).
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        if codebooks == "free":
            self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
            self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        else:
            # Bare [r, H] tensors, not `nn.Linear`s: the FP8 drafter converts linear modules, and these are read
            # as matrices (`codebooks`, `codebook_rows`).
            self.predecessor_map = nn.Parameter(torch.empty(rank, hidden_size))
            self.successor_map = nn.Parameter(torch.empty(rank, hidden_size))
            self.register_buffer("predecessor_codebook", torch.zeros(vocab_size, rank))
            self.register_buffer("successor_codebook", torch.zeros(vocab_size, rank))
            self.register_state_dict_pre_hook(_refresh_before_state_dict)
        self.token_embedding: Tensor | None = None
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        with torch.no_grad():
            nn.init.normal_(self.hidden_projection.weight, std=std)
            if self.codebooks_from == "free":
                nn.init.normal_(self.predecessor_codebook, std=std)
                self.successor_codebook.zero_()  # the transition term starts at 0: the walk is the unary argmax
            else:
                # Unit-RMS features times N(0, std^2 / H) entries: codebook rows of about `std`, as the free ones.
                nn.init.normal_(self.predecessor_map, std=std / self.predecessor_map.shape[1] ** 0.5)
                self.successor_map.zero_()
                self.refresh_codebooks()

    def bind_token_embedding(self, weight: Tensor) -> None:
        """The target's token embedding [V, H] (frozen; not a parameter or buffer of this module, never saved), which
        the `embedding` codebooks are maps of. The trainer binds it; unbound, the walk reads the stored codebooks."""
        if self.codebooks_from != "embedding":
            raise ValueError("bind_token_embedding: this selector's codebooks are free parameters")
        vocab, width = self.predecessor_codebook.shape[0], self.predecessor_map.shape[1]
        if tuple(weight.shape) != (vocab, width):
            raise ValueError(
                f"bind_token_embedding: expected the [{vocab}, {width}] embedding, got {tuple(weight.shape)}"
            )
        self.token_embedding = weight.detach()
        self.refresh_codebooks()

    def codebooks(self) -> tuple[Tensor, Tensor]:
        """(A, C), each [V, r]: the parameters, or with `embedding` codebooks the maps applied to the whole
        vocabulary, differentiable w.r.t. the maps (float32; training reads them once per selector term)."""
        if self.codebooks_from == "free":
            return self.predecessor_codebook, self.successor_codebook
        return _MapsOfEmbedding.apply(self._bound_embedding(), self.predecessor_map, self.successor_map)

    @torch.no_grad()
    def refresh_codebooks(self) -> None:
        """Materialise the `embedding` codebooks into their buffers (a no-op while no embedding is bound)."""
        if self.codebooks_from == "embedding" and self.token_embedding is not None:
            predecessor, successor = self.codebooks()
            self.predecessor_codebook.copy_(predecessor)
            self.successor_codebook.copy_(successor)

    def codebook_rows(self, ids: Tensor, *, successor: bool) -> Tensor:
        """Rows of A (or C) for `ids` [...] -> [..., r]: from the maps while an embedding is bound (the live
        parameters), else from the codebook tensors."""
        if self.codebooks_from == "embedding" and self.token_embedding is not None:
            matrix = self.successor_map if successor else self.predecessor_map  # [r, H]
            features = token_features(F.embedding(ids, self.token_embedding)).to(matrix.dtype)  # [..., H]
            with torch.autocast(device_type=features.device.type, enabled=False):  # as `codebooks` computes them
                return F.linear(features, matrix)
        return F.embedding(ids, self.successor_codebook if successor else self.predecessor_codebook)

    def _bound_embedding(self) -> Tensor:
        if self.token_embedding is None:
            raise RuntimeError(
                "CandidateSelector: `embedding` codebooks are trained from the target's token embedding; "
                "call bind_token_embedding(target embedding weight) first"
            )
        return self.token_embedding

    def forward(
        self,
        hidden: Tensor,  # [R, N, B, H]
        lm_head_weight: Tensor,  # [V, H]
        labels: Tensor,  # [R, N, B]
        predecessors: Tensor,  # [R, N, B]
        valid: Tensor,  # [R, N, B]
        *,
        gamma: float | None,
        gold_injection: bool,
        stop_gradient: bool,
        chunk_blocks: int,
        lm_head_bias: Tensor | None,  # [V]
        candidates: Tensor | None,  # [R, N, B-1, K]
        compile: bool,
    ) -> SelectorOutput:
        """The selector's training term: `loss.py`'s `selector_loss` with this selector (arguments as there). The
        term is the module's forward so that training reads the parameters inside a call of the module: a wrapper
        of the module (FSDP2's `fully_shard`, train/sharding.py) gathers them around the call and reduces their
        gradients after its backward, as it does for any forward. (Decoding's `walk` is another such entry:
        `Fsdp2Sync` registers it as an FSDP forward method.)"""
        from .loss import selector_loss  # loss.py imports this module

        return selector_loss(
            hidden,
            lm_head_weight,
            self,
            labels,
            predecessors,
            valid,
            gamma=gamma,
            gold_injection=gold_injection,
            stop_gradient=stop_gradient,
            chunk_blocks=chunk_blocks,
            lm_head_bias=lm_head_bias,
            candidates=candidates,
            compile=compile,
        )

    def transition_scores(
        self, hidden: Tensor, predecessors: Tensor, candidates: Tensor, *, dtype: torch.dtype = torch.float32
    ) -> Tensor:
        """<A[p] * (P h), C[c]> in `dtype` for every predecessor p and candidate c of a slot.
        hidden [..., H], predecessors [..., Pn], candidates [..., K] -> [..., Pn, K]."""
        gate = F.linear(hidden.to(dtype), self.hidden_projection.weight.to(dtype))  # [..., r]
        left = self.codebook_rows(predecessors, successor=False).to(dtype) * gate.unsqueeze(-2)  # [..., Pn, r]
        right = self.codebook_rows(candidates, successor=True).to(dtype)  # [..., K, r]
        return left @ right.transpose(-1, -2)

    def candidates(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        """logits [..., V] -> (candidate ids [..., K], unary scores [..., K] in float32 or wider), highest first."""
        unary, ids = torch.topk(logits, self.top_k, dim=-1)  # ranked in the logits' dtype, as the engines do
        return ids, unary.to(torch.promote_types(logits.dtype, torch.float32))

    @torch.no_grad()
    def walk(self, hidden: Tensor, logits: Tensor, anchor_tokens: Tensor) -> Tensor:
        """The engines' greedy walk. hidden [R, S, H] and logits [R, S, V] of slots 1..B-1, anchor_tokens [R] (the
        slot-0 tokens) -> drafts [R, S]. Fixed shapes, no host sync (runs inside captured decoding steps)."""
        rows, slots, _ = hidden.shape
        ids, unary = self.candidates(logits)  # [R, S, K], scored in float32 (float64 for float64 inputs)
        # Predecessors of slot i: the anchor (the same for all k rows) at the first slot, else slot i-1's candidates.
        first = anchor_tokens[:, None, None].expand(rows, 1, self.top_k)
        predecessors = torch.cat([first, ids[:, :-1]], dim=1)  # [R, S, K]
        transitions = self.transition_scores(hidden, predecessors, ids, dtype=unary.dtype)
        edges = unary.unsqueeze(-2) + transitions  # [R, S, K (predecessor), K (candidate)]
        previous = torch.zeros(rows, 1, 1, dtype=torch.long, device=hidden.device)  # index of the chosen predecessor
        drafts = []
        for slot in range(slots):
            row = edges[:, slot].gather(1, previous.expand(rows, 1, self.top_k))[:, 0]  # [R, K]
            previous = row.argmax(dim=-1)[:, None, None]
            drafts.append(ids[:, slot].gather(1, previous[:, 0]))  # [R, 1]
        return torch.cat(drafts, dim=1)


# Vocabulary rows per step of `_MapsOfEmbedding`: the float32 features of 8,192 rows of a 5,120-wide embedding (the
# 27B target's) are 168 MB, where the whole [248K, 5120] at once would be 5 GB.
_VOCAB_CHUNK = 8192


class _MapsOfEmbedding(torch.autograd.Function):
    """(embedding E [V, H], maps M_A, M_C [r, H]) -> (n(E) M_A^T, n(E) M_C^T), each [V, r] in the maps' dtype.

    Autograd over `token_features(E) @ M^T` would keep the [V, H] float32 features for the backward (and build them
    whole); this walks the vocabulary in chunks, forward and backward, recomputing each chunk's features there
    (E is frozen: no gradient flows to it). Products in the maps' dtype with autocast off, float32 for the master
    weights: 4 V H r FLOPs each way per call, at the 8B shape 0.64 TFLOP, about 10 ms each way at an H200's float32
    rate (SmolLM2: 29 GFLOP each way, well under 1 ms)."""

    @staticmethod
    def forward(ctx: FunctionCtx, embedding: Tensor, predecessor_map: Tensor, successor_map: Tensor):
        maps = torch.stack([predecessor_map, successor_map]).detach()  # [2, r, H]
        vocab = embedding.shape[0]
        out = maps.new_empty(2, vocab, maps.shape[1])  # [2, V, r]
        with torch.autocast(device_type=embedding.device.type, enabled=False):
            for start in range(0, vocab, _VOCAB_CHUNK):
                features = token_features(embedding[start : start + _VOCAB_CHUNK]).to(maps.dtype)  # [c, H]
                out[:, start : start + _VOCAB_CHUNK] = features @ maps.transpose(1, 2)
        ctx.save_for_backward(embedding, maps)
        return out[0], out[1]

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_predecessor: Tensor, grad_successor: Tensor):
        embedding, maps = ctx.saved_tensors
        grad_maps = torch.zeros_like(maps)  # [2, r, H]
        with torch.autocast(device_type=embedding.device.type, enabled=False):
            for start in range(0, embedding.shape[0], _VOCAB_CHUNK):
                features = token_features(embedding[start : start + _VOCAB_CHUNK]).to(maps.dtype)  # [c, H]
                for index, grad in enumerate((grad_predecessor, grad_successor)):  # each [V, r]
                    grad_maps[index] += grad[start : start + _VOCAB_CHUNK].to(maps.dtype).t() @ features
        return None, grad_maps[0], grad_maps[1]


def _refresh_before_state_dict(module: CandidateSelector, prefix: str, keep_vars: bool) -> None:
    # A state dict (checkpoint, export, digest) holds the codebooks of the current maps.
    module.refresh_codebooks()
