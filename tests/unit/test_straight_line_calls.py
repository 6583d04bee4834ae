"""Calls that run in a straight line: they keep the views of a loop's arrays (Note
[bound lines] in plait.runtime.line), used again only for the very arrays they were made
for and kept only for small calls; and the plain ones take the call runner's short path
(Note [the straight-line short path] in plait._runner), with the same results, failures
and recorder as the whole way.

The ranks are threads over the in-process fabric with no shared window, so the
message-passing algorithms run, through the same executor as over TCP.
"""

from __future__ import annotations

import gc
import time
import weakref
from typing import Any

import numpy as np
import pytest

import plait
from plait import Communicator
from plait.errors import MismatchError
from plait.runtime import line
from plait.testing import run_ranks
from spies import runs_of

pytestmark = pytest.mark.timeout(60)

ALGORITHM = "recursive_doubling"  # a straight line at every size


def _kept(arr: np.ndarray) -> bool:
    """Whether some line keeps views of ``arr`` (as IN or OUT, or a view of it the first
    call made) for the next call."""
    for _, ln in list(line._LINES.values()):
        bound = ln.bound if ln is not None else None
        if bound is not None and any(b is arr or b.base is arr for b in bound[:2]):
            return True
    return False


@pytest.mark.parametrize("size", [2, 3])
def test_a_loop_on_one_array_keeps_its_views_and_reads_each_calls_values(size: int) -> None:
    def body(comm: Communicator) -> list[Any]:
        x = np.empty(5, np.float32)
        got = []
        for k in range(4):
            x[:] = np.arange(5) * (comm.rank + 1) + k
            comm.allreduce(x, out=x, algorithm=ALGORITHM)
            got.append(x.copy())
        return [got, _kept(x)]

    results = run_ranks(size, body, window=0)
    for k in range(4):
        want = sum(np.arange(5, dtype=np.float32) * (r + 1) + k for r in range(size))
        for got, _ in results:
            np.testing.assert_array_equal(got[k], want)
    assert all(kept for _, kept in results)


def test_a_call_on_other_arrays_never_touches_the_arrays_of_the_call_before() -> None:
    def body(comm: Communicator) -> None:
        n = comm.size
        a = np.ones(3, np.float64)
        comm.allreduce(a, out=a, algorithm=ALGORITHM)
        np.testing.assert_array_equal(a, n)
        b = np.full(3, 2.0)  # same shape and dtype: the same schedule and line
        comm.allreduce(b, out=b, algorithm=ALGORITHM)
        np.testing.assert_array_equal(b, 2.0 * n)
        np.testing.assert_array_equal(a, n)  # the views of a were not used for b
        c = np.empty(3)
        comm.allreduce(a, out=c, algorithm=ALGORITHM)  # not in place: IN and OUT differ
        np.testing.assert_array_equal(c, n * n)
        np.testing.assert_array_equal(a, n)
        first = comm.allreduce(b, algorithm=ALGORITHM)  # a new result each call
        second = comm.allreduce(a, algorithm=ALGORITHM)
        np.testing.assert_array_equal(first, 2.0 * n * n)
        np.testing.assert_array_equal(second, n * n)

    run_ranks(3, body, window=0)


def test_an_array_whose_dtype_changed_in_place_is_reduced_as_its_new_dtype() -> None:
    def body(comm: Communicator) -> np.ndarray:
        x = np.full(4, 1.5, np.float32)
        comm.allreduce(x, out=x, algorithm=ALGORITHM)
        x.dtype = np.dtype(np.int32)  # the same object and item size, another dtype
        x[:] = comm.rank + 1
        comm.allreduce(x, out=x, algorithm=ALGORITHM)
        return x.copy()

    for got in run_ranks(2, body, window=0):
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, 3)


def test_only_small_calls_keep_their_arrays(monkeypatch: pytest.MonkeyPatch) -> None:
    def body(comm: Communicator) -> list[bool]:
        small = np.ones(8, np.float32)
        comm.allreduce(small, out=small, algorithm=ALGORITHM)
        ref = weakref.ref(small)
        kept = _kept(small)
        del small
        gc.collect()
        alive = ref() is not None  # the line holds it until a call replaces its views
        other = np.ones(8, np.float32)
        comm.allreduce(other, out=other, algorithm=ALGORITHM)
        gc.collect()
        return [kept, alive, ref() is None, _kept(other)]

    for kept, alive, freed, kept_other in run_ranks(2, body, window=0):
        assert [kept, alive, freed, kept_other] == [True, True, True, True]

    monkeypatch.setattr(line, "BIND_BYTES", 16)  # below one 8-element array

    def big(comm: Communicator) -> list[bool]:
        x = np.ones(8, np.float32)
        comm.allreduce(x, out=x, algorithm=ALGORITHM)
        ref = weakref.ref(x)
        kept = _kept(x)
        np.testing.assert_array_equal(x, comm.size)
        del x
        gc.collect()
        return [kept, ref() is None]

    for kept, freed in run_ranks(2, big, window=0):
        assert [kept, freed] == [False, True]


def test_plain_straight_line_calls_take_the_short_path_and_the_others_the_whole_way(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    taken = runs_of(monkeypatch, "_run_straight")

    def body(comm: Communicator) -> list[Any]:
        x = np.arange(10.0) * (comm.rank + 1)
        return [
            comm.allreduce(x, algorithm=ALGORITHM),  # short
            comm.allreduce(x, op=plait.AVG, algorithm=ALGORITHM),  # an average
            comm.allreduce(x, algorithm=ALGORITHM, timeout=20),  # its own timeout
            comm.allreduce(x, algorithm=ALGORITHM, async_op=True).wait(),  # queued
            comm.broadcast(x.copy(), root=1, algorithm="binomial"),  # short (it fills its x)
            comm.allreduce(x, algorithm=ALGORITHM),  # short again, after all of those
        ]

    got = run_ranks(2, body, window=0)
    assert sorted(taken) == ["allreduce"] * 4 + ["broadcast"] * 2  # three on each rank
    total = np.arange(10.0) * 3
    for res in got:
        for i, want in enumerate([total, total / 2, total, total, np.arange(10.0) * 2, total]):
            np.testing.assert_array_equal(res[i], want)


def test_a_mismatch_on_the_short_path_fails_every_rank_and_breaks_the_communicator() -> None:
    def body(comm: Communicator) -> str:
        x = np.ones(3 + comm.rank)  # another count on each rank
        with pytest.raises(MismatchError, match="this rank called") as caught:
            comm.allreduce(x, out=x, algorithm=ALGORITHM)
        assert "the output buffer's contents are undefined" in str(caught.value)
        with pytest.raises(plait.CommError, match="unusable after an earlier failure"):
            comm.allreduce(x, out=x, algorithm=ALGORITHM)
        return "raised"

    assert run_ranks(2, body, window=0, timeout=20) == ["raised", "raised"]


def test_a_straight_line_call_in_flight_is_found_on_its_callers_line() -> None:
    # The short path's frame is the one a dump looks for (runs_calls), as _run's is.
    seen: list[dict[str, Any]] = []
    recorders: dict[int, Any] = {}

    def body(comm: Communicator) -> None:
        x = np.ones(4)
        recorders[comm.rank] = comm._runner.recorder
        if comm.rank == 0:
            comm.allreduce(x, algorithm=ALGORITHM)  # in flight until rank 1 comes
            return
        deadline = time.monotonic() + 20
        while not seen and time.monotonic() < deadline:  # until rank 0 waits in its call
            rec = recorders.get(0)
            if rec is not None:
                seen.extend(c for c in rec.snapshot() if c["state"] == "running" and c["stack"])
            time.sleep(0.01)
        comm.allreduce(x, algorithm=ALGORITHM)

    first = body.__code__.co_firstlineno + 4
    run_ranks(2, body, window=0)
    assert seen, "rank 0's call was never seen in flight"
    assert seen[0]["stack"][0][:3] == [__file__, first, "body"]
