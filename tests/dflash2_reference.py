"""An independent DFlash2 drafter, written from the serving engines' semantics (test code only).

It reads an export directory (config.json + model.safetensors) the way z-lab's `DFlash2DraftModel` and vLLM's
`DFlash2Qwen3ForCausalLM` do, and proposes one block with plain tensor code: no module of the package is used, so
a wrong weight name, shape, config key or a misplaced convolution in our drafter or our export shows up as a
difference. Scope: full-attention layers, default RoPE, no biases (what our exports of these tests hold).

One proposal, for context features of positions 0..n-1 and the last committed token t at position n:
    ctx = rmsnorm(fc(features), hidden_norm)
    x = embed([t, MASK x (B-1)]) at positions n..n+B-1
    per layer:  h = conv_in(rmsnorm(x));  x += conv_out(attention(h, ctx))
                h = conv_in'(rmsnorm(x));  x += conv_out'(mlp(h))
    attention: q from h; k, v from [ctx ; h] (same projections), q/k RMSNorm per head, RoPE, GQA, no mask
    hidden = rmsnorm(x, norm); logits = lm_head(hidden[1:])
    drafts = greedy walk: prev = t; at slot i: argmax over the top-k c of logit(c) + <A[prev] * (P h_i), C[c]>
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor


class ReferenceDFlash2:
    def __init__(self, export_dir: Path) -> None:
        self.config = json.loads((Path(export_dir) / "config.json").read_text())
        self.weights = {name: t.float() for name, t in load_file(str(Path(export_dir) / "model.safetensors")).items()}
        assert self.config["architectures"] == ["DFlash2DraftModel"]
        draft = self.config["dflash_config"]
        self.taps = draft["conv_kernel_size"]
        self.group = draft["conv_group_size"]
        self.top_k = draft["selector_top_k"]
        self.mask_token_id = draft["mask_token_id"]
        self.block_size = draft["block_size"]
        assert self.block_size == self.config["block_size"]
        assert set(self.config["layer_types"]) == {"full_attention"}
        self.eps = self.config["rms_norm_eps"]
        self.heads = self.config["num_attention_heads"]
        self.kv_heads = self.config["num_key_value_heads"]
        self.head_dim = self.config["head_dim"]
        self.theta = self.config["rope_parameters"]["rope_theta"]

    def w(self, name: str) -> Tensor:
        return self.weights[name]

    def rmsnorm(self, x: Tensor, name: str) -> Tensor:
        return self.w(name) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def rope(self, x: Tensor, positions: Tensor) -> Tensor:  # x [heads, S, D]
        half = self.head_dim // 2
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim))
        angles = positions.double()[:, None] * inv_freq[None]  # [S, D/2]
        cos, sin = torch.cos(angles).float(), torch.sin(angles).float()
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def conv(self, x: Tensor, delta: Tensor, base: Tensor) -> Tensor:
        """x [B, H] one block; delta [T, G]; base [T, H]: out[i,c] = sum_t (base[t,c] + delta[i,t,c//g]) x[i-t,c]."""
        out = torch.zeros_like(x)
        for i in range(x.shape[0]):
            for t in range(self.taps):
                if i - t >= 0:
                    kernel = base[t] + delta[i, t].repeat_interleave(self.group)
                    out[i] += kernel * x[i - t]
        return out

    def wrapped(self, prefix: str, x: Tensor, sublayer) -> Tensor:
        """conv(out side) of sublayer(conv(in side) of x); both kernels projected from x."""
        groups = x.shape[-1] // self.group
        delta = (x @ self.w(f"{prefix}.kernel_projection.weight").T).view(x.shape[0], 2, self.taps, groups)
        base = self.w(f"{prefix}.base_kernel")  # [2, T, H]
        return self.conv(sublayer(self.conv(x, delta[:, 0], base[0])), delta[:, 1], base[1])

    def attention(self, i: int, h: Tensor, ctx: Tensor, positions: Tensor) -> Tensor:
        p = f"layers.{i}.self_attn"
        both = torch.cat([ctx, h])
        q = (h @ self.w(f"{p}.q_proj.weight").T).view(len(h), self.heads, self.head_dim)
        k = (both @ self.w(f"{p}.k_proj.weight").T).view(len(both), self.kv_heads, self.head_dim)
        v = (both @ self.w(f"{p}.v_proj.weight").T).view(len(both), self.kv_heads, self.head_dim)
        q = self.rope(self.rmsnorm(q, f"{p}.q_norm.weight").transpose(0, 1), positions[-len(h) :])
        k = self.rope(self.rmsnorm(k, f"{p}.k_norm.weight").transpose(0, 1), positions)
        repeat = self.heads // self.kv_heads
        k, v = k.repeat_interleave(repeat, 0), v.transpose(0, 1).repeat_interleave(repeat, 0)
        weights = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(self.head_dim), dim=-1)
        out = (weights @ v).transpose(0, 1).reshape(len(h), -1)
        return out @ self.w(f"{p}.o_proj.weight").T

    def mlp(self, i: int, h: Tensor) -> Tensor:
        p = f"layers.{i}.mlp"
        gate = h @ self.w(f"{p}.gate_proj.weight").T
        return (torch.nn.functional.silu(gate) * (h @ self.w(f"{p}.up_proj.weight").T)) @ self.w(
            f"{p}.down_proj.weight"
        ).T

    @torch.no_grad()
    def propose(self, features: Tensor, last_token: int, embed: Tensor, lm_head: Tensor) -> tuple[Tensor, list[int]]:
        """features [n, K*H] of positions 0..n-1; embed, lm_head [V, H]. Returns (final hidden [B, H], drafts)."""
        n = features.shape[0]
        positions = torch.arange(n + self.block_size)
        ctx = self.rmsnorm(features.float() @ self.w("fc.weight").T, "hidden_norm.weight")
        x = embed[torch.tensor([last_token] + [self.mask_token_id] * (self.block_size - 1))].float()
        for i in range(self.config["num_hidden_layers"]):
            h = self.rmsnorm(x, f"layers.{i}.input_layernorm.weight")
            x = x + self.wrapped(f"layers.{i}.attention_conv", h, lambda h, i=i: self.attention(i, h, ctx, positions))
            h = self.rmsnorm(x, f"layers.{i}.post_attention_layernorm.weight")
            x = x + self.wrapped(f"layers.{i}.mlp_conv", h, lambda h, i=i: self.mlp(i, h))
        hidden = self.rmsnorm(x, "norm.weight")
        return hidden, self.walk(hidden[1:], hidden[1:] @ lm_head.float().T, last_token)

    def walk(self, hidden: Tensor, logits: Tensor, anchor: int) -> list[int]:
        s = "candidate_selector"
        gate = hidden @ self.w(f"{s}.hidden_projection.weight").T  # [S, r]
        predecessor, drafts = anchor, []
        for slot in range(len(hidden)):
            unary, candidates = torch.topk(logits[slot], self.top_k)
            left = self.w(f"{s}.predecessor_codebook")[predecessor] * gate[slot]
            scores = unary + self.w(f"{s}.successor_codebook")[candidates] @ left
            predecessor = int(candidates[int(torch.argmax(scores))])
            drafts.append(predecessor)
        return drafts
