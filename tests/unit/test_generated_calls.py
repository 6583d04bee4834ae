"""A one-sided call as one generated function: its begin and posts in place, its Call made
only where a slow way needs one (Note [generated runs] in plait.runtime.compiled)."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from plait.algos._registry import build_schedule, get
from plait.runtime import compiled
from plait.runtime.executor import Call
from plait.schedule.builder import Context
from plait.transport.base import background_thread, may_spin

EPOCH = 6  # past the first two calls: a begin reads the peers' counters
BASE = EPOCH << 32
CHECK = 7


class _Window:
    """Two ranks' window in lists: each rank's counter and two digest words, read in place."""

    polls = 0
    yields = 0

    def __init__(self, peer_counter: Any) -> None:
        self.halves = [np.zeros(4096, np.uint8) for _ in range(2)]
        self.counters: list[Any] = [[0], peer_counter]
        self.digests = [[0, 0], [CHECK, CHECK]]
        self.posted: list[int] = []
        self.begun: list[int] = []

    def typed(self, q: int, half: int, dtype: np.dtype) -> np.ndarray:
        return self.halves[q][half * 2048 : (half + 1) * 2048].view(dtype)

    def reserve(self, nbytes: int) -> None:
        assert nbytes <= 2048

    def probe(self, q: int, half: int) -> tuple[Any, int, Any, int]:
        return self.counters[q], 0, self.digests[q], half

    def begin(self, epoch: int, digest: int, deadline: float | None) -> int:
        self.begun.append(epoch)
        self.digests[0][epoch & 1] = digest
        return epoch & 1

    def post(self, value: int) -> None:
        self.posted.append(value)
        self.counters[0][0] = value

    def end(self, epoch: int) -> None:
        self.post((epoch + 1) << 32)


class _Poster(_Window):
    """The window, posting in place as a shared-memory window does (Window.poster)."""

    def __init__(self, peer_counter: Any) -> None:
        super().__init__(peer_counter)
        self.flags = [0]
        self.fence = threading.Lock()

    def poster(self) -> Any:
        return self.counters[0], 0, self.fence, (self.flags,), 0


class _Late:
    """A peer's counter: short of ``need`` at its first ``short`` reads, then at ``need``."""

    def __init__(self, short: int, need: int) -> None:
        self.reads, self.short, self.need = 0, short, need

    def __getitem__(self, i: int) -> int:
        self.reads += 1
        return 0 if self.reads <= self.short else self.need


def _run(window: _Window) -> tuple[np.ndarray, list[tuple[Any, ...]]]:
    """A 2-rank one-shot allreduce of rank 0 through the generated run; the Calls it made."""
    ctx = Context("allreduce", 0, 2, 4, 4, window=2048)
    schedule = build_schedule(get("allreduce", "arena_oneshot"), ctx)
    made: list[tuple[Any, ...]] = []
    key = Call("allreduce (test)", 0, CHECK, np.add, None, epoch=EPOCH, seq=EPOCH)

    def make(k: Any, epoch: int, seq: int, slot: Any) -> Call:
        made.append((k, epoch, seq, slot))
        return key

    window.typed(1, EPOCH & 1, np.dtype(np.float32))[:4] = [10, 20, 30, 40]
    x = np.arange(4, dtype=np.float32)
    run = compiled.compiled_for(schedule, window, np.dtype(np.float32)).run
    run(x, x, x[:0], True, EPOCH, EPOCH, None, make, key, window, None)
    return x, made


def test_a_call_whose_peers_are_ready_makes_no_call_and_begins_in_place() -> None:
    window = _Window([BASE | 5])  # the peer posted every phase of this call
    x, made = _run(window)
    np.testing.assert_array_equal(x, [10, 21, 32, 43])
    assert made == []  # the fast way needs no Call
    assert window.begun == []  # Window.begin, inline: the peer ended call EPOCH - 2
    assert window.digests[0][EPOCH & 1] == CHECK  # this rank's digest word for the half
    assert window.posted[0] == BASE | 1


def test_a_peer_behind_at_the_start_takes_the_windows_begin_with_the_calls_call() -> None:
    window = _Window(_Late(1, BASE | 5))  # short at the begin's read only
    x, made = _run(window)
    np.testing.assert_array_equal(x, [10, 21, 32, 43])
    assert window.begun == [EPOCH]  # through begin_call, which waits for the peer
    assert [m[1:] for m in made] == [(EPOCH, EPOCH, None)]  # made once, for the slow way


class _Reads:
    """A peer's counter that reads ``values`` in turn, then the last of them for good."""

    def __init__(self, *values: int) -> None:
        self.values = list(values)

    def __getitem__(self, i: int) -> int:
        return self.values.pop(0) if len(self.values) > 1 else self.values[0]


def test_where_ranks_outnumber_cores_a_wait_yields_before_it_makes_a_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    yielded: list[int] = []
    monkeypatch.setattr(compiled.os, "sched_yield", lambda: yielded.append(1))
    window = _Window(_Reads(BASE | 5, 0, 0, BASE | 5))  # begun; short at two reads of the wait
    window.yields = 8
    x, made = _run(window)
    np.testing.assert_array_equal(x, [10, 21, 32, 43])
    assert len(yielded) == 2  # the core given up until the peer's post was there
    assert made == []  # and no Call made, no slow way taken


def test_a_post_is_stored_in_place_and_goes_through_post_only_for_a_sleeper() -> None:
    window = _Poster([BASE | 5])
    _run(window)
    assert window.counters[0][0] == BASE | 1  # its one post (the call ends with it)
    assert window.posted == []  # in place, not through post

    window = _Poster([BASE | 5])
    window.flags[0] = 1  # the peer sleeps on this rank's counter: post wakes it
    _run(window)
    assert window.posted == [BASE | 1]


def test_may_spin_is_per_thread() -> None:
    # A thread that never called background_thread reads the class's default (an attribute
    # read, not a caught AttributeError on every wait); the worker's mark stays its own.
    seen: list[bool] = []

    def worker() -> None:
        seen.append(may_spin())
        background_thread()
        seen.append(may_spin())

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    other = threading.Thread(target=lambda: seen.append(may_spin()))
    other.start()
    other.join()
    assert seen == [True, False, True]
    assert may_spin()


def test_a_call_that_cannot_be_compiled_tells_its_peers_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The call is compiled before it begins: an error there that is not a CommError (out
    # of memory, an interrupt) left the peers to wait out the timeout; it is posted now.
    import time

    import plait
    from plait.testing import run_ranks

    generate = compiled._generate
    here = threading.local()

    def failing(*args: Any, **kwargs: Any) -> Any:
        if getattr(here, "fails", False):
            raise MemoryError("no memory for the compiled call")
        return generate(*args, **kwargs)

    monkeypatch.setattr(compiled, "_generate", failing)

    peer_done = threading.Event()  # rank 0 stays (closing would tell rank 1 as much)

    def body(comm: plait.Communicator) -> tuple[str, float]:
        here.fails = comm.rank == 0
        start = time.monotonic()
        try:
            comm.allreduce(np.ones(4), algorithm="arena_oneshot")
            got = "ok"
        except (MemoryError, plait.CommError) as exc:
            got = type(exc).__name__
        waited = time.monotonic() - start
        if comm.rank == 1:
            peer_done.set()
        else:
            peer_done.wait(30)
        return got, waited

    (zero, _), (one, waited) = run_ranks(2, body, timeout=20.0)
    assert (zero, one) == ("MemoryError", "PeerLostError")
    assert waited < 10  # at once, not at the timeout
