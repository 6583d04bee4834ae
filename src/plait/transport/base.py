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
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

_thread = threading.local()


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
    return not getattr(_thread, "background", False)


__all__ = ["Handle", "Transport", "background_thread", "may_spin", "spin_seconds"]


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
