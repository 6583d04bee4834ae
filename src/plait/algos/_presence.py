"""Calls with nothing to move still meet their peers, so that a mismatch shows.

Note [empty calls meet]
    A call with nothing to move (a count of 0, or every count of an uneven
    call 0) records no step of its own, and its rank used to return at once.
    Where one rank's array was empty and its peers' were not, that rank ended
    its call as if it had succeeded, and its peers waited for data it never
    sent: until its next call's stall probe said it had moved on, or until
    their timeout, and never where it made no further call. The same for an
    empty call with different roots, or an empty allreduce against an empty
    broadcast: nothing was compared.

    So every call of more than one rank that moves nothing meets its peers as
    a barrier does: in a one-sided algorithm where they share one window, as
    the one-sided barrier (:func:`post_and_wait_all`: a post whose digest each
    peer compares), else as the dissemination barrier (:func:`signal_all`, ⌈lg p⌉ one-element
    messages, each carrying the call's digest). A rank whose call differs
    raises MismatchError, and its peers learn it from its verdict or their
    stall probes (Note [stall probes] in :mod:`plait.runtime.stall`), in that
    call. Ranks that agree pay a barrier's time for an empty call.
    A rank with nothing to move in a call that moves data elsewhere (a
    gatherv count of 0) is not such a call: its schedule says what it does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from plait.algos.topology import dissemination_peers
from plait.schedule.builder import Builder

__all__ = ["meets_when_empty", "moves_nothing", "post_and_wait_all", "signal_all"]


def moves_nothing(b: Builder) -> bool:
    """Whether the call moves no element anywhere (count 0, or every uneven count 0)."""
    ctx = b.ctx
    return ctx.count == 0 if ctx.counts is None else not any(ctx.counts)


def signal_all(b: Builder) -> None:
    """The dissemination barrier's steps: signal rank r+2^k, wait for r-2^k, ⌈lg p⌉ rounds
    (:mod:`plait.algos.dissemination`). Nothing on one rank."""
    rounds = dissemination_peers(b.rank, b.size)
    if not rounds:
        return
    token = b.scratch(1)  # what each round sends: all this rank has heard so far
    for k, (to, frm) in enumerate(rounds):
        b.send(to, token)
        heard = b.scratch(1)
        b.recv(frm, heard)
        if k + 1 < len(rounds):
            b.copy(heard, token)


def post_and_wait_all(b: Builder) -> None:
    """The one-sided barrier's steps (:mod:`plait.algos.arena`): post phase 1, then wait until
    every other rank has posted it. Nothing on one rank."""
    if b.size == 1:
        return
    b.post(1)
    for q in range(b.size):
        if q != b.rank:
            b.wait(q, 1)


def meets_when_empty(
    build: Callable[[Builder], None], one_sided: bool
) -> Callable[[Builder], None]:
    """``build``, followed by a barrier's steps where the call moves nothing and ``build``
    recorded no step (Note [empty calls meet]): for a one-sided algorithm (``one_sided``)
    where every rank shares the window, :func:`post_and_wait_all` (a barrier's time there);
    else :func:`signal_all`, so that a message-passing algorithm's schedule stays one of
    messages (it may run where a one-sided schedule cannot, as in a call whose number was
    reserved ahead)."""

    @functools.wraps(build)
    def built(b: Builder) -> None:
        build(b)
        if b.recorded or b.rank >= b.size or not moves_nothing(b):
            return
        ctx = b.ctx
        if one_sided and ctx.window > 0 and (ctx.hosts is None or ctx.hosts.n_hosts == 1):
            post_and_wait_all(b)
        else:
            signal_all(b)

    return built
