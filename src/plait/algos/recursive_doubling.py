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

from plait.algos._cost import Cost, lg
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


# -- closed-form cost (plait.algos._cost) ----------------------------------------------


def allreduce_recursive_doubling(p: int, n: float, a: float, b: float, g: float, d: float) -> float:
    """``nδ + lg p·(α + nβ + nγ)``; otherwise ``nδ + (⌊lg p⌋+1)(α + nβ + nγ) + α + nβ``.

    Paper: ``lg p·α + n·lg p·β + n·lg p·γ``, and two more steps of n when it
    folds, as plait does. plait first copies IN to OUT (nδ; the folded-out rank
    too, since it sends OUT), and every exchange waits for its own message to
    land (the receive-and-reduce rewrites the region it sent), so a step ends
    when the later partner's message has arrived and the ranks stay in lock
    step. Folding adds one reducing step, unfolding one plain message.
    """
    q = pof2_floor(p)
    step = a + n * b + n * g
    if q == p:
        return n * d + lg(p) * step
    return n * d + (lg(q) + 1) * step + a + n * b


def allgather_recursive_doubling(p: int, n: float, a: float, b: float, g: float, d: float) -> float:
    """Power of two: ``(n/p)δ + lg p·α + ((p-1)/p)·nβ``, the paper's plus one copy.

    Otherwise plait folds (the paper instead gives a separate scheme with
    messages of uneven sizes): each folded-out rank sends its block to its odd
    neighbour, which speaks for both, so virtual rank v's block is 2 real
    blocks for v < p - q and 1 otherwise, and the hypercube exchanges carry
    uneven windows. The time is then the longest chain of messages (each
    exchange waits only for the receives that filled what it sends), written
    as a max-plus recurrence over the q virtual ranks, plus the unfold: the
    whole output (n) back to each folded-out rank.
    """
    m = n / p
    q = pof2_floor(p)
    rem = p - q
    if q == p:
        return m * d + lg(p) * a + (p - 1) * m * b
    w = [2 * m if v < rem else m for v in range(q)]  # bytes each virtual rank speaks for
    pre = [0.0]
    for x in w:
        pre.append(pre[-1] + x)

    def window(v: int, width: int) -> float:  # bytes of the aligned window holding v
        lo = v & ~(width - 1)
        return pre[lo + width] - pre[lo]

    # ready[v]: when v may send its next window (everything it sends has arrived).
    ready = [m * d + a + m * b if v < rem else m * d for v in range(q)]
    width = 1
    while width < q:
        ready = [
            max(ready[v], ready[v ^ width] + a + window(v ^ width, width) * b) for v in range(q)
        ]
        width <<= 1
    return max(max(ready), max(ready[:rem]) + a + n * b)


@register(
    "allreduce",
    "recursive_doubling",
    cost=Cost(allreduce_recursive_doubling, allreduce_recursive_doubling, ports_pow2=True),
)
def allreduce(b: Builder) -> None:
    """Exchange the whole vector with partners at distance 1, 2, 4, …: lg p steps."""
    b.copy(b.inp, b.out)
    rd_allreduce(b, range(b.ctx.size), b.ctx.rank, b.out)


@register(
    "allgather",
    "recursive_doubling",
    cost=Cost(allgather_recursive_doubling, allgather_recursive_doubling, ports_pow2=True),
)
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
