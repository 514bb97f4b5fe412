"""Lossless speculative decoding with a DFlash drafter, and plain autoregressive decoding as its reference.

One decoding step (DESIGN §2 "Inference"), with n the position of the last committed token:

    drafter   block [last, MASK x (B-1)] at positions n..n+B-1, context = target features of positions < n
              -> drafts d_1..d_{B-1} = argmax of the target's LM head on drafter slots 1..B-1
    target    verifies [last, d_1..d_{B-1}] in one forward (KV cache), choosing its own token t_k at every slot
    commit    d_1..d_j for the longest prefix with d_k == t_{k-1}, then t_j (the target's token after them):
              j + 1 tokens for one target forward
    rollback  the target's KV cache is cropped to the committed length; the target features of the verified
              positions that were committed become the drafter's new context entries

The drafter keeps a `ContextCache` (per-layer context keys/values), so each step projects only the newly
committed positions' features. At temperature 0 the target's choice is its argmax and the output is exactly
the target's own greedy decoding. At temperature > 0 the target *samples* its token at every verified slot and
a draft is accepted only while it equals the target's sample: every committed token is then a sample from the
target's conditional distribution given the committed prefix, so the output distribution is exactly the
target's (the drafter proposes deterministically, so rejection sampling with draft probabilities is not needed).

Target features are the outputs of the decoder layers `drafter.config.target_layer_ids`, read with forward
hooks during the cached forwards (the same definition as training's `FeatureCapture`).

Limits:
- Targets with linear-attention (recurrent) layers, such as Qwen3.5/Qwen3-Next hybrids, are refused with
  NotImplementedError: their recurrent state after a verified block cannot be rolled back to the committed
  length, so a rejected draft would corrupt every later token.
- Batch size 1 per call. `speculative_generate_batch` runs the prompts one after the other.
- The drafter runs in its own parameter dtype; for speed measurements load it in the target's dtype.
- Drafter layers that are causal inside the block (sliding layers with `sliding_causal_in_block`) get the
  same in-block mask as in training; every other layer sees the whole context and block, as in training.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType

import torch
from torch import Tensor, nn
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from ..model.attention import DrafterMasks, MaskVariant
from ..model.drafter import ContextCache, DFlashDrafter
from ..target.capture import decoder_module, embedding_module, lm_head_module


@dataclass
class GenerationResult:
    # New tokens only (the prompt is not repeated); ends with a stop token when one was produced.
    output_ids: list[int]
    # Tokens committed by each decoding forward of the target (1..B); the prefill's first token is not in it,
    # so sum(accepted_lengths) == len(output_ids) - 1.
    accepted_lengths: list[int]
    # Target forwards including the prefill.
    num_target_forwards: int
    prefill_s: float
    decode_s: float

    @property
    def tau(self) -> float:
        """Mean tokens committed per decoding forward of the target (1.0 for plain decoding)."""
        return sum(self.accepted_lengths) / len(self.accepted_lengths) if self.accepted_lengths else 0.0


class _LayerTap:
    """Forward hooks that keep the outputs of the tapped decoder layers of the latest target forward."""

    def __init__(self, layers: nn.ModuleList, layer_ids: Sequence[int]) -> None:
        for layer_id in layer_ids:
            if not 0 <= layer_id < len(layers):
                raise ValueError(f"target_layer_ids: {layer_id} outside 0..{len(layers) - 1} (target layers)")
        self.layer_ids = list(layer_ids)
        self.outputs: dict[int, Tensor] = {}
        self.handles = [layers[i].register_forward_hook(self._hook(i)) for i in self.layer_ids]

    def _hook(self, layer_id: int):
        def hook(module: nn.Module, args: tuple, output: Tensor | tuple) -> None:
            self.outputs[layer_id] = output[0] if isinstance(output, tuple) else output  # [1, T, H]

        return hook

    def take(self) -> Tensor:
        """The tapped outputs of the latest forward, concatenated in layer-id order: [1, T, K*H]."""
        features = torch.cat([self.outputs[i] for i in self.layer_ids], dim=-1)
        self.outputs.clear()
        return features

    def __enter__(self) -> _LayerTap:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        for handle in self.handles:
            handle.remove()


def choose_tokens(logits: Tensor, temperature: float, generator: torch.Generator | None) -> Tensor:
    """The target's token at every position: argmax at temperature 0, else a sample. [1, T, V] -> [1, T]."""
    if temperature <= 0.0:
        return logits.argmax(dim=-1)
    rows, length, vocab = logits.shape
    probs = torch.softmax(logits.float() / temperature, dim=-1).view(rows * length, vocab)
    return torch.multinomial(probs, num_samples=1, generator=generator).view(rows, length)


def new_target_cache(target_model: PreTrainedModel) -> DynamicCache:
    """A KV cache that can be cropped back after a partly rejected block, or NotImplementedError."""
    cache = DynamicCache(config=target_model.config)
    if any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in cache.layers):
        raise NotImplementedError(
            f"{type(target_model).__name__} has linear-attention (recurrent) layers: their state after a "
            "verified block cannot be rolled back to the accepted length, so speculative decoding against this "
            "target is not supported here (use a serving engine with state checkpointing, e.g. vLLM)"
        )
    # Sliding-window layers drop keys past the window on update unless told to keep them until `crop`.
    cache.activate_past_recording()
    return cache


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _check_request(input_ids: Tensor, max_new_tokens: int) -> None:
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids: expected one non-empty prompt [1, P], got shape {tuple(input_ids.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")


def _cut_after_stop(tokens: list[int], stop_ids: set[int]) -> list[int]:
    for index, token in enumerate(tokens):
        if token in stop_ids:
            return tokens[: index + 1]
    return tokens


@torch.inference_mode()
def target_generate(
    target_model: PreTrainedModel,
    input_ids: Tensor,
    *,
    max_new_tokens: int,
    stop_token_ids: Sequence[int],
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> GenerationResult:
    """Plain autoregressive decoding with a KV cache: the baseline and the lossless reference.

    `input_ids` [1, P] on the target's device. Stops after a stop token (kept in the output) or
    `max_new_tokens` new tokens."""
    _check_request(input_ids, max_new_tokens)
    device = input_ids.device
    stop_ids = set(stop_token_ids)
    cache = DynamicCache(config=target_model.config)
    start = _now(device)
    logits = target_model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    token = choose_tokens(logits[:, -1:], temperature, generator)  # [1, 1]
    output = [int(token)]  # host sync: the stop check needs the value
    prefill_end = _now(device)
    position = input_ids.shape[1]
    while len(output) < max_new_tokens and output[-1] not in stop_ids:
        logits = target_model(
            input_ids=token,
            position_ids=torch.tensor([[position]], device=device),
            past_key_values=cache,
            use_cache=True,
        ).logits
        token = choose_tokens(logits, temperature, generator)
        output.append(int(token))  # host sync: the stop check needs the value
        position += 1
    return GenerationResult(
        output_ids=output,
        accepted_lengths=[1] * (len(output) - 1),
        num_target_forwards=len(output),
        prefill_s=prefill_end - start,
        decode_s=_now(device) - prefill_end,
    )


class _Drafter:
    """The drafter side of one generation: its context cache and the target's embedding and LM head."""

    def __init__(self, drafter: DFlashDrafter, target_model: PreTrainedModel) -> None:
        self.drafter = drafter
        self.block_size = drafter.config.block_size
        self.mask_token_id = drafter.config.mask_token_id
        self.dtype = drafter.fc.weight.dtype
        self.embed = embedding_module(target_model)
        self.lm_head = lm_head_module(target_model)
        self.context = ContextCache()

    def _masks(self, context_len: int, device: torch.device) -> DrafterMasks | None:
        """Dense masks for layers that are causal inside the block; None (see everything) when no layer is.

        The context needs no masking: it holds exactly the positions before the block, and sliding layers
        already cut it to their window from the cache."""
        variants = self.drafter.mask_variants
        if not any(variant.causal_in_block for variant in variants):
            return None
        block = self.block_size
        causal = torch.ones(block, block, dtype=torch.bool, device=device).tril()
        by_variant: dict[MaskVariant, object] = {}
        for variant in variants:
            visible_context = context_len if variant.window is None else min(context_len, variant.window)
            in_block = causal if variant.causal_in_block else torch.ones_like(causal)
            context = torch.ones(block, visible_context, dtype=torch.bool, device=device)
            by_variant[variant] = torch.cat([context, in_block], dim=1)[None, None]  # [1, 1, B, Tc + B]
        return DrafterMasks(backend="sdpa", by_variant=by_variant)

    def propose(self, *, last_token: Tensor, position: int, new_features: Tensor, new_positions: Tensor) -> Tensor:
        """Drafts for positions position+1 .. position+B-1: [1, B-1].

        `last_token` [1, 1] sits at `position`; `new_features` [1, t, K*H] at `new_positions` [1, t] are the
        target features not yet in the context cache (together with it: every position < `position`)."""
        mask = torch.full(
            (1, self.block_size - 1), self.mask_token_id, dtype=last_token.dtype, device=last_token.device
        )
        block_ids = torch.cat([last_token, mask], dim=1)  # [1, B]
        block_positions = torch.arange(position, position + self.block_size, device=last_token.device)[None]
        context_len = self.context.length + new_features.shape[1]
        hidden = self.drafter(
            features=new_features.to(self.dtype),
            block_embeds=self.embed(block_ids),
            ctx_positions=new_positions,
            block_positions=block_positions,
            masks=self._masks(context_len, last_token.device),
            backend="sdpa",
            cache=self.context,
        )  # [1, B, H]
        logits = self.lm_head(hidden[:, 1:].to(self.lm_head.weight.dtype))  # [1, B-1, V]
        return logits.argmax(dim=-1)


@torch.inference_mode()
def speculative_generate(
    target_model: PreTrainedModel,
    drafter: DFlashDrafter,
    input_ids: Tensor,
    *,
    max_new_tokens: int,
    stop_token_ids: Sequence[int],
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> GenerationResult:
    """Speculative decoding of one prompt `input_ids` [1, P] (target's device; the drafter on the same device).

    Same stopping rule and output as `target_generate` (identical tokens at temperature 0). `generator`, for
    temperature > 0, must live on the target's device."""
    _check_request(input_ids, max_new_tokens)
    device = input_ids.device
    stop_ids = set(stop_token_ids)
    block_size = drafter.config.block_size
    cache = new_target_cache(target_model)
    proposer = _Drafter(drafter, target_model)
    accepted_lengths: list[int] = []

    with _LayerTap(decoder_module(target_model).layers, drafter.config.target_layer_ids) as tap:
        start = _now(device)
        logits = target_model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        last_token = choose_tokens(logits[:, -1:], temperature, generator)  # [1, 1]
        new_features = tap.take()  # [1, P, K*H]: the context of the first block
        output = [int(last_token)]  # host sync: the stop check needs the value
        prefill_end = _now(device)
        if not cache.is_croppable:
            raise NotImplementedError(
                f"{type(target_model).__name__}: its KV cache cannot be rolled back after a rejected draft"
            )
        # With past recording on, sliding-window layers keep everything until cropped; the next forward's mask
        # assumes they hold only their window, so trim them now (a no-op for full-attention layers).
        cache.crop(0)
        position = input_ids.shape[1]  # of the last committed token, whose features do not exist yet
        new_positions = torch.arange(position, device=device)[None]  # [1, P]

        while len(output) < max_new_tokens and output[-1] not in stop_ids:
            # Never verify more tokens than may still be committed: a block commits at most its length.
            verify_len = min(block_size, max_new_tokens - len(output))
            block = last_token
            if verify_len > 1:
                drafts = proposer.propose(
                    last_token=last_token, position=position, new_features=new_features, new_positions=new_positions
                )
                block = torch.cat([last_token, drafts[:, : verify_len - 1]], dim=1)  # [1, verify_len]
            logits = target_model(
                input_ids=block,
                position_ids=torch.arange(position, position + verify_len, device=device)[None],
                past_key_values=cache,
                use_cache=True,
            ).logits  # [1, verify_len, V]
            chosen = choose_tokens(logits, temperature, generator)  # [1, verify_len]: target's token after slot k
            features = tap.take()  # [1, verify_len, K*H]

            # One host sync per step: the number of accepted drafts decides what happens next.
            tokens = torch.cat([block[0, 1:], chosen[0]]).tolist()
            drafted, target_tokens = tokens[: verify_len - 1], tokens[verify_len - 1 :]
            accepted = 0
            while accepted < len(drafted) and drafted[accepted] == target_tokens[accepted]:
                accepted += 1
            committed = _cut_after_stop([*drafted[:accepted], target_tokens[accepted]], stop_ids)
            output.extend(committed)
            accepted_lengths.append(len(committed))

            # The cache holds [last, d_1..d_{verify_len-1}]; keep [last, d_1..d_accepted], the new last token's
            # keys/values are computed by the next forward.
            cache.crop(-(verify_len - accepted - 1))
            new_features = features[:, : accepted + 1]
            new_positions = torch.arange(position, position + accepted + 1, device=device)[None]
            last_token = chosen[:, accepted : accepted + 1]
            position += accepted + 1

    return GenerationResult(
        output_ids=output,
        accepted_lengths=accepted_lengths,
        num_target_forwards=1 + len(accepted_lengths),
        prefill_s=prefill_end - start,
        decode_s=_now(device) - prefill_end,
    )


def speculative_generate_batch(
    target_model: PreTrainedModel,
    drafter: DFlashDrafter,
    prompts: Sequence[Tensor],
    *,
    max_new_tokens: int,
    stop_token_ids: Sequence[int],
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> list[GenerationResult]:
    """Speculative decoding of several prompts (each [1, P_i]), with per-prompt accepted lengths.

    The prompts run one after the other through `speculative_generate`: batching rows that accept different
    numbers of tokens would need per-row cache lengths, which HF's `DynamicCache` does not keep (one crop
    length for all rows). Results are identical to single calls; throughput is that of batch 1."""
    return [
        speculative_generate(
            target_model,
            drafter,
            input_ids,
            max_new_tokens=max_new_tokens,
            stop_token_ids=stop_token_ids,
            temperature=temperature,
            generator=generator,
        )
        for input_ids in prompts
    ]
