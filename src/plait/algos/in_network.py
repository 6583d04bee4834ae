"""In-network allreduce: switches sum the vectors on their way up a tree and send the result down.

SHARP (Mellanox/NVIDIA) and SwitchML put reduction engines with a little
memory into the switches. Each rank sends its vector once to the switch it
hangs off and receives the result once; each switch adds what its children
send, passes one stream to its parent, and copies the root's result down to
its children. No rank forwards anything, so a host's link carries n bytes each
way whatever the number of ranks, against about 2n for ring or Rabenseifner.

Here a switch is a participant with a schedule of its own (``Context.fabric``:
switch ``s`` is participant ``size + s``), built by this same file, so the
simulator runs it like any other schedule. Bounded switch memory is a window:
the vector travels in segments (``ctx.segment`` elements, at most a quarter
of the smallest switch's memory), a switch has ``memory // segment``
slots and reuses slot ``k mod W`` for segment ``k`` (the data hazards on the
slot order the reuse), and a rank sends segment ``k`` only after it has the
result of segment ``k - W``, as SwitchML's hosts do, so nothing waits in a
switch beyond its memory.

Cost (n bytes, p ranks, a tree of depth d switches, s-byte segments,
contention-free links of α and β, switches reducing at line rate):
    allreduce  2dα + (n + (2d-1)s)·β   about nβ for large n; ring: 2(p-1)α + 2((p-1)/p)·nβ
(store and forward of s-byte segments over 2d links; when the memory is
not enough to cover a segment's round trip, the window bounds the rate instead)
Restrictions: commutative ops (a switch adds its children in arrival order on
real hardware); plait's transports have no such switches, so it runs only in
:mod:`plait.sim` on a network built with aggregating switches
(``aggregation_memory=``); a communicator refuses it. Every rank receives the
bytes the root switch produced, so all results are bit-identical.

Example, p=4 on two leaf switches under one spine (one segment)::

    r0, r1 -> leaf0: x0∘x1 -> spine <- leaf1: x2∘x3 <- r2, r3
    spine: (x0∘x1)∘(x2∘x3) -> leaf0, leaf1 -> r0, r1, r2, r3
"""

from __future__ import annotations

from plait.algos._registry import register
from plait.errors import UnsupportedError
from plait.schedule.builder import Builder
from plait.schedule.ir import Region

__all__: list[str] = []

#: Slots a switch's memory is cut into when the call does not give a segment size.
DEFAULT_WINDOW = 4


def plan(count: int, itemsize: int, segment: int, memory: int) -> tuple[int, int]:
    """(elements per segment, segments in flight) for a vector of ``count`` elements.

    ``segment`` elements, but at most ``1/DEFAULT_WINDOW`` of what one switch
    holds, so that several segments are always in flight (one would leave
    every link idle for a round trip per segment); the window is how many
    segments fit in the memory.
    """
    per = max(1, memory // itemsize)  # elements one switch can hold
    cap = max(1, per // DEFAULT_WINDOW)
    seg = min(segment, cap) if segment > 0 else cap
    if count:
        seg = min(seg, count)
    return seg, max(1, per // seg)


def _cut(region: Region, seg: int) -> list[Region]:
    """``region`` in pieces of ``seg`` elements, as the switches cut it: however many there
    are (a switch holds a piece in its memory, so the pieces cannot grow as
    :func:`~plait.schedule.builder.segments` lets others grow)."""
    n = region.count
    return [region.sub(o, min(seg, n - o)) for o in range(0, n, seg)] or [region]


@register("allreduce", "in_network", commutative_only=True, in_place=False, needs_fabric=True)
def allreduce(b: Builder) -> None:
    """Switches reduce up a tree and broadcast down it: n bytes per link each way.

    Needs ``ctx.fabric`` (switches that reduce, as :mod:`plait.sim` networks
    built with ``aggregation_memory`` have). Segments are ``ctx.segment``
    elements, at most a quarter of a switch's memory; ``memory // segment``
    are in flight per rank.
    """
    ctx = b.ctx
    fabric = ctx.fabric
    if fabric is None:
        raise UnsupportedError(
            "allreduce algorithm 'in_network' needs switches that reduce in flight "
            "(SHARP/SwitchML); plait's transports have none. Simulate it with plait.sim on a "
            "network built with aggregation_memory=..., or use algorithm='auto'"
        )
    p, r = ctx.size, ctx.rank
    seg, window = plan(ctx.count, ctx.itemsize, ctx.segment, fabric.memory)
    if r < p:  # a rank: its vector up, the result down, at most `window` segments in flight
        switch = p + fabric.attach[r]
        received: list[int] = []
        pieces = zip(_cut(b.inp, seg), _cut(b.out, seg), strict=True)
        for k, (x, y) in enumerate(pieces):
            b.send(switch, x, after=(received[k - window],) if k >= window else ())
            received.append(b.recv(switch, y))
        return
    s = r - p  # a switch: add the children's segments in a slot, up, down
    ranks, below = fabric.children(s)
    kids = ranks + [p + q for q in below]
    up = fabric.parent[s]
    slots = b.scratch(min(window * seg, ctx.count))
    for k, offset in enumerate(range(0, ctx.count, seg)):
        slot = slots.sub((k % window) * seg, min(seg, ctx.count - offset))
        b.recv(kids[0], slot)
        for kid in kids[1:]:
            b.recv_reduce(kid, slot, recv_first=False)
        if up >= 0:
            b.send(p + up, slot)
            b.recv(p + up, slot)
        for kid in kids:
            b.send(kid, slot)
