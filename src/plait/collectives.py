"""What each collective means, described once: one :class:`Collective` per name in :data:`TABLE`.

Everything that has to know what a collective *is* reads it here instead of
branching on its name: the registry sizes every rank's buffers from
:meth:`Collective.counts`, the symbolic prover states its postcondition from
:meth:`Collective.pieces`, :func:`reference` (re-exported as
:func:`plait.testing.reference`) computes every rank's expected result from the
same pieces, the simulator sizes and checks its data with them, and the bench
reads the bus-bandwidth factor and the block layout of nccl-tests.

Two counts appear throughout, as in :class:`plait.schedule.builder.Context`:

* ``count``, the *unit* of a call: the whole vector for allreduce, reduce and
  broadcast; one rank's block for the block collectives (reduce_scatter,
  allgather, alltoall, gather, scatter); 0 for barrier.
* the *whole buffer* ``S`` that ``plait bench``, nccl-tests and
  :func:`plait.sim.simulate` size a call by: ``count`` or, for the block
  collectives (:attr:`Collective.blocked`), ``size * count``.

A rank's output is a list of :class:`Piece`\\ s: runs of its flat ``OUT``, each
copied from one rank's flat ``x`` or reduced over several. For 3 ranks and
``count = 2``, rank 1 of reduce_scatter holds one piece,
``Piece(0, 2, (0, 1, 2), 2, True)`` (elements 2..3 of every rank's input,
reduced in rank order), and rank 1 of alltoall holds three,
``Piece(0, 2, (0,), 2, False)``, ``Piece(2, 2, (1,), 2, False)`` and
``Piece(4, 2, (2,), 2, False)``.

The *uneven* collectives (``allgatherv``, ``gatherv``, ``scatterv``,
``alltoallv``, ``reduce_scatterv``: MPI's ``Allgatherv``, ``Gatherv``,
``Scatterv``, ``Alltoallv`` and ``Reduce_scatter``) carry per-rank counts
instead of one ``count`` (:class:`Uneven`; ``Context.counts``). Each is the
table entry of its even twin generalised: with every count equal to ``k`` it
is that twin with ``count = k``, which is what its ``counts``, ``pieces`` and
``result_shape`` describe (so bench-style sizing by one ``count`` still
works), while :meth:`Collective.buffer_counts`, :meth:`Collective.output_pieces`
and :meth:`Collective.reference` take the per-rank counts. Their results are
flat: the counts are element counts of the flat buffers. They are kept out of
:data:`COLLECTIVES` (what listings, ``auto``, the bench and the tuner offer)
and listed in :data:`UNEVEN_COLLECTIVES`.

For 3 ranks and counts ``(2, 0, 1)``, rank 1 of allgatherv holds three pieces,
``Piece(0, 2, (0,), 0, False)``, ``Piece(2, 0, (1,), 0, False)`` and
``Piece(2, 1, (2,), 0, False)``; alltoallv's counts are the 3×3 matrix of what
rank i sends rank j, row-major.

This module sits at the bottom of the package: it imports only
:mod:`plait.ops` and numpy.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from plait.ops import Op

__all__ = [
    "BLOCK_COLLECTIVES",
    "COLLECTIVES",
    "REDUCING",
    "TABLE",
    "UNEVEN_COLLECTIVES",
    "Collective",
    "Piece",
    "Uneven",
    "displacements",
    "fold",
    "get",
    "reference",
]


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
    with np.errstate(all="ignore"):
        for x in arrays[1:]:
            op.ufunc(acc, x, out=acc)
        if op.average:
            np.divide(acc, size, out=acc)
    return acc


# -- the table ------------------------------------------------------------------------------


def _every(size: int) -> tuple[int, ...]:
    return tuple(range(size))


def _same_shape(shape: Shape, size: int) -> Shape:
    return shape


def _stacked(shape: Shape, size: int) -> Shape:
    return (size, *shape)


def _one_block(shape: Shape, size: int) -> Shape:
    return (shape[0] // size, *shape[1:]) if shape else shape


def _allreduce_pieces(size: int, k: int, rank: int, root: int) -> tuple[Piece, ...]:
    return (Piece(0, k, _every(size), 0, True),)


def _reduce_pieces(size: int, k: int, rank: int, root: int) -> tuple[Piece, ...] | None:
    return (Piece(0, k, _every(size), 0, True),) if rank == root else None


def _broadcast_pieces(size: int, k: int, rank: int, root: int) -> tuple[Piece, ...]:
    return (Piece(0, k, (root,), 0, False),)


def _reduce_scatter_pieces(size: int, k: int, rank: int, root: int) -> tuple[Piece, ...]:
    return (Piece(0, k, _every(size), rank * k, True),)


def _allgather_pieces(size: int, k: int, rank: int, root: int) -> tuple[Piece, ...]:
    return tuple(Piece(q * k, k, (q,), 0, False) for q in range(size))


def _alltoall_pieces(size: int, k: int, rank: int, root: int) -> tuple[Piece, ...]:
    return tuple(Piece(q * k, k, (q,), rank * k, False) for q in range(size))


def _gather_pieces(size: int, k: int, rank: int, root: int) -> tuple[Piece, ...] | None:
    return _allgather_pieces(size, k, rank, root) if rank == root else None


def _scatter_pieces(size: int, k: int, rank: int, root: int) -> tuple[Piece, ...]:
    return (Piece(0, k, (root,), rank * k, False),)


def _no_pieces(size: int, k: int, rank: int, root: int) -> None:
    return None


def _all_but_one(size: int) -> float:
    return (size - 1) / size


def _flat_stacked(shape: Shape, size: int) -> Shape:
    return (size * int(np.prod(shape, dtype=np.int64)),)


def _flat_same(shape: Shape, size: int) -> Shape:
    return (int(np.prod(shape, dtype=np.int64)),)


def _flat_one_block(shape: Shape, size: int) -> Shape:
    return (int(np.prod(shape, dtype=np.int64)) // size,)


# -- uneven collectives: one count per rank (c), or a matrix (m[i * size + j]: i sends j) ---


def _allgatherv_counts(size: int, c: Counts, rank: int, root: int) -> tuple[int, int]:
    return c[rank], sum(c)


def _allgatherv_pieces(size: int, c: Counts, rank: int, root: int) -> tuple[Piece, ...]:
    at = displacements(c)
    return tuple(Piece(at[q], c[q], (q,), 0, False) for q in range(size))


def _gatherv_counts(size: int, c: Counts, rank: int, root: int) -> tuple[int, int]:
    return c[rank], sum(c) if rank == root else 0


def _gatherv_pieces(size: int, c: Counts, rank: int, root: int) -> tuple[Piece, ...] | None:
    return _allgatherv_pieces(size, c, rank, root) if rank == root else None


def _scatterv_counts(size: int, c: Counts, rank: int, root: int) -> tuple[int, int]:
    return sum(c) if rank == root else 0, c[rank]


def _scatterv_pieces(size: int, c: Counts, rank: int, root: int) -> tuple[Piece, ...]:
    return (Piece(0, c[rank], (root,), displacements(c)[rank], False),)


def _reduce_scatterv_counts(size: int, c: Counts, rank: int, root: int) -> tuple[int, int]:
    return sum(c), c[rank]


def _reduce_scatterv_pieces(size: int, c: Counts, rank: int, root: int) -> tuple[Piece, ...]:
    return (Piece(0, c[rank], _every(size), displacements(c)[rank], True),)


def _alltoallv_counts(size: int, m: Counts, rank: int, root: int) -> tuple[int, int]:
    return sum(m[rank * size : (rank + 1) * size]), sum(m[rank::size])


def _alltoallv_pieces(size: int, m: Counts, rank: int, root: int) -> tuple[Piece, ...]:
    # From rank q: m[q][rank] elements, at q's send offset for us, after lower ranks' in OUT.
    at = displacements(m[rank::size])
    return tuple(
        Piece(at[q], m[q * size + rank], (q,), sum(m[q * size : q * size + rank]), False)
        for q in range(size)
    )


def _even(uneven: UnevenCountsFn, matrix: bool) -> CountsFn:
    def counts(size: int, k: int, rank: int, root: int) -> tuple[int, int]:
        return uneven(size, (k,) * (size * size if matrix else size), rank, root)

    return counts


def _even_pieces(uneven: UnevenPiecesFn, matrix: bool) -> PiecesFn:
    def pieces(size: int, k: int, rank: int, root: int) -> tuple[Piece, ...] | None:
        return uneven(size, (k,) * (size * size if matrix else size), rank, root)

    return pieces


def _uneven(
    name: str,
    even: Collective,
    counts: UnevenCountsFn,
    pieces: UnevenPiecesFn,
    result_shape: Callable[[Shape, int], Shape],
    *,
    matrix: bool = False,
) -> Collective:
    """The uneven twin of ``even``: the same flags and bus factor, per-rank counts, flat results."""
    return Collective(
        name,
        reduces=even.reduces,
        rooted=even.rooted,
        blocked=even.blocked,
        split_input=even.split_input,
        fills_x=even.fills_x,
        replicated=even.replicated,
        synchronizes=even.synchronizes,
        counts=_even(counts, matrix),
        pieces=_even_pieces(pieces, matrix),
        result_shape=result_shape,
        bus_factor=even.bus_factor,
        uneven=Uneven(even.name, matrix, counts, pieces),
    )


_EVEN: dict[str, Collective] = {
    c.name: c
    for c in (
        Collective(
            "allreduce",
            reduces=True,
            rooted=False,
            blocked=False,
            split_input=False,
            fills_x=False,
            replicated=True,
            synchronizes=False,
            counts=lambda size, k, rank, root: (k, k),
            pieces=_allreduce_pieces,
            result_shape=_same_shape,
            bus_factor=lambda size: 2 * (size - 1) / size,
        ),
        Collective(
            "reduce",
            reduces=True,
            rooted=True,
            blocked=False,
            split_input=False,
            fills_x=False,
            replicated=False,
            synchronizes=False,
            counts=lambda size, k, rank, root: (k, k if rank == root else 0),
            pieces=_reduce_pieces,
            result_shape=_same_shape,
            bus_factor=lambda size: 1.0,
        ),
        Collective(
            "broadcast",
            reduces=False,
            rooted=True,
            blocked=False,
            split_input=False,
            fills_x=True,
            replicated=True,
            synchronizes=False,
            counts=lambda size, k, rank, root: (0, k),
            pieces=_broadcast_pieces,
            result_shape=_same_shape,
            bus_factor=lambda size: 1.0,
        ),
        Collective(
            "reduce_scatter",
            reduces=True,
            rooted=False,
            blocked=True,
            split_input=True,
            fills_x=False,
            replicated=False,
            synchronizes=False,
            counts=lambda size, k, rank, root: (size * k, k),
            pieces=_reduce_scatter_pieces,
            result_shape=_one_block,
            bus_factor=_all_but_one,
        ),
        Collective(
            "allgather",
            reduces=False,
            rooted=False,
            blocked=True,
            split_input=False,
            fills_x=False,
            replicated=True,
            synchronizes=False,
            counts=lambda size, k, rank, root: (k, size * k),
            pieces=_allgather_pieces,
            result_shape=_stacked,
            bus_factor=_all_but_one,
        ),
        Collective(
            "alltoall",
            reduces=False,
            rooted=False,
            blocked=True,
            split_input=True,
            fills_x=False,
            replicated=False,
            synchronizes=False,
            counts=lambda size, k, rank, root: (size * k, size * k),
            pieces=_alltoall_pieces,
            result_shape=_same_shape,
            bus_factor=_all_but_one,
        ),
        Collective(
            "gather",
            reduces=False,
            rooted=True,
            blocked=True,
            split_input=False,
            fills_x=False,
            replicated=False,
            synchronizes=False,
            counts=lambda size, k, rank, root: (k, size * k if rank == root else 0),
            pieces=_gather_pieces,
            result_shape=_stacked,
            # The root's link carries every block but its own (nccl-tests' choice).
            bus_factor=_all_but_one,
        ),
        Collective(
            "scatter",
            reduces=False,
            rooted=True,
            blocked=True,
            split_input=True,
            fills_x=False,
            replicated=False,
            synchronizes=False,
            counts=lambda size, k, rank, root: (size * k if rank == root else 0, k),
            pieces=_scatter_pieces,
            result_shape=_one_block,
            bus_factor=_all_but_one,
        ),
        Collective(
            "barrier",
            reduces=False,
            rooted=False,
            blocked=False,
            split_input=False,
            fills_x=False,
            replicated=False,
            synchronizes=True,
            counts=lambda size, k, rank, root: (0, 0),
            pieces=_no_pieces,
            result_shape=_same_shape,
            bus_factor=lambda size: 0.0,  # no data: read the time
        ),
    )
}

#: Every even collective, in the order listings show them: what ``plait algorithms``,
#: ``auto``, the bench and the tuner offer.
COLLECTIVES: tuple[str, ...] = tuple(_EVEN)
#: Collectives of :data:`COLLECTIVES` whose schedules combine data with a reduction op.
REDUCING: frozenset[str] = frozenset(c.name for c in _EVEN.values() if c.reduces)
#: Collectives of :data:`COLLECTIVES` whose whole buffer is ``size`` blocks of ``count``
#: (nccl-tests' convention).
BLOCK_COLLECTIVES: frozenset[str] = frozenset(c.name for c in _EVEN.values() if c.blocked)

#: Every collective, even and uneven, by name.
TABLE: Mapping[str, Collective] = {
    **_EVEN,
    **{
        c.name: c
        for c in (
            _uneven(
                "allgatherv",
                _EVEN["allgather"],
                _allgatherv_counts,
                _allgatherv_pieces,
                _flat_stacked,
            ),
            _uneven("gatherv", _EVEN["gather"], _gatherv_counts, _gatherv_pieces, _flat_stacked),
            _uneven(
                "scatterv", _EVEN["scatter"], _scatterv_counts, _scatterv_pieces, _flat_one_block
            ),
            _uneven(
                "alltoallv",
                _EVEN["alltoall"],
                _alltoallv_counts,
                _alltoallv_pieces,
                _flat_same,
                matrix=True,
            ),
            _uneven(
                "reduce_scatterv",
                _EVEN["reduce_scatter"],
                _reduce_scatterv_counts,
                _reduce_scatterv_pieces,
                _flat_one_block,
            ),
        )
    },
}
#: The uneven collectives (per-rank counts, :class:`Uneven`), in the order listings show them.
UNEVEN_COLLECTIVES: tuple[str, ...] = tuple(c for c in TABLE if c not in COLLECTIVES)


def get(name: str) -> Collective:
    """The collective called ``name``; ValueError naming the choices if there is none."""
    try:
        return TABLE[name]
    except KeyError:
        raise ValueError(
            f"unknown collective {name!r}; expected one of "
            + ", ".join((*COLLECTIVES, *UNEVEN_COLLECTIVES))
        ) from None


def reference(
    collective: str,
    inputs: Sequence[np.ndarray | None],
    *,
    op: Op | None = None,
    root: int = 0,
    counts: Sequence[int] | None = None,
) -> list[np.ndarray | None]:
    """Every rank's expected result of a collective, computed directly with numpy.

    ``inputs[r]`` is rank r's ``x`` (for broadcast and scatter only root's is
    read). Reductions fold ``op`` over ranks in rank order, then divide by the
    number of ranks for ``AVG``. Returns one entry per rank: the array that
    rank's call returns, or None where it returns None (reduce and gather off
    root, barrier). ``counts``: an uneven collective's per-rank counts
    (:class:`Uneven`); its results are then flat.
    """
    return get(collective).reference(inputs, op=op, root=root, counts=counts)
