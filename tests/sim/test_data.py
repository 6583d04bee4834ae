"""With data: real arrays move through the same schedules, and every result matches numpy."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import plait
from plait import sim
from plait.algos._registry import COLLECTIVES, REDUCING, specs
from plait.schedule.builder import Builder, Context
from plait.sim.engine import Data, run_schedules

LINK = sim.LinkParams(1e-6, 1e-9)
# in_network needs aggregating switches: tests/sim/test_in_network.py runs it with data
SPECS = [s for c in COLLECTIVES for s in specs(c) if not s.needs_fabric]


def networks(p: int) -> list[sim.Network]:
    return [
        sim.flat(p, 1e-6, 1e-9, 1e-10),
        sim.fat_tree(p, 3, LINK, oversubscription=2, spines=2),
        sim.torus((p,), LINK),
    ]


def window(spec: plait.algos.AlgorithmSpec) -> int:
    """The window a one-sided algorithm needs (the ranks share one host); 0 for the others."""
    return 1 << 20 if spec.needs_window else 0


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.collective}-{s.name}")
def test_every_algorithm_matches_the_reference(spec: plait.algos.AlgorithmSpec) -> None:
    c = spec.collective
    for p in (1, 2, 3, 5, 8, 12):
        for net in networks(p):
            for nbytes in (0, 4, 4 * p * 7 + 4):
                roots = (
                    sorted({0, p - 1}) if c in ("reduce", "broadcast", "gather", "scatter") else [0]
                )
                for root in roots:
                    sim.simulate(
                        c,
                        spec.name,
                        nbytes,
                        net,
                        dtype=np.int32,
                        with_data=True,
                        root=root,
                        window=window(spec),
                    )
        # Segmented, on one network.
        sim.simulate(
            c,
            spec.name,
            4 * p * 9,
            networks(p)[0],
            dtype=np.int64,
            with_data=True,
            segment_bytes=16,
            window=window(spec),
        )


@pytest.mark.parametrize("name", ["hierarchical", "cascade", "ring", "direct"])
def test_host_aware_allreduce_on_hosts(name: str) -> None:
    for hosts, local, nics in ((2, 2, 1), (3, 4, 2), (4, 3, 1)):
        net = sim.hosts(hosts, local, sim.LinkParams(1e-7, 1e-10), LINK, nics=nics)
        for segment in (0, 64):
            res = sim.simulate(
                "allreduce",
                name,
                4 * 999,
                net,
                dtype=np.int64,
                with_data=True,
                segment_bytes=segment,
            )
            assert res.bytes_by_class()["inter"] > 0


def first(x: np.ndarray, y: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``x ∘ y = x``: associative, not commutative; the fold over ranks is rank 0's input."""
    out[...] = x
    return out


@pytest.mark.parametrize("c", sorted(REDUCING))
def test_non_commutative_ops_keep_rank_order(c: str) -> None:
    op = plait.Op(first, commutative=False, name="first")
    for spec in specs(c):
        if spec.commutative_only:
            with pytest.raises(ValueError, match="commutative"):
                sim.simulate(c, spec.name, 64, sim.flat(4, 1e-6, 1e-9), op=op)
            continue
        for p in (2, 3, 6):
            res = sim.simulate(
                c,
                spec.name,
                4 * p * 5,
                sim.flat(p, 1e-6, 1e-9),
                dtype=np.int32,
                op=op,
                with_data=True,
                window=window(spec),
            )
            assert res.outputs is not None


def test_average_and_floats() -> None:
    res = sim.simulate(
        "allreduce",
        "ring",
        8 * 6 * 10,
        sim.flat(6, 1e-6, 1e-9),
        dtype=np.float64,
        op=plait.AVG,
        with_data=True,
    )
    assert res.outputs is not None
    assert res.outputs[0] is not None
    assert res.outputs[0].dtype == np.float64


def test_given_inputs() -> None:
    xs = [np.full(4, r + 1, dtype=np.int64) for r in range(3)]
    res = sim.simulate(
        "allreduce",
        "recursive_doubling",
        32,
        sim.flat(3, 1e-6, 1e-9),
        dtype=np.int64,
        with_data=True,
        inputs=xs,
    )
    assert res.outputs is not None
    for out in res.outputs:
        assert out is not None
        assert out.tolist() == [6, 6, 6, 6]
    with pytest.raises(ValueError, match="elements"):
        sim.simulate(
            "allreduce",
            "ring",
            32,
            sim.flat(3, 1e-6, 1e-9),
            dtype=np.int64,
            with_data=True,
            inputs=[np.zeros(3)] * 3,
        )


def test_a_write_over_data_in_flight_is_caught() -> None:
    """A send reads its region when it completes, so a missing dependency shows in the data."""

    def schedules(drop: bool) -> list:
        out = []
        for r in range(2):
            b = Builder(Context("allreduce", r, 2, 4), 4, 4)
            if r == 0:
                b.copy(b.inp, b.out)
                b.send(1, b.out)
                b.reduce(b.inp, b.out, src_first=True)  # must wait for the send (WAR)
            else:
                b.recv(0, b.out)
            s = b.build()
            if drop and r == 0:
                steps = list(s.steps)
                steps[2] = dataclasses.replace(steps[2], deps=(0,))
                s = dataclasses.replace(
                    s, steps=tuple(steps), n_deps=(0, 1, 1), dependents=((1, 2), (), ())
                )
            out.append(s)
        return out

    for drop, want in ((False, [5, 5, 5, 5]), (True, [10, 10, 10, 10])):
        bufs = [
            (np.full(4, 5, np.int64), np.zeros(4, np.int64), np.zeros(0, np.int64))
            for _ in range(2)
        ]
        run_schedules(
            schedules(drop), sim.flat(2, 1e-6, 1e-9, gamma=1e-12), 8, data=Data(bufs, np.add)
        )
        assert bufs[1][1].tolist() == want
