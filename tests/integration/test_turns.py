"""A one-sided call that gives up waiting for its turn breaks the communicator.

Note [a turn given up] in plait._turns. A blocking call queued behind an asynchronous
one-sided call that waited for a late peer timed out, passed the turn on though it never had
it, and left the communicator usable: the next one-sided call could run beside the call
still running, and once that one ended it handed the turn back, so that a later call waited
its whole timeout behind nothing; the peers, which would make the call given up, were not
told. The same jobs in separate processes: tests/multiprocess/test_turn_given_up.py.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

import plait
from plait.testing import run_ranks

pytestmark = pytest.mark.timeout(60)

ONE_SIDED = "arena_oneshot"


@pytest.mark.parametrize("timeout", [None, 0.3], ids=["short-path", "own-timeout"])
def test_a_call_that_gives_up_its_turn_breaks_the_communicator(timeout: float | None) -> None:
    """Rank 1 is late to call #0, an async one-sided call of rank 0; rank 0's blocking call
    #1 (the communicator's timeout: the one-sided short path; its own: the general one)
    gives up waiting for its turn. The communicator is broken there, the turn stays with
    call #0, which still finishes, later calls refuse at once, and rank 1's call #1 learns
    at its first stall that rank 0 gave up on it."""
    gave_up, told = threading.Event(), threading.Event()

    def body(c: plait.Communicator) -> dict[str, Any]:
        x = np.ones(3)
        if c.rank == 1:
            assert gave_up.wait(20)
            first = c.allreduce(x, algorithm=ONE_SIDED, timeout=20).tolist()
            try:
                c.allreduce(x, algorithm=ONE_SIDED, timeout=30)
            except plait.CommError as exc:
                error: BaseException = exc
            told.set()
            return {"first": first, "error": error}
        a = c.allreduce(x, algorithm=ONE_SIDED, async_op=True, timeout=20)
        with pytest.raises(plait.CollectiveTimeout) as info:
            c.allreduce(x, algorithm=ONE_SIDED, timeout=timeout)
        turn = c._runner.turn  # call #0 still runs: rank 1 comes only once told below
        gave_up.set()
        first = a.wait().tolist()
        refused = []
        for algorithm in (ONE_SIDED, "ring"):
            start = time.monotonic()
            with pytest.raises(plait.CommError) as later:
                c.allreduce(x, algorithm=algorithm, timeout=10)
            refused.append((str(later.value), time.monotonic() - start))
        assert told.wait(40)  # rank 1 hears of the call given up before this rank closes
        return {"gave_up": str(info.value), "turn": turn, "first": first, "refused": refused}

    zero, one = run_ranks(2, body, timeout=0.3 if timeout is None else 30)
    assert zero["turn"] == 0  # not passed on by the call that never had it
    assert zero["first"] == one["first"] == [2.0] * 3
    for said, seconds in zero["refused"]:
        assert "this communicator is unusable after an earlier failure" in said
        assert "(arena_oneshot, call #1): the one-sided call before it" in said
        assert seconds < 5  # refused at once, not after waiting for a turn or a peer
    assert "the one-sided call before it, allreduce (arena_oneshot, call #0)" in zero["gave_up"]
    assert (
        "this rank gave up on the call; its peers were told, and this communicator is "
        "unusable now; flight recorder dump: "
    ) in zero["gave_up"]
    error = one["error"]
    assert isinstance(error, plait.PeerLostError), error
    assert "rank 0 gave up on the call after an error of its own, CollectiveTimeout" in str(error)


def test_the_calls_waiting_behind_a_turn_given_up_stop_waiting() -> None:
    """Two calls of rank 0 (on two threads) wait for their turns behind an async call that
    waits for rank 1: once one gives up, the other raises at once, naming it, instead of
    waiting out its own timeout behind a turn that cannot come."""
    done = threading.Event()

    def body(c: plait.Communicator) -> Any:
        x = np.ones(3)
        if c.rank == 1:
            assert done.wait(40)
            return c.allreduce(x, algorithm=ONE_SIDED, timeout=20).tolist()
        a = c.allreduce(x, algorithm=ONE_SIDED, async_op=True, timeout=30)
        seen: dict[float, tuple[BaseException, float]] = {}

        def call(seconds: float) -> None:
            start = time.monotonic()
            try:
                c.allreduce(x, algorithm=ONE_SIDED, timeout=seconds)
            except plait.CommError as exc:
                seen[seconds] = (exc, time.monotonic() - start)

        others = [threading.Thread(target=call, args=(s,)) for s in (0.5, 25.0)]
        for t in others:
            t.start()
        for t in others:
            t.join(40)
        done.set()
        first = a.wait().tolist()
        return first, {s: (type(e).__name__, str(e), took) for s, (e, took) in seen.items()}

    (first, seen), other = run_ranks(2, body)
    assert first == other == [2.0] * 3
    assert seen[0.5][0] == "CollectiveTimeout"
    name, said, took = seen[25.0]
    assert name == "CommError"
    assert "this communicator is unusable after an earlier failure" in said, said
    assert took < 10  # not its 25 s
