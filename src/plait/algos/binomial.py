"""Binomial trees: reduce, broadcast, allreduce as the one then the other, gather and scatter.

Ranks are renumbered relative to the root (vrank ``v = (rank - root) % p``) and
hung on the binomial tree of :func:`plait.algos.topology.binomial_parent`:
``v`` talks to its parent ``v`` with the lowest set bit cleared, and its subtree
is the contiguous range of vranks ``[v, v + subtree_size(v, p))``. Each level
doubles the ranks that hold (or have contributed) data, so there are ⌈lg p⌉
levels. Reduce and broadcast move the whole vector over every edge and are
pipelined: every message is cut into ``ctx.segment``-element segments, and the
builder's hazard tracking lets a segment go on up (or down) the tree as soon as
it is combined (received). Gather and scatter move, over each edge, the blocks
of the subtree below it (MPICH's algorithm), segmented in the same way.

Costs (n bytes, p ranks; Thakur, Rabenseifner & Gropp 2005):
    reduce     ⌈lg p⌉(α + nβ + nγ)
    broadcast  ⌈lg p⌉(α + nβ)
    allreduce  2⌈lg p⌉(α + nβ) + ⌈lg p⌉nγ        (reduce to rank 0, then broadcast)
    gather     ⌈lg p⌉α + ((p-1)/p)·nβ            (n = the root's whole output)
    scatter    ⌈lg p⌉α + ((p-1)/p)·nβ            (n = the root's whole input)
Segments of s bytes bring reduce and broadcast towards (⌈lg p⌉ + n/s - 1)(α + sβ).

Restrictions: none; any p, any count, any root. Each subtree is a contiguous
range of tree positions, combined lower range first, so on a tree over the real
ranks contributions meet in rank order. A non-commutative reduce therefore runs
the tree rooted at rank 0 and then sends the result to the root if that is not
0 (one more α + nβ); allreduce always reduces to rank 0. With root ≠ 0, the one
subtree of a gather or scatter whose vrank range wraps past rank p-1 moves as
two messages, one per run of real ranks, so blocks land in place in the root's
buffer without a staging copy.

Example, p=5, root=0 (each rank's subtree in brackets; children nearest first):

    0 [0,5) ─┬─ 1 [1,2)
             ├─ 2 [2,4) ── 3 [3,4)
             └─ 4 [4,5)

    reduce:    3→2 (x2∘x3) while 1→0; then 2→0, 4→0:  0 holds ((x0∘x1)∘(x2∘x3))∘x4
    broadcast: 0→4, 0→2, 0→1 (farthest subtree first); 2→3
    gather, root=1 (vrank v is rank (v+1)%5): vrank 2 [2,4) is ranks 3, 4 and
               sends them as one message; vrank 4 is rank 0. With p=4, root=1,
               vrank 2's range [2,4) is ranks 3, 0: two messages, blocks 3 and 0.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from plait.algos._cost import Cost
from plait.algos._registry import register
from plait.algos._rooted import agree_on_root, ends_with_the_roots_word
from plait.algos.topology import binomial_children, binomial_parent
from plait.schedule.builder import Builder, segments
from plait.schedule.ir import Region

__all__ = [
    "WORD_BYTES",
    "binomial_bcast",
    "binomial_reduce",
    "relative_group",
    "roots_word_time",
    "subtree_size",
    "wrap_runs",
]


# -- pure rank arithmetic -----------------------------------------------------------


def subtree_size(vrank: int, size: int) -> int:
    """Number of vranks in ``vrank``'s subtree ``[vrank, vrank + n)`` of a binomial tree.

    The root's subtree is everything; another vrank's spans its lowest set bit,
    cut off at ``size``::

        size 6:  vrank  0  1  2  3  4  5
                 n      6  1  2  1  2  1
    """
    if vrank == 0:
        return size
    return min(vrank & -vrank, size - vrank)


def relative_group(root: int, size: int) -> list[int]:
    """Real rank of each tree position when vranks are counted from ``root``."""
    return list(_relative_group(root, size))


@functools.lru_cache(maxsize=64)
def _relative_group(root: int, size: int) -> tuple[int, ...]:
    """:func:`relative_group`, made once per (root, size): every rank of a call lists it
    alike (Note [lists every rank makes] in :mod:`plait.schedule.builder`)."""
    return tuple([(root + v) % size for v in range(size)])


def wrap_runs(lo: int, hi: int, root: int, size: int) -> list[tuple[int, int]]:
    """Split vranks ``[lo, hi)`` into the runs that are contiguous in real ranks.

    Vrank ``v`` is real rank ``(v + root) % size``, so a range is cut at most
    once, at the vrank of real rank 0. Empty ranges give no runs::

        size 4, root 1:  [2, 4) -> [(2, 3), (3, 4)]   (ranks 3 | 0)
                         [1, 3) -> [(1, 3)]           (ranks 2, 3)
    """
    if lo >= hi:
        return []
    cut = (size - root) % size
    if lo < cut < hi:
        return [(lo, cut), (cut, hi)]
    return [(lo, hi)]


# -- schedule fragments ---------------------------------------------------------------


def binomial_reduce(
    b: Builder,
    group: Sequence[int],
    me: int,
    src: Region,
    acc: Region | None,
    segment: int,
) -> None:
    """Reduce ``src`` over the tree on ``group`` positions into ``acc`` at position 0.

    ``group[i]`` is the real rank at position ``i``; ``me`` is ours. Each
    position combines its children's subtrees into its own contribution in
    position order (``acc ∘ child``), so a ``group`` monotone in rank keeps a
    non-commutative op in rank order. Leaves send ``src`` as it is; inner
    positions work in ``acc``, or in fresh scratch if ``acc`` is None.
    """
    p = len(group)
    parent = binomial_parent(me)
    children = binomial_children(me, p)
    work = src
    if children or parent < 0:
        work = acc if acc is not None else b.scratch(src.count)
        b.copy(src, work)
    for seg in segments(work, segment):
        for child in children:
            b.recv_reduce(group[child], seg, recv_first=False)
        if parent >= 0:
            b.send(group[parent], seg)


def binomial_bcast(b: Builder, group: Sequence[int], me: int, region: Region, segment: int) -> None:
    """Broadcast ``region`` from position 0 over the tree on ``group`` positions.

    Each segment is received from the parent and passed on to the children,
    farthest (largest) subtree first.
    """
    p = len(group)
    parent = binomial_parent(me)
    children = binomial_children(me, p)[::-1]
    for seg in segments(region, segment):
        if parent >= 0:
            b.recv(group[parent], seg)
        for child in children:
            b.send(group[child], seg)


# -- registered algorithms ------------------------------------------------------------


# -- closed-form cost (plait.algos._cost) ----------------------------------------------


def reduce_binomial(p: int, n: float, a: float, b: float, g: float, d: float) -> float:
    """Binomial reduce: power of two, ``max(nδ, α + nβ) + nγ + (lg p - 1)(α + nβ + nγ)``.

    Paper: ``⌈lg p⌉(α + nβ + nγ)``. An inner node copies its input into its
    working buffer (nδ) while its first child's message is on the way, then
    reduces its children in order, each when its message is there. For other
    p, a subtree of s ranks (children at distances 1, 2, 4, … with subtrees of
    min(d, s-d) ranks) is ready to send at ``R(s)``: its copy, then each
    child's message ``max(previous, R(child) + α + nβ) + nγ``; leaves send at
    once. p = 1 is the copy alone.
    """
    return _binomial_ready(p, n, a, b, g, d) if p > 1 else n * d


@functools.lru_cache(maxsize=1024)
def _binomial_ready(s: int, n: float, a: float, b: float, g: float, d: float) -> float:
    if s == 1:
        return 0.0
    t = n * d
    dist = 1
    while dist < s:
        child = min(dist, s - dist)
        t = max(t, _binomial_ready(child, n, a, b, g, d) + a + n * b) + n * g
        dist <<= 1
    return t


def broadcast_binomial(p: int, n: float, a: float, b: float, g: float, d: float) -> float:
    """``depth·(α + nβ)``: ``lg p·(α + nβ)`` for a power of two, the paper's.

    The paper's root sends its ⌈lg p⌉ messages one after the other, so its
    last child waits ⌈lg p⌉ message times. plait's ranks send to all their
    children at once, so the time is the depth of the tree: the most set bits
    of a vrank below p, ``max(popcount(p-1), bit_length(p-1) - 1)``, which is
    ⌈lg p⌉ - 1 for some p that are not powers of two (p = 3, 5, 6, 9, …).
    """
    return _binomial_depth(p) * (a + n * b)


def _binomial_depth(p: int) -> int:
    """Edges from the root to the deepest vrank of a binomial tree over p ranks."""
    x = p - 1
    return max(x.bit_count(), x.bit_length() - 1) if x else 0


def broadcast_binomial_ports(p: int, n: float, a: float, b: float, g: float, d: float) -> float:
    """With ports: a rank's k children share its send port, so all get the data after knβ.

    A subtree of s ranks takes ``α + ⌈lg s⌉·nβ`` plus its slowest child's
    subtree; for p = 2^k that is ``k·α + k(k+1)/2·nβ`` (the paper's
    ``k(α + nβ)`` sends the same messages one after another).
    """
    return _bcast_ports(p, n * b, a)


@functools.lru_cache(maxsize=1024)
def _bcast_ports(s: int, nb: float, a: float) -> float:
    if s == 1:
        return 0.0
    children = []
    dist = 1
    while dist < s:
        children.append(min(dist, s - dist))
        dist <<= 1
    return a + len(children) * nb + max(_bcast_ports(c, nb, a) for c in children)


def allreduce_binomial(p: int, n: float, a: float, b: float, g: float, d: float) -> float:
    """Binomial reduce to rank 0, then binomial broadcast from it (see both)."""
    return reduce_binomial(p, n, a, b, g, d) + broadcast_binomial(p, n, a, b, g, d)


def allreduce_binomial_ports(p: int, n: float, a: float, b: float, g: float, d: float) -> float:
    """With ports: the reduce (no two messages meet for p = 2^k), then the broadcast."""
    return reduce_binomial(p, n, a, b, g, d) + broadcast_binomial_ports(p, n, a, b, g, d)


#: The bytes of the root's word (Note [the root's word] in plait.algos._rooted) as the closed
#: forms count them: one float32 element (another type changes the time by depth·Δbytes·β).
WORD_BYTES = 4


def roots_word_time(p: int, a: float, b: float, g: float, d: float, ports: bool = False) -> float:
    """The root's word, from the moment the root has everything: a binomial broadcast of
    :data:`WORD_BYTES`."""
    bcast = broadcast_binomial_ports if ports else broadcast_binomial
    return bcast(p, WORD_BYTES, a, b, g, d)


def reduce_binomial_call(p: int, n: float, a: float, b: float, g: float, d: float) -> float:
    """The registered reduce: :func:`reduce_binomial`, then the root's word."""
    return reduce_binomial(p, n, a, b, g, d) + roots_word_time(p, a, b, g, d)


def reduce_binomial_call_ports(p: int, n: float, a: float, b: float, g: float, d: float) -> float:
    """With ports (p = 2^k): the reduce, then the root's word sent child after child."""
    return reduce_binomial(p, n, a, b, g, d) + roots_word_time(p, a, b, g, d, ports=True)


@register(
    "reduce",
    "binomial",
    cost=Cost(reduce_binomial_call, reduce_binomial_call_ports, ports_pow2=True),
)
@ends_with_the_roots_word
def reduce(b: Builder) -> None:
    """Binomial-tree reduce to the root: ⌈lg p⌉ steps of the whole vector, pipelined."""
    ctx = b.ctx
    p, r, root = ctx.size, ctx.rank, ctx.root
    if ctx.commutative or root == 0:
        acc = b.out if r == root else None
        binomial_reduce(b, relative_group(root, p), (r - root) % p, b.inp, acc, ctx.segment)
        return
    # Non-commutative, root ≠ 0: reduce in rank order at rank 0, then hand the result
    # to the root. (Aliased IN/OUT on the root is safe: what it receives depends on
    # its own contribution, so it arrives only after that has been read.)
    if r == 0:
        result = b.scratch(ctx.count)
        binomial_reduce(b, range(p), r, b.inp, result, ctx.segment)
        for seg in segments(result, ctx.segment):
            b.send(root, seg)
        return
    binomial_reduce(b, range(p), r, b.inp, None, ctx.segment)
    if r == root:
        for seg in segments(b.out, ctx.segment):
            b.recv(0, seg)


@register("broadcast", "binomial", cost=Cost(broadcast_binomial, broadcast_binomial_ports))
def broadcast(b: Builder) -> None:
    """Binomial-tree broadcast from the root: ⌈lg p⌉ steps of the whole vector, pipelined."""
    ctx = b.ctx
    p, root = ctx.size, ctx.root
    agree_on_root(b)
    binomial_bcast(b, relative_group(root, p), (ctx.rank - root) % p, b.out, ctx.segment)


@register(
    "allreduce",
    "binomial",
    cost=Cost(allreduce_binomial, allreduce_binomial_ports, ports_pow2=True),
)
def allreduce(b: Builder) -> None:
    """Binomial reduce to rank 0, then binomial broadcast: 2⌈lg p⌉ steps, pipelined."""
    ctx = b.ctx
    group = range(ctx.size)
    binomial_reduce(b, group, ctx.rank, b.inp, b.out, ctx.segment)
    binomial_bcast(b, group, ctx.rank, b.out, ctx.segment)


@register("gather", "binomial")
@ends_with_the_roots_word
def gather(b: Builder) -> None:
    """Binomial-tree gather: each rank forwards its subtree's blocks, ⌈lg p⌉ steps."""
    ctx = b.ctx
    p, r, root, k = ctx.size, ctx.rank, ctx.root, ctx.count
    v = (r - root) % p
    parent = binomial_parent(v)
    children = binomial_children(v, p)
    if parent < 0:
        # The root receives every run of real ranks straight into its place in OUT.
        b.copy(b.inp, b.out.sub(r * k, k))
        for child in children:
            for lo, hi in wrap_runs(child, child + subtree_size(child, p), root, p):
                run = b.out.sub((lo + root) % p * k, (hi - lo) * k)
                for seg in segments(run, ctx.segment):
                    b.recv((child + root) % p, seg)
        return
    # Others collect their subtree in vrank order (leaves just send their input).
    n = subtree_size(v, p)
    buf = b.inp
    if children:
        buf = b.scratch(n * k)
        b.copy(b.inp, buf.sub(0, k))
        for child in children:
            part = buf.sub((child - v) * k, subtree_size(child, p) * k)
            for seg in segments(part, ctx.segment):
                b.recv((child + root) % p, seg)
    runs = wrap_runs(v, v + n, root, p) if parent == 0 else [(v, v + n)]
    for lo, hi in runs:
        for seg in segments(buf.sub((lo - v) * k, (hi - lo) * k), ctx.segment):
            b.send((parent + root) % p, seg)


@register("scatter", "binomial")
def scatter(b: Builder) -> None:
    """Binomial-tree scatter: each rank passes on its subtree's blocks, ⌈lg p⌉ steps."""
    ctx = b.ctx
    p, r, root, k = ctx.size, ctx.rank, ctx.root, ctx.count
    agree_on_root(b)
    v = (r - root) % p
    parent = binomial_parent(v)
    children = binomial_children(v, p)[::-1]  # farthest subtree first
    if parent < 0:
        # The root sends every run of real ranks straight from its place in IN.
        b.copy(b.inp.sub(r * k, k), b.out)
        for child in children:
            for lo, hi in wrap_runs(child, child + subtree_size(child, p), root, p):
                run = b.inp.sub((lo + root) % p * k, (hi - lo) * k)
                for seg in segments(run, ctx.segment):
                    b.send((child + root) % p, seg)
        return
    # Others receive their subtree in vrank order (leaves straight into OUT).
    n = subtree_size(v, p)
    buf = b.scratch(n * k) if children else b.out
    runs = wrap_runs(v, v + n, root, p) if parent == 0 else [(v, v + n)]
    for lo, hi in runs:
        for seg in segments(buf.sub((lo - v) * k, (hi - lo) * k), ctx.segment):
            b.recv((parent + root) % p, seg)
    for child in children:
        part = buf.sub((child - v) * k, subtree_size(child, p) * k)
        for seg in segments(part, ctx.segment):
            b.send((child + root) % p, seg)
    if children:
        b.copy(buf.sub(0, k), b.out)
