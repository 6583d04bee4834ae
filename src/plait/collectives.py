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
    "Collective",
    "Piece",
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

    def buffer_counts(self, size: int, count: int, rank: int, root: int) -> tuple[int, int]:
        """Element counts of (IN, OUT) of ``rank``'s schedule; (0, 0) for a fabric's switch."""
        if rank >= size:
            return 0, 0
        return self.counts(size, count, rank, root)

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
        flat = [a.reshape(-1) if a is not None else None for a in arrays]
        results: list[np.ndarray | None] = []
        for r in range(size):
            pieces = self.pieces(size, count, r, root)
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
            out = np.concatenate(parts) if len(parts) != 1 else np.array(parts[0], copy=True)
            results.append(out.reshape(self.result_shape(shaped.shape, size)))
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


TABLE: Mapping[str, Collective] = {
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

#: Every collective, in the order listings show them.
COLLECTIVES: tuple[str, ...] = tuple(TABLE)
#: Collectives whose schedules combine data with a reduction op.
REDUCING: frozenset[str] = frozenset(c.name for c in TABLE.values() if c.reduces)
#: Collectives whose whole buffer is ``size`` blocks of ``count`` (nccl-tests' convention).
BLOCK_COLLECTIVES: frozenset[str] = frozenset(c.name for c in TABLE.values() if c.blocked)


def get(name: str) -> Collective:
    """The collective called ``name``; ValueError naming the choices if there is none."""
    try:
        return TABLE[name]
    except KeyError:
        raise ValueError(
            f"unknown collective {name!r}; expected one of {', '.join(COLLECTIVES)}"
        ) from None


def reference(
    collective: str,
    inputs: Sequence[np.ndarray | None],
    *,
    op: Op | None = None,
    root: int = 0,
) -> list[np.ndarray | None]:
    """Every rank's expected result of a collective, computed directly with numpy.

    ``inputs[r]`` is rank r's ``x`` (for broadcast and scatter only root's is
    read). Reductions fold ``op`` over ranks in rank order, then divide by the
    number of ranks for ``AVG``. Returns one entry per rank: the array that
    rank's call returns, or None where it returns None (reduce and gather off
    root, barrier).
    """
    return get(collective).reference(inputs, op=op, root=root)
