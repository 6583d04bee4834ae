"""An in-process transport: threads play ranks, messages are copied between arrays.

:class:`MemoryFabric` connects ``size`` endpoints living in one process. By
default sends are eager (the payload is copied at once and the send completes);
with ``lockstep=True`` a send completes only when its receive is posted and the
bytes are copied straight into it, the strictest behaviour any transport can
have, which surfaces schedules that would deadlock without buffering.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from typing import Any, cast

from plait.errors import MismatchError, PeerLostError
from plait.transport.base import Handle

__all__ = ["MemoryFabric", "MemoryTransport"]


class _Op:
    __slots__ = ("buf", "check", "done", "error", "owner", "peer", "tag")

    def __init__(self, owner: MemoryTransport, peer: int, tag: int, buf: memoryview, check: int):
        self.owner = owner
        self.peer = peer
        self.tag = tag
        self.buf = buf
        self.check = check
        self.done = False
        self.error: BaseException | None = None


class _Message:
    __slots__ = ("check", "data", "send")

    def __init__(self, data: bytes | memoryview, check: int, send: _Op | None) -> None:
        self.data = data
        self.check = check
        self.send = send  # lockstep: the send that completes when this is received


class MemoryFabric:
    """``size`` connected in-process endpoints; ``fabric.endpoints[r]`` is rank r's."""

    def __init__(self, size: int, *, lockstep: bool = False) -> None:
        if size < 1:
            raise ValueError(f"size must be at least 1, got {size}")
        self.lock = threading.Lock()
        self.lockstep = lockstep
        self.endpoints = [MemoryTransport(self, r, size) for r in range(size)]


class MemoryTransport:
    """Rank ``rank``'s end of a :class:`MemoryFabric`; see :mod:`plait.transport.base`.

    Attributes:
        bytes_sent: payload bytes handed to :meth:`isend` so far.
        bytes_received: payload bytes delivered into receives so far.
    """

    def __init__(self, fabric: MemoryFabric, rank: int, size: int) -> None:
        self.fabric = fabric
        self.rank = rank
        self.size = size
        self.closed = False
        self._cond = threading.Condition(fabric.lock)
        self._unexpected: dict[tuple[int, int], deque[_Message]] = {}
        self._posted: dict[tuple[int, int], deque[_Op]] = {}
        self.bytes_sent = 0
        self.bytes_received = 0

    # -- contract ----------------------------------------------------------------
    def isend(self, peer: int, tag: int, data: memoryview, check: int) -> _Op:
        op = _Op(self, peer, tag, data, check)
        target = self.fabric.endpoints[peer]
        with self.fabric.lock:
            self.bytes_sent += data.nbytes
            if target.closed:
                self._fail(op, PeerLostError(f"rank {peer} has closed its communicator"))
                return op
            key = (self.rank, tag)
            posted = target._posted.get(key)
            if posted:
                recv = posted.popleft()
                if not posted:
                    del target._posted[key]
                target._deliver(recv, data, check, op)
                self._complete(op)
                return op
            if self.fabric.lockstep:
                message = _Message(data, check, op)
            else:
                message = _Message(bytes(data), check, None)
                self._complete(op)
            target._unexpected.setdefault(key, deque()).append(message)
        return op

    def irecv(self, peer: int, tag: int, into: memoryview, check: int) -> _Op:
        op = _Op(self, peer, tag, into, check)
        key = (peer, tag)
        with self.fabric.lock:
            queue = self._unexpected.get(key)
            if queue:
                message = queue.popleft()
                if not queue:
                    del self._unexpected[key]
                self._deliver(op, message.data, message.check, message.send)
                if message.send is not None:
                    message.send.owner._complete(message.send)
            elif self.fabric.endpoints[peer].closed:
                self._fail(op, PeerLostError(f"rank {peer} has closed its communicator"))
            else:
                self._posted.setdefault(key, deque()).append(op)
        return op

    def wait_any(self, handles: Sequence[Handle], timeout: float | None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: any(h.done for h in handles), timeout)

    def cancel(self, handle: Handle) -> None:
        op = cast(_Op, handle)  # handles come from this transport's isend/irecv
        with self.fabric.lock:
            if op.done:
                return
            # receives posted here, and messages (lockstep sends) waiting at the peer
            tables: list[dict[tuple[int, int], deque[Any]]]
            tables = [self._posted, self.fabric.endpoints[op.peer]._unexpected]
            for table in tables:
                for queue in table.values():
                    for item in list(queue):
                        if item is op or getattr(item, "send", None) is op:
                            queue.remove(item)
            op.done = True

    def close(self) -> None:
        with self.fabric.lock:
            if self.closed:
                return
            self.closed = True
            lost = PeerLostError(f"rank {self.rank} has closed its communicator")
            # Receives that other ranks posted for our messages will never complete.
            for other in self.fabric.endpoints:
                for (src, _), queue in list(other._posted.items()):
                    if src == self.rank:
                        for op in queue:
                            other._fail(op, lost)
                        queue.clear()
            # Lockstep sends to us that nobody will receive now.
            for messages in self._unexpected.values():
                for message in messages:
                    if message.send is not None:
                        message.send.owner._fail(message.send, lost)
            self._unexpected.clear()
            for queue in self._posted.values():
                for op in queue:
                    self._fail(op, lost)
            self._posted.clear()

    # -- internals (lock held) ----------------------------------------------------
    def _deliver(self, op: _Op, data: bytes | memoryview, check: int, send: _Op | None) -> None:
        if check != op.check:
            err = MismatchError(
                f"rank {self.rank} received from rank {op.peer} a message of a different call "
                "(the two ranks disagree on the collective, count, dtype, op, root, algorithm or "
                "segment size; or, for a send and its recv, on the dtype)"
            )
            self._fail(op, err)
            if send is not None:
                send.owner._fail(send, err)
            return
        if len(data) != op.buf.nbytes:
            err = MismatchError(
                f"rank {op.peer} sent {len(data)} bytes but rank {self.rank} expected "
                f"{op.buf.nbytes} bytes"
            )
            self._fail(op, err)
            if send is not None:
                send.owner._fail(send, err)
            return
        op.buf[:] = data
        self.bytes_received += len(data)
        self._complete(op)

    def _complete(self, op: _Op) -> None:
        op.done = True
        op.owner._cond.notify_all()

    def _fail(self, op: _Op, err: BaseException) -> None:
        if not op.done:
            op.error = err
            op.done = True
            op.owner._cond.notify_all()
