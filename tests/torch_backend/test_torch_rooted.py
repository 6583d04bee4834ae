"""gather and scatter of the "plait" torch backend with wrong lists, in real jobs.

One ``plait run`` job per world size runs ``torch_rooted_check.py`` (the
checks live in the ranks): valid calls bit-exact, and a wrong
``gather_list`` or ``scatter_list`` on the root raising where it must while
the group stays usable (Note [a list only the root sees] in
``plait.torch._rooted``).
"""

from __future__ import annotations

import functools
import re
import sys
from pathlib import Path

import pytest

from launchers.launch_helpers import JobResult, clean_env, run_job

pytest.importorskip(
    "torch",
    reason="torch is not installed; the plait backend needs it (pip install 'plait[torch]')",
)

pytestmark = pytest.mark.multiprocess

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RANKS = HERE / "torch_rooted_check.py"
#: Seconds a job may take before it is killed (pytest-timeout is 120 per test).
JOB_SECONDS = 100.0
#: The modes of torch_rooted_check.py, run in one job.
MODES = "valid,gather,scatter,async"


@functools.cache
def job(size: int) -> JobResult:
    """Every mode on ``size`` ranks, one torch thread per rank (2 shared cores)."""
    cmd = [sys.executable, "-m", "plait", "run", "-n", str(size), "--tag-output", str(RANKS),
           MODES]  # fmt: skip
    return run_job(cmd, clean_env(OMP_NUM_THREADS="1"), timeout=JOB_SECONDS, cwd=ROOT)


def passed(res: JobResult, mode: str, size: int) -> None:
    """Every rank printed that ``mode`` passed."""
    done = sorted(int(r) for r in re.findall(rf"rank (\d+): {mode} passed", res.stdout))
    assert done == list(range(size)), f"{mode} did not pass on every rank\n{res.describe()}"


@pytest.mark.parametrize("size", [2, 3])
def test_valid_gather_and_scatter_are_bit_exact(size: int) -> None:
    """Every root, blocking and async: float32 with awkward bits, float64 and int64, strided
    entries and outputs, arrive bit for bit."""
    passed(job(size), "valid", size)


@pytest.mark.parametrize("size", [2, 3])
def test_wrong_gather_list_raises_on_root_and_the_group_stays_usable(size: int) -> None:
    """A gather_list entry of the wrong size: ValueError on the root alone, its list not
    written; the others complete, and the next all_reduce is right on every rank."""
    passed(job(size), "gather", size)


@pytest.mark.parametrize("size", [2, 3])
def test_wrong_scatter_list_raises_where_a_share_is_wrong(size: int) -> None:
    """A scatter_list entry of the wrong size or dtype, or a list of the wrong length: the
    root and each rank whose share is wrong raise, writing no tensor; the others get their
    shares, and the next all_reduce is right on every rank."""
    passed(job(size), "scatter", size)


@pytest.mark.parametrize("size", [2, 3])
def test_async_scatter_does_not_wait_for_the_root(size: int) -> None:
    """An async scatter returns on the other ranks before the root calls it; the job ends
    cleanly."""
    res = job(size)
    passed(res, "async", size)
    assert res.returncode == 0, res.describe()
