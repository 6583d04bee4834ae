"""Communicator ids of splits that run at once on threads of each rank (Note [communicator
ids] in plait.group): two communicators of a rank never share one."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import plait
from plait.group import child_comm_id
from plait.testing import run_ranks


def forced_color(a: plait.Communicator, b: plait.Communicator) -> int:
    """A color whose split of ``b`` at its next call has the first candidate id of ``a``'s
    split of color 0 at its next call: the two groups hash to one id."""
    target = child_comm_id(a._comm_id, a._runner.seq, 0)
    seq = b._runner.seq
    return next(c for c in range(1 << 24) if child_comm_id(b._comm_id, seq, c) == target)


def split_at_once(
    a: plait.Communicator, b: plait.Communicator, color_b: int, a_first: bool
) -> tuple[plait.Communicator, plait.Communicator]:
    """``a.split(0)`` and ``b.split(color_b)`` on two threads of this rank, the one of
    ``a`` begun first (``a_first``, else the one of ``b``), each sending its word only once
    the other has begun: neither has made its group when the other chooses an id."""
    both = threading.Barrier(2, timeout=20)
    first_in = threading.Event()
    first = a if a_first else b
    out: dict[str, Any] = {}

    def gated(comm: plait.Communicator) -> None:
        inner = comm._within

        def within(*args: Any, **kwargs: Any) -> Any:  # the split's exchange
            if comm is first:
                first_in.set()
            both.wait()
            return inner(*args, **kwargs)

        comm._within = within  # type: ignore[method-assign]

    def run(name: str, comm: plait.Communicator, color: int) -> None:
        try:
            if comm is not first:
                assert first_in.wait(20)
            out[name] = comm.split(color)
        except BaseException as exc:
            out[name] = exc
            both.abort()
        finally:
            del comm._within

    gated(a)
    gated(b)
    threads = [
        threading.Thread(target=run, args=("a", a, 0)),
        threading.Thread(target=run, args=("b", b, color_b)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for name in ("a", "b"):
        if isinstance(out.get(name), BaseException):
            raise out[name]
    return out["a"], out["b"]


@pytest.mark.parametrize("firsts", [(True, True), (True, False), (False, True)])
def test_splits_on_threads_at_once_never_give_two_communicators_one_id(
    firsts: tuple[bool, bool],
) -> None:
    """Two threads of each rank split their own communicator at once, both groups hashing
    to one first candidate, the ranks beginning them in the same or opposite orders: both
    groups took that id (each rank's word said it had not used it), and a call on each
    took the other's messages (allreduces of 1 and 100 gave 101 on both)."""

    def body(comm: plait.Communicator) -> Any:
        a, b = comm.split(0), comm.split(0)
        a2, b2 = split_at_once(a, b, forced_color(a, b), firsts[comm.rank])
        if comm.rank == 0:
            a2.send(np.full(4, 1.0), 1)
            b2.send(np.full(4, 2.0), 1)
            got = None
        else:
            got = (b2.recv(np.empty(4), 0)[0], a2.recv(np.empty(4), 0)[0])
        xa, xb = np.full(4, 1.0), np.full(4, 100.0)
        if comm.rank == 0:
            wa, wb = a2.allreduce(xa, async_op=True), b2.allreduce(xb, async_op=True)
        else:
            wb, wa = b2.allreduce(xb, async_op=True), a2.allreduce(xa, async_op=True)
        return (a2._comm_id, b2._comm_id), got, (wa.wait(timeout=20)[0], wb.wait(timeout=20)[0])

    results = run_ranks(2, body, timeout=20)
    ids = {ids for ids, _, _ in results}
    assert len(ids) == 1, results  # the ranks agree on each id
    (ida, idb) = ids.pop()
    assert ida != idb, results
    assert results[1][1] == (2.0, 1.0), results
    assert [sums for _, _, sums in results] == [(2.0, 200.0)] * 2, results


def test_a_split_holds_its_candidates_until_it_takes_one() -> None:
    """Another split of the rank meanwhile marks every candidate the first reserved; once
    the first took its id, only that id stays held, and a failed split holds none."""
    from plait.group import reserve_ids

    class Transport:
        pass

    transport = Transport()
    with reserve_ids(transport, 0, 5, 1) as first:
        assert first.word == 0
        with reserve_ids(transport, 0, 5, 1) as second:  # the same candidates
            assert second.word == (1 << len(first.ids)) - 1
        taken = first.take(0)
        with reserve_ids(transport, 0, 5, 1) as third:
            assert third.word == 1
    with reserve_ids(transport, 0, 6, 1) as failed:  # it ends without taking one
        assert failed.word == 0
    with reserve_ids(transport, 0, 6, 1) as again:
        assert again.word == 0
    assert taken == child_comm_id(0, 5, 1)
