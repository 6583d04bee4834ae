"""The shape of a table entry: :class:`Collective`, its output :class:`Piece`\\ s, :class:`Uneven`.

:mod:`plait.collectives` holds the table itself and says what the fields mean;
this module holds the classes and the helpers they share (:func:`displacements`,
:func:`fold`). It imports only :mod:`plait.ops` and numpy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from plait.ops import Op


class Piece(NamedTuple):
    """A run of one rank's flat ``OUT`` and where its elements come from.

    ``OUT[out_offset : out_offset + length]`` is, element by element,
    ``x[src_offset : src_offset + length]`` of the single rank in ``sources``
    or, when ``reduced``, the op folded over those of every rank in
    ``sources``, in that order (which is rank order).
    """

    out_offset: int
    length: int
    sources: tuple[int, ...]
    src_offset: int
    reduced: bool


#: ``(size, count, rank, root) -> (IN, OUT)`` element counts; ``count`` is the call's unit.
CountsFn = Callable[[int, int, int, int], tuple[int, int]]
#: ``(size, count, rank, root) ->`` the pieces of the rank's ``OUT``, or None.
PiecesFn = Callable[[int, int, int, int], tuple[Piece, ...] | None]
Shape = tuple[int, ...]
#: Per-rank counts of an uneven call: one per rank, or a size×size matrix row-major.
Counts = tuple[int, ...]
#: ``(size, counts, rank, root) -> (IN, OUT)`` element counts of an uneven call.
UnevenCountsFn = Callable[[int, Counts, int, int], tuple[int, int]]
#: ``(size, counts, rank, root) ->`` the pieces of the rank's ``OUT``, or None.
UnevenPiecesFn = Callable[[int, Counts, int, int], tuple[Piece, ...] | None]


@dataclass(frozen=True, slots=True)
class Uneven:
    """How an uneven collective reads its per-rank counts.

    Attributes:
        even: the collective it generalises (``allgather`` for ``allgatherv``).
        matrix: whether the counts are a size×size matrix, row-major, entry
            ``i * size + j`` what rank i sends rank j (alltoallv); otherwise
            one count per rank (the block rank r contributes or receives).
        counts: ``(size, counts, rank, root) -> (IN, OUT)`` element counts.
        pieces: ``(size, counts, rank, root) ->`` the pieces of the rank's ``OUT``.
    """

    even: str
    matrix: bool
    counts: UnevenCountsFn
    pieces: UnevenPiecesFn

    def length(self, size: int) -> int:
        """How many counts a call on ``size`` ranks carries."""
        return size * size if self.matrix else size


def displacements(counts: Sequence[int]) -> list[int]:
    """Exclusive prefix sums: where each block starts when the blocks lie back to back.

    >>> displacements([2, 0, 3])
    [0, 2, 2]
    """
    out, total = [], 0
    for c in counts:
        out.append(total)
        total += c
    return out


@dataclass(frozen=True, slots=True)
class Collective:
    """One collective: its buffers, its result and its bandwidth accounting.

    Attributes:
        name: as in ``comm.<name>(...)`` and ``algorithm=`` listings.
        reduces: whether it combines data with a reduction op (``op=``).
        rooted: whether it has a ``root`` argument.
        blocked: whether its whole buffer ``S`` is ``size`` blocks of ``count``
            (nccl-tests' convention, which ``auto`` and the bench size by).
        split_input: whether ``x`` is cut into ``size`` blocks along axis 0, so
            that ``count`` is ``x.size // size`` (otherwise ``x.size``).
        fills_x: whether the call writes its result into ``x`` itself, root's
            data starting in ``OUT`` (broadcast: the schedule has no ``IN``).
        replicated: whether every rank gets the same result, which must then
            be bit-identical everywhere (reductions in the same order).
        synchronizes: whether the call moves no data and its whole postcondition
            is that no rank leaves before every rank has entered (barrier).
        counts: ``(size, count, rank, root) -> (IN, OUT)`` element counts of one
            rank's schedule buffers (a fabric's switches, ``rank >= size``, have none).
        pieces: ``(size, count, rank, root) ->`` what the rank's ``OUT`` holds,
            or None where the call returns nothing on that rank.
        result_shape: ``(x.shape, size) ->`` the shape of the array a call returns.
        bus_factor: ``size -> busbw / algbw``, nccl-tests' factor: the fraction of
            ``S`` that crosses the busiest link of an optimal algorithm.
        uneven: for an uneven collective, how it reads per-rank counts; None for
            the even ones. ``counts``, ``pieces`` and ``result_shape`` then
            describe the call whose counts are all ``count``.
    """

    name: str
    reduces: bool
    rooted: bool
    blocked: bool
    split_input: bool
    fills_x: bool
    replicated: bool
    synchronizes: bool
    counts: CountsFn
    pieces: PiecesFn
    result_shape: Callable[[Shape, int], Shape]
    bus_factor: Callable[[int], float]
    uneven: Uneven | None = None

    def check_counts(self, size: int, counts: Sequence[int] | None) -> None:
        """ValueError unless ``counts`` fits this collective on ``size`` ranks.

        Even collectives take none; uneven ones take None (every count equal
        to ``count``) or :meth:`Uneven.length` non-negative integers.
        """
        if counts is None:
            return
        self._uneven_of(size, counts)
        if any(not isinstance(c, int | np.integer) or c < 0 for c in counts):
            raise ValueError(f"{self.name}: counts must be integers >= 0; got {list(counts)}")

    def _uneven_of(self, size: int, counts: Sequence[int]) -> Uneven:
        """The :class:`Uneven` entry, if ``counts`` has the length it needs (O(1))."""
        if self.uneven is None:
            raise ValueError(f"{self.name} takes one count, not per-rank counts")
        want = self.uneven.length(size)
        if len(counts) != want:
            what = f"a {size}x{size} matrix" if self.uneven.matrix else "one per rank"
            raise ValueError(
                f"{self.name} on {size} ranks needs {want} counts ({what}); got {len(counts)}"
            )
        return self.uneven

    def even_counts(self, size: int, count: int) -> Counts:
        """The per-rank counts of the call whose counts are all ``count`` (uneven collectives)."""
        if self.uneven is None:
            raise ValueError(f"{self.name} takes one count, not per-rank counts")
        return (count,) * self.uneven.length(size)

    def buffer_counts(
        self, size: int, count: int, rank: int, root: int, counts: Counts | None = None
    ) -> tuple[int, int]:
        """Element counts of (IN, OUT) of ``rank``'s schedule; (0, 0) for a fabric's switch.

        ``counts``: an uneven call's per-rank counts; None reads ``count``. Only
        their length is checked here, once per rank and call; whoever takes
        counts from a caller checks their values once (:meth:`check_counts`).
        """
        uneven = self._uneven_of(size, counts) if counts is not None else None
        if rank >= size:
            return 0, 0
        if uneven is not None:
            assert counts is not None
            return uneven.counts(size, counts, rank, root)
        return self.counts(size, count, rank, root)

    def output_pieces(
        self, size: int, count: int, rank: int, root: int, counts: Counts | None = None
    ) -> tuple[Piece, ...] | None:
        """What ``rank``'s ``OUT`` holds (see :attr:`pieces`), for per-rank ``counts`` too."""
        if counts is not None:
            return self._uneven_of(size, counts).pieces(size, counts, rank, root)
        return self.pieces(size, count, rank, root)

    def uneven_whole(self, size: int, counts: Counts) -> int:
        """The whole buffer ``S`` of an uneven call, in elements (as ``whole_count`` for even).

        The sum of the counts (every block once), or for a matrix the most any
        one rank sends or receives: with equal counts both are ``size * count``.
        """
        if not self._uneven_of(size, counts).matrix:
            return sum(counts)
        rows = [sum(counts[i * size : (i + 1) * size]) for i in range(size)]
        cols = [sum(counts[j::size]) for j in range(size)]
        return max([*rows, *cols], default=0)

    def unit_count(self, whole: int, size: int) -> int:
        """``count`` for a whole buffer of ``whole`` elements (rounded down to whole blocks).

        0 for a collective that moves no data, whatever ``whole`` says.
        """
        if self.synchronizes:
            return 0
        return whole // size if self.blocked else whole

    def whole_count(self, count: int, size: int) -> int:
        """Elements of the whole buffer ``S`` of a call whose unit is ``count``."""
        return count * size if self.blocked else count

    def x_count(self, x_size: int, size: int) -> int:
        """``count`` of a call whose ``x`` has ``x_size`` elements."""
        return x_size // size if self.split_input else x_size

    def reference(
        self,
        inputs: Sequence[np.ndarray | None],
        *,
        op: Op | None = None,
        root: int = 0,
        counts: Sequence[int] | None = None,
    ) -> list[np.ndarray | None]:
        """Every rank's expected result, computed directly with numpy (see :func:`reference`)."""
        size = len(inputs)
        arrays = [np.asarray(x) if x is not None else None for x in inputs]
        shaped = arrays[root] if self.rooted and 0 <= root < size else None
        if shaped is None:
            shaped = next((a for a in arrays if a is not None), None)
        if shaped is None:
            shaped = np.empty(0)
        count = self.x_count(shaped.size, size)
        self.check_counts(size, counts)
        given = tuple(int(c) for c in counts) if counts is not None else None
        flat = [a.reshape(-1) if a is not None else None for a in arrays]
        results: list[np.ndarray | None] = []
        for r in range(size):
            pieces = self.output_pieces(size, count, r, root, given)
            if pieces is None:
                results.append(None)
                continue
            parts: list[np.ndarray] = []
            for piece in pieces:
                lo, hi = piece.src_offset, piece.src_offset + piece.length
                runs = []
                for q in piece.sources:
                    x = flat[q]
                    if x is None:
                        raise ValueError(f"{self.name}: rank {q}'s input is needed, got None")
                    runs.append(x[lo:hi])
                if piece.reduced:
                    if op is None:
                        raise ValueError(f"{self.name} reduces: pass op=")
                    parts.append(fold(op, runs, size))
                else:
                    parts.append(runs[0])
            if not parts:
                out = np.empty(0, dtype=shaped.dtype)
            elif len(parts) == 1:
                out = np.array(parts[0], copy=True)
            else:
                out = np.concatenate(parts)
            if given is None:  # an uneven call's result is flat
                out = out.reshape(self.result_shape(shaped.shape, size))
            results.append(out)
        return results


def fold(op: Op, arrays: Sequence[np.ndarray], size: int) -> np.ndarray:
    """``op`` over ``arrays`` in order (a new array), then divided by ``size`` for ``AVG``.

    Floating-point warnings are silenced, as the executor silences them: an
    overflow to inf is a result, not an error.
    """
    acc = np.array(arrays[0], copy=True)
    flat = acc.reshape(-1)  # a view: acc is a fresh copy; kernels take 1-D arrays
    kernel = op.kernel(acc.dtype)
    with np.errstate(all="ignore"):
        for x in arrays[1:]:
            kernel(flat, np.asarray(x).reshape(-1), out=flat)
        if op.average:
            np.divide(acc, size, out=acc)
    return acc
