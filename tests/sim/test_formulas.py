"""The simulator reproduces the α-β-γ formulas of Thakur, Rabenseifner and Gropp exactly.

On the flat network without pipelining (one segment), the simulated time of
plait's own schedules equals the closed forms registered with them
(``AlgorithmSpec.cost``, written next to each builder) to 1e-9 relative: on the
contention-free model for every covered algorithm and every p in 1..33, and
on the model with ports where the cost says they hold. Four regimes of
(α, β, γ, δ) make latency, bandwidth, reduction or copies dominate, so a
formula that is wrong in any term, or in any of the max() choices it makes,
fails somewhere. Element counts divide evenly among
the ranks and the virtual ranks (the formulas assume equal blocks).
"""

from __future__ import annotations

import math

import pytest

import plait
from plait import sim
from plait.algos._registry import COLLECTIVES, get, specs
from plait.algos.binomial import WORD_BYTES
from plait.algos.topology import pof2_floor
from plait.sim import formulas

REGIMES = {
    "latency": (7.3e-6, 1.3e-10, 2.9e-11, 1.7e-11),
    "bandwidth": (1.1e-7, 3.7e-10, 1.9e-10, 0.7e-10),
    "compute": (2.3e-7, 1.1e-10, 6.1e-10, 4.3e-10),
    "no-copy": (3.3e-6, 2.3e-10, 1.2e-10, 0.0),
}
SIZES = [*range(1, 18), 24, 31, 32, 33]
#: The quick loop (``-m "not slow"``) checks these; the full suite checks the rest of SIZES too.
QUICK_SIZES = [1, 2, 3, 4, 5, 7, 8, 17]
SIZE_SETS = [
    pytest.param(QUICK_SIZES, id="quick"),
    pytest.param([p for p in SIZES if p not in QUICK_SIZES], id="rest", marks=pytest.mark.slow),
]

#: What the paper covers and plait has: every one must have a formula.
PAPER = {
    ("allreduce", "recursive_doubling"),
    ("allreduce", "rabenseifner"),
    ("allreduce", "ring"),
    ("allreduce", "binomial"),
    ("reduce", "binomial"),
    ("reduce", "rabenseifner"),
    ("broadcast", "binomial"),
    ("broadcast", "scatter_allgather"),
    ("allgather", "ring"),
    ("allgather", "recursive_doubling"),
    ("allgather", "bruck"),
    ("reduce_scatter", "ring"),
    ("reduce_scatter", "recursive_halving"),
    ("reduce_scatter", "pairwise"),
    ("alltoall", "pairwise"),
}


def nbytes_for(collective: str, p: int, itemsize: int = 4) -> int:
    """A buffer whose blocks are equal for p ranks and for pof2_floor(p) virtual ranks."""
    count = math.lcm(p, pof2_floor(p)) * 12
    return count * itemsize * (p if collective in sim.BLOCK_COLLECTIVES else 1)


def check(collective: str, algorithm: str, p: int, *, ports: bool) -> None:
    n = nbytes_for(collective, p)
    for name, (a, b, g, d) in REGIMES.items():
        net = sim.flat(p, a, b, g, delta=d, ports=ports)
        got = sim.simulate(collective, algorithm, n, net).time
        cost = get(collective, algorithm).cost
        assert cost is not None
        want = cost.time(p, n, a, b, g, d, ports=ports)
        assert want is not None, (collective, algorithm, p, ports)
        assert got == pytest.approx(want, rel=1e-9, abs=0), (
            f"{collective}/{algorithm} p={p} {name} ports={ports}: "
            f"simulated {got!r}, formula {want!r}"
        )


def _paper(
    collective: str, algorithm: str, p: int, n: float, a: float, b: float, g: float
) -> float:
    """The paper's expressions as printed (p a power of two, n as in plait.sim)."""
    lg = math.log2(p)
    f = (p - 1) / p
    table = {
        ("allreduce", "recursive_doubling"): lg * a + n * lg * b + n * lg * g,
        ("allreduce", "rabenseifner"): 2 * lg * a + 2 * f * n * b + f * n * g,
        ("allreduce", "ring"): 2 * (p - 1) * a + 2 * f * n * b + f * n * g,
        ("allreduce", "binomial"): 2 * lg * a + 2 * lg * n * b + lg * n * g,
        # and the root's word, one element down a binomial tree (Note [the root's word])
        ("reduce", "binomial"): lg * (a + n * b + n * g) + lg * (a + WORD_BYTES * b),
        ("reduce", "rabenseifner"): 2 * lg * a
        + 2 * f * n * b
        + f * n * g
        + lg * (a + WORD_BYTES * b),
        ("broadcast", "binomial"): lg * (a + n * b),
        ("broadcast", "scatter_allgather"): (lg + p - 1) * a + 2 * f * n * b,
        ("allgather", "ring"): (p - 1) * a + f * n * b,
        ("allgather", "recursive_doubling"): lg * a + f * n * b,
        ("allgather", "bruck"): lg * a + f * n * b,
        ("reduce_scatter", "ring"): (p - 1) * a + f * n * b + f * n * g,
        ("reduce_scatter", "recursive_halving"): lg * a + f * n * b + f * n * g,
    }
    return table[(collective, algorithm)]


#: Where plait's schedule is not the paper's even with free copies, and why.
NOT_THE_PAPERS = {
    # Every message is posted at once, so latencies overlap: α + (n/p)β, not (p-1)α + ....
    ("reduce_scatter", "pairwise"),
    ("alltoall", "pairwise"),
}


#: (collective, algorithm) of every registration with a formula on each model.
COSTED = [(s.collective, s.name) for c in COLLECTIVES for s in specs(c) if s.cost is not None]
FLAT = sorted(k for k in COSTED if get(*k).cost.flat is not None)  # type: ignore[union-attr]
PORTS = sorted(k for k in COSTED if get(*k).cost.ports is not None)  # type: ignore[union-attr]


def test_every_paper_algorithm_has_a_formula() -> None:
    assert set(FLAT) >= PAPER
    for c, a in FLAT:
        assert a in plait.algorithms(c)


def test_sim_formulas_reads_the_registrations() -> None:
    """``plait.sim.formulas`` is the registrations' costs under their (collective, name)."""
    assert sorted(formulas.COVERED) == FLAT
    assert sorted(formulas.ON_PORTS) == PORTS
    for key in PORTS:
        cost = get(*key).cost
        assert cost is not None
        assert formulas.ON_PORTS[key] == (cost.ports, "pow2" if cost.ports_pow2 else "any")
    want = get("allreduce", "ring").cost.time(8, 1 << 20, 1e-6, 1e-9, 1e-10)  # type: ignore[union-attr]
    assert formulas.predict("allreduce", "ring", 8, 1 << 20, 1e-6, 1e-9, 1e-10) == want
    with pytest.raises(KeyError, match="no formula"):
        formulas.predict("allreduce", "direct", 8, 1 << 20, 1e-6, 1e-9, 1e-10)
    with pytest.raises(KeyError, match="with ports at p = 3"):
        formulas.predict("allreduce", "swing", 3, 1 << 20, 1e-6, 1e-9, 1e-10, ports=True)


@pytest.mark.parametrize(("collective", "algorithm"), sorted(PAPER - NOT_THE_PAPERS))
def test_the_papers_expressions_without_copies(collective: str, algorithm: str) -> None:
    """δ = 0, p = 2^k, contention-free: the simulator gives the paper's numbers verbatim."""
    for p in (1, 2, 4, 8, 16, 32):
        n = nbytes_for(collective, p)
        for a, b, g, _ in REGIMES.values():
            got = sim.simulate(collective, algorithm, n, sim.flat(p, a, b, g, delta=0, ports=False))
            assert got.time == pytest.approx(_paper(collective, algorithm, p, n, a, b, g), rel=1e-9)


@pytest.mark.parametrize("sizes", SIZE_SETS)
@pytest.mark.parametrize(("collective", "algorithm"), FLAT)
def test_contention_free(collective: str, algorithm: str, sizes: list[int]) -> None:
    for p in sizes:
        check(collective, algorithm, p, ports=False)


@pytest.mark.parametrize("sizes", SIZE_SETS)
@pytest.mark.parametrize(("collective", "algorithm"), PORTS)
def test_with_ports(collective: str, algorithm: str, sizes: list[int]) -> None:
    cost = get(collective, algorithm).cost
    assert cost is not None
    for p in sizes:
        if cost.ports_pow2 and p & (p - 1):
            continue
        check(collective, algorithm, p, ports=True)
