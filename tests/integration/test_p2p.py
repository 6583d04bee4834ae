"""Point to point as MPI users know it, over threads: requests, wildcards, probes, sendrecv.

Ranks are threads over the in-process transport (eager, and lockstep where
buffering matters); ``tests/multiprocess/test_point_to_point.py`` runs the same ideas
between processes over shared memory and TCP. Where a test needs one rank to
act only after another did something, the ranks wait on a threading.Event or
on a message, never on time.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import numpy as np
import pytest

import plait
from plait.testing import RankFailure, memory_communicators, run_ranks


def test_isend_irecv_move_arrays_of_every_kind() -> None:
    cases: list[tuple[str, Any]] = [
        ("float64 matrix", np.arange(12.0).reshape(3, 4)),
        ("int16", np.arange(-5, 5, dtype=np.int16)),
        ("complex64", (np.arange(4) + 1j).astype(np.complex64)),
        ("bool", np.array([True, False, True])),
        ("big-endian", np.arange(6, dtype=">i4")),
        ("empty", np.empty(0, np.float32)),
        ("scalar", np.array(7.5)),
        ("large", np.arange(300_000, dtype=np.float64)),
    ]

    def body(comm: plait.Communicator) -> Any:
        if comm.rank == 0:
            reqs = [comm.isend(x, 1, tag=i) for i, (_, x) in enumerate(cases)]
            assert plait.wait_all(reqs) == [None] * len(cases)
            return None
        out = []
        reqs = []
        for i, (_, x) in enumerate(cases):
            # Strided receive buffers for half of them: written back on completion.
            buf = (
                np.zeros((x.size, 2), x.dtype)[:, 0].reshape(x.shape) if i % 2 else np.zeros_like(x)
            )
            reqs.append(comm.irecv(buf, 0, tag=i))
            out.append(buf)
        got = plait.wait_all(reqs)
        assert all(g is b for g, b in zip(got, out, strict=True))
        for i, ((_, x), req) in enumerate(zip(cases, reqs, strict=True)):
            st = req.status
            assert st is not None
            assert (st.source, st.tag, st.count) == (0, i, x.size)
            assert st.nbytes == x.nbytes
        return out

    _, out = run_ranks(2, body)
    for (name, x), got in zip(cases, out, strict=True):
        np.testing.assert_array_equal(got, x, err_msg=name)


@pytest.mark.parametrize("lockstep", [False, True])
def test_master_worker_queue_with_any_source(lockstep: bool) -> None:
    """Rank 0 hands out tasks, takes results from whoever is done first, and stops everyone."""
    tasks = list(range(40))
    task_tag, result_tag, stop_tag = 1, 2, 3

    def body(comm: plait.Communicator) -> Any:
        if comm.rank == 0:
            queue = list(tasks)
            results: dict[int, tuple[int, int]] = {}
            busy = 0
            for w in range(1, comm.size):
                comm.send(np.array([queue.pop()]), w, task_tag)
                busy += 1
            while busy:
                st = plait.Status()
                got = comm.recv(np.empty(2, np.int64), plait.ANY_SOURCE, result_tag, status=st)
                results[int(got[0])] = (int(got[1]), st.source)
                assert st.tag == result_tag
                if queue:
                    comm.send(np.array([queue.pop()]), st.source, task_tag)
                else:
                    comm.send(np.array([-1]), st.source, stop_tag)
                    busy -= 1
            return results
        done = 0
        while True:
            st = plait.Status()
            task = comm.recv(np.empty(1, np.int64), 0, plait.ANY_TAG, status=st)
            if st.tag == stop_tag:
                return done
            comm.send(np.array([task[0], task[0] ** 2]), 0, result_tag)
            done += 1

    results, *done = run_ranks(4, body, lockstep=lockstep)
    assert sorted(results) == tasks
    assert all(sq == t * t for t, (sq, _) in results.items())
    assert sum(done) == len(tasks)
    assert {src for _, src in results.values()} <= {1, 2, 3}


def test_messages_of_one_sender_and_tag_never_overtake() -> None:
    """Whatever mix of plain, ANY_TAG and ANY_SOURCE receives takes them, in send order."""
    n = 30

    def body(comm: plait.Communicator) -> Any:
        if comm.rank == 1:
            reqs = [comm.isend(np.array([i]), 0, tag=5) for i in range(n)]
            plait.wait_all(reqs)
            return None
        got = []
        for i in range(n):
            buf = np.empty(1, np.int64)
            if i % 3 == 0:
                comm.recv(buf, 1, 5)
            elif i % 3 == 1:
                comm.recv(buf, 1, plait.ANY_TAG)
            else:
                comm.recv(buf, plait.ANY_SOURCE, 5)
            got.append(int(buf[0]))
        return got

    assert run_ranks(2, body)[0] == list(range(n))


def test_posted_receives_take_messages_in_posting_order() -> None:
    """A message goes to the earliest posted receive that matches it, wildcard or not."""

    def body(comm: plait.Communicator) -> Any:
        if comm.rank == 1:
            ready = comm.recv(np.empty(1, np.int64), 0, tag=9)
            assert ready[0] == 1
            plait.wait_all([comm.isend(np.array([i]), 0, tag=4) for i in range(3)])
            return None
        bufs = [np.full(1, -1) for _ in range(3)]
        reqs = [
            comm.irecv(bufs[0], plait.ANY_SOURCE, plait.ANY_TAG),
            comm.irecv(bufs[1], 1, 4),
            comm.irecv(bufs[2], plait.ANY_SOURCE, 4),
        ]
        comm.send(np.array([1]), 1, tag=9)
        plait.wait_all(reqs)
        return [int(b[0]) for b in bufs]

    assert run_ranks(2, body)[0] == [0, 1, 2]


def test_any_source_takes_the_earliest_arrived_message() -> None:
    first_in = threading.Event()

    def body(comm: plait.Communicator) -> Any:
        if comm.rank == 2:
            assert first_in.wait(30)
            comm.send(np.array([2]), 0, tag=1)
            return None
        if comm.rank == 1:
            comm.send(np.array([1]), 0, tag=1)
            return None
        comm.probe(1, 1)  # rank 1's message is in
        first_in.set()
        comm.probe(2, 1)  # and now rank 2's
        st = plait.Status()
        a = comm.recv(np.empty(1, np.int64), plait.ANY_SOURCE, 1, status=st)
        b = comm.recv(np.empty(1, np.int64), plait.ANY_SOURCE, 1)
        return int(a[0]), st.source, int(b[0])

    assert run_ranks(3, body)[0] == (1, 1, 2)


def test_any_tag_never_takes_collective_or_other_communicators_messages() -> None:
    def body(comm: plait.Communicator) -> Any:
        sub = comm.split(0)  # the same ranks, another communicator
        req = comm.irecv(np.empty(1, np.int64), plait.ANY_SOURCE, plait.ANY_TAG)
        sub_req = sub.irecv(np.empty(1, np.int64), plait.ANY_SOURCE, plait.ANY_TAG)
        total = comm.allreduce(np.array([comm.rank]))  # its messages pass by the receives
        comm.barrier()
        assert not req.done()
        assert not sub_req.done()
        comm.barrier()  # nobody sends before every rank has checked
        sub.send(np.array([100 + comm.rank]), (comm.rank + 1) % comm.size, tag=6)
        comm.send(np.array([comm.rank]), (comm.rank + 1) % comm.size, tag=7)
        got = req.wait()
        sub_got = sub_req.wait()
        st, sub_st = req.status, sub_req.status
        assert st is not None
        assert sub_st is not None
        return int(total[0]), int(got[0]), st.tag, int(sub_got[0]), sub_st.tag

    for r, res in enumerate(run_ranks(3, body)):
        prv = (r - 1) % 3
        assert res == (3, prv, 7, 100 + prv, 6)


def test_sub_communicator_wildcards_speak_its_ranks() -> None:
    def body(comm: plait.Communicator) -> Any:
        sub = comm.split(comm.rank % 2, key=-comm.rank)  # reversed order inside each group
        if sub.rank == 0:
            got = {}
            for _ in range(sub.size - 1):
                st = plait.Status()
                buf = sub.recv(np.empty(1, np.int64), plait.ANY_SOURCE, plait.ANY_TAG, status=st)
                got[st.source] = (int(buf[0]), st.tag)
            return got
        sub.send(np.array([comm.rank]), 0, tag=sub.rank)
        return None

    res = run_ranks(5, body)
    # Evens: world 4, 2, 0 are group ranks 0, 1, 2; odds: world 3, 1 are 0, 1.
    assert res[4] == {1: (2, 1), 2: (0, 2)}
    assert res[3] == {1: (1, 1)}


def test_probe_describes_a_message_of_unknown_size() -> None:
    def body(comm: plait.Communicator) -> Any:
        if comm.rank == 1:
            comm.send(np.arange(7, dtype=np.float32), 0, tag=3)
            comm.send(np.arange(2, dtype=np.uint16), 0, tag=4)
            return None
        assert comm.iprobe(1, 5) is None  # nothing with tag 5, ever
        st = comm.probe(plait.ANY_SOURCE, plait.ANY_TAG)
        assert (st.source, st.tag, st.count, st.dtype, st.nbytes) == (1, 3, 7, np.float32, 28)
        again = plait.Status()
        assert comm.probe(1, 3, status=again) is not None
        assert (again.source, again.tag, again.count) == (1, 3, 7)  # probing consumes nothing
        buf = comm.recv(np.empty(st.count, st.dtype), st.source, st.tag)
        found = None
        while found is None:  # iprobe makes progress each time: the message comes
            found = comm.iprobe(plait.ANY_SOURCE, 4)
        assert (found.source, found.count, found.dtype) == (1, 2, np.uint16)
        assert found.get_count(np.uint8) == 4
        other = comm.recv(np.empty(2, np.uint16), 1, 4)
        return buf, other

    buf, other = run_ranks(2, body)[0]
    np.testing.assert_array_equal(buf, np.arange(7, dtype=np.float32))
    np.testing.assert_array_equal(other, [0, 1])


@pytest.mark.parametrize("size", [1, 2, 3, 5])
@pytest.mark.parametrize("lockstep", [False, True])
def test_sendrecv_ring_never_deadlocks(size: int, lockstep: bool) -> None:
    def body(comm: plait.Communicator) -> Any:
        r, p = comm.rank, comm.size
        x = np.full(1000, r, np.int32)
        got = comm.sendrecv(x, (r + 1) % p, np.empty_like(x), (r - 1) % p, 1, 1)
        return int(got[0]), int(got[-1])

    for r, res in enumerate(run_ranks(size, body, lockstep=lockstep)):
        assert res == ((r - 1) % size,) * 2


def test_sendrecv_refuses_a_buf_that_shares_memory_with_x() -> None:
    """The message received overwrote the one being sent: over shared memory a rank got its
    own data back, without an error."""

    def body(comm: plait.Communicator) -> Any:
        peer = 1 - comm.rank
        x = np.full(8, float(comm.rank), np.float32)
        for buf in (x, x[2:6], x.reshape(2, 4)[:, 1]):
            with pytest.raises(ValueError, match="buf shares memory with x"):
                comm.sendrecv(x, peer, buf, peer)
        assert (x == comm.rank).all()  # refused before a byte moved
        evens, odds = x[0::2], x[1::2]  # side by side, no element in common: fine
        comm.sendrecv(evens, peer, odds, peer)
        mixed = x.tolist()
        got = comm.sendrecv(x.copy(), peer, x, peer)  # the replace MPI spells apart
        return mixed, got.tolist()

    for r, (mixed, got) in enumerate(run_ranks(2, body)):
        assert mixed == [float(r), float(1 - r)] * 4
        assert got == mixed[1:] + mixed[:1]  # the peer's x, as it was


def test_proc_null_ends_a_non_periodic_shift() -> None:
    def body(comm: plait.Communicator) -> Any:
        r, p = comm.rank, comm.size
        right = r + 1 if r + 1 < p else plait.PROC_NULL
        left = r - 1 if r > 0 else plait.PROC_NULL
        st = plait.Status()
        buf = np.full(2, -1.0)
        comm.sendrecv(np.full(2, float(r)), right, buf, left, status=st)
        return buf.tolist(), st.source, st.count

    res = run_ranks(3, body)
    assert res[0] == ([-1.0, -1.0], plait.PROC_NULL, 0)
    assert res[1] == ([0.0, 0.0], 0, 2)
    assert res[2] == ([1.0, 1.0], 1, 2)


def test_cancel_withdraws_a_receive_that_matched_nothing() -> None:
    def body(comm: plait.Communicator) -> Any:
        if comm.rank == 1:
            comm.recv(np.empty(1, np.int64), 0, tag=9)
            comm.send(np.array([42]), 0, tag=2)
            return None
        dead = np.full(1, -1)
        for src, tag in ((1, 2), (plait.ANY_SOURCE, plait.ANY_TAG)):
            req = comm.irecv(dead, src, tag)
            assert not req.test()
            req.cancel()
            assert req.cancelled
            assert req.done()
            st = plait.Status()
            assert req.wait(status=st) is dead
            assert st.cancelled
        comm.send(np.array([1]), 1, tag=9)
        got = comm.irecv(np.empty(1, np.int64), 1, 2)
        assert got.wait()[0] == 42
        got.cancel()  # done: nothing happens
        assert not got.cancelled
        return int(dead[0])

    assert run_ranks(2, body)[0] == -1


def test_wait_any_returns_requests_as_they_complete() -> None:
    def body(comm: plait.Communicator) -> Any:
        if comm.rank == 0:
            reqs = [comm.irecv(np.empty(1, np.int64), q, tag=1) for q in range(1, comm.size)]
            order = []
            for q in reversed(range(1, comm.size)):  # release them one at a time, last first
                comm.send(np.array([0]), q, tag=2)
                i = plait.wait_any(reqs)
                order.append(int(reqs[i].wait()[0]))
                reqs.pop(i)
            return order
        comm.recv(np.empty(1, np.int64), 0, tag=2)
        comm.send(np.array([comm.rank]), 0, tag=1)
        return None

    assert run_ranks(4, body)[0] == [3, 2, 1]


def test_wait_all_and_wait_any_take_a_timeout_of_0_as_a_poll() -> None:
    """As a request's wait(0) and concurrent.futures.wait(timeout=0): they look once (they
    refused 0 as not positive)."""

    def body(comm: plait.Communicator) -> Any:
        peer = 1 - comm.rank
        pending = comm.irecv(np.empty(1, np.int64), peer, tag=3)
        for wait in (plait.wait_all, plait.wait_any):
            with pytest.raises(plait.CommTimeout, match="within 0 s"):
                wait([pending], timeout=0)
        comm.send(np.array([comm.rank]), peer, tag=4)
        got = comm.irecv(np.empty(1, np.int64), peer, tag=4)
        got._wait_until(time.monotonic() + 30)  # arrived: a look of 0 s now finds it done
        assert plait.wait_any([pending, got], timeout=0) == 1
        assert int(plait.wait_all([got], timeout=0)[0][0]) == peer
        comm.sendrecv(np.array([0]), peer, np.empty(1, np.int64), peer, sendtag=5, recvtag=5)
        comm.send(np.array([7]), peer, tag=3)  # both have looked: now it may come
        return int(pending.wait()[0])

    assert run_ranks(2, body) == [7, 7]


def test_a_lost_peer_fails_only_the_requests_that_need_it() -> None:
    """Rank 2 leaves: the receive from it fails; the others, ANY_SOURCE's too, go on."""

    def body(comm: plait.Communicator) -> Any:
        if comm.rank == 2:
            comm.recv(np.empty(1, np.int64), 0, tag=8)  # told to go
            comm.close()
            return None
        if comm.rank == 1:
            comm.recv(np.empty(1, np.int64), 0, tag=8)
            comm.send(np.array([11]), 0, tag=1)
            comm.send(np.array([12]), 0, tag=2)
            comm.recv(np.empty(1, np.int64), 0, tag=8)
            comm.close()
            return None
        from_two = comm.irecv(np.empty(1, np.int64), 2, tag=1)
        from_one = comm.irecv(np.empty(1, np.int64), 1, tag=1)
        from_any = comm.irecv(np.empty(1, np.int64), plait.ANY_SOURCE, tag=2)
        comm.send(np.array([0]), 2, tag=8)
        with pytest.raises(plait.PeerLostError, match="from rank 2") as info:
            from_two.wait(timeout=20)
        assert "rank 0: irecv" in str(info.value)
        assert not from_any.done()
        comm.send(np.array([0]), 1, tag=8)
        assert from_one.wait()[0] == 11
        assert from_any.wait()[0] == 12
        comm.send(np.array([0]), 1, tag=8)  # now rank 1 leaves too: nobody is left
        with pytest.raises(plait.PeerLostError, match="every rank"):
            comm.recv(np.empty(1, np.int64), plait.ANY_SOURCE, plait.ANY_TAG, timeout=20)
        with pytest.raises(plait.PeerLostError):
            comm.send(np.array([1]), 1)
        return "ok"

    assert run_ranks(3, body)[0] == "ok"


def test_deadlines_name_the_peer_and_tag_and_leave_the_communicator_usable() -> None:
    def body(comm: plait.Communicator) -> Any:
        if comm.rank == 1:
            comm.recv(np.empty(1, np.int64), 0, tag=8)
            comm.send(np.array([5]), 0, tag=4)
            return comm.allreduce(np.array([1]))[0]
        with pytest.raises(plait.CommTimeout, match=r"recv from rank 1 \(tag 4\)"):
            comm.recv(np.empty(1, np.int64), 1, 4, timeout=0.2)
        with pytest.raises(plait.CommTimeout, match=r"from any rank \(any tag\)"):
            comm.recv(np.empty(1, np.int64), plait.ANY_SOURCE, plait.ANY_TAG, timeout=0.2)
        with pytest.raises(plait.CommTimeout, match=r"probe from rank 1 \(tag 4\)"):
            comm.probe(1, 4, timeout=0.2)
        req = comm.irecv(np.empty(1, np.int64), 1, 4)
        with pytest.raises(plait.CommTimeout, match=r"irecv from rank 1 \(tag 4\)"):
            req.wait(timeout=0.2)
        assert not req.done()  # still pending: a later message completes it
        comm.send(np.array([0]), 1, tag=8)
        assert req.wait()[0] == 5  # the timed-out blocking receives were withdrawn
        return comm.allreduce(np.array([1]))[0]

    assert run_ranks(2, body) == [2, 2]


BAD = [
    ("dst type", lambda c, x: c.isend(x, "1"), TypeError, "dst must be an int"),
    ("dst range", lambda c, x: c.send(x, 5), ValueError, r"dst=5 is invalid; expected a rank"),
    ("src range", lambda c, x: c.irecv(x, 3), ValueError, "src=3 is invalid"),
    ("src -3", lambda c, x: c.recv(x, -3), ValueError, "src=-3 is invalid"),
    ("negative tag", lambda c, x: c.isend(x, 1, tag=-4), ValueError, "tag -4 out of range"),
    ("ANY_TAG send", lambda c, x: c.send(x, 1, tag=-1), ValueError, "ANY_TAG is for receives"),
    ("recv tag", lambda c, x: c.irecv(x, 1, tag=-2), ValueError, "tag -2 out of range"),
    ("tag type", lambda c, x: c.irecv(x, 1, tag=1.0), TypeError, "tag must be an int"),
    ("bool src", lambda c, x: c.irecv(x, True), TypeError, "src must be an int"),
    ("list buf", lambda c, x: c.irecv([0.0], 1), TypeError, "write in place"),
    ("read-only", lambda c, x: c.irecv(np.broadcast_to(x, (2, 6)), 1), ValueError, "read-only"),
    ("status type", lambda c, x: c.recv(x, 1, status={}), TypeError, "plait.Status"),
    ("probe src", lambda c, x: c.iprobe(7), ValueError, "src=7 is invalid"),
    ("timeout", lambda c, x: c.recv(x, 1, timeout=0), ValueError, "timeout must be positive"),
    (
        "sendrecv bad recv half",
        lambda c, x: c.sendrecv(x, 1, x, 1, recvtag=-5),
        ValueError,
        "recvtag -5 out of range",
    ),
    ("wait_all", lambda c, x: plait.wait_all([x]), TypeError, r"requests\[0\] is a ndarray"),
    ("wait_any empty", lambda c, x: plait.wait_any([]), ValueError, "no requests"),
]


@pytest.mark.parametrize(("what", "call", "exc", "fragment"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises_before_any_byte_moves(
    what: str, call: Any, exc: type, fragment: str
) -> None:
    def body(comm: plait.Communicator) -> Any:
        x = np.arange(6, dtype=np.float64)
        before = comm.stats()
        if comm.rank == 0:
            with pytest.raises(exc, match=fragment):
                call(comm, x)
        assert comm.stats() == before, "a refused call moved bytes"
        # Nothing was posted: the next messages match as if the call never happened.
        got = comm.sendrecv(x + comm.rank, 1 - comm.rank, np.empty(6), 1 - comm.rank)
        return got

    res = run_ranks(2, body)
    np.testing.assert_array_equal(res[0], np.arange(6.0) + 1)


def test_wait_any_refuses_requests_of_unrelated_transports() -> None:
    a, b = memory_communicators(2), memory_communicators(2)
    try:
        reqs = [a[0].irecv(np.empty(1), 1), b[0].irecv(np.empty(1), 1)]
        with pytest.raises(ValueError, match="2 different transports"):
            plait.wait_any(reqs)
        with pytest.raises(plait.CommTimeout, match="2 of 2 requests did not complete"):
            plait.wait_all(reqs, timeout=0.1)
        for r in reqs:
            r.cancel()
        assert plait.wait_all(reqs, timeout=1) == [reqs[0]._value, reqs[1]._value]
    finally:
        for c in a + b:
            c.close()


def test_requests_fail_with_the_communicator_closed_under_them() -> None:
    (comm,) = memory_communicators(1)
    req = comm.irecv(np.empty(1), 0, 3)
    comm.close()
    with pytest.raises(plait.CommError, match="irecv from rank 0"):
        req.wait()
    assert isinstance(req.exception(), plait.CommError)
    with pytest.raises(plait.ClosedError):
        comm.isend(np.empty(1), 0)


def test_a_rank_sends_to_itself() -> None:
    (comm,) = memory_communicators(1)
    with comm:
        req = comm.irecv(np.empty(3), plait.ANY_SOURCE)
        comm.send(np.arange(3.0), 0)
        assert req.wait().tolist() == [0.0, 1.0, 2.0]
        assert repr(req) == "<plait.Request irecv from any rank (tag 0) done>"
        st = req.status
        assert st is not None
        assert repr(st) == "<plait.Status source=0 tag=0 count=3 dtype=float64 nbytes=24>"


def test_a_mismatch_names_the_receive_and_consumes_the_message() -> None:
    """A mismatch on a wildcard receive names this rank's receive and consumes the message."""

    def body(comm: plait.Communicator) -> Any:
        if comm.rank == 1:
            # Whether the sender hears of the mismatch too depends on which call came first.
            with contextlib.suppress(plait.MismatchError):
                comm.send(np.ones(3), 0)
            comm.send(np.ones(3), 0)
            comm.recv(np.empty(1), 0)  # stay until rank 0 is done
            return None
        with pytest.raises(plait.MismatchError, match="this rank's recv: 3 elements of int64"):
            comm.recv(np.empty(3, np.int64), plait.ANY_SOURCE)
        got = comm.recv(np.empty(3), plait.ANY_SOURCE).tolist()  # the second message
        comm.send(np.empty(1), 1)
        return got

    assert run_ranks(2, body)[0] == [1.0, 1.0, 1.0]
    with pytest.raises(RankFailure):
        run_ranks(2, lambda c: c.recv(np.empty(1), 1 - c.rank, timeout=0.1))


def test_a_receive_from_a_lost_peer_names_it_in_lost_rank() -> None:
    """A collective's PeerLostError set lost_rank; a receive from (or a send to) the rank it
    named was lost left it None, though it knows the rank."""
    comms = memory_communicators(2, timeout=10.0)
    try:
        comms[1].close()
        with pytest.raises(plait.PeerLostError) as info:
            comms[0].recv(np.empty(4), 1, tag=3)
        assert info.value.lost_rank == 1
        with pytest.raises(plait.PeerLostError) as sent:
            comms[0].isend(np.ones(4), 1, tag=3).wait()
        assert sent.value.lost_rank == 1
    finally:
        for c in comms:
            c.close()


@pytest.mark.parametrize("layout", ["strided", "byte-swapped"])
def test_done_is_true_only_once_the_buffer_holds_the_message(layout: str) -> None:
    """A strided or byte-swapped buf receives into a copy, written back when the request
    settles: done() said True while the copy was not written back yet, and buf read zeros."""
    n = 10

    def body(comm: plait.Communicator) -> Any:
        # Rank 0 stays until rank 1 is done: a probe of a peer that has closed its
        # communicator raises (no message can come from it any more), so rank 0 returning
        # while rank 1 still probes would fail the loop below for a reason of its own.
        if comm.rank == 0:
            comm.send(np.arange(n, dtype=np.int32), 1, tag=1)
            comm.barrier()
            return None
        buf = np.zeros(2 * n, np.int32)[::2] if layout == "strided" else np.zeros(n, ">i4")
        req = comm.irecv(buf, 0, tag=1)
        while not req.done():
            comm.iprobe(0, 99)  # progress, as a user's loop makes it
        seen = buf.copy()
        req.wait()
        comm.barrier()
        return seen

    seen = run_ranks(2, body)[1]
    np.testing.assert_array_equal(seen, np.arange(n))


class _SlowStatus(plait.Status):
    """A request's status that holds up the thread settling the request: it says so
    (``started``), then waits (at most ``hold`` seconds) for the other thread to be done."""

    def __init__(self, hold: float) -> None:
        super().__init__()
        self.started = threading.Event()
        self.other_done = threading.Event()
        self.hold = hold

    def _set(self, *args: Any, **kwargs: Any) -> None:
        super()._set(*args, **kwargs)
        self.started.set()
        self.other_done.wait(self.hold)


@pytest.mark.parametrize("how", ["wait", "test", "done", "status", "wait_all"])
def test_a_second_thread_sees_a_request_complete_only_once_settled(how: str) -> None:
    """Two threads complete one strided receive. The one that did not fill the buffer
    returned at once, while the other was still writing the message back into it (or had not
    filled the status yet). Now it waits until the request is settled.

    The settling thread is held up inside the request (the status it fills) until the other
    thread has looked, or for ``hold`` seconds: the other thread blocks now, so the hold runs
    out and the test passes; before, it returned in the hold with the buffer unfilled."""
    n = 1000
    hold = 1.0

    def body(comm: plait.Communicator) -> Any:
        if comm.rank == 0:
            comm.recv(np.empty(1), 1, tag=9)  # the receive is posted
            comm.send(np.arange(n, dtype=np.float64), 1, tag=1)
            return None
        view = np.zeros(2 * n)[::2]
        req = comm.irecv(view, plait.ANY_SOURCE, plait.ANY_TAG)
        slow = _SlowStatus(hold)
        req._status = slow
        seen: list[Any] = []

        def other() -> None:
            slow.started.wait(60)
            try:
                if how == "wait":
                    req.wait()
                elif how == "test":
                    assert req.test()
                elif how == "done":
                    assert req.done()
                elif how == "status":
                    assert req.status is not None
                else:
                    plait.wait_all([req])
                st = req.status
                assert st is not None
                seen.append((view.copy(), st.source, st.tag))
            finally:
                slow.other_done.set()

        thread = threading.Thread(target=other)
        thread.start()
        comm.send(np.ones(1), 0, tag=9)
        req.wait()
        thread.join(60)
        return seen

    seen = run_ranks(2, body)[1]
    assert len(seen) == 1
    got, source, tag = seen[0]
    np.testing.assert_array_equal(got, np.arange(n, dtype=np.float64))
    assert (source, tag) == (0, 1)


def test_an_any_source_receive_cut_short_names_its_lost_sender() -> None:
    """A receive from ANY_SOURCE that has matched a message fails where the message's sender
    is lost before all of it has arrived (shared memory and TCP do so; the in-process
    transport moves a message at once, so its transport's part is played here: bind the
    receive to rank 2's message and fail it as a link that lost rank 2 does). The error's
    lost_rank is that sender; it was None, though the message named the rank."""
    comms = memory_communicators(3, timeout=10.0)
    try:
        req = comms[0].irecv(np.empty(4), plait.ANY_SOURCE, tag=1)
        ep = comms[0]._transport
        h = req._handle
        with ep.lock:  # as Endpoint._take_wild binds it, then as the lost link fails it
            ep._wild.remove(h)
            h.peer = 2
            ep.fail(h, plait.PeerLostError("rank 2 was lost: its process exited or was killed"))
        with pytest.raises(plait.PeerLostError, match=r"from any rank .*rank 2 was lost") as info:
            req.wait()
        assert info.value.lost_rank == 2
        # Every rank lost: no one rank to name.
        comms[1].close()
        comms[2].close()
        with pytest.raises(plait.PeerLostError, match="every rank") as every:
            comms[0].recv(np.empty(4), plait.ANY_SOURCE, tag=1)
        assert every.value.lost_rank is None
    finally:
        for c in comms:
            c.close()
