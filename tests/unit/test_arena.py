"""The one-sided algorithms (plait.algos.arena): proofs with small windows, choice, errors.

Every registered algorithm is proven for p = 1..33 with an unlimited window in
test_symbolic.py; here the windows are small, so that pieces reuse the window's
buffers and the race check of :func:`plait.schedule.verify.run_joint` has
something to check. The calls run over the in-process transport's window.
"""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import plait
from plait.algos._registry import COLLECTIVES, REDUCING, AlgorithmSpec, specs
from plait.errors import CollectiveTimeout, MismatchError
from plait.schedule.builder import Context, record
from plait.schedule.symbolic import prove
from plait.testing import RankFailure, memory_communicators, run_ranks
from spies import runs_of

ARENA = [s for c in COLLECTIVES for s in specs(c) if s.needs_window]
ROOTED = {"reduce", "broadcast", "gather", "scatter"}
IN_PLACE = {"allreduce", "reduce", "alltoall"}


def test_every_collective_has_a_one_sided_algorithm() -> None:
    assert {s.collective for s in ARENA} == set(COLLECTIVES) - {
        c for c in COLLECTIVES if c.endswith("v")
    }


def _fits(spec: AlgorithmSpec, size: int, count: int, root: int, window: int) -> bool:
    """Whether a window of ``window`` elements holds one piece of ``spec``'s call."""
    ctx = Context(spec.collective, 0, size, count, 1, True, root, window=window)
    try:
        record(spec.build, ctx)
    except ValueError as exc:
        assert "cannot hold one piece" in str(exc) or "do not fit" in str(exc), exc  # noqa: PT017
        return False
    return True


@pytest.mark.parametrize(
    "size", [1, 2, 3, 4, *(pytest.param(p, marks=pytest.mark.slow) for p in (5, 7, 12))]
)
@pytest.mark.parametrize("spec", ARENA, ids=lambda s: f"{s.collective}-{s.name}")
def test_small_windows_reuse_buffers_safely(spec: AlgorithmSpec, size: int) -> None:
    roots = sorted({0, size // 2, size - 1}) if spec.collective in ROOTED else [0]
    for count in (1, size + 1, 37):
        # Windows of a few elements (itemsize 1 in the prover): many pieces per call.
        for window in (2 * size + 2, 3 * size + 5, 64):
            for root in roots:
                if not _fits(spec, size, count, root, window):
                    continue
                prove(spec, size, count, root=root, window=window)
                if spec.collective in REDUCING and not spec.commutative_only:
                    prove(spec, size, count, root=root, window=window, commutative=False)
                if spec.collective in IN_PLACE:
                    prove(spec, size, count, root=root, window=window, in_place=True)


def test_a_call_without_a_window_is_refused_before_anything_moves() -> None:
    comms = memory_communicators(2, window=0)
    try:
        x = np.ones(4)
        with pytest.raises(ValueError, match="share memory on one host"):
            comms[0].allreduce(x, algorithm="arena")
        assert comms[0].stats().bytes_sent == 0
    finally:
        for c in comms:
            c.close()


@pytest.mark.parametrize(
    ("window", "nbytes", "want"),
    [(1 << 20, 8, "arena_oneshot"), (1 << 20, 1 << 20, "arena"), (0, 8, "recursive_doubling")],
)
def test_auto_picks_one_sided_algorithms_only_where_ranks_share_a_window(
    window: int, nbytes: int, want: str
) -> None:
    def body(comm: plait.Communicator) -> str:
        comm.allreduce(np.zeros(nbytes // 8))
        return comm._auto[("allreduce", nbytes, True, window > 0, False)].name

    assert run_ranks(2, body, window=window) == [want, want]


@pytest.mark.parametrize("size", [3, 4])
@pytest.mark.parametrize("window", [16, 64, 128])
def test_auto_goes_through_messages_where_a_window_holds_no_piece(size: int, window: int) -> None:
    """A window too small for one piece of an arena algorithm (PLAIT_SHM_WINDOW set that
    low) made ``auto`` pick one for a call that fitted in it, which then refused to run
    ("cannot hold one piece") on every rank: alltoall, reduce_scatter, scatter."""

    def body(comm: plait.Communicator) -> list[np.ndarray]:
        p, r = comm.size, comm.rank
        x = (np.arange(p, dtype=np.clongdouble) + 10 * r).astype(np.clongdouble)
        return [
            comm.alltoall(x),
            comm.reduce_scatter(x),
            comm.scatter(np.arange(p, dtype=np.float64), root=0),
            comm.allreduce(np.ones(1)),
        ]

    for r, (a2a, rs, sc, ar) in enumerate(run_ranks(size, body, window=window)):
        np.testing.assert_array_equal(a2a, [r + 10 * q for q in range(size)])
        np.testing.assert_array_equal(rs, [size * r + 10 * sum(range(size))])
        np.testing.assert_array_equal(sc, [float(r)])
        np.testing.assert_array_equal(ar, [float(size)])


def test_every_collective_agrees_with_numpy_through_small_windows() -> None:
    def body(comm: plait.Communicator) -> list[np.ndarray | None]:
        p, r = comm.size, comm.rank
        x = np.arange(1000, dtype=np.float64) * (r + 1)
        blocks = np.arange(p * 300, dtype=np.int64) + 1000 * r
        return [
            comm.allreduce(x, algorithm="arena"),
            comm.allreduce(x, algorithm="arena_oneshot"),
            comm.reduce(x, p - 1, algorithm="arena"),
            comm.broadcast(x.copy(), 1, algorithm="arena"),
            comm.reduce_scatter(blocks, algorithm="arena"),
            comm.allgather(x, algorithm="arena"),
            comm.alltoall(blocks, algorithm="arena"),
            comm.gather(x, 0, algorithm="arena"),
            comm.scatter(blocks.reshape(p, -1), 2, algorithm="arena"),
        ]

    p = 3
    got = run_ranks(p, body, window=1024)  # pieces of at most 1 KiB: many per call
    xs = [np.arange(1000, dtype=np.float64) * (r + 1) for r in range(p)]
    bl = [np.arange(p * 300, dtype=np.int64) + 1000 * r for r in range(p)]
    for r in range(p):
        res = got[r]
        np.testing.assert_array_equal(res[0], sum(xs))
        np.testing.assert_array_equal(res[1], sum(xs))
        if r == p - 1:
            np.testing.assert_array_equal(res[2], sum(xs))
        else:
            assert res[2] is None
        np.testing.assert_array_equal(res[3], xs[1])
        np.testing.assert_array_equal(res[4], sum(bl)[r * 300 : (r + 1) * 300])
        np.testing.assert_array_equal(res[5], np.stack(xs))
        want = np.concatenate([b[r * 300 : (r + 1) * 300] for b in bl])
        np.testing.assert_array_equal(res[6], want)
        if r == 0:
            np.testing.assert_array_equal(res[7], np.stack(xs))
        np.testing.assert_array_equal(res[8], bl[2].reshape(p, -1)[r : r + 1])


def test_ranks_in_different_one_sided_calls_raise_mismatch() -> None:
    def body(comm: plait.Communicator) -> None:
        x = np.ones(8)
        if comm.rank == 0:
            comm.allreduce(x, algorithm="arena_oneshot")
        else:
            comm.broadcast(x, 0, algorithm="arena")

    with pytest.raises(RankFailure) as info:
        run_ranks(2, body, timeout=10)
    for r in (0, 1):
        err = info.value.errors[r]
        assert isinstance(err, MismatchError), err
        assert "different call" in str(err)


def test_a_rank_that_never_comes_is_named_at_the_timeout() -> None:
    gave_up = threading.Event()

    def body(comm: plait.Communicator) -> None:
        if comm.rank == 0:
            try:
                comm.allreduce(np.ones(4), algorithm="arena", timeout=0.3)
            finally:
                gave_up.set()
        else:
            gave_up.wait(30)  # stays out of the call (closing would make it a lost peer)

    with pytest.raises(RankFailure) as info:
        run_ranks(2, body)
    err = info.value.errors[0]
    assert isinstance(err, CollectiveTimeout)
    assert "rank(s) [1]" in str(err)


def test_async_and_blocking_one_sided_calls_keep_program_order() -> None:
    def body(comm: plait.Communicator) -> list[np.ndarray]:
        works = []
        outs = []
        for i in range(20):
            x = np.full(100, float(i + comm.rank))
            works.append(comm.allreduce(x, algorithm="arena", async_op=True))
            outs.append(comm.allreduce(x * 2, algorithm="arena_oneshot"))
        return [w.wait(timeout=30) for w in works] + outs

    for res in run_ranks(3, body):
        for i in range(20):
            np.testing.assert_array_equal(res[i], np.full(100, 3.0 * i + 3))
            np.testing.assert_array_equal(res[20 + i], np.full(100, 6.0 * i + 6))


def test_a_failed_one_sided_call_breaks_the_communicator_only_once() -> None:
    comms = memory_communicators(2, timeout=5)
    done = threading.Event()
    errors: list[BaseException] = []

    def rank0() -> None:
        try:
            comms[0].allreduce(np.ones(3), algorithm="arena", timeout=0.2)
        except BaseException as exc:
            errors.append(exc)
        done.set()

    t = threading.Thread(target=rank0)
    t.start()
    t.join(30)
    assert done.is_set()
    assert isinstance(errors[0], CollectiveTimeout)
    with pytest.raises(plait.CommError, match="unusable after an earlier failure"):
        comms[0].allreduce(np.ones(3), algorithm="arena")
    for c in comms:
        c.close()


def test_a_peer_giving_up_on_a_later_call_does_not_fail_an_earlier_one() -> None:
    """Rank 2, slow in call #0, sees rank 1 already abandoned call #1: #0 must still succeed."""
    comms = memory_communicators(3, timeout=10)
    gave_up = threading.Event()
    window = comms[2]._transport.window
    assert window is not None
    original = window.wait
    held = [False]

    def slow_wait(q: int, value: int, deadline: float | None) -> bool:
        if q == 1 and not held[0]:  # rank 2 reads rank 1 only after rank 1 gave up on #1
            held[0] = True
            assert gave_up.wait(30)
        return original(q, value, deadline)

    window.wait = slow_wait  # type: ignore[method-assign]
    results: dict[int, object] = {}

    def body(r: int) -> None:
        comm = comms[r]
        x = np.full(4, float(r + 1))
        try:
            results[r, 0] = comm.allreduce(x, algorithm="arena_oneshot")
            if r == 1:
                comm.broadcast(x, 0, algorithm="arena")  # the others allreduce: a mismatch
            else:
                comm.allreduce(x, algorithm="arena_oneshot")
        except plait.CommError as exc:
            results[r, 1] = exc
        finally:
            if r == 1:
                gave_up.set()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for c in comms:
        c.close()
    for r in range(3):
        np.testing.assert_array_equal(results[r, 0], np.full(4, 6.0))  # call #0 everywhere
    assert isinstance(results[1, 1], MismatchError)


class _Window:
    """What compiling a schedule reads of a window: each rank's typed half and probe."""

    def __init__(self, size: int) -> None:
        self.halves = [np.zeros(4096, np.uint8) for _ in range(size)]

    def typed(self, q: int, half: int, dtype: np.dtype) -> np.ndarray:
        return self.halves[q].view(dtype)

    def reserve(self, nbytes: int) -> None:
        assert nbytes <= 4096

    def probe(self, q: int, half: int) -> tuple[list[int], int, list[int], int]:
        return [0], 0, [0], 0


@pytest.mark.parametrize("name", ["arena", "arena_oneshot"])
def test_a_copy_and_a_reduction_into_one_region_run_as_one_fold(name: str) -> None:
    # Note [compiled one-sided schedules]: every rank's fold of two operands is one ufunc call
    # (the bits are checked in tests/integration/test_collectives.py, non-commutative ops too).
    from plait.algos._registry import build_schedule, get
    from plait.runtime import compiled

    for rank in (0, 1):
        ctx = Context("allreduce", rank, 2, 64, 4, window=4096)
        schedule = build_schedule(get("allreduce", name), ctx)
        ops = compiled._compile(schedule, _Window(2), np.dtype(np.float32)).ops[0]
        folds = [op for op in ops if op[0] == compiled._FOLD]
        assert len(folds) == 1, (rank, schedule.steps)
        assert len(ops) == len(schedule.steps) - 1


class _PostingWindow(_Window):
    """A window whose calls begin at once and whose posts go nowhere: enough to run a
    schedule that reads no peer."""

    polls = 0
    yields = 0

    def begin(self, epoch: int, digest: int, deadline: float | None) -> int:
        return epoch & 1

    def post(self, value: int) -> None:
        pass

    def end(self, epoch: int) -> None:
        pass


@pytest.mark.parametrize("aliased", [False, True])
def test_compiled_local_steps_do_what_run_local_does(aliased: bool) -> None:
    # Note [compiled one-sided schedules]: only a copy between IN and OUT at equal offsets is
    # skipped in place; one into or out of TMP at equal offsets is not (a scratch region read
    # before it was written would give the old bits).
    from plait.runtime import one_sided
    from plait.runtime.executor import Call, run_local
    from plait.schedule.builder import Builder
    from plait.schedule.ir import StepKind

    ctx = Context("allreduce", 0, 2, 4, 4, window=4096)
    b = Builder(ctx, 4, 4)
    t = b.scratch(4)
    b.copy(b.inp, t)  # IN to TMP at equal offsets
    b.copy(b.inp, b.out)  # IN to OUT: nothing to do in place
    b.reduce(t, b.out, src_first=True)
    b.copy(b.out.sub(1, 2), t.sub(1, 2))  # OUT to TMP, equal offsets again
    b.reduce(t, b.out, src_first=False)
    shared = b.shared(4)
    b.copy(b.out, shared)
    b.post(1)
    schedule = b.build()
    local = [s for s in schedule.steps if s.kind in (StepKind.COPY, StepKind.REDUCE)][:-1]

    def buffers() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        x = np.arange(1, 5, dtype=np.float32)
        out = x if aliased else np.full(4, 7, np.float32)
        return x, out, np.full(4, -100, np.float32)

    expected = buffers()
    run_local(local, expected, np.add, aliased)
    got = buffers()
    call = Call("allreduce (test)", 0, 0, np.add, None, epoch=0)
    transport: Any = SimpleNamespace(window=_PostingWindow(2))
    one_sided.run_one_sided(schedule, got, transport, call, aliased)
    np.testing.assert_array_equal(got[1], expected[1])
    np.testing.assert_array_equal(got[2], expected[2])


def test_every_kind_of_compiled_operation_does_what_its_steps_say() -> None:
    # Note [generated runs] in plait.runtime.compiled: each operation's line, in the steps'
    # order, with a non-commutative op (the order of every reduction shows in the bits).
    from plait.runtime import compiled, one_sided
    from plait.runtime.executor import Call
    from plait.schedule.builder import Builder

    n = 4
    ctx = Context("allreduce", 0, 3, n, 8, window=4096)
    b = Builder(ctx, n, n)
    shared = b.shared(n)
    t = b.scratch(n)
    b.copy(b.inp, shared)
    b.post(1)
    b.get(1, shared, b.out, 1)  # a get alone
    b.get_reduce(2, shared.sub(0, 2), b.out.sub(0, 2), 1, get_first=True)
    b.get_reduce(2, shared.sub(2, 2), b.out.sub(2, 2), 1, get_first=False)
    b.wait(1, 1)
    b.get(1, shared, t, 1)
    b.reduce(b.inp, t, src_first=True)  # with the get: a fold, t = IN - theirs
    b.reduce(t, b.out, src_first=False)  # out = out - t
    b.copy(b.inp, t)
    b.get_reduce(2, shared, t, 1, get_first=False)  # with the copy: a fold, t = IN - theirs
    b.reduce(t, b.out, src_first=True)  # out = t - out
    schedule = b.build()
    window = _ReadyWindow(3)
    peers = {q: window.typed(q, 0, np.dtype(np.float64)) for q in (1, 2)}
    peers[1][:n] = [3.0, -7.5, 11.25, 0.5]
    peers[2][:n] = [-2.0, 9.0, 4.75, -13.5]
    ops = compiled._compile(schedule, window, np.dtype(np.float64)).ops[0]
    kinds = {op[0] for op in ops}
    assert {compiled._COPY, compiled._POST, compiled._GET, compiled._GET_REDUCE} <= kinds
    assert {compiled._WAIT, compiled._FOLD, compiled._REDUCE} <= kinds

    x = np.array([1.0, 2.5, -4.0, 8.0])
    out = np.zeros(n)
    call = Call("allreduce (test)", 0, 7, np.subtract, None, epoch=0)
    one_sided.run_one_sided(
        schedule, (x, out, np.zeros(n)), SimpleNamespace(window=window), call, False
    )
    p1, p2 = peers[1][:n].copy(), peers[2][:n].copy()
    want = p1.copy()
    want[:2] = p2[:2] - want[:2]
    want[2:] = want[2:] - p2[2:]
    want = want - (x - p1)
    want = (x - p2) - want
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(window.typed(0, 0, np.dtype(np.float64))[:n], x)
    assert window.posted == [1]


def test_calls_of_one_kind_share_the_code_of_their_generated_run() -> None:
    # Note [generated runs]: sizes, views and probes are names, so a new size binds them
    # again and compiles nothing; each size's run still moves its own elements.
    from plait.algos._registry import build_schedule, get
    from plait.runtime import compiled

    window = _Window(2)
    runs = []
    for count in (4, 12, 300):
        ctx = Context("allreduce", 0, 2, count, 4, window=4096)
        schedule = build_schedule(get("allreduce", "arena_oneshot"), ctx)
        runs.append(compiled._compile(schedule, window, np.dtype(np.float32)).run)
    assert runs[0].__code__ is runs[1].__code__ is runs[2].__code__
    assert [run.__globals__["n_in"] for run in runs] == [4, 12, 300]


def test_a_peer_in_another_call_takes_the_slow_way_to_its_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A generated run's wait checks the peer's digest inline; where it differs, _peer
    # checks the peer (check_peer raises what it finds) before anything is read.
    from plait.algos._registry import build_schedule, get
    from plait.runtime import compiled, one_sided
    from plait.runtime.executor import Call

    class OtherCall(_ReadyWindow):
        def probe(self, q: int, half: int) -> Any:
            return [1000], 0, [8], 0  # posted, but the digest of another call

    checked: list[int] = []

    def check_peer(window: Any, q: int, half: int, call: Any, rank: int) -> None:
        checked.append(q)
        raise MismatchError("rank 0: in another call")

    monkeypatch.setattr(compiled, "check_peer", check_peer)
    monkeypatch.setattr(compiled, "await_post", lambda *args: None)
    ctx = Context("allreduce", 0, 2, 4, 4, window=4096)
    schedule = build_schedule(get("allreduce", "arena_oneshot"), ctx)
    x = np.arange(4, dtype=np.float32)
    window = OtherCall(2)
    call = Call("allreduce (test)", 0, 7, np.add, None, epoch=0)
    with pytest.raises(MismatchError, match="another call"):
        one_sided.run_one_sided(schedule, (x, x, x[:0]), SimpleNamespace(window=window), call, True)
    assert checked == [1]
    np.testing.assert_array_equal(x, np.arange(4))  # nothing of the peer's was reduced in


class _ReadyWindow(_PostingWindow):
    """Peers that have posted every phase of call 0, with its digest (7)."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.posted: list[int] = []

    def probe(self, q: int, half: int) -> Any:
        return [1000], 0, [7], 0

    def post(self, value: int) -> None:
        self.posted.append(value)


class _LateCounter:
    """A peer's counter words that reach ``need`` at the ``late``-th read."""

    def __init__(self, late: int, need: int) -> None:
        self.reads, self.late, self.need = 0, late, need

    def __getitem__(self, i: int) -> int:
        self.reads += 1
        return self.need if self.reads >= self.late else 0


@pytest.mark.parametrize(
    ("polls", "yields", "given_up", "waits"),
    [
        (0, 0, 0, 1),
        (3, 0, 0, 1),
        (4, 0, 0, 0),
        (128, 0, 0, 0),
        (0, 3, 3, 1),
        (0, 4, 4, 0),
        (2, 4, 2, 0),
        (4, 16, 0, 0),
    ],
)
def test_a_compiled_wait_reads_a_short_counter_again_before_it_waits(
    monkeypatch: pytest.MonkeyPatch, polls: int, yields: int, given_up: int, waits: int
) -> None:
    # Note [a second look]: the counter is read up to window.polls more times in place,
    # then (where ranks outnumber cores) again after each of up to window.yields
    # sched_yield calls; the wait through the window comes only after those.
    from plait.algos._registry import build_schedule, get
    from plait.runtime import compiled, one_sided
    from plait.runtime.executor import Call

    ctx = Context("allreduce", 0, 2, 4, 4, window=4096)
    schedule = build_schedule(get("allreduce", "arena_oneshot"), ctx)
    ops = compiled._compile(schedule, _Window(2), np.dtype(np.float32)).ops[0]
    (phase,) = [op[5] for op in ops if op[0] >= compiled._GET]
    counter = _LateCounter(5, phase)  # the first read and four more: short until the fifth

    class Window(_PostingWindow):
        def probe(self, q: int, half: int) -> Any:
            return counter, 0, [7], 0

    window = Window(2)
    window.polls, window.yields = polls, yields
    yielded: list[int] = []
    waited: list[int] = []

    def wait(*args: Any) -> None:
        waited.append(counter.reads)
        counter.late = 0

    monkeypatch.setattr(os, "sched_yield", lambda: yielded.append(counter.reads))
    monkeypatch.setattr(compiled, "await_post", wait)
    x = np.arange(4, dtype=np.float32)
    call = Call("allreduce (test)", 0, 7, np.add, None, epoch=0)
    one_sided.run_one_sided(schedule, (x, x, x[:0]), SimpleNamespace(window=window), call, True)
    assert len(yielded) == given_up
    assert yielded == list(range(1 + polls, 1 + polls + given_up))  # after the polls' reads
    assert waited == ([1 + polls + given_up] if waits else [])  # the first read, then each


def test_plain_one_sided_calls_take_the_short_path_and_the_others_the_whole_way(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Note [the one-sided short path] in plait._runner: the same results either way.
    taken = runs_of(monkeypatch, "_run_window", lambda req: req.spec.name)

    def body(comm: plait.Communicator) -> list[np.ndarray]:
        x = np.arange(10.0) * (comm.rank + 1)
        return [
            comm.allreduce(x, algorithm="arena_oneshot"),  # short
            comm.allreduce(x, op=plait.AVG, algorithm="arena_oneshot"),  # an average
            comm.allreduce(x, algorithm="arena_oneshot", timeout=20),  # its own timeout
            comm.allreduce(x, algorithm="arena_oneshot", async_op=True).wait(),  # queued
            comm.allreduce(x, algorithm="ring"),  # messages
            comm.allreduce(x, algorithm="arena_oneshot"),  # short again, after all of those
        ]

    got = run_ranks(2, body)
    assert taken == ["arena_oneshot"] * 4  # two calls on each of two ranks
    total = np.arange(10.0) * 3
    for res in got:
        for i, y in enumerate(res):
            np.testing.assert_array_equal(y, total / 2 if i == 1 else total)


def test_a_one_sided_call_in_flight_is_found_on_its_callers_line() -> None:
    # The short path's frame is the one a dump looks for (runs_calls), as _run's is.
    import time

    seen: list[dict[str, Any]] = []
    recorders: dict[int, Any] = {}

    def body(comm: plait.Communicator) -> None:
        x = np.ones(4)
        recorders[comm.rank] = comm._runner.recorder
        if comm.rank == 0:
            comm.allreduce(x, algorithm="arena_oneshot")  # in flight until rank 1 comes
            return
        deadline = time.monotonic() + 20
        while not seen and time.monotonic() < deadline:  # until rank 0 waits in its call
            rec = recorders.get(0)
            if rec is not None:
                seen.extend(c for c in rec.snapshot() if c["state"] == "running" and c["stack"])
            time.sleep(0.01)
        comm.allreduce(x, algorithm="arena_oneshot")

    line = body.__code__.co_firstlineno + 4
    run_ranks(2, body)
    assert seen, "rank 0's call was never seen in flight"
    assert seen[0]["stack"][0][:3] == [__file__, line, "body"]


def test_a_peer_that_followed_another_in_an_earlier_call_is_not_said_to_have_erred() -> None:
    """Note [who gave up first]: a peer whose post of an earlier call says it gave up only
    because another had read "after an error of its own", and this rank then posted as if
    the error were its own (ABANDONED), so that the next rank blamed it in turn."""
    from types import SimpleNamespace

    from plait.runtime import posts

    window = SimpleNamespace(counter=lambda q: (3 << 32) | posts.FOLLOWED)
    call = SimpleNamespace(epoch=5, describe="allreduce (arena, call #9)")
    with pytest.raises(plait.PeerLostError) as info:
        posts._look(window, 1, call, 0, 1)  # type: ignore[arg-type]
    assert "rank 1 gave up on one-sided call 3 of this communicator because another" in str(
        info.value
    )
    assert posts.gave_up_phase(info.value) == posts.FOLLOWED
