"""When recorders dump: on a communication error, on SIGUSR1, on a stall."""

from __future__ import annotations

import gc
import io
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from dumpkit import FakeClock

import plait
from plait.diagnostics import recorder, triggers
from plait.diagnostics.recorder import CallShape, FlightRecorder
from plait.diagnostics.schema import load
from plait.diagnostics.timeline import Timeline
from plait.diagnostics.triggers import (
    STALL_MARKER,
    Watchdog,
    catches_signal,
    dump_all,
    dump_on_error,
    install_signal_handler,
    parse_stall_line,
    stall_timeout_from_env,
)

SHAPE = CallShape("allreduce", "ring", 2, np.dtype(np.float32), plait.SUM)


def test_dump_on_a_communication_error(tmp_path: Path) -> None:
    rec = FlightRecorder(1, 2)
    err = plait.PeerLostError("rank 1: allreduce (ring, call #0): rank 0 closed its connection")
    rec.end(rec.begin(SHAPE, 0), err)
    path = dump_on_error(rec, err)
    assert path == tmp_path / "dumps" / "testjob" / "rank1.json"
    assert load(path).reason.startswith("PeerLostError: rank 1: allreduce")
    assert dump_on_error(rec, ValueError("a bad argument")) is None
    assert dump_on_error(None, err) is None


def test_a_dump_that_cannot_be_written_does_not_raise(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    rec = FlightRecorder(0, 2, folder=tmp_path / "file")  # a file where a folder should be
    assert dump_on_error(rec, plait.MismatchError("x")) is None
    assert dump_all("x", [rec]) == []


def test_a_dump_that_fails_for_any_reason_does_not_raise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ring JSON could not write (a numpy root, before roots were made ints) made the
    error's dump raise TypeError, which the caller raised in place of the MismatchError."""
    rec = FlightRecorder(0, 2, folder=tmp_path)
    rec.end(rec.begin(SHAPE, 0), plait.MismatchError("x"))

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise TypeError("Object of type int64 is not JSON serializable")

    monkeypatch.setattr(recorder.json, "dumps", refuse)
    assert dump_on_error(rec, plait.MismatchError("x")) is None
    assert dump_all("x", [rec]) == []


def _returns(fn: Any, seconds: float = 10.0) -> bool:
    """Whether ``fn()``, run on a thread of its own, returns within ``seconds``."""
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    t.join(seconds)
    return not t.is_alive()


def test_a_dump_waits_on_no_lock_the_interrupted_thread_may_hold(tmp_path: Path) -> None:
    """Note [dumps from a signal handler]: SIGUSR1 while the main thread wrote its timeline
    (at exit) made the handler wait for the timeline's lock, which that thread held: the
    rank never exited. Here the locks are held by this thread while another dumps."""
    rec = FlightRecorder(0, 2, folder=tmp_path / "dumps")
    rec.timeline = Timeline(tmp_path / "trace.json", 0)
    rec.end(rec.begin(SHAPE, 0))
    with rec.timeline._lock:  # a write under way
        assert _returns(lambda: dump_all("signal SIGUSR1", [rec]))
    assert (tmp_path / "dumps").exists()
    assert not (tmp_path / "trace.json").exists()  # left to the write under way
    with recorder._live_lock:  # a communicator being made
        found: list[Any] = []
        assert _returns(lambda: found.extend(recorder.live_recorders(wait=False)))
        assert rec in found
    assert rec.timeline.write(wait=False) == tmp_path / "trace.json"


@pytest.fixture
def restore_sigusr1(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    old = signal.getsignal(signal.SIGUSR1)
    monkeypatch.setattr(triggers, "_installed", False)
    yield
    signal.signal(signal.SIGUSR1, old)


@pytest.mark.usefixtures("restore_sigusr1")
def test_sigusr1_dumps_every_recorder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gc.collect()  # recorders of earlier tests must not dump into this one's folder
    seen: list[int] = []
    signal.signal(signal.SIGUSR1, lambda sig, frame: seen.append(sig))
    recs = [FlightRecorder(r, 2, job="sig") for r in range(2)]
    slot = recs[0].begin(SHAPE, 0)
    assert install_signal_handler()
    assert not install_signal_handler()  # once per process
    signal.raise_signal(signal.SIGUSR1)  # runs the handler before it returns
    for r in range(2):
        d = load(tmp_path / "dumps" / "sig" / f"rank{r}.json")
        assert d.reason == "signal SIGUSR1"
    assert "flight recorder dumped to" in capsys.readouterr().err
    assert seen == [signal.SIGUSR1]  # the handler that was there runs too
    recs[0].end(slot)
    if Path("/proc/self/status").exists():
        assert catches_signal(os.getpid()) is True
    assert catches_signal(-1) is None


def test_the_watchdog_reports_a_stall_once(clock: FakeClock, tmp_path: Path) -> None:
    rec = FlightRecorder(3, 4, job="stall")
    rec.end(rec.begin(SHAPE, 0))
    slot = rec.begin(SHAPE, 1)
    stream = io.StringIO()
    dog = Watchdog(60.0, recorders=lambda: [rec], stream=stream, clock=clock)
    assert dog.interval == 5.0
    clock.advance(59.0)
    assert dog.check() is None
    clock.advance(2.0)
    line = dog.check()
    assert line is not None
    assert line.startswith(f"{STALL_MARKER} rank 3: allreduce #1 (ring) in flight for 61 s")
    assert stream.getvalue() == line + "\n"
    assert load(tmp_path / "dumps" / "stall" / "rank3.json").reason.startswith("stall:")
    assert dog.check() is None  # reported once
    rec.end(slot)
    assert parse_stall_line(f"[3]: {line}") == line[len(STALL_MARKER) :].strip()


def test_the_watchdog_sees_a_blocking_point_to_point_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two ranks each in a recv from the other, under a stall timeout: no stall line and no
    dump for the whole wait (the ring keeps no point-to-point calls)."""
    monkeypatch.setenv("PLAIT_DUMP_DIR", str(tmp_path))
    stream = io.StringIO()
    seen: list[str] = []
    reported = threading.Event()

    def watch(dog: Watchdog) -> None:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not reported.is_set():
            line = dog.check()
            if line is not None:
                seen.append(line)
                reported.set()
            time.sleep(0.05)

    def body(c: plait.Communicator) -> Any:
        rec = c._runner.recorder
        assert rec is not None
        if c.rank == 0:
            watcher = threading.Thread(
                target=watch, args=(Watchdog(0.2, recorders=lambda: [rec], stream=stream),)
            )
            watcher.start()
            c.recv(np.empty(1), 1, tag=3, timeout=20.0)
            watcher.join()
            assert rec.p2p == {}  # taken off once the wait ended
        else:
            reported.wait(15)  # outside plait until rank 0's wait was reported
            c.send(np.ones(1), 0, tag=3)
        return None

    plait.testing.run_ranks(2, body, timeout=30)
    [line] = seen
    assert line.startswith(f"{STALL_MARKER} rank 0: recv from rank 1 (tag 3) in flight for ")


def test_a_split_communicators_stall_names_the_job_rank(
    clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its rank alone (rank 0 of a group) named job rank 0, another process."""
    monkeypatch.setenv("PLAIT_RANK", "1")
    rec = FlightRecorder(0, 2, 0x36B73, job="split")
    slot = rec.begin(SHAPE, 0)
    dog = Watchdog(1.0, recorders=lambda: [rec], stream=io.StringIO(), clock=clock)
    clock.advance(2.0)
    line = dog.check()
    assert line is not None
    assert line.startswith(f"{STALL_MARKER} rank 1 (rank 0 of communicator 36b73): allreduce #0")
    rec.end(slot)


def test_a_stall_line_is_written_whole(clock: FakeClock, tmp_path: Path) -> None:
    """The line and its newline go in one write: print wrote them apart, and a dump line
    of the signal handler written between them joined the two into one line, which the
    launcher did not read as a stall."""
    writes: list[str] = []

    class Stream(io.StringIO):
        def write(self, s: str) -> int:
            writes.append(s)
            return super().write(s)

    rec = FlightRecorder(3, 4, job="whole")
    slot = rec.begin(SHAPE, 0)
    dog = Watchdog(1.0, recorders=lambda: [rec], stream=Stream(), clock=clock)
    clock.advance(2.0)
    line = dog.check()
    assert writes == [f"{line}\n"]
    rec.end(slot)
    assert parse_stall_line("loss 0.25") is None


def test_the_watchdog_thread_starts_and_stops() -> None:
    found: list[str] = []
    dog = Watchdog(1000.0, interval=0.001, recorders=list, on_stall=found.append).start()
    dog.stop()
    assert found == []


def test_stall_timeout_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PLAIT_STALL_TIMEOUT", raising=False)
    assert stall_timeout_from_env() is None
    monkeypatch.setenv("PLAIT_STALL_TIMEOUT", "90")
    assert stall_timeout_from_env() == 90.0
    monkeypatch.setenv("PLAIT_STALL_TIMEOUT", "0")
    assert stall_timeout_from_env() is None
    monkeypatch.setenv("PLAIT_STALL_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="PLAIT_STALL_TIMEOUT"):
        stall_timeout_from_env()
    with pytest.raises(ValueError, match="stall timeout"):
        Watchdog(0)


def test_a_failed_point_to_point_wait_dumps_as_a_collective_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank whose receive timed out (its peer in a barrier) left no dump, and analyze
    called it "probably died". A timeout the caller chose is a receive that may come later:
    no dump."""
    monkeypatch.setenv("PLAIT_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("PLAIT_JOB_ID", "p2p")

    def body(c: plait.Communicator) -> Any:
        if c.rank == 0:
            with pytest.raises(plait.CommTimeout) as chosen:
                c.recv(np.empty(1), 1, tag=5, timeout=0.1)
            assert "flight recorder dump" not in str(chosen.value)
            with pytest.raises(plait.CommError) as info:
                c.recv(np.empty(1), 1, tag=5)  # the communicator's timeout
            with pytest.raises(plait.CommError) as waited:
                c.irecv(np.empty(1), 1, tag=6).wait()
            return str(info.value), str(waited.value)
        with pytest.raises(plait.CommError):  # rank 0 never comes
            c.barrier()
        return None

    said, waited = plait.testing.run_ranks(2, body, timeout=1.0)[0]
    assert said.endswith(f"flight recorder dump: {tmp_path / 'p2p' / 'rank0.json'}")
    assert waited.endswith(f"flight recorder dump: {tmp_path / 'p2p' / 'rank0.json'}")
    dump = load(tmp_path / "p2p" / "rank0.json")  # the second failure's, written over
    assert dump.reason.split(": ", 1)[1] == waited.rpartition("; flight recorder dump")[0]


def test_a_dump_asked_for_soon_after_an_errors_dump_leaves_it_be(tmp_path: Path) -> None:
    """plait run has the ranks still running dump (SIGUSR1) when one fails; a rank that had
    just dumped the PeerLostError it met had that dump replaced by "signal SIGUSR1"."""
    rec = FlightRecorder(0, 2, job="keep", folder=tmp_path)
    rec.end(rec.begin(SHAPE, 0), plait.PeerLostError("rank 0: lost rank 1"))
    path = dump_on_error(rec, plait.PeerLostError("rank 0: lost rank 1"))
    assert path is not None
    assert dump_all("signal SIGUSR1", [rec]) == [path]
    assert load(path).reason.startswith("PeerLostError: ")
    rec.error_dumped -= 60  # long after, a dump asked for is written as before
    dump_all("signal SIGUSR1", [rec])
    assert load(path).reason == "signal SIGUSR1"


@pytest.mark.usefixtures("restore_sigusr1")
def test_a_signal_says_which_dumps_it_left_be(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A rank signalled soon after it dumped an error keeps that dump, and its line on
    stderr says so: it said "flight recorder dumped to" the file it had not rewritten."""
    gc.collect()  # recorders of earlier tests must not dump into this one's folder
    recs = [FlightRecorder(r, 2, job="kept", folder=tmp_path) for r in range(2)]
    err = plait.PeerLostError("rank 0: lost rank 1")
    recs[0].end(recs[0].begin(SHAPE, 0), err)
    kept = dump_on_error(recs[0], err)
    assert kept is not None
    assert install_signal_handler()
    signal.raise_signal(signal.SIGUSR1)
    err_text = capsys.readouterr().err
    written = tmp_path / "kept" / "rank1.json"
    # Recorders of other tests still alive in this process dump too, and may print lines of
    # their own: this signal's line is the first that names this test's files.
    lines = [x for x in err_text.splitlines() if x.startswith("plait: flight recorder")]
    line = next((x for x in lines if str(written) in x), "")
    dumped, _, again = line.removeprefix("plait: flight recorder ").partition(
        "; not dumped again: "
    )
    assert dumped.startswith("dumped to "), line
    assert str(written) in dumped.removeprefix("dumped to ").split(", "), line
    assert str(kept) not in dumped.removeprefix("dumped to ").split(", "), line
    assert f"{kept} keeps the dump of the error met " in again, line
    assert load(kept).reason.startswith("PeerLostError: ")
    assert load(written).reason == "signal SIGUSR1"
    want = f"not dumped again: {kept} keeps the dump of the error met 2.0 s ago"
    assert triggers.dumped_line([(kept, 2.0)]) == f"plait: flight recorder {want}"
    assert triggers.dumped_line([]) is None


def test_a_call_queued_behind_a_stuck_async_call_names_whom_it_waits_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call queued behind an async one-sided call that waited for a late rank timed out
    with a bare CommTimeout ("the one-sided call before it did not finish"): no rank named,
    no dump, unlike the same call's own timeout."""
    monkeypatch.setenv("PLAIT_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("PLAIT_JOB_ID", "queued")

    gave_up = threading.Event()

    def body(c: plait.Communicator) -> Any:
        if c.rank == 1:  # late: it comes once rank 0's queued call has given up
            assert gave_up.wait(5)
            return c.allreduce(np.ones(3)).tolist()
        w = c.allreduce(np.ones(3), async_op=True)
        with pytest.raises(plait.CollectiveTimeout) as info:
            c.allreduce(np.ones(3), timeout=0.2)
        gave_up.set()
        assert w.wait().tolist() == [2.0] * 3  # the call it waited behind was not harmed
        return str(info.value)

    said = plait.testing.run_ranks(2, body, timeout=5.0)[0]
    assert "the one-sided call before it, allreduce (" in said
    assert "call #0), did not finish within 0.2 s: it waits for rank(s) [1]" in said
    assert said.endswith(f"flight recorder dump: {tmp_path / 'queued' / 'rank0.json'}")
