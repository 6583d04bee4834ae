"""plait analyze: dumps written outside every recorded call (a point-to-point call), the
order of a killed rank and a rank the others wait for, the words of ranks without a dump,
and the thread that makes a communicator's calls."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from dumpkit import T0, call, dump, write

import plait
from plait.diagnostics._words import died
from plait.diagnostics.analyze import diagnose, format_report, main
from plait.diagnostics.schema import Dump, load_all, parse

PLAIT_RECV = [
    ["/x/lib/plait/_p2p_request.py", 613, "raise_dumped"],
    ["/x/lib/plait/_p2p.py", 477, "_block"],
    ["/x/lib/plait/_p2p.py", 182, "recv"],
]
WATCH = {"name": "plait-watch-rank0", "stack": [["/x/lib/plait/_recovery.py", 300, "_watch"]]}


def parsed(dumps: list[dict[str, Any]]) -> list[Dump]:
    return [parse(d) for d in dumps]


def main_at(*frames: list[Any]) -> list[dict[str, Any]]:
    """A dump's threads: plait's watcher, and the main thread at ``frames``."""
    return [WATCH, {"name": "MainThread", "stack": list(frames)}]


def p2p_dumps(reason0: str, reason1: str, *, rank1_in_recv: bool) -> list[dict[str, Any]]:
    """Two ranks past allreduce #0 to #2 (p2p.py:6); rank 0 in a recv at p2p.py:15 (dumped
    on ``reason0``), rank 1 in a recv too (line 11) or asleep at p2p.py:17."""
    calls = [call(s, file="/job/p2p.py", line=6) for s in range(3)]
    d0 = dump(0, 2, calls, reason=reason0)
    d0["threads"] = main_at(*PLAIT_RECV, ["/job/p2p.py", 15, "<module>"])
    d1 = dump(1, 2, calls, reason=reason1, time=T0 + 103)
    d1["threads"] = (
        main_at(*PLAIT_RECV, ["/job/p2p.py", 11, "<module>"])
        if rank1_in_recv
        else main_at(["/job/p2p.py", 17, "<module>"])
    )
    return [d0, d1]


def test_a_rank_stalled_in_a_receive_is_a_problem(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rank 0 waited in recv from rank 1 while rank 1 slept; plait run --stall-timeout had
    both dump. The report said "dumped on: stall (rank 0)" and "no problem found ... none
    is stuck", and exited with 0."""
    dumps = p2p_dumps(
        "stall: recv from rank 1 (tag 0) in flight for 4 s", "signal SIGUSR1", rank1_in_recv=False
    )
    [d] = diagnose(parsed(dumps))
    assert not d.ok
    assert d.reasons == ("stall in recv from rank 1 (tag 0) (rank 0)", "signal SIGUSR1 (rank 1)")
    first = d.findings[0]
    assert (first.kind, first.ranks, first.seq) == ("p2p", (0,), None)
    assert first.message.startswith(
        "rank 0 is stuck in recv from rank 1 (tag 0), a point-to-point call, at p2p.py:15: "
        "in flight for 4 s when the stall watchdog (--stall-timeout) dumped it, after its "
        "last collective, allreduce #2 (p2p.py:6)"
    )
    assert first.message.endswith(
        "rank 1's dump (signal SIGUSR1, 3.0 s later) finds it past its last call, "
        "allreduce #2 (p2p.py:6), at p2p.py:17"
    )
    write(tmp_path, dumps)
    assert main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "no problem found" not in out
    assert "first problem: rank 0 is stuck in recv from rank 1 (tag 0)" in out
    assert main([str(tmp_path), "--json"]) == 1
    [doc] = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False
    assert [f["kind"] for f in doc["findings"]] == ["p2p"]


def test_ranks_that_failed_in_point_to_point_calls_are_problems(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Both ranks received from each other (a MismatchError each), or rank 0 received from
    a rank that never sent (a CommTimeout): no collective was in flight, and the report
    said "no problem found" with exit status 0."""
    mismatch = (
        "MismatchError: rank {0}: recv from rank {1} (tag 0): job rank {1} waits in recv from "
        "rank {0} (tag 0) of the world communicator, for job rank(s) [{0}], a call this rank "
        "has not begun, while this rank waits for it here: the ranks made different calls on "
        "one communicator"
    )
    dumps = p2p_dumps(mismatch.format(0, 1), mismatch.format(1, 0), rank1_in_recv=True)
    [d] = diagnose(parsed(dumps))
    assert not d.ok
    assert d.reasons == ("MismatchError (ranks 0, 1)",)
    assert [(f.kind, f.ranks) for f in d.findings] == [("p2p", (0,)), ("p2p", (1,))]
    assert d.findings[0].message == (
        "rank 0 failed in recv from rank 1 (tag 0), a point-to-point call, at p2p.py:15, after "
        f"its last collective, allreduce #2 (p2p.py:6), ended at 12:00:02.010 UTC: "
        f"{mismatch.format(0, 1)}"
    )
    assert d.findings[1].message.startswith(
        "rank 1 failed in recv from rank 0 (tag 0), a point-to-point call, at p2p.py:11"
    )
    write(tmp_path, dumps)
    assert main([str(tmp_path)]) == 1
    assert "no problem found" not in capsys.readouterr().out

    timeout = (
        "CommTimeout: rank 0: recv from rank 1 (tag 0) did not complete within 5 s; the peer "
        "may have died or not made the matching send; flight recorder dump: /d/ro/rank0.json"
    )
    [d] = diagnose(parsed(p2p_dumps(timeout, "signal SIGUSR1", rank1_in_recv=False)))
    assert not d.ok
    [f] = d.findings
    assert f.kind == "p2p"
    assert f.message.startswith(
        "rank 0 failed in recv from rank 1 (tag 0), a point-to-point call, at p2p.py:15"
    )
    assert "did not complete within 5 s" in f.message
    assert f.message.endswith("at p2p.py:17")


def test_an_error_outside_every_recorded_call_is_a_problem() -> None:
    """An error's dump that names no point-to-point call is still said, with its thread's
    line, as no recorded call says it."""
    d0 = dump(0, 2, [call(0)], reason="CommError: rank 0: send_object to ... broke")
    d0["threads"] = main_at(["/x/lib/plait/objects.py", 10, "send_object"], ["/job/a.py", 3, "f"])
    [d] = diagnose(parsed([d0, dump(1, 2, [call(0)])]))
    [f] = d.findings
    assert f.kind == "error"
    assert f.message.startswith(
        "rank 0 dumped on an error outside any collective at a.py:3, after its last collective"
    )
    assert f.message.endswith(": CommError: rank 0: send_object to ... broke")


def test_a_stall_of_another_communicators_collective_is_not_this_ones() -> None:
    """A stall dumps every communicator of the process: one with no call in flight is not
    where the stalled collective is (its own report says so); a point-to-point stall
    could be on any of them, and the report says so."""
    dumps = [dump(r, 2, [call(0)], reason="stall: allreduce #5 in flight for 9 s") for r in (0, 1)]
    [d] = diagnose(parsed(dumps))
    assert d.ok
    stall = "stall: recv from rank 1 (tag 0) in flight for 4 s"
    world = dump(0, 2, [call(0)], reason=stall)
    group = dump(0, 2, [call(0)], reason=stall, comm=0x41A2)
    others = [dump(1, 2, [call(0)], comm=c) for c in (0, 0x41A2)]
    for d in (world, group):
        d["threads"] = main_at(*PLAIT_RECV, ["/job/train.py", 7, "<module>"])
    diags = diagnose(parsed([world, group, *others]))
    assert len(diags) == 2
    for x in diags:
        assert x.findings[0].message.startswith(
            "rank 0 is stuck in recv from rank 1 (tag 0) (this communicator's, or another's of "
            "its process), a point-to-point call, at train.py:7"
        )


def test_real_point_to_point_failures_are_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ranks made to fail in point-to-point calls write the dumps analyze reads: both
    receiving from each other, then rank 0 receiving from a rank that went on."""
    monkeypatch.setenv("PLAIT_DUMP_DIR", str(tmp_path))

    def crossed(c: plait.Communicator) -> None:
        c.allreduce(np.ones(4))
        with pytest.raises(plait.CommError):
            c.recv(np.empty(4), 1 - c.rank)

    monkeypatch.setenv("PLAIT_JOB_ID", "crossed")
    plait.testing.run_ranks(2, crossed, timeout=1.0)
    dumps, skipped = load_all([str(tmp_path / "crossed")])
    assert not skipped
    assert len(dumps) == 2
    [d] = diagnose(dumps)
    assert not d.ok
    assert {f.kind for f in d.findings} == {"p2p"}
    assert "recv from rank 1 (tag 0)" in d.findings[0].message
    assert "no problem found" not in format_report([d])

    def alone(c: plait.Communicator) -> None:
        c.allreduce(np.ones(4))
        if c.rank == 0:
            with pytest.raises(plait.CommError):
                c.recv(np.empty(4), 1, tag=3)

    monkeypatch.setenv("PLAIT_JOB_ID", "alone")
    plait.testing.run_ranks(2, alone, timeout=1.0)
    dumps, _ = load_all([str(tmp_path / "alone")])
    [d] = diagnose(dumps)
    assert not d.ok
    [f] = [f for f in d.findings if f.kind == "p2p"]
    assert f.ranks == (0,)
    assert f.message.startswith("rank 0 failed in recv from rank 1 (tag 3), a point-to-point call")


def test_a_rank_killed_while_the_others_waited_for_another_comes_after_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rank 3 hung before allreduce #5; 3 s later rank 1 was killed by SIGKILL, its part of
    #5 sent. The report's first problem was rank 1 ("left no dump: rank 1 was killed by
    SIGKILL"), which no rank waited for; rank 3, whom every rank waited for, came next."""
    wait = {"state": "running", "end": None, "waiting_on": (3,), "start": T0 + 97.0}
    dumps = [
        dump(r, 4, [*(call(s, line=5) for s in range(5)), call(5, line=10, **wait)]) for r in (0, 2)
    ]
    dumps.append(dump(3, 4, [call(s, line=5) for s in range(5)]))
    dumps[-1]["threads"] = main_at(["/job/two.py", 9, "<module>"])
    write(tmp_path, dumps)
    note = {"format": "plait-launcher-note", "version": 1, "time": T0 + 100}
    note["ended"] = {"1": "was killed by SIGKILL"}
    (tmp_path / "launcher.json").write_text(json.dumps(note))
    assert main([str(tmp_path)]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "first problem: rank 3 never reached call #5 (allreduce at train.py:10)" in out
    assert (
        "then: rank 1 left no dump: rank 1 was killed by SIGKILL, as plait run saw (no rank "
        "here waited for it); ranks 0, 2 wait in allreduce #5 (train.py:10) for rank 3"
    ) in out
    # A killed rank the others wait for is still the first problem.
    for d in dumps[:2]:
        d["calls"][-1]["waiting_on"] = [1, 3]
    [d] = diagnose(parsed(dumps), notes={})
    assert [f.kind for f in d.findings[:2]] == ["missing", "never_arrived"]


def test_ranks_without_a_dump_are_each_described_once() -> None:
    """Rank 0 timed out waiting for rank 2 and was the only one to dump: the report said
    "ranks 1, 2, 3 left no dump: they probably finished, or died (no rank here waited for
    them ...); rank 2 probably died ...", naming rank 2 twice, once as not waited for."""
    wait = {"state": "failed", "waiting_on": (2,), "error": "CollectiveTimeout: rank 0: ..."}
    only = dump(0, 4, [*(call(s) for s in range(5)), call(5, end=T0 + 60, **wait)])
    [d] = diagnose(parsed([only]))
    assert d.findings[0].message == (
        "ranks 1, 2, 3 left no dump: rank 2 probably died or was killed (see its exit status in "
        "plait run's output), or it wrote to another folder or host; ranks 1, 3 probably "
        "finished, or died (no rank here waited for them; see their exit status in plait run's "
        "output), or they wrote to another folder or host; rank 0 waited in allreduce #5 "
        "(train.py:42) for rank 2"
    )
    assert died([1, 2], idle=[1, 2]).startswith("they probably finished")
    assert died([2], idle=[2]).startswith("it probably finished")
    assert died([1, 2], idle=[1]).startswith("rank 2 probably died or was killed")
    assert "ranks 1" not in died([1, 2], idle=[1])


def _threads_dump(comm: int, line: int, function: str) -> dict[str, Any]:
    """Rank 1 of threads.py: its main thread in Thread.join at line 15, its thread "side"
    asleep at line 9 in worker, which makes the calls of communicator 41a2."""
    calls = [call(s, file="/job/threads.py", line=line) for s in range(2)]
    for c in calls:
        c["stack"] = [["/job/threads.py", line, function]]
    d = dump(1, 3, calls, comm=comm)
    join = [threading.__file__, 1139, "_wait_for_tstate_lock"]
    d["threads"] = [
        WATCH,
        {
            "name": "side",
            "stack": [
                ["/job/threads.py", 9, "worker"],
                [threading.__file__, 982, "run"],
            ],
        },
        {"name": "MainThread", "stack": [join, ["/job/threads.py", 15, "<module>"]]},
    ]
    return d


def test_the_thread_that_makes_a_communicators_calls_is_the_one_said() -> None:
    """A thread "side" drove communicator 41a2 and hung in a sleep; the report said where
    the main thread was (joining "side"), not where "side" was."""
    wait = {"state": "running", "end": None, "waiting_on": (1,), "file": "/job/threads.py"}
    group = _threads_dump(0x41A2, 10, "worker")
    others = [dump(r, 3, [call(0), call(1), call(2, line=10, **wait)], comm=0x41A2) for r in (0, 2)]
    [d] = diagnose(parsed([group, *others]))
    assert d.where[1].endswith('no call since; its thread "side" is at threads.py:9')
    # The world communicator's calls are the main thread's.
    [d] = diagnose(parsed([_threads_dump(0, 14, "<module>")]))
    assert "its main thread is at threads.py:15, in threading.py:1139" in d.where[1]
    # A thread in a plait call is where a rank past its last call waits.
    world = _threads_dump(0, 14, "<module>")
    world["threads"][1]["stack"][:0] = PLAIT_RECV
    [d] = diagnose(parsed([world]))
    assert "its main thread is at threads.py:15" in d.where[1]
    # Where no thread is in the function that made the call, the one in a plait call.
    world["calls"][-1]["stack"] = []
    [d] = diagnose(parsed([world]))
    assert d.where[1].endswith('its thread "side" is at threads.py:9, in plait\'s recv')
