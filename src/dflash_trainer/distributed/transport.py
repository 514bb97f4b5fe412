"""Feature batches between ranks: a small header first, then the tensors, over torch.distributed send/recv.

One message from a sender to a receiver is, in this order, all with tag `DATA_TAG` (messages between two ranks
on one tag are delivered in the order they were sent, on gloo and NCCL alike, so nothing else is needed to keep
them apart):
1. prefix: int64[3] on the header group = (kind, description length in bytes, protocol version);
2. description (BATCH only): uint8 JSON `{"tensors": [[name, dtype, shape], ...], "meta": {...}}`;
3. the tensors, one send each on the payload group, in the description's order.
`kind` END closes the stream from one sender to one receiver; it has no description and no tensors.

In-flight window and receive-ahead. A sender keeps at most `queue_depth` messages outstanding per destination
(posted with isend, not yet taken by the receiver) and blocks on the oldest before posting more; completion is
tracked, never waited for on the compute stream. A receiver receives ahead on a thread (`FeatureReceiver`): it
takes the next header as soon as one of its `queue_depth` slots is free, allocates the payload from it and posts
the payload receives, in the order the schedule names, into a bounded local queue that `recv` takes from. So
while a drafter computes, the next batches are already matched and moving (on NCCL, on the communication
stream, overlapping compute), and a fast sender runs ahead until the receiver's queue and then its own window
are full. Memory, per (sender, receiver) pair at most: `queue_depth` batches held by the sender (its window)
and, per receiver over all its senders, `queue_depth` batches received ahead, besides the ones in use.

Waiting, as counted here. A sender blocked on a full window is waiting for its receivers (`SendStats.wait_s`).
A receiver waiting for the next batch (the transfer included) is waiting for its senders (`ReceiveStats`).

Notices travel the other way, on `NOTICE_TAG`: when the receivers end (schedule done, or a stop agreed), each
sends one int64 code to each sender. Senders post the matching receives at the start and poll them between
batches, so a stop reaches them without any collective.

Completion of sends is watched by a helper thread per sender (and per notice board) that waits on the posted
works in order: gloo reports a point-to-point work complete only once someone has waited on it, so polling
`is_completed` would never see a message taken. The helper waits without the group's timeout (an unfinished
gloo wait that times out closes the connection); the poster applies `timeout_s` to its own waits instead.
"""

from __future__ import annotations

import datetime
import json
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

DATA_TAG = 0
NOTICE_TAG = 1
PROTOCOL_VERSION = 1
KIND_BATCH = 1
KIND_END = 2
# Notice codes: the receivers consumed their whole schedule, or they stopped early (a signal).
NOTICE_DONE = 1
NOTICE_STOP = 2
# The helper thread's wait: effectively unbounded (see the module docstring).
_HELPER_WAIT = datetime.timedelta(days=30)


class TransportError(RuntimeError):
    """A message did not follow the protocol (wrong kind or version): the two sides disagree on the schedule."""


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise TransportError(f"header names unknown dtype {name!r}")
    return dtype


def _wait_on_host(work: dist.Work, *, poll: bool) -> None:
    """Block this thread until `work` is done, and raise its error if it failed: gloo works by waiting (nothing
    else completes them); NCCL works by polling, because an NCCL `wait` on a transfer still running would make this
    thread's CUDA stream, which is also the trainer's, wait for it and stall the next forward behind it.

    Completed is not succeeded: a work with an error set (a peer gone) reports itself completed too, possibly before
    its kernel ended. So once polling sees it done, `wait` is called as well: after a transfer that finished the
    stream has nothing left to wait for; after a failed one `wait` aborts the communicator (which ends the kernel)
    and raises the error, which the poster re-raises where it waits (`_Posted`). NCCL's watchdog may take the process
    down on the same error first (TORCH_NCCL_ASYNC_ERROR_HANDLING); this makes the poster's report not depend on
    that race."""
    if not poll:
        work.wait(_HELPER_WAIT)
        return
    while not work.is_completed():
        time.sleep(0.0005)
    work.wait()


def _polls(group: dist.ProcessGroup | None) -> bool:
    return dist.get_backend(group) == "nccl"


@dataclass
class _Posted:
    """Works posted together (one message), watched by a `_Completions` thread."""

    # (work, poll: see `_wait_on_host`)
    works: list[tuple[dist.Work, bool]]
    # The buffers must live until the transfer is done.
    keepalive: list[torch.Tensor] = field(default_factory=list)
    finished: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def done(self) -> bool:
        if self.finished.is_set() and self.error is not None:
            raise self.error
        return self.finished.is_set()

    def wait(self, timeout_s: float, what: str) -> None:
        if not self.finished.wait(timeout_s):
            # The bound is placement.timeout_s, or that plus checkpoint.timeout_s where the peer may be checkpointing.
            raise TimeoutError(f"{what}: not done within {timeout_s:g}s")
        if self.error is not None:
            raise self.error


class _Completions:
    """A daemon thread that waits on posted works in order and marks each message finished."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[_Posted] = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def watch(self, posted: _Posted) -> _Posted:
        self._queue.put(posted)
        return posted

    def _run(self) -> None:
        while True:
            posted = self._queue.get()
            try:
                for work, poll in posted.works:
                    _wait_on_host(work, poll=poll)
            except BaseException as error:  # a dead peer: the poster raises it where it waits
                posted.error = error
            posted.finished.set()


@dataclass
class SendStats:
    """Cumulative sender counters (host floats, no device syncs)."""

    wait_s: float = 0.0
    sends: int = 0
    # Sum over sends of the messages outstanding to that destination right after posting (mean = depth).
    inflight_sum: int = 0

    def as_dict(self) -> dict[str, float]:
        return {"send_wait_s": self.wait_s, "sends": self.sends, "inflight_sum": self.inflight_sum}


class FeatureSender:
    def __init__(
        self,
        *,
        queue_depth: int,
        header_group: dist.ProcessGroup | None,
        payload_group: dist.ProcessGroup | None,
        timeout_s: float,
    ) -> None:
        if queue_depth < 1:
            raise ValueError(f"queue_depth must be >= 1, got {queue_depth}")
        self.queue_depth = queue_depth
        self.header_group = header_group
        self.payload_group = payload_group
        self.timeout_s = timeout_s
        self.stats = SendStats()
        self._windows: dict[int, deque[_Posted]] = {}
        self._completions = _Completions("dflash-send-completions")

    def inflight(self, destination: int) -> int:
        """Messages posted to `destination` that it has not taken yet."""
        window = self._windows.get(destination, deque())
        while window and window[0].done():
            window.popleft()
        return len(window)

    def wait_for_room(self, destination: int) -> None:
        """Block until fewer than `queue_depth` messages to `destination` are outstanding (`send` does this too;
        calling it first lets the caller describe the wait in the header it is about to send)."""
        self._make_room(destination)

    def send(self, destination: int, *, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """Post one batch to `destination`, first waiting for room in its window."""
        window = self._make_room(destination)
        description = {
            "tensors": [[name, str(t.dtype), list(t.shape)] for name, t in tensors.items()],
            "meta": meta,
        }
        encoded = torch.frombuffer(bytearray(json.dumps(description).encode()), dtype=torch.uint8)
        prefix = torch.tensor([KIND_BATCH, encoded.numel(), PROTOCOL_VERSION], dtype=torch.int64)
        works = [
            (dist.isend(prefix, destination, group=self.header_group, tag=DATA_TAG), False),
            (dist.isend(encoded, destination, group=self.header_group, tag=DATA_TAG), False),
        ]
        payload = [t.contiguous() for t in tensors.values()]
        poll = _polls(self.payload_group)
        works += [(dist.isend(t, destination, group=self.payload_group, tag=DATA_TAG), poll) for t in payload]
        window.append(self._completions.watch(_Posted(works=works, keepalive=[prefix, encoded, *payload])))
        self.stats.sends += 1
        self.stats.inflight_sum += len(window)

    def end(self, destination: int) -> None:
        """Close the stream to `destination` (after everything already posted to it)."""
        window = self._make_room(destination)
        prefix = torch.tensor([KIND_END, 0, PROTOCOL_VERSION], dtype=torch.int64)
        work = dist.isend(prefix, destination, group=self.header_group, tag=DATA_TAG)
        window.append(self._completions.watch(_Posted(works=[(work, False)], keepalive=[prefix])))

    def finish(self) -> None:
        """Wait until every posted message has been taken by its receiver."""
        started = time.perf_counter()
        for destination, window in self._windows.items():
            while window:
                window.popleft().wait(self.timeout_s, f"message to rank {destination}")
        self.stats.wait_s += time.perf_counter() - started

    def _make_room(self, destination: int) -> deque[_Posted]:
        self.inflight(destination)  # drops what the receiver already took
        window = self._windows.setdefault(destination, deque())
        if len(window) >= self.queue_depth:
            started = time.perf_counter()
            while len(window) >= self.queue_depth:
                window.popleft().wait(self.timeout_s, f"room in the window to rank {destination}")
            self.stats.wait_s += time.perf_counter() - started
        return window


@dataclass
class ReceiveStats:
    """Cumulative receiver counters, all on the host.

    `wait_s`: time the consumer waited for features. On the CPU, the host time blocked in `recv` (transfer
    included). On CUDA the host does not block for a transfer, so it is the device's stall instead: from the
    moment the consumer's stream finished its earlier work (or the host asked, whichever is later) until the
    payload had arrived, read from CUDA events without a sync (`settle` finishes the rest).
    """

    wait_s: float = 0.0
    # Batches taken by `recv`, and the sum over them of the messages already received (queued) when `recv` was
    # called: its mean is how full the local queue ran, from 0 (always waiting) to `queue_depth`.
    received: int = 0
    ahead_sum: int = 0


@dataclass
class Received:
    meta: dict[str, Any]
    tensors: dict[str, torch.Tensor]


@dataclass
class _Arrival:
    """One message as the receive thread hands it over: a batch (payload posted, `works` pending on NCCL), an
    END (`message` None), the end of the thread's work (`last`), or the error that stopped it."""

    source: int
    message: Received | None = None
    works: list[dist.Work] = field(default_factory=list)
    last: bool = False
    error: BaseException | None = None


class FeatureReceiver:
    """Receives feature batches ahead of their use, on a thread, in the order the schedule names.

    `order` yields the source rank of every batch this receiver will take, in the order `recv` takes them; after
    it, the thread receives the END of every rank in `sources` (it stops waiting on a source once that source
    has sent END, which after a stop can come early). The thread holds at most `queue_depth` messages received
    and not yet taken: it asks for a slot before it receives the next header, allocates the payload buffers from
    that header and posts the payload receives (on NCCL it does not wait for them: the consumer's stream does,
    in `recv`; on gloo it waits, so the message is complete when taken). So the sender's next messages are
    already matched while the consumer computes, and at most `queue_depth` feature batches wait here.

    Receives are posted in one fixed order (the schedule's) by one thread, so matching is deterministic.

    Streams (CUDA): the thread allocates and posts on the device's default stream, the consumer's own, so the
    buffers never change allocator stream and no `record_stream` bookkeeping is needed (the seed system's copy on
    a second stream raced). The cost: NCCL starts a posted receive once the compute queued before it has run,
    which leaves the transfer itself (one batch's features: a few hundred MB, about a millisecond over NVLink)
    outside the overlap, while everything the receiver used to wait for (the sender's pace, the matching) is not.
    """

    def __init__(
        self,
        *,
        sources: list[int],
        queue_depth: int,
        header_group: dist.ProcessGroup | None,
        payload_group: dist.ProcessGroup | None,
        device: torch.device,
        timeout_s: float,
    ) -> None:
        if queue_depth < 1:
            raise ValueError(f"queue_depth must be >= 1, got {queue_depth}")
        self.sources = list(sources)
        self.queue_depth = queue_depth
        self.header_group = header_group
        self.payload_group = payload_group
        self.device = device
        self.timeout_s = timeout_s
        self.stats = ReceiveStats()
        self._slots = threading.Semaphore(queue_depth)
        self._arrivals: queue.SimpleQueue[_Arrival] = queue.SimpleQueue()
        # Batches in `_arrivals` (not the END and end-of-schedule markers, which queue too): `ahead` in the stats.
        self._batches_queued = 0
        self._queued_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._finished = False
        # CUDA: (event before the stream waits for a payload, event after), until both are done.
        self._stalls: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()

    def start(self, order: Iterator[int]) -> None:
        """Start receiving ahead along `order` (the source of each batch `recv` will take, in order)."""
        if self._thread is not None:
            raise RuntimeError("FeatureReceiver.start: already started")
        self._thread = threading.Thread(
            target=self._receive_ahead, args=(order,), name="dflash-receive-ahead", daemon=True
        )
        self._thread.start()

    def recv(self, source: int) -> Received | None:
        """The next message of the schedule, which must come from `source`: a batch, or None (its END)."""
        started = time.perf_counter()
        on_cuda = self.device.type == "cuda"
        if on_cuda:
            before = torch.cuda.Event(enable_timing=True)
            before.record()
        arrival, ahead = self._take()
        if arrival.last:
            raise TransportError(f"expected a message from rank {source}; the schedule of this receiver has ended")
        if arrival.source != source:
            raise TransportError(f"expected a message from rank {source}, the receive order says rank {arrival.source}")
        for work in arrival.works:
            # NCCL: later kernels on this stream wait for the payload; the host goes on.
            work.wait()
        if on_cuda:
            after = torch.cuda.Event(enable_timing=True)
            after.record()
            self._stalls.append((before, after))
            self._collect_stalls(block=False)
        else:
            self.stats.wait_s += time.perf_counter() - started
        if arrival.message is not None:
            self.stats.received += 1
            self.stats.ahead_sum += ahead
        return arrival.message

    def settle(self) -> ReceiveStats:
        """The counters with every measured stall included (on CUDA this waits for the last taken payload: call
        it where the caller syncs anyway, e.g. on log steps)."""
        self._collect_stalls(block=True)
        return self.stats

    def drain(self) -> int:
        """After the consumer's last `recv`: take and drop what the thread still receives until every source has
        ended; returns the number of batches dropped (sent ahead for steps that will not run)."""
        dropped = 0
        while not self._finished:
            arrival, _ = self._take()
            for work in arrival.works:
                work.wait()  # NCCL: the buffers are not handed back to the allocator mid-transfer
            dropped += arrival.message is not None
        if self._thread is not None:
            self._thread.join(self.timeout_s)
        return dropped

    # consumer side -------------------------------------------------------------------------------------------

    def _take(self) -> tuple[_Arrival, int]:
        """(the next arrival, how many batches were already queued when asked: 0 means the consumer waits; at most
        `queue_depth`, the END markers that may queue behind the last batches are not counted)."""
        if self._thread is None:
            raise RuntimeError("FeatureReceiver: call start(order) before recv/drain")
        with self._queued_lock:
            ready = self._batches_queued
        try:
            arrival = self._arrivals.get(timeout=self.timeout_s)
        except queue.Empty:
            raise TimeoutError(f"no feature batch arrived within placement.timeout_s={self.timeout_s:g}s") from None
        if arrival.message is not None:
            with self._queued_lock:
                self._batches_queued -= 1
        if arrival.error is not None:
            self._finished = True
            raise arrival.error
        if arrival.last:
            self._finished = True
        else:
            self._slots.release()
        return arrival, ready

    def _collect_stalls(self, *, block: bool) -> None:
        while self._stalls:
            before, after = self._stalls[0]
            if block:
                after.synchronize()  # Sync: only from `settle`, on steps that sync anyway.
            elif not after.query():
                return
            self.stats.wait_s += before.elapsed_time(after) / 1000
            self._stalls.popleft()

    # receive thread ------------------------------------------------------------------------------------------

    def _receive_ahead(self, order: Iterator[int]) -> None:
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # the current device is per thread
            ended: set[int] = set()
            for source in order:
                if source in ended:  # it stopped early; the consumer stopped too
                    continue
                self._slots.acquire()
                arrival = self._receive(source)
                if arrival.message is None:
                    ended.add(source)
                else:
                    with self._queued_lock:  # counted before it can be taken
                        self._batches_queued += 1
                self._arrivals.put(arrival)
            for source in self.sources:
                if source in ended:
                    continue
                self._slots.acquire()
                arrival = self._receive(source)
                if arrival.message is not None:
                    raise TransportError(f"rank {source} sent a batch past the end of this receiver's schedule")
                self._arrivals.put(arrival)
        except BaseException as error:  # a dead peer or a protocol error: the consumer raises it
            self._arrivals.put(_Arrival(source=-1, error=error))
            return
        self._arrivals.put(_Arrival(source=-1, last=True))

    def _receive(self, source: int) -> _Arrival:
        """Header from `source` (blocking, this thread), then post the payload receives."""
        prefix = torch.empty(3, dtype=torch.int64)
        dist.recv(prefix, source, group=self.header_group, tag=DATA_TAG)
        kind, length, version = prefix.tolist()
        if version != PROTOCOL_VERSION or kind not in (KIND_BATCH, KIND_END):
            raise TransportError(f"from rank {source}: header kind {kind} version {version} not understood")
        if kind == KIND_END:
            return _Arrival(source=source)
        encoded = torch.empty(length, dtype=torch.uint8)
        dist.recv(encoded, source, group=self.header_group, tag=DATA_TAG)
        description = json.loads(bytes(encoded.numpy()).decode())
        tensors = {
            name: torch.empty(shape, dtype=_dtype_from_name(dtype), device=self.device)
            for name, dtype, shape in description["tensors"]
        }
        works = [dist.irecv(t, source, group=self.payload_group, tag=DATA_TAG) for t in tensors.values()]
        if not _polls(self.payload_group):
            for work in works:  # gloo: the data is here once waited on
                work.wait()
            works = []
        return _Arrival(source=source, message=Received(meta=description["meta"], tensors=tensors), works=works)


class NoticeBoard:
    """Sender side: one receive posted per receiver rank for its end-of-run notice, checked without blocking."""

    def __init__(self, sources: list[int], group: dist.ProcessGroup | None, *, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._codes = {source: torch.zeros(1, dtype=torch.int64) for source in sources}
        completions = _Completions("dflash-notice-completions")
        self._posted = {
            source: completions.watch(_Posted(works=[(dist.irecv(code, source, group=group, tag=NOTICE_TAG), False)]))
            for source, code in self._codes.items()
        }

    def arrived(self) -> bool:
        return any(posted.done() for posted in self._posted.values())

    def wait_all(self) -> dict[int, int]:
        for source, posted in self._posted.items():
            posted.wait(self.timeout_s, f"end-of-run notice from rank {source}")
        return {source: int(code.item()) for source, code in self._codes.items()}


@dataclass
class PostedNotices:
    works: list[dist.Work]
    # The send buffers must live until the works are done.
    buffers: list[torch.Tensor]

    def wait(self) -> None:
        for work in self.works:
            work.wait()


def send_notices(destinations: list[int], code: int, group: dist.ProcessGroup | None) -> PostedNotices:
    """Receiver side: tell every sender the run ended (`NOTICE_DONE`) or stopped early (`NOTICE_STOP`)."""
    buffers = [torch.tensor([code], dtype=torch.int64) for _ in destinations]
    works = [dist.isend(buf, dst, group=group, tag=NOTICE_TAG) for buf, dst in zip(buffers, destinations, strict=True)]
    return PostedNotices(works=works, buffers=buffers)
