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
from plait.collectives import COLLECTIVES, TABLE, UNEVEN_COLLECTIVES, Piece, reference


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
    assert {c for c in COLLECTIVES if TABLE[c].rooted} == {
        "reduce",
        "broadcast",
        "gather",
        "scatter",
    }
    assert set(TABLE) == {*COLLECTIVES, *UNEVEN_COLLECTIVES}
    assert {c for c in UNEVEN_COLLECTIVES if TABLE[c].rooted} == {"gatherv", "scatterv"}
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


# -- the uneven collectives ------------------------------------------------------------------


def uneven_counts(name: str, size: int, seed: int) -> tuple[int, ...]:
    """Seeded random per-rank counts (a matrix for alltoallv), zeros included."""
    uneven = TABLE[name].uneven
    assert uneven is not None
    rng = np.random.default_rng(seed)
    return tuple(int(c) for c in rng.choice([0, 0, 1, 2, 5], uneven.length(size)))


@pytest.mark.parametrize("name", UNEVEN_COLLECTIVES)
@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_uneven_pieces_fill_out_exactly_and_read_inside_x(name: str, size: int) -> None:
    c = TABLE[name]
    for seed in range(4):
        counts = uneven_counts(name, size, seed)
        for root in sorted({0, size - 1}):
            for rank in range(size):
                _, n_out = c.buffer_counts(size, 0, rank, root, counts)
                pieces = c.output_pieces(size, 0, rank, root, counts)
                if pieces is None:
                    assert n_out == 0, (name, rank, root)
                    continue
                offset = 0
                for piece in pieces:
                    assert piece.out_offset == offset
                    offset += piece.length
                    assert piece.reduced == c.reduces
                    for q in piece.sources:
                        q_in, _ = c.buffer_counts(size, 0, q, root, counts)
                        assert piece.src_offset + piece.length <= q_in, (name, piece)
                assert offset == n_out, (name, size, counts, rank, root)


@pytest.mark.parametrize("name", UNEVEN_COLLECTIVES)
def test_uneven_collectives_with_equal_counts_are_their_even_twins(name: str) -> None:
    c = TABLE[name]
    assert c.uneven is not None
    even = TABLE[c.uneven.even]
    assert (c.reduces, c.rooted, c.blocked, c.split_input, c.replicated) == (
        even.reduces,
        even.rooted,
        even.blocked,
        even.split_input,
        even.replicated,
    )
    for size in (1, 2, 3, 5):
        assert c.bus_factor(size) == even.bus_factor(size)
        for k in (0, 1, 3):
            counts = c.even_counts(size, k)
            assert c.uneven_whole(size, counts) == even.whole_count(k, size)
            for rank in range(size):
                for root in sorted({0, size - 1}):
                    want = even.counts(size, k, rank, root)
                    assert c.counts(size, k, rank, root) == want
                    assert c.buffer_counts(size, 0, rank, root, counts) == want
                    assert c.output_pieces(size, 0, rank, root, counts) == even.pieces(
                        size, k, rank, root
                    )


def test_uneven_reference_on_a_small_example() -> None:
    """3 ranks with counts (2, 0, 1), and a 3×3 alltoallv matrix; zeros included."""
    counts = (2, 0, 1)
    xs = [np.arange(n) + 10 * r for r, n in enumerate(counts)]
    gathered = reference("allgatherv", xs, counts=counts)
    assert [list(x) for x in gathered if x is not None] == [[0, 1, 20]] * 3
    assert TABLE["allgatherv"].output_pieces(3, 0, 1, 0, counts) == (
        Piece(0, 2, (0,), 0, False),
        Piece(2, 0, (1,), 0, False),
        Piece(2, 1, (2,), 0, False),
    )
    at_root = reference("gatherv", xs, root=2, counts=counts)
    assert at_root[0] is None
    assert at_root[2] is not None
    assert list(at_root[2]) == [0, 1, 20]
    scattered = reference("scatterv", [None, np.arange(3), None], root=1, counts=counts)
    assert [x.tolist() for x in scattered if x is not None] == [[0, 1], [], [2]]
    whole = [np.arange(3) + 10 * r for r in range(3)]
    rs = reference("reduce_scatterv", whole, op=plait.SUM, counts=counts)
    assert [x.tolist() for x in rs if x is not None] == [[30, 33], [], [36]]
    m = (1, 2, 0, 0, 1, 1, 2, 0, 1)  # row i: what rank i sends ranks 0, 1, 2
    xs = [np.arange(sum(m[3 * r : 3 * r + 3])) + 10 * r for r in range(3)]
    a2a = reference("alltoallv", xs, counts=m)
    assert [x.tolist() for x in a2a if x is not None] == [[0, 20, 21], [1, 2, 10], [11, 22]]
    assert TABLE["alltoallv"].uneven_whole(3, m) == 3


def test_uneven_counts_are_checked() -> None:
    with pytest.raises(ValueError, match="needs 3 counts"):
        TABLE["allgatherv"].check_counts(3, (1, 2))
    with pytest.raises(ValueError, match=r"3x3 matrix"):
        TABLE["alltoallv"].check_counts(3, (1, 2, 3))
    with pytest.raises(ValueError, match="takes one count"):
        TABLE["allgather"].check_counts(3, (1, 2, 3))
    with pytest.raises(ValueError, match=">= 0"):
        TABLE["gatherv"].check_counts(2, (1, -1))
    with pytest.raises(ValueError, match="allgatherv"):
        collectives.get("nope")
