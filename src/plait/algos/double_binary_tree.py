"""Double binary tree allreduce (NCCL 2.4): two complementary pipelined trees, one per half.

Tree 0 is NCCL's ``ncclGetBtree``, an in-order binary tree built from the
lowest set bit of each rank; tree 1 is its mirror (``r -> p-1-r``, p even) or
its shift by one (``r -> r+1 mod p``, p odd). Odd ranks are leaves of tree 0
and the roots have a single child, so every rank has more than one tree
neighbour ("is interior") in at most one of the two trees: each rank's link
load is that of a leaf in one tree and an interior node in the other, and the
two trees together use the links evenly. The vector is cut in two halves;
half ``t`` is reduced up tree ``t`` to its root and broadcast back down, each
half cut into segments of ``ctx.segment`` elements (one segment if 0) that the
builder's hazard tracking pipelines level by level.

Costs (n bytes, p ranks, h = ⌈lg p⌉ the height of each tree, S segments per
half of m = n/(2S) bytes; an interior rank receives two segments and sends one
per stage of the reduce, and the reverse in the broadcast):
    allreduce  ≈ 2(h + S - 1)·(2α + 2mβ) + (h + S - 1)·2mγ
               S = 1:   ≈ 2h·(2α + nβ) + h·nγ
               S ≫ h:   ≈ 4Sα + 2nβ + nγ   (bandwidth term independent of p)
Restrictions: commutative ops only (for odd p the shifted tree puts rank 0
after rank p-1, so contributions are not combined in rank order). Every
element is reduced once, at its tree's root, and then only copied down, so
results are bit-identical on all ranks. Any p, any count (a half may be empty).

Example, allreduce, p=4, vector [A|B] (A = half 0, B = half 1)::

    tree 0 (btree)      tree 1 (mirror)
        0                   3
        |                   |
        2                   1
       / \\                 / \\
      1   3               0   2

    half A: 1 and 3 send A up to 2, which reduces and sends to 0 (the root);
            0 sends the sum down to 2, which forwards it to 1 and 3.
    half B: 0 and 2 send B up to 1, then on to 3; 3 broadcasts back down.
    Rank 2 is interior in tree 0 only, rank 1 in tree 1 only; 0 and 3 are
    roots with one child (one neighbour, like a leaf) in one tree and leaves
    in the other.
"""

from __future__ import annotations

from plait.algos._registry import register
from plait.schedule.builder import Builder, blocks, segments

__all__ = ["btree_children", "btree_parent", "tree_children", "tree_parent"]


def btree_parent(rank: int, size: int) -> int:
    """Parent of ``rank`` in NCCL's in-order binary tree over ``size`` ranks; -1 for the root 0.

    With ``bit`` the lowest set bit of ``rank``, the parent is ``rank`` with
    ``bit`` cleared and ``2*bit`` set (``xx01[0] -> xx10[0]``, ``xx11[0] -> xx10[0]``),
    or, if that is out of range, just with ``bit`` cleared::

        size 14:  0 ──────────── 8
                          ______/ \\______
                         4                12
                       /   \\             /  \\
                     2       6        10     \\
                    / \\     / \\      /  \\     \\
                   1   3   5   7    9   11    13

    The tree is in-order: a rank's left subtree holds lower ranks, its right
    subtree higher ones, and every subtree is a contiguous range of ranks.
    """
    if rank == 0:
        return -1
    bit = rank & -rank
    up = (rank ^ bit) | (bit << 1)
    return up if up < size else rank ^ bit


def btree_children(rank: int, size: int) -> tuple[int, ...]:
    """Children of ``rank`` in the tree of :func:`btree_parent`, lower first.

    The root 0 has the single child ``2**⌈lg size⌉ / 2``; a rank with lowest
    set bit ``2*low`` has children ``rank - low`` and ``rank + low'`` with
    ``low'`` the largest power of two ``<= low`` keeping it below ``size``;
    odd ranks are leaves.
    """
    if size <= 1:
        return ()
    if rank == 0:
        top = 1 << (size - 1).bit_length()  # smallest power of two >= size
        return (top >> 1,)
    low = (rank & -rank) >> 1
    if low == 0:
        return ()
    right = low
    while right and rank + right >= size:
        right >>= 1
    return (rank - low, rank + right) if right else (rank - low,)


def _to_btree(rank: int, size: int, tree: int) -> int:
    """Position of ``rank`` in the btree of which tree ``tree`` is an image."""
    if tree == 0:
        return rank
    if size % 2 == 0:
        return size - 1 - rank
    return (rank - 1) % size


def _from_btree(pos: int, size: int, tree: int) -> int:
    if tree == 0:
        return pos
    if size % 2 == 0:
        return size - 1 - pos
    return (pos + 1) % size


def tree_parent(rank: int, size: int, tree: int) -> int:
    """Parent of ``rank`` in tree ``tree`` (0 or 1) of the double binary tree; -1 at its root.

    Tree 0 is :func:`btree_parent`'s tree (root 0). Tree 1 is its mirror for even
    ``size`` (root ``size-1``) and its shift by one for odd ``size`` (root 1)::

        size 6:  tree 0      tree 1 (mirror)     size 5:  tree 0    tree 1 (shift)
                   0             5                          0          1
                   |             |                          |          |
                   4             1                          4          0
                  / \\           / \\                        /          /
                 2   5         3   0                      2          3
                / \\           / \\                        / \\        / \\
               1   3         4   2                      1   3      2   4
    """
    up = btree_parent(_to_btree(rank, size, tree), size)
    return -1 if up < 0 else _from_btree(up, size, tree)


def tree_children(rank: int, size: int, tree: int) -> tuple[int, ...]:
    """Children of ``rank`` in tree ``tree`` of the double binary tree, in increasing rank order."""
    down = btree_children(_to_btree(rank, size, tree), size)
    return tuple(sorted(_from_btree(c, size, tree) for c in down))


@register("allreduce", "double_binary_tree", commutative_only=True)
def allreduce(b: Builder) -> None:
    """Two complementary binary trees, one per half: pipelined reduce up, broadcast down."""
    ctx = b.ctx
    p, r = ctx.size, ctx.rank
    b.copy(b.inp, b.out)
    if p == 1:
        return
    plan = []
    for tree, (offset, n) in enumerate(blocks(ctx.count, 2)):
        segs = segments(b.out.sub(offset, n), ctx.segment)
        plan.append((tree_parent(r, p, tree), tree_children(r, p, tree), segs))
    # Both ends of every edge walk (segment, tree) in the same order, so the
    # messages of each ordered pair of ranks are numbered alike on both sides.
    for k in range(max(len(segs) for _, _, segs in plan)):
        for parent, children, segs in plan:
            if k >= len(segs):
                continue
            seg = segs[k]
            for c in children:  # lower child first: in rank order where the tree is in-order
                b.recv_reduce(c, seg, recv_first=c < r)
            if parent >= 0:
                b.send(parent, seg)
                b.recv(parent, seg)
            for c in children:
                b.send(c, seg)
