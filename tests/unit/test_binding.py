"""Crowded ranks, one CPU each in turn (Note [binding crowded ranks] in plait._binding)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from plait import _binding

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def cpus(monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """Two CPUs (3 and 5) for the process; what a binding set, per call."""
    state: dict[str, object] = {"allowed": {3, 5}, "bound": []}

    def get(pid: int) -> set[int]:
        return set(state["allowed"])  # type: ignore[call-overload]

    def set_(pid: int, mask: set[int]) -> None:
        state["bound"].append(sorted(mask))  # type: ignore[attr-defined]

    monkeypatch.setattr(os, "sched_getaffinity", get, raising=False)
    monkeypatch.setattr(os, "sched_setaffinity", set_, raising=False)
    return state


def test_ranks_that_outnumber_the_cpus_take_one_each_in_turn(cpus: dict[str, object]) -> None:
    hosts = ["a", "b", "a", "a", "b"]  # host a: ranks 0, 2, 3 on its two CPUs
    got = [_binding.bind_crowded(r, hosts, {}) for r in (0, 2, 3)]
    assert got == [3, 5, 3]
    assert cpus["bound"] == [[3], [5], [3]]


def test_ranks_with_a_cpu_each_or_bind_0_are_left_alone(cpus: dict[str, object]) -> None:
    assert _binding.bind_crowded(0, ["a", "a", "b", "b"], {}) is None  # two on two CPUs
    assert _binding.bind_crowded(0, ["a"] * 4, {"PLAIT_BIND": "0"}) is None
    assert _binding.bind_crowded(0, ["a"] * 4, {"PLAIT_BIND": " False "}) is None  # bound
    cpus["allowed"] = {7}  # bound already (a launcher's binding): nothing to spread over
    assert _binding.bind_crowded(0, ["a"] * 4, {}) is None
    assert cpus["bound"] == []


@pytest.mark.multiprocess
@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux's CPU affinity and two CPUs",
)
def test_a_job_of_three_ranks_on_two_cpus_binds_them_in_turn(tmp_path: Path) -> None:
    # The launcher (and so every rank) may use two CPUs: ranks 0 and 2 share the first.
    two = sorted(os.sched_getaffinity(0))[:2]
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, numpy as np, plait
            comm = plait.init(timeout=60)
            mine = sorted(os.sched_getaffinity(0))
            got = comm.allgather(np.array(mine + [-1] * (2 - len(mine))))
            if comm.rank == 0:
                print("CPUS", got.tolist())
            comm.close()
            """
        )
    )
    # The launcher binds itself first (not preexec_fn: a fork of this process, where another
    # test may have imported JAX, warns), and its ranks inherit the two CPUs.
    launch = (
        f"import os, runpy, sys; os.sched_setaffinity(0, {set(two)}); "
        "sys.argv = ['plait', *sys.argv[1:]]; runpy.run_module('plait', run_name='__main__')"
    )
    res = subprocess.run(
        [sys.executable, "-c", launch, "run", "-n", "3", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr
    (line,) = [ln for ln in res.stdout.splitlines() if ln.startswith("CPUS")]
    assert line == f"CPUS {[[two[0], -1], [two[1], -1], [two[0], -1]]}"


def test_a_bind_setting_that_is_no_switch_is_refused() -> None:
    """PLAIT_BIND=maybe (or anything but 0) bound the ranks, unseen."""
    with pytest.raises(ValueError, match="PLAIT_BIND='maybe' is not a switch; expected 0 or 1"):
        _binding.bind_crowded(0, ["a"] * 4, {"PLAIT_BIND": "maybe"})
