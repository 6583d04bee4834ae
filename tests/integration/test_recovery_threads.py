"""abort, agree and shrink with threads as ranks (TCP over loopback, one in-memory store).

Real processes, kill -9 and the store's host dying: tests/multiprocess/test_recovery_processes.py.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import plait
from plait import _liveness, _recovery
from plait.rendezvous.store import MemoryStore, PrefixStore
from plait.testing import memory_communicators, run_ranks
from plait.transport.route import connect

pytestmark = pytest.mark.timeout(60)


def store_ranks(
    n: int, fn: Callable[[plait.Communicator], Any], store: MemoryStore | None = None
) -> list[Any]:
    """Run ``fn`` on ``n`` threads, each with a communicator that has its recovery
    (namespace ``job/ft`` of ``store``, a new one by default)."""
    store = MemoryStore(timeout=30) if store is None else store
    results: list[Any] = [None] * n

    def body(r: int) -> None:
        t = connect(r, n, ["h"] * n, PrefixStore("job", store), links=("tcp",), timeout=20)
        comm = plait.Communicator(t, timeout=20)
        _recovery.enable(comm, store, "job/ft", ("tcp",))
        try:
            results[r] = fn(comm)
        except BaseException as exc:
            results[r] = exc
        finally:
            comm.close()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(50)
    return results


def test_agree_ands_the_flags_and_lists_every_rank() -> None:
    def body(comm: plait.Communicator) -> Any:
        first = comm.agree(0b111 if comm.rank else 0b101)
        second = comm.agree(np.int64(6))
        return first, second

    for first, second in store_ranks(3, body):
        assert first == plait.Agreement(0b101, (0, 1, 2))
        assert second == plait.Agreement(6, (0, 1, 2))


def test_shrink_without_a_failure_renumbers_and_closes_the_old_one() -> None:
    def body(comm: plait.Communicator) -> Any:
        new = comm.shrink()
        try:
            got = new.allreduce(np.arange(3.0) + new.rank)
            return comm.closed, new.rank, new.size, got.tolist()
        finally:
            new.close()

    for r, res in enumerate(store_ranks(3, body)):
        assert res == (True, r, 3, [3.0, 6.0, 9.0])


def test_a_group_of_a_communicator_shrunk_while_healthy_says_why_it_is_gone() -> None:
    """Its next call said only that the transport was closed (the rank twice over)."""

    def body(comm: plait.Communicator) -> Any:
        group = comm.split(0)
        new = comm.shrink()
        try:
            with pytest.raises(plait.AbortedError, match=r"replaced by shrink\(\)") as info:
                group.allreduce(np.ones(1))
            with pytest.raises(plait.AbortedError, match=r"replaced by shrink\(\)"):
                comm.allreduce(np.ones(1))  # the old one: closed, and why
            for again in (comm.agree, comm.shrink):  # they said only "closed"
                with pytest.raises(plait.ClosedError, match=r"closed .*replaced by shrink\(\)"):
                    again()
            return str(info.value).count(f"rank {comm.rank}: ")
        finally:
            group.close()
            new.close()

    assert store_ranks(2, body) == [1, 1]


def test_abort_of_a_communicator_shrink_replaced_returns_at_once() -> None:
    """A healthy shrink marked the old communicator aborted but left its abort unfinished:
    abort() on it (or a group of it) waited out the whole second it gives peers."""

    def body(comm: plait.Communicator) -> Any:
        group = comm.split(0)
        new = comm.shrink()
        try:
            start = time.monotonic()
            comm.abort("late")
            group.abort("late")
            return time.monotonic() - start
        finally:
            group.close()
            new.close()

    assert max(store_ranks(2, body)) < 0.5  # it was 2 s: a second for each


def test_a_late_rank_is_left_out_and_told(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 2 closes its communicator (its heartbeat stops): the others agree without it."""
    monkeypatch.setattr(_recovery, "HEARTBEAT_SECONDS", 0.05)
    monkeypatch.setattr(_liveness, "STALE_SECONDS", 0.3)

    def body(comm: plait.Communicator) -> Any:
        if comm.rank == 2:
            return None
        return comm.agree(1, timeout=10)

    results = store_ranks(3, body)
    assert results[:2] == [plait.Agreement(1, (0, 1))] * 2


def test_an_agree_that_times_out_raises_a_timeout_and_keeps_the_ranks_in_step() -> None:
    """Rank 1 comes late, alive: rank 0's agree (then shrink) times out. It raised
    RendezvousError ("the store ... is unreachable"), and its next agree waited in agreement
    #1 while rank 1 waited in #0 for it, until both timed out. Now the late rank finds the
    agreement given up and raises at once, and the next agree of each meets."""
    gave_up = [threading.Event(), threading.Event()]

    def body(comm: plait.Communicator) -> Any:
        for call, event in zip((comm.agree, comm.shrink), gave_up, strict=True):
            if comm.rank == 0:
                with pytest.raises(plait.CommTimeout, match=r"rank\(s\) \[1\] neither took"):
                    call(timeout=0.3)  # type: ignore[operator]
                event.set()
            else:
                assert event.wait(20)
                start = time.monotonic()
                with pytest.raises(plait.CommTimeout, match="given up by rank 0"):
                    call(timeout=10)  # type: ignore[operator]
                assert time.monotonic() - start < 5
        got = comm.agree(0b110 if comm.rank else 0b011, timeout=10)
        new = comm.shrink(timeout=10)
        try:
            return got, new.allreduce(np.ones(2)).tolist()
        finally:
            new.close()

    assert store_ranks(2, body) == [(plait.Agreement(0b010, (0, 1)), [2.0, 2.0])] * 2


def test_shrinking_a_healthy_communicator_lets_the_peers_end_their_calls() -> None:
    """Rank 0 sends, then shrinks; rank 1 receives only once rank 0 is agreeing. shrink
    aborted the old communicator first, so rank 1's receive of a message already sent
    failed with AbortedError (and a collective that rank 0 had finished failed on a peer
    still reading its window, now and then)."""
    store = MemoryStore(timeout=30)

    def body(comm: plait.Communicator) -> Any:
        if comm.rank == 0:
            comm.send(np.arange(3.0), 1, tag=5)
        else:
            store.wait(["job/ft/agree/0/flag/0"], 20)  # rank 0 is in shrink
            got = comm.recv(np.zeros(3), 0, tag=5).tolist()
            assert got == [0.0, 1.0, 2.0]
        new = comm.shrink(timeout=20)
        try:
            return new.size, new.allreduce(np.ones(1)).tolist()
        finally:
            new.close()

    assert store_ranks(2, body, store) == [(2, [2.0])] * 2


def test_a_shrunk_communicator_dumps_and_splits_apart_from_the_old_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """It took the id of the world (0): its dumps replaced the old communicator's files
    (rank<r>.json), and a split of it had the id of the same split of the old one."""
    monkeypatch.setenv("PLAIT_DUMP_DIR", str(tmp_path))

    def body(comm: plait.Communicator) -> Any:
        old = comm._runner.recorder
        assert old is not None
        old_split = comm.split(0)
        old_id = old_split._comm_id
        old_split.close()
        new = comm.shrink(timeout=20)
        try:
            rec = new._runner.recorder
            assert rec is not None
            assert rec.comm != 0
            new_split = new.split(0)
            assert new_split._comm_id != old_id
            new_split.close()
            return str(old.dump("old")), str(rec.dump("new"))
        finally:
            new.close()

    paths = [p for pair in store_ranks(2, body) for p in pair]
    assert len(set(paths)) == 4, paths
    assert all(Path(p).exists() for p in paths)


def test_abort_from_a_watchdog_fails_blocked_receives_everywhere_within_a_second() -> None:
    def body(comm: plait.Communicator) -> Any:
        comm.barrier()
        if comm.rank == 0:
            threading.Timer(0.3, comm.abort, ("watchdog",)).start()  # fires while all wait
        start = time.monotonic()
        with pytest.raises(plait.CommError) as info:
            comm.recv(np.zeros(2), (comm.rank + 1) % comm.size, tag=3)
        elapsed = time.monotonic() - start
        assert str(info.value).count(f"rank {comm.rank}: ") == 1, info.value  # said once
        with pytest.raises(plait.AbortedError, match="aborted by rank 0 \\(watchdog\\)"):
            comm.allreduce(np.ones(2))
        return elapsed, type(info.value).__name__

    for res in store_ranks(3, body):
        assert not isinstance(res, BaseException), res
        elapsed, kind = res
        assert elapsed < 0.3 + 1.0
        assert kind in ("AbortedError", "PeerLostError")


def test_a_reason_that_is_not_valid_unicode_is_told_escaped() -> None:
    """str() of an OSError on a non-UTF-8 file name holds lone surrogates: encoding it
    failed on the abort's thread, and the peers saw a lost peer instead of an abort."""

    def body(comm: plait.Communicator) -> Any:
        comm.barrier()
        if comm.rank == 1:
            comm.abort("cannot open ckpt-\udcff")
        with pytest.raises(plait.AbortedError) as info:
            comm.allreduce(np.ones(2), timeout=15)
        return str(info.value)

    for text in store_ranks(3, body):
        assert "aborted by rank 1 (cannot open ckpt-" in text, text


def test_abort_in_a_signal_handler_while_the_main_thread_is_blocked() -> None:
    """Rank 0 runs on the main thread, where Python runs signal handlers."""
    comms: list[plait.Communicator] = []
    store = MemoryStore(timeout=30)
    ready = threading.Barrier(2)
    outcome: dict[int, str] = {}

    def peer() -> None:
        t = connect(1, 2, ["h", "h"], PrefixStore("job", store), links=("tcp",), timeout=20)
        comm = plait.Communicator(t, timeout=20)
        _recovery.enable(comm, store, "job/ft", ("tcp",))
        ready.wait(20)
        try:
            comm.recv(np.zeros(1), 0, tag=1)
        except plait.CommError as exc:
            outcome[1] = type(exc).__name__
        comm.close()

    thread = threading.Thread(target=peer)
    thread.start()
    t = connect(0, 2, ["h", "h"], PrefixStore("job", store), links=("tcp",), timeout=20)
    comm = plait.Communicator(t, timeout=20)
    _recovery.enable(comm, store, "job/ft", ("tcp",))
    comms.append(comm)
    old = signal.signal(signal.SIGUSR2, lambda *_: comm.abort("signal"))
    try:
        ready.wait(20)
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR2)).start()
        with pytest.raises(plait.AbortedError, match="signal"):
            comm.recv(np.zeros(1), 1, tag=1)
    finally:
        signal.signal(signal.SIGUSR2, old)
        comm.close()
        thread.join(20)
    assert outcome[1] in ("AbortedError", "PeerLostError")


def test_without_a_store_abort_is_local_and_agree_and_shrink_refuse() -> None:
    def body(comm: plait.Communicator) -> str:
        with pytest.raises(plait.UnsupportedError, match="without a store"):
            comm.agree(1)
        with pytest.raises(plait.UnsupportedError, match="without a store"):
            comm.shrink()
        if comm.rank == 0:
            comm.abort()
            with pytest.raises(plait.AbortedError, match="aborted by rank 0"):
                comm.allreduce(np.ones(1))
            return "aborted"
        with pytest.raises(plait.CommError):  # rank 0 closed its end
            comm.recv(np.zeros(1), 0)
        return "lost"

    assert run_ranks(2, body) == ["aborted", "lost"]


def test_a_split_group_is_aborted_with_its_parent_but_cannot_agree() -> None:
    def body(comm: plait.Communicator) -> Any:
        group = comm.split(comm.rank % 2)
        with pytest.raises(plait.UnsupportedError, match="split"):
            group.agree(1)
        comm.barrier()
        if comm.rank == 0:
            comm.abort("stop")
        with pytest.raises(plait.CommError):  # nobody sends this: only the abort ends it
            group.recv(np.zeros(1), 1 - group.rank, tag=9)
        # The group's ranks are numbered apart: the rank that aborted is named as its own
        # communicator numbers it (it said "aborted by rank 0" in a group of ranks 1 and 3).
        with pytest.raises(plait.AbortedError, match="split from was aborted by its rank 0"):
            group.allreduce(np.ones(1))
        group.close()
        return True

    assert store_ranks(4, body) == [True] * 4


def test_a_lone_rank_agrees_with_itself_and_shrinks_to_itself() -> None:
    (comm,) = memory_communicators(1)
    assert comm.agree(5) == plait.Agreement(5, (0,))
    new = comm.shrink()
    assert comm.closed
    assert new.allreduce(np.ones(2)).tolist() == [1.0, 1.0]
    # An id of its own, as a shrink of many ranks: its dumps do not replace the world's.
    assert new._comm_id != comm._comm_id
    newer = new.shrink()
    assert len({comm._comm_id, new._comm_id, newer._comm_id}) == 3
    newer.close()


def test_bad_arguments_are_named() -> None:
    (comm,) = memory_communicators(1)
    with pytest.raises(TypeError, match="flag must be an int"):
        comm.agree("yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout must be positive"):
        comm.agree(1, timeout=0)
    with pytest.raises(TypeError, match="reason must be a str"):
        comm.abort(3)  # type: ignore[arg-type]
    comm.close()


def test_an_abort_runs_once_when_a_caller_and_the_watcher_race() -> None:
    """Two threads mark the same recovery aborted at once (a caller's abort() and the
    watcher's, for a peer's abort): only one runs the abort. Both passed a test of
    ``_aborted`` before either set it, and the second run released a lock twice, which
    raised in the watcher before it closed the transport."""
    import linecache
    import sys

    def body(comm: plait.Communicator) -> Any:
        rec = comm._recovery
        assert rec is not None
        first_in, second_done = threading.Event(), threading.Event()
        results: dict[str, Any] = {}
        code = _recovery.Recovery._mark.__code__

        def paused(frame: Any, event: str, arg: Any) -> Any:
            if frame.f_code is code and event == "line":
                line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
                if line.startswith("self._aborted = text"):
                    first_in.set()  # past its test, about to set _aborted
                    second_done.wait(10)
            return paused

        def first() -> None:
            sys.settrace(paused)
            try:
                results["first"] = rec._mark("first")
            finally:
                sys.settrace(None)

        t = threading.Thread(target=first)
        t.start()
        assert first_in.wait(10)
        results["second"] = rec._mark("second")
        second_done.set()
        t.join(10)
        runs = [k for k in ("first", "second") if results[k] is not None]
        for k in runs:  # let the abort it began end, so the job closes cleanly
            rec._finish_abort(rec._aborted, k, results[k], comm.rank)
        return runs

    assert store_ranks(1, body) == [["first"]]


class StallingStore(MemoryStore):
    """A store that fails every request while ``down`` is set, as a TCP store whose host is
    stopped does (the client's request times out), and answers again once it is cleared."""

    def __init__(self) -> None:
        super().__init__(timeout=30)
        self.down = threading.Event()

    def _up(self) -> None:
        if self.down.is_set():
            raise plait.RendezvousError("store: the server did not answer (stopped)")

    def set(self, key: str, value: bytes) -> None:
        self._up()
        super().set(key, value)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        self._up()
        return super().get(key, timeout)

    def add(self, key: str, amount: int) -> int:
        self._up()
        return super().add(key, amount)

    def wait(self, keys: Any, timeout: float | None = None) -> None:
        self._up()
        super().wait(keys, timeout)

    def check(self, keys: Any) -> bool:
        self._up()
        return super().check(keys)


def _stall_and_heal(
    comm: plait.Communicator, store: StallingStore, saw: threading.Barrier, healed: threading.Event
) -> None:
    """Rank 0 stops the store until every rank's watcher has seen it fail, then heals it."""
    recovery = comm._recovery
    assert recovery is not None
    comm.barrier()
    if comm.rank == 0:
        store.down.set()
    saw.wait(20)
    deadline = time.monotonic() + 20
    while recovery.store_error is None and time.monotonic() < deadline:
        time.sleep(0.05)  # the watcher's next look at the store fails (a heartbeat)
    assert recovery.store_error is not None
    saw.wait(20)
    if comm.rank == 0:
        store.down.clear()
        healed.set()
    assert healed.wait(20)


def test_a_store_that_stalled_and_came_back_still_serves_agree_and_abort() -> None:
    """Note [a store that stalls]: one failed answer stopped every rank's watcher for good, so
    every later agree raised that the store was unreachable, aborts were no longer heard,
    and the heartbeats stopped."""
    store = StallingStore()
    saw = threading.Barrier(3)
    healed = threading.Event()

    def body(comm: plait.Communicator) -> Any:
        _stall_and_heal(comm, store, saw, healed)
        agreed = comm.agree(1)
        if comm.rank == 1:
            comm.abort("after the stall")
            return agreed, "aborted"
        with pytest.raises(plait.AbortedError, match="aborted by rank 1"):
            comm.allreduce(np.ones(2), timeout=15)
        return agreed, "told"

    results = store_ranks(3, body, store)
    assert results == [
        (plait.Agreement(1, (0, 1, 2)), "told"),
        (plait.Agreement(1, (0, 1, 2)), "aborted"),
        (plait.Agreement(1, (0, 1, 2)), "told"),
    ], results


def test_an_abort_just_after_the_store_came_back_is_heard_as_an_abort() -> None:
    """Note [a store that stalls]: an abort before the watcher's next look at a store that
    came back took the store for gone, told no peer through it, and only closed the
    transport: the peers raised PeerLostError, not AbortedError."""
    store = StallingStore()
    saw = threading.Barrier(3)
    healed = threading.Event()

    def body(comm: plait.Communicator) -> Any:
        _stall_and_heal(comm, store, saw, healed)
        if comm.rank == 1:
            comm.abort("just after the stall")  # before its watcher looks again
            return "aborted"
        with pytest.raises(plait.AbortedError, match="aborted by rank 1"):
            comm.allreduce(np.ones(2), timeout=15)
        return "told"

    assert store_ranks(3, body, store) == ["told", "aborted", "told"]


def test_a_store_that_fails_at_once_is_said_at_once() -> None:
    """A question to a store that is gone waited its whole time bound (half a second added
    to every failed call) though the store had failed at once."""

    def gone() -> None:
        raise plait.RendezvousError("store: connection refused")

    start = time.monotonic()
    assert _recovery._within(5.0, gone) is False
    assert time.monotonic() - start < 2.0
    assert _recovery._within(5.0, lambda: None) is True


def test_a_rank_that_never_agrees_is_named_on_every_rank() -> None:
    """The coordinator named the rank that never came; the others said only that "the
    coordinator neither decided nor was found failed", though it had, at the same deadline."""
    late = threading.Event()

    def body(comm: plait.Communicator) -> Any:
        if comm.rank == 2:  # alive, and never in time
            late.wait(10)
            return None
        if comm.rank == 0:  # the coordinator's deadline comes after rank 1's
            time.sleep(0.3)
        try:
            with pytest.raises(plait.CommTimeout) as info:
                comm.agree(1, timeout=1.0)
            return str(info.value)
        finally:
            if comm.rank == 1:
                late.set()

    said = store_ranks(3, body)
    assert "rank(s) [2] neither took part nor failed" in said[0]
    assert "before rank(s) [2] took part or failed" in said[1]


def test_an_aborted_communicator_that_shrink_replaced_says_both() -> None:
    """Its later calls said only the abort, never that shrink had replaced it."""

    def body(comm: plait.Communicator) -> Any:
        group = comm.split(0)
        if comm.rank == 0:
            comm.abort("why")
        new = comm.shrink()
        try:
            said = []
            for call in (lambda: comm.allreduce(np.ones(1)), lambda: group.allreduce(np.ones(1))):
                with pytest.raises(plait.AbortedError) as info:
                    call()
                said.append(str(info.value))
            with pytest.raises(plait.ClosedError) as closed:
                comm.agree()
            return [*said, str(closed.value)]
        finally:
            group.close()
            new.close()

    for said in store_ranks(3, body):
        assert said[0].endswith(
            "the communicator was aborted by rank 0 (why); then replaced by shrink()"
        )
        assert "aborted by its rank 0 (why); then replaced by shrink()" in said[1]
        assert said[2].endswith(
            "(the communicator was aborted by rank 0 (why); then replaced by shrink())"
        )


def test_a_shrink_that_failed_does_not_say_it_replaced_the_communicator() -> None:
    """The old communicator said "aborted by rank 1 (replaced by shrink())" after a shrink
    that timed out: nothing had replaced it."""
    late = threading.Event()

    def body(comm: plait.Communicator) -> Any:
        if comm.rank == 2:
            late.wait(10)
            return None
        try:
            with pytest.raises(plait.CommTimeout):
                comm.shrink(timeout=1.5)
            with pytest.raises(plait.AbortedError) as info:
                comm.allreduce(np.ones(1))
            return str(info.value)
        finally:
            if comm.rank == 1:
                late.set()

    for said in store_ranks(3, body)[:2]:
        assert "left for shrink()" in said
        assert "replaced" not in said


def test_an_abort_fails_every_receive_as_the_abort() -> None:
    """Every rank waiting in a receive when rank 1 aborted: a receive from a rank that had
    left after its own error said that rank was "lost: its process exited or was killed"."""

    def body(comm: plait.Communicator) -> Any:
        if comm.rank == 1:
            threading.Timer(0.3, comm.abort, ("watchdog",)).start()
        with pytest.raises(plait.CommError) as info:
            comm.recv(np.empty(4), (comm.rank + 1) % comm.size)
        return type(info.value).__name__, str(info.value)

    for r, (kind, said) in enumerate(store_ranks(4, body)):
        assert kind == "AbortedError", said
        assert said.startswith(f"rank {r}: recv from rank {(r + 1) % 4} (tag 0): "), said
        assert "aborted by rank 1 (watchdog)" in said


def test_ranks_that_all_abort_at_once_do_not_wait_for_each_other() -> None:
    """Each aborting rank waited out half a second for the others' marks, which a rank
    that aborted itself never wrote; every survivor aborting is the documented idiom."""
    ready = threading.Barrier(3)

    def body(comm: plait.Communicator) -> float:
        ready.wait(10)
        start = time.monotonic()
        comm.abort("every survivor aborts")
        return time.monotonic() - start

    took = store_ranks(3, body)
    assert max(took) < 0.3, took


@pytest.mark.parametrize("call", ["agree", "shrink"])
def test_a_coordinator_that_comes_after_the_others_gave_up_gives_up_too(call: str) -> None:
    """Rank 0, the coordinator, comes once ranks 1 and 2 have raised CommTimeout: it
    returned a result of agreement #0 the others never saw (a shrink then connected to
    survivors that had given up). A rank that times out now claims the void result itself
    (Note [one result] in plait._agreement), and the coordinator reads it."""
    gave_up = [threading.Event(), threading.Event()]

    def body(comm: plait.Communicator) -> Any:
        method = getattr(comm, call)
        if comm.rank == 0:
            assert all(event.wait(20) for event in gave_up)
            start = time.monotonic()
            with pytest.raises(plait.CommTimeout, match=r"given up by rank [12] .*\[0[],]"):
                method(timeout=10)
            assert time.monotonic() - start < 5
        else:
            try:  # (the other may come after this one's timeout on a loaded machine: [0,2])
                with pytest.raises(plait.CommTimeout, match=r"\[0[],]"):
                    method(timeout=0.3)
            finally:
                gave_up[comm.rank - 1].set()
        return comm.agree(comm.rank + 1 if comm.rank else 7, timeout=10)

    assert store_ranks(3, body) == [plait.Agreement(7 & 2 & 3, (0, 1, 2))] * 3


def test_a_coordinator_with_a_longer_timeout_decides_only_if_no_rank_gave_up() -> None:
    """Rank 1 (timeout 0.3 s) gave up on rank 2 and raised; rank 0 (timeout 20 s) waited on,
    and when rank 2 came, both returned a result of the agreement rank 1 had given up."""
    gave_up = threading.Event()
    store = MemoryStore(timeout=30)

    def body(comm: plait.Communicator) -> Any:
        if comm.rank == 2:
            assert gave_up.wait(20)
            start = time.monotonic()
            with pytest.raises(plait.CommTimeout, match="given up by rank 1"):
                comm.agree(1, timeout=10)
            assert time.monotonic() - start < 5
        elif comm.rank == 1:
            try:
                store.wait(["job/ft/agree/0/flag/0"], 20)  # rank 0 waits in the agreement
                with pytest.raises(plait.CommTimeout, match=r"rank\(s\) \[2\] neither took"):
                    comm.agree(1, timeout=0.3)
            finally:
                gave_up.set()
        else:
            with pytest.raises(plait.CommTimeout, match="given up by rank 1"):
                comm.agree(1, timeout=20)
        return comm.agree(1, timeout=10)

    assert store_ranks(3, body, store) == [plait.Agreement(1, (0, 1, 2))] * 3


def test_a_claim_whose_winner_failed_before_writing_it_is_settled_from_its_proposal() -> None:
    """Rank 0 won the claim of agreement #0 and failed before it wrote the result: rank 1,
    which lost the claim, writes rank 0's proposal for every rank (Note [one result])."""
    from plait._agreement import Ballot

    store = MemoryStore(timeout=5)
    live = _liveness.Liveness(store)
    live.failed.add(0)  # failed, as an earlier agreement would have left it out
    store.set("agree/0/proposal/0", b"void 0 2")
    store.add("agree/0/claims", 1)
    ballot = Ballot(store, live, 1, 3, 0, "agree")
    ballot.take_part(1)
    assert ballot.decide(time.monotonic()) is None  # lost: the winner wrote nothing
    assert ballot.settle(5.0) == "void 0 2"
    assert store.get("agree/0/result") == b"void 0 2"
    # Two ranks that may have won, both failed: nobody can know which, and every rank says so.
    live.failed.add(2)
    store.set("agree/1/proposal/0", b"void 0 2")
    store.add("agree/1/claims", 1)
    store.set("agree/1/proposal/2", b"1 0,1,2")
    store.add("agree/1/claims", 1)
    other = Ballot(store, live, 1, 3, 1, "agree")
    assert other.decide(time.monotonic()) is None
    with pytest.raises(plait.CommTimeout, match=r"one of rank\(s\) \[0, 2\] claimed"):
        other.settle(5.0)


def test_a_lone_rank_closed_or_replaced_by_shrink_refuses_as_many_ranks_do() -> None:
    """A communicator of one rank agreed and shrank after shrink() had replaced it, or after
    close(), and its later calls did not say that shrink() had replaced it."""
    (comm,) = memory_communicators(1)
    new = comm.shrink()
    for again in (comm.agree, comm.shrink):
        with pytest.raises(plait.ClosedError, match=r"closed .*replaced by shrink\(\)"):
            again()
    with pytest.raises(plait.AbortedError, match=r"replaced by shrink\(\)"):
        comm.allreduce(np.ones(1))
    new.close()
    for again in (new.agree, new.shrink):
        with pytest.raises(plait.ClosedError, match="on a closed communicator"):
            again()


@pytest.mark.parametrize("value", [b"\xff\xfe", b"abc\nhello", b"7\nno such rank"])
def test_an_abort_value_no_rank_writes_aborts_without_killing_the_watcher(
    value: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store client with the secret that wrote a value no rank writes (not UTF-8, no rank
    as its source) killed rank 1's watcher thread (UnicodeDecodeError, ValueError in
    int()): its heartbeat stopped, and no abort was heard there again."""
    died: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: died.append(args.exc_value))
    store = MemoryStore(timeout=30)

    def body(comm: plait.Communicator) -> Any:
        comm.barrier()
        if comm.rank == 0:
            store.set("job/ft/abort/1", value)
        if comm.rank == 1:
            with pytest.raises(plait.AbortedError) as info:
                comm.recv(np.zeros(2), 0, tag=3, timeout=15)
            return str(info.value)
        with pytest.raises(plait.CommError):
            comm.recv(np.zeros(2), 1, tag=3, timeout=15)
        return None

    results = store_ranks(3, body, store)
    assert not [r for r in results if isinstance(r, BaseException)], results
    assert "aborted by a store client that is no rank of it" in results[1], results[1]
    assert died == []
