"""Shared by the decoding tests (engine, speculative decoding, regeneration)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest
import torch

T = TypeVar("T")


def seeded(build: Callable[[], T], seed: int) -> T:
    """`build()` under its own RNG stream: building a model must not shift the test's random numbers."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return build()


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Tiny matmuls are dominated by thread hand-off on a busy 2-core machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
