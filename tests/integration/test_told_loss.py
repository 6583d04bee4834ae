"""A rank that learns of a lost rank from a peer's notice passes it on, as one that saw it.

Ranks run as threads over the in-process transport without a window (message calls, as in
``tests/integration/test_stall_probes.py``). Rank 2 is the rank lost: it makes no call and
stays, so no rank sees it go; rank 3 saw it go and told rank 0 alone (its notice to rank 1
stuck behind megabytes on a slow link, as across hosts). Rank 0 then leaves; rank 1, which
waits on rank 0 alone, named rank 0 as the lost rank, or timed out waiting on it.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import plait
from plait.runtime import notices, stall
from plait.runtime.executor import Call
from plait.testing import run_ranks

#: Far below rank 1's timeout: it learns of the loss from rank 0, not from its deadline.
RANK1_TIMEOUT = 10.0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("leaves", ["closes", "stays"])
@pytest.mark.parametrize("learns", ["stalled", "timed out"])
def test_a_loss_told_by_a_peer_is_passed_on(
    learns: str, leaves: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # stalled: rank 0's stall probes read the notice; timed out: rank 0's deadline, under a
    # probe period, ends its call and the notice read then explains it. closes: rank 0 closes
    # its communicator at once (a with block); stays: it stops driving its transport.
    told: list[tuple[int, int, int]] = []  # (teller, kind, lost) of each tell_all of settle
    real = stall.tell_all

    def spy(t: Any, call: Call, rank: int, size: int, kind: int = 1, lost: int = -1) -> None:
        told.append((rank, kind, lost))
        real(t, call, rank, size, kind, lost)

    monkeypatch.setattr(stall, "tell_all", spy)
    sent, done = threading.Event(), threading.Event()

    def body(comm: plait.Communicator) -> tuple[str, int | None, str] | None:
        if comm.rank == 3:  # it saw rank 2 go in its allreduce, and its notice reached rank 0
            call = Call(("allreduce", "ring", 0), 0, 1, np.add, None, seq=0)
            call = call._replace(probe_tag=comm._runner._probe_tag)
            notice = notices.pack(call, notices.LOST, (2,))
            comm._transport.isend(0, call.probe_tag, memoryview(notice), 0)
            sent.set()
        if comm.rank in (2, 3):
            assert done.wait(50)
            return None
        assert sent.wait(30)
        timeout = RANK1_TIMEOUT if comm.rank == 1 else 0.5 if learns == "timed out" else 30.0
        try:
            comm.allreduce(np.ones(4), algorithm="ring", timeout=timeout)
            out: tuple[str, int | None, str] = ("ok", None, "")
        except plait.CommError as exc:
            lost = exc.lost_rank if isinstance(exc, plait.PeerLostError) else None
            out = (type(exc).__name__, lost, str(exc).split("; flight recorder dump:")[0])
        if comm.rank == 1:
            done.set()
        elif leaves == "stays":
            assert done.wait(50)
        return out

    results = run_ranks(4, body, timeout=30, window=0)
    assert results[0] is not None
    assert results[1] is not None
    assert results[0][:2] == ("PeerLostError", 2), results
    assert "rank 2 was lost (rank 3 found so" in results[0][2], results[0]
    assert results[1][:2] == ("PeerLostError", 2), results
    assert "rank 2 was lost (rank 0 found so" in results[1][2], results[1]
    assert told.count((0, notices.LOST, 2)) == 1, told  # rank 0 passed it on, once
