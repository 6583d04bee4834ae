"""The flight recorder: a ring that wraps, allocates nothing per call, dumps a documented JSON."""

from __future__ import annotations

import json
import os
import sys
import tracemalloc
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from dumpkit import FakeClock

import plait
from plait.diagnostics import recorder as recorder_module
from plait.diagnostics.frames import PLAIT_DIR
from plait.diagnostics.recorder import CallShape, FlightRecorder, Slot, dump_dir, job_id
from plait.diagnostics.schema import FORMAT, VERSION, DumpError, load, parse

SHAPE = CallShape("allreduce", "ring", 2, np.dtype(np.float32), plait.SUM, 0)


def run(rec: FlightRecorder, first: int, n: int) -> None:
    for seq in range(first, first + n):
        rec.end(rec.begin(SHAPE, seq))


def plait_frames(source: str) -> dict[str, Any]:
    """Functions compiled as if they were a file of plait's: the recorder looks past them."""
    namespace: dict[str, Any] = {}
    exec(compile(source, PLAIT_DIR + "_fake_edge.py", "exec"), namespace)
    return namespace


EDGE = plait_frames(
    """
def allreduce(rec, shape, seq):
    return start(rec, shape, seq)

def start(rec, shape, seq):
    return rec.begin(shape, seq)
"""
)


def test_ring_keeps_the_last_calls_oldest_first() -> None:
    rec = FlightRecorder(0, 2, capacity=5)
    run(rec, 0, 12)
    assert [c["seq"] for c in rec.snapshot()] == [7, 8, 9, 10, 11]
    assert rec.recorded == 12
    assert all(c["state"] == "done" for c in rec.snapshot())


def test_slots_are_reused() -> None:
    rec = FlightRecorder(0, 2, capacity=4)
    run(rec, 0, 4)
    first = [id(s) for s in rec.slots()]
    run(rec, 4, 8)
    assert sorted(id(s) for s in rec.slots()) == sorted(first)


def test_a_call_in_flight_keeps_its_slot_when_the_ring_wraps() -> None:
    rec = FlightRecorder(0, 2, capacity=2)
    stuck = rec.begin(SHAPE, 0)
    run(rec, 1, 3)  # the ring comes round to the stuck call's place twice
    rec.end(stuck)
    assert stuck.seq == 0
    assert stuck.state == "done"
    assert [c["seq"] for c in rec.snapshot()] == [2, 3]


def test_no_allocation_per_call_on_a_warm_recorder() -> None:
    rec = FlightRecorder(0, 2, capacity=64, stack_depth=1)
    n = 20_000
    seqs = list(range(1000, 1000 + n))  # the ints exist before measuring

    def calls() -> None:
        for seq in seqs:
            rec.end(EDGE["allreduce"](rec, SHAPE, seq))

    calls()  # fill every slot once
    slots = [id(s) for s in rec.slots()]
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        blocks = sys.getallocatedblocks()
        calls()
        grown = sys.getallocatedblocks() - blocks
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    # The same slots, refilled; and nothing a call stores outlives the next use of its slot.
    assert sorted(id(s) for s in rec.slots()) == sorted(slots)
    assert grown < 50, f"{grown} blocks more after {n} calls"
    here = tracemalloc.Filter(True, recorder_module.__file__)
    diff = after.filter_traces([here]).compare_to(before.filter_traces([here]), "filename")
    assert sum(d.size_diff for d in diff) < 2048


def test_the_caller_is_the_first_frame_outside_plait() -> None:
    rec = FlightRecorder(0, 2, stack_depth=1)
    slot = EDGE["allreduce"](rec, SHAPE, 0)
    line = sys._getframe().f_lineno - 1
    rec.end(slot)
    [c] = rec.snapshot()
    path, lineno, name = c["stack"][0]
    assert (path, lineno, name) == (
        __file__,
        line,
        "test_the_caller_is_the_first_frame_outside_plait",
    )
    assert len(c["stack"]) == 1


def test_each_call_site_is_its_own() -> None:
    """The recorder remembers the last caller outside plait; a new one is still found."""
    rec = FlightRecorder(0, 2, capacity=8, stack_depth=1)

    def first() -> None:
        rec.end(EDGE["allreduce"](rec, SHAPE, rec.recorded))

    def second() -> None:
        rec.end(EDGE["allreduce"](rec, SHAPE, rec.recorded))

    for fn in (first, first, second, first):
        fn()
    assert [c["stack"][0][2] for c in rec.snapshot()] == ["first", "first", "second", "first"]


def test_callers_inside_plait_are_found_again_by_their_remembered_way_out() -> None:
    """A wrapper inside plait (compiled as if it lived there) calls from two places."""

    rec = FlightRecorder(0, 2, stack_depth=1)
    inside = {"rec": rec, "SHAPE": SHAPE}
    source = "def wrapper(seq):\n    return rec.begin(SHAPE, seq, 1)\n"  # skip 1: begins inside
    exec(compile(source, PLAIT_DIR + "wrapped.py", "exec"), inside)
    wrapper = inside["wrapper"]

    def here(seq: int) -> Slot:
        return wrapper(seq)  # the caller: this line, every time

    def there(seq: int) -> Slot:
        return wrapper(seq)

    for seq, fn in enumerate([here, here, here, there, here]):
        rec.end(fn(seq))
    names = [c["stack"][0][2] for c in rec.snapshot()]
    assert names == ["here", "here", "here", "there", "here"]
    assert [n for _, n in rec._hops.values()] == [1]  # one way out, from the first call


def test_skip_beyond_the_outermost_frame() -> None:
    rec = FlightRecorder(0, 2, stack_depth=1)
    rec.end(rec.begin(SHAPE, 0, 10_000))
    assert rec.snapshot()[0]["stack"] == []


def test_skip_and_stack_depth() -> None:
    rec = FlightRecorder(0, 2, stack_depth=3)

    def inner() -> Slot:
        return rec.begin(SHAPE, 0, skip=2)  # skip inner: the frame of outer is the caller

    def outer() -> Slot:
        return inner()

    rec.end(outer())
    stack = rec.snapshot()[0]["stack"]
    assert [f[2] for f in stack] == ["outer", "test_skip_and_stack_depth", stack[2][2]]
    assert len(stack) == 3


def test_by_default_a_call_that_ends_well_keeps_no_stack() -> None:
    rec = FlightRecorder(0, 2)
    assert rec.stack_depth == 0
    run(rec, 0, 3)
    assert [c["stack"] for c in rec.snapshot()] == [[], [], []]
    assert not any(s.extra for s in rec.slots())  # the runner's short path may refill them


RUNNER = plait_frames(
    """
from plait.diagnostics.frames import runs_calls

@runs_calls
def run_call(rec, shape, seq, started, release):
    slot = rec.begin(shape, seq)  # the call runner holds its slot so while the call runs
    started.set()
    release.wait(30)
    rec.end(slot)
"""
)


def test_a_call_in_flight_is_found_where_its_thread_runs_it() -> None:
    """Without a stack per call, a dump finds an in-flight call's caller on its thread's stack."""
    import threading

    rec = FlightRecorder(0, 2)
    started, release = threading.Event(), threading.Event()

    def user_code() -> None:
        RUNNER["run_call"](rec, SHAPE, 0, started, release)

    line = user_code.__code__.co_firstlineno + 1
    t = threading.Thread(target=user_code)
    t.start()
    try:
        assert started.wait(30)
        [c] = rec.snapshot()
        assert c["state"] == "running"
        assert c["stack"] == [[__file__, line, "user_code"]]
    finally:
        release.set()
        t.join(30)
    [c] = rec.snapshot()
    assert c["state"] == "done"
    assert c["stack"] == []  # it ended well: its line is not kept


ENDING = plait_frames(
    """
from plait.diagnostics.frames import runs_calls

@runs_calls
def ending(slot, seq, started, release):
    started.set()  # a call numbered seq ends here, holding a slot a newer call has taken
    release.wait(30)
"""
)


def test_a_frame_still_ending_an_older_call_is_not_taken_for_the_newer_one() -> None:
    import threading

    rec = FlightRecorder(0, 2, capacity=1)
    slot = rec.begin(SHAPE, 5)  # in flight, begun here: no runner frame holds it
    started, release = threading.Event(), threading.Event()
    t = threading.Thread(target=ENDING["ending"], args=(slot, 4, started, release))
    t.start()
    try:
        assert started.wait(30)
        [c] = rec.snapshot()
        assert c["seq"] == 5
        assert c["state"] == "running"
        assert c["stack"] == []  # not the thread that is ending call #4
    finally:
        release.set()
        t.join(30)


def test_a_failed_call_keeps_its_callers_line() -> None:
    rec = FlightRecorder(0, 2, capacity=2)
    slot = EDGE["allreduce"](rec, SHAPE, 0)
    rec.end(slot, plait.CollectiveTimeout("rank 0: allreduce timed out"))
    line = sys._getframe().f_lineno - 1
    [c] = rec.snapshot()
    assert c["stack"] == [[__file__, line, "test_a_failed_call_keeps_its_callers_line"]]
    rec.end(rec.begin(SHAPE, 2))  # the same place, taken again by a call that ends well
    assert [c["stack"] for c in rec.snapshot()][-1] == []
    assert rec.ring[0].error is None
    assert not rec.ring[0].extra


def test_a_queued_call_keeps_its_callers_line() -> None:
    """An async call runs on another thread: its caller is taken when it is queued."""
    rec = FlightRecorder(0, 2)
    slot = rec.begin(SHAPE, 0, 1, True)
    line = sys._getframe().f_lineno - 1
    rec.started(slot)
    rec.end(slot)
    [c] = rec.snapshot()
    assert c["stack"] == [[__file__, line, "test_a_queued_call_keeps_its_callers_line"]]


def test_no_stack_when_depth_is_zero() -> None:
    rec = FlightRecorder(0, 2, stack_depth=0)
    run(rec, 0, 1)
    assert rec.snapshot()[0]["stack"] == []


def test_queued_then_started(clock: FakeClock) -> None:
    rec = FlightRecorder(0, 2)
    slot = rec.begin(SHAPE, 0, queued=True)
    assert rec.snapshot()[0]["state"] == "queued"
    assert rec.snapshot()[0]["start"] is None
    clock.advance(2.0)
    rec.started(slot)
    clock.advance(1.0)
    rec.end(slot)
    c = rec.snapshot()[0]
    assert c["state"] == "done"
    assert c["start"] - c["queued"] == pytest.approx(2.0)
    assert c["end"] - c["start"] == pytest.approx(1.0)


class Handle:
    """A transport handle as the recorder sees one: hashable, with ``done``."""

    def __init__(self, done: bool) -> None:
        self.done = done


def test_waiting_on_is_read_from_the_executor_table_when_dumped() -> None:
    rec = FlightRecorder(1, 4)
    slot = rec.begin(SHAPE, 0)
    steps = [SimpleNamespace(peer=p) for p in (0, 2, 3, 2)]
    handles = [Handle(d) for d in (True, False, True, False)]
    rec.watch(slot, {h: i for i, h in enumerate(handles)}, steps)
    assert rec.snapshot()[0]["waiting_on"] == [2]
    handles[1].done = handles[3].done = True
    assert rec.snapshot()[0]["waiting_on"] == []
    rec.end(slot)
    assert slot.pending is None
    assert slot.steps is None


def test_a_failed_call_keeps_its_error_and_whom_it_waited_for() -> None:
    rec = FlightRecorder(0, 4)
    slot = rec.begin(SHAPE, 7)
    rec.waiting_on(slot, [3])
    rec.end(slot, plait.CollectiveTimeout("rank 0: allreduce (ring, call #7) timed out"))
    c = rec.snapshot()[0]
    assert c["state"] == "failed"
    assert c["error"] == "CollectiveTimeout: rank 0: allreduce (ring, call #7) timed out"
    assert c["waiting_on"] == [3]


def test_dump_round_trip(tmp_path: Path, clock: FakeClock) -> None:
    rec = FlightRecorder(2, 4, capacity=8, job="j1", stack_depth=1)
    run(rec, 0, 3)
    clock.advance(0.5)
    slot = rec.begin(CallShape("broadcast", "binomial", 10, np.dtype(np.int64), None, 1), 3)
    rec.waiting_on(slot, [1])
    path = rec.dump("signal SIGUSR1")
    assert path == tmp_path / "dumps" / "j1" / "rank2.json"
    raw = json.loads(path.read_text())
    assert raw["format"] == FORMAT
    assert raw["version"] == VERSION
    assert set(raw) == {
        "format", "version", "job", "run", "comm", "rank", "size", "global_rank", "members",
        "pid", "host", "reason", "time", "capacity", "recorded", "calls", "threads",
    }  # fmt: skip
    assert any(t["name"] == "MainThread" and t["stack"] for t in raw["threads"])
    d = load(path)
    assert (d.job, d.comm, d.rank, d.size, d.capacity, d.recorded) == ("j1", 0, 2, 4, 8, 4)
    assert d.reason == "signal SIGUSR1"
    assert [c.seq for c in d.calls] == [0, 1, 2, 3]
    done, last = d.calls[0], d.calls[-1]
    assert done.signature == ("allreduce", "ring", 2, "float32", "SUM", 0)
    assert done.nbytes == 8
    assert done.state == "done"
    assert done.end is not None
    assert last.signature == ("broadcast", "binomial", 10, "int64", "-", 1)
    assert last.in_flight
    assert last.end is None
    assert last.waiting_on == (1,)
    assert last.start is not None
    assert done.start is not None
    assert last.start - done.start == pytest.approx(0.5)
    assert last.where == "test_recorder.py:" + str(last.stack[0][1])
    assert d.threads
    assert d.threads[0][1]


def test_split_communicators_dump_to_their_own_file(tmp_path: Path) -> None:
    rec = FlightRecorder(1, 2, comm=0x1F, job="j1")
    assert rec.dump("x") == tmp_path / "dumps" / "j1" / "comm1f.rank1.json"
    explicit = rec.dump("x", tmp_path / "here.json")
    assert load(explicit).comm == 0x1F


def test_settings_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLAIT_RECORDER_SIZE", "16")
    monkeypatch.setenv("PLAIT_RECORDER_STACK", "2")
    rec = FlightRecorder.from_env(0, 2)
    assert rec is not None
    assert rec.capacity == 16
    assert rec.stack_depth == 2
    assert job_id() == "testjob"
    assert dump_dir() == tmp_path / "dumps"
    monkeypatch.setenv("PLAIT_RECORDER_SIZE", "0")
    assert FlightRecorder.from_env(0, 2) is None
    monkeypatch.setenv("PLAIT_RECORDER_SIZE", "many")
    with pytest.raises(ValueError, match="PLAIT_RECORDER_SIZE"):
        FlightRecorder.from_env(0, 2)
    # A ring is made whole when its communicator is: 10^11 slots hung plait.init while it
    # ate the memory. At most a million are taken.
    monkeypatch.setenv("PLAIT_RECORDER_SIZE", "99999999999")
    with pytest.raises(ValueError, match="PLAIT_RECORDER_SIZE must be an integer from 0 to"):
        FlightRecorder.from_env(0, 2)
    monkeypatch.delenv("PLAIT_DUMP_DIR")
    monkeypatch.delenv("PLAIT_JOB_ID")
    assert dump_dir().name == "plait-dumps"
    assert job_id() in ("local", *filter(None, [_env("TORCHELASTIC_RUN_ID"), _env("SLURM_JOB_ID")]))


def _env(name: str) -> str | None:
    return os.environ.get(name)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="capacity"):
        FlightRecorder(0, 1, capacity=0)
    with pytest.raises(ValueError, match="stack_depth"):
        FlightRecorder(0, 1, stack_depth=-1)


def test_reading_something_that_is_not_a_dump(tmp_path: Path) -> None:
    with pytest.raises(DumpError, match="not a plait flight-recorder dump"):
        parse({"traceEvents": []})
    with pytest.raises(DumpError, match="version 2"):
        parse({"format": FORMAT, "version": 2})
    with pytest.raises(DumpError, match="malformed"):
        parse({"format": FORMAT, "version": 1, "calls": []})
    cut = tmp_path / "cut.json"
    cut.write_text('{"format": "plait-flight-recorder", "calls": [')
    with pytest.raises(DumpError, match="cut short"):
        load(cut)


def test_a_dump_made_while_the_same_thread_writes_one_leaves_both_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dump on SIGUSR1 that came while the same thread was between writing an error's
    dump and renaming it used the same file beside and renamed it away: the error's dump
    failed ("No such file or directory: '.../.rank0.json.<pid>.<thread>.tmp'")."""
    rec = FlightRecorder(0, 2, job="twice", folder=tmp_path)
    rec.end(rec.begin(SHAPE, 0), plait.PeerLostError("rank 0: lost rank 1"))
    real = os.replace
    inner: list[Path] = []
    calls: list[Any] = []

    def interrupted(src: Any, dst: Any, **fds: Any) -> None:
        calls.append(src)
        if len(calls) == 1:  # the handler's dump runs before the interrupted rename
            inner.append(rec.dump("signal SIGUSR1"))
        real(src, dst, **fds)

    monkeypatch.setattr(os, "replace", interrupted)
    path = rec.dump("PeerLostError: rank 0: lost rank 1")
    assert inner == [path]
    assert len(calls) == 2
    assert load(path).reason == "PeerLostError: rank 0: lost rank 1"  # the last one written
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # nothing left beside it
