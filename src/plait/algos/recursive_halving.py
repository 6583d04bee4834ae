"""Recursive halving: a latency-optimal reduce-scatter in ⌈lg p⌉ exchanges.

Each rank copies its input (one block of ``k`` elements per rank) into
scratch. At distance p/2, p/4, …, 1 it sends the half of its current window
that its partner keeps and reduces the partner's copy of its own half, so
after lg p steps rank ``r`` holds block ``r`` reduced over all ranks and
copies it out. Thakur, Rabenseifner and Gropp, "Optimization of collective
communication operations in MPICH" (2005).

For p not a power of two the extra ranks are folded in first
(:func:`plait.algos.topology.fold`): each even rank below
``2*(p - pof2)`` sends its whole input to its odd neighbour, which reduces it
in and takes part as one virtual rank owning the blocks of both (the windows
follow :func:`plait.algos.rabenseifner.fold_spans`, so every real rank's
block ends on exactly one virtual rank); at the end the odd rank sends the
even one its block.

Costs (n bytes = the whole input, p·k elements; p ranks, lg = log2):
    p = 2^m:    lg p·α + ((p-1)/p)·nβ + ((p-1)/p)·nγ
    otherwise:  (⌊lg p⌋ + 2)·α + about (1 + (pof2-1)/pof2 + 1/p)·nβ + (1 + (pof2-1)/pof2)·nγ
                (the fold moves and reduces the whole input once; windows of
                folded pairs are twice as long, so halving is not exactly even)
Restrictions: commutative ops only (halving combines rank groups {0,2} with
{1,3}, as MPICH); any p; any k (k = 0 records nothing).

Example, p=4, blocks [A|B|C|D] on every rank::

    distance 2:  0<->2, 1<->3   r0,r1 reduce [A|B], r2,r3 reduce [C|D]
    distance 1:  0<->1, 2<->3   rank r holds block r reduced over all 4

Example, p=6 (pof2 4, rem 2), blocks [0|1|2|3|4|5]::

    rank    0   1   2   3   4   5
    vrank   -   0   -   1   2   3        vrank 0 owns blocks 0-1, vrank 1 owns 2-3
    fold:   0 -> 1, 2 -> 3 (whole input, reduced in)
    distance 2:  r1<->r4, r3<->r5   r1,r3 reduce [0..3], r4,r5 reduce [4|5]
    distance 1:  r1<->r3, r4<->r5   r1: [0|1], r3: [2|3], r4: [4], r5: [5]
    unfold: r1 sends block 0 to r0, r3 sends block 2 to r2

p=5 folds 0 onto 1 only: vrank 0 (rank 1) owns blocks 0-1, vranks 1..3 own 2..4.
"""

from __future__ import annotations

from plait.algos._cost import Cost
from plait.algos._registry import register
from plait.algos.rabenseifner import halving_reduce_scatter, span_regions, virtual_group
from plait.algos.topology import fold, pof2_floor
from plait.schedule.builder import Builder, segments

__all__: list[str] = []


# -- closed-form cost (plait.algos._cost) ----------------------------------------------


def reduce_scatter_recursive_halving(
    p: int, n: float, a: float, b: float, g: float, d: float
) -> float:
    """Power of two: ``nδ + lg p·α + ((p-1)/p)·n(β + γ) + (n/p)δ`` (n = the whole input).

    Paper: ``lg p·α + ((p-1)/p)·n(β + γ)``; plait reduces in scratch (copy in,
    copy own block out). Otherwise the folded-out ranks send their whole input
    (n) to their odd neighbour, which reduces it in (``max(nδ, α + nβ) + nγ``,
    the copy hidden behind the message), the halving runs over q virtual
    ranks of which v < p - q own two blocks (uneven windows: a max-plus
    recurrence over the chains of receive-and-reduce steps, where a rank that
    already has its partner's data only pays the reduction), and each folded
    rank sends its neighbour's block back (α + (n/p)β) while copying its own.
    """
    m = n / p
    q = pof2_floor(p)
    rem = p - q
    w = [2 * m if v < rem else m for v in range(q)]
    pre = [0.0]
    for x in w:
        pre.append(pre[-1] + x)
    t = [max(n * d, a + n * b) + n * g if v < rem else n * d for v in range(q)]
    half = q >> 1
    while half:
        nxt = []
        for v in range(q):
            lo = v & ~(half - 1)  # v keeps the aligned window of `half` blocks holding it
            kept = pre[lo + half] - pre[lo]
            nxt.append(max(t[v], t[v ^ half] + a + kept * b) + kept * g)
        t = nxt
        half >>= 1
    if not rem:
        return max(t) + m * d
    return max(max(t) + m * d, max(t[:rem]) + max(a + m * b, m * d))


@register(
    "reduce_scatter",
    "recursive_halving",
    commutative_only=True,
    cost=Cost(reduce_scatter_recursive_halving, reduce_scatter_recursive_halving, ports_pow2=True),
)
def reduce_scatter(b: Builder) -> None:
    """Recursive halving in scratch, then each rank copies out its own block: lg p steps.

    With p not a power of two, folded-out even ranks send their input to their
    odd neighbour and receive their own block from it at the end (2 more steps).
    """
    ctx = b.ctx
    p, r, k, seg = ctx.size, ctx.rank, ctx.count, ctx.segment
    v = fold(r, p)
    if v is None:
        for s in segments(b.inp, seg):
            b.send(r + 1, s)
        for s in segments(b.out, seg):
            b.recv(r + 1, s)
        return
    work = b.scratch(p * k)
    b.copy(b.inp, work)
    folded = r < 2 * (p - pof2_floor(p))
    if folded:
        for s in segments(work, seg):
            b.recv_reduce(r - 1, s, recv_first=True)
    group = virtual_group(p)
    regions = span_regions(work, p, k)
    halving_reduce_scatter(b, group, v, regions, seg)
    if folded:
        for s in segments(work.sub((r - 1) * k, k), seg):
            b.send(r - 1, s)
    b.copy(work.sub(r * k, k), b.out)
