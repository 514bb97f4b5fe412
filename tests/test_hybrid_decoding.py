"""The decoding engine on hybrid targets (Qwen3.5-style: Gated DeltaNet linear-attention layers beside full
attention): the static-cache forward with rolled-back recurrent states equals transformers' forward (float64 against
a naive float64 delta rule; float32 with transformers' own kernels), continuous batching and regeneration equal
`generate`, speculative decoding is lossless with every accepted length, a CUDA-graph capture after a key's first
step leaves the recurrent states as one step does, and evaluation reports tau for a hybrid. The rollback, batching
and speculative tests run twice: with the kernels the engine selects (CPU: transformers' own) and with fla's
contracts computed by reference implementations (`FlaContract`: the engine's fast path on the CPU). They also run
on a GPU (`-m gpu`, float32; with flash-linear-attention's kernels, the engine's fast path, when `fla` is importable
there), where fla's kernels are checked against `FlaContract` and the fast path in bf16 against the float32 forward.
(Captured CUDA-graph steps of a hybrid on a GPU: test_decoding.py's `test_cuda_graph_steps_equal_eager_steps`.)"""

from __future__ import annotations

import copy
import itertools
import json
import os
import subprocess
import sys
import typing
from collections import Counter
from functools import partial
from pathlib import Path

import pytest
import torch
import transformers.models.qwen3_5.modeling_qwen3_5 as qwen3_5_modeling
from torch import Tensor
from transformers import PreTrainedModel

from decoding_helpers import (  # noqa: F401 (one_thread: autouse fixture)
    HYBRID_DIMS,
    cpu_target,
    hf_greedy,
    hybrid_target,
    one_thread,
    run_then_capture,
    seeded,
)
from dflash_trainer.decoding import target as target_module
from dflash_trainer.decoding.batch import BatchDecoder, Request, RequestQueue
from dflash_trainer.decoding.cache import UnsupportedTargetError
from dflash_trainer.decoding.graphs import StepGraphs
from dflash_trainer.decoding.hybrid_kernels import (
    ADVANCE_TILES,
    CONV_KERNELS,
    FLA,
    FLA_PUBLIC_TILE,
    TRANSFORMERS,
    AdvanceTile,
    HybridKernels,
    fla_advance,
    fla_available,
    routed_convolutions,
    select_hybrid_kernels,
)
from dflash_trainer.decoding.plain import target_generate_batch
from dflash_trainer.decoding.recurrent import DELTA_RULE_KERNELS, STATE_DTYPES
from dflash_trainer.decoding.sampling import SamplingParams
from dflash_trainer.decoding.speculative import SpeculativeDecoder
from dflash_trainer.decoding.target import TargetRunner
from dflash_trainer.eval.runner import NEAR_TIE_ULPS, evaluate, first_difference
from dflash_trainer.model.config import DrafterModelConfig
from dflash_trainer.model.drafter import DFlashDrafter
from test_speculative import expected_accepted_lengths

VOCAB = HYBRID_DIMS["vocab_size"]
HIDDEN = HYBRID_DIMS["hidden_size"]


def naive_delta_rule(
    query: Tensor,  # [B, T, H, Dk]
    key: Tensor,
    value: Tensor,  # [B, T, H, Dv]
    g: Tensor,  # [B, T, H]
    beta: Tensor,  # [B, T, H]
    initial_state: Tensor | None = None,  # [B, H, Dk, Dv]
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **kwargs: object,
) -> tuple[Tensor, Tensor | None]:
    """The gated delta rule token by token in float64 (a reference independent of transformers' kernels)."""
    q, k, v, b, decay = (x.transpose(1, 2).double() for x in (query, key, value, beta, g))  # [B, H, T, ...]
    if use_qk_l2norm_in_kernel:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * q.shape[-1] ** -0.5
    batch, heads, length, key_dim = k.shape
    state = (
        initial_state.double()
        if initial_state is not None
        else torch.zeros(batch, heads, key_dim, v.shape[-1], dtype=torch.float64)
    )
    outputs = []
    for t in range(length):
        state = state * decay[:, :, t].exp()[..., None, None]
        delta = (v[:, :, t] - (state * k[:, :, t, :, None]).sum(-2)) * b[:, :, t, None]  # [B, H, Dv]
        state = state + k[:, :, t, :, None] * delta[:, :, None, :]
        outputs.append((state * q[:, :, t, :, None]).sum(-2))
    out = torch.stack(outputs, dim=2).transpose(1, 2).to(value.dtype)  # [B, T, H, Dv]
    return out, state if output_final_state else None


def run_blocks(
    model: PreTrainedModel,
    ids: Tensor,
    *,
    keeps: list[list[int]],
    tolerance: float,
    kernels: HybridKernels | None = None,
    reference_model: PreTrainedModel | None = None,
) -> float:
    """Prefill right-padded prompts of lengths 12, 9, 5, then verify blocks of 3 tokens per row, each row keeping
    keeps[step][row] of them (0 = a finished row, nothing kept): every logit and tap equals the model's own
    forward over the whole sequence (or `reference_model`'s, the same weights in another dtype) within `tolerance`.
    Returns the largest logit error."""
    runner = TargetRunner(model, tap_layers=[1, 3], hybrid_kernels=kernels)
    with torch.no_grad():
        reference = (reference_model or model)(ids, output_hidden_states=True)
    cache = runner.new_cache(3, 48)
    device = ids.device
    lengths = torch.tensor([12, 9, 5], device=device)
    prefill = runner.forward(
        cache,
        ids[:, :12],
        torch.arange(12, device=device).expand(3, 12),
        rows=torch.arange(3, device=device),
        last_index=lengths - 1,
    )
    error = 0.0
    for row in range(3):
        expected = reference.logits[row, lengths[row] - 1].double()
        torch.testing.assert_close(prefill.logits[row].double(), expected, rtol=0, atol=tolerance)
        error = max(error, float((prefill.logits[row] - expected).abs().max()))
        taps = torch.cat([reference.hidden_states[2][row], reference.hidden_states[4][row]], dim=-1).double()
        got = prefill.features[row, : lengths[row]].double()
        torch.testing.assert_close(got, taps[: lengths[row]], rtol=0, atol=tolerance)
    position = lengths.clone()
    for step, keep in enumerate(keeps):
        positions = position[:, None] + torch.arange(3, device=device)  # [3, 3]
        out = runner.forward(cache, torch.gather(ids, 1, positions), positions, kv_len=48, verify=True)
        for row in range(3):
            expected = reference.logits[row, positions[row]].double()
            torch.testing.assert_close(
                out.logits[row].double(),
                expected,
                rtol=0,
                atol=tolerance,
                msg=lambda m, s=step, r=row: f"block {s} row {r}: {m}",
            )
            error = max(error, float((out.logits[row] - expected).abs().max()))
        kept = torch.tensor(keep, device=device)
        cache.commit(kept)
        position += kept
    return error


KEEPS = [[1, 3, 2], [3, 0, 1], [2, 2, 3], [0, 1, 1], [3, 3, 0], [1, 2, 3]]


# ------------------------------------------------------------------------------------------------------------
# The engine's fast path (`hybrid_kernels.py`) on the CPU: flash-linear-attention's contracts (a stateless
# convolution over [k, C, L], a one-token convolution that shifts its state in place, a delta rule that advances its
# state in place, RMS norms with the effective weight, the gated norm), implemented in float64 by other means than
# transformers' references (unfolded windows instead of F.conv1d), counting their calls. The engine's bookkeeping
# around them (conv windows, in-place advance in decode steps and commits, no copy, the norms' weights 1 + w) must
# give what transformers gives.


class FlaContract:
    """A `HybridKernels` with fla's calling contracts computed by reference implementations; `calls` counts uses."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.kernels = HybridKernels(
            "fla-contract",
            conv=self.conv,
            conv_update=self.conv_update,
            advance=self.advance,
            rms_norm=self.rms_norm,
            gated_rms_norm=self.gated_rms_norm,
        )

    @staticmethod
    def _activate(out: Tensor, activation: str | None) -> Tensor:
        return torch.nn.functional.silu(out) if activation in ("silu", "swish") else out

    def conv(self, x: Tensor, weight: Tensor, bias: Tensor | None = None, activation: str | None = None, **_) -> Tensor:
        """[k, C, L] -> [k, C, L]: out[t] = sum_j weight[j] * x[t - K + 1 + j], zeros before position 0."""
        self.calls["conv"] += 1
        kernel = weight.shape[-1]
        windows = torch.nn.functional.pad(x.double(), (kernel - 1, 0)).unfold(-1, kernel, 1)  # [k, C, L, K]
        out = (windows * weight.double()[:, None, :]).sum(-1)
        out = out + bias.double()[:, None] if bias is not None else out
        return self._activate(out, activation).to(x.dtype)

    def conv_update(
        self, x: Tensor, conv_state: Tensor, weight: Tensor, bias: Tensor | None = None, activation: str | None = None
    ) -> Tensor:
        """x [R, C, 1]; `conv_state` [R, C, K] (the last K inputs) shifted by x in place."""
        self.calls["conv_update"] += 1
        window = torch.cat([conv_state[..., 1:], x.to(conv_state.dtype)], dim=-1)  # [R, C, K]
        conv_state.copy_(window)
        out = (window.double() * weight.double()).sum(-1, keepdim=True)
        out = out + bias.double()[:, None] if bias is not None else out
        return self._activate(out, activation).to(x.dtype)

    # The norms in float32 in transformers' own order of operations (its norms compute in float32 whatever the model
    # dtype, so the float64 rollback test stays exact and checks the routing: the effective weight 1 + w, eps);
    # fla's kernels compute the same in float32 in their own order, checked against these on the GPU.

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        """x * rsqrt(mean(x^2) + eps) * weight, `weight` the effective one (1 + w for Qwen3.5's norms)."""
        self.calls["rms_norm"] += 1
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)

    def gated_rms_norm(self, x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
        self.calls["gated_rms_norm"] += 1
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        return (weight * normed * torch.nn.functional.silu(gate.float())).to(x.dtype)

    def advance(self, query, key, value, g, beta, state: Tensor, use_qk_l2norm_in_kernel: bool) -> Tensor:
        self.calls["advance"] += 1
        out, final = naive_delta_rule(
            query, key, value, g, beta, state, output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel
        )
        state.copy_(final)
        return out


@pytest.mark.parametrize("kernels", ["transformers", "fla-contract"])
def test_verified_blocks_roll_the_recurrent_states_back_exactly(monkeypatch, kernels):
    """float64 model, transformers' delta-rule kernels replaced by a naive float64 recurrence (the engine routes
    whatever the layers call): the commit re-advance gives exactly the states of running the kept tokens only;
    with fla's contracts too (the verify window through the stateless convolution, the commit in place)."""
    for name in DELTA_RULE_KERNELS:
        monkeypatch.setattr(qwen3_5_modeling, name, naive_delta_rule)
    model = hybrid_target().double()
    ids = seeded(lambda: torch.randint(0, VOCAB, (3, 36)), 1)
    contract = FlaContract() if kernels == "fla-contract" else None
    run_blocks(model, ids, keeps=KEEPS, tolerance=1e-10, kernels=contract.kernels if contract else None)
    if contract:
        forwards, linear_layers = 1 + len(KEEPS), 3
        norms = 2 * 5 + 2 * 2 + 1  # two per layer, q and k norms of the 2 attention layers, the final norm
        assert contract.calls == {
            "conv": linear_layers * forwards,
            "advance": linear_layers * len(KEEPS),
            "rms_norm": norms * forwards,
            "gated_rms_norm": linear_layers * forwards,
        }


FLA_CONTRACT_KERNELS = ("conv", "conv_update", "advance", "rms_norm", "gated_rms_norm")


@pytest.fixture(params=["selected", "fla-contract"])
def engine_kernels(request, monkeypatch) -> FlaContract | None:
    """Every `TargetRunner` of the test runs the kernels `select_hybrid_kernels` picks (CPU: transformers'
    bindings; a GPU: fla's when importable) or fla's contracts in float64 (`FlaContract`)."""
    if request.param == "selected":
        return None
    contract = FlaContract()
    monkeypatch.setattr(target_module, "select_hybrid_kernels", lambda device: contract.kernels)
    return contract


def test_routed_convolutions_bind_for_one_forward_and_leave_unknown_activations_to_the_reference():
    contract = FlaContract()
    saved = [getattr(qwen3_5_modeling, name) for name in CONV_KERNELS]
    x, weight = torch.randn(2, 6, 5), torch.randn(6, 4)
    with routed_convolutions([qwen3_5_modeling], contract.kernels):
        routed = qwen3_5_modeling.causal_conv1d_fn
        fast = routed(x, weight, None, activation="silu")
        reference = routed(x, weight, None, activation="gelu")  # fla applies no gelu
    assert [getattr(qwen3_5_modeling, name) for name in CONV_KERNELS] == saved
    assert contract.calls == {"conv": 1}
    torch.testing.assert_close(fast, saved[0](x, weight, None, activation="silu"))
    torch.testing.assert_close(reference, saved[0](x, weight, None, activation="gelu"))
    assert select_hybrid_kernels(torch.device("cpu")) is TRANSFORMERS


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, GPU])]
# How far a logit of the float32 forward on a GPU (fla's kernels) may be from transformers' on the same device.
CUDA_LOGIT_TOLERANCE = 5e-2


@pytest.mark.parametrize(
    ("device", "tolerance"),
    [("cpu", 2e-3), pytest.param("cuda", CUDA_LOGIT_TOLERANCE, marks=[pytest.mark.gpu, GPU])],
    ids=["cpu", "cuda"],
)
def test_static_cache_forward_equals_transformers_with_its_own_kernels(device, tolerance):
    """float32 with the kernels transformers bound (its PyTorch fallbacks; on a GPU flash-linear-attention's
    Triton kernels when `fla` is importable, whose chunked form takes TF32 dots): equal up to their rounding, where
    a wrong rollback is off by O(1)."""
    model = hybrid_target().to(device)
    ids = seeded(lambda: torch.randint(0, VOCAB, (3, 36)), 1).to(device)
    run_blocks(model, ids, keeps=KEEPS, tolerance=tolerance)


NEEDS_FLA = pytest.mark.skipif(not fla_available(), reason="needs flash-linear-attention (fla-core) on the path")


@pytest.mark.gpu
@GPU
@NEEDS_FLA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_fla_kernels_keep_the_contracts_the_engine_relies_on(dtype):
    """fla's convolutions, norms and the in-place delta rule (`hybrid_kernels.FLA`) against `FlaContract`'s float64
    references, inputs laid out as transformers' layers pass them: float32 to its rounding, bf16 within one rounding
    step of the output. The one-token convolution leaves exactly the shifted state, and the in-place delta rule
    exactly what fla's public kernel returns as a fresh final state (the same kernel: aliasing its initial and final
    state is safe), at the Qwen3.6-27B layer's head shape. (Checked on the CPU in Triton's interpreter.)"""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    torch.manual_seed(0)
    device = torch.device("cuda")
    contract = FlaContract()
    step = 2**-7 if dtype == torch.bfloat16 else 1e-5  # bf16: one rounding step at 1
    rows, channels, kernel, length = 3, 320, 4, 9
    weight = (torch.randn(channels, kernel, device=device) / 2).to(dtype)
    x = torch.randn(rows, length, channels, device=device, dtype=dtype).transpose(1, 2)  # [R, C, L], as the layer's
    got = FLA.conv(x, weight, None, activation="silu")
    torch.testing.assert_close(got.double(), contract.conv(x, weight, None, "silu").double(), rtol=step, atol=step)

    state = torch.randn(rows, channels, kernel, device=device).to(dtype)
    expected_state = state.clone()
    x = torch.randn(rows, 1, channels, device=device, dtype=dtype).transpose(1, 2)  # [R, C, 1]
    got = FLA.conv_update(x, state, weight, None, "silu")
    expected = contract.conv_update(x, expected_state, weight, None, "silu")
    torch.testing.assert_close(got.double(), expected.double(), rtol=step, atol=step)
    assert torch.equal(state, expected_state)

    hidden = torch.randn(rows, 1, 5120, device=device, dtype=dtype)  # the decoder's norms
    weight = torch.randn(5120, device=device) * 0.1 + 1.0
    got, expected = FLA.rms_norm(hidden, weight, 1e-6), contract.rms_norm(hidden, weight, 1e-6)
    torch.testing.assert_close(got.double(), expected.double(), rtol=step, atol=step)
    query = torch.randn(rows, 1, 24, 512, device=device, dtype=dtype)[..., :256]  # q norm: a view of q_proj's output
    weight = weight[:256]
    got, expected = FLA.rms_norm(query, weight, 1e-6), contract.rms_norm(query, weight, 1e-6)
    torch.testing.assert_close(got.double(), expected.double(), rtol=step, atol=step)
    x, gate = (torch.randn(rows * 48, 128, device=device, dtype=dtype) for _ in range(2))  # the linear layers' norm
    weight = (torch.randn(128, device=device) * 0.1 + 1.0).to(dtype)
    got, expected = FLA.gated_rms_norm(x, gate, weight, 1e-6), contract.gated_rms_norm(x, gate, weight, 1e-6)
    # The reference rounds to the model dtype in the middle as transformers does, fla once: two steps apart at most.
    torch.testing.assert_close(got.double(), expected.double(), rtol=2 * step, atol=2 * step)

    for rows, tokens, heads, dim in ((3, 5, 4, 32), (16, 1, 48, 128)):
        q, k, v = (torch.randn(rows, tokens, heads, dim, device=device, dtype=dtype) for _ in range(3))
        g = -torch.rand(rows, tokens, heads, device=device)  # log-decays, float32 as the layer computes them
        beta = torch.rand(rows, tokens, heads, device=device).to(dtype)
        state = torch.randn(rows, heads, dim, dim, device=device)
        before, address = state.clone(), state.data_ptr()
        out = fla_advance(q, k, v, g, beta, state, True, FLA_PUBLIC_TILE)  # the public kernel's own tile
        assert state.data_ptr() == address
        public_out, public_final = fused_recurrent_gated_delta_rule(
            q, k, v, g=g, beta=beta, initial_state=before.clone(), output_final_state=True, use_qk_l2norm_in_kernel=True
        )
        assert torch.equal(out, public_out) and torch.equal(state, public_final)
        reference = before.clone()
        expected = contract.advance(q, k, v, g, beta, reference, True)
        torch.testing.assert_close(state, reference, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out.double(), expected.double(), rtol=max(step, 1e-4), atol=max(step, 1e-4))
        # Other tiles split the same arithmetic differently (`ADVANCE_TILES`); a bf16 state (its own tile) computes
        # as its float32 widening does and is rounded once, at the store.
        for tile in (ADVANCE_TILES[torch.float32], AdvanceTile(16, 2), AdvanceTile(64, 4)):
            tiled = before.clone()
            tiled_out = fla_advance(q, k, v, g, beta, tiled, True, tile)
            torch.testing.assert_close(tiled, state, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(tiled_out, out, rtol=max(step, 1e-5), atol=max(step, 1e-5))
        narrow = before.bfloat16()
        widened = narrow.float()
        narrow_out = FLA.advance(q, k, v, g, beta, narrow, True)
        widened_out = FLA.advance(q, k, v, g, beta, widened, True)
        torch.testing.assert_close(narrow_out, widened_out, rtol=max(step, 1e-5), atol=max(step, 1e-5))
        torch.testing.assert_close(narrow.float(), widened, rtol=2**-8, atol=1e-5)


@pytest.mark.gpu
@GPU
@NEEDS_FLA
def test_fla_engine_in_bfloat16_is_as_close_to_float32_as_transformers_kernels():
    """The verify-and-commit protocol in bf16 with fla's convolution and in-place commits, against the same weights'
    float32 forward: no further off than the engine with transformers' kernels (its reference convolution and the
    commit through the chunked kernel and a copy). A wrong rollback is off by O(1)."""
    exact = hybrid_target().cuda()
    model = copy.deepcopy(exact).bfloat16()
    ids = seeded(lambda: torch.randint(0, VOCAB, (3, 36)), 1).cuda()
    errors = {
        kernels.name: run_blocks(model, ids, keeps=KEEPS, tolerance=1.0, kernels=kernels, reference_model=exact)
        for kernels in (FLA, TRANSFORMERS)
    }
    assert errors["fla"] <= 1.5 * errors["transformers"] + 1e-2, errors


def test_only_known_hybrid_layouts_are_served():
    model = hybrid_target()
    model.config.model_type = "qwen3"  # linear-attention layers under a layout the engine has not checked
    with pytest.raises(UnsupportedTargetError, match="linear-attention"):
        TargetRunner(model)


def _prompts(lengths: tuple[int, ...]) -> list[list[int]]:
    return [seeded(lambda n=n: torch.randint(0, VOCAB, (n,)).tolist(), n) for n in lengths]


class Float64Greedy:
    """The CUDA variants' reference. On a GPU with `fla` importable, transformers binds flash-linear-attention's
    kernels: their chunked form (the engine's prefill, verify and commit) takes most of its float32 dots in TF32
    (hard-coded in some, Triton's default in others; torch's allow_tf32 flags do not reach them: rounding 2^-11
    relative), their one-token form has no dots. The tiny hybrids' top-2 logit margins along these tests' greedy
    outputs go down to 5e-3 (measured in float64; logits up to 17 with the orthogonal head, whose 4x scale widens
    the drafter's margins, not the target's), so an output on a GPU may part from exact greedy decoding at a
    near-tie and no test can hold it to token equality there. So on a GPU an output must equal the reference up to
    where it parts, and part only where the two tokens' float64 logits are within twice CUDA_LOGIT_TOLERANCE (each
    may be off by that much) of the top one. A wrong rollback moves logits by O(1) (gaps of 14-21 when the commit
    drops a token), and 85-93 % of the positions have margins above 0.1. The reference is the same hybrid in
    float64 on the CPU with the naive delta rule (fla's kernels take no CPU tensors)."""

    near_tie = 2 * CUDA_LOGIT_TOLERANCE

    def __init__(self, **build: object) -> None:
        self.model = hybrid_target(**build).double()

    def _run(self, function, *args):
        with pytest.MonkeyPatch.context() as patch, torch.no_grad():
            for name in DELTA_RULE_KERNELS:
                patch.setattr(qwen3_5_modeling, name, naive_delta_rule)
            return function(*args)

    def near_tie_at(self, top: float) -> float:
        """The largest gap to the top logit `top` that counts as a near-tie."""
        return self.near_tie

    def generate(self, prompt: list[int], max_new_tokens: int, stops: list[int]) -> list[int]:
        return self._run(hf_greedy, self.model, prompt, max_new_tokens, stops)

    def agreed(self, prompt: list[int], reference: list[int], got: list[int]) -> int:
        """The number of new tokens `got` shares with `reference` (greedy outputs of `prompt`, from any device);
        where they part, the two tokens must be a near-tie."""
        position = first_difference(reference, got)
        if position is None:
            return len(reference)
        assert position < min(len(reference), len(got)), f"one output ends early: {reference} vs {got}"
        logits = self._run(self.model, torch.tensor([prompt + reference[:position]])).logits[0, -1]
        gap = float(logits.max() - logits[[reference[position], got[position]]].min())
        near_tie = self.near_tie_at(float(logits.max()))
        assert gap <= near_tie, (
            f"new token {position}: {got[position]} instead of {reference[position]}, float64 logit gap {gap:.3g} "
            f"to the top one (near-tie: {near_tie:.3g})"
        )
        return position


@pytest.mark.parametrize("device", DEVICES)
def test_continuous_batching_of_a_hybrid_equals_generate(device, engine_kernels):
    """Seven prompts of different lengths through three rows: refilled rows start from a zero recurrent state
    (their previous request's state would change every later token), some replies stop on a stop token. On a GPU
    against float64 greedy decoding, parting only at near-ties (`Float64Greedy`)."""
    model = hybrid_target()
    exact = Float64Greedy() if device != "cpu" else None
    greedy = exact.generate if exact else partial(hf_greedy, model)
    prompts = _prompts((3, 9, 5, 14, 7, 2, 11))
    free_running = [greedy(p, 16, []) for p in prompts]
    stops = sorted({ref[5] for ref in free_running[:3] if ref[5] not in ref[:5]})
    assert stops
    references = [greedy(p, 16, stops) for p in prompts]
    assert {len(r) < 16 for r in references} == {True, False}
    decoder = BatchDecoder(TargetRunner(model.to(device)), rows=3, max_new_tokens=16, stop_token_ids=stops)
    got = {c.key: c.tokens for c in decoder.generate(RequestQueue([Request(i, p) for i, p in enumerate(prompts)]))}
    if exact:
        for index, prompt in enumerate(prompts):
            exact.agreed(prompt, references[index], got[index])
    else:
        assert [got[i] for i in range(len(prompts))] == references
    assert decoder.stats.prefills >= 3
    if engine_kernels:  # prefills convolve statelessly; decode steps shift the conv state and advance in place
        assert set(engine_kernels.calls) == set(FLA_CONTRACT_KERNELS)


class BatchOracleDrafter(DFlashDrafter):
    """Knows every row's greedy continuation; at position n of row r it drafts `correct(r, n)` right tokens, then
    wrong ones (hidden states the target's orthogonal LM head maps to exactly those tokens)."""

    def __init__(self, config: DrafterModelConfig, *, references: list[list[int]], head: Tensor, correct) -> None:
        super().__init__(config)
        self.references = references  # per row: prompt + greedy output
        self.head = head  # [V, H]: head[t] scores token t alone
        self.correct = correct

    def forward(self, *, features, block_embeds, ctx_positions, block_positions, masks, backend="sdpa", cache=None):
        rows, block = block_positions.shape
        hidden = torch.zeros(rows, block, HIDDEN, device=block_positions.device)
        for row in range(rows):
            reference = self.references[row]
            start = int(block_positions[row, 0])
            for slot in range(1, block):
                token = reference[start + slot] if start + slot < len(reference) else 0
                if slot > self.correct(row, start):
                    token = (token + 1) % VOCAB  # never what the target picks
                hidden[row, slot] = self.head[token]
        return hidden


def leading_steps(accepted_lengths: list[int], tokens: int) -> list[int]:
    """The accepted lengths of the verify steps that committed only new tokens among the first `tokens` (the
    prefill produced the first)."""
    ends = itertools.accumulate(accepted_lengths)
    return [length for length, end in zip(accepted_lengths, ends, strict=True) if 1 + end <= tokens]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [4, 6])
def test_speculative_decoding_of_a_hybrid_is_lossless_at_every_accepted_length(block_size, device, engine_kernels):
    """Three prompts decoded together; each row accepts a position-dependent number of drafts (0..B-1), so the
    recurrent states are rolled back by a different amount per row and step. Output equals plain decoding through
    the engine and transformers' greedy `generate`; the accepted lengths are exactly the oracle's. On a GPU (the
    orthogonal head does not widen the target's own margins: `Float64Greedy`): plain decoding parts from float64
    greedy decoding, and speculative from plain, only at near-ties, and the accepted lengths are the oracle's
    for every step before the parting (a wrong rollback parts at the first partial acceptance); the full set of
    lengths is checked when no row parted."""
    target = hybrid_target(orthogonal_head=True).to(device)
    exact = Float64Greedy(orthogonal_head=True) if device != "cpu" else None
    prompts = _prompts((10, 7, 13))
    max_new = 36
    plain = target_generate_batch(target, prompts, max_new_tokens=max_new, stop_token_ids=[])
    references = [result.output_ids for result in plain.results]
    if exact:
        for prompt, reference in zip(prompts, references, strict=True):
            exact.agreed(prompt, exact.generate(prompt, max_new, []), reference)
    else:
        assert references == [hf_greedy(target, p, max_new, []) for p in prompts]

    oracle, correct = rotating_oracle(target, prompts, references, block_size)
    oracle.to(device)
    # No CUDA graphs: the oracle reads block positions on the host (off CUDA there are none anyway).
    run = SpeculativeDecoder(target, oracle, prompts, max_new_tokens=max_new, stop_token_ids=[], use_graphs=False).run()
    parted = False
    for row, (prompt, result) in enumerate(zip(prompts, run.results, strict=True)):
        expected = expected_accepted_lengths(
            prompt_len=len(prompt), max_new_tokens=max_new, block_size=block_size, correct=partial(correct, row)
        )
        if exact:
            agreed = exact.agreed(prompt, references[row], result.output_ids)
            assert leading_steps(result.accepted_lengths, agreed) == leading_steps(expected, agreed)
            parted = parted or agreed < max_new
        else:
            assert result.output_ids == references[row]
            assert result.accepted_lengths == expected
    if not parted:
        lengths = {length for result in run.results for length in result.accepted_lengths}
        assert lengths == set(range(1, block_size + 1))
        assert all(result.tau > 1.0 for result in run.results)
    if engine_kernels:
        assert set(engine_kernels.calls) == set(FLA_CONTRACT_KERNELS)


# ------------------------------------------------------------------------------------------------------------
# bf16 recurrent states (`recurrent_state_dtype`, `recurrent.py` "State dtype"): the kernels compute in float32 from
# the stored state and round only the store, so logits move by about bf16 rounding of their scale, and speculative
# decoding parts from plain decoding only at near-ties. The bound: the evaluation's near-tie tolerance with a bf16
# state, NEAR_TIE_ULPS bf16 rounding steps of the top logit (the tiny hybrid over 32 steps: up to 0.58 of it).
BF16_STATE_ULPS = NEAR_TIE_ULPS * torch.finfo(torch.bfloat16).eps


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.float64])
def test_recurrent_states_are_float32_by_default_and_bfloat16_when_asked(model_dtype):
    model = hybrid_target().to(model_dtype)
    default = torch.float64 if model_dtype == torch.float64 else torch.float32
    sizes = {}
    for state_dtype, runner in [
        (default, TargetRunner(model)),
        (torch.bfloat16, TargetRunner(model, recurrent_state_dtype=torch.bfloat16)),
    ]:
        states = runner.new_cache(3, 16).recurrent
        layers = [layer for layer in states.layers if layer is not None]
        assert len(layers) == 3
        assert {layer.recurrent_states[0].dtype for layer in layers} == {state_dtype}
        assert {layer.conv_states[0].dtype for layer in layers} == {model_dtype}  # the convolution's stay
        # What the batch decoder sizes its rows by is what is allocated.
        assert runner.state_bytes_per_row() == sum(t.nbytes for t in states.tensors()) // 3
        sizes[state_dtype] = runner.state_bytes_per_row()
    dims = HYBRID_DIMS
    elements = 3 * dims["linear_num_value_heads"] * dims["linear_key_head_dim"] * dims["linear_value_head_dim"]
    assert sizes[default] - sizes[torch.bfloat16] == elements * (default.itemsize - 2)
    with pytest.raises(ValueError, match="floating-point"):
        TargetRunner(model, recurrent_state_dtype=torch.int16)


def teacher_forced_logits(runner: TargetRunner, prompt: list[int], tokens: list[int]) -> Tensor:
    """Prefill `prompt`, then one-token steps feeding `tokens[:-1]`: the logits before each of `tokens` [N, V]."""
    cache = runner.new_cache(1, len(prompt) + len(tokens))
    length = len(prompt)
    out = runner.forward(
        cache,
        torch.tensor([prompt]),
        torch.arange(length)[None],
        rows=torch.arange(1),
        last_index=torch.tensor([length - 1]),
    )
    logits = [out.logits[0]]
    for index, token in enumerate(tokens[:-1]):
        step = runner.forward(cache, torch.tensor([[token]]), torch.tensor([[length + index]]), kv_len=cache.max_len)
        logits.append(step.logits[0, 0])
    return torch.stack(logits)


def test_plain_decoding_with_bfloat16_states_stays_within_bf16_rounding_of_float32_states(engine_kernels):
    """Along the float32-state greedy output (32 tokens), a bf16-state engine's logits at every step are within
    the bf16 near-tie tolerance of the float32-state ones (max over the vocabulary); the prefill's are equal (it
    reads no stored state); later ones do differ (the states really are bf16, rounded after each step)."""
    model = hybrid_target()
    (prompt,) = _prompts((10,))
    (plain,) = target_generate_batch(model, [prompt], max_new_tokens=32, stop_token_ids=[]).results
    exact = teacher_forced_logits(TargetRunner(model), prompt, plain.output_ids)
    rounded = teacher_forced_logits(TargetRunner(model, recurrent_state_dtype=torch.bfloat16), prompt, plain.output_ids)
    difference = (rounded - exact).abs().amax(-1)  # [N]
    tolerance = BF16_STATE_ULPS * exact.amax(-1).abs().clamp(min=1.0)  # [N]
    share = float((difference / tolerance).max())
    print(f"bf16 states: max |logit difference| {float(difference.max()):.4f}, {share:.2f} of the tolerance")
    assert torch.equal(rounded[0], exact[0])
    assert float(difference[1:].min()) > 0
    assert bool((difference <= tolerance).all()), (difference / tolerance).tolist()
    if engine_kernels:  # the decode steps advanced the bf16 states in place
        assert engine_kernels.calls["advance"] > 0


class Bf16StateNearTies(Float64Greedy):
    """Near-ties of two bf16-state runs: each may be off by the bf16-state tolerance of the top logit."""

    def near_tie_at(self, top: float) -> float:
        return 2 * BF16_STATE_ULPS * max(abs(top), 1.0)


def test_speculative_decoding_with_bfloat16_states_parts_from_plain_only_at_near_ties(engine_kernels):
    """The rollback with bf16 states: three rows, each accepting a position-dependent number of drafts (the oracle
    of the lossless test, drafting plain bf16-state decoding's tokens). Speculative output equals plain output (both
    with bf16 states) up to where they part, and they part, if at all, only where both tokens' float64 logits are
    within twice the bf16-state tolerance of the top one (each run may be off by about that much); before the
    parting every step accepted exactly what the oracle offered (a wrong rollback parts at the first partial
    acceptance, with gaps of 14-21). Plain bf16-state decoding itself parts from float64 greedy decoding only at
    such near-ties."""
    block_size, max_new = 4, 36
    target = hybrid_target(orthogonal_head=True)
    exact = Bf16StateNearTies(orthogonal_head=True)
    prompts = _prompts((10, 7, 13))
    bf16 = torch.bfloat16
    plain = target_generate_batch(
        target, prompts, max_new_tokens=max_new, stop_token_ids=[], recurrent_state_dtype=bf16
    )
    references = [result.output_ids for result in plain.results]
    for prompt, reference in zip(prompts, references, strict=True):
        exact.agreed(prompt, exact.generate(prompt, max_new, []), reference)

    oracle, correct = rotating_oracle(target, prompts, references, block_size)
    run = SpeculativeDecoder(
        target, oracle, prompts, max_new_tokens=max_new, stop_token_ids=[], use_graphs=False, recurrent_state_dtype=bf16
    ).run()
    agreed_tokens = []
    for row, (prompt, result) in enumerate(zip(prompts, run.results, strict=True)):
        expected = expected_accepted_lengths(
            prompt_len=len(prompt), max_new_tokens=max_new, block_size=block_size, correct=partial(correct, row)
        )
        agreed = exact.agreed(prompt, references[row], result.output_ids)
        assert leading_steps(result.accepted_lengths, agreed) == leading_steps(expected, agreed)
        agreed_tokens.append(agreed)
    print(f"bf16 states: speculative == plain for the first {agreed_tokens} of {max_new} tokens")
    assert sum(agreed_tokens) >= max_new  # the rows do not all part at once
    if all(agreed == max_new for agreed in agreed_tokens):
        lengths = {length for result in run.results for length in result.accepted_lengths}
        assert lengths == set(range(1, block_size + 1))
    if engine_kernels:  # the commits advanced the bf16 states in place
        assert engine_kernels.calls["advance"] > 0


def test_target_recurrent_state_dtype_config():
    from dflash_trainer.config import ConfigError, TargetConfig, load_config

    assert load_config(None, []).target.recurrent_state_dtype == "auto"
    assert load_config(None, ["target.recurrent_state_dtype=bfloat16"]).target.recurrent_state_dtype == "bfloat16"
    with pytest.raises(ConfigError, match=r"target\.recurrent_state_dtype"):
        load_config(None, ["target.recurrent_state_dtype=float16"])
    # Every value the config accepts names a state dtype of the engine.
    values = typing.get_args(typing.get_type_hints(TargetConfig)["recurrent_state_dtype"])
    assert set(values) == set(STATE_DTYPES)
    assert STATE_DTYPES["auto"] is None and STATE_DTYPES["bfloat16"] == torch.bfloat16


def test_capture_after_the_first_run_leaves_the_recurrent_states_as_one_run_does(monkeypatch):
    """A key's first call runs the step and then captures it (its Python twice, its kernels once): simulated for
    every step (`run_then_capture`), the tokens (sampled, plain and speculative) must equal running it once; the
    recurrent states' bookkeeping (verify records, commit) must survive the second pass of Python."""
    model = hybrid_target()
    prompts = _prompts((3, 9, 5, 14))
    sampling = SamplingParams(temperature=1.0, top_p=0.9)
    config = DrafterModelConfig.from_target(
        model.config, num_layers=1, block_size=4, mask_token_id=VOCAB - 1, num_target_features=2
    )
    drafter = seeded(lambda: DFlashDrafter(config).eval(), 0)

    def run_all() -> tuple[dict, list]:
        decoder = BatchDecoder(TargetRunner(model), rows=2, max_new_tokens=10, stop_token_ids=[5], sampling=sampling)
        queue = RequestQueue([Request(i, p, seed=i) for i, p in enumerate(prompts)])
        plain = {c.key: c.tokens for c in decoder.generate(queue)}
        speculative = SpeculativeDecoder(
            model, drafter, prompts, max_new_tokens=10, stop_token_ids=[5], sampling=sampling, seeds=range(4)
        ).run()
        return plain, [r.output_ids for r in speculative.results]

    reference = run_all()
    assert reference[1] == [reference[0][i] for i in range(len(prompts))]  # speculative sampling == plain sampling

    monkeypatch.setattr(StepGraphs, "run", run_then_capture)
    assert run_all() == reference


@pytest.mark.parametrize("state_dtype", [None, torch.bfloat16], ids=["auto", "bfloat16"])
def test_evaluation_of_a_hybrid_target_reports_tau_and_checks_losslessness(
    tiny_qwen3_5, tiny_chat_tokenizer, tmp_path: Path, state_dtype, monkeypatch
):
    """With bf16 recurrent states (`recurrent_state_dtype`: every decoder of the evaluation keeps them) the outputs
    may part at near-ties (bf16 tolerance)."""
    state_dtypes = set()
    new_cache = TargetRunner.new_cache

    def recording_new_cache(runner: TargetRunner, *args: int) -> object:
        state_dtypes.add(runner.recurrent_state_dtype)
        return new_cache(runner, *args)

    monkeypatch.setattr(TargetRunner, "new_cache", recording_new_cache)
    target = cpu_target(tiny_qwen3_5, tiny_chat_tokenizer, "tiny-hybrid")
    drafter = DFlashDrafter(
        DrafterModelConfig.from_target(
            tiny_qwen3_5.config, num_layers=1, block_size=4, mask_token_id=5, target_layer_ids=[1, 2]
        )
    )
    path = tmp_path / "prompts.jsonl"
    lines = [{"id": f"p{i}", "prompt": " ".join(f"w{(7 * i + j) % 200}" for j in range(4 + i))} for i in range(3)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    report = evaluate(
        target,
        drafter,
        [str(path)],
        num_prompts=3,
        max_new_tokens=12,
        progress=False,
        recurrent_state_dtype=state_dtype,
    )
    (data,) = report.datasets
    assert data.lossless_checked and data.exact_matches + len(data.near_ties) == 3
    assert state_dtype is not None or data.exact_matches == 3
    assert state_dtypes == {state_dtype or torch.float32}
    assert data.tau >= 1.0 and sum(data.accepted_histogram) > 0


@pytest.mark.slow
def test_hybrid_steps_trace_without_graph_breaks():
    """The hybrid decode and verify steps (routed delta rules, recurrent states, commit) compile as one graph
    (dynamo, no code generation): no host syncs, no data-dependent shapes, what a CUDA-graph capture needs."""
    model = hybrid_target()
    sampling = SamplingParams(temperature=1.0, top_p=0.9)
    decoder = BatchDecoder(TargetRunner(model), rows=2, max_new_tokens=8, stop_token_ids=[5], sampling=sampling)
    config = DrafterModelConfig.from_target(
        model.config, num_layers=1, block_size=4, mask_token_id=VOCAB - 1, num_target_features=2
    )
    drafter = seeded(lambda: DFlashDrafter(config).eval(), 0)
    speculative = SpeculativeDecoder(
        model, drafter, [[1, 2, 3], [4, 5, 6, 7]], max_new_tokens=8, stop_token_ids=[5], sampling=sampling
    )
    torch._dynamo.reset()
    try:
        with torch.inference_mode():
            decoder._prefill([0, 1], [Request(0, [1, 2, 3]), Request(1, [7])])
            torch.compile(partial(decoder._decode_step, 128), backend="eager", fullgraph=True)()
            speculative._prefill()
            torch.compile(partial(speculative._step, 128), backend="eager", fullgraph=True)()
    finally:
        torch._dynamo.reset()


# A stand-in for flash-linear-attention's two entry points (its signatures; the naive recurrence inside), so the
# engine's routing is checked against the calling convention transformers uses when it binds `fla` on a GPU.
FLA_STAND_IN = """
import torch
CALLS = []
def _naive(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel):
    q, k, v, b, decay = (x.transpose(1, 2).float() for x in (q, k, v, beta, g))
    if use_qk_l2norm_in_kernel:
        q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    q = q * (scale if scale is not None else q.shape[-1] ** -0.5)
    state = initial_state.float() if initial_state is not None else q.new_zeros(*k.shape[:2], k.shape[-1], v.shape[-1])
    out = []
    for t in range(k.shape[2]):
        state = state * decay[:, :, t].exp()[..., None, None]
        delta = (v[:, :, t] - (state * k[:, :, t, :, None]).sum(-2)) * b[:, :, t, None]
        state = state + k[:, :, t, :, None] * delta[:, :, None, :]
        out.append((state * q[:, :, t, :, None]).sum(-2))
    return torch.stack(out, 2).transpose(1, 2).to(v.dtype), (state if output_final_state else None)
def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
    CALLS.append("chunk")
    return _naive(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel)
def fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None, initial_state=None,
                                     output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None,
                                     **kwargs):
    assert gk is None and gv is None and beta is not None
    CALLS.append("recurrent")
    return _naive(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel)
"""
FLA_CHECK = """
import fla.ops.gated_delta_rule as fla
from decoding_helpers import hf_greedy, hybrid_target
from dflash_trainer.decoding.plain import target_generate_batch
from dflash_trainer.decoding.speculative import SpeculativeDecoder
from dflash_trainer.model.config import DrafterModelConfig
from dflash_trainer.model.drafter import DFlashDrafter
model = hybrid_target()
prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
plain = [r.output_ids for r in target_generate_batch(model, prompts, max_new_tokens=10, stop_token_ids=[]).results]
calls = set(fla.CALLS)
config = DrafterModelConfig.from_target(
    model.config, num_layers=1, block_size=4, mask_token_id=63, num_target_features=2
)
drafter = DFlashDrafter(config).eval()
run = SpeculativeDecoder(model, drafter, prompts, max_new_tokens=10, stop_token_ids=[]).run()
assert calls == {"chunk", "recurrent"}, calls
assert plain == [r.output_ids for r in run.results] == [hf_greedy(model, p, 10, []) for p in prompts]
print("ok")
"""


def test_engine_with_flash_linear_attention_calling_convention(tmp_path: Path):
    """transformers binds `fla`'s kernels (when importable) under the same names: with a stand-in of fla's two
    entry points on the path, plain decoding (prefill: chunk; decode: fused recurrent) and speculative decoding
    (verify and commit: chunk) through the engine still equal `generate`."""
    package = tmp_path / "fla" / "ops" / "gated_delta_rule"
    package.mkdir(parents=True)
    for folder in (tmp_path / "fla", tmp_path / "fla" / "ops"):
        (folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text(FLA_STAND_IN)
    here = Path(__file__).resolve().parent
    path = os.pathsep.join([str(tmp_path), str(here), str(here.parent / "src")])
    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", FLA_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr


def test_a_dropped_decoders_recurrent_states_are_freed_at_once():
    """The recurrent states (tens of GB on a large hybrid at hundreds of rows) go with their cache as soon as the
    decoder is dropped, without waiting for the garbage collector: nothing closes a reference cycle around them."""
    import gc
    import weakref

    runner = TargetRunner(hybrid_target())
    decoder = BatchDecoder(runner, rows=2, max_new_tokens=3, stop_token_ids=[], max_len=16, refill_min=2)
    list(decoder.generate(RequestQueue([Request(index, [1, 2, 3 + index]) for index in range(2)])))
    states = weakref.ref(decoder.cache.recurrent)
    gc.disable()
    try:
        del decoder
        assert states() is None
    finally:
        gc.enable()


def rotating_oracle(target, prompts: list[list[int]], references: list[list[int]], block_size: int):
    """A 1-layer oracle drafter over `references` (the target's greedy outputs) on a target with an orthogonal head:
    in row r, the block at `position` gets `(position + r) % block_size` tokens right. Returns (oracle, correct)."""

    def correct(row: int, position: int) -> int:
        return (position + row) % block_size

    config = DrafterModelConfig.from_target(
        target.config, num_layers=1, block_size=block_size, mask_token_id=VOCAB - 1, num_target_features=2
    )
    oracle = BatchOracleDrafter(
        config,
        references=[p + r for p, r in zip(prompts, references, strict=True)],
        head=target.lm_head.weight / 4.0,
        correct=correct,
    )
    return oracle, correct
