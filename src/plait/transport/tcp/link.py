"""The TCP link: one or more sockets per peer, driven by the endpoint's epoll.

Matching, errors and waiting belong to the :class:`~plait.transport.endpoint.Endpoint`;
this link moves frames (:mod:`.writer`, :mod:`.reader`, :mod:`.rendezvous`) and turns
closed, broken or misbehaving connections into lost peers. See ``docs/transport.md``
(The TCP transport).

Note [exit without close]
    A rank whose script ends without closing its communicator leaves its sockets to the
    exit, and the kernel sends what they hold, then ends the connections. A send is done
    once its bytes are in the kernel, so a rank may return from its last call and exit
    with megabytes still on their way (behind a slow link, on every stream of a striped
    message). The kernel of a process that has exited answers anything that reaches its
    sockets with a reset, and a reset drops what it had still to send: a peer still
    receiving the last message, which sent this rank a stall probe meanwhile (the wait
    was long), lost the message and named this rank as lost, though it had sent all.
    So at the exit of the process (``atexit``), each link still open drives its endpoint
    until every stream of every peer has nothing queued and its kernel holds no byte the
    peer has not acknowledged (``TIOCOUTQ``), for at most
    :data:`~plait.transport.endpoint.CLOSE_FLUSH_SECONDS` in all, as :meth:`TcpLink.flush`
    waits for the kernel when closing, reading what arrives meanwhile (nothing is left
    unread, which a close answers with a reset too). It sends no goodbye: the peers still
    see a rank that exited, not one that closed. A child made by ``fork`` flushes nothing
    of its parent's links (Note [communicators after fork] in :mod:`plait._fork`).
"""

from __future__ import annotations

import atexit
import errno
import functools
import logging
import math
import os
import select
import socket
import struct
import time
import weakref
from collections.abc import Sequence

from plait.errors import CommError, PeerLostError, TransportError
from plait.transport.base import closed_peer
from plait.transport.endpoint import CLOSE_FLUSH_SECONDS, Endpoint
from plait.transport.link import Message, Op
from plait.transport.tcp import reader, rendezvous, writer
from plait.transport.tcp.pair import Conn, Inbound, Out, Peer, Rts
from plait.transport.tcp.wire import (
    BYE,
    DATA,
    EAGER_MAX,
    HDR,
    HDR_SIZE,
    REFUSE,
    STRIPE_MIN,
    PeerProtocolError,
    part,
)

__all__ = ["TcpLink"]

_log = logging.getLogger("plait")
_EMPTY = memoryview(b"")
_pack = HDR.pack
_IN, _OUT = select.EPOLLIN, select.EPOLLOUT
_TIOCOUTQ = 0x5411  # Linux: bytes in a socket's send queue not yet acknowledged
#: Seconds between looks at the kernel's send queues while close waits for them to empty.
_UNSENT_POLL = 0.002
#: Largest payload a send joins to its header in one buffer rather than gathering the two.
_JOIN_MAX = 1024
_LOST_ERRNOS = frozenset(
    {
        errno.ECONNRESET,
        errno.EPIPE,
        errno.ECONNABORTED,
        errno.ETIMEDOUT,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
        errno.ENETDOWN,
        errno.ENOTCONN,
    }
)


#: The links of this process, flushed at its exit (Note [exit without close]).
_OPEN: weakref.WeakSet[TcpLink] = weakref.WeakSet()


@atexit.register
def _flush_at_exit() -> None:
    """Note [exit without close]: let every open link deliver what it wrote, within
    :data:`CLOSE_FLUSH_SECONDS` in all."""
    deadline = time.monotonic() + CLOSE_FLUSH_SECONDS
    for link in list(_OPEN):
        try:
            link.drain(deadline)
        except Exception:  # best effort: the process is ending
            _log.debug("rank %d: flush at exit failed", link.rank, exc_info=True)


class TcpLink:
    """The link of one rank to its TCP peers.

    Args:
        endpoint: the rank's endpoint (its lock guards this link).
        socks: the connected sockets, ``{(peer, stream): socket}`` (see
            :func:`~plait.transport.tcp.bootstrap.connect_mesh`).
        streams: connections per peer.
        peers: the ranks this link reaches.
        address: the address this rank listens on, as published in the store.

    Attributes:
        peers: the state of each peer, by rank (None for ranks not reached over TCP).
        address: as given.
    """

    def __init__(
        self,
        endpoint: Endpoint,
        socks: dict[tuple[int, int], socket.socket],
        streams: int,
        peers: Sequence[int],
        address: str = "",
    ) -> None:
        self.ep = endpoint
        self.address = address
        self.rank = endpoint.rank
        self.streams = streams
        self.driven = bool(peers)
        #: Conns given frames by the read path (CTS, payloads) that nobody has written yet.
        self.kick: list[Conn] = []
        self.peers: list[Peer | None] = [None] * endpoint.size
        self._by_fd: dict[int, Conn] = {}
        self._phase = 0  # closing: 0 flush sends, 1 flush the goodbye, 2 wait for the kernel
        self._pid = os.getpid()  # a child made by fork flushes none of it at its exit
        for j in sorted(peers):
            p = Peer(j)
            for s in range(streams):
                sock = socks[(j, s)]
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                c = Conn(p, s, sock)
                p.conns.append(c)
                self._by_fd[c.fd] = c
            self.peers[j] = p
        for q in self.peers:
            if q is not None:
                self.set_events(q.conns[0], _IN)
        if peers:
            _OPEN.add(self)

    # -- the link interface (endpoint lock held) -------------------------------------------------
    def send(self, op: Op) -> None:
        """Send ``op`` eagerly (straight into the socket if it has room) or announce it.

        Raises:
            ValueError: ``tag`` or ``check`` do not fit the header.
        """
        p = self.peers[op.peer]
        assert p is not None
        nbytes = op.nbytes
        try:
            hdr = _pack(DATA, op.check, op.tag, nbytes)
        except struct.error:
            raise ValueError(
                f"tag {op.tag} or check {op.check} out of range (tag < 2**64, check < 2**32)"
            ) from None
        ep = self.ep
        ep.bytes_sent += nbytes
        if p.gone is not None:
            ep.fail(op, p.gone)
        elif nbytes > EAGER_MAX:
            rendezvous.send_rts(self, p, op)
        elif nbytes < STRIPE_MIN or self.streams == 1:
            c = p.conns[0]
            op.state = 1
            if c.sendq:
                c.sendq.append(Out(op, hdr, op.buf, 0))
            else:  # the fast path: straight into the socket
                try:
                    sock: socket.socket = c.sock  # type: ignore[assignment]  # live: p not gone
                    if nbytes > _JOIN_MAX:
                        n = sock.sendmsg((hdr, op.buf))
                    else:  # one buffer: send() takes about 0.2 µs less than sendmsg() here
                        n = sock.send(hdr + op.buf)
                except BlockingIOError:
                    n = 0
                except OSError as exc:
                    c.sendq.append(Out(op, hdr, op.buf, 0))
                    self.lose(p, exc)
                    n = -1
                if n == HDR_SIZE + nbytes:
                    ep.complete(op)
                elif n >= 0:
                    c.sendq.append(Out(op, hdr, op.buf, n))
                    self.set_events(c, c.events | _OUT)
        else:
            writer.send_striped(self, p, op)
        if self.kick:
            writer.do_kicks(self)

    def recv_posted(self, op: Op) -> None:
        """Nothing to read here: the wait that follows reads the socket.

        A receive is posted before its message is in the socket far more often
        than after (a collective posts its receives before its sends), and a
        read that finds nothing costs a failed ``recv`` (EAGAIN, raised and
        caught: about 2 µs here), while the waiting endpoint polls the socket
        anyway, at once. Whoever needs the receive done waits for it
        (:meth:`~plait.transport.endpoint.Endpoint.wait_any`), which reads.
        """
        if self.kick:
            writer.do_kicks(self)

    def claim(self, op: Op, msg: Message) -> None:
        """Copy an eager message's bytes so far (the rest lands in ``op``), or clear an RTS."""
        source = msg.source
        if source.__class__ is Rts:
            rts: Rts = source
            p = rts.peer
            del p.rts_in[rts.rid]
            rts.msg = None
            rendezvous.clear(self, p, op, rts.check, rts.nbytes, rts.rid)
        elif msg.complete:
            self.ep.deliver_buffered(op, msg)
        else:
            self._take_arriving(op, source)
        if self.kick:
            writer.do_kicks(self)

    def reject(self, msg: Message, err: BaseException) -> None:
        """Refuse an announced message (unless closing), or discard the rest of an eager one."""
        source = msg.source
        if source.__class__ is Rts:
            rts: Rts = source
            rts.msg = None
            if rts.peer.rts_in.pop(rts.rid, None) is not None and not self.ep.closed:
                rendezvous.answer(self, rts.peer, REFUSE, rts.rid)
                if self.kick:
                    writer.do_kicks(self)
        else:
            rec: Inbound = source
            rec.msg = None
            if not msg.complete:
                rec.view = None  # the rest of it is discarded

    def cancel(self, op: Op) -> None:
        """Withdraw a send, or finish it from a private copy; discard a receive's payload.

        A receive whose message is partly read, or cleared to be sent, has the
        rest of the message discarded; a send already partly written finishes
        from a private copy of its remaining bytes (the frame must stay whole on
        the wire). A large send whose payload has not started is withdrawn: the
        receiver never sees its payload (a receive that had matched it is put
        back among the posted ones: Note [withdrawn messages] in :mod:`.rendezvous`).
        """
        p = self.peers[op.peer]
        assert p is not None
        if op.is_send:
            conns = () if rendezvous.withdraw(self, p, op) else p.conns
            for c in conns:
                for item in list(c.sendq):
                    if item.op is not op:
                        continue
                    if not item.started() and op.state == 1 and c.index == 0:
                        c.sendq.remove(item)  # not a byte out yet: the peer never sees it
                    else:  # finish the frame (payload) from a private copy of what is left
                        if item.off > HDR_SIZE:
                            item.data = memoryview(bytes(item.data[item.off - HDR_SIZE :]))
                            item.total = HDR_SIZE + item.data.nbytes
                            item.off = HDR_SIZE
                        else:
                            item.data = memoryview(bytes(item.data))
                        if item.rest is not None:
                            item.rest = memoryview(bytes(item.rest))
                        item.op = None
        else:
            rec = op.state
            if rec is not None:  # payload partly read or cleared: discard it
                rec.op = None
                rec.view = None
                op.state = None
        if self.kick:
            writer.do_kicks(self)

    def progress(self, stalled: bool) -> bool:
        """Write what the read path queued; the endpoint polls the sockets themselves."""
        if self.kick:
            writer.do_kicks(self)
        return False

    def arm(self) -> float:
        """Sockets wake the endpoint by themselves."""
        if self.kick:
            writer.do_kicks(self)
        return math.inf

    def disarm(self) -> None:
        """Nothing armed."""

    def check(self, now: float) -> None:
        """End-of-file and resets arrive on the sockets."""

    def flush(self, err: BaseException) -> float | None:
        """Closing: send what is queued, wait for announced messages' answers, say goodbye.

        Returns None when done, else the longest the endpoint may wait for socket
        events before asking again.
        """
        live = self._live()
        if self._phase == 0:
            if any(c.sendq for c in live) or self._announced():
                return math.inf
            self._goodbye(err)
        if self._phase == 1:
            if any(c.sendq for c in live):
                return math.inf
            self._phase = 2
        # Wait until the kernel has delivered what we wrote: closing a socket with
        # unread input resets the connection, which would drop unsent output.
        return _UNSENT_POLL if any(_unsent(c) for c in self._live()) else None

    def shutdown(self, err: BaseException) -> None:
        """Fail everything still pending with ``err`` and close the sockets."""
        if self._phase == 0:
            self._goodbye(err)
        for p in self.peers:
            if p is None:
                continue
            self._fail_rendezvous(p, err)
            for c in p.conns:
                for item in c.sendq:
                    if item.op is not None:
                        self.ep.fail(item.op, err)
                for rec in (c.rec, c.cont, *c.due):
                    if rec is not None and rec.op is not None:
                        self.ep.fail(rec.op, err)
                c.sendq.clear()
                c.due.clear()
                c.rec = c.cont = None
                self.drop(c)
            p.owed = 0
            p.dead = True
            if p.gone is None:
                p.gone = err
        self.kick.clear()

    def release(self) -> None:
        """Nothing left: :meth:`shutdown` closed the sockets."""

    def drain(self, deadline: float) -> None:
        """The process exits without closing this link: drive the endpoint until every
        stream has delivered what it was given, or ``deadline`` (Note [exit without close])."""
        ep = self.ep
        if self._pid != os.getpid():
            return
        while True:
            with ep.lock:
                if ep.closed or not any(c.sendq or _unsent(c) for c in self._live()):
                    return
            left = deadline - time.monotonic()
            if left <= 0:
                return
            ep.wait_any([], min(left, _UNSENT_POLL))

    # -- for the reader, writer and rendezvous (lock held) ---------------------------------------
    def start_payload(self, c: Conn, rec: Inbound, chunk: int = 0) -> None:
        """See :func:`.reader.start_payload`."""
        reader.start_payload(self, c, rec, chunk)

    def set_events(self, c: Conn, events: int) -> None:
        """Have the endpoint watch ``c`` for ``events`` (0: not at all)."""
        if events == c.events or c.sock is None:
            return
        if c.events == 0:
            self.ep.watch(
                c.fd, self._on_socket, events, polled=True, direct=functools.partial(self._look, c)
            )
        elif events == 0:
            self.ep.unwatch(c.fd)
        else:
            self.ep.rewatch(c.fd, events)
        c.events = events

    def drop(self, c: Conn) -> None:
        """Close ``c``'s socket."""
        if c.sock is None:
            return
        self.set_events(c, 0)
        c.sock.close()
        c.sock = None

    def eof(self, c: Conn) -> None:
        """``c``'s peer closed it: after a goodbye and with nothing owed, just drop it."""
        p = c.peer
        if p.gone is not None and c.rec is None and c.cont is None and not c.due:
            self.drop(c)
            return
        self.lose(p, None, "connection closed without a goodbye (the process exited or died)")

    def on_bye(self, p: Peer) -> None:
        """``p`` closed its transport: fail what waits on it, keep reading parts still owed.

        The error says it closed, not died (Note [peers that close] in
        :mod:`plait.transport.base`): what it told before its goodbye came first. It
        names the communicator, which a user knows and whose close closes the transport,
        as every transport does.
        """
        p.gone = closed_peer(f"rank {p.rank} has closed its communicator")
        self._fail_pending(p, p.gone, inbound=False)
        for c in p.conns:
            if c.index == 0 or (c.rec is None and not c.due):
                self.drop(c)

    def lose(
        self, p: Peer, exc: OSError | None, why: str | None = None, protocol: bool = False
    ) -> None:
        """Connections to ``p`` broke: fail everything pending with it and close them.

        EOF and connection errors (reset, broken pipe, unreachable) fail the
        operations with PeerLostError, protocol violations with
        PeerProtocolError, other OS errors with TransportError. The OSError is
        the ``__cause__``.
        """
        if p.dead:
            return
        if why is None:
            why = f"{type(exc).__name__}: {exc}"
        msg = f"rank {self.rank}: connection to rank {p.rank} lost: {why}"
        err: CommError
        if protocol:
            err = PeerProtocolError(msg)
        elif exc is None or exc.errno in _LOST_ERRNOS or isinstance(exc, ConnectionError):
            err = PeerLostError(msg)
        else:
            err = TransportError(msg)
        err.__cause__ = exc
        if p.gone is None:
            p.gone = err
        self._fail_pending(p, p.gone, inbound=True)
        for c in p.conns:
            self.drop(c)
        p.dead = True

    def protocol_error(self, p: Peer, what: str) -> None:
        """``p`` sent something impossible: drop it, log it, fail everything pending with it."""
        _log.warning("rank %d: protocol error from rank %d: %s", self.rank, p.rank, what)
        self.lose(p, None, f"protocol error: {what}", protocol=True)

    # -- internals ---------------------------------------------------------------------------
    def _on_socket(self, fd: int, ready: int) -> None:
        c = self._by_fd.get(fd)
        if c is None or c.sock is None:
            return
        if ready & (_IN | select.EPOLLERR | select.EPOLLHUP) and c.events & _IN:
            reader.read(self, c)
        if ready & (_OUT | select.EPOLLERR | select.EPOLLHUP) and c.sock is not None:
            writer.write(self, c)  # with an empty queue (a send was cancelled): drops the interest
        if self.kick:
            writer.do_kicks(self)

    def _look(self, c: Conn) -> bool:
        """What :meth:`_on_socket` would do for whatever ``c`` is ready for, without epoll.

        Reads (if ``c`` is read) and writes its queue (if any); whether a byte moved
        or the connection ended (Note [one watched descriptor] in
        :mod:`plait.transport.descriptors`).
        """
        if c.sock is None:
            return False
        got, sent = c.received, c.sent
        if c.events & _IN:
            reader.read(self, c)
        if c.sendq and c.sock is not None:
            writer.write(self, c)
        if self.kick:
            writer.do_kicks(self)
        return c.received != got or c.sent != sent or c.sock is None

    def _take_arriving(self, op: Op, rec: Inbound) -> None:
        """Receive ``op`` takes eager message ``rec`` while it arrives: copy what is there."""
        view = rec.view
        assert view is not None
        p = rec.peer
        striped = rec.seq >= 0
        for k in range(self.streams if striped else 1):
            lo, hi = part(rec.nbytes, self.streams, k) if striped else (0, rec.nbytes)
            ck = p.conns[k]
            if ck.rec is rec:
                upto = ck.pos
            elif k > 0 and rec in ck.due:
                upto = lo
            else:
                upto = hi
            if upto > lo:
                op.buf[lo:upto] = view[lo:upto]
        rec.msg = None
        rec.view = op.buf
        rec.op = op
        op.state = rec

    def _fail_rendezvous(self, p: Peer, err: BaseException) -> None:
        """Fail the rendezvous messages with ``p`` that can no longer finish."""
        for op, _ in p.rts_out.values():
            if op is not None:
                self.ep.fail(op, err)
        p.rts_out.clear()
        for rec in p.cleared.values():
            if rec.op is not None:
                self.ep.fail(rec.op, err)
                rec.op.state = None
                rec.op = None
        p.cleared.clear()
        for rts in p.rts_in.values():
            if rts.msg is not None:
                self.ep.discard(rts.msg)
                rts.msg = None
        p.rts_in.clear()

    def _fail_pending(self, p: Peer, err: BaseException, inbound: bool) -> None:
        """Fail what is pending with ``p``: all of it, or (``inbound`` False, after its
        goodbye) all but the payloads still arriving on its other streams."""
        self.ep.lose(p.rank, err)
        self._fail_rendezvous(p, err)
        for c in p.conns:
            for item in c.sendq:
                if item.op is not None:
                    self.ep.fail(item.op, err)
            c.sendq.clear()
            if inbound:  # messages from p that will never finish arriving
                for rec in (c.rec, c.cont, *c.due):
                    if rec is None:
                        continue
                    if rec.op is not None:
                        self.ep.fail(rec.op, err)
                        rec.op.state = None
                        rec.op = None
                    if rec.msg is not None:
                        self.ep.discard(rec.msg)
                        rec.msg = None
                    rec.view = None
                c.rec = c.cont = None
                c.due.clear()
                p.owed = 0

    def _live(self) -> list[Conn]:
        return [c for p in self.peers if p is not None for c in p.conns if c.sock is not None]

    def _announced(self) -> bool:
        """Whether large sends still wait for their receiver's answer."""
        return any(
            op is not None for p in self.peers if p is not None for op, _ in p.rts_out.values()
        )

    def _goodbye(self, err: BaseException) -> None:
        """Fail the sends still unanswered and queue a ``BYE`` to every live peer."""
        self._phase = 1
        bye = HDR.pack(BYE, 0, 0, 0)
        for p in self.peers:
            if p is None:
                continue
            # Unanswered now: they fail, and an answer that still comes ends a tombstone.
            for rid, (op, rts) in list(p.rts_out.items()):
                if op is not None:
                    self.ep.fail(op, err)
                    p.rts_out[rid] = (None, rts)
            c = p.conns[0]
            if p.gone is None and c.sock is not None:
                c.sendq.append(Out(None, bye, _EMPTY, 0))
                if len(c.sendq) == 1:
                    writer.write(self, c)


def _unsent(c: Conn) -> bool:
    """Whether ``c``'s kernel send queue still holds unacknowledged bytes (Linux only)."""
    if c.sock is None:
        return False
    try:
        import fcntl

        raw = fcntl.ioctl(c.sock.fileno(), _TIOCOUTQ, b"\0\0\0\0")
        queued: int = struct.unpack("i", raw)[0]
        return queued > 0
    except (OSError, ImportError):
        return False
