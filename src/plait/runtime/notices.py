"""The messages on a communicator's probe tag: stall probes, verdicts and notices.

Their wire format, how a failing call tells them to every peer (and sees that they leave,
Note [notices that wait]), and how a call reads those that have arrived, as the errors they
explain. What each kind means, and when a call sends or reads one: Note [stall probes] in
:mod:`plait.runtime.stall`.
"""

from __future__ import annotations

import contextlib
import struct
import threading
import time
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from plait.errors import MismatchError, PeerLostError
from plait.runtime.crossing import NAME_BYTES, wire_name
from plait.transport.base import PEER_CLOSED, Handle, Transport, background_thread, peer_closed

if TYPE_CHECKING:
    from plait.runtime.executor import Call

__all__ = [
    "ABANDONED",
    "CLOSED",
    "LOST",
    "NAMED",
    "OWN",
    "PROBE_BYTES",
    "RELAYED",
    "STALLED",
    "VERDICT",
    "WIRE",
    "abandon",
    "abandoned_error",
    "keep_later",
    "kept",
    "likelier",
    "lost_error",
    "notice_soon",
    "pack",
    "tell_all",
    "text",
    "verdict_error",
    "verdict_here",
]

# RELAYED: a verdict passed on; CLOSED: a LOST notice whose rank closed its communicator
# rather than died (Note [peers that close] in plait.transport.base); ABANDONED: a rank
# gave up on a call after an error of its own (its name: the call's, then the error's type)
STALLED, VERDICT, LOST, RELAYED, CLOSED, ABANDONED = 0, 1, 2, 3, 4, 5
#: Set on the PeerLostError of an ``ABANDONED`` notice: the cause of whatever follows.
OWN = "_plait_own"
#: Most of the peers a probe says its call waits on.
NAMED = 8
#: seq (the call's number), digest, kind, the call's name (UTF-8, zero-padded), how many
#: peers the call waits on, and the first of them (-1 after the last).
WIRE = struct.Struct(f"<QQQ{NAME_BYTES}sI{NAMED}i")
#: Bytes of one probe.
PROBE_BYTES = WIRE.size


def verdict_here(
    transport: Transport, call: Call, rank: int, size: int
) -> MismatchError | PeerLostError | None:
    """A peer's verdict already received (not waited for), as this rank's MismatchError;
    else a peer's ``LOST`` or ``ABANDONED`` notice, as its PeerLostError; else None."""
    lost = kept(transport, call, rank)
    for q in range(size):
        if q == rank:
            continue
        while True:
            buf = np.zeros(PROBE_BYTES, np.uint8)
            h = transport.irecv(q, call.probe_tag, buf.data, 0)
            if not h.done:  # nothing waiting from q
                transport.cancel(h)
                break
            if h.error is not None:
                break
            found = _notice(call, rank, q, buf, transport)
            if isinstance(found, MismatchError):
                return found
            lost = likelier(lost, found)
    return lost


def _notice(
    call: Call, rank: int, q: int, buf: np.ndarray, transport: Transport | None = None
) -> MismatchError | PeerLostError | None:
    """Peer ``q``'s verdict or ``LOST`` notice in ``buf``, as this rank's error (None for a
    stall probe; an ``ABANDONED`` notice of a later call is kept for that call, given the
    ``transport``)."""
    seq, _, kind, name, _, *theirs = WIRE.unpack(buf.tobytes())
    if kind in (VERDICT, RELAYED):
        return verdict_error(call, rank, q, text(name), kind == RELAYED)
    if kind in (LOST, CLOSED):
        return lost_error(call, rank, q, text(name), theirs[0], kind)
    if kind == ABANDONED and seq <= call.seq:
        return abandoned_error(call, rank, q, seq, name)
    if kind == ABANDONED and transport is not None:
        keep_later(transport, call.probe_tag, q, seq, name)
    return None


#: ``ABANDONED`` notices read during a call earlier than theirs, by transport: (probe tag,
#: peer) -> (the call's number, its name), for that call or a later one to raise (Note [stall
#: probes]): read once, a notice is gone from the transport.
_later: weakref.WeakKeyDictionary[Any, dict[tuple[int, int], tuple[int, bytes]]] = (
    weakref.WeakKeyDictionary()
)
_later_lock = threading.Lock()


def keep_later(transport: Transport, tag: int, q: int, seq: int, raw: bytes) -> None:
    with _later_lock, contextlib.suppress(TypeError):  # (a transport no weak reference takes)
        _later.setdefault(transport, {}).setdefault((tag, q), (seq, raw))


def kept(transport: Transport, call: Call, rank: int) -> PeerLostError | None:
    """A kept ``ABANDONED`` notice of ``call`` or an earlier call, as this rank's error."""
    if not _later:
        return None
    with _later_lock:
        try:
            kept = list(_later.get(transport, {}).items())
        except TypeError:
            return None
    for (tag, q), (seq, raw) in kept:
        if tag == call.probe_tag and seq <= call.seq:
            return abandoned_error(call, rank, q, seq, raw)
    return None


def likelier(known: PeerLostError | None, told: PeerLostError | None) -> PeerLostError | None:
    """Of two notices, the first, unless only the second names a rank that died (the other
    one that closed: Note [peers that close] in plait.transport.base)."""
    if known is None or (peer_closed(known) and told is not None and not peer_closed(told)):
        return told
    return known


def notice_soon(
    transport: Transport, call: Call, rank: int, size: int, seconds: float
) -> MismatchError | PeerLostError | None:
    """A peer's verdict or ``LOST`` notice, waited for up to ``seconds``: the receive from a
    lost peer fails at once, and a stall probe is not what is waited for, so each ends only
    its own peer's wait (a probe's peer is listened to again)."""
    deadline = time.monotonic() + seconds
    posted: dict[int, tuple[np.ndarray, Handle]] = {}

    def post(q: int) -> None:
        buf = np.zeros(PROBE_BYTES, np.uint8)
        posted[q] = (buf, transport.irecv(q, call.probe_tag, buf.data, 0))

    try:
        for q in range(size):
            if q != rank:
                post(q)
        while posted:
            for q, (buf, h) in list(posted.items()):
                if not h.done:
                    continue
                del posted[q]
                if h.error is None:
                    found = _notice(call, rank, q, buf)
                    if found is not None:
                        return found
                    post(q)  # a stall probe: its notice may follow
            left = deadline - time.monotonic()
            if left <= 0 or not posted:
                return None
            if not any(h.done for _, h in posted.values()):
                transport.wait_any([h for _, h in posted.values()], left)
        return None
    finally:
        for _, h in posted.values():
            if not h.done:
                transport.cancel(h)


def abandon(transport: Transport, call: Call, rank: int, size: int, error: BaseException) -> None:
    """Tell every peer that this rank gave up on ``call`` after ``error``, an error of its
    own (an ``ABANDONED`` notice: Note [errors of a rank's own] in :mod:`plait._failures`).
    Best effort, as every notice."""
    if call.probe_tag < 0 or size < 2:
        return
    with contextlib.suppress(Exception):
        name = wire_name(f"{call.describe}\n{type(error).__name__}")
        tell_all(transport, call, rank, size, ABANDONED, said=name)


def pack(call: Call, kind: int, waiting: Sequence[int], name: bytes | None = None) -> bytes:
    named = list(waiting[:NAMED]) + [-1] * (NAMED - min(len(waiting), NAMED))
    said = _name(call) if name is None else name
    return WIRE.pack(call.seq, call.check, kind, said, len(waiting), *named)


def tell_all(
    transport: Transport,
    call: Call,
    rank: int,
    size: int,
    kind: int = VERDICT,
    lost: int = -1,
    said: bytes | None = None,
) -> None:
    """Send every peer a verdict, an ``ABANDONED`` notice (``said``: what it says), or a
    ``LOST`` notice naming rank ``lost`` (best effort: the call is failing anyway), and see
    that they leave (Note [notices that wait])."""
    verdict = pack(call, kind, () if lost < 0 else (lost,), said)
    sent: list[Handle] = []
    for q in range(size):
        if q != rank and q != lost:
            try:
                sent.append(transport.isend(q, call.probe_tag, memoryview(verdict), 0))
            except Exception:
                continue
    waiting = [h for h in sent if not h.done]
    if waiting:
        name = f"plait-notices-rank{transport.rank}"
        courier = threading.Thread(target=_deliver, args=(transport, waiting), name=name)
        courier.daemon = True
        try:
            courier.start()
        except RuntimeError:  # the interpreter is shutting down: no peer waits for long
            return


# Note [notices that wait]
#     A verdict or a LOST notice is sent as its call fails, and the rank then stops
#     driving its transport: it raises, and goes on to agree, shrink or code of its own.
#     A send that cannot leave at once waits in the rank's own queue, and moves only
#     while some thread of the rank waits on the transport: on shared memory, a ring
#     whose slots all hold messages its reader has not taken in yet (four, by default:
#     the reader was busy outside plait or descheduled, while this rank sent it its
#     part of the last call and of this one). The notice then never left, and a peer
#     that waits only on this rank (rank 3 of a ring of four that lost rank 1, waiting
#     on rank 2) drained the ring once it stalled, found no notice, and waited for its
#     timeout, blaming a live peer. So a notice that has not left when its call fails
#     is driven by a thread of its own (:func:`_deliver`), which sleeps in the
#     transport until the reader takes in what blocks it (the reader's wait rings this
#     rank's doorbell) or the transport closes (the rank's close, abort or shrink
#     ends it). It costs nothing where every notice leaves at once, nearly always;
#     where one waits, the rank's own threads may still use the transport meanwhile
#     (one thread drives it, the others wait to be told of their completions).


def _deliver(transport: Transport, sent: list[Handle]) -> None:
    """Wait on the transport until every notice of ``sent`` has left, or cannot (its peer
    lost, the transport closed): Note [notices that wait]."""
    background_thread()  # it sleeps in the kernel at once, never polls
    try:
        while sent and transport.wait_any(sent, None):
            sent = [h for h in sent if not h.done]
    except Exception:  # the transport went away meanwhile: nothing more to tell
        return


def verdict_error(call: Call, rank: int, q: int, name: str, relayed: bool) -> MismatchError:
    if relayed:  # q passed on what another rank found (settle)
        return MismatchError(
            f"rank {rank}: {call.describe}: rank {q} heard from another rank that the ranks "
            f"called different collectives (in its {name}; the rank that found it says what "
            "differs)"
        )
    return MismatchError(
        f"rank {rank}: {call.describe}: rank {q} found that the ranks called different "
        f"collectives (in its {name}; its own message says what differs)"
    )


def lost_error(
    call: Call, rank: int, q: int, name: str, lost: int, kind: int = LOST
) -> PeerLostError:
    if kind == CLOSED:  # Note [peers that close] in plait.transport.base
        err = PeerLostError(
            f"rank {rank}: {call.describe}: rank {lost} closed its communicator during the "
            f"call (rank {q} found so in its {name}), and no call of this communicator can "
            "finish without it"
        )
        setattr(err, PEER_CLOSED, True)
    else:
        err = PeerLostError(
            f"rank {rank}: {call.describe}: rank {lost} was lost (rank {q} found so in its "
            f"{name}), and no call of this communicator can finish without it"
        )
    err.lost_rank = lost
    return err


def abandoned_error(call: Call, rank: int, q: int, seq: int, raw: bytes) -> PeerLostError:
    theirs, _, error = text(raw).rpartition("\n")
    which = "the call" if seq == call.seq else f"an earlier call, {theirs},"
    err = PeerLostError(
        f"rank {rank}: {call.describe}: rank {q} gave up on {which} after an error of its own, "
        f"{error} (see its message), and no call of this communicator can finish without it"
    )
    err.lost_rank = q  # lost to this communicator: it makes no more calls of it
    setattr(err, OWN, True)
    return err


def _name(call: Call) -> bytes:
    return wire_name(call.describe)


def text(raw: bytes) -> str:
    return raw.rstrip(b"\0").decode("utf-8", "replace")
