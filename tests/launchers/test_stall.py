"""Stalls (``plait run --stall-timeout S``, ``Job(stall_timeout=S)``): a rank's stall line makes
the launcher send SIGUSR1 to the other ranks that catch it, once per stall, and name the folder
of the dumps; the job goes on."""

from __future__ import annotations

import io
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any, cast

import pytest

from plait.diagnostics.schema import load
from plait.launch import Job, launch
from plait.launch.relay import DRAIN_SECONDS, Relay
from plait.launch.stall import StallResponder, dump_folder, folder_problem, stall_timeout
from plait.launch.watch import RankProcess

#: A rank of the launcher tests. Ranks listed in argv[2] keep SIGUSR1's default action (a
#: signal would kill them); the others count SIGUSR1 and dump through plait's own handler,
#: with a recorder whose call #4 is in flight. Rank 0 reports the stall once every rank is
#: ready, with the watchdog's own code (its clock a minute ahead: no waiting); rank 2 reports
#: it again once signalled, within the same episode. With argv[3] == "fail", rank 1 of the
#: first attempt exits with code 3 at once (then no rank reports).
STALLER = """
    import os, select, signal, sys, time
    from plait.diagnostics.recorder import CallShape, FlightRecorder
    from plait.diagnostics.triggers import Watchdog, install_signal_handler
    from plait.rendezvous.url import store_from_url

    rank, size = int(os.environ["PLAIT_RANK"]), int(os.environ["PLAIT_SIZE"])
    out, bare, mode = sys.argv[1], {int(r) for r in sys.argv[2].split(",") if r}, sys.argv[3]
    if mode == "fail" and rank == 1 and os.environ["PLAIT_RESTART_COUNT"] == "0":
        sys.exit(3)
    store = store_from_url(os.environ["PLAIT_STORE"], rank=rank, timeout=60)
    received = 0
    wake_r, wake_w = os.pipe()

    def count(signum, frame):
        global received
        received += 1
        os.write(wake_w, b"x")

    if rank not in bare:
        signal.signal(signal.SIGUSR1, count)
        install_signal_handler()  # dumps every recorder, then calls count
        recorder = FlightRecorder(rank, size)
        recorder.begin(CallShape("allreduce", "ring", 8, "float32", "SUM"), 4)

    def report_stall():
        Watchdog(1.0, clock=lambda: time.monotonic() + 60).check()

    store.set(f"ready-{rank}", b"1")
    signalled = [f"signalled-{r}" for r in range(1, size) if r not in bare]
    if rank == 0:
        store.wait([f"ready-{r}" for r in range(size)])
        report_stall()
    elif rank not in bare:
        select.select([wake_r], [], [], 60)  # until SIGUSR1 (PEP 475: the handler wakes it)
        if rank == 2:
            report_stall()
        store.set(f"signalled-{rank}", b"1")
    # A bare rank is still running while the launcher signals the ranks after it.
    store.wait(signalled)
    with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
        f.write(f"{received} {os.environ['PLAIT_JOB_ID']}")
"""


def _launch(tmp_path: Path, nproc: int, bare: str, mode: str, **kw: Any) -> tuple[int, str]:
    """Run STALLER on ``nproc`` ranks (``bare``, ``mode``: its argv); the exit code, stderr."""
    script = tmp_path / "staller.py"
    script.write_text(textwrap.dedent(STALLER))
    out = tmp_path / "out"
    out.mkdir()
    job = Job(
        (sys.executable, "-u", str(script), str(out), bare, mode),
        nproc=nproc,
        env={"PLAIT_DUMP_DIR": str(tmp_path / "dumps")},
        timeout=20,
        **kw,
    )
    stderr = io.StringIO()
    code = launch(job, stdout=io.StringIO(), stderr=stderr)
    return code, stderr.getvalue()


def _ranks_said(tmp_path: Path, nproc: int) -> list[tuple[int, str]]:
    """(SIGUSR1 received, PLAIT_JOB_ID) of every rank, in rank order."""
    said = [(tmp_path / "out" / f"rank{r}.txt").read_text().split() for r in range(nproc)]
    return [(int(n), job) for n, job in said]


def _reason(folder: Path, rank: int) -> str:
    return str(json.loads((folder / f"rank{rank}.json").read_text())["reason"])


@pytest.mark.timeout(150)
def test_a_stall_line_makes_every_other_catching_rank_dump_once(tmp_path: Path) -> None:
    code, err = _launch(tmp_path, 4, "1", "", stall_timeout=30)
    assert code == 0, err  # a stall is no failure
    said = _ranks_said(tmp_path, 4)
    # Rank 0 reported (its watchdog dumped it); rank 1 has no handler; rank 2's own report
    # came within the episode and sent nothing more.
    assert [n for n, _ in said] == [0, 0, 1, 1], err
    job = said[0][1]
    folder = tmp_path / "dumps" / job
    launcher = [line for line in err.splitlines() if line.startswith("plait run:")]
    assert launcher == [
        "plait run: rank 0 reports a stall; SIGUSR1 sent to have ranks 2, 3 dump too "
        f"(not rank 1: no handler for SIGUSR1); dumps in {folder}: plait analyze {folder}"
    ]
    assert sum("plait: stall: rank" in line for line in err.splitlines()) == 2  # relayed as is
    assert sorted(p.name for p in folder.iterdir()) == ["rank0.json", "rank2.json", "rank3.json"]
    assert _reason(folder, 0).startswith("stall: allreduce #4")
    assert _reason(folder, 2).startswith("stall: allreduce #4")  # its own report came last
    assert _reason(folder, 3) == "signal SIGUSR1"


@pytest.mark.timeout(90)
def test_after_a_restart_the_folder_is_the_attempts(tmp_path: Path) -> None:
    code, err = _launch(tmp_path, 2, "", "fail", stall_timeout=30, max_restarts=1)
    assert code == 0, err
    said = _ranks_said(tmp_path, 2)
    assert [n for n, _ in said] == [0, 1]
    job = said[0][1]
    assert job.endswith("-r1"), job
    folder = tmp_path / "dumps" / job
    assert "plait run: rank 0 reports a stall; SIGUSR1 sent to have rank 1 dump too; " in err
    assert f"dumps in {folder}: plait analyze {folder}\n" in err
    assert sorted(p.name for p in folder.iterdir()) == ["rank0.json", "rank1.json"]


class _Proc:
    """What the responder uses of a rank's Popen: its pid, its state, send_signal."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.sent: list[int] = []

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:  # as Popen: nothing for a process already reaped
            self.sent.append(signum)


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


#: The dump folder of the responder tests: made (a stall line names it only if it exists).
_DUMPS = Path(tempfile.mkdtemp(prefix="plait-stall-test-")) / "job 1"
_DUMPS.mkdir()
_QUOTED = shlex.quote(str(_DUMPS))


def _responder(
    window: float | None, catching: set[int]
) -> tuple[StallResponder, list[RankProcess], _Clock]:
    ranks = [RankProcess(r, cast("subprocess.Popen[bytes]", _Proc(1000 + r))) for r in range(4)]
    clock = _Clock()
    responder = StallResponder(
        ranks,
        _DUMPS,
        window,
        catches=lambda pid: pid - 1000 in catching,
        clock=clock,
    )
    return responder, ranks, clock


def _sent(ranks: list[RankProcess]) -> list[int]:
    """How many SIGUSR1 every rank got."""
    return [cast("_Proc", r.proc).sent.count(signal.SIGUSR1) for r in ranks]


def test_one_round_of_signals_per_episode() -> None:
    responder, ranks, clock = _responder(10.0, {0, 1, 2})
    line = responder.report(1, "rank 1: allreduce #7 (ring) in flight for 10 s; ...")
    assert line == (
        "rank 1 reports a stall; SIGUSR1 sent to have ranks 0, 2 dump too (not rank 3: no "
        f"handler for SIGUSR1); dumps in {_QUOTED}: plait analyze {_QUOTED}"
    )
    assert _sent(ranks) == [1, 0, 1, 0]
    clock.now += 9.9
    assert responder.report(0, "rank 0: ...") is None  # the same hang, seen by another rank
    assert _sent(ranks) == [1, 0, 1, 0]
    clock.now += 10.0
    ranks[0].exit = (0, clock.now)  # exited: never signalled again
    cast("_Proc", ranks[2].proc).returncode = -9  # reaped: never signalled again
    line = responder.report(3, "rank 3: ...")  # a new stall, later: a new round
    assert line is not None
    assert line.startswith("rank 3 reports a stall; SIGUSR1 sent to have rank 1 dump too; ")
    assert _sent(ranks) == [1, 1, 1, 0]


def test_without_a_known_stall_timeout_one_round_per_attempt() -> None:
    responder, ranks, clock = _responder(None, {0, 1, 2, 3})
    assert responder.report(2, "rank 2: ...") is not None
    clock.now += 1e6
    assert responder.report(1, "rank 1: ...") is None
    assert _sent(ranks) == [1, 1, 0, 1]


def test_no_rank_to_signal() -> None:
    responder, ranks, _ = _responder(5.0, set())
    line = responder.report(0, "rank 0: ...")
    assert line is not None
    assert line.startswith(
        "rank 0 reports a stall; no other rank signalled (not ranks 1, 2, 3: no handler for "
    )
    assert _sent(ranks) == [0, 0, 0, 0]


def test_settings_from_the_ranks_environment(tmp_path: Path) -> None:
    env = {"PLAIT_DUMP_DIR": str(tmp_path), "PLAIT_JOB_ID": "a/b-r2", "PLAIT_STALL_TIMEOUT": "2.5"}
    assert dump_folder(env) == tmp_path / "a_b-r2"  # as the recorder names the job's folder
    assert stall_timeout(env) == 2.5
    assert stall_timeout({}) is None
    assert stall_timeout({"PLAIT_STALL_TIMEOUT": "0"}) is None
    assert stall_timeout({"PLAIT_STALL_TIMEOUT": "soon"}) is None


def test_the_option_sets_the_ranks_variable(tmp_path: Path) -> None:
    script = tmp_path / "show.py"
    script.write_text("import os\nprint(os.environ.get('PLAIT_STALL_TIMEOUT'))\n")
    plait = [sys.executable, "-m", "plait", "run", "-n", "2"]
    res = subprocess.run(
        [*plait, "--stall-timeout", "2.5", str(script)], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["2.5", "2.5"]
    # 0 turns off what the launcher inherited (it was left as it was, stalls dumped still)
    inherited = {**os.environ, "PLAIT_STALL_TIMEOUT": "1"}
    res = subprocess.run(
        [*plait, "--stall-timeout", "0", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        env=inherited,
    )
    assert res.returncode == 0, res.stderr
    assert [float(v) for v in res.stdout.split()] == [0.0, 0.0]
    res = subprocess.run(
        [*plait, "--stall-timeout", "-1", str(script)], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 2
    assert "--stall-timeout must be a number of seconds >= 0" in res.stderr
    with pytest.raises(ValueError, match="stall_timeout must be >= 0"):
        Job(("true",), stall_timeout=-1.0)
    for bad in (-5.0, 0.0, float("nan")):  # every rank failed in plait.init; 0 was ignored
        with pytest.raises(ValueError, match="timeout must be > 0 seconds"):
            Job(("true",), timeout=bad)


#: Three ranks of a real job. After call #0, rank 2 is stuck in its own compute: the behaviour
#: under test (a data loader that hangs, say), here a wait for the launcher's SIGUSR1 and then
#: for both other ranks' stall reports (so that no dump of theirs can come after the release),
#: while ranks 0 and 1 wait for it in call #1. Their watchdogs (PLAIT_STALL_TIMEOUT=1) report the
#: stall, the launcher signals rank 2, and every rank has dumped before call #1 completes.
SLEEPER = """
    import os, select, signal, sys
    import numpy as np
    import plait
    from plait.diagnostics.triggers import STALL_MARKER
    from plait.rendezvous.url import store_from_url

    comm = plait.init()
    store = store_from_url(os.environ["PLAIT_STORE"], rank=comm.rank, timeout=20)
    comm.allreduce(np.ones(4), algorithm="direct")
    if comm.rank == 2:
        wake_r, wake_w = os.pipe()
        dump = signal.getsignal(signal.SIGUSR1)  # plait.init's handler

        def woken(signum, frame):
            dump(signum, frame)
            os.write(wake_w, b"x")

        signal.signal(signal.SIGUSR1, woken)
        select.select([wake_r], [], [], 20)
        store.wait(["stalled-0", "stalled-1"])
    else:
        class Tee:
            # The watchdog prints its stall line on sys.stderr: tell rank 2 when it has.
            def __init__(self, stream):
                self.stream = stream

            def write(self, text):
                n = self.stream.write(text)
                if STALL_MARKER in text:
                    self.stream.flush()
                    store.set(f"stalled-{comm.rank}", b"1")
                return n

            def flush(self):
                self.stream.flush()

        sys.stderr = Tee(sys.stderr)
    comm.allreduce(np.ones(4), algorithm="direct")
    print("job", os.environ["PLAIT_JOB_ID"], flush=True)
    comm.close()
"""


@pytest.mark.timeout(90)
def test_a_rank_stuck_in_its_compute_is_named_by_the_others_dumps(tmp_path: Path) -> None:
    script = tmp_path / "sleeper.py"
    script.write_text(textwrap.dedent(SLEEPER))
    job = Job(
        (sys.executable, "-u", str(script)),
        nproc=3,
        env={"PLAIT_DUMP_DIR": str(tmp_path / "dumps")},
        timeout=20,
        stall_timeout=1,
    )
    out, err = io.StringIO(), io.StringIO()
    code = launch(job, stdout=out, stderr=err)
    assert code == 0, err.getvalue()
    (job_id,) = {line.split()[1] for line in out.getvalue().splitlines()}
    folder = tmp_path / "dumps" / job_id
    assert f"dump too; dumps in {folder}: plait analyze {folder}\n" in err.getvalue()
    dumps = {r: load(folder / f"rank{r}.json") for r in range(3)}
    for r in (0, 1):  # waiting in call #1 for rank 2 (and for what rank 2 holds up)
        (call,) = [c for c in dumps[r].calls if c.in_flight]
        assert (call.seq, call.collective) == (1, "allreduce"), dumps[r]
        assert 2 in call.waiting_on, dumps[r]
    assert dumps[2].reason == "signal SIGUSR1"
    assert [(c.seq, c.in_flight) for c in dumps[2].calls] == [(0, False)]
    # What the launcher's line suggests.
    res = subprocess.run(
        [sys.executable, "-m", "plait", "analyze", str(folder)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 1, res.stdout + res.stderr  # 1: something is wrong
    assert "first problem: rank 2 never reached call #1 (allreduce at sleeper.py" in res.stdout


def test_the_relay_goes_on_when_the_stall_handler_fails() -> None:
    code = (
        "import sys; from plait.diagnostics.triggers import STALL_MARKER as m; "
        "print(m, 'rank 0: x', file=sys.stderr); print('after', file=sys.stderr)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0
    )
    seen: list[tuple[int, str]] = []

    def broken(rank: int, description: str) -> str | None:
        seen.append((rank, description))
        raise RuntimeError("no /proc here")

    err = io.StringIO()
    relay = Relay(False, stdout=io.StringIO(), stderr=err, on_stall=broken)
    relay.add(5, proc)
    relay.start()
    assert proc.wait(timeout=30) == 0
    relay.close(DRAIN_SECONDS)
    assert seen == [(5, "rank 0: x")]
    # The launcher's line follows the read that held the stall line, whole.
    assert sorted(err.getvalue().splitlines()) == [
        "after",
        "plait run: could not handle rank 5's stall: RuntimeError('no /proc here')",
        "plait: stall: rank 0: x",
    ]


def test_a_dump_folder_under_a_file_is_named_as_the_problem(tmp_path: Path) -> None:
    """PLAIT_DUMP_DIR naming a file: no rank can dump, so the stall line names no folder."""
    afile = tmp_path / "afile"
    afile.write_text("")
    assert folder_problem(tmp_path / "new" / "job", make=True) is None  # as the launcher starts
    assert (tmp_path / "new" / "job").is_dir()
    assert folder_problem(tmp_path / "other") == (
        f"the ranks could not make {tmp_path / 'other'} (see their 'dump failed' lines)"
    )
    assert folder_problem(afile / "job") == f"{afile} is not a folder"
    ranks = [RankProcess(r, cast("subprocess.Popen[bytes]", _Proc(1000 + r))) for r in range(2)]
    responder = StallResponder(ranks, afile / "job", None, catches=lambda pid: True)
    assert responder.report(0, "rank 0: ...") == (
        "rank 0 reports a stall; SIGUSR1 sent to have rank 1 dump too; no dumps: "
        f"{afile} is not a folder"
    )


def test_a_dump_folder_that_cannot_be_reached_is_a_problem_not_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A folder on the way that may not be entered made Path.exists raise, and the job
    never started."""
    locked = tmp_path / "locked"

    def exists(self: Path) -> bool:
        if str(self).startswith(str(locked)):
            raise PermissionError(13, "Permission denied")
        return self.stat() is not None if self == tmp_path else False

    monkeypatch.setattr(Path, "exists", exists)
    problem = folder_problem(locked / "inner" / "dumps", make=True)
    assert problem == f"{locked / 'inner' / 'dumps'} cannot be reached (Permission denied)"


def test_the_launcher_says_at_once_that_dumps_will_fail(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    err = io.StringIO()
    job = Job(command=(sys.executable, "-c", "pass"), nproc=1, env={"PLAIT_DUMP_DIR": str(afile)})
    assert launch(job, stdout=io.StringIO(), stderr=err) == 0
    assert (
        f"plait run: PLAIT_DUMP_DIR={afile}: {afile} is not a folder; flight-recorder dumps "
        "will fail\n" in err.getvalue()
    )


class _Dumper(_Proc):
    """A rank that, on SIGUSR1, dumps a communicator it has besides the world (a shrunk one,
    where it is rank ``index``): ``comm1337c.rank<index>.json``, its rank in the job inside."""

    def __init__(self, pid: int, folder: Path, rank: int, index: int) -> None:
        super().__init__(pid)
        self.path = folder / f"comm1337c.rank{index}.json"
        self.rank = rank

    def send_signal(self, signum: int) -> None:
        super().send_signal(signum)
        self.path.write_text(json.dumps({"global_rank": self.rank, "members": [0, 1, 3]}))


def test_a_dump_of_a_communicator_other_than_the_world_counts(tmp_path: Path) -> None:
    """Job rank 3, rank 2 of a communicator shrunk after rank 2 was lost, dumps that
    communicator when signalled, and its world dump is an older one it keeps: the launcher
    waited only for ``rank3.json`` and said "asked rank 3 to dump; none did in 0.3 s"."""
    ranks = [RankProcess(r, cast("subprocess.Popen[bytes]", _Proc(1000 + r))) for r in range(3)]
    ranks.append(RankProcess(3, cast("subprocess.Popen[bytes]", _Dumper(1003, tmp_path, 3, 2))))
    for r in ranks[:3]:
        r.exit = (1, 0.0)  # failed, or killed: not signalled
    (tmp_path / "rank3.json").write_text(json.dumps({"global_rank": 3}))
    os.utime(tmp_path / "rank3.json", (1.0, 1.0))  # the error it met long before
    responder = StallResponder(ranks, tmp_path, None, catches=lambda pid: True)
    line = responder.dump_before_stop({0: "exited with code 1"}, seconds=0.3)
    folder = shlex.quote(str(tmp_path))
    assert line == f"rank 3 dumped their calls before being stopped: plait analyze {folder}"


def test_a_dump_named_with_the_rank_of_another_does_not_count(tmp_path: Path) -> None:
    """``comm1337c.rank1.json``, written by job rank 3, is not job rank 1's dump."""
    ranks = [RankProcess(r, cast("subprocess.Popen[bytes]", _Proc(1000 + r))) for r in range(3)]
    ranks.append(RankProcess(3, cast("subprocess.Popen[bytes]", _Dumper(1003, tmp_path, 3, 1))))
    ranks[0].exit = ranks[2].exit = (1, 0.0)
    responder = StallResponder(ranks, tmp_path, None, catches=lambda pid: True)
    line = responder.dump_before_stop({0: "exited with code 1"}, seconds=0.3)
    folder = shlex.quote(str(tmp_path))
    assert line == f"rank 3 dumped their calls before being stopped: plait analyze {folder}"
