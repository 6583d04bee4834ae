"""PLAIT_DEBUG=detail's check of every call is a part of the call, in the flight recorder too.

The check allgathers every rank's signature before the call (Note [the check] in
:mod:`plait._signature`). It takes no call number users see and no slot of the ring: the
recorder, ``stragglers`` and errors number the calls as without the check, and a
mismatch the check finds fails the call as any MismatchError does, dumped and named.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import plait
from plait.testing import run_ranks


@pytest.fixture(autouse=True)
def _detail(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLAIT_DEBUG", "detail")


def _ring(comm: plait.Communicator) -> list[tuple[int, str]]:
    rec = comm._runner.recorder
    assert rec is not None
    return [(c["seq"], c["collective"]) for c in rec.snapshot() if not c.get("within")]


def test_the_ring_holds_the_users_calls_numbered_as_without_the_check() -> None:
    def body(comm: plait.Communicator) -> Any:
        for _ in range(4):
            comm.allreduce(np.ones(3))
        comm.broadcast(np.ones(2), root=0, async_op=True).wait()
        late = comm.stragglers()
        return _ring(comm), [lateness.calls for lateness in late]

    for ring, measured in run_ranks(3, body):
        assert ring == [(0, "allreduce"), (1, "allreduce"), (2, "allreduce"), (3, "allreduce"),
                        (4, "broadcast")]  # fmt: skip
        assert measured == [5, 5, 5]  # the user's five calls, not their checks too


def test_a_mismatch_the_check_finds_names_the_call_and_its_dump() -> None:
    def body(comm: plait.Communicator) -> tuple[str, list[tuple[int, str]]]:
        comm.allreduce(np.ones(3))
        with pytest.raises(plait.MismatchError) as info:
            comm.allreduce(np.ones(5 + comm.rank % 2), algorithm="ring")
        return str(info.value), _ring(comm)

    for r, (msg, ring) in enumerate(run_ranks(3, body)):
        assert msg.startswith(f"rank {r}: allreduce (ring, call #1): ranks made different calls")
        assert "ranks [0, 2]: allreduce(count=5, dtype=float64, op=SUM" in msg
        assert "ranks [1]: allreduce(count=6" in msg
        said, _, path = msg.partition("; flight recorder dump: ")
        assert "this rank called" not in said  # every rank's call is named already
        dumped = json.loads(Path(path).read_text())
        assert dumped["reason"].startswith(f"MismatchError: rank {r}: allreduce (ring, call #1)")
        last = dumped["calls"][-1]
        assert (last["seq"], last["collective"], last["state"]) == (1, "allreduce", "failed")
        assert ring == [(0, "allreduce"), (1, "allreduce")]


def test_a_check_that_waits_in_vain_fails_as_the_users_call() -> None:
    """Rank 1 never makes call #1: rank 0 times out in the check, and its error and its dump
    name its allreduce #1, waiting for rank 1, not an allgather of its own."""
    failed = threading.Event()

    def body(comm: plait.Communicator) -> str | None:
        comm.allreduce(np.ones(3))
        if comm.rank == 1:
            failed.wait(30)
            return None
        try:
            with pytest.raises(plait.CollectiveTimeout) as info:
                comm.allreduce(np.ones(3), algorithm="ring", timeout=1.0)
        finally:
            failed.set()
        return str(info.value)

    msg, _ = run_ranks(2, body)
    assert msg is not None
    assert msg.startswith("rank 0: allreduce (ring, call #1) timed out waiting for rank(s) [1]")
    path = msg.rpartition("; flight recorder dump: ")[2]
    last = json.loads(Path(path).read_text())["calls"][-1]
    assert (last["seq"], last["collective"], last["state"]) == (1, "allreduce", "failed")
    assert last["waiting_on"] == [1]
