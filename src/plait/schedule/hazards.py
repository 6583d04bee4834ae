"""Data hazards: which earlier steps of a rank a step must follow, from the memory it touches.

:class:`plait.schedule.builder.Builder` derives every step's ``deps`` here: a
step that reads a region follows the last step that wrote any of it; a step
that writes one follows that writer and every step that read the region since
(read-after-write, write-after-write, write-after-read). Steps that touch
disjoint memory stay unordered, which is what lets segments pipeline.
"""

from __future__ import annotations

import bisect
from typing import Any

__all__ = ["Hazards"]


class Hazards:
    """Per buffer, the last writer of every element and its readers since, as disjoint pieces.

    An access to [start, end) depends on the last writer of every piece it
    overlaps and, if it writes, on the readers since. The pieces tile the buffer;
    ``piece`` maps each piece's start to ``[end, writer, readers]`` and ``starts``
    keeps the starts sorted (Note [hazard pieces]).

    Note [hazard pieces]
    ~~~~~~~~~~~~~~~~~~~~
    What a step depends on is a fact about elements: the last step that wrote
    each element it touches, and, for a write, the steps that read it since.
    The pieces are only a compression of that map (a piece is a run of elements
    with the same writer and readers), so where the pieces are cut changes no
    dependency. Algorithms touch the same blocks again and again (a ring's
    chunks, a segment), so most accesses are exactly one piece: found by its
    start in ``piece`` and its end compared, without a bisection or a cut. Only
    an access that starts or ends inside a piece cuts it (bisecting ``starts``),
    and a write merges the pieces it covers into one.
    """

    __slots__ = ("piece", "starts")

    _END = 1 << 62

    def __init__(self) -> None:
        self.starts: list[int] = [0]
        self.piece: dict[int, list[Any]] = {0: [self._END, -1, []]}

    def _cut(self, x: int) -> None:
        """Make ``x`` the start of a piece (cutting the piece around it)."""
        if x in self.piece:
            return
        starts = self.starts
        i = bisect.bisect_right(starts, x)
        around = self.piece[starts[i - 1]]
        self.piece[x] = [around[0], around[1], list(around[2])]
        around[0] = x
        starts.insert(i, x)

    def deps(self, start: int, end: int, write: bool, out: list[int]) -> None:
        """Append to ``out`` the steps an access to [start, end) must follow."""
        one = self.piece.get(start)
        if one is not None and one[0] == end:  # exactly one piece: the common case
            if one[1] >= 0:
                out.append(one[1])
            if write:
                out += one[2]
            return
        self._cut(start)
        self._cut(end)
        piece = self.piece
        starts = self.starts
        for s in starts[bisect.bisect_left(starts, start) : bisect.bisect_left(starts, end)]:
            one = piece[s]
            if one[1] >= 0:
                out.append(one[1])
            if write:
                out += one[2]

    def read(self, start: int, end: int, index: int, out: list[int]) -> None:
        """:meth:`deps` and :meth:`record` of step ``index``, which reads [start, end) only."""
        one = self.piece.get(start)
        if one is None or one[0] != end:
            self.deps(start, end, False, out)
            self.record(start, end, index, False)
            return
        if one[1] >= 0:
            out.append(one[1])
        one[2].append(index)

    def write(self, start: int, end: int, index: int, out: list[int]) -> None:
        """:meth:`deps` and :meth:`record` of step ``index``, which writes [start, end) only."""
        one = self.piece.get(start)
        if one is None or one[0] != end:
            self.deps(start, end, True, out)
            self.record(start, end, index, True)
            return
        if one[1] >= 0:
            out.append(one[1])
        out += one[2]
        one[1] = index
        one[2] = []

    def record(self, start: int, end: int, index: int, write: bool) -> None:
        """Step ``index`` reads or writes [start, end); :meth:`deps` has cut its ends."""
        piece = self.piece
        one = piece[start]
        if one[0] == end:
            if write:
                one[1] = index
                one[2] = []
            else:
                one[2].append(index)
            return
        if start == end:  # no element: nothing to record (the builder drops empty steps)
            return
        starts = self.starts
        i = bisect.bisect_left(starts, start)
        j = bisect.bisect_left(starts, end, i)
        if write:
            for s in starts[i + 1 : j]:
                del piece[s]
            del starts[i + 1 : j]
            one[0] = end
            one[1] = index
            one[2] = []
        else:
            for s in starts[i:j]:
                piece[s][2].append(index)
