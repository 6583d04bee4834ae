"""Stalled calls: ranks that wait on each other in different calls find out within seconds.

Note [stall probes]
    Every message carries its call's digest, so two ranks in different calls
    fail with MismatchError as soon as one receives a message of the other.
    Some mismatches exchange no message at all: an allreduce on one rank
    against a broadcast on the others (each side waits to receive from the
    other), a reduce with different roots, a leaf that sends its part and
    returns while its peers wait for something it never sends. Without more,
    those ranks would wait for their timeout (300 s by default).

    So a call that has waited :data:`PROBE_SECONDS` without finishing
    *probes*: it sends every other rank of the communicator one small message
    on the communicator's probe tag (outside the tags of calls and of the
    user's point-to-point messages) saying "call #n, this digest, stalled",
    and from then on until it ends keeps a receive posted for each peer's
    probe on that tag. A probe names its call, so one tag serves every call
    and a probe that arrives late is recognised as old. A stalled rank that
    reads a peer's probe decides:

    - same call number, different digest: the two ranks are in different
      calls: MismatchError;
    - a later call number, from a rank this call still waits on: that rank
      has finished this call without sending what this rank waits for, or
      its message is still on the way. If the call still waits on that rank
      :data:`GRACE_SECONDS` later, MismatchError (a message that takes
      longer than that to arrive after its sender has finished with it, and
      has then itself waited a probe period, would be mistaken: megabytes
      in flight over a link of well under 1 MB/s);
    - a ``VERDICT`` (a peer found this call, or an earlier one, mismatched):
      MismatchError, naming that peer (or a ``RELAYED`` one: a peer that lost the
      rank which found it passes it on, :func:`settle`);
    - anything else (an older call, the same call and digest) says nothing.

    - a ``LOST`` notice (a peer's call failed because a rank was lost, which
      the notice names): PeerLostError naming the lost rank, as its
      ``lost_rank``. Every rank takes part in every collective, so a stalled
      call of a communicator that lost a rank cannot finish; a rank that
      waits on a live peer (which itself waited on the lost one) would
      otherwise wait for its timeout and blame that live peer. A notice
      leaves even where the rank that tells stops driving its transport
      (Note [notices that wait]). A call that failed because a peer closed
      its transport tells the rank that peer said it lost, and raises that;
      where the peer said nothing, a ``CLOSED`` notice names it as a rank
      that closed, not one that died (Note [peers that close] in
      :mod:`plait.transport.base`).

    A rank that raises MismatchError this way first sends every other rank a
    verdict, so that the ranks of the same mistake that found no evidence of
    their own (a leaf that returned, then waits in its next call) fail too as
    soon as they stall. Every rank stuck in such a mismatch thus raises
    MismatchError within about one to two probe periods.

    A one-sided call (Note [one-sided] in :mod:`plait.runtime.one_sided`)
    waits on a peer's counter, not on messages; once stalled it probes the
    same way, waiting for the counter and the peers' probes at once
    (:func:`wait_post`), and a one-sided call that fails tells its verdict
    too (:func:`settle`). So a rank in a one-sided call and ranks in a
    message call (one rank's ``algorithm="arena"`` against the others'
    ``"ring"``), or two one-sided calls that each wait for a post the other
    never makes (a gather against a scatter), find each other out like any
    other mismatch.

    Costs: nothing while calls finish within :data:`PROBE_SECONDS`; a stalled
    call sends ``size - 1`` messages of :data:`PROBE_BYTES` once (again only
    where whom it waits on changes between its waits) and keeps
    ``size - 1`` receives posted. A probe that reaches a rank which never
    stalls stays among its unexpected messages until that rank next stalls
    (it reads every probe waiting then) or closes: one small message per
    stalled call of a peer.

Note [foreign messages]
    Some mismatches stall only one rank: a broadcast whose root rank 3 takes
    for a leaf that never sends to it, while ranks 0 to 2 agree on another
    root and go on. Rank 3 waits; the others never stall, so they never read
    its probes, and their messages to it for this call's number sit among its
    unexpected messages (taken in, on shared memory or eagerly over TCP),
    where no receive compares their digests. So a stalled message call also
    looks there: a message under one of its own tags whose digest is not its
    call's is a peer in another call, MismatchError, told to every rank as a
    verdict. (Across hosts, the broadcast and scatter of different roots went
    undetected, and rank 3 kept every later message of rank 2, without bound.)
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from plait.errors import CommTimeout, MismatchError, PeerLostError
from plait.runtime.crossing import NAME_BYTES, Crossing, wire_name
from plait.schedule.ir import Schedule
from plait.transport.base import PEER_CLOSED, Handle, Transport, background_thread, peer_closed

if TYPE_CHECKING:
    from plait.runtime.executor import Call

__all__ = ["GRACE_SECONDS", "PROBE_BYTES", "PROBE_SECONDS", "Prober", "settle", "wait_post"]

#: Seconds a call waits before it probes its peers (Note [stall probes]).
PROBE_SECONDS = 1.0
#: Seconds a peer found in a later call may still deliver what this call waits for.
GRACE_SECONDS = 2.0
# _RELAYED: a verdict passed on; _CLOSED: a LOST notice whose rank closed its communicator
# rather than died (Note [peers that close] in plait.transport.base)
_STALLED, _VERDICT, _LOST, _RELAYED, _CLOSED = 0, 1, 2, 3, 4
#: The attribute that marks an error :func:`settle` has settled.
_SETTLED = "_plait_settled"
#: Set on the PeerLostError of a call that met a peer's mark that it gave up on the call: the
#: peer's own error (a rank it lost, told by a LOST notice) is the one to raise.
GAVE_UP = "_plait_gave_up"
#: Seconds a call that met such a mark waits for the peer's notice (sent before the mark).
NOTICE_SECONDS = 0.5
#: Most of the peers a probe says its call waits on.
_NAMED = 8
#: seq (the call's number), digest, kind, the call's name (UTF-8, zero-padded), how many
#: peers the call waits on, and the first of them (-1 after the last).
_WIRE = struct.Struct(f"<QQQ{NAME_BYTES}sI{_NAMED}i")
#: Bytes of one probe.
PROBE_BYTES = _WIRE.size


class Prober:
    """The probes of one stalled call (Note [stall probes]).

    Args:
        transport: the call's transport.
        call: the call (its ``probe_tag``, number and digest).
        rank, size: this rank and the communicator's size.
    """

    __slots__ = (
        "_bufs",
        "_call",
        "_cross",
        "_heard",
        "_posted",
        "_rank",
        "_size",
        "_suspects",
        "_t",
        "_tags",
    )

    def __init__(
        self, transport: Transport, call: Call, rank: int, size: int, tags: int = 0
    ) -> None:
        self._t = transport
        self._tags = tags  # a message call's: it sends on tags tag_base .. tag_base + tags - 1
        self._call = call
        self._rank = rank
        self._size = size
        self._bufs: dict[int, np.ndarray] = {}
        self._posted: dict[Handle, int] = {}  # receive -> peer
        # peer found in a later call -> (when the grace ends, the error it would be)
        self._suspects: dict[int, tuple[float, MismatchError]] = {}
        # peer stalled in this very call -> the peers it said it waits on
        self._heard: dict[int, tuple[int, ...]] = {}
        # the call's notices to peers that may wait in other communicators' calls
        self._cross = Crossing(transport, call.probe_tag, call.seq, call.describe)

    def start(self, waiting: Sequence[int]) -> None:
        """Tell every peer this call is stalled waiting on ``waiting``, and listen for theirs.

        A one-sided call probes anew for each wait that stalls; its recorder slot keeps
        what it last told, so it tells the peers again only where whom it waits on
        changed (else a peer that never stalls would gather a probe per wait)."""
        me = _pack(self._call, _STALLED, waiting)
        slot, said = self._call.slot, (self._call.seq, tuple(waiting))
        told = slot is not None and slot.probed == said
        if slot is not None:
            slot.probed = said
        for q in range(self._size):
            if q == self._rank:
                continue
            if not told:
                self._send(q, me)
            self._bufs[q] = np.zeros(PROBE_BYTES, np.uint8)
            self._post(q)
        self._cross.start(waiting)  # Note [crossed calls] in plait.runtime.crossing

    def check(self, waiting: Sequence[int]) -> None:
        """Read the peers' probes that arrived; raise MismatchError on evidence.

        ``waiting``: the peers this call still waits on.
        """
        now = time.monotonic()
        lost: PeerLostError | None = None
        for h in [h for h in self._posted if h.done]:
            q = self._posted.pop(h)
            if h.error is not None:  # the peer is lost or the transport closed: the call says so
                continue
            seq, digest, kind, name, n, *theirs = _WIRE.unpack(self._bufs[q].tobytes())
            self._post(q)  # the next probe from q (a verdict may follow its stall probe)
            if kind == _STALLED and seq == self._call.seq and digest == self._call.check:
                self._heard[q] = tuple(p for p in theirs[: min(n, _NAMED)] if p >= 0)
            if kind in (_LOST, _CLOSED):  # raised once the rest has been read: a mismatch first
                told = _lost_error(self._call, self._rank, q, _text(name), theirs[0], kind)
                lost = _likelier(lost, told)
                continue
            err = self._verdict(q, seq, digest, kind, _text(name), waiting)
            if err is not None:
                self._tell_all()
                raise err
            if seq > self._call.seq and q in waiting and q not in self._suspects:
                self._suspects[q] = (now + GRACE_SECONDS, self._ahead(q, _text(name)))
        if lost is not None:
            raise lost
        for q, (until, err) in list(self._suspects.items()):
            if q not in waiting:
                del self._suspects[q]  # what it owed arrived
            elif now >= until:
                self._tell_all()
                raise err
        foreign = self._foreign()
        if foreign is not None:
            self._tell_all()
            raise foreign
        crossed = self._cross.check(self._rank, waiting)
        if crossed is not None:
            self._tell_all()
            raise crossed

    def explain(self, waiting: Sequence[int]) -> str:
        """Who waits on whom, from the probes of peers stalled in this call (for a timeout).

        Follows the chain from the ranks this call waits on: a rank that waits
        too says on whom, and the ranks at the end, which sent no probe, are
        the likeliest cause. Empty when no probe came.
        """
        if not self._heard:
            return self._cross.explain(waiting)
        parts: list[str] = []
        silent: list[int] = []
        seen = set(waiting) | {self._rank}
        todo = list(waiting)
        while todo:
            q = todo.pop(0)
            if q not in self._heard:
                silent.append(q)
                continue
            theirs = self._heard[q]
            parts.append(f"rank {q} waits in this call too, for rank(s) {list(theirs)}")
            for p in theirs:
                if p not in seen:
                    seen.add(p)
                    todo.append(p)
        if silent:
            parts.append(
                f"rank(s) {sorted(silent)} did not say they wait: the likeliest cause (stopped, "
                "busy outside plait, in another call, or cut off from this rank's network)"
            )
        return "; " + "; ".join(parts) + self._cross.explain(waiting)

    @property
    def wake_at(self) -> float | None:
        """When :meth:`check` must look again though nothing arrived (None: no need)."""
        return min((until for until, _ in self._suspects.values()), default=None)

    def close(self) -> None:
        """Withdraw the receives still posted (the call is over)."""
        for h in self._posted:
            if not h.done:
                self._t.cancel(h)
        self._posted.clear()
        self._cross.close()

    @property
    def handles(self) -> list[Handle]:
        """The posted receives, to wait on along with the call's own."""
        return [*self._posted, *self._cross.handles]

    # -- internals ---------------------------------------------------------------------------
    def _verdict(
        self, q: int, seq: int, digest: int, kind: int, name: str, waiting: Sequence[int]
    ) -> MismatchError | None:
        call, r = self._call, self._rank
        if kind in (_VERDICT, _RELAYED):
            return _verdict_error(call, r, q, name, kind == _RELAYED)
        if seq == call.seq and digest != call.check:
            return MismatchError(
                f"rank {r}: {call.describe}: rank {q} is in a different call, {name}, and "
                "waits like this rank; the ranks disagree on the collective, count, dtype, op, "
                "root or algorithm"
            )
        return None

    def _foreign(self) -> MismatchError | None:
        """The error of a message call to which a peer sent a message of another call (Note
        [foreign messages]); None if none waits here."""
        call, found = self._call, getattr(self._t, "foreign", None)
        if not self._tags or found is None:
            return None
        q = found(call.tag_base, call.tag_base + self._tags, call.check)
        if q is None:
            return None
        return MismatchError(
            f"rank {self._rank}: {call.describe}: rank {q} is in a different call: a message "
            "it sent under this call's number carries another call's parameters (the ranks "
            "disagree on the collective, count, dtype, op, root or algorithm)"
        )

    def _ahead(self, q: int, name: str) -> MismatchError:
        call = self._call
        return MismatchError(
            f"rank {self._rank}: {call.describe}: rank {q} has finished this call without "
            f"sending what this rank waits for, and waits in a later one, {name}: the ranks "
            "called different collectives, or with different roots"
        )

    def _tell_all(self) -> None:
        _tell_all(self._t, self._call, self._rank, self._size)

    def _send(self, q: int, payload: bytes) -> None:
        self._t.isend(q, self._call.probe_tag, memoryview(payload), 0)

    def _post(self, q: int) -> None:
        h = self._t.irecv(q, self._call.probe_tag, self._bufs[q].data, 0)
        self._posted[h] = q


def settle(
    transport: Transport,
    call: Call,
    where: Schedule,
    err: BaseException,
    prober: Prober | None = None,
) -> BaseException:
    """The error a failing call raises: ``err``, or the mismatch or loss behind it.

    A MismatchError is told to every peer (a verdict: Note [stall probes]), and
    so is a PeerLostError that names its lost rank (a ``LOST`` notice), unless a
    verdict here explains the loss (the rank that found the mismatch raised and
    left): then that mismatch is told, so that a rank which hears only from this
    one learns the cause, not its consequence. A lost
    peer or a timeout may be the consequence of a mismatch that another rank
    found first, and a timeout that of a rank another found lost: a verdict or
    notice already here says so, and the call raises that instead. Costs
    nothing on success; a few small messages on failure. Settling an error this
    returned returns it as it is (nothing is told twice).
    """
    if call.probe_tag < 0 or where.size < 2 or getattr(err, _SETTLED, False):
        return err
    setattr(err, _SETTLED, True)
    try:
        if isinstance(err, MismatchError):
            _tell_all(transport, call, where.rank, where.size)
            return err
        found: MismatchError | PeerLostError | None = None
        if prober is not None:  # its receives may hold a verdict already (a mismatch it
            try:  # raises, it has told)
                prober.check(())
            except (MismatchError, PeerLostError) as exc:
                found = exc
        if found is None:
            found = _verdict_here(transport, call, where.rank, where.size)
            if isinstance(found, MismatchError):
                # The cause behind the loss: the peer that found it may have left since, and
                # ranks that can hear only from this one must learn it, not its consequence.
                _tell_all(transport, call, where.rank, where.size, _RELAYED)
        lost = err.lost_rank if isinstance(err, PeerLostError) else None
        kind, closed = _LOST, peer_closed(err)
        if closed:  # Note [peers that close]: what the peer told came before its close
            if isinstance(found, PeerLostError) and found.lost_rank not in (None, lost):
                lost = found.lost_rank
                kind = _CLOSED if peer_closed(found) else _LOST
            else:  # it told nothing (this rank saw its close itself): it closed
                kind = _CLOSED
                if isinstance(found, PeerLostError):
                    found = None
        if lost is not None and not isinstance(found, MismatchError):
            _tell_all(transport, call, where.rank, where.size, kind, lost)
        gave_up = getattr(err, GAVE_UP, False)
        if found is None and gave_up:  # the peer told before it marked: on its way
            found = _notice_soon(transport, call, where.rank, where.size, NOTICE_SECONDS)
        if isinstance(found, PeerLostError) and not (
            gave_up or closed or isinstance(err, CommTimeout)
        ):  # a loss told by a peer explains a timeout, a peer giving up or closing only
            found = None
    except Exception:
        return err
    if found is None:
        return err
    found.__cause__ = err
    setattr(found, _SETTLED, True)
    return found


def wait_post(
    window: Any,
    transport: Transport,
    q: int,
    value: int,
    call: Call,
    rank: int,
    size: int,
    shown: int,
    look: Callable[[], None],
) -> str | None:
    """Wait until rank ``q`` of ``window`` posts ``value``, probing the call's peers once it
    has stalled (Note [stall probes]). None once ``q`` has posted; on the deadline, what the
    peers' probes say about whom they wait on (a timeout's note, maybe empty).

    ``shown``: ``q``'s rank in the communicator (probes and messages name it); ``look``:
    raises if ``q`` can no longer post (it gave up on an earlier call), called first
    and then each time the stalled wait wakes, at least every :data:`PROBE_SECONDS`.

    Raises:
        MismatchError: the probes show the ranks in different calls.
        PeerLostError, ClosedError: as :meth:`Window.wait`.
    """
    look()
    deadline = call.deadline
    slot = call.slot
    probe_at = (slot.start if slot is not None else time.monotonic()) + PROBE_SECONDS
    if call.probe_tag < 0 or size < 2 or (deadline is not None and deadline <= probe_at):
        return None if window.wait(q, value, deadline) else ""
    if window.wait(q, value, probe_at):
        return None
    prober = Prober(transport, call, rank, size)
    try:
        prober.start([shown])
        while True:
            h = window.watch(q, value)
            if h is None:
                return None
            try:
                now = time.monotonic()
                limit = PROBE_SECONDS if deadline is None else min(deadline - now, PROBE_SECONDS)
                wake = prober.wake_at
                if wake is not None:
                    limit = min(limit, wake - now)
                transport.wait_any([h, *prober.handles], max(limit, 0.0))
            finally:
                arrived = h.done
                if not arrived:
                    window.unwatch(h)  # which marks it done
            if arrived:
                if h.error is not None:
                    raise h.error
                return None
            look()
            prober.check([shown])
            if deadline is not None and time.monotonic() >= deadline:
                return prober.explain([shown])
    finally:
        prober.close()


def _verdict_here(
    transport: Transport, call: Call, rank: int, size: int
) -> MismatchError | PeerLostError | None:
    """A peer's verdict already received (not waited for), as this rank's MismatchError;
    else a peer's ``LOST`` notice, as its PeerLostError; else None."""
    lost: PeerLostError | None = None
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
            found = _notice(call, rank, q, buf)
            if isinstance(found, MismatchError):
                return found
            lost = _likelier(lost, found)
    return lost


def _notice(call: Call, rank: int, q: int, buf: np.ndarray) -> MismatchError | PeerLostError | None:
    """Peer ``q``'s verdict or ``LOST`` notice in ``buf``, as this rank's error (None for a
    stall probe)."""
    _, _, kind, name, _, *theirs = _WIRE.unpack(buf.tobytes())
    if kind in (_VERDICT, _RELAYED):
        return _verdict_error(call, rank, q, _text(name), kind == _RELAYED)
    if kind in (_LOST, _CLOSED):
        return _lost_error(call, rank, q, _text(name), theirs[0], kind)
    return None


def _likelier(known: PeerLostError | None, told: PeerLostError | None) -> PeerLostError | None:
    """Of two notices, the first, unless only the second names a rank that died (the other
    one that closed: Note [peers that close] in plait.transport.base)."""
    if known is None or (peer_closed(known) and told is not None and not peer_closed(told)):
        return told
    return known


def _notice_soon(
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


def _pack(call: Call, kind: int, waiting: Sequence[int]) -> bytes:
    named = list(waiting[:_NAMED]) + [-1] * (_NAMED - min(len(waiting), _NAMED))
    return _WIRE.pack(call.seq, call.check, kind, _name(call), len(waiting), *named)


def _tell_all(
    transport: Transport, call: Call, rank: int, size: int, kind: int = _VERDICT, lost: int = -1
) -> None:
    """Send every peer a verdict, or a ``LOST`` notice naming rank ``lost`` (best effort:
    the call is failing anyway), and see that they leave (Note [notices that wait])."""
    verdict = _pack(call, kind, () if lost < 0 else (lost,))
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


def _verdict_error(call: Call, rank: int, q: int, name: str, relayed: bool) -> MismatchError:
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


def _lost_error(
    call: Call, rank: int, q: int, name: str, lost: int, kind: int = _LOST
) -> PeerLostError:
    if kind == _CLOSED:  # Note [peers that close] in plait.transport.base
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


def _name(call: Call) -> bytes:
    return wire_name(call.describe)


def _text(raw: bytes) -> str:
    return raw.rstrip(b"\0").decode("utf-8", "replace")
