"""The flight recorder hooked into the communicator: every call recorded, dumps on errors.

Threads play the ranks (``plait.testing.run_ranks``); multi-process checks
(SIGUSR1, ``plait analyze`` on a real job, timelines of ``plait run``) are in
tests/multiprocess/test_diagnostics.py.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import plait
from plait.diagnostics import load
from plait.diagnostics.recorder import FlightRecorder
from plait.testing import memory_communicators, run_ranks


def _recorder(comm: plait.Communicator) -> FlightRecorder:
    rec = comm._runner.recorder
    assert rec is not None
    return rec


def _here() -> int:
    """The line number of the caller's line."""
    return sys._getframe(1).f_lineno


def test_every_call_is_recorded_with_the_callers_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLAIT_RECORDER_STACK", "1")  # else only calls in flight or failed

    def body(comm: plait.Communicator) -> dict[str, int]:
        lines = {}
        x = np.arange(4.0)
        comm.allreduce(x)
        lines["allreduce"] = _here() - 1
        comm.broadcast(x, 0)
        lines["broadcast"] = _here() - 1
        comm.scatter(x, 0)
        lines["scatter"] = _here() - 1
        comm.barrier()
        lines["barrier"] = _here() - 1
        comm.allreduce(x, async_op=True).wait()
        lines["async allreduce"] = _here() - 1
        sub = comm.split(0)
        lines["split"] = _here() - 1
        sub.allreduce(x)
        lines["sub allreduce"] = _here() - 1
        calls = _recorder(comm).snapshot()
        got = {f"{c['collective']} #{c['seq']}": c for c in calls}
        assert list(got) == [
            "allreduce #0",
            "broadcast #1",
            "scatter #2",
            "barrier #3",
            "allreduce #4",
            "allgather #5",  # the split's
        ]
        for key, name in zip(got, lines, strict=False):
            c = got[key]
            assert c["state"] == "done", c
            assert c["stack"][0][:2] == [__file__, lines[name]], (name, c["stack"])
        assert got["allreduce #0"]["dtype"] == "float64"
        assert got["allreduce #0"]["op"] == "SUM"
        assert got["allreduce #4"]["queued"] is not None
        sub_calls = _recorder(sub).snapshot()
        assert [c["collective"] for c in sub_calls] == ["allreduce"]
        assert sub_calls[0]["stack"][0][1] == lines["sub allreduce"]
        sub.close()
        return lines

    run_ranks(2, body)


@pytest.mark.parametrize("size", [1, 2])
def test_a_kept_call_is_recorded_with_the_callers_line(
    monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    # A repeated call runs in the call runner's short-path frame straight from the edge
    # (CallRunner.short_path): the caller found from there is still the user's line.
    monkeypatch.setenv("PLAIT_RECORDER_STACK", "1")

    def body(comm: plait.Communicator) -> None:
        x = np.arange(4.0)
        lines = []
        for _ in range(2):
            comm.allreduce(x, out=x)
            lines.append(_here() - 1)
            comm.broadcast(x, 0)
            lines.append(_here() - 1)
            comm.barrier()
            lines.append(_here() - 1)
        assert all(cut.go is not None for cut in comm._shortcuts.values())
        calls = _recorder(comm).snapshot()
        assert [c["collective"] for c in calls] == ["allreduce", "broadcast", "barrier"] * 2
        assert [c["stack"][0][:3] for c in calls] == [[__file__, n, "body"] for n in lines]

    run_ranks(size, body)


def test_by_default_a_call_that_ends_well_shows_where_its_kind_was_first_made() -> None:
    """No stack per call (PLAIT_RECORDER_STACK=0): the call shape's first caller instead."""

    def body(comm: plait.Communicator) -> None:
        x = np.arange(4.0)
        comm.allreduce(x)
        first = _here() - 1
        comm.allreduce(x)  # the same kind of call from another line
        comm.broadcast(x, 0)
        bcast = _here() - 1
        calls = _recorder(comm).snapshot()
        assert [c["stack"] for c in calls] == [[], [], []]
        assert [c["site"][1] for c in calls] == [first, first, bcast]
        assert calls[0]["site"] == [__file__, first, "body"]

    run_ranks(2, body)


def test_a_failed_call_is_dumped_with_whom_it_waited_for(tmp_path: Path) -> None:
    failed = threading.Event()

    def body(comm: plait.Communicator) -> str | None:
        if comm.rank == 1:
            failed.wait(30)  # rank 1 stays out of the call until rank 0 has given up on it
            return None
        try:
            with pytest.raises(plait.CollectiveTimeout) as info:
                comm.allreduce(np.ones(4), timeout=0.5)
        finally:
            failed.set()
        return str(info.value)

    message, _ = run_ranks(2, body)
    assert message is not None
    path = Path(message.rsplit("flight recorder dump: ", 1)[1])
    assert path == tmp_path / "dumps" / "testjob" / "rank0.json"  # conftest.py
    dump = load(path)
    assert dump.reason.startswith("CollectiveTimeout: rank 0: allreduce")
    [call] = dump.calls
    assert call.state == "failed"
    assert call.waiting_on == (1,)  # kept before the executor withdrew its handles
    assert call.stack[0][0] == __file__  # a failed call keeps its caller's line
    assert call.stack[0][2] == "body"
    assert call.error is not None


def test_a_one_sided_mismatch_is_dumped_with_the_peer_that_differs() -> None:
    # Of two ranks in different one-sided calls, at least one finds the other's post there
    # already and never waits: its dump must still name the peer it checked.
    def body(comm: plait.Communicator) -> int:
        x = np.ones(4, np.float32)
        comm.allreduce(x, algorithm="arena_oneshot")
        op = plait.SUM if comm.rank == 0 else plait.MAX
        with pytest.raises(plait.MismatchError) as info:
            comm.allreduce(x, op, algorithm="arena_oneshot")
        dump = load(Path(str(info.value).rsplit("flight recorder dump: ", 1)[1]))
        call = dump.calls[-1]
        assert call.state == "failed"
        assert call.waiting_on == (1 - comm.rank,), call
        return comm.rank

    assert run_ranks(2, body) == [0, 1]


def test_an_argument_error_is_not_a_call() -> None:
    [comm] = memory_communicators(1)
    with comm:
        with pytest.raises(TypeError):
            comm.allreduce(np.ones(2), out=[0.0, 0.0])
        comm.allreduce(np.ones(2))
        assert [c["seq"] for c in _recorder(comm).snapshot()] == [0]


def test_a_call_on_a_broken_communicator_is_recorded_as_failed() -> None:
    """The runner ends the slot on every way out, the refusal of a broken communicator too."""
    [comm] = memory_communicators(1)
    with comm:
        comm.allreduce(np.ones(1))
        choice = comm._choose("allreduce", "auto", 8, plait.SUM)
        req = comm._stage.request(choice, 1, np.ones(1), None, (1,), plait.SUM)
        rec = _recorder(comm)
        slot = rec.begin(req.plan.shape, 7)
        comm._runner.broken = plait.CommError("earlier failure")
        with pytest.raises(plait.CommError, match="unusable"):
            comm._runner._run(req, 7, 1.0, ("allreduce", req.spec.name, 7), slot)
        assert slot.state == "failed"
        assert slot.error is not None


def test_recorder_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLAIT_RECORDER_SIZE", "0")
    [comm] = memory_communicators(1)
    with comm:
        assert comm._runner.recorder is None
        np.testing.assert_array_equal(comm.allreduce(np.ones(2)), [1.0, 1.0])
        with pytest.raises(plait.UnsupportedError, match="PLAIT_RECORDER_SIZE=0"):
            comm.stragglers()


def test_a_bad_recorder_setting_fails_at_construction(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLAIT_RECORDER_SIZE", "many")
    with pytest.raises(ValueError, match="PLAIT_RECORDER_SIZE"):
        memory_communicators(1)


def test_stragglers_measures_the_calls_every_rank_completed() -> None:
    def body(comm: plait.Communicator) -> list[Any]:
        assert [x.calls for x in comm.stragglers()] == [0] * comm.size  # nothing yet
        for _ in range(5):
            comm.allreduce(np.ones(3))
        every = comm.stragglers()
        last = comm.stragglers(window=2)
        return [every, last]

    results = run_ranks(3, body)
    for every, last in results:
        assert [x.rank for x in every] == [0, 1, 2]
        # the first stragglers() made one call (#0: nothing to gather yet), then five
        # allreduces (#1 .. #5); the second measured those five, not its own calls (it
        # counted #0, and the third its #6 and #7); the third measured #4 and #5
        assert all(x.calls == 5 for x in every), every
        assert all(x.calls == 2 for x in last), last
        assert all(x.worst_seq in (4, 5) for x in last), last
        assert all(0 <= x.median <= x.max for x in every)
    assert all(r == results[0] for r in results)  # the same table on every rank


def test_stragglers_measures_a_whole_window_past_its_own_calls() -> None:
    """Earlier stragglers calls in the ring do not shorten the window: it is the last
    ``window`` calls of the program, whatever their numbers."""

    def body(comm: plait.Communicator) -> list[Any]:
        for _ in range(20):
            comm.allreduce(np.ones(4))
        comm.stragglers(window=10)  # calls #20 and #21
        comm.stragglers(window=10)  # #22 and #23
        for _ in range(3):
            comm.allreduce(np.ones(4))  # #24 .. #26
        return comm.stragglers(window=10)

    for late in run_ranks(2, body):
        assert [x.calls for x in late] == [10, 10], late
        assert all(x.worst_seq in {*range(13, 20), *range(24, 27)} for x in late), late


def test_stragglers_measures_a_full_ring(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a ring of R calls it measures R: its own first call takes a place in the ring
    only after it has read the calls there; a later call finds two places taken by the
    earlier one's calls."""
    monkeypatch.setenv("PLAIT_RECORDER_SIZE", "10")

    def body(comm: plait.Communicator) -> list[list[int]]:
        for _ in range(20):
            comm.allreduce(np.ones(4))
        first = [x.calls for x in comm.stragglers()]
        return [first, [x.calls for x in comm.stragglers(window=10)]]

    for first, second in run_ranks(2, body):
        assert first == [10, 10]
        assert second == [8, 8]  # the ring holds #12 .. #19 and the first call's #20, #21


def test_stragglers_with_a_ring_of_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLAIT_RECORDER_SIZE", "1")

    def body(comm: plait.Communicator) -> list[list[int]]:
        for _ in range(3):
            comm.allreduce(np.ones(4))
        first = [x.calls for x in comm.stragglers()]
        return [first, [x.calls for x in comm.stragglers()]]

    for first, second in run_ranks(2, body):
        assert first == [1, 1]  # the last allreduce
        assert second == [0, 0]  # the ring holds only the first stragglers' allgather


def test_stragglers_refuses_a_bad_window() -> None:
    [comm] = memory_communicators(1)
    with comm, pytest.raises(ValueError, match="window"):
        comm.stragglers(window=0)


def test_timeline_of_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLAIT_TIMELINE", str(tmp_path / "trace-{rank}.json"))

    def body(comm: plait.Communicator) -> None:
        comm.allreduce(np.ones(64, np.float32), algorithm="ring")
        tl = comm._runner.timeline
        assert tl is not None
        tl.write()

    run_ranks(2, body)
    for r in range(2):
        events = json.loads((tmp_path / f"trace-{r}.json").read_text())["traceEvents"]
        assert [e["name"] for e in events if e.get("cat") == "call"] == ["allreduce #0"]
        steps = [e for e in events if e.get("cat") in ("send", "recv", "recv_reduce")]
        assert steps, events
        assert all(e["args"]["peer"] == 1 - r for e in steps)
