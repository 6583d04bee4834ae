"""PLAIT_TIMELINE: per-rank Chrome traces in the format of plait sim --trace, and their merge."""

from __future__ import annotations

import itertools
import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from dumpkit import FakeClock

import plait
from plait.diagnostics import timeline as timeline_module
from plait.diagnostics.recorder import CallShape, FlightRecorder
from plait.diagnostics.timeline import CALLS_TID, Timeline, merge, rank_path

SHAPE = CallShape("allreduce", "ring", 4, np.dtype(np.float32), plait.SUM)
DEBUGGING = Path(__file__).parents[2] / "docs" / "debugging.md"


def test_rank_paths() -> None:
    assert rank_path("out/trace.json", 3) == Path("out/trace.rank3.json")
    assert rank_path("trace", 0) == Path("trace.rank0.json")
    assert rank_path("t/{rank}/x.json", 12) == Path("t/12/x.json")


def record_rank(rank: int, clock: FakeClock, path: Path) -> Timeline:
    """Two ring allreduces of 2 ranks: each step sends to and receives from the other."""
    tl = Timeline(path, rank)
    rec = FlightRecorder(rank, 2, timeline=tl)
    peer = 1 - rank
    for seq in range(2):
        slot = rec.begin(SHAPE, seq)
        t0 = clock()
        tl.step("send", peer, 8, 100 + seq, 0, t0, t0 + 0.002)
        tl.step("recv", peer, 8, 100 + seq, 1, t0, t0 + 0.003)
        tl.wait(t0 + 0.0005, t0 + 0.003, [peer])
        tl.step("reduce", -1, 8, 0, 2, t0 + 0.003, t0 + 0.004)
        clock.advance(0.005)
        rec.end(slot)
        clock.advance(0.001)
    return tl


def events_of(path: Path) -> list[dict[str, Any]]:
    doc = json.loads(path.read_text())
    assert set(doc) == {"traceEvents", "displayTimeUnit", "otherData"}
    assert doc["displayTimeUnit"] == "ns"
    events: list[dict[str, Any]] = doc["traceEvents"]
    return events


def test_a_rank_trace_is_a_chrome_trace(tmp_path: Path, clock: FakeClock) -> None:
    path = record_rank(0, clock, tmp_path / "t.rank0.json").write()
    events = events_of(path)
    names = {(e["tid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
    assert names == {(CALLS_TID, "calls"), (0, "compute"), (1, "net 0"), (2, "net 1")}
    assert [e["args"]["name"] for e in events if e["name"] == "process_name"] == ["rank 0"]
    slices = [e for e in events if e["ph"] == "X"]
    for e in slices:
        assert set(e) == {"name", "cat", "ph", "pid", "tid", "ts", "dur", "args"}
        assert e["pid"] == 0
        assert e["dur"] >= 0
    calls = [e for e in slices if e["cat"] == "call"]
    assert [e["name"] for e in calls] == ["allreduce #0", "allreduce #1"]
    assert calls[0]["args"] == {
        "algorithm": "ring", "count": 4, "dtype": "float32", "op": "SUM", "root": 0, "seq": 0,
    }  # fmt: skip
    assert calls[0]["dur"] == pytest.approx(5000, abs=1)  # µs
    waits = [e for e in slices if e["cat"] == "wait"]
    assert [e["name"] for e in waits] == ["wait r1", "wait r1"]
    for call, wait in zip(calls, waits, strict=True):  # each wait lies inside its call
        assert call["ts"] <= wait["ts"]
        assert wait["ts"] + wait["dur"] <= call["ts"] + call["dur"] + 1e-3
    steps = {e["name"]: e for e in slices if e["cat"] in ("send", "recv", "reduce")}
    assert set(steps) == {"send -> r1", "recv <- r1", "reduce"}
    assert steps["send -> r1"]["args"] == {"step": 0, "bytes": 8, "tag": 101, "peer": 1}
    tracks: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for e in slices:
        if e["tid"] != CALLS_TID:
            tracks.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in tracks.values():
        spans.sort()
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert start >= end - 1e-3  # slices on one track do not overlap


def test_merge_draws_each_message(tmp_path: Path, clock: FakeClock) -> None:
    paths = [record_rank(r, clock, tmp_path / f"t.rank{r}.json").write() for r in (0, 1)]
    out = merge(paths, tmp_path / "merged.json")
    events = events_of(out)
    assert {e["args"]["name"] for e in events if e["name"] == "process_name"} == {
        "rank 0",
        "rank 1",
    }
    starts = [e for e in events if e["ph"] == "s"]
    finishes = [e for e in events if e["ph"] == "f"]
    assert len(starts) == len(finishes) == 4  # 2 calls x 2 directions
    for s, f in zip(starts, finishes, strict=True):
        assert s["id"] == f["id"]
        assert s["pid"] != f["pid"]
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(ValueError, match="not a Chrome trace"):
        merge([tmp_path / "x.json"], tmp_path / "y.json")


def test_merge_refuses_a_rank_twice_and_two_runs(
    tmp_path: Path, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same rank's file twice doubled its events and arrows, and files of two runs were
    merged into one picture with arrows between them, both without a word."""
    monkeypatch.setenv("PLAIT_JOB_ID", "first")
    paths = [record_rank(r, clock, tmp_path / f"t.rank{r}.json").write() for r in (0, 1)]
    assert paths[0] is not None
    with pytest.raises(ValueError, match=r"rank 0's timeline, as is .*t\.rank0\.json"):
        merge([paths[0], paths[1], paths[0]], tmp_path / "merged.json")
    monkeypatch.setenv("PLAIT_JOB_ID", "second")
    other = record_rank(1, clock, tmp_path / "u.rank1.json").write()
    with pytest.raises(ValueError, match=r"a timeline of job 'second', and .* of job 'first'"):
        merge([paths[0], other], tmp_path / "merged.json")
    assert not (tmp_path / "merged.json").exists()
    merge(paths, tmp_path / "merged.json")  # one run's, each rank once


def test_the_documented_merge_command(tmp_path: Path, clock: FakeClock) -> None:
    """docs/debugging.md's merge command, run as written: no warning, one valid trace."""
    (command,) = [
        line.partition("#")[0].strip()
        for line in DEBUGGING.read_text(encoding="utf-8").splitlines()
        if line.startswith("python -m plait.diagnostics.timeline ")
    ]
    for r in (0, 1):
        record_rank(r, clock, tmp_path / f"trace.rank{r}.json").write()
    # Through a shell, which expands trace.rank*.json as it does for whoever types it.
    res = subprocess.run(
        shlex.quote(sys.executable) + command.removeprefix("python"),
        shell=True,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""  # no RuntimeWarning from runpy: import plait must not import it
    out = tmp_path / shlex.split(command)[3]
    assert res.stdout == f"merged 2 timelines into {out.name}\n"
    events = events_of(out)
    assert {e["pid"] for e in events} == {0, 1}
    assert sum(e["ph"] == "s" for e in events) == sum(e["ph"] == "f" for e in events) == 4


def test_the_limit_drops_and_counts(tmp_path: Path, clock: FakeClock) -> None:
    tl = Timeline(tmp_path / "t.json", 0, limit=3)
    for i in range(5):
        tl.wait(clock(), clock() + 0.001, [i])
    doc = json.loads(tl.write().read_text())
    assert doc["otherData"]["dropped_events"] == 2
    assert sum(e["ph"] == "X" for e in doc["traceEvents"]) == 3


def test_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    registered: list[object] = []
    monkeypatch.setattr(timeline_module.atexit, "register", registered.append)
    monkeypatch.setattr(timeline_module, "_by_path", {})
    monkeypatch.delenv("PLAIT_TIMELINE", raising=False)
    assert Timeline.from_env(0) is None
    monkeypatch.setenv("PLAIT_TIMELINE", str(tmp_path / "trace.json"))
    tl = Timeline.from_env(1)
    assert tl is not None
    assert tl.path == tmp_path / "trace.rank1.json"
    assert Timeline.from_env(1) is tl  # a split communicator shares its rank's timeline
    assert len(registered) == 1  # written at exit
    monkeypatch.setenv("PLAIT_TIMELINE_EVENTS", "0")
    with pytest.raises(ValueError, match="PLAIT_TIMELINE_EVENTS"):
        Timeline.from_env(2)


def test_the_same_format_as_plait_sim_trace(tmp_path: Path, clock: FakeClock) -> None:
    """A real run's events have the keys and names of a simulated run's (plait.sim.trace)."""
    from plait import sim

    res = sim.simulate("allreduce", "ring", 2 * 8, sim.flat(2, 1e-6, 1e-9), trace=True)
    sim.write_trace(res, tmp_path / "sim.json")
    simulated = events_of(tmp_path / "sim.json")
    real = events_of(record_rank(0, clock, tmp_path / "real.json").write())

    def kinds(events: list[dict[str, Any]]) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for e in events:
            if e["ph"] in ("X", "M"):
                out.setdefault(e["ph"], set()).update(e)
        return out

    assert kinds(real) == kinds(simulated)
    sim_threads = {e["args"]["name"] for e in simulated if e["name"] == "thread_name"}
    real_threads = {e["args"]["name"] for e in real if e["name"] == "thread_name"}
    assert sim_threads <= real_threads
    sim_names = {e["name"] for e in simulated if e["ph"] == "X"}
    assert {"send -> r1", "recv <- r1"} <= sim_names
    assert {"send -> r1", "recv <- r1"} <= {e["name"] for e in real if e["ph"] == "X"}
    for e in simulated:
        if e["ph"] == "X":
            assert {"step", "bytes", "tag"} <= set(e["args"])


def test_merge_joins_messages_within_their_communicator(tmp_path: Path) -> None:
    """A split numbers its calls, so its tags, on its own: keyed without the communicator,
    the world's slow message (sent at 1.0, received at 3.0) and a group's quick one with
    the same tag (2.0 to 2.1) were joined crosswise, an arrow back in time among them."""
    tl = [Timeline(tmp_path / f"t.rank{r}.json", r) for r in (0, 1)]
    for t in tl:
        t._mono0 = t._wall0 = 0.0
    tl[0].step("send", 1, 8, 5, 0, 0.9, 1.1)
    tl[1].step("recv", 0, 8, 5, 0, 1.0, 3.0)
    tl[0].step("send", 1, 8, 5, 0, 1.95, 2.05, 0x41)
    tl[1].step("recv", 0, 8, 5, 0, 2.0, 2.1, 0x41)
    out = merge([t.write() for t in tl], tmp_path / "merged.json")
    events = events_of(out)
    ends = {e["id"]: e["ts"] for e in events if e["ph"] == "f"}
    spans = sorted((e["ts"] / 1e6, ends[e["id"]] / 1e6) for e in events if e["ph"] == "s")
    assert spans == [(1.0, 3.0), (2.0, 2.1)]


def test_a_groups_steps_name_their_peers_by_job_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The steps of ``comm.split(rank % 2)`` named the peer by its rank in the group: job
    rank 0's partner, job rank 2, read ``r1``."""
    monkeypatch.setenv("PLAIT_TIMELINE", str(tmp_path / "trace.json"))

    def body(c: plait.Communicator) -> Any:
        sub = c.split(c.rank % 2)
        sub.allreduce(np.ones(8, np.float32), algorithm="ring")
        tl = c._runner.timeline
        assert tl is not None
        steps = [e for e in tl.events() if e.get("cat") in ("send", "recv", "recv_reduce")]
        return {(e["args"]["peer"], e["args"].get("comm", 0) != 0) for e in steps}

    got = plait.testing.run_ranks(4, body, timeout=20)
    assert got == [{(2, True)}, {(3, True)}, {(0, True)}, {(1, True)}]


def test_a_one_sided_call_that_waits_shows_the_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shared-memory (one-sided) calls showed no wait slice on the calls thread, only TCP's
    did: a rank blocked for its peer's post showed only a long ``get`` step."""
    import time

    monkeypatch.setenv("PLAIT_TIMELINE", str(tmp_path / "trace.json"))

    def body(c: plait.Communicator) -> Any:
        if c.rank == 1:
            time.sleep(0.2)
        c.allreduce(np.ones(8, np.float32), algorithm="arena")
        tl = c._runner.timeline
        assert tl is not None
        calls = [e for e in tl.events() if e.get("tid") == CALLS_TID and e.get("cat") == "wait"]
        return [(e["args"]["peers"], e["dur"]) for e in calls]

    waits = plait.testing.run_ranks(2, body, timeout=20)[0]
    assert any(peers == [1] and dur >= 0.1e6 for peers, dur in waits), waits


def test_a_send_slice_starts_before_its_bytes_leave(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A send was stamped after the transport's isend returned, but isend may send the bytes
    itself: the slice began after its message had arrived, and the merged arrow ran back in
    time. Here every isend takes 20 ms: each send slice holds it."""
    import time

    monkeypatch.setenv("PLAIT_TIMELINE", str(tmp_path / "trace.json"))

    def body(c: plait.Communicator) -> Any:
        transport = c._runner._transport
        isend = transport.isend

        def slow(*args: Any) -> Any:
            time.sleep(0.02)
            return isend(*args)

        transport.isend = slow  # type: ignore[method-assign]
        c.allreduce(np.ones(8, np.float32), algorithm="ring")
        tl = c._runner.timeline
        assert tl is not None
        return [e["dur"] for e in tl.events() if e.get("cat") == "send"]

    for durations in plait.testing.run_ranks(2, body, timeout=20):
        assert durations
        assert min(durations) >= 20_000 * 0.9, durations  # µs
