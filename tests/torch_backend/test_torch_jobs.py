"""The "plait" torch.distributed backend in real multi-process jobs.

Every job runs ``torch_rank_check.py`` (the checks live there, inside the
ranks) under ``plait run``, torchrun, or with an explicit ``init_method``, in a
session of its own that is killed if it overruns. One ``plait run`` job per
world size runs the DDP comparison with gloo, every call against numpy and
the error cases, so that torch is imported once per rank for all of them.
"""

from __future__ import annotations

import functools
import re
import sys
from pathlib import Path

import pytest

from launchers.launch_helpers import JobResult, clean_env, free_port_pair, job_dirs, run_job

pytest.importorskip(
    "torch",
    reason="torch is not installed; the plait backend needs it (pip install 'plait[torch]')",
)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RANKS = HERE / "torch_rank_check.py"
EXITS = HERE / "torch_exit_check.py"
PLAIT_RUN = [sys.executable, "-m", "plait", "run"]
#: Seconds a job may take before it is killed (pytest-timeout is 120 per test).
JOB_SECONDS = 100.0


def job_env(**extra: str) -> dict[str, str]:
    """No launcher variables of this process; one torch thread per rank (2 shared cores)."""
    return clean_env(OMP_NUM_THREADS="1", **extra)


@functools.cache
def plait_run_job(size: int) -> JobResult:
    """DDP against gloo, every call, the errors, the suite's paths, the ``*_object``
    functions, (fake) CUDA tensors staged through the host, the futures' values against
    gloo and resizable tensors (FSDP against gloo), on ``size`` ranks."""
    cmd = [
        *PLAIT_RUN,
        "-n",
        str(size),
        "--tag-output",
        str(RANKS),
        "ddp,calls,errors,suite,objects,staging,futures,resize",
    ]
    return run_job(cmd, job_env(), timeout=JOB_SECONDS, cwd=ROOT)


def passed(res: JobResult, mode: str, size: int) -> None:
    """Every rank printed that ``mode`` passed."""
    done = sorted(int(r) for r in re.findall(rf"rank (\d+): {mode} passed", res.stdout))
    assert done == list(range(size)), f"{mode} did not pass on every rank\n{res.describe()}"


@pytest.mark.parametrize("size", [2, 3])
def test_ddp_on_plait_matches_gloo(size: int) -> None:
    """The issue's key test: the same DDP loop ends with the same parameters on both."""
    res = plait_run_job(size)
    passed(res, "ddp", size)
    diffs = re.findall(r"largest relative difference ([-+.0-9e]+)", res.stdout)
    assert len(diffs) == size
    assert all(float(d) < 1e-6 for d in diffs), diffs


@pytest.mark.parametrize("size", [2, 3])
def test_every_call_matches_numpy(size: int) -> None:
    """all_reduce … recv, float32/float64/int64, sync and async, strided tensors."""
    passed(plait_run_job(size), "calls", size)


@pytest.mark.parametrize("size", [2, 3])
def test_refused_calls_and_failed_work(size: int) -> None:
    """Clear errors for what plait cannot serve; a failed call's work raises plait's error."""
    res = plait_run_job(size)
    passed(res, "errors", size)
    assert res.returncode == 0, res.describe()


@pytest.mark.parametrize("size", [2, 3])
def test_what_torchs_own_suite_needs(size: int) -> None:
    """Receive from any source, the CPU device's backend, coalesced calls, "Timed out", sparse
    all_reduce, and monitored_barrier: what torch's own test suite needs (torch_dist_suite.py).
    Coalesced all_gather_into_tensor and reduce_scatter_tensor with tensors of several dtypes
    (refused before), and a tag per message leaving no thread behind (one thread per tag)."""
    passed(plait_run_job(size), "suite", size)


@pytest.mark.parametrize("size", [2, 3])
def test_object_functions_run_on_plaits_object_collectives(size: int) -> None:
    """dist.all_gather_object … recv_object_list on plait groups: plait's object collectives,
    with gloo's results and errors (global and group ranks, sub-groups, large objects with numpy
    arrays and tensors); gloo groups still run torch's own functions."""
    passed(plait_run_job(size), "objects", size)


@pytest.mark.parametrize("size", [2, 3])
def test_cuda_tensors_staged_through_the_host(size: int) -> None:
    """dist.* with tensors torch sees as CUDA tensors (tests/torch_backend/fake_cuda.py): the
    results are written back into them and synchronised, between real processes."""
    passed(plait_run_job(size), "staging", size)


@pytest.mark.parametrize("size", [2, 3])
def test_futures_hold_what_gloos_hold(size: int) -> None:
    """An async call's future (and ``result()``) holds what gloo's does: ``all_gather`` and
    ``gather`` their output list, ``all_gather_into_tensor`` the output's chunks."""
    passed(plait_run_job(size), "futures", size)


@pytest.mark.parametrize("size", [2, 3])
def test_tensors_stay_resizable_and_fsdp_trains(size: int) -> None:
    """A tensor that went through any call (collectives, point to point, the ``*_object``
    functions) can be resized afterwards, and FSDP's FULL_SHARD and SHARD_GRAD_OP, which free
    parameters with ``storage.resize_(0)``, train to gloo's parameters."""
    passed(plait_run_job(size), "resize", size)


def test_monitored_barrier_as_the_last_call() -> None:
    """``monitored_barrier()`` just before ``destroy_process_group()`` on 4 ranks, 3 rounds:
    rank 0 serves the store, and waits until every rank has read its verdict (it returned at
    once, and the others' reads of the verdict failed with torch's DistNetworkError)."""
    cmd = [*PLAIT_RUN, "-n", "4", "--tag-output", str(EXITS), "monitored"]
    res = run_job(cmd, job_env(), timeout=JOB_SECONDS, cwd=ROOT)
    assert res.returncode == 0, res.describe()
    done = re.findall(r"rank (\d+): round (\d+) clean exit", res.stdout)
    assert sorted(done) == sorted((str(r), str(k)) for r in range(4) for k in range(3)), done


def test_sub_group_errors_name_global_ranks() -> None:
    """A peer lost in ``new_group([1, 2])``: global rank 1's errors name ranks both ways
    (``rank 0 (global rank 1)``, ``rank 1 (global rank 2)``), keeping their class and
    ``lost_rank``."""
    with job_dirs() as (tmp, _):
        cmd = [*PLAIT_RUN, "-n", "3", "--tag-output", str(EXITS), "lost"]
        res = run_job(cmd, job_env(PLAIT_DUMP_DIR=str(tmp)), timeout=JOB_SECONDS, cwd=ROOT)
    assert res.returncode == 0, res.describe()
    passed_by = sorted(int(r) for r in re.findall(r"rank (\d+): lost passed", res.stdout))
    assert passed_by == [0, 1], res.describe()


def test_a_rank_outside_a_sub_group_and_one_that_never_comes() -> None:
    """plait.torch.monitored_barrier on a rank outside its group raised TypeError where
    torch's returns; a sub-group whose rank never came named it as "rank(s) [1]", the
    group's number, to global rank 1, and blamed a plait.init the user never called."""
    cmd = [*PLAIT_RUN, "-n", "3", "--tag-output", str(EXITS), "outside"]
    res = run_job(cmd, job_env(), timeout=JOB_SECONDS, cwd=ROOT)
    assert res.returncode == 0, res.describe()
    passed_by = sorted(int(r) for r in re.findall(r"rank (\d+): outside passed", res.stdout))
    assert passed_by == [0, 1, 2], res.describe()


def torchrun(script: Path, mode: str) -> JobResult:
    """``script mode`` on 2 ranks under torchrun, in a temporary folder of its own."""
    port = free_port_pair()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["--master-addr", "127.0.0.1", "--master-port", str(port), str(script), mode]
    with job_dirs() as (tmp, _):
        return run_job(cmd, job_env(TMPDIR=str(tmp)), timeout=JOB_SECONDS, cwd=ROOT)


def test_torchrun_env() -> None:
    """Under torchrun, env:// is torch's own: the group meets through torchrun's store."""
    res = torchrun(RANKS, "basic")
    assert res.returncode == 0, res.describe()
    passed(res, "basic", 2)


def test_a_new_default_group_after_destroy_under_torchrun() -> None:
    """After ``destroy_process_group()``, torch gives the next default group the old one's
    namespace in torchrun's store, which outlives it: plait's keys of the first group were
    still there, and the second ``init_process_group`` failed on every rank with "another
    process has already joined this job as rank 0"."""
    res = torchrun(EXITS, "again")
    assert res.returncode == 0, res.describe()
    done = re.findall(r"rank (\d+): round (\d+) again", res.stdout)
    assert sorted(done) == sorted((str(r), str(k)) for r in range(2) for k in range(3)), done


def test_explicit_init_method(tmp_path: Path) -> None:
    """init_method=file://… with rank and world_size given: torch's FileStore carries it."""
    url = f"file://{tmp_path / 'rendezvous'}"
    cmd = [*PLAIT_RUN, "-n", "2", "--tag-output", str(RANKS), "basic", url]
    res = run_job(cmd, job_env(), timeout=JOB_SECONDS, cwd=ROOT)
    assert res.returncode == 0, res.describe()
    passed(res, "basic", 2)


def test_example_trains_identical_replicas() -> None:
    """The example (``plait run -n 4`` in the docs; 2 ranks here, to keep the suite short)."""
    cmd = [*PLAIT_RUN, "-n", "2", "examples/train_torch_ddp.py", "--epochs", "2"]
    res = run_job(cmd, job_env(), timeout=JOB_SECONDS, cwd=ROOT)
    assert res.returncode == 0, res.describe()
    assert "replicas identical: True" in res.stdout, res.describe()


def test_compression_hooks_in_ddp() -> None:
    """plait's compressors as DDP communication hooks, on two ranks."""
    cmd = [*PLAIT_RUN, "-n", "2", "--tag-output", str(RANKS), "hooks"]
    res = run_job(cmd, job_env(), timeout=JOB_SECONDS, cwd=ROOT)
    passed(res, "hooks", 2)
