"""The token-mixing kernels of linear-attention layers as opaque custom ops inside the target's compiled layers.

Contract: inside `opaque_linear_attention_kernels(modules)`, each modeling module in `modules` that defines the
Gated DeltaNet kernels transformers (5.17) binds at import (`torch_chunk_gated_delta_rule`, `causal_conv1d_fn`: the
Qwen3.5/3.6, Qwen3.5-MoE, Qwen3-Next and OLMo-hybrid modeling files) has those names pointed at a wrapper. Outside
compiled code the wrapper calls the bound function as it is; while dynamo traces, a stateless call (no cache, no
`seq_idx`: what a feature capture makes, over plain rows or, with the sequences' boundaries `cu_seqlens`, over one
row of sequences: `varlen_hybrid.py`) becomes one call of a custom op
(`dflash_target::chunk_gated_delta_rule`, `dflash_target::causal_conv1d`) whose kernel is that same bound function,
run eagerly with the graph's inputs. Every other call goes to the bound function unchanged. On exit the module's own
functions are back. The ops' outputs are the bound function's, contiguous (the delta rule's as both of its
implementations return it; the convolution's in `[B, T, C]`, the layout fla writes, handed to the layer as the
`[B, C, T]` view it expects); their fakes give shape and dtype from the inputs, symbolic sizes included, so one
graph serves every row count and length.

Why: the bound function is one of two things, and dynamo handles neither well when it traces a decoder layer.
- flash-linear-attention installed (the GPU): fla-core 0.5.2's `chunk_gated_delta_rule` is `torch.compiler.disable`d.
  Dynamo breaks the graph there, four frames deep (the layer's forward, accelerate's hook wrapper, the Gated
  DeltaNet forward, transformers' kernel wrapper): each linear-attention layer then runs as four graphs and their
  resume functions (counted on the CPU with a disabled stand-in), each frame compiled and guarded on its own (on
  the kernel output's strides too).
- its PyTorch reference (no fla; the CPU): a Python loop over 64-token chunks. Dynamo unrolls it, so the graph grows
  with the row length, and guards on the chunk count: each new `ceil(length / 64)` compiles the layer again
  (counted on the CPU: a second length of another chunk count recompiled the linear-attention layers at once), up
  to dynamo's recompile limit, after which the layers run eagerly. Packed rows of a hybrid run per document
  (`per_document.py`), so the lengths change with every group.
As custom ops the kernels are opaque: the compiled graph holds the norms, projections, gates, the MLP and the
full-attention layers; the delta rule and the short convolution run between its pieces exactly as they run eagerly
(fla's kernels and their autotuning, or the reference), and a decoder class compiles one graph per layer type
(linear or full attention) whatever the lengths. A custom op rather than `torch.compiler.disable`: a disabled call
breaks the graph, an op is a node in it.

The ops find their kernel by name (`module.function`) in a table filled on entry, so a compiled graph calls whatever
function the module binds when it runs. Nested or concurrent uses are counted; the last one out restores the module.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from types import ModuleType

import torch
from torch import Tensor, nn

CHUNK_RULE = "torch_chunk_gated_delta_rule"
CONVOLUTION = "causal_conv1d_fn"
# The reference's chunk length; fla's default. A call naming another one is left to the bound function.
_CHUNK_SIZE = 64

# "module.function" -> the function transformers bound there (the kernel each op runs).
_KERNELS: dict[str, Callable] = {}
_users: dict[str, int] = {}  # module name -> captures currently inside the context
_lock = threading.Lock()


@torch.library.custom_op("dflash_target::chunk_gated_delta_rule", mutates_args=())
def _chunk_gated_delta_rule(
    kernel: str,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    g: Tensor,
    beta: Tensor,
    use_qk_l2norm_in_kernel: bool,
    cu_seqlens: Tensor | None,
    cu_seqlens_cpu: Tensor | None,
) -> Tensor:
    """`[B, T, HV, V]` in query's dtype: the bound kernel's output, no initial and no final state; over one row of
    sequences when their boundaries `cu_seqlens` `[S+1]` (and the same on the host) are given."""
    out, _ = _KERNELS[kernel](
        query,
        key,
        value,
        g=g,
        beta=beta,
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        cu_seqlens=cu_seqlens,
        **_host_boundaries("cu_seqlens_cpu", cu_seqlens_cpu),
    )
    return out.contiguous()


@_chunk_gated_delta_rule.register_fake
def _chunk_gated_delta_rule_fake(
    kernel, query, key, value, g, beta, use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_cpu
):
    return value.new_empty(value.shape, dtype=query.dtype)  # [B, T, HV, V]


@torch.library.custom_op("dflash_target::causal_conv1d", mutates_args=())
def _causal_conv1d(
    kernel: str,
    hidden_states: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    activation: str | None,
    cu_seq_lens_q: Tensor | None,
    cu_seqlens_cpu: Tensor | None,
) -> Tensor:
    """`hidden_states` `[B, C, T]` -> `[B, T, C]` contiguous in hidden_states' dtype: the bound depthwise causal
    convolution (and activation), transposed, the layout fla's kernel writes (its `[B, C, T]` result is a view of
    it, and the layer reads q/k/v from the transposed result: the op hands that back without a copy); the
    sequences' boundaries, when given, go to the kernel as the layer's keywords (`hybrid_kernels.fla_conv`)."""
    boundaries = _host_boundaries("cu_seq_lens_q", cu_seq_lens_q) | _host_boundaries("cu_seqlens_cpu", cu_seqlens_cpu)
    out = _KERNELS[kernel](hidden_states, weight, bias, activation=activation, **boundaries)  # [B, C, T]
    return out.transpose(1, 2).contiguous()  # [B, T, C]


@_causal_conv1d.register_fake
def _causal_conv1d_fake(kernel, hidden_states, weight, bias, activation, cu_seq_lens_q, cu_seqlens_cpu):
    batch, channels, length = hidden_states.shape
    return hidden_states.new_empty((batch, length, channels))  # [B, T, C]


def _host_boundaries(name: str, value: Tensor | None) -> dict[str, Tensor]:
    """`{name: value}`, or nothing for None: a keyword passed on only when the capture gave it."""
    return {} if value is None else {name: value}


def _chunk_rule_wrapper(kernel: str) -> Callable:
    def torch_chunk_gated_delta_rule(
        query: Tensor,
        key: Tensor,
        value: Tensor,
        g: Tensor,
        beta: Tensor,
        chunk_size: int = _CHUNK_SIZE,
        initial_state: Tensor | None = None,
        output_final_state: bool = False,
        use_qk_l2norm_in_kernel: bool = False,
        cu_seqlens: Tensor | None = None,
        **passed_through,
    ) -> tuple[Tensor, Tensor | None]:
        stateless = initial_state is None and not output_final_state
        if torch.compiler.is_compiling() and stateless and chunk_size == _CHUNK_SIZE:
            # The layer's other keywords (use_cache, ...) are parameters of neither kernel: transformers' own
            # wrapper drops them as well.
            op = torch.ops.dflash_target.chunk_gated_delta_rule
            host = passed_through.get("cu_seqlens_cpu")
            return op(kernel, query, key, value, g, beta, use_qk_l2norm_in_kernel, cu_seqlens, host), None
        return _KERNELS[kernel](
            query,
            key,
            value,
            g=g,
            beta=beta,
            chunk_size=chunk_size,
            initial_state=initial_state,
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            cu_seqlens=cu_seqlens,
            **passed_through,
        )

    return torch_chunk_gated_delta_rule


def _convolution_wrapper(kernel: str) -> Callable:
    def causal_conv1d_fn(
        hidden_states: Tensor,
        weight: Tensor,
        bias: Tensor | None = None,
        activation: str | None = None,
        seq_idx: Tensor | None = None,
        **passed_through,
    ) -> Tensor:
        if torch.compiler.is_compiling() and seq_idx is None:
            boundaries = passed_through.get("cu_seq_lens_q"), passed_through.get("cu_seqlens_cpu")
            op = torch.ops.dflash_target.causal_conv1d
            return op(kernel, hidden_states, weight, bias, activation, *boundaries).transpose(1, 2)  # [B, C, T]
        return _KERNELS[kernel](hidden_states, weight, bias, activation=activation, seq_idx=seq_idx, **passed_through)

    return causal_conv1d_fn


_WRAPPER_FACTORIES = {CHUNK_RULE: _chunk_rule_wrapper, CONVOLUTION: _convolution_wrapper}


def linear_attention_modules(layers: Iterable[nn.Module]) -> tuple[ModuleType, ...]:
    """The modeling modules of the classes in `layers` (and inside them) that define the kernels above."""
    names = sorted({type(module).__module__ for layer in layers for module in layer.modules()})
    modules = (sys.modules.get(name) for name in names)
    return tuple(m for m in modules if m is not None and any(hasattr(m, name) for name in _WRAPPER_FACTORIES))


@contextmanager
def opaque_linear_attention_kernels(modules: Iterable[ModuleType]) -> Iterator[None]:
    """The kernels of `modules` as custom ops while dynamo traces, for the duration (module docstring)."""
    entered = []
    try:
        for module in modules:
            _enter(module)
            entered.append(module)
        yield
    finally:
        for module in entered:
            _exit(module)


def _enter(module: ModuleType) -> None:
    with _lock:
        if _users.get(module.__name__, 0) == 0:
            for function, make_wrapper in _WRAPPER_FACTORIES.items():
                bound = getattr(module, function, None)
                if bound is None:
                    continue
                kernel = f"{module.__name__}.{function}"
                _KERNELS[kernel] = bound
                setattr(module, function, make_wrapper(kernel))
        _users[module.__name__] = _users.get(module.__name__, 0) + 1


def _exit(module: ModuleType) -> None:
    with _lock:
        _users[module.__name__] -= 1
        if _users[module.__name__] == 0:
            for function in _WRAPPER_FACTORIES:
                kernel = f"{module.__name__}.{function}"
                if kernel in _KERNELS and hasattr(module, function):
                    setattr(module, function, _KERNELS[kernel])
