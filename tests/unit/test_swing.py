"""Swing's rank arithmetic (peers, reachable sets, block layout), alone, and its schedule shape."""

from __future__ import annotations

import pytest

from plait.algos._registry import build_schedule, get
from plait.algos.swing import (
    swing_order,
    swing_peer,
    swing_reachable,
    swing_rho,
    swing_span,
)
from plait.schedule.builder import Context
from plait.schedule.ir import StepKind

POF2 = [1, 2, 4, 8, 16, 32, 64, 128]


def test_rho() -> None:
    assert [swing_rho(s) for s in range(7)] == [1, -1, 3, -5, 11, -21, 43]
    for s in range(20):
        assert swing_rho(s) == sum((-2) ** i for i in range(s + 1))


@pytest.mark.parametrize("size", [2, 4, 8, 16, 1024])
def test_peers_pair_up(size: int) -> None:
    for s in range(size.bit_length() - 1):
        for r in range(size):
            q = swing_peer(r, s, size)
            assert q != r
            assert (q - r) % 2 == 1
            assert swing_peer(q, s, size) == r


def test_peers_p8() -> None:
    assert [swing_peer(r, 0, 8) for r in range(8)] == [1, 0, 3, 2, 5, 4, 7, 6]
    assert [swing_peer(r, 1, 8) for r in range(8)] == [7, 2, 1, 4, 3, 6, 5, 0]
    assert [swing_peer(r, 2, 8) for r in range(8)] == [3, 6, 5, 0, 7, 2, 1, 4]


@pytest.mark.parametrize(
    "size", [p if p <= 64 else pytest.param(p, marks=pytest.mark.slow) for p in POF2]
)
def test_reachable_sets_nest(size: int) -> None:
    steps = size.bit_length() - 1
    for r in range(size):
        assert swing_reachable(r, 0, size) == frozenset(range(size))
        assert swing_reachable(r, steps, size) == {r}
        for s in range(steps):
            whole = swing_reachable(r, s, size)
            mine = swing_reachable(r, s + 1, size)
            theirs = swing_reachable(swing_peer(r, s, size), s + 1, size)
            assert len(whole) == size >> s
            assert not mine & theirs
            assert mine | theirs == whole
            # A partition: everyone in the group sees the same group.
            for q in whole:
                assert swing_reachable(q, s, size) == whole


@pytest.mark.parametrize("size", POF2)
def test_spans_are_the_reachable_sets(size: int) -> None:
    order = swing_order(size)
    assert sorted(order) == list(range(size))
    for r in range(size):
        for s in range(size.bit_length()):
            lo, hi = swing_span(r, s, size)
            assert hi - lo == size >> s
            assert frozenset(order[lo:hi]) == swing_reachable(r, s, size)


def test_order_p8() -> None:
    assert swing_order(8) == (0, 3, 4, 7, 1, 6, 2, 5)
    assert sorted(swing_reachable(0, 1, 8)) == [0, 3, 4, 7]
    assert sorted(swing_reachable(0, 2, 8)) == [0, 3]


def test_order_is_cheap_for_large_sizes() -> None:
    order = swing_order(1 << 14)
    assert sorted(order) == list(range(1 << 14))


@pytest.mark.parametrize("size", [2, 4, 8, 16, 64, 5, 12, 33])
def test_schedule_cost(size: int) -> None:
    # Powers of two: 2 lg p messages, 2(p-1)/p·n elements sent. Others add the fold.
    spec = get("allreduce", "swing")
    pof2 = 1 << (size.bit_length() - 1)
    steps = pof2.bit_length() - 1
    count = 8 * pof2
    for rank in range(size):
        sched = build_schedule(spec, Context("allreduce", rank, size, count))
        sends = [s for s in sched.steps if s.kind is StepKind.SEND]
        sent = sum(s.count for s in sends)
        extra = size - pof2
        if rank < 2 * extra and rank % 2 == 0:
            assert len(sends) == 1
            assert sent == count
        elif rank < 2 * extra:
            assert len(sends) == 2 * steps + 1
            assert sent == 2 * (pof2 - 1) * 8 + count
        else:
            assert len(sends) == 2 * steps
            assert sent == 2 * (pof2 - 1) * 8


def test_segmented_build_splits_messages() -> None:
    spec = get("allreduce", "swing")
    sched = build_schedule(spec, Context("allreduce", 0, 8, 8 * 20, segment=7))
    sends = [s for s in sched.steps if s.kind is StepKind.SEND]
    assert max(s.count for s in sends) <= 7
    assert sum(s.count for s in sends) == 2 * 7 * 20
