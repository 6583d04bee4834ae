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
    message from the witness (one element of scratch, sent first thing), which
    carries the witness's digest, which the root compares with its own. The
    one-sided schedules (:mod:`plait.algos.arena`) do more, since a post costs
    little: every rank posts phase 1 once it has read its first piece (the root
    once it has written it) and waits, before it ends, for every other rank's
    phase 1, comparing each one's digest; so where any two differ, every rank
    raises in the call itself (on 2 ranks this is the witness's post alone).
    Where ranks disagree: a root other than rank 0 waits for rank 0, which
    either holds another opinion (its digest differs, or it never sends: the root
    stalls, and the stall probes compare digests, Note [stall probes] in
    :mod:`plait.runtime.stall`) or agrees; where rank 0 is itself a root, every
    other root waits for it in vain, or reads a digest that differs. A rank that is
    no root and differs from the root it believes in hears from that root, or from
    a rank on the way, and compares. So some rank always raises MismatchError, and
    the others learn of it from that rank (its verdict, its posted MISMATCHED) by
    their next call at the latest.

    The cost: one small message from the witness, and the root ends only once the
    witness has begun the call; one-sided, a post from every rank and a wait for
    the last to have read its first piece.

Note [the root's word]
    A reduce or gather moves data into the root, the other way round, and has the
    mirror problem: a rank that only sends (a leaf of the tree) ended its call as
    soon as its message was on its way, and returned as if it had succeeded where
    the ranks disagreed on the root (the others raised MismatchError; the leaf only
    at its next call, or never if it made none). So these schedules end with the
    root's word: one element sent from the root down a binomial tree rooted at it,
    once the root has everything. The root's result depends on every rank's input,
    and every message on the way carried a digest that its receiver compared, so the
    root ends only where every rank is in the same call; where they disagree it
    never sends its word, every rank stalls, and the stall probes make each raise
    (Note [stall probes] in :mod:`plait.runtime.stall`). The cost: the ranks other
    than the root end ⌈lg p⌉ small messages after the root instead of when their
    part is sent (docs/performance.md). The one-sided reduce needs it only for
    the ranks that own no slice (fewer elements than ranks): an owner reduces its
    slice from every other rank's window and compares each digest. A rank that
    sends nothing would go unseen: where the rank that disagrees has a gatherv
    count of 0, the root had everything without it and the others ended (that
    rank alone raised, at the word of its own root), and so in an allgatherv.
    So a gatherv or allgatherv rank without rows (in a binomial gatherv: a
    subtree without rows) sends a one-element token where its rows would go,
    which is waited for (and, in a ring, passed on) like rows; it costs only
    calls with such ranks. A reduce_scatterv rank without rows has the mirror
    problem (it receives no data, and ended unseen by a peer that counted rows
    for it), so every rank sends it a one-element token. A call that moves
    nothing at all meets its peers instead (Note [empty calls meet] in
    :mod:`plait.algos._presence`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from plait.algos._presence import moves_nothing
from plait.algos.topology import binomial_children, binomial_parent
from plait.schedule.builder import Builder

__all__ = ["agree_on_root", "ends_with_the_roots_word", "witness"]


def witness(root: int, size: int) -> int:
    """The rank the root of a broadcast, scatter or scatterv hears from (Note [rooted calls
    agree on the root]); ``size`` must be at least 2."""
    return 1 if root == 0 else 0


def agree_on_root(b: Builder) -> None:
    """The witness's message to the root, for a message-passing schedule (call it first).

    Nothing where there is one rank or nothing to move (such a call meets its peers
    instead: Note [empty calls meet] in :mod:`plait.algos._presence`).
    """
    if _moves_nothing(b):
        return
    ctx = b.ctx
    p, r, root = ctx.size, ctx.rank, ctx.root
    w = witness(root, p)
    if r == w:
        b.send(root, b.scratch(1))
    elif r == root:
        b.recv(w, b.scratch(1))


def _moves_nothing(b: Builder) -> bool:
    return b.ctx.size < 2 or moves_nothing(b)


def roots_word(b: Builder) -> None:
    """The root's word that it has everything, down a binomial tree from it (Note [the
    root's word]); call it last. Nothing where there is one rank or nothing to move."""
    if _moves_nothing(b):
        return
    ctx = b.ctx
    p, root = ctx.size, ctx.root
    v = (ctx.rank - root) % p
    # After the call's own messages: the root's word once it has everything, and the
    # others' wait for it once their part is sent (one chain of waits: a straight line).
    after = b.messages()
    word = b.scratch(1)
    parent = binomial_parent(v)
    if parent >= 0:
        b.recv((parent + root) % p, word, after=after)  # passed on: the sends read it
        after = []
    for child in binomial_children(v, p)[::-1]:  # farthest subtree first
        b.send((child + root) % p, word, after=after)


def ends_with_the_roots_word(build: Callable[[Builder], None]) -> Callable[[Builder], None]:
    """A reduce or gather builder whose schedule ends with :func:`roots_word`."""

    @functools.wraps(build)
    def built(b: Builder) -> None:
        build(b)
        roots_word(b)

    return built
