"""Fixed-shape decoding steps replayed as CUDA graphs (eager elsewhere).

A step is a Python function with no arguments that reads and writes only *static* device tensors (allocated once,
updated in place, never rebound) and has shapes fixed by its key (for example the number of cache entries it
attends to). On CUDA the first call with a key captures the step into a `torch.cuda.CUDAGraph` and every call
replays it: one launch instead of the thousand-odd small kernels of a decoder forward, which is what bounds
decoding speed for small targets. On other devices, or when graphs are disabled, the function simply runs.

Capture protocol (per key): the first call runs the step eagerly on a side stream: it is that call's step, for
real, and the warm-up a capture needs (cuBLAS workspaces, lazy initialisation, Triton compiling and autotuning);
then it captures the step, which records its kernels without running them, so nothing the step writes changes a
second time (caches, output buffers, per-row state, the recurrent states of a hybrid target alike) and nothing
needs a snapshot. Later calls replay the graph. (An earlier protocol warmed up, restored the state from a
snapshot, captured and replayed: the snapshot of a hybrid's recurrent states is 38.6 GB at 256 rows of the
Qwen3.6-27B shape, which does not fit beside the weights and the states themselves on one H200.)
The Python of the step runs twice on a key's first call (run and capture): it must leave its own bookkeeping as
one run does (the verify step's commit clears what the verify forward recorded, for example).
All graphs share one memory pool: they never run concurrently and their outputs live in the static tensors,
so their temporaries may overlap. One side stream serves every first run, so the blocks its temporaries leave
in the caching allocator are reused by the next one.

Rules for step functions (checked by capture failing loudly): no host syncs (`.item()`, `.tolist()`,
`nonzero`, boolean indexing, printing tensors), no CPU tensors, no shapes that depend on tensor values.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

import torch

Step = Callable[[], None]


class StepGraphs:
    """Run steps eagerly or as CUDA graphs keyed by shape; see the module docstring."""

    def __init__(self, device: torch.device, *, enabled: bool = True) -> None:
        self.enabled = enabled and device.type == "cuda"
        self.device = device
        self._graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self._pool = None
        self._side: torch.cuda.Stream | None = None
        # Wall time of first calls (the eager step and the capture), for callers that time the steps around `run`.
        self.capture_s = 0.0

    @property
    def captured(self) -> int:
        return len(self._graphs)

    def run(self, key: Hashable, step: Step) -> None:
        """Run `step` (its first call with `key` runs it eagerly, then captures it; later calls replay)."""
        if not self.enabled:
            step()
            return
        graph = self._graphs.get(key)
        if graph is not None:
            graph.replay()
            return
        torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        self._graphs[key] = self._run_and_capture(step)
        torch.cuda.synchronize(self.device)
        self.capture_s += time.perf_counter() - start

    def _run_and_capture(self, step: Step) -> torch.cuda.CUDAGraph:
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._side):
            step()  # this call's step, and the warm-up of the capture
        torch.cuda.current_stream(self.device).wait_stream(self._side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            step()  # recorded, not run
        return graph
