"""plait.mpi in process: buffer specifications, ops, calls on threads as ranks, and the errors
of what it does not support."""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import plait
from plait import mpi as MPI
from plait.mpi._datatypes import DATATYPES, message, vector
from plait.mpi._ops import combine_pairs
from plait.testing import RankFailure, run_ranks

PAIR = np.dtype([("value", np.float64), ("index", np.intc)], align=True)


def ranks(size: int, fn: Callable[[MPI.Comm], Any]) -> list[Any]:
    """``fn`` on ``size`` threads, each with an mpi4py communicator over plait's."""
    return run_ranks(size, lambda c: fn(MPI.Comm(c, "test")), timeout=20)


# -- buffer specifications ---------------------------------------------------------------
def test_a_buffer_alone_takes_its_datatype_from_the_array() -> None:
    a = np.arange(6, dtype=np.float64)
    m = message(a, "t")
    assert (m.datatype, m.count, m.displs) == (MPI.DOUBLE, 6, [0])
    assert np.shares_memory(m.typed(), a)
    assert np.array_equal(m.typed(), a)
    b = message(bytearray(5), "t")
    assert (b.datatype, b.count) == (MPI.UNSIGNED_CHAR, 5)  # mpi4py's reading of format "B"


def test_any_buffer_takes_its_own_type_as_mpi4py_reads_it() -> None:
    """array.array and memoryview buffers were read as bytes: sums added bytes, and a count
    of 2 was two bytes."""
    import array

    assert message(array.array("d", [1.0, 2.0]), "t").datatype == MPI.DOUBLE
    assert message(memoryview(np.zeros(3, np.int32)), "t").datatype == MPI.INT

    def body(c: MPI.Comm) -> Any:
        r = c.Get_rank()
        s, o = array.array("d", [1.5 + r, 2.0]), array.array("d", [0.0, 0.0])
        c.Allreduce(s, o, op=MPI.SUM)
        mo = np.zeros(2)
        c.Allreduce(memoryview(np.array([1000.0 * r, 1.0])), memoryview(mo), op=MPI.SUM)
        b = array.array("d", [1.0, 2.0, 3.0, 4.0] if r == 0 else [0.0] * 4)
        c.Bcast([b, 2], root=0)
        return list(o), mo.tolist(), list(b)

    for r, got in enumerate(ranks(3, body)):
        assert got[0] == [7.5, 6.0]
        assert got[1] == [3000.0, 3.0]
        assert got[2] == ([1.0, 2.0, 3.0, 4.0] if r == 0 else [1.0, 2.0, 0.0, 0.0])


@pytest.mark.parametrize(
    ("spec", "count", "displ"),
    [
        (lambda a: [a, MPI.INT], 8, 0),
        (lambda a: (a, MPI.INT), 8, 0),
        (lambda a: [a, 3, MPI.INT], 3, 0),
        (lambda a: [a, (3, 2), MPI.INT], 3, 2),
        (lambda a: [a, 3, 2, MPI.INT], 3, 2),
        (lambda a: [a, 4], 4, 0),
    ],
)
def test_plain_specifications(spec: Callable[[np.ndarray], Any], count: int, displ: int) -> None:
    a = np.arange(8, dtype=np.intc)
    m = message(spec(a), "t")
    assert (m.count, m.displs[0]) == (count, displ)
    assert np.array_equal(m.typed(), a[displ : displ + count])


def test_a_datatype_reinterprets_the_bytes_as_mpi_does() -> None:
    a = np.arange(4, dtype=np.int64)
    m = message([a, MPI.INT], "t")
    assert m.count == 8
    assert m.typed().dtype == np.intc


def test_vector_specifications() -> None:
    a = np.arange(10, dtype=np.float64)
    v = vector([a, [1, 2, 3], [0, 3, 6], MPI.DOUBLE], 3, "t")
    assert (v.counts, v.displs, v.packed()) == ([1, 2, 3], [0, 3, 6], False)
    v = vector([a, [1, 2, 3], MPI.DOUBLE], 3, "t")
    assert (v.displs, v.packed(), v.block_bytes()) == ([0, 1, 3], True, [8, 16, 24])
    v = vector([a, ([2, 2], [0, 5]), MPI.DOUBLE], 2, "t")
    assert (v.counts, v.displs) == ([2, 2], [0, 5])
    assert vector(a, 5, "t").counts == [2] * 5
    assert vector([a, 2, MPI.DOUBLE], 5, "t").counts == [2] * 5
    v = vector([a, (2, None), MPI.DOUBLE], 5, "t")  # mpi4py's form; it was refused
    assert (v.counts, v.displs) == ([2] * 5, [0, 2, 4, 6, 8])


@pytest.mark.parametrize(
    ("spec", "error", "words"),
    [
        (lambda: np.zeros((4, 4))[:, 0], BufferError, "not contiguous"),
        (lambda: np.zeros((4, 4))[:, 0], ValueError, "not contiguous"),  # as it was
        (lambda: [np.zeros(3), MPI.DOUBLE.Create_contiguous(3)], MPI.Unsupported, "Datatype"),
        (lambda: [np.zeros(4), 9, MPI.DOUBLE], ValueError, "holds 4"),
        (lambda: [np.zeros(4), MPI.DOUBLE, 2], TypeError, "datatype goes last"),
        (lambda: [np.zeros(3, np.uint8), MPI.INT], ValueError, "not a whole number"),
        (lambda: [1, 2, 3], TypeError, "not a buffer"),
    ],
)
def test_bad_specifications(spec: Callable[[], Any], error: type, words: str) -> None:
    with pytest.raises(error, match=words):
        message(spec(), "Send")


def test_pair_datatypes_have_mpis_size_and_extent() -> None:
    assert (MPI.DOUBLE_INT.Get_size(), MPI.DOUBLE_INT.extent) == (12, 16)
    assert (MPI.TWOINT.Get_size(), MPI.TWOINT.extent) == (8, 8)
    assert MPI.INT_INT is MPI.TWOINT
    packed = np.zeros(3, np.dtype([("v", "f8"), ("i", "i4")]))  # align=False: 12 bytes
    m = message([packed, MPI.DOUBLE_INT], "t")
    assert m.count == 3
    assert m.typed().dtype == packed.dtype


def test_datatype_names_are_mpi4pys() -> None:
    """Get_name said the Python name (MPI_LONG_LONG, MPI_TWOINT, MPI_BOOL) where mpi4py on
    Open MPI says the C name of the one type the Python names share."""
    differ = {
        "SIGNED_SHORT": "MPI_SHORT",
        "SIGNED_INT": "MPI_INT",
        "UNSIGNED_INT": "MPI_UNSIGNED",
        "SIGNED_LONG": "MPI_LONG",
        "LONG_LONG": "MPI_LONG_LONG_INT",
        "SIGNED_LONG_LONG": "MPI_LONG_LONG_INT",
        "BOOL": "MPI_C_BOOL",
        "C_FLOAT_COMPLEX": "MPI_C_COMPLEX",
        "TWOINT": "MPI_2INT",
        "INT_INT": "MPI_2INT",
    }
    for name in DATATYPES:
        said = getattr(MPI, name).Get_name()
        assert said == differ.get(name, f"MPI_{name}"), name


# -- ops ---------------------------------------------------------------------------------
def test_object_ops_follow_mpi4py() -> None:
    assert MPI.SUM([1], [2]) == [1, 2]
    assert MPI.PROD(3, 4) == 12
    assert MPI.MAX(2, 5) == 5
    assert MPI.MIN("b", "a") == "a"
    assert MPI.LAND(1, 0) is False  # bools, as mpi4py's: not an operand
    assert MPI.LOR(0, 3) is True
    assert MPI.LXOR(True, True) is False
    assert MPI.BAND(6, 3) == 2
    assert MPI.BOR(6, 3) == 7
    assert MPI.BXOR(6, 3) == 5
    assert MPI.MAXLOC((3, 2), (3, 1)) == (3, 1)
    assert MPI.MAXLOC((4, 2), (3, 1)) == (4, 2)
    assert MPI.MINLOC((3, 2), (3, 1)) == (3, 1)
    assert MPI.MINLOC((2, 2), (3, 1)) == (2, 2)


def test_combine_pairs_on_structured_and_plain_pairs() -> None:
    blocks = [np.array([(1.0, 0), (5.0, 0)], PAIR), np.array([(1.0, 1), (7.0, 1)], PAIR)]
    out = np.empty(2, PAIR)
    combine_pairs(blocks, "max", out, "t")
    assert out.tolist() == [(1.0, 0), (7.0, 1)]
    combine_pairs(blocks, "min", out, "t")
    assert out.tolist() == [(1.0, 0), (5.0, 0)]
    plain = [np.array([[2, 1], [0, 1]]), np.array([[2, 0], [1, 0]])]
    got = np.empty((2, 2), np.int64)
    combine_pairs(plain, "max", got, "t")
    assert got.tolist() == [[2, 0], [1, 0]]
    with pytest.raises(TypeError, match="value, index"):
        combine_pairs([np.zeros(3)], "max", np.zeros(3), "t")


# -- calls, on threads as ranks ----------------------------------------------------------
def test_maxloc_and_minloc_buffers() -> None:
    def body(comm: MPI.Comm) -> list[Any]:
        r = comm.Get_rank()
        x = np.array([(float(r % 2), r), (float(-r), r)], PAIR)
        best = np.empty_like(x)
        comm.Allreduce([x, MPI.DOUBLE_INT], [best, MPI.DOUBLE_INT], op=MPI.MAXLOC)
        low = np.empty_like(x) if r == 2 else None
        comm.Reduce([x, MPI.DOUBLE_INT], [low, MPI.DOUBLE_INT], op=MPI.MINLOC, root=2)
        pairs = np.array([[r * 10 % 7, r]], np.int64)  # a plain array of (value, index) rows
        comm.Allreduce(MPI.IN_PLACE, pairs, op=MPI.MAXLOC)
        part = np.empty(1, PAIR)
        whole = np.array([(float(r == k), r) for k in range(3)], PAIR)
        comm.Reduce_scatter_block([whole, MPI.DOUBLE_INT], [part, MPI.DOUBLE_INT], op=MPI.MAXLOC)
        return [best.tolist(), None if low is None else low.tolist(), pairs.tolist(), part[0]]

    res = ranks(3, body)
    assert all(o[0] == [(1.0, 1), (0.0, 0)] for o in res)
    assert res[2][1] == [(0.0, 0), (-2.0, 2)]
    assert all(o[2] == [[6, 2]] for o in res)
    assert [tuple(o[3]) for o in res] == [(1.0, 0), (1.0, 1), (1.0, 2)]


def test_in_place_and_vector_collectives() -> None:
    def body(comm: MPI.Comm) -> list[Any]:
        r, p = comm.rank, comm.size
        g = np.zeros(p) if r == 1 else None
        if r == 1:
            g[1] = 10.0 + r
            comm.Gather(MPI.IN_PLACE, g, root=1)
        else:
            comm.Gather(np.array([10.0 + r]), g, root=1)
        ag = np.zeros(2 * p, np.int32)
        ag[2 * r : 2 * r + 2] = r
        comm.Allgather(MPI.IN_PLACE, ag)
        a2a = np.arange(p, dtype=np.int64) + 10 * r
        comm.Alltoall(MPI.IN_PLACE, a2a)
        sc = np.full(2, -1.0)
        comm.Scatter(np.arange(2.0 * p) if r == 0 else None, MPI.IN_PLACE if r == 0 else sc)
        counts = [k + 1 for k in range(p)]
        displs = [sum(counts[:k]) + k for k in range(p)]  # gaps between blocks
        av = np.zeros(sum(counts) + p)
        av[displs[r] : displs[r] + counts[r]] = r
        comm.Allgatherv(MPI.IN_PLACE, [av, counts, displs, MPI.DOUBLE])
        send = np.arange(p, dtype=np.float64) + 100 * r
        recv = np.zeros(2 * p)
        comm.Alltoallv([send, [1] * p, MPI.DOUBLE], [recv, [1] * p, [2 * k for k in range(p)]])
        rs = np.arange(6.0)
        comm.Reduce_scatter(MPI.IN_PLACE, rs, recvcounts=[1, 2, 3], op=MPI.SUM)
        flags = np.array([r > 0, r >= 0, r == 1])
        comm.Allreduce(MPI.IN_PLACE, flags, op=MPI.LOR)
        return [g, ag, a2a, sc, av, recv, rs[: r + 1], flags]

    res = ranks(3, body)
    assert res[1][0].tolist() == [10.0, 11.0, 12.0]
    assert all(o[1].tolist() == [0, 0, 1, 1, 2, 2] for o in res)
    assert res[2][2].tolist() == [2, 12, 22]
    assert res[1][3].tolist() == [2.0, 3.0]
    assert res[2][3].tolist() == [4.0, 5.0]
    assert all(o[4].tolist() == [0, 0, 1, 1, 0, 2, 2, 2, 0] for o in res)
    assert res[1][5].tolist() == [1, 0, 101, 0, 201, 0]
    assert [o[6].tolist() for o in res] == [[0.0], [3.0, 6.0], [9.0, 12.0, 15.0]]
    assert all(o[7].tolist() == [True, True, True] for o in res)


def test_point_to_point_buffers() -> None:
    def body(comm: MPI.Comm) -> Any:
        if comm.rank == 0:
            comm.Send(np.arange(3.0), dest=1, tag=4)
            comm.Send(np.arange(9.0), dest=1, tag=5)
            req = comm.Isend([np.arange(4, dtype=np.intc), MPI.INT], dest=1, tag=6)
            req.Wait()
            return None
        st = MPI.Status()
        big = np.zeros(5)
        comm.Recv(big, source=MPI.ANY_SOURCE, tag=4, status=st)
        with pytest.raises(ValueError, match="truncated"):
            comm.Recv(np.zeros(2), source=0, tag=5)
        comm.Recv(np.zeros(9), source=0, tag=5)
        into = np.zeros(4, np.intc)
        req = comm.Irecv(into, source=0, tag=MPI.ANY_TAG)
        rst = MPI.Status()
        req.Wait(rst)
        return big.tolist(), st.Get_count(MPI.DOUBLE), st.source, st.tag, into.tolist(), rst.tag

    got = ranks(2, body)[1]
    assert got == ([0.0, 1.0, 2.0, 0.0, 0.0], 3, 0, 4, [0, 1, 2, 3], 6)


def test_object_receives_match_in_the_order_they_were_posted() -> None:
    def body(comm: MPI.Comm) -> Any:
        if comm.rank == 1:
            for k in range(3):
                comm.send(f"m{k}", dest=0, tag=k)
            return None
        first = comm.irecv(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)
        second = comm.irecv(source=1)
        st = MPI.Status()
        later = second.wait(st)  # the earlier receive takes the first message first
        flag, early = first.test()
        third = comm.irecv(source=1, tag=2)
        i, value = MPI.Request.waitany([third])
        return later, st.tag, flag, early, i, value

    assert ranks(2, body)[0] == ("m1", 1, True, "m0", 0, "m2")


def test_lowercase_collectives_and_split() -> None:
    def body(comm: MPI.Comm) -> Any:
        r = comm.rank
        sub = comm.Split(MPI.UNDEFINED if r == 0 else 1, key=-r)
        inner = None if sub == MPI.COMM_NULL else (sub.rank, sub.allgather(r))
        dup = comm.Dup()
        out = (
            comm.bcast({"r": r}, root=2),
            comm.scatter([k * k for k in range(3)] if r == 0 else None),
            comm.gather(r, root=1),
            comm.reduce([r], op=MPI.SUM, root=0),
            comm.allreduce((r % 2, r), op=MPI.MINLOC),
            dup.sendrecv(r, dest=(r + 1) % 3, source=(r - 1) % 3),
            inner,
        )
        dup.Free()
        assert dup == MPI.COMM_NULL
        assert not dup
        return out

    res = ranks(3, body)
    assert res[0] == ({"r": 2}, 0, None, [0, 1, 2], (0, 0), 2, None)
    assert res[1] == ({"r": 2}, 1, [0, 1, 2], None, (0, 0), 0, (1, [2, 1]))
    assert res[2][6] == (0, [2, 1])


# -- errors --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("get", "words"),
    [
        (lambda: MPI.Win, "MPI.Win; nearest supported: the collectives"),
        (lambda: MPI.COMM_WORLD.Ibcast, "Comm.Ibcast; nearest supported: Bcast"),
        (lambda: MPI.COMM_NULL.Scan, "Comm.Scan; nearest supported: allgather"),
        (lambda: MPI.Comm(None).Allgatherw, "Comm.Allgatherw; nearest supported: Allgather"),
        (lambda: MPI.REPLACE, "MPI.REPLACE; nearest supported: a Python function"),
        (lambda: MPI.Comm_spawn, "MPI.Comm_spawn; see docs/mpi.md"),
        # Note [nearest]: no constant or verb spelled alike but meaning another thing
        (lambda: MPI.IDENT, "MPI.IDENT; see docs/mpi.md"),
        (lambda: MPI.CONGRUENT, "MPI.CONGRUENT; see docs/mpi.md"),
        (lambda: MPI.COMPLEX16, "MPI.COMPLEX16; nearest supported: C_DOUBLE_COMPLEX"),
        (lambda: MPI.FLOAT32_T, "MPI.FLOAT32_T; nearest supported: FLOAT (the same"),
        (lambda: MPI.INTEGER8, "MPI.INTEGER8; nearest supported: INT64_T"),
        (lambda: MPI.Status.py2f, "Status.py2f; see docs/mpi.md"),
        (lambda: MPI.Status.tomemory, "Status.tomemory; see docs/mpi.md"),
        (lambda: MPI.COMM_WORLD.Agree, "Comm.Agree; nearest supported: plait's own"),
        (lambda: MPI.COMM_WORLD.Iscan, "Comm.Iscan; nearest supported: allgather"),
        (lambda: MPI.COMM_WORLD.Iallgatherv, "Comm.Iallgatherv; nearest supported: Allgatherv"),
        (lambda: MPI.COMM_WORLD.Allreduce_init, "nearest supported: Allreduce (called each"),
        (lambda: MPI.Intercomm, "MPI.Intercomm; nearest supported: Intracomm (no inter"),
        (lambda: MPI.Get_abi_version, "MPI.Get_abi_version; nearest supported: Get_version"),
    ],
)
def test_what_is_not_supported_says_so(get: Callable[[], Any], words: str) -> None:
    with pytest.raises(NotImplementedError) as info:
        get()
    assert words in str(info.value)


def test_unsupported_names_are_absent_to_feature_checks() -> None:
    assert not hasattr(MPI, "Ibarrier")
    assert not hasattr(MPI.COMM_WORLD, "Ibarrier")
    with pytest.raises(AttributeError):
        MPI.__wrapped__  # noqa: B018  (private names are plain AttributeErrors)
    with pytest.raises(ValueError, match="COMM_NULL"):
        MPI.COMM_NULL.Get_rank()
    with pytest.raises(RankFailure, match=r"TypeError.*lowercase reduce"):
        ranks(1, lambda comm: comm.Allreduce(np.zeros(1), np.zeros(1), op=max))


def test_an_uncaught_exception_aborts_the_world(monkeypatch: pytest.MonkeyPatch) -> None:
    """The exception hook that joining COMM_WORLD installs aborts the communicator."""
    for name in ("PLAIT_RANK", "PLAIT_SIZE", "PLAIT_STORE", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "excepthook", lambda *exc: None)
    world = MPI._comm.world()
    assert world.Get_size() == 1
    try:
        sys.excepthook(RuntimeError, RuntimeError("boom"), None)
        with pytest.raises(plait.AbortedError, match="boom"):
            world.Barrier()
    finally:
        world._release()


def test_maxloc_of_no_pairs_is_refused_before_anything_moves() -> None:
    """A plain buffer of odd length holds no (value, index) pairs: the TypeError that says so
    comes before the call's allgather (it used to be numpy's reshape error, after it)."""

    def body(comm: MPI.Comm) -> list[str]:
        said = []
        for call in (
            lambda: comm.Allreduce(np.arange(3.0), np.zeros(3), MPI.MAXLOC),
            lambda: comm.Reduce(np.arange(3.0), np.zeros(3), MPI.MINLOC, root=0),
        ):
            with pytest.raises(TypeError, match="MAXLOC and MINLOC reduce \\(value, index\\)"):
                call()
            said.append("refused")
        comm.Barrier()  # nothing moved: the ranks still meet in step
        got = np.zeros(4)
        comm.Allreduce(np.array([1.0, 0.0, 5.0, 1.0]) * (comm.rank + 1), got, MPI.MAXLOC)
        return [*said, got.tolist()]

    for r in ranks(2, body):
        assert r == ["refused", "refused", [2.0, 0.0, 10.0, 2.0]]


@pytest.mark.parametrize(
    ("spec", "said"),
    [
        (lambda a: [a, 2.5, MPI.DOUBLE], "count must be an int; got 2.5"),
        (lambda a: [a, (2, 1.0), MPI.DOUBLE], "displacement must be an int; got 1.0"),
        (lambda a: [a, "2", MPI.DOUBLE], "count must be an int"),
    ],
)
def test_a_count_that_is_not_an_int_is_refused(
    spec: Callable[[np.ndarray], Any], said: str
) -> None:
    """MPI counts are integers: 2.5 elements used to be taken as 2."""
    with pytest.raises(TypeError, match=said):
        message(spec(np.arange(4.0)), "Bcast")
    assert message([np.arange(4.0), np.int64(2), MPI.DOUBLE], "Bcast").count == 2


def test_reduce_scatter_counts_must_be_ints() -> None:
    def body(comm: MPI.Comm) -> str:
        with pytest.raises(TypeError, match="recvcounts must be a sequence of ints"):
            comm.Reduce_scatter(np.ones(2), np.zeros(1), recvcounts=[1.9, 1.2])
        return "refused"

    assert ranks(2, body) == ["refused", "refused"]


def test_waitany_hands_out_each_completion_once_and_never_waits_on_one_alone() -> None:
    """Waitany returned the same finished request again (mpi4py's is then REQUEST_NULL),
    and over object and buffer receives, or past a message none wanted, it waited for the
    first request alone until the timeout."""

    def body(c: MPI.Comm) -> Any:
        r = c.Get_rank()
        if r == 0:
            bufs = [np.zeros(1), np.zeros(1)]
            reqs = [c.Irecv(bufs[0], 1, 7), c.Irecv(bufs[1], 2, 7)]
            order = sorted(MPI.Request.Waitany(reqs) for _ in reqs)
            after = MPI.Request.Testany(reqs)
            mixed = [c.irecv(source=1, tag=1), c.Irecv(np.zeros(1), 2, tag=2)]
            first = MPI.Request.Waitany(mixed)  # rank 1 sends only once told
            c.send("go", 1, tag=9)
            mixed[0].wait()
            objs = [c.irecv(source=1, tag=3), c.irecv(source=2, tag=3)]
            got = MPI.Request.waitany(objs)  # past rank 2's unrelated message (tag 5)
            c.recv(source=2, tag=5)
            c.send("go", 1, tag=9)
            objs[0].wait()
            return order, [b[0] for b in bufs], after, first, got
        c.Send(np.array([float(r)]), 0, 7)
        if r == 1:
            c.recv(source=0, tag=9)
            c.send("late", 0, tag=1)
            c.recv(source=0, tag=9)
            c.send("late", 0, tag=3)
        else:
            c.Send(np.ones(1), 0, tag=2)
            c.send("unrelated", 0, tag=5)
            c.send("answer", 0, tag=3)
        return None

    order, values, after, first, got = ranks(3, body)[0]
    assert order == [0, 1]
    assert values == [1.0, 2.0]
    assert after == (MPI.UNDEFINED, True)
    assert first == 1
    assert got == (1, "answer")


def test_gatherv_checks_each_ranks_count_at_root() -> None:
    """Counts 3, 1, 2 against root's 2, 2, 2 were taken (the sum matched): rank 0's third
    element landed in rank 1's block, with no error (mpi4py: MPI_ERR_TRUNCATE)."""

    def body(c: MPI.Comm) -> Any:
        r = c.Get_rank()
        x = np.full([3, 1, 2][r], float(r))
        if r == 0:
            rb = np.zeros(6)
            with pytest.raises(
                ValueError, match=r"expects \[2, 2, 2\] .* rank\(s\) \[0, 1\] sent 3, 1"
            ):
                c.Gatherv(x, [rb, [2, 2, 2], [0, 2, 4], MPI.DOUBLE], root=0)
            c.Gatherv(x[:2], [rb, [2, 2, 2], [0, 2, 4], MPI.DOUBLE], root=0)
            return rb.tolist()
        c.Gatherv(x, None, root=0)
        c.Gatherv(np.full(2, float(r)), None, root=0)
        return None

    assert ranks(3, body)[0] == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0]


def test_v_calls_refuse_a_ranks_own_block_in_elements_before_anything_moves() -> None:
    """A rank whose message is not its own block's size was refused by plait's check, in
    bytes of the uint8 view ("x has 24 rows ... counts[1] says 16"); it now says elements
    and datatypes, and the call after it still runs (nothing moved)."""

    def body(c: MPI.Comm) -> Any:
        r = c.Get_rank()
        x = np.full(3, float(r))
        rb = np.zeros(6)
        errors = []
        calls = [
            lambda: c.Allgatherv(x, [rb, [2, 2, 2]]),
            lambda: c.Alltoallv([x, [1, 1, 1]], [rb, [2, 2, 2]]),
            lambda: c.Reduce_scatter(x, rb, [2, 2, 2]),
        ]
        for call in calls:  # (Scatterv's root takes part first: Note [root's own block])
            with pytest.raises(ValueError, match="element") as info:
                call()
            errors.append(str(info.value))
        c.Allgatherv(x[:2], [rb, [2, 2, 2]])
        return errors, rb.tolist()

    got = ranks(3, body)
    for errors, rb in got:
        assert rb == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0]
        assert all("bytes" not in e or "element" in e for e in errors)
    errors = got[1][0]
    assert "3 element(s) of DOUBLE (24 bytes), but recvbuf's count for this rank" in errors[0]
    assert "counts[1]) is 2 element(s)" in errors[0]
    assert "sends itself 1 element(s) of DOUBLE but receives 2" in errors[1]
    assert "sendbuf holds 3 element(s) of DOUBLE, but recvcounts [2, 2, 2] add up to 6" in errors[2]


def test_get_count_of_pairs_counts_pairs() -> None:
    """Three DOUBLE_INT pairs (16 bytes each as sent, 12 as MPI's size) counted 4."""

    def body(c: MPI.Comm) -> Any:
        if c.Get_rank() == 0:
            c.Send([np.zeros(3, PAIR), MPI.DOUBLE_INT], 1, 4)
            return None
        st = MPI.Status()
        c.Recv([np.zeros(3, PAIR), MPI.DOUBLE_INT], 0, 4, status=st)
        return st.Get_count(MPI.DOUBLE_INT)

    assert ranks(2, body)[1] == 3


def test_names_request_status_and_op_lack_are_unsupported_not_attribute_errors() -> None:
    """``MPI.Request.Waitsome`` and the like raised a bare AttributeError, where the module
    and Comm raise Unsupported naming the call (and docs/mpi.md says so)."""
    for get, words in [
        (lambda: MPI.Request.Waitsome, "Request.Waitsome; nearest supported: Waitany"),
        (lambda: MPI.Status().tomemory, "Status.tomemory"),
        (lambda: MPI.Op.Create, "Op.Create; nearest supported: MPI.SUM"),
        (lambda: MPI.SUM.Reduce_local, "Op.Reduce_local"),
    ]:
        with pytest.raises(MPI.Unsupported, match=words):
            get()
    assert not hasattr(MPI.Request, "Startall")  # feature checks still see it as absent


def test_logical_object_ops_give_bools_as_mpi4py_does() -> None:
    assert (MPI.LAND(1, 0), MPI.LOR(0, 3), MPI.LXOR(0, 0), MPI.LXOR(2, 0)) == (
        False,
        True,
        False,
        True,
    )
    assert all(type(v) is bool for v in (MPI.LAND(1, 2), MPI.LOR(0, 0)))


def test_a_typecode_names_the_datatype_as_mpi4py_reads_it() -> None:
    """``[buf, 'd']`` was refused: "count must be an int; got 'd'"."""
    assert (message([np.zeros(4), "d"], "t").datatype, message([np.zeros(4), "d"], "t").count) == (
        MPI.DOUBLE,
        4,
    )
    assert message([np.zeros(4, np.int32), 2, "i"], "t").count == 2
    with pytest.raises(TypeError, match="'zz' is not a datatype or typecode"):
        message([np.zeros(4), "zz"], "t")

    def body(c: MPI.Comm) -> Any:
        x = np.arange(3.0) if c.Get_rank() == 0 else np.zeros(3)
        c.Bcast([x, "d"], root=0)
        return x.tolist()

    assert ranks(2, body) == [[0.0, 1.0, 2.0]] * 2


def test_a_truncated_receive_is_said_in_elements_by_the_call_that_made_it() -> None:
    """It read "Recv: message truncated: rank 0 sent 40 bytes with tag 1 into a buffer of
    16", and Sendrecv's called itself Recv."""

    def body(c: MPI.Comm) -> Any:
        if c.Get_rank() == 0:
            c.Send(np.zeros(5), 1, tag=1)
            c.Send(np.zeros(5), 1, tag=2)
            c.Barrier()
            return None
        said = []
        for call in (
            lambda: c.Recv(np.zeros(2), 0, 1),
            lambda: c.Sendrecv(np.zeros(1), MPI.PROC_NULL, 0, np.zeros(2), 0, 2),
        ):
            with pytest.raises(ValueError, match="message truncated") as info:
                call()
            said.append(str(info.value))
        c.Recv(np.zeros(5), 0, 1)  # left unreceived: still there
        c.Recv(np.zeros(5), 0, 2)
        c.Barrier()
        return said

    recv, sendrecv = ranks(2, body)[1]
    assert recv == (
        "Recv: message truncated (MPI_ERR_TRUNCATE): rank 0 sent 5 DOUBLE (40 bytes) with tag "
        "1, but the buffer holds 2 DOUBLE (16 bytes); the message is left unreceived"
    )
    assert sendrecv.startswith("Sendrecv: message truncated (MPI_ERR_TRUNCATE): rank 0 sent 5")


def test_buffer_collectives_refuse_sizes_that_differ_in_elements_before_anything_moves() -> None:
    """plait's own checks said "alltoall: out has shape (36,); expected (24,)" (bytes, and
    plait's argument names) where mpi4py says MPI_ERR_TRUNCATE or names the counts."""

    def body(c: MPI.Comm) -> Any:
        n = c.Get_size()
        said = []
        for call in (
            lambda: c.Alltoall(np.zeros(2 * n, "i4"), np.zeros(3 * n, "i4")),
            lambda: c.Allgather(np.zeros(3, "i4"), np.zeros(2 * n, "i4")),
            lambda: c.Allreduce(np.zeros(4), np.zeros(3)),
            lambda: c.Reduce_scatter_block(np.zeros(2 * n + 1), np.zeros(2)),
        ):
            try:
                call()
            except ValueError as exc:
                said.append(str(exc))
        c.Allreduce(np.ones(2), np.zeros(2))  # nothing moved: the ranks are still in step
        return said

    said = ranks(3, body)
    assert said[0] == said[2]
    assert said[0] == [
        "Alltoall: each block of sendbuf is 2 INT (8 bytes) but each block of recvbuf is 3 INT "
        "(12 bytes); they must hold the same bytes (MPI_ERR_TRUNCATE where the receive is "
        "shorter)",
        "Allgather: sendbuf is 3 INT (12 bytes) but each block of recvbuf is 2 INT (8 bytes); "
        "they must hold the same bytes (MPI_ERR_TRUNCATE where the receive is shorter)",
        "Allreduce: sendbuf is 4 DOUBLE (32 bytes) but recvbuf is 3 DOUBLE (24 bytes); they "
        "must hold the same bytes (MPI_ERR_TRUNCATE where the receive is shorter)",
        "Reduce_scatter_block: sendbuf: 7 elements of DOUBLE do not split into 3 blocks",
    ]


@pytest.mark.parametrize("how", ["Wait", "Waitany", "Waitall", "Test", "Testany"])
def test_an_irecv_of_another_size_says_so_in_elements_however_it_is_waited_on(how: str) -> None:
    """An Irecv's message of another size was reported in bytes of the uint8 view ("sent 80
    bytes but rank 1 expected 32 bytes; ... 32 elements of uint8"), and Waitany returned its
    index with no error at all, the buffer untouched and the status empty."""

    def body(comm: MPI.Comm) -> Any:
        if comm.rank == 0:  # its sends may see the mismatch too, where the Irecv came first
            for n, tag in ((10, 3), (2, 4)):
                with contextlib.suppress(plait.MismatchError):
                    comm.Send(np.arange(float(n)), dest=1, tag=tag)
            return None
        said = []
        for tag in (3, 4):
            req = comm.Irecv(np.zeros(4), source=0, tag=tag)
            with pytest.raises(plait.MismatchError) as info:
                _finish_one(req, how)
            said.append(str(info.value))
        return said

    longer, shorter = ranks(2, body)[1]
    assert longer.startswith("rank 1: Irecv from rank 0 (tag 3): message truncated")
    assert "the message holds 10 DOUBLE (80 bytes), but the buffer holds 4 DOUBLE" in longer
    assert "the message holds 2 DOUBLE (16 bytes), but the buffer holds 4 DOUBLE" in shorter
    assert "exactly its buffer's size" in shorter
    assert "uint8" not in longer + shorter


def _finish_one(req: MPI.Request, how: str) -> None:
    """Wait on ``req`` (or test it until it is done) the way ``how`` names."""
    if how == "Wait":
        req.Wait()
    elif how == "Waitany":
        MPI.Request.Waitany([req])
    elif how == "Waitall":
        MPI.Request.Waitall([req])
    elif how == "Test":
        while not req.Test():
            pass
    else:
        while not MPI.Request.Testany([req])[1]:
            pass


def test_ranks_whose_bcast_sizes_differ_are_told_their_own_in_elements() -> None:
    """A Bcast whose buffers differ in size from rank to rank said only "this rank called
    broadcast(count=12, dtype=uint8, ...)": bytes of the view, under plait's name."""

    def body(comm: MPI.Comm) -> Any:
        with pytest.raises(plait.MismatchError) as info:
            comm.Bcast(np.zeros(5 if comm.rank == 0 else 3, np.float32), root=0)
        return str(info.value)

    said = ranks(2, body)
    assert "this rank's Bcast buf holds 5 FLOAT (20 bytes)" in said[0]
    assert "this rank's Bcast buf holds 3 FLOAT (12 bytes)" in said[1]


def test_a_request_once_waited_is_spent_as_mpis_request_null() -> None:
    """Waitany, Testany and waitall handed out again a request that Wait or wait had
    completed (mpi4py's is then REQUEST_NULL): a Waitany loop saw one completion twice."""

    def body(c: MPI.Comm) -> Any:
        if c.Get_rank() == 1:
            for tag in (1, 2):
                c.Send(np.array([float(tag)]), 0, tag)
            c.send("v", 0, tag=3)
            return None
        reqs = [c.Irecv(np.zeros(1), 1, 1), c.Irecv(np.zeros(1), 1, 2)]
        reqs[0].Wait()
        anys = [MPI.Request.Waitany(reqs), MPI.Request.Waitany(reqs)]
        q = c.irecv(source=1, tag=3)
        first = q.wait()
        st = MPI.Status()
        again = q.wait(st)
        spent = (MPI.Request.waitall([q]), MPI.Request.Testany([q]), q.test())
        return anys, first, again, st.Get_source(), *spent

    anys, first, again, source, all_, testany, test = ranks(2, body)[0]
    assert anys == [1, MPI.UNDEFINED]
    assert (first, again, source) == ("v", None, MPI.ANY_SOURCE)
    assert all_ == [None]
    assert testany == (MPI.UNDEFINED, True)
    assert test == (True, None)


def test_a_freed_request_is_null_and_request_of_a_request_is_a_second_handle() -> None:
    """Free left the request true and unequal to REQUEST_NULL, and MPI.Request(r) wrapped r
    in a request whose wait raised Unsupported; mpi4py's Free makes the handle null, and
    Request(r) is another handle to r's request (equal to it, and waiting on it)."""

    def body(c: MPI.Comm) -> Any:
        r = c.Isend(np.ones(2), c.Get_rank(), 5)
        c.Recv(np.zeros(2), c.Get_rank(), 5)
        r.Free()
        freed = (bool(r), r == MPI.REQUEST_NULL)
        b = np.zeros(2)
        q = c.Irecv(b, c.Get_rank(), 6)
        q2 = MPI.Request(q)
        same = (q2 == q, bool(q2))
        c.Send(np.full(2, 3.0), c.Get_rank(), 6)
        st = MPI.Status()
        q2.Wait(st)
        null = MPI.Request(MPI.REQUEST_NULL) == MPI.REQUEST_NULL
        return freed, same, (st.Get_tag(), b.tolist(), bool(q2)), null

    for got in ranks(2, body):
        assert got == ((False, True), (True, True), (6, [3.0, 3.0], False), True)


def test_a_recv_that_timed_out_leaves_a_later_message_to_the_next_recv() -> None:
    """The receive a timed-out recv had queued stayed queued, and took the message that
    came later: the next recv timed out too, and the message was lost."""
    first_gave_up = threading.Event()

    def body(c: plait.Communicator) -> Any:
        comm = MPI.Comm(c, "test")
        if comm.Get_rank() == 0:
            first_gave_up.wait(20)
            comm.send("hello", 1, tag=1)
            return None
        with pytest.raises(plait.CommTimeout):
            comm.recv(source=0, tag=1)
        first_gave_up.set()
        return comm.recv(source=0, tag=1)

    assert run_ranks(2, body, timeout=1.0)[1] == "hello"


def test_bad_sources_tags_colors_and_frees_are_refused_at_the_call() -> None:
    """An irecv of a rank or tag that does not exist was queued (its error came at wait, or
    never); Split of a negative color joined no group; Free of COMM_WORLD freed it."""

    def body(c: MPI.Comm) -> list[str]:
        said = []
        for call in (
            lambda: c.irecv(source=c.Get_size(), tag=0),
            lambda: c.irecv(source=0, tag=-7),
            lambda: c.recv(source=-5),
            lambda: c.Split(-5, 0),
        ):
            with pytest.raises(ValueError, match=r"invalid|out of range") as info:
                call()
            said.append(str(info.value))
        return said

    said = ranks(2, body)[0]
    assert "irecv: source=2 is invalid" in said[0]
    assert "irecv: tag -7 out of range" in said[1]
    assert "recv: source=-5 is invalid" in said[2]
    assert "Split: color=-5 is invalid (MPI_ERR_ARG)" in said[3]
    for comm in (MPI.COMM_WORLD, MPI.COMM_SELF, MPI.COMM_NULL):
        with pytest.raises(ValueError, match="cannot be freed"):
            comm.Free()


def test_split_reads_color_and_key_as_mpi4py_reads_a_c_int() -> None:
    """A float color was refused (mpi4py truncates it, as C does) and a color of 2**40 was
    accepted (mpi4py raises OverflowError: an MPI color is a C int)."""

    def body(c: MPI.Comm) -> list[Any]:
        said: list[Any] = [
            c.Split(1.5, 0.9).Get_size(),
            c.Split(np.float32(c.Get_rank()), 0).Get_size(),
        ]
        for color, key in (
            (1 << 40, 0),
            (0, -(1 << 31) - 1),
            ("1", 0),
            (None, 0),
            (float("nan"), 0),
        ):
            try:
                c.Split(color, key)
                said.append("ok")
            except (TypeError, OverflowError, ValueError) as exc:
                said.append(f"{type(exc).__name__}: {exc}")
        return said

    assert ranks(2, body)[0] == [
        2,
        1,
        "OverflowError: value too large to convert to int",
        "OverflowError: value too large to convert to int",
        "TypeError: an integer is required",
        "TypeError: an integer is required",
        "ValueError: cannot convert float NaN to integer",
    ]
