"""Crossed calls: stalled calls of different communicators that wait on each other.

Note [crossed calls]
    Stall probes (Note [stall probes] in :mod:`plait.runtime.stall`) travel
    on their communicator's own tag, so they tell a rank about its peers'
    calls on that communicator only. Communicators that share ranks (a parent
    and the groups split from it) can wait on each other across: rank 0 in
    the world's ``allreduce`` waits for rank 1, which waits in a group's
    ``allreduce`` for rank 0, which makes that call only after its own
    returns. Each sees a peer that is late, which is no mismatch (a rank may
    compute for minutes before its next call), and would wait for its timeout.

    So a stalled call also sends each rank it waits on one *whereabouts* notice, on one
    tag of the transport that all of them share (outside every
    communicator's tags: Note [wire tags] in :mod:`plait.group`): its
    communicator's id, its call's number and name, and the ranks it waits on
    as the transport numbers them. And it reads every rank's. Peer ``q``'s
    notice that its call ``n`` of communicator ``C`` waits on this rank,
    where ``C`` is not the communicator of this call, this call waits on
    ``q``, and this rank has not begun ``C``'s call ``n`` (its ``C`` has
    numbered at most ``n`` calls, and is neither broken nor closed), is a
    *crossing* as this rank sees it: each waits for a call the other has not
    begun. The rank then sends ``q`` a *confirmation* naming both calls.

    A crossing that both ranks see is a deadlock for sure only where nothing
    but the two stalled threads can begin the calls they wait for: neither
    process runs a Python thread but the stalled one and plait's own that
    begin no calls (named ``plait-``; a worker runs queued calls, numbered
    when they were queued; the torch backend's threads run the user's
    callbacks, so they count as the user's). Each notice and confirmation
    says whether its sender is so alone. A rank that sees a crossing, is
    alone, and holds its peer's confirmation of the same two calls from a
    peer that is alone raises MismatchError (and tells its peers, as for any
    mismatch); the peer, holding this rank's confirmation, does too. One
    side is not enough: a peer whose call runs on its worker thread while
    its main thread waits in the other communicator has begun the call this
    rank waits in, so it sees no crossing and confirms none, and both calls
    finish (with both ranks alone, a crossing that only one sees is not
    logged or named either). Where other threads run on either side, one of
    them may yet begin a call, so the crossing is only logged (once per
    call) and a timeout's message names it. Threads that Python's ``threading`` module
    does not know (started by a C extension) are not seen.

    What a stalled call reads goes on the transport's *board*, kept for every
    call of the process: a rank's latest notice, and the confirmations of the
    latest calls. So a notice that one call (or one wait of a call: a
    one-sided call probes anew for each peer it waits on) took serves a later
    call that waits on that rank, and a confirmation taken by another
    thread's call serves the call it names. Each call sends each rank one
    notice and one confirmation at most. A notice outlives its call; one
    whose call has ended names a call this rank has begun (that call could
    not end on ``q`` without this rank) or a communicator that broke here,
    and is passed over. A notice about this very communicator is the stall
    probes' business and passed over too. Only crossings of two ranks are
    found; a ring of three or more shows in each timeout's message, as what
    each peer said it waits in.

    A blocking wait for a message of one rank (``recv``, a receive request's
    ``wait``, ``probe``, and ``sendrecv``'s receive, without a timeout of the
    caller's: one given may be a poll the program means to outlast) that
    stalls is a call of its communicator here
    too, numbered from :data:`P2P` up (a number no call reaches, so never
    begun): it sends the rank it waits on a notice (``recv from rank 0 (tag
    0)``) and reads the board like a collective. Its number never says that it
    ended, so a wait that told ends by telling so too (an ``ENDED`` notice,
    which takes its notice off the peer's board; not one that raised a
    crossing, whose peer needs its notice there to raise too): before, a rank whose peer
    had long finished a ``recv`` from it logged a crossing with that
    ``recv``, and its timeouts named it. So a rank in a ``recv`` from
    a rank that waits for it in a collective of the same communicator (the
    stall probes' business only between collectives), or in a ``recv`` of
    its own, is a crossing seen from both sides, and raises as above where
    both are alone; but not as seen by a rank with a send to the receiver
    still in flight (:data:`pending_sends`, any of them: a large message
    waits for its receive to be posted, so sends end in any order), which
    may be the very message (a large one takes seconds). A send takes no
    part: whether it waits for its receive depends on the transport and the
    size (shared memory takes the bytes at any wait of the receiver, TCP
    holds a large message until its receive is posted); nor does a wait on
    several ranks, or on any rank (another rank may end it).

    Costs: nothing while calls finish within the probe period. A stalled call sends one notice of
    :data:`NOTICE_BYTES` to each rank it waits on, and keeps one receive
    posted that any rank's notice matches (a pattern, Note [patterns] in
    :mod:`plait.transport.patterns`; one per rank it waits on where the
    transport matches no patterns). As with probes, a notice to a rank that
    never stalls stays among that rank's unexpected messages until it does,
    or closes: one per stalled call of a peer, two per stalled point-to-point wait
    (its notice, and the ENDED that follows it).
"""

from __future__ import annotations

import itertools
import logging
import struct
import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from plait.errors import MismatchError
from plait.transport.base import Handle, Matching, Transport

__all__ = [
    "NAME_BYTES",
    "NOTICE_BYTES",
    "P2P",
    "Crossing",
    "Numbered",
    "p2p_number",
    "pending_sends",
    "register",
    "sending",
    "wire_name",
]

_log = logging.getLogger("plait")

#: Bytes of a call's name in a notice or a probe (:func:`wire_name`).
NAME_BYTES = 96


def wire_name(describe: str) -> bytes:
    """A call's name (``gather_object's gatherv (binomial, call #3)``) as a notice or a
    probe carries it: UTF-8, at most :data:`NAME_BYTES`, cut in the middle where longer so
    that its call number at the end stays, and never within a character."""
    raw = describe.encode("utf-8", "replace")
    if len(raw) <= NAME_BYTES:
        return raw
    tail = raw[-40:].decode("utf-8", "ignore").encode()
    head = raw[: NAME_BYTES - len(tail) - 3].decode("utf-8", "ignore").encode()
    return head + b"..." + tail


# _ENDED: a point-to-point wait that told where it waits has ended (Note [crossed calls])
_WHERE, _CONFIRM, _ENDED = 0, 1, 2
#: Most of the ranks a notice says its call waits on.
_NAMED = 8
#: Kind; the sender's communicator id and call number, the call's name (UTF-8, zero-padded),
#: whether the sender is alone (_alone); for a confirmation, the receiver's call that the
#: sender has not begun (communicator id, number); how many ranks the call waits on, and the
#: first of them as the shared transport numbers them (-1 after the last).
_WIRE = struct.Struct(f"<IQQ{NAME_BYTES}sIQQI{_NAMED}i")
#: Bytes of one whereabouts notice or confirmation.
NOTICE_BYTES = _WIRE.size
#: The first number of a point-to-point wait (Note [crossed calls]): above every call's.
P2P = 1 << 63
_p2p_waits = itertools.count(P2P)


def p2p_number() -> int:
    """A number of this process's own for a stalled point-to-point wait's notices."""
    return next(_p2p_waits)


#: The point-to-point sends to each peer that were not done when posted (a message too large
#: to go at once, or one queued behind others), by (id(transport), the peer as the transport
#: numbers it), by weak reference (a send holds the sender's memory; one that is gone is
#: done): a rank sees no crossing with a peer's receive while one is in flight (Note [crossed
#: calls]). They may end in any order (a large message waits for its receive to be posted).
pending_sends: dict[tuple[int, int], _Sends] = {}


class _Sends(list):  # type: ignore[type-arg]
    """One peer's sends in :data:`pending_sends`, and the length at which the ended ones
    are next dropped: twice what was left the last time, so that posting ``k`` sends that
    stay in flight (a loop of isends ahead of its receives) costs O(k), not O(k²)."""

    __slots__ = ("prune_at",)

    def __init__(self, first: weakref.ref[Any]) -> None:
        super().__init__((first,))
        self.prune_at = _PRUNE_AT


#: The fewest kept sends of one peer at which the ended ones are dropped.
_PRUNE_AT = 64


def sending(transport: Transport, peer: int, handle: Handle) -> None:
    """Keep ``handle``, a send to ``peer`` not done when posted, in :data:`pending_sends`
    (dropping the ones that ended, now and then: :class:`_Sends`)."""
    try:
        ref = weakref.ref(handle)
    except TypeError:  # a transport whose handles take no weak reference: none kept
        return
    key = (id(transport), peer)
    refs = pending_sends.get(key)
    if refs is None:
        pending_sends[key] = _Sends(ref)
        return
    refs.append(ref)
    if len(refs) >= refs.prune_at:
        refs[:] = [r for r in refs if (h := r()) is not None and not h.done]
        refs.prune_at = max(_PRUNE_AT, 2 * len(refs))


def _sending(root: Transport, p: int) -> bool:
    """Whether a send of this process to job rank ``p`` over ``root`` is in flight."""
    for tid, member in list(_by_transport.items()):
        if member.root is root and p in member.ranks:
            for ref in pending_sends.get((tid, member.ranks.index(p)), ()):
                h = ref()
                if h is not None and not h.done:
                    return True
    return False


class Numbered(Protocol):
    """What a communicator's call runner shows here: how many calls it has numbered, and
    whether it can still begin one."""

    seq: int
    closed: bool
    broken: BaseException | None


@dataclass(frozen=True)
class _Member:
    """One communicator of this rank, as registered by its call runner."""

    comm_id: int
    root: Transport  # the transport every communicator of the job shares
    ranks: tuple[int, ...]  # the communicator's rank i is the root's rank ranks[i]
    tag: int  # the root's whereabouts tag
    owner: weakref.ref[Any]  # the runner

    def began(self, seq: int) -> bool:
        """Whether this rank has numbered call ``seq``, or will begin no call (a runner
        that is gone, closed or broken: a notice about it is no current crossing)."""
        runner = self.owner()
        return runner is None or runner.seq > seq or runner.closed or runner.broken is not None

    def describe(self) -> str:
        if self.comm_id == 0:
            return "the world communicator"
        return f"communicator {self.comm_id:x} (job ranks {list(self.ranks)})"


#: A notice as kept: communicator id, call number, name, alone, the ranks it waits on.
_Notice = tuple[int, int, str, bool, tuple[int, ...]]


class _Board:
    """What this rank has heard on one transport's whereabouts tag, kept for every call:
    a notice read by one stalled call (or one of a call's waits) serves the others."""

    __slots__ = ("confirms", "notices", "sent")

    def __init__(self) -> None:
        self.notices: dict[int, _Notice] = {}  # peer -> its latest notice
        # (peer, this rank's communicator id, call number) -> (the peer's, alone)
        self.confirms: dict[tuple[int, int, int], tuple[int, int, bool]] = {}
        # (kind, communicator id, call number, peer) of what this rank has sent
        self.sent: dict[tuple[int, int, int, int], None] = {}

    def once(self, key: tuple[int, int, int, int]) -> bool:
        """Whether ``key`` is new (then remember it, among the latest :data:`_KEPT`)."""
        if key in self.sent:
            return False
        _keep(self.sent, key, None)
        return True


#: Most confirmations and sent marks a board keeps (the oldest go first).
_KEPT = 256


def _keep(table: dict[Any, Any], key: Any, value: Any) -> None:
    table[key] = value
    if len(table) > _KEPT:
        del table[next(iter(table))]


# Plain dicts, read and written whole (atomic under the GIL): a runner's entries go when it
# does (a weakref's callback, which may run in a collection anywhere, so no lock here).
_by_probe: dict[tuple[int, int], _Member] = {}  # (id(its transport), probe tag) -> member
_by_comm: dict[tuple[int, int], _Member] = {}  # (id(root), comm id) -> member
_boards: dict[int, _Board] = {}  # id(root) -> what was heard there
_counts: dict[int, int] = {}  # id(root) -> how many communicators are registered on it
_by_transport: dict[int, _Member] = {}  # id(its transport) -> member (point-to-point waits)


def register(
    owner: Numbered,
    transport: Transport,
    probe_tag: int,
    comm_id: int,
    root: Transport,
    ranks: Sequence[int],
    tag: int,
) -> None:
    """Make ``owner``'s communicator (its calls probe on ``probe_tag`` over ``transport``)
    known to the crossings of this process (Note [crossed calls]), until ``owner`` is
    collected."""
    by_probe, by_comm = (id(transport), probe_tag), (id(root), comm_id)

    def gone(_: object) -> None:
        if _by_probe.get(by_probe) is member:
            _by_probe.pop(by_probe, None)
        if _by_comm.get(by_comm) is member:
            _by_comm.pop(by_comm, None)
        if _by_transport.get(by_probe[0]) is member:
            _by_transport.pop(by_probe[0], None)
            for key in [k for k in pending_sends if k[0] == by_probe[0]]:
                pending_sends.pop(key, None)
        left = _counts.get(by_comm[0], 1) - 1
        if left > 0:
            _counts[by_comm[0]] = left
        else:
            _counts.pop(by_comm[0], None)
            _boards.pop(by_comm[0], None)

    member = _Member(comm_id, root, tuple(ranks), tag, weakref.ref(owner, gone))
    _by_probe[by_probe] = member
    _by_comm[by_comm] = member
    _by_transport[by_probe[0]] = member
    _counts[by_comm[0]] = _counts.get(by_comm[0], 0) + 1


class Crossing:
    """The whereabouts notices of one stalled call (Note [crossed calls]).

    ``transport`` and ``probe_tag``: the call's (``probe_tag`` None: a
    point-to-point wait, ``seq`` from :func:`p2p_number`); ``seq`` and
    ``describe``: its number and name. A call of a communicator that was
    never registered (a bare transport) makes none.
    """

    __slots__ = (
        "_board",
        "_describe",
        "_me",
        "_posted",
        "_raised",
        "_seq",
        "_told",
        "found",
        "sure",
    )

    def __init__(
        self, transport: Transport, probe_tag: int | None, seq: int, describe: str
    ) -> None:
        if probe_tag is None:
            me = _by_transport.get(id(transport))
        else:
            me = _by_probe.get((id(transport), probe_tag))
        self._me = me
        self._board = _boards.setdefault(id(me.root), _Board()) if me is not None else None
        self._seq = seq
        self._describe = describe
        # receive -> its peer (-1: any peer) and the buffer it fills
        self._posted: dict[Handle, tuple[int, np.ndarray]] = {}
        self._told: list[int] = []  # the ranks this call sent its notice (by the transport's)
        self._raised = False  # whether check returned a crossing's error
        #: The crossing seen, in words ("" until one is).
        self.found = ""
        #: Whether it is one for sure: both ranks see it (confirmed), or either runs other
        #: threads (then only they can undo it). Where both are alone and only this rank sees
        #: it, the peer has begun the call another way (on its worker thread).
        self.sure = False

    def start(self, waiting: Sequence[int]) -> None:
        """Tell the ranks this call waits on (``waiting``, as its communicator numbers
        them) where it waits, once a call, and listen for every rank's notices."""
        me, board = self._me, self._board
        if me is None or board is None:
            return
        peers = [me.ranks[q] for q in waiting][:_NAMED]
        notice = self._pack(_WHERE, 0, 0, peers)
        for p in peers:
            if board.once((_WHERE, me.comm_id, self._seq, p)):
                self._send(p, notice)
                self._told.append(p)
        if isinstance(me.root, Matching):
            self._post(-1)  # one receive that any rank's notice matches
        else:
            for p in peers:
                self._post(p)

    def check(self, rank: int, waiting: Sequence[int]) -> MismatchError | None:
        """Read the notices that arrived; the error to raise for a crossing that is a
        deadlock for sure, else None (a crossing that may not be one is logged once).
        ``rank``: this rank, and ``waiting``: the ranks this call still waits on, as its
        communicator numbers them."""
        me, board = self._me, self._board
        if me is None or board is None:
            return None
        done = [h for h in self._posted if h.done]
        while done:  # each read posts the next receive, which what has arrived may end at once
            for h in done:
                self._read(h, *self._posted.pop(h))
            done = [h for h in self._posted if h.done]
        self.found, self.sure = "", False
        for p, (comm_id, seq, _, alone, waits), where in self._elsewhere(waiting):
            if me.root.rank not in waits:
                continue
            how = (
                "made different calls on one communicator"
                if comm_id == me.comm_id
                else "made calls on different communicators in different orders"
            )
            self.found = (
                f"job rank {p} waits in {where}, a call this rank has not begun, while this "
                f"rank waits for it here: the ranks {how}"
            )
            if board.once((_CONFIRM, me.comm_id, self._seq, p)):
                self._send(p, self._pack(_CONFIRM, comm_id, seq, ()))
            text = f"rank {rank}: {self._describe}: {self.found}"
            here = _alone()
            confirmed = board.confirms.get((p, me.comm_id, self._seq))
            if confirmed == (comm_id, seq, True) and here:
                self.sure = self._raised = True
                return MismatchError(text)
            self.sure = confirmed is not None or not (here and alone)
            if self.sure and board.once((-1, me.comm_id, self._seq, p)):  # logged once
                _log.warning(
                    "%s (a deadlock unless another thread of this rank or of job rank %d "
                    "begins the call the other waits for)",
                    text,
                    p,
                )
            return None
        return None

    def explain(self, waiting: Sequence[int]) -> str:
        """Where the peers this call waits on (``waiting``) said they wait in other
        communicators' calls (for a timeout's message; empty where none said so)."""
        me, board = self._me, self._board
        if me is None or board is None:
            return ""
        if self.found and self.sure:
            return "; " + self.found
        elsewhere = self._elsewhere(waiting)
        return "".join(f"; job rank {p} waits in {where}" for p, _, where in elsewhere)

    def _elsewhere(self, waiting: Sequence[int]) -> Iterator[tuple[int, _Notice, str]]:
        """The ranks of ``waiting`` whose latest notice says they wait in a call of another
        of this rank's communicators that this rank has not begun: each with its notice, and
        where it waits in words."""
        me, board = self._me, self._board
        assert me is not None
        assert board is not None
        for p in sorted({me.ranks[q] for q in waiting}):
            notice = board.notices.get(p)
            if notice is None:
                continue
            if notice[0] == me.comm_id and notice[1] < P2P and self._seq < P2P:
                continue  # two collectives of this communicator: the stall probes' business
            other = _by_comm.get((id(me.root), notice[0]))
            if other is None or other.began(notice[1]):
                continue  # not a communicator of this rank's, or an old notice
            if notice[1] >= P2P and _sending(me.root, p):
                continue  # p's receive may be waiting for this rank's send in flight
            yield p, notice, f"{notice[2]} of {other.describe()}, for job rank(s) {list(notice[4])}"

    @property
    def handles(self) -> list[Handle]:
        """The posted receives, to wait on along with the call's own."""
        return list(self._posted)

    def close(self) -> None:
        """Withdraw the receives still posted (the call is over); keep what they took. A
        point-to-point wait tells the ranks it told where it waited that it ended, unless it
        raised a crossing (whose peer needs its notice there to raise too)."""
        me = self._me
        if me is None:
            return
        if self._seq >= P2P and not self._raised:  # no number says so (Note [crossed calls])
            ended = self._pack(_ENDED, 0, 0, ())
            for p in self._told:
                self._send(p, ended)
        for h, (p, buf) in self._posted.items():
            if h.done:
                self._read(h, p, buf, repost=False)
            elif p < 0 and isinstance(me.root, Matching):
                if not me.root.withdraw(h) and h.done:  # matched meanwhile
                    self._read(h, p, buf, repost=False)
            else:
                me.root.cancel(h)
        self._posted.clear()

    def _read(self, h: Handle, p: int, buf: np.ndarray, repost: bool = True) -> None:
        """File what receive ``h`` (from peer ``p``; -1: any) took into ``buf`` on the
        board."""
        me, board = self._me, self._board
        assert me is not None
        assert board is not None
        if h.error is not None:
            return
        if p < 0 and isinstance(me.root, Matching):
            p = me.root.envelope(h)[0]
        kind, comm_id, seq, raw, alone, mine, my_seq, n, *theirs = _WIRE.unpack(buf.tobytes())
        if repost:
            self._post(-1 if isinstance(me.root, Matching) else p)
        if kind == _CONFIRM:
            _keep(board.confirms, (p, mine, my_seq), (comm_id, seq, bool(alone)))
        elif kind == _WHERE:
            name = raw.rstrip(b"\0").decode("utf-8", "replace")
            waits = tuple(t for t in theirs[: min(n, _NAMED)] if t >= 0)
            board.notices[p] = (comm_id, seq, name, bool(alone), waits)
        elif kind == _ENDED:
            notice = board.notices.get(p)
            if notice is not None and notice[:2] == (comm_id, seq):
                del board.notices[p]

    def _pack(self, kind: int, comm_id: int, seq: int, peers: Sequence[int]) -> bytes:
        me = self._me
        assert me is not None
        named = list(peers) + [-1] * (_NAMED - len(peers))
        name = wire_name(self._describe)
        return _WIRE.pack(
            kind, me.comm_id, self._seq, name, _alone(), comm_id, seq, len(peers), *named
        )

    def _send(self, p: int, payload: bytes) -> None:
        me = self._me
        assert me is not None
        try:
            me.root.isend(p, me.tag, memoryview(payload), 0)
        except Exception:  # a lost peer: the call itself says so
            return

    def _post(self, p: int) -> None:
        """Post a receive of a notice from peer ``p`` (-1: any peer, by pattern)."""
        me = self._me
        assert me is not None
        buf = np.zeros(NOTICE_BYTES, np.uint8)
        try:
            if p < 0:
                assert isinstance(me.root, Matching)
                h = me.root.irecv_match(None, me.tag, -1, buf.data, 0)
            else:
                h = me.root.irecv(p, me.tag, buf.data, 0)
        except Exception:  # lost peers, a closed transport: the call itself says so
            return
        self._posted[h] = (p, buf)


def _alone() -> bool:
    """Whether no Python thread but this one and plait's own that begin no calls runs in
    this process (the torch backend's run the user's callbacks and point-to-point)."""
    me = threading.current_thread()
    return all(
        t is me or (t.name.startswith("plait-") and not t.name.startswith("plait-torch-"))
        for t in threading.enumerate()
    )
