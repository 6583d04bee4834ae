"""Ring algorithms: reduce-scatter, allgather, and allreduce as one followed by the other.

Ranks form a ring ``r -> r+1``; the vector is cut into ``p`` chunks (one per rank)
and every step moves one chunk one hop, so each link carries the same load and
the time is independent of ``p`` for large messages. Chunks are further cut into
segments of ``ctx.segment`` elements; the builder's hazard tracking lets a
segment move on as soon as it has been reduced, which pipelines the ring.

Costs (n bytes, p ranks; Thakur et al. notation):
    reduce_scatter  (p-1)α + ((p-1)/p)·nβ + ((p-1)/p)·nγ     (n = whole input)
    allgather       (p-1)α + ((p-1)/p)·nβ                    (n = whole output)
    allreduce       2(p-1)α + 2((p-1)/p)·nβ + ((p-1)/p)·nγ
Restrictions: reductions need a commutative op (chunk j is reduced starting
at rank j+1, not in rank order); any p; any count (chunks may be empty).

Example, allreduce, p=3, vector [a|b|c] cut into chunks 0,1,2:
    step 0: r0 sends chunk 2 to r1, r1 sends 0 to r2, r2 sends 1 to r0 (each reduces)
    step 1: r0 sends chunk 1, r1 chunk 2, r2 chunk 0  -> rank r owns reduced chunk r
    steps 2-3: the same ring pass, copying instead of reducing (allgather).
"""

from __future__ import annotations

from collections.abc import Sequence

from plait.algos._cost import Cost
from plait.algos._registry import register
from plait.schedule.builder import Builder, blocks, segments
from plait.schedule.ir import Region

__all__ = ["ring_allgather", "ring_reduce_scatter"]


def ring_reduce_scatter(
    b: Builder, group: Sequence[int], me: int, chunks: Sequence[Region], segment: int
) -> None:
    """Reduce ``chunks`` (one per ring position, in place) so position ``i`` owns chunk ``i``.

    ``group[i]`` is the real rank at ring position ``i``; ``me`` is ours.
    """
    p = len(group)
    nxt, prv = group[(me + 1) % p], group[(me - 1) % p]
    for s in range(p - 1):
        outs = segments(chunks[(me - s - 1) % p], segment)
        ins = segments(chunks[(me - s - 2) % p], segment)
        for seg_out, seg_in in zip(outs, ins, strict=False):
            b.send(nxt, seg_out)
            b.recv_reduce(prv, seg_in, recv_first=True)
        # Chunks may differ in length by one element, hence in segment count.
        for seg in outs[len(ins) :]:
            b.send(nxt, seg)
        for seg in ins[len(outs) :]:
            b.recv_reduce(prv, seg, recv_first=True)


def ring_allgather(
    b: Builder, group: Sequence[int], me: int, chunks: Sequence[Region], segment: int
) -> None:
    """Circulate ``chunks`` so every position gets all; position ``i`` starts with chunk ``i``."""
    p = len(group)
    nxt, prv = group[(me + 1) % p], group[(me - 1) % p]
    for s in range(p - 1):
        out_segs = segments(chunks[(me - s) % p], segment)
        in_segs = segments(chunks[(me - s - 1) % p], segment)
        for k in range(max(len(out_segs), len(in_segs))):
            if k < len(out_segs):
                b.send(nxt, out_segs[k])
            if k < len(in_segs):
                b.recv(prv, in_segs[k])


def _chunks(region: Region, parts: int) -> list[Region]:
    return [region.sub(o, n) for o, n in blocks(region.count, parts)]


# -- closed-form cost (plait.algos._cost) ----------------------------------------------


def allreduce_ring(p: int, n: float, a: float, b: float, g: float, d: float) -> float:
    """``nδ + 2(p-1)α + 2((p-1)/p)·nβ + ((p-1)/p)·nγ``, any p.

    Paper (as usually quoted, e.g. Patarasuk and Yuan): the same without nδ,
    the copy of IN into OUT that every send waits for.
    """
    m = n / p
    return n * d + (p - 1) * (2 * a + 2 * m * b + m * g)


def reduce_scatter_ring(p: int, n: float, a: float, b: float, g: float, d: float) -> float:
    """``nδ + (p-1)(α + (n/p)β + (n/p)γ) + (n/p)δ``, any p (n = the whole input).

    Paper: ``(p-1)α + ((p-1)/p)·n(β + γ)``. plait reduces in scratch: it copies
    the input there first and its own block out at the end.
    """
    m = n / p
    return n * d + (p - 1) * (a + m * b + m * g) + m * d


def allgather_ring(p: int, n: float, a: float, b: float, g: float, d: float) -> float:
    """``(n/p)δ + (p-1)(α + (n/p)β)``, any p (n = the whole output); the paper's plus one copy."""
    m = n / p
    return m * d + (p - 1) * (a + m * b)


@register("allreduce", "ring", commutative_only=True, cost=Cost(allreduce_ring, allreduce_ring))
def allreduce(b: Builder) -> None:
    """Ring reduce-scatter then ring allgather: bandwidth-optimal, 2(p-1) steps."""
    ctx = b.ctx
    b.copy(b.inp, b.out)
    group = range(ctx.size)
    chunks = _chunks(b.out, ctx.size)
    ring_reduce_scatter(b, group, ctx.rank, chunks, ctx.segment)
    ring_allgather(b, group, ctx.rank, chunks, ctx.segment)


@register(
    "reduce_scatter",
    "ring",
    commutative_only=True,
    cost=Cost(reduce_scatter_ring, reduce_scatter_ring),
)
def reduce_scatter(b: Builder) -> None:
    """Ring reduce-scatter in scratch, then each rank copies out its own block: p-1 steps."""
    ctx = b.ctx
    k = ctx.count
    work = b.scratch(ctx.size * k)
    b.copy(b.inp, work)
    chunks = [work.sub(q * k, k) for q in range(ctx.size)]
    ring_reduce_scatter(b, range(ctx.size), ctx.rank, chunks, ctx.segment)
    b.copy(chunks[ctx.rank], b.out)


@register("allgather", "ring", cost=Cost(allgather_ring, allgather_ring))
def allgather(b: Builder) -> None:
    """Ring allgather: p-1 steps, each moving one rank's block one hop."""
    ctx = b.ctx
    k = ctx.count
    chunks = [b.out.sub(q * k, k) for q in range(ctx.size)]
    b.copy(b.inp, chunks[ctx.rank])
    ring_allgather(b, range(ctx.size), ctx.rank, chunks, ctx.segment)
