"""Run an iterator ahead on a background thread: the data stage off the training step's critical path.

`Prefetcher(items, depth=d)` runs the iterator `items` on one daemon thread and keeps up to `d` finished items in
a bounded queue; iterating the Prefetcher yields them in the order `items` made them. The trainer's items are
whole optimizer steps of host batches (collation, anchors, labels, mask tile tables, pinned memory), so the
training thread only issues their non-blocking copies to the device.

Contract:
- Order and content are exactly those of iterating `items` on the calling thread (`depth=0` does just that,
  with no thread: the ablation and the fallback).
- Bounded and observed: at most `depth` items wait in the queue (plus the one the worker is making); `wait_s`
  accumulates the seconds the consumer waited for an item (0 while the worker keeps ahead).
- Errors: an exception raised by `items` on the worker is re-raised by the consumer's next `next()`, as the same
  exception object (its traceback shows the worker's frames); the worker stops there.
- Shutdown: `close()` (also at the end of a `with` block) stops the worker at its next hand-over, closes `items`
  on the worker thread and joins it; a worker blocked on a full queue notices within `POLL_S`. Closing never
  hangs: a worker stuck inside `items` itself is left behind as a daemon thread after `JOIN_S`.
- `items` must not be touched by other threads while the worker runs: anything the consumer needs to know about
  the state of the source (e.g. the sampler position after an item, for checkpoints) travels inside the item.

Why a thread and not a process: the work is numpy and torch CPU kernels, which release the GIL, and its results
(tensors in pinned memory) are consumed in this process without serialisation.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")

POLL_S = 0.1
JOIN_S = 30.0

_ITEM, _END, _ERROR = "item", "end", "error"


class Prefetcher(Generic[T]):
    def __init__(self, items: Iterator[T], *, depth: int, name: str = "prefetch") -> None:
        if depth < 0:
            raise ValueError(f"Prefetcher: depth must be >= 0, got {depth}")
        self.depth = depth
        self.wait_s = 0.0
        self._items = items
        self._done = False
        self._stop = threading.Event()
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=max(depth, 1))
        self._thread: threading.Thread | None = None
        if depth > 0:
            self._thread = threading.Thread(target=self._work, name=name, daemon=True)
            self._thread.start()

    # -------------------------------------------------------------------------------------------- worker side

    def _work(self) -> None:
        try:
            for item in self._items:
                if not self._put((_ITEM, item)):
                    return
            self._put((_END, None))
        except BaseException as error:  # handed to the consumer, which re-raises it
            self._put((_ERROR, error))
        finally:
            close = getattr(self._items, "close", None)
            if close is not None:
                close()

    def _put(self, entry: tuple[str, Any]) -> bool:
        """Blocks while the queue is full; False once `close()` asked the worker to stop."""
        while not self._stop.is_set():
            try:
                self._queue.put(entry, timeout=POLL_S)
                return True
            except queue.Full:
                continue
        return False

    # ------------------------------------------------------------------------------------------ consumer side

    def __iter__(self) -> Prefetcher[T]:
        return self

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        started = time.perf_counter()
        try:
            if self._thread is None:
                try:
                    return next(self._items)
                except StopIteration:
                    self._done = True
                    raise
            kind, value = self._get()
        finally:
            self.wait_s += time.perf_counter() - started
        if kind == _END:
            self._done = True
            raise StopIteration
        if kind == _ERROR:
            self._done = True
            self.close()
            raise value  # the worker's exception, traceback included
        return value

    def _get(self) -> tuple[str, Any]:
        while True:
            try:
                return self._queue.get(timeout=POLL_S)
            except queue.Empty:
                # The worker always hands over an end or an error before it exits; this guards against hangs.
                if self._thread is not None and not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError(f"prefetch worker {self._thread.name} ended without a result") from None

    def queued(self) -> int:
        """Items ready now (approximate while the worker runs)."""
        return self._queue.qsize()

    def close(self) -> None:
        self._done = True
        self._stop.set()
        if self._thread is None:
            close = getattr(self._items, "close", None)
            if close is not None:
                close()
            return
        # Free a worker blocked on a full queue, then wait for it.
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=JOIN_S)

    def __enter__(self) -> Prefetcher[T]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
