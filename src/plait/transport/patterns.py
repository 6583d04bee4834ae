"""Matching patterns: the part of the endpoint that receives and probes from any of several peers.

:class:`PatternMatching` is a mixin of :class:`~plait.transport.endpoint.Endpoint`
(the one class that owns matching); it keeps the promises of
:class:`~plait.transport.base.Matching` with the endpoint's own queues, lock
and lost peers, and the endpoint calls it from ``take_posted``,
``add_unexpected``, ``lose``, ``cancel`` and ``close``. It also puts back a
receive whose message its sender withdrew (:meth:`PatternMatching.repost`, for
links), plain or pattern. See ``docs/transport.md``, "Matching patterns".

Note [patterns]
    A receive posted with a pattern (:class:`Wildcard`: any of several
    peers, tags agreeing on the bits of a mask) has no one (peer, tag) key,
    so it waits in ``_wild``, in posting order, and links never see the
    difference: they still ask :meth:`Endpoint.take_posted` for each message.
    While a pattern receive waits, ``take_posted`` finds the earliest one that
    matches and compares its posting number (``Op.seq``) with that of the
    oldest plain receive of the message's (peer, tag): the earlier of the two
    takes the message, a pattern bound to the message's peer and tag first,
    so that the link moves it like any other. A pattern posted after
    messages were filed takes the earliest filed one it matches
    (``Message.seq``), always the head of a (peer, tag) queue, so messages of
    one peer and tag never overtake each other. Probes wait in ``_probes`` and
    complete when a matching message is filed; they never take it. A pattern
    from several peers is posted without ``recv_posted`` (no one link to
    ask): the links' next progress delivers to it. Plain receives pay one test
    of ``_wild`` per message; nothing else on their path changes.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from plait.errors import MismatchError, PeerLostError
from plait.transport.base import Handle
from plait.transport.link import Link, Message, Op

__all__ = ["PatternMatching", "Wildcard", "lost_error"]


def lost_error(lost: str | BaseException) -> BaseException:
    """The error of an operation with a lost peer (see :meth:`Endpoint.lose`)."""
    return PeerLostError(lost) if isinstance(lost, str) else lost


def _writable(into: memoryview) -> memoryview:
    """``into`` as writable bytes (1-D, format ``B``)."""
    mv = into if isinstance(into, memoryview) else memoryview(into)
    if not mv.c_contiguous:
        raise ValueError("into must be a contiguous buffer")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    if mv.readonly:
        raise ValueError("into is read-only; it must be writable")
    return mv


class PatternMatching:
    """Pattern receives and probes, mixed into the endpoint (Note [patterns]).

    Every method takes the endpoint's lock itself or says that it must be held.
    """

    if TYPE_CHECKING:
        rank: int
        size: int
        _me: int
        _lock: threading.Lock
        _closed: bool
        _completed: int
        _unexpected: dict[tuple[int, int], deque[Message]]
        _posted: dict[tuple[int, int], deque[Op]]
        _route: list[Link | None]
        _lost: list[str | BaseException | None]

        def fail(self, op: Op, err: BaseException) -> None: ...
        def complete(self, op: Op) -> None: ...
        def mismatch(self, op: Op, check: int, nbytes: int) -> MismatchError | None: ...
        def _take(self, op: Op, msg: Message) -> None: ...
        def closed_error(self) -> BaseException: ...
        def _after_progress(self) -> None: ...
        def _not_a_peer(self, peer: int) -> ValueError: ...

    def _init_patterns(self) -> None:
        # Receives and probes posted with a pattern, in posting order, and the counters
        # that order receives (Op.seq) and filed messages (Message.seq).
        self._wild: list[Wildcard] = []
        self._probes: list[Wildcard] = []
        self._posts = 0
        self._arrivals = 0

    def irecv_match(
        self, peers: Sequence[int] | None, tag: int, mask: int, into: memoryview, check: int
    ) -> Wildcard:
        """Start receiving ``len(into)`` bytes of the first message matching a pattern.

        See :class:`~plait.transport.base.Matching` and Note [patterns].
        """
        allowed = self._pattern_peers(peers)
        if (
            into.__class__ is not memoryview
            or into.format != "B"
            or into.ndim != 1
            or not into.c_contiguous
            or into.readonly
        ):
            into = _writable(into)
        op = Wildcard(allowed, tag, mask, into, check, False)
        with self._lock:
            if self._closed:
                self.fail(op, self.closed_error())
            elif (found := self._earliest(op)) is not None:
                self._take(op, self._unfile(op, *found))
            elif (err := self._hopeless(op)) is not None:
                self.fail(op, err)
            else:
                op.seq = self._posts
                self._posts += 1
                self._wild.append(op)
                if op.peer >= 0:  # one peer: its link may have the message at hand
                    link = self._route[op.peer]
                    assert link is not None
                    link.recv_posted(op)
            if self._completed:
                self._after_progress()
        return op

    def probe(self, peers: Sequence[int] | None, tag: int, mask: int) -> Wildcard:
        """A handle done once a message matching the pattern has arrived; it stays there.

        See :class:`~plait.transport.base.Matching`. Messages that links keep
        until their receive is posted (shared memory) are taken in when the
        endpoint is stalled, so a wait on the probe sees them.
        """
        op = Wildcard(self._pattern_peers(peers), tag, mask, memoryview(b""), 0, True)
        with self._lock:
            if self._closed:
                self.fail(op, self.closed_error())
            elif (found := self._earliest(op)) is not None:
                key, queue = found
                op.describe(key, queue[0])
                self.complete(op)
            elif (err := self._hopeless(op)) is not None:
                self.fail(op, err)
            else:
                self._probes.append(op)
            if self._completed:
                self._after_progress()
        return op

    def withdraw(self, handle: Handle) -> bool:
        """Cancel a receive or probe that has matched no message yet; whether it was one.

        Unlike :meth:`cancel`, a receive whose message has begun to arrive is
        left to complete (MPI's cancel). Sends are never withdrawn (False).
        """
        if not isinstance(handle, Op):
            raise TypeError(f"rank {self._me}: {handle!r} is not a handle of this transport")
        with self._lock:
            if handle.done or handle.is_send:
                return False
            if isinstance(handle, Wildcard):
                waiting = self._probes if handle.probing else self._wild
                if handle not in waiting:
                    return False
                waiting.remove(handle)
            else:
                key = (handle.peer, handle.tag)
                queue = self._posted.get(key)
                if queue is None or handle not in queue:
                    return False
                queue.remove(handle)
                if not queue:
                    del self._posted[key]
            handle.done = True
            self._completed += 1
            self._after_progress()
            return True

    def envelope(self, handle: Handle) -> tuple[int, int, int, int]:
        """``(peer, tag, nbytes, check)`` of what a done receive or probe matched."""
        if not isinstance(handle, Op):
            raise TypeError(f"rank {self._me}: {handle!r} is not a handle of this transport")
        return handle.peer, handle.tag, handle.nbytes, handle.check

    # -- for links (lock held) -----------------------------------------------------------------
    def repost(self, op: Op) -> None:
        """Put receive ``op`` back among the posted receives: the message it had taken (from
        :meth:`take_posted` or a filed one) was withdrawn by its sender before a byte of it
        came, so nothing of it is in ``op``'s buffer (Note [withdrawn messages] in
        :mod:`plait.transport.tcp.rendezvous`).

        The invariant it keeps: ``op`` is as if that message had never matched it. It goes
        back where it was in posting order (its posting number, ``Op.seq``), ahead of every
        receive posted after it, so it takes the next message that matches it before they
        do; a pattern is unbound from the withdrawn message's peer and tag. If a message it
        matches was filed meanwhile, it takes the first such at once: none filed before
        ``op`` took the withdrawn one can match it (it would have taken that one instead),
        so that is the next its sender sent. Like ``irecv`` and ``irecv_match`` for a receive
        posted already: its link is not told again (the link that calls this moves it).
        """
        if isinstance(op, Wildcard):
            peers = op.peers
            op.peer = min(peers) if peers is not None and len(peers) == 1 else -1
            op.tag = op.want
            found = self._earliest(op)
            if found is not None:
                self._take(op, self._unfile(op, *found))
                return
            wild = self._wild
            wild.insert(next((i for i, w in enumerate(wild) if w.seq > op.seq), len(wild)), op)
            return
        key = (op.peer, op.tag)
        filed = self._unexpected.get(key)
        if filed:
            msg = filed.popleft()
            if not filed:
                del self._unexpected[key]
            self._take(op, msg)
            return
        queue = self._posted.setdefault(key, deque())
        queue.insert(next((i for i, o in enumerate(queue) if o.seq > op.seq), len(queue)), op)

    # -- patterns (lock held; Note [patterns]) --------------------------------------------------
    def _pattern_peers(self, peers: Sequence[int] | None) -> frozenset[int] | None:
        """``peers`` of a pattern, checked: None (any rank) or a set of reachable ranks."""
        if peers is None:
            return None
        allowed = frozenset(int(p) for p in peers)
        if not allowed:
            raise ValueError(f"rank {self._me}: a pattern must name at least one peer, or None")
        for p in allowed:
            if not 0 <= p < self.size or self._route[p] is None:
                raise self._not_a_peer(p)
        return allowed

    def _take_wild(self, peer: int, tag: int, before: int | None) -> Wildcard | None:
        """The earliest pattern receive that takes a message of (``peer``, ``tag``), bound to it.

        None if none matches, or if a plain receive posted as number ``before``
        came first.
        """
        for i, w in enumerate(self._wild):
            if (w.peers is None or peer in w.peers) and tag & w.mask == w.want:
                if before is not None and before < w.seq:
                    return None
                del self._wild[i]
                w.peer, w.tag = peer, tag
                return w
        return None

    def _earliest(self, w: Wildcard) -> tuple[tuple[int, int], deque[Message]] | None:
        """The key and queue of the earliest filed message that ``w`` matches, or None."""
        best: tuple[tuple[int, int], deque[Message]] | None = None
        for key, queue in self._unexpected.items():
            if (
                (w.peers is None or key[0] in w.peers)
                and key[1] & w.mask == w.want
                and (best is None or queue[0].seq < best[1][0].seq)
            ):
                best = (key, queue)
        return best

    def _unfile(self, w: Wildcard, key: tuple[int, int], queue: deque[Message]) -> Message:
        """Take the first message of ``queue`` (filed under ``key``) for ``w``, binding ``w``."""
        msg = queue.popleft()
        if not queue:
            del self._unexpected[key]
        w.peer, w.tag = key
        return msg

    def _notice(self, peer: int, tag: int, msg: Message) -> None:
        """Complete the probes that ``msg``, just filed, matches; wake their waiters."""
        hit = False
        for w in list(self._probes):
            if (w.peers is None or peer in w.peers) and tag & w.mask == w.want:
                self._probes.remove(w)
                w.describe((peer, tag), msg)
                self.complete(w)
                hit = True
        if hit:
            self._after_progress()  # a sender's thread may file it (memory): wake ours

    def _hopeless(self, w: Wildcard) -> BaseException | None:
        """The error of ``w`` if every peer it may match, other than this rank, is lost."""
        last: str | BaseException | None = None
        for q in range(self.size) if w.peers is None else w.peers:
            if q != self.rank:
                lost = self._lost[q]
                if lost is None:
                    return None
                last = lost
        if last is None:  # no other peer: this rank is never lost to itself
            return None
        if w.peers is not None and len(w.peers) == 1:
            return lost_error(last)
        return PeerLostError(
            f"rank {self._me}: every rank a {'probe' if w.probing else 'receive'} from any of "
            f"several ranks could match has been lost (the last: {lost_error(last)})"
        )


class Wildcard(Op):
    """A receive or probe posted with a pattern (Note [patterns]).

    ``peers`` (None: any rank) and ``want``/``mask`` say which messages it
    matches: those from a rank in ``peers`` whose tag ``t`` has
    ``t & mask == want``. Until it matches, ``peer`` is -1 (or the one
    peer it names) and ``tag`` is ``want``; matching sets both to the
    message's. A probe (``probing``) also takes the message's ``nbytes`` and
    ``check``, and leaves the message where it is.
    """

    __slots__ = ("mask", "peers", "probing", "want")

    def __init__(
        self,
        peers: frozenset[int] | None,
        tag: int,
        mask: int,
        buf: memoryview,
        check: int,
        probing: bool,
    ) -> None:
        one = peers is not None and len(peers) == 1
        super().__init__(min(peers) if one and peers else -1, tag & mask, buf, check, False)
        self.peers = peers
        self.mask = mask
        self.want = tag & mask
        self.probing = probing

    def describe(self, key: tuple[int, int], msg: Message) -> None:
        """A probe found ``msg``, filed under ``key``: take its envelope."""
        self.peer, self.tag = key
        self.nbytes, self.check = msg.nbytes, msg.check

    def __repr__(self) -> str:
        what = "probe" if self.probing else "recv"
        peers = "any rank" if self.peers is None else f"ranks {sorted(self.peers)}"
        state = "failed" if self.error else "done" if self.done else "pending"
        return f"<{what} from {peers} tag {self.want:#x}/{self.mask & (2**64 - 1):#x} {state}>"
