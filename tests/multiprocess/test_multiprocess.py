"""Real processes, started by ``plait run``, over shared memory and TCP.

Every collective and algorithm is checked against the numpy reference inside
the ranks (``rank_check.py``), for world sizes that are and are not powers of
two; plus the launcher's main job and failure behaviour with real collectives.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PLAIT = [sys.executable, "-m", "plait", "run"]


def plait_run(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*PLAIT, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


@pytest.mark.parametrize(
    ("transport", "nproc", "mode"),
    [
        *[("shm", n, "full") for n in (2, 3, 4, 5)],
        *[("tcp", n, "full") for n in (2, 3, 5)],
        ("shm", 8, "quick"),
        ("tcp", 7, "quick"),
    ],
)
def test_every_collective_matches_reference(transport: str, nproc: int, mode: str) -> None:
    res = plait_run(["-n", str(nproc), "--transport", transport, str(HERE / "rank_check.py"), mode])
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"on {nproc} ranks over" in res.stdout


def test_main_job_trains_identical_replicas() -> None:
    res = plait_run(["-n", "4", "examples/train_mlp.py", "--steps", "60"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert "replicas identical: True" in res.stdout


def test_dead_rank_makes_the_others_fail_fast(tmp_path: Path) -> None:
    script = tmp_path / "die.py"
    script.write_text(
        textwrap.dedent("""
        import os, numpy as np, plait
        comm = plait.init(timeout=120)
        comm.allreduce(np.ones(10))
        if comm.rank == 1:
            os._exit(7)  # dies without closing
        try:
            comm.allreduce(np.ones(1 << 20))
        except plait.PeerLostError as exc:
            print("lost:", exc, flush=True)
            raise SystemExit(5)
    """)
    )
    res = plait_run(["-n", "3", "--tag-output", str(script)], timeout=60)
    assert res.returncode in (5, 7)
    assert "rank 1 exited with code 7" in res.stderr or "lost:" in res.stdout


def test_no_shared_memory_left_behind() -> None:
    leftovers = [p for p in os.listdir("/dev/shm") if p.startswith("plait")]
    assert leftovers == []
