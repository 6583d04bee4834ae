"""The transport contract: a handful of operations that every transport implements.

Messages match on (peer, tag): the n-th send from a to b with tag t meets the
n-th receive posted at b for (a, t). Every message also carries a ``check``
word; a receive whose check differs from the sender's fails with
:class:`~plait.errors.MismatchError` (the executor puts a digest of the call
there, so ranks in different calls fail fast instead of exchanging garbage).
A message whose length differs from the posted receive fails the same way.

Operations never block except :meth:`Transport.wait_any`, which takes a
timeout. Handles complete exactly once, either with ``error`` None or with the
exception to raise; the transport never raises from ``isend``/``irecv``
themselves for peer failures, it completes the handle with the error instead,
so the executor reports all failures in one place.

A transport may also match *patterns* (:class:`Matching`; every endpoint does,
and a sub-communicator's group over one): a receive or a probe from any of
several peers, or with any tag among those that agree with a given one on the
bits of a mask. Point-to-point's ``ANY_SOURCE`` and ``ANY_TAG`` are made of
them; see ``docs/transport.md``, "Matching patterns".
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from plait.errors import PeerLostError


class _ThreadState(threading.local):
    """Per-thread state of waits. ``background`` has a class default, so that reading it on
    a thread that never set it is an attribute read (``getattr`` with a default on a bare
    ``threading.local`` raises and catches AttributeError inside: 0.3-0.5 µs, paid by every
    wait that found a peer's counter short)."""

    background = False


_thread = _ThreadState()


def background_thread() -> None:
    """Mark the calling thread as one that runs calls in the background.

    Such a thread never spins while it waits (it sleeps in the kernel at
    once): a Python thread that polls holds the GIL, and would slow down the
    very computation the background call is meant to overlap with. The
    worker thread of ``async_op=True`` calls marks itself.
    """
    _thread.background = True


def spin_seconds(variable: str, default: float) -> float:
    """Seconds a waiting rank polls, from ``variable`` (microseconds) or ``default``.

    Raises:
        ValueError: the variable is not a number of microseconds >= 0 (named).
    """
    text = os.environ.get(variable, "").strip()
    if not text:
        return default
    try:
        micros = float(text)
    except ValueError:
        raise ValueError(f"{variable}={text!r} is not a number of microseconds") from None
    if not micros >= 0:
        raise ValueError(f"{variable}={text!r} must be a number of microseconds >= 0")
    return micros * 1e-6


def may_spin() -> bool:
    """Whether the calling thread may poll briefly before it sleeps (see background_thread)."""
    return not _thread.background


__all__ = [
    "OTHER_MEMBER",
    "PEER_CLOSED",
    "Handle",
    "Matching",
    "Transport",
    "background_thread",
    "closed_peer",
    "may_spin",
    "peer_closed",
    "renumbered",
    "spin_seconds",
]

#: The attribute a transport sets on the PeerLostError of a wait on one peer that failed
#: because another member of the call was lost (its rank, as the transport numbers it):
#: the peer waited on is not the one lost (Note [members lost] in plait.transport.shm.link).
OTHER_MEMBER = "_plait_other_member"

#: The attribute (True) a transport sets on the PeerLostError of an operation whose peer
#: closed its transport in order, rather than died: such a peer may have left after a
#: failure of its own, which it told its peers before it closed (Note [peers that close]).
PEER_CLOSED = "_plait_peer_closed"

# Note [peers that close]
#     A rank whose call fails tells its peers the rank it lost (a LOST notice, Note [stall
#     probes] in plait.runtime.stall), then often closes its communicator at once (a
#     ``with`` block, a ``close()`` in an except clause). A peer still waiting on it in the
#     same call then fails on the close, and blamed the rank that closed as the lost one,
#     and told its own peers so. So a transport marks the error of a peer's orderly close
#     (PEER_CLOSED: the TCP goodbye, the shared-memory closed word, the in-process close),
#     and a call failing with such an error looks first for what that peer told: its notice
#     travels before its close on the same ordered path (the TCP stream, the ring, the
#     in-process queue), so it is at hand, and the call raises the rank that was lost. A
#     peer that told nothing (it closed after a timeout, or without taking part) stays the
#     rank named, as one that *closed*, not one that died.


def closed_peer(message: str) -> PeerLostError:
    """The PeerLostError of an operation whose peer closed its transport (PEER_CLOSED)."""
    err = PeerLostError(message)
    setattr(err, PEER_CLOSED, True)
    return err


def peer_closed(err: BaseException | None) -> bool:
    """Whether ``err`` says that the peer closed its transport, rather than died."""
    return bool(getattr(err, PEER_CLOSED, False))


@runtime_checkable
class Handle(Protocol):
    """One posted send or receive."""

    peer: int
    #: None while in flight or after success; the exception after a failure.
    error: BaseException | None

    @property
    def done(self) -> bool:
        """Whether the operation has finished (successfully or not)."""
        ...


@runtime_checkable
class Transport(Protocol):
    """Moves bytes between ``size`` ranks; this object is rank ``rank``'s end."""

    rank: int
    size: int

    def isend(self, peer: int, tag: int, data: memoryview, check: int) -> Handle:
        """Start sending ``data`` (bytes; must stay unchanged until the handle is done)."""
        ...

    def irecv(self, peer: int, tag: int, into: memoryview, check: int) -> Handle:
        """Start receiving exactly ``len(into)`` bytes from ``peer`` into ``into``."""
        ...

    def wait_any(self, handles: Sequence[Handle], timeout: float | None) -> bool:
        """Block until one of ``handles`` is done; False if ``timeout`` seconds pass first."""
        ...

    def cancel(self, handle: Handle) -> None:
        """Withdraw an unfinished operation so it never touches its buffer again."""
        ...

    def close(self) -> None:
        """Release resources; peers waiting on this rank fail with PeerLostError."""
        ...


@runtime_checkable
class Matching(Transport, Protocol):
    """A :class:`Transport` that also matches patterns.

    A pattern is ``peers`` (the ranks a message may come from; None: any
    rank, this one included) and a ``tag`` with a ``mask``: a message with tag
    ``t`` matches when ``t & mask == tag & mask`` (``mask`` -1: the whole tag).
    Patterns keep MPI's order: a message goes to the earliest posted receive
    that matches it (plain or pattern), a pattern receive takes the earliest
    arrived message that matches it, and messages of one (peer, tag) still
    match in the order they were sent. A pattern from several peers fails
    with PeerLostError only once every one of them other than this rank is
    lost; one from a single peer fails as a plain receive does.
    """

    def irecv_match(
        self, peers: Sequence[int] | None, tag: int, mask: int, into: memoryview, check: int
    ) -> Handle:
        """Start receiving exactly ``len(into)`` bytes of the first message matching the pattern."""
        ...

    def probe(self, peers: Sequence[int] | None, tag: int, mask: int) -> Handle:
        """A handle that completes once a message matching the pattern has arrived.

        The message stays where it is for a receive to take; :meth:`envelope`
        describes it. The handle fails as a pattern receive would (lost peers,
        close); :meth:`withdraw` or ``cancel`` ends it unmatched.
        """
        ...

    def withdraw(self, handle: Handle) -> bool:
        """Cancel a receive or probe only if it has matched no message yet; whether it did.

        A withdrawn handle is done with ``error`` None and never touches its
        buffer; one that has matched (even if its bytes are still arriving) is
        left to complete.
        """
        ...

    def envelope(self, handle: Handle) -> tuple[int, int, int, int]:
        """``(peer, tag, nbytes, check)`` of the message a done receive or probe matched.

        ``peer`` is in this transport's numbering (-1 for a pattern that
        matched nothing).
        """
        ...


def renumbered(transport: object, err: BaseException) -> BaseException:
    """``err``, which a handle of ``transport`` failed with, naming ranks as ``transport``
    numbers them.

    A sub-communicator's transport hands out its parent's handles, whose errors
    name the job's ranks ("connection to rank 3 lost"); a transport that numbers
    ranks otherwise rewrites them with its ``renumber`` method (a group's: "rank
    1 (job rank 3)"). Any other transport's errors are returned as they are.
    """
    renumber = getattr(transport, "renumber", None)
    if renumber is None:
        return err
    out: BaseException = renumber(err)
    if out is not err and peer_closed(err):  # what kind of loss it was, whatever the numbers
        setattr(out, PEER_CLOSED, True)
    return out
