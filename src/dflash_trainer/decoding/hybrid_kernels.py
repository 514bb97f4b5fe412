"""Which kernels the layers of a hybrid target (Qwen3.5/3.6) run in the decoding engine besides transformers' own.

transformers 5.17's `Qwen3_5GatedDeltaNet` calls four kernels by module-level names of its modeling module, bound
once when transformers imports that module:
- `causal_conv1d_fn` and `causal_conv1d_update` (the short causal convolution over q/k/v): the `causal-conv1d`
  package's CUDA kernels when it is importable then, else PyTorch references (`F.conv1d` over the zero-padded
  input; for one token a cat, a copy into the state, a conv, an activation and a cast: five kernels per layer and
  step, with the warning "falling back to its reference PyTorch implementation"). transformers never binds
  flash-linear-attention's convolution;
- `torch_chunk_gated_delta_rule` and `torch_recurrent_gated_delta_rule`: flash-linear-attention's Triton kernels
  when `fla` is importable then, else PyTorch references.

`HybridKernels` says what the engine adds on top. `TRANSFORMERS` adds nothing: the layers run what transformers
bound (CPU, the tests' reference, a GPU without `fla`). `select_hybrid_kernels(device)` gives `FLA` on a CUDA
device where `fla` (fla-core 0.5.2, the version these facts were read in) is importable and the fused recurrent
kernel has the signature below:
- `conv`, `conv_update`: for the duration of an engine forward (`routed_convolutions`) the two convolution names
  point at fla's Triton convolution, unless transformers bound `causal-conv1d`'s (then those run).
  `fla.modules.convolution.causal_conv1d(x [B, T, D] (any strides), weight [D, W], bias, activation)` returns
  `(y [B, T, D], final state)`; it also takes an initial state `[N, D, W]`, returns the final one and runs packed
  rows through `cu_seqlens`, but has no per-row lengths for right-padded rows, so the engine keeps its own state
  bookkeeping (`recurrent.py`) and runs it statelessly over what `update_conv_state` returns (the prompt, zeros
  before position 0; or the window [state ; block]), exactly as transformers' reference does.
  `causal_conv1d_update(x [N, 1, D], cache [N, D, W], weight, bias, activation)` is the one-token step: it shifts
  `cache` in place (transformers' `conv_states` layout: the last W inputs, oldest first) and returns `(y, cache)`;
  its autotuner restores the cache after each timing run.
- `advance`: one call that runs the delta rule over T tokens and leaves the state advanced in place
  (`RecurrentStates`: plain decode steps and the commit after a verify step). fla's public
  `fused_recurrent_gated_delta_rule` returns a fresh final state, which the engine would then copy into its
  static state: at 256 rows of the Qwen3.6-27B shape (48 linear layers, 48 value heads of 128 x 128, float32)
  that is 38.6 GB read and written twice per step instead of once (about 9 ms of an H200's 4.3 TB/s each way).
  So `advance` launches its kernel (`fused_recurrent_gated_delta_rule_fwd_kernel`) itself with the initial
  and the final state the same tensor, which is safe: each program loads its own `[K, BV]` tile of the state
  into registers before the token loop and stores that same tile after it, and no two programs share a tile.
  Inputs as transformers passes them (`[k, T, H, K]` queries and keys already repeated to the value heads,
  `[k, T, HV, V]` values, `[k, T, HV]` log-decays and betas), the scale 1/sqrt(K) as transformers' references
  and fla's default use, queries and keys L2-normalised in the kernel when asked (as transformers asks). The
  state may be float32 or bfloat16 (`recurrent.py` "State dtype"): the kernel loads its tile as float32
  (`tl.load(h0).to(tl.float32)`), runs the T tokens in float32 registers (the outputs see the unrounded memory)
  and stores `b_h.to(ht's element type)`, so a bf16 state is rounded once per call, at the store.
  Each program owns `BV` whole columns of a head's `[K, V]` state, so it reads rows of `BV` contiguous elements:
  fla picks `BV = 8`, 32 bytes of float32, one memory sector; in bf16 the same 8 columns are half a sector, and the
  one-token update of a 256-row 27B state reached 1,583 GB/s against 2,856 in float32 (BENCHMARKS.md, 2026-12-02).
  `ADVANCE_TILES` gives each state dtype its columns per program and warps; the tile does not change the arithmetic
  (every column's update is independent of the others), only how the state is read.
- `rms_norm`, `gated_rms_norm`: for the duration of an engine forward (`routed_norms`) the `forward` of the
  target's `Qwen3_5RMSNorm` modules (two per layer, the attention layers' q and k norms, the final norm) and
  `Qwen3_5RMSNormGated` modules (the linear layers' output norm) is one fla Triton kernel instead of transformers'
  8 to 12 elementwise kernels (casts, square, mean, rsqrt, products). With CUDA graphs a decode step of the 27B
  shape is otherwise about 3,600 small kernels besides the GEMMs, a few microseconds each whatever the rows (about
  10 ms of a 25 ms step at 8 rows); the norms are 1,600 of them. Same arithmetic in float32: transformers'
  zero-centred norm is `x * rsqrt(mean(x^2) + eps) * (1 + w)` computed in float32 and cast back, and fla's
  `rms_norm(x, w', eps)` computes `x * rstd * w'` in float32 with `w' = 1 + w` (float32, made once per module
  by `NormWeights`); the gated norm is `rmsnorm(x) * w * silu(gate)`, which transformers rounds to the model
  dtype once more in the middle (`w * x_normed.to(dtype)`) and fla does not: bf16 outputs may differ by a
  rounding step, float32 ones by float32 rounding.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import cache, partial
from types import ModuleType

import torch
from torch import Tensor, nn

# The module-level names transformers' Gated DeltaNet layers call their convolution kernels by.
CONV_KERNELS = ("causal_conv1d_fn", "causal_conv1d_update")
# Activations fla's convolution applies (others would be silently skipped: the reference runs then).
FLA_CONV_ACTIVATIONS = (None, "silu", "swish")
# The fused recurrent kernel's parameters `advance` passes (fla-core 0.5.2); another signature: no `advance`.
_RECURRENT_KERNEL_ARGS = (
    {"q", "k", "v", "g", "gk", "gv", "beta", "A_log", "dt_bias", "o", "h0", "ht", "cu_seqlens"}
    | {"scale", "T", "H", "HV", "K", "V", "BK", "BV"}
    | {"USE_QK_L2NORM_IN_KERNEL", "IS_BETA_HEADWISE", "STATE_V_FIRST", "APPLY_BETA_SIGMOID", "ALLOW_NEG_EIGVAL"}
)

# (query, key, value, g, beta, state, use_qk_l2norm_in_kernel) -> output [k, T, HV, V]; `state` [k, HV, K, V]
# advanced over the T tokens in place.
Advance = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, bool], Tensor]
# (x [..., D], weight [D] float32 (1 + w for zero-centred norms), eps) -> [..., D] in x's dtype.
RmsNorm = Callable[[Tensor, Tensor, float], Tensor]
# (x [N, D], gate [N, D], weight [D], eps) -> rmsnorm(x) * weight * silu(gate), [N, D] in x's dtype.
GatedRmsNorm = Callable[[Tensor, Tensor, Tensor, float], Tensor]


@dataclass(frozen=True)
class HybridKernels:
    """What the engine runs in a hybrid's layers besides transformers' bindings (module docstring).
    `conv` / `conv_update` take transformers' calling convention of `causal_conv1d_fn` / `causal_conv1d_update`
    and are used only where transformers bound its references; None keeps transformers' binding (or forward)."""

    name: str
    conv: Callable[..., Tensor] | None = None
    conv_update: Callable[..., Tensor] | None = None
    advance: Advance | None = None
    rms_norm: RmsNorm | None = None
    gated_rms_norm: GatedRmsNorm | None = None


TRANSFORMERS = HybridKernels("transformers")


# ----------------------------------------------------------------------------------------------------------
# flash-linear-attention


def fla_conv(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    activation: str | None = None,
    cu_seq_lens_q: Tensor | None = None,
    cu_seqlens_cpu: Tensor | None = None,
    **_: object,
) -> Tensor:
    """`causal_conv1d_fn`: `x` [k, C, L] -> [k, C, L], the causal convolution with zeros before position 0, and
    before every sequence's first token when one row's sequence boundaries come with the layer's keyword arguments
    (`cu_seq_lens_q` [S+1] on the device, `cu_seqlens_cpu` on the host: `targets/varlen_hybrid.py`)."""
    from fla.modules.convolution import causal_conv1d

    y, _ = causal_conv1d(
        x.transpose(1, 2),
        weight=weight,
        bias=bias,
        activation=activation,
        backend="triton",
        cu_seqlens=cu_seq_lens_q,
        cu_seqlens_cpu=cu_seqlens_cpu,
    )
    return y.transpose(1, 2)  # [k, C, L] view of the [k, L, C] output


def fla_conv_update(
    x: Tensor, conv_state: Tensor, weight: Tensor, bias: Tensor | None = None, activation: str | None = None
) -> Tensor:
    """`causal_conv1d_update`: `x` [R, C, 1] -> [R, C, 1]; `conv_state` [R, C, W] shifted by x in place."""
    from fla.modules.convolution import causal_conv1d_update

    y, _ = causal_conv1d_update(x=x.transpose(1, 2), cache=conv_state, weight=weight, bias=bias, activation=activation)
    return y.transpose(1, 2)


@dataclass(frozen=True)
class AdvanceTile:
    """How `fla_advance` splits a head's `[K, V]` state among programs: `block_v` whole columns each (at most V),
    on `num_warps` warps."""

    block_v: int
    num_warps: int


# fla's choice for this kernel (its public function's), and the fastest of a sweep of 8 tiles per state dtype for
# the one-token update of the 27B shape at 256 rows on an H200 (BENCHMARKS.md, 2026-12-02): float32 22.4 ms per
# step at 32 x 2 against 27.0 at fla's 8 x 1; bf16 15.5 ms at 16 x 1 (32-byte rows, one memory sector) against 24.4.
FLA_PUBLIC_TILE = AdvanceTile(8, 1)
ADVANCE_TILES = {torch.float32: AdvanceTile(32, 2), torch.bfloat16: AdvanceTile(16, 1)}


def fla_advance(
    query: Tensor,  # [k, T, H, K]
    key: Tensor,  # [k, T, H, K]
    value: Tensor,  # [k, T, HV, V]
    g: Tensor,  # [k, T, HV] log-decay
    beta: Tensor,  # [k, T, HV]
    state: Tensor,  # [k, HV, K, V] float32 or bfloat16, advanced in place (computed in float32)
    use_qk_l2norm_in_kernel: bool,
    tile: AdvanceTile | None = None,
) -> Tensor:
    """The gated delta rule over T tokens from `state`, which ends advanced in place; returns [k, T, HV, V].
    `tile` (default: `ADVANCE_TILES` for the state's dtype) is for benchmarks that compare tiles."""
    import triton
    from fla.ops.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule_fwd_kernel as kernel

    tile = tile or ADVANCE_TILES.get(state.dtype, ADVANCE_TILES[torch.float32])
    rows, length, heads, key_dim = key.shape
    value_heads, value_dim = value.shape[-2:]
    if state.shape != (rows, value_heads, key_dim, value_dim) or not state.is_contiguous():
        raise ValueError(f"advance: state of shape {tuple(state.shape)} for {rows} rows x {value_heads} heads")
    query, key, value, g, beta = (t.contiguous() for t in (query, key, value, g, beta))
    out = torch.empty_like(value)
    block_v = min(tile.block_v, triton.next_power_of_2(value_dim))
    grid = (triton.cdiv(value_dim, block_v), rows * value_heads)
    device = torch.cuda.device(state.device) if state.device.type == "cuda" else nullcontext()
    with device:
        kernel[grid](
            q=query,
            k=key,
            v=value,
            g=g,
            gk=None,
            gv=None,
            beta=beta,
            A_log=None,
            dt_bias=None,
            o=out,
            h0=state,
            ht=state,  # the same tensor: in place (module docstring)
            cu_seqlens=None,
            scale=key_dim**-0.5,
            T=length,
            H=heads,
            HV=value_heads,
            K=key_dim,
            V=value_dim,
            BK=triton.next_power_of_2(key_dim),
            BV=block_v,
            IS_BETA_HEADWISE=beta.ndim != value.ndim,
            USE_QK_L2NORM_IN_KERNEL=use_qk_l2norm_in_kernel,
            APPLY_BETA_SIGMOID=False,
            ALLOW_NEG_EIGVAL=False,
            STATE_V_FIRST=False,
            num_warps=tile.num_warps,
            num_stages=3,
        )
    return out


def fla_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    from fla.modules.layernorm import rms_norm

    return rms_norm(x, weight, None, eps=eps)


def fla_gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    from fla.modules.fused_norm_gate import rms_norm_gated

    return rms_norm_gated(x, gate, weight, None, activation="swish", eps=eps)


FLA = HybridKernels(
    "fla",
    conv=fla_conv,
    conv_update=fla_conv_update,
    advance=fla_advance,
    rms_norm=fla_rms_norm,
    gated_rms_norm=fla_gated_rms_norm,
)


@cache
def fla_available() -> bool:
    """`fla` importable with the fused recurrent kernel this module launches (module docstring)."""
    if importlib.util.find_spec("fla") is None:
        return False
    try:
        convolution = importlib.import_module("fla.modules.convolution")
        gated_norm = importlib.import_module("fla.modules.fused_norm_gate")
        norm = importlib.import_module("fla.modules.layernorm")
        from fla.ops.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule_fwd_kernel as kernel
    except ImportError:
        return False
    needed = (convolution, "causal_conv1d"), (convolution, "causal_conv1d_update"), (gated_norm, "rms_norm_gated")
    if not all(hasattr(module, name) for module, name in (*needed, (norm, "rms_norm"))):
        return False
    return set(getattr(kernel, "arg_names", ())) >= _RECURRENT_KERNEL_ARGS


def select_hybrid_kernels(device: torch.device) -> HybridKernels:
    """`FLA` on a CUDA device where flash-linear-attention can run, else `TRANSFORMERS`."""
    return FLA if device.type == "cuda" and fla_available() else TRANSFORMERS


@cache
def causal_conv1d_installed() -> bool:
    """transformers binds the `causal-conv1d` package's kernels when it is importable; those are kept."""
    return importlib.util.find_spec("causal_conv1d") is not None


@contextmanager
def routed_convolutions(modules: Sequence[ModuleType], kernels: HybridKernels) -> Iterator[None]:
    """Inside the block, the layers of `modules` run `kernels`' convolutions (where `kernels` has them and
    transformers bound its references); activations fla does not apply run the reference still."""
    if kernels.conv is None or kernels.conv_update is None or causal_conv1d_installed():
        yield
        return
    saved = [(module, name, getattr(module, name)) for module in modules for name in CONV_KERNELS]
    wrappers = {
        "causal_conv1d_fn": partial(_conv_fn, kernels.conv),
        "causal_conv1d_update": partial(_conv_update, kernels.conv_update),
    }
    for module, name, reference in saved:
        setattr(module, name, wrappers[name](reference))
    try:
        yield
    finally:
        for module, name, reference in saved:
            setattr(module, name, reference)


# transformers' calling conventions (5.17): `causal_conv1d_fn(x, weight, bias, activation=..., **kwargs)` and
# `causal_conv1d_update(x, conv_state, weight, bias, activation)` (activation positional).


def _conv_fn(fast: Callable[..., Tensor], reference: Callable[..., Tensor]) -> Callable[..., Tensor]:
    def causal_conv1d_fn(
        x: Tensor, weight: Tensor, bias: Tensor | None = None, activation: str | None = None, **kwargs: object
    ) -> Tensor:
        kernel = fast if activation in FLA_CONV_ACTIVATIONS else reference
        return kernel(x, weight, bias, activation=activation, **kwargs)

    return causal_conv1d_fn


def _conv_update(fast: Callable[..., Tensor], reference: Callable[..., Tensor]) -> Callable[..., Tensor]:
    def causal_conv1d_update(
        x: Tensor, conv_state: Tensor, weight: Tensor, bias: Tensor | None = None, activation: str | None = None
    ) -> Tensor:
        kernel = fast if activation in FLA_CONV_ACTIVATIONS else reference
        return kernel(x, conv_state, weight, bias, activation)

    return causal_conv1d_update


# ----------------------------------------------------------------------------------------------------------
# Norms


# The norm classes of transformers' Qwen3.5/3.6 modeling module whose forward `routed_norms` replaces (5.17: the
# zero-centred RMSNorm `x_normed * (1 + w)` and the gated RMSNorm with a silu gate).
_QWEN3_5_MODELING = "transformers.models.qwen3_5.modeling_qwen3_5"
ZERO_CENTRED_NORM = "Qwen3_5RMSNorm"
GATED_NORM = "Qwen3_5RMSNormGated"


class NormWeights:
    """The norms of `root` that `routed_norms` serves, with their float32 effective weights (made once)."""

    def __init__(self, root: nn.Module) -> None:
        self.zero_centred: list[tuple[nn.Module, Tensor]] = []
        self.gated: list[nn.Module] = []
        for module in root.modules():
            kind = type(module)
            if kind.__module__ != _QWEN3_5_MODELING:
                continue
            if kind.__name__ == ZERO_CENTRED_NORM:
                self.zero_centred.append((module, 1.0 + module.weight.detach().float()))
            elif kind.__name__ == GATED_NORM and module.activation in ("silu", "swish"):
                self.gated.append(module)


@contextmanager
def routed_norms(norms: NormWeights, kernels: HybridKernels) -> Iterator[None]:
    """Inside the block, the modules in `norms` run `kernels`' norms (where it has them) instead of their forward."""
    patched: list[nn.Module] = []
    if kernels.rms_norm is not None:
        for module, weight in norms.zero_centred:
            module.forward = partial(kernels.rms_norm, weight=weight, eps=module.eps)
            patched.append(module)
    if kernels.gated_rms_norm is not None:
        for module in norms.gated:
            module.forward = partial(kernels.gated_rms_norm, weight=module.weight, eps=module.variance_epsilon)
            patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            del module.forward  # the class's forward again
