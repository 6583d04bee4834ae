"""Helpers for the launcher tests: clean environments, free ports, jobs that cannot hang.

Every job runs in a session of its own, so that whatever happens its processes
can be found and killed (:func:`run_job`, :func:`run_ranks`), and with TMPDIR
pointing at a fresh short directory, so that the test can see exactly what the
job left in the temp dir.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ports import free_port_pair  # noqa: F401 - the launcher tests' import of it

HERE = Path(__file__).resolve().parent
RANK_SCRIPT = HERE / "rank_script.py"
#: Seconds a whole job may take before it is killed and the test fails.
JOB_TIMEOUT = 45.0
#: Seconds each rank gives plait for a call or the rendezvous.
RANK_TIMEOUT = "20"

#: Prefixes and names of variables that launchers set: a test's job starts without them.
_LAUNCHER_PREFIXES = ("PLAIT_", "OMPI_", "PMIX_", "PRTE_", "SLURM_", "TORCHELASTIC_", "GROUP_")
_LAUNCHER_NAMES = {
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TMPDIR",
}


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any launcher's variables, plus ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _LAUNCHER_NAMES and not k.startswith(_LAUNCHER_PREFIXES)
    }
    env["PYTHONUNBUFFERED"] = "1"
    env["PLAIT_TIMEOUT"] = RANK_TIMEOUT
    env.update(extra)
    return env


@contextlib.contextmanager
def job_dirs() -> Iterator[tuple[Path, Path]]:
    """(temp dir for the job, directory its ranks write results into); both removed after.

    The temp dir lives directly under /tmp with a short name: Open MPI puts its
    session directory (and Unix socket paths, at most 108 bytes) under TMPDIR.
    """
    tmp = Path(tempfile.mkdtemp(prefix="plt", dir="/tmp" if os.path.isdir("/tmp") else None))
    out = Path(tempfile.mkdtemp(prefix="plait-test-results-"))
    try:
        yield tmp, out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)


def plait_leftovers(tmp: Path) -> list[str]:
    """Entries plait left in the job's temp dir.

    The flight recorder's dumps (``plait-dumps``, written when a call fails: see
    docs/debugging.md) are the job's output, not leftovers.
    """
    return sorted(
        p.name for p in tmp.iterdir() if p.name.startswith("plait") and p.name != "plait-dumps"
    )


def shm_left(out: Path) -> set[str]:
    """This job's files still in /dev/shm, once its ranks have exited.

    Every rank of rank_script.py writes the job tokens of its shared-memory
    segments into ``out`` (``shm-*.txt``); only files of those jobs count, so
    segments of other plait jobs running on this machine are never blamed.
    Segments live only during a rendezvous: after the job none may remain.
    """
    tokens = {
        line for path in out.glob("shm-*.txt") for line in path.read_text().splitlines() if line
    }
    return {path for token in tokens for path in glob.glob(f"/dev/shm/plait-{token}-*")}


@dataclass
class JobResult:
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    def describe(self) -> str:
        out, err = self.stdout[-3000:], self.stderr[-4000:]
        return f"rc={self.returncode}\n--- stdout\n{out}\n--- stderr\n{err}"


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _reap_group(pgid: int, grace: float = 5.0) -> bool:
    """Wait up to ``grace`` s for the group to empty; True if it did (then nothing is killed)."""
    deadline = time.monotonic() + grace
    while _group_alive(pgid):
        if time.monotonic() > deadline:
            _kill_group(pgid)
            return False
        # A poll, not an event: the group's processes are not all our children (the
        # launcher's ranks are its own), so nothing here can wait on them to exit.
        time.sleep(0.02)
    return True


def run_job(
    cmd: Sequence[str],
    env: Mapping[str, str],
    timeout: float = JOB_TIMEOUT,
    cwd: Path | None = None,
) -> JobResult:
    """Run a launcher command in its own session; kill the whole session if it overruns.

    Raises:
        AssertionError: the job overran ``timeout``, or left processes behind.
    """
    start = time.monotonic()
    proc = subprocess.Popen(
        list(cmd),
        env=dict(env),
        cwd=cwd,
        stdin=subprocess.DEVNULL,  # mpirun forwards stdin to rank 0
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        out, err = proc.communicate()
        raise AssertionError(
            f"{cmd[0]} job ran past {timeout} s and was killed\n{out[-3000:]}\n{err[-4000:]}"
        ) from None
    finally:
        if proc.poll() is None:
            _kill_group(proc.pid)
            proc.wait()
    seconds = time.monotonic() - start
    clean = _reap_group(proc.pid)
    assert clean, f"{cmd[0]} job left processes running after it exited (killed them)"
    return JobResult(proc.returncode, out, err, seconds)


def run_ranks(
    envs: Sequence[Mapping[str, str]],
    args: Sequence[str],
    timeout: float = JOB_TIMEOUT,
) -> list[JobResult]:
    """Start one ``python rank_script.py *args`` per environment, as a launcher would.

    All ranks share one new process group, killed as a whole if any rank overruns.

    Raises:
        AssertionError: the ranks overran ``timeout``, or left processes behind.
    """
    start = time.monotonic()
    procs: list[subprocess.Popen[str]] = []
    pgid = 0
    try:
        for env in envs:
            p = subprocess.Popen(
                [sys.executable, str(RANK_SCRIPT), *args],
                env=dict(env),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                process_group=pgid,  # 0 for the first: a new group, led by it
            )
            if not procs:
                pgid = p.pid
            procs.append(p)
        results = []
        for p in procs:
            left = max(timeout - (time.monotonic() - start), 0.1)
            try:
                out, err = p.communicate(timeout=left)
            except subprocess.TimeoutExpired:
                raise AssertionError(
                    f"rank processes ran past {timeout} s and were killed"
                ) from None
            results.append(JobResult(p.returncode, out, err, time.monotonic() - start))
        clean = _reap_group(pgid)
        assert clean, "rank processes left children running after they exited (killed them)"
        return results
    finally:
        if pgid:
            _kill_group(pgid)
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            for stream in (p.stdout, p.stderr):
                if stream is not None:
                    stream.close()


def read_results(out: Path) -> list[dict]:
    """The JSON reports the ranks wrote into ``out``, in rank order."""
    reports = [json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json"))]
    return sorted(reports, key=lambda r: r["rank"])
