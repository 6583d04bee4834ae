"""Pairwise, direct and Bruck: rank and position arithmetic alone, and schedule shapes."""

from __future__ import annotations

import pytest

from plait.algos._registry import build_schedule, get
from plait.algos.bruck import bit_positions, bruck_steps, contiguous, copy_blocks
from plait.algos.pairwise import owner_chains, pairwise_peers
from plait.schedule.builder import Builder, Context
from plait.schedule.ir import IN, OUT, TMP, Region, StepKind
from plait.schedule.symbolic import prove

SIZES = [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17, 31, 32, 33, 64, 100]


def lg(p: int) -> int:
    """⌈lg p⌉."""
    return (p - 1).bit_length()


# -- pairwise ------------------------------------------------------------------------------


@pytest.mark.parametrize("size", SIZES)
def test_pairwise_peers_meet_everyone_once(size: int) -> None:
    met: set[tuple[int, int]] = set()
    for s in range(1, size):
        to = [pairwise_peers(r, size, s)[0] for r in range(size)]
        frm = [pairwise_peers(r, size, s)[1] for r in range(size)]
        assert sorted(to) == list(range(size))  # everyone is one sender's target
        for r in range(size):
            assert to[r] != r
            assert frm[to[r]] == r  # r's partner expects r
            met.add((r, to[r]))
    assert len(met) == size * (size - 1)


@pytest.mark.parametrize("size", SIZES)
def test_owner_chains_follow_arrival_and_give_rank_order(size: int) -> None:
    for r in range(size):
        lo, hi = owner_chains(r, size)
        arrival = [pairwise_peers(r, size, s)[1] for s in range(1, size)]
        assert lo + hi == arrival
        # Fold as reduce_to_owners does: lo = q ∘ lo, hi = q ∘ hi, result lo ∘ hi.
        acc: tuple[int, ...] = (r,)
        for q in lo:
            acc = (q, *acc)
        if hi:
            h: tuple[int, ...] = (hi[0],)
            for q in hi[1:]:
                h = (q, *h)
            acc = acc + h
        assert acc == tuple(range(size))


# -- Bruck ---------------------------------------------------------------------------------


def test_bruck_steps_examples() -> None:
    assert bruck_steps(1) == []
    assert bruck_steps(2) == [(1, 1)]
    assert bruck_steps(5) == [(1, 1), (2, 2), (4, 1)]
    assert bruck_steps(8) == [(1, 1), (2, 2), (4, 4)]
    assert bruck_steps(9) == [(1, 1), (2, 2), (4, 4), (8, 1)]


@pytest.mark.parametrize("size", SIZES)
def test_bruck_steps_fill_every_position_once(size: int) -> None:
    steps = bruck_steps(size)
    assert len(steps) == lg(size)
    have = 1  # positions [0, have) are filled
    for d, c in steps:
        assert have == d
        assert 1 <= c <= d  # the sender has its first c positions
        have += c
    assert have == size


@pytest.mark.parametrize("size", SIZES)
def test_bruck_allgather_positions(size: int) -> None:
    # Position i on rank r holds rank r+i's block; simulate every rank at once.
    held = [[r] for r in range(size)]
    for d, c in bruck_steps(size):
        # r receives from r+d the first c positions it holds and appends them.
        held = [held[r] + held[(r + d) % size][:c] for r in range(size)]
    for r in range(size):
        assert held[r] == [(r + i) % size for i in range(size)]


def test_bit_positions_examples() -> None:
    assert bit_positions(5, 1) == [1, 3]
    assert bit_positions(5, 2) == [2, 3]
    assert bit_positions(5, 4) == [4]
    assert bit_positions(7, 2) == [2, 3, 6]


@pytest.mark.parametrize("size", SIZES)
def test_bruck_alltoall_routes(size: int) -> None:
    # blocks[r][i] = (source, destination) of the block at position i on rank r.
    blocks = [[(r, (r - i) % size) for i in range(size)] for r in range(size)]
    final_at: dict[int, int] = {}
    for d, _ in bruck_steps(size):
        moved = bit_positions(size, d)
        assert len(moved) <= size // 2  # about n/2 per step
        new = [list(row) for row in blocks]
        for r in range(size):
            for i in moved:  # sent to r-d, received from r+d
                new[(r - d) % size][i] = blocks[r][i]
        blocks = new
        for i in moved:
            assert i not in final_at  # a block never moves after its highest bit
            if i < 2 * d:
                final_at[i] = d
    assert sorted(final_at) == list(range(1, size))
    for r in range(size):
        assert blocks[r] == [((r + i) % size, r) for i in range(size)]


def test_contiguous() -> None:
    assert contiguous([]) is None
    assert contiguous([Region(OUT, 3, 2)]) == Region(OUT, 3, 2)
    assert contiguous([Region(TMP, 0, 2), Region(TMP, 2, 3)]) == Region(TMP, 0, 5)
    assert contiguous([Region(TMP, 0, 2), Region(TMP, 3, 3)]) is None
    assert contiguous([Region(TMP, 2, 2), Region(TMP, 0, 2)]) is None  # out of order
    assert contiguous([Region(TMP, 0, 2), Region(OUT, 2, 2)]) is None


def test_copy_blocks_merges_runs() -> None:
    b = Builder(Context("alltoall", 0, 4, 2), 8, 8)
    tmp = b.scratch(8)
    pairs = [
        (Region(IN, 0, 2), Region(TMP, 0, 2)),
        (Region(IN, 2, 2), Region(TMP, 2, 2)),  # continues both sides: merged
        (Region(IN, 6, 2), Region(TMP, 4, 2)),  # source jumps: new copy
        (Region(OUT, 0, 2), tmp.sub(6, 2)),  # other buffer: new copy
    ]
    copy_blocks(b, pairs)
    steps = b.build().steps
    assert [(s.src, s.dst) for s in steps] == [
        (Region(IN, 0, 4), Region(TMP, 0, 4)),
        (Region(IN, 6, 2), Region(TMP, 4, 2)),
        (Region(OUT, 0, 2), Region(TMP, 6, 2)),
    ]


# -- schedule shapes -----------------------------------------------------------------------


def sends(collective: str, name: str, size: int, count: int, rank: int) -> list[tuple[int, int]]:
    sched = build_schedule(get(collective, name), Context(collective, rank, size, count))
    return [(s.peer, s.count) for s in sched.steps if s.kind is StepKind.SEND]


def n_steps(collective: str, name: str, size: int, count: int, rank: int, comm: bool) -> int:
    ctx = Context(collective, rank, size, count, 1, comm)
    return len(build_schedule(get(collective, name), ctx).steps)


@pytest.mark.parametrize("size", SIZES)
def test_shapes(size: int) -> None:
    k = 3
    for r in sorted({0, 1 % size, size // 2, size - 1}):
        assert [c for _, c in sends("allgather", "bruck", size, k, r)] == [
            c * k for _, c in bruck_steps(size)
        ]
        assert sends("alltoall", "bruck", size, k, r) == [
            ((r - d) % size, len(bit_positions(size, d)) * k) for d, _ in bruck_steps(size)
        ]
        pair = [((r + s) % size, k) for s in range(1, size)]
        assert sends("alltoall", "pairwise", size, k, r) == pair
        assert sends("reduce_scatter", "pairwise", size, k, r) == pair
        peers = [q for q, _ in sends("allreduce", "direct", size, size * k, r)]
        assert peers == [(r + s) % size for s in range(1, size)] * 2
        for comm in (True, False):
            # O(p) steps per rank.
            for c, name in [
                ("allreduce", "direct"),
                ("reduce_scatter", "pairwise"),
                ("alltoall", "pairwise"),
                ("allgather", "bruck"),
                ("alltoall", "bruck"),
            ]:
                assert n_steps(c, name, size, k, r, comm) <= 4 * size + 2


def test_flags() -> None:
    assert get("allreduce", "direct").in_place
    assert not get("allreduce", "direct").commutative_only
    assert not get("reduce_scatter", "pairwise").commutative_only
    assert not get("alltoall", "pairwise").in_place
    assert not get("alltoall", "bruck").in_place


@pytest.mark.slow
@pytest.mark.parametrize("size", [34, 48, 64])
def test_prove_beyond_33(size: int) -> None:
    for count in (0, 1, size + 1):
        prove(get("allreduce", "direct"), size, count, commutative=False)
        prove(get("allreduce", "direct"), size, count, in_place=True)
        prove(get("reduce_scatter", "pairwise"), size, count, commutative=False)
        prove(get("reduce_scatter", "pairwise"), size, count)
        prove(get("alltoall", "pairwise"), size, count)
        prove(get("allgather", "bruck"), size, count)
        prove(get("alltoall", "bruck"), size, count)
