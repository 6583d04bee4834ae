"""Every registered algorithm proves its collective's postcondition for p = 1..33.

Counts {0, 1, p-1, p, p+1, a large odd number} up to 17 ranks, {1, p+1, the odd one}
above (the edge counts behave alike at every p; what a larger p brings is its shape);
every root for rooted collectives at a few positions; rank order for non-commutative
ops where the algorithm allows them; aliased IN/OUT (``out=x``) where the algorithm claims it;
and a segmented build. ``prove`` also runs the static checks (bounds, matching
sends and receives, no deadlock under zero buffering), and with ``agreement=True``
checks that every rank heard from whom it must so that ranks which disagree on the
call find out (``symbolic.must_hear``: the witness, the root's word, tokens, empty
calls that meet). The host-aware allreduces are proven on every host layout, with
slices that cross hosts by recursive doubling and (a wider item) by ring.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest

from plait.algos import _rooted, hierarchical
from plait.algos._registry import (
    COLLECTIVES,
    REDUCING,
    UNEVEN_COLLECTIVES,
    AlgorithmSpec,
    algorithms,
    build_schedule,
    get,
    specs,
)
from plait.algos.binomial import binomial_bcast, relative_group
from plait.algos.uneven import uneven_blocks
from plait.schedule.builder import Builder, Context, HostLayout, record
from plait.schedule.symbolic import prove, witness
from plait.schedule.verify import ScheduleError

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
            prove(spec, size, count, root=root, build=build_schedule, agreement=True)
            if spec.collective in REDUCING and not spec.commutative_only:
                prove(spec, size, count, root=root, commutative=False, build=build_schedule)
            if spec.in_place and spec.collective in IN_PLACE:
                prove(spec, size, count, root=root, in_place=True, build=build_schedule)
    if size <= 17 or size == 33:
        prove(spec, size, BIG_ODD, root=roots[-1], segment=7, agreement=True)


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
    spec = get("allreduce", name)
    for hosts in layouts(size):
        for count in counts(size):
            prove(spec, size, count, hosts=hosts, agreement=True)
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
            prove(spec, size, 0, root=root, counts=ctx_counts, window=window, agreement=True)
        if size > 1:
            ctx = Context(spec.collective, 0, size, 0, counts=_tuple(ctx_counts), window=window)
            assert record(spec.build, ctx).steps, (spec.name, size)


def _tuple(counts: list[int] | None) -> tuple[int, ...] | None:
    return None if counts is None else tuple(counts)


# -- slices that cross hosts by ring ---------------------------------------------------------

#: An item so wide that every slice but an empty one is at least INNER_RD_BYTES.
WIDE = hierarchical.INNER_RD_BYTES
#: The window prove gives each rank by default (bytes).
WINDOW = 1 << 40


@pytest.mark.parametrize(
    "size",
    [
        p if p in QUICK_SIZES else pytest.param(p, marks=pytest.mark.slow)
        for p in [*range(2, 10), 12, 17, 24, 33]
    ],
)
@pytest.mark.parametrize("name", ["hierarchical", "hierarchical_arena", "cascade_arena"])
def test_wide_slices_cross_hosts_by_ring_on_every_layout(name: str, size: int) -> None:
    # Proofs run with one-byte items, so a slice crosses hosts by recursive doubling unless
    # it is INNER_RD_BYTES or more (hierarchical._cross): the ring across hosts is proven
    # here, with items that wide, on every layout of more than one host.
    spec = get("allreduce", name)
    for hosts in layouts(size)[1:]:
        for count in (1, size - 1, size + 1, BIG_ODD):
            prove(spec, size, count, hosts=hosts, itemsize=WIDE, agreement=True)
            prove(spec, size, count, hosts=hosts, itemsize=WIDE, in_place=True)
        prove(spec, size, BIG_ODD, hosts=hosts, itemsize=WIDE, segment=8)


@pytest.mark.parametrize("name", ["hierarchical", "hierarchical_arena", "cascade_arena"])
def test_the_item_width_picks_the_inner_algorithm(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wide proofs take the ring across hosts, the narrow ones recursive doubling."""
    rings: list[int] = []
    ring = hierarchical._cross_ring

    def counted(b: Builder, *args: Any) -> None:
        rings.append(b.rank)
        ring(b, *args)

    monkeypatch.setattr(hierarchical, "_cross_ring", counted)
    spec = get("allreduce", name)
    layout = HostLayout([r // 2 for r in range(6)])
    # 12 elements, 2 ranks on each host: slices of 6, by ring from INNER_RD_BYTES on.
    edge = -(-hierarchical.INNER_RD_BYTES // 6)
    for itemsize, want in ((1, False), (edge - 1, False), (edge, True), (WIDE, True)):
        rings.clear()
        for r in range(6):
            record(
                spec.build, Context("allreduce", r, 6, 12, itemsize, hosts=layout, window=WINDOW)
            )
        assert bool(rings) is want, (itemsize, rings)


# -- whom a rank must have heard from --------------------------------------------------------


class _Recipe(NamedTuple):
    collective: str
    name: str
    build: Callable[[Builder], None]


def _without_the_witness(b: Builder) -> None:
    """broadcast binomial without the witness's message to the root."""
    ctx = b.ctx
    binomial_bcast(
        b, relative_group(ctx.root, ctx.size), (ctx.rank - ctx.root) % ctx.size, b.out, ctx.segment
    )


def _without_tokens(b: Builder) -> None:
    """allgatherv direct whose ranks without rows send nothing (no token)."""
    ctx = b.ctx
    blocks = uneven_blocks(b.out, ctx.block_counts())
    b.copy(b.inp, blocks[ctx.rank])
    for q in range(ctx.size):
        if q != ctx.rank:
            b.send(q, b.inp)
            b.recv(q, blocks[q])


def _unwrapped(collective: str, name: str) -> _Recipe:
    """A registered builder without what its wrappers add: the root's word, the meeting of
    an empty call."""
    return _Recipe(collective, name, inspect.unwrap(get(collective, name).build))


_HEARS_TOO_LITTLE = [
    (_Recipe("broadcast", "no_witness", _without_the_witness), 3, None, "the root's witness"),
    (_unwrapped("reduce", "binomial"), 3, None, "the root's word"),
    (_unwrapped("gather", "binomial"), 3, None, "the root's word"),
    (_unwrapped("gatherv", "direct"), 0, (2, 0, 1), "the root's word"),
    (_Recipe("allgatherv", "no_tokens", _without_tokens), 0, (2, 0, 1), "every rank shares"),
    (_unwrapped("allreduce", "ring"), 0, None, "moves nothing"),
]


@pytest.mark.parametrize(
    ("recipe", "count", "counts", "rule"),
    [pytest.param(*case, id=f"{case[0].collective}-{case[0].name}") for case in _HEARS_TOO_LITTLE],
)
def test_agreement_catches_a_rank_that_hears_too_little(
    recipe: _Recipe, count: int, counts: tuple[int, ...] | None, rule: str
) -> None:
    # Each result is right without the message that lets ranks which disagree find out:
    # only the agreement check sees it missing.
    for root in range(3):
        prove(recipe, 3, count, root=root, counts=counts)
        with pytest.raises(ScheduleError, match=rf"can leave before hearing from .*{rule}"):
            prove(recipe, 3, count, root=root, counts=counts, agreement=True)


def test_the_provers_witness_is_the_rank_the_builders_send_from() -> None:
    for p in range(2, 34):
        for root in range(p):
            assert witness(root, p) == _rooted.witness(root, p)
