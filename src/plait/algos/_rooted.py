"""Rooted calls that move data out of the root: how their ranks find out they disagree on it.

Note [rooted calls agree on the root]
    A broadcast, scatter or scatterv moves data from the root only, so ranks that
    disagree on the root can each finish without hearing from a rank of the other
    opinion: with roots 0 and 1 among 3 ranks, rank 2 takes rank 0's data, and
    ranks 0 and 1, each a root in its own eyes, hear from nobody. Every message
    and window carries the call's digest, which holds the root, but nobody reads
    rank 1's, and rank 1 keeps its own data.

    So one fixed rank, the *witness* (rank 0, or rank 1 where the root is 0), tells
    the root it is in the call, and the root waits for that before it ends: a
    message from the witness (one element of scratch, sent first thing), or in the
    one-sided schedules the witness's post of phase 1 after it has read its first
    piece. Either carries the witness's digest, which the root compares with its
    own. Where ranks disagree: a root other than rank 0 waits for rank 0, which
    either holds another opinion (its digest differs, or it never sends: the root
    stalls, and the stall probes compare digests, Note [stall probes] in
    :mod:`plait.runtime.stall`) or agrees; where rank 0 is itself a root, every
    other root waits for it in vain, or reads a digest that differs. A rank that is
    no root and differs from the root it believes in hears from that root, or from
    a rank on the way, and compares. So some rank always raises MismatchError, and
    the others learn of it from that rank (its verdict, its posted MISMATCHED) by
    their next call at the latest.

    The cost: one small message (or one post) from the witness, and the root ends
    only once the witness has begun the call (has read its first piece, one-sided).
"""

from __future__ import annotations

from plait.schedule.builder import Builder

__all__ = ["agree_on_root", "witness"]


def witness(root: int, size: int) -> int:
    """The rank the root of a broadcast, scatter or scatterv hears from (Note [rooted calls
    agree on the root]); ``size`` must be at least 2."""
    return 1 if root == 0 else 0


def agree_on_root(b: Builder) -> None:
    """The witness's message to the root, for a message-passing schedule (call it first).

    Nothing where there is one rank or nothing to move (ranks that disagree on the root of
    an empty call get the same, empty, results).
    """
    ctx = b.ctx
    p, r, root = ctx.size, ctx.rank, ctx.root
    if p < 2 or (ctx.count == 0 if ctx.counts is None else not any(ctx.counts)):
        return
    w = witness(root, p)
    if r == w:
        b.send(root, b.scratch(1))
    elif r == root:
        b.recv(w, b.scratch(1))
