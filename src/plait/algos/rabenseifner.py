"""Rabenseifner's algorithms: recursive-halving reduce-scatter, then allgather or gather.

The vector is cut into one block per virtual rank. Recursive halving
(distance p/2, p/4, …, 1) leaves each virtual rank ``v`` with block ``v``
reduced over all ranks; recursive doubling (distance 1, 2, …, p/2) then
circulates the blocks to everyone (allreduce), or a binomial gather along the
same hypercube edges collects them at the root (reduce). Every step halves or
doubles the data in flight, so both latency (lg p) and bandwidth (about 2n)
are near optimal. Thakur, Rabenseifner and Gropp, "Optimization of collective
communication operations in MPICH" (2005).

For p not a power of two the extra ranks are folded in first
(:func:`plait.algos.topology.fold`): each even rank below ``2*(p - pof2)``
sends its whole vector to its odd neighbour, which reduces it in and takes
part as one virtual rank; the even rank gets its result back at the end.

Costs (n bytes, p ranks, lg = log2; pow2 = pof2_floor(p)):
    allreduce  p = 2^m:   2 lg p·α + 2((p-1)/p)·nβ + ((p-1)/p)·nγ
               otherwise: (2 lg pow2 + 2)·α + (2(pow2-1)/pow2 + 2)·nβ + ((pow2-1)/pow2 + 1)·nγ
    reduce     p = 2^m:   2 lg p·α + 2((p-1)/p)·nβ + ((p-1)/p)·nγ
               otherwise: +α + nβ + nγ for the fold, and +α + nβ more when the root
               is a folded-out rank (its odd neighbour gathers and forwards).
Restrictions: commutative ops only (recursive halving combines rank groups
that are not contiguous: {0,2} with {1,3}, as MPICH); any p; any count
(blocks may be empty when count < p). Each block is reduced by one owner and
then only copied, so allreduce results are bit-identical on all ranks.

Example, allreduce, p=4, vector [A|B|C|D], one block per rank::

    halving, distance 2:  0<->2, 1<->3   r0,r1 keep [A|B], r2,r3 keep [C|D]
    halving, distance 1:  0<->1, 2<->3   rank r keeps block r, reduced over all
    doubling, distance 1: 0<->1, 2<->3   r0,r1 hold [A|B], r2,r3 hold [C|D]
    doubling, distance 2: 0<->2, 1<->3   everyone holds [A|B|C|D]

Example, p=6 (pof2 4, rem 2): ranks 0 and 2 fold onto 1 and 3::

    rank    0   1   2   3   4   5
    vrank   -   0   -   1   2   3
    fold:   0 -> 1, 2 -> 3 (whole vector, reduced in)
    halving/doubling among real ranks 1, 3, 4, 5 as above (4 blocks)
    unfold: 1 -> 0, 3 -> 2 (whole result)

p=5 (pof2 4, rem 1) folds only 0 onto 1; virtual ranks 0..3 are real 1..4.
A reduce to root 0 at p=6 gathers at real rank 1 (vrank 0) and forwards to 0.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from plait.algos._cost import Cost, lg
from plait.algos._registry import register
from plait.algos._rooted import ends_with_the_roots_word
from plait.algos.binomial import roots_word_time
from plait.algos.topology import fold, pof2_floor, unfold
from plait.schedule.builder import Builder, blocks, exchange, segments
from plait.schedule.ir import Region

__all__ = [
    "Window",
    "doubling_allgather",
    "doubling_plan",
    "fold_spans",
    "gather_plan",
    "halving_plan",
    "halving_reduce_scatter",
    "hypercube_gather",
    "span_regions",
    "virtual_group",
]

#: A half-open range ``[lo, hi)`` of virtual-rank blocks.
Window = tuple[int, int]


# -- pure rank arithmetic -----------------------------------------------------------


def _aligned(v: int, width: int) -> Window:
    """The window of ``width`` (a power of two) blocks aligned on ``width`` that holds ``v``."""
    lo = v & ~(width - 1)
    return lo, lo + width


def halving_plan(v: int, pof2: int) -> list[tuple[int, Window, Window]]:
    """Recursive-halving steps of virtual rank ``v`` among ``pof2``: (partner, kept, given).

    At distance ``d`` (``pof2/2`` down to 1) ``v`` holds the aligned window of
    ``2d`` blocks around it, keeps the half with block ``v`` and gives the other
    half to ``v ^ d``, whose kept half is ``v``'s given half. After the last
    step ``v`` keeps exactly ``(v, v + 1)``.
    """
    plan = []
    d = pof2 >> 1
    while d:
        lo, hi = _aligned(v, 2 * d)
        lower, upper = (lo, lo + d), (lo + d, hi)
        plan.append((v ^ d, upper, lower) if v & d else (v ^ d, lower, upper))
        d >>= 1
    return plan


def doubling_plan(v: int, pof2: int) -> list[tuple[int, Window, Window]]:
    """Recursive-doubling steps of ``v`` among ``pof2``: (partner, sent, received).

    ``v`` starts with block ``v``; at distance ``d`` (1, 2, …, ``pof2/2``) it
    sends the aligned window of ``d`` blocks it holds and receives the
    partner's, so it then holds the aligned window of ``2d``.
    """
    plan = []
    d = 1
    while d < pof2:
        plan.append((v ^ d, _aligned(v, d), _aligned(v ^ d, d)))
        d <<= 1
    return plan


def gather_plan(v: int, vroot: int, pof2: int) -> list[tuple[int, bool, Window]]:
    """Binomial gather of one block per virtual rank to ``vroot``: (partner, sends, window).

    The tree is the hypercube of :func:`doubling_plan` relabelled by
    ``v ^ vroot``: at distance ``d`` the rank whose relative number has bit
    ``d`` set sends the aligned window of ``d`` blocks it has gathered to
    ``v ^ d`` and is done; the partner receives it. Windows stay aligned (so
    contiguous) for any root, and ``vroot`` ends with all ``pof2`` blocks.
    """
    plan = []
    rel = v ^ vroot
    d = 1
    while d < pof2:
        if rel & d:
            plan.append((v ^ d, True, _aligned(v, d)))
            break
        plan.append((v ^ d, False, _aligned(v ^ d, d)))
        d <<= 1
    return plan


def fold_spans(size: int) -> list[tuple[int, int]]:
    """Per virtual rank, the real ranks ``[first, end)`` it speaks for after :func:`fold`.

    Consecutive, disjoint and covering ``range(size)``, since fold is monotone::

        size 6:  vrank 0 -> [0, 2), 1 -> [2, 4), 2 -> [4, 5), 3 -> [5, 6)
    """
    pof2 = pof2_floor(size)
    rem = size - pof2
    return [(2 * j, 2 * j + 2) if j < rem else (j + rem, j + rem + 1) for j in range(pof2)]


# -- schedule pieces ----------------------------------------------------------------


def _span(regions: Sequence[Region], window: Window) -> Region:
    """The region covered by ``regions[lo:hi]`` (they must tile memory in order)."""
    lo, hi = window
    first = regions[lo]
    return Region(first.buf, first.offset, regions[hi - 1].end - first.offset)


def _send(b: Builder, peer: int, region: Region, segment: int) -> None:
    for seg in segments(region, segment):
        b.send(peer, seg)


def _recv(b: Builder, peer: int, region: Region, segment: int) -> None:
    for seg in segments(region, segment):
        b.recv(peer, seg)


def _recv_reduce(b: Builder, peer: int, region: Region, segment: int, *, recv_first: bool) -> None:
    for seg in segments(region, segment):
        b.recv_reduce(peer, seg, recv_first=recv_first)


def halving_reduce_scatter(
    b: Builder, group: Sequence[int], v: int, regions: Sequence[Region], segment: int
) -> None:
    """Recursive-halving reduce-scatter, in place: virtual rank ``v`` ends owning ``regions[v]``.

    ``group[j]`` is the real rank of virtual rank ``j`` (``len(group)`` a power
    of two); ``regions[j]`` is block ``j``, and the blocks tile one region in
    order (any lengths, empty allowed). Needs a commutative op.
    """
    for pv, kept, given in halving_plan(v, len(group)):
        exchange(
            b,
            group[pv],
            _span(regions, given),
            _span(regions, kept),
            segment,
            reduce=True,
            recv_first=pv < v,
        )


def doubling_allgather(
    b: Builder, group: Sequence[int], v: int, regions: Sequence[Region], segment: int
) -> None:
    """Recursive-doubling allgather: ``v`` starts with ``regions[v]`` and ends with all."""
    for pv, sent, received in doubling_plan(v, len(group)):
        exchange(
            b, group[pv], _span(regions, sent), _span(regions, received), segment, reduce=False
        )


def hypercube_gather(
    b: Builder, group: Sequence[int], v: int, vroot: int, regions: Sequence[Region], segment: int
) -> None:
    """Gather ``regions[j]`` from each virtual rank ``j`` to ``vroot`` (see :func:`gather_plan`)."""
    for pv, sends, window in gather_plan(v, vroot, len(group)):
        if sends:
            _send(b, group[pv], _span(regions, window), segment)
        else:
            _recv(b, group[pv], _span(regions, window), segment)


@functools.lru_cache(maxsize=64)
def virtual_group(size: int) -> tuple[int, ...]:
    """The real rank of each virtual rank of a folded group (the same on every rank: made
    once per size, Note [lists every rank makes] in :mod:`plait.schedule.builder`)."""
    return tuple([unfold(j, size) for j in range(pof2_floor(size))])


@functools.lru_cache(maxsize=64)
def _blocks(region: Region, parts: int) -> tuple[Region, ...]:
    """``region`` cut into ``parts`` blocks (made once per region and parts)."""
    return tuple([region.sub(o, n) for o, n in blocks(region.count, parts)])


@functools.lru_cache(maxsize=64)
def span_regions(region: Region, size: int, block: int) -> tuple[Region, ...]:
    """Per virtual rank of ``size`` folded ranks, the part of ``region`` (``block`` elements
    per real rank) that the real ranks it speaks for own (:func:`fold_spans`; made once)."""
    return tuple([region.sub(lo * block, (hi - lo) * block) for lo, hi in fold_spans(size)])


# -- registered builders ------------------------------------------------------------


def _fold_and_halve(
    b: Builder, work: Region, v: int
) -> tuple[Sequence[int], Sequence[Region], bool]:
    """The common first half of both algorithms, for a participating rank (virtual rank ``v``).

    Copies IN into ``work``, folds in the even neighbour's vector if this rank
    has one, and reduce-scatters ``work`` over the virtual ranks. Returns the
    virtual group, the per-virtual-rank regions of ``work``, and whether this
    rank folded a neighbour in (and owes it data at the end).
    """
    ctx = b.ctx
    p, r, seg = ctx.size, ctx.rank, ctx.segment
    b.copy(b.inp, work)
    folded = r < 2 * (p - pof2_floor(p))
    if folded:
        _recv_reduce(b, r - 1, work, seg, recv_first=True)
    group = virtual_group(p)
    regions = _blocks(work, len(group))
    halving_reduce_scatter(b, group, v, regions, seg)
    return group, regions, folded


# -- closed-form cost (plait.algos._cost) ----------------------------------------------


def allreduce_rabenseifner(p: int, n: float, a: float, b: float, g: float, d: float) -> float:
    """Power of two: ``nδ + 2 lg p·α + 2((p-1)/p)·nβ + ((p-1)/p)·nγ``.

    Otherwise, with q = pof2_floor(p):
    ``max(nδ, α + nβ) + nγ + 2 lg q·α + 2((q-1)/q)·nβ + ((q-1)/q)·nγ + α + nβ``.
    Paper: ``(2⌊lg p⌋+2)α + (2(q-1)/q + 2)·nβ + (1 + (q-1)/q)·nγ`` (its p is our
    q in the fractions). plait's folded-out rank sends its input at once,
    while its neighbour copies its own into OUT, so the copy hides behind the
    fold message (the max). Ranks that did not fold start earlier, but every
    path through the halving and doubling from a folded rank back to one takes
    each step's full cost, so the late start carries through.
    """
    q = pof2_floor(p)
    k = lg(q)
    core = 2 * k * a + 2 * (q - 1) / q * n * b + (q - 1) / q * n * g
    if q == p:
        return n * d + core
    return max(n * d, a + n * b) + n * g + core + a + n * b


def reduce_rabenseifner(p: int, n: float, a: float, b: float, g: float, d: float) -> float:
    """Rabenseifner's reduce to rank 0: the paper's cost plus nδ when p is a power of two.

    ``nδ + 2 lg p·α + 2((p-1)/p)·nβ + ((p-1)/p)·nγ`` (copy of IN into the
    working buffer, recursive halving, binomial gather of the blocks along the
    same hypercube). Otherwise: the fold as in allreduce, the halving over q
    virtual ranks, and the gather, written as the longest chain over them (the
    gather waits at each virtual rank for all the windows it collects). Rank 0
    is folded out when p is not a power of two, so its neighbour gathers in
    its place and forwards the whole result (α + nβ).
    """
    q = pof2_floor(p)
    rem = p - q
    mq = n / q
    t = [max(n * d, a + n * b) + n * g if v < rem else n * d for v in range(q)]
    half = q >> 1
    while half:
        t = [max(t[v], t[v ^ half] + a + half * mq * b) + half * mq * g for v in range(q)]
        half >>= 1
    # Gather to virtual rank 0: at distance `width` the ranks with that bit set send.
    width = 1
    while width < q:
        t = [
            max(t[v], t[v ^ width] + a + width * mq * b) if not v & width else t[v]
            for v in range(q)
        ]
        width <<= 1
    return t[0] + (a + n * b if rem else 0.0)


@register(
    "allreduce",
    "rabenseifner",
    commutative_only=True,
    cost=Cost(allreduce_rabenseifner, allreduce_rabenseifner, ports_pow2=True),
)
def allreduce(b: Builder) -> None:
    """Recursive-halving reduce-scatter then recursive-doubling allgather: 2 lg p steps.

    Folded-out even ranks send their input to their odd neighbour and receive
    the whole result from it at the end (2 more steps).
    """
    ctx = b.ctx
    p, r, seg = ctx.size, ctx.rank, ctx.segment
    v = fold(r, p)
    if v is None:
        # The result can only come back after the partner has received all of
        # IN, so receiving into OUT is safe even when OUT aliases IN.
        _send(b, r + 1, b.inp, seg)
        _recv(b, r + 1, b.out, seg)
        return
    work = b.out
    group, regions, folded = _fold_and_halve(b, work, v)
    doubling_allgather(b, group, v, regions, seg)
    if folded:
        _send(b, r - 1, work, seg)


def reduce_rabenseifner_call(p: int, n: float, a: float, b: float, g: float, d: float) -> float:
    """The registered reduce: :func:`reduce_rabenseifner`, then the root's word."""
    return reduce_rabenseifner(p, n, a, b, g, d) + roots_word_time(p, a, b, g, d)


def reduce_rabenseifner_call_ports(
    p: int, n: float, a: float, b: float, g: float, d: float
) -> float:
    """With ports (p = 2^k): the reduce, then the root's word sent child after child."""
    return reduce_rabenseifner(p, n, a, b, g, d) + roots_word_time(p, a, b, g, d, ports=True)


@register(
    "reduce",
    "rabenseifner",
    commutative_only=True,
    cost=Cost(reduce_rabenseifner_call, reduce_rabenseifner_call_ports, ports_pow2=True),
)
@ends_with_the_roots_word
def reduce(b: Builder) -> None:
    """Recursive-halving reduce-scatter then a binomial gather of the blocks to the root.

    For p not a power of two, folded-out even ranks send their input to their
    odd neighbour; if the root is one of them, its neighbour gathers in its
    place and forwards the result.
    """
    ctx = b.ctx
    p, r, root, seg = ctx.size, ctx.rank, ctx.root, ctx.segment
    v = fold(r, p)
    if v is None:
        _send(b, r + 1, b.inp, seg)
        if r == root:
            # Safe when OUT aliases IN: the result is sent only after all of IN arrived.
            _recv(b, r + 1, b.out, seg)
        return
    vroot = fold(root, p)
    gatherer = vroot is not None
    if vroot is None:
        vroot = fold(root + 1, p)
        assert vroot is not None
    work = b.out if r == root else b.scratch(ctx.count)
    group, regions, _ = _fold_and_halve(b, work, v)
    hypercube_gather(b, group, v, vroot, regions, seg)
    if v == vroot and not gatherer:
        _send(b, root, work, seg)
