"""``plait run`` and signals: a rank's own processes are stopped with it (a wrapper script's
Python too), SIGHUP stops the job as SIGTERM does, and SIGUSR1 to the launcher makes the
ranks dump (Note [a rank's processes] in plait.launch.job)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(90)

PLAIT = [sys.executable, "-m", "plait"]


def _gone(pid: int) -> bool:
    """Whether process ``pid`` no longer runs (gone, or a zombie no one reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] in "ZX"


def _pids(folder: Path, n: int, seconds: float = 30) -> list[int]:
    """The pids the ranks' Python wrote into ``folder`` (rank r: ``pid<r>``), once all did."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        files = [folder / f"pid{r}" for r in range(n)]
        if all(f.exists() and f.read_text().strip() for f in files):
            return [int(f.read_text()) for f in files]
        time.sleep(0.05)
    raise AssertionError(f"the ranks never wrote their pids into {folder}")


def _until_gone(pids: list[int], seconds: float = 10) -> list[int]:
    """``pids`` still running after up to ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not all(_gone(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if not _gone(p)]


#: A rank that writes its pid (rank 0 fails once every rank has, with "fail") and sleeps.
RANK = """
    import os, sys, time
    rank, folder = int(os.environ["PLAIT_RANK"]), sys.argv[1]
    with open(os.path.join(folder, f"pid{rank}.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.replace(os.path.join(folder, f"pid{rank}.tmp"), os.path.join(folder, f"pid{rank}"))
    if rank == 0 and sys.argv[2] == "fail":
        while not all(os.path.exists(os.path.join(folder, f"pid{r}")) for r in range(3)):
            time.sleep(0.05)
        sys.exit(3)
    time.sleep(120)
"""


def test_a_wrapper_scripts_python_is_stopped_with_its_rank(tmp_path: Path) -> None:
    """``plait run -- ./train.sh``: the launcher signalled the shell alone, and the Python it
    ran went on after the job had ended."""
    (tmp_path / "rank.py").write_text(textwrap.dedent(RANK))
    wrapper = tmp_path / "train.sh"
    wrapper.write_text(f'#!/bin/sh\n"{sys.executable}" "{tmp_path / "rank.py"}" "$@"\nexit $?\n')
    wrapper.chmod(0o755)
    res = subprocess.run(
        [*PLAIT, "run", "-n", "3", "--", str(wrapper), str(tmp_path), "fail"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 3, res.stderr
    assert _until_gone(_pids(tmp_path, 3)) == [], res.stderr


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM])
def test_sighup_stops_the_job_as_sigterm_does(tmp_path: Path, sig: int) -> None:
    """A closed terminal or ssh session (SIGHUP) ended the launcher alone."""
    (tmp_path / "rank.py").write_text(textwrap.dedent(RANK))
    launcher = subprocess.Popen(
        [*PLAIT, "run", "-n", "3", str(tmp_path / "rank.py"), str(tmp_path), "wait"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        pids = _pids(tmp_path, 3)
        launcher.send_signal(sig)
        _, err = launcher.communicate(timeout=30)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 128 + sig, err
    assert _until_gone(pids) == [], err


DUMPS = """
    import os, sys, time, plait
    comm = plait.init(timeout=60)
    with open(os.path.join(sys.argv[1], f"pid{comm.rank}"), "w") as f:
        f.write(str(os.getpid()))
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(sys.argv[1], "dumps", "sigjob", f"rank{comm.rank}.json")):
        if time.monotonic() > deadline:
            sys.exit(5)
        time.sleep(0.05)
    comm.barrier()
"""


def test_sigusr1_to_the_launcher_makes_every_rank_dump(tmp_path: Path) -> None:
    """mpirun passes SIGUSR1 on; plait run's default action for it was to die, leaving the
    ranks running."""
    (tmp_path / "rank.py").write_text(textwrap.dedent(DUMPS))
    env = {**os.environ, "PLAIT_DUMP_DIR": str(tmp_path / "dumps"), "PLAIT_JOB_ID": "sigjob"}
    launcher = subprocess.Popen(
        [*PLAIT, "run", "-n", "2", str(tmp_path / "rank.py"), str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        _pids(tmp_path, 2)  # written after plait.init, which installs the handler
        launcher.send_signal(signal.SIGUSR1)
        _, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, err
    for r in range(2):
        assert (tmp_path / "dumps" / "sigjob" / f"rank{r}.json").exists()


AWAITS = """
    import os, sys, time, plait
    comm = plait.init(timeout=120)
    with open(os.path.join(sys.argv[1], f"pid{comm.rank}"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)
"""


@pytest.mark.parametrize("wrapped", [False, True])
def test_ranks_die_with_a_launcher_killed_by_sigkill(tmp_path: Path, wrapped: bool) -> None:
    """A launcher killed with SIGKILL cannot stop its ranks: they ran on, orphaned, until
    their timeout (300 s by default) or for ever. The kernel's parent-death signal covers a
    rank whose parent is the launcher; a rank's Python started by a wrapper script (its
    parent the script, ``wrapped``) ran on even after that."""
    (tmp_path / "rank.py").write_text(textwrap.dedent(AWAITS))
    command = [str(tmp_path / "rank.py")]
    if wrapped:
        wrapper = tmp_path / "wrapper.sh"
        wrapper.write_text(f'#!/bin/sh\n"{sys.executable}" "{tmp_path / "rank.py"}" "$1"\n')
        wrapper.chmod(0o755)
        command = [str(wrapper)]
    launcher = subprocess.Popen(
        [*PLAIT, "run", "-n", "2", *command, str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    pids: list[int] = []
    try:
        pids = _pids(tmp_path, 2)  # written after plait.init, which asks for it
        launcher.kill()
        launcher.wait(30)
        assert _until_gone(pids) == []
    finally:
        for pid in pids:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)


WORKERS = """
    import os, subprocess, sys, time
    rank, folder = int(os.environ["PLAIT_RANK"]), sys.argv[1]
    child = subprocess.Popen(["sleep", "120"])  # a worker of the rank's own
    with open(os.path.join(folder, f"pid{rank}.tmp"), "w") as f:
        f.write(str(child.pid))
    os.replace(os.path.join(folder, f"pid{rank}.tmp"), os.path.join(folder, f"pid{rank}"))
    if rank == 0:
        while not os.path.exists(os.path.join(folder, "pid1")):
            time.sleep(0.05)
        os._exit(3)  # its worker left behind
    time.sleep(120)
"""


def test_the_workers_of_a_rank_that_exited_are_stopped_too(tmp_path: Path) -> None:
    """Only groups whose first process still ran were signalled: rank 0's worker lived on."""
    (tmp_path / "rank.py").write_text(textwrap.dedent(WORKERS))
    res = subprocess.run(
        [*PLAIT, "run", "-n", "2", str(tmp_path / "rank.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 3, res.stderr
    assert _until_gone(_pids(tmp_path, 2)) == [], res.stderr


@contextlib.contextmanager
def _at_a_terminal(line: str) -> Iterator[bytes]:
    """Run the shell ``line`` at a terminal whose session a shell leads (as at a prompt),
    which outlives it; yield what the terminal showed up to ``line``'s exit status
    (``exit=N``), and end the session after the block."""
    import pty

    pid, fd = pty.fork()
    if pid == 0:  # the child: a session of its own, the terminal its controlling one
        os.execv("/bin/sh", ["sh", "-c", f"{line}; echo exit=$?; exec sleep 60"])
    out = b""
    try:
        deadline = time.monotonic() + 60
        while b"exit=" not in out and time.monotonic() < deadline:
            try:
                out += os.read(fd, 4096)
            except OSError:  # the session ended
                break
        yield out
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(fd)


def test_the_workers_of_the_rank_at_the_terminal_are_stopped_too(tmp_path: Path) -> None:
    """At a terminal the first rank shares the launcher's process group (so that it may
    read the terminal), and stopping it signalled its process alone: its worker, left
    behind when it exited, ran on after the job (until the terminal's session ended)."""
    import shlex

    (tmp_path / "rank.py").write_text(textwrap.dedent(WORKERS))
    run = shlex.join([*PLAIT, "run", "-n", "2", str(tmp_path / "rank.py"), str(tmp_path)])
    pids: list[int] = []
    try:
        with _at_a_terminal(run) as out:
            assert b"exit=3" in out, out
            pids = _pids(tmp_path, 2)
            assert _until_gone(pids) == [], out
    finally:
        for worker in pids:
            if not _gone(worker):
                os.kill(worker, signal.SIGKILL)


def test_the_other_commands_of_a_pipeline_at_the_terminal_are_left_alone(tmp_path: Path) -> None:
    """Looking for the first rank's processes, the launcher took every newcomer of its
    process group for one: a command the other side of a pipe ran during the job was
    killed, though the job succeeded."""
    import shlex

    job = tmp_path / "ok.py"
    job.write_text("import time\ntime.sleep(2)\nprint('done')\n")  # the pipe's sleep 4 meanwhile
    mark = tmp_path / "survived"
    run = shlex.join([*PLAIT, "run", "-n", "2", str(job)])
    with _at_a_terminal(
        f"{run} | {{ sleep 1; sleep 4 && touch {shlex.quote(str(mark))}; cat; }}"
    ) as out:
        assert b"exit=0" in out, out
        assert mark.exists(), out


def test_a_rank_reads_the_launchers_terminal(tmp_path: Path) -> None:
    """Ranks in process groups of their own were stopped (SIGTTIN) when they read the
    terminal (input(), a debugger): the first rank now stays in the launcher's group."""
    import pty

    script = tmp_path / "ask.py"
    script.write_text(
        "import os, sys\n"
        "line = sys.stdin.readline().strip()\n"
        "print(f'rank {os.environ[\"PLAIT_RANK\"]} got {line!r}', flush=True)\n"
    )
    pid, fd = pty.fork()
    if pid == 0:  # the child: a session of its own, the terminal its controlling one
        os.execv(sys.executable, [*PLAIT, "run", "-n", "2", str(script)])
    out = b""
    try:
        os.write(fd, b"hello\n")
        deadline = time.monotonic() + 30
        while b"rank 0 got" not in out and time.monotonic() < deadline:
            try:
                out += os.read(fd, 4096)
            except OSError:  # the launcher exited: its end of the terminal closed
                break
    finally:
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(pid, os.WNOHANG) == (0, 0):
                os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(fd)
    assert b"rank 0 got 'hello'" in out, out


def test_piped_stdin_goes_to_the_first_rank_alone(tmp_path: Path) -> None:
    """Every rank read a piped stdin, and each got a share of it that depended on which ran
    first; the first rank of the host now reads it all and the others read nothing, as
    at a terminal (and as mpirun gives stdin to rank 0)."""
    script = tmp_path / "read.py"
    script.write_text(  # the others read first: rank 0 waits until they have
        "import os, sys, time\n"
        "rank, folder = int(os.environ['PLAIT_RANK']), sys.argv[1]\n"
        "if rank == 0:\n"
        "    deadline = time.monotonic() + 30\n"
        "    while not all(os.path.exists(os.path.join(folder, f'read{r}')) for r in (1, 2)):\n"
        "        assert time.monotonic() < deadline, 'the others never read'\n"
        "        time.sleep(0.01)\n"
        "data = sys.stdin.read()\n"
        "open(os.path.join(folder, f'read{rank}'), 'w').close()\n"
        "print(f'rank {rank} read {len(data.splitlines())}', flush=True)\n"
    )
    lines = "".join(f"line {i}\n" for i in range(20_000))
    done = subprocess.run(
        [*PLAIT, "run", "-n", "3", str(script), str(tmp_path)],
        input=lines,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "rank 0 read 20000" in done.stdout, done.stdout
    assert "rank 1 read 0" in done.stdout, done.stdout
    assert "rank 2 read 0" in done.stdout, done.stdout


LATE = """
    import os, sys, time, plait
    folder = sys.argv[1]
    while not os.path.exists(os.path.join(folder, "go")):  # the launcher is killed meanwhile
        time.sleep(0.05)
    with open(os.path.join(folder, f"pid{os.environ['PLAIT_RANK']}"), "w") as f:
        f.write(str(os.getpid()))
    plait.init(timeout=120)
"""


def test_ranks_that_reach_init_after_their_launcher_was_killed_stop(tmp_path: Path) -> None:
    """A rank that called plait.init only after its launcher had died (SIGKILL) was no
    longer its child, asked for nothing, and waited out its init timeout for a store that
    was gone (300 s by default): it now stops at once, as if the launcher had died then."""
    (tmp_path / "rank.py").write_text(textwrap.dedent(LATE))
    launcher = subprocess.Popen(
        [*PLAIT, "run", "-n", "2", str(tmp_path / "rank.py"), str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 30
        while len(_children_of(launcher.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        launcher.kill()
        launcher.wait(30)
        (tmp_path / "go").touch()
        pids = _pids(tmp_path, 2)
        assert _until_gone(pids) == []
    finally:
        for pid in pids:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)


def _children_of(pid: int) -> list[int]:
    """The pids whose parent is ``pid``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
                    found.append(int(entry))
    return found
