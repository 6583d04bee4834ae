"""Pure rank arithmetic, on sizes that are and are not powers of two."""

from __future__ import annotations

import pytest

from plait.algos.topology import (
    binomial_children,
    binomial_parent,
    fold,
    pof2_floor,
    ring_neighbours,
    unfold,
)


@pytest.mark.parametrize("size", range(1, 70))
def test_fold_is_a_monotone_bijection_onto_pof2(size: int) -> None:
    pof2 = pof2_floor(size)
    assert pof2 <= size < 2 * pof2
    virtual = [fold(r, size) for r in range(size)]
    kept = [v for v in virtual if v is not None]
    assert kept == list(range(pof2))
    for r, v in enumerate(virtual):
        if v is None:
            assert r % 2 == 0
            assert fold(r + 1, size) is not None
        else:
            assert unfold(v, size) == r


@pytest.mark.parametrize("size", range(1, 70))
def test_binomial_tree_spans_every_rank_once(size: int) -> None:
    seen = {0}
    stack = [0]
    while stack:
        v = stack.pop()
        for child in binomial_children(v, size):
            assert binomial_parent(child) == v
            assert child not in seen
            seen.add(child)
            stack.append(child)
    assert seen == set(range(size))
    assert binomial_parent(0) == -1


def test_binomial_example() -> None:
    assert binomial_children(0, 8) == [1, 2, 4]
    assert binomial_children(4, 8) == [5, 6]
    assert binomial_children(4, 6) == [5]
    assert binomial_children(0, 5) == [1, 2, 4]
    assert binomial_parent(6) == 4


def test_ring() -> None:
    assert ring_neighbours(0, 5) == (1, 4)
    assert ring_neighbours(4, 5) == (0, 3)
    assert ring_neighbours(0, 1) == (0, 0)
