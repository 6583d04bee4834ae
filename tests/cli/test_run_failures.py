"""``plait run`` names the rank that started a failure, not a rank that failed because of it, and
says how every rank ended; tracebacks carry their rank."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from plait.launch.relay import Traceback, named_ranks

PLAIT = [sys.executable, "-m", "plait"]


def plait_run(args: list[str], body: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.run(
        [*PLAIT, "run", *args, str(script), str(tmp_path / "peers")],
        capture_output=True,
        text=True,
        timeout=60,
    )


def status_lines(stderr: str) -> list[str]:
    """The summary's lines, one per rank."""
    return [line for line in stderr.splitlines() if re.match(r"plait run:   rank \d+: ", line)]


def assert_every_line_has_an_owner(stderr: str) -> None:
    for line in stderr.splitlines():
        assert line.startswith("plait run: ") or re.match(r"\[\d\]: ", line), line


#: Rank 1 raises ValueError; the others lose it as a peer and fail of PeerLostError, each its own
#: way. Rank 1 exits last for sure: after printing its traceback, its interpreter waits until
#: the other ranks have exited (each holds the write end of a FIFO that rank 1 reads to its end).
CASCADE = """
    import atexit, os, sys, traceback, numpy as np, plait
    rank, fifo = int(os.environ["PLAIT_RANK"]), sys.argv[1]
    if rank == 1:
        fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        atexit.register(lambda: (os.set_blocking(fd, True), os.read(fd, 1)))
    else:
        held = os.open(fifo, os.O_WRONLY)  # until this rank exits
    print("hello from", rank)
    with plait.init(timeout=30) as comm:
        comm.allreduce(np.ones(4))
        if rank == 1:
            raise ValueError("bad value on rank 1")
        try:
            comm.allreduce(np.ones(4))
        except plait.PeerLostError as exc:
            if rank == 0:
                raise RuntimeError("training stopped") from exc
            traceback.print_exc()
            sys.exit(5)
"""


@pytest.mark.multiprocess
def test_the_rank_whose_exception_started_it_is_named(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "peers")
    res = plait_run(["-n", "3"], CASCADE, tmp_path)
    assert res.returncode == 1, res.stderr
    assert "plait run: rank 1 exited with code 1 (ValueError)" in res.stderr
    assert status_lines(res.stderr) == [
        "plait run:   rank 0: exit 1 (RuntimeError)",
        "plait run:   rank 1: exit 1 (ValueError)   <- started the failure",
        "plait run:   rank 2: exit 5 (PeerLostError)",
    ]
    assert res.stderr.endswith("plait run: rank 1 failed with ValueError: bad value on rank 1\n")
    assert_every_line_has_an_owner(res.stderr)
    assert "[1]: Traceback (most recent call last):" in res.stderr
    assert "[0]: The above exception was the direct cause of the following exception:" in (
        res.stderr
    )
    # Untagged stdout stays as the ranks printed it.
    assert sorted(res.stdout.splitlines()) == [f"hello from {r}" for r in range(3)]


@pytest.mark.multiprocess
def test_ranks_stopped_by_the_launcher_are_said_so(tmp_path: Path) -> None:
    body = """
        import os, threading
        if os.environ["PLAIT_RANK"] == "1":
            raise ValueError("no")
        threading.Event().wait()  # hangs: only the launcher can end it
    """
    res = plait_run(["-n", "3"], body, tmp_path)
    assert res.returncode == 1, res.stderr
    assert "plait run: rank 1 exited with code 1 (ValueError); stopping the other ranks" in (
        res.stderr
    )
    assert status_lines(res.stderr) == [
        "plait run:   rank 0: killed by SIGTERM (stopped by plait run)",
        "plait run:   rank 1: exit 1 (ValueError)   <- started the failure",
        "plait run:   rank 2: killed by SIGTERM (stopped by plait run)",
    ]
    assert "[1]: ValueError: no" in res.stderr
    assert_every_line_has_an_owner(res.stderr)


@pytest.mark.multiprocess
def test_a_rank_that_raised_and_hangs_on_its_way_out_is_named(tmp_path: Path) -> None:
    body = """
        import threading, numpy as np, plait
        with plait.init(timeout=30) as comm:
            comm.allreduce(np.ones(4))
            if comm.rank == 1:
                threading.Thread(target=threading.Event().wait).start()  # Python waits for it
                raise ValueError("stuck after this")
            comm.allreduce(np.ones(4))
    """
    res = plait_run(["-n", "3"], body, tmp_path)
    assert res.returncode == 1, res.stderr
    assert "plait run: rank 1 raised ValueError but has not exited; stopping the other" in (
        res.stderr
    )
    assert status_lines(res.stderr) == [
        "plait run:   rank 0: exit 1 (PeerLostError)",
        "plait run:   rank 1: killed by SIGTERM (stopped by plait run, after ValueError)"
        "   <- started the failure",
        "plait run:   rank 2: exit 1 (PeerLostError)",
    ]


@pytest.mark.multiprocess
def test_a_rank_that_logged_an_exception_and_went_on_is_not_named(tmp_path: Path) -> None:
    """A traceback a rank printed for an exception it handled, shortly before another rank
    exited with code 2, was read as a rank that raised and hung: the job exited 1 blaming
    it. A rank that writes after its traceback went on; the rank that exited is named."""
    body = """
        import os, sys, time, traceback
        if os.environ["PLAIT_RANK"] == "0":
            try:
                int("not a number")
            except ValueError:
                traceback.print_exc()  # logged, and the rank goes on
            time.sleep(0.2)  # some work
            print("rank 0 goes on", flush=True)
            time.sleep(60)
        time.sleep(0.5)
        sys.exit(2)
    """
    res = plait_run(["-n", "2"], body, tmp_path)
    assert res.returncode == 2, res.stderr
    assert status_lines(res.stderr) == [
        "plait run:   rank 0: killed by SIGTERM (stopped by plait run, after ValueError)",
        "plait run:   rank 1: exit 2   <- started the failure",
    ]


# How a rank's stderr is read (Note [which rank started a failure] in plait.launch.watch).


def read(text: str) -> Traceback:
    """A parser fed ``text``, a line per second."""
    tb = Traceback()
    for i, line in enumerate(text.splitlines(keepends=True)):
        tb.feed(line.encode(), float(i))
    return tb


def test_a_chain_starts_with_its_first_exception() -> None:
    tb = read(
        textwrap.dedent("""\
        some output
        Traceback (most recent call last):
          File "x.py", line 3, in <module>
            comm.allreduce(x)
            ^^^^^^^^^^^^^^^^^
        plait.errors.PeerLostError: rank 0: allreduce: rank 2 has closed its transport

        The above exception was the direct cause of the following exception:

        Traceback (most recent call last):
          File "x.py", line 5, in <module>
        RuntimeError: training stopped
        with a second line
    """)
    )
    assert (tb.seen, tb.first, tb.last, tb.started) == (
        True,
        "plait.errors.PeerLostError",
        "RuntimeError",
        1.0,
    )
    assert tb.last_line == "RuntimeError: training stopped"


def test_a_later_traceback_that_is_not_chained_starts_anew() -> None:
    tb = read(
        textwrap.dedent("""\
        Traceback (most recent call last):
          File "x.py", line 3, in <module>
        KeyError: 'a'
        handled; going on
        Traceback (most recent call last):
          File "x.py", line 9, in <module>
          [Previous line repeated 2 more times]
        __main__ stray line from another thread
        ValueError
    """)
    )
    assert (tb.first, tb.last, tb.started) == ("ValueError", "ValueError", 4.0)


def test_plaits_own_line_within_a_traceback_is_not_its_exception() -> None:
    # A signal's dump says where it wrote between the frames and the exception line.
    tb = read(
        textwrap.dedent("""\
        Traceback (most recent call last):
          File "x.py", line 3, in <module>
        plait: flight recorder dumped to /dumps/job/rank0.json
        plait.errors.AbortedError: rank 0: barrier: the communicator was aborted by rank 1
    """)
    )
    assert (tb.first, tb.last) == ("plait.errors.AbortedError", "plait.errors.AbortedError")


def test_an_exception_group_is_named_by_the_group() -> None:
    tb = read(
        "  + Exception Group Traceback (most recent call last):\n"
        '  |   File "x.py", line 1, in <module>\n'
        "  | ExceptionGroup: two (2 sub-exceptions)\n"
        "  +-+---------------- 1 ----------------\n"
        "    | ValueError: a\n"
        "    +------------------------------------\n"
    )
    assert (tb.seen, tb.first, tb.last) == (True, "ExceptionGroup", "ExceptionGroup")


def test_output_without_a_traceback_leaves_it_unset() -> None:
    tb = read(
        textwrap.dedent("""\
        ValueError: printed, not raised
        During handling of the above exception, another exception occurred:
    """)
    )
    assert (tb.seen, tb.first) == (False, None)
    assert tb.skim(b"Traceback is a word\nno\n")
    assert not tb.skim(b"Traceback (most recent call last):\n")


#: Rank 1 is killed; with --enable-recovery the others shrink and finish. ``BAD`` in the
#: environment makes rank 2 raise afterwards instead.
RECOVERING = """
    import os, signal, sys, numpy as np, plait
    rank = int(os.environ["PLAIT_RANK"])
    comm = plait.init(timeout=30)
    comm.allreduce(np.ones(4))
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        comm.allreduce(np.ones(4))
    except plait.CommError:
        comm.abort("lost rank 1")
        comm = comm.shrink()
    total = comm.allreduce(np.ones(4))
    print(f"rank {rank} of {comm.size}: {total[0]:.0f}", flush=True)
    if rank == 2 and os.environ.get("BAD"):
        raise ValueError("a survivor fails")
    comm.close()
"""


@pytest.mark.multiprocess
def test_enable_recovery_lets_the_others_go_on(tmp_path: Path) -> None:
    res = plait_run(["-n", "3", "--enable-recovery"], RECOVERING, tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "rank 1 was killed by SIGKILL; the others go on (--enable-recovery)" in res.stderr
    assert sorted(res.stdout.split("\n")[:2]) == ["rank 0 of 2: 2", "rank 2 of 2: 2"], res.stdout


@pytest.mark.multiprocess
def test_enable_recovery_still_fails_on_a_survivors_exception(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(RECOVERING))
    res = subprocess.run(
        [*PLAIT, "run", "-n", "3", "--enable-recovery", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "BAD": "1"},
    )
    assert res.returncode == 1, res.stdout + res.stderr
    assert "ValueError: a survivor fails" in res.stderr


@pytest.mark.multiprocess
def test_enable_recovery_names_the_rank_lost_where_the_others_do_not_recover(
    tmp_path: Path,
) -> None:
    """The survivors raise the PeerLostError that names rank 1: the launcher marked the first
    of them "<- started the failure", and rank 1, killed by SIGKILL, not at all."""
    body = """
        import os, signal, numpy as np, plait
        comm = plait.init(timeout=30)
        comm.allreduce(np.ones(4))
        if comm.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        comm.allreduce(np.ones(4))
    """
    res = plait_run(["-n", "3", "--enable-recovery"], body, tmp_path)
    assert res.returncode == 1, res.stderr
    lines = status_lines(res.stderr)
    assert "plait run:   rank 1: killed by SIGKILL   <- started the failure" in lines, lines
    assert sum("started the failure" in line for line in lines) == 1, lines
    assert "plait run: rank 1 was killed by SIGKILL (the others failed of its loss)" in res.stderr


def test_enable_recovery_and_restarts_exclude_each_other(tmp_path: Path) -> None:
    res = plait_run(["-n", "2", "--enable-recovery", "--max-restarts", "1"], "pass\n", tmp_path)
    assert res.returncode == 2
    assert "--enable-recovery and --max-restarts exclude each other" in res.stderr


#: Rank 1 is killed before it has told the others anything in plait.init (``WHERE``: at its
#: start, in the shared-memory rendezvous, or as its first TCP connection arrives); the others
#: wait in plait.init with a deadline longer than the test may run.
DIES_IN_INIT = """
    import os, signal, sys, time, plait
    rank, where = int(os.environ["PLAIT_RANK"]), os.environ["WHERE"]
    if os.environ.get("PLAIT_TRANSPORT") == "hybrid":  # two emulated hosts
        os.environ["PLAIT_HOST"] = "ab"[rank % 2]
    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 1:
        if where == "start":
            die()
        elif where == "shm":
            from plait.transport.shm import bootstrap
            bootstrap._Join.meet = die
        else:
            from plait.transport.tcp import bootstrap
            bootstrap._Listener.accept = die
    try:
        comm = plait.init(timeout=300)
    except plait.PeerLostError as exc:
        print(f"rank {rank}: lost {exc.lost_rank} in init: {exc}", flush=True)
    else:  # (over TCP, rank 0 may have connected to rank 1 already)
        try:
            comm.barrier()
        except plait.PeerLostError as exc:
            print(f"rank {rank}: lost {exc.lost_rank} in a call: {exc}", flush=True)
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("transport", "where"),
    [("shm", "start"), ("shm", "shm"), ("tcp", "start"), ("tcp", "tcp"), ("hybrid", "tcp")],
)
def test_a_rank_killed_in_init_fails_the_others_at_once_with_recovery(
    tmp_path: Path, transport: str, where: str
) -> None:
    # Before, the others waited out init's deadline (300 s): nothing tells a key that never
    # appears from one that is late. The launcher files the rank it saw die in the store.
    n = 4 if transport == "hybrid" else 3  # hybrid: rank 3 waits for rank 1's host window
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(DIES_IN_INIT))
    res = subprocess.run(
        [*PLAIT, "run", "-n", str(n), "--enable-recovery", "--transport", transport, str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "WHERE": where},
    )
    assert res.returncode == 0, res.stdout + res.stderr
    lines = sorted(line for line in res.stdout.splitlines() if ": lost " in line)
    survivors = [f"rank {r}: lost 1" for r in range(n) if r != 1]
    assert [line[:14] for line in lines] == survivors, res.stdout
    in_init = [line for line in lines if " in init: " in line]
    assert in_init, res.stdout
    for line in in_init:
        assert "rank(s) [1] died before they could" in line, line
        assert "rank 1 was killed by SIGKILL, as plait run saw" in line, line


def test_a_rank_that_returned_early_is_named_not_the_one_that_lost_it(tmp_path: Path) -> None:
    """Rank 1 leaves with exit 0 after 3 calls; the others lose it in the 4th. The status
    marked rank 0's PeerLostError "<- started the failure" and rank 1 "exit 0"."""
    body = """
        import sys, numpy as np, plait
        comm = plait.init(timeout=30)
        for i in range(6):
            if comm.rank == 1 and i == 3:
                sys.exit(0)
            comm.allreduce(np.ones(16, np.float32))
    """
    res = plait_run(["-n", "3"], body, tmp_path)
    lines = status_lines(res.stderr)
    assert res.returncode == 1, res.stderr
    assert "plait run:   rank 1: exit 0   <- exited while the others still needed it" in lines
    assert not any("started the failure" in line for line in lines), lines


def test_a_syntax_error_and_an_exception_named_past_ascii_are_read() -> None:
    """A SyntaxError's report has no "Traceback" line, and a name such as Ошибка did not
    match: the summary said only "exit 1", and the report's lines had no rank prefix."""
    syntax = read('  File "/tmp/job.py", line 1\n    x = (\n        ^\nSyntaxError: never closed\n')
    assert (syntax.seen, syntax.first, syntax.last) == (True, "SyntaxError", "SyntaxError")
    named = read(
        'Traceback (most recent call last):\n  File "x.py", line 3, in <module>\n'
        "__main__.Ошибка: нет\n"
    )
    assert (named.first, named.last_line) == ("__main__.Ошибка", "__main__.Ошибка: нет")
    frame = read('  File "x.py", line 3, in <module>\n')  # a frame alone starts nothing
    assert not frame.seen


@pytest.mark.multiprocess
def test_a_rank_whose_script_does_not_compile_is_named_with_its_error(tmp_path: Path) -> None:
    res = plait_run(["-n", "2"], "x = (\n", tmp_path)
    assert res.returncode == 1, res.stderr
    # Both ranks fail alike; either may be first.
    said = r"plait run: rank [01] failed with SyntaxError: '\(' was never closed"
    assert re.search(said, res.stderr), res.stderr
    assert_every_line_has_an_owner(res.stderr)


#: Rank 1 is killed; the others shrink to a communicator of job ranks 0 and 2, where job rank 2
#: is rank 1, and then job rank 2 hangs outside plait: rank 0 times out waiting for "rank(s)
#: [1] (job rank(s) [2])".
HANGS_AFTER_A_SHRINK = """
    import os, signal, time, numpy as np, plait
    comm = plait.init()
    me = comm.rank
    comm.allreduce(np.ones(4))
    if me == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        comm.allreduce(np.ones(4))
    except plait.CommError:
        comm.abort("lost a rank")
        comm = comm.shrink()
    comm.allreduce(np.ones(4))
    if me == 2:
        time.sleep(1000)
    comm.allreduce(np.ones(4))
"""


@pytest.mark.multiprocess
def test_a_hang_after_a_shrink_is_not_blamed_on_the_rank_lost_before(tmp_path: Path) -> None:
    """The timeout's "rank(s) [1]" is the shrunk communicator's rank 1, job rank 2: the
    launcher said "rank 1 was killed by SIGKILL (the others failed of its loss)" and marked
    rank 1, which the others had recovered from, "<- started the failure"."""
    res = plait_run(
        ["-n", "3", "--enable-recovery", "--timeout", "3"], HANGS_AFTER_A_SHRINK, tmp_path
    )
    assert res.returncode == 1, res.stderr
    assert "(job rank(s) [2])" in res.stderr, res.stderr
    assert "the others failed of its loss" not in res.stderr
    lines = status_lines(res.stderr)
    assert "plait run:   rank 0: exit 1 (CollectiveTimeout)   <- started the failure" in lines
    assert "plait run:   rank 1: killed by SIGKILL" in lines, lines


def test_an_error_names_ranks_by_their_rank_in_the_job(tmp_path: Path) -> None:
    """Only the ranks an error names, by their rank in the job: not the rank that raised it,
    and not a shrunk communicator's numbers taken for the job's."""
    error = "plait.errors.PeerLostError: rank 1: allreduce (ring, call #3): "
    assert named_ranks(error + "rank 2 was lost (rank 0 found so in its step)") == {0, 2}
    timeout = "plait.errors.CollectiveTimeout: rank 0: allreduce (ring, call #3) timed out "
    said = timeout + "waiting for rank(s) [2] (job rank(s) [3]) of communicator 1337c: ..."
    assert named_ranks(said) == {3}
    assert named_ranks(error + "rank 1 (job rank 3) was lost") == {3}
    # A communicator other than the world, by its dump's name: mapped by its members.
    dump = tmp_path / "comm1337c.rank1.json"
    dump.write_text(json.dumps({"members": [0, 1, 3], "global_rank": 1}))
    lost = error + "rank 2 was lost: its process exited or was killed"
    assert named_ranks(f"{lost}; flight recorder dump: {dump}") == {3}
    assert named_ranks(f"{lost}; flight recorder dump: {tmp_path / 'commab.rank1.json'}") == set()
    assert named_ranks(f"{lost}; flight recorder dump: {tmp_path / 'rank1.json'}") == {2}


#: Rank 2 calls broadcast where the others call allreduce: ranks 0 and 2, at least, raise
#: MismatchError at once; rank 1 raises ValueError two seconds later.
MISMATCH_THEN_AN_ERROR = """
    import time, numpy as np, plait
    comm = plait.init(timeout=30)
    x = np.ones(16, np.float32)
    comm.allreduce(x)
    if comm.rank == 1:
        time.sleep(2)
        raise ValueError("bad batch")
    if comm.rank == 2:
        comm.broadcast(x, root=0)
    else:
        comm.allreduce(x)
"""


@pytest.mark.multiprocess
def test_a_mismatch_is_a_cause_not_a_symptom(tmp_path: Path) -> None:
    """The launcher took every CommError for a symptom, MismatchError too, and named rank 1's
    ValueError, raised seconds after the mismatch, as the failure's start."""
    res = plait_run(["-n", "3"], MISMATCH_THEN_AN_ERROR, tmp_path)
    assert res.returncode == 1, res.stderr
    lines = status_lines(res.stderr)
    (started,) = [line for line in lines if "started the failure" in line]
    assert "(MismatchError)" in started, lines
    assert "ValueError" not in started, lines


@pytest.mark.multiprocess
def test_a_failed_job_leaves_its_note_when_no_rank_is_left_to_stop(tmp_path: Path) -> None:
    """The note of how the failed ranks ended was written only where some rank still ran, and
    ``plait analyze`` then knew nothing of how the others had ended."""
    script = tmp_path / "job.py"
    script.write_text("import sys\nsys.exit(3)\n")
    env = {**os.environ, "PLAIT_DUMP_DIR": str(tmp_path / "dumps"), "PLAIT_JOB_ID": "j"}
    res = subprocess.run(
        [*PLAIT, "run", "-n", "2", str(script)], capture_output=True, text=True, timeout=60, env=env
    )
    assert res.returncode == 3, res.stderr
    note = json.loads((tmp_path / "dumps" / "j" / "launcher.json").read_text())
    assert set(note["ended"].values()) == {"exited with code 3"}, note
