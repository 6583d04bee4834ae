"""What an endpoint and its links share: handles, unexpected messages and the link interface.

A :class:`Link` moves the bytes of messages between an
:class:`~plait.transport.endpoint.Endpoint` and some of its peers; the endpoint
keeps the contract (matching, errors, waiting). See ``docs/transport.md``.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import numpy as np

__all__ = ["COPY_MIN", "Link", "Message", "Op", "copy_bytes"]

#: Copies of at least this many bytes go through numpy, which releases the GIL.
COPY_MIN = 64 << 10


class Op:
    """A posted send or receive: the :class:`~plait.transport.base.Handle` an endpoint returns.

    ``offset`` (bytes published by a send, delivered into a receive) and
    ``state`` belong to the link that moves the message. ``seq`` is the
    endpoint's: the order in which receives were posted (set when one is
    queued, read only for the queued ones).
    """

    __slots__ = (
        "__weakref__",  # the point-to-point layer keeps a rank's last send by weak reference
        "arr",
        "buf",
        "check",
        "done",
        "error",
        "is_send",
        "nbytes",
        "offset",
        "peer",
        "seq",
        "state",
        "tag",
    )

    seq: int

    def __init__(self, peer: int, tag: int, buf: memoryview, check: int, is_send: bool) -> None:
        self.peer = peer
        self.tag = tag
        self.buf = buf
        self.nbytes = nbytes = buf.nbytes
        #: A numpy view for large copies (they release the GIL), else None.
        self.arr: np.ndarray | None = (
            np.frombuffer(buf, dtype=np.uint8) if nbytes >= 65536 else None  # COPY_MIN
        )
        self.check = check & 0xFFFFFFFFFFFFFFFF
        self.is_send = is_send
        self.offset = 0
        self.state: Any = None
        self.done = False
        self.error: BaseException | None = None

    def __repr__(self) -> str:
        kind = "send to" if self.is_send else "recv from"
        state = "failed" if self.error else "done" if self.done else "pending"
        return f"<{kind} rank {self.peer} tag {self.tag} {self.nbytes} B {state}>"


class Message:
    """A message that arrived (or began to) before its receive was posted.

    The link that made it fills ``data`` up to ``received`` bytes and sets
    ``complete`` (buffered messages), or keeps what it needs in ``source``
    (a message still at the sender, such as a rendezvous announcement).
    ``seq`` is the endpoint's: the order in which messages were filed, which
    a receive from any peer follows.
    """

    __slots__ = ("check", "complete", "data", "link", "nbytes", "received", "seq", "source")

    def __init__(self, link: Link, check: int, nbytes: int, *, buffer: bool = True) -> None:
        self.link = link
        self.check = check
        self.nbytes = nbytes
        self.data: np.ndarray | None = np.empty(nbytes, dtype=np.uint8) if buffer else None
        self.received = 0
        self.complete = False
        self.source: Any = None
        self.seq = 0


class Link(Protocol):
    """Moves the bytes of messages between an endpoint and some of its peers.

    Every method is called with the endpoint's lock held and never blocks.
    A link completes operations with :meth:`Endpoint.complete` /
    :meth:`Endpoint.fail`, asks for posted receives with
    :meth:`Endpoint.take_posted`, files messages nobody waits for yet with
    :meth:`Endpoint.add_unexpected`, and reports a dead or closed peer with
    :meth:`Endpoint.lose`. See ``docs/transport.md``.
    """

    #: Whether the endpoint must call :meth:`progress` while it waits; False for a
    #: link whose operations complete inside the calls of some rank (in-process memory).
    driven: bool

    def send(self, op: Op) -> None:
        """Start sending ``op`` (its peer is reachable and not lost)."""
        ...

    def recv_posted(self, op: Op) -> None:
        """``op`` was just posted (no unexpected message matched it): move what can move."""
        ...

    def claim(self, op: Op, msg: Message) -> None:
        """``op`` takes ``msg`` (check word and length agree): deliver it, now or later."""
        ...

    def reject(self, msg: Message, err: BaseException) -> None:
        """``msg`` met a receive that disagrees (or the endpoint closes): drop the message."""
        ...

    def cancel(self, op: Op) -> None:
        """``op`` was cancelled (already marked done; not in the posted queues): forget it."""
        ...

    def progress(self, stalled: bool) -> bool:
        """One pass that moves bytes; whether anything moved.

        ``stalled``: the endpoint has nothing else to do, so messages whose
        receive is not posted must be taken in (as unexpected messages) to
        let their senders go on.
        """
        ...

    def arm(self) -> float:
        """Before the endpoint sleeps: arrange that every event it needs wakes one of its fds.

        Returns the longest the endpoint may sleep (``math.inf``: no limit),
        or 0.0 when something moved meanwhile (then nothing is armed).
        """
        ...

    def disarm(self) -> None:
        """After sleeping: undo :meth:`arm`."""
        ...

    def check(self, now: float) -> None:
        """Now and then while waiting: notice peers that died without a sound."""
        ...

    def flush(self, err: BaseException) -> float | None:
        """The endpoint closes: one step of sending what is still queued, and goodbyes.

        Returns None when the link has nothing left to send (or gives up on it);
        else the longest the endpoint may wait for its descriptors before it
        asks again (``math.inf``: until one is ready). The endpoint asks for at
        most ``CLOSE_FLUSH_SECONDS``; ``err`` is the error of operations the
        link gives up on meanwhile.
        """
        ...

    def shutdown(self, err: BaseException) -> None:
        """The endpoint closes: fail what the link holds with ``err`` and tell the peers."""
        ...

    def release(self) -> None:
        """Free sockets and memory (nobody polls the link's descriptors any more)."""
        ...


class UndrivenLink:
    """The waiting hooks of a link whose operations complete inside the calls of some rank.

    Such a link (a rank's loopback, the in-process memory fabric) is never
    driven: the endpoint never calls :meth:`progress` while it waits, has no
    descriptor of it to sleep on, and nothing of it is queued at close.
    Subclasses implement the moving of messages and ``shutdown``/``release``.
    """

    driven = False

    def progress(self, stalled: bool) -> bool:
        """Never driven."""
        return False

    def arm(self) -> float:
        """Never driven."""
        return math.inf

    def disarm(self) -> None:
        """Never driven."""

    def check(self, now: float) -> None:
        """Never driven."""

    def flush(self, err: BaseException) -> float | None:
        """Nothing to flush: queued sends fail at shutdown."""
        return None


def copy_bytes(
    dst_mv: memoryview,
    dst_arr: np.ndarray | None,
    d0: int,
    src_mv: memoryview,
    src_arr: np.ndarray | None,
    s0: int,
    n: int,
) -> None:
    """memcpy ``n`` bytes; numpy for large copies because it releases the GIL."""
    if n >= COPY_MIN and dst_arr is not None and src_arr is not None:
        dst_arr[d0 : d0 + n] = src_arr[s0 : s0 + n]
    elif n:
        dst_mv[d0 : d0 + n] = src_mv[s0 : s0 + n]
