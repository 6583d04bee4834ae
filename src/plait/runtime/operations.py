"""The operations of a compiled one-sided schedule (:mod:`plait.runtime.compiled`): their
codes and fields, what each names, and where a large call's repeat, so that its generated
run loops over its pieces (Note [rolled pieces]).

Note [rolled pieces]
    A call larger than its window is cut into pieces (:mod:`plait.algos.arena`), and
    every piece is the same operations as the one before on other regions, other
    views of the window and later phases. Written out one by one (Note [generated
    runs] in :mod:`plait.runtime.compiled`), the source of a call grew with its
    pieces: a 64 MiB allreduce on 2 ranks was 0.48 MB of source and 0.17-0.54 s to
    compile, 512 MiB 3.9 MB and 1.5-4.7 s, and each new size compiled its own, so a
    loop over varying large sizes spent its time compiling and kept megabytes a size
    (docs/performance.md). So where a half has more than :data:`WRITTEN_OUT`
    operations, :func:`stretches` looks for the longest stretch of them that is one
    period of operations repeated, each period with a post in it (a piece posts
    what it put in the window), and the generated run loops over that stretch: the
    period's operations are written once, and what differs from one period to the
    next (each region's slice, each view, each phase) is read from a table bound
    with the run, a row a period (:func:`rows`). The operations before and after
    the stretch are written out (the first piece waits for less, the last may be
    shorter), looked at again for a stretch of their own where they are many; their
    phases are names too, and the names of operations and regions are numbered in
    the order they are written, so that nothing in the source depends on the
    number of pieces.

    A period's operations must be alike in all but those values (:class:`Shapes`):
    the same codes and orders, the same caller's buffer for each region, the same
    peers and places of their words, and the same operands of one element (their
    folds are other lines: Note [one-element folds] in :mod:`plait.ops`). The loop
    runs the same operations in the same order with the same operands as the lines
    written out would, so the bits are theirs. Calls of one kind and many sizes
    then share one compiled function, as small calls do; a call of one piece, or
    of a few, is written out as before. A loop costs nothing measurable: a call of
    200 pieces of 40 bytes ran in 248 µs looped against 355 µs written out.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

__all__ = ["WRITTEN_OUT", "Shapes", "operands", "phase_of", "rows", "stretches"]

# Operation codes of a compiled schedule (Note [compiled one-sided schedules] in
# plait.runtime.compiled): an operation is (code, source, destination, first) and, for those
# on a peer (from _GET on), (peer, phase, (peer,), probe); a _FOLD is (code, left operand,
# destination, right operand, peer, phase, (peer,), probe); a _POST is (code, phase). The
# one-tuple is what the flight recorder's slot says the call waits for, made once; the probe
# is where the peer's counter and digest are read (Window.probe). _SELF_COPY: a _COPY from
# IN to OUT at equal offsets, skipped in place. An operand is a place in one numbering: the
# caller's buffers IN, OUT and TMP (0-2), then their regions, then the window's views.
_POST, _COPY, _SELF_COPY, _REDUCE, _GET, _GET_REDUCE, _WAIT, _FOLD = range(8)

#: A half of at most this many operations is written out whole; of more, its repeats loop.
WRITTEN_OUT = 16

#: Periods tried, counted in anchors (posts) from a few places in the operations: a
#: piece of the arena algorithms posts once or twice.
_ANCHORS_PER_PERIOD = 16


def operands(op: tuple[Any, ...]) -> tuple[int, ...]:
    """The operands ``op`` names, in the order of its fields."""
    code = op[0]
    if code in (_POST, _WAIT):
        return ()
    return (op[1], op[2], op[3]) if code == _FOLD else (op[1], op[2])


def phase_of(op: tuple[Any, ...]) -> int | None:
    """The phase ``op`` posts or waits for; None for an operation of this rank alone."""
    code = op[0]
    return int(op[1]) if code == _POST else int(op[5]) if code >= _GET else None


class Shapes:
    """What one half's operations name: the caller's ``regions`` (buffer, start, end) from
    operand 3 on, every operand's element count before the views (``sizes``), and the
    window's views (``consts``), which follow."""

    def __init__(
        self, regions: tuple[tuple[int, int, int], ...], sizes: list[int], consts: Any
    ) -> None:
        self.regions, self.sizes, self.consts, self.n = regions, sizes, consts, len(sizes)

    def one(self, k: int) -> bool:
        """Whether operand ``k`` is one element."""
        return (self.sizes[k] if k < self.n else self.consts[k - self.n].size) == 1

    def of(self, op: tuple[Any, ...]) -> Hashable:
        """All that ``op``'s lines say but what a loop's table gives: its code, order,
        operands (a caller's buffer by its place, a region by its buffer, a view; each
        with whether it is one element), and its peer with its words' places."""
        code = op[0]
        if code == _POST:
            return (_POST,)
        kinds = tuple(
            (k,) if k < 3 else (self.regions[k - 3][0] if k < self.n else 3, self.one(k))
            for k in operands(op)
        )
        shape: tuple[Any, ...] = (code, None if code == _FOLD else op[3], kinds)
        if code >= _GET:
            probe = op[7]
            shape += (op[4], int(probe[1]), int(probe[3]))
        return shape


def rows(
    ops: list[tuple[Any, ...]], lo: int, hi: int, period: int, shapes: Shapes
) -> tuple[tuple[Any, ...], ...]:
    """The table of a loop over ``ops[lo:hi]``: a row for each period, with its regions'
    slices, its views and its phases in the order of its operations and their fields."""
    n = shapes.n
    table = []
    for at in range(lo, hi, period):
        row: list[Any] = []
        for op in ops[at : at + period]:
            for k in operands(op):
                if 3 <= k < n:
                    row.append(slice(*shapes.regions[k - 3][1:]))
                elif k >= n:
                    row.append(shapes.consts[k - n])
            phase = phase_of(op)
            if phase is not None:
                row.append(phase)
        table.append(tuple(row))
    return tuple(table)


def stretches(
    keys: Sequence[Hashable], anchor: Hashable, shortest: int
) -> list[tuple[int, int, int]]:
    """Cut the operations whose shapes are ``keys`` into stretches ``(start, end, period)``
    that follow each other from 0 to ``len(keys)``: a period of 0 is a stretch written out;
    else ``keys[start:end]`` is ``keys[start:start + period]`` again and again, at least
    twice, the period holds an ``anchor``, and the stretch is more than ``shortest``
    operations (Note [rolled pieces])."""
    ids: dict[Hashable, int] = {}
    k = np.array([ids.setdefault(key, len(ids)) for key in keys], dtype=np.int64)
    out: list[tuple[int, int, int]] = []
    if anchor in ids:
        _cut(k, ids[anchor], 0, len(k), shortest, out)
    elif len(k):
        out.append((0, len(k), 0))
    return out


def _cut(
    k: np.ndarray, anchor: int, lo: int, hi: int, shortest: int, out: list[tuple[int, int, int]]
) -> None:
    """Stretches of ``k[lo:hi]`` into ``out``: the longest repeat, and around it the same."""
    found = _repeat(k, anchor, lo, hi, shortest) if hi - lo > shortest else None
    if found is None:
        if hi > lo:
            out.append((lo, hi, 0))
        return
    start, period, times = found
    end = start + period * times
    _cut(k, anchor, lo, start, shortest, out)
    out.append((start, end, period))
    _cut(k, anchor, end, hi, shortest, out)


def _repeat(
    k: np.ndarray, anchor: int, lo: int, hi: int, shortest: int
) -> tuple[int, int, int] | None:
    """The stretch of ``k[lo:hi]`` that one period repeated covers most: ``(start, period,
    times)``, the period the shortest of those that cover as much; None where none covers
    more than ``shortest``.

    A period is a distance between two anchors (a shift that maps the stretch onto itself
    maps a post onto a post), tried from a quarter, half and three quarters of the way.
    """
    at = np.flatnonzero(k[lo:hi] == anchor)
    periods = {
        int(at[i + j] - at[i])
        for i in {len(at) // 4, len(at) // 2, 3 * len(at) // 4}
        for j in range(1, _ANCHORS_PER_PERIOD + 1)
        if i + j < len(at)
    }
    best: tuple[int, int, int, int] | None = None  # (covered, start, period, times)
    for p in sorted(periods):
        if 2 * p > hi - lo:
            break
        same = (k[lo : hi - p] == k[lo + p : hi]).astype(np.int8)
        edges = np.flatnonzero(np.diff(np.concatenate(([0], same, [0]))))
        starts, ends = edges[::2], edges[1::2]  # runs of equal keys p apart
        if not len(starts):
            continue
        i = int(np.argmax(ends - starts))
        start = lo + int(starts[i])
        times = (int(ends[i] - starts[i]) + p) // p
        if times * p <= shortest or times < 2 or not (k[start : start + p] == anchor).any():
            continue
        if best is None or times * p > best[0]:
            best = (times * p, start, p, times)
    return None if best is None else best[1:]
