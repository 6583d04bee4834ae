"""Pairwise exchange: reduce-scatter and alltoall in p-1 steps, one partner each way per step.

At step ``s`` (1 ≤ s < p) rank ``r`` sends the block that rank ``r+s`` needs to
``r+s`` and receives its own block's piece from ``r-s`` (mod p); over the p-1
steps every rank meets every other once in each direction (Thakur,
Rabenseifner and Gropp 2005). No message depends on another, so an executor
may post them all at once; the step order only sets their priority and
spreads the load (at each step every rank is one sender's only target).

Costs (n bytes, p ranks):
    reduce_scatter  (p-1)α + ((p-1)/p)·nβ + ((p-1)/p)·nγ   (n = whole input)
    alltoall        (p-1)α + ((p-1)/p)·nβ                  (n = whole input; ≈ nβ)
Restrictions: any p, any count. Non-commutative ops are reduced in rank order
at no extra messages (see below). Neither is in-place: both write ``OUT``
while input blocks are still to be sent, so in-place calls stage the input.

Rank order for free: rank ``r`` hears from r-1, r-2, …, 0, p-1, …, r+1 in
that order. Folding the first run onto its own block from the left and the
second run into a second accumulator, also from the left, consumes every
message as it arrives, and ``lo ∘ hi`` is in rank order. With a commutative op
a single accumulator takes them all in arrival order.

Example, reduce_scatter, p=5, rank 2 (xq = rank q's piece of block 2)::

    step        1    2    3    4
    sends to   r3   r4   r0   r1
    hears from r1   r0   r4   r3
    lo = x2 -> x1∘x2 -> x0∘(x1∘x2)
    hi =                 x4 -> x3∘x4
    OUT = lo ∘ hi = (x0∘(x1∘x2))∘(x3∘x4)
"""

from __future__ import annotations

from collections.abc import Sequence

from plait.algos._cost import Cost
from plait.algos._registry import register
from plait.schedule.builder import Builder, segments
from plait.schedule.ir import Region

__all__ = ["owner_chains", "pairwise_peers", "reduce_to_owners"]


def pairwise_peers(rank: int, size: int, step: int) -> tuple[int, int]:
    """(to, from) of ``rank`` at ``step`` (1 ≤ step < size): rank+step and rank-step, mod size."""
    return (rank + step) % size, (rank - step) % size


def owner_chains(rank: int, size: int) -> tuple[list[int], list[int]]:
    """The other ranks, as the two runs ``rank`` folds in rank order: (lo, hi).

    ``lo`` is rank-1, …, 0 and ``hi`` is size-1, …, rank+1; ``lo + hi`` is the
    order in which the pairwise schedule delivers their contributions.
    """
    return list(range(rank - 1, -1, -1)), list(range(size - 1, rank, -1))


def reduce_to_owners(
    b: Builder, contributions: Sequence[Region], acc: Region, segment: int
) -> None:
    """Send ``contributions[q]`` to rank q for every other q, and reduce our own block into ``acc``.

    Afterwards ``acc`` holds x0 ∘ x1 ∘ … ∘ x(p-1), where xq is rank q's
    ``contributions[rank]`` (ours is copied in first). Sends go out in pairwise
    order (to rank+1, rank+2, …). The reduction is in rank order unless
    ``b.ctx.commutative``; either way its association is fixed by the rank
    alone. ``contributions[q]`` must have the length that rank q's ``acc`` has;
    messages are cut into segments of ``segment`` elements (0: whole).
    """
    ctx = b.ctx
    p, r = ctx.size, ctx.rank
    for s in range(1, p):
        to, _ = pairwise_peers(r, p, s)
        for seg in segments(contributions[to], segment):
            b.send(to, seg)
    b.copy(contributions[r], acc)
    lo, hi = owner_chains(r, p)
    acc_segs = segments(acc, segment)
    if ctx.commutative:
        for q in lo + hi:
            for seg in acc_segs:
                b.recv_reduce(q, seg, recv_first=q < r)
        return
    for q in lo:
        for seg in acc_segs:
            b.recv_reduce(q, seg, recv_first=True)
    if not hi:
        return
    hi_acc = b.scratch(acc.count)
    hi_segs = segments(hi_acc, segment)
    for seg in hi_segs:
        b.recv(hi[0], seg)
    for q in hi[1:]:
        for seg in hi_segs:
            b.recv_reduce(q, seg, recv_first=True)
    for a, h in zip(acc_segs, hi_segs, strict=True):
        b.reduce(h, a, src_first=False)


# -- closed-form cost (plait.algos._cost) ----------------------------------------------


def reduce_scatter_pairwise(p: int, n: float, a: float, b: float, g: float, d: float) -> float:
    """``max((n/p)δ, α + (n/p)β) + ((p-1)/p)·nγ`` (n = the whole input).

    Paper: ``(p-1)α + ((p-1)/p)·n(β + γ)``: there each step is a blocking
    exchange. plait posts all p-1 sends at once (no message depends on
    another), so on the contention-free network all arrive after one message
    time; the reductions into the result then run one after the other.
    """
    m = n / p
    if p == 1:
        return m * d
    return max(m * d, a + m * b) + (p - 1) * m * g


def reduce_scatter_pairwise_ports(
    p: int, n: float, a: float, b: float, g: float, d: float
) -> float:
    """With ports: all p-1 messages share each rank's ports: ``α + ((p-1)/p)·nβ``, then reduces."""
    m = n / p
    if p == 1:
        return m * d
    return max(m * d, a + (p - 1) * m * b) + (p - 1) * m * g


def alltoall_pairwise(p: int, n: float, a: float, b: float, g: float, d: float) -> float:
    """``max((n/p)δ, α + (n/p)β)`` (n = each rank's whole input); paper ``(p-1)α + nβ``.

    As for reduce_scatter: every message is posted at once and none waits for
    another; the copy of the rank's own block overlaps them.
    """
    m = n / p
    return max(m * d, a + m * b) if p > 1 else m * d


def alltoall_pairwise_ports(p: int, n: float, a: float, b: float, g: float, d: float) -> float:
    """With ports: ``max((n/p)δ, α + ((p-1)/p)·nβ)``: one latency, every byte through the port."""
    m = n / p
    return max(m * d, a + (p - 1) * m * b) if p > 1 else m * d


@register(
    "reduce_scatter",
    "pairwise",
    in_place=False,
    cost=Cost(reduce_scatter_pairwise, reduce_scatter_pairwise_ports),
)
def reduce_scatter(b: Builder) -> None:
    """Pairwise exchange: step s sends block r+s to its owner and folds in r-s's piece of block r.

    The result is reduced straight into ``OUT``; in rank order for
    non-commutative ops (two accumulators, see the module docstring).
    """
    ctx = b.ctx
    k = ctx.count
    blocks = [b.inp.sub(q * k, k) for q in range(ctx.size)]
    reduce_to_owners(b, blocks, b.out, ctx.segment)


@register(
    "alltoall", "pairwise", in_place=False, cost=Cost(alltoall_pairwise, alltoall_pairwise_ports)
)
def alltoall(b: Builder) -> None:
    """Pairwise exchange: step s sends IN block r+s to r+s and receives OUT block r-s from r-s.

    ``ctx.segment`` is ignored: nothing is forwarded, so there is nothing to pipeline.
    """
    ctx = b.ctx
    p, r, k = ctx.size, ctx.rank, ctx.count
    b.copy(b.inp.sub(r * k, k), b.out.sub(r * k, k))
    for s in range(1, p):
        to, frm = pairwise_peers(r, p, s)
        b.send(to, b.inp.sub(to * k, k))
        b.recv(frm, b.out.sub(frm * k, k))
