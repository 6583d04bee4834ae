"""A bare ``plait.init()`` in the environment Slurm's srun gives its tasks (no Slurm needed).

Without MASTER_ADDR the ranks of one host meet through a file store in the
temp dir, named after the job and step ids, which the last rank to be done
with it deletes; with MASTER_ADDR, through rank 0's store on MASTER_PORT + 1.
"""

from __future__ import annotations

import os
import secrets

import pytest
from launch_helpers import (
    clean_env,
    free_port_pair,
    job_dirs,
    plait_leftovers,
    read_results,
    run_ranks,
    shm_left,
)


def srun_envs(n: int, job: str, tmp, out, **extra: str) -> list[dict[str, str]]:
    """What srun -n N (one node, step 0) sets for each task, trimmed to what matters."""
    return [
        clean_env(
            SLURM_JOB_ID=job,
            SLURM_JOBID=job,
            SLURM_STEP_ID="0",
            SLURM_STEPID="0",
            SLURM_PROCID=str(r),
            SLURM_LOCALID=str(r),
            SLURM_NODEID="0",
            SLURM_NTASKS=str(n),
            SLURM_NPROCS=str(n),
            SLURM_STEP_NUM_TASKS=str(n),
            SLURM_NNODES="1",
            SLURM_STEP_NUM_NODES="1",
            TMPDIR=str(tmp),
            PLAIT_TEST_OUT=str(out),
            **extra,
        )
        for r in range(n)
    ]


def check_reports(reports: list[dict], n: int) -> None:
    assert [r["rank"] for r in reports] == list(range(n))
    for r in reports:
        assert r["launcher"] == "srun"
        assert r["size"] == n
        assert r["env_local_rank"] == r["rank"]
    assert len({r["store_url"] for r in reports}) == 1


@pytest.mark.parametrize(
    ("transport", "mode"), [("auto", "check"), ("tcp", "check"), ("auto", "twice")]
)
def test_file_store_keyed_by_job(transport: str, mode: str) -> None:
    job = str(secrets.randbelow(10**9))
    with job_dirs() as (tmp, out):
        envs = srun_envs(4, job, tmp, out, PLAIT_TRANSPORT=transport)
        for res in run_ranks(envs, [mode]):
            assert res.returncode == 0, res.describe()
        reports = read_results(out)
        check_reports(reports, 4)
        for r in reports:
            assert r["job_id"] == f"{job}.0"
            assert r["store_is_temp"]
            assert not r["store_is_server"]
            assert r["store_url"] == f"file://{tmp}/plait-{os.getuid()}-{job}.0"
            assert (r["local_rank"], r["local_size"], r["cross_size"]) == (r["rank"], 4, 1)
            assert r["transport"] == ("ShmTransport" if transport == "auto" else "TcpTransport")
        assert plait_leftovers(tmp) == [], "the file store's directory was not removed"
        assert shm_left(out) == set()


def test_emulated_hosts() -> None:
    job = str(secrets.randbelow(10**9))
    with job_dirs() as (tmp, out):
        for res in run_ranks(srun_envs(6, job, tmp, out, PLAIT_TEST_HOSTS="3"), ["check"]):
            assert res.returncode == 0, res.describe()
        reports = read_results(out)
        check_reports(reports, 6)
        for r in reports:
            assert (r["local_rank"], r["local_size"]) == (r["rank"] % 2, 2)
            assert (r["cross_rank"], r["cross_size"]) == (r["rank"] // 2, 3)
            assert r["sub_sum"] == 4 * (r["rank"] // 2) + 1
        assert plait_leftovers(tmp) == []


def test_master_addr_store() -> None:
    port = free_port_pair()
    with job_dirs() as (tmp, out):
        envs = srun_envs(3, "77", tmp, out, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        for res in run_ranks(envs, ["check"]):
            assert res.returncode == 0, res.describe()
        reports = read_results(out)
        check_reports(reports, 3)
        for r in reports:
            assert r["store_url"] == f"tcp://127.0.0.1:{port + 1}"
            assert r["store_is_server"] == (r["rank"] == 0)
        assert plait_leftovers(tmp) == []


def test_failed_init_still_removes_the_directory() -> None:
    """Ranks that fail in init count themselves out too: the last one removes the directory."""
    job = str(secrets.randbelow(10**9))
    with job_dirs() as (tmp, out):
        # shared memory across three (emulated) hosts: every rank refuses, after meeting
        envs = srun_envs(3, job, tmp, out, PLAIT_TRANSPORT="shm", PLAIT_TEST_HOSTS="3")
        for res in run_ranks(envs, ["check"]):
            assert res.returncode != 0
            assert "needs all ranks on one host" in res.stderr, res.describe()
        assert plait_leftovers(tmp) == []


def test_missing_rank_times_out() -> None:
    """A rank that never comes: the others time out, count it out, and remove the directory."""
    job = str(secrets.randbelow(10**9))
    with job_dirs() as (tmp, out):
        envs = srun_envs(3, job, tmp, out, PLAIT_TIMEOUT="1")[:2]  # rank 2 never starts
        for res in run_ranks(envs, ["check"]):
            assert res.returncode != 0
            assert "waiting for rank(s) [2] to arrive" in res.stderr, res.describe()
        assert plait_leftovers(tmp) == [], "the file store's directory was not removed"
