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

import numpy as np

from plait.collectives._model import (
    Collective,
    Counts,
    CountsFn,
    Piece,
    PiecesFn,
    Shape,
    Uneven,
    UnevenCountsFn,
    UnevenPiecesFn,
    displacements,
    fold,
)
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
