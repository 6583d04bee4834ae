"""The harness of the transport conformance suite: ranks on threads, waits with a deadline.

:func:`build_in_threads` builds transports whose constructors block until all ranks
are there (TCP, shared memory) on one thread per rank; :func:`run_ranks` runs one
function per rank on its own thread, because transports such as TCP move bytes only
while their own rank waits; :func:`wait_all` waits for handles with a deadline. The
checks themselves are in :mod:`plait.transport.conformance`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import numpy as np

from plait.transport.base import Handle, Transport

__all__ = [
    "WAIT",
    "Factory",
    "build_in_threads",
    "close_all",
    "made",
    "mv",
    "ok",
    "pattern",
    "run_ranks",
    "wait_all",
]

#: ``make(size)`` -> ``size`` connected transports, index = rank.
Factory = Callable[[int], Sequence[Transport]]

T = TypeVar("T")


class _Closable(Protocol):
    def close(self) -> None: ...


TT = TypeVar("TT", bound=_Closable)

#: Seconds any single wait in a check may take before the check fails.
WAIT = 20.0


# -- helpers ------------------------------------------------------------------------------------


def build_in_threads(size: int, build: Callable[[int], T], timeout: float = 60.0) -> list[T]:
    """Call ``build(rank)`` for every rank on its own thread; the results in rank order.

    For transports whose constructor blocks until all ranks have arrived. If
    any rank fails, the others that were built are closed and the first error
    (in rank order) is raised.

    Raises:
        BaseException: whatever the first failing ``build`` raised.
        TimeoutError: some rank took longer than ``timeout``.
    """
    results: list[Any] = [None] * size
    errors: dict[int, BaseException] = {}

    def body(rank: int) -> None:
        try:
            results[rank] = build(rank)
        except BaseException as exc:
            errors[rank] = exc

    threads = [
        threading.Thread(target=body, args=(r,), name=f"build-rank-{r}", daemon=True)
        for r in range(size)
    ]
    for t in threads:
        t.start()
    end = time.monotonic() + timeout
    for t in threads:
        t.join(max(end - time.monotonic(), 0.0))
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"building {size} transports took more than {timeout} s")
    if errors:
        for r in results:
            if r is not None and hasattr(r, "close"):
                r.close()
        raise errors[min(errors)]
    return results


def run_ranks(transports: Sequence[TT], fn: Callable[[TT], T], timeout: float = 60.0) -> list[T]:
    """Run ``fn(transport)`` on one thread per rank; the results in rank order.

    Raises:
        AssertionError: some rank failed (its error is chained) or hung.
    """
    results: list[Any] = [None] * len(transports)
    errors: dict[int, BaseException] = {}

    def body(rank: int) -> None:
        try:
            results[rank] = fn(transports[rank])
        except BaseException as exc:
            errors[rank] = exc

    threads = [
        threading.Thread(target=body, args=(r,), name=f"rank-{r}", daemon=True)
        for r in range(len(transports))
    ]
    for t in threads:
        t.start()
    end = time.monotonic() + timeout
    for t in threads:
        t.join(max(end - time.monotonic(), 0.0))
    hung = [r for r, t in enumerate(threads) if t.is_alive()]
    if hung:
        for tr in transports:  # unblock them so the threads end
            tr.close()
        for t in threads:
            t.join(5.0)
        raise AssertionError(f"rank(s) {hung} did not finish within {timeout} s")
    if errors:
        first = min(errors)
        raise AssertionError(f"rank {first} failed: {errors[first]!r}") from errors[first]
    return results


def wait_all(t: Transport, handles: Sequence[Handle], timeout: float = WAIT) -> None:
    """Wait until every handle is done; assert it happened within ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while True:
        left = [h for h in handles if not h.done]
        if not left:
            return
        remaining = end - time.monotonic()
        assert remaining > 0, f"rank {t.rank}: {len(left)} handle(s) not done after {timeout} s"
        t.wait_any(left, remaining)


def ok(t: Transport, handles: Sequence[Handle], timeout: float = WAIT) -> None:
    """Wait for ``handles`` and assert that none failed."""
    wait_all(t, handles, timeout)
    errors = [h.error for h in handles if h.error is not None]
    assert not errors, f"rank {t.rank}: unexpected errors {errors!r}"


def pattern(nbytes: int, seed: int) -> np.ndarray:
    """Bytes that differ between seeds and positions (catches shifted or swapped data)."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, nbytes, dtype=np.uint8)


def mv(a: np.ndarray) -> memoryview:
    """The bytes of ``a``, as the transports take them."""
    return a.data  # a 1-D contiguous uint8 array: format "B"


def close_all(transports: Sequence[Transport]) -> None:
    """Close every transport."""
    for t in transports:
        t.close()


def made(make: Factory, size: int) -> Sequence[Transport]:
    """``make(size)``, checked to be ``size`` transports in rank order."""
    ts = make(size)
    assert len(ts) == size, f"make({size}) returned {len(ts)} transports"
    for r, t in enumerate(ts):
        assert (t.rank, t.size) == (r, size), f"transport {r} says rank {t.rank} of {t.size}"
    return ts
