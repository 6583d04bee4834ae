"""Every algorithm of an uneven collective proves its postcondition for p = 1..33.

The uneven collectives (allgatherv, gatherv, scatterv, alltoallv,
reduce_scatterv) carry per-rank counts (``Context.counts``). For each world
size a few seeded random count vectors (or alltoallv matrices) are proven:
all zeros, mostly zeros, small counts with zeros among them, one large odd
count among small ones, and equal counts; every root at a few positions for
the rooted ones, rank order for a non-commutative op where the algorithm
allows it, and a segmented build; for an algorithm correct in place, every set
again with ``IN`` and ``OUT`` one memory on each rank where they have one length,
as an ``out=x`` call runs (and sets where one rank holds every row, so that such a
rank moves rows). With equal counts each builder must record exactly its even
twin's schedule, which is what lets it carry the twin's closed-form cost.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from plait.algos._registry import (
    COLLECTIVES,
    UNEVEN_COLLECTIVES,
    AlgorithmSpec,
    algorithms,
    build_schedule,
    get,
    specs,
)
from plait.collectives import TABLE
from plait.schedule.builder import Builder, Context, record
from plait.schedule.symbolic import prove
from plait.schedule.verify import ScheduleError

SPECS = [spec for c in UNEVEN_COLLECTIVES for spec in specs(c)]
BIG_ODD = 131

#: World sizes the quick loop proves (``-m "not slow"``); the full suite proves 1..33.
QUICK_SIZES = {1, 2, 3, 4, 5, 7}
PROVED_SIZES = [
    p if p in QUICK_SIZES else pytest.param(p, marks=pytest.mark.slow) for p in range(1, 34)
]


def count_sets(collective: str, size: int) -> list[tuple[int, ...]]:
    """Seeded random counts for ``size`` ranks, zeros included (see the module docstring)."""
    uneven = TABLE[collective].uneven
    assert uneven is not None
    n = uneven.length(size)
    rng = random.Random(f"{collective}-{size}")
    sets = [
        (0,) * n,
        tuple(rng.choice((0, 0, 0, 1)) for _ in range(n)),
        tuple(rng.choice((0, 1, 2, 3, 5, 8)) for _ in range(n)),
        tuple(BIG_ODD if i == rng.randrange(n) else rng.randrange(4) for i in range(n)),
        (size + 1,) * n,
    ]
    return list(dict.fromkeys(sets))


def in_place_sets(collective: str, size: int) -> list[tuple[int, ...]]:
    """Counts under which ranks' ``IN`` and ``OUT`` have one length, so that an ``out=x``
    call runs on one memory (:mod:`plait._request` aliases them only where the lengths are
    equal).

    One rank holds every row (allgatherv and reduce_scatterv: that rank; gatherv and
    scatterv: the root, whose peers have none), at a few positions; for a matrix, a
    symmetric one (every rank sends as much as it receives).
    """
    uneven = TABLE[collective].uneven
    assert uneven is not None
    if uneven.matrix:
        rng = random.Random(f"{collective}-{size}-in-place")
        m = [[0] * size for _ in range(size)]
        for i in range(size):
            for j in range(i, size):
                m[i][j] = m[j][i] = rng.choice((0, 3) if i == j else (1, 2, 5))
        return [tuple(n for row in m for n in row)]
    return [
        tuple(size + 1 if q == j else 0 for q in range(size))
        for j in sorted({0, size // 2, size - 1})
    ]


@pytest.mark.parametrize("size", PROVED_SIZES)
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.collective}-{s.name}")
def test_postcondition(spec: AlgorithmSpec, size: int) -> None:
    c = TABLE[spec.collective]
    roots = sorted({0, size // 2, size - 1}) if c.rooted else [0]
    sets = count_sets(spec.collective, size)
    for counts in sets:
        for root in roots:
            prove(spec, size, 0, root=root, counts=counts, agreement=True)
            if c.reduces and not spec.commutative_only:
                prove(spec, size, 0, root=root, counts=counts, commutative=False)
    prove(spec, size, 0, root=roots[-1], counts=sets[3 % len(sets)], segment=2)
    if spec.in_place:
        # Aliased on every rank whose IN and OUT have one length, as the edge runs out=x.
        for counts in [*sets, *in_place_sets(spec.collective, size)]:
            for root in roots:
                prove(spec, size, 0, root=root, counts=counts, in_place=True)


@pytest.mark.parametrize(
    "spec", [s for s in SPECS if s.in_place], ids=lambda s: f"{s.collective}-{s.name}"
)
def test_in_place_proofs_alias_ranks_that_have_rows(spec: AlgorithmSpec) -> None:
    """The in-place proofs alias memory that holds rows, not only empty buffers."""
    c = TABLE[spec.collective]
    for p in range(2, 8):
        roots = sorted({0, p // 2, p - 1}) if c.rooted else [0]
        aliased = {
            r
            for counts in in_place_sets(spec.collective, p)
            for root in roots
            for r in range(p)
            if (n := c.buffer_counts(p, 0, r, root, counts))[0] == n[1] > 0
        }
        assert aliased, (spec.name, p)


def test_alltoallv_pairwise_is_wrong_in_place() -> None:
    # Why it copies its input in place (in_place=False): a block's send from IN and the
    # receive into OUT at the same place are not ordered.
    spec = get("alltoallv", "pairwise")
    assert not spec.in_place
    for p in (2, 3):
        (counts,) = in_place_sets("alltoallv", p)
        prove(spec, p, 0, counts=counts)
        with pytest.raises(ScheduleError, match="IN and OUT are one memory in place"):
            prove(spec, p, 0, counts=counts, in_place=True)


def test_every_uneven_collective_has_algorithms_and_stays_out_of_listings() -> None:
    assert UNEVEN_COLLECTIVES == (
        "allgatherv",
        "gatherv",
        "scatterv",
        "alltoallv",
        "reduce_scatterv",
    )
    assert not set(UNEVEN_COLLECTIVES) & set(COLLECTIVES)
    for c in UNEVEN_COLLECTIVES:
        assert algorithms(c), c
    assert set(algorithms("allgatherv")) == {"ring", "direct"}
    assert set(algorithms("gatherv")) == set(algorithms("scatterv")) == {"direct", "binomial"}
    assert set(algorithms("alltoallv")) == {"pairwise"}
    assert set(algorithms("reduce_scatterv")) == {"ring", "pairwise"}


@pytest.mark.parametrize(
    "spec", [s for s in SPECS if s.cost is not None], ids=lambda s: f"{s.collective}-{s.name}"
)
def test_equal_counts_build_the_even_twins_schedule(spec: AlgorithmSpec) -> None:
    """Equal counts, given or not, record the even twin's schedule: its cost formula holds."""
    c = TABLE[spec.collective]
    assert c.uneven is not None
    twin = get(c.uneven.even, spec.name)
    assert spec.cost == twin.cost
    for p in (1, 2, 3, 4, 7):
        for k in (0, 1, 5):
            for segment in (0, 2):
                even = Context(twin.collective, 0, p, k, segment=segment)
                none = Context(spec.collective, 0, p, k, segment=segment)
                given = Context(
                    spec.collective, 0, p, 0, segment=segment, counts=c.even_counts(p, k)
                )
                for r in range(p):
                    want = build_schedule(twin, even.with_rank(r))
                    assert build_schedule(spec, none.with_rank(r)) == want
                    assert build_schedule(spec, given.with_rank(r)) == want


def test_counts_are_checked() -> None:
    spec = get("allgatherv", "ring")
    with pytest.raises(ValueError, match="needs 3 counts"):
        record(spec.build, Context("allgatherv", 0, 3, 0, counts=(1, 2)))
    with pytest.raises(ValueError, match="needs 4 counts"):
        record(get("alltoallv", "pairwise").build, Context("alltoallv", 0, 2, 0, counts=(1, 2)))
    with pytest.raises(ValueError, match=">= 0"):
        prove(spec, 2, 0, counts=(1, -1))
    with pytest.raises(ValueError, match="takes one count"):
        record(get("allgather", "ring").build, Context("allgather", 0, 2, 1, counts=(1, 1)))


def test_contexts_with_counts_are_cache_keys() -> None:
    spec = get("allgatherv", "ring")
    a = Context("allgatherv", 1, 3, 0, counts=(2, 0, 1))
    b = Context("allgatherv", 0, 3, 0, counts=(2, 0, 1)).with_rank(1)
    assert a == b
    assert hash(a) == hash(b)
    assert build_schedule(spec, a) is build_schedule(spec, b)
    assert build_schedule(spec, a).out_count == 3
    assert build_schedule(spec, Context("allgatherv", 1, 3, 0, counts=(2, 0, 2))).out_count == 4


@dataclass(frozen=True)
class _EvenLayout:
    """allgatherv that ignores the counts and lays blocks out as allgather would (wrong)."""

    collective: str = "allgatherv"
    name: str = "even_layout"

    @staticmethod
    def build(b: Builder) -> None:
        ctx = b.ctx
        k = ctx.block_counts()[ctx.rank]
        p = ctx.size
        b.copy(b.inp, b.out.sub(min(ctx.rank * k, b.out.count - k), k))
        for s in range(1, p):
            b.send((ctx.rank + s) % p, b.inp)


def test_the_proof_catches_a_builder_that_ignores_the_counts() -> None:
    with pytest.raises(ScheduleError):
        prove(_EvenLayout(), 3, 0, counts=(2, 0, 1))


def test_readme_table_lists_exactly_the_uneven_algorithms() -> None:
    """As tests/unit/test_docs.py does for the even collectives."""
    from pathlib import Path

    readme = Path(__file__).resolve().parents[2] / "README.md"
    rows = set()
    for line in readme.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[1].startswith("`") and cells[0] in UNEVEN_COLLECTIVES:
            rows.add((cells[0], cells[1].strip("`")))
    assert rows == {(c, name) for c in UNEVEN_COLLECTIVES for name in algorithms(c)}
