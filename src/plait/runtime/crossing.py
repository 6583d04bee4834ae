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

    So a stalled call also sends each rank it waits on one *whereabouts*
    notice, on one tag of the transport that all those communicators share
    (outside every communicator's tags: Note [wire tags] in :mod:`plait.group`):
    its communicator's id, its call's number and name, and the ranks it waits
    on as the transport numbers them. And it reads theirs. Peer ``q``'s notice
    that its call ``n`` of communicator ``C`` waits on this rank, where ``C``
    is not the communicator of this call and this rank has not begun ``C``'s
    call ``n`` (its ``C`` has numbered at most ``n`` calls), is a *crossing*:
    each waits for a call the other makes only later.

    It is a deadlock for sure only where nothing but the two stalled threads
    can make the calls they wait for: neither process runs a Python thread
    but the stalled one and plait's own that make no calls of their own
    (named ``plait-``; a worker's queued calls are numbered already, so it
    never begins a call not yet numbered; the torch backend's threads run
    the user's callbacks, so they count as the user's). Each notice says
    whether its sender is so alone. Then the call raises MismatchError, and
    tells its peers as for any mismatch; ``q``, stalled the same way, finds
    the crossing from this rank's notice and raises too. Where other threads
    run on either side, one of them may yet make the call (two threads that
    drive one communicator each), so the crossing is only logged, once per
    call, and a timeout's message names it.

    A notice outlives its call: it is read whenever this rank next stalls.
    One whose call has ended names a call this rank has begun (that call
    could not end on ``q`` without this rank), and is passed over. A notice
    about this very communicator is the stall probes' business and passed
    over too. Costs: nothing while calls finish within the probe period; a
    stalled call sends one notice of :data:`NOTICE_BYTES` to each rank it
    waits on and keeps one receive posted for each. As with probes, a notice
    to a rank that never stalls waiting on its sender stays among that
    rank's unexpected messages until it does, or closes.
"""

from __future__ import annotations

import logging
import struct
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from plait.errors import MismatchError
from plait.transport.base import Handle, Transport

__all__ = ["NOTICE_BYTES", "Crossing", "Numbered", "register"]

_log = logging.getLogger("plait")

#: Most of the ranks a notice says its call waits on.
_NAMED = 8
#: The communicator's id, the call's number, its name (UTF-8, zero-padded), whether the
#: sender runs no other thread that could make a call (_alone), how many ranks it waits on,
#: and the first of them as the shared transport numbers them (-1 after the last).
_WIRE = struct.Struct(f"<QQ40sII{_NAMED}i")
#: Bytes of one whereabouts notice.
NOTICE_BYTES = _WIRE.size


class Numbered(Protocol):
    """What a communicator's call runner shows here: how many calls it has numbered."""

    seq: int


@dataclass(frozen=True)
class _Member:
    """One communicator of this rank, as registered by its call runner."""

    comm_id: int
    root: Transport  # the transport every communicator of the job shares
    ranks: tuple[int, ...]  # the communicator's rank i is the root's rank ranks[i]
    tag: int  # the root's whereabouts tag
    owner: weakref.ref[Any]  # the runner (its seq)

    def began(self, seq: int) -> bool:
        """Whether this rank has numbered call ``seq`` (a gone runner: say it has)."""
        runner = self.owner()
        return runner is None or runner.seq > seq

    def describe(self) -> str:
        if self.comm_id == 0:
            return "the world communicator"
        return f"communicator {self.comm_id:x} (job ranks {list(self.ranks)})"


# Plain dicts, read and written whole (atomic under the GIL): a runner's entries go when it
# does (a weakref's callback, which may run in a collection anywhere, so no lock here).
_by_probe: dict[tuple[int, int], _Member] = {}  # (id(its transport), probe tag) -> member
_by_comm: dict[tuple[int, int], _Member] = {}  # (id(root), comm id) -> member


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

    member = _Member(comm_id, root, tuple(ranks), tag, weakref.ref(owner, gone))
    _by_probe[by_probe] = member
    _by_comm[by_comm] = member


class Crossing:
    """The whereabouts notices of one stalled call (Note [crossed calls]).

    ``transport`` and ``probe_tag``: the call's; ``describe``: its name. A call
    of a communicator that was never registered (a bare transport) makes none.
    """

    __slots__ = (
        "_bufs",
        "_describe",
        "_heard",
        "_logged",
        "_me",
        "_peer",
        "_posted",
        "_seq",
        "_sure",
        "found",
    )

    def __init__(self, transport: Transport, probe_tag: int, seq: int, describe: str) -> None:
        self._me = _by_probe.get((id(transport), probe_tag))
        self._seq = seq
        self._describe = describe
        self._bufs: dict[int, np.ndarray] = {}
        self._posted: dict[Handle, int] = {}  # receive -> root rank of the peer
        self._heard: dict[int, str] = {}  # root rank -> where it waits, in words
        self._logged = False
        self._peer = -1  # the root rank of the crossing's peer
        self._sure = False  # whether that peer said it runs no other thread (_alone)
        #: The crossing found, in words ("" until one is).
        self.found = ""

    def start(self, waiting: Sequence[int]) -> None:
        """Tell the ranks this call waits on (``waiting``, as its communicator numbers
        them) where it waits, and listen for theirs."""
        me = self._me
        if me is None:
            return
        peers = [me.ranks[q] for q in waiting][:_NAMED]
        named = peers + [-1] * (_NAMED - len(peers))
        name = self._describe.encode("utf-8", "replace")[:40]
        notice = _WIRE.pack(me.comm_id, self._seq, name, _alone(), len(peers), *named)
        for p in peers:
            try:
                me.root.isend(p, me.tag, memoryview(notice), 0)
            except Exception:  # a lost peer: the call itself says so
                continue
            self._bufs[p] = np.zeros(NOTICE_BYTES, np.uint8)
            self._post(p)

    def check(self, rank: int, waiting: Sequence[int]) -> MismatchError | None:
        """Read the notices that arrived; the error to raise for a crossing that is a
        deadlock for sure, else None (a crossing that may not be one is logged once).
        ``rank``: this rank, and ``waiting``: the ranks this call still waits on, as its
        communicator numbers them."""
        me = self._me
        if me is None:
            return None
        still = {me.ranks[q] for q in waiting}
        if self.found and self._peer not in still:
            self.found = ""  # what the call waited for from that peer came after all
        for h in [h for h in self._posted if h.done]:
            p = self._posted.pop(h)
            if h.error is not None:
                continue
            comm_id, seq, raw, alone, n, *theirs = _WIRE.unpack(self._bufs[p].tobytes())
            self._post(p)
            if comm_id == me.comm_id:
                continue
            other = _by_comm.get((id(me.root), comm_id))
            if other is None or other.began(seq):
                continue  # not a communicator of this rank, or an old notice
            name = raw.rstrip(b"\0").decode("utf-8", "replace")
            waits = [t for t in theirs[: min(n, _NAMED)] if t >= 0]
            where = f"{name} of {other.describe()}, for job rank(s) {waits}"
            self._heard[p] = where
            if p in still and me.root.rank in waits and not self.found:
                self._peer, self._sure = p, bool(alone)
                self.found = (
                    f"job rank {p} waits in {where}, a call this rank has not begun, while this "
                    f"rank waits for it here: the ranks made calls on different communicators "
                    f"in different orders"
                )
        if not self.found:
            return None
        text = f"rank {rank}: {self._describe}: {self.found}"
        if self._sure and _alone():
            return MismatchError(text)
        if not self._logged:
            self._logged = True
            _log.warning(
                "%s (a deadlock unless another thread of this rank or of job rank %d makes the "
                "call the other waits for)",
                text,
                self._peer,
            )
        return None

    def explain(self) -> str:
        """Where the peers this call waits on said they wait in other communicators' calls
        (for a timeout's message; empty where none said so)."""
        if self.found:
            return "; " + self.found
        return "".join(f"; job rank {p} waits in {w}" for p, w in sorted(self._heard.items()))

    @property
    def handles(self) -> list[Handle]:
        """The posted receives, to wait on along with the call's own."""
        return list(self._posted)

    def close(self) -> None:
        """Withdraw the receives still posted (the call is over)."""
        me = self._me
        for h in self._posted:
            if not h.done and me is not None:
                me.root.cancel(h)
        self._posted.clear()

    def _post(self, p: int) -> None:
        me = self._me
        assert me is not None
        try:
            h = me.root.irecv(p, me.tag, self._bufs[p].data, 0)
        except Exception:  # a lost peer: the call itself says so
            return
        self._posted[h] = p


def _alone() -> bool:
    """Whether no Python thread but this one and plait's own that make no calls of their own
    runs in this process (the torch backend's run the user's callbacks and point-to-point)."""
    me = threading.current_thread()
    return all(
        t is me or (t.name.startswith("plait-") and not t.name.startswith("plait-torch-"))
        for t in threading.enumerate()
    )
