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
      :data:`GRACE_SECONDS` later, MismatchError. A transport reads a peer's
      frames in the order it sent them, so the probe is read only after
      everything that rank sent before it, however slow the link: over TCP
      with several streams, a probe on stream 0 waits for the parts of a
      striped message still on the other streams (Note [striped order] in
      :mod:`plait.transport.tcp.reader`; overtaking them, it made identical
      calls a MismatchError where a part took more than the grace to come);
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

      Note [a peer that told, then left]: a peer that told which rank it lost
      and then left without closing (its script went on to its end, or it was
      killed) fails the calls that wait on it as a death. Its notice travelled
      before its end on the same ordered path, as before a close, and a loss
      told by any peer came before the death this rank saw: the call raises
      the rank told lost first, and passes that on. Before, ranks waiting in
      a ring behind a lost rank's neighbour each named the rank before them.

      Note [a loss told on]: a rank that learns of a loss only from a peer's
      notice (its probes read it, or it explains the call's timeout) passes
      it on to its other peers, as a rank that saw the loss does, once
      (:func:`settle`; the probes' ``block`` in
      :mod:`plait.runtime.waits` settles what they raise). The notice of the
      rank that saw the loss may still be on its way to those peers (behind
      megabytes on a slow link between hosts), and this rank may leave at
      once: before, it told nothing, and a peer waiting on it saw it go and
      named it as the lost rank. A peer that gave up after an error of its own
      (``ABANDONED``, below) told every rank itself: that is not passed on.
    - an ``ABANDONED`` notice of this call or an earlier one (the peer gave up
      on it after an error of its own, and makes no more calls of this
      communicator: Note [errors of a rank's own] in :mod:`plait._failures`):
      PeerLostError naming that rank and its error's type. One of a later call
      is read as a stall probe of that call, and kept for the transport's
      life: read once, it is gone from the transport, and that later call,
      waiting on a rank that will never come, raises it once it stalls.

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
    call sends ``size - 1`` messages of :data:`~plait.runtime.notices.PROBE_BYTES` once (again only
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

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from plait.errors import CommTimeout, MismatchError, PeerLostError
from plait.runtime.crossing import Crossing
from plait.runtime.notices import (
    ABANDONED,
    CLOSED,
    LOST,
    NAMED,
    OWN,
    PROBE_BYTES,
    RELAYED,
    STALLED,
    VERDICT,
    WIRE,
    abandoned_error,
    keep_later,
    kept,
    likelier,
    lost_error,
    notice_soon,
    pack,
    tell_all,
    text,
    verdict_error,
    verdict_here,
)
from plait.schedule.ir import Schedule
from plait.transport.base import PEER_CLOSED, Handle, Transport, peer_closed

if TYPE_CHECKING:
    from plait.runtime.executor import Call

__all__ = ["GAVE_UP", "GRACE_SECONDS", "PROBE_SECONDS", "Prober", "settle", "wait_post"]

#: Seconds a call waits before it probes its peers (Note [stall probes]).
PROBE_SECONDS = 1.0
#: Seconds a peer found in a later call may still deliver what this call waits for.
GRACE_SECONDS = 2.0
#: The attribute that marks an error :func:`settle` has settled.
_SETTLED = "_plait_settled"
#: Set on the PeerLostError of a call that met a peer's mark that it gave up on the call (its
#: one-sided post, a message it withdrew): the peer's own error (a rank it lost, told by a
#: LOST notice) is the one to raise.
GAVE_UP = "_plait_gave_up"
#: Seconds a call that met such a mark waits for the peer's notice (sent before the mark).
NOTICE_SECONDS = 0.5
#: Set on the PeerLostError the probes raise from a peer's notice: a loss or close that peer
#: told, not one this rank saw (:func:`settle` words a close seen here itself).
_TOLD = "_plait_told"


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
        me = pack(self._call, STALLED, waiting)
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
            seq, digest, kind, name, n, *theirs = WIRE.unpack(self._bufs[q].tobytes())
            self._post(q)  # the next probe from q (a verdict may follow its stall probe)
            if kind == STALLED and seq == self._call.seq and digest == self._call.check:
                self._heard[q] = tuple(p for p in theirs[: min(n, NAMED)] if p >= 0)
            if kind in (LOST, CLOSED):  # raised once the rest has been read: a mismatch first
                told = lost_error(self._call, self._rank, q, text(name), theirs[0], kind)
                lost = likelier(lost, told)
                continue
            if kind == ABANDONED and seq <= self._call.seq:  # as a loss: a mismatch first
                lost = likelier(lost, abandoned_error(self._call, self._rank, q, seq, name))
                continue
            if kind == ABANDONED:  # for a later call of this communicator to raise
                keep_later(self._t, self._call.probe_tag, q, seq, name)
            err = self._verdict(q, seq, digest, kind, text(name), waiting)
            if err is not None:
                self.tell_all()
                raise err
            if seq > self._call.seq and q in waiting and q not in self._suspects:
                self._suspects[q] = (now + GRACE_SECONDS, self._ahead(q, text(name)))
        lost = likelier(lost, kept(self._t, self._call, self._rank))
        if lost is not None:
            setattr(lost, _TOLD, True)
            raise lost
        for q, (until, err) in list(self._suspects.items()):
            if q not in waiting:
                del self._suspects[q]  # what it owed arrived
            elif now >= until:
                self.tell_all()
                raise err
        foreign = self._foreign()
        if foreign is not None:
            self.tell_all()
            raise foreign
        crossed = self._cross.check(self._rank, waiting)
        if crossed is not None:
            self.tell_all()
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
        if kind in (VERDICT, RELAYED):
            return verdict_error(call, r, q, name, kind == RELAYED)
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

    def tell_all(self) -> None:
        tell_all(self._t, self._call, self._rank, self._size)

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
    so is a PeerLostError that names its lost rank (a ``LOST`` notice; a loss a
    peer told too, Note [a loss told on]), unless a
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
            tell_all(transport, call, where.rank, where.size)
            return err
        found: MismatchError | PeerLostError | None = None
        if prober is not None:  # its receives may hold a verdict already (a mismatch it
            try:  # raises, it has told)
                prober.check(())
            except (MismatchError, PeerLostError) as exc:
                found = exc
        if found is None:
            found = verdict_here(transport, call, where.rank, where.size)
            if isinstance(found, MismatchError):
                # The cause behind the loss: the peer that found it may have left since, and
                # ranks that can hear only from this one must learn it, not its consequence.
                tell_all(transport, call, where.rank, where.size, RELAYED)
        gave_up = getattr(err, GAVE_UP, False)
        if found is None and gave_up:  # the peer told before it gave up: on its way
            found = notice_soon(transport, call, where.rank, where.size, NOTICE_SECONDS)
        lost = err.lost_rank if isinstance(err, PeerLostError) else None
        kind, closed = LOST, peer_closed(err)
        # A peer that gave up after an error of its own told every rank: the cause of all
        own = getattr(found, OWN, False)
        # Note [a peer that told, then left]: what the peer that died told came first; what
        # a peer that gave up told is why it did (passed on, as a loss this rank saw)
        first = isinstance(found, PeerLostError) and found.lost_rank not in (None, lost)
        first = first and (lost is not None or gave_up) and not own
        if (closed or first) and not own:  # Note [peers that close]: what it told came first
            if isinstance(found, PeerLostError) and found.lost_rank not in (None, lost):
                lost = found.lost_rank
                kind = CLOSED if peer_closed(found) else LOST
            else:  # no other rank told: it closed (seen here, or a peer's CLOSED notice)
                kind = CLOSED
                if not isinstance(found, MismatchError):  # (a verdict here explains it)
                    found = None
                    if lost is not None and not getattr(err, _TOLD, False):
                        found = _closed(transport, call, where.rank, lost)  # seen here
        elif isinstance(err, CommTimeout) and isinstance(found, PeerLostError) and not own:
            # Note [a loss told on]: the loss a peer told explains the timeout, and goes on
            lost, kind = found.lost_rank, CLOSED if peer_closed(found) else LOST
        if lost is not None and not (own or isinstance(found, MismatchError)):
            tell_all(transport, call, where.rank, where.size, kind, lost)
        if isinstance(found, PeerLostError) and not (
            own or first or gave_up or closed or isinstance(err, CommTimeout)
        ):  # a loss told by a peer explains a timeout, a peer giving up, closing, or leaving
            # after it told
            found = None
    except Exception:
        return err
    if found is None:
        return err
    found.__cause__ = err
    setattr(found, _SETTLED, True)
    return found


def _closed(transport: Transport, call: Call, rank: int, q: int) -> PeerLostError:
    """The error of a call that saw its peer ``q`` close its communicator, ``q`` having told
    nothing: named as one that closed during the call, in the words of a peer's ``CLOSED``
    notice and of the window's post (Note [peers that close] in
    :mod:`plait.transport.base`); a group's peer also by the job's number, as a group's
    transport names it (:meth:`plait.group.GroupTransport.renumber`)."""
    who = f"rank {q}"
    if getattr(transport, "renumber", None) is not None:
        job = int(transport.name(q))  # type: ignore[attr-defined]
        who = who if job == q else f"rank {q} (job rank {job})"
    err = PeerLostError(
        f"rank {rank}: {call.describe}: {who} closed its communicator during the call, "
        "and no call of this communicator can finish without it"
    )
    err.lost_rank = q
    setattr(err, PEER_CLOSED, True)
    return err


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
