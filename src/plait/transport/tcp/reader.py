"""The TCP receive path: staging buffers, frame parsing, payloads read into their receive.

A header that matches a posted receive sends the payload straight into the receive's
buffer (``recv_into`` on a slice of it); small frames are read in batches through a
64 KiB staging buffer per stream and copied out. Inside a chunked payload the reader
takes no more than the next header into the staging buffer, mostly in the same
``recvmsg_into`` call as the end of the chunk before it, so every chunk lands in the
receive's buffer directly too. An eager message that arrives before its receive is
posted is read into an unexpected message of exactly its length (at most
:data:`~plait.transport.tcp.wire.EAGER_MAX`), copied on match (the only extra copy).

Note [striped order]
    Over one stream, whatever a peer sent arrives in the order it was sent: a frame read
    says that every byte sent before it has arrived. The runtime counts on that. A stall
    probe of call n + 1 says its sender has finished call n, and so sent all it had to
    send in it (Note [stall probes] in :mod:`plait.runtime.stall`); a notice a peer sent
    before its goodbye, or before it exited, is read before the end of its connection
    (Note [peers that close] in :mod:`plait.transport.base`). With several streams a
    striped message travels on all of them while the frames after it use stream 0 only,
    and stream 0 could run ahead: its part of a message done, it went on to the next
    frames while the other parts were still on their way (behind a slow stream, or
    megabytes over a link of 0.5 MB/s). A probe of the next call read then, with the
    message it follows still arriving on stream 1, was taken after a grace of two
    seconds for a peer that had finished the call without sending what this rank waited
    for: MismatchError on both ranks, though they made the same calls. A sender that
    exited without closing after its last send had gone into the kernel ended stream 0
    first, and its end, read before the rest of that message, lost the peer and failed
    a receive whose bytes were still coming.

    So stream 0 reads no further frame while a striped message from that peer still owes
    a part on another stream (``Peer.owed``): having read its own part (part 0 between
    two chunks goes on, as the message's chunks must), it stops watching its socket for
    input, and the frames behind it wait in the staging buffer and the kernel. When the
    last part owed has arrived, stream 0 reads again (:func:`_part_done`). A frame read
    on stream 0, the end of its connection included, thus comes after everything its
    sender sent before it, as over one stream. The parts owed need nothing from stream 0
    to arrive: the sender queued them on their streams with the message, and they are
    read while owed. What waits meanwhile is stream 0's frames, for as long as the
    slowest stream lags behind it, which a receive of the striped message waits anyway.
"""

from __future__ import annotations

import select
from typing import TYPE_CHECKING

from plait.transport.link import Message, Op
from plait.transport.tcp import rendezvous
from plait.transport.tcp.pair import Conn, Inbound
from plait.transport.tcp.wire import (
    BYE,
    CTS,
    DATA,
    EAGER_MAX,
    HDR,
    HDR_SIZE,
    KIND_NAMES,
    PART,
    RTS,
    RTS_SIZE,
    STRIPE_MIN,
    WITHDRAW,
    part,
)

if TYPE_CHECKING:
    from plait.transport.tcp.link import TcpLink

__all__ = ["read", "start_payload"]

_DIRECT_MIN = 16 * 1024  # payload left at least this large: recv straight into the target
_SCRATCH = 256 * 1024  # discard buffer for payloads nobody wants any more
_scratch = memoryview(bytearray(_SCRATCH))  # written, never read: one for all links
_IN, _OUT = select.EPOLLIN, select.EPOLLOUT


def read(link: TcpLink, c: Conn) -> None:
    """Read from ``c`` until its socket is drained."""
    sock = c.sock
    assert sock is not None
    stage = c.stage
    greedy = c.greedy
    ep = link.ep
    drained = False
    try:
        while True:
            rec = c.rec
            if rec is not None:
                need = c.end - c.pos
                if need and c.hi > c.lo:
                    n = min(need, c.hi - c.lo)
                    view = rec.view
                    if view is not None:
                        view[c.pos : c.pos + n] = stage[c.lo : c.lo + n]
                    c.pos += n
                    c.lo += n
                    need -= n
                    if c.lo == c.hi:
                        c.lo = c.hi = 0
                if not need:
                    if c.end < c.stop:  # a chunk: the next one follows (or urgent frames)
                        c.rec = None
                        c.cont = rec
                        continue
                    _part_done(link, c, rec)
                    if c.sock is None:
                        return
                    continue
                if drained:
                    return
                if need >= _DIRECT_MIN or not greedy:
                    view = rec.view
                    if view is not None:
                        target = view[c.pos : c.end]
                    else:
                        target = _scratch[: min(need, _SCRATCH)]
                    if c.stop > c.end and len(target) == need:
                        # The header of the next chunk comes with the rest of this one:
                        # one call reads both (the staging buffer is empty here).
                        n = sock.recvmsg_into((target, stage[:HDR_SIZE]))[0]
                        c.received += n
                        if n > need:
                            c.hi = n - need
                            n = need
                        elif n < need:
                            drained = True
                    else:
                        n = sock.recv_into(target)
                        c.received += n
                        if n < len(target):
                            drained = True
                    if not n:
                        link.eof(c)
                        return
                    c.pos += n
                    continue
            else:
                if greedy and c.peer.owed and c.cont is None:  # Note [striped order]
                    link.set_events(c, c.events & _OUT)
                    return
                have = c.hi - c.lo
                if have >= HDR_SIZE:
                    kind, check, tag, nbytes = HDR.unpack_from(stage, c.lo)
                    if c.cont is not None and not CTS <= kind <= WITHDRAW:
                        name = KIND_NAMES.get(kind, str(kind))
                        link.protocol_error(
                            c.peer,
                            f"{name} frame in the middle of the payload of message #{c.cid}",
                        )
                        return
                    # An RTS whose id has not all arrived waits for the refill below.
                    if kind != RTS or have >= RTS_SIZE or not greedy:
                        c.lo += HDR_SIZE
                        if c.lo == c.hi:
                            c.lo = c.hi = 0
                        if kind == DATA and c.index == 0:
                            if nbytes > EAGER_MAX:
                                link.protocol_error(
                                    c.peer,
                                    f"an eager message of {nbytes} B (tag {tag}); "
                                    f"eager messages are at most {EAGER_MAX} B",
                                )
                                return
                            op = ep.take_posted(c.peer.rank, tag)
                            if (
                                op is not None
                                and nbytes <= c.hi - c.lo
                                and op.check == check
                                and op.nbytes == nbytes
                            ):
                                # The fast path: a whole small message for a posted receive.
                                lo = c.lo
                                op.buf[:] = stage[lo : lo + nbytes]
                                lo += nbytes
                                if lo == c.hi:
                                    c.lo = c.hi = 0
                                else:
                                    c.lo = lo
                                ep.bytes_received += nbytes
                                ep.complete(op)
                                continue
                            _on_data(link, c, check, tag, nbytes, op)
                        elif kind == PART and c.index > 0 and c.due:
                            if not _on_part(link, c, tag, nbytes):
                                return
                        elif RTS <= kind <= WITHDRAW and c.index == 0:
                            if not rendezvous.on_control(link, c, kind, check, tag, nbytes):
                                return
                        elif kind == BYE and c.index == 0:
                            link.on_bye(c.peer)
                            return
                        else:
                            name = KIND_NAMES.get(kind, str(kind))
                            link.protocol_error(c.peer, f"frame kind {name} on stream {c.index}")
                            return
                        continue
                if not greedy and not c.due:  # no part owed: leave the socket alone
                    link.set_events(c, c.events & _OUT)
                    return
                if drained:
                    return
                if c.lo:
                    stage[:have] = stage[c.lo : c.hi]
                    c.lo, c.hi = 0, have
            # Refill the staging buffer (just the header's worth on striping streams).
            # Inside a chunked payload read no further than the next header, so that
            # the chunk behind it lands in the receive's buffer directly.
            end = len(stage)
            if c.cont is not None:
                end = HDR_SIZE
            elif rec is not None and c.stop > c.end:
                end = min(end, c.hi + c.end - c.pos + HDR_SIZE)
            room = end - c.hi
            n = sock.recv_into(stage[c.hi : end])
            c.received += n
            if not n:
                link.eof(c)
                return
            c.hi += n
            if n < room:
                drained = True
    except BlockingIOError:
        return
    except OSError as exc:
        link.lose(c.peer, exc)


def _on_data(link: TcpLink, c: Conn, check: int, tag: int, nbytes: int, op: Op | None) -> None:
    """An eager header: read its payload into receive ``op``, or an unexpected message."""
    p = c.peer
    rec = Inbound(p, check, nbytes)
    if op is not None:
        err = link.ep.mismatch(op, check, nbytes)
        if err is not None:
            link.ep.fail(op, err)  # rec.view stays None: the payload is discarded
        else:
            rec.op = op
            rec.view = op.buf
            op.state = rec
    else:
        rec.msg = msg = Message(link, check, nbytes)  # nbytes <= EAGER_MAX: checked by read
        assert msg.data is not None
        msg.source = rec
        rec.view = msg.data.data
        link.ep.add_unexpected(p.rank, tag, msg)
    start_payload(link, c, rec)


def start_payload(link: TcpLink, c: Conn, rec: Inbound, chunk: int = 0) -> None:
    """Stream 0 read the header of ``rec``'s payload: read it (part 0 if striped).

    ``chunk``: the length of the frame, when the part comes in chunks.
    """
    nbytes = rec.nbytes
    streams = link.streams
    if streams > 1 and nbytes >= STRIPE_MIN:
        p = c.peer
        rec.left = streams
        rec.seq = p.seq_in
        p.seq_in += 1
        p.owed += streams - 1
        for k in range(1, streams):
            ck = p.conns[k]
            ck.due.append(rec)
            if not ck.events & _IN:
                link.set_events(ck, ck.events | _IN)
        c.pos, c.stop = part(nbytes, streams, 0)
    else:
        c.pos, c.stop = 0, nbytes
    c.end = c.pos + chunk if chunk else c.stop
    c.rec = rec


def _on_part(link: TcpLink, c: Conn, seq: int, nbytes: int) -> bool:
    rec = c.due.popleft()
    if rec.seq != seq or rec.nbytes != nbytes:
        link.protocol_error(
            c.peer,
            f"stream {c.index} got part of striped message #{seq} "
            f"({nbytes} B) but expected #{rec.seq} ({rec.nbytes} B)",
        )
        return False
    c.rec = rec
    c.pos, c.end = part(nbytes, link.streams, c.index)
    c.stop = c.end
    return True


def _part_done(link: TcpLink, c: Conn, rec: Inbound) -> None:
    c.rec = None
    rec.left -= 1
    if rec.left == 0:
        op = rec.op
        if op is not None:
            rec.op = None
            op.state = None
            if not op.done:
                link.ep.bytes_received += rec.nbytes
                link.ep.complete(op)
        elif rec.view is not None and rec.msg is not None:
            rec.msg.received = rec.nbytes
            rec.msg.complete = True
            rec.msg = None  # complete: it no longer depends on the connection
    if c.index > 0:
        p = c.peer
        p.owed -= 1
        if not c.due:
            if p.gone is not None:
                link.drop(c)  # the peer said goodbye and this stream owes nothing more
            elif c.hi == c.lo:
                link.set_events(c, c.events & _OUT)
        c0 = p.conns[0]
        if not p.owed and c0.sock is not None and not c0.events & _IN:
            # Stream 0 waited for this part (Note [striped order]): it reads on, frames it
            # has staged already first (no socket event would announce those).
            link.set_events(c0, c0.events | _IN)
            read(link, c0)
