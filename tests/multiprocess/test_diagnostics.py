"""The flight recorder, ``plait analyze`` and ``PLAIT_TIMELINE`` in real jobs of ``plait run``.

Each job takes a few seconds: calls have short timeouts, and the one rank
that must stay away from a call waits on a FIFO the test opens, not on a
clock (docs/debugging.md describes what is checked here).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from plait.diagnostics import load

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(90)


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(PLAIT_DUMP_DIR=str(tmp_path / "dumps"), PLAIT_JOB_ID="diagjob", **extra)
    return env


def _script(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(text))
    return path


def _run(
    tmp_path: Path, n: int, script: str, env: dict[str, str], timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "plait", "run", "-n", str(n), str(_script(tmp_path, script))],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )


def _analyze(folder: Path) -> subprocess.CompletedProcess[str]:
    """``plait analyze FOLDER``, run as a user would."""
    return subprocess.run(
        [sys.executable, "-m", "plait", "analyze", str(folder)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


def test_a_skipped_call_is_named_by_every_rank_and_by_analyze(tmp_path: Path) -> None:
    script = """
        import numpy as np, plait
        comm = plait.init(timeout=20)
        comm.allreduce(np.ones(4))                      # call #0
        try:
            if comm.rank != 1:  # rank 1 skips the broadcast (the bug under test)
                comm.broadcast(np.ones(4), 0, timeout=5)    # call #1 on ranks 0 and 2
            comm.allreduce(np.ones(4), timeout=5)
        except plait.CommError as exc:
            print(f"ERROR rank {comm.rank}: {exc}", flush=True)
        else:
            print(f"NO ERROR rank {comm.rank}", flush=True)
    """
    res = _run(tmp_path, 3, script, _env(tmp_path))
    out = res.stdout + res.stderr
    errors = [line for line in res.stdout.splitlines() if line.startswith("ERROR rank")]
    assert len(errors) == 3, out[-3000:]
    for line in errors:
        rank = int(line.split()[2].rstrip(":"))
        assert f"flight recorder dump: {tmp_path / 'dumps' / 'diagjob'}" in line, line
        assert line.endswith(f"rank{rank}.json"), line

    analyze = _analyze(tmp_path / "dumps")
    report = analyze.stdout
    assert analyze.returncode == 1, report + analyze.stderr
    assert "dumps from 3 of 3 ranks" in report, report
    first = next(line for line in report.splitlines() if line.startswith("first problem:"))
    # rank 1 made the allreduce where ranks 0 and 2 made the broadcast: call #1, with its line
    assert "rank 1" in first, report
    assert "#1" in first, report
    # ranks 0 and 2 fail in their broadcast: its root waits for rank 1, its witness (Note
    # [rooted calls agree on the root]), and finds it in the allreduce
    assert "broadcast #1 (job.py:7)" in " ".join(report.split()), report
    assert "allreduce #1 (job.py:8)" in report, report


def _lines(stream: Iterator[str], into: queue.Queue[str]) -> None:
    for line in stream:
        into.put(line)


def _expect(lines: queue.Queue[str], predicate: object, deadline: float, seen: list[str]) -> str:
    """The first line for which ``predicate(line)`` holds, read before ``deadline``."""
    assert callable(predicate)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError("no such line; output so far:\n" + "".join(seen[-40:]))
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            continue
        seen.append(line)
        if predicate(line):
            return line


def test_sigusr1_dumps_a_rank_blocked_in_a_call_with_whom_it_waits_for(tmp_path: Path) -> None:
    fifo = tmp_path / "release"
    os.mkfifo(fifo)
    script = f"""
        import os, numpy as np, plait
        comm = plait.init(timeout=60)
        comm.allreduce(np.ones(4))                      # call #0
        if comm.rank == 0:
            print(f"PID {{os.getpid()}}", flush=True)
        else:
            # The slow rank under test: away from call #1 until the test opens the FIFO.
            with open({str(fifo)!r}) as f:
                f.read()
        comm.allreduce(np.ones(4))                      # call #1: rank 0 waits for rank 1
        print(f"DONE rank {{comm.rank}}", flush=True)
    """
    # The stall watchdog says when rank 0 has been in call #1 for a second: then it is
    # blocked for sure, and the signal finds it there.
    env = _env(tmp_path, PLAIT_STALL_TIMEOUT="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "plait", "run", "-n", "2", str(_script(tmp_path, script))],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env=env,
    )
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    reader = threading.Thread(target=_lines, args=(proc.stdout, lines), daemon=True)
    reader.start()
    seen: list[str] = []
    deadline = time.monotonic() + 60
    released = False
    try:
        pid = int(_expect(lines, lambda s: s.startswith("PID "), deadline, seen).split()[1])
        stall = _expect(lines, lambda s: "plait: stall:" in s, deadline, seen)
        assert "rank 0: allreduce #1" in stall, stall
        os.kill(pid, signal.SIGUSR1)
        # (plait run may also have had rank 1 dump on the stall: wait for rank 0's line)
        _expect(
            lines,
            lambda s: (
                s.startswith("plait: flight recorder dumped to ")
                and s.rstrip().endswith("rank0.json")
            ),
            deadline,
            seen,
        )
        dump = load(tmp_path / "dumps" / "diagjob" / "rank0.json")
        assert dump.reason == "signal SIGUSR1", "".join(seen)
        call = dump.call(1)
        assert call is not None, dump.calls
        assert call.state == "running"
        assert call.waiting_on == (1,)
        assert call.where == "job.py:11"
        assert any(t[0] == "MainThread" for t in dump.threads)
        with open(fifo, "w") as f:  # let rank 1 go on: the job ends normally
            f.write("go")
        released = True
        assert proc.wait(timeout=max(deadline - time.monotonic(), 1)) == 0
    finally:
        if not released:
            # open without blocking would fail with no reader: release rank 1 only if it waits
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
                os.close(fd)
            except OSError:
                pass
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(10)  # ends at the end of the output, once every process is gone
        proc.stdout.close()


def test_timeline_writes_a_valid_trace_per_rank(tmp_path: Path) -> None:
    script = """
        import numpy as np, plait
        with plait.init() as comm:
            comm.allreduce(np.ones(1024, np.float32))
            comm.broadcast(np.ones(8), 0)
            sub = comm.split(comm.rank % 2)
            sub.allreduce(np.ones(4))
    """
    template = tmp_path / "trace.json"
    res = _run(tmp_path, 3, script, _env(tmp_path, PLAIT_TIMELINE=str(template)))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    paths = [tmp_path / f"trace.rank{r}.json" for r in range(3)]
    for r, path in enumerate(paths):
        doc = json.loads(path.read_text())
        events = doc["traceEvents"]
        calls = [e["name"] for e in events if e.get("cat") == "call"]
        assert calls[:3] == ["allreduce #0", "broadcast #1", "allgather #2"], calls
        assert any(name.startswith("allreduce #0 (comm ") for name in calls), calls
        assert {e["pid"] for e in events} == {r}
        for e in events:
            if e["ph"] == "X":
                assert e["dur"] >= 0, e
                assert e["ts"] > 0, e
        kinds = {e.get("cat") for e in events if e["ph"] == "X"}
        # One host: every call is one-sided (posts and gets), the split's too, over the
        # group's own window: nothing is sent.
        assert "post" in kinds, kinds
        assert kinds & {"get", "get_reduce"}, kinds
        assert not kinds & {"send", "recv", "recv_reduce"}, kinds
        if r != 1:  # rank 1 is alone in its split; the others' split call posts and reads
            (split,) = [e for e in events if e.get("cat") == "call" and "(comm " in e["name"]]
            steps = {
                e.get("cat")
                for e in events
                if e["ph"] == "X"
                and e.get("cat") != "call"
                and split["ts"] <= e["ts"] <= split["ts"] + split["dur"]
            }
            assert "post" in steps, steps
            assert steps & {"get", "get_reduce"}, steps
        assert doc["otherData"]["dropped_events"] == 0
    merged = tmp_path / "merged.json"
    res = subprocess.run(
        [sys.executable, "-m", "plait.diagnostics.timeline", str(merged), *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr
    doc = json.loads(merged.read_text())
    assert any(e["ph"] == "s" for e in doc["traceEvents"])  # arrows: posts to their readers


def test_dumps_of_an_earlier_run_of_a_job_id_used_again_are_left_out(tmp_path: Path) -> None:
    """PLAIT_JOB_ID used again: the first run's rank 1 and 2 dumps stay beside the second
    run's rank 0 dump, and read together made rank 0 look as if in another call."""
    first = """
        import numpy as np, os, plait, signal
        comm = plait.init(timeout=20)
        comm.allreduce(np.ones(4))
        os.kill(os.getpid(), signal.SIGUSR1)  # every rank dumps
        comm.barrier()
    """
    second = """
        import numpy as np, plait, time
        comm = plait.init(timeout=20)
        comm.allreduce(np.ones(4))
        if comm.rank == 0:
            comm.broadcast(np.ones(4), timeout=2)  # the others never come: only rank 0 dumps
        else:
            time.sleep(4)
    """
    folder = tmp_path / "dumps" / "diagjob"
    res = _run(tmp_path, 3, first, _env(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    runs = {load(folder / f"rank{r}.json").run for r in range(3)}
    assert len(runs) == 1, runs  # one run token, on every rank
    assert None not in runs
    _run(tmp_path, 3, second, _env(tmp_path))
    assert load(folder / "rank0.json").run not in runs  # a new run, a new token
    analyze = _analyze(folder)
    report = " ".join(analyze.stdout.split())
    assert "dumps from 1 of 3 ranks" in report, report
    assert "first problem: ranks 1, 2 left no dump" in report, report
    assert "note: left out 2 dumps of an earlier run of job diagjob (rank1.json, rank2.json" in (
        report
    ), report
    assert "broadcast #1" in report, report
    assert "allreduce #1" not in report, report


def test_a_rank_killed_under_plait_run_leaves_the_others_dumps_and_a_note(
    tmp_path: Path,
) -> None:
    """Rank 2 dies by SIGKILL in a loop of calls: the launcher stopped the others at once,
    and no rank dumped (analyze: "no flight-recorder dump found"). Now they dump first,
    beside a note of how rank 2 ended, and analyze names it."""
    script = """
        import os, signal, time, numpy as np, plait
        comm = plait.init(timeout=60)
        for i in range(200):
            comm.allreduce(np.ones(1 << 10, np.float32))
        if comm.rank == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # the others at work outside plait: only the launcher can tell them
    """
    res = _run(tmp_path, 3, script, _env(tmp_path))
    out = res.stdout + res.stderr
    assert res.returncode == 128 + 9, out[-3000:]
    folder = tmp_path / "dumps" / "diagjob"
    assert "dumped their calls before being stopped: plait analyze" in out, out[-3000:]
    assert (folder / "launcher.json").exists(), out[-3000:]
    analyze = _analyze(folder)
    report = " ".join(analyze.stdout.split())
    assert analyze.returncode == 1, report + analyze.stderr
    assert "dumps from 2 of 3 ranks" in report, report
    assert (
        "first problem: rank 2 left no dump: rank 2 was killed by SIGKILL, as plait run saw"
        in report
    ), report
    assert "skipped" not in report, report  # the note is not read as a dump


def test_two_worlds_open_in_one_process_dump_to_files_of_their_own(tmp_path: Path) -> None:
    """plait.init twice (or beside torch's init_process_group("plait")): both worlds had id
    0, and each rank's second dump overwrote its first, losing one communicator's calls."""
    script = """
        import numpy as np, os, plait, signal
        a = plait.init(timeout=20)
        b = plait.init(timeout=20)
        a.allreduce(np.ones(3))
        b.allgather(np.ones(5))
        assert (a.allreduce(np.ones(1)) == a.size).all()  # still apart on the wire
        os.kill(os.getpid(), signal.SIGUSR1)  # every rank dumps both
        b.close()
        a.close()
        with plait.init(timeout=20) as c:  # the only world open again: rank<r>.json
            assert c._comm_id == 0 and a._comm_id == 0 and b._comm_id != 0
    """
    res = _run(tmp_path, 2, script, _env(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    folder = tmp_path / "dumps" / "diagjob"
    names = sorted(p.name for p in folder.glob("*.json"))
    seconds = [n for n in names if n.startswith("comm")]
    assert names == sorted(["rank0.json", "rank1.json", *seconds]), names
    assert len(seconds) == 2, names
    assert seconds[0].split(".")[0] == seconds[1].split(".")[0], names  # one id on every rank
    for r in range(2):
        first = [c.collective for c in load(folder / f"rank{r}.json").calls]
        second = [c.collective for c in load(folder / seconds[r]).calls]
        assert first == ["allreduce", "allreduce"], first
        assert second == ["allgather"], second
