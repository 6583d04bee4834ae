"""A call that fails on one rank for a reason of its own: its peers are told, and raise.

Note [errors of a rank's own] in plait._failures. Before, the rank that raised kept a usable
communicator and told nobody; its peers waited, probed, and blamed a mismatch of collectives
once it made its next call, or waited for their timeout where it made none.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

import plait
from plait.testing import run_ranks

pytestmark = pytest.mark.timeout(60)

#: (collective, algorithm): message calls, a straight-line one and a one-sided one.
CALLS = [
    ("allreduce", "ring"),
    ("allreduce", "recursive_doubling"),
    ("allreduce", "arena"),
    ("reduce", "binomial"),
]


def _failing_op(bad: int, rank: int) -> plait.Op:
    """SUM, but it raises on rank ``bad`` once it reduces more than one element (the op's
    probe of the dtype at the call's start reduces one)."""

    def add(a: np.ndarray, b: np.ndarray, out: Any = None) -> Any:
        if rank == bad and a.size > 1:
            raise ZeroDivisionError("the op failed here")
        return np.add(a, b, out=out)

    return plait.Op(add, name="failing_add")


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize(("collective", "algorithm"), CALLS)
def test_an_op_that_raises_on_one_rank_is_told_to_every_rank(
    collective: str, algorithm: str, size: int
) -> None:
    bad = size - 1
    stay = threading.Event()  # the failing rank stays until the others have their errors
    done = [0]
    lock = threading.Lock()

    def body(comm: plait.Communicator) -> tuple[BaseException | None, float, BaseException]:
        op = _failing_op(bad, comm.rank)
        x = np.arange(1000, dtype=np.float32)
        start = time.monotonic()
        first: BaseException | None = None
        try:
            if collective == "reduce":
                comm.reduce(x, op=op, root=bad, algorithm=algorithm)
            else:
                comm.allreduce(x, op=op, algorithm=algorithm)
        except (ZeroDivisionError, plait.CommError) as exc:
            first = exc
        waited = time.monotonic() - start
        if comm.rank == bad:
            stay.wait(30)
            later: BaseException = AssertionError("no error")
            try:
                comm.allreduce(np.ones(4))
            except plait.CommError as exc:
                later = exc
            return first, waited, later
        later = AssertionError("no error")
        try:  # a rank whose own call finished learns it at its next call
            comm.allreduce(np.ones(4))
        except plait.CommError as exc:
            later = exc
        with lock:
            done[0] += 1
            if done[0] == size - 1:
                stay.set()
        return first, waited, later

    results = run_ranks(size, body, timeout=60.0)
    first, _, later = results[bad]
    assert isinstance(first, ZeroDivisionError)
    assert any("failed midway on this rank; its peers were told" in n for n in first.__notes__)
    assert "unusable after an earlier failure" in str(later)
    assert "gave up on the call after an error of its own, ZeroDivisionError" in str(later)
    for rank in range(size):
        if rank == bad:
            continue
        first, waited, later = results[rank]
        told = first if first is not None else later
        assert isinstance(told, plait.PeerLostError), (rank, told)
        assert f"rank {bad} gave up on " in str(told)
        assert told.lost_rank == bad, (rank, told, told.lost_rank)
        assert waited < 20  # within a probe period or two, not at the 60 s timeout
        if first is not None:
            assert "unusable after an earlier failure" in str(later)


def test_an_error_before_the_call_takes_its_number_breaks_nothing() -> None:
    """An op refused by its probe of the dtype moves no byte: the communicator stays usable
    (here on every rank, so that the next call runs everywhere)."""

    def refuse(a: np.ndarray, b: np.ndarray, out: Any = None) -> Any:
        raise ValueError("not for this dtype")

    def body(comm: plait.Communicator) -> np.ndarray:
        with pytest.raises(TypeError, match="not for this dtype"):
            comm.allreduce(np.ones(4), op=plait.Op(refuse, name="refuse"))
        return comm.allreduce(np.ones(4))

    for got in run_ranks(2, body):
        np.testing.assert_array_equal(got, np.full(4, 2.0))
