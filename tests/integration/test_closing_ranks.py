"""Calls cut short by a close: a rank's own close, and a peer's (threads as ranks).

A rank whose communicator is closed from another thread while a call on it is blocked
raises ClosedError on every transport (the in-process one raised PeerLostError, as if the
rank had lost itself). A rank that closes during a call is named as one that closed, not
one that died, by the ranks that hear of it from others (Note [peers that close] in
plait.transport.base); kill -9 and survivors that close: tests/multiprocess/
test_closing_survivors.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import plait
from plait.rendezvous.store import MemoryStore
from plait.testing import memory_communicators
from plait.transport.harness import build_in_threads
from plait.transport.route import connect

pytestmark = pytest.mark.timeout(60)


def _communicators(kind: str, n: int) -> list[plait.Communicator]:
    if kind == "memory":
        return memory_communicators(n, timeout=20)
    store = MemoryStore(timeout=30)
    links = ("shm",) if kind == "shm" else ("tcp",)
    return build_in_threads(
        n,
        lambda r: plait.Communicator(
            connect(r, n, ["h"] * n, store, links=links, timeout=20), timeout=20
        ),
    )


CALLS: dict[str, Callable[[plait.Communicator], Any]] = {
    "recv": lambda comm: comm.recv(np.zeros(4), 1),
    "allreduce": lambda comm: comm.allreduce(np.ones(4), algorithm="ring"),
    # (a message larger than any transport holds for a receive not posted: the send waits;
    # its wait read the close's wake-up as its timeout, and raised CommTimeout)
    "send": lambda comm: comm.send(np.ones(4_000_000), 1),
    "isend": lambda comm: comm.isend(np.ones(4_000_000), 1).wait(),
}


@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("kind", ["memory", "shm", "tcp"])
def test_a_close_from_another_thread_fails_the_blocked_call_with_closed_error(
    kind: str, call: str
) -> None:
    if kind == "memory" and "send" in call:
        pytest.skip("the in-process transport takes any send at once: nothing to cut short")
    comms = _communicators(kind, 2)
    try:
        closer = threading.Timer(0.3, comms[0].close)
        closer.start()
        start = time.monotonic()
        with pytest.raises(plait.CommError) as info:
            CALLS[call](comms[0])  # rank 1 never takes part
        closer.join()
        assert time.monotonic() - start < 10  # the close ended it, not the timeout
        assert isinstance(info.value, plait.ClosedError), repr(info.value)
        assert not isinstance(info.value, plait.PeerLostError)
        assert str(info.value).startswith("rank 0: "), info.value
    finally:
        for comm in comms:
            comm.close()


def test_ranks_that_hear_of_a_close_say_it_closed_not_that_it_was_lost() -> None:
    # A ring of 4: rank 0 closes instead of making the second call. Rank 1 receives from
    # it and rank 3 sends to it, so both fail on its close; rank 2 talks only to ranks 1
    # and 3, and hears of rank 0 from them: rank 0 closed, it was not lost.
    comms = memory_communicators(4, timeout=20)
    errors: dict[int, BaseException] = {}

    def body(comm: plait.Communicator) -> None:
        try:
            comm.allreduce(np.ones(4), algorithm="ring")
            if comm.rank == 0:
                comm.close()
                return
            comm.allreduce(np.ones(4), algorithm="ring")
        except plait.CommError as exc:
            errors[comm.rank] = exc

    threads = [threading.Thread(target=body, args=(c,)) for c in comms]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for comm in comms:
        comm.close()
    assert sorted(errors) == [1, 2, 3], errors
    for r in (1, 2, 3):
        err = errors[r]
        assert isinstance(err, plait.PeerLostError), repr(err)
        assert err.lost_rank == 0, (r, err)
        assert "rank 0 has closed its communicator" in str(err) or (
            "rank 0 closed its communicator during the call" in str(err)
        ), (r, err)
        assert "was lost" not in str(err), (r, err)
