"""Test kit: run a function on ``size`` ranks played by threads over the in-process transport.

::

    def body(comm):
        return comm.allreduce(np.arange(3) * comm.rank)

    results = plait.testing.run_ranks(4, body)   # one result per rank

If a rank raises, its communicator is closed at once, so the others fail fast
with PeerLostError instead of waiting for their timeout; ``run_ranks`` then
re-raises the first failure in rank order (the others are in ``errors``).

:func:`reference`, every rank's expected result computed with numpy, lives
with the table of collectives (:mod:`plait.collectives`) and is re-exported
here for tests and users.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from plait.collectives import reference
from plait.communicator import Communicator
from plait.transport.memory import MemoryFabric
from plait.transport.window import DEFAULT_WINDOW_BYTES

__all__ = ["RankFailure", "memory_communicators", "reference", "run_ranks"]

T = TypeVar("T")


class RankFailure(Exception):
    """Raised by :func:`run_ranks` when some rank raised; ``errors[r]`` holds each rank's.

    The message gives every rank's error in rank order: the one that failed first is
    often not rank 0 (the others then fail with PeerLostError as it closes).
    """

    def __init__(self, errors: dict[int, BaseException]) -> None:
        each = "; ".join(f"rank {r} failed: {errors[r]!r}" for r in sorted(errors))
        super().__init__(f"{each} ({len(errors)} rank(s) failed)")
        self.errors = errors


def memory_communicators(
    size: int,
    *,
    lockstep: bool = False,
    timeout: float | None = None,
    window: int = DEFAULT_WINDOW_BYTES,
) -> list[Communicator]:
    """``size`` communicators joined by one in-process fabric (one per thread).

    ``window``: bytes of each rank's shared window (0: none, so the one-sided
    algorithms cannot run and ``auto`` picks message-passing ones, as between hosts).
    """
    fabric = MemoryFabric(size, lockstep=lockstep, window=window)
    return [Communicator(t, timeout=timeout, _members=range(size)) for t in fabric.endpoints]


def run_ranks(
    size: int,
    fn: Callable[[Communicator], T],
    *,
    lockstep: bool = False,
    timeout: float | None = 30.0,
    join_timeout: float = 120.0,
    window: int = DEFAULT_WINDOW_BYTES,
) -> list[T]:
    """Run ``fn(comm)`` on ``size`` threads, one rank each; return their results in rank order.

    ``window``: as for :func:`memory_communicators`.

    Raises:
        RankFailure: some rank raised (with every rank's error attached).
    """
    comms = memory_communicators(size, lockstep=lockstep, timeout=timeout, window=window)
    results: list[Any] = [None] * size
    errors: dict[int, BaseException] = {}

    def body(rank: int) -> None:
        comm = comms[rank]
        try:
            results[rank] = fn(comm)
        except BaseException as exc:
            errors[rank] = exc
        finally:
            comm.close()

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_timeout)
        if t.is_alive():
            raise TimeoutError(f"a rank thread did not finish within {join_timeout} s")
    if errors:
        raise RankFailure(errors)
    return results
