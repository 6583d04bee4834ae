"""plait's exceptions: one tree under :class:`CommError`.

::

    CommError                          anything that went wrong in communication
    ├── CommTimeout (TimeoutError)     a call did not finish in time
    │   └── CollectiveTimeout          a collective timed out; names it, its call number and the
    │                                  ranks that did not arrive
    ├── PeerLostError                  a peer closed, died or dropped its connection
    ├── MismatchError                  ranks disagree on the call (collective, count, dtype, op, …)
    ├── ClosedError                    this communicator was closed by its owner
    ├── UnsupportedError (ValueError)  the combination asked for has no implementation
    ├── TransportError                 a transport failed for another reason (OS errors wrapped)
    ├── RendezvousError                ranks could not find each other
    └── InternalError                  a bug in plait: please report it

Bad arguments (wrong type, shape, dtype, root, unknown algorithm) raise plain
:class:`ValueError` or :class:`TypeError` before any byte moves. A
:class:`CommError` raised by a collective leaves its communicator *broken*: the
ranks no longer agree on what has been exchanged, so later calls raise
:class:`CommError` at once; make a new communicator. Every message names this
rank, the call, and the peer or value at fault.
"""

from __future__ import annotations

__all__ = [
    "ClosedError",
    "CollectiveTimeout",
    "CommError",
    "CommTimeout",
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
    """A peer closed its communicator, exited, or its connection broke."""


class MismatchError(CommError):
    """Ranks made calls that do not match (collective, count, dtype, op, root or algorithm)."""


class ClosedError(CommError):
    """The communicator was closed by its owner before or during the call."""


class UnsupportedError(CommError, ValueError):
    """The requested combination (algorithm, op, dtype, …) is not supported."""


class TransportError(CommError):
    """A transport failed (OS or socket error), wrapped with the rank and peer."""


class RendezvousError(CommError):
    """Ranks could not find each other through the store."""


class InternalError(CommError):
    """A bug in plait; the message says where. Please report it."""
