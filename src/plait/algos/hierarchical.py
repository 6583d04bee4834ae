"""Host-aware allreduce: ``hierarchical`` and ``cascade``, built from the flat pieces.

Both split the work along the host layout (``ctx.hosts``): ranks on one host
talk over fast intra-host links, and only one slice of the vector per rank
crosses the slower inter-host network. With ``L`` ranks on every host and
``H`` hosts, the vector is cut into ``L`` slices; local rank ``j`` of every host
*leads* slice ``j``: it collects the slice from its host, reduces it across
hosts with the other hosts' leaders of ``j``, and hands the result back to its
host. So every rank (and every NIC) carries ``1/L`` of the inter-host traffic;
no single leader per host becomes the bottleneck. If hosts have different
numbers of ranks, ``m = min L`` slices are led by local ranks ``0..m-1`` and
the other ranks only contribute and receive. With one host (no layout) both
reduce to a flat algorithm over all ranks.

``hierarchical`` runs three bulk phases, each a sub-schedule of a flat
algorithm: an intra-host ring reduce-scatter, an inter-host allreduce of each
slice (ring for large slices, recursive doubling for small ones: the inner
algorithm), and an intra-host ring allgather (Horovod's and NCCL's
hierarchical allreduce).

``cascade`` is plait's own name and design (no published algorithm goes by
it): the same division of labour, but every stage talks directly (each rank
sends each leader its part of the slice; leaders send the result to each
member) and every slice moves in segments of a quarter of ``ctx.segment``, so
segment k crosses the hosts while segment k+1 is still being reduced inside
them and segment k-1 is already going back: the three stages run as a
cascade instead of one after the other. Direct intra-host steps suit shared
memory, where a step costs a copy rather than a network latency.

Costs (n bytes; L ranks per host, H hosts; α, β intra-host and α', β' inter-host):
    hierarchical  2(L-1)(α + nβ/L) + inner + (L-1)/L · nγ,
                  inner = 2(H-1)α' + 2((H-1)/H)(n/L)β' + ((H-1)/H)(n/L)γ   (ring)
    cascade       2α·(L-1 messages) + 2((L-1)/L)·nβ + the same inner ring,
                  overlapped across S segments: ≈ max(stage) · (1 + 2/S)
Restrictions: commutative ops only (ring and direct stages reduce out of rank
order); any p and any layout, including hosts of unequal size and ranks of a
host that are not contiguous.

Example: 2 hosts × 2 ranks (r0, r1 on A; r2, r3 on B), vector [x|y]:
    A: r0 leads x, r1 leads y      B: r2 leads x, r3 leads y
    1. intra-host: r0 gets x0+x1, r1 gets y0+y1; r2 gets x2+x3, r3 gets y2+y3
    2. inter-host: r0 <-> r2 reduce x;  r1 <-> r3 reduce y  (both links busy)
    3. intra-host: r0 sends x to r1, r1 sends y to r0; likewise on B.
"""

from __future__ import annotations

from collections.abc import Sequence

from plait.algos._registry import register
from plait.algos.recursive_doubling import rd_allreduce
from plait.algos.ring import ring_allgather, ring_reduce_scatter
from plait.schedule.builder import Builder, blocks, segments
from plait.schedule.ir import Region

__all__ = ["INNER_RD_BYTES", "host_groups"]

#: Slices below this many bytes cross hosts by recursive doubling, larger ones by ring.
INNER_RD_BYTES = 64 << 10


def host_groups(hosts: Sequence[int] | None, size: int) -> list[tuple[int, ...]]:
    """The ranks of each host, hosts in order of their first rank (all on one host if None).

    >>> host_groups([0, 1, 0, 1, 1], 5)
    [(0, 2), (1, 3, 4)]
    """
    if hosts is None:
        return [tuple(range(size))]
    groups: dict[int, list[int]] = {}
    for rank, host in enumerate(hosts):
        groups.setdefault(host, []).append(rank)
    return [tuple(g) for g in groups.values()]


def _plan(
    b: Builder,
) -> tuple[tuple[int, ...], int, list[tuple[int, ...]], int, list[Region], int]:
    """(my host's ranks, my index there, every host's ranks, leaders per host, slices,
    my host's index in the list of hosts)."""
    ctx = b.ctx
    layout = ctx.hosts.hosts if ctx.hosts is not None else None
    groups = host_groups(layout, ctx.size)
    host = next(i for i, g in enumerate(groups) if ctx.rank in g)
    local = groups[host]
    m = min(len(g) for g in groups)
    slices = [b.out.sub(o, n) for o, n in blocks(ctx.count, m)]
    return local, local.index(ctx.rank), groups, m, slices, host


def _cross_ring(b: Builder, cross: Sequence[int], me: int, region: Region, segment: int) -> None:
    chunks = [region.sub(o, n) for o, n in blocks(region.count, len(cross))]
    ring_reduce_scatter(b, cross, me, chunks, segment)
    ring_allgather(b, cross, me, chunks, segment)


@register("allreduce", "hierarchical", commutative_only=True)
def hierarchical(b: Builder) -> None:
    """Intra-host reduce-scatter, inter-host allreduce of each slice, intra-host allgather."""
    b.copy(b.inp, b.out)
    local, me, groups, m, slices, host = _plan(b)
    empty = b.out.sub(0, 0)
    chunks = [slices[j] if j < m else empty for j in range(len(local))]
    ring_reduce_scatter(b, local, me, chunks, 0)
    if me < m:
        _cross(b, [g[me] for g in groups], host, slices[me])
    ring_allgather(b, local, me, chunks, 0)


@register("allreduce", "cascade", commutative_only=True)
def cascade(b: Builder) -> None:
    """Every local rank leads a slice across hosts; direct, segmented, overlapping stages."""
    ctx = b.ctx
    b.copy(b.inp, b.out)
    local, me, groups, m, slices, host = _plan(b)
    segment = max(1, ctx.segment // 4) if ctx.segment else 0
    # Stage 1: send each leader its slice, leader j reduces the slice from its host.
    for j in range(m):
        if j != me:
            for seg in segments(slices[j], segment):
                b.send(local[j], seg)
    if me < m:
        for i in range(len(local)):
            if i != me:
                for seg in segments(slices[me], segment):
                    b.recv_reduce(local[i], seg, recv_first=i < me)
        # Stage 2: leaders of slice `me` on every host reduce it across hosts.
        _cross_ring(b, [g[me] for g in groups], host, slices[me], segment)
        # Stage 3: hand the reduced slice to every other rank of the host.
        for i in range(len(local)):
            if i != me:
                for seg in segments(slices[me], segment):
                    b.send(local[i], seg)
    for j in range(m):
        if j != me:
            for seg in segments(slices[j], segment):
                b.recv(local[j], seg)


@register("allreduce", "hierarchical_arena", commutative_only=True, host_windows=True)
def hierarchical_arena(b: Builder) -> None:
    """``hierarchical`` with one-sided intra-host stages over each host's window.

    Each piece of the vector (as large as the window holds) takes: copy the slices
    the host's other leaders own into this rank's window, post; a leader reduces
    its slice straight from its host's windows into ``OUT`` and allreduces it with
    the other hosts' leaders of that slice (messages), copies the result into its
    window and posts; every rank copies the other leaders' results out. Two posts
    and a few copies per piece instead of a ring's 2(L-1) messages per segment. A
    host of one rank needs no window: its rank only takes part in the inter-host
    stage. On one host this is the one-sided ``arena`` allreduce's shape.
    """
    _arena_stages(b, pipelined=False)


@register("allreduce", "cascade_arena", commutative_only=True, host_windows=True)
def cascade_arena(b: Builder) -> None:
    """``hierarchical_arena`` with its pieces pipelined, as ``cascade`` pipelines ``hierarchical``.

    The window steps of piece k+1's first stage come before piece k's last stage,
    so piece k's messages across hosts run while the host reduces piece k+1 (Note
    [mixed schedules] in :mod:`plait.schedule.ir`: the window's steps form a chain,
    messages run beside it). Two pieces are then in the window at once, each
    stage's region twice over, so pieces are half as large.
    """
    _arena_stages(b, pipelined=True)


def _arena_stages(b: Builder, pipelined: bool) -> None:
    """The two algorithms above: stage ``A`` (in) and ``B`` (out) of each piece, the
    inter-host allreduce between them, in sequence or pipelined."""
    from plait.algos.arena import _span, _Sync  # it imports the registry

    ctx = b.ctx
    n = ctx.count
    if n == 0:
        return
    local, me, groups, m, _, host = _plan(b)
    cross = [g[me] for g in groups] if me < m and len(groups) > 1 else None
    ways, piece = 1, n
    if ctx.window > 0:  # (every rank's; 0 only where every host has one rank)
        piece = _host_piece(b, m, 1)
        if pipelined and n > piece and 2 * (2 + -(-2 // m)) <= ctx.window // ctx.itemsize:
            ways, piece = 2, _host_piece(b, m, 2)  # two pieces at a time in the window
    pipelined = ways == 2  # (a window too small for two pieces runs them in sequence)
    pieces = _span(n, piece)
    if len(local) == 1:  # alone on its host: the inter-host stage only, piece by piece
        b.copy(b.inp, b.out)
        if cross is not None:
            for o, k in pieces:
                _cross(b, cross, host, b.out.sub(o, k))
        return
    # The stages in the order they are built: A0 X0 B0 A1 X1 B1 ..., or pipelined
    # A0 A1 X0 B0 A2 X1 B1 ...; each A and B posts, at phases 1, 2, 3, ... in that order.
    order: list[tuple[str, int]] = [("A", 0)]
    for k in range(len(pieces)):
        if pipelined and k + 1 < len(pieces):
            order.append(("A", k + 1))
        order += [("X", k), ("B", k)]
        if not pipelined and k + 1 < len(pieces):
            order.append(("A", k + 1))
    posting = [st for st in order if st[0] != "X"]
    phase = {st: i + 1 for i, st in enumerate(posting)}
    # A stage reads (or lets be read) after its post: the next stage's post says it is done.
    after = {st: i + 2 for i, st in enumerate(posting)}
    inbufs = [b.shared(piece) for _ in range(ways)]
    outbufs = [b.shared(-(-piece // m)) for _ in range(ways)]
    sync = _Sync(b)
    for stage, k in order:
        o, count = pieces[k]
        parts = blocks(count, m)
        lo, ln = parts[me] if me < m else (count, 0)
        mine = b.out.sub(o + lo, ln)
        if stage == "A":  # publish the others' slices; a leader reduces its own
            inbuf = inbufs[k % ways]
            if k >= ways:  # the leaders read this region for piece k - ways
                for j in range(m):
                    if j != me:
                        sync.need(local[j], after[("A", k - ways)])
            b.copy(b.inp.sub(o, lo), inbuf.sub(0, lo))
            b.copy(b.inp.sub(o + lo + ln, count - lo - ln), inbuf.sub(lo + ln, count - lo - ln))
            b.post(phase[("A", k)])
            if ln:
                b.copy(b.inp.sub(o + lo, ln), mine)  # its own part first, then the others'
                for i, q in enumerate(local):
                    if i != me:
                        sync.get_reduce(q, inbuf.sub(lo, ln), mine, phase[("A", k)])
        elif stage == "X":
            if cross is not None and ln:
                _cross(b, cross, host, mine)
        else:  # B: publish the reduced slice; every rank copies the others' out
            outbuf = outbufs[k % ways]
            if ln:
                if k >= ways:  # its readers read this region for piece k - ways
                    for q in local:
                        if q != ctx.rank:
                            sync.need(q, after[("B", k - ways)])
                b.copy(mine, outbuf.sub(0, ln))
            b.post(phase[("B", k)])
            for j in range(m):
                jo, jn = parts[j]
                if j != me and jn:
                    sync.get(local[j], outbuf.sub(0, jn), b.out.sub(o + jo, jn), phase[("B", k)])


def _host_piece(b: Builder, leaders: int, ways: int) -> int:
    """Elements per piece: ``ways`` pieces (2 where pipelined) and their largest slices fit
    the window.

    Not cut to ``ctx.segment``: each piece costs two posts and a round of inter-host
    messages.
    """
    from plait.algos.arena import _window_elements

    room = _window_elements(b) // ways
    piece = min(b.ctx.count, int(room / (1 + 1 / leaders)))
    while piece > 1 and piece + -(-piece // leaders) > room:
        piece -= 1
    if piece < 1 or piece + -(-piece // leaders) > room:
        raise ValueError(
            f"rank {b.rank}: a window of {b.ctx.window} bytes cannot hold {ways} piece(s) "
            f"of {b.ctx.itemsize}-byte elements"
        )
    return piece


def _cross(b: Builder, cross: Sequence[int], me: int, region: Region) -> None:
    """Allreduce ``region`` with the other hosts' leaders of it (``cross``, this one ``me``)."""
    if region.count * b.ctx.itemsize < INNER_RD_BYTES:
        rd_allreduce(b, cross, me, region)
    else:
        _cross_ring(b, cross, me, region, 0)
