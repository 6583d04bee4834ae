"""Uneven calls and object collectives of the "plait" torch backend, in real jobs.

One ``plait run`` job per world size runs ``torch_uneven_check.py`` (the
checks live in the ranks: against a gloo group of the same job where gloo
serves the call, else against numpy) and prints the byte counts read here.
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

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RANKS = HERE / "torch_uneven_check.py"
#: Seconds a job may take before it is killed (pytest-timeout is 120 per test).
JOB_SECONDS = 100.0


@functools.cache
def job(size: int) -> JobResult:
    """Both modes on ``size`` ranks, one torch thread per rank (2 shared cores).

    Without the shared window (PLAIT_SHM_WINDOW=0), so that every call sends
    messages and the byte counts compare what torch's padding and plait's uneven
    calls put on the wire.
    """
    cmd = [sys.executable, "-m", "plait", "run", "-n", str(size), "--tag-output", str(RANKS),
           "uneven,objects"]  # fmt: skip
    env = clean_env(OMP_NUM_THREADS="1", PLAIT_SHM_WINDOW="0")
    return run_job(cmd, env, timeout=JOB_SECONDS, cwd=ROOT)


def passed(res: JobResult, mode: str, size: int) -> None:
    done = sorted(int(r) for r in re.findall(rf"rank (\d+): {mode} passed", res.stdout))
    assert done == list(range(size)), f"{mode} did not pass on every rank\n{res.describe()}"


def byte_counts(res: JobResult, case: str, size: int) -> list[dict[str, int]]:
    """Each rank's ``rank R: bytes <case>: key n key n ...`` line, in rank order."""
    found = dict(re.findall(rf"rank (\d+): bytes {case}: ([^\n]*)", res.stdout))
    assert sorted(map(int, found)) == list(range(size)), res.describe()
    rows = []
    for r in range(size):
        words = found[str(r)].split()
        rows.append({k: int(v) for k, v in zip(words[::2], words[1::2], strict=True)})
    return rows


@pytest.mark.parametrize("size", [2, 3])
def test_uneven_calls_match_gloo_and_numpy(size: int) -> None:
    """all_to_all_single and all_to_all with zero splits, uneven all_gather and reduce_scatter."""
    res = job(size)
    passed(res, "uneven", size)
    assert res.returncode == 0, res.describe()


@pytest.mark.parametrize("size", [2, 3])
def test_skewed_all_to_all_single_moves_no_padding(size: int) -> None:
    """Each rank sends its payload and the count exchange, exactly: no block is padded."""
    counts = byte_counts(job(size), "all_to_all_single skewed", size)
    for c in counts:
        assert c["sent"] == c["payload"] + c["exchange"], counts
    # the one big block crosses once; padded to it, every rank would send it to every peer
    big_block = counts[0]["padded"] // (size - 1)
    assert sum(c["sent"] for c in counts) < big_block + 1024, counts


@pytest.mark.parametrize("size", [2, 3])
def test_object_collectives_through_the_communicator(size: int) -> None:
    """plait.torch.communicator()'s object collectives agree with torch's on gloo."""
    res = job(size)
    passed(res, "objects", size)
    counts = byte_counts(res, "all_gather_object skewed", size)
    # torch pads every rank's pickle to the largest (1 MiB): plait sends each at its size
    assert sum(c["plait"] for c in counts) < 0.6 * sum(c["torch"] for c in counts), counts
