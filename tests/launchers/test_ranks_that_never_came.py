"""srun's ranks on one host meet in a directory of the temp dir, which the last rank to leave
deletes; a rank that times out counts out the ranks that never came, so that the directory
goes with the ranks that did (Note [ranks that never came] in plait._meeting). A rank that
comes after that is told so.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time

from launch_helpers import clean_env, job_dirs, plait_leftovers

from plait.rendezvous.file_store import FileStore

RANK = "import plait; plait.init()"


def _rank(rank: int, job: str, tmp: object, timeout: str) -> subprocess.Popen[str]:
    """Rank ``rank`` of 3 of srun's step 0 of ``job``, one node; PLAIT_TIMEOUT ``timeout``."""
    env = clean_env(
        SLURM_JOB_ID=job,
        SLURM_STEP_ID="0",
        SLURM_PROCID=str(rank),
        SLURM_LOCALID=str(rank),
        SLURM_NTASKS="3",
        SLURM_NNODES="1",
        TMPDIR=str(tmp),
        PLAIT_TIMEOUT=timeout,
    )
    return subprocess.Popen(
        [sys.executable, "-c", RANK], env=env, stderr=subprocess.PIPE, text=True
    )


def _error(p: subprocess.Popen[str]) -> str:
    try:
        err = p.communicate(timeout=60)[1]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode != 0, err
    return err.strip().splitlines()[-1]


def test_a_rank_that_comes_after_another_gave_up_on_it_is_told_and_the_directory_goes() -> None:
    job = str(secrets.randbelow(10**9))
    with job_dirs() as (tmp, _):
        path = tmp / f"plait-{os.getuid()}-{job}.0-1"
        one = _rank(1, job, tmp, "10")
        try:
            # Rank 0 starts once rank 1 has said its host, so that rank 2 alone never came.
            deadline = time.monotonic() + 30
            while not (path.is_dir() and FileStore(path).check(["plait/init1/host/1"])):
                assert one.poll() is None, "rank 1 ended before it said its host"
                assert time.monotonic() < deadline, "rank 1 never said its host"
                time.sleep(0.05)  # a poll: another process's file has no event to wait on
            zero = _error(_rank(0, job, tmp, "1"))
            assert "waiting for rank(s) [2] to arrive" in zero, zero
            late = _error(_rank(2, job, tmp, "10"))
            first = _error(one)
        finally:
            if one.poll() is None:
                one.kill()
                one.wait()
        assert "gave up waiting for this rank" in late, late
        assert "already joined" not in late, late
        assert "waiting for rank(s) [2] to arrive" in first, first
        assert plait_leftovers(tmp) == [], "the file store's directory was not removed"
