"""``detect_launch`` on crafted environments: every launcher, nesting, bad values; and
what ``init`` makes of them before any rank is contacted."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import pytest

import plait
from plait._init import LaunchInfo, detect_launch, first_slurm_host

UID = os.getuid()


def tmp_url(name: str) -> str:
    return f"file://{tempfile.gettempdir()}/plait-{UID}-{name}"


# What the launchers set (trimmed copies of real environments).
PLAIT = {
    "PLAIT_RANK": "2",
    "PLAIT_SIZE": "4",
    "PLAIT_LOCAL_RANK": "0",
    "PLAIT_LOCAL_SIZE": "2",
    "PLAIT_NODE_RANK": "1",
    "PLAIT_NNODES": "2",
    "PLAIT_STORE": "tcp://10.0.0.1:29400",
    "PLAIT_JOB_ID": "10.0.0.1-29400",
}
TORCHRUN = {
    "RANK": "3",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "1",
    "GROUP_WORLD_SIZE": "2",
    "MASTER_ADDR": "node0",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "66457efc-caa4-44f0-9958-b755a51e9465",
    "TORCHELASTIC_RESTART_COUNT": "0",
}
OMPI4 = {  # mpirun (Open MPI) 4.1.4, -np 4 on one host
    "OMPI_COMM_WORLD_RANK": "1",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
    "OMPI_COMM_WORLD_NODE_RANK": "1",
    "OMPI_MCA_ess_base_jobid": "2048196609",
    "OMPI_MCA_orte_hnp_uri": "2048196608.0;tcp://192.0.2.2:37025",
    "PMIX_NAMESPACE": "2048196609",
    "PMIX_RANK": "1",
}
OMPI5 = {  # mpirun (Open MPI) 5.x: PRRTE, no OMPI_MCA_ess_base_jobid
    "OMPI_COMM_WORLD_RANK": "0",
    "OMPI_COMM_WORLD_SIZE": "2",
    "OMPI_COMM_WORLD_LOCAL_RANK": "0",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "OMPI_FILE_LOCATION": "/tmp/prte.vm.0/dvm.12345/1/0",
    "PMIX_NAMESPACE": "prterun-vm-12345@1",
    "PMIX_RANK": "0",
}
SRUN = {  # srun -n 4 on one node, step 0 of job 4242
    "SLURM_JOB_ID": "4242",
    "SLURM_JOBID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_STEPID": "0",
    "SLURM_PROCID": "2",
    "SLURM_LOCALID": "2",
    "SLURM_NODEID": "0",
    "SLURM_NTASKS": "4",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_NNODES": "1",
    "SLURM_STEP_NUM_NODES": "1",
}
BATCH = {  # the sbatch script itself (--ntasks=4): one process, not a task of a step
    "SLURM_JOB_ID": "4242",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
    "SLURM_NTASKS": "4",
    "SLURM_NNODES": "1",
}


def test_nothing() -> None:
    assert detect_launch({}) == LaunchInfo("none", 0, 1, None, None, False, None)
    info = detect_launch({"PLAIT_STORE": "tcp://h:1"})
    assert (info.launcher, info.size, info.store_url) == ("none", 1, "tcp://h:1")


@pytest.mark.parametrize("rank", [None, "", "  "])
def test_a_size_of_several_without_a_rank_is_refused_naming_plait_rank(rank: str | None) -> None:
    """PLAIT_SIZE=2 with PLAIT_RANK empty or unset (``PLAIT_RANK=$r`` with ``$r`` unset) gave
    a job of one rank on every process: each allreduce returned its own input."""
    env = {"PLAIT_SIZE": "2", "PLAIT_STORE": "tcp://127.0.0.1:29999"}
    if rank is not None:
        env["PLAIT_RANK"] = rank
    with pytest.raises(ValueError, match=r"PLAIT_SIZE is '2' but PLAIT_RANK is not set"):
        detect_launch(env)
    assert detect_launch({**env, "PLAIT_SIZE": "1"}).size == 1  # one alone: as it says


def test_plait_run() -> None:
    info = detect_launch(PLAIT)
    assert (info.launcher, info.rank, info.size) == ("plait", 2, 4)
    assert (info.local_rank, info.local_size) == (0, 2)
    assert (info.store_url, info.store_is_server, info.job_id) == (
        "tcp://10.0.0.1:29400",
        False,
        "10.0.0.1-29400",
    )


def test_torchrun() -> None:
    info = detect_launch(TORCHRUN)
    assert (info.launcher, info.rank, info.size) == ("torchrun", 3, 4)
    assert (info.local_rank, info.local_size) == (1, 2)
    assert info.store_url == "tcp://node0:29501"  # MASTER_PORT + 1: 29500 is torch's
    assert info.store_by_rank0
    assert not info.store_is_server
    assert info.job_id == TORCHRUN["TORCHELASTIC_RUN_ID"]
    rank0 = detect_launch({**TORCHRUN, "RANK": "0", "LOCAL_RANK": "0"})
    assert rank0.store_is_server


def test_torch_variables_alone() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "::1"}  # MASTER_PORT defaults
    info = detect_launch(env)
    assert (info.launcher, info.rank, info.size, info.local_rank) == ("torchrun", 1, 2, None)
    assert info.store_url == "tcp://[::1]:29501"
    assert info.job_id is None
    no_master = detect_launch({"RANK": "1", "WORLD_SIZE": "2"})
    assert no_master.store_url is None


@pytest.mark.parametrize(("env", "job"), [(OMPI4, "2048196609"), (OMPI5, "prterun-vm-12345@1")])
def test_mpirun(env: dict[str, str], job: str) -> None:
    info = detect_launch(env)
    rank, size = int(env["OMPI_COMM_WORLD_RANK"]), int(env["OMPI_COMM_WORLD_SIZE"])
    assert (info.launcher, info.rank, info.size) == ("mpirun", rank, size)
    assert (info.local_rank, info.local_size) == (rank, size)
    assert info.job_id == job
    assert info.store_is_temp
    assert not info.store_is_server
    assert info.store_url is not None
    assert info.store_url.startswith(tmp_url(""))
    name = info.store_url.rsplit("/", 1)[1]
    assert "@" not in name
    assert "/" not in name


def test_mpirun_store_is_the_same_on_every_rank_and_differs_between_jobs() -> None:
    urls = {
        detect_launch({**OMPI4, "OMPI_COMM_WORLD_RANK": str(r), "PMIX_RANK": str(r)}).store_url
        for r in range(4)
    }
    assert len(urls) == 1
    # Open MPI 4 hashes (host, pid) into 16 bits: two jobs may share an id; not a store
    other = {**OMPI4, "OMPI_MCA_orte_hnp_uri": "2048196608.0;tcp://192.0.2.2:41111"}
    assert detect_launch(other).store_url not in urls


def test_old_open_mpi_job_id() -> None:
    env = {k: v for k, v in OMPI4.items() if k != "PMIX_NAMESPACE"}
    assert detect_launch(env).job_id == "2048196609"


def test_srun() -> None:
    info = detect_launch(SRUN)
    assert (info.launcher, info.rank, info.size, info.local_rank) == ("srun", 2, 4, 2)
    assert info.job_id == "4242.0"
    assert info.store_url == tmp_url("4242.0")
    assert info.store_is_temp
    assert not info.store_is_server


def test_srun_step_size_and_requeue() -> None:
    # srun --preserve-env -n 2 inside an allocation of 8 tasks: the step has 2
    env = {**SRUN, "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8"}
    env["SLURM_STEP_NUM_TASKS"] = "2"
    info = detect_launch(env)
    assert (info.rank, info.size) == (1, 2)
    # a requeued job keeps its id: a directory left by a killed run must not be reused
    assert detect_launch({**SRUN, "SLURM_RESTART_COUNT": "2"}).job_id == "4242.0.r2"
    assert detect_launch({**SRUN, "SLURM_RESTART_COUNT": "0"}).job_id == "4242.0"


def test_sbatch_script_is_one_process() -> None:
    assert detect_launch(BATCH).launcher == "none"
    assert detect_launch(BATCH).size == 1


@pytest.mark.parametrize(
    "env",
    [
        {**SRUN, "SLURM_NNODES": "2", "SLURM_STEP_NUM_NODES": "2"},
        {**OMPI4, "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
    ],
    ids=["srun", "mpirun"],
)
def test_several_hosts(env: dict[str, str]) -> None:
    """A file store in each host's temp dir would never meet: no store without MASTER_ADDR."""
    assert detect_launch(env).store_url is None
    info = detect_launch({**env, "MASTER_ADDR": "node0", "MASTER_PORT": "1234"})
    assert info.store_url == "tcp://node0:1235"
    assert info.store_by_rank0
    assert not info.store_is_temp
    assert detect_launch({**env, "PLAIT_STORE": "redis://r:6379"}).store_url == "redis://r:6379"


def test_master_addr_under_mpirun_and_srun() -> None:
    for env in (OMPI4, SRUN):
        info = detect_launch({**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "5000"})
        assert info.store_url == "tcp://127.0.0.1:5001"
        assert not info.store_is_server  # rank 1 / rank 2
    info = detect_launch({**SRUN, "SLURM_PROCID": "0", "MASTER_ADDR": "127.0.0.1"})
    assert info.store_is_server
    assert info.store_url == "tcp://127.0.0.1:29501"


def test_plait_store_wins_over_master_addr() -> None:
    for env in (TORCHRUN, OMPI4, SRUN):
        info = detect_launch({**env, "PLAIT_STORE": "tcp://h:7"})
        assert info.store_url == "tcp://h:7"
        assert not info.store_is_server
        assert not info.store_by_rank0
        assert not info.store_is_temp


# ---- precedence: the innermost launcher wins


def test_plait_run_wins_over_everything() -> None:
    info = detect_launch({**SRUN, **OMPI4, **TORCHRUN, **PLAIT})
    assert (info.launcher, info.rank) == ("plait", 2)


def test_torchrun_under_srun() -> None:
    # srun -N 2 torchrun --nproc-per-node 2: task 1 of the step, worker 3 of torchrun
    env = {**SRUN, "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2"}
    info = detect_launch({**env, **TORCHRUN})
    assert (info.launcher, info.rank, info.size) == ("torchrun", 3, 4)
    assert info.store_url == "tcp://node0:29501"


def test_torchrun_under_mpirun() -> None:
    # even where the numbers happen to agree, torchrun's workers are torchrun's
    env = {**OMPI4, "OMPI_COMM_WORLD_RANK": "3", **TORCHRUN}
    assert detect_launch(env).launcher == "torchrun"


def test_rank_copied_from_mpirun_keeps_mpirun() -> None:
    # a script under mpirun that exports RANK/WORLD_SIZE from OMPI_COMM_WORLD_*:
    # the same place in the job, and mpirun's job id still gives a store
    env = {**OMPI4, "RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}
    info = detect_launch(env)
    assert (info.launcher, info.rank, info.size, info.store_is_temp) == ("mpirun", 1, 4, True)


def test_own_launcher_inside_srun() -> None:
    # one srun task per node starts 4 processes itself and sets torch's variables
    env = {**SRUN, "RANK": "9", "WORLD_SIZE": "16", "MASTER_ADDR": "node0"}
    info = detect_launch(env)
    assert (info.launcher, info.rank, info.size) == ("torchrun", 9, 16)


def test_world_size_alone_is_not_an_identity() -> None:
    # sbatch scripts often export WORLD_SIZE for the program to read; srun still decides
    info = detect_launch({**SRUN, "WORLD_SIZE": "4"})
    assert (info.launcher, info.rank) == ("srun", 2)


def test_empty_variables_count_as_unset() -> None:
    assert detect_launch({"PLAIT_RANK": "", "RANK": " ", "WORLD_SIZE": "2"}).launcher == "none"


# ---- bad values name the variable


@pytest.mark.parametrize(
    ("env", "name"),
    [
        ({"RANK": "abc", "WORLD_SIZE": "4"}, "RANK"),
        ({"RANK": "1", "WORLD_SIZE": "four"}, "WORLD_SIZE"),
        ({**TORCHRUN, "LOCAL_RANK": "x"}, "LOCAL_RANK"),
        ({"RANK": "4", "WORLD_SIZE": "4"}, "RANK"),
        ({"RANK": "-1", "WORLD_SIZE": "4"}, "RANK"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE"),
        ({**TORCHRUN, "LOCAL_RANK": "2"}, "LOCAL_RANK"),
        ({**TORCHRUN, "LOCAL_WORLD_SIZE": "5"}, "LOCAL_WORLD_SIZE"),
        ({**TORCHRUN, "MASTER_PORT": "http"}, "MASTER_PORT"),
        ({**TORCHRUN, "MASTER_PORT": "65535"}, "MASTER_PORT"),
        ({**OMPI4, "OMPI_COMM_WORLD_SIZE": "x"}, "OMPI_COMM_WORLD_SIZE"),
        ({k: v for k, v in OMPI4.items() if k != "OMPI_COMM_WORLD_SIZE"}, "OMPI_COMM_WORLD_SIZE"),
        ({**SRUN, "SLURM_PROCID": "2.0"}, "SLURM_PROCID"),
        ({**SRUN, "SLURM_STEP_NUM_TASKS": "2"}, "SLURM_PROCID"),
        ({**SRUN, "SLURM_RESTART_COUNT": "once"}, "SLURM_RESTART_COUNT"),
        ({"PLAIT_RANK": "1"}, "PLAIT_SIZE"),
        ({**PLAIT, "PLAIT_RANK": "0x1"}, "PLAIT_RANK"),
    ],
)
def test_bad_values(env: dict[str, str], name: str) -> None:
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        detect_launch(env)


# ---- init, before it contacts anyone


@pytest.fixture
def launch_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Replace this process's launcher variables; the temp dir is ``tmp_path``."""
    for k in list(os.environ):
        if k.startswith(("PLAIT_", "OMPI_", "PMIX_", "SLURM_", "TORCHELASTIC_")) or k in (
            "RANK",
            "WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
        ):
            monkeypatch.delenv(k)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def set_env(env: dict[str, str]) -> None:
        for k, v in env.items():
            monkeypatch.setenv(k, v)

    return set_env


def test_init_says_why_it_cannot_find_the_others(launch_env) -> None:
    launch_env({**SRUN, "SLURM_NNODES": "2", "SLURM_STEP_NUM_NODES": "2"})
    with pytest.raises(plait.RendezvousError, match=r"several hosts.*MASTER_ADDR"):
        plait.init()
    launch_env({**BATCH})  # the batch script alone: one rank, nothing to meet
    for k in SRUN.keys() - BATCH.keys():
        os.environ.pop(k, None)
    with plait.init() as comm:
        assert comm.size == 1


def test_init_refuses_a_store_directory_it_does_not_own(launch_env, tmp_path: Path) -> None:
    launch_env({**SRUN, "PLAIT_TIMEOUT": "1"})
    # someone else made the directory the next init would meet in, writable by all
    path = tmp_path / f"plait-{UID}-4242.0-{_next_generation()}"
    path.mkdir()
    path.chmod(0o777)
    with pytest.raises(plait.RendezvousError, match="not a private directory"):
        plait.init()
    assert stat.S_IMODE(path.stat().st_mode) == 0o777  # left as it was


def _next_generation() -> int:
    import plait._init as m

    return m._generation + 1


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [
        ("node07", "node07"),
        ("node[07-09,12],gpu1", "node07"),
        ("gpu1,node[07-09]", "gpu1"),
        ("rack[2-3]-n[010-011]", "rack2-n010"),
        ("a-b[5,1-2]", "a-b5"),
        ("node[07", None),
        ("", None),
    ],
)
def test_first_slurm_host(nodelist: str, first: str | None) -> None:
    assert first_slurm_host(nodelist) == first


def test_srun_on_several_nodes_meets_on_the_first_node() -> None:
    """Without MASTER_ADDR, rank 0 serves the store on the first node of the step."""
    env = {**SRUN, "SLURM_NNODES": "2", "SLURM_STEP_NUM_NODES": "2"}
    env["SLURM_STEP_NODELIST"] = "cn[012-013]"
    info = detect_launch(env)
    assert info.store_url is not None
    assert info.store_url.startswith("tcp://cn012:")
    port = int(info.store_url.rsplit(":", 1)[1])
    assert 20000 <= port < 30000
    assert info.store_by_rank0
    assert not info.store_is_server  # this is rank 2
    assert detect_launch({**env, "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}).store_is_server
    # Another step of the job gets another port; MASTER_PORT wins when set.
    other = detect_launch({**env, "SLURM_STEP_ID": "1", "SLURM_STEPID": "1"})
    assert other.store_url != info.store_url
    assert detect_launch({**env, "MASTER_PORT": "4000"}).store_url == "tcp://cn012:4001"
    # MASTER_ADDR still wins over the node list.
    assert detect_launch({**env, "MASTER_ADDR": "h0"}).store_url == "tcp://h0:29501"


def test_plaits_variables_take_master_addr_where_no_store_is_named() -> None:
    env = {"PLAIT_RANK": "1", "PLAIT_SIZE": "2", "MASTER_ADDR": "node0", "MASTER_PORT": "5000"}
    info = detect_launch(env)
    assert (info.launcher, info.store_url, info.store_by_rank0) == (
        "plait",
        "tcp://node0:5001",
        True,
    )
    assert not info.store_is_server
    assert detect_launch({**env, "PLAIT_RANK": "0"}).store_is_server
    named = detect_launch({**env, "PLAIT_STORE": "tcp://h:7"})
    assert (named.store_url, named.store_by_rank0) == ("tcp://h:7", False)


def test_a_job_meets_under_its_id_only_in_a_store_served_apart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Under plait run --nnodes each launcher named the job after its own --master-addr, and
    # the namespace of that name split a job whose hosts spelled node 0 differently.
    from plait._meeting import job_space

    for name in ("PLAIT_LAUNCHER_PID", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    by_hand = {"PLAIT_RANK": "1", "PLAIT_SIZE": "2", "PLAIT_STORE": "tcp://h:7"}
    assert job_space(detect_launch({**by_hand, "PLAIT_JOB_ID": "j"})) == "j"
    assert job_space(detect_launch(by_hand)) is None
    torch = {"RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "r", "PLAIT_STORE": "tcp://h:7"}
    assert job_space(detect_launch(torch)) == "r"
    assert job_space(detect_launch({**torch, "TORCHELASTIC_RUN_ID": "none"})) is None
    del torch["PLAIT_STORE"]
    assert job_space(detect_launch({**torch, "MASTER_ADDR": "n0"})) is None  # rank 0's store
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")  # nodes may count differently
    assert job_space(detect_launch({**torch, "PLAIT_STORE": "tcp://h:7"})) == "r"
    monkeypatch.setenv("PLAIT_LAUNCHER_PID", "1")  # plait run's own store, one per attempt
    assert job_space(detect_launch({**by_hand, "PLAIT_JOB_ID": "j"})) is None


def test_a_claim_met_again_names_the_launchers_own_id() -> None:
    # It said to set PLAIT_JOB_ID, which torchrun's ranks never read.
    from plait._meeting import claim_rank
    from plait.rendezvous.store import MemoryStore, PrefixStore

    group = PrefixStore("plait/init1/job/r", MemoryStore())
    claim_rank(group, 0, 2, "r", "torchrun")
    with pytest.raises(plait.RendezvousError, match=r"same id \('r'\).*--rdzv-id\); a restart"):
        claim_rank(group, 0, 2, "r", "torchrun")
    with pytest.raises(plait.RendezvousError, match=r"an id of its own \(PLAIT_JOB_ID\)$"):
        claim_rank(group, 0, 2, "r", "plait")
