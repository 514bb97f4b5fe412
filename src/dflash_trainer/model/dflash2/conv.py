"""The grouped dynamic causal convolution that DFlash2 wraps around each sublayer (attention and MLP).

For a block of B slots x_0..x_{B-1} (slot 0 the anchor / last committed token, then the mask slots), per channel c
of group g(c) = c // group_size and taps t = 0..T-1 (T = `conv_kernel_size`, 2 in every published checkpoint):

    out[i, c] = sum_t (base[t, c] + delta[i, t, g(c)]) * x[i - t, c]        x[i - t] = 0 when i - t < 0

`base` is a learned kernel per channel; `delta` is predicted per slot from the sublayer's *input* (after its
RMSNorm) by one bias-free projection H -> 2 * T * G (G = H / group_size groups). That projection yields two kernels
at once: the first convolves the sublayer's input ("prepare"), the second its output ("finish"); so the parameters
are `base_kernel [2, T, H]` (0: input side, 1: output side) and `kernel_projection [2*T*G, H]`, laid out as
[side, tap, group] in the projection's output. Causal over the block's slots only: taps never cross a block
boundary (in training many blocks lie side by side in one row; at inference a block is the whole query).

Initialised as the identity (base tap 0 = 1, other taps 0, projection 0), so a new DFlash2 drafter computes
exactly what a DFlash drafter of the same weights computes, and training moves away from it.

Sources (read, not copied): z-lab/dflash `dflash/model.py` (`GroupedDynamicCausalConv`, `prepare`/`finish`), vLLM
`model_executor/models/qwen3_dflash2.py` (`DFlashGroupedConv`: taps masked where the slot index within the block is
below the tap), SGLang PR #35371 and llama.cpp PR #27342 (the same formula).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class GroupedDynamicCausalConv(nn.Module):
    def __init__(self, hidden_size: int, *, taps: int, group_size: int, block_size: int) -> None:
        super().__init__()
        if hidden_size % group_size:
            raise ValueError(f"conv group size {group_size} does not divide hidden size {hidden_size}")
        self.taps = taps
        self.group_size = group_size
        self.groups = hidden_size // group_size
        self.block_size = block_size
        self.base_kernel = nn.Parameter(torch.empty(2, taps, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [R, L, H] (the sublayer's normed input, L a whole number of blocks) -> (the convolved input
        [R, L, H], the output-side kernel [R, L, T, G] for `finish`)."""
        rows, length, _ = x.shape
        delta = self.kernel_projection(x).view(rows, length, 2, self.taps, self.groups)
        return self._convolve(x, delta[:, :, 0], side=0), delta[:, :, 1]

    def finish(self, y: Tensor, delta: Tensor) -> Tensor:
        """y [R, L, H] the sublayer's output, delta [R, L, T, G] from `prepare` -> convolved output [R, L, H]."""
        return self._convolve(y, delta, side=1)

    def compile_convolution(self, backend: str | Callable = "inductor") -> None:
        """The convolution compiled with symbolic sizes (`DFlash2Drafter.compile_for_decoding`: decoding only)."""
        self._convolve = torch.compile(self._convolve, dynamic=True, backend=backend)

    def _convolve(self, x: Tensor, delta: Tensor, *, side: int) -> Tensor:
        # On the flat sequence, with the block boundary as a mask on the slot index (position % block_size, blocks
        # starting at multiples of block_size), rather than a view of [R, L/B, B, ...]: under torch.compile's
        # symbolic shapes that view's L/B put a floor division into every shape of the graph, and compiling the
        # layer's forward and backward took about twice as long for the same arithmetic (a tiny drafter's first step
        # on the CPU: tracing 31.6 against 15.2 s; with Inductor from an empty cache 100 against 55-59 s, DFlash's 38).
        rows, length, hidden = x.shape
        dtype = x.dtype  # what the engines do: the kernel in the activations' dtype
        grouped = x.view(rows, length, self.groups, self.group_size)
        delta = delta.to(dtype).unsqueeze(-1)  # [R, L, T, G, 1]
        base = self.base_kernel[side].to(dtype).view(self.taps, self.groups, self.group_size)
        out = (base[0] + delta[:, :, 0]) * grouped  # [R, L, G, g]
        slot = torch.arange(length, device=x.device) % self.block_size  # [L]
        for tap in range(1, self.taps):
            # x[i - tap] within the block; the first `tap` slots of a block see zeros (no tap across a boundary).
            # A select, not a product with a 0/1 mask: a non-finite value must not cross the boundary either.
            within = (slot >= tap).view(1, length, 1, 1)
            shifted = torch.where(within, F.pad(grouped[:, :-tap], (0, 0, 0, 0, tap, 0)), 0.0)
            out = out + (base[tap] + delta[:, :, tap]) * shifted
        return out.view(rows, length, hidden)
