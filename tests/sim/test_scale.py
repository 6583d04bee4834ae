"""Scale: thousands of ranks, timing only, with results checked against the formulas.

The slow runs take seconds each: ring on 1,024 ranks (4 M steps), the others
on 2,048. Recursive doubling, Swing and double binary tree on 16,384 ranks run
only with ``PLAIT_SIM_SCALE=full`` (with ring on 1,024 again: the times in
:mod:`plait.sim`). No test asserts a duration, since the machine is shared:
``tests/unit/test_schedule_scale.py`` counts the work instead.
"""

from __future__ import annotations

import os
import sys
import threading
import types

import pytest

from plait import sim
from plait.sim import formulas
from plait.sim.program import build_program, default_workers

A, B, G = 2e-6, 1e-10, 5e-11
FULL = os.environ.get("PLAIT_SIM_SCALE") == "full"


def run(algorithm: str, p: int, nbytes: int = 64 << 20) -> sim.Result:
    return sim.simulate("allreduce", algorithm, nbytes, sim.flat(p, A, B, G))


def expect(algorithm: str, p: int, nbytes: int = 64 << 20) -> float:
    formula = "rabenseifner" if algorithm == "swing" else algorithm
    return formulas.predict("allreduce", formula, p, nbytes, A, B, G, ports=True)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("algorithm", "p"), [("ring", 1024), ("recursive_doubling", 2048), ("swing", 2048)]
)
def test_large_flat_runs_match_the_formulas(algorithm: str, p: int) -> None:
    res = run(algorithm, p)
    assert res.time == pytest.approx(expect(algorithm, p), rel=1e-9)


def test_double_binary_tree_on_many_ranks() -> None:
    res = run("double_binary_tree", 2048)
    # Each half climbs and descends a tree of height about lg p: at least 2 lg p messages.
    assert res.time > 2 * 11 * (A + (32 << 20) * B)
    assert res.messages == 2 * (2048 - 1) * 2  # each tree: every edge once up, once down


def test_contended_fat_tree_at_scale() -> None:
    net = sim.fat_tree(1024, 32, sim.LinkParams(1e-6, 1e-10), oversubscription=4, spines=4)
    res = sim.simulate("allreduce", "recursive_doubling", 1 << 20, net)
    flat = sim.simulate("allreduce", "recursive_doubling", 1 << 20, sim.flat(1024, 2e-6, 1e-10))
    assert res.time > flat.time


def test_a_process_with_jax_builds_without_forking(monkeypatch: pytest.MonkeyPatch) -> None:
    """JAX runs threads Python does not count and warns at every fork: a process that had
    imported it forked its workers, and the warning failed the tests that ran after."""
    monkeypatch.setitem(sys.modules, "jax", types.ModuleType("jax"))
    assert default_workers() == 1


@pytest.mark.multiprocess
@pytest.mark.skipif(threading.active_count() > 1, reason="forking needs a single-threaded process")
@pytest.mark.skipif("jax" in sys.modules, reason="forking is refused once JAX is imported")
def test_building_in_workers_gives_the_same_program() -> None:
    kwargs = {"itemsize": 4, "segment": 1000}
    one = build_program("allreduce", "swing", 96, 96 * 5000, workers=1, **kwargs)
    two = build_program("allreduce", "swing", 96, 96 * 5000, workers=2, **kwargs)
    assert one.local.tolist() == two.local.tolist()
    for field in (
        "kind",
        "peer",
        "tag",
        "nbytes",
        "owner",
        "n_deps",
        "dep_ptr",
        "dep_idx",
        "match",
    ):
        assert getattr(one, field) == getattr(two, field), field


@pytest.mark.slow
@pytest.mark.skipif(not FULL, reason="full-size scale runs: set PLAIT_SIM_SCALE=full")
@pytest.mark.parametrize(
    ("algorithm", "p"),
    [
        ("ring", 1024),
        ("recursive_doubling", 16384),
        ("swing", 16384),
        ("double_binary_tree", 16384),
    ],
)
def test_full_scale(algorithm: str, p: int) -> None:
    res = run(algorithm, p)
    print(
        f"{algorithm} on {p} ranks: {res.steps} steps, build {res.build_seconds:.1f} s, "
        f"simulation {res.sim_seconds:.1f} s"
    )
    if algorithm != "double_binary_tree":
        assert res.time == pytest.approx(expect(algorithm, p), rel=1e-9)
