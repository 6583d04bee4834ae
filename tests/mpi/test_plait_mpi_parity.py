"""plait.mpi where it differed from mpi4py: counts read per block, receives from threads,
empty request lists, counts past a buffer's end, errors in MPI's terms, None as IN_PLACE,
Free, Status copies, Abort and timeouts, numpy scalars as buffers, datatypes of two names,
the maps of type codes, a second handle to a freed communicator. Each case was reproduced
against real mpi4py."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import plait
from plait import mpi as MPI
from plait.mpi._datatypes import DATATYPES, message
from plait.testing import run_ranks


def ranks(size: int, fn: Callable[[MPI.Comm], Any], timeout: float = 20) -> list[Any]:
    """``fn`` on ``size`` threads, each with an mpi4py communicator over plait's."""
    return run_ranks(size, lambda c: fn(MPI.Comm(c, "test")), timeout=timeout)


# -- 1: Reduce_scatter_block reads the send count per block ------------------------------
def test_reduce_scatter_block_reads_an_explicit_send_count_per_block() -> None:
    """[sb, 2, MPI.DOUBLE] at n=2 was read as 2 elements in all (ValueError), and
    [sb, 4, ...] was accepted, which mpi4py refuses."""

    def body(c: MPI.Comm) -> Any:
        n, r = c.Get_size(), c.Get_rank()
        sb = np.arange(2 * n, dtype="d") + r
        rb = np.zeros(2)
        c.Reduce_scatter_block([sb, 2, MPI.DOUBLE], [rb, 2, MPI.DOUBLE], op=MPI.SUM)
        with pytest.raises(ValueError, match="sendbuf: the specification reaches element 8"):
            c.Reduce_scatter_block([sb, 2 * n, MPI.DOUBLE], [rb, 2, MPI.DOUBLE], op=MPI.SUM)
        return rb.tolist()

    assert ranks(2, body) == [[1.0, 3.0], [5.0, 7.0]]


# -- 2: threads receiving ----------------------------------------------------------------
def test_threads_receiving_with_one_pattern_each_get_whole_messages() -> None:
    """Two threads' Recv probed the same message, then each received another (MismatchError,
    and a message consumed): most runs lost messages."""
    count = 200

    def body(c: MPI.Comm) -> Any:
        if c.Get_rank() == 0:
            for k in range(count):
                c.Send(np.full(1 if k % 2 == 0 else 51, k, "i"), 1, 1)
            return None
        got: list[int] = []
        errors: list[BaseException] = []

        def receive(call: str) -> None:
            try:
                for _ in range(count // 2):
                    st = MPI.Status()
                    buf = np.zeros(100, "i")
                    if call == "Recv":
                        c.Recv(buf, MPI.ANY_SOURCE, 1, st)
                    else:
                        c.Sendrecv(buf[:0], MPI.PROC_NULL, 0, buf, MPI.ANY_SOURCE, 1, st)
                    n = st.Get_count(MPI.INT)
                    assert n == (1 if buf[0] % 2 == 0 else 51)
                    assert (buf[:n] == buf[0]).all()
                    got.append(int(buf[0]))
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=receive, args=(k,)) for k in ("Recv", "Sendrecv")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return sorted(got)

    for _ in range(3):  # the race lost messages in most runs, not every one
        assert ranks(2, body)[1] == list(range(count))


def test_a_thread_waiting_on_one_tag_holds_up_no_other_thread() -> None:
    """No lock is held while a Recv waits: a thread's Recv of a later tag does not keep
    another thread's Recv of an earlier message waiting."""

    def body(c: MPI.Comm) -> Any:
        if c.Get_rank() == 0:
            c.Send(np.array([1], "i"), 1, 1)
            c.recv(source=1, tag=9)  # rank 1 got tag 1 while its other thread waited on 2
            c.Send(np.array([2], "i"), 1, 2)
            return None
        late = np.zeros(1, "i")
        waiting = threading.Thread(target=c.Recv, args=(late, 0, 2))
        waiting.start()
        early = np.zeros(1, "i")
        c.Recv(early, 0, 1)
        c.send("got it", 0, tag=9)
        waiting.join()
        return int(early[0]), int(late[0])

    assert ranks(2, body)[1] == (1, 2)


# -- 3: empty request lists --------------------------------------------------------------
def test_waits_and_tests_of_no_requests_are_done_as_in_mpi4py() -> None:
    """Waitany([]) raised ValueError and Testany([]) gave (UNDEFINED, False), so a
    ``while not Testany(reqs)[1]`` loop never ended."""
    R = MPI.Request
    assert R.Waitany([]) == MPI.UNDEFINED
    assert R.Testany([]) == (MPI.UNDEFINED, True)
    assert R.waitany([]) == (MPI.UNDEFINED, None)
    assert R.testany([]) == (MPI.UNDEFINED, True, None)
    assert (R.Waitall([]), R.Testall([]), R.waitall([]), R.testall([])) == (
        True,
        True,
        [],
        (True, []),
    )


# -- 4: explicit counts past a buffer's end ----------------------------------------------
def test_a_count_too_long_for_all_its_blocks_is_refused_naming_the_buffer() -> None:
    """numpy's reshape error ("cannot reshape array of size 16 into shape (3,8)"), or
    plait's "out has shape (16,); expected (12,)" (bytes, the wrong buffer), came instead."""

    def body(c: MPI.Comm) -> list[str]:
        r, n = c.Get_rank(), c.Get_size()
        said = []
        rb = np.full(4, -1, "i")
        for call in (
            lambda: c.Allgather(np.array([r, r], "i"), [rb, 2, MPI.INT]),
            lambda: c.Alltoall([np.zeros(n, "i"), 2, MPI.INT], np.zeros(2 * n, "i")),
            lambda: c.Reduce_scatter_block(MPI.IN_PLACE, [np.zeros(2), 2, MPI.DOUBLE]),
            lambda: c.Reduce_scatter_block([np.zeros(2 * n), 3, MPI.DOUBLE], np.zeros(3)),
        ):
            with pytest.raises(ValueError, match="the specification reaches") as info:
                call()
            said.append(str(info.value))
        if r == 0:  # root alone reads these buffers: the others do not call
            for call in (
                lambda: c.Gather(np.array([r, r], "i"), [rb, 2, MPI.INT]),
                lambda: c.Scatter([np.zeros(2 * n - 1), 2, MPI.DOUBLE], np.zeros(2)),
            ):
                with pytest.raises(ValueError, match="the specification reaches") as info:
                    call()
                said.append(str(info.value))
        c.Allgather(np.array([r], "i"), rb[:n])  # nothing moved: the ranks are in step
        assert rb[:n].tolist() == list(range(n))
        return said

    said = ranks(3, body)[0]
    assert said == [
        "Allgather: recvbuf: the specification reaches element 6 of INT (3 blocks of 2) but "
        "the buffer holds 4",
        "Alltoall: sendbuf: the specification reaches element 6 of INT (3 blocks of 2) but "
        "the buffer holds 3",
        "Reduce_scatter_block: recvbuf: the specification reaches element 6 of DOUBLE (3 "
        "blocks of 2) but the buffer holds 2",
        "Reduce_scatter_block: sendbuf: the specification reaches element 9 of DOUBLE (3 "
        "blocks of 3) but the buffer holds 6",
        "Gather: recvbuf: the specification reaches element 6 of INT (3 blocks of 2) but the "
        "buffer holds 4",
        "Scatter: sendbuf: the specification reaches element 6 of DOUBLE (3 blocks of 2) but "
        "the buffer holds 5",
    ]
    with pytest.raises(ValueError, match=r"element 7 of INT \(3 blocks of 2 from element 1\)"):
        message([np.zeros(6, "i"), 2, 1, MPI.INT], "Scatter", blocks=3)


# -- 5: errors in MPI's terms ------------------------------------------------------------
def test_a_scatterv_recvbuf_of_another_size_is_said_in_elements() -> None:
    """Off root it said "rank 1: scatterv: out has shape (4,); expected (8,): the counts the
    ranks exchanged give this rank 8 row(s)": bytes of the view, under plait's names."""

    def body(c: MPI.Comm) -> Any:
        r = c.Get_rank()
        send = [np.arange(4, dtype="i"), [2, 2], MPI.INT] if r == 0 else None
        odd = [np.arange(6, dtype=np.uint8), [3, 3], MPI.BYTE] if r == 0 else None
        said = []
        for spec, size in ((send, 1), (send, 3), (odd, 1)):
            rb = np.full(size, -1, "i")
            if r == 0:
                c.Scatterv(
                    spec, np.zeros(2 if spec is send else 3, np.uint8 if spec is odd else "i")
                )
                continue
            with pytest.raises(ValueError, match="recvbuf was not written") as info:
                c.Scatterv(spec, rb)
            assert (rb == -1).all()  # not written
            said.append(str(info.value))
        rb = np.zeros(2, "i")
        c.Scatterv(send, rb)  # the communicator is still usable
        return said, rb.tolist()

    got = ranks(2, body)
    assert got[0] == ([], [0, 1])
    shorter, longer, odd = got[1][0]
    assert got[1][1] == [2, 3]
    assert shorter == (
        "rank 1: Scatterv: message truncated (MPI_ERR_TRUNCATE): root sends this rank 2 INT "
        "(8 bytes), but recvbuf holds 1 INT (4 bytes); recvbuf was not written, and the other "
        "ranks have their data"
    )
    assert "root sends this rank 2 INT (8 bytes), but recvbuf holds 3 INT (12 bytes)" in longer
    assert "MPI_ERR_TRUNCATE" not in longer
    assert "root sends this rank 3 bytes (3 bytes), but recvbuf holds 1 INT" in odd


def test_alltoallv_recvcounts_that_disagree_are_said_in_elements() -> None:
    """It said "recv_counts [4, 8], sent [4, 4]" for counts of 1 and 2 INTs: bytes."""

    def body(c: MPI.Comm) -> Any:
        r = c.Get_rank()
        rc = [1, 2] if r == 0 else [1, 1]
        with pytest.raises(ValueError, match="recvcounts disagree") as info:
            c.Alltoallv([np.zeros(2, "i"), [1, 1], MPI.INT], [np.zeros(3, "i"), rc, MPI.INT])
        rb = np.zeros(2, "i")
        c.Alltoallv([np.full(2, r, "i"), [1, 1], MPI.INT], [rb, [1, 1], MPI.INT])
        return str(info.value), rb.tolist()

    got = ranks(2, body)
    for r, (said, rb) in enumerate(got):
        assert rb == [0, 1]
        assert said.startswith(f"rank {r}: Alltoallv: recvcounts disagree")
        assert "rank 0's recvcounts are [1, 2] INT, but the ranks send it [1, 1] INT" in said
        assert "recv_counts" not in said


# -- 6: None ---------------------------------------------------------------------------
def test_none_is_in_place_where_mpi4py_reads_it_so() -> None:
    """mpi4py reads a bare None as MPI.IN_PLACE where a call takes IN_PLACE, so a rank of
    count 0 passes None; plait said "Gatherv: a NoneType is not a buffer"."""

    def body(c: MPI.Comm) -> Any:
        r = c.Get_rank()
        counts = [0, 1]
        g = np.full(1, -1, "i")
        c.Gatherv(None if r == 0 else np.array([r], "i"), [g, counts, MPI.INT] if r == 0 else None)
        a = np.full(1, -1, "i")
        c.Allgatherv(None if r == 0 else np.array([r], "i"), [a, counts, MPI.INT])
        s = np.full(1, -1, "i")
        c.Scatterv([np.array([5], "i"), counts, MPI.INT] if r == 0 else None, None if r == 0 else s)
        kept = np.array([10 + r, 10 + r], "i")
        c.Allgatherv(None, [kept, [1, 1], MPI.INT])  # None: each rank's block is in place
        total = np.array([r + 1.0])
        c.Allreduce(None, total)
        st = MPI.Status()
        c.Send(None, MPI.PROC_NULL)  # no process: mpi4py does not read the buffer
        c.Recv(None, MPI.PROC_NULL, status=st)
        assert (st.Get_source(), st.Get_count()) == (MPI.PROC_NULL, 0)
        empty = [None, 0, MPI.INT]  # mpi4py's empty message, on any rank
        e = np.full(1, -1, "i")
        c.Gatherv(empty if r == 0 else np.array([7], "i"), [e, counts, MPI.INT] if r == 0 else None)
        return g.tolist(), a.tolist(), s.tolist(), kept.tolist(), total.tolist(), e.tolist()

    got = ranks(2, body)
    assert got[0] == ([1], [1], [-1], [10, 11], [3.0], [7])
    assert got[1] == ([-1], [1], [5], [10, 11], [3.0], [-1])
    with pytest.raises(ValueError, match="the buffer is None, but the specification counts 1"):
        message([None, 1, MPI.INT], "Gatherv", what="sendbuf")
    with pytest.raises(TypeError, match=r"mpi4py reads a bare None as MPI\.IN_PLACE"):
        message(None, "Gatherv", what="sendbuf")


# -- 7: Free, Status, Abort, timeouts ----------------------------------------------------
def test_a_second_free_is_refused_as_freeing_comm_null() -> None:
    def body(c: MPI.Comm) -> str:
        d = c.Dup()
        d.Free()
        with pytest.raises(ValueError, match="MPI_COMM_NULL cannot be freed") as info:
            d.Free()
        return str(info.value)

    assert "freed already" in ranks(2, body)[0]


def test_status_copies_a_status() -> None:
    st = MPI.Status()
    st.Set_source(3)
    st.Set_tag(4)
    st.nbytes = 8
    copy = MPI.Status(st)
    assert copy is not st
    assert (copy.Get_source(), copy.Get_tag(), copy.Get_count(MPI.INT)) == (3, 4, 2)
    st.Set_tag(5)
    assert copy.Get_tag() == 4
    with pytest.raises(TypeError, match="a Status to copy"):
        MPI.Status(3)  # type: ignore[arg-type]


def _abort(script: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PLAIT_", "OMPI_", "PMIX", "SLURM_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    return subprocess.run(
        [sys.executable, "-c", "from plait import mpi as MPI\n" + script],
        capture_output=True,
        text=True,
        timeout=60,
        env={**clean, **env},
    )


@pytest.mark.multiprocess
def test_abort_before_the_world_is_joined_names_this_ranks_rank() -> None:
    """Abort as the first call printed "rank 0" on every rank."""
    res = _abort("MPI.COMM_WORLD.Abort(3)", PLAIT_RANK="2", PLAIT_SIZE="3")
    assert res.returncode == 3
    assert (
        "MPI_ABORT was invoked on rank 2 in communicator MPI_COMM_WORLD with errorcode 3"
        in res.stderr
    )


@pytest.mark.multiprocess
def test_abort_on_a_split_communicator_says_where_it_came_from() -> None:
    """It printed "in communicator a communicator with errorcode 5", then "MPI COMMUNICATOR
    SPLIT FROM MPI_COMM_WORLD"; Open MPI numbers a split as a Dup (Note [communicator
    numbers] in plait.mpi._comm)."""
    res = _abort("MPI.COMM_WORLD.Split(0, 0).Split(0, 0).Abort(5)")
    assert res.returncode == 5
    assert (
        "MPI_ABORT was invoked on rank 0 in communicator MPI COMMUNICATOR 4 SPLIT FROM 3 "
        "with errorcode 5" in res.stderr
    )


def test_a_receive_that_times_out_names_the_call_made() -> None:
    """Recv, recv and irecv().wait() that timed out said "probe from rank 0 (tag 5) found no
    message within 1 s": plait.mpi's own probe, not the user's call."""
    done = threading.Event()

    def body(c: plait.Communicator) -> Any:
        comm = MPI.Comm(c, "test")
        if comm.Get_rank() == 0:
            done.wait(20)
            return None
        said = []
        req = comm.irecv(source=0, tag=5)
        for call in (
            lambda: comm.Recv(np.zeros(1), 0, 5),
            lambda: comm.Sendrecv(np.zeros(1), MPI.PROC_NULL, 0, np.zeros(1), 0, 5),
            lambda: comm.recv(source=0, tag=5),
            req.wait,
        ):
            with pytest.raises(plait.CommTimeout) as info:
                call()
            said.append(str(info.value))
        req.Cancel()
        done.set()
        return said

    said = run_ranks(2, body, timeout=1.0)[1]
    for call, text in zip(("Recv", "Sendrecv", "recv", "irecv"), said, strict=True):
        assert text.startswith(f"rank 1: {call} from rank 0 (tag 5) found no message within 1 s")


# -- MPI.Exception: what mpi4py raises with MPI's error class ---------------------------
def test_bad_ranks_tags_roots_and_truncation_raise_mpi_exception_with_its_class() -> None:
    """``except MPI.Exception`` raised AttributeError (plait.mpi had no such name) while the
    error it meant to catch was on its way; mpi4py raises these as MPI.Exception."""

    def body(comm: MPI.Comm) -> list[tuple[int, bool]]:
        got = []
        calls: list[Callable[[], Any]] = [
            lambda: comm.Send(np.zeros(2), dest=5),
            lambda: comm.send(1, dest=-7),
            lambda: comm.recv(source=9),
            lambda: comm.Send(np.zeros(2), dest=0, tag=-5),
            lambda: comm.Recv(np.zeros(2), source=0, tag=-7),
            lambda: comm.Bcast(np.zeros(2), root=7),
            lambda: comm.reduce(1, root=9),
            lambda: comm.Split(-5),
        ]
        for call in calls:
            try:
                call()
            except MPI.Exception as exc:
                got.append((exc.Get_error_class(), isinstance(exc, ValueError)))
        req = comm.Isend(np.zeros(4), dest=comm.rank, tag=3)
        try:
            comm.Recv(np.zeros(2), source=comm.rank, tag=3)
        except MPI.Exception as exc:
            got.append((exc.error_class, "MPI_ERR_TRUNCATE" in str(exc)))
        comm.Recv(np.zeros(4), source=comm.rank, tag=3)  # the message stayed
        req.Wait()
        return got

    want = [(MPI.ERR_RANK, True)] * 3 + [(MPI.ERR_TAG, True)] * 2 + [(MPI.ERR_ROOT, True)] * 2
    want += [(MPI.ERR_ARG, True), (MPI.ERR_TRUNCATE, True)]
    assert ranks(2, body) == [want, want]
    null = MPI.COMM_NULL
    with pytest.raises(MPI.Exception) as info:
        null.Get_rank()
    assert info.value.Get_error_class() == MPI.ERR_COMM


def test_mpi_exception_is_mpi4pys() -> None:
    e = MPI.Exception(MPI.ERR_RANK)
    assert isinstance(e, RuntimeError)
    assert (repr(e), str(e), int(e), e == MPI.ERR_RANK, bool(e)) == (
        "MPI.Exception(6)",
        "MPI_ERR_RANK: invalid rank",
        6,
        True,
        True,
    )
    assert (e.Get_error_code(), e.Get_error_class(), e.error_string) == (6, 6, str(e))
    assert not MPI.Exception(MPI.SUCCESS)
    assert MPI.Get_error_string(MPI.ERR_TAG) == "MPI_ERR_TAG: invalid tag"
    assert MPI.Get_error_class(MPI.ERR_TRUNCATE) == MPI.ERR_TRUNCATE


# -- 8: numpy scalars as buffers ---------------------------------------------------------
class _CopyEachTime:
    """An array-like whose ``__array__`` gives a new copy each time."""

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return np.zeros(2)


def test_a_numpy_scalar_a_call_writes_into_raises_buffer_error_before_anything_moves() -> None:
    """A numpy scalar as a receive buffer was copied into an array, the call received into
    the copy and returned: the result was lost (a Recv's message with it). mpi4py raises
    BufferError ("scalar buffer is readonly") on the rank that passed it, before anything
    moves, and reads a scalar as a send buffer."""
    scalar = "scalar buffer is readonly"

    def body(c: MPI.Comm) -> Any:
        r = c.Get_rank()
        said: list[Any] = []
        for call in (
            lambda: c.Allreduce(np.float64(r + 1.0), np.float64(0.0), op=MPI.SUM),
            lambda: c.Allreduce(MPI.IN_PLACE, np.float64(0.0)),
            lambda: c.Allreduce(np.float64(1.0), [np.float64(0.0), MPI.DOUBLE]),
            lambda: c.Allgather(np.float64(1.0), np.float64(0.0)),
            lambda: c.Alltoall(np.zeros(2), np.float64(0.0)),
            lambda: c.Reduce_scatter_block(np.zeros(2), np.float64(0.0)),
            lambda: c.Allgatherv(np.float64(1.0), [np.float64(0.0), [1, 1], MPI.DOUBLE]),
            lambda: c.Sendrecv(np.float64(1.0), r, 0, np.float64(0.0), r, 0),
            lambda: c.Irecv(np.float64(0.0), r, 0),
        ):
            with pytest.raises(BufferError, match=scalar) as info:
                call()
            assert isinstance(info.value, ValueError)
            said.append(str(info.value).split(":")[0])
        c.Barrier()
        said.append(c.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG))  # nothing was sent
        # A receive that raised left its message for the next; a root's call, the retry.
        got = []
        if r == 0:
            c.Send(np.float64(5.0), dest=1)  # a scalar is read as a send buffer
            c.Bcast(np.array([7.0]), root=0)
            out = np.float64(0.0)
            with pytest.raises(BufferError, match=scalar):
                c.Reduce(np.float64(1.0), out, root=0)
            total = np.zeros(1)
            c.Reduce(np.float64(1.0), total, root=0)
            c.Scatter(np.array([1.0, 2.0]), np.zeros(1), root=0)
            got.append(total.tolist())
        else:
            with pytest.raises(BufferError, match=scalar):
                c.Recv(np.float64(0.0), source=0)
            x = np.zeros(1)
            c.Recv(x, source=0)
            with pytest.raises(BufferError, match=scalar):
                c.Bcast(np.float64(0.0), root=0)
            b = np.zeros(1)
            c.Bcast(b, root=0)
            got += [x.tolist(), b.tolist()]
            c.Reduce(np.float64(2.0), np.float64(0.0), root=0)  # off root: not read
            with pytest.raises(BufferError, match=scalar):
                c.Scatter(None, np.float64(0.0), root=0)
            x = np.zeros(1)
            c.Scatter(None, x, root=0)
            got.append(x.tolist())
        y = np.zeros(1)
        c.Allreduce(np.float64(r + 1.0), y, op=MPI.SUM)
        return said, got, y.tolist()

    calls = ["Allreduce"] * 3 + ["Allgather", "Alltoall", "Reduce_scatter_block"]
    calls += ["Allgatherv", "Sendrecv", "Irecv"]
    assert ranks(2, body) == [
        ([*calls, False], [[3.0]], [3.0]),
        ([*calls, False], [[5.0], [7.0], [2.0]], [3.0]),
    ]
    with pytest.raises(BufferError, match=f"Bcast: buf: {scalar}"):
        message(np.float64(0.0), "Bcast", what="buf", writes=True)
    assert message(np.float64(2.5), "Bcast", what="buf").typed().tolist() == [2.5]
    with pytest.raises(BufferError, match="gives a new copy of its data each time"):
        message(_CopyEachTime(), "Recv", what="buf", writes=True)
    assert message(_CopyEachTime(), "Send", what="buf").count == 2
    assert message(np.array(0.0), "Recv", what="buf", writes=True).count == 1  # 0-d: memory


# -- 9: datatypes of two names, and mpi4py's maps of type codes -------------------------
#: The names that are one handle in mpi4py 4.1 on Open MPI, among the datatypes plait.mpi has
#: (every pair of MPI's Datatype attributes compared with ==).
ONE_TYPE = [
    ("BOOL", "C_BOOL"),
    ("C_COMPLEX", "C_FLOAT_COMPLEX"),
    ("INT", "SIGNED_INT"),
    ("INT_INT", "TWOINT"),
    ("LONG", "SIGNED_LONG"),
    ("LONG_LONG", "SIGNED_LONG_LONG"),
    ("SHORT", "SIGNED_SHORT"),
    ("UNSIGNED", "UNSIGNED_INT"),
]


def test_two_names_of_one_type_are_equal_exactly_where_mpi4pys_are() -> None:
    """MPI.BOOL == MPI.C_BOOL, MPI.UNSIGNED_INT == MPI.UNSIGNED and MPI.C_FLOAT_COMPLEX ==
    MPI.C_COMPLEX were False (TWOINT == INT_INT alone was True); in mpi4py on Open MPI each
    pair is one handle. Names of one size and kind that are two handles stay unequal."""
    names = sorted(DATATYPES)
    equal = [
        (a, b)
        for i, a in enumerate(names)
        for b in names[i + 1 :]
        if getattr(MPI, a) == getattr(MPI, b)
    ]
    assert equal == ONE_TYPE
    for a, b in ONE_TYPE:
        assert getattr(MPI, a) is getattr(MPI, b)
        assert getattr(MPI, a).Get_name() == getattr(MPI, b).Get_name()
    for x, y in ((MPI.INT, MPI.INT32_T), (MPI.CHAR, MPI.SIGNED_CHAR), (MPI.COMPLEX, MPI.C_COMPLEX)):
        assert x != y  # one size and kind, two handles in mpi4py
    assert MPI.UNSIGNED_INT.Get_name() == "MPI_UNSIGNED"


#: mpi4py 4.1's MPI._typedict on Open MPI, by name, for the codes whose datatype plait.mpi
#: has: all but half precision's "e" and "f2" and wchar_t's "U", "U1", "w" and "1w".
TYPEDICT_C = {
    "?": "C_BOOL",
    "b": "SIGNED_CHAR",
    "h": "SHORT",
    "i": "INT",
    "l": "LONG",
    "q": "LONG_LONG",
    "B": "UNSIGNED_CHAR",
    "H": "UNSIGNED_SHORT",
    "I": "UNSIGNED",
    "L": "UNSIGNED_LONG",
    "Q": "UNSIGNED_LONG_LONG",
    "f": "FLOAT",
    "d": "DOUBLE",
    "g": "LONG_DOUBLE",
    "F": "C_COMPLEX",
    "D": "C_DOUBLE_COMPLEX",
    "G": "C_LONG_DOUBLE_COMPLEX",
    "b1": "C_BOOL",
    "i1": "INT8_T",
    "i2": "INT16_T",
    "i4": "INT32_T",
    "i8": "INT64_T",
    "u1": "UINT8_T",
    "u2": "UINT16_T",
    "u4": "UINT32_T",
    "u8": "UINT64_T",
    "f4": "FLOAT",
    "c8": "C_COMPLEX",
    "f8": "DOUBLE",
    "c16": "C_DOUBLE_COMPLEX",
    "f16": "LONG_DOUBLE",
    "c32": "C_LONG_DOUBLE_COMPLEX",
}
TYPEDICT = {
    **TYPEDICT_C,
    "Zf": "C_COMPLEX",
    "Zd": "C_DOUBLE_COMPLEX",
    "Zg": "C_LONG_DOUBLE_COMPLEX",
    "n": "COUNT",
    "N": "UNSIGNED_LONG",
    "p": "AINT",
    "P": "UNSIGNED_LONG",
    **dict.fromkeys(["c", "a", "S", "S1", "s", "1s"], "CHAR"),
    **dict.fromkeys(["u", "1u"], "UINT16_T"),
    **dict.fromkeys(["M", "M8", "m", "m8"], "INT64_T"),
}
#: Fortran's: all but LOGICAL's "l" and the sized ones ("i4": INTEGER4, ...).
TYPEDICT_F = {
    "i": "INTEGER",
    "r": "REAL",
    "s": "REAL",
    "d": "DOUBLE_PRECISION",
    "c": "COMPLEX",
    "z": "DOUBLE_COMPLEX",
}


def test_typedict_maps_type_codes_as_mpi4pys() -> None:
    """MPI._typedict[a.dtype.char], an idiom of mpi4py scripts, raised AttributeError."""
    for got, want in (
        (MPI._typedict, TYPEDICT),
        (MPI._typedict_c, TYPEDICT_C),
        (MPI._typedict_f, TYPEDICT_F),
    ):
        assert got == {code: getattr(MPI, name) for code, name in want.items()}
    for dtype in ("f8", "i4", "c8", "?", "u2", "g"):
        a = np.zeros(2, dtype)
        assert message([a, MPI._typedict[a.dtype.char]], "t").count == 2
    # Other names beginning with "_" stay Python's AttributeError, not Unsupported.
    for name in ("_typedict_x", "_addressof"):
        with pytest.raises(AttributeError, match=f"has no attribute '{name}'") as info:
            getattr(MPI, name)
        assert not isinstance(info.value, MPI.Unsupported)


# -- 10: a second handle to a freed communicator ----------------------------------------
def test_freeing_a_second_handle_leaves_the_first_a_handle_to_a_freed_communicator() -> None:
    """a = comm.Dup(); h = MPI.Intracomm(a); h.Free() made a COMM_NULL too; mpi4py sets
    only the handle freed to COMM_NULL, and a, still true and unequal to COMM_NULL, is a
    handle to a freed communicator, whose use plait.mpi refuses as MPI_ERR_COMM."""

    def body(c: MPI.Comm) -> Any:
        a = c.Dup()
        h, b = MPI.Intracomm(a), MPI.Comm(a)
        said: list[Any] = [a == h, h.allreduce(1)]
        h.Free()
        said += [h == MPI.COMM_NULL, bool(h), a == MPI.COMM_NULL, bool(a), a == h, a == b]
        said.append(MPI.Intracomm(a) == a)
        for call in (a.Get_rank, lambda: b.allreduce(1), a.Free, h.Free):
            with pytest.raises(MPI.Exception) as info:
                call()
            assert isinstance(info.value, ValueError)
            said.append((info.value.Get_error_class(), str(info.value).split(" (")[0]))
        said += [bool(a), c.allreduce(1)]  # the refused Free changed nothing
        return said

    null = "Free: MPI_COMM_NULL cannot be freed"
    want: list[Any] = [True, 2, True, False, False, True, False, True, True]
    want += [(MPI.ERR_COMM, "plait.mpi: COMM_NULL")] * 2
    want += [(MPI.ERR_COMM, "Free: this communicator cannot be freed"), (MPI.ERR_COMM, null)]
    want += [True, 2]
    assert ranks(2, body) == [want, want]
