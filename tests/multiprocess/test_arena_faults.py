"""Faults and waiting in real multi-process jobs on the one-sided (arena) path of one host.

On one host the ranks share a window in shared memory, and ``allreduce`` goes one-sided
there (``algorithm="arena"``, and what ``auto`` picks for small vectors: ``arena_oneshot``, or
``arena_leader`` where ranks outnumber cores):
ranks read each other's memory and wait on each other's counters instead of exchanging
messages. A lost, absent or mismatched rank must fail such calls as it fails the message
algorithms (test_faults.py): on every rank, naming whom, in time, and leaving nothing in
/dev/shm. And a rank waiting on a slow peer, one-sided or through messages, must sleep
rather than burn a core.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: Every rank script starts with this. ``arrived`` and ``wait_for`` keep a rank alive (and
#: its communicator open) until the others have got as far: a rank that closed first would
#: make a peer still in the call raise PeerLostError instead of the error under test.
#: ``leftovers`` is what of this job is still in /dev/shm; it is read inside the ranks,
#: since ``plait run`` removes the job's segments on its way out, which would hide a leak.
PROLOGUE = """\
import json, os, signal, sys, threading, time
import numpy as np
import plait

FLAGS = sys.argv[-1]

def arrived(what, rank):
    open(os.path.join(FLAGS, f"{what}{rank}"), "w").close()

def wait_for(what, count):
    deadline = time.monotonic() + 30
    while sum(f.startswith(what) for f in os.listdir(FLAGS)) < count:
        assert time.monotonic() < deadline, f"only some ranks got to {what}"
        time.sleep(0.02)

def leftovers():
    mine = f"plait-{os.environ['PLAIT_JOB_ID']}-"  # this job's segments, not others'
    return [p for p in os.listdir("/dev/shm") if p.startswith(mine)]

def report(**fields):
    print("RESULT " + json.dumps(fields), flush=True)
"""

#: (algorithm, float32 count, the algorithm the calls run): the explicit one-sided
#: algorithms on 1 MiB and on a small vector, and what ``auto`` picks for a small vector on
#: 3 ranks of one host with 2 cores or fewer (more ranks than cores: one rank reduces).
ARENA_CASES = [
    ("arena", 1 << 18, "arena"),
    ("arena_oneshot", 8, "arena_oneshot"),
    ("auto", 8, "arena_leader" if (os.cpu_count() or 1) < 3 else "arena_oneshot"),
]


def plait_run(
    args: list[str], script: str, tmp_path: Path, *script_args: str, timeout: float = 90
) -> tuple[subprocess.CompletedProcess[str], dict[int, list[dict]]]:
    """``plait run ARGS`` of ``script`` (with ``script_args`` and a flags folder last).

    Returns the launcher's result and each rank's RESULT lines (``--tag-output`` is added).
    """
    path = tmp_path / "job.py"
    path.write_text(PROLOGUE + textwrap.dedent(script))
    flags = tmp_path / "flags"
    flags.mkdir()
    rank_args = [str(path), *script_args, str(flags)]
    env = {**os.environ, "PLAIT_DUMP_DIR": str(tmp_path / "dumps")}  # failures' dumps
    res = subprocess.run(
        [sys.executable, "-m", "plait", "run", "--tag-output", *args, *rank_args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )
    results: dict[int, list[dict]] = {}
    for line in res.stdout.splitlines():
        tag, _, text = line.partition(": RESULT ")
        if text:
            results.setdefault(int(tag.strip("[]")), []).append(json.loads(text))
    return res, results


@pytest.mark.parametrize(("algorithm", "count", "runs"), ARENA_CASES)
def test_kill_9_mid_arena_allreduces_fails_the_survivors_naming_it(
    tmp_path: Path, algorithm: str, count: int, runs: str
) -> None:
    """Rank 2 dies by SIGKILL in a loop of one-sided allreduces: the two others raise
    PeerLostError within seconds (not the 120 s timeout), and close cleanly.

    Both name rank 2: the first to notice, and the other also where it meets the first's
    mark that it gave up on the call (Note [one-sided] in ``plait.runtime.one_sided``)
    before it notices itself: it raises the loss the first told it of, not "rank 0 gave
    up" with no lost rank.
    """
    script = """
        # plait run stops the other ranks (SIGTERM) once one is killed; ignoring it lets the
        # survivors show what plait itself raises, and when (SIGKILL follows 5 s later).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        algorithm, count = sys.argv[1], int(sys.argv[2])
        comm = plait.init(timeout=120)
        x = np.ones(count, np.float32)
        comm.allreduce(x, algorithm=algorithm)
        used = comm._runner.recorder.snapshot()[-1]["algorithm"]
        calls, start = 0, time.monotonic()
        try:
            while True:
                if comm.rank == 2 and calls == 20:  # die in a later call, from another thread
                    threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGKILL)).start()
                comm.allreduce(x, algorithm=algorithm)
                calls += 1
        except plait.CommError as exc:
            seconds = time.monotonic() - start
            error, lost, message = type(exc).__name__, getattr(exc, "lost_rank", None), str(exc)
        arrived("raised", comm.rank)
        wait_for("raised", 2)
        comm.close()
        report(used=used, calls=calls, error=error, lost=lost, message=message[:300],
               seconds=seconds, left=leftovers())
    """
    res, results = plait_run(["-n", "3"], script, tmp_path, algorithm, str(count))
    logs = res.stdout[-3000:] + res.stderr[-3000:]
    assert res.returncode == 128 + 9, logs  # rank 2's SIGKILL; the survivors exit 0
    assert sorted(results) == [0, 1], logs
    for rank, (out,) in results.items():
        assert out["used"] == runs, out
        assert out["calls"] >= 19, out  # rank 2 made 20 calls, ranks drift one apart at most
        assert out["error"] == "PeerLostError", out
        assert f"rank {rank}: allreduce ({runs}, call #" in out["message"], out
        assert out["seconds"] < 10, out
        assert out["left"] == [], out
        assert "rank 2 was lost" in out["message"], out
        assert out["lost"] == 2, out


@pytest.mark.parametrize(("algorithm", "count", "runs"), ARENA_CASES)
def test_rank_skipping_an_arena_allreduce_times_out_naming_it(
    tmp_path: Path, algorithm: str, count: int, runs: str
) -> None:
    """Rank 1 stays alive but skips a one-sided allreduce: ranks 0 and 2 raise
    CollectiveTimeout after their 2 s timeout, naming rank 1 as the one that never came."""
    script = """
        algorithm, count = sys.argv[1], int(sys.argv[2])
        comm = plait.init(timeout=60)
        x = np.ones(count, np.float32)
        comm.allreduce(x, algorithm=algorithm)
        used = comm._runner.recorder.snapshot()[-1]["algorithm"]
        if comm.rank == 1:
            # Behaviour under test, not synchronisation: rank 1 skips the next allreduce and
            # stays alive and silent until the others have given up on it.
            wait_for("raised", 2)
            comm.close()
            report(used=used, left=leftovers())
            raise SystemExit(0)
        start = time.monotonic()
        try:
            comm.allreduce(x, algorithm=algorithm, timeout=2)
        except plait.CommError as exc:
            seconds, error, message = time.monotonic() - start, type(exc).__name__, str(exc)
        else:
            raise SystemExit("no error")
        arrived("raised", comm.rank)
        wait_for("raised", 2)
        comm.close()
        report(used=used, error=error, message=message[:300], seconds=seconds, left=leftovers())
    """
    res, results = plait_run(["-n", "3"], script, tmp_path, algorithm, str(count))
    logs = res.stdout[-3000:] + res.stderr[-3000:]
    assert res.returncode == 0, logs
    assert sorted(results) == [0, 1, 2], logs
    assert results[1] == [{"used": runs, "left": []}]
    for rank in (0, 2):
        (out,) = results[rank]
        assert out["used"] == runs, out
        assert out["error"] == "CollectiveTimeout", out
        assert (
            f"rank {rank}: allreduce ({runs}, call #1) timed out waiting for rank(s) [1]"
            in out["message"]
        ), out
        assert 1.9 < out["seconds"] < 10, out  # its own timeout, not the 60 s one
        assert out["left"] == [], out


@pytest.mark.parametrize(("algorithm", "count", "runs"), ARENA_CASES)
def test_mismatched_counts_on_the_arena_path_fail_on_every_rank(
    tmp_path: Path, algorithm: str, count: int, runs: str
) -> None:
    """Three ranks pass three different counts to a one-sided allreduce: every rank raises
    MismatchError at once (the digests in the window differ), not after the 30 s timeout."""
    script = """
        algorithm, count = sys.argv[1], int(sys.argv[2])
        comm = plait.init(timeout=30)
        comm.allreduce(np.ones(count, np.float32), algorithm=algorithm)
        used = comm._runner.recorder.snapshot()[-1]["algorithm"]
        start = time.monotonic()
        try:
            comm.allreduce(np.ones(count + comm.rank, np.float32), algorithm=algorithm)
        except plait.CommError as exc:
            seconds, error, message = time.monotonic() - start, type(exc).__name__, str(exc)
        else:
            raise SystemExit("no error")
        arrived("raised", comm.rank)
        wait_for("raised", comm.size)
        comm.close()
        report(used=used, error=error, message=message[:300], seconds=seconds, left=leftovers())
    """
    res, results = plait_run(["-n", "3"], script, tmp_path, algorithm, str(count))
    logs = res.stdout[-3000:] + res.stderr[-3000:]
    assert res.returncode == 0, logs
    assert sorted(results) == [0, 1, 2], logs
    for rank, (out,) in results.items():
        assert out["used"] == runs, out
        assert out["error"] == "MismatchError", out
        assert f"rank {rank}: allreduce ({runs}, call #1)" in out["message"], out
        assert f"allreduce(count={count + rank}," in out["message"], out
        assert out["seconds"] < 5, out
        assert out["left"] == [], out


@pytest.mark.parametrize("nproc", [2, 4])
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_rank_waiting_on_a_long_computation_does_not_burn_a_core(
    tmp_path: Path, transport: str, nproc: int
) -> None:
    """The last rank computes for 1.5 s of CPU before it joins an allreduce; the others,
    already in the call, must sleep there: a few ms of CPU, far below the wait.

    Measured with ``time.process_time``, the CPU time of every thread of the process: a
    wait may run on a thread of plait's (an ``async_op`` call's worker), and a core burnt
    there is burnt all the same; the script's own thread does nothing else meanwhile. The
    computation is counted in CPU time, not wall time: on a machine busy with other jobs a
    rank gets only part of a core, and a waiter spinning beside the computation gets about
    as much as it, so it still shows about the computation's 1.5 s of CPU (over 0.25 s as
    long as the computation gets 5 % of a core within its 5 s cap). 4 ranks on 2 cores:
    more ranks than cores, where a waiting rank must also leave the cores to the one that
    computes.
    """
    script = """
        comm = plait.init(timeout=60)
        last = comm.size - 1
        rounds = [("auto", False), ("auto", True)]
        if sys.argv[1] == "shm":
            rounds.append(("arena", False))
        x = np.ones(8, np.float32)
        comm.allreduce(x)  # connections and the window set up before any measure
        for algorithm, async_op in rounds:
            comm.barrier()
            wall, cpu = time.monotonic(), time.process_time()
            if comm.rank == last:  # the long computation: 1.5 s of CPU (at most 5 s long)
                while time.process_time() - cpu < 1.5 and time.monotonic() - wall < 5:
                    pass
            if async_op:
                got = comm.allreduce(x, algorithm=algorithm, async_op=True).wait()
            else:
                got = comm.allreduce(x, algorithm=algorithm)
            wall, cpu = time.monotonic() - wall, time.process_time() - cpu
            assert got[0] == comm.size, got
            report(used=comm._runner.recorder.snapshot()[-1]["algorithm"], async_op=async_op,
                   wall=wall, cpu=cpu)
        comm.close()
    """
    res, results = plait_run(
        ["-n", str(nproc), "--transport", transport], script, tmp_path, transport
    )
    logs = res.stdout[-3000:] + res.stderr[-3000:]
    assert res.returncode == 0, logs
    assert sorted(results) == list(range(nproc)), logs
    rounds = 3 if transport == "shm" else 2
    for rank in range(nproc - 1):
        outs = results[rank]
        assert [o["async_op"] for o in outs] == [False, True, False][:rounds], outs
        if transport == "shm":  # one-sided, not through messages
            small = "arena_leader" if nproc > (os.cpu_count() or 1) else "arena_oneshot"
            assert [o["used"] for o in outs] == [small, small, "arena"]
        for out in outs:
            assert out["wall"] > 1.4, out  # it did wait for the computation
            assert out["cpu"] < 0.25, out  # and slept meanwhile (a few ms)


def test_ranks_name_the_rank_that_gave_up_not_the_late_one_that_passed_it_on(
    tmp_path: Path,
) -> None:
    """Rank 1 times out (its own 1 s) on rank 3, which comes 3 s late; ranks 0 and 2 wait
    on rank 3. Rank 3 gives up because rank 1 had, and 0 and 2, reading rank 3's post,
    said "rank 3 gave up on the call after an error of its own" (Note [who gave up first])."""
    script = """
        comm = plait.init(timeout=30)
        comm.barrier()
        if comm.rank == 3:
            wait_for("gave_up", 1)  # rank 1 has timed out: come now
        try:
            comm.allreduce(np.ones(4096), algorithm="arena", timeout=1 if comm.rank == 1 else 30)
            message = None
        except plait.CommError as exc:
            message = f"{type(exc).__name__}: {exc}"
        if comm.rank == 1:
            arrived("gave_up", 1)
        arrived("raised", comm.rank)
        wait_for("raised", 4)
        comm.close()
        report(message=message[:400] if message else None)
    """
    res, results = plait_run(["-n", "4"], script, tmp_path)
    logs = res.stdout[-3000:] + res.stderr[-3000:]
    assert sorted(results) == [0, 1, 2, 3], logs
    assert results[1][0]["message"].startswith("CollectiveTimeout: rank 1: allreduce"), logs
    for rank in (0, 2, 3):
        message = results[rank][0]["message"]
        assert message.startswith(f"PeerLostError: rank {rank}: allreduce (arena"), message
        assert "rank 1 gave up on the call when its timeout passed" in message, message
        assert "rank 3 gave up" not in message, message


@pytest.mark.parametrize("how", ["close", "kill"])
@pytest.mark.parametrize(("algorithm", "count", "runs"), ARENA_CASES[-1:])  # auto: the leader's
def test_a_rank_waiting_on_a_busy_peer_hears_at_once_of_another_lost_before_the_call(
    tmp_path: Path, algorithm: str, count: int, runs: str, how: str
) -> None:
    """Rank 0 closes (or dies) before the call; rank 1 is busy for 6 s. Rank 2, waiting on
    rank 1 (arena_leader's first piece waits on the other non-leaders first), heard of rank
    0 only once rank 1 arrived, or at its timeout (Note [members lost] in
    ``plait.transport.shm.link``): it now raises within a second or two, naming rank 0."""
    script = """
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as above: show what plait raises
        algorithm, count, how = sys.argv[1], int(sys.argv[2]), sys.argv[3]
        comm = plait.init(timeout=120)
        x = np.ones(count, np.float32)
        comm.allreduce(x, algorithm=algorithm)
        if comm.rank == 0:
            wait_for("ready", 2)
            if how == "close":
                comm.close()
                sys.exit(0)
            os.kill(os.getpid(), signal.SIGKILL)
        arrived("ready", comm.rank)
        if comm.rank == 1:
            time.sleep(6)
        start = time.monotonic()
        try:
            comm.allreduce(x, algorithm=algorithm)
            error, message, lost = None, "", None
        except plait.CommError as exc:
            error, message = type(exc).__name__, str(exc)
            lost = getattr(exc, "lost_rank", None)
        report(error=error, message=message[:300], seconds=time.monotonic() - start, lost=lost)
        arrived("raised", comm.rank)
        wait_for("raised", 2)
        comm.close()
    """
    res, results = plait_run(
        ["-n", "3", "--enable-recovery"], script, tmp_path, algorithm, str(count), how
    )
    logs = res.stdout[-3000:] + res.stderr[-3000:]
    assert sorted(results) == [1, 2], logs
    (out,) = results[2]
    assert out["error"] == "PeerLostError", out
    assert "rank 0 " in out["message"], out
    assert out["seconds"] < 3, out
    assert out["lost"] == 0, out
