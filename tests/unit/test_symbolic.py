"""Every registered algorithm proves its collective's postcondition for p = 1..33.

Counts {0, 1, p-1, p, p+1, a large odd number} up to 17 ranks, {1, p+1, the odd one}
above (the edge counts behave alike at every p; what a larger p brings is its shape);
every root for rooted collectives at a few positions; rank order for non-commutative
ops where the algorithm allows them; aliased IN/OUT (``out=x``) where the algorithm claims it;
and a segmented build. ``prove`` also runs the static checks (bounds, matching
sends and receives, no deadlock under zero buffering).
"""

from __future__ import annotations

from typing import Any

import pytest

from plait.algos._registry import (
    COLLECTIVES,
    REDUCING,
    UNEVEN_COLLECTIVES,
    AlgorithmSpec,
    algorithms,
    build_schedule,
    specs,
)
from plait.schedule.builder import Context, record
from plait.schedule.symbolic import prove

ROOTED = {"reduce", "broadcast", "gather", "scatter"}
IN_PLACE = {"allreduce", "reduce", "alltoall"}
BIG_ODD = 131

# in_network needs a fabric of switches: proven in tests/sim/test_in_network.py
SPECS = [spec for c in COLLECTIVES for spec in specs(c) if not spec.needs_fabric]


def counts(p: int) -> list[int]:
    return sorted({0, 1, max(p - 1, 0), p, p + 1, BIG_ODD})


#: World sizes the quick loop proves (``-m "not slow"``); the full suite proves 1..33.
QUICK_SIZES = {1, 2, 3, 4, 5, 7}


def _cases() -> list[Any]:
    cases = []
    for spec in SPECS:
        for p in range(1, 34):
            marks = () if p in QUICK_SIZES else (pytest.mark.slow,)
            cases.append(
                pytest.param(spec, p, marks=marks, id=f"{spec.collective}-{spec.name}-{p}")
            )
    return cases


@pytest.mark.parametrize(("spec", "size"), _cases())
def test_postcondition(spec: AlgorithmSpec, size: int) -> None:
    roots = sorted({0, size // 2, size - 1}) if spec.collective in ROOTED else [0]
    sizes = counts(size)
    if size > 17:
        # Above 17 ranks the shapes of p are what is new (trees and rings around 32), not the
        # edge counts, which every p <= 17 proves: one element (most ranks' blocks empty), one
        # left over and a large odd count. One-sided schedules have no tree or ring that
        # changes shape with p: the last two suffice (small windows in test_arena.py).
        sizes = [size + 1, BIG_ODD] if spec.needs_window else [1, size + 1, BIG_ODD]
    # The registry's cached schedules, which the executor runs: the in-place proof reuses
    # the ones the plain proof built.
    for count in sizes:
        for root in roots:
            prove(spec, size, count, root=root, build=build_schedule)
            if spec.collective in REDUCING and not spec.commutative_only:
                prove(spec, size, count, root=root, commutative=False, build=build_schedule)
            if spec.in_place and spec.collective in IN_PLACE:
                prove(spec, size, count, root=root, in_place=True, build=build_schedule)
    if size <= 17 or size == 33:
        prove(spec, size, BIG_ODD, root=roots[-1], segment=7)


def test_every_collective_has_algorithms() -> None:
    for c in COLLECTIVES:
        assert algorithms(c), c


def layouts(p: int) -> list[list[int] | None]:
    """Host layouts: none, contiguous hosts of 2 and 3, interleaved, and uneven."""
    out: list[list[int] | None] = [None, [r // 2 for r in range(p)], [r // 3 for r in range(p)]]
    out.append([r % 3 for r in range(p)])  # ranks of a host are not contiguous
    out.append([0 if r < p // 2 + 1 else 1 + r % 2 for r in range(p)])  # hosts of unequal size
    return out


@pytest.mark.parametrize(
    "size",
    [
        p if p in QUICK_SIZES else pytest.param(p, marks=pytest.mark.slow)
        for p in [*range(1, 18), 24, 33]
    ],
)
@pytest.mark.parametrize("name", ["hierarchical", "cascade"])
def test_host_aware_algorithms_on_every_layout(name: str, size: int) -> None:
    from plait.algos._registry import get

    spec = get("allreduce", name)
    for hosts in layouts(size):
        for count in counts(size):
            prove(spec, size, count, hosts=hosts)
            prove(spec, size, count, hosts=hosts, in_place=True)
        prove(spec, size, BIG_ODD, hosts=hosts, segment=8)


#: Every algorithm but the simulator's; a one-sided one builds without a window only where
#: it has nothing to move (it refuses a call without one otherwise).
ALL_SPECS = [
    spec
    for c in (*COLLECTIVES, *UNEVEN_COLLECTIVES)
    for spec in specs(c)
    if not spec.needs_fabric and not (spec.needs_window and c == "barrier")
]


@pytest.mark.parametrize("spec", ALL_SPECS, ids=lambda s: f"{s.collective}-{s.name}")
@pytest.mark.parametrize("window", [0, 1 << 40], ids=["messages", "window"])
def test_a_call_that_moves_nothing_meets_its_peers(spec: AlgorithmSpec, window: int) -> None:
    # Note [empty calls meet] in plait.algos._presence: proven with and without a window
    # (messages over TCP and in the simulator, a post where every rank shares the window),
    # and every rank of more than one records steps.
    for size in range(1, 10):
        ctx_counts = [0] * size if spec.collective in UNEVEN_COLLECTIVES else None
        if spec.collective == "alltoallv":
            ctx_counts = [0] * (size * size)
        for root in sorted({0, size - 1}):
            prove(spec, size, 0, root=root, counts=ctx_counts, window=window)
        if size > 1:
            ctx = Context(spec.collective, 0, size, 0, counts=_tuple(ctx_counts), window=window)
            assert record(spec.build, ctx).steps, (spec.name, size)


def _tuple(counts: list[int] | None) -> tuple[int, ...] | None:
    return None if counts is None else tuple(counts)
