"""An in-process transport: threads play ranks, messages are copied between arrays.

:class:`MemoryFabric` connects ``size`` endpoints living in one process. By
default sends are eager (the payload is copied at once and the send completes);
with ``lockstep=True`` a send completes only when its receive is posted and the
bytes are copied straight into it, the strictest behaviour any transport can
have, which surfaces schedules that would deadlock without buffering. Each
endpoint is an :class:`~plait.transport.endpoint.Endpoint` whose one link,
:class:`MemoryLink`, reaches every rank (itself included), and whose ``window`` is
a :class:`~plait.transport.window.MemoryWindow` over arrays the fabric holds; see
``docs/transport.md``.
"""

from __future__ import annotations

import threading

from plait.errors import ClosedError
from plait.transport.base import closed_peer
from plait.transport.endpoint import Endpoint
from plait.transport.link import Message, Op, UndrivenLink
from plait.transport.window import DEFAULT_WINDOW_BYTES, MemoryArena, MemoryWindow

__all__ = ["MemoryFabric", "MemoryLink", "MemoryTransport"]


class MemoryFabric:
    """``size`` connected in-process endpoints; ``fabric.endpoints[r]`` is rank r's.

    One lock guards every endpoint of the fabric, so a send may complete the
    receive of another rank directly. ``window`` is the bytes of one half of each
    rank's window (default 2 MiB; 0: the endpoints have no window); the arrays are
    allocated zeroed, so untouched pages cost no memory.
    """

    def __init__(
        self, size: int, *, lockstep: bool = False, window: int = DEFAULT_WINDOW_BYTES
    ) -> None:
        if size < 1:
            raise ValueError(f"size must be at least 1, got {size}")
        if window < 0:
            raise ValueError(f"window must be a number of bytes >= 0, got {window}")
        self.lock = threading.Lock()
        self.lockstep = lockstep
        self.arena = MemoryArena(size, window, self.lock) if window else None
        self.endpoints = [MemoryTransport(self, r, size) for r in range(size)]


class MemoryTransport(Endpoint):
    """Rank ``rank``'s end of a :class:`MemoryFabric`; see :mod:`plait.transport.base`.

    Attributes:
        bytes_sent: payload bytes handed to :meth:`isend` so far.
        bytes_received: payload bytes delivered into receives so far.
        window: this rank's :class:`~plait.transport.window.MemoryWindow`, or None
            (a fabric made with ``window=0``).
    """

    def __init__(self, fabric: MemoryFabric, rank: int, size: int) -> None:
        super().__init__(rank, size, lock=fabric.lock)
        self.fabric = fabric
        self.link = MemoryLink(fabric, self)
        self.attach(self.link, range(size))
        if fabric.arena is not None:
            self.window = MemoryWindow(
                fabric.arena,
                rank,
                lambda q: fabric.endpoints[q].closed,
                self.closed_error,
                self,
            )

    def _closed_error(self) -> BaseException:
        # This rank's own operations (and window waits) cut short by its close, as on the
        # other transports; its peers see it lost (MemoryLink.shutdown).
        return ClosedError(f"rank {self._me}: this rank's communicator was closed")

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<MemoryTransport rank {self.rank} of {self.size}, {state}>"


class MemoryLink(UndrivenLink):
    """The link of one in-process endpoint to every rank of its fabric (the fabric's lock held).

    A send is copied straight into a posted receive at the peer's endpoint;
    otherwise it is filed there as an unexpected message: a copy of its bytes
    (eager), or the send itself, which completes when a receive takes it (lockstep).
    """

    def __init__(self, fabric: MemoryFabric, endpoint: Endpoint) -> None:
        self._fabric = fabric
        self._ep = endpoint

    def send(self, op: Op) -> None:
        """Deliver ``op`` to the peer's posted receive, or file it there as unexpected."""
        ep = self._ep
        ep.bytes_sent += op.nbytes
        target = self._fabric.endpoints[op.peer]
        recv = target.take_posted(ep.rank, op.tag)
        if recv is not None:
            if recv.check == op.check and recv.nbytes == op.nbytes:
                recv.buf[:] = op.buf
                target.bytes_received += op.nbytes
                target.complete(recv)
                ep.complete(op)
            else:  # both ends fail, as in lockstep mode
                err = target.mismatch(recv, op.check, op.nbytes)
                assert err is not None
                target.fail(recv, err)
                ep.fail(op, err)
            if target is not ep:
                target.notify()
            return
        msg = Message(target.link, op.check, op.nbytes, buffer=False)
        if self._fabric.lockstep:
            msg.source = (ep, op)
            op.state = msg  # for cancel
        else:
            msg.source = bytes(op.buf)
            msg.complete = True
            ep.complete(op)
        target.add_unexpected(ep.rank, op.tag, msg)

    def recv_posted(self, op: Op) -> None:
        """Nothing to do: the peer's next send finds the receive."""

    def claim(self, op: Op, msg: Message) -> None:
        """Copy the message into ``op``; a lockstep send completes now."""
        ep = self._ep
        if msg.complete:
            op.buf[:] = msg.source
        else:
            sender, send = msg.source
            op.buf[:] = send.buf
            sender.complete(send)
            sender.notify()
        ep.bytes_received += op.nbytes
        ep.complete(op)

    def reject(self, msg: Message, err: BaseException) -> None:
        """A lockstep send fails with the receiver's error; eager bytes are dropped."""
        if not msg.complete:
            sender, send = msg.source
            sender.fail(send, err)
            sender.notify()

    def cancel(self, op: Op) -> None:
        """A lockstep send still waiting at its peer is withdrawn from there."""
        if op.is_send and op.state is not None:
            self._fabric.endpoints[op.peer].discard(op.state)
            op.state = None

    def shutdown(self, err: BaseException) -> None:
        """Every other rank loses this one: receives posted there for it fail."""
        me = self._ep.rank
        for other in self._fabric.endpoints:
            if other.rank != me:
                # a close, not a death (Note [peers that close] in plait.transport.base)
                other.lose(me, closed_peer(f"rank {me} has closed its communicator"))
                other.notify()
        if self._fabric.arena is not None:  # ranks waiting on a window counter look again
            self._fabric.arena.cond.notify_all()
            self._fabric.arena.lose(me, err)

    def release(self) -> None:
        """Nothing to release."""
