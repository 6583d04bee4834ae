"""Windows: memory that the ranks of one host read directly from each other, and counters.

A :class:`Window` gives each rank two *halves* of ``capacity`` bytes that its peers
can read in place, and one *counter* it publishes. One-sided collectives run as
"copy in, post, read the peers' halves, post": a rank writes its half, publishes a
counter value with :meth:`Window.post`, and a peer that has seen that value with
:meth:`Window.wait` reads the half with numpy. Calls are numbered (``epoch`` 0, 1,
2, ... alike on every rank) and alternate halves, so a rank may start writing the
next call while slow peers still read the last one (Note [window reuse] in
:mod:`plait.transport.shm.window`).

Counter values are ``(epoch << 32) | phase`` with ``phase`` in ``1 .. 2**32 - 1``
while call ``epoch`` runs, and ``(epoch + 1) << 32`` once the rank has finished it
(:meth:`Window.end`): every value a rank publishes is larger than the one before.
One call at a time uses a window (its caller, the executor, guarantees it); the
transport it belongs to may meanwhile carry point-to-point traffic of other threads.

Implementations: :class:`MemoryWindow` (threads of one process, the in-process
memory transport) here, and :class:`~plait.transport.shm.window.ShmWindow` (the
shared-memory transport: each rank's window lives in its own segment). A transport
without one has ``window = None``. See ``docs/transport.md`` (Note [windows]).

A split's group gets a window of its own from :meth:`Window.split` (Note [split
windows] in :mod:`plait.transport.shm.window`): new memory, counters and digests,
so that the parent's calls and the group's, which interleave in program order and
number their epochs apart, never share a half or a counter. The ranks agree on it
through :func:`exchange`, an allgather over the group's messages.
"""

from __future__ import annotations

import abc
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from plait.errors import PeerLostError, RendezvousError
from plait.transport.base import OTHER_MEMBER, Handle, Transport, closed_peer
from plait.transport.link import Op

__all__ = [
    "DEFAULT_WINDOW_BYTES",
    "EXCHANGE_BYTES",
    "GROUP_WINDOW_BYTES",
    "MASK64",
    "PHASE_BITS",
    "MemoryArena",
    "MemoryWindow",
    "Poster",
    "Probe",
    "Window",
    "check_half",
    "decreasing_error",
    "exchange",
    "own_counter_error",
]

#: Bytes of one half of each rank's window unless configured otherwise.
DEFAULT_WINDOW_BYTES = 2 << 20
#: Bytes of each half of a split group's window reserved when it is made (:meth:`Window.split`):
#: what the one-shot allreduce needs to take the largest vector ``auto`` gives it (128 KiB,
#: on up to 3 ranks) in one piece. The rest of its capacity (the parent's) is reserved at
#: the first call that needs it (:meth:`Window.reserve`).
GROUP_WINDOW_BYTES = 256 << 10
#: A counter value is ``(epoch << PHASE_BITS) | phase``.
PHASE_BITS = 32
#: A digest word holds the low 64 bits of a call's digest.
MASK64 = (1 << 64) - 1
#: Where a peer's counter and digest word are read directly (:meth:`Window.probe`).
Probe = tuple[Any, int, Any, int]
#: Where this rank posts in place (:meth:`Window.poster`): its counter's words and index,
#: the fence's lock (or None), each peer's control words and the index of its sleeping flag.
Poster = tuple[Any, int, Any, tuple[Any, ...], int]
#: Bytes of one rank's announcement in :func:`exchange`, at most.
EXCHANGE_BYTES = 255
#: The check word of :func:`exchange`'s messages.
_EXCHANGE_CHECK = 0x57494E44  # b"WIND"


class Window(abc.ABC):
    """One rank's view of the windows of ``size`` ranks: its own and its peers'.

    Attributes:
        rank: this rank (in the numbering of the transport it belongs to).
        size: number of ranks.
        capacity: bytes of one half of each rank's window (the same on every rank).
        members: each window rank's rank in the transport that holds its link (a
            host's window in a job over several hosts: the host's ranks in the job);
            empty where the window does not say (the in-process one).
    """

    rank: int
    size: int
    capacity: int
    members: tuple[int, ...] = ()

    @property
    def polls(self) -> int:
        """How many more times a caller that found a peer's counter short may read it in
        place before it calls :meth:`wait` (0: wait at once).

        Where each rank has a core of its own, a peer a moment behind posts within a
        few reads, and :meth:`wait`'s way in costs more than the reads (Note [doorbells
        and waiting] in ``docs/transport.md``); where ranks share cores, are threads of
        one process or must not spin, reading on keeps the peer from running: 0.
        """
        return 0

    @property
    def yields(self) -> int:
        """How many times a caller that found a peer's counter short, and read it :attr:`polls`
        times more, may give up its core (``os.sched_yield``) and read it again before it
        calls :meth:`wait` (0: wait at once).

        Where ranks outnumber cores, the peer waited for often shares this rank's core and
        runs only once this rank lets it; :meth:`wait`'s way in costs a few microseconds
        each time, and a rank that reaches its sleep must be woken. 0 where each rank has a
        core (:attr:`polls` serves there), for threads of one process, and where a rank
        must not spin.
        """
        return 0

    @abc.abstractmethod
    def local(self, half: int) -> np.ndarray:
        """This rank's ``half`` (0 or 1): a writable uint8 array of ``capacity`` bytes.

        The same object every call.
        """

    @abc.abstractmethod
    def peer(self, q: int, half: int) -> np.ndarray:
        """Rank ``q``'s ``half`` as a uint8 array of ``capacity`` bytes (same object every call).

        Read-only for a peer (``q == rank`` gives :meth:`local`). Read it only
        after :meth:`wait` has seen a value ``q`` posted after writing what is read.
        """

    def reserve(self, nbytes: int) -> None:
        """Back the first ``nbytes`` of each of this rank's halves with memory, before a
        call that writes that far runs (memory is reserved once, never per call).

        A window reserved whole when it is made (this base class's) has nothing to do; a
        group's grows here (Note [split windows] in :mod:`plait.transport.shm.window`).

        Raises:
            TransportError: the OS has no room left for it.
            ClosedError, AbortedError: the window was released.
        """
        return  # reserved whole: nothing to do

    def typed(self, q: int, half: int, dtype: np.dtype) -> np.ndarray:
        """Rank ``q``'s ``half`` (:meth:`peer`; :meth:`local` for this rank) as ``dtype``.

        Made once per (rank, half, dtype) and kept: an executor reads it on every call.
        """
        try:
            return self._typed[(q, half, dtype)]
        except AttributeError:
            self._typed: dict[tuple[int, int, np.dtype], np.ndarray] = {}
        except KeyError:
            pass
        raw = self.local(half) if q == self.rank else self.peer(q, half)
        view = self._typed[(q, half, dtype)] = raw[
            : raw.size // dtype.itemsize * dtype.itemsize
        ].view(dtype)
        return view

    def poster(self) -> Poster | None:
        """Where a caller may post in place of :meth:`post`, or None (this base class's).

        ``(counters, i, fence, flags, sleeping)``: store the value in
        ``counters[i]``, then, where ``fence`` is a lock, acquire and release it (a
        full memory fence), then read ``f[sleeping]`` of each ``f`` in ``flags``;
        where one is set (a peer may be asleep on this rank's counter) or a store
        or read raised ValueError or TypeError (the memory is released), call
        :meth:`post` with the same value, which wakes the peer or raises the closed
        error. A compiled schedule posts so (Note [generated runs] in
        :mod:`plait.runtime.compiled`): a method call is most of a small post's cost.
        """
        return None

    @abc.abstractmethod
    def post(self, value: int) -> None:
        """Publish ``value`` as this rank's counter (values never decrease).

        Every earlier write of this rank to its window is visible to a peer that
        then reads a counter of at least ``value``; peers asleep waiting on this
        rank are woken.

        Raises:
            ValueError: ``value`` is below the last value posted.
            ClosedError: the transport is closed (the memory transport: its own
                closed error, as for its sends and receives).
        """

    @abc.abstractmethod
    def wait(self, q: int, value: int, deadline: float | None) -> bool:
        """Until rank ``q``'s counter is at least ``value``: True; False when ``deadline`` passes.

        ``deadline`` is a :func:`time.monotonic` time, or None for none. Costs one
        read of the counter when it is satisfied already. Whatever ``q`` posted
        stays readable after it closes or dies.

        Raises:
            PeerLostError: ``q`` closed or died before posting ``value``.
            ClosedError: this transport is closed.
            ValueError: ``q`` is this rank and its counter is below ``value`` (only
                this rank could post it: the wait could never end).
        """

    @abc.abstractmethod
    def watch(self, q: int, value: int) -> Handle | None:
        """A handle of this window's transport, done once rank ``q``'s counter reaches ``value``.

        None if it has already. The handle takes part in the transport's
        ``wait_any`` among the call's messages, so a mixed call waits for a post
        and its messages at once (Note [mixed schedules] in :mod:`plait.schedule.ir`).
        It fails with PeerLostError if ``q`` is lost before posting ``value``, and
        with the transport's closed error if the transport closes. Give a handle
        that is not done back with :meth:`unwatch`.

        Raises:
            ValueError: ``q`` is this rank and its counter is below ``value``.
        """

    @abc.abstractmethod
    def unwatch(self, handle: Handle) -> None:
        """Forget ``handle`` from :meth:`watch` (its call failed); it is done after this."""

    @abc.abstractmethod
    def counter(self, q: int) -> int:
        """Rank ``q``'s counter as last published."""

    @abc.abstractmethod
    def digest(self, q: int, half: int) -> int:
        """The digest rank ``q`` stored for ``half`` in :meth:`begin` (unsigned 64-bit).

        Stable from the time ``q`` posts a phase of the call that uses ``half``
        until every rank has ended that call.
        """

    def peer_state(self, q: int, half: int) -> tuple[int, int]:
        """Rank ``q``'s digest word for ``half`` and its counter, read together (the check
        of a peer that a one-sided call makes once per peer)."""
        return self.digest(q, half), self.counter(q)

    def probe(self, q: int, half: int) -> Probe:
        """Where rank ``q``'s counter and its digest word for ``half`` can be read directly.

        ``(counters, i, digests, j)``: ``counters[i]`` is :meth:`counter` and
        ``digests[j]`` is :meth:`digest` for ``half``, each one subscript instead of
        a method call (a compiled schedule keeps the probe of every peer it reads).
        After :meth:`release` a read raises ValueError or TypeError, or still gives
        the last values; either way :meth:`wait` then raises the closed error. This
        base class reads through :meth:`counter` and :meth:`digest`; the windows
        here give their words themselves, and this rank's own probe is where a
        compiled call writes its digest word for the half in place, as :meth:`begin`
        does (a write that raises TypeError sends every call through :meth:`begin`).
        """
        check_half(half)
        return _Read(self.counter), q, _Read(lambda i: self.digest(q, i)), half

    @abc.abstractmethod
    def _set_digest(self, half: int, digest: int) -> None:
        """Store this rank's digest word for ``half``."""

    def begin(self, epoch: int, digest: int, deadline: float | None) -> int:
        """Start call ``epoch`` (0, 1, 2, ... alike on every rank); the half it uses, or -1.

        Waits until every peer has ended call ``epoch - 2`` (which used the same
        half, so nobody reads it any more), stores ``digest`` (the parameters
        of the call, reduced to 64 bits) in this rank's digest word for the
        half, and returns the half, ``epoch & 1``. Returns -1 when ``deadline``
        passes first (:meth:`behind` names the peers waited for); a ``deadline``
        of 0.0 returns -1 at once where some peer has not ended that call (a
        caller that waits for such peers itself first asks so).

        Raises:
            PeerLostError, ClosedError: as :meth:`wait`.
        """
        need = (epoch - 1) << PHASE_BITS
        if need > 0:
            me = self.rank
            for q in range(self.size):
                if q != me and not self.wait(q, need, deadline):
                    return -1
        half = epoch & 1
        self._set_digest(half, digest & MASK64)
        return half

    def end(self, epoch: int) -> None:
        """Finish call ``epoch``: post ``(epoch + 1) << 32`` (this rank reads no peer's half)."""
        self.post((epoch + 1) << PHASE_BITS)

    def behind(self, value: int) -> list[int]:
        """The peers whose counter is below ``value`` (for a timeout's message)."""
        return [q for q in range(self.size) if q != self.rank and self.counter(q) < value]

    def split(
        self, group: Transport, ranks: Sequence[int], tag: int, deadline: float
    ) -> Window | None:
        """The window of a group of these ranks, in memory of its own; None if it gets none.

        A collective of the group: each of its ranks calls it with ``group``, the
        group's transport (its numbering: ``group.rank`` is this rank), and
        ``ranks``, the group's ranks in this window's numbering (``ranks[i]`` is
        group rank ``i``); the ranks agree through ``group``'s messages with
        ``tag`` (:func:`exchange`; one tag per group, so that the set-ups of two
        groups never take each other's messages) before ``deadline`` (a
        :func:`time.monotonic` time). Every rank gets a window, or every rank gets
        None (a group of one rank, or memory or a socket that some rank could
        not get before it announced itself). The new window has counters,
        digests and halves of its own, all zero: its epochs start again at 0;
        its capacity is this window's, of which it may reserve only
        :data:`GROUP_WINDOW_BYTES` per half at first. It waits as this one
        does and fails when a rank's process dies or this rank's transport
        closes; :meth:`release` frees it. This base class gives None (a window
        that cannot be split).

        Raises:
            RendezvousError: some rank did not take part before ``deadline``, or
                one failed after it announced itself (the others hear of it at once).
            PeerLostError: some rank of the group closed or died.
            TransportError: the OS refused memory or a socket.
            ClosedError, AbortedError: this rank's transport was closed or aborted
                meanwhile (its closed error).
        """
        return None

    @abc.abstractmethod
    def release(self) -> None:
        """Give the window's memory back (its transport or its group closes); idempotent.

        Later calls raise the transport's closed error. Arrays handed out
        before keep their memory alive until they are dropped.
        """


class _Read:
    """``r[i]`` calls ``fn(i)``: a probe of a window that has no words to hand out."""

    __slots__ = ("_fn",)

    def __init__(self, fn: Callable[[int], int]) -> None:
        self._fn = fn

    def __getitem__(self, i: int) -> int:
        return self._fn(i)


def check_half(half: int) -> None:
    """Refuse a half that is not 0 or 1."""
    if half not in (0, 1):
        raise ValueError(f"half must be 0 or 1, got {half}")


def member_lost(rank: int) -> PeerLostError:
    """The error of a wait on one rank's counter whose call lost another member, ``rank``,
    before that began it (Note [members lost] in plait.transport.shm.link)."""
    err = PeerLostError(f"rank {rank} has closed its communicator")
    setattr(err, OTHER_MEMBER, rank)
    return err


class MemoryArena:
    """The windows of the ranks of an in-process fabric: arrays, counters, one condition.

    ``lock`` is the fabric's (closing an endpoint notifies ``cond`` under it). A
    split's group gets an arena of its own that shares its parent's ``cond``
    (``cond=``), so that closing an endpoint wakes its waiters too. ``splits``
    holds the arenas of groups being set up, under the number group rank 0 sent
    its peers, until each peer has taken its own (:meth:`MemoryWindow.split`).
    """

    def __init__(
        self,
        size: int,
        capacity: int,
        lock: threading.Lock | None,
        *,
        cond: threading.Condition | None = None,
    ) -> None:
        self.capacity = capacity
        self.halves = [
            (buf[:capacity], buf[capacity:])
            for buf in (np.zeros(2 * capacity, dtype=np.uint8) for _ in range(size))
        ]
        self.counters = [0] * size
        self.digests = [[0, 0] for _ in range(size)]
        self.cond = threading.Condition(lock) if cond is None else cond
        self.splits: dict[int, list[Any]] = {}  # number -> [arena, peers yet to take it]
        self._made = 0
        # The arenas of groups split from this one, each with its ranks here by group rank:
        # a rank's loss fails the watches in them too (:meth:`lose`). Dead ones are dropped
        # at the next :meth:`offer`.
        self._children: list[tuple[weakref.ref[MemoryArena], tuple[int, ...]]] = []
        # MemoryWindow.watch: (rank waited for, value, handle, the endpoint that owns it)
        self.watchers: list[tuple[int, int, Op, Any]] = []

    def settle(self, rank: int, lost: BaseException | None = None) -> None:
        """Complete the watches ``rank``'s counter now satisfies; with ``lost``, fail the rest
        of those on ``rank`` and those that ``rank``'s endpoint owns (lock held)."""
        keep = []
        for w in self.watchers:
            q, value, op, ep = w
            if q == rank and self.counters[q] >= value:
                ep.complete(op)
            elif lost is not None and q == rank:
                ep.fail(op, closed_peer(f"rank {rank} has closed its communicator"))
            elif lost is not None and op.peer == -1 - rank:
                ep.fail(op, lost)
            elif lost is not None and self.counters[rank] <= value >> PHASE_BITS << PHASE_BITS:
                ep.fail(op, member_lost(rank))  # it never began the call (Note [members lost])
            else:
                keep.append(w)
                continue
            ep.notify()
        self.watchers = keep

    def lose(self, rank: int, lost: BaseException) -> None:
        """:meth:`settle` with ``lost`` here and in every group's arena ``rank`` belongs to,
        as that group's rank (lock held): no watch waits out its deadline for a closed rank."""
        self.settle(rank, lost)
        for ref, members in self._children:
            child = ref()
            if child is not None and rank in members:
                child.lose(members.index(rank), lost)

    def offer(self, arena: MemoryArena, takers: int, members: Sequence[int]) -> int:
        """Keep ``arena`` until ``takers`` peers have taken it; its number (lock held).

        ``members``: the group's ranks in this arena, by group rank.
        """
        self._children = [(ref, m) for ref, m in self._children if ref() is not None]
        self._children.append((weakref.ref(arena), tuple(members)))
        self._made += 1
        self.splits[self._made] = [arena, takers]
        return self._made

    def take(self, number: int) -> MemoryArena:
        """The arena offered under ``number``, forgotten after its last taker (lock held)."""
        entry = self.splits[number]
        entry[1] -= 1
        if entry[1] == 0:
            del self.splits[number]
        arena: MemoryArena = entry[0]
        return arena


class MemoryWindow(Window):
    """Rank ``rank``'s window in a :class:`MemoryArena` (threads as ranks).

    ``closed(q)`` tells whether rank ``q``'s endpoint is closed, and ``closed_error()``
    is the error this rank's own operations fail with once it is.
    """

    def __init__(
        self,
        arena: MemoryArena,
        rank: int,
        closed: Callable[[int], bool],
        closed_error: Callable[[], BaseException],
        endpoint: Any = None,
    ) -> None:
        self.rank = rank
        self.size = len(arena.counters)
        #: The endpoint whose waits take this window's watches (the root transport's).
        self.endpoint = endpoint
        self.capacity = arena.capacity
        self._arena = arena
        self._counters = arena.counters
        self._closed = closed
        self._closed_error = closed_error
        self._released = False
        self._peers: list[tuple[np.ndarray, np.ndarray]] = []
        for q, (h0, h1) in enumerate(arena.halves):
            if q != rank:
                h0, h1 = h0.view(), h1.view()
                h0.flags.writeable = h1.flags.writeable = False
            self._peers.append((h0, h1))

    def local(self, half: int) -> np.ndarray:
        """This rank's half (see :meth:`Window.local`)."""
        check_half(half)
        return self._peers[self.rank][half]

    def peer(self, q: int, half: int) -> np.ndarray:
        """Rank ``q``'s half (see :meth:`Window.peer`)."""
        check_half(half)
        return self._peers[q][half]

    def post(self, value: int) -> None:
        """Publish ``value`` and wake waiting ranks (see :meth:`Window.post`)."""
        with self._arena.cond:
            if self._released or self._closed(self.rank):
                raise self._closed_error()
            if value < self._counters[self.rank]:
                raise decreasing_error(self.rank, self._counters[self.rank], value)
            self._counters[self.rank] = value
            self._arena.cond.notify_all()
            if self._arena.watchers:
                self._arena.settle(self.rank)

    def wait(self, q: int, value: int, deadline: float | None) -> bool:
        """Until rank ``q``'s counter reaches ``value`` (see :meth:`Window.wait`)."""
        if self._counters[q] >= value:
            return True
        if q == self.rank:
            raise own_counter_error(q, self._counters[q], value)
        cond = self._arena.cond
        with cond:
            while True:
                if self._released or self._closed(self.rank):
                    raise self._closed_error()
                if self._counters[q] >= value:
                    return True
                if self._closed(q):
                    raise closed_peer(f"rank {q} has closed its communicator")
                if (m := self._absent(value)) is not None:
                    raise member_lost(m)
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                cond.wait(left)

    def watch(self, q: int, value: int) -> Handle | None:
        """A handle of the endpoint, done when ``q`` posts ``value`` (see :meth:`Window.watch`)."""
        if self._counters[q] >= value:
            return None
        if q == self.rank:
            raise own_counter_error(q, self._counters[q], value)
        ep = self.endpoint
        if ep is None:
            raise ValueError(f"rank {self.rank}: this window was made without its endpoint")
        op = Op(-1 - self.rank, 0, memoryview(b""), 0, False)  # a watch, no message
        with self._arena.cond:
            if self._released or self._closed(self.rank):
                raise self._closed_error()
            if self._counters[q] >= value:
                return None
            if self._closed(q):
                ep.fail(op, closed_peer(f"rank {q} has closed its communicator"))
            elif (m := self._absent(value)) is not None:
                ep.fail(op, member_lost(m))
            else:
                self._arena.watchers.append((q, value, op, ep))
        return op

    def _absent(self, value: int) -> int | None:
        """A closed rank that never began the call whose post ``value`` is waited for, so
        that the call cannot complete (Note [members lost] in plait.transport.shm.link)."""
        begun = value >> PHASE_BITS << PHASE_BITS
        for m, counter in enumerate(self._counters):
            if counter <= begun and m != self.rank and self._closed(m):
                return m
        return None

    def unwatch(self, handle: Handle) -> None:
        """Forget a watch (see :meth:`Window.unwatch`)."""
        with self._arena.cond:
            self._arena.watchers = [w for w in self._arena.watchers if w[2] is not handle]
            if isinstance(handle, Op):
                handle.done = True

    def counter(self, q: int) -> int:
        """Rank ``q``'s counter."""
        return self._counters[q]

    def digest(self, q: int, half: int) -> int:
        """Rank ``q``'s digest word for ``half``."""
        check_half(half)
        return self._arena.digests[q][half]

    def probe(self, q: int, half: int) -> Probe:
        """Rank ``q``'s counter and digest word for ``half`` in place (see :meth:`Window.probe`)."""
        check_half(half)
        return self._counters, q, self._arena.digests[q], half

    def _set_digest(self, half: int, digest: int) -> None:
        self._arena.digests[self.rank][half] = digest

    def split(
        self, group: Transport, ranks: Sequence[int], tag: int, deadline: float
    ) -> MemoryWindow | None:
        """A new arena for the group (see :meth:`Window.split`).

        Group rank 0 makes it and offers it in this arena under a number, which it
        sends the others; each takes the arena by that number.
        """
        if group.size < 2:
            return None
        arena, me = self._arena, group.rank
        mine = b""
        if me == 0:
            child = MemoryArena(group.size, arena.capacity, None, cond=arena.cond)
            with arena.cond:
                mine = arena.offer(child, group.size - 1, ranks).to_bytes(8, "little")
        number = int.from_bytes(exchange(group, mine, tag, deadline)[0], "little")
        if me != 0:
            with arena.cond:
                child = arena.take(number)
        members = tuple(ranks)
        parent_closed = self._closed
        return MemoryWindow(
            child, me, lambda q: parent_closed(members[q]), self._closed_error, self.endpoint
        )

    def release(self) -> None:
        """Later calls raise the closed error (see :meth:`Window.release`)."""
        with self._arena.cond:
            self._released = True
            self._arena.cond.notify_all()


def exchange(group: Transport, mine: bytes, tag: int, deadline: float) -> list[bytes]:
    """Every rank's ``mine`` (up to :data:`EXCHANGE_BYTES`) in rank order: an allgather.

    One message of ``EXCHANGE_BYTES + 1`` bytes (a length, then the bytes) to every
    other rank of ``group`` with ``tag``, and one from each, so that ranks that set
    up a group's window agree through the transport they already share.

    Raises:
        RendezvousError: some rank's message did not arrive before ``deadline``
            (a :func:`time.monotonic` time); it names them.
        PeerLostError, MismatchError, ClosedError: a message failed so.
        ValueError: ``mine`` is too long.
    """
    if len(mine) > EXCHANGE_BYTES:
        raise ValueError(f"an announcement holds {EXCHANGE_BYTES} bytes at most, got {len(mine)}")
    me, size = group.rank, group.size
    frames = [bytearray(EXCHANGE_BYTES + 1) for _ in range(size)]
    frames[me][0] = len(mine)
    frames[me][1 : 1 + len(mine)] = mine
    out = bytes(frames[me])
    recvs: dict[int, Handle] = {
        q: group.irecv(q, tag, memoryview(frames[q]), _EXCHANGE_CHECK)
        for q in range(size)
        if q != me
    }
    handles = [*recvs.values()]
    handles += [
        group.isend(q, tag, memoryview(out), _EXCHANGE_CHECK) for q in range(size) if q != me
    ]
    try:
        while True:
            err = next((h.error for h in handles if h.error is not None), None)
            if err is not None:
                raise err
            pending = [h for h in handles if not h.done]
            if not pending:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                absent = sorted(q for q, h in recvs.items() if not h.done)
                raise RendezvousError(
                    f"rank {me} of a new group: ranks {absent} of the group did not take part "
                    "in setting up its window in time"
                )
            # False: the deadline passed, or the transport closed (the handles have failed:
            # the next round raises their error).
            group.wait_any(pending, left)
    except BaseException:
        for h in handles:
            if not h.done:
                group.cancel(h)
        raise
    return [bytes(f[1 : 1 + f[0]]) for f in frames]


def decreasing_error(rank: int, have: int, value: int) -> ValueError:
    """The error of a rank that posts a counter value below the last one."""
    return ValueError(
        f"rank {rank}: counter {value:#x} posted after {have:#x}; values must not decrease"
    )


def own_counter_error(rank: int, have: int, value: int) -> ValueError:
    """The error of a rank that waits for a value of its own counter it has not posted."""
    return ValueError(
        f"rank {rank} waits for its own counter to reach {value:#x}, but it is {have:#x} "
        "and only this rank posts it"
    )
