"""Swing allreduce (De Sensi et al., NSDI 2024): reduce-scatter and allgather over swinging peers.

At step ``s`` rank ``r`` pairs with ``pi(r, s) = r + rho(s)`` if ``r`` is even,
``r - rho(s)`` if odd (mod p), where ``rho(s) = sum_{i<=s} (-2)^i`` = 1, -1, 3,
-5, 11, -21, …: peers sit at distances 1, 1, 3, 5, 11, 21, … instead of
recursive doubling's 1, 2, 4, 8, …, which on rings and tori means fewer hops
and less link sharing. This is the bandwidth-optimal variant: a reduce-scatter
in lg p steps, then the mirrored allgather. At reduce-scatter step ``s`` a rank
keeps the blocks of the ranks it can still reach in steps ``s+1..lg p - 1``
(:func:`swing_reachable`) and sends its partner the blocks of the ranks the
partner can reach; after the last step it holds one block, reduced over all.
Those sets are not contiguous in rank order, but they nest, so ranks are laid
out in an order (:func:`swing_order`) in which every kept set is an aligned
run of blocks: rank ``r`` owns vector block ``swing_order(p).index(r)``, and
every step moves one contiguous region.

For p not a power of two the extra ranks are folded in first
(:func:`plait.algos.topology.fold`): each even rank below ``2*(p - pof2)``
sends its whole vector to its odd neighbour, which reduces it in and takes part
as one virtual rank; the even rank gets its result back at the end.

Costs (n bytes, p ranks, lg = log2; pow2 = pof2_floor(p)):
    allreduce  p = 2^m:   2 lg p·α + 2((p-1)/p)·nβ + ((p-1)/p)·nγ
               otherwise: (2 lg pow2 + 2)·α + (2(pow2-1)/pow2 + 2)·nβ + ((pow2-1)/pow2 + 1)·nγ
Restrictions: commutative ops only (the blocks a rank reduces come from rank
sets that are not contiguous); any p; any count (blocks may be empty). Each
block is reduced by one owner and then only copied, so results are
bit-identical on all ranks. Messages are cut into ``ctx.segment``-element
segments when it is set.

Example, p=8: peers by step, and the ranks rank 0 can still reach::

    step 0 (±1):  0-1  2-3  4-5  6-7     reachable from 0 after it: {0,3,4,7}
    step 1 (∓1):  0-7  1-2  3-4  5-6                                {0,3}
    step 2 (±3):  0-3  2-5  4-7  6-1                                {0}

    swing_order(8) = 0 3 4 7 1 6 2 5   (block b is owned by the b-th rank listed)
    block          = 0 1 2 3 4 5 6 7

    reduce-scatter at rank 0:  step 0: send blocks 4-7 to 1, reduce in blocks 0-3
                               step 1: send blocks 2-3 to 7, reduce in blocks 0-1
                               step 2: send block  1   to 3, reduce in block  0
    allgather at rank 0:       step 2: send block 0, receive block 1 from 3
                               step 1: send blocks 0-1, receive 2-3 from 7
                               step 0: send blocks 0-3, receive 4-7 from 1
"""

from __future__ import annotations

import functools

from plait.algos._cost import Cost, lg
from plait.algos._registry import register
from plait.algos.topology import fold, pof2_floor, unfold
from plait.schedule.builder import Builder, blocks, exchange
from plait.schedule.ir import Region

__all__ = ["swing_order", "swing_peer", "swing_reachable", "swing_rho", "swing_span"]


def swing_rho(step: int) -> int:
    """``rho(step) = sum_{i=0..step} (-2)**i``: 1, -1, 3, -5, 11, -21, …"""
    rho: int = (1 - (-2) ** (step + 1)) // 3
    return rho


def swing_peer(rank: int, step: int, size: int) -> int:
    """Swing partner of ``rank`` at ``step``: ``rank ± rho(step) mod size`` (+ for even ranks).

    ``rho`` is odd, so an even rank always pairs with an odd one and the
    relation is symmetric (``swing_peer(swing_peer(r, s, p), s, p) == r``) for even ``size``.
    """
    rho = swing_rho(step)
    return (rank + rho) % size if rank % 2 == 0 else (rank - rho) % size


def _steps(size: int) -> int:
    return size.bit_length() - 1


def swing_reachable(rank: int, step: int, size: int) -> frozenset[int]:
    """Ranks ``rank`` reaches (itself included) through swing steps ``step..lg size - 1``.

    ``size`` is a power of two. Defined by ``R(r, lg p) = {r}`` and
    ``R(r, s) = R(r, s+1) ∪ R(swing_peer(r, s), s+1)``; the two parts are
    disjoint and ``R(q, s) == R(r, s)`` for every ``q`` in ``R(r, s)``, so for
    each ``s`` the sets partition the ranks into ``2**s`` groups of
    ``size / 2**s``, each group splitting into two groups of the next step.
    In the reduce-scatter, a rank keeps the blocks of ``R(r, s+1)`` after step ``s``.
    """
    if step >= _steps(size):
        return frozenset((rank,))
    return swing_reachable(rank, step + 1, size) | swing_reachable(
        swing_peer(rank, step, size), step + 1, size
    )


@functools.lru_cache(maxsize=64)
def swing_order(size: int) -> tuple[int, ...]:
    """Ranks of a power of two ``size`` in a block order that keeps reachable sets contiguous.

    Each group ``R(r, s)`` of :func:`swing_reachable` is laid out as its two
    subgroups ``R(r, s+1)`` and ``R(peer, s+1)``, the one holding the lower
    rank first. So ``R(r, s)`` occupies the aligned run of ``size / 2**s``
    positions that contains ``r``'s own (see :func:`swing_span`).
    O(size·lg size), once per size.
    """
    steps = _steps(size)

    def order(rep: int, s: int) -> list[int]:
        if s == steps:
            return [rep]
        mine = order(rep, s + 1)
        theirs = order(swing_peer(rep, s, size), s + 1)
        return mine + theirs if min(mine) < min(theirs) else theirs + mine

    return tuple(order(0, 0))


@functools.lru_cache(maxsize=64)
def _positions(size: int) -> tuple[int, ...]:
    pos = [0] * size
    for i, rank in enumerate(swing_order(size)):
        pos[rank] = i
    return tuple(pos)


def swing_span(rank: int, step: int, size: int) -> tuple[int, int]:
    """Positions ``[lo, hi)`` of ``swing_reachable(rank, step, size)`` in :func:`swing_order`."""
    width = size >> step
    lo = _positions(size)[rank] & ~(width - 1)
    return lo, lo + width


# -- closed-form cost (plait.algos._cost) ----------------------------------------------


def allreduce_swing(p: int, n: float, a: float, b: float, g: float, d: float) -> float:
    """Swing (De Sensi et al. 2024, after the paper): on the flat network, Rabenseifner's cost.

    Power of two: ``nδ + 2 lg p·α + 2((p-1)/p)·nβ + ((p-1)/p)·nγ``: the same
    volumes per step, only the peers differ (which matters on tori, not here).
    Otherwise it folds like recursive doubling, whose extra rank copies IN to
    OUT before sending OUT, so the fold is ``nδ + α + nβ + nγ`` (no overlap)
    and the unfold ``α + nβ``.
    """
    q = pof2_floor(p)
    k = lg(q)
    core = 2 * k * a + 2 * (q - 1) / q * n * b + (q - 1) / q * n * g
    if q == p:
        return n * d + core
    return n * d + a + n * b + n * g + core + a + n * b


@register(
    "allreduce",
    "swing",
    commutative_only=True,
    cost=Cost(allreduce_swing, allreduce_swing, ports_pow2=True),
)
def allreduce(b: Builder) -> None:
    """Swing reduce-scatter then allgather, peers at distance 1, 1, 3, 5, 11, …: 2 lg p steps."""
    ctx = b.ctx
    p, r = ctx.size, ctx.rank
    out = b.out
    b.copy(b.inp, out)
    if p == 1:
        return
    pof2 = pof2_floor(p)
    folded = r < 2 * (p - pof2)
    v = fold(r, p)
    if v is None:  # extra rank: contribute, then wait for the result
        b.send(r + 1, out)
        b.recv(r + 1, out)
        return
    if folded:
        b.recv_reduce(r - 1, out, recv_first=True)
    chunks = blocks(ctx.count, pof2)

    def region(span: tuple[int, int]) -> Region:
        lo, hi = span
        start = chunks[lo][0]
        end = chunks[hi - 1][0] + chunks[hi - 1][1]
        return out.sub(start, end - start)

    steps = _steps(pof2)
    for s in range(steps):
        pv = swing_peer(v, s, pof2)
        mine = region(swing_span(v, s + 1, pof2))
        theirs = region(swing_span(pv, s + 1, pof2))
        exchange(b, unfold(pv, p), theirs, mine, ctx.segment, reduce=True, recv_first=pv < v)
    for s in range(steps - 1, -1, -1):
        pv = swing_peer(v, s, pof2)
        mine = region(swing_span(v, s + 1, pof2))
        theirs = region(swing_span(pv, s + 1, pof2))
        exchange(b, unfold(pv, p), mine, theirs, ctx.segment, reduce=False)
    if folded:
        b.send(r - 1, out)
