"""A one-sided call's posts: waiting for a peer's, and what a peer's counter says of it.

A peer's counter says more than how far it got (Note [one-sided] in
:mod:`plait.runtime.one_sided`): a phase of :data:`ABANDONED` or :data:`MISMATCHED`
says it gave up on that call, and one of an earlier call says it gave up then and
posts nothing more. A wait that stalls probes the call's peers as a message call
does (Note [stall probes] in :mod:`plait.runtime.stall`). Both the compiled
operations and the step-by-step runner (:class:`~plait.runtime.one_sided.WindowSteps`)
wait, begin, check and give up through these functions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from plait.errors import ClosedError, CommError, CommTimeout, MismatchError, PeerLostError
from plait.runtime.executor import Call
from plait.runtime.notices import OWN
from plait.runtime.stall import GAVE_UP, settle, wait_post
from plait.runtime.waits import timeout_for, wrap
from plait.schedule.ir import Schedule
from plait.transport.base import OTHER_MEMBER, Transport, renumbered

__all__ = [
    "ABANDONED",
    "LOST",
    "MISMATCHED",
    "await_post",
    "begin_call",
    "begin_waiting",
    "check_peer",
    "failed",
    "give_up",
    "mismatch_behind",
    "named",
]

#: The phase a rank posts when it gives up on a one-sided call (Note [one-sided]).
ABANDONED = (1 << 32) - 1
#: The phase it posts instead when it gave up because it lost a rank: it told the others
#: which one (a LOST notice, Note [stall probes] in plait.runtime.stall) before it posted.
LOST = (1 << 32) - 2
#: The phase it posts instead when it gave up because the ranks' calls differ.
MISMATCHED = (1 << 32) - 3
#: The phase it posts instead when it gave up only because a peer had (Note [who gave up
#: first]).
FOLLOWED = (1 << 32) - 4
#: The phase it posts instead when its own timeout passed (it waited for another rank).
TIMED_OUT = (1 << 32) - 5
#: The phase it posts instead when its communicator was closed during the call (from
#: another thread, or a signal handler).
CLOSED = (1 << 32) - 6
#: The lowest of the phases above: a counter at or above it in a call's epoch says the rank
#: gave up.
GAVE_UP_FROM = CLOSED
#: Phases of a rank that gave up of its own accord, not after another rank (Note [who gave
#: up first]).
_OWN_ACCORD = (ABANDONED, LOST, TIMED_OUT, CLOSED)
#: The attribute of a PeerLostError raised because a peer gave up (its rank in the window).
_FOLLOWS = "_plait_follows"

# Note [who gave up first]
#     A rank that gives up on a one-sided call posts so, and a peer waiting on it raises at
#     once, posting that it gave up too: a rank that timed out ends the call everywhere. A
#     rank waiting on a late rank, though, reads the late one's post, and that late rank
#     gave up only because the one that timed out had: read as its own error, the report
#     named a rank that did nothing wrong. So a rank that gives up because of a peer's post
#     posts FOLLOWED, not ABANDONED; a rank that reads FOLLOWED looks through the window
#     for the rank whose post of the call is its own (ABANDONED or LOST) and names that
#     one, saying which rank passed it on.


def begin_waiting(
    window: Any, transport: Transport, call: Call, where: Schedule, members: list[int] | None
) -> int:
    """Begin the call where ``window.begin`` would wait: for each peer that has not ended
    call ``epoch - 2`` yet, wait as a step waits (probing once stalled, and raising at once
    for a peer that gave up on an earlier call, which would never end it), then begin.
    ``members``: each window rank's rank, where they differ (a host's window)."""
    epoch = call.epoch
    need = (epoch - 1) << 32
    slot = call.slot
    for q in window.behind(need):
        shown = q if members is None else members[q]
        if slot is not None:
            slot.peers = (shown,)  # a dump while it waits names the peer
        await_post(window, transport, q, need, call, where, shown)
        if slot is not None:
            slot.peers = ()  # (kept after a failure, for the dump)
    half: int = window.begin(epoch, call.check, call.deadline)
    if half < 0:  # the deadline passed meanwhile
        behind = window.behind(need)
        raise timeout_for(
            where.rank, call, behind if members is None else [members[q] for q in behind]
        )
    return half


def begin_call(window: Any, transport: Transport, call: Call, where: Schedule) -> int:
    """Begin one-sided call ``call.epoch`` on ``window``: the half it uses. Peers have nearly
    always ended call ``epoch - 2``; where one has not, wait for it (:func:`begin_waiting`).

    Raises:
        CommError: what the call raises; the rank has posted that it gave up on it.
    """
    epoch = call.epoch
    try:
        half: int = window.begin(epoch, call.check, 0.0)
        if half < 0:
            half = begin_waiting(window, transport, call, where, None)
    except CommError as exc:  # a peer lost, the transport closed; or a timeout, a mismatch
        found = settle(
            transport, call, where, named(where.rank, call, "the start of the call", exc)
        )
        give_up(window, epoch, found)
        raise found from None
    return half


def failed(
    window: Any, transport: Transport, call: Call, where: Schedule, exc: BaseException
) -> BaseException:
    """What a one-sided call that began raises after ``exc``: a mismatch told or found
    (:func:`~plait.runtime.stall.settle`), once this rank has posted that it gave up."""
    found = settle(transport, call, where, exc)
    give_up(window, call.epoch, found)
    return found


def give_up(window: Any, epoch: int, error: BaseException | None) -> None:
    """Post that this rank gave up on call ``epoch`` with ``error`` (Note [one-sided]; best
    effort: the transport may be gone)."""
    with contextlib.suppress(Exception):
        window.post((epoch << 32) | gave_up_phase(error))


def gave_up_phase(error: BaseException | None) -> int:
    """The phase that says why a rank gave up: MISMATCHED, LOST (a lost rank, told to the
    peers when the error was settled), or ABANDONED."""
    if isinstance(error, MismatchError):
        return MISMATCHED
    if isinstance(error, PeerLostError) and error.lost_rank is not None:
        return FOLLOWED if getattr(error, OWN, False) else LOST  # (it followed a rank)
    if getattr(error, _FOLLOWS, None) is not None:
        return FOLLOWED
    if isinstance(error, ClosedError):
        return CLOSED
    if isinstance(error, CommTimeout):
        return TIMED_OUT
    return ABANDONED


def await_post(
    window: Any, transport: Transport, q: int, need: int, call: Call, where: Schedule, shown: int
) -> None:
    """Wait until rank ``q`` of ``window`` (``shown`` in messages) posts ``need``, probing
    the call's peers once it stalls (:func:`~plait.runtime.stall.wait_post`)."""
    rank = where.rank
    try:
        late = wait_post(
            window,
            transport,
            q,
            need,
            call,
            rank,
            where.size,
            shown,
            lambda: _look(window, q, call, rank, shown),
        )
    except CommError as exc:
        if _names_call(rank, call, exc):
            raise  # the probes' or _look's (and the rank a notice says was lost)
        err = wrap(rank, call, f"a wait for rank {shown}", renumbered(transport, exc))
        if isinstance(err, PeerLostError):
            err.lost_rank = _lost_rank(window, q, shown, getattr(exc, OTHER_MEMBER, None))
        raise err from None
    if late is not None:
        err = timeout_for(rank, call, [shown])
        raise type(err)(f"{err}{late}") if late else err


def _lost_rank(window: Any, q: int, shown: int, other: int | None) -> int | None:
    """The rank a wait on rank ``q`` of ``window`` (``shown`` in messages) lost: ``q``, or
    ``other``, another member of the window lost before the call (Note [members lost] in
    plait.transport.shm.link; as the transport numbers it), where messages number the
    window's ranks as the window does; else None."""
    if other is None:
        return shown
    if shown != q:  # a host's window: its ranks are named otherwise
        return None
    roots = getattr(window, "members", ())  # a shared-memory window: the transport's ranks
    if not roots:  # an in-process window names its own ranks
        return other
    return roots.index(other) if other in roots else None


def _look(window: Any, q: int, call: Call, rank: int, shown: int) -> None:
    """Raise if rank ``q`` of ``window`` gave up on an earlier one-sided call: its
    communicator is broken, so it posts nothing more (Note [one-sided]).

    A rank that finished a call in which a peer found a mismatch (a leaf that
    read nothing) learns it so in its next one-sided call, at its first wait.
    """
    counter = window.counter(q)
    phase, epoch = counter & 0xFFFFFFFF, counter >> 32
    if phase < GAVE_UP_FROM or epoch >= call.epoch:
        return
    if phase == MISMATCHED:
        raise _found_earlier(rank, call.describe, shown, epoch, "makes no more calls on it")
    # (A host's window numbers its ranks apart, and this look cannot say how: the rank that
    # gave up first is named where the call of that epoch failed.)
    if phase == FOLLOWED:
        who = f"rank {shown} gave up on one-sided call {epoch} of this communicator because "
        why = "another rank had (see its message), and"
    else:
        who = f"rank {shown} gave up on one-sided call {epoch} of this communicator after an "
        why = "error of its own (see its message), and"
    err = PeerLostError(f"rank {rank}: {call.describe}: {who}{why} makes no more calls on it")
    setattr(err, _FOLLOWS, q)  # this rank gives up because of it: it posts FOLLOWED
    raise err


def mismatch_behind(window: Any, rank: int, what: str, epoch: int) -> MismatchError | None:
    """MismatchError where a rank of ``window`` found, in one of its one-sided calls up to
    ``epoch``, that the ranks called different collectives; else None.

    Such a rank posts MISMATCHED for its call (Note [one-sided]) and raises; if it then
    closes, a peer that finished that call without reading its window (Note [rooted calls
    agree on the root] in :mod:`plait.algos._rooted`) meets a lost rank in a later call, one-
    sided or not, and the mismatch, not the loss, is what went wrong: the caller asks here
    when a call fails with PeerLostError. ``what``: the failed call, as messages name it.
    """
    for q in range(window.size):
        if q == window.rank:
            continue
        try:
            counter = window.counter(q)
        except CommError:  # this rank's own window is released: nothing to read
            return None
        if counter & 0xFFFFFFFF == MISMATCHED and counter >> 32 <= epoch:
            return _found_earlier(rank, what, q, counter >> 32, "has left since")
    return None


def _found_earlier(rank: int, what: str, q: int, epoch: int, since: str) -> MismatchError:
    """Rank ``q`` posted MISMATCHED for one-sided call ``epoch``, an earlier one."""
    return MismatchError(
        f"rank {rank}: {what}: rank {q} found that the ranks called different collectives in "
        f"one-sided call {epoch} of this communicator (its own message says what differs), "
        f"and {since}"
    )


def check_peer(
    window: Any,
    q: int,
    half: int,
    call: Call,
    rank: int,
    shown: int | None = None,
    names: Sequence[int] | None = None,
) -> None:
    """Raise unless rank ``q`` is in this call and has not given up on it (Note [one-sided]).

    ``shown``: the rank messages name, where ``q`` is its rank in the window only;
    ``names``: each window rank's rank in messages, where they differ (a host's window).
    """
    digest, counter = window.peer_state(q, half)
    q = q if shown is None else shown
    if digest != call.check:
        raise MismatchError(
            f"rank {rank}: {call.describe}: rank {q} is in a different call "
            "(its parameters' digest differs from this rank's)"
        )
    # Only this call's: a peer that gave up on a later call has finished this one.
    phase = counter - (call.epoch << 32)
    if phase == MISMATCHED:
        raise MismatchError(
            f"rank {rank}: {call.describe}: rank {q} found that the ranks called different "
            "collectives (its own message says what differs)"
        )
    if phase in _OWN_ACCORD or phase == FOLLOWED:
        first, how = _first_to_give_up(window, call.epoch) if phase == FOLLOWED else (None, 0)
        if first is not None:
            who = first if names is None else names[first]  # a host's window numbers apart
            text = f"{_gave_up(who, how)} (see its message; rank {q} passed it on)"
        elif phase == FOLLOWED:  # its origin's post is not seen (or not by its number)
            text = f"rank {q} gave up on the call because another rank had (see its message)"
        elif phase == CLOSED:  # as Note [peers that close] in plait.transport.base says it
            text = f"{_gave_up(q, phase)}, and no call of this communicator can finish without it"
        else:
            text = f"{_gave_up(q, phase)} (see its message)"
        err = PeerLostError(f"rank {rank}: {call.describe}: {text}")
        setattr(err, _FOLLOWS, q)
        if LOST in (phase, how):
            setattr(err, GAVE_UP, True)  # settle raises the rank it lost, which it told
        raise err


def _gave_up(q: int, phase: int) -> str:
    """What rank ``q`` did, having posted ``phase``."""
    if phase == CLOSED:
        return f"rank {q} closed its communicator during the call"
    if phase == TIMED_OUT:
        return f"rank {q} gave up on the call when its timeout passed"
    return f"rank {q} gave up on the call after an error of its own"


def _first_to_give_up(window: Any, epoch: int) -> tuple[int | None, int]:
    """A rank of ``window`` whose post of call ``epoch`` says it gave up of its own accord,
    and that phase (one of _OWN_ACCORD); (None, 0) if none (Note [who gave up first])."""
    for p in range(window.size):
        try:
            counter = window.counter(p)
        except CommError:
            break
        if counter >> 32 == epoch and counter & 0xFFFFFFFF in _OWN_ACCORD:
            return p, counter & 0xFFFFFFFF
    return None, 0


def named(rank: int, call: Call, what: str, exc: BaseException) -> BaseException:
    """``exc`` naming this rank and the call, unless it does already (the probes' errors
    and those raised here do)."""
    return exc if _names_call(rank, call, exc) else wrap(rank, call, what, exc)


def _names_call(rank: int, call: Call, exc: BaseException) -> bool:
    return str(exc).startswith(f"rank {rank}: {call.describe}: ")
