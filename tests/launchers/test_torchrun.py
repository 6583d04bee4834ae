"""A bare ``plait.init()`` under torchrun, and with torch's variables set by hand (no torch).

torchrun's own store listens on MASTER_PORT; plait's rank 0 serves plait's
store on MASTER_PORT + 1, so the two live side by side in one job (checked by
running torch.distributed and plait together).
"""

from __future__ import annotations

import importlib.util
import os
import socket
import sys

import pytest
from launch_helpers import (
    RANK_SCRIPT,
    clean_env,
    free_port_pair,
    job_dirs,
    plait_leftovers,
    read_results,
    run_job,
    run_ranks,
    shm_left,
)

HAS_TORCH = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(
    not HAS_TORCH, reason="torch is not installed (torchrun comes with it)"
)


def torchrun(args: list[str], mode: str, env: dict[str, str]):
    # python -m torch.distributed.run is what the torchrun script runs.
    cmd = [sys.executable, "-m", "torch.distributed.run", *args, str(RANK_SCRIPT), mode]
    return run_job(cmd, env)


def check_reports(reports: list[dict], n: int, launcher: str = "torchrun") -> None:
    assert [r["rank"] for r in reports] == list(range(n))
    for r in reports:
        assert r["launcher"] == launcher
        assert r["size"] == n
        assert (r["env_local_rank"], r["env_local_size"]) == (r["rank"], n)
        assert (r["local_rank"], r["local_size"], r["cross_size"]) == (r["rank"], n, 1)
        assert r["sub_sum"] == n * (n - 1) // 2
        assert r["store_is_server"] == (r["rank"] == 0)
        assert not r["store_is_temp"]
    assert len({r["store_url"] for r in reports}) == 1


@needs_torch
@pytest.mark.parametrize("mode", ["check", "torch"])
def test_torchrun_bare_init(mode: str) -> None:
    port = free_port_pair()
    with job_dirs() as (tmp, out):
        env = clean_env(TMPDIR=str(tmp), PLAIT_TEST_OUT=str(out), OMP_NUM_THREADS="1")
        args = ["--nproc-per-node", "3", "--master-addr", "127.0.0.1", "--master-port", str(port)]
        res = torchrun(args, mode, env)
        assert res.returncode == 0, res.describe()
        reports = read_results(out)
        check_reports(reports, 3)
        for r in reports:
            assert r["store_url"] == f"tcp://127.0.0.1:{port + 1}"
            assert r["job_id"]  # TORCHELASTIC_RUN_ID
            if mode == "torch":  # torch's store on MASTER_PORT worked alongside plait's
                assert r["torch_sum"] == 0 + 1 + 2
        assert plait_leftovers(tmp) == []
        assert shm_left(out) == set()
    assert res.seconds < 30, res.seconds


@needs_torch
def test_torchrun_standalone() -> None:
    """``--standalone``: torch picks MASTER_PORT itself; plait follows it."""
    with job_dirs() as (tmp, out):
        env = clean_env(TMPDIR=str(tmp), PLAIT_TEST_OUT=str(out), OMP_NUM_THREADS="1")
        res = torchrun(["--standalone", "--nproc-per-node", "2"], "check", env)
        if res.returncode and "MASTER_PORT + 1" in res.stderr:
            # torch picked a free MASTER_PORT, but the port after it, plait's store's, was
            # taken by another process of this busy machine (the error says so and what to
            # do): a new run picks another port.
            res = torchrun(["--standalone", "--nproc-per-node", "2"], "check", env)
        assert res.returncode == 0, res.describe()
        reports = read_results(out)
        check_reports(reports, 2)
        assert reports[0]["store_url"].startswith("tcp://")


def env_ranks(n: int, port: int, tmp, out, **extra: str) -> list[dict[str, str]]:
    """The variables torchrun gives its workers, without torchrun."""
    return [
        clean_env(
            RANK=str(r),
            WORLD_SIZE=str(n),
            LOCAL_RANK=str(r),
            LOCAL_WORLD_SIZE=str(n),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            TMPDIR=str(tmp),
            PLAIT_TEST_OUT=str(out),
            **extra,
        )
        for r in range(n)
    ]


@pytest.mark.parametrize("mode", ["check", "twice"])
def test_torch_variables_without_torch(mode: str) -> None:
    port = free_port_pair()
    with job_dirs() as (tmp, out):
        results = run_ranks(env_ranks(4, port, tmp, out), [mode])
        for res in results:
            assert res.returncode == 0, res.describe()
        reports = read_results(out)
        check_reports(reports, 4)
        for r in reports:
            assert r["store_url"] == f"tcp://127.0.0.1:{port + 1}"
            assert r["job_id"] is None
            if mode == "twice":  # the second init served its store on the same port
                assert r["first"]["sub_sum"] == 6
        assert plait_leftovers(tmp) == []
        assert shm_left(out) == set()
    # the store died with rank 0: the port is free again for the next job
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port + 1))


def test_store_port_taken_is_a_clear_error() -> None:
    port = free_port_pair()
    with job_dirs() as (tmp, out), socket.socket() as squatter:
        squatter.bind(("127.0.0.1", port + 1))
        squatter.listen()
        # Rank 0 alone: it cannot serve, and says why at once.
        (res,) = run_ranks(env_ranks(2, port, tmp, out)[:1], ["check"])
    assert res.returncode != 0
    assert "RendezvousError" in res.stderr, res.describe()
    assert "MASTER_PORT + 1" in res.stderr, res.describe()
    assert res.seconds < 15


def test_leftover_launcher_variables_do_not_leak(tmp_path) -> None:
    """The test helpers start jobs without this process's launcher variables."""
    env = clean_env()
    assert not {"RANK", "WORLD_SIZE", "MASTER_ADDR", "OMPI_COMM_WORLD_RANK"} & set(env)
    assert env["PLAIT_TIMEOUT"]
    assert os.path.isdir(tmp_path)


def test_plaits_variables_with_master_addr_meet_as_torchs_do() -> None:
    # PLAIT_RANK and PLAIT_SIZE set by hand next to MASTER_ADDR failed at once, asking
    # for MASTER_ADDR: plait's own variables never looked at it.
    port = free_port_pair()
    with job_dirs() as (tmp, out):
        envs = [
            clean_env(
                PLAIT_RANK=str(r),
                PLAIT_SIZE="3",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                TMPDIR=str(tmp),
                PLAIT_TEST_OUT=str(out),
            )
            for r in range(3)
        ]
        for res in run_ranks(envs, ["check"]):
            assert res.returncode == 0, res.describe()
        reports = read_results(out)
        assert [r["rank"] for r in reports] == [0, 1, 2]
        for r in reports:
            assert r["store_url"] == f"tcp://127.0.0.1:{port + 1}"
            assert r["store_is_server"] == (r["rank"] == 0)
            assert r["sub_sum"] == 3
