"""Which kernels the linear-attention (Gated DeltaNet) layers of a hybrid target run in the decoding engine.

transformers 5.17's `Qwen3_5GatedDeltaNet` calls four kernels by module-level names of its modeling module, bound
once when transformers imports that module:
- `causal_conv1d_fn` and `causal_conv1d_update` (the short causal convolution over q/k/v): the `causal-conv1d`
  package's CUDA kernels when it is importable then, else PyTorch references (`F.conv1d` over the zero-padded
  input; for one token a cat, a copy into the state, a conv, an activation and a cast: five kernels per layer and
  step, with the warning "falling back to its reference PyTorch implementation"). transformers never binds
  flash-linear-attention's convolution;
- `torch_chunk_gated_delta_rule` and `torch_recurrent_gated_delta_rule`: flash-linear-attention's Triton kernels
  when `fla` is importable then, else PyTorch references.

`LinearKernels` says what the engine adds on top. `TRANSFORMERS` adds nothing: the layers run what transformers
bound (CPU, the tests' reference, a GPU without `fla`). `select_linear_kernels(device)` gives `FLA` on a CUDA
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
  and fla's default use, queries and keys L2-normalised in the kernel when asked (as transformers asks).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import cache, partial
from types import ModuleType

import torch
from torch import Tensor

# The module-level names transformers' Gated DeltaNet layers call their convolution kernels by.
CONV_KERNELS = ("causal_conv1d_fn", "causal_conv1d_update")
# Activations fla's convolution applies (others would be silently skipped: the reference runs then).
_FLA_ACTIVATIONS = (None, "silu", "swish")
# The fused recurrent kernel's parameters `advance` passes (fla-core 0.5.2); another signature: no `advance`.
_RECURRENT_KERNEL_ARGS = (
    {"q", "k", "v", "g", "gk", "gv", "beta", "A_log", "dt_bias", "o", "h0", "ht", "cu_seqlens"}
    | {"scale", "T", "H", "HV", "K", "V", "BK", "BV"}
    | {"USE_QK_L2NORM_IN_KERNEL", "IS_BETA_HEADWISE", "STATE_V_FIRST", "APPLY_BETA_SIGMOID", "ALLOW_NEG_EIGVAL"}
)

# (query, key, value, g, beta, state, use_qk_l2norm_in_kernel) -> output [k, T, HV, V]; `state` [k, HV, K, V]
# advanced over the T tokens in place.
Advance = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, bool], Tensor]


@dataclass(frozen=True)
class LinearKernels:
    """What the engine runs in linear-attention layers besides transformers' bindings (module docstring).
    `conv` / `conv_update` take transformers' calling convention of `causal_conv1d_fn` / `causal_conv1d_update`
    and are used only where transformers bound its references; None keeps transformers' binding."""

    name: str
    conv: Callable[..., Tensor] | None = None
    conv_update: Callable[..., Tensor] | None = None
    advance: Advance | None = None


TRANSFORMERS = LinearKernels("transformers")


# ----------------------------------------------------------------------------------------------------------
# flash-linear-attention


def fla_conv(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, activation: str | None = None, **_: object
) -> Tensor:
    """`causal_conv1d_fn`: `x` [k, C, L] -> [k, C, L], the causal convolution with zeros before position 0."""
    from fla.modules.convolution import causal_conv1d

    y, _ = causal_conv1d(x.transpose(1, 2), weight=weight, bias=bias, activation=activation, backend="triton")
    return y.transpose(1, 2)  # [k, C, L] view of the [k, L, C] output


def fla_conv_update(
    x: Tensor, conv_state: Tensor, weight: Tensor, bias: Tensor | None = None, activation: str | None = None
) -> Tensor:
    """`causal_conv1d_update`: `x` [R, C, 1] -> [R, C, 1]; `conv_state` [R, C, W] shifted by x in place."""
    from fla.modules.convolution import causal_conv1d_update

    y, _ = causal_conv1d_update(x=x.transpose(1, 2), cache=conv_state, weight=weight, bias=bias, activation=activation)
    return y.transpose(1, 2)


def fla_advance(
    query: Tensor,  # [k, T, H, K]
    key: Tensor,  # [k, T, H, K]
    value: Tensor,  # [k, T, HV, V]
    g: Tensor,  # [k, T, HV] log-decay
    beta: Tensor,  # [k, T, HV]
    state: Tensor,  # [k, HV, K, V] float32, advanced in place
    use_qk_l2norm_in_kernel: bool,
) -> Tensor:
    """The gated delta rule over T tokens from `state`, which ends advanced in place; returns [k, T, HV, V]."""
    import triton
    from fla.ops.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule_fwd_kernel as kernel

    rows, length, heads, key_dim = key.shape
    value_heads, value_dim = value.shape[-2:]
    if state.shape != (rows, value_heads, key_dim, value_dim) or not state.is_contiguous():
        raise ValueError(f"advance: state of shape {tuple(state.shape)} for {rows} rows x {value_heads} heads")
    query, key, value, g, beta = (t.contiguous() for t in (query, key, value, g, beta))
    out = torch.empty_like(value)
    block_v = min(8, triton.next_power_of_2(value_dim))  # fla's own choice for this kernel
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
            num_warps=1,
            num_stages=3,
        )
    return out


FLA = LinearKernels("fla", conv=fla_conv, conv_update=fla_conv_update, advance=fla_advance)


@cache
def fla_available() -> bool:
    """`fla` importable with the fused recurrent kernel this module launches (module docstring)."""
    if importlib.util.find_spec("fla") is None:
        return False
    try:
        from fla.modules.convolution import causal_conv1d, causal_conv1d_update  # noqa: F401
        from fla.ops.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule_fwd_kernel as kernel
    except ImportError:
        return False
    return set(getattr(kernel, "arg_names", ())) >= _RECURRENT_KERNEL_ARGS


def select_linear_kernels(device: torch.device) -> LinearKernels:
    """`FLA` on a CUDA device where flash-linear-attention can run, else `TRANSFORMERS`."""
    return FLA if device.type == "cuda" and fla_available() else TRANSFORMERS


@cache
def causal_conv1d_installed() -> bool:
    """transformers binds the `causal-conv1d` package's kernels when it is importable; those are kept."""
    return importlib.util.find_spec("causal_conv1d") is not None


@contextmanager
def routed_convolutions(modules: Sequence[ModuleType], kernels: LinearKernels) -> Iterator[None]:
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
        kernel = fast if activation in _FLA_ACTIVATIONS else reference
        return kernel(x, weight, bias, activation=activation, **kwargs)

    return causal_conv1d_fn


def _conv_update(fast: Callable[..., Tensor], reference: Callable[..., Tensor]) -> Callable[..., Tensor]:
    def causal_conv1d_update(
        x: Tensor, conv_state: Tensor, weight: Tensor, bias: Tensor | None = None, activation: str | None = None
    ) -> Tensor:
        kernel = fast if activation in _FLA_ACTIVATIONS else reference
        return kernel(x, conv_state, weight, bias, activation)

    return causal_conv1d_update
