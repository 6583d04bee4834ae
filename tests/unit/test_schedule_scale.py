"""Building schedules at scale: what the simulator reads is what the builder records, and
the builder's work per step does not grow with the number of ranks.

No test here times anything (the machine is shared): each counts the work a
thousand-rank build does, which would grow p-fold if a shortcut were lost.
Note [recorded rows] (the columns), Note [hazard pieces] and Note [lists every
rank makes] say what is counted and why it matters.
"""

from __future__ import annotations

import pytest

import plait
from plait.algos import rabenseifner
from plait.algos._registry import get
from plait.schedule import builder as builder_module
from plait.schedule import cuts
from plait.schedule.builder import Context, record, record_columns
from plait.schedule.hazards import Hazards
from plait.sim.call import build_all
from plait.sim.model import LinkParams
from plait.sim.program import build_program, compile_schedules
from plait.sim.topologies import single_switch


def contexts(c: str, a: str, p: int) -> list[Context]:
    """Contexts of ``c``/``a`` on ``p`` ranks: a few counts, segments and ops, every rank."""
    spec = get(c, a)
    fabric = None
    if spec.needs_fabric:
        switch = single_switch(p, LinkParams(1e-6, 1e-9), aggregation_memory=4096)
        fabric = switch.aggregation_fabric()[0]
    window = 4096 if spec.needs_window else 0
    out = []
    for count in (0, 7, 1001):
        counts = None
        if c.endswith("v"):
            n = p * p if c == "alltoallv" else p
            counts = tuple((i * 31 + count) % (count + 3) for i in range(n))
        for segment in (0, 64):
            for commutative in (True,) if spec.commutative_only else (True, False):
                ctx = Context(
                    c, 0, p, count, 4, commutative, p // 2, segment, None, fabric, counts, window
                )
                out += [ctx.with_rank(r) for r in range(ctx.participants)]
    return out


ALGORITHMS = [
    (c, a)
    for c in (
        *plait.COLLECTIVES,
        "allgatherv",
        "gatherv",
        "scatterv",
        "alltoallv",
        "reduce_scatterv",
    )
    for a in plait.algorithms(c)
]


@pytest.mark.parametrize(("collective", "algorithm"), ALGORITHMS)
def test_the_columns_are_what_build_records(collective: str, algorithm: str) -> None:
    """``record_columns`` (the simulator's) against the steps of ``record`` (the executor's)."""
    build = get(collective, algorithm).build
    for p in (1, 2, 5, 8):
        for ctx in contexts(collective, algorithm, p):
            steps = record(build, ctx).steps
            kind, peer, tag, count, deps = record_columns(build, ctx)
            assert list(kind) == [s.kind for s in steps]
            assert all(type(k) is type(s.kind) for k, s in zip(kind, steps, strict=True))
            assert list(peer) == [s.peer for s in steps]
            assert list(tag) == [s.tag for s in steps]
            assert list(count) == [s.count for s in steps]
            assert list(deps) == [s.deps for s in steps]


@pytest.mark.parametrize(
    ("collective", "algorithm", "p"),
    [
        ("allreduce", "ring", 12),
        ("alltoall", "bruck", 13),
        ("allreduce", "arena", 6),
        ("allreduce", "in_network", 9),
    ],
)
def test_the_program_from_columns_is_the_program_from_schedules(
    collective: str, algorithm: str, p: int
) -> None:
    window = 4096 if get(collective, algorithm).needs_window else 0
    net = single_switch(p, LinkParams(1e-6, 1e-9), aggregation_memory=4096)
    fabric = net.aggregation_fabric()[0] if get(collective, algorithm).needs_fabric else None
    kw = {"itemsize": 4, "segment": 16, "window": window}
    fast = build_program(collective, algorithm, p, 500, workers=1, fabric=fabric, **kw)
    schedules = build_all(collective, algorithm, p, 500, network=net, **kw)
    slow = compile_schedules(schedules, 4)
    assert fast.local.tolist() == slow.local.tolist()
    for field in ("kind", "peer", "tag", "nbytes", "owner", "n_deps", "dep_ptr", "dep_idx"):
        assert getattr(fast, field) == getattr(slow, field), field
    assert fast.match == slow.match
    assert (fast.one_sided, fast.mixed) == (slow.one_sided, slow.mixed)


def test_a_thousand_rank_ring_is_recorded_without_steps_in_linear_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 0 of a 1,000-rank ring allreduce: 4p steps, no ``Step`` object made for the
    simulator, and the hazard tables cut about once per chunk (p times, not p² or per
    step: every later access finds its chunk's piece by its start)."""
    made, cuts = [], []
    real_step, real_cut = builder_module.Step, Hazards._cut

    def counting_cut(self: Hazards, x: int) -> None:
        cuts.append(x)
        real_cut(self, x)

    monkeypatch.setattr(builder_module, "Step", lambda *a: made.append(a) or real_step(*a))
    monkeypatch.setattr(Hazards, "_cut", counting_cut)
    p = 1000
    ctx = Context("allreduce", 0, p, 262144, 4, True, 0, 1 << 18)
    kind, *_ = record_columns(get("allreduce", "ring").build, ctx)
    assert len(kind) == 1 + 4 * (p - 1)
    assert made == []
    assert len(cuts) <= 2 * p + 4  # each access's two ends, on the first touch of a chunk
    assert len(record(get("allreduce", "ring").build, ctx).steps) == len(kind)
    assert len(made) == len(kind)  # the executor's schedule: each Step made once


def test_every_rank_shares_the_lists_of_the_call() -> None:
    """Rabenseifner on 1,000 ranks lists the vector's blocks, the virtual group and the
    regions of its blocks once for the call, not once per rank (Note [lists every
    rank makes])."""
    caches = (cuts._blocks, rabenseifner.virtual_group, rabenseifner._blocks)
    for cache in caches:
        cache.cache_clear()
    build_program("allreduce", "rabenseifner", 1000, 262144, itemsize=4, workers=1)
    assert [cache.cache_info().misses for cache in caches] == [1, 1, 1]
    assert rabenseifner.virtual_group(1000) == tuple(
        rabenseifner.unfold(v, 1000) for v in range(512)
    )
