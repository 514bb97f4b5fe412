"""The DFlash2 drafter: the DFlash drafter (`model/drafter.py`) with a convolution around each sublayer and a path
selector on its outputs. Everything else is DFlash's own code: context projection, KV injection, masks, RoPE.

One layer, with conv_a / conv_m the layer's `attention_conv` / `mlp_conv` (`conv.py`):

    h, k_a = conv_a.prepare(input_layernorm(x))          # convolve the normed input; k_a from the same input
    x = x + conv_a.finish(self_attn(h, ctx), k_a)        # block K/V read h; the context K/V read ctx unchanged
    h, k_m = conv_m.prepare(post_attention_layernorm(x))
    x = x + conv_m.finish(mlp(h), k_m)

The final norm, the target's LM head and the selector (`selector.py`) then turn slots 1..B-1 into drafts
(`draft_tokens`). Parameter names are those of z-lab's `DFlash2DraftModel` checkpoints:
`layers.{i}.attention_conv.{base_kernel, kernel_projection.weight}`, `layers.{i}.mlp_conv.(same)`,
`candidate_selector.{hidden_projection.weight, predecessor_codebook, successor_codebook}`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from ..attention import Backend
from ..drafter import ContextCache, DFlashDrafter, DrafterLayer
from .config import DFlash2ModelConfig
from .conv import GroupedDynamicCausalConv
from .selector import CandidateSelector


class DFlash2Layer(DrafterLayer):
    def __init__(self, config: DFlash2ModelConfig, layer: int) -> None:
        super().__init__(config, layer)
        sizes = dict(taps=config.conv_kernel_size, group_size=config.conv_group_size, block_size=config.block_size)
        self.attention_conv = GroupedDynamicCausalConv(config.hidden_size, **sizes)
        self.mlp_conv = GroupedDynamicCausalConv(config.hidden_size, **sizes)

    def forward(
        self,
        x: Tensor,  # [R, N*B, H] whole blocks
        ctx: Tensor,
        block_rope: tuple[Tensor, Tensor],
        ctx_rope: tuple[Tensor, Tensor],
        mask: object | None,
        backend: Backend,
        cache: ContextCache | None,
    ) -> Tensor:
        layer = self.layer if cache is not None else 0  # as in DrafterLayer: read only at inference
        h, attention_kernel = self.attention_conv.prepare(self.input_layernorm(x))
        h = self.self_attn(h, ctx, block_rope, ctx_rope, mask, backend, cache=cache, layer=layer)
        x = x + self.attention_conv.finish(h, attention_kernel)
        h, mlp_kernel = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(h), mlp_kernel)


class DFlash2Drafter(DFlashDrafter):
    layer_class = DFlash2Layer
    config: DFlash2ModelConfig

    def __init__(self, config: DFlash2ModelConfig) -> None:
        super().__init__(config)
        self.candidate_selector = CandidateSelector(
            config.hidden_size,
            config.vocab_size,
            rank=config.selector_rank,
            top_k=config.selector_top_k,
            codebooks=config.selector_codebooks,
        )
        # Draft with the selector's walk (what the engines serve); off inside `argmax_drafts`.
        self.walk_drafts = True

    def reset_parameters(self, std: float = 0.02) -> None:
        """DFlash's initialisation, then the convolutions as identities and the selector as a no-op on the unary
        scores (`conv.py`, `selector.py`): a new DFlash2 drafter drafts what the DFlash drafter of its weights would.
        (DFlashDrafter's own initialiser runs this before the selector exists; the selector initialises itself.)"""
        super().reset_parameters(std)
        for module in self.modules():
            if isinstance(module, GroupedDynamicCausalConv):
                module.reset_parameters()
            elif isinstance(module, CandidateSelector):
                module.reset_parameters(std)

    def export_state_dict(self) -> dict[str, Tensor]:
        """The published layout: with `embedding` codebooks, the codebooks they give (refreshed as the state dict is
        taken) and not the maps, which no engine reads."""
        maps = ("candidate_selector.predecessor_map", "candidate_selector.successor_map")
        return {name: tensor for name, tensor in self.state_dict().items() if name not in maps}

    def draft_tokens(self, hidden: Tensor, logits: Tensor, anchor_tokens: Tensor) -> Tensor:
        """The selector's greedy walk over the unary top-k from the anchor (`selector.py`); each slot's argmax inside
        `argmax_drafts`."""
        if not self.walk_drafts:
            return super().draft_tokens(hidden, logits, anchor_tokens)
        return self.candidate_selector.walk(hidden, logits, anchor_tokens)

    @contextlib.contextmanager
    def argmax_drafts(self) -> Iterator[None]:
        """Draft each slot's argmax, as DFlash does, with the selector unused: held-out tau with and without it
        separates what the walk adds from what the convolutions add (`eval.argmax_drafts`, `eval --argmax-drafts`).
        Set before decoding starts: a CUDA graph captured inside keeps the argmax."""
        before = self.walk_drafts
        self.walk_drafts = False
        try:
            yield
        finally:
            self.walk_drafts = before

    def compile_for_decoding(self, backend: str | Callable = "inductor") -> None:
        """DFlash's pieces (`DFlashDrafter.compile_for_decoding`), the convolutions (about 12 small ops each
        eager, four per layer) and the selector's walk (a few ops per slot, unrolled by the compiler)."""
        super().compile_for_decoding(backend)
        for module in self.modules():
            if isinstance(module, GroupedDynamicCausalConv):
                module.compile_convolution(backend)
        selector = self.candidate_selector
        selector.walk = torch.compile(selector.walk, dynamic=True, backend=backend)
