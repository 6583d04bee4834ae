"""The uneven collectives in the simulator: real data through every algorithm, and their costs.

``simulate(..., counts=...)`` builds the schedules with per-rank counts, moves
seeded random data and checks every rank's result against the table's
reference (zeros among the counts, rooted calls at both ends, segmented,
rank order for a non-commutative op). Without counts an uneven collective is
its even twin sized by ``nbytes``, and the twin's closed form holds for it.
"""

from __future__ import annotations

import numpy as np
import pytest

import plait
from plait import sim
from plait.algos._registry import UNEVEN_COLLECTIVES, AlgorithmSpec, specs
from plait.collectives import TABLE

SPECS = [s for c in UNEVEN_COLLECTIVES for s in specs(c)]
LINK = sim.LinkParams(1e-6, 1e-9)


def random_counts(collective: str, p: int, seed: int) -> list[int]:
    uneven = TABLE[collective].uneven
    assert uneven is not None
    rng = np.random.default_rng(seed)
    return [int(c) for c in rng.choice([0, 0, 1, 3, 7, 16], uneven.length(p))]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.collective}-{s.name}")
def test_every_uneven_algorithm_matches_the_reference(spec: AlgorithmSpec) -> None:
    c = spec.collective
    roots = [0, -1] if TABLE[c].rooted else [0]
    for p in (1, 2, 3, 5, 8):
        nets = [sim.flat(p, 1e-6, 1e-9, 1e-10), sim.fat_tree(p, 3, LINK, spines=2)]
        for seed in range(3):
            counts = random_counts(c, p, seed)
            for net in nets:
                for root in roots:
                    res = sim.simulate(
                        c,
                        spec.name,
                        0,
                        net,
                        dtype=np.int32,
                        with_data=True,
                        root=root % p,
                        counts=counts,
                    )
                    assert res.outputs is not None
                    assert res.nbytes == 4 * TABLE[c].uneven_whole(p, tuple(counts))
        sim.simulate(
            c,
            spec.name,
            0,
            nets[0],
            dtype=np.float64,
            with_data=True,
            segment_bytes=16,
            counts=random_counts(c, p, 7),
        )
        sim.simulate(c, spec.name, 0, nets[0], with_data=True, counts=[0] * len(counts))


def first(x: np.ndarray, y: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``x ∘ y = x``: associative, not commutative; the fold over ranks is rank 0's input."""
    out[...] = x
    return out


def test_non_commutative_reduce_scatterv_keeps_rank_order() -> None:
    op = plait.Op(first, commutative=False, name="first")
    net = sim.flat(3, 1e-6, 1e-9)
    with pytest.raises(ValueError, match="commutative"):
        sim.simulate("reduce_scatterv", "ring", 0, net, op=op, counts=[1, 2, 3])
    for p in (2, 3, 6):
        res = sim.simulate(
            "reduce_scatterv",
            "pairwise",
            0,
            sim.flat(p, 1e-6, 1e-9),
            dtype=np.int32,
            op=op,
            with_data=True,
            counts=random_counts("reduce_scatterv", p, p),
        )
        assert res.outputs is not None


def test_given_inputs_and_bad_counts() -> None:
    net = sim.flat(3, 1e-6, 1e-9)
    xs = [np.arange(2.0), np.arange(0.0), np.arange(1.0) + 5]
    res = sim.simulate("allgatherv", "ring", 0, net, with_data=True, inputs=xs, counts=[2, 0, 1])
    assert res.outputs is not None
    assert [list(o) for o in res.outputs if o is not None] == [[0.0, 1.0, 5.0]] * 3
    with pytest.raises(ValueError, match="call needs 1"):
        sim.simulate("allgatherv", "ring", 0, net, with_data=True, inputs=xs, counts=[2, 1, 1])
    with pytest.raises(ValueError, match="needs 3 counts"):
        sim.simulate("allgatherv", "ring", 0, net, counts=[2, 1])
    with pytest.raises(ValueError, match="takes one count"):
        sim.simulate("allgather", "ring", 64, net, counts=[2, 1, 1])


@pytest.mark.parametrize(
    "spec", [s for s in SPECS if s.cost is not None], ids=lambda s: f"{s.collective}-{s.name}"
)
def test_the_even_twins_formula_holds_for_equal_counts(spec: AlgorithmSpec) -> None:
    cost = spec.cost
    assert cost is not None
    for p in (1, 2, 3, 4, 5, 8):
        n = 4 * p * 24
        for ports in (False, True):
            net = sim.flat(p, 3.3e-6, 2.3e-10, 1.2e-10, delta=0.7e-10, ports=ports)
            got = sim.simulate(spec.collective, spec.name, n, net).time
            want = cost.time(p, n, 3.3e-6, 2.3e-10, 1.2e-10, 0.7e-10, ports=ports)
            assert want is not None
            assert got == pytest.approx(want, rel=1e-9, abs=0), (spec.name, p, ports)
            k = n // 4 // p
            counts = [k] * TABLE[spec.collective].uneven.length(p)  # type: ignore[union-attr]
            given = sim.simulate(spec.collective, spec.name, 0, net, counts=counts).time
            assert given == got
