"""Calls plait makes within another (split's allgather, bcast_object's broadcasts) are
recorded with the call they are part of, and ``plait analyze`` tells them from the user's."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
from dumpkit import call, dump

import plait
from plait.diagnostics._mismatch import first_mismatch
from plait.diagnostics.schema import parse
from plait.testing import run_ranks


def _calls(comm: plait.Communicator) -> list[tuple[int, str, str]]:
    rec = comm._runner.recorder
    assert rec is not None
    return [(c["seq"], c["collective"], c["within"]) for c in rec.snapshot()]


def test_the_recorder_keeps_the_call_an_inner_call_is_part_of() -> None:
    def body(comm: plait.Communicator) -> Any:
        comm.allgather(np.zeros(3, np.int64))
        comm.split(0)
        comm.bcast_object({"a": 1}, root=0)
        return _calls(comm)

    for calls in run_ranks(2, body):
        assert calls[:2] == [(0, "allgather", ""), (1, "allgather", "split")]
        assert {within for _, c, within in calls[2:] if c == "broadcast"} == {"bcast_object"}


def test_a_dump_without_within_reads_as_the_users_calls() -> None:
    old = dump(0, 2, [call(0)])  # as dumps were written before the field
    assert "within" not in old["calls"][0]
    assert parse(old).calls[0].within == ""
    new = copy.deepcopy(old)
    new["calls"][0]["within"] = "split"
    record = parse(new).calls[0]
    assert (record.within, record.name) == ("split", "split (its allreduce)")
    assert record.describe() == "split (its allreduce) #0 (train.py:42)"


def test_an_inner_call_against_the_users_own_is_a_mismatch() -> None:
    """One rank in split, the others in an allgather of three int64: the calls' fields are
    equal, but not what they are part of (the case docs/debugging.md gives)."""
    mine = call(1, "allgather", count=3, dtype="int64", op="-", line=8)
    theirs = dict(call(1, "allgather", count=3, dtype="int64", op="-", line=6), within="split")
    dumps = [parse(dump(r, 3, [call(0), theirs if r == 1 else mine])) for r in range(3)]
    found = first_mismatch({d.rank: {c.seq: c for c in d.calls} for d in dumps})
    assert found is not None
    assert (found[0].kind, found[0].seq, found[0].ranks) == ("mismatch", 1, (1,))
    assert found[0].message == (
        "rank 1 is in split (its allgather) #1 (train.py:6) while ranks 0, 2 are in "
        "allgather #1 (train.py:8)"
    )


def test_analyze_names_the_call_an_unreached_inner_call_is_part_of() -> None:
    """A rank that never reached a bcast_object's broadcast was said to miss "broadcast":
    a call the program never made."""
    from plait.diagnostics.analyze import diagnose

    inner = {"within": "bcast_object"}
    dumps = []
    for r in range(3):
        calls = [call(0), dict(call(1, "broadcast", state="running", end=None), **inner)]
        calls[1]["waiting_on"] = [2]
        dumps.append(parse(dump(r, 3, calls)))
    dumps[2] = parse(dump(2, 3, [call(0)], reason="signal SIGUSR1"))
    [d] = diagnose(dumps)
    assert d.findings[0].kind == "never_arrived"
    assert d.findings[0].message.startswith(
        "rank 2 never reached call #1 (bcast_object (its broadcast) at train.py:42)"
    ), d.findings[0].message
