"""Test kit: run a function on ``size`` ranks played by threads over the in-process transport.

::

    def body(comm):
        return comm.allreduce(np.arange(3) * comm.rank)

    results = plait.testing.run_ranks(4, body)   # one result per rank

If a rank raises, its communicator is closed at once, so the others fail fast
with PeerLostError instead of waiting for their timeout; ``run_ranks`` then
re-raises the first failure in rank order (the others are in ``errors``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from plait.communicator import Communicator
from plait.ops import Op
from plait.transport.memory import MemoryFabric

__all__ = ["RankFailure", "memory_communicators", "reference", "run_ranks"]

T = TypeVar("T")


class RankFailure(Exception):
    """Raised by :func:`run_ranks` when some rank raised; ``errors[r]`` holds each rank's."""

    def __init__(self, errors: dict[int, BaseException]) -> None:
        first = min(errors)
        super().__init__(f"rank {first} failed: {errors[first]!r} ({len(errors)} rank(s) failed)")
        self.errors = errors


def memory_communicators(
    size: int, *, lockstep: bool = False, timeout: float | None = None
) -> list[Communicator]:
    """``size`` communicators joined by one in-process fabric (one per thread)."""
    fabric = MemoryFabric(size, lockstep=lockstep)
    return [Communicator(t, timeout=timeout) for t in fabric.endpoints]


def run_ranks(
    size: int,
    fn: Callable[[Communicator], T],
    *,
    lockstep: bool = False,
    timeout: float | None = 30.0,
    join_timeout: float = 120.0,
) -> list[T]:
    """Run ``fn(comm)`` on ``size`` threads, one rank each; return their results in rank order.

    Raises:
        RankFailure: some rank raised (with every rank's error attached).
    """
    comms = memory_communicators(size, lockstep=lockstep, timeout=timeout)
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


def reference(
    collective: str,
    inputs: Sequence[np.ndarray | None],
    *,
    op: Op | None = None,
    root: int = 0,
) -> list[np.ndarray | None]:
    """Every rank's expected result of a collective, computed directly with numpy.

    ``inputs[r]`` is rank r's ``x`` (for broadcast and scatter only root's is
    read). Reductions fold ``op`` over ranks in rank order, then divide by the
    number of ranks for ``AVG``. Returns one entry per rank: the array that
    rank's call returns, or None where it returns None (reduce and gather off
    root, barrier).
    """
    size = len(inputs)
    arrays = [np.asarray(x) if x is not None else None for x in inputs]

    def fold() -> np.ndarray:
        assert op is not None
        acc = np.array(arrays[0], copy=True)
        with np.errstate(all="ignore"):
            for x in arrays[1:]:
                op.ufunc(acc, x, out=acc)
            if op.average:
                np.divide(acc, size, out=acc)
        return acc

    if collective == "allreduce":
        total = fold()
        return [total.copy() for _ in range(size)]
    if collective == "reduce":
        total = fold()
        return [total if r == root else None for r in range(size)]
    if collective == "broadcast":
        return [np.array(arrays[root], copy=True) for _ in range(size)]
    if collective == "reduce_scatter":
        total = fold()
        k = total.shape[0] // size
        return [total[r * k : (r + 1) * k].copy() for r in range(size)]
    if collective == "allgather":
        stacked = np.stack(arrays)  # type: ignore[arg-type]
        return [stacked.copy() for _ in range(size)]
    if collective == "gather":
        stacked = np.stack(arrays)  # type: ignore[arg-type]
        return [stacked if r == root else None for r in range(size)]
    if collective == "alltoall":
        k = arrays[0].shape[0] // size  # type: ignore[union-attr]
        return [
            np.concatenate([arrays[q][r * k : (r + 1) * k] for q in range(size)])  # type: ignore[index]
            for r in range(size)
        ]
    if collective == "scatter":
        x = arrays[root]
        assert x is not None
        k = x.shape[0] // size
        return [x[r * k : (r + 1) * k].copy() for r in range(size)]
    if collective == "barrier":
        return [None] * size
    raise ValueError(f"unknown collective {collective!r}")
