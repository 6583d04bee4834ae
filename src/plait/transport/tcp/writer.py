"""The TCP send path: send queues, urgent control frames, batched ``sendmsg``.

Sends go out with ``sendmsg([header, payload])``, straight from ``isend`` when the
socket has room (:meth:`TcpLink.send`); the rest waits in the connection's queue
until the socket drains (the endpoint watches it for ``EPOLLOUT`` meanwhile). A
chunked rendezvous payload is one queue entry, handing up to 4 MiB of chunks with
their headers to one ``sendmsg``. ``CTS``, ``REFUSE`` and ``WITHDRAW`` jump the
queue: they go before every frame not started yet, between two chunks of a payload
that has started, never into a frame already started.
"""

from __future__ import annotations

import select
from collections import deque
from typing import TYPE_CHECKING

from plait.transport.link import Op
from plait.transport.tcp.pair import Conn, Out, Peer
from plait.transport.tcp.wire import CHUNK, DATA, HDR, HDR_SIZE, PART, RDATA, part

if TYPE_CHECKING:
    from plait.transport.tcp.link import TcpLink

__all__ = ["do_kicks", "push", "send_striped", "write"]

_GATHER = 64  # most buffers handed to one sendmsg
_BATCH = 4 << 20  # most bytes of a chunked payload handed to one sendmsg
_IN, _OUT = select.EPOLLIN, select.EPOLLOUT


def send_striped(link: TcpLink, p: Peer, op: Op) -> None:
    """Queue ``op`` as one part per stream (part 0 in the ``DATA`` frame on stream 0)."""
    mv = op.buf
    nbytes = mv.nbytes
    streams = link.streams
    seq = p.seq_out
    p.seq_out += 1
    op.state = streams
    for k, c in enumerate(p.conns):
        lo, hi = part(nbytes, streams, k)
        hdr = HDR.pack(DATA, op.check, op.tag, nbytes) if k == 0 else HDR.pack(PART, 0, seq, nbytes)
        c.sendq.append(Out(op, hdr, mv[lo:hi], 0))
        if len(c.sendq) == 1:
            write(link, c)
        if p.dead:
            return


def push(link: TcpLink, c: Conn, out: Out, urgent: bool = False) -> None:
    """Queue ``out`` on ``c`` without writing: :func:`do_kicks` writes it.

    The read path's way to send (it must never re-enter itself); every entry
    into the link ends with :func:`do_kicks`. ``urgent`` frames (CTS, REFUSE,
    WITHDRAW: header only) go before every frame not started yet, after the
    urgent ones queued before them; a chunked payload lets them pass at its
    next chunk (see :func:`_next_chunk`), so a long payload delays a handshake
    behind it by at most one :data:`~plait.transport.tcp.wire.CHUNK`.
    """
    q = c.sendq
    if urgent:
        out.urgent = True
        i = 1 if q and q[0].off else 0  # never into a frame already started
        while i < len(q) and q[i].urgent:
            i += 1
        q.insert(i, out)
    else:
        q.append(out)
    if len(q) == 1:  # otherwise c already waits for writability or a kick
        link.kick.append(c)


def do_kicks(link: TcpLink) -> None:
    """Write what :func:`push` queued."""
    kicks, link.kick = link.kick, []
    for c in kicks:
        if c.sock is not None and c.sendq:
            write(link, c)


def write(link: TcpLink, c: Conn) -> None:
    """Write queued frames of ``c`` until the socket is full."""
    q = c.sendq
    sock = c.sock
    assert sock is not None
    try:
        while q:
            bufs: list[bytes | memoryview] = []
            total = 0
            for i, item in enumerate(q):
                off = item.off
                if off < HDR_SIZE:
                    bufs.append(item.hdr[off:] if off else item.hdr)
                    if item.data.nbytes:
                        bufs.append(item.data)
                else:
                    bufs.append(item.data[off - HDR_SIZE :])
                total += item.total - off
                if item.rest is not None:
                    # A payload with chunks to come ends the batch. Urgent frames
                    # queued behind it go out after this chunk; with none, its next
                    # chunks join the batch (those queued later wait for a later one).
                    if i + 1 == len(q) or not q[i + 1].urgent:
                        total += _more_chunks(item, bufs, total)
                    break
                if len(bufs) >= _GATHER or total >= 1 << 20:
                    break
            n = sock.sendmsg(bufs)
            c.sent += n
            whole = n == total
            while n:
                item = q[0]
                rest = item.total - item.off
                if n >= rest:
                    n -= rest
                    if item.rest is not None:  # on to its next chunk, which n may cover
                        _next_chunk(q, item)
                        continue
                    q.popleft()
                    op = item.op
                    if op is not None and not op.done:
                        op.state -= 1
                        if op.state == 0:
                            link.ep.complete(op)
                else:
                    item.off += n
                    n = 0
            if not whole:
                break
    except BlockingIOError:
        pass
    except OSError as exc:
        link.lose(c.peer, exc)
        return
    want = (c.events & _IN) | (_OUT if q else 0)
    if want != c.events:
        link.set_events(c, want)


def _next_chunk(q: deque[Out], item: Out) -> None:
    """The chunk of ``item`` (at the head of ``q``) is written: set up the next one.

    Urgent frames queued while the chunk was going out go first.
    """
    rest = item.rest
    assert rest is not None
    n = min(rest.nbytes, CHUNK)
    item.sent += item.data.nbytes
    if n < rest.nbytes:
        item.data, item.rest = rest[:n], rest[n:]
    else:
        item.data, item.rest = rest, None
    _, check, rid, _ = HDR.unpack(item.hdr)
    item.hdr = HDR.pack(RDATA, check, rid, n)
    item.off = 0
    item.total = HDR_SIZE + n
    if len(q) > 1 and q[1].urgent:
        q.popleft()
        i = 0
        while i < len(q) and q[i].urgent:
            i += 1
        q.insert(i, item)


def _more_chunks(item: Out, bufs: list[bytes | memoryview], total: int) -> int:
    """Append the chunks after ``item``'s current one to a batch of ``total`` bytes.

    Up to :data:`_BATCH` bytes and :data:`_GATHER` buffers in all, with the
    headers :func:`_next_chunk` will give them; returns the bytes added.
    """
    rest = item.rest
    assert rest is not None
    _, check, rid, _ = HDR.unpack(item.hdr)
    size = rest.nbytes
    at = added = 0
    while at < size and total + added < _BATCH and len(bufs) < _GATHER:
        n = min(size - at, CHUNK)
        bufs.append(HDR.pack(RDATA, check, rid, n))
        bufs.append(rest[at : at + n])
        at += n
        added += HDR_SIZE + n
    return added
