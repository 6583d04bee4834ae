"""The shared-memory window: each rank's arena in its own segment, read in place by its peers.

Every rank's segment ends in an *arena* (Note [segment layout] in ``docs/transport.md``):
a header with the rank's counter on a cache line of its own and its two digest words
on the next, then two halves of ``capacity`` bytes each, page-aligned. Peers map the
segment already (the rendezvous hands it over), so :meth:`ShmWindow.peer` is a numpy
view of a peer's half and reading it is a plain copy. Counters and digests go
through the segment's counter words (libatomic on weakly ordered CPUs), halves are
copied with numpy, and the order of the two follows Note [memory ordering]: a rank
writes its half and then posts, a peer waits for the counter and then reads.
Waiting polls the counter and then sleeps on the link's doorbell (Note [doorbells
and waiting]): the wait becomes an operation of the
:class:`~plait.transport.shm.link.ShmLink` that the endpoint drives, sleeps on and
fails when the peer is lost, as it does for messages.

Note [window reuse]
~~~~~~~~~~~~~~~~~~~

Calls alternate halves: call ``n`` (its ``epoch``, numbered alike on every rank)
uses half ``n & 1`` of every rank's window, the half that call ``n - 2`` used
last. Why a rank ``r`` may overwrite its half ``h = n & 1`` once ``begin(n)`` has
returned:

* A peer reads ``r``'s half for call ``m`` only while it is in call ``m``: after
  seeing a phase of call ``m`` that ``r`` posted (a GET waits for it first), and
  before it ends ``m`` (its reads are numpy copies that have returned before its
  ``end`` stores the counter; TSO keeps load-then-store order, and so does a
  seq_cst store).
* ``begin(n)`` waits until every peer's counter is at least ``(n - 1) << 32``,
  the value of ``end(n - 2)``, which any phase of call ``n - 1`` exceeds too: every
  peer has ended call ``n - 2`` or posted in call ``n - 1`` (a rank's calls run one
  after the other, so it has then finished ``n - 2`` and all calls before it), so
  nobody reads half ``h`` for an older call any more. Hence a call whose schedule
  posts a phase need not ``end``: its first post says as much (the executor ends
  only the calls that post nothing).
* Nobody reads half ``h`` for a later call ``n + 2, n + 4, ...`` yet: ``r`` posts
  no phase of those before it has ended call ``n``.
* Within call ``n`` the schedule orders every overwrite of a region after the
  phases its readers post once they have read it (:mod:`plait.schedule.ir`).

So while ``r`` is in call ``n`` every peer is in call ``n - 1`` or later, ranks
drift at most one call apart, and the two calls that may run at once never share
a half.

The digest word of each half follows the same rule: ``begin(n)`` stores it after
the wait above and before any phase of call ``n`` is posted; a peer reads it after
seeing a phase of call ``n`` from its owner (so it reads this call's value, "word,
then counter" against "counter, then word" as for data); and the owner stores it
again only in ``begin(n + 2)``, after every peer has ended call ``n``. Counters are
written by their owner only and only grow (``(epoch << 32) | phase``, then
``(epoch + 1) << 32`` at the end of the call), so "at least ``v``" never turns
false again and no read-modify-write is needed.

Note [split windows]
~~~~~~~~~~~~~~~~~~~~

A communicator from ``comm.split`` numbers its one-sided calls from 0 (its own
epochs), and its calls interleave with the parent's in program order, so it
cannot use the parent's arena: two calls of epoch ``n`` (one of each) would
write the same half and post the same counter values. So its ranks get a
window of their own (:meth:`ShmWindow.split`, called by the group's
``GroupTransport`` when it is made):

* Memory: every rank of the group creates one more segment, a control block and
  an arena of the parent's capacity (no rings: ``W_SLOTS`` 0), named
  ``plait-<job>-split-<group rank>-<random>``, a file without a name in
  ``/dev/shm`` (:func:`~plait.transport.shm.segment.create`). Only its control
  block, its arena's header and the first ``GROUP_WINDOW_BYTES`` (256 KiB) of
  each half are reserved (``posix_fallocate``), and neither it nor its peers map
  pages ahead (no ``MAP_POPULATE``): a split then costs about 1.5-2.5 ms on 2
  ranks and 4-6 ms on 3, against 8-19 ms with 2 MiB halves reserved and mapped
  ahead. The window grows on demand: the first call whose schedule needs more of
  a half (its ``shared_count``; :meth:`ShmWindow.reserve`, called where the
  schedule is compiled for the window, once per schedule, and, a comparison, at
  the start of each call of a timed or mixed schedule) reserves at least twice as
  much of both halves of the rank's own segment,
  through the segment's file, which the rank keeps open for it. Only the rank
  writes its halves, and a peer reads only what the rank wrote in the same call,
  so no other rank needs to know: the growth is local, takes no message, and
  cannot fault for want of memory later (a SIGBUS); where the OS has no room it
  fails that call on that rank with TransportError, which gives the call up and
  so fails it on the peers at once (Note [stall probes] in :mod:`plait.runtime.stall`);
  as after any failed call, the group's communicator is then broken.
  The ranks
  announce ``<random>:<bytes>`` to each other through the parent's messages
  (:func:`~plait.transport.window.exchange`, with a tag made from the group's
  communicator id: Note [wire tags] in :mod:`plait.group`) instead of the
  store, and then run the rendezvous of the transport itself
  (:func:`~plait.transport.shm.bootstrap.join_window`): each listens on an
  abstract socket, the ranks connect, check each other's user and the set-up's
  nonce (the tag: a connection meant for another set-up of the same ranks is
  refused), hand their segment's open file over (``SCM_RIGHTS``), map each
  other's with the same checks, say so, and close these sockets. No name in
  ``/dev/shm`` ever refers to a segment, so nothing stays there after any
  exit, kill -9 included.
* Failing to set it up: a rank that cannot create its segment or its socket
  (``/dev/shm`` full, no descriptors left) announces none, and then no rank of
  the group gets a window: the group's calls go through messages, as they did
  before. A rank that fails after the announcements writes ``F`` and its
  error's text to every peer (connecting to those that wait for its
  connection), so that they raise at once, naming it; a rank waiting for a
  peer looks every 0.1 s whether its own transport was closed or aborted (it
  raises that error: ClosedError, AbortedError) and whether a peer's process
  ended or its transport closed (the closed word in its control block:
  PeerLostError). No rank waits out the set-up's timeout for a set-up that
  cannot complete. The messages of a failed set-up that no rank took stay
  unread: the next set-up has another tag.
* Waiting and failing: the group's counters are waited on through the parent
  transport's link, as :class:`CounterWait` operations naming the peer by its
  rank there; its doorbells wake the sleepers (a post rings only the group's
  peers whose sleeping flag, in their transport's control block, is up, after
  the same store-fence-load), and the loss of a peer's process or transport fails
  the waits on its counters with PeerLostError, as in the parent's window.
* Reuse: the group's calls alternate the halves of the group's window by the
  group's epochs (Note [window reuse], which holds for each window on its own:
  it only uses the window's own counters, and a rank's calls of one
  communicator run one after the other); the parent's calls use the parent's
  halves and counters. The two share no byte of memory and no counter, so
  however they interleave, neither can overwrite what a reader of the other
  still reads. A split of a split gets its own the same way (its peers named
  through both renumberings).
* Release: closing the group releases its window (its views and the segments it
  mapped); closing the transport releases the windows of every group still
  open (the link keeps them, weakly); process exit unmaps the rest. A peer's
  memory stays mapped by whoever still maps it, so closing one rank's group
  never pulls memory from under another rank. A group of one rank gets no window.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from plait.errors import RendezvousError
from plait.transport.base import Handle, Transport, may_spin
from plait.transport.link import Op
from plait.transport.shm.segment import CONTROL_BYTES, W_SLEEPING, Fence, Segment
from plait.transport.window import (
    DEFAULT_WINDOW_BYTES,
    GROUP_WINDOW_BYTES,
    MASK64,
    PHASE_BITS,
    Poster,
    Probe,
    Window,
    check_half,
    decreasing_error,
    exchange,
    own_counter_error,
)

if TYPE_CHECKING:
    from plait.transport.endpoint import Endpoint
    from plait.transport.shm.link import ShmLink
    from plait.transport.shm.wire import Joined

__all__ = [
    "ARENA_HEADER",
    "POLLS",
    "YIELDS",
    "CounterWait",
    "ShmWindow",
    "arena_bytes",
    "check_arena",
    "half_stride",
    "window_bytes",
]

#: Bytes of the arena's header, before the halves (a page, so halves are page-aligned).
ARENA_HEADER = 4096
#: Reads of a peer's counter in place before a wait (Window.polls), each a few tens of
#: nanoseconds: with 2 ranks, each with a core, a loop of 8-byte calls took 2-6 % less
#: time per allreduce and 10-25 % per broadcast, alike from 32 reads up
#: (docs/performance.md, "Small calls on one host, a fifth time").
POLLS = 128
#: :attr:`ShmWindow.yields` where ranks outnumber cores. A rank that has a core to itself
#: for a while (the scheduler put three ranks on the other) gets each ``sched_yield`` back
#: at once, so the count must cover a few of the others' calls: with 4 ranks on 2 cores, a
#: loop of 8-byte allreduces went through the whole wait thousands of times in 4,000 calls
#: with 16 or 32 of them on some runs, and at most twice with 128 or 256
#: (docs/performance.md, "Four ranks on two cores, again").
YIELDS = 128
_PAGE = 4096
# Word indexes (8-byte units) into the arena header.
#: The owner's counter, on a cache line of its own (peers poll it).
_W_COUNTER = 0
#: The digest words of half 0 and half 1, on the next cache line.
_W_DIGEST = 64 // 8
_SIZE = re.compile(r"\s*(\d+)\s*([kKmMgG]?)i?[bB]?\s*")


def half_stride(capacity: int) -> int:
    """Bytes from the start of half 0 to half 1: ``capacity`` rounded up to a page."""
    return -(-capacity // _PAGE) * _PAGE


def arena_bytes(capacity: int) -> int:
    """Bytes of an arena with halves of ``capacity`` bytes (0: no window, no arena)."""
    return ARENA_HEADER + 2 * half_stride(capacity) if capacity else 0


def arena_ranges(offset: int, capacity: int, reserved: int) -> list[tuple[int, int]]:
    """The ``(offset, length)`` byte ranges of a segment to reserve for its control block,
    an arena at ``offset`` with halves of ``capacity`` bytes, and the first ``reserved``
    bytes of each half (Note [split windows])."""
    start = offset + ARENA_HEADER
    n = min(half_stride(reserved), capacity)
    return [(0, start + n), (start + half_stride(capacity), n)]


def window_bytes(explicit: int | None = None) -> int:
    """Bytes of one half: ``explicit``, else PLAIT_SHM_WINDOW, else 2 MiB (0: no window).

    PLAIT_SHM_WINDOW is a byte count with an optional binary suffix (``65536``,
    ``64K``, ``2M``).

    Raises:
        ValueError: the setting is not a size in bytes (named), or ``explicit`` < 0.
    """
    if explicit is not None:
        if explicit < 0:
            raise ValueError(f"window_bytes must be a number of bytes >= 0, got {explicit}")
        return int(explicit)
    text = os.environ.get("PLAIT_SHM_WINDOW", "")
    if not text.strip():
        return DEFAULT_WINDOW_BYTES
    match = _SIZE.fullmatch(text)
    if match is None:
        raise ValueError(
            f"PLAIT_SHM_WINDOW={text!r} is not a size in bytes (e.g. 2097152 or 2M; 0: no window)"
        )
    return int(match.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[match.group(2).lower()]


def check_arena(offset: int, capacity: int, nbytes: int, me: int, path: str) -> None:
    """Refuse a window geometry that a segment of ``nbytes`` bytes cannot hold.

    Raises:
        RendezvousError: the geometry recorded in the segment ``path`` does not fit it.
    """
    if offset == 0 and capacity == 0:
        return
    if (
        offset < CONTROL_BYTES
        or offset % _PAGE
        or capacity <= 0
        or offset + arena_bytes(capacity) > nbytes
    ):
        raise RendezvousError(
            f"rank {me}: {path} records a window ({capacity} bytes per half at offset "
            f"{offset}) outside its {nbytes} bytes"
        )


_NOTHING = memoryview(b"")


class CounterWait(Op):
    """An operation of a :class:`~plait.transport.shm.link.ShmLink`: ``words[index] >= value``.

    The link completes it in ``progress`` once rank ``peer``'s counter (word
    ``index`` of ``words``, the peer's segment) reaches ``value``, and fails it
    when the peer is lost first (PeerLostError), or another of ``members`` (the
    window's ranks and their counters) is lost before it began the call (Note
    [members lost]), or the endpoint closes.
    """

    __slots__ = ("index", "members", "value", "words")

    def __init__(self, peer: int, words: Any, index: int, value: int, members: Any) -> None:
        super().__init__(peer, 0, _NOTHING, 0, False)
        self.words, self.index, self.value, self.members = words, index, value, members

    def __repr__(self) -> str:
        state = "failed" if self.error else "done" if self.done else "pending"
        return f"<wait for rank {self.peer}'s counter >= {self.value:#x} {state}>"


class ShmWindow(Window):
    """Rank ``rank``'s window among the ranks of one shared-memory transport, or of a group.

    Made by :meth:`build` (the transport's) or :meth:`split` (a group's); see the
    module docstring and :class:`~plait.transport.window.Window`.

    Args:
        endpoint, link: the transport whose link sleeps on the doorbells, notices
            lost peers and completes the :class:`CounterWait` operations.
        rank: this rank in the window's numbering.
        arenas: for every rank of the window, in its numbering, ``(its rank in
            the endpoint, the segment holding its arena, the arena's offset)``.
        capacity: bytes of each half (the same on every rank).
        owned: segments this window maps for itself (a group's), unmapped by
            :meth:`release`; the transport's own belong to its link.
        reserved: bytes of each of this rank's halves backed by memory so far, where
            not all (a group's: its segment's file is open to reserve more).
    """

    def __init__(
        self,
        endpoint: Endpoint,
        link: ShmLink,
        rank: int,
        arenas: Sequence[tuple[int, Segment, int]],
        capacity: int,
        *,
        owned: Sequence[Segment] = (),
        reserved: int | None = None,
    ) -> None:
        self.rank = rank
        self.size = len(arenas)
        self.capacity = capacity
        self._reserved = capacity if reserved is None else reserved
        _, seg, offset = arenas[rank]
        self._mine = seg, offset + ARENA_HEADER
        self._ep = endpoint
        self._link = link
        self._fence = Fence()
        #: More ranks on this host than cores: yield the CPU between polls (Note [windows]).
        self._crowded = endpoint.size > (os.cpu_count() or 1)
        self._released = False
        self._releasing = threading.Lock()
        self._last = 0
        self._owned = list(owned)
        #: Each rank's rank in the endpoint (the link's numbering: waits, losses, doorbells).
        self._roots = [root for root, _, _ in arenas]
        self.members = tuple(self._roots)
        self._ring = [root for q, root in enumerate(self._roots) if q != rank]
        self._ctr: list[tuple[Any, int]] = []
        self._digests: list[tuple[Any, int]] = []
        self._halves: list[tuple[np.ndarray, np.ndarray]] = []
        self._flags: list[Any] = []  # each peer's control words (its sleeping flag)
        for q, (root, seg, offset) in enumerate(arenas):
            words = seg.words
            self._ctr.append((words, offset // 8 + _W_COUNTER))
            self._digests.append((words, offset // 8 + _W_DIGEST))
            self._halves.append(_halves(seg.arr, offset, capacity, writable=q == rank))
            if q != rank:
                peer = link.by_rank[root].seg
                if peer is None:  # the transport has closed: its link has unmapped it
                    raise endpoint.closed_error()
                self._flags.append(peer.words)
        #: Each peer's (rank, words, index of its counter): what begin reads.
        self._peer_ctr = [(q, w, i) for q, (w, i) in enumerate(self._ctr) if q != rank]
        self._words: Any = self._ctr[rank][0]
        self._index = self._ctr[rank][1]
        self._digest = self._digests[rank][1]

    @classmethod
    def build(
        cls, endpoint: Endpoint, link: ShmLink, joined: Joined, members: Sequence[int] = ()
    ) -> ShmWindow | None:
        """The window of ``joined``'s ranks, or None when some rank has none (all agree).

        Its capacity is the smallest any rank recorded, so every rank computes the same.
        ``members``: the endpoint's ranks that share it, in order, where they are not
        all of them (a host's ranks in a job over several hosts); a window rank is an
        index into it.
        """
        capacity = _agreed(joined)
        if capacity == 0:
            return None
        me = endpoint.rank
        arenas = _arenas(joined, me)
        # Crowded (yield between polls) by the endpoint's size even where it spans hosts:
        # hosts emulated on one machine share its cores, and a yield costs little where
        # nothing else is ready to run.
        return cls(endpoint, link, list(members).index(me) if members else me, arenas, capacity)

    def split(
        self, group: Transport, ranks: Sequence[int], tag: int, deadline: float
    ) -> ShmWindow | None:
        """A group's window in segments of its own (Note [split windows]; :meth:`Window.split`)."""
        from plait.transport.shm.bootstrap import join_window  # it imports this module

        if group.size < 2:
            return None
        ep, link = self._ep, self._link
        if self._released or ep.closed:
            raise ep.closed_error()
        roots = [self._roots[r] for r in ranks]

        def stopped() -> BaseException | None:
            return ep.closed_error() if ep.closed or self._released else None

        joined = join_window(
            group.rank,
            group.size,
            names=[ep.name(r) for r in roots],
            job=link.job,
            window=self.capacity,
            reserved=GROUP_WINDOW_BYTES,
            announce=lambda mine: exchange(group, mine, tag, deadline),
            timeout=max(deadline - time.monotonic(), 1e-3),
            nonce=tag,
            alive=lambda q: link.alive(roots[q]),
            stopped=stopped,
        )
        if joined is None:
            return None
        segments = [joined.seg, *(w.seg for w in joined.wires if w.seg is not None)]
        for w in joined.wires:  # the handover is done: the link's doorbells serve from here on
            if w.sock is not None:
                w.sock.close()
                w.sock = None
        try:
            capacity = _agreed(joined)
            arenas = [
                (roots[q], seg, offset)
                for q, (_, seg, offset) in enumerate(_arenas(joined, group.rank))
            ]
            # Under the lock: the transport cannot close (and its link unmap the peers'
            # control blocks, which the window reads) between the look and the window.
            with ep.lock:
                error = stopped()
                if error is not None:
                    raise error
                reserved = min(half_stride(GROUP_WINDOW_BYTES), capacity)  # as join_window did
                window = ShmWindow(
                    ep, link, group.rank, arenas, capacity, owned=segments, reserved=reserved
                )
                link.keep(window)  # released with the transport, if not before
        except BaseException:
            for seg in segments:
                seg.release()
            raise
        return window

    # -- the data --------------------------------------------------------------------------------
    def reserve(self, nbytes: int) -> None:
        """Back the first ``nbytes`` of each of this rank's halves with memory (see
        :meth:`Window.reserve`): at least twice what was, so that a few growths reach any
        size; a group's window grows so (Note [split windows])."""
        if nbytes <= self._reserved:
            return
        with self._releasing:  # not while the group or the transport closes
            if self._released:
                raise self._ep.closed_error()
            if nbytes <= self._reserved:  # another thread grew it meanwhile
                return
            seg, start = self._mine
            n = min(max(half_stride(nbytes), 2 * self._reserved), self.capacity)
            for at in (start, start + half_stride(self.capacity)):
                seg.reserve(at, n, self._ep.rank)
            self._reserved = n

    def local(self, half: int) -> np.ndarray:
        """This rank's half (see :meth:`Window.local`)."""
        check_half(half)
        return self._halves[self.rank][half]

    def peer(self, q: int, half: int) -> np.ndarray:
        """Rank ``q``'s half, read-only for a peer (see :meth:`Window.peer`)."""
        check_half(half)
        return self._halves[q][half]

    def digest(self, q: int, half: int) -> int:
        """Rank ``q``'s digest word for ``half``."""
        if half != 0 and half != 1:  # check_half(half), inlined: read on every call
            check_half(half)
        words, index = self._digests[q]
        if words is None:
            raise self._ep.closed_error()
        return int(words[index + half])

    def begin(self, epoch: int, digest: int, deadline: float | None) -> int:
        """:meth:`Window.begin`, with each peer's counter read here first: once a rank runs
        one call after another, its peers have nearly always ended the call before."""
        need = (epoch - 1) << PHASE_BITS
        if need > 0:
            for q, words, index in self._peer_ctr:
                try:
                    behind = words[index] < need
                except (TypeError, ValueError):  # released: the transport is closed
                    raise self._ep.closed_error() from None
                if behind and (deadline == 0.0 or not self._wait(q, need, deadline)):
                    return -1
        half = epoch & 1
        try:  # self._set_digest(half, digest & MASK64), inlined
            self._words[self._digest + half] = digest & MASK64
        except (TypeError, ValueError):
            raise self._ep.closed_error() from None
        return half

    def peer_state(self, q: int, half: int) -> tuple[int, int]:
        """Rank ``q``'s digest word for ``half`` and its counter (see :meth:`Window.peer_state`)."""
        if half != 0 and half != 1:
            check_half(half)
        words, index = self._digests[q]
        counters, at = self._ctr[q]
        if words is None or counters is None:
            raise self._ep.closed_error()
        return int(words[index + half]), int(counters[at])

    def probe(self, q: int, half: int) -> Probe:
        """Rank ``q``'s counter and digest word for ``half`` in its segment's words (see
        :meth:`Window.probe`): after :meth:`release`, the words raise ValueError."""
        check_half(half)
        words, index = self._ctr[q]
        digests, at = self._digests[q]
        if words is None or digests is None:
            raise self._ep.closed_error()
        return words, index, digests, at + half

    def _set_digest(self, half: int, digest: int) -> None:
        try:
            self._words[self._digest + half] = digest
        except (TypeError, ValueError):
            raise self._ep.closed_error() from None

    def counter(self, q: int) -> int:
        """Rank ``q``'s counter."""
        words, index = self._ctr[q]
        if words is None:
            raise self._ep.closed_error()
        return int(words[index])

    # -- posting and waiting ---------------------------------------------------------------------
    def poster(self) -> Poster:
        """Where a caller posts in place (see :meth:`Window.poster`)."""
        return self._words, self._index, self._fence.lock, tuple(self._flags), W_SLEEPING

    def post(self, value: int) -> None:
        """Publish ``value``; ring peers asleep in poll (see :meth:`Window.post`)."""
        if value < self._last:
            raise decreasing_error(self.rank, self._last, value)
        try:
            self._words[self._index] = value  # after the half's bytes (Note [memory ordering])
            self._last = value
            # store, fence, load: Dekker with a peer going to sleep (self._fence(), inlined)
            fence = self._fence.lock
            if fence is not None:
                fence.acquire()
                fence.release()
            for flags in self._flags:
                if flags[W_SLEEPING]:
                    self._wake()
                    return
        except (TypeError, ValueError):  # released: the transport is closed
            raise self._ep.closed_error() from None

    def _wake(self) -> None:
        ep = self._ep
        with ep.lock:
            if not ep.closed:
                self._link.ring_sleepers(self._ring)

    @property
    def polls(self) -> int:
        """:data:`POLLS` where a waiting rank may spin and has a core of its own, else 0
        (see :attr:`Window.polls`)."""
        return 0 if self._crowded or self._ep.spin <= 0 or not may_spin() else POLLS

    @property
    def yields(self) -> int:
        """:data:`YIELDS` where ranks outnumber the host's cores and a waiting rank may spin,
        else 0 (see :attr:`Window.yields`)."""
        return YIELDS if self._crowded and self._ep.spin > 0 and may_spin() else 0

    def wait(self, q: int, value: int, deadline: float | None) -> bool:
        """Until rank ``q``'s counter reaches ``value`` (see :meth:`Window.wait`)."""
        words, index = self._ctr[q]
        try:
            if words[index] >= value:
                return True
        except (TypeError, ValueError):  # released: the transport is closed
            raise self._ep.closed_error() from None
        return self._wait(q, value, deadline)

    def watch(self, q: int, value: int) -> Handle | None:
        """A :class:`CounterWait` of the link, done when ``q`` posts ``value`` (see
        :meth:`Window.watch`)."""
        words, index = self._ctr[q]
        try:
            if words[index] >= value:
                return None
        except (TypeError, ValueError):  # released: the transport is closed
            raise self._ep.closed_error() from None
        if q == self.rank:
            raise own_counter_error(q, int(words[index]), value)
        return self._watch(q, words, index, value)

    def _watch(self, q: int, words: Any, index: int, value: int) -> CounterWait:
        """A :class:`CounterWait` on ``q``'s counter, handed to the link (which completes it)."""
        w = CounterWait(self._roots[q], words, index, value, (self._roots, self._ctr))
        ep = self._ep
        with ep.lock:
            if ep.closed:
                raise ep.closed_error()
            self._link.watch_counter(w)
        return w

    def unwatch(self, handle: Handle) -> None:
        """Forget a watch (see :meth:`Window.unwatch`)."""
        ep = self._ep
        with ep.lock:
            if isinstance(handle, CounterWait):
                self._link.unwatch_counter(handle)
                handle.done = True

    def _wait(self, q: int, value: int, deadline: float | None) -> bool:
        """Poll, then sleep on the doorbell (Note [doorbells and waiting])."""
        words, index = self._ctr[q]
        if q == self.rank:
            raise own_counter_error(q, int(words[index]), value)
        ep = self._ep
        try:
            spin = ep.spin
            if spin > 0 and may_spin():
                monotonic = time.monotonic
                start = monotonic()
                until = start + spin if deadline is None else min(start + spin, deadline)
                crowded, sched_yield = self._crowded, os.sched_yield
                while True:
                    if words[index] >= value:
                        return True
                    if monotonic() >= until:
                        break
                    if crowded:  # the peer may share our core: a flat-out spin would keep
                        sched_yield()  # it from posting (Note [doorbells and waiting])
            return self._sleep(q, words, index, value, deadline)
        except (TypeError, ValueError):
            if self._released or ep.closed:
                raise ep.closed_error() from None
            raise

    def _sleep(self, q: int, words: Any, index: int, value: int, deadline: float | None) -> bool:
        """Wait through the link: the endpoint sleeps on doorbells and notices lost peers."""
        ep, link = self._ep, self._link
        w = self._watch(q, words, index, value)
        if not w.done:
            try:
                ep.wait_polled([w], deadline)
            finally:
                if not w.done:
                    with ep.lock:
                        link.unwatch_counter(w)
        if w.error is not None:
            raise w.error
        if w.done:
            return True
        if ep.closed:
            raise ep.closed_error()
        return bool(words[index] >= value)

    def release(self) -> None:
        """Drop the views, and unmap a group's segments (its group or the transport closes).

        Later calls raise the transport's closed error. Idempotent.
        """
        with self._releasing:  # the group and the transport may close on two threads at once
            self._released = True
            self._words = None
            self._flags = []
            self._ctr[:] = [(None, 0)] * self.size  # in place: a CounterWait's members too
            self._peer_ctr = []
            self._digests = [(None, 0)] * self.size
            self._halves = [(_EMPTY, _EMPTY)] * self.size
            self.__dict__.pop("_typed", None)  # typed views and compiled schedules hold memory
            self.__dict__.pop("compiled", None)
            self.__dict__.pop("last_compiled", None)
            owned, self._owned = self._owned, []
            for seg in owned:
                seg.release()


_EMPTY = np.zeros(0, dtype=np.uint8)


def _agreed(joined: Joined) -> int:
    """The capacity of a window: the smallest any rank recorded (0: none)."""
    return min([joined.window[1], *(w.window[1] for w in joined.wires)])


def _arenas(joined: Joined, rank: int) -> list[tuple[int, Segment, int]]:
    """``(rank, segment, arena offset)`` of every rank of ``joined``, in rank order."""
    arenas: list[tuple[int, Segment, int]] = [(rank, joined.seg, joined.window[0])]
    for wire in joined.wires:
        assert wire.seg is not None
        arenas.append((wire.rank, wire.seg, wire.window[0]))
    arenas.sort(key=lambda a: a[0])
    return arenas


def _halves(
    arr: np.ndarray, offset: int, capacity: int, *, writable: bool
) -> tuple[np.ndarray, np.ndarray]:
    """The two halves of the arena at ``offset`` of a segment's bytes ``arr``."""
    start = offset + ARENA_HEADER
    stride = half_stride(capacity)
    h0 = arr[start : start + capacity]
    h1 = arr[start + stride : start + stride + capacity]
    if not writable:
        h0.flags.writeable = h1.flags.writeable = False
    return h0, h1
