"""Restarts (``plait run --max-restarts K``, ``Job(max_restarts=K)``): a failed attempt is
reported as usual and every rank starts again, with a new store and job id, up to K times."""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from plait.launch import Job, launch

#: Rendezvous through a fresh store, allreduce, report; rank 1 fails on attempts before
#: FAIL_UNTIL (argv[1]). Every rank leaves a key in the store, which no later attempt sees.
FLAKY = """
    import os, sys, numpy as np, plait
    from plait.rendezvous.url import store_from_url

    restart = int(os.environ["PLAIT_RESTART_COUNT"])
    fail_until = int(sys.argv[1])
    store = store_from_url(os.environ["PLAIT_STORE"], rank=1, timeout=20)
    mine = "left-by-rank-" + os.environ["PLAIT_RANK"]
    stale = store.check([mine])
    store.set(mine, b"1")
    store.close()
    with plait.init(timeout=20) as comm:
        total = comm.allreduce(np.ones(1))[0]
        print(
            f"rank {comm.rank} attempt {restart} of {os.environ['PLAIT_MAX_RESTARTS']}"
            f" sum {total:g} stale {stale} job {os.environ['PLAIT_JOB_ID']}",
            flush=True,
        )
        comm.barrier()
    if comm.rank == 1 and restart < fail_until:
        sys.exit(3)
"""


def _job(tmp_path: Path, fail_until: int, max_restarts: int) -> Job:
    script = tmp_path / "flaky.py"
    script.write_text(textwrap.dedent(FLAKY))
    return Job(
        (sys.executable, "-u", str(script), str(fail_until)),
        nproc=2,
        max_restarts=max_restarts,
        timeout=20,
    )


def _attempts(out: str) -> list[tuple[int, int, str, str]]:
    """(rank, attempt, stale, job id) of every rank's report, in attempt order."""
    rows = []
    for line in out.splitlines():
        words = line.split()
        rows.append((int(words[1]), int(words[3]), words[9], words[11]))
        assert words[7] == "2", line  # the allreduce of that attempt reached both ranks
    return sorted(rows, key=lambda row: (row[1], row[0]))


@pytest.mark.timeout(90)
def test_a_job_that_fails_once_succeeds_on_its_restart(tmp_path: Path) -> None:
    out, err = io.StringIO(), io.StringIO()
    code = launch(_job(tmp_path, fail_until=1, max_restarts=2), stdout=out, stderr=err)
    assert code == 0, err.getvalue()
    rows = _attempts(out.getvalue())
    assert [(rank, attempt) for rank, attempt, _, _ in rows] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    # Nothing of attempt 0 is reused: a new store (its key is gone), a new job id.
    assert [stale for _, _, stale, _ in rows] == ["False"] * 4
    assert rows[0][3] == rows[1][3] != rows[2][3] == rows[3][3]
    lines = err.getvalue().splitlines()
    assert "plait run: rank 1 exited with code 3" in lines
    assert "plait run:   rank 1: exit 3   <- started the failure" in lines
    assert "plait run: restart 1 of 2: starting every rank again (PLAIT_RESTART_COUNT=1)" in lines
    assert not any("restart 2" in line for line in lines)


@pytest.mark.timeout(120)
def test_after_k_restarts_the_job_fails_with_the_usual_blame(tmp_path: Path) -> None:
    out, err = io.StringIO(), io.StringIO()
    code = launch(_job(tmp_path, fail_until=99, max_restarts=2), stdout=out, stderr=err)
    assert code == 3
    rows = _attempts(out.getvalue())
    assert sorted({attempt for _, attempt, _, _ in rows}) == [0, 1, 2]
    lines = err.getvalue().splitlines()
    assert lines.count("plait run:   rank 1: exit 3   <- started the failure") == 3
    assert [line for line in lines if "restart" in line] == [
        "plait run: restart 1 of 2: starting every rank again (PLAIT_RESTART_COUNT=1)",
        "plait run: restart 2 of 2: starting every rank again (PLAIT_RESTART_COUNT=2)",
        "plait run: no restarts left (2 of 2 used)",
    ]


def test_without_restarts_a_failure_ends_the_job_at_once(tmp_path: Path) -> None:
    out, err = io.StringIO(), io.StringIO()
    body = "import os, sys; print(os.environ['PLAIT_RESTART_COUNT']); sys.exit(4)"
    assert launch(Job((sys.executable, "-c", body)), stdout=out, stderr=err) == 4
    assert out.getvalue() == "0\n"
    assert "restart" not in err.getvalue()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_restarts": -1}, "max_restarts must be >= 0"),
        ({"max_restarts": 1, "nnodes": 2, "master_port": 9}, "one host"),
    ],
)
def test_restarts_that_cannot_be_are_refused(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Job(("true",), **kwargs)  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_plait_run_max_restarts(tmp_path: Path) -> None:
    script = tmp_path / "once.py"
    script.write_text(
        "import os, sys\n"
        "n = int(os.environ['PLAIT_RESTART_COUNT'])\n"
        "print('attempt', n, flush=True)\n"
        "sys.exit(7 if n == 0 else 0)\n"
    )
    run = [sys.executable, "-m", "plait", "run"]
    res = subprocess.run(
        [*run, "--max-restarts", "1", str(script)], capture_output=True, text=True, timeout=50
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == ["attempt 0", "attempt 1"]
    assert "plait run: restart 1 of 1" in res.stderr
    bad = subprocess.run(
        [*run, "--max_restarts", "1", "--nnodes", "2", "--master-port", "9", str(script)],
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert bad.returncode == 2
    assert "--max-restarts is for a job on one host" in bad.stderr
