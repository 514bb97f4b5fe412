"""Fixed-shape decoding steps replayed as CUDA graphs (eager elsewhere).

A step is a Python function with no arguments that reads and writes only *static* device tensors (allocated once,
updated in place, never rebound) and has shapes fixed by its key (for example the number of cache entries it
attends to). On CUDA the first call with a key captures the step into a `torch.cuda.CUDAGraph` and every call
replays it: one launch instead of the thousand-odd small kernels of a decoder forward, which is what bounds
decoding speed for small targets. On other devices, or when graphs are disabled, the function simply runs.

Capture protocol (per key): snapshot the step's state tensors; run the step once on a side stream (warm-up:
cuBLAS workspaces, lazy initialisation, Triton autotuning); restore the state (the warm-up must not advance
anything: it wrote KV cache entries at the positions the real step writes with the same values, which is
harmless; the recurrent states of a hybrid target change in place whatever the positions, so the callers
declare them as state, `StaticKVCache.state_tensors`); capture; replay.
All graphs share one memory pool: they never run concurrently and their outputs live in the static tensors,
so their temporaries may overlap.

Rules for step functions (checked by capture failing loudly): no host syncs (`.item()`, `.tolist()`,
`nonzero`, boolean indexing, printing tensors), no CPU tensors, no shapes that depend on tensor values.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence

import torch
from torch import Tensor

Step = Callable[[], None]


class StepGraphs:
    """Run steps eagerly or as CUDA graphs keyed by shape; see the module docstring."""

    def __init__(self, device: torch.device, *, enabled: bool = True) -> None:
        self.enabled = enabled and device.type == "cuda"
        self.device = device
        self._graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self._pool = None
        # Wall time spent capturing (warm-up included), for callers that time the steps around `run`.
        self.capture_s = 0.0

    @property
    def captured(self) -> int:
        return len(self._graphs)

    def run(self, key: Hashable, step: Step, state: Sequence[Tensor]) -> None:
        """Run `step` (captured under `key` on first use). `state`: every tensor the step updates in place
        apart from caches and output buffers, restored after the warm-up run."""
        if not self.enabled:
            step()
            return
        graph = self._graphs.get(key)
        if graph is None:
            torch.cuda.synchronize(self.device)
            start = time.perf_counter()
            graph = self._capture(step, state)
            self._graphs[key] = graph
            torch.cuda.synchronize(self.device)
            self.capture_s += time.perf_counter() - start
        graph.replay()

    def _capture(self, step: Step, state: Sequence[Tensor]) -> torch.cuda.CUDAGraph:
        saved = [tensor.clone() for tensor in state]
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        for tensor, value in zip(state, saved, strict=True):
            tensor.copy_(value)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            step()
        return graph
