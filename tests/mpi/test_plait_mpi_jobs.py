"""plait.mpi in real jobs: small mpi4py scripts under ``plait run -n 2``, each rank's results
read back from a file, where plait.mpi differed from mpi4py. Each case was reproduced
against real mpi4py; the expected values are what mpi4py gives."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

#: What every script starts with: the communicator, and ``done(value)``, which writes this
#: rank's result to ``<out>/<rank>.json``.
PRELUDE = """\
import json, sys
import numpy as np
from plait import mpi as MPI
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
def done(value):
    with open(f"{sys.argv[1]}/{rank}.json", "w") as f:
        json.dump(value, f)
"""

#: mpi4py's constants (Open MPI's values), as the scripts see them.
MPI_ANY_SOURCE, MPI_ANY_TAG, MPI_PROC_NULL, MPI_UNDEFINED = -1, -1, -2, -32766
#: plait run, with a deadline for every call well under the tests' own.
PLAIT_RUN = [sys.executable, "-m", "plait", "run", "--timeout", "30"]


def _clean_env() -> dict[str, str]:
    """This environment without plait's settings (a job's own come from plait run)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PLAIT_")}


def job(tmp_path: Path, body: str, ranks: int = 2) -> list[Any]:
    """Run ``body`` (after :data:`PRELUDE`) on ``ranks`` ranks; each rank's ``done`` value."""
    script = tmp_path / "script.py"
    script.write_text(PRELUDE + textwrap.dedent(body))
    out = tmp_path / "out"
    out.mkdir()
    res = subprocess.run(
        [*PLAIT_RUN, "-n", str(ranks), str(script), str(out)],
        capture_output=True,
        text=True,
        timeout=100,
        stdin=subprocess.DEVNULL,
        env=_clean_env(),
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return [json.loads((out / f"{r}.json").read_text()) for r in range(ranks)]


# -- a message goes to the earliest posted receive that matches it -----------------------
def test_buffer_receives_and_probes_leave_queued_object_receives_their_messages(
    tmp_path: Path,
) -> None:
    """An object irecv is matched lazily, when waited on: a later Recv took its pickled bytes
    as doubles (and the irecv then failed to unpickle the array), a later Irecv of the same
    tag did the same inside Waitall, and iprobe saw the message the irecv was to take."""
    got = job(
        tmp_path,
        """
        if rank == 0:
            comm.send("obj", dest=1, tag=1)
            comm.Send(np.arange(4.0), dest=1, tag=1)
            comm.send({"meta": 1}, dest=1, tag=2)
            comm.Send(np.arange(3.0), dest=1, tag=2)
            comm.send("only", dest=1, tag=3)
            comm.send("any", dest=1, tag=4)
            comm.Send(np.arange(2.0), dest=1, tag=4)
            comm.Barrier()
            done(None)
        else:
            r = comm.irecv(source=0, tag=1)  # posted first: takes the first message
            b = np.zeros(4)
            st = MPI.Status()
            comm.Recv(b, source=0, tag=1, status=st)
            first = [b.tolist(), st.Get_count(MPI.DOUBLE), r.wait()]
            r_obj = comm.irecv(source=0, tag=2)
            data = np.zeros(3)
            r_buf = comm.Irecv(data, source=0, tag=2)
            second = [MPI.Request.waitall([r_obj, r_buf]), data.tolist()]
            r = comm.irecv(source=0, tag=3)
            comm.probe(source=0, tag=4)  # tag 3 came before it: it has arrived
            third = [comm.iprobe(source=0, tag=3), comm.Iprobe(source=0, tag=3), r.wait()]
            r = comm.irecv(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)  # wildcards overlap too
            st = MPI.Status()
            comm.Probe(source=0, tag=4, status=st)
            two = np.zeros(2)
            comm.Recv(two, source=MPI.ANY_SOURCE, tag=4)
            fourth = [st.Get_count(MPI.BYTE), r.wait(), two.tolist()]
            comm.Barrier()
            done([first, second, third, fourth])
        """,
    )
    first, second, third, fourth = got[1]
    assert first == [[0.0, 1.0, 2.0, 3.0], 4, "obj"]
    assert second == [[{"meta": 1}, None], [0.0, 1.0, 2.0]]
    assert third == [False, False, "only"]
    assert fourth == [16, "any", [0.0, 1.0]]


@pytest.mark.parametrize("kind", ["Irecv", "Recv", "iprobe"])
def test_a_thread_waiting_on_an_object_holds_up_no_other_threads_receive(
    tmp_path: Path, kind: str
) -> None:
    """Note [waiting without the inbox's lock]: a blocking object recv held the inbox's lock
    while it waited, so another thread's Irecv, Recv or iprobe of another tag waited for
    it; here the object is sent only once that other receive is done, and both timed out."""
    got = job(
        tmp_path,
        f"""
        import threading
        kind = {kind!r}
        if rank == 0:
            got = {{}}
            queued = threading.Event()
            def receive_object():
                req = comm.irecv(source=1, tag=1)  # queued, as the blocking recv's is
                queued.set()
                got["obj"] = req.wait()
            t = threading.Thread(target=receive_object)
            t.start()
            queued.wait(30)
            buf = np.zeros(4)
            if kind == "Irecv":
                comm.Irecv(buf, source=1, tag=2).Wait()
            elif kind == "Recv":
                comm.Recv(buf, source=1, tag=2)
            else:
                while not comm.iprobe(source=1, tag=2):
                    pass
                comm.Recv(buf, source=1, tag=2)
            comm.Send(buf, dest=1, tag=3)
            t.join()
            done([buf.tolist(), got["obj"]])
        else:
            comm.Send(np.arange(4.0), dest=0, tag=2)
            comm.Recv(np.zeros(4), source=0, tag=3)  # the object goes only after this
            comm.send("late object", dest=0, tag=1)
            done(None)
        """,
    )
    assert got[0] == [[0.0, 1.0, 2.0, 3.0], "late object"], got


def test_an_irecv_behind_a_queued_object_receive_takes_what_that_one_does_not_match(
    tmp_path: Path,
) -> None:
    """A wildcard Irecv posted after an object irecv took the object's message (the transport
    knew nothing of the queued irecv), and failed as a message of another size."""
    got = job(
        tmp_path,
        """
        def receive():
            q = comm.irecv(source=0, tag=5)
            b1, b2 = np.zeros(3), np.zeros(2)
            d = comm.Irecv(b1, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)
            e = comm.Irecv(b2, source=0, tag=7)  # behind d, which it overlaps
            comm.Barrier()
            st = MPI.Status()
            i = MPI.Request.Waitany([d], st)
            MPI.Request.Waitall([e])
            return [i, st.Get_tag(), b1.tolist(), b2.tolist(), q.wait()]

        if rank == 0:
            for object_first in (False, True):
                if object_first:
                    comm.send("five", dest=1, tag=5)
                comm.Send(np.arange(3.0), dest=1, tag=7)
                if not object_first:
                    comm.send("five", dest=1, tag=5)
                comm.Send(np.arange(2.0) + 10, dest=1, tag=7)
                comm.Barrier()
            done(None)
        else:
            done([receive(), receive()])
        """,
    )
    assert got[1] == [[0, 7, [0.0, 1.0, 2.0], [10.0, 11.0], "five"]] * 2


# -- requests ------------------------------------------------------------------------------
def test_a_get_status_loop_ends_once_the_message_comes(tmp_path: Path) -> None:
    """Get_status made no progress, so ``while not r.Get_status(): pass`` never ended: an
    Irecv's message was never taken in, nor an object irecv's."""
    got = job(
        tmp_path,
        """
        import time

        def poll(r, s=None):
            give_up = time.monotonic() + 20  # against a hang: the loop must end long before
            while not r.Get_status(s):
                if time.monotonic() > give_up:
                    return "never"
            return "done"

        if rank == 0:
            comm.Send(np.array([9.0]), 1, 9)
            comm.send("o10", 1, 10)
            done(None)
        else:
            b, s = np.zeros(1), MPI.Status()
            r = comm.Irecv(b, 0, 9)
            first = [poll(r, s), s.Get_source(), s.Get_tag(), s.Get_count(MPI.DOUBLE)]
            first.append(r.Get_status())  # still not spent: Wait gives it
            r.Wait(s)
            q = comm.irecv(source=0, tag=10)
            done([first, b.tolist(), s.Get_tag(), poll(q), q.wait()])
        """,
    )
    assert got[1] == [["done", 0, 9, 1, True], [9.0], 9, "done", "o10"]


def test_a_sends_status_says_no_message_as_mpi4pys_does(tmp_path: Path) -> None:
    """A wait or test of a send filled its status with the peer, the tag and the bytes sent,
    as if a message had come; mpi4py's says source PROC_NULL, tag ANY_TAG, count 0."""
    got = job(
        tmp_path,
        """
        peer = 1 - rank

        def said(st):
            return [st.Get_source(), st.Get_tag(), st.Get_count()]

        out = []
        for how in ("Wait", "wait", "Test", "Waitall", "Waitany", "testall"):
            sts = [MPI.Status(), MPI.Status()]
            reqs = [comm.Isend(np.full(2, 1.0), peer, 4), comm.Irecv(np.zeros(2), peer, 4)]
            if how == "Waitall":
                MPI.Request.Waitall(reqs, sts)
            elif how == "testall":
                while not MPI.Request.testall(reqs, sts)[0]:
                    pass
            else:
                reqs[1].Wait(sts[1])
                if how == "Waitany":
                    MPI.Request.Waitany(reqs[:1], sts[0])
                elif how == "Test":
                    while not reqs[0].Test(sts[0]):
                        pass
                else:
                    getattr(reqs[0], how)(sts[0])
            out.append(said(sts[0]) + said(sts[1]))
        st = MPI.Status()
        r = comm.isend("x", peer, 5)
        comm.recv(source=peer, tag=5)
        r.wait(st)
        out.append(said(st))
        done(out)
        """,
    )
    send = [MPI_PROC_NULL, MPI_ANY_TAG, 0]
    for rank, out in enumerate(got):
        assert out == [[*send, 1 - rank, 4, 16]] * 6 + [send], rank


def test_a_truncated_irecv_raises_mpi_exception_of_class_err_truncate(tmp_path: Path) -> None:
    """A message longer than an Irecv's buffer raised plait.MismatchError, which
    ``except MPI.Exception`` does not catch; Recv's raised MPI_ERR_TRUNCATE already."""
    got = job(
        tmp_path,
        """
        if rank == 0:
            comm.Send(np.arange(5.0), dest=1, tag=5)
            comm.Send(np.arange(5.0), dest=1, tag=6)
            done(None)
        else:
            said = []
            for tag in (5, 6):
                r = comm.Irecv(np.zeros(3), source=0, tag=tag)
                try:
                    if tag == 5:
                        r.Wait()
                    else:
                        while not r.Test():
                            pass
                except MPI.Exception as e:
                    said.append(e.Get_error_class())
            done(said)
        """,
    )
    assert got[1] == [15, 15]  # MPI.ERR_TRUNCATE


# -- object collectives --------------------------------------------------------------------
def test_bcast_gives_the_root_a_copy_as_every_other_rank_gets(tmp_path: Path) -> None:
    """bcast at root returned the root's own object: changing the result changed it."""
    got = job(
        tmp_path,
        """
        config = {"n": 1} if rank == 0 else None
        local = comm.bcast(config, root=0)
        local["n"] += 10
        a = np.zeros(3) if rank == 0 else None
        b = comm.bcast(a, root=0)
        b += 1
        done([config, None if a is None else a.tolist(), local, b.tolist()])
        """,
    )
    assert got[0] == [{"n": 1}, [0.0, 0.0, 0.0], {"n": 11}, [1.0, 1.0, 1.0]]
    assert got[1] == [None, None, {"n": 11}, [1.0, 1.0, 1.0]]


def test_waitany_and_testany_of_no_live_request_leave_an_empty_status(tmp_path: Path) -> None:
    """Waitany and Testany of an empty list, or of spent requests only, left the status as
    it was (here the last message's); MPI empties it."""
    got = job(
        tmp_path,
        """
        R = MPI.Request
        def seen(st):
            return [st.Get_source(), st.Get_tag(), st.Get_error(), st.Get_count(MPI.BYTE)]

        if rank == 0:
            comm.Send(np.array([1.0]), 1, 5)
            done(None)
        else:
            b = np.zeros(1)
            reqs = [comm.Irecv(b, 0, 5)]
            st = MPI.Status()
            said = [R.Waitany(reqs, st), seen(st)]
            said += [R.Waitany(reqs, st), seen(st)]
            comm.Sendrecv(np.zeros(1), 1, 7, b, 1, 7, st)
            said += [list(R.Testany(reqs, st)), seen(st)]
            comm.Sendrecv(np.zeros(1), 1, 7, b, 1, 7, st)
            said += [R.Waitany([], st), seen(st)]
            done(said)
        """,
    )
    empty = [MPI_ANY_SOURCE, MPI_ANY_TAG, 0, 0]
    assert got[1] == [
        0,
        [0, 5, 0, 8],
        MPI_UNDEFINED,
        empty,
        [MPI_UNDEFINED, True],
        empty,
        MPI_UNDEFINED,
        empty,
    ]


# -- communicators -------------------------------------------------------------------------
def test_a_dup_has_no_name_and_aborts_as_open_mpi_names_it(tmp_path: Path) -> None:
    """Dup named its communicator 'MPI_COMM_WORLD.dup' (mpi4py's Get_name is ''), and its
    Abort line said that name instead of Open MPI's "MPI COMMUNICATOR 3 DUP FROM 0"."""
    got = job(
        tmp_path,
        """
        d = comm.Dup()
        done([d.Get_name(), MPI.COMM_SELF.Dup().Get_name()])
        """,
    )
    assert got == [["", ""]] * 2
    script = tmp_path / "abort.py"
    script.write_text(PRELUDE + "comm.Dup().Dup().Abort(2)\n")
    res = subprocess.run(
        [*PLAIT_RUN, "-n", "1", str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=100,
        stdin=subprocess.DEVNULL,
        env=_clean_env(),
    )
    assert res.returncode == 2
    assert (
        "MPI_ABORT was invoked on rank 0 in communicator MPI COMMUNICATOR 4 DUP FROM 3 "
        "with errorcode 2" in res.stderr
    )


def test_ranks_tags_and_roots_are_read_as_mpi4py_reads_a_c_int(tmp_path: Path) -> None:
    """A float, numpy float or bool rank, tag or root was refused ("bcast_object: root must
    be an int; got 0.0"): mpi4py truncates it, as C does, in every method. A tag of 2**31
    or more raises OverflowError, as mpi4py's, and a string TypeError."""
    got = job(
        tmp_path,
        """
        half = comm.size / 2  # a float
        said = [comm.bcast(f"from {rank}", root=half - 1)]
        if rank == 0:
            comm.send("x", dest=half, tag=1.0)
            comm.Send(np.arange(2.0), dest=np.float64(1.9), tag=np.float32(2.5))
            comm.isend("y", dest=True, tag=3.7).wait()
            comm.Isend(np.arange(3.0), dest=1.2, tag=4).Wait()
            comm.Sendrecv(np.arange(1.0), 1.0, 5.5, np.zeros(1), source=1.0, recvtag=6.1)
            said.append(comm.sendrecv("a", 1.0, 7.9, source=np.float64(1), recvtag=8.0))
        else:
            st = MPI.Status()
            said.append(comm.recv(source=0.0, tag=1.0, status=st))
            said.append([st.Get_source(), st.Get_tag()])
            b = np.zeros(2)
            comm.Recv(b, source=np.float64(0.2), tag=2.0)
            said.append(b.tolist())
            comm.probe(source=0.5, tag=3.2)
            said.append(comm.iprobe(source=0.5, tag=np.float64(3)))
            said.append(comm.irecv(source=False, tag=3.0).wait())
            b = np.zeros(3)
            comm.Irecv(b, source=0.0, tag=4.4).Wait()
            said.append(b.tolist())
            comm.Sendrecv(np.arange(1.0), 0.0, 6.9, np.zeros(1), source=0.0, recvtag=5.0)
            said.append(comm.sendrecv("b", dest=0.3, sendtag=8.0, source=0.0, recvtag=7.0))
        a = np.full(2, float(rank))
        comm.Bcast(a, root=0.9)
        said.append(a.tolist())
        said.append(comm.reduce(rank + 1, root=np.float32(1.5)))
        said.append(comm.gather(rank, root=False))
        said.append(comm.scatter([10, 11] if rank == 1 else None, root=True))
        r = np.zeros(1)
        comm.Reduce(np.ones(1), r, root=1.0)
        said.append(r.tolist())
        g = np.zeros(2)
        comm.Gather(np.full(1, float(rank)), g, root=np.float64(1))
        said.append(g.tolist())
        x = np.zeros(1)
        comm.Scatter(np.arange(2.0), x, root=1.1)
        said.append(x.tolist())
        g = np.zeros(2)
        comm.Gatherv(np.full(1, float(rank)), g, root=0.0)
        said.append(g.tolist())
        x = np.zeros(1)
        comm.Scatterv(np.arange(2.0), x, root=0.0)
        said.append(x.tolist())
        for call in (
            lambda: comm.send(1, dest=1, tag=2**31),
            lambda: comm.Isend(np.zeros(1), 1, 2**31),
            lambda: comm.recv(source=0, tag=2**40),
            lambda: comm.bcast(1, root=2**31),
            lambda: comm.send(1, dest="1"),
            lambda: comm.Recv(np.zeros(1), source=None, tag=0),
            lambda: comm.Bcast(np.zeros(1), root=float("nan")),
        ):
            try:
                call()
                said.append("ok")
            except (TypeError, ValueError, OverflowError) as e:
                said.append(f"{type(e).__name__}: {e}")
        done(said)
        """,
    )
    refused = ["OverflowError: value too large to convert to int"] * 4 + [
        "TypeError: an integer is required",
        "TypeError: an integer is required",
        "ValueError: cannot convert float NaN to integer",
    ]
    assert [said[-7:] for said in got] == [refused, refused]
    assert got[0][:-7] == [
        *["from 0", "b", [0.0, 0.0], None, [0, 1], 10, [0.0], [0.0, 0.0], [0.0]],
        *[[0.0, 1.0], [0.0]],
    ]
    assert got[1][:-7] == [
        *["from 0", "x", [0, 1], [0.0, 1.0], True, "y", [0.0, 1.0, 2.0], "a", [0.0, 0.0]],
        *[3, None, 11, [2.0], [0.0, 1.0], [1.0], [0.0, 0.0], [1.0]],
    ]


def test_comm_of_a_comm_is_its_communicator_and_request_null_is_a_null_request(
    tmp_path: Path,
) -> None:
    """MPI.Intracomm(MPI.COMM_WORLD) made a Comm over a Comm, whose calls raised
    Unsupported ("Comm.allreduce_object"); MPI.Comm() raised TypeError; MPI.REQUEST_NULL
    raised Unsupported. mpi4py's are a second handle to the same communicator, COMM_NULL,
    and a request that a wait passes over."""
    got = job(
        tmp_path,
        """
        size = comm.Get_size()
        said = []
        s = MPI.Comm(MPI.COMM_SELF)  # before COMM_SELF is first used: one join for both
        said += [s == MPI.COMM_SELF, s.allreduce(1), MPI.COMM_SELF.allreduce(2)]
        c = MPI.Intracomm(comm)
        said += [c == comm, c is comm, c.Get_rank() == rank, c.allreduce(1), c.Get_name()]
        said += [MPI.Comm() == MPI.COMM_NULL, bool(MPI.Comm()), MPI.Intracomm() == MPI.COMM_NULL]
        reqs = [MPI.REQUEST_NULL] * size
        buf = np.zeros(size)
        for p in range(size):
            if p != rank:
                reqs[p] = comm.Irecv(buf[p : p + 1], source=p)
        for p in range(size):
            if p != rank:
                comm.Send(np.array([float(rank + 1)]), dest=p)
        sts = [MPI.Status() for _ in range(size)]
        MPI.Request.Waitall(reqs, sts)
        said += [buf.tolist(), [[st.source, st.tag] for st in sts]]
        st = MPI.Status()
        MPI.REQUEST_NULL.Wait(st)
        said.append([st.source, st.tag, st.Get_count()])
        said += [MPI.Request() == MPI.REQUEST_NULL, bool(MPI.REQUEST_NULL)]
        said += [MPI.Request.Waitany([MPI.REQUEST_NULL]), MPI.Request.Testall([MPI.Request()])]
        r = comm.Isend(np.zeros(1), dest=rank, tag=3)
        said += [bool(r), r == MPI.REQUEST_NULL]
        comm.Recv(np.zeros(1), source=rank, tag=3)
        r.Wait()
        said += [bool(r), r == MPI.REQUEST_NULL]
        done(said)
        """,
    )
    same = [True, 1, 2, True, False, True, 2, "MPI_COMM_WORLD", True, False, True]
    nulls = [[MPI_ANY_SOURCE, MPI_ANY_TAG, 0], True, False, MPI_UNDEFINED, True, True, False]
    assert got == [
        [*same, [0.0, 2.0], [[MPI_ANY_SOURCE, MPI_ANY_TAG], [1, 0]], *nulls, False, True],
        [*same, [1.0, 0.0], [[0, 0], [MPI_ANY_SOURCE, MPI_ANY_TAG]], *nulls, False, True],
    ]


# -- buffer collectives ----------------------------------------------------------------------
def test_scatterv_roots_own_recvbuf_may_be_longer_and_a_short_one_raises_after_the_call(
    tmp_path: Path,
) -> None:
    """Root refused a recvbuf longer than its own block before it joined the call, so the
    other ranks, in it already, failed with it (the next call mismatched). mpi4py's root
    fills the start of a longer one; a shorter one is MPI's truncation error, which root
    raises once the others have their data, as a rank off root does (that one's was a
    plain ValueError, not MPI.Exception)."""
    got = job(
        tmp_path,
        """
        said = []
        for n in ((4, 2), (1, 2), (2, 1)):
            send = [np.arange(4.0), [2, 2], MPI.DOUBLE] if rank == 0 else None
            recv = np.full(n[rank], -1.0)
            try:
                comm.Scatterv(send, recv, root=0)
            except MPI.Exception as e:
                said.append([e.Get_error_class(), str(e)])
            said.append(recv.tolist())
            said.append(comm.allreduce(1))
        done(said)
        """,
    )
    truncated = (
        "rank 1: Scatterv: message truncated (MPI_ERR_TRUNCATE): root sends this rank 2 DOUBLE "
        "(16 bytes), but recvbuf holds 1 DOUBLE (8 bytes); recvbuf was not written, and the "
        "other ranks have their data"
    )
    assert got[1] == [[2.0, 3.0], 2, [2.0, 3.0], 2, [15, truncated], [-1.0], 2]
    assert got[0][5:] == [[0.0, 1.0], 2]
    assert got[0][:5] == [
        [0.0, 1.0, -1.0, -1.0],
        2,
        [
            15,  # MPI.ERR_TRUNCATE
            "Scatterv: message truncated (MPI_ERR_TRUNCATE): root sends itself 2 DOUBLE (16 "
            "bytes), but recvbuf holds 1 DOUBLE (8 bytes); recvbuf was not written, and the "
            "other ranks have their data",
        ],
        [-1.0],
        2,
    ]


# -- buffer specifications -----------------------------------------------------------------
def test_a_count_of_none_is_the_whole_buffer(tmp_path: Path) -> None:
    """[buf, None, datatype] was refused ("count must be an int; got None")."""
    got = job(
        tmp_path,
        """
        said = []
        for spec in ("[x, None, MPI.DOUBLE]", "[x, (None, 1), MPI.DOUBLE]"):
            x = np.arange(4.0)
            a = eval(spec)
            x = np.zeros(4)
            comm.Allreduce(a, eval(spec))
            said.append(x.tolist())
        g = np.zeros(8)
        comm.Allgather([np.arange(4.0), None, MPI.DOUBLE], [g, None, MPI.DOUBLE])
        done(said + [g.tolist()])
        """,
    )
    assert got[0] == [[0.0, 2.0, 4.0, 6.0], [0.0, 2.0, 4.0, 6.0], [0.0, 1.0, 2.0, 3.0] * 2]


def test_a_count_of_none_after_a_displacement_is_per_block_of_the_rest(tmp_path: Path) -> None:
    """[r, (None, 1), MPI.DOUBLE] with one block per rank split the whole buffer into
    blocks ("5 elements of DOUBLE do not split into 2 blocks"); mpi4py's count is what
    follows the displacement, divided into blocks: (n - displ) // blocks."""
    got = job(
        tmp_path,
        """
        D = MPI.DOUBLE
        said = []
        r = np.zeros(5)
        comm.Allgather(np.full(2, float(rank)), [r, (None, 1), D])
        said.append(r.tolist())
        g = np.zeros(5)
        comm.Gather(np.full(2, float(rank)), [g, (None, 1), D], root=0)
        said.append(g.tolist())
        x = np.zeros(2)
        comm.Scatter([np.arange(5.0), (None, 1), D], x, root=0)
        said.append(x.tolist())
        r = np.zeros(5)
        comm.Alltoall([np.arange(5.0) + 100 * rank, (None, 1), D], [r, (None, 1), D])
        said.append(r.tolist())
        r = np.zeros(2)
        comm.Reduce_scatter_block([np.arange(5.0) + rank, (None, 1), D], r)
        said.append(r.tolist())
        r = np.zeros(4)
        comm.Allgather(np.full(1, float(rank)), [r, None, 2, D])
        said.append(r.tolist())
        for spec in ("[np.zeros(6), (None, 1), D]", "[np.zeros(5), (None, 6), D]"):
            try:
                comm.Allgather(np.zeros(2), eval(spec))
            except ValueError as e:
                said.append(str(e))
        done(said)
        """,
    )
    gathered = [0.0, 0.0, 0.0, 1.0, 1.0]
    refused = [
        "Allgather: recvbuf: 5 elements of DOUBLE after the displacement 1 do not split into "
        "2 blocks",
        "Allgather: recvbuf: the displacement 6 is past the buffer's end (5 elements of DOUBLE)",
    ]
    shifted = [0.0, 0.0, 0.0, 1.0]
    assert [said[:6] for said in got] == [
        [gathered, gathered, [1.0, 2.0], [0.0, 1.0, 2.0, 101.0, 102.0], [3.0, 5.0], shifted],
        [gathered, [0.0] * 5, [3.0, 4.0], [0.0, 3.0, 4.0, 103.0, 104.0], [7.0, 9.0], shifted],
    ]
    assert [said[6:] for said in got] == [refused, refused]


def test_buffers_mpi4py_cannot_use_raise_buffer_error(tmp_path: Path) -> None:
    """A strided buffer raised ValueError, and so did a Fortran-ordered one, which mpi4py
    takes (in memory order); a read-only buffer a call writes into raised plait's "out is
    read-only" (a bytes object as Recv's buffer was taken, and the call waited), and
    Sendrecv sent before it looked at its receive buffer. mpi4py raises BufferError, before
    anything is sent; plait.mpi's is also the ValueError it was."""
    got = job(
        tmp_path,
        """
        ro = np.zeros(2)
        ro.setflags(write=False)
        said = []
        for call in (
            lambda: comm.Send(np.zeros(4)[::2], rank, 1),
            lambda: comm.Allreduce(np.zeros((2, 2))[:, 0], np.zeros(2)),
            lambda: comm.Recv(ro, rank, 1),
            lambda: comm.Irecv(b"ab", rank, 1),
            lambda: comm.Sendrecv(np.ones(2), rank, 1, ro, rank, 1),
            lambda: comm.Allreduce(np.ones(2), ro),
            lambda: comm.Allreduce(MPI.IN_PLACE, ro),
            lambda: comm.Allgather(np.ones(1), [ro, 1, MPI.DOUBLE]),
            lambda: comm.Bcast(ro, root=1 - rank),
        ):
            try:
                call()
                said.append("ok")
            except BufferError as e:
                said.append([isinstance(e, ValueError), str(e)])
        comm.Bcast(ro if rank == 0 else np.zeros(2), root=0)  # root only reads its buffer
        said.append(comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG))  # nothing was sent
        f = np.arange(6.0).reshape(2, 3, order="F")
        b = np.zeros(6)
        comm.Sendrecv(f, rank, 2, b, rank, 2)
        r = np.zeros((3, 2), order="F")
        comm.Allreduce(np.arange(6.0), r)
        said += [b.tolist(), r.ravel(order="K").tolist()]
        done(said)
        """,
    )
    strided = (
        "the buffer is not contiguous (a strided view, such as x[:, 0] or x[::2]); pass "
        "np.ascontiguousarray(x), and copy back what is received"
    )
    read_only = "the buffer is read-only, but this call writes into it; pass a writable array"
    refused = [
        f"Send: buf: {strided}",
        f"Allreduce: sendbuf: {strided}",
        f"Recv: buf: {read_only}",
        f"Irecv: buf: {read_only}",
        f"Sendrecv: buf: {read_only}",
        f"Allreduce: recvbuf: {read_only}",
        f"Allreduce: recvbuf: {read_only}",
        f"Allgather: recvbuf: {read_only}",
        f"Bcast: buf: {read_only}",
    ]
    in_order = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    for said in got:
        summed = [2 * v for v in in_order]  # two ranks
        assert said == [*([True, words] for words in refused), False, in_order, summed]


def test_v_buffers_without_counts_split_as_mpi4py_splits_them(tmp_path: Path) -> None:
    """A v buffer without counts whose elements the ranks do not divide was refused ("5
    elements of DOUBLE do not split into 2"); mpi4py gives rank i n // size of them, and
    one more to each of the first n % size ranks: 5 on 2 ranks are 3 and 2."""
    got = job(
        tmp_path,
        """
        n = 5
        mine = n // 2 + (n % 2 > rank)
        said = []
        r = np.zeros(n)
        comm.Allgatherv(np.full(mine, float(rank)), r)
        said.append(r.tolist())
        r = np.zeros(n)
        comm.Allgatherv(np.full(mine, float(rank)), [r, None, MPI.DOUBLE])
        said.append(r.tolist())
        x = np.zeros(mine)
        comm.Scatterv(np.arange(5.0) if rank == 0 else None, x, root=0)
        said.append(x.tolist())
        g = np.zeros(n) if rank == 0 else None
        comm.Gatherv(np.full(mine, float(rank)), g, root=0)
        said.append(None if g is None else g.tolist())
        a = np.zeros(4 if rank == 0 else 2)  # 3 sent by each: 2 to rank 0, 1 to rank 1
        comm.Alltoallv(np.arange(3.0) + 10 * rank, a)
        said.append(a.tolist())
        done(said)
        """,
    )
    gathered = [0.0, 0.0, 0.0, 1.0, 1.0]
    assert got == [
        [gathered, gathered, [0.0, 1.0, 2.0], gathered, [0.0, 1.0, 10.0, 11.0]],
        [gathered, gathered, [3.0, 4.0], None, [2.0, 12.0]],
    ]


# -- the module ----------------------------------------------------------------------------
def test_query_thread_says_what_init_thread_gave(tmp_path: Path) -> None:
    """MPI.Query_thread was missing, and its hint said threads each need a communicator,
    which docs/mpi.md contradicts."""
    got = job(tmp_path, "done([MPI.Init_thread(), MPI.Query_thread(), MPI.THREAD_MULTIPLE])\n")
    assert got[0] == [3, 3, 3]


def test_names_comm_and_datatype_lack_are_unsupported_on_the_class_too(tmp_path: Path) -> None:
    """MPI.Comm.Get_parent and MPI.Datatype.Create_struct raised a bare AttributeError, with
    no hint, where the instance's (comm.Compare) raised Unsupported."""
    got = job(
        tmp_path,
        """
        said = []
        for name in ("MPI.Comm.Get_parent", "MPI.Intracomm.Create_cart",
                     "MPI.Datatype.Create_struct", "comm.Compare"):
            try:
                eval(name)
            except MPI.Unsupported as e:
                said.append(str(e))
        done(said)
        """,
    )
    assert len(got[0]) == 4
    assert got[0][2] == (
        "plait.mpi does not support Datatype.Create_struct; nearest supported: a numpy "
        "structured dtype, sent as bytes"
    )
    assert got[0][1].startswith("plait.mpi does not support Intracomm.Create_cart; nearest")


def test_split_refuses_a_negative_numpy_color_as_mpi_err_arg(tmp_path: Path) -> None:
    """A numpy integer color was not seen as an int: -3 raised a plain ValueError from the
    split, not MPI.Exception of class ERR_ARG; np.int64(UNDEFINED) gave COMM_NULL already."""
    got = job(
        tmp_path,
        """
        said = [comm.Split(np.int64(MPI.UNDEFINED), 0) == MPI.COMM_NULL]
        try:
            comm.Split(np.int64(-3), 0)
        except MPI.Exception as e:
            said.append(e.Get_error_class())
        said.append(comm.Split(np.int32(rank), 0).Get_size())
        done(said)
        """,
    )
    assert got == [[True, 13, 1]] * 2  # MPI.ERR_ARG


def test_sendrecv_refuses_its_receives_source_and_tag_before_it_sends(tmp_path: Path) -> None:
    """A Sendrecv whose source or recvtag no message can match raised MPI_ERR_RANK or
    MPI_ERR_TAG, but only after its send had gone: the peer found a stray message in a
    later receive. Open MPI checks the arguments first."""
    got = job(
        tmp_path,
        """
        said = []
        for kw in (dict(source=5), dict(source=1 - rank, recvtag=-7)):
            try:
                comm.Sendrecv(np.ones(1), 1 - rank, 0, np.zeros(1), **kw)
                said.append("ok")
            except MPI.Exception as e:
                said.append(MPI.Get_error_string(e.Get_error_class()))
        comm.Barrier()
        said.append(comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG))  # nothing was sent
        done(said)
        """,
    )
    for said in got:
        assert said == ["MPI_ERR_RANK: invalid rank", "MPI_ERR_TAG: invalid tag", False]


# -- communicators: classes, names, attributes ----------------------------------------------
def test_world_and_what_it_makes_are_intracomms_with_mpi4pys_names_and_tag_ub(
    tmp_path: Path,
) -> None:
    """MPI.Intracomm was MPI.Comm, so COMM_NULL was an Intracomm and COMM_WORLD's class was
    Comm; Set_name, Is_intra, Is_inter, Get_attr, TAG_UB and VERSION raised Unsupported.
    Every value here is mpi4py's on Open MPI."""
    got = job(
        tmp_path,
        """
        def err(f):
            try:
                return f()
            except MPI.Exception as e:
                return e.Get_error_class()
        kind = lambda c: type(c).__name__
        said = [kind(comm), kind(MPI.COMM_SELF), kind(MPI.COMM_NULL)]
        said += [isinstance(MPI.COMM_NULL, MPI.Intracomm), issubclass(MPI.Intracomm, MPI.Comm)]
        said += [kind(MPI.Comm()), kind(MPI.Intracomm()), MPI.Intracomm() == MPI.COMM_NULL]
        said += [kind(MPI.Comm(comm)), kind(MPI.Intracomm(comm)), kind(comm.Dup())]
        said += [kind(comm.Clone()), kind(comm.Split(0, 0)), kind(comm.Split(MPI.UNDEFINED))]
        said += [kind(MPI.Comm(comm).Dup()), kind(MPI.Comm(comm).Split(0, 0))]
        said += [comm.Is_inter(), comm.Is_intra(), comm.is_inter, comm.is_intra]
        said += [err(MPI.COMM_NULL.Is_inter), err(lambda: MPI.COMM_NULL.Set_name("x"))]
        d = comm.Dup()
        second = MPI.Comm(d)
        d.Set_name("mine")
        said += [d.Get_name(), second.Get_name(), d.name, comm.Dup().Get_name()]
        d.name = "a" * 70
        said.append(len(second.Get_name()))
        d.Free()
        said += [d.Get_name(), second.Get_name() == "a" * 63, err(d.Is_inter)]
        comm.Set_name("w")
        said += [comm.Get_name(), err(comm.Free)]
        comm.Set_name("MPI_COMM_WORLD")
        said += [MPI.TAG_UB, comm.Get_attr(MPI.TAG_UB), comm.Dup().Dup().Get_attr(MPI.TAG_UB)]
        said += [comm.Split(0, 0).Get_attr(MPI.TAG_UB), MPI.COMM_SELF.Get_attr(MPI.TAG_UB)]
        said += [err(lambda: MPI.COMM_NULL.Get_attr(MPI.TAG_UB)), comm.Get_attr(0.5)]
        said += [MPI.VERSION, MPI.SUBVERSION]
        comm.Send(np.zeros(1), (rank + 1) % comm.size, comm.Get_attr(MPI.TAG_UB))
        comm.Recv(np.zeros(1), MPI.ANY_SOURCE, comm.Get_attr(MPI.TAG_UB))
        done(said)
        """,
    )
    tag_ub = 2**31 - 1
    assert (
        got
        == [
            [
                *["Intracomm", "Intracomm", "Comm", False, True, "Comm", "Intracomm", True],
                *["Comm", "Intracomm", "Intracomm", "Intracomm", "Intracomm", "Intracomm"],
                *["Comm", "Comm", False, True, False, True, 5, 5],
                *["mine", "mine", "mine", "", 63, "MPI_COMM_NULL", True, 5, "w", 5],
                *[0, tag_ub, tag_ub, None, None, 5, tag_ub, 3, 1],
            ]
        ]
        * 2
    )
