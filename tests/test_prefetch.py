"""The prefetch worker: same items in the same order, bounded, errors re-raised, clean shutdown."""

from __future__ import annotations

import threading

import pytest

from dflash_trainer.train.prefetch import Prefetcher


class Source:
    """Counts how far the worker has run ahead and whether it was closed (on which thread)."""

    def __init__(self, n: int, fail_at: int | None = None) -> None:
        self.n, self.fail_at = n, fail_at
        self.made = 0
        self.closed_on: str | None = None

    def __iter__(self):
        try:
            for i in range(self.n):
                if i == self.fail_at:
                    raise ValueError(f"bad item {i}")
                self.made += 1
                yield i
        finally:
            self.closed_on = threading.current_thread().name


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_items_arrive_in_order_and_the_worker_ends(depth):
    source = Source(10)
    prefetcher = Prefetcher(iter(source), depth=depth, name="pf-test")
    assert list(prefetcher) == list(range(10))
    prefetcher.close()
    assert source.closed_on == ("pf-test" if depth else threading.current_thread().name)
    assert prefetcher.wait_s >= 0.0


def test_the_queue_is_bounded():
    source = Source(100)
    prefetcher = Prefetcher(iter(source), depth=2)
    assert next(prefetcher) == 0
    deadline = threading.Event()
    deadline.wait(0.5)  # give the worker time to run as far ahead as it may
    # One item taken, two waiting in the queue, one more made and blocked on the full queue.
    assert source.made <= 1 + 2 + 1
    assert prefetcher.queued() <= 2
    prefetcher.close()
    assert source.closed_on is not None  # the worker stopped and closed its source


@pytest.mark.parametrize("depth", [0, 2])
def test_worker_errors_reach_the_consumer(depth):
    prefetcher = Prefetcher(iter(Source(10, fail_at=3)), depth=depth)
    got = []
    with pytest.raises(ValueError, match="bad item 3"):
        for item in prefetcher:
            got.append(item)
    assert got == [0, 1, 2]
    with pytest.raises(StopIteration):
        next(prefetcher)


def test_close_mid_stream_stops_the_worker():
    source = Source(1000)
    with Prefetcher(iter(source), depth=4, name="pf-close") as prefetcher:
        assert [next(prefetcher) for _ in range(3)] == [0, 1, 2]
    assert source.closed_on == "pf-close"
    assert source.made < 1000
    assert not any(t.name == "pf-close" for t in threading.enumerate())
