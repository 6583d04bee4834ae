"""The table of collectives (plait.collectives) agrees with itself and with its readers.

Each entry describes a collective once: buffer counts, the pieces of every
rank's output, the result's shape, the bus factor. These tests check that the
descriptions fit together (the pieces fill exactly the ``OUT`` the counts
give and read only inside ``IN``), that the reference built from the pieces
returns what a call returns, and that the old names read the table.
"""

from __future__ import annotations

import numpy as np
import pytest

import plait
import plait.testing
from plait import collectives, sim
from plait.algos import _registry
from plait.bench import sweep
from plait.collectives import COLLECTIVES, TABLE, Piece, reference


@pytest.mark.parametrize("name", COLLECTIVES)
@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_pieces_fill_out_exactly_and_read_inside_x(name: str, size: int) -> None:
    c = TABLE[name]
    for count in (0, 1, 4):
        for root in sorted({0, size - 1}):
            for rank in range(size):
                _, n_out = c.counts(size, count, rank, root)
                pieces = c.pieces(size, count, rank, root)
                if pieces is None:
                    assert n_out == 0, (name, rank, root)
                    continue
                offset = 0
                for piece in pieces:
                    assert piece.out_offset == offset
                    offset += piece.length
                    assert piece.reduced == (len(piece.sources) > 1 or c.reduces)
                    # A source's x holds what that rank's IN holds (root's OUT for broadcast).
                    for q in piece.sources:
                        q_in, q_out = c.counts(size, count, q, root)
                        x_len = q_out if c.fills_x else q_in
                        assert piece.src_offset + piece.length <= x_len, (name, piece)
                assert offset == n_out, (name, size, count, rank, root)


def test_names_and_sets() -> None:
    assert COLLECTIVES == plait.COLLECTIVES == _registry.COLLECTIVES == sweep.COLLECTIVES
    assert {"allreduce", "reduce", "reduce_scatter"} == _registry.REDUCING
    assert sweep.BLOCK_COLLECTIVES == sim.BLOCK_COLLECTIVES
    assert {
        "reduce_scatter",
        "allgather",
        "alltoall",
        "gather",
        "scatter",
    } == sweep.BLOCK_COLLECTIVES
    assert {c.name for c in TABLE.values() if c.rooted} == {
        "reduce",
        "broadcast",
        "gather",
        "scatter",
    }
    with pytest.raises(ValueError, match="unknown collective 'nope'"):
        collectives.get("nope")


def test_bus_factors_are_nccl_tests() -> None:
    assert sweep.bus_factor("allreduce", 4) == 1.5
    assert sweep.bus_factor("allgather", 4) == 0.75
    assert sweep.bus_factor("broadcast", 4) == sweep.bus_factor("reduce", 4) == 1.0
    assert sweep.bus_factor("barrier", 4) == 0.0


def test_reference_on_a_small_example() -> None:
    """3 ranks, the worked example of the module docstring."""
    xs = [np.arange(6) + 10 * r for r in range(3)]
    rs = reference("reduce_scatter", xs, op=plait.SUM)
    assert [list(x) for x in rs if x is not None] == [[30, 33], [36, 39], [42, 45]]
    a2a = reference("alltoall", xs)
    assert list(a2a[1]) == [2, 3, 12, 13, 22, 23]  # type: ignore[arg-type]
    assert TABLE["alltoall"].pieces(3, 2, 1, 0) == (
        Piece(0, 2, (0,), 2, False),
        Piece(2, 2, (1,), 2, False),
        Piece(4, 2, (2,), 2, False),
    )
    gathered = reference("gather", [np.ones((2, 2)) * r for r in range(3)], root=2)
    assert gathered[0] is None
    assert gathered[2] is not None
    assert gathered[2].shape == (3, 2, 2)
    scattered = reference("scatter", [None, np.arange(6).reshape(3, 2), None], root=1)
    assert [x.tolist() for x in scattered if x is not None] == [[[0, 1]], [[2, 3]], [[4, 5]]]
    assert reference("barrier", [None, None]) == [None, None]
    avg = reference("allreduce", [np.array([1.0, 2.0]), np.array([3.0, 6.0])], op=plait.AVG)
    assert [x.tolist() for x in avg if x is not None] == [[2.0, 4.0], [2.0, 4.0]]
    assert plait.testing.reference is reference
