"""Broadcast as a binomial scatter followed by a ring allgather (van de Geijn).

The root's vector is cut into ``p`` chunks, chunk ``v`` for the rank ``v``
places after the root (vrank ``v = (rank - root) % p``). A binomial scatter
leaves vrank ``v`` with chunk ``v`` (on the way, the chunks of its subtree
``[v, v + subtree_size(v))``, which are contiguous in the vector, so the scatter
needs no scratch and no reordering); a ring allgather over the ranks in vrank
order then gives everyone every chunk. Each rank sends and receives about
``2n`` bytes in all instead of ``n·lg p``, which wins for long vectors. Every
message is cut into ``ctx.segment``-element segments; hazard tracking lets a
rank forward a segment as soon as it has arrived.

Cost (n bytes, p ranks; Thakur, Rabenseifner & Gropp 2005):
    broadcast  (⌈lg p⌉ + p - 1)α + 2((p-1)/p)·nβ

Restrictions: none; any p, any count, any root. With fewer elements than ranks
some chunks are empty and their messages are dropped.

Example, p=4, root=1, vector [a|b|c|d] (chunk v goes to vrank v = rank (v+1)%4):

    scatter:   r1 -> r3: [c|d]   (vrank 2's subtree: vranks 2, 3)
               r1 -> r2: [b]     r3 -> r0: [d]
    allgather: ring r1 -> r2 -> r3 -> r0 -> r1, 3 steps of one chunk each
"""

from __future__ import annotations

import functools

from plait.algos._cost import Cost
from plait.algos._registry import register
from plait.algos._rooted import agree_on_root
from plait.algos.binomial import relative_group, subtree_size
from plait.algos.ring import ring_allgather
from plait.algos.topology import binomial_children, binomial_parent
from plait.schedule.builder import Builder, blocks, segments
from plait.schedule.ir import Region

__all__: list[str] = []


# -- closed-form cost (plait.algos._cost) ----------------------------------------------


def broadcast_scatter_allgather(p: int, n: float, a: float, b: float, g: float, d: float) -> float:
    """``(lg p + p - 1)α + 2((p-1)/p)·nβ`` for a power of two (the paper's); any p below.

    A binomial scatter of p chunks of n/p, every subtree's chunks in one
    message, then a ring allgather. plait starts each rank's ring as soon as
    its own chunk is there, and a chunk then moves one rank per step, so the
    time is the latest chunk's arrival plus p - 1 ring steps. The latest
    arrival is the longest root-to-leaf path, a hop into a subtree of s ranks
    costing ``α + s(n/p)β``; for p = 2^k that is ``lg p·α + ((p-1)/p)·nβ``.
    """
    m = n / p
    return _scatter_depth(p, a, m * b) + (p - 1) * (a + m * b)


@functools.lru_cache(maxsize=1024)
def _scatter_depth(s: int, a: float, mb: float) -> float:
    """Latest arrival in a binomial scatter over a subtree of s ranks (chunk time ``mb``)."""
    best = 0.0
    dist = 1
    while dist < s:
        child = min(dist, s - dist)
        best = max(best, a + child * mb + _scatter_depth(child, a, mb))
        dist <<= 1
    return best


@register("broadcast", "scatter_allgather", cost=Cost(broadcast_scatter_allgather))
def broadcast(b: Builder) -> None:
    """Binomial scatter of p chunks from the root, then ring allgather: long vectors.

    The witness tells the root it is in the call (Note [rooted calls agree on the root]):
    with fewer elements than ranks the chunks of all but the first are empty, the root
    received nothing, and ranks that disagreed on the root each returned as if all was
    well."""
    agree_on_root(b)
    ctx = b.ctx
    p, root = ctx.size, ctx.root
    v = (ctx.rank - root) % p
    group = relative_group(root, p)
    out = b.out
    chunks = [out.sub(o, n) for o, n in blocks(out.count, p)]
    bounds = [c.offset for c in chunks] + [out.count]

    def span(lo: int, hi: int) -> list[Region]:  # chunks of vranks [lo, hi), segmented
        return segments(out.sub(bounds[lo], bounds[hi] - bounds[lo]), ctx.segment)

    parent = binomial_parent(v)
    if parent >= 0:
        for seg in span(v, v + subtree_size(v, p)):
            b.recv(group[parent], seg)
    for child in binomial_children(v, p)[::-1]:  # farthest subtree first
        for seg in span(child, child + subtree_size(child, p)):
            b.send(group[child], seg)
    ring_allgather(b, group, v, chunks, ctx.segment)
