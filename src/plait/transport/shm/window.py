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
"""

from __future__ import annotations

import os
import re
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from plait.errors import RendezvousError
from plait.transport.base import may_spin
from plait.transport.link import Op
from plait.transport.shm.segment import CONTROL_BYTES, W_SLEEPING, Fence
from plait.transport.window import (
    DEFAULT_WINDOW_BYTES,
    Window,
    check_half,
    decreasing_error,
    own_counter_error,
)

if TYPE_CHECKING:
    from plait.transport.endpoint import Endpoint
    from plait.transport.shm.bootstrap import Joined
    from plait.transport.shm.link import ShmLink

__all__ = [
    "ARENA_HEADER",
    "CounterWait",
    "ShmWindow",
    "arena_bytes",
    "check_arena",
    "half_stride",
    "window_bytes",
]

#: Bytes of the arena's header, before the halves (a page, so halves are page-aligned).
ARENA_HEADER = 4096
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
    when the peer is lost first (PeerLostError) or the endpoint closes.
    """

    __slots__ = ("index", "value", "words")

    def __init__(self, peer: int, words: Any, index: int, value: int) -> None:
        super().__init__(peer, 0, _NOTHING, 0, False)
        self.words = words
        self.index = index
        self.value = value

    def __repr__(self) -> str:
        state = "failed" if self.error else "done" if self.done else "pending"
        return f"<wait for rank {self.peer}'s counter >= {self.value:#x} {state}>"


class ShmWindow(Window):
    """Rank ``rank``'s window among the ranks of one shared-memory transport.

    Made by :meth:`build`; see the module docstring and :class:`~plait.transport.window.Window`.
    """

    def __init__(
        self,
        endpoint: Endpoint,
        link: ShmLink,
        joined: Joined,
        capacity: int,
    ) -> None:
        self.rank = rank = endpoint.rank
        self.size = size = endpoint.size
        self.capacity = capacity
        self._ep = endpoint
        self._link = link
        self._fence = Fence()
        #: More ranks on this host than cores: yield the CPU between polls (Note [windows]).
        self._crowded = size > (os.cpu_count() or 1)
        self._released = False
        self._last = 0
        ctr: list[tuple[Any, int]] = [(None, 0)] * size
        halves: list[tuple[np.ndarray, np.ndarray]] = [(_EMPTY, _EMPTY)] * size
        seg = joined.seg
        offset = joined.window[0]
        ctr[rank] = (seg.words, offset // 8 + _W_COUNTER)
        halves[rank] = _halves(seg.arr, offset, capacity, writable=True)
        self._words: Any = seg.words
        self._index = offset // 8 + _W_COUNTER
        self._digest = offset // 8 + _W_DIGEST
        self._digests: list[tuple[Any, int]] = [(None, 0)] * size
        self._digests[rank] = (seg.words, self._digest)
        self._flags: list[Any] = []  # each peer's control words (its sleeping flag)
        for wire in joined.wires:
            assert wire.seg is not None
            off = wire.window[0]
            words = wire.seg.words
            ctr[wire.rank] = (words, off // 8 + _W_COUNTER)
            self._digests[wire.rank] = (words, off // 8 + _W_DIGEST)
            halves[wire.rank] = _halves(wire.seg.arr, off, capacity, writable=False)
            self._flags.append(words)
        self._ctr = ctr
        self._halves = halves

    @classmethod
    def build(cls, endpoint: Endpoint, link: ShmLink, joined: Joined) -> ShmWindow | None:
        """The window of ``joined``'s ranks, or None when some rank has none (all agree).

        Its capacity is the smallest any rank recorded, so every rank computes the same.
        """
        capacities = [joined.window[1], *(w.window[1] for w in joined.wires)]
        if min(capacities) == 0:
            return None
        return cls(endpoint, link, joined, min(capacities))

    # -- the data --------------------------------------------------------------------------------
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
        check_half(half)
        words, index = self._digests[q]
        if words is None:
            raise self._ep.closed_error()
        return int(words[index + half])

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
    def post(self, value: int) -> None:
        """Publish ``value``; ring peers asleep in poll (see :meth:`Window.post`)."""
        if value < self._last:
            raise decreasing_error(self.rank, self._last, value)
        try:
            self._words[self._index] = value  # after the half's bytes (Note [memory ordering])
            self._last = value
            self._fence()  # store, fence, load: Dekker with a peer going to sleep
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
                self._link.ring_sleepers()

    def wait(self, q: int, value: int, deadline: float | None) -> bool:
        """Until rank ``q``'s counter reaches ``value`` (see :meth:`Window.wait`)."""
        words, index = self._ctr[q]
        try:
            if words[index] >= value:
                return True
        except (TypeError, ValueError):  # released: the transport is closed
            raise self._ep.closed_error() from None
        return self._wait(q, value, deadline)

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
                eager = start + ep.eager_spin
                crowded, sched_yield = self._crowded, os.sched_yield
                while True:
                    if words[index] >= value:
                        return True
                    now = monotonic()
                    if now >= until:
                        break
                    if crowded and now >= eager:
                        sched_yield()  # a peer that shares our core can run and post
            return self._sleep(q, words, index, value, deadline)
        except (TypeError, ValueError):
            if self._released or ep.closed:
                raise ep.closed_error() from None
            raise

    def _sleep(self, q: int, words: Any, index: int, value: int, deadline: float | None) -> bool:
        """Wait through the link: the endpoint sleeps on doorbells and notices lost peers."""
        ep, link = self._ep, self._link
        w = CounterWait(q, words, index, value)
        with ep.lock:
            if ep.closed:
                raise ep.closed_error()
            link.watch_counter(w)
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
        """Drop the views (the transport closes); later calls raise its closed error."""
        self._released = True
        self._words = None
        self._flags = []
        self._ctr = [(None, 0)] * self.size
        self._digests = [(None, 0)] * self.size
        self._halves = [(_EMPTY, _EMPTY)] * self.size


_EMPTY = np.zeros(0, dtype=np.uint8)


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
