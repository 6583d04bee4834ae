"""Mismatched calls that exchange no message fail on every rank in seconds (stall probes).

Ranks run as threads over the in-process transport without a window, so every call takes
the message path that :mod:`plait.runtime.stall` guards; the same over real processes is in
``tests/multiprocess/test_faults.py``.
"""

from __future__ import annotations

import operator
import threading
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import plait
import plait.testing
from plait.compression import FP16
from plait.runtime import crossing, notices, posts, stall
from plait.runtime.executor import Call
from plait.runtime.stall import GRACE_SECONDS, PROBE_SECONDS
from plait.testing import run_ranks

#: Far below the calls' timeout: a mismatch is found by the probes, not by the deadline.
SOON = 4 * (PROBE_SECONDS + GRACE_SECONDS)


def _outcome(fn: Any) -> tuple[str, float, str]:
    """The error's class, the seconds until it came, and its message without the dump's path
    (which holds the test's name, and so the names the checks look for)."""
    start = time.monotonic()
    try:
        fn()
    except plait.CommError as exc:
        text = str(exc).split("; flight recorder dump:")[0]
        return type(exc).__name__, time.monotonic() - start, text
    return "ok", time.monotonic() - start, ""


def test_allreduce_against_broadcast_fails_everywhere() -> None:
    def body(comm: plait.Communicator) -> tuple[str, float, str]:
        x = np.ones(5, np.float32)
        if comm.rank == 0:
            # Binomial: rank 0 waits to receive from its children as they wait to receive
            # from it. The broadcast's witness (rank 1) tells its root, rank 0, that it is in
            # the call (Note [rooted calls agree on the root]), and rank 0 finds the mismatch
            # in that message; ranks 1 and 2 learn it from rank 0's verdict.
            return _outcome(lambda: comm.allreduce(x, algorithm="binomial"))
        return _outcome(lambda: comm.broadcast(x, root=0))

    results = run_ranks(3, body, timeout=60, window=0)
    assert [r[0] for r in results] == ["MismatchError"] * 3, results
    assert all(r[1] < SOON for r in results), results
    assert "received from rank 1 a message of a different call" in results[0][2], results
    assert "rank 0 found that the ranks called different collectives" in results[2][2], results


@pytest.mark.parametrize("size", [2, 3, 4])
def test_reduce_with_different_roots_fails_everywhere(size: int) -> None:
    # With 3 ranks rank 1 is a leaf of both trees: it sends and returns, and learns of the
    # mismatch in its next call (a verdict of the ranks that found it).
    def body(comm: plait.Communicator) -> tuple[str, float, str]:
        x = np.ones(3)
        root = comm.rank if size == 2 else (2 if comm.rank == 2 else 0)

        def calls() -> None:
            comm.reduce(x, root=root)
            comm.barrier()

        return _outcome(calls)

    results = run_ranks(size, body, timeout=60, window=0)
    assert [r[0] for r in results] == ["MismatchError"] * size, results
    assert all(r[1] < SOON for r in results), results


#: Rooted calls that move data out of the root, each called with this rank's idea of the root.
OUT_OF_ROOT: dict[str, Any] = {
    "broadcast": lambda comm, root: comm.broadcast(np.full(3, float(comm.rank)), root),
    "scatter": lambda comm, root: comm.scatter(np.arange(2.0 * comm.size), root),
    "scatterv": lambda comm, root: comm.scatterv(
        np.arange(1.0 * comm.size), [1] * comm.size, root, out=np.empty(1)
    ),
    "bcast_object": lambda comm, root: comm.bcast_object(comm.rank, root),
    "scatter_object": lambda comm, root: comm.scatter_object(list(range(comm.size)), root),
}


@pytest.mark.parametrize(
    "window", [0, plait.testing.DEFAULT_WINDOW_BYTES], ids=["messages", "window"]
)
@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("collective", list(OUT_OF_ROOT))
def test_a_rooted_call_with_different_roots_fails_everywhere(
    collective: str, size: int, window: int
) -> None:
    # Each root sends and nobody of the other opinion receives: every rank used to finish,
    # some with their own data (Note [rooted calls agree on the root]). 2 ranks: each its own
    # root; 3: rank 1 alone thinks it is the root; 4: ranks 0, 1 say 0 and ranks 2, 3 say 2,
    # two groups that agree within themselves.
    roots = {2: [0, 1], 3: [0, 1, 0], 4: [0, 0, 2, 2]}[size]

    def body(comm: plait.Communicator) -> tuple[str, float, str]:
        def calls() -> None:
            OUT_OF_ROOT[collective](comm, roots[comm.rank])
            comm.barrier()

        return _outcome(calls)

    results = run_ranks(size, body, timeout=60, window=window)
    assert [r[0] for r in results] == ["MismatchError"] * size, results
    assert all(r[1] < SOON for r in results), results


@pytest.mark.parametrize("count", [1, 3, 9])
@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("algorithm", ["binomial", "scatter_allgather"])
def test_each_broadcast_algorithm_finds_ranks_that_differ_on_the_root(
    algorithm: str, size: int, count: int
) -> None:
    """scatter_allgather had no witness: with fewer elements than ranks every chunk but the
    first is empty, the root received nothing, and ranks that differed on the root each
    returned (some with their own data), and so did the barrier after."""
    roots = {2: [0, 1], 3: [0, 1, 0], 4: [0, 0, 2, 2]}[size]

    def body(comm: plait.Communicator) -> tuple[str, float, str]:
        def calls() -> None:
            x = np.full(count, float(comm.rank))
            comm.broadcast(x, roots[comm.rank], algorithm=algorithm)
            comm.barrier()

        return _outcome(calls)

    results = run_ranks(size, body, timeout=60, window=0)
    assert [r[0] for r in results] == ["MismatchError"] * size, results
    assert all(r[1] < SOON for r in results), results


#: Calls where the last rank passes nothing and the others something (or, ``roots``, where
#: every rank passes nothing and the ranks disagree on the root).
EMPTY_ON_ONE: dict[str, Any] = {
    "allreduce": lambda comm, none: comm.allreduce(np.ones(0 if none else 3)),
    "reduce": lambda comm, none: comm.reduce(np.ones(0 if none else 3), root=0),
    "allgather": lambda comm, none: comm.allgather(np.ones(0 if none else 3)),
    "gatherv": lambda comm, none: comm.gatherv(
        np.ones(0 if none else 1), [0 if none else 1] * comm.size, root=0
    ),
    "reduce roots": lambda comm, none: comm.reduce(np.ones(0), root=comm.rank % 2),
}


@pytest.mark.parametrize(
    "window", [0, plait.testing.DEFAULT_WINDOW_BYTES], ids=["messages", "window"]
)
@pytest.mark.parametrize("case", list(EMPTY_ON_ONE))
def test_an_empty_call_against_others_fails_every_rank_in_the_call(case: str, window: int) -> None:
    # A call with nothing to move recorded no step, and its rank returned at once as if it
    # had succeeded while its peers waited for what it never sent (until its next call, or
    # their timeout). It now meets its peers (Note [empty calls meet] in
    # plait.algos._presence), and every rank raises in the call; no call follows.
    size = 3

    def body(comm: plait.Communicator) -> tuple[str, float, str]:
        return _outcome(lambda: EMPTY_ON_ONE[case](comm, comm.rank == size - 1))

    results = run_ranks(size, body, timeout=60, window=window)
    assert [r[0] for r in results] == ["MismatchError"] * size, results
    assert all(r[1] < SOON for r in results), results


#: A call plait makes of others (on the last rank) against the user's call that looks like
#: its first part (on the others).
INNER_ON_ONE = {
    "split": (lambda c: c.split(0), lambda c: c.allgather(np.zeros(2, np.int64))),
    "gatherv without counts": (
        lambda c: c.gatherv(np.ones(1), root=0),
        lambda c: c.allgather(np.zeros((), np.int64)),
    ),
    "allgather_object": (
        lambda c: c.allgather_object("x"),
        lambda c: c.allgather(np.zeros((), np.uint64)),
    ),
    "bcast_object": (
        lambda c: c.bcast_object("x", root=0),
        lambda c: c.broadcast(np.zeros((), np.uint64), root=0),
    ),
    # allreduce_object is an allgather_object and a fold: its inner calls carried
    # allgather_object's purpose, so one rank's allreduce_object went through with the
    # others' allgather_object, every rank returning as if they matched.
    "allreduce_object": (
        lambda c: c.allreduce_object(c.rank, operator.add),
        lambda c: c.allgather_object(c.rank),
    ),
}


@pytest.mark.parametrize(
    "window", [0, plait.testing.DEFAULT_WINDOW_BYTES], ids=["messages", "window"]
)
@pytest.mark.parametrize("case", list(INNER_ON_ONE))
def test_a_call_within_a_call_never_matches_the_users_call(case: str, window: int) -> None:
    # split's allgather of each rank's color and key had the check word of a user's
    # allgather of two int64: one rank's split against the others' allgather went through
    # (over messages every rank ended as if it had succeeded). An inner call carries its
    # purpose in its check word (Note [calls within calls] in plait._request).
    size = 3
    inner, lookalike = INNER_ON_ONE[case]

    def body(comm: plait.Communicator) -> tuple[tuple[str, float, str], str]:
        got = _outcome(lambda: (inner if comm.rank == size - 1 else lookalike)(comm))
        after = _outcome(comm.barrier)[0]
        return got, after

    results = run_ranks(size, body, timeout=60, window=window)
    assert results[-1][0][0] == "MismatchError", results
    assert all(r[0][1] < SOON for r in results), results
    if case == "bcast_object" and not window:  # the ranks that agree with root may end
        assert all("MismatchError" in (r[0][0], r[1]) for r in results), results
    else:
        assert [r[0][0] for r in results] == ["MismatchError"] * size, results


@pytest.mark.parametrize("size", [3, 4])
@pytest.mark.parametrize(
    ("collective", "algorithm"),
    [
        ("gatherv", "direct"),
        ("gatherv", "binomial"),
        ("allgatherv", "direct"),
        ("allgatherv", "ring"),
    ],
)
def test_a_rank_without_rows_that_disagrees_fails_every_rank(
    collective: str, algorithm: str, size: int
) -> None:
    # The last rank has no rows in every rank's eyes but disagrees on another rank's count:
    # it sent nothing, so the others had everything without it (a gatherv's root sent its
    # word) and every rank but the last (an allgatherv: but its ring neighbour) ended as if
    # the call had succeeded. A rank (a subtree) without rows now sends a one-element token
    # where its rows would go, checked like any message (Note [the root's word]).
    def body(comm: plait.Communicator) -> tuple[str, float, str]:
        counts = [1] * (size - 1) + [0]
        if comm.rank == size - 1:
            counts[0] = 2
        x = np.ones(counts[comm.rank])
        if collective == "gatherv":
            return _outcome(lambda: comm.gatherv(x, counts, root=0, algorithm=algorithm))
        return _outcome(lambda: comm.allgatherv(x, counts, algorithm=algorithm))

    results = run_ranks(size, body, timeout=60, window=0)
    assert [r[0] for r in results] == ["MismatchError"] * size, results
    assert all(r[1] < SOON for r in results), results


@pytest.mark.parametrize(
    "window", [0, plait.testing.DEFAULT_WINDOW_BYTES], ids=["messages", "window"]
)
def test_empty_calls_that_agree_meet_and_succeed(window: int) -> None:
    # The other side: ranks that all pass nothing meet like a barrier (none ends before the
    # last has begun) and return empty results.
    late = 0.3

    def body(comm: plait.Communicator) -> tuple[list[int], float]:
        if comm.rank == 2:
            time.sleep(late)  # the late rank under test
        start = time.monotonic()
        got = [comm.allreduce(np.ones(0)).size]
        waited = time.monotonic() - start
        got.append(comm.allgather(np.ones(0)).size)
        r = comm.reduce(np.ones(0), root=1)
        got.append(-1 if r is None else r.size)
        return got, waited

    results = run_ranks(3, body, timeout=30, window=window)
    assert [r[0] for r in results] == [[0, 0, -1], [0, 0, 0], [0, 0, -1]]
    assert all(r[1] > late / 2 for r in results[:2]), results


def test_empty_calls_run_where_a_call_number_is_reserved_ahead() -> None:
    # A call whose number is reserved ahead (an uneven call that learns its counts first, a
    # compressed allreduce, async) runs only message-passing schedules: an empty call of a
    # message-passing algorithm meets its peers by messages, even where they share a window.
    def body(comm: plait.Communicator) -> tuple[int, int | None, int]:
        a = comm.allgatherv(np.ones(0), async_op=True).wait()
        g = comm.gatherv(np.ones(0), root=0, async_op=True).wait()
        r = comm.allreduce(np.ones(0, np.float32), compression=FP16(), async_op=True).wait()
        return a.size, None if g is None else g.size, r.size

    results = run_ranks(3, body, timeout=30, window=plait.testing.DEFAULT_WINDOW_BYTES)
    assert results == [(0, 0, 0), (0, None, 0), (0, None, 0)]


@pytest.mark.parametrize("size", [3, 4])
@pytest.mark.parametrize("collective", ["broadcast", "scatter"])
def test_a_one_sided_rooted_call_with_different_roots_fails_in_the_call(
    collective: str, size: int
) -> None:
    # One-sided, every rank posts once it has read its first piece and waits for every other
    # rank's post before it ends (Note [rooted calls agree on the root]), so no rank ends with
    # a root's data while another raises: each raises in the call itself, no later call needed.
    roots = {3: [0, 1, 0], 4: [0, 0, 2, 2]}[size]

    def body(comm: plait.Communicator) -> tuple[str, float, str]:
        outcome = _outcome(lambda: OUT_OF_ROOT[collective](comm, roots[comm.rank]))
        last = comm._runner.recorder.snapshot()[-1]["algorithm"]  # type: ignore[union-attr]
        return (*outcome[:2], last)

    results = run_ranks(size, body, timeout=60, window=plait.testing.DEFAULT_WINDOW_BYTES)
    assert [r[0] for r in results] == ["MismatchError"] * size, results
    assert all(r[1] < SOON for r in results), results
    assert all(r[2] == "arena" for r in results), results


#: One-sided calls (window) and message calls that wait on each other in a mismatch.
ONE_SIDED: dict[str, Any] = {
    "gather0": lambda comm: comm.gather(np.ones(3), root=0),
    "gather1": lambda comm: comm.gather(np.ones(3), root=1),
    "scatter0": lambda comm: comm.scatter(np.ones(3 * comm.size), root=0),
    "gather0_f32": lambda comm: comm.gather(np.ones(3, np.float32), root=0),
    "arena": lambda comm: comm.allreduce(np.ones(3), algorithm="arena"),
    "ring": lambda comm: comm.allreduce(np.ones(3), algorithm="ring"),
    "barrier": lambda comm: comm.barrier(),
    "bcast_object": lambda comm: comm.bcast_object({"a": 1}, root=0),
}


@pytest.mark.parametrize(
    ("plan", "then"),
    [
        # Each waits for a post the other never makes (no digest is ever read).
        (["gather0", "scatter0"], "barrier"),
        (["gather0", "gather1"], "barrier"),
        # Rank 2 agrees with rank 0 and finishes its part: it learns in its next call, a
        # one-sided one or a message one, though the ranks that found the mismatch live on.
        (["gather0", "gather1", "gather0"], "barrier"),
        (["gather0", "gather1", "gather0"], "ring"),
        (["gather0_f32", "gather0", "gather0"], "barrier"),
        (["gather0_f32", "gather0", "gather0"], "ring"),
        # A one-sided call against message calls: each side waits on the other.
        (["arena", "ring"], "barrier"),
        (["arena", "ring", "ring"], "barrier"),
        # Ranks 0 and 1 finish two one-sided broadcasts between themselves; their barrier
        # then waits at its start for ranks 2 and 3 to end a call they gave up on.
        (["bcast_object", "bcast_object", "arena", "arena"], "barrier"),
    ],
    ids=lambda v: "-".join(v) if isinstance(v, list) else v,
)
def test_one_sided_mismatches_fail_everywhere_while_every_rank_lives(
    plan: list[str], then: str
) -> None:
    # The ranks that raise stay alive (a closed rank says enough by itself): what each
    # rank learns comes from posts, probes and verdicts alone.
    size = len(plan)
    alive = threading.Barrier(size)

    def body(comm: plait.Communicator) -> tuple[str, float, str]:
        def calls() -> None:
            ONE_SIDED[plan[comm.rank]](comm)
            ONE_SIDED[then](comm)

        outcome = _outcome(calls)
        alive.wait(60)
        return outcome

    results = run_ranks(size, body, timeout=30, window=plait.testing.DEFAULT_WINDOW_BYTES)
    assert [r[0] for r in results] == ["MismatchError"] * size, results
    assert all(r[1] < SOON for r in results), results


def test_a_lost_rank_fails_every_call_that_waits_behind_it() -> None:
    # Rank 1 leaves; in a ring allreduce rank 2 waits on it, rank 0 sends to it, and rank 3
    # waits only on rank 2, which is alive: rank 3 learns from a notice of rank 0 or 2 that
    # rank 1 is gone, instead of timing out and blaming rank 2. Rank 1 closed its
    # communicator (threads cannot die), and the notice says so (Note [peers that close]).
    alive = threading.Barrier(3)

    def body(comm: plait.Communicator) -> tuple[str, float, str, int | None]:
        if comm.rank == 1:
            return "left", 0.0, "", None  # run_ranks closes its communicator
        start = time.monotonic()
        try:
            comm.allreduce(np.ones(5), algorithm="ring")
        except plait.PeerLostError as exc:
            alive.wait(60)
            return "PeerLostError", time.monotonic() - start, str(exc), exc.lost_rank
        return "ok", time.monotonic() - start, "", None

    results = run_ranks(4, body, timeout=30, window=0)
    survivors = [results[r] for r in (0, 2, 3)]
    assert [r[0] for r in survivors] == ["PeerLostError"] * 3, results
    assert all(r[1] < SOON for r in survivors), results
    assert [r[3] for r in survivors] == [1, 1, 1], results
    said = "rank 1 closed its communicator during the call (rank {} found so"
    assert said.format(0) in results[3][2] or said.format(2) in results[3][2], results[3]


def test_a_group_names_its_own_ranks_in_a_lost_peer_error() -> None:
    # The group's transport hands out the job's handles, whose errors name the job's ranks.
    def body(comm: plait.Communicator) -> tuple[str, int | None]:
        group = comm.split(comm.rank % 2)  # job ranks 1 and 3 are ranks 0 and 1 of theirs
        if comm.rank != 1:
            return "", None
        comm.barrier()  # job rank 3 closes after this (run_ranks closes it on return)
        try:
            group.allreduce(np.ones(3), algorithm="ring", timeout=20)
        except plait.PeerLostError as exc:
            return str(exc), exc.lost_rank
        return "no error", None

    def others(comm: plait.Communicator) -> tuple[str, int | None]:
        out = body(comm)
        if comm.rank != 1:
            comm.barrier()
        return out

    text, lost = run_ranks(4, others, timeout=30, window=0)[1]
    assert text.startswith("rank 0: allreduce (ring, call #0): "), text
    assert "rank 1 (job rank 3)" in text, text
    assert "rank 3 " not in text.replace("job rank 3", ""), text
    assert lost == 1


def test_slow_rank_is_not_a_mismatch() -> None:
    # Rank 1 arrives long after the others have probed (and rank 2, a leaf of the reduce,
    # waits in the next call meanwhile): a slow peer is no evidence of a mismatch.
    def body(comm: plait.Communicator) -> Any:
        x = np.full(4, comm.rank + 1.0)
        if comm.rank == 1:
            time.sleep(PROBE_SECONDS + GRACE_SECONDS + 1.0)  # the slow rank under test
        r = comm.reduce(x, root=0)
        comm.barrier()
        return comm.allreduce(x), r

    results = run_ranks(3, body, timeout=60, window=0)
    for total, _ in results:
        np.testing.assert_array_equal(total, np.full(4, 6.0))
    np.testing.assert_array_equal(results[0][1], np.full(4, 6.0))


def test_timeout_names_the_rank_at_the_end_of_the_chain() -> None:
    # A ring: rank 3 stays away, and each of the others waits on its left neighbour, so
    # only rank 0 waits on rank 3 itself. The probes of the others say on whom they wait,
    # and every timeout names rank 3 as the likeliest cause, not a healthy neighbour.
    done = threading.Barrier(3)  # no rank returns (and closes) before all three timed out

    def body(comm: plait.Communicator) -> str:
        if comm.rank == 3:
            time.sleep(4.0)  # the absent rank under test, alive and silent past the timeout
            return ""
        try:
            comm.allreduce(np.ones(4), algorithm="ring", timeout=2.5)
        except plait.CollectiveTimeout as exc:
            done.wait(30)
            return str(exc)
        return "no timeout"

    results = run_ranks(4, body, timeout=60, window=0)
    for msg in results[:3]:
        assert "rank(s) [3] did not say they wait: the likeliest cause" in msg, msg
        assert "or cut off from this rank's network)" in msg, msg  # a partition too
    assert "rank 1 waits in this call too, for rank(s) [0]" in results[2], results[2]


@pytest.mark.parametrize(
    "window", [0, plait.testing.DEFAULT_WINDOW_BYTES], ids=["messages", "window"]
)
def test_crossed_calls_of_two_communicators_are_named_where_threads_may_undo_them(
    window: int, caplog: pytest.LogCaptureFixture
) -> None:
    # Rank 0 calls the world then the group, rank 1 the group then the world. Ranks that
    # are threads of one process may yet be undone by another thread (Note [crossed calls]
    # in plait.runtime.crossing), so they log the crossing and wait: the timeout names it.
    done = threading.Barrier(2)  # no rank returns (and closes) before both timed out

    def body(comm: plait.Communicator) -> str:
        group = comm.split(0)
        x = np.ones(3)
        try:
            if comm.rank == 0:
                comm.allreduce(x, timeout=PROBE_SECONDS + 2.5)
                group.allreduce(x)
            else:
                group.allreduce(x, timeout=PROBE_SECONDS + 2.5)
        except plait.CollectiveTimeout as exc:
            done.wait(30)
            return str(exc)
        return "no timeout"

    with caplog.at_level("WARNING", logger="plait"):
        results = run_ranks(2, body, timeout=60, window=window)
    crossed = "a call this rank has not begun, while this rank waits for it here"
    assert all(crossed in msg for msg in results), results
    assert "job rank 1 waits in allreduce" in results[0], results[0]
    assert "job rank 0 waits in allreduce" in results[1], results[1]
    assert "of the world communicator" in results[1], results[1]
    logged = [r.getMessage() for r in caplog.records if crossed in r.getMessage()]
    assert len(logged) == 2, logged  # once per rank
    assert all("unless another thread of this rank or of job rank" in m for m in logged)


def _stalled_alone(timeout: float) -> str:
    """What rank 0 of 2 raises in an allreduce over messages (its class's name) while rank 1
    stays away long enough for it to probe."""

    def body(comm: plait.Communicator) -> str:
        if comm.rank == 1:
            time.sleep(PROBE_SECONDS + 1.0)  # away until rank 0 has stalled a while
            return ""
        return _outcome(lambda: comm.allreduce(np.ones(2), timeout=timeout))[0]

    return run_ranks(2, body, timeout=60, window=0)[0]


def test_a_rank_with_one_communicator_sends_one_whereabouts_a_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A point-to-point wait of the same communicator may cross it (Note [crossed calls]), so
    # a stalled call tells the rank it waits on where it waits even with one communicator:
    # once a call (a notice to a rank that never stalls waits among its unexpected messages,
    # as its probes do).
    sent: list[int] = []
    monkeypatch.setattr(crossing.Crossing, "_send", lambda self, p, payload: sent.append(p))

    assert _stalled_alone(PROBE_SECONDS + 0.5) == "CollectiveTimeout"
    assert sent == [1]


def test_a_prober_whose_first_look_raises_withdraws_its_receives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The prober that a message call makes once it has stalled looks at once; where that
    # look raised, the call never held the prober, and its receives (on the probe tag, and
    # the whereabouts tag every communicator of the transport shares) stayed posted.
    made: list[stall.Prober] = []

    def check(self: stall.Prober, waiting: Any) -> None:
        made.append(self)
        raise plait.MismatchError("the first look finds a mismatch (test)")

    monkeypatch.setattr(stall.Prober, "check", check)

    assert _stalled_alone(PROBE_SECONDS + 5) == "MismatchError"
    assert made, "the call never probed"
    assert made[0].handles == []  # withdrawn


def test_a_prober_whose_start_raises_withdraws_its_receives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Its start sends each peer a probe and posts a receive for that peer's; a send that
    # raised (a peer lost meanwhile) left the receives already posted behind.
    made: list[stall.Prober] = []
    real_init, real_send = stall.Prober.__init__, stall.Prober._send

    def init(self: stall.Prober, *args: Any) -> None:
        real_init(self, *args)
        made.append(self)

    def send(self: stall.Prober, q: int, payload: bytes) -> None:
        if len(self._posted) == 1:  # the second probe: this peer is lost now (test)
            raise plait.PeerLostError(f"rank {q} was lost (test)")
        real_send(self, q, payload)

    monkeypatch.setattr(stall.Prober, "__init__", init)
    monkeypatch.setattr(stall.Prober, "_send", send)

    def body(comm: plait.Communicator) -> str:
        if comm.rank > 0:
            time.sleep(PROBE_SECONDS + 1.0)  # away until rank 0 has stalled
            return ""
        return _outcome(lambda: comm.allreduce(np.ones(2), timeout=PROBE_SECONDS + 5))[0]

    assert run_ranks(3, body, timeout=60, window=0)[0] == "PeerLostError"
    assert made, "the call never probed"
    assert made[0].handles == []  # withdrawn


def test_a_one_sided_call_that_stalls_on_many_waits_probes_each_peer_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An arena allreduce of 4 MiB waits on its peer's counter many times; with the peer
    # late, every wait stalled and probed anew, and the peer (never stalling itself) kept a
    # probe per wait among its unexpected messages.
    sent: list[tuple[int, int]] = []
    real_send = stall.Prober._send

    def send(self: stall.Prober, q: int, payload: bytes) -> None:
        sent.append((self._call.seq, q))
        real_send(self, q, payload)

    monkeypatch.setattr(stall.Prober, "_send", send)

    def body(comm: plait.Communicator) -> None:
        x = np.ones(1 << 20, np.float32)
        for _ in range(2):
            if comm.rank == 1:
                time.sleep(PROBE_SECONDS + 0.5)  # late for each call: rank 0 stalls
            comm.allreduce(x, algorithm="arena")

    run_ranks(2, body, timeout=60)
    assert sorted(sent) == [(0, 1), (1, 1)], sent


def test_a_peer_that_gave_up_is_explained_by_the_rank_it_lost() -> None:
    # A one-sided call that meets a peer's mark that it gave up on the call for a lost rank
    # raises what the peer found: rank 0 lost rank 2 and tells (a LOST notice) before it
    # marks; rank 1, which met the mark before the notice came, raised "rank 0 gave up" with
    # no lost rank, though rank 2 was dead. Here the notice comes only once rank 1 is
    # settling its error, and rank 1's receive from rank 2, gone, fails at once.
    gone, settling, done = threading.Event(), threading.Event(), threading.Event()

    def body(comm: plait.Communicator) -> tuple[int | None, str] | None:
        t = comm._transport
        call = Call(("allreduce", "arena", 7), 0, 1234, np.add, None, seq=7)
        call = call._replace(probe_tag=comm._runner._probe_tag)
        where = SimpleNamespace(rank=comm.rank, size=comm.size)
        if comm.rank == 2:
            t.close()
            gone.set()
            return None
        if comm.rank == 0:
            assert settling.wait(30)
            notices.tell_all(t, call, 0, comm.size, notices.LOST, 2)
            assert done.wait(30)
            return None
        assert gone.wait(30)
        err = plait.PeerLostError("rank 1: allreduce (arena, call #7): rank 0 gave up on the call")
        setattr(err, stall.GAVE_UP, True)
        settling.set()
        try:
            found = stall.settle(t, call, where, err)  # type: ignore[arg-type]
        finally:
            done.set()
        assert isinstance(found, plait.PeerLostError)
        return found.lost_rank, str(found)

    results = run_ranks(3, body, timeout=30, window=0)
    assert results[1] is not None
    assert results[1][0] == 2, results[1]
    assert "rank 2 was lost (rank 0 found so" in results[1][1], results[1]


def test_a_loss_behind_a_mismatch_is_told_as_the_mismatch() -> None:
    # Rank 2 found the ranks in different calls, told its verdict and left; rank 0 then lost
    # it, and rank 1, which waited on rank 0 alone, could hear only from rank 0. Rank 0 told
    # "rank 2 was lost" and rank 1 raised PeerLostError though the ranks had called
    # different collectives: the loss is told as the mismatch behind it.
    told, settled = threading.Event(), threading.Event()

    def body(comm: plait.Communicator) -> tuple[str, str]:
        t = comm._transport
        call = Call(("reduce", "binomial", 0), 0, 4321, np.add, None, seq=0)
        call = call._replace(probe_tag=comm._runner._probe_tag)
        where = SimpleNamespace(rank=comm.rank, size=comm.size)
        if comm.rank == 2:  # its verdict reaches rank 0 only, as where rank 1 lost it too
            t.isend(0, call.probe_tag, memoryview(notices.pack(call, notices.VERDICT, ())), 0)
            t.close()
            told.set()
            return "", ""
        if comm.rank == 0:
            assert told.wait(30)
            found = stall.settle(t, call, where, _lost(2))  # type: ignore[arg-type]
            settled.set()
            return type(found).__name__, str(found)
        assert settled.wait(30)
        found = notices.verdict_here(t, call, 1, comm.size)
        return type(found).__name__, str(found)

    results = run_ranks(3, body, timeout=30, window=0)
    assert [r[0] for r in results[:2]] == ["MismatchError", "MismatchError"], results
    assert "rank 2 found that the ranks called different collectives" in results[0][1]
    assert "rank 0 heard from another rank that the ranks called" in results[1][1], results


def _lost(rank: int) -> plait.PeerLostError:
    err = plait.PeerLostError(f"rank {rank} was lost")
    err.lost_rank = rank
    return err


@pytest.mark.parametrize(
    ("error", "phase", "waits"),
    [
        (_lost(2), posts.LOST, True),
        (plait.PeerLostError("closed"), posts.ABANDONED, False),
        (ValueError("an op of the user's raised"), posts.ABANDONED, False),
        (plait.MismatchError("differs"), posts.MISMATCHED, False),
    ],
)
def test_a_give_up_mark_says_whether_a_notice_of_a_lost_rank_comes(
    error: BaseException, phase: int, waits: bool
) -> None:
    # Only a rank that lost a peer tells the others which (a LOST notice): a peer that meets
    # its mark waits for that notice (briefly), and for no other mark, so a call failing for
    # another reason (a user's op raising on one rank) fails its peers at once.
    assert posts.gave_up_phase(error) == phase
    call = Call(("allreduce", "arena", 3), 0, 99, np.add, None, epoch=5, seq=3)
    window = SimpleNamespace(peer_state=lambda q, half: (99, (5 << 32) | phase))
    with pytest.raises((plait.PeerLostError, plait.MismatchError)) as info:
        posts.check_peer(window, 0, 0, call, 1)
    assert getattr(info.value, stall.GAVE_UP, False) is waits


def test_a_timeout_names_the_receive_that_waits_for_this_rank() -> None:
    # Threads as ranks are not alone (Note [crossed calls]): rank 1's receive from rank 0,
    # which waits for it in a barrier, is no sure deadlock here, but both timeouts say it.
    # Nobody closes (run_ranks closes a rank's communicator as its body returns) before both
    # timeouts came: rank 0's barrier read rank 1's close as a lost peer once. Rank 1's receive
    # (the communicator's timeout: one of its own takes no part in crossings) waits 4 s longer
    # than rank 0's barrier: where it ended first (its thread started first on a busy
    # machine), the notice that it had ended reached rank 0 before its own timeout, which then
    # named no receive.
    both = threading.Barrier(2)

    def body(comm: plait.Communicator) -> tuple[str, float, str]:
        if comm.rank == 1:
            got = _outcome(lambda: comm.recv(np.zeros(4), 0))
        else:
            got = _outcome(lambda: comm.barrier(timeout=8))
        both.wait(30)
        return got

    (kind0, _, said0), (kind1, _, said1) = run_ranks(2, body, timeout=12)
    assert kind0 == "CollectiveTimeout", said0
    assert "job rank 1 waits in recv from rank 0 (tag 0) of the world communicator" in said0
    assert kind1 == "CommTimeout", said1


def test_a_rank_with_a_send_in_flight_to_the_receiver_sees_no_crossing() -> None:
    # A send still in flight may be what the receive waits for (a large message takes
    # seconds): the rank that sent it sees no crossing with the receiver, and names none.
    # (Zero-buffer sends keep rank 0's send in flight; here the receive wants another tag.)
    ended = threading.Event()  # rank 0's barrier: rank 1 closes only after it, not before

    def body(comm: plait.Communicator) -> tuple[str, float, str]:
        if comm.rank == 1:
            got = _outcome(lambda: comm.recv(np.zeros(4), 0, tag=7))
            ended.wait(30)  # its timeout may end first: a close would fail rank 0's barrier
            return got
        req = comm.isend(np.ones(4), 1, tag=5)
        got = _outcome(comm.barrier)
        ended.set()
        req.cancel()
        return got

    (kind0, _, said0), _ = run_ranks(2, body, timeout=6, lockstep=True)
    assert kind0 == "CollectiveTimeout", said0
    assert "waits in recv" not in said0, said0


class _Send:
    """A send's handle as the crossings see it: done or not."""

    def __init__(self, done: bool) -> None:
        self.done = done


def test_every_send_in_flight_counts_not_only_the_last() -> None:
    # Over TCP a large message waits for its receive to be posted while a small one sent
    # after it ends at once: keeping only the last send posted to a peer, a rank took a
    # 8 GiB message in flight for none and raised on a correct program (Note [crossed calls]).
    def body(comm: plait.Communicator) -> list[bool]:
        t = comm._transport
        big, small = _Send(False), _Send(False)
        crossing.sending(t, 1 - comm.rank, big)
        crossing.sending(t, 1 - comm.rank, small)
        small.done = True
        root = crossing._by_transport[id(t)].root
        seen = [crossing._sending(root, 1 - comm.rank)]
        big.done = True
        seen.append(crossing._sending(root, 1 - comm.rank))
        del big, small  # a send that is gone is done
        seen.append(crossing._sending(root, 1 - comm.rank))
        return seen

    assert run_ranks(2, body) == [[True, False, False]] * 2


def test_a_notice_that_a_peer_gave_up_a_later_call_is_kept_for_that_call() -> None:
    """Rank 0, stalled in call #4, read rank 1's notice that it gave up on call #5 (an error
    of its own): it was read as a stall probe and dropped, and rank 0's call #5, waiting on a
    rank that will never come, waited for its timeout. It is kept for call #5 now, which
    names rank 1 as its lost_rank (Note [stall probes])."""
    told, read = threading.Event(), threading.Event()

    def body(comm: plait.Communicator) -> tuple[Any, ...] | None:
        t = comm._transport
        tag = comm._runner._probe_tag

        def call(seq: int) -> Call:
            return Call(("allreduce", "ring", seq), 0, 1234, np.add, None, seq=seq, probe_tag=tag)

        if comm.rank == 1:
            notices.abandon(t, call(5), 1, comm.size, ZeroDivisionError("boom"))
            told.set()
            assert read.wait(30)
            return None
        assert told.wait(30)
        prober = stall.Prober(t, call(4), 0, comm.size)
        prober.start([1])
        try:
            deadline = time.monotonic() + 20
            while not any(h.done for h in prober.handles) and time.monotonic() < deadline:
                t.wait_any(prober.handles, 1.0)
            prober.check([1])  # call #4 learns nothing from a notice of call #5
        finally:
            prober.close()
            read.set()
        later = stall.Prober(t, call(5), 0, comm.size)
        try:
            later.check([1])
        except plait.PeerLostError as exc:
            return exc.lost_rank, str(exc)
        finally:
            later.close()
        return ("no error",)

    result = run_ranks(2, body, timeout=30, window=0)[0]
    assert result is not None
    assert result[0] == 1, result
    assert "rank 1 gave up on the call after an error of its own, ZeroDivisionError" in result[1]
