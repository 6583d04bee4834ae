"""A bare ``plait.init()`` under Open MPI's mpirun (4.x and 5.x), with no plait launcher.

Needs ``mpirun`` from Open MPI on PATH (Debian: ``apt-get install -y openmpi-bin``);
skipped otherwise. Only the launcher is used: the ranks never call MPI_Init.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from launch_helpers import (
    RANK_SCRIPT,
    clean_env,
    free_port_pair,
    job_dirs,
    plait_leftovers,
    read_results,
    run_job,
    shm_left,
)

from plait.rendezvous.tcp_store import TCPStoreServer

MPIRUN = shutil.which("mpirun")


def _open_mpi_version() -> str | None:
    if MPIRUN is None:
        return None
    try:
        res = subprocess.run([MPIRUN, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = res.stdout + res.stderr
    if "Open MPI" not in text and "OpenRTE" not in text:
        return None
    return text.splitlines()[0]


VERSION = _open_mpi_version()
pytestmark = pytest.mark.skipif(
    VERSION is None,
    reason="Open MPI's mpirun is not installed (Debian: apt-get install -y openmpi-bin)",
)


def mpirun_env(tmp: Path, out: Path, **extra: str) -> dict[str, str]:
    env = clean_env(TMPDIR=str(tmp), PLAIT_TEST_OUT=str(out), **extra)
    if shutil.which("ssh") is None and shutil.which("rsh") is None:
        # Open MPI refuses to start, even on one host, without a remote shell
        # to launch daemons with; none is needed here.
        env["OMPI_MCA_plm_rsh_agent"] = "false"
        env["PRTE_MCA_plm_ssh_agent"] = "false"
    return env


def mpirun(n: int, mode: str, env: dict[str, str]):
    cmd = [
        MPIRUN,
        "--allow-run-as-root",  # CI containers run as root; harmless otherwise
        "--oversubscribe",  # more ranks than cores
        "--bind-to",
        "none",  # oversubscribed ranks pinned to one core would starve each other
        "-np",
        str(n),
        sys.executable,
        str(RANK_SCRIPT),
        mode,
    ]
    return run_job(cmd, env)


def check_reports(reports: list[dict], n: int) -> None:
    assert [r["rank"] for r in reports] == list(range(n))
    for r in reports:
        assert r["launcher"] == "mpirun"
        assert r["size"] == n
        assert r["env_local_rank"] == r["rank"]
        assert r["env_local_size"] == n
    jobs = {r["job_id"] for r in reports}
    assert len(jobs) == 1, jobs
    assert None not in jobs
    # PMIX_NAMESPACE in Open MPI 4 and 5 (a number in 4, prterun-<host>-<pid>@1 in 5)
    namespace = reports[0]["pmix_namespace"]
    if namespace:
        assert jobs == {namespace}


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_bare_init(transport: str) -> None:
    with job_dirs() as (tmp, out):
        env = mpirun_env(tmp, out, PLAIT_TRANSPORT=transport)
        res = mpirun(4, "check", env)
        assert res.returncode == 0, res.describe()
        reports = read_results(out)
        check_reports(reports, 4)
        for r in reports:
            assert r["transport"] == ("ShmTransport" if transport == "auto" else "TcpTransport")
            assert r["store_is_temp"]
            assert not r["store_is_server"]
            assert r["store_url"].startswith(f"file://{tmp}/plait-{os.getuid()}-"), r
            assert (r["local_rank"], r["local_size"]) == (r["rank"], 4)
            assert (r["cross_rank"], r["cross_size"]) == (0, 1)
            assert r["sub_sum"] == 0 + 1 + 2 + 3
        assert len({r["store_url"] for r in reports}) == 1
        assert plait_leftovers(tmp) == [], "the file store's directory was not removed"
        assert shm_left(out) == set()
    assert res.seconds < 30, res.seconds


def test_emulated_hosts_split_by_host() -> None:
    with job_dirs() as (tmp, out):
        res = mpirun(4, "check", mpirun_env(tmp, out, PLAIT_TEST_HOSTS="2"))
        assert res.returncode == 0, res.describe()
        reports = read_results(out)
        check_reports(reports, 4)
        for r in reports:
            assert r["host"] == f"host{r['rank'] // 2}"
            # Two hosts of two ranks: shared memory within each, TCP across.
            assert r["transport"] == "HybridTransport"
            assert (r["local_rank"], r["local_size"]) == (r["rank"] % 2, 2)
            assert (r["cross_rank"], r["cross_size"]) == (r["rank"] // 2, 2)
            assert r["sub_sum"] == (1 if r["rank"] < 2 else 5)
        assert plait_leftovers(tmp) == []


def test_two_inits_in_one_job() -> None:
    with job_dirs() as (tmp, out):
        res = mpirun(3, "twice", mpirun_env(tmp, out))
        assert res.returncode == 0, res.describe()
        reports = read_results(out)
        check_reports(reports, 3)
        assert all(r["first"]["sub_sum"] == 3 for r in reports)
        assert plait_leftovers(tmp) == []


def test_agree_says_why_the_file_store_gives_no_recovery() -> None:
    """It said the communicator was "made without a store (from a transport object, or
    with PLAIT_RECOVERY=0)": neither was so, and what to set was not said."""
    with job_dirs() as (tmp, out):
        res = mpirun(2, "agree", mpirun_env(tmp, out))
        assert res.returncode == 0, res.describe()
        for r in read_results(out):
            assert r["store_is_temp"], r
            assert "a file store in the temp dir" in r["agree"], r
            assert "set PLAIT_STORE or MASTER_ADDR for agree and shrink" in r["agree"], r


def test_master_addr_store() -> None:
    port = free_port_pair()
    with job_dirs() as (tmp, out):
        env = mpirun_env(tmp, out, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        res = mpirun(4, "check", env)
        assert res.returncode == 0, res.describe()
        reports = read_results(out)
        check_reports(reports, 4)
        for r in reports:
            assert r["store_url"] == f"tcp://127.0.0.1:{port + 1}"
            assert r["store_is_server"] == (r["rank"] == 0)
            assert not r["store_is_temp"]
        assert plait_leftovers(tmp) == []


@pytest.mark.parametrize("scheme", ["tcp", "file"])
def test_plait_store(scheme: str, tmp_path: Path) -> None:
    with job_dirs() as (tmp, out), TCPStoreServer("127.0.0.1", 0) as server:
        url = f"tcp://{server.address}" if scheme == "tcp" else f"file://{tmp_path}/store"
        # PLAIT_STORE wins over MASTER_ADDR (whose port nobody serves here).
        env = mpirun_env(tmp, out, PLAIT_STORE=url, MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
        res = mpirun(3, "check", env)
        assert res.returncode == 0, res.describe()
        reports = read_results(out)
        check_reports(reports, 3)
        for r in reports:
            assert r["store_url"] == url
            assert not r["store_is_server"]
            assert not r["store_is_temp"]
        assert plait_leftovers(tmp) == []
    if scheme == "file":  # a directory the user named is the user's: left in place
        assert (tmp_path / "store").is_dir()


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_failed_rank_ends_the_job_fast(transport: str) -> None:
    with job_dirs() as (tmp, out):
        # With a 60 s timeout, only prompt failure detection ends the job in seconds.
        env = mpirun_env(tmp, out, PLAIT_TRANSPORT=transport, PLAIT_TIMEOUT="60")
        res = mpirun(3, "fail", env)
        # Rank 1 exits with 7; mpirun ends the job with the first failure's
        # code. The others saw the peer go (PeerLostError, exit 5), unless
        # mpirun killed them first; either way nothing waits for a timeout.
        assert res.returncode in (5, 7), res.describe()
        assert "lost:" in res.stdout or "Exit code:" in res.stderr, res.describe()
        assert plait_leftovers(tmp) == []
        assert shm_left(out) == set()
    assert res.seconds < 30, res.describe()
