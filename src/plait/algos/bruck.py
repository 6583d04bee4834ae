"""Bruck's allgather and alltoall: ⌈lg p⌉ steps at distances 1, 2, 4, … for any p.

Both work in *positions* relative to the rank (Bruck, Ho, Kipnis, Upfal and
Weathersby 1997), which is what makes any p work without folding.

allgather: position i of a scratch buffer holds the block of rank r+i. Step k
(d = 2**k) sends positions [0, c) to r-d and receives positions [d, d+c) from
r+d, c = min(d, p-d): the sender's first c positions are exactly the blocks the
receiver lacks next. Each received run is copied on into ``OUT`` (at most two
copies: the run may wrap past rank p-1) while the next step is under way; the
last step receives straight into ``OUT`` when its run does not wrap.

alltoall: position i holds the block bound for rank r-i. Step k sends every
position with bit k set to r-d and receives the same positions from r+d, so a
block at position i travels i ranks in all and lands at its destination, where
position i then holds the block *from* rank r+i. Positions of a step are not
contiguous, so they are packed into one message (a copy per run) and unpacked
after; a block is read straight from ``IN`` the first time it moves and written
straight to ``OUT`` the last time (at the step of its highest bit), so there is
no separate rotation phase.

Costs (n bytes, p ranks, lg = log2):
    allgather  ⌈lg p⌉α + ((p-1)/p)·nβ      (n = whole output) + about n of local copies
    alltoall   ⌈lg p⌉α + (n/2)·⌈lg p⌉β     (n = whole input; p/2 blocks per step)
                                            + about n per step of packing and unpacking
Restrictions: none; any p, any count. ``ctx.segment`` is ignored (each step
forwards blocks gathered by the one before, and packing already makes one
message per step). alltoall is not in-place: it reads some ``IN`` blocks
after it has written ``OUT`` blocks, so in-place calls get a staged input.

Example, allgather, p=5, rank 0 (W = scratch, digits = whose block)::

    step 0  d=1  send W[0:1] -> r4   recv W[1:2] <- r1   W = 0 1 . . .
    step 1  d=2  send W[0:2] -> r3   recv W[2:4] <- r2   W = 0 1 2 3 .
    step 2  d=4  send W[0:1] -> r1   recv W[4:5] <- r4   W = 0 1 2 3 4
    Each received run goes on to OUT (step 2's straight into OUT[4]). On rank 2,
    W = 2 3 4 0 1 and step 1's run [4 0] wraps, so it is copied out in two pieces.

Example, alltoall, p=5: step d=1 moves positions 1 and 3, d=2 moves 2 and 3,
d=4 moves 4; the block at position 3 on rank 4 (bound for rank 1) goes
4 -> 3 -> 1.
"""

from __future__ import annotations

from collections.abc import Sequence

from plait.algos._cost import Cost
from plait.algos._registry import register
from plait.schedule.builder import Builder
from plait.schedule.ir import IN, Region

__all__ = ["bit_positions", "bruck_steps", "contiguous", "copy_blocks"]


def bruck_steps(size: int) -> list[tuple[int, int]]:
    """(distance, blocks) of each allgather step: distance 2**k, min(2**k, size - 2**k) blocks."""
    out = []
    d = 1
    while d < size:
        out.append((d, min(d, size - d)))
        d <<= 1
    return out


def bit_positions(size: int, distance: int) -> list[int]:
    """Positions 0 ≤ i < size with the bit ``distance`` (a power of two) set, ascending.

    These are the blocks Bruck's alltoall moves at the step of that distance.
    """
    return [i for i in range(size) if i & distance]


def contiguous(regions: Sequence[Region]) -> Region | None:
    """The one region that ``regions`` tile back to back, in order; None if they don't."""
    if not regions:
        return None
    first = regions[0]
    end = first.end
    for reg in regions[1:]:
        if reg.buf != first.buf or reg.offset != end:
            return None
        end = reg.end
    return Region(first.buf, first.offset, end - first.offset)


def copy_blocks(b: Builder, pairs: Sequence[tuple[Region, Region]]) -> None:
    """Copy every (src, dst) pair, as one copy per run where both sides continue back to back.

    A run's regions are made once, when it ends (p/2 pairs a step on thousands of ranks).
    """
    i, n = 0, len(pairs)
    while i < n:
        src, dst = pairs[i]
        src_end, dst_end = src.offset + src.count, dst.offset + dst.count
        j = i + 1
        while j < n:
            s, d = pairs[j]
            if s.buf != src.buf or s.offset != src_end or d.buf != dst.buf or d.offset != dst_end:
                break
            src_end += s.count
            dst_end += d.count
            j += 1
        if j > i + 1:
            src = Region(src.buf, src.offset, src_end - src.offset)
            dst = Region(dst.buf, dst.offset, dst_end - dst.offset)
        b.copy(src, dst)
        i = j


# -- closed-form cost (plait.algos._cost) ----------------------------------------------


def allgather_bruck(p: int, n: float, a: float, b: float, g: float, d: float) -> float:
    """``⌈lg p⌉α + ((p-1)/p)·nβ`` for the messages when p is a power of two (the paper's).

    Step j (distance 2^j) sends the first ``c_j = min(2^j, p - 2^j)`` blocks of
    the rotated scratch buffer, which need only the receives of the steps
    that filled them (position i arrives at step ⌊lg i⌋). So when p is not a
    power of two the last, short step does not wait for the one before it:
    fewer than ⌈lg p⌉ message times may be on the longest chain (p = 3 takes
    one). plait also copies its block into OUT and into scratch, and every
    received run on into OUT, one copy at a time on the rank, while messages
    go on; the last run lands in OUT directly unless it wraps past rank p-1
    on some rank. The time is the later of the message chain and the copies.
    """
    m = n / p
    steps = []
    dist = 1
    while dist < p:
        steps.append((dist, min(dist, p - dist)))
        dist <<= 1
    if not steps:
        return m * d
    scratch = m * d * (2 if len(steps) > 1 else 1)  # copies into OUT, then into scratch
    arrive: list[float] = []
    copies: list[tuple[float, int, float]] = []  # copy-outs: (ready, step, bytes)
    for j, (dist, c) in enumerate(steps):
        if j == 0:
            send = 0.0  # the first message is IN itself
        else:
            needs = (c - 1).bit_length()  # positions [1, c) came in steps < needs
            send = max([scratch, *arrive[:needs]])
        arrive.append(send + a + c * m * b)
        last = j == len(steps) - 1
        if not last or p - dist >= 2:  # the last run wraps on some rank: copied out
            copies.append((arrive[-1], j, c * m))
    t = scratch
    for ready, _, size in sorted(copies):
        t = max(t, ready) + size * d
    return max(t, *arrive)


@register("allgather", "bruck", cost=Cost(allgather_bruck, allgather_bruck, ports_pow2=True))
def allgather(b: Builder) -> None:
    """Bruck's allgather: ⌈lg p⌉ steps at distances 1, 2, 4, … in a rotated scratch buffer."""
    ctx = b.ctx
    p, r, k = ctx.size, ctx.rank, ctx.count

    def out_runs(d: int, c: int) -> list[tuple[int, int]]:
        """Positions [d, d+c) as runs (first position, length) whose OUT blocks lie back to
        back: one, or two where the run wraps past rank p-1 (what :func:`copy_blocks` of
        the c blocks one by one would merge them into, without listing them)."""
        head = p - (r + d) % p
        return [(d, c)] if c <= head or k == 0 else [(d, head), (d + head, c - head)]

    b.copy(b.inp, b.out.sub(r * k, k))
    steps = bruck_steps(p)
    if not steps:
        return
    work = b.scratch(p * k)  # position i: the block of rank r+i
    if len(steps) > 1:
        b.copy(b.inp, work.sub(0, k))
    for j, (d, c) in enumerate(steps):
        b.send((r - d) % p, b.inp if d == 1 else work.sub(0, c * k))
        runs = out_runs(d, c)
        if j == len(steps) - 1 and len(runs) == 1:  # nothing is forwarded after the last step
            b.recv((r + d) % p, b.out.sub((r + d) % p * k, c * k))
            continue
        b.recv((r + d) % p, work.sub(d * k, c * k))
        for i, n in runs:
            b.copy(work.sub(i * k, n * k), b.out.sub((r + i) % p * k, n * k))


@register("alltoall", "bruck", in_place=False)
def alltoall(b: Builder) -> None:
    """Bruck's alltoall: ⌈lg p⌉ steps, step k moving the blocks whose position has bit k set.

    Each step packs its blocks into one message and unpacks the reply, unless
    they already lie back to back (then it sends or receives in place).
    """
    ctx = b.ctx
    p, r, k = ctx.size, ctx.rank, ctx.count

    def in_block(q: int) -> Region:
        return b.inp.sub(q * k, k)

    def out_block(q: int) -> Region:
        return b.out.sub(q * k, k)

    b.copy(in_block(r), out_block(r))
    distances = [d for d, _ in bruck_steps(p)]
    if not distances:
        return
    most = max(len(bit_positions(p, d)) for d in distances)
    pack = b.scratch(most * k)
    unpack = b.scratch(most * k)
    work = b.scratch(p * k)  # position i, between its first and last move
    where = [in_block((r - i) % p) for i in range(p)]  # where position i's block is now
    for d in distances:
        moved = bit_positions(p, d)
        n = len(moved) * k
        src = contiguous([where[i] for i in moved])
        if src is None or src.buf != IN:  # only IN is never written, so never a receive target
            src = pack.sub(0, n)
            copy_blocks(b, [(where[i], pack.sub(j * k, k)) for j, i in enumerate(moved)])
        b.send((r - d) % p, src)
        # A position whose highest bit is d has arrived: the block from rank r+i.
        dsts = [out_block((r + i) % p) if i < 2 * d else work.sub(i * k, k) for i in moved]
        dst = contiguous(dsts)
        if dst is not None:
            b.recv((r + d) % p, dst)
        else:
            b.recv((r + d) % p, unpack.sub(0, n))
            copy_blocks(b, [(unpack.sub(j * k, k), to) for j, to in enumerate(dsts)])
        for i, to in zip(moved, dsts, strict=True):
            where[i] = to
