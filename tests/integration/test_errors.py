"""Bad input fails fast and cleanly; failures across ranks raise clear plait errors everywhere."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import plait
from plait.testing import memory_communicators, run_ranks

NONCOMMUTATIVE = plait.Op(np.subtract, commutative=False)

# (description, call, expected exception, message fragment). Every rank makes the same bad call.
BAD_CALLS: list[tuple[str, Callable[[plait.Communicator, np.ndarray], Any], type, str]] = [
    (
        "out dtype",
        lambda c, x: c.allreduce(x, out=np.empty(6, np.float32)),
        TypeError,
        "out has dtype float32; expected float64",
    ),
    (
        "out shape",
        lambda c, x: c.allreduce(x, out=np.empty(5)),
        ValueError,
        r"out has shape \(5,\); expected \(6,\)",
    ),
    (
        "read-only out",
        lambda c, x: c.allreduce(
            x,
            out=np.zeros(6)[::1].view().setflags(write=False) or np.broadcast_to(np.zeros(1), (6,)),
        ),
        ValueError,
        "read-only",
    ),
    (
        "root too big",
        lambda c, x: c.reduce(x, root=c.size),
        ValueError,
        r"root 3 is out of range; expected 0 <= root < 3",
    ),
    ("negative root", lambda c, x: c.broadcast(x, root=-1), ValueError, "root -1 is out of range"),
    ("root type", lambda c, x: c.gather(x, root="0"), TypeError, "root must be an int"),
    (
        "unknown algorithm",
        lambda c, x: c.allreduce(x, algorithm="bogus"),
        ValueError,
        "unknown algorithm 'bogus' for allreduce; expected 'auto' or one of: ",
    ),
    (
        "algorithm type",
        lambda c, x: c.allgather(x, algorithm=3),
        TypeError,
        "algorithm must be a str",
    ),
    (
        "unknown barrier algorithm",
        lambda c, x: c.barrier(algorithm="ring"),
        ValueError,
        "unknown algorithm 'ring' for barrier; expected 'auto' or one of: ",
    ),
    (
        "barrier algorithm type",
        lambda c, x: c.barrier(algorithm=np.array(["auto"])),
        TypeError,
        "algorithm must be a str",
    ),
    ("op as string", lambda c, x: c.allreduce(x, op="sum"), TypeError, "op must be a plait.Op"),
    (
        "BAND on float",
        lambda c, x: c.allreduce(x, op=plait.BAND),
        TypeError,
        "op BAND is not defined for float64",
    ),
    (
        "AVG on int",
        lambda c, x: c.allreduce(x.astype(np.int32), op=plait.AVG),
        TypeError,
        "op AVG is not defined for int32",
    ),
    (
        "MAX on complex",
        lambda c, x: c.allreduce(x.astype(np.complex64), op=plait.MAX),
        TypeError,
        "op MAX is not defined for complex64",
    ),
    (
        "non-commutative on ring",
        lambda c, x: c.allreduce(x, op=NONCOMMUTATIVE, algorithm="ring"),
        plait.UnsupportedError,
        "needs a commutative op",
    ),
    (
        "reduce_scatter rows",
        lambda c, x: c.reduce_scatter(x[:5]),
        ValueError,
        r"axis 0 of x must be a multiple of size 3 \(size\*k rows\); got shape \(5,\)",
    ),
    ("alltoall rows", lambda c, x: c.alltoall(x[:4]), ValueError, "multiple of size 3"),
    # An unhashable algorithm or op failed in the short path's lookup: "unhashable type".
    (
        "unhashable algorithm",
        lambda c, x: c.allreduce(x, algorithm=["ring"]),
        TypeError,
        r"allreduce: algorithm must be a str; got \['ring'\]",
    ),
    (
        "unhashable algorithm, broadcast",
        lambda c, x: c.broadcast(x, 0, algorithm=["ring"]),
        TypeError,
        r"broadcast: algorithm must be a str; got \['ring'\]",
    ),
    (
        "unhashable algorithm, gather",
        lambda c, x: c.gather(x, algorithm={"ring": 1}),
        TypeError,
        "gather: algorithm must be a str",
    ),
    ("unhashable op", lambda c, x: c.allreduce(x, [np.add]), TypeError, "op must be a plait.Op"),
    # reduce_scatter(counts=)'s out was refused in the name of reduce_scatterv.
    (
        "reduce_scatter counts out",
        lambda c, x: c.reduce_scatter(x, counts=[2, 2, 2], out=np.empty(2, np.float32)),
        TypeError,
        "rank [0-2]: reduce_scatter: out has dtype float32",
    ),
    ("scalar alltoall", lambda c, x: c.alltoall(x[0]), ValueError, r"got shape \(\)"),
    (
        "object dtype",
        lambda c, x: c.allreduce(np.array([object()] * 6)),
        TypeError,
        "dtype object is not supported",
    ),
    ("string dtype", lambda c, x: c.allgather(np.array(["a", "b"])), TypeError, "is not supported"),
    # An int past 64 bits was refused as "dtype object is not supported".
    (
        "int past 64 bits",
        lambda c, x: c.allreduce(2**70),
        TypeError,
        r"allreduce: x = 1180591620717411303424 does not fit in 64 bits \(int64 or uint64\)",
    ),
    ("timeout", lambda c, x: c.allreduce(x, timeout=-1), ValueError, "timeout must be positive"),
    ("dst out of range", lambda c, x: c.send(x, dst=3), ValueError, "dst=3 is invalid"),
    ("send to ANY_SOURCE", lambda c, x: c.send(x, dst=-1), ValueError, "ANY_SOURCE is for"),
    ("tag range", lambda c, x: c.send(x, dst=(c.rank + 1) % 3, tag=-2), ValueError, "tag -2 out"),
    (
        "recv read-only",
        lambda c, x: c.recv(np.broadcast_to(x, (2, 6)), src=(c.rank + 1) % 3),
        ValueError,
        "read-only",
    ),
]


@pytest.mark.parametrize(
    ("what", "call", "exc", "fragment"), BAD_CALLS, ids=[b[0] for b in BAD_CALLS]
)
def test_bad_input_raises_before_anything_moves(
    what: str, call: Any, exc: type, fragment: str
) -> None:
    def body(comm: plait.Communicator) -> Any:
        x = np.arange(6, dtype=np.float64) + comm.rank
        before = x.copy()
        with pytest.raises(exc, match=fragment) as info:
            call(comm, x)
        assert f"rank {comm.rank}" in str(info.value)
        assert np.array_equal(x, before), "a refused call modified its input"
        # The communicator still works, and all ranks are still in step.
        return comm.allreduce(x, timeout=10)

    for res in run_ranks(3, body):
        assert np.array_equal(res, 3 * np.arange(6) + 3)


def test_error_on_one_rank_times_out_the_others_and_breaks_the_communicator() -> None:
    # Nobody leaves (closing its endpoint) before all are done: the others must
    # see a silent peer, not a dead one.
    all_done = threading.Barrier(3)

    def body(comm: plait.Communicator) -> Any:
        x = np.ones(4)
        if comm.rank == 0:
            with pytest.raises(ValueError, match="out has shape"):
                comm.allreduce(x, out=np.empty(3))
        else:
            with pytest.raises(plait.CommTimeout) as info:
                comm.allreduce(x, timeout=0.5)
            assert "waiting for rank(s)" in str(info.value)
            with pytest.raises(plait.CommError, match="unusable after an earlier failure"):
                comm.allreduce(x)
        all_done.wait(30)

    run_ranks(3, body)


def test_timeout_names_the_missing_rank() -> None:
    all_done = threading.Barrier(3)

    def body(comm: plait.Communicator) -> Any:
        if comm.rank != 2:
            with pytest.raises(
                plait.CommTimeout, match=r"rank \d: allreduce \(ring, call #0\) timed out"
            ):
                comm.allreduce(np.ones(10), algorithm="ring", timeout=0.5)
        all_done.wait(30)

    run_ranks(3, body)


def test_a_groups_timeout_names_the_silent_rank_by_the_jobs_number_too() -> None:
    """Job rank 1's timeout on ``split(rank % 2)`` read "rank 0: ... waiting for rank(s)
    [1]": its group's numbers, which name other processes of the job."""
    done = threading.Event()

    def body(comm: plait.Communicator) -> Any:
        sub = comm.split(comm.rank % 2)
        if comm.rank == 3:
            done.wait(30)
            return None
        if comm.rank == 1:
            with pytest.raises(plait.CommTimeout) as info:
                sub.allreduce(np.ones(2), algorithm="ring", timeout=0.5)
            done.set()
            return str(info.value)
        return None

    said = run_ranks(4, body)[1]
    assert "waiting for rank(s) [1] (job rank(s) [3]) of communicator " in said, said


def test_timeout_lists_exactly_the_silent_rank() -> None:
    done = threading.Event()

    def body(comm: plait.Communicator) -> Any:
        if comm.rank == 1:
            done.wait(30)
            return None
        with pytest.raises(plait.CommTimeout, match=r"waiting for rank\(s\) \[1\]"):
            comm.gather(np.ones(2), root=0, algorithm="binomial", timeout=0.5)
        done.set()
        return None

    run_ranks(2, body)


def test_mismatched_counts_raise_mismatch_error() -> None:
    def body(comm: plait.Communicator) -> Any:
        x = np.ones(5 + comm.rank)
        with pytest.raises(plait.MismatchError, match=r"different call|bytes"):
            comm.allreduce(x, algorithm="recursive_doubling", timeout=10)

    run_ranks(2, body)


def _mismatched_call(comm: plait.Communicator) -> Callable[[], Any]:
    """Rank 0 allreduces (sends and receives); rank 1 is a leaf of a reduce (only sends).

    (Not a broadcast root: that waits for its witness, Note [rooted calls agree on the root].)
    """
    x = np.ones(8)
    if comm.rank == 0:
        return lambda: comm.allreduce(x, algorithm="recursive_doubling", timeout=10)
    return lambda: comm.reduce(x, root=0, algorithm="binomial", timeout=10)


def test_barriers_of_different_algorithms_raise_on_every_rank() -> None:
    def body(comm: plait.Communicator) -> Any:
        comm.barrier(algorithm="dissemination")  # forced, on every rank: no error
        with pytest.raises(plait.MismatchError, match=r"different (call|collectives)"):
            comm.barrier(algorithm="arena" if comm.rank else "dissemination", timeout=10)

    run_ranks(2, body)


def test_mismatched_collectives_raise_on_every_rank_that_waits() -> None:
    """Under zero buffering every send waits for its match, so both ranks see the mismatch."""

    def body(comm: plait.Communicator) -> Any:
        with pytest.raises(plait.MismatchError, match="different call"):
            _mismatched_call(comm)()

    run_ranks(2, body, lockstep=True)


def test_mismatched_collectives_a_rank_that_only_sends_raises_too() -> None:
    """A leaf of a reduce waits for the root's word before it ends (Note [the root's word] in
    plait.algos._rooted), so it raises in that call too: it used to return first, its message
    left unchecked at rank 0, and learn of the mismatch only in a later call."""

    def body(comm: plait.Communicator) -> Any:
        with pytest.raises(plait.MismatchError, match="different call"):
            _mismatched_call(comm)()
        return "raised"

    assert run_ranks(2, body) == ["raised", "raised"]


def test_mismatched_ops_raise_mismatch_error() -> None:
    def body(comm: plait.Communicator) -> Any:
        op = plait.SUM if comm.rank == 0 else plait.MAX
        with pytest.raises(plait.MismatchError):
            comm.allreduce(np.ones(8), op, algorithm="recursive_doubling", timeout=10)

    run_ranks(2, body)


def test_dead_peer_raises_peer_lost_on_every_rank() -> None:
    def body(comm: plait.Communicator) -> Any:
        if comm.rank == 1:
            comm.close()  # as if the process died before the call
            return None
        # Rank 1, not a rank that closed after failing on it (Note [peers that close])
        with pytest.raises(plait.PeerLostError, match=r"rank 1 (has )?closed") as info:
            comm.allreduce(np.ones(100), algorithm="ring", timeout=30)
        assert info.value.lost_rank == 1
        return None

    run_ranks(4, body)


def test_in_place_failure_says_buffer_is_undefined() -> None:
    done = threading.Event()

    def body(comm: plait.Communicator) -> Any:
        if comm.rank == 1:
            done.wait(30)
            return None
        x = np.ones(4)
        with pytest.raises(plait.CommTimeout, match="contents are undefined"):
            comm.allreduce(x, out=x, timeout=0.3)
        done.set()
        return None

    run_ranks(2, body)


def test_a_failed_broadcast_leaves_roots_x_as_it_was_and_says_so() -> None:
    """Root only reads its ``x``: its error said the buffer's contents were undefined."""

    def body(comm: plait.Communicator) -> Any:
        x = np.arange(4.0) if comm.rank == 0 else np.zeros(4, np.float32)  # dtypes differ
        with pytest.raises(plait.MismatchError) as info:
            comm.broadcast(x, root=0)
        return "undefined" in str(info.value), x.tolist()

    (root_says, root_x), (other_says, _) = run_ranks(2, body, window=0)
    assert (root_says, root_x) == (False, [0.0, 1.0, 2.0, 3.0])
    assert other_says


def test_closed_communicator() -> None:
    def body(comm: plait.Communicator) -> Any:
        comm.close()
        comm.close()  # idempotent
        with pytest.raises(plait.ClosedError, match=f"rank {comm.rank}: barrier on a closed"):
            comm.barrier()

    run_ranks(2, body)


def test_error_tree() -> None:
    for cls in (
        plait.CommTimeout,
        plait.PeerLostError,
        plait.MismatchError,
        plait.ClosedError,
        plait.UnsupportedError,
        plait.TransportError,
        plait.RendezvousError,
        plait.InternalError,
        plait.ForkedError,
    ):
        assert issubclass(cls, plait.CommError)
    assert issubclass(plait.CommTimeout, TimeoutError)
    assert issubclass(plait.UnsupportedError, ValueError)


def test_debug_detail_names_every_ranks_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLAIT_DEBUG", "detail")

    def body(comm: plait.Communicator) -> Any:
        assert np.array_equal(comm.allreduce(np.ones(4)), np.full(4, 3.0))  # same calls: fine
        x = np.ones(5 + comm.rank % 2)
        with pytest.raises(plait.MismatchError) as info:
            comm.allreduce(x, algorithm="ring")
        return str(info.value)

    for msg in run_ranks(3, body):
        assert "ranks [0, 2]: allreduce(count=5, dtype=float64, op=SUM" in msg
        assert "ranks [1]: allreduce(count=6" in msg


@pytest.mark.parametrize(
    ("algorithm", "mismatch"),
    # With recursive doubling at 3 ranks, rank 0 receives nothing from rank 1 before rank 1
    # has heard from rank 2: a mismatch there is told by the stall probes, after a second.
    [("direct", False), ("recursive_doubling", False), ("direct", True)],
)
def test_a_failed_peer_is_reported_at_once_while_another_is_late(
    algorithm: str, mismatch: bool
) -> None:
    """Rank 1 is gone (or calls with another count) while rank 2 never comes: rank 0 raises
    rank 1's error at once, whichever handle of the call it happens to wait for first, rather
    than waiting out the deadline on rank 2."""
    comms = memory_communicators(3, timeout=30.0)
    try:
        if mismatch:

            def late_and_wrong() -> None:  # rank 2 never comes, so this call fails too
                with pytest.raises(plait.CommError):
                    comms[1].allreduce(np.ones(8, np.float32), algorithm=algorithm, timeout=5.0)

            other = threading.Thread(target=late_and_wrong)
            other.start()
        else:
            comms[1].close()
        start = time.monotonic()
        want = plait.MismatchError if mismatch else plait.PeerLostError
        with pytest.raises(want, match="rank 1"):
            comms[0].allreduce(np.ones(4, np.float32), algorithm=algorithm)
        assert time.monotonic() - start < 0.8  # the probes' verdict would take a second
        if mismatch:
            other.join(10)
    finally:
        for c in comms:
            c.close()


@pytest.mark.parametrize("algorithm", ["arena_leader", "arena_oneshot", "arena"])
def test_a_rank_waiting_on_a_late_peer_hears_at_once_of_another_that_closed(
    algorithm: str,
) -> None:
    """Rank 0 has closed before the call; rank 1 is late. Rank 2, whose wait was on rank 1
    (arena_leader waits on the other non-leaders before the leader), raised only once rank
    1 came, or at its timeout (Note [members lost] in plait.transport.shm.link)."""
    comms = memory_communicators(3, timeout=30.0)
    try:
        comms[0].close()
        late = threading.Timer(2.0, _late_call, (comms[1], algorithm))
        late.start()
        start = time.monotonic()
        with pytest.raises(plait.PeerLostError, match=r"rank 0 (has )?closed its comm") as info:
            comms[2].allreduce(np.ones(4, np.float32), algorithm=algorithm)
        assert time.monotonic() - start < 1.5
        assert info.value.lost_rank == 0
        late.join(10)
    finally:
        for c in comms:
            c.close()


@pytest.mark.parametrize("algorithm", ["arena_leader", "arena_oneshot", "arena"])
def test_a_late_rank_hears_why_its_peers_gave_up(algorithm: str) -> None:
    """Ranks 0 and 1 give up on a one-sided call at their timeout; rank 2, coming later,
    heard of it as "an error of its own" (a close: tests/multiprocess/test_faults.py)."""
    x = np.ones(4, np.float32)

    def calls(comms: list[plait.Communicator], ranks: list[int], **kw: Any) -> list[Any]:
        got: list[Any] = [None] * len(comms)

        def call(r: int) -> None:
            try:
                comms[r].allreduce(x, algorithm=algorithm, **kw)
            except plait.CommError as exc:
                got[r] = exc

        threads = [threading.Thread(target=call, args=(r,)) for r in ranks]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        return got

    comms = memory_communicators(3, timeout=30.0)
    try:
        timed_out = calls(comms, [0, 1], timeout=0.2)
        assert all(isinstance(e, plait.CollectiveTimeout) for e in timed_out[:2]), timed_out
        with pytest.raises(plait.PeerLostError, match=r"rank [01] gave up on the call when its "
                           "timeout passed"):  # fmt: skip
            comms[2].allreduce(x, algorithm=algorithm)
    finally:
        for c in comms:
            c.close()


def _late_call(comm: plait.Communicator, algorithm: str) -> None:
    with contextlib.suppress(plait.CommError):
        comm.allreduce(np.ones(4, np.float32), algorithm=algorithm)


def test_a_root_only_one_rank_disagrees_on_is_found_by_that_rank() -> None:
    """Rank 3 takes rank 1 for the root of a broadcast that ranks 0-2 root at 0: rank 1, a
    leaf, never sends to it, and the others go on without stalling, so none read its probes.
    Rank 3 waited out its timeout, keeping every later message of its parent (Note [foreign
    messages] in plait.runtime.stall)."""
    comms = memory_communicators(4, timeout=15.0)
    try:

        def body(r: int) -> tuple[str, float]:
            start = time.monotonic()
            try:
                for i in range(4):
                    root = 1 if (r == 3 and i == 2) else 0
                    comms[r].broadcast(np.full(100, float(r)), root, algorithm="binomial")
            except plait.CommError as exc:
                return type(exc).__name__, time.monotonic() - start
            return "", time.monotonic() - start

        results: dict[int, tuple[str, float]] = {}
        threads = [
            threading.Thread(target=lambda r=r: results.__setitem__(r, body(r))) for r in range(4)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        kind, seconds = results[3]
        assert kind == "MismatchError", results
        assert seconds < 5, results
    finally:
        for c in comms:
            c.close()


FORKS = """
import os, sys
import numpy as np
import plait
from plait.testing import memory_communicators

comm = memory_communicators(1, timeout=5)[0]
comm.allreduce(np.ones(2))
pid = os.fork()
if pid == 0:
    try:
        comm.allreduce(np.ones(2))
        said = "no error"
    except plait.ForkedError as exc:
        said = str(exc)
    comm.close()  # (leaving a with block): touches nothing of the parent's
    print("child:", said, flush=True)
    os._exit(0)
os.waitpid(pid, 0)
print("parent:", comm.allreduce(np.ones(2)).tolist(), flush=True)
comm.close()
"""


FORKED_RECOVERY = """
import os, sys
import numpy as np
import plait
from plait.testing import memory_communicators

comm = memory_communicators(1, timeout=5)[0]
req = comm.irecv(np.zeros(2), 0, tag=4)  # posted before the fork
pid = os.fork()
if pid == 0:
    for name, call in [
        ("wait", lambda: req.wait(1)),
        ("test", req.test),
        ("wait_any", lambda: plait.wait_any([req], timeout=1)),
        ("cancel", req.cancel),
        ("abort", comm.abort),
        ("agree", comm.agree),
        ("shrink", comm.shrink),
    ]:
        try:
            call()
            print(name, "no error", flush=True)
        except plait.ForkedError as exc:
            print(name, "ForkedError", str(exc).split(": this")[0], flush=True)
    os._exit(0)
os.waitpid(pid, 0)
comm.send(np.ones(2), 0, tag=4)
print("parent:", req.wait(5).tolist(), comm.allreduce(np.ones(2)).tolist(), flush=True)
comm.close()
"""


def test_a_forked_child_cannot_wait_abort_agree_or_shrink_its_parents() -> None:
    """A request's wait in the child took the parent's message off its transport, and abort,
    agree and shrink there acted on the parent's job through its store and transport: the
    peers were aborted, or an agreement was given up as the parent's rank."""
    import subprocess
    import sys

    res = subprocess.run(
        [sys.executable, "-c", FORKED_RECOVERY], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stderr
    *child, parent = res.stdout.splitlines()
    assert child == [
        "wait ForkedError rank 0: irecv: wait",
        "test ForkedError rank 0: irecv: test",
        "wait_any ForkedError rank 0: wait_any",
        "cancel ForkedError rank 0: irecv: cancel",
        "abort ForkedError rank 0: abort",
        "agree ForkedError rank 0: agree",
        "shrink ForkedError rank 0: shrink",
    ], res.stdout
    assert parent == "parent: [1.0, 1.0] [1.0, 1.0]"


def test_a_forked_child_cannot_use_its_parents_communicator() -> None:
    """A child made by fork used its parent's communicator: it took part in the parent's
    calls (the ranks disagreed on the results, with no error), and its close() broke the
    parent's (Note [communicators after fork] in plait._fork)."""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-c", FORKS], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    child, parent = res.stdout.splitlines()
    assert child.startswith("child: rank 0: allreduce: this communicator belongs to process")
    assert "call plait.init in the child" in child
    assert parent == "parent: [1.0, 1.0]"
