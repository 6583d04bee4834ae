"""How builders cut buffers: a vector into one block per rank, a region into segments.

Pure arithmetic on counts and :class:`~plait.schedule.ir.Region`, shared by
every algorithm (and re-exported by :mod:`plait.schedule.builder`, where
builders import them from).
"""

from __future__ import annotations

import functools

from plait.schedule.ir import Region

__all__ = ["MOST_SEGMENTS", "blocks", "segments"]


def blocks(count: int, parts: int) -> list[tuple[int, int]]:
    """Split ``count`` elements into ``parts`` contiguous (offset, length) blocks.

    The first ``count % parts`` blocks are one element longer, as in MPI's
    ``MPI_Reduce_scatter`` conventions. Blocks may be empty when count < parts.
    Every rank of a call asks for the same blocks: they are made once (Note
    [lists every rank makes]) and each caller gets its own list of them.

    >>> blocks(7, 3)
    [(0, 3), (3, 2), (5, 2)]
    """
    return list(_blocks(count, parts))


@functools.lru_cache(maxsize=64)
def _blocks(count: int, parts: int) -> tuple[tuple[int, int], ...]:
    """:func:`blocks`, made once per (count, parts).

    Note [lists every rank makes]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    Many builders start by listing something about the whole call that every
    rank lists alike: the vector's p blocks, the virtual ranks of a folded
    group, a buffer cut into one region per rank. That is O(p) work per rank,
    O(p²) per call, and at 4,096 ranks it was most of the time it took to build
    the schedules of the O(p log p) algorithms. Such lists are made once per call
    shape (an ``lru_cache`` on what they depend on) and shared between ranks:
    they hold ints and regions, which are immutable, so sharing them changes
    nothing in any schedule, and a caller that needs a list of its own gets a
    copy (a C-speed copy, not the Python loop that made it).
    """
    base, extra = divmod(count, parts)
    longer = [(i * (base + 1), base + 1) for i in range(extra)]
    start = extra * (base + 1)
    return (*longer, *[(start + i * base, base) for i in range(parts - extra)])


#: Most segments one region is cut into: a longer region gets longer segments. A schedule's
#: size then never grows with the element count alone: an uneven call whose counts claim a
#: peer's rows by the trillion (a mistake; the peer refuses them) built its steps one by one,
#: a core busy and memory growing, before any byte could move.
MOST_SEGMENTS = 4096


def segments(region: Region, segment: int) -> list[Region]:
    """Split ``region`` into pipelining segments of at most ``segment`` elements (0: one),
    and at most :data:`MOST_SEGMENTS` of them (alike on both sides of a message: they cut
    regions of one size with one ``segment``)."""
    n = region.count
    if segment <= 0 or n <= segment:
        return [region]
    segment = max(segment, -(-n // MOST_SEGMENTS))
    return [region.sub(o, min(segment, n - o)) for o in range(0, n, segment)]
