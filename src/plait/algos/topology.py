"""Pure rank arithmetic shared by the algorithms: rings, power-of-two folding, binomial trees,
the dissemination barrier's rounds.

Nothing here knows about buffers or messages; every function is tested alone on
sizes that are and are not powers of two.
"""

from __future__ import annotations

__all__ = [
    "binomial_children",
    "binomial_parent",
    "dissemination_peers",
    "fold",
    "pof2_floor",
    "ring_neighbours",
    "unfold",
]


def pof2_floor(n: int) -> int:
    """The largest power of two not above ``n`` (``n >= 1``)."""
    return 1 << (n.bit_length() - 1)


def ring_neighbours(index: int, size: int) -> tuple[int, int]:
    """(next, previous) of position ``index`` on a ring of ``size`` positions."""
    return (index + 1) % size, (index - 1) % size


def fold(rank: int, size: int) -> int | None:
    """Virtual rank of ``rank`` once ``size`` ranks are folded onto a power of two.

    With ``pof2 = pof2_floor(size)`` and ``rem = size - pof2``, the first ``2*rem``
    ranks pair up (0,1), (2,3), …: the even one of each pair hands its data to
    the odd one and sits out (None); the odd one becomes virtual rank ``rank//2``.
    The remaining ranks shift down by ``rem``. Virtual ranks are monotone in the
    real ones, so reductions over contiguous virtual ranks stay in rank order::

        size 6 (pof2 4, rem 2):  rank   0  1  2  3  4  5
                                 vrank  -  0  -  1  2  3
    """
    pof2 = pof2_floor(size)
    rem = size - pof2
    if rank < 2 * rem:
        return None if rank % 2 == 0 else rank // 2
    return rank - rem


def unfold(vrank: int, size: int) -> int:
    """The real rank of virtual rank ``vrank`` (inverse of :func:`fold`)."""
    rem = size - pof2_floor(size)
    return 2 * vrank + 1 if vrank < rem else vrank + rem


def binomial_parent(vrank: int) -> int:
    """Parent of ``vrank`` in a binomial tree rooted at 0 (clear the lowest set bit); -1 for 0.

    ::

        size 8:   0 ── 1
                  ├─── 2 ── 3
                  └─── 4 ── 5
                       └─── 6 ── 7
    """
    return vrank & (vrank - 1) if vrank else -1


def binomial_children(vrank: int, size: int) -> list[int]:
    """Children of ``vrank`` in a binomial tree of ``size`` rooted at 0, nearest subtree first.

    Child ``vrank + 2**k`` exists for every ``2**k`` below ``vrank``'s lowest set
    bit (below ``size`` for the root) with ``vrank + 2**k < size``. The child at
    ``2**k`` roots a subtree of ranks ``[vrank + 2**k, vrank + 2**(k+1))``.
    """
    limit = vrank & -vrank if vrank else pof2_floor(size) * 2
    out = []
    k = 1
    while k < limit and vrank + k < size:
        out.append(vrank + k)
        k <<= 1
    return out


def dissemination_peers(rank: int, size: int) -> list[tuple[int, int]]:
    """(send to, receive from) for each round of the dissemination barrier.

    Round ``k`` pairs ``rank`` with ``rank + 2**k`` and ``rank - 2**k`` (mod
    ``size``); there are ⌈lg size⌉ rounds::

        size 5, rank 0:  [(1, 4), (2, 3), (4, 1)]
    """
    out = []
    dist = 1
    while dist < size:
        out.append(((rank + dist) % size, (rank - dist) % size))
        dist <<= 1
    return out
