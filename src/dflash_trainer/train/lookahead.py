"""Run the frozen target one optimizer step ahead, on a side CUDA stream: its forward overlaps the drafter's step.

`TargetLookahead(works, compute, device=...)` iterates `works` (one `StepWork` per optimizer step, its micro-batches
already on the device, `outputs` all None: the target runs in this process) and yields the same steps in the same
order with `outputs` filled by `compute(batch)` for each micro-batch.

Contract:
- Same results: `compute` is the function the step would otherwise call itself on the same batch, and the target is
  frozen, so computing a step's outputs earlier changes no value the step sees (tests compare whole runs).
- Overlap (CUDA): step n+1's `compute` is enqueued on a side stream before step n is handed out, so the GPU runs the
  target's forward for the next step beside this step's drafter work: the drafter's attention, norms, loss passes
  and optimizer leave the tensor cores idle for part of each step, and the target's GEMMs fill them. Only the order
  of kernels on the device changes; the host thread and its launches are the same.
- Ordering (why it is safe):
  - the side stream first waits for everything issued on the main stream so far, among it the batch's non-blocking
    host-to-device copies (issued there by the data path);
  - a step is handed out only after the main stream waits for the event recorded behind its outputs' compute;
  - its outputs, allocated on the side stream, `record_stream` the main stream, so the caching allocator does not give
    their memory to the side stream's next forward while the drafter may still read them;
  - the batch's own tensors live on the main stream and stay referenced by the step until it is handed out, after
    the main stream waited for the side stream's reads of them.
- Memory: one step's target outputs more than without it (features `[R, T, K*H]` and the labels' tokens), plus the
  target forward's transient activations alive beside the drafter's step (no autograd state: `no_grad`).
- Elsewhere (the CPU) the same schedule runs on the one stream there is: step n+1's outputs are computed before step
  n is handed out, which gains nothing there but is the order the CPU tests check.
- `settle()` waits for a forward in flight (before work that must not share the device with it, e.g. an evaluation
  that records CUDA graphs); `close()` settles and closes `works`. Iteration is single-use.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from ..targets.capture import TargetOutputs

if TYPE_CHECKING:
    from .batch import TrainBatch
    from .trainer import StepWork


class TargetLookahead:
    def __init__(
        self,
        works: Iterator[StepWork],
        compute: Callable[[TrainBatch], TargetOutputs],
        *,
        device: torch.device,
    ) -> None:
        self._works = works
        self._compute = compute
        self._device = device
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def __iter__(self) -> Iterator[StepWork]:
        ahead: tuple[StepWork, torch.cuda.Event | None] | None = None
        try:
            for work in self._works:
                launched = self._launch(work)
                if ahead is not None:
                    yield self._hand_out(*ahead)
                ahead = launched
            if ahead is not None:
                yield self._hand_out(*ahead)
        finally:
            self.close()

    def _launch(self, work: StepWork) -> tuple[StepWork, torch.cuda.Event | None]:
        """Enqueue the target for `work` (CUDA: on the side stream, returning the event behind it)."""
        if any(outputs is not None for outputs in work.outputs):
            raise ValueError("TargetLookahead: a step arrived with target outputs already (another rank's)")
        if self._side is None:
            return dataclasses.replace(work, outputs=[self._compute(batch) for batch in work.batches]), None
        self._side.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(self._side):
            outputs = [self._compute(batch) for batch in work.batches]
            done = torch.cuda.Event()
            done.record(self._side)
        return dataclasses.replace(work, outputs=outputs), done

    def _hand_out(self, work: StepWork, done: torch.cuda.Event | None) -> StepWork:
        if done is None:  # not CUDA: computed already, on this stream
            return work
        main = torch.cuda.current_stream(self._device)
        main.wait_event(done)
        for outputs in work.outputs:
            for tensor in (outputs.features, outputs.final_hidden, outputs.next_tokens):
                if tensor is not None:
                    tensor.record_stream(main)
        return work

    def settle(self) -> None:
        if self._side is not None:
            self._side.synchronize()

    def close(self) -> None:
        self.settle()
        close = getattr(self._works, "close", None)
        if close is not None:
            close()
