"""PLAIT_JOB_ID names a job's namespace in a store that jobs share, whoever started the ranks.

Two jobs one after the other in one shared store, each given an id of its own: the second
failed at once ("another process has already joined this job as rank 0", asking for
PLAIT_JOB_ID) where the store was passed to ``init`` as a URL or the ranks were started with
torch's variables, since only ranks started with plait's own variables read the id.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from launch_helpers import clean_env

import plait
from plait._init import detect_launch
from plait._meeting import claim_rank, job_space
from plait.rendezvous.store import MemoryStore, PrefixStore

# One rank: its place from the command line and the store passed as a URL, or (no
# arguments) a bare init() reading the environment.
RANK = """
import sys, plait
if len(sys.argv) > 1:
    comm = plait.init(rank=int(sys.argv[1]), size=2, store=sys.argv[2], timeout=20)
else:
    comm = plait.init(timeout=20)
comm.close()
"""


def _job(job: str, envs: list[dict[str, str]], args: list[list[str]]) -> list[str]:
    """Run one job's two ranks together; each one's error output (empty where it ran well)."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, *a],
            env={**e, "PLAIT_JOB_ID": job},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for e, a in zip(envs, args, strict=True)
    ]
    errs = []
    for p in procs:
        try:
            err = p.communicate(timeout=60)[1]
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        errs.append(err if p.returncode else "")
    return errs


@pytest.mark.parametrize("how", ["store=", "RANK and WORLD_SIZE", "torchrun's run id 'none'"])
def test_jobs_of_their_own_ids_meet_one_after_the_other_in_a_shared_store(
    how: str, tmp_path: Path
) -> None:
    url = f"file://{tmp_path / 'shared'}"
    if how == "store=":
        envs = [clean_env(), clean_env()]
        args = [["0", url], ["1", url]]
    else:
        run = {"TORCHELASTIC_RUN_ID": "none"} if how.startswith("torchrun") else {}
        envs = [clean_env(RANK=str(r), WORLD_SIZE="2", PLAIT_STORE=url, **run) for r in (0, 1)]
        args = [[], []]
    for job in ("jobA", "jobB"):
        errs = _job(job, envs, args)
        assert errs == ["", ""], f"{job}: {errs}"


def test_plait_job_id_names_the_job_under_every_launcher(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("PLAIT_LAUNCHER_PID", "PLAIT_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    shared = {"PLAIT_STORE": "tcp://h:7", "PLAIT_JOB_ID": "mine"}
    torch = {"RANK": "1", "WORLD_SIZE": "2", **shared}
    mpirun = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "PMIX_NAMESPACE": "p@1"}
    srun = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "9"}
    for env in (
        torch,
        {**torch, "TORCHELASTIC_RUN_ID": "none"},  # torchrun's default run id
        {**torch, "TORCHELASTIC_RUN_ID": "r"},  # the user's id wins over the launcher's
        {**mpirun, **shared},
        {**srun, **shared},
    ):
        assert job_space(detect_launch(env)) == "mine", env
    # Unset: as before, the launcher's id where it gives one, else the plain namespace.
    del torch["PLAIT_JOB_ID"]
    assert job_space(detect_launch(torch)) is None
    assert job_space(detect_launch({**torch, "TORCHELASTIC_RUN_ID": "r"})) == "r"
    # A store of the job's own keeps the plain namespace: rank 0's, the temp dir's.
    assert job_space(detect_launch({**torch, "MASTER_ADDR": "n0", "PLAIT_STORE": ""})) is None
    assert job_space(detect_launch({**mpirun, "PLAIT_JOB_ID": "mine"})) is None
    # A store URL passed to init: PLAIT_JOB_ID where set, else the plain namespace.
    info = detect_launch(torch)
    assert job_space(info, url=True) is None
    monkeypatch.setenv("PLAIT_JOB_ID", "mine")
    assert job_space(info, url=True) == "mine"


def test_a_claim_met_again_under_plait_job_id_asks_for_another_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Under torchrun's variables, an id from PLAIT_JOB_ID is not torchrun's --rdzv-id.
    monkeypatch.setenv("PLAIT_JOB_ID", "mine")
    group = PrefixStore("plait/init1/job/mine", MemoryStore())
    claim_rank(group, 0, 2, "mine", "torchrun")
    with pytest.raises(
        plait.RendezvousError, match=r"\('mine'\).*an id of its own \(PLAIT_JOB_ID\)$"
    ):
        claim_rank(group, 0, 2, "mine", "torchrun")
