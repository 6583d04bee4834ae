"""The short path of repeated calls (Note [the short path] in plait._shortcut).

A call repeated with the same kind of arguments skips the checks; these
tests make sure that what the key cannot say is still tested on every call
(``out`` read-only, not contiguous, overlapping ``x``) and that each kind of
``out`` (none, ``x`` itself, another array) gives numpy's answer, call after
call. Threads play the ranks.
"""

from __future__ import annotations

import numpy as np
import pytest

import plait
from plait.testing import run_ranks
from spies import runs_of


def _kinds(comm: plait.Communicator) -> set[object]:
    """What ``out`` was in the calls the communicator keeps a short path for."""
    return {key[5] for key in comm._shortcuts}


def test_each_kind_of_out_takes_the_short_path_and_gives_numpys_answer() -> None:
    def body(comm: plait.Communicator) -> None:
        r, p = comm.rank, comm.size
        out = np.empty(5, np.float32)
        for step in range(4):
            x = np.arange(5, dtype=np.float32) * (r + 1) + step
            want = sum(np.arange(5, dtype=np.float32) * (q + 1) + step for q in range(p))
            np.testing.assert_array_equal(comm.allreduce(x), want)
            got = comm.allreduce(x, out=out)
            assert got is out
            np.testing.assert_array_equal(out, want)
            assert comm.allreduce(x, out=x) is x
            np.testing.assert_array_equal(x, want)
        assert _kinds(comm) == {None, True, ((5,), np.dtype(np.float32))}

    run_ranks(3, body)


def test_an_out_that_overlaps_x_is_found_on_the_short_path() -> None:
    """After a call into a separate array of the same shape, an overlapping view still works."""

    def body(comm: plait.Communicator) -> None:
        p = comm.size
        buf = np.arange(8, dtype=np.float64)
        x = buf[0:6]
        comm.allreduce(x, out=np.empty(6))  # the short path for (6,) float64 into an array
        assert ((6,), np.dtype(np.float64)) in _kinds(comm)
        want = x.copy() * p
        out = buf[2:8]  # a view that overlaps x
        assert comm.allreduce(x, out=out) is out
        np.testing.assert_array_equal(out, want)

    run_ranks(2, body)


def test_separate_tells_apart_views_of_different_arrays_and_finds_every_overlap() -> None:
    from plait._shortcut import separate

    a, b = np.zeros(8), np.zeros(8)
    assert separate(a, b)
    assert not separate(a, a)
    grid = b.reshape(2, 4)  # a view of another array (allgather's out=grid)
    assert separate(a, grid)
    assert separate(a[:4], grid)
    assert separate(a[:4], a[4:])  # one array, no common element
    assert not separate(a[:5], a[4:])
    assert not separate(a, a.reshape(2, 4))
    assert not separate(a[1:], a.reshape(2, 4))
    raw = bytearray(64)
    v, w = np.frombuffer(raw, np.float64)[:4], np.frombuffer(raw, np.float64)[3:]
    assert not separate(v, w)  # views of one buffer that is no array: tested by bounds
    assert separate(v[:3], w)


def test_a_read_only_or_strided_out_is_tested_on_every_call() -> None:
    def body(comm: plait.Communicator) -> None:
        p = comm.size
        x = np.ones(4, np.int64)
        comm.allreduce(x, out=np.empty(4, np.int64))
        frozen = np.empty(4, np.int64)
        frozen.flags.writeable = False
        with pytest.raises(ValueError, match="out is read-only"):
            comm.allreduce(x, out=frozen)
        wide = np.zeros(8, np.int64)
        strided = wide[::2]
        assert comm.allreduce(x, out=strided) is strided
        np.testing.assert_array_equal(wide, [p, 0, p, 0, p, 0, p, 0])

    run_ranks(2, body)


def test_out_off_root_of_a_reduce_is_not_written_on_the_short_path() -> None:
    def body(comm: plait.Communicator) -> None:
        x = np.full(3, comm.rank + 1.0)
        out = np.full(3, -1.0)
        for _ in range(3):
            got = comm.reduce(x, 0, out=out)
            if comm.rank == 0:
                assert got is out
                np.testing.assert_array_equal(out, [3.0, 3.0, 3.0])
            else:
                assert got is None
                np.testing.assert_array_equal(out, [-1.0, -1.0, -1.0])

    run_ranks(2, body)


def test_broadcast_takes_the_short_path_and_still_refuses_a_read_only_x() -> None:
    def body(comm: plait.Communicator) -> None:
        x = np.zeros((2, 3), np.float32)
        for step in range(4):
            if comm.rank == 1:
                x[...] = np.arange(6, dtype=np.float32).reshape(2, 3) + step
            assert comm.broadcast(x, 1) is x
            np.testing.assert_array_equal(x, np.arange(6, dtype=np.float32).reshape(2, 3) + step)
        assert ("broadcast", (2, 3), np.dtype(np.float32), 1, "auto") in comm._shortcuts
        if comm.rank == 0:
            frozen = np.zeros((2, 3), np.float32)
            frozen.flags.writeable = False
            with pytest.raises(ValueError, match="read-only"):
                comm.broadcast(frozen, 1)
        comm.broadcast(x, 1)  # both ranks go on together

    run_ranks(2, body)


def test_scatter_takes_the_short_path_and_reads_x_on_root_only() -> None:
    def body(comm: plait.Communicator) -> None:
        r, p = comm.rank, comm.size
        out = np.empty((2, 3), np.float32)
        for step in range(4):
            blocks = np.arange(p * 6, dtype=np.float32).reshape(2 * p, 3) + step
            # Off root x is only a shape: its contents (and a changing one) are never read.
            x = blocks if r == 1 else np.full_like(blocks, np.nan)
            want = blocks[2 * r : 2 * r + 2]
            np.testing.assert_array_equal(comm.scatter(x, root=1), want)
            assert comm.scatter(x, root=1, out=out) is out
            np.testing.assert_array_equal(out, want)
            with pytest.raises(ValueError, match="read-only"):
                comm.scatter(x, root=1, out=_read_only((2, 3)))
            # The root's out overlaps its x: the long way, which copies x first.
            overlapping = x.reshape(-1)[:6].reshape(2, 3) if r == 1 else out
            np.testing.assert_array_equal(comm.scatter(x, root=1, out=overlapping), want)
        kinds = {key[4] for key in comm._shortcuts if key[0] == "scatter"}
        assert kinds == {None, ((2, 3), np.dtype(np.float32))}, kinds

    run_ranks(3, body)


def _read_only(shape: tuple[int, ...]) -> np.ndarray:
    a = np.empty(shape, np.float32)
    a.flags.writeable = False
    return a


def test_a_barrier_runs_one_request_again_and_again() -> None:
    def body(comm: plait.Communicator) -> None:
        for _ in range(5):
            assert comm.barrier() is None
        first = comm._barrier
        assert first is not None
        comm.barrier()
        assert comm._barrier is first

    run_ranks(3, body)


def test_a_root_the_long_way_refuses_is_refused_after_a_short_path_is_kept() -> None:
    """True and 0.0 hash as 1 and 0: a kept short path must not let them through."""

    def body(comm: plait.Communicator) -> None:
        x = np.ones(3)
        comm.broadcast(x, 0)
        comm.reduce(x, 0, out=np.empty(3))
        for bad in (False, 0.0):
            with pytest.raises(TypeError, match="root"):
                comm.broadcast(x, bad)  # type: ignore[arg-type]
            with pytest.raises(TypeError, match="root"):
                comm.reduce(x, bad, out=np.empty(3))  # type: ignore[arg-type]

    run_ranks(2, body)


def test_a_kept_call_runs_in_the_runners_frame_without_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A kept request whose plan has a short path goes to that frame (CallRunner.short_path)
    # while the runner is plain; every other call goes through start.
    started = runs_of(monkeypatch, "start")

    def body(comm: plait.Communicator) -> None:
        runner = comm._runner
        x = np.arange(6.0) * (comm.rank + 1)
        for _ in range(3):  # the first of each goes the whole way, the others are kept
            np.testing.assert_array_equal(comm.allreduce(x), np.arange(6.0) * 3)
            y = np.full(4, float(comm.rank))
            assert comm.broadcast(y, 1) is y
            np.testing.assert_array_equal(y, np.ones(4))
            assert comm.barrier() is None
        assert all(cut.go is not None for cut in comm._shortcuts.values())
        assert comm._barrier is not None
        assert comm._barrier[1] is not None
        np.testing.assert_array_equal(comm.allreduce(x, timeout=20), np.arange(6.0) * 3)
        assert comm.barrier(async_op=True).wait() is None  # queued
        # While a thread runs a compressor's calls, no call skips start.
        assert runner.plain
        assert runner.compressing(lambda: runner.plain) is False
        assert runner.plain
        np.testing.assert_array_equal(comm.allreduce(x), np.arange(6.0) * 3)  # kept again

    run_ranks(2, body)
    # On each rank: the first of each kind, then the one with a timeout and the queued one.
    assert sorted(started) == sorted(
        ["allreduce", "broadcast", "barrier"] * 2 + ["allreduce", "barrier"] * 2
    )


def test_a_rank_alone_runs_its_kept_calls_in_one_frame(monkeypatch: pytest.MonkeyPatch) -> None:
    # Note [a rank alone] in plait._runner: the same results as the whole way.
    taken = runs_of(monkeypatch, "_run_alone")

    def body(comm: plait.Communicator) -> None:
        out = np.empty(5, np.float32)
        for step in range(3):
            x = np.arange(5, dtype=np.float32) + step
            want = x.copy()
            np.testing.assert_array_equal(comm.allreduce(x), want)  # a new array
            assert comm.allreduce(x, out=out) is out
            np.testing.assert_array_equal(out, want)
            assert comm.allreduce(x, out=x) is x  # in place: nothing to do
            np.testing.assert_array_equal(x, want)
            np.testing.assert_array_equal(comm.allreduce(x, op=plait.AVG), want)  # start's
            assert comm.broadcast(x) is x
            assert comm.barrier() is None
            np.testing.assert_array_equal(comm.allgather(x), want[None])
        assert comm._barrier is not None
        assert comm._barrier[1] == comm._runner._run_alone

    run_ranks(1, body)
    # Every plain call but the average (start hands plain calls to the same frames); the
    # barrier too: alone it has nobody to post for.
    assert taken == (["allreduce"] * 3 + ["broadcast", "barrier", "allgather"]) * 3
