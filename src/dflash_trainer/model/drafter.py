"""The DFlash drafter (DESIGN §2): fused target context, Qwen3-style layers with KV injection.

    ctx = RMSNorm(fc([h_l1; ...; h_lK]))                      shared by every layer
    per layer: queries from block tokens; keys/values = [W ctx ; W x] with the same W
               context entries skip Q, O and the MLP; non-causal inside a block
    out = RMSNorm(x)                                           fed to the target's frozen LM head

Parameter names follow the z-lab `DFlashDraftModel` checkpoint (`layers.{i}.self_attn.q_proj`, `fc`,
`hidden_norm`, `norm`, ...), so export is a plain state-dict save. The target's embedding and LM head are not
submodules: the caller embeds the block tokens and applies the head (they stay frozen and are never saved).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from ..compiling import compile_dynamic, configure_compiler
from .attention import Backend, DrafterMasks, MaskVariant, attend
from .config import DrafterModelConfig
from .fp8 import Fp8Scaling, Fp8TrainingLinear, convert_to_fp8_training, fp8_linear


class RMSNorm(nn.Module):
    """Qwen3's RMSNorm: normalise in float32, return the input dtype. (Qwen3 scales in the input dtype; with
    fp32 master weights under bf16 autocast that would promote the output to fp32, so we scale in fp32 and cast.)"""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32).to(dtype)


def fused_linear(x: Tensor, layers: Sequence[nn.Linear], *, fp8: bool = True) -> list[Tensor]:
    """The outputs of several Linear layers that read the same input, from one matmul over their concatenated
    weights (and biases). The parameters, and with them the checkpoint names, stay separate; the step runs one
    wider GEMM instead of narrow ones (q/k/v: 576 / 192 / 192 columns on SmolLM2), in the backward too. In FP8
    when all of them train in FP8 (`model/fp8.py`: the concatenated weight is quantised as one) and `fp8` allows it."""
    weight = torch.cat([layer.weight for layer in layers])  # [sum(out), in]
    bias = None if layers[0].bias is None else torch.cat([layer.bias for layer in layers])
    if fp8 and all(isinstance(layer, Fp8TrainingLinear) and layer.training for layer in layers):
        out = fp8_linear(x, weight, bias, rowwise=layers[0].rowwise, fast_backward=layers[0].fast_backward)
    else:
        out = F.linear(x, weight, bias)
    return list(out.split([layer.out_features for layer in layers], dim=-1))


def project_context(fc: nn.Linear, hidden_norm: RMSNorm, features: Tensor) -> Tensor:
    """[R, T, K*H] target features -> [R, T, H] context (`DFlashDrafter.fuse_context`); a function of its modules,
    so that the FP8 path compiles the projection and the norm as one region (`DFlashDrafter.compile_layers`)."""
    return hidden_norm(fc(features))


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [R, heads, S, D]; cos/sin [R, S, D]."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


class ContextCache(Protocol):
    """Where inference keeps the context's keys and values per layer (the decoding engine's
    `decoding/drafter_step.StaticDrafterContext`): context K/V do not depend on the block, so each step projects only
    the newly accepted tokens' features and `append` returns everything the layer attends to."""

    def append(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]: ...


class DrafterAttention(nn.Module):
    def __init__(self, config: DrafterModelConfig, layer: int) -> None:
        super().__init__()
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.flex_kernel_options: dict[str, int | bool] = {}  # DFlashDrafter.set_flex_kernel_options
        self.window = config.layer_window(layer)
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def _keys_values(self, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """Projected keys and values [R, S, Hkv*D] -> normed, rotated keys and values [R, Hkv, S, D]."""
        rows, length, _ = k.shape
        k = self.k_norm(k.view(rows, length, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = v.view(rows, length, self.kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(
        self,
        x: Tensor,  # [R, Q, H] block tokens (normed)
        ctx: Tensor,  # [R, T, H] fused context (new entries only when a cache is given)
        block_rope: tuple[Tensor, Tensor],
        ctx_rope: tuple[Tensor, Tensor],
        mask: object | None,
        backend: Backend,
        cache: ContextCache | None = None,
        layer: int = 0,
    ) -> Tensor:
        rows, q_len, _ = x.shape
        q, k_blk, v_blk = fused_linear(x, (self.q_proj, self.k_proj, self.v_proj))
        q = self.q_norm(q.view(rows, q_len, self.heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, *block_rope)  # [R, Hq, Q, D]
        # The context's keys and values stay in bf16 with FP8 linears: a narrow GEMM (2 x kv columns) over many rows,
        # where quantising the rows costs more than FP8 saves (paper setting, forward + backward: 1.32 ms in FP8
        # against 0.70 in bf16 per layer, benchmarks/BENCHMARKS.md 2026-12-03).
        k_ctx, v_ctx = self._keys_values(*fused_linear(ctx, (self.k_proj, self.v_proj), fp8=False), *ctx_rope)
        if cache is not None:
            # The cache returns the context this layer attends to (on window layers only what the window can reach:
            # decoding/drafter_step.py), masked by `mask` together with the block.
            k_ctx, v_ctx = cache.append(layer, k_ctx, v_ctx)
        k_blk, v_blk = self._keys_values(k_blk, v_blk, *block_rope)
        k = torch.cat([k_ctx, k_blk], dim=2)  # [R, Hkv, T+Q, D]
        v = torch.cat([v_ctx, v_blk], dim=2)
        out = attend(q, k, v, mask, backend, self.scale, self.flex_kernel_options)  # [R, Hq, Q, D]
        return self.o_proj(out.transpose(1, 2).reshape(rows, q_len, self.heads * self.head_dim))


class DrafterMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = fused_linear(x, (self.gate_proj, self.up_proj))
        return self.down_proj(F.silu(gate) * up)


class DrafterLayer(nn.Module):
    def __init__(self, config: DrafterModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.variant = MaskVariant(
            window=config.layer_window(layer), causal_in_block=config.layer_causal_in_block(layer)
        )
        self.self_attn = DrafterAttention(config, layer)
        self.mlp = DrafterMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: Tensor,
        ctx: Tensor,
        block_rope: tuple[Tensor, Tensor],
        ctx_rope: tuple[Tensor, Tensor],
        mask: object | None,
        backend: Backend,
        cache: ContextCache | None,
    ) -> Tensor:
        # `self.layer` is read only with a cache (inference): a per-layer value read here would make the compiled
        # layers guard on it and compile once per layer.
        layer = self.layer if cache is not None else 0
        x = x + self.self_attn(
            self.input_layernorm(x), ctx, block_rope, ctx_rope, mask, backend, cache=cache, layer=layer
        )
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    # A block drafter of another family subclasses this one and swaps its layer (model/dflash2/).
    layer_class: type[DrafterLayer] = DrafterLayer

    def __init__(self, config: DrafterModelConfig) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.fc = nn.Linear(config.num_features * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.layers = nn.ModuleList(self.layer_class(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        # Recompute each layer's activations in the backward instead of keeping them (set by the trainer from
        # `drafter.activation_checkpointing`): a layer keeps only its input, [R, N*B, H], instead of about 16x that
        # (q/k/v, attention output, the MLP's 3 x intermediate-wide tensors), for one more forward of the layers.
        self.checkpoint_layers = False
        self.rotary_emb = Qwen3RotaryEmbedding(config.to_hf_config())
        self._project_context = project_context  # compiled by compile_layers
        self._one_layer_graph = False  # compile_layers: see forward
        # Kept outside the module's buffers so `.to(bfloat16)` cannot round it (see `_apply`).
        self._inv_freq_fp32 = self.rotary_emb.inv_freq.detach().clone().float().cpu()
        self.reset_parameters()

    def _apply(self, fn, recurse=True):
        """`.to(dtype)` would round the RoPE frequencies to bf16 (a radian of phase error by position ~1000):
        whatever the module's dtype, the frequencies stay the exact float32 values."""
        super()._apply(fn, recurse)
        device = self.rotary_emb.inv_freq.device
        self.rotary_emb.inv_freq = self._inv_freq_fp32.to(device)
        self.rotary_emb.original_inv_freq = self._inv_freq_fp32.to(device)
        return self

    @property
    def mask_variants(self) -> list[MaskVariant]:
        return list(dict.fromkeys(layer.variant for layer in self.layers))

    def reset_parameters(self, std: float = 0.02) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def fuse_context(self, features: Tensor) -> Tensor:
        """[R, T, K*H] target features -> [R, T, H] context shared by every layer. Outside autocast, features of
        another dtype than the drafter's (a bf16 target beside an fp32 drafter on the CPU) are cast to its dtype;
        under autocast the projection casts them itself, so they are left as they are (no [R, T, K*H] copy)."""
        if not torch.is_autocast_enabled(features.device.type):
            features = features.to(self.fc.weight.dtype)
        return self._project_context(self.fc, self.hidden_norm, features)

    def forward(
        self,
        *,
        features: Tensor,  # [R, T, K*H]
        block_embeds: Tensor,  # [R, N*B, H] target embedding of [x_a, MASK...] per block
        ctx_positions: Tensor,  # [R, T]
        block_positions: Tensor,  # [R, N*B]
        masks: DrafterMasks | None,
        backend: Backend = "sdpa",
        cache: ContextCache | None = None,
    ) -> Tensor:
        """Returns the final-normed block hidden states [R, N*B, H]. `masks` None (inference only): every block
        query sees all context and its whole block."""
        ctx = self.fuse_context(features)
        x = block_embeds.to(ctx.dtype)
        if self._one_layer_graph and torch.is_grad_enabled() and not x.requires_grad:
            # Compiled layers guard on whether their input requires grad: the first layer's (frozen embeddings)
            # does not, the others' do, so the first would compile a graph of its own, forward and backward (one
            # more layer compile in the cold first step). With this input a leaf that requires grad, all layers
            # run one graph; the price is the first layer's input gradient, which nothing reads: one
            # [tokens, q+k+v] x [q+k+v, H] GEMM and a norm backward per step (~2 ms at the paper shape, 0.5 %).
            x = x.detach().requires_grad_()
        block_rope = self.rotary_emb(x, block_positions)  # cos/sin [R, N*B, D]
        ctx_rope = self.rotary_emb(x, ctx_positions)  # [R, T, D]
        recompute = self.checkpoint_layers and self.training and torch.is_grad_enabled()
        for layer in self.layers:
            mask = masks.for_variant(layer.variant) if masks is not None else None
            if recompute:
                # Non-reentrant: works around compiled layers (their saved tensors go through the checkpoint's hooks)
                # and restores autocast for the recomputation.
                x = checkpoint(layer, x, ctx, block_rope, ctx_rope, mask, backend, cache, use_reentrant=False)
            else:
                x = layer(x, ctx, block_rope, ctx_rope, mask, backend, cache)
        return self.norm(x)

    def draft_tokens(self, hidden: Tensor, logits: Tensor, anchor_tokens: Tensor) -> Tensor:
        """The drafts of slots 1..B-1 from their final hidden states [R, B-1, H] and LM-head logits [R, B-1, V]
        (`anchor_tokens` [R]: slot 0's token): DFlash takes each slot's argmax independently."""
        return logits.argmax(dim=-1)

    def set_flex_kernel_options(self, options: dict[str, int | bool]) -> None:
        """Tiles, warps and stages of flex_attention's kernels in every layer (`drafter.flex_kernel_options`,
        checked by config.flex_kernel_option_problem); set before the first compiled call, which bakes them in."""
        for layer in self.layers:
            layer.self_attn.flex_kernel_options = dict(options)

    def export_state_dict(self) -> dict[str, Tensor]:
        """The tensors an export holds (and its digest covers): DFlash's whole state dict."""
        return self.state_dict()

    def use_fp8_training(self, scaling: Fp8Scaling = "tensorwise") -> tuple[int, int]:
        """Train the linear layers (q/k/v/o, gate/up/down, fc; never the norms) in FP8 from now on (`model/fp8.py`):
        same parameters and names, exact in eval mode. Call before compile_layers and before building the optimizer.
        Returns (linear layers converted, left in high precision because a size is not a multiple of 16)."""
        return convert_to_fp8_training(self, scaling=scaling)

    def compile_layers(self, mode: str = "default", backend: str = "inductor") -> None:
        """torch.compile each decoder layer (GPU training): fuses the norms, RoPE, SwiGLU and residual adds
        around the matmuls and compiles flex attention inside. Shapes change from batch to batch (rows, row
        length, anchors; bucketed by the data stage), so the layers compile with symbolic sizes from the first
        call: one compile, no recompile per new shape. The layers share one code object and read no per-layer
        value on the training path, so they also share the compiled code: one frame, one graph for all of them
        (regional compilation), once the first layer's input requires grad as the others' do (forward). The two
        norms outside the layers are compiled too (one more frame: eager, the final one makes seven float32 passes
        over every block position); an FP8 context projection compiles with its norm as one region instead (its
        FP8 GEMMs run inside as opaque ops, `model/fp8.py`). `backend`: another dynamo
        backend, for tests ("eager" counts frames without Inductor)."""
        configure_compiler()  # the first batch's coincident sizes must not become guards (compiling.py)
        self._one_layer_graph = True
        options = {} if backend != "inductor" else {"mode": mode}
        for layer in self.layers:
            layer.compile(dynamic=True, backend=backend, **options)
        self.norm.compile(dynamic=True, backend=backend, **options)
        if isinstance(self.fc, Fp8TrainingLinear):
            self._project_context = compile_dynamic(project_context, backend=backend, **options)
        else:
            self.hidden_norm.compile(dynamic=True, backend=backend, **options)

    def compile_for_decoding(self, backend: str | Callable = "inductor") -> None:
        """torch.compile the pieces of the inference pass that hold no context cache (`decoding/drafter_step.py`):
        every RMSNorm (the layers', the q/k norms, the final and the context norm) and every MLP, with symbolic
        sizes (one compile per kind of piece, before any CUDA graph is captured: the prefill's proposal runs
        eagerly first). Why: a decoding step replays one CUDA graph of small kernels, and at batch 1 its time
        follows their count (on SmolLM2, 1,392 ops per plain step and 1,961 per DFlash step at block 16, about
        2 us each; 1,740 with this); eager, an RMSNorm is 8 kernels (cast, square, mean, add, rsqrt, two products,
        cast), compiled one. The attention stays eager: its cache writes and `kv_len`-sized reads would recompile
        per KV bucket. `eval` calls it on a GPU (measured at batch 1 on an H200: a DFlash2 step 1.77 -> 1.48 target
        steps); a compiled drafter is for decoding only, not for training. `backend`: another dynamo backend (a
        name or a callable), for tests."""
        configure_compiler()
        for module in self.modules():
            if isinstance(module, (RMSNorm, DrafterMLP)):
                module.compile(dynamic=True, backend=backend)


def build_drafter(config: DrafterModelConfig) -> DFlashDrafter:
    """The drafter of `config`'s algorithm, freshly initialised: DFlash (this module) or DFlash2 (model/dflash2/).

    Every block drafter shares this module's context projection, KV injection, masks and layer stack; each family
    beyond DFlash is one package beside model/dflash2/ of the same shape (a config subclass, a drafter subclass
    with its own layer or head, its loss term, its export keys), chosen here by its config class: see
    model/dflash2/__init__.py for where DSpark and DSpine would go."""
    from .dflash2 import DFlash2Drafter, DFlash2ModelConfig  # the subpackage builds on this module

    if isinstance(config, DFlash2ModelConfig):
        return DFlash2Drafter(config)
    return DFlashDrafter(config)
