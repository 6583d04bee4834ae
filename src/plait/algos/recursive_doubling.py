"""Recursive doubling: latency-optimal allreduce and allgather in ⌈lg p⌉ exchanges.

At step ``k`` each (virtual) rank exchanges everything it has with the rank
whose virtual number differs in bit ``k``. For p not a power of two the extra
ranks are folded in first (:func:`plait.algos.topology.fold`, Thakur,
Rabenseifner and Gropp 2005): even ranks below ``2*(p - pof2)`` hand their data
to their odd neighbour, wait, and get the result back at the end.

Costs (n bytes, p ranks, lg = log2):
    allreduce  lg p·α + n·lg p·β + n·lg p·γ        (+2 steps of n when p is not a power of two)
    allgather  lg p·α + ((p-1)/p)·nβ               (n = whole output; non-powers of two
                                                    fold in the same way, +2 steps)
Restrictions: none. Non-commutative ops are reduced in rank order because
virtual ranks are monotone in real ranks and each exchange combines two
contiguous, adjacent groups, lower group first (which also makes both
partners compute bit-identical values).

Example, allreduce, p=4: step 0 pairs (0,1),(2,3) -> each holds x0∘x1 or x2∘x3;
step 1 pairs (0,2),(1,3) -> everyone holds (x0∘x1)∘(x2∘x3).
"""

from __future__ import annotations

from collections.abc import Sequence

from plait.algos._registry import register
from plait.algos.topology import fold, pof2_floor, unfold
from plait.schedule.builder import Builder
from plait.schedule.ir import Region

__all__ = ["rd_allreduce"]


def rd_allreduce(b: Builder, group: Sequence[int], me: int, region: Region) -> None:
    """Recursive-doubling allreduce of ``region`` in place among ``group`` (we are ``group[me]``).

    Positions in ``group`` play the ranks: non-commutative ops are combined in
    the order of the group, and every member computes the same association.
    """
    p = len(group)
    if p == 1:
        return
    pof2 = pof2_floor(p)
    v = fold(me, p)
    if v is None:  # extra member: contribute, then wait for the result
        b.send(group[me + 1], region)
        b.recv(group[me + 1], region)
        return
    if me < 2 * (p - pof2):
        b.recv_reduce(group[me - 1], region, recv_first=True)
    mask = 1
    while mask < pof2:
        pv = v ^ mask
        peer = group[unfold(pv, p)]
        b.send(peer, region)
        b.recv_reduce(peer, region, recv_first=pv < v)
        mask <<= 1
    if me < 2 * (p - pof2):
        b.send(group[me - 1], region)


@register("allreduce", "recursive_doubling")
def allreduce(b: Builder) -> None:
    """Exchange the whole vector with partners at distance 1, 2, 4, …: lg p steps."""
    b.copy(b.inp, b.out)
    rd_allreduce(b, range(b.ctx.size), b.ctx.rank, b.out)


@register("allgather", "recursive_doubling")
def allgather(b: Builder) -> None:
    """Exchange all blocks gathered so far with partners at distance 1, 2, 4, …: lg p steps.

    With p not a power of two, each folded-out even rank first sends its block
    to its odd neighbour (which then speaks for both) and receives the whole
    result at the end.
    """
    ctx = b.ctx
    p, r, k = ctx.size, ctx.rank, ctx.count
    out = b.out

    def span(lo: int, hi: int) -> tuple[int, int]:
        # Real ranks covered by virtual ranks [lo, hi): contiguous because fold is monotone.
        first = unfold(lo, p) - (1 if lo < p - pof2 else 0)
        last = unfold(hi - 1, p)
        return first, last + 1

    b.copy(b.inp, out.sub(r * k, k))
    if p == 1:
        return
    pof2 = pof2_floor(p)
    v = fold(r, p)
    if v is None:
        b.send(r + 1, out.sub(r * k, k))
        b.recv(r + 1, out)
        return
    if r < 2 * (p - pof2):
        b.recv(r - 1, out.sub((r - 1) * k, k))
    mask = 1
    while mask < pof2:
        pv = v ^ mask
        peer = unfold(pv, p)
        mine = span(v & ~(mask - 1), (v & ~(mask - 1)) + mask)
        theirs = span(pv & ~(mask - 1), (pv & ~(mask - 1)) + mask)
        b.send(peer, out.sub(mine[0] * k, (mine[1] - mine[0]) * k))
        b.recv(peer, out.sub(theirs[0] * k, (theirs[1] - theirs[0]) * k))
        mask <<= 1
    if r < 2 * (p - pof2):
        b.send(r - 1, out)
