"""plait analyze: what went wrong first, in plain words, from the dumps of every rank."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from dumpkit import T0, FakeClock, call, dump, write

import plait
from plait.diagnostics import _words, analyze
from plait.diagnostics.analyze import diagnose, format_report, main
from plait.diagnostics.recorder import CallShape, FlightRecorder
from plait.diagnostics.schema import Dump, DumpError, load, load_all, parse


def parsed(dumps: list[dict[str, Any]]) -> list[Dump]:
    return [parse(d) for d in dumps]


def training(steps: int, *, skip_at: int | None = None) -> list[dict[str, Any]]:
    """A rank's calls for ``steps`` steps of: broadcast (line 40), then allreduce (line 42).

    ``skip_at``: the step whose broadcast this rank skips; its allreduce then
    blocks (in flight) as the others' broadcast does.
    """
    calls = []
    seq = 0
    for step in range(steps):
        if step != skip_at:
            calls.append(call(seq, "broadcast", line=40, algorithm="binomial", op="-"))
            seq += 1
        calls.append(call(seq, "allreduce", line=42))
        seq += 1
    return calls


def test_all_well() -> None:
    [d] = diagnose(parsed([dump(r, 4, training(5)) for r in range(4)]))
    assert d.ok
    assert d.compared == (0, 9)
    assert [x.calls for x in d.lateness] == [10] * 4
    report = format_report([d])
    assert "no problem found: every rank made the same calls (calls #0 to #9)" in report
    assert "rank 3: done with allreduce #9 (train.py:42)" in report


def test_a_skipped_call() -> None:
    dumps = [dump(r, 4, training(5)) for r in (0, 1, 3)]
    mine = training(3, skip_at=2)
    mine[-1].update(state="running", end=None, waiting_on=[1, 3])
    dumps.append(dump(2, 4, mine))
    for d in dumps[:3]:  # the others block in the broadcast #4
        del d["calls"][5:]
        d["calls"][4].update(state="running", end=None, waiting_on=[2])
    [d] = diagnose(parsed(dumps))
    first, hint = d.findings[:2]
    assert first.kind == "mismatch"
    assert first.seq == 4
    assert first.ranks == (2,)
    assert first.message == (
        "rank 2 is in allreduce #4 (train.py:42) while ranks 0, 1, 3 are in broadcast #4 "
        "(train.py:40)"
    )
    assert hint.kind == "skipped"
    assert hint.message == (
        "rank 2 did not make the others' broadcast at train.py:40 this time (its last one "
        "there was #2) and went on to allreduce at train.py:42: a branch that only some ranks "
        "took?"
    )
    assert d.compared == (0, 3)  # lateness stops before the mismatch
    assert not d.ok


def as_recorded(calls: list[dict[str, Any]], sites: dict[str, int]) -> list[dict[str, Any]]:
    """``calls`` as the recorder writes them by default: each with the site of its kind
    (``sites``: the line where that collective was first made), and a stack of its own
    only while in flight or failed."""
    for c in calls:
        c["site"] = ["/job/train.py", sites[c["collective"]], "warm_up"]
        if c["state"] == "done":
            c["stack"] = []
    return calls


def test_a_skipped_call_found_from_the_sites_of_calls_that_kept_no_line() -> None:
    """Calls first made in a warm-up (lines 30, 32), then in the loop (lines 40, 42)."""
    sites = {"broadcast": 30, "allreduce": 32}
    dumps = [dump(r, 4, as_recorded(training(5), sites)) for r in (0, 1, 3)]
    mine = training(3, skip_at=2)
    mine[-1].update(state="running", end=None, waiting_on=[1, 3])
    dumps.append(dump(2, 4, as_recorded(mine, sites)))
    for d in dumps[:3]:  # the others block in the broadcast #4
        del d["calls"][5:]
        d["calls"][4].update(state="running", end=None, waiting_on=[2])
        d["calls"][4]["stack"] = [["/job/train.py", 40, "train_step"]]
    [d] = diagnose(parsed(dumps))
    first, hint = d.findings[:2]
    assert first.message == (
        "rank 2 is in allreduce #4 (train.py:42) while ranks 0, 1, 3 are in broadcast #4 "
        "(train.py:40)"
    )
    assert hint.kind == "skipped"
    # Its #2 kept no line of its own: it is a broadcast of the same kind, first made at
    # line 30 as the others' was, not known to be from line 40 (it said "its last one there").
    assert hint.message.startswith(
        "rank 2 did not make the others' broadcast at train.py:40 this time (its last call "
        "of that kind was #2)"
    )


def test_a_skip_seen_in_the_calls_that_follow() -> None:
    """Rank 1 skipped #2; its later calls are the others', one number earlier."""
    lines = [40, 42, 44, 46, 48, 50]
    kinds = ["allreduce", "broadcast", "allgather"] * 2
    others = [call(s, kinds[s], line=lines[s]) for s in range(6)]
    mine = [call(s, kinds[s + (s >= 2)], line=lines[s + (s >= 2)]) for s in range(5)]
    [d] = diagnose(parsed([dump(0, 3, others), dump(1, 3, mine), dump(2, 3, others)]))
    mismatch, skipped = d.findings[:2]
    assert mismatch.seq == 2
    assert (
        skipped.message
        == "rank 1 skipped a call: its #2 is the others' #3 (allreduce at train.py:46)"
    )


def test_an_isolated_difference_is_not_a_skip() -> None:
    dumps = [
        dump(r, 2, [call(s, count=8 if (r, s) == (1, 1) else 1024) for s in range(4)])
        for r in range(2)
    ]
    [d] = diagnose(parsed(dumps))
    assert [f.kind for f in d.findings] == ["mismatch"]


def test_a_rank_in_a_different_collective() -> None:
    dumps = [dump(r, 3, [call(0), call(1), call(2, state="running", end=None)]) for r in (0, 2)]
    odd = [call(0), call(1), call(2, "allgather", line=57, state="running", end=None)]
    dumps.insert(1, dump(1, 3, odd))
    [d] = diagnose(parsed(dumps))
    assert d.findings[0].kind == "mismatch"
    assert d.findings[0].message == (
        "rank 1 is in allgather #2 (train.py:57) while ranks 0, 2 are in allreduce #2 (train.py:42)"
    )


def test_ranks_that_failed_in_different_calls_of_one_number_are_told_apart() -> None:
    # Ranks 0 and 1 failed in reduce #2 at line 9, rank 2 in its reduce #2 at line 7 (another
    # root): all three were credited with line 9's call.
    def failed(r: int) -> dict[str, Any]:
        line, root = (7, 1) if r == 2 else (9, 0)
        last = call(2, "reduce", line=line, root=root, state="failed", error="MismatchError: x")
        return dump(r, 3, [call(0), call(1), last])

    [d] = diagnose(parsed([failed(r) for r in range(3)]))
    said = [f.message for f in d.findings if f.kind == "failed"]
    assert said == [
        "ranks 0, 1: reduce #2 (train.py:9) failed: MismatchError: x",
        "rank 2: reduce #2 (train.py:7) failed: MismatchError: x",
    ], said


def test_a_split_communicator_says_its_ranks_job_ranks() -> None:
    # Job ranks 1 and 3 raised in the group's call; they left no dump for the world's, where
    # ranks 0 and 2 wait for them. The world's report said they "probably died".
    world = [dump(r, 4, [call(0), call(1, state="running", end=None)]) for r in (0, 2)]
    group = []
    for r, job_rank in ((0, 1), (1, 3)):
        d = dump(r, 2, [call(0, state="failed", end=None, error="MismatchError: x")], comm=0x36B)
        d["global_rank"] = job_rank
        group.append(d)
    text = format_report(diagnose(parsed(world + group)))
    assert "its ranks, as this report numbers them: 0 is job rank 1, 1 is job rank 3" in text
    world_part = text.split("communicator 36b")[0]
    assert "ranks 1, 3 dumped for another communicator of the job" in world_part, world_part
    assert "probably died" not in world_part, world_part


def test_a_rank_with_another_count() -> None:
    dumps = [dump(r, 2, [call(0, count=1024 if r == 0 else 1000)]) for r in range(2)]
    [d] = diagnose(parsed(dumps))
    assert d.findings[0].message == (
        "rank 1 is in allreduce #0 with count=1000 (train.py:42) while rank 0 is in "
        "allreduce #0 (train.py:42)"
    )


def test_a_sleeping_rank() -> None:
    def rank_calls(r: int) -> list[dict[str, Any]]:
        late = 0.3 if r == 2 else 0.001 * r
        return [call(s, start=T0 + s + late, end=T0 + s + 0.31) for s in range(20)]

    [d] = diagnose(parsed([dump(r, 4, rank_calls(r)) for r in range(4)]))
    [late] = d.findings
    assert late.kind == "late"
    assert late.ranks == (2,)
    assert late.message.startswith(
        "rank 2 arrives late: 300.0 ms after the first rank (median) over 20 calls"
    )
    assert d.lateness[2].median == pytest.approx(0.3)
    assert d.lateness[0].median == pytest.approx(0.0)
    report = format_report([d])
    assert "first problem: rank 2 arrives late" in report
    assert "  rank 2: median 300.0 ms" in report


def test_a_sleeping_rank_on_another_host_is_found_from_waits() -> None:
    """Across hosts the clocks are not compared: a late rank waits less in an allreduce."""

    def rank_calls(r: int) -> list[dict[str, Any]]:
        skew = 5.0 * r  # these hosts' clocks disagree by seconds
        late = 0.3 if r == 1 else 0.0
        return [call(s, start=T0 + s + late + skew, end=T0 + s + 0.31 + skew) for s in range(9)]

    dumps = [dump(r, 3, rank_calls(r), host=f"node{r}") for r in range(3)]
    [d] = diagnose(parsed(dumps))
    assert [f.ranks for f in d.findings] == [(1,)]
    assert d.lateness[1].median == pytest.approx(0.3)
    assert d.lateness[2].median == pytest.approx(0.0)


def test_a_dead_rank_left_no_dump() -> None:
    dumps = []
    for r in range(3):
        calls = [call(s) for s in range(10)]
        calls.append(call(10, state="running", end=None, waiting_on=(3,)))
        dumps.append(dump(r, 4, calls))
    [d] = diagnose(parsed(dumps))
    assert d.findings[0].kind == "missing"
    assert d.findings[0].ranks == (3,)
    assert d.findings[0].message.startswith("rank 3 left no dump: it probably died")
    assert d.findings[0].message.endswith(
        "ranks 0, 1, 2 wait in allreduce #10 (train.py:42) for rank 3"
    )
    assert len(d.findings) == 1
    assert d.where[3] == "rank 3: no dump"


def test_a_rank_that_never_arrived() -> None:
    dumps = []
    for r in range(3):
        calls = [call(s) for s in range(10)]
        calls.append(
            call(
                10,
                state="failed",
                end=T0 + 310,
                waiting_on=(3,),
                error="CollectiveTimeout: rank 0: allreduce (ring, call #10) timed out",
            )
        )
        dumps.append(dump(r, 4, calls, reason="CollectiveTimeout: ..."))
    dumps.append(dump(3, 4, [call(s) for s in range(10)], reason="signal SIGUSR1"))
    [d] = diagnose(parsed(dumps))
    [never] = d.findings  # the timeouts it caused are not another problem
    assert never.kind == "never_arrived"
    assert never.ranks == (3,)
    assert never.message == (
        "rank 3 never reached call #10 (allreduce at train.py:42), where ranks 0, 1, 2 waited "
        "for rank 3 from 12:00:10.000 UTC on: rank 3's last call, allreduce #9 (train.py:42), "
        "ended at 12:00:09.010 UTC, 990.0 ms before the first rank began #10"
    )
    assert d.where[0].startswith("rank 0: failed in allreduce #10 (train.py:42) for rank 3 at")
    assert d.reasons == ("CollectiveTimeout (ranks 0, 1, 2)", "signal SIGUSR1 (rank 3)")


def test_the_first_problem_comes_first() -> None:
    """A mismatch at #3 went wrong before a rank that never reached #5."""
    dumps = []
    for r in range(3):
        calls = [call(s, count=8 if (r, s) == (1, 3) else 1024) for s in range(5)]
        if r != 2:
            calls.append(call(5, state="running", end=None))
        dumps.append(dump(r, 3, calls))
    [d] = diagnose(parsed(dumps))
    assert [f.kind for f in d.findings] == ["mismatch", "never_arrived"]


def test_communicators_and_jobs_are_diagnosed_apart() -> None:
    dumps = [dump(r, 2, [call(0)], comm=c) for r in range(2) for c in (0, 0xA)]
    dumps.append(dump(0, 2, [call(0)], job="other", reason="CollectiveTimeout: ..."))
    result = diagnose(parsed(dumps))
    assert [(d.job, d.comm, d.ranks) for d in result] == [
        ("job1", 0, (0, 1)),
        ("job1", 0xA, (0, 1)),
        ("other", 0, (0,)),
    ]
    assert result[2].findings[0].kind == "missing"


def test_one_rank_dumped_on_request_is_no_problem(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``kill -USR1`` of one rank, to see where it is: the others left no dump, and nothing
    says they are in trouble (this read "ranks 1, 2 probably died")."""
    write(tmp_path, [dump(0, 3, [call(0), call(1)])])
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "no problem found: no call is blocked in rank 0's dump\n" in out
    assert "note: ranks 1, 2 left no dump, so rank 0 could not be compared with them" in out
    assert "died" not in out
    # The same dump written on an error, or with a call blocked, is a problem as before.
    for d in (
        dump(0, 3, [call(0), call(1)], reason="PeerLostError: ..."),
        dump(0, 3, [call(0), call(1, state="running", end=None)]),
        dump(0, 3, [call(0, state="failed", error="CollectiveTimeout: ..."), call(1)]),
    ):
        [x] = diagnose(parsed([d]))
        assert not x.ok
        assert x.findings[0].kind == "missing"


def test_dumps_of_an_earlier_run_of_the_job_are_left_out() -> None:
    """A job id used again (Note [runs of a job]): ranks 1 and 2 of the first run, where
    every rank made a broadcast at #1, beside rank 0 of the second, blocked in an allreduce."""
    old = [dump(r, 3, [call(0), call(1, "broadcast")], time=T0 + 10) for r in (1, 2)]
    new = dump(0, 3, [call(0), call(1, state="running", end=None, waiting_on=(1,))])
    for d in old:
        d["run"] = "aaaa"
    new["run"] = "bbbb"
    [d] = diagnose(parsed([*old, new]))
    assert d.ranks == (0,)
    assert [f.kind for f in d.findings] == ["missing", "older_run"]  # no mismatch at #1
    assert d.findings[1].ranks == (1, 2)
    assert d.findings[1].message.startswith("left out 2 dumps of an earlier run of job job1 (")
    # Dumps without a token (an older plait) are read with every run's, as before.
    for x in old:
        del x["run"]
    [d] = diagnose(parsed([*old, new]))
    assert d.findings[0].kind == "mismatch"


def test_dumps_from_different_runs_are_flagged() -> None:
    dumps = [dump(0, 2, [call(0)]), dump(1, 2, [call(0)], time=T0 + 7200)]
    [d] = diagnose(parsed(dumps))
    assert d.findings[0].kind == "stale"


def test_main(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(tmp_path / "ok", [dump(r, 2, [call(0)]) for r in range(2)])
    assert main([str(tmp_path / "ok")]) == 0
    assert "no problem found" in capsys.readouterr().out
    write(tmp_path / "bad", [dump(0, 2, [call(0, state="running", end=None)])])
    (tmp_path / "bad" / "notes.json").write_text("[1, 2]")
    assert main([str(tmp_path / "bad"), "--json"]) == 1
    out = capsys.readouterr().out
    [d] = json.loads(out)
    assert d["findings"][0]["kind"] == "missing"
    assert main([str(tmp_path / "nothing-here")]) == 2
    assert "no flight-recorder dump found" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("field", "value", "said"),
    [
        ("size", 1e308, "size"),  # int() of it is a number no reader could walk to its end
        ("size", 2**70, "size"),
        ("size", 0, "size"),
        ("size", float("inf"), "size"),  # int() of it raised OverflowError, uncaught
        ("nbytes", 1e308, "nbytes"),
        ("pid", -1, "pid"),
        ("size", 2.5, "size"),
        ("rank", 2, "rank"),  # of a communicator of 2
        ("rank", -1, "rank"),
        ("global_rank", -3, "global_rank"),
        ("recorded", -1, "recorded"),
        ("time", float("nan"), "time"),
        ("time", "inf", "time"),
        ("seq", -5, "seq"),
        ("seq", True, "seq"),
        ("count", 1e300, "count"),
        ("start", float("inf"), "start"),
        ("waiting_on", [1, -1], "waiting_on"),
    ],
)
def test_a_corrupt_dump_is_refused_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], field: str, value: Any, said: str
) -> None:
    """A dump is a file anyone may have edited: a field out of its range is refused, named,
    and the other dumps are still read (a size of 1e308 used to make the reader walk ranks
    for ever)."""
    d = dump(0, 2, [call(0, state="running", end=None)])
    if field in d:
        d[field] = value
    else:
        d["calls"][0][field] = value
    with pytest.raises(DumpError, match=f"malformed dump: ValueError: {said}"):
        parse(d)
    write(tmp_path, [d, dump(1, 2, [call(0)])])
    assert main([str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    assert f"ValueError: {said}" in out + err
    assert "rank 0" in out  # the readable dump's rank 1 says rank 0 left none


def test_real_recorders_end_to_end(tmp_path: Path, clock: FakeClock) -> None:
    """Dumps written by FlightRecorder itself: rank 2 stops after call #4."""
    shape = CallShape("allreduce", "ring", 256, np.dtype(np.float32), plait.SUM)
    recs = [FlightRecorder(r, 3, job="e2e", stack_depth=1) for r in range(3)]
    for seq in range(5):
        for rec in recs:
            clock.advance(0.001)
            rec.end(rec.begin(shape, seq))
    clock.advance(2.0)
    stuck = [rec.begin(shape, 5) for rec in recs[:2]]
    line = stuck[0].code.co_firstlineno if stuck[0].code else 0
    assert line
    for rec, slot in zip(recs[:2], stuck, strict=True):
        rec.waiting_on(slot, [2])
    clock.advance(60.0)
    paths = [rec.dump("signal SIGUSR1") for rec in recs]
    assert {p.parent for p in paths} == {tmp_path / "dumps" / "e2e"}
    dumps, skipped = load_all([tmp_path / "dumps"])
    assert skipped == []
    [d] = diagnose(dumps)
    [never] = d.findings
    assert never.kind == "never_arrived"
    assert never.ranks == (2,)
    assert never.message.startswith("rank 2 never reached call #5 (allreduce at test_analyze.py:")
    assert "where ranks 0, 1 wait for rank 2" in never.message
    assert d.where[0].startswith("rank 0: waiting in allreduce #5 (test_analyze.py:")
    assert "(60.0 s before its dump)" in d.where[0]
    assert load(paths[2]).last is not None


def test_a_failure_nothing_else_explains() -> None:
    error = "PeerLostError: rank 0: allreduce (ring, call #3): rank 1 closed its connection"
    dumps = [
        dump(
            0, 2, [*(call(s) for s in range(3)), call(3, state="failed", end=T0 + 4, error=error)]
        ),
        dump(1, 2, [call(s) for s in range(4)]),
    ]
    [d] = diagnose(parsed(dumps))
    [failed] = d.findings
    assert failed.kind == "failed"
    assert failed.message == f"rank 0: allreduce #3 (train.py:42) failed: {error}"


def test_a_rank_that_made_no_call() -> None:
    dumps = [dump(0, 2, [call(0, state="running", end=None, waiting_on=(1,))]), dump(1, 2, [])]
    [d] = diagnose(parsed(dumps))
    [never] = d.findings
    assert never.message.endswith("rank 1 made no call at all")
    assert d.where[1] == "rank 1: no call recorded"
    assert d.compared is None


def test_main_as_a_registered_subcommand(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The plait CLI registry calls add_arguments(parser), then main(parsed arguments)."""
    write(tmp_path, [dump(r, 2, [call(0)]) for r in range(2)])
    parser = argparse.ArgumentParser(prog="plait analyze")
    analyze.add_arguments(parser)
    assert analyze.main(parser.parse_args([str(tmp_path), "--late", "0.5"])) == 0
    assert "no problem found" in capsys.readouterr().out


def test_a_rank_past_its_last_call_says_where_its_main_thread_is() -> None:
    # A rank blocked in a point-to-point receive (which the recorder does not keep) read as
    # "done with allreduce #1; no call since": the dump's thread stacks say where it is.
    d = dump(1, 2, [call(0), call(1)])
    d["threads"] = [
        {"name": "plait-watch-rank1", "stack": [["/x/lib/plait/_recovery.py", 300, "_watch"]]},
        {
            "name": "MainThread",
            "stack": [
                ["/x/lib/plait/_p2p_request.py", 350, "_wait_until"],
                ["/x/lib/plait/_p2p.py", 170, "recv"],
                ["/job/train.py", 13, "<module>"],
            ],
        },
    ]
    others = dump(0, 2, [call(0), call(1), call(2, state="running", end=None)])
    [diag] = diagnose(parsed([others, d]))
    assert diag.where[1].endswith(
        "no call since; its main thread is at train.py:13, in plait's recv"
    )
    d["threads"] = [{"name": "MainThread", "stack": [["/job/train.py", 7, "<module>"]]}]
    [diag] = diagnose(parsed([others, d]))
    assert diag.where[1].endswith("no call since; its main thread is at train.py:7")
    # In Python's own library (a Thread.join): the program's line, not threading.py's.
    import sysconfig
    import threading

    join = [threading.__file__, 1139, "_wait_for_tstate_lock"]
    assert join[0].startswith(sysconfig.get_paths()["stdlib"])
    d["threads"] = [{"name": "MainThread", "stack": [join, ["/job/train.py", 9, "<module>"]]}]
    [diag] = diagnose(parsed([others, d]))
    assert diag.where[1].endswith(
        "its main thread is at train.py:9, in threading.py:1139 (_wait_for_tstate_lock)"
    )


def test_a_rank_that_came_after_the_others_gave_up_is_named_as_the_cause() -> None:
    """Rank 1 reached #3 after the others' timeout had run out; every rank failed in #3, and
    the report gave all three rank 0's timeout, never naming rank 1."""
    timeout = "CollectiveTimeout: rank {r}: allreduce (ring, call #3) timed out waiting for [1]"
    dumps = [
        dump(
            r,
            3,
            [
                *(call(s) for s in range(3)),
                call(3, end=T0 + 8, state="failed", waiting_on=(1,), error=timeout.format(r=r)),
            ],
        )
        for r in (0, 2)
    ]
    lost = "PeerLostError: rank 1: allreduce (ring, call #3): rank 2 gave up on the call"
    mine = [*(call(s) for s in range(3)), call(3, start=T0 + 9.5, end=T0 + 9.5, state="failed")]
    mine[-1].update(error=lost, waiting_on=[2])
    dumps.append(dump(1, 3, mine))
    [d] = diagnose(parsed(dumps))
    kinds = [(f.kind, f.ranks) for f in d.findings]
    assert kinds == [("too_late", (1,)), ("failed", (0, 2)), ("failed", (1,))], kinds
    assert d.findings[0].message.startswith(
        "rank 1 reached call #3 (allreduce at train.py:42) only after ranks 0, 2 had given up "
        "on it at 12:00:08.000 UTC: rank 1 at 12:00:09.500 UTC, 6.5 s after the first rank."
    )
    assert "PeerLostError" in d.findings[2].message
    # The others failed at once of a lost peer, not at their timeout: nobody gave up on a
    # late rank, and rank 1 is not named (it was, as if 6.5 s late had been too late).
    for x in dumps[:2]:
        x["calls"][-1]["error"] = "PeerLostError: rank 0: allreduce (ring, call #3): rank 3 ..."
    [d] = diagnose(parsed(dumps))
    assert "too_late" not in [f.kind for f in d.findings]


def test_the_call_a_rank_blocks_in_is_its_oldest_not_done_not_its_newest() -> None:
    """Asynchronous calls: #4 runs, waiting for rank 1 (asleep), and #5 is queued behind it.
    The report took the newest, #5: "rank 1 never reached call #5 ... rank 0: queued
    behind allreduce #5"."""
    dumps = []
    for r in (0, 2):
        calls = [call(s) for s in range(4)]
        calls.append(call(4, state="running", end=None, waiting_on=(1,)))
        calls.append(call(5, state="queued", end=None, start=None))
        calls[-1]["queued"] = T0 + 4.5
        dumps.append(dump(r, 3, calls, reason="stall: allreduce #4 in flight for 2 s"))
    dumps.append(dump(1, 3, [call(s) for s in range(4)]))
    [d] = diagnose(parsed(dumps))
    first = d.findings[0]
    assert first.kind == "never_arrived"
    assert first.seq == 4
    assert first.message.startswith("rank 1 never reached call #4 (allreduce at train.py:42)")
    assert d.where[0].startswith("rank 0: waiting in allreduce #4 (train.py:42) for rank 1")
    assert d.where[0].endswith("; a call queued behind it (#5)")


def test_a_count_mismatch_on_one_line_is_not_called_a_branch() -> None:
    """Rank 1 makes the call of line 10 with 32 elements, rank 0 with 16: the sites differ
    (rank 0's kind was first made at line 9), which read as "rank 1 did not make the
    others' allreduce at train.py:10 this time ...: a branch that only some ranks took?"."""
    dumps = []
    for r, count in ((0, 16), (1, 32)):
        calls = [call(s, count=16, line=9) for s in range(3)]
        calls.append(call(3, count=count, line=10, state="running", end=None))
        for c in calls:
            c["site"] = ["/job/train.py", 9 if c["count"] == 16 else 10, "main"]
            if c["state"] == "done":
                c["stack"] = []
        dumps.append(dump(r, 2, calls, reason="MismatchError: ..."))
    [d] = diagnose(parsed(dumps))
    assert d.findings[0].kind == "mismatch"
    assert d.findings[0].message == (
        "rank 1 is in allreduce #3 with count=32 (train.py:10) while rank 0 is in allreduce #3 "
        "(train.py:10)"
    )
    assert all(f.kind != "skipped" for f in d.findings)


def test_a_signal_that_finds_a_busy_rank_just_inside_a_call_is_no_problem() -> None:
    """``kill -USR1`` of one rank of a healthy job in a loop of calls finds it 1.2 ms into
    one: read as blocked there, "ranks 0, 2 left no dump: they probably died"."""
    now = T0 + 100
    calls = [call(s, start=now - 1 + s * 0.001) for s in range(183)]
    calls.append(call(183, start=now - 0.0012, state="running", end=None, waiting_on=(2,)))
    [d] = diagnose(parsed([dump(1, 3, calls, time=now)]))
    assert d.ok
    assert [f.kind for f in d.findings] == ["undumped"]
    assert d.where[1].startswith("rank 1: waiting in allreduce #183")
    # In flight for a second or more at the signal: blocked, as before.
    calls[-1]["start"] = now - 1.0
    [d] = diagnose(parsed([dump(1, 3, calls, time=now)]))
    assert d.findings[0].kind == "missing"


def test_a_busy_ranks_old_snapshot_is_not_where_it_blocked() -> None:
    """Rank 1 dumped on a signal at call #154 of a loop; 13 s later rank 2 failed in an
    extra call #3000 after ranks 0 and 1 had ended. The report said "rank 1 waits in
    allreduce #154" as the first problem, though rank 2 completed #154 to #2999 with it."""
    snap = T0 + 10
    early = [call(s, start=snap - 1 + s * 0.001) for s in range(154)]
    early.append(call(154, start=snap - 0.008, state="running", end=None, waiting_on=(2,)))
    late = [call(s, start=snap - 1 + s * 0.001) for s in range(3000)]
    late.append(
        call(
            3000,
            start=T0 + 23,
            end=T0 + 23.5,
            state="failed",
            waiting_on=(0, 1),
            error="PeerLostError: rank 0 was lost",
        )
    )
    dumps = [dump(1, 3, early, time=snap), dump(2, 3, late, reason="PeerLostError: ...")]
    dumps[1]["time"] = T0 + 23.5
    [d] = diagnose(parsed(dumps))
    kinds = [f.kind for f in d.findings]
    assert kinds[:2] == ["missing", "never_arrived"]
    assert d.findings[0].message.startswith("rank 0 left no dump")
    assert "rank 2 waited in allreduce #3000" in d.findings[0].message
    never = d.findings[1]
    assert never.ranks == (1,)
    assert "rank 1's dump (signal SIGUSR1, at " in never.message
    assert "found it in allreduce #154 (train.py:42), 8.0 ms after it began" in never.message
    assert "rank 1 waits" not in format_report([d])


def test_a_groups_rank_that_dumped_for_another_communicator_is_named_so() -> None:
    """A split's dumps did not say which job ranks its ranks are: a member stuck in the world
    communicator (and dumped there) read "rank 0 left no dump: it probably died", and the
    header said "0 is job rank ?"."""
    world = dump(1, 4, [call(0), call(1, state="failed", error="MismatchError: ...")])
    world["global_rank"] = 1
    mine = dump(1, 2, [call(0, state="failed", error="MismatchError: ...")], comm=0x41A2)
    mine["global_rank"] = 3
    mine["members"] = [1, 3]
    [_world, g] = diagnose(parsed([world, mine]))
    assert g.job_ranks == (1, 3)
    assert "died" not in g.findings[0].message
    assert "rank 0 dumped for another communicator of the job" in g.findings[0].message
    assert "0 is job rank 1, 1 is job rank 3" in format_report([g])
    with pytest.raises(DumpError, match="members must be a list of 2 world ranks"):
        parse({**mine, "members": [1]})


def test_a_splits_recorder_knows_its_members_by_world_rank() -> None:
    def body(c: plait.Communicator) -> Any:
        sub = c.split(c.rank % 2, key=-c.rank)
        rec = sub._runner.recorder
        assert rec is not None
        return rec.describe("test")["members"]

    got = plait.testing.run_ranks(4, body, timeout=20)
    assert got == [[2, 0], [3, 1], [2, 0], [3, 1]]


def test_a_launcher_note_says_how_a_rank_ended_and_its_dumps_are_no_snapshots(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """plait run had ranks 0 and 1 dump (a signal) once rank 2 was killed: their calls, a
    few ms in, are where they block, and rank 2 is named as plait run saw it end."""
    from plait.diagnostics.schema import launcher_notes, write_launcher_note

    now = T0 + 100
    blocked = [call(0), call(1, start=now - 0.005, state="running", end=None, waiting_on=(2,))]
    write(tmp_path, [dump(r, 3, [dict(c) for c in blocked], time=now) for r in (0, 1)])
    write_launcher_note(tmp_path, {2: "was killed by SIGKILL"}, "launcher.node1.json")
    note = tmp_path / "launcher.node1.json"
    note.write_text(note.read_text().replace('"time": ', f'"time": {now}, "was": '))
    assert launcher_notes([tmp_path]) == {
        tmp_path.resolve(): (now, {2: "was killed by SIGKILL"})
    }  # written as the failure was seen, just before the dumps it asked for
    assert main([str(tmp_path)]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "first problem: rank 2 left no dump: rank 2 was killed by SIGKILL, as plait run saw; "
        "ranks 0, 1 wait in allreduce #1 (train.py:42) for rank 2" in out
    )
    assert "skipped" not in out


def test_a_rank_whose_dump_cannot_be_read_is_not_called_dead(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A truncated rank1.json was skipped, and the report went on: "rank 1 left no dump:
    it probably died or was killed"."""
    blocked = [call(0), call(1, state="failed", error="CollectiveTimeout: ...", waiting_on=(1,))]
    [_, bad] = write(tmp_path, [dump(0, 2, blocked), dump(1, 2, [call(0)])])
    bad.write_text(bad.read_text()[:50])
    assert main([str(tmp_path)]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert out.startswith("skipped ")
    assert "rank 1 left no dump: the dump file of rank 1 could not be read" in out
    assert "died" not in out


def test_a_communicator_not_of_the_jobs_world_claims_no_job_ranks() -> None:
    """A torch group's plait.init (rank 0 of 2, in job rank 2) dumped "members": [0, 1]
    beside "global_rank": 2, and analyze named it job rank 0."""
    from plait.communicator import Communicator
    from plait.transport.memory import MemoryFabric

    comms = [Communicator(t) for t in MemoryFabric(2).endpoints]
    try:
        assert all(c._runner.recorder.describe("x")["members"] is None for c in comms)  # type: ignore[union-attr]
    finally:
        for c in comms:
            c.close()


def test_a_launcher_note_of_another_run_is_left_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A job id used again: an earlier run's note said rank 2 "was killed by SIGKILL" of a
    run in which it was not."""
    from plait.diagnostics.schema import write_launcher_note

    write(tmp_path, [dump(r, 3, [call(0)]) for r in (0, 1)])
    write_launcher_note(tmp_path, {2: "was killed by SIGKILL"})  # now: years after T0
    main([str(tmp_path)])
    assert "SIGKILL" not in capsys.readouterr().out


@pytest.mark.parametrize("late", ["-1", "-0.5", "nan", "soon"])
def test_a_negative_late_is_a_usage_error(late: str, capsys: pytest.CaptureFixture[str]) -> None:
    """--late -1 was accepted, and every rank was reported late."""
    with pytest.raises(SystemExit) as exit_info:
        analyze.main(["some-folder", "--late", late])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --late: expected a number of seconds >= 0, not {late!r}" in err


def test_dumps_that_disagree_on_size_and_list_members_are_diagnosed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two runs' dumps of one job id, 2 ranks and 3, each listing its members: the reader
    asked the smaller one for the world rank of rank 2 and raised IndexError."""
    small = [dump(r, 2, [call(0)]) | {"members": [0, 1]} for r in range(2)]
    large = dump(2, 3, [call(0), call(1, state="running", end=None)]) | {"members": [0, 1, 2]}
    write(tmp_path, [*small, large])
    assert main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "the dumps disagree on the communicator's size: [2, 3]" in out


def test_files_that_are_not_dumps_are_named_not_raised(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Bytes that are not UTF-8 raised UnicodeDecodeError, and JSON nested deeper than the
    parser goes RecursionError, out of plait analyze; a path that is not there was said as
    Python's "[Errno 2] No such file or directory: '...'"."""
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00junk")
    (tmp_path / "deep.json").write_text("[" * 100_000)
    (tmp_path / "launcher.json").write_text("[" * 100_000)  # a launcher's note's name
    missing = tmp_path / "gone" / "rank0.json"
    assert main([str(tmp_path), str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'binary.json'}: not a dump (not UTF-8 text)" in err
    assert f"{tmp_path / 'deep.json'}: not a dump (JSON nested too deep)" in err
    assert f"{missing}: cannot be read (No such file or directory)" in err
    assert "Errno" not in err


def test_ranks_that_probably_died_after_others_named_are_named_themselves() -> None:
    """Two ranks left no dump, one of them dumped for another communicator: the report
    read "rank 2 dumped for another communicator ...; rank 1 it probably died"."""
    from plait.diagnostics._words import died

    assert died([1, 2], away=[2]) == (
        "rank 2 dumped for another communicator of the job (see its report): stuck or failed "
        "there; rank 1 probably died or was killed (see its exit status in plait run's output), "
        "or it wrote to another folder or host"
    )
    said = died([0, 1, 3], saw={0: "was killed by SIGKILL"})
    assert said.startswith("rank 0 was killed by SIGKILL, as plait run saw; ranks 1, 3 probably")
    assert died([3]).startswith("it probably died or was killed")


@pytest.mark.parametrize("when", [1e308, -1e20])
def test_a_time_no_clock_gives_is_refused_naming_the_field(when: float) -> None:
    # A start of 1e308 (a corrupt or hand-made dump) ended the report in an OverflowError.
    calls = [call(s, start=T0 + s, end=T0 + s + 0.1) for s in range(3)]
    calls[1]["start"] = when
    with pytest.raises(DumpError, match=r"start .* is not a time a clock gives"):
        parse(dump(1, 2, calls))
    assert _words.clock(when) == "?"  # and the report's words say so, where one gets there


def _note(folder: Path, when: float, ended: dict[int, str]) -> None:
    """plait run's note of how ranks ended, written at ``when`` (wall clock)."""
    doc = {"format": "plait-launcher-note", "version": 1, "time": when, "ended": ended}
    (folder / "launcher.json").write_text(json.dumps(doc))


def _lost(rank: int, peer: int, start: float) -> dict[str, Any]:
    """Call #0 of ``rank``, failed at ``start`` + 0.3 s: ``peer`` was lost."""
    return call(
        0,
        start=start,
        end=start + 0.3,
        state="failed",
        waiting_on=(peer,),
        error=f"PeerLostError: rank {rank}: allreduce (ring, call #0): rank {peer} was lost: "
        "its process exited or was killed",
    )


def _shrunk_twice(comm: int) -> list[dict[str, Any]]:
    """Job rank 1 was killed; job rank 3 dumped its loss in the world communicator and was
    killed in turn in communicator ``comm`` (made of job ranks 0, 2, 3), where ranks 0 and
    2 dumped its loss; they then aborted that one and shrank again."""
    world = dump(3, 4, [_lost(3, 1, T0 + 1)], reason="PeerLostError: ...", time=T0 + 1.3)
    world["members"] = [0, 1, 2, 3]
    dumps = [world]
    for r, g in ((0, 0), (1, 2)):
        d = dump(r, 3, [_lost(r, 2, T0 + 2)], comm=comm, reason="PeerLostError: ...")
        dumps.append(d | {"global_rank": g, "members": [0, 2, 3], "time": T0 + 2.3})
    return dumps


def test_a_rank_killed_in_a_shrunk_communicator_is_dead_not_stuck_in_the_one_before(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rank 2 of the communicator made by shrink (job rank 3, killed by SIGKILL) read "rank
    2 dumped for another communicator of the job (see its report): stuck or failed there":
    its dump of the world communicator was written before that communicator existed. And
    the world's report said ranks 0 and 2, which went on to it, were stuck or failed there."""
    from plait.group import shrunk_comm_id

    comm = shrunk_comm_id(0, 0)
    write(tmp_path, _shrunk_twice(comm))
    _note(tmp_path, T0 + 2.4, {1: "was killed by SIGKILL", 3: "was killed by SIGKILL"})
    assert main([str(tmp_path)]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "stuck or failed there" not in out
    assert (
        f"first problem: ranks 0, 1, 2 left no dump: rank 1 was killed by SIGKILL, as plait run "
        f"saw; ranks 0, 2 went on to communicator {comm:x}, shrunk from this one (see its "
        "report); rank 3 waited in allreduce #0 (train.py:42) for rank 1" in out
    )
    assert (
        "first problem: rank 2 left no dump: rank 2 was killed by SIGKILL, as plait run saw; "
        "ranks 0, 1 waited in allreduce #0 (train.py:42) for rank 2" in out
    )


def test_a_dump_of_another_communicator_from_before_this_one_began_is_no_whereabouts() -> None:
    """Without plait run's note, and of a communicator whose lineage the ids do not tell (a
    split): the dead rank's dump of the world communicator, written before the split's
    first call, said it was "stuck or failed there"; the others' errors say it was lost."""
    [_, split] = diagnose(parsed(_shrunk_twice(0x41A2)))
    [first] = [f for f in split.findings if f.kind == "missing"]
    assert first.message == (
        "rank 2 left no dump: rank 2 was lost, as the others' PeerLostError says: its process "
        "exited or was killed (see plait run's output for how); ranks 0, 1 waited in allreduce "
        "#0 (train.py:42) for rank 2"
    )
    # Dumped while the split's call was in flight on it, it may still be there.
    dumps = _shrunk_twice(0x41A2)
    dumps[0]["calls"][0].update(state="running", end=None, error=None)
    [_, split] = diagnose(parsed(dumps))
    assert "rank 2 dumped for another communicator of the job" in split.findings[0].message


def _diverged(missing: int) -> list[dict[str, Any]]:
    """Rank 2 in an allreduce (line 9) where ranks 3.. are in a broadcast (line 10) at #3;
    ranks 0 .. ``missing`` - 1 left no dump."""
    size = 4 + (0 if missing == 2 else 1)
    dumps = []
    for r in range(missing, size):
        calls = [call(0, line=5), call(1, line=5), call(2, "barrier", line=7, op="-")]
        if r == 2:
            calls.append(call(3, line=9, state="failed", waiting_on=(3,), error="MismatchError"))
        else:
            calls.append(
                call(
                    3,
                    "broadcast",
                    line=10,
                    algorithm="binomial",
                    op="-",
                    state="failed",
                    waiting_on=(2,),
                    error="MismatchError",
                )
            )
        dumps.append(dump(r, size, calls, reason="MismatchError: ..."))
    return dumps


def test_a_mismatch_seen_by_the_odd_ranks_alone_names_each_ranks_call(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Over TCP, ranks 0 and 1 finished their broadcast and exited with 0 (no dump); ranks 2
    (allreduce, line 9) and 3 (broadcast, line 10) dumped. The report made rank 2 "the
    others": "rank 3 did not make the others' allreduce at train.py:9 ...", and said ranks 0
    and 1 "probably died" while "ranks 2, 3 waited in allreduce #3 (train.py:9)"."""
    [d] = diagnose(parsed(_diverged(missing=2)))
    said = " ".join(f.message for f in d.findings)
    assert d.findings[0].kind == "mismatch"
    assert d.findings[0].ranks == (2, 3)
    assert d.findings[0].message.startswith(
        "rank 2 is in allreduce #3 (train.py:9); rank 3 is in broadcast #3 (train.py:10): "
        "different calls at #3, and ranks 0, 1 left no dump"
    )
    assert "the others'" not in said
    assert "rank 2 waited in allreduce #3 (train.py:9), rank 3 in broadcast #3 (train.py:10)" in (
        said
    )
    assert "ranks 2, 3 waited" not in said
    assert "they probably finished, or died (no rank here waited for them" in said
    write(tmp_path, _diverged(missing=2))
    _note(tmp_path, T0 + 100, {0: "exited with code 0", 1: "exited with code 0"})
    assert main([str(tmp_path)]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "ranks 0, 1 left no dump: ranks 0, 1 exited with code 0, as plait run saw: they "
        "finished their calls (a rank that ends well writes no dump)" in out
    )
    assert "died" not in out
    # Three ranks of one call against one, a fifth without a dump: the one is the odd one.
    [d] = diagnose(parsed(_diverged(missing=1)))
    assert d.findings[0].message == (
        "rank 2 is in allreduce #3 (train.py:9) while ranks 1, 3, 4 are in broadcast #3 "
        "(train.py:10)"
    )
    assert "ranks 1, 3, 4 waited in broadcast #3 (train.py:10), rank 2 in allreduce #3" in (
        d.findings[1].message
    )
