"""plait's exceptions: one tree under :class:`CommError`.

::

    CommError                          anything that went wrong in communication
    ├── CommTimeout (TimeoutError)     a call did not finish in time
    │   └── CollectiveTimeout          a collective timed out; names it, its call number and the
    │                                  ranks that did not arrive
    ├── PeerLostError                  a peer closed, died or dropped its connection
    ├── MismatchError                  ranks disagree on the call (collective, count, dtype, op, …)
    ├── ClosedError                    this communicator was closed by its owner
    ├── AbortedError                   some rank called ``abort()`` on the communicator
    ├── ExcludedError                  the other ranks agreed without this one (took it for failed)
    ├── UnsupportedError (ValueError)  the combination asked for has no implementation
    ├── TransportError                 a transport failed for another reason (OS errors wrapped)
    ├── RendezvousError                ranks could not find each other
    └── InternalError                  a bug in plait: please report it

Bad arguments (wrong type, shape, dtype, root, unknown algorithm) raise plain
:class:`ValueError` or :class:`TypeError` before any byte moves. A
:class:`CommError` raised by a collective leaves its communicator *broken*: the
ranks no longer agree on what has been exchanged, so later calls raise
:class:`CommError` at once; make a new communicator. Every message names this
rank, the call, and the peer or value at fault. To go on without a lost rank
instead, see ``abort``, ``agree`` and ``shrink`` (docs/fault-tolerance.md).
"""

from __future__ import annotations

__all__ = [
    "AbortedError",
    "ClosedError",
    "CollectiveTimeout",
    "CommError",
    "CommTimeout",
    "ExcludedError",
    "ForkedError",
    "InternalError",
    "MismatchError",
    "PeerLostError",
    "RendezvousError",
    "TransportError",
    "UnsupportedError",
]


class CommError(Exception):
    """Base of every plait communication error."""


class CommTimeout(CommError, TimeoutError):
    """A call did not finish within its timeout."""


class CollectiveTimeout(CommTimeout):
    """A collective did not finish in time; the message names the ranks that never arrived."""


class PeerLostError(CommError):
    """A peer closed its communicator, exited, or its connection broke.

    ``lost_rank`` is that peer as the communicator numbers it, where the failed
    call knows it (a collective does: it waited on the peer, or the rank that did
    told it), else None.
    """

    lost_rank: int | None = None


class MismatchError(CommError):
    """Ranks made calls that do not match (collective, count, dtype, op, root or algorithm).

    ``sent``: where a message did not match the receive it reached, its check word and its
    size in bytes: on the transport's error, for the point-to-point layer to name the
    sender's dtype in the message of the error the call raises, and on that error too, for
    a layer above to say the message's size in its own terms (plait.mpi's Irecv); None on
    every other error.
    """

    sent: tuple[int, int] | None = None


class ClosedError(CommError):
    """The communicator was closed by its owner before or during the call."""


class AbortedError(CommError):
    """The communicator was aborted: some rank called ``abort()``, here or on a peer.

    Every collective in flight on any rank fails with it (a point-to-point call
    in flight may fail with PeerLostError instead), and so does every later
    call; the message names the rank that aborted and its reason. What is left
    to do with the communicator is ``agree``, ``shrink`` or ``close``.
    """


class ExcludedError(CommError):
    """The other ranks agreed without this rank: they took it for failed (it came too late).

    Raised by ``agree`` and ``shrink`` on the rank left out; the survivors go on
    without it, so the only thing left for it is to close the communicator.
    """


class ForkedError(CommError):
    """A communicator used in a child process that ``fork`` made after the communicator:
    its memory, sockets and store connection are the parent's (Note [communicators after
    fork] in plait._fork). ``plait.init`` in the child makes one of its own."""


class UnsupportedError(CommError, ValueError):
    """The requested combination (algorithm, op, dtype, …) is not supported."""


class TransportError(CommError):
    """A transport failed (OS or socket error), wrapped with the rank and peer."""


class RendezvousError(CommError):
    """Ranks could not find each other through the store."""


class InternalError(CommError):
    """A bug in plait; the message says where. Please report it."""
