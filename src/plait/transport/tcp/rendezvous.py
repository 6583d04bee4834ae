"""Large TCP messages: announce (RTS), clear (CTS) or refuse, withdraw, send in chunks.

A message above :data:`~plait.transport.tcp.wire.EAGER_MAX` bytes is announced with an
``RTS`` carrying a per-pair id; the receiver matches it like an eager header and,
once a receive takes it, answers ``CTS`` (the sender then sends the payload as
``RDATA`` chunks straight into the receive's buffer) or ``REFUSE`` (the receive
disagrees: it fails with MismatchError, the send completes without its payload).
Every ``RTS`` gets exactly one answer. See ``docs/transport.md`` (Note [TCP rendezvous]).

Note [withdrawn messages]
    A sender withdraws a message it had announced when it cancels the send, nearly always
    because its call failed: it lost a rank, timed out, met a mismatch or an error of its
    own, and gave up on the call. A withdrawn message never arrives, as MPI's cancelled
    send never matches a receive: the receiver forgets it, and a receive that had taken
    it (cleared it, the payload not begun, so nothing of it is in the receive's buffer)
    is put back among the posted receives where it was, as if the announcement had never
    come (the endpoint's ``repost``, :mod:`plait.transport.patterns`); it takes the next
    message that matches it. That a receive took the message at all may say nothing of
    the order of events: TCP reads frames only while some call waits, so a receive posted
    long after the sender withdrew reads the announcement and the withdrawal together,
    and used to fail with MismatchError for a message its sender had given up on before
    the receive was made. A collective call whose receive is put back learns that the
    sender gave up from what that rank told its peers as it gave up (Note [stall probes]
    in :mod:`plait.runtime.stall`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from plait.transport.link import Message, Op
from plait.transport.tcp import writer
from plait.transport.tcp.pair import Conn, Inbound, Out, Peer, Rts
from plait.transport.tcp.wire import (
    CHUNK,
    CTS,
    EAGER_MAX,
    HDR,
    ID,
    KIND_NAMES,
    PART,
    RDATA,
    REFUSE,
    RTS,
    STRIPE_MIN,
    WITHDRAW,
    part,
)

if TYPE_CHECKING:
    from plait.transport.tcp.link import TcpLink

__all__ = ["clear", "on_control", "send_payload", "send_rts", "withdraw"]

_EMPTY = memoryview(b"")


def send_rts(link: TcpLink, p: Peer, op: Op) -> None:
    """Announce a large message to ``p``; its payload waits for the receiver's CTS."""
    rid = p.rid_out
    p.rid_out += 1
    op.state = 1
    hdr = HDR.pack(RTS, op.check, op.tag, op.nbytes)
    item = Out(None, hdr, memoryview(ID.pack(rid)), 0)
    p.rts_out[rid] = (op, item)
    writer.push(link, p.conns[0], item)


def send_payload(link: TcpLink, p: Peer, op: Op, rid: int) -> None:
    """Queue the payload of cleared message ``rid`` (written by the next kick).

    Stream 0 carries it (part 0 of it, if striped) as ``RDATA`` chunks of at
    most :data:`CHUNK` bytes, one queue entry for all of them.
    """
    mv = op.buf
    nbytes = mv.nbytes
    streams = link.streams
    striped = streams > 1 and nbytes >= STRIPE_MIN
    op.state = streams if striped else 1
    lo, hi = part(nbytes, streams, 0) if striped else (0, nbytes)
    first = min(hi - lo, CHUNK)
    item = Out(op, HDR.pack(RDATA, op.check, rid, first), mv[lo : lo + first], 0)
    if lo + first < hi:
        item.rest = mv[lo + first : hi]
    writer.push(link, p.conns[0], item)
    if not striped:
        return
    seq = p.seq_out
    p.seq_out += 1
    hdr = HDR.pack(PART, 0, seq, nbytes)
    for k in range(1, streams):
        lo, hi = part(nbytes, streams, k)
        writer.push(link, p.conns[k], Out(op, hdr, mv[lo:hi], 0))


def withdraw(link: TcpLink, p: Peer, op: Op) -> bool:
    """Cancel rendezvous send ``op`` if its payload has not started; False otherwise.

    An RTS not written yet is simply dropped (the peer never hears of the
    message); otherwise a WITHDRAW follows, and a withdrawn RTS stays as a
    tombstone until its answer comes.
    """
    c = p.conns[0]
    for rid, (waiting, rts) in p.rts_out.items():
        if waiting is op:
            if rts.off == 0 and rts in c.sendq:
                c.sendq.remove(rts)
                del p.rts_out[rid]
            else:
                p.rts_out[rid] = (None, rts)
                writer.push(link, c, Out(None, HDR.pack(WITHDRAW, 0, rid, 0), _EMPTY, 0), True)
            return True
    if op.state == 1 and op.nbytes > EAGER_MAX:  # cleared: is the payload untouched?
        for item in c.sendq:
            if item.op is op and not item.started() and item.hdr[0] == RDATA:
                c.sendq.remove(item)
                rid = HDR.unpack(item.hdr)[2]
                writer.push(link, c, Out(None, HDR.pack(WITHDRAW, 0, rid, 0), _EMPTY, 0), True)
                return True
    return False


def on_control(link: TcpLink, c: Conn, kind: int, check: int, tag: int, nbytes: int) -> bool:
    """A rendezvous frame on stream 0; False after a protocol error (the peer is lost)."""
    p = c.peer
    if kind == RDATA:
        return _on_rdata(link, c, check, tag, nbytes)
    if kind == RTS:
        (rid,) = ID.unpack_from(c.stage, c.lo)
        c.lo += ID.size
        if c.lo == c.hi:
            c.lo = c.hi = 0
        if rid <= p.rid_in or nbytes <= EAGER_MAX:
            link.protocol_error(
                p,
                f"RTS #{rid} for {nbytes} B (expected an id above #{p.rid_in} "
                f"and more than {EAGER_MAX} B)",
            )
            return False
        p.rid_in = rid
        _on_rts(link, p, check, tag, nbytes, rid)
        return True
    name = KIND_NAMES[kind]
    if check or nbytes:
        link.protocol_error(p, f"{name} frame with check {check} and length {nbytes}")
        return False
    if kind == WITHDRAW:
        if tag > p.rid_in or (c.cont is not None and tag == c.cid):
            what = "never announced" if tag > p.rid_in else "whose payload has begun"
            link.protocol_error(p, f"WITHDRAW of message #{tag}, {what}")
            return False
        _on_withdraw(link, p, tag)
        return True
    entry = p.rts_out.pop(tag, None)  # CTS or REFUSE: the answer to one of our RTS
    if entry is None:
        link.protocol_error(p, f"{name} for message #{tag}, which awaits no answer")
        return False
    op = entry[0]
    if op is not None:  # None: we withdrew it; the answer just ends the tombstone
        if kind == CTS:
            send_payload(link, p, op, tag)
        else:  # refused: the receiver's receive failed (MismatchError); the send is done
            link.ep.complete(op)
    return True


def _on_rdata(link: TcpLink, c: Conn, check: int, rid: int, nbytes: int) -> bool:
    p = c.peer
    rec = c.cont
    if rec is not None:  # the next chunk of the payload being read
        left = c.stop - c.pos
        if rid != c.cid or check != rec.check or not 0 < nbytes <= left:
            if rid != c.cid:
                what = f"a chunk of message #{rid} inside the payload of #{c.cid}"
            elif check != rec.check:
                what = f"a chunk of message #{rid} whose check differs from its RTS"
            else:
                what = f"a {nbytes}-byte chunk of message #{rid}, which has {left} B left"
            link.protocol_error(p, what)
            return False
        c.cont = None
        c.rec = rec
        c.end = c.pos + nbytes
        return True
    rec = p.cleared.get(rid)
    if rec is None or rec.check != check:
        what = (
            "was never cleared (or is complete already)" if rec is None else "differs from its RTS"
        )
        link.protocol_error(p, f"payload of message #{rid} ({nbytes} B) {what}")
        return False
    span = rec.nbytes  # what stream 0 carries: all of it, or part 0 if striped
    if link.streams > 1 and span >= STRIPE_MIN:
        span = part(span, link.streams, 0)[1]
    if not 0 < nbytes <= span:
        link.protocol_error(
            p, f"a {nbytes}-byte chunk of message #{rid}, whose payload here is {span} B"
        )
        return False
    del p.cleared[rid]
    link.start_payload(c, rec, nbytes)
    c.cid = rid
    return True


def _on_rts(link: TcpLink, p: Peer, check: int, tag: int, nbytes: int, rid: int) -> None:
    """A large message announced: clear it for a posted receive, or keep it as unexpected."""
    op = link.ep.take_posted(p.rank, tag)
    if op is not None:
        clear(link, p, op, check, nbytes, rid)
        return
    rts = Rts(p, check, tag, nbytes, rid)
    rts.msg = msg = Message(link, check, nbytes, buffer=False)
    msg.source = rts
    p.rts_in[rid] = rts
    link.ep.add_unexpected(p.rank, tag, msg)


def clear(link: TcpLink, p: Peer, op: Op, check: int, nbytes: int, rid: int) -> None:
    """Answer RTS ``rid`` for receive ``op``: CTS if they agree, else fail ``op`` and REFUSE."""
    err = link.ep.mismatch(op, check, nbytes)
    if err is not None:
        link.ep.fail(op, err)
        answer(link, p, REFUSE, rid)
        return
    rec = Inbound(p, check, nbytes)
    rec.op = op
    rec.view = op.buf
    op.state = rec
    p.cleared[rid] = rec
    answer(link, p, CTS, rid)


def answer(link: TcpLink, p: Peer, kind: int, rid: int) -> None:
    """Queue a ``CTS`` or ``REFUSE`` for RTS ``rid`` ahead of every frame not started."""
    writer.push(link, p.conns[0], Out(None, HDR.pack(kind, 0, rid, 0), _EMPTY, 0), urgent=True)


def _on_withdraw(link: TcpLink, p: Peer, rid: int) -> None:
    """The sender cancelled message ``rid`` before its payload: forget it (Note [withdrawn
    messages]), putting a receive that had taken it back among the posted ones."""
    rts = p.rts_in.pop(rid, None)
    if rts is not None:  # nobody took it yet: it vanishes
        if rts.msg is not None:
            link.ep.discard(rts.msg)
        answer(link, p, REFUSE, rid)  # every RTS gets one answer
        return
    rec = p.cleared.pop(rid, None)  # cleared (our CTS was the answer), or refused before
    if rec is not None and rec.op is not None:  # None: its receive was cancelled since
        op = rec.op
        rec.op = None
        op.state = None
        if not op.done:
            link.ep.repost(op)
