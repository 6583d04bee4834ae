"""The endpoint on its own: a toy driven link passes the whole conformance suite.

:class:`QueueLink` is the smallest link the endpoint has to drive: ranks are
threads, a message is a tuple appended to the receiver's inbox, and a
doorbell socket pair per rank wakes a sleeping receiver. It stays in its inbox
until its receive is posted or the receiver is stalled, like shared memory's
rings, so the suite exercises the endpoint's matching, waiting (spin, arm,
sleep in epoll, wake-ups), threads, cancel, peer loss and close.
"""

from __future__ import annotations

import contextlib
import math
import socket
import threading
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np
import pytest

from plait.errors import ClosedError, PeerLostError
from plait.transport import conformance
from plait.transport.base import Transport, closed_peer
from plait.transport.endpoint import Endpoint
from plait.transport.link import Message, Op
from plait.transport.loopback import Loopback

_Item = tuple[int, int, bytes]  # tag, check, payload


class _Fabric:
    """Shared state of ``size`` toy endpoints: inboxes, doorbells, closed flags."""

    def __init__(self, size: int) -> None:
        self.inbox: list[list[deque[_Item]]] = [[deque() for _ in range(size)] for _ in range(size)]
        # made by each rank's link (a rank alone has none)
        self.bells: list[tuple[socket.socket, socket.socket]] = []
        self.closed = [False] * size

    def ring(self, rank: int) -> None:
        with contextlib.suppress(OSError):
            self.bells[rank][1].send(b"\0", socket.MSG_DONTWAIT)


class QueueLink:
    """A driven link between threads: ``inbox[dst][src]`` holds messages in flight."""

    driven = True

    def __init__(self, fabric: _Fabric, ep: Endpoint, peers: Sequence[int]) -> None:
        self.fabric, self.ep, self.peers = fabric, ep, list(peers)
        fabric.bells.append(socket.socketpair())
        bell = fabric.bells[ep.rank][0]
        bell.setblocking(False)
        ep.watch(bell.fileno(), lambda fd, ready: self._drain(bell))

    def send(self, op: Op) -> None:
        self.fabric.inbox[op.peer][self.ep.rank].append((op.tag, op.check, bytes(op.buf)))
        self.ep.bytes_sent += op.nbytes
        self.ep.complete(op)
        self.fabric.ring(op.peer)

    def recv_posted(self, op: Op) -> None:
        self._pull(op.peer, False)

    def claim(self, op: Op, msg: Message) -> None:
        self.ep.deliver_buffered(op, msg)

    def reject(self, msg: Message, err: BaseException) -> None:
        """Buffered messages are dropped with the queue entry."""

    def cancel(self, op: Op) -> None:
        """Sends complete at once; posted receives are the endpoint's."""

    def progress(self, stalled: bool) -> bool:
        return any([self._pull(peer, stalled) for peer in self.peers])

    def arm(self) -> float:
        # A sender appends, then rings: a message appended after this check wakes epoll.
        return 0.0 if self.progress(True) else math.inf

    def disarm(self) -> None:
        """Nothing to undo."""

    def check(self, now: float) -> None:
        """Closing peers ring the doorbell; nothing dies silently here."""

    def flush(self, err: BaseException) -> float | None:
        """Nothing to flush: queued sends fail at shutdown."""
        return None

    def shutdown(self, err: BaseException) -> None:
        self.fabric.closed[self.ep.rank] = True
        for peer in self.peers:
            self.fabric.ring(peer)

    def release(self) -> None:
        self.fabric.bells[self.ep.rank][0].close()
        self.fabric.bells[self.ep.rank][1].close()

    def _pull(self, peer: int, stalled: bool) -> bool:
        ep, box, moved = self.ep, self.fabric.inbox[self.ep.rank][peer], False
        while box:
            tag, check, data = box[0]
            op = ep.take_posted(peer, tag)
            if op is None and not stalled:
                break
            box.popleft()
            moved = True
            if op is None:
                msg = Message(self, check, len(data))
                assert msg.data is not None
                msg.data[:] = np.frombuffer(data, np.uint8)
                msg.received, msg.complete = len(data), True
                ep.add_unexpected(peer, tag, msg)
            elif (err := ep.mismatch(op, check, len(data))) is not None:
                ep.fail(op, err)
            else:
                op.buf[:] = data
                ep.bytes_received += len(data)
                ep.complete(op)
        if not box and self.fabric.closed[peer]:
            ep.lose(peer, closed_peer(f"rank {peer} has closed its transport"))
            moved = True
        return moved

    def _drain(self, bell: socket.socket) -> None:
        with contextlib.suppress(BlockingIOError):
            while bell.recv(4096):
                pass


def queue_transports(size: int) -> list[Endpoint]:
    """``size`` toy endpoints, connected through one :class:`_Fabric`."""
    fabric = _Fabric(size)
    endpoints = []
    for rank in range(size):
        ep = Endpoint(rank, size)
        ep.attach(Loopback(ep), [rank])
        others = [p for p in range(size) if p != rank]
        if others:
            ep.attach(QueueLink(fabric, ep, others), others)
        endpoints.append(ep)
    return endpoints


@pytest.mark.parametrize("check", conformance.CHECKS, ids=lambda f: f.__name__)
def test_conformance(check: Callable[[conformance.Factory], None]) -> None:
    check(queue_transports)


def test_is_a_transport_and_checks_arguments() -> None:
    ep, other = queue_transports(2)
    other.close()
    try:
        assert isinstance(ep, Transport)
        with pytest.raises(ValueError, match=r"peer 2 is not in 0\.\.1"):
            ep.isend(2, 1, memoryview(b"x"), 0)
        with pytest.raises(ValueError, match="signed 64-bit"):
            ep.isend(1, 1 << 63, memoryview(b"x"), 0)
        with pytest.raises(ValueError, match="writable"):
            ep.irecv(1, 1, memoryview(b"abc"), 0)
        with pytest.raises(TypeError, match="not a handle"):
            ep.cancel(object())  # type: ignore[arg-type]
    finally:
        ep.close()
    late = ep.isend(1, 1, memoryview(b"x"), 0)
    assert isinstance(late.error, ClosedError)


def test_a_second_thread_waits_while_the_first_drives() -> None:
    """Two threads of one rank wait at once; a send from the peer wakes the right one."""
    a, b = queue_transports(2)
    try:
        bufs = [np.zeros(4, np.uint8) for _ in range(2)]
        hs = [b.irecv(0, tag, bufs[tag].data, 0) for tag in range(2)]
        started = threading.Barrier(3)
        results: list[bool] = []

        def waiter(i: int) -> None:
            started.wait()
            results.append(b.wait_any([hs[i]], 20.0))

        threads = [threading.Thread(target=waiter, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        started.wait()
        for tag in (1, 0):
            a.isend(1, tag, np.full(4, tag + 1, np.uint8).data, 0)
        for t in threads:
            t.join(20.0)
        assert results == [True, True]
        assert [int(x[0]) for x in bufs] == [1, 2]
    finally:
        a.close()
        b.close()


def test_lost_peer_fails_posted_and_later_receives() -> None:
    a, b = queue_transports(2)
    try:
        a.isend(1, 1, memoryview(b"kept"), 0)
        a.close()
        kept, lost = np.zeros(4, np.uint8), np.zeros(4, np.uint8)
        h1 = b.irecv(0, 1, kept.data, 0)
        h2 = b.irecv(0, 2, lost.data, 0)
        assert b.wait_any([h2], 20.0)
        assert h1.error is None
        assert kept.tobytes() == b"kept"
        assert isinstance(h2.error, PeerLostError)
    finally:
        b.close()


def _post(ep: Endpoint, kind: str, buf: np.ndarray) -> Op:
    """A receive of ``buf`` on tag 1 from rank 0: plain, a pattern from rank 0 alone, or a
    pattern from any rank."""
    if kind == "plain":
        return ep.irecv(0, 1, buf.data, 0)
    return ep.irecv_match([0] if kind == "pattern-one" else None, 1, -1, buf.data, 0)


_KINDS = ["plain", "pattern-one", "pattern"]


@pytest.mark.parametrize("kind", _KINDS)
def test_a_receive_put_back_goes_where_it_was_in_posting_order(kind: str) -> None:
    """``repost`` (Note [withdrawn messages] in plait.transport.tcp.rendezvous): a receive
    a link had taken for a message that its sender withdrew goes back ahead of the
    receives posted after it, plain and pattern, and takes the next message."""
    a, b = queue_transports(2)
    try:
        bufs = [np.zeros(4, np.uint8) for _ in range(3)]
        r = _post(b, kind, bufs[0])
        later = [b.irecv(0, 1, bufs[1].data, 0), _post(b, kind, bufs[2])]
        with b.lock:  # a link reads the message's header, and its sender withdraws it
            assert b.take_posted(0, 1) is r
            b.repost(r)
        assert (r.peer, r.tag) == (-1 if kind == "pattern" else 0, 1)  # a pattern unbound
        sends = [a.isend(1, 1, np.full(4, k, np.uint8).data, 0) for k in (1, 2, 3)]
        conformance.wait_all(b, [r, *later])
        assert [h.error for h in [r, *later, *sends]] == [None] * 6
        assert [int(x[0]) for x in bufs] == [1, 2, 3]
        assert b.envelope(r)[:2] == (0, 1)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("kind", _KINDS)
def test_a_receive_put_back_takes_a_message_filed_meanwhile(kind: str) -> None:
    """A message that the receive matches, filed while its link held it, is the receive's
    as it is put back; a filed one it does not match stays filed."""
    a, b = queue_transports(2)
    try:
        buf, other = np.zeros(4, np.uint8), np.zeros(4, np.uint8)
        r = _post(b, kind, buf)
        with b.lock:
            assert b.take_posted(0, 1) is r
            link = b._route[0]
            assert link is not None
            for tag, fill in ((2, 9), (1, 7)):  # as the link files messages nobody waits for
                msg = Message(link, 0, 4)
                assert msg.data is not None
                msg.data[:] = fill
                msg.received, msg.complete = 4, True
                b.add_unexpected(0, tag, msg)
            b.repost(r)
        assert r.done
        assert r.error is None
        assert (buf == 7).all()
        assert b.envelope(r)[:2] == (0, 1)
        h = b.irecv(0, 2, other.data, 0)
        assert h.done
        assert (other == 9).all()
    finally:
        a.close()
        b.close()
