"""The double binary tree's rank arithmetic, alone, and the shape of its schedules."""

from __future__ import annotations

import pytest

from plait.algos._registry import build_schedule, get
from plait.algos.double_binary_tree import (
    btree_children,
    btree_parent,
    tree_children,
    tree_parent,
)
from plait.schedule.builder import Context
from plait.schedule.ir import StepKind

SIZES = range(1, 65)


def _neighbours(rank: int, size: int, tree: int) -> int:
    return (tree_parent(rank, size, tree) >= 0) + len(tree_children(rank, size, tree))


def _subtree(rank: int, size: int, tree: int) -> list[int]:
    out = [rank]
    for c in tree_children(rank, size, tree):
        out += _subtree(c, size, tree)
    return out


def test_btree_matches_nccl_diagram() -> None:
    # The picture in ncclGetBtree's comment (and in btree_parent's docstring), size 14.
    parents = {8: 0, 4: 8, 12: 8, 2: 4, 6: 4, 10: 12, 13: 12, 1: 2, 3: 2, 5: 6, 7: 6}
    parents |= {9: 10, 11: 10}
    assert btree_parent(0, 14) == -1
    for rank, parent in parents.items():
        assert btree_parent(rank, 14) == parent, rank
    assert btree_children(0, 14) == (8,)
    assert btree_children(12, 14) == (10, 13)
    assert btree_children(4, 14) == (2, 6)
    assert btree_children(13, 14) == ()


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("tree", [0, 1])
def test_tree_spans_all_ranks_once(size: int, tree: int) -> None:
    roots = [r for r in range(size) if tree_parent(r, size, tree) == -1]
    assert len(roots) == 1
    (root,) = roots
    assert root == (0 if tree == 0 else (size - 1 if size % 2 == 0 else 1 % size))
    for rank in range(size):
        parent = tree_parent(rank, size, tree)
        children = tree_children(rank, size, tree)
        assert len(children) <= 2
        assert list(children) == sorted(set(children))
        if rank != root:
            assert 0 <= parent < size
            assert parent != rank
            assert rank in tree_children(parent, size, tree)
        for c in children:
            assert tree_parent(c, size, tree) == rank
    # Every rank reaches the root, within the height ⌈lg p⌉ the cost model assumes.
    height = (size - 1).bit_length()
    for rank in range(size):
        hops, x = 0, rank
        while x != root:
            x = tree_parent(x, size, tree)
            hops += 1
            assert hops <= height, (size, tree, rank)
    assert sorted(_subtree(root, size, tree)) == list(range(size))


@pytest.mark.parametrize("size", SIZES)
def test_each_rank_interior_in_at_most_one_tree(size: int) -> None:
    # Interior: more than one tree neighbour. Roots have a single child, so
    # they carry a leaf's load; odd ranks are leaves of tree 0.
    for rank in range(size):
        interior = [t for t in (0, 1) if _neighbours(rank, size, t) > 1]
        assert len(interior) <= 1, (size, rank, interior)
    for tree in (0, 1):
        root = next(r for r in range(size) if tree_parent(r, size, tree) == -1)
        assert len(tree_children(root, size, tree)) == (1 if size > 1 else 0)


@pytest.mark.parametrize("size", SIZES)
def test_btree_is_in_order(size: int) -> None:
    # Every subtree is a contiguous range: left child's below the rank, right child's above.
    for rank in range(size):
        sub = sorted(_subtree(rank, size, 0))
        assert sub == list(range(sub[0], sub[-1] + 1))
        for c in btree_children(rank, size):
            below = _subtree(c, size, 0)
            assert all(x < rank for x in below) or all(x > rank for x in below)


@pytest.mark.parametrize("size", [2, 8, 9, 64])
def test_mirror_and_shift(size: int) -> None:
    for rank in range(size):
        image = size - 1 - rank if size % 2 == 0 else (rank - 1) % size
        up = btree_parent(image, size)
        want = -1 if up < 0 else (size - 1 - up if size % 2 == 0 else (up + 1) % size)
        assert tree_parent(rank, size, 1) == want


@pytest.mark.parametrize(("size", "segment"), [(1, 0), (2, 0), (7, 0), (64, 0), (64, 5), (33, 7)])
def test_schedule_is_linear_in_segments(size: int, segment: int) -> None:
    spec = get("allreduce", "double_binary_tree")
    count = 131
    halves = [(count + 1) // 2, count // 2]
    nseg = [1 if segment == 0 else -(-n // segment) for n in halves]
    for rank in range(size):
        sched = build_schedule(spec, Context("allreduce", rank, size, count, segment=segment))
        sends = [s for s in sched.steps if s.kind is StepKind.SEND]
        # Per tree and segment: at most one send up and two down (leaf or interior).
        want = 0
        for tree in (0, 1):
            degree = _neighbours(rank, size, tree)
            want += degree * nseg[tree]
        assert len(sends) == want
        assert len(sched.steps) <= 1 + 6 * sum(nseg)
        # Interior in one tree (three halves out), leaf or single-child root in the other (one).
        sent = sum(s.count for s in sends)
        assert sent <= 3 * halves[0] + halves[0]
