"""The endpoint: the point-to-point contract of :mod:`plait.transport.base`, implemented once.

An :class:`Endpoint` is one rank's end of a transport. It owns everything the contract promises
(handles, matching on (peer, tag) and on patterns, mismatch errors, cancel, the fan-out of a lost
peer, the closed state, byte counters, waiting and the "one thread drives, the others wait" policy)
and routes each peer to a :class:`~plait.transport.link.Link`, which only moves the bytes of
messages. Matching patterns (any of several peers, tags under a mask, probes) is mixed in from
:class:`~plait.transport.patterns.PatternMatching` (Note [patterns] there). See
``docs/transport.md`` for the design, the link interface and the rules a link must keep.
"""

from __future__ import annotations

import _thread
import math
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from plait.errors import ClosedError, MismatchError
from plait.transport.base import Handle, may_spin
from plait.transport.descriptors import Descriptors
from plait.transport.link import Link, Message, Op, copy_bytes
from plait.transport.patterns import PatternMatching, Wildcard
from plait.transport.patterns import lost_error as _lost_error

if TYPE_CHECKING:
    from plait.transport.window import Window

__all__ = ["CLOSE_FLUSH_SECONDS", "Endpoint", "Wildcard"]

#: Seconds :meth:`Endpoint.close` spends at most letting links flush queued sends.
CLOSE_FLUSH_SECONDS = 2.0

#: Seconds a waiting rank polls before it sleeps, and of those, how many without yielding.
_SPIN = 50e-6
_EAGER_SPIN = 5e-6
#: Seconds of waiting without sleeping after which the links' descriptors are checked anyway.
_LIVENESS_INTERVAL = 0.1


def _as_bytes(data: Any, writable: bool, what: str) -> memoryview:
    mv = data if isinstance(data, memoryview) else memoryview(data)
    if not mv.c_contiguous:
        raise ValueError(f"{what} must be a contiguous buffer")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    if writable and mv.readonly:
        raise ValueError(f"{what} is read-only; it must be writable")
    return mv


class Endpoint(PatternMatching, Descriptors):
    """Rank ``rank``'s end of a transport among ``size`` ranks; see :mod:`plait.transport.base`.

    A transport class derives from it, builds its links and calls :meth:`attach` for each; the
    endpoint does the rest.

    Args:
        rank: this rank, ``0 <= rank < size``.
        size: number of ranks.
        names: how messages name the ranks (default: their numbers here).
        lock: the lock guarding this endpoint (the in-process transport shares
            one among all its endpoints); default a new one.

    Attributes:
        bytes_sent: payload bytes sent so far.
        bytes_received: payload bytes delivered into posted receives so far.
        spin: seconds a waiting rank polls its driven links before it sleeps.
        eager_spin: seconds of that polling done flat out, before it yields the CPU between polls.
        window: the rank's :class:`~plait.transport.window.Window` (ranks sharing memory), or None.
    """

    window: Window | None = None
    #: The error of :meth:`abort`, once called (None: closed or open as usual).
    _aborted: Callable[[], BaseException] | None = None
    _sleeper, _unreleased = 0, False  # the thread last in poll(); close() left it the links

    def __init__(
        self,
        rank: int,
        size: int,
        *,
        names: Sequence[int] | None = None,
        lock: threading.Lock | None = None,
    ) -> None:
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"invalid rank {rank} for size {size}; expected 0 <= rank < size")
        if names is not None and len(names) != size:
            raise ValueError(f"names must name {size} ranks, got {len(names)}")
        self.rank = rank
        self.size = size
        self._names = list(range(size)) if names is None else [int(n) for n in names]
        self._me = self._names[rank]
        self.bytes_sent = 0
        self.bytes_received = 0
        self.spin = _SPIN
        self.eager_spin = _EAGER_SPIN
        self._lock = threading.Lock() if lock is None else lock
        self._cond = threading.Condition(self._lock)
        self._closed = False
        self._polling = False  # a thread sleeps in poll() without the lock
        self._waiters = 0  # threads waiting on _cond
        self._completed = 0  # completions since the last _after_progress (wakes other threads)
        self._posted: dict[tuple[int, int], deque[Op]] = {}
        self._unexpected: dict[tuple[int, int], deque[Message]] = {}
        self._init_patterns()  # Note [patterns]
        self._links: list[Link] = []
        self._driven: list[Link] = []
        self._route: list[Link | None] = [None] * size
        #: Why each peer is lost: a reason (a new PeerLostError per operation) or the error.
        self._lost: list[str | BaseException | None] = [None] * size
        self._init_descriptors()  # epoll over the links' descriptors (plait.transport.descriptors)

    # -- building (for transport classes and links) ------------------------------------------
    def attach(self, link: Link, peers: Sequence[int]) -> None:
        """Route ``peers`` to ``link`` (a peer belongs to one link)."""
        if link not in self._links:
            self._links.append(link)
            if link.driven:
                self._driven.append(link)
        for p in peers:
            self._route[p] = link

    # -- for links (lock held) ---------------------------------------------------------------
    def take_posted(self, peer: int, tag: int) -> Op | None:
        """The oldest receive posted for (``peer``, ``tag``), removed from its queue, or None."""
        key = (peer, tag)
        queue = self._posted.get(key)
        if self._wild:
            wild = self._take_wild(peer, tag, queue[0].seq if queue else None)
            if wild is not None:
                return wild
        if not queue:
            return None
        op = queue.popleft()
        if not queue:
            del self._posted[key]
        return op

    def foreign(self, lo: int, hi: int, check: int) -> int | None:
        """A peer with a message waiting to be received, tagged in ``[lo, hi)`` (one call's
        tags) but carrying another call's ``check``; None if there is none. A rank in
        another call sends on this call's tags where the two calls share a number: a
        stalled call finds it here (Note [foreign messages] in plait.runtime.stall)."""
        with self._lock:
            for (peer, tag), queue in self._unexpected.items():
                if lo <= tag < hi and any(m.check != check for m in queue):
                    return peer
        return None

    def add_unexpected(self, peer: int, tag: int, msg: Message) -> None:
        """File ``msg`` from ``peer`` for the next receive of (``peer``, ``tag``)."""
        msg.seq = self._arrivals
        self._arrivals += 1
        key = (peer, tag)
        queue = self._unexpected.get(key)
        if queue is None:
            self._unexpected[key] = deque((msg,))
        else:
            queue.append(msg)
        if self._probes:
            self._notice(peer, tag, msg)

    def discard(self, msg: Message) -> None:
        """Remove ``msg`` from the unexpected messages (its sender withdrew or died)."""
        for key, queue in list(self._unexpected.items()):
            if msg in queue:
                queue.remove(msg)
                if not queue:
                    del self._unexpected[key]
                return

    def _take(self, op: Op, msg: Message) -> None:
        """Receive ``op`` takes unexpected ``msg``: its link delivers it, or both fail."""
        err = self.mismatch(op, msg.check, msg.nbytes)
        if err is None:
            msg.link.claim(op, msg)
        else:
            self.fail(op, err)
            msg.link.reject(msg, err)

    def mismatch(self, op: Op, check: int, nbytes: int) -> MismatchError | None:
        """The error for a message (``check``, ``nbytes``) that ``op`` cannot take, or None."""
        if check != op.check:
            err = MismatchError(
                f"rank {self._me} received from rank {self._names[op.peer]} a message of a "
                "different call "
                "(the two ranks disagree on the collective, count, dtype, op, root, algorithm or "
                "segment size; or, for a send and its recv, on the dtype)"
            )
            err.sent = (check, nbytes)
            return err
        if nbytes != op.nbytes:
            err = MismatchError(
                f"rank {self._names[op.peer]} sent {nbytes} bytes but rank {self._me} expected "
                f"{op.nbytes} bytes"
            )
            err.sent = (check, nbytes)
            return err
        return None

    def deliver_buffered(self, op: Op, msg: Message) -> bool:
        """Copy what ``msg`` holds into ``op``; complete ``op`` and return True if that is all."""
        data = msg.data
        assert data is not None
        copy_bytes(op.buf, op.arr, 0, data.data, data, 0, msg.received)
        self.bytes_received += msg.received
        op.offset = msg.received
        if msg.complete:
            self.complete(op)
            return True
        return False

    def complete(self, op: Op) -> None:
        """Finish ``op`` successfully (unless it was cancelled meanwhile)."""
        op.done = True
        self._completed += 1

    def fail(self, op: Op, err: BaseException) -> None:
        """Finish ``op`` with ``err`` (unless it is done already)."""
        if not op.done:
            op.error = err
            op.done = True
            self._completed += 1

    def lose(self, peer: int, reason: str | BaseException) -> None:
        """``peer`` closed or died: fail its posted receives and every later operation.

        ``reason`` is a message (each operation fails with a PeerLostError of its own) or the
        error to fail them all with (a link that tells errors apart).
        """
        if self._lost[peer] is not None:
            return
        self._lost[peer] = reason
        err = _lost_error(reason)
        for key in [k for k in self._posted if k[0] == peer]:
            for op in self._posted.pop(key):
                self.fail(op, err)
        for waiting in (self._wild, self._probes):
            for w in list(waiting):
                if (hopeless := self._hopeless(w)) is not None:
                    waiting.remove(w)
                    self.fail(w, hopeless)

    def name(self, rank: int) -> int:
        """How messages name ``rank``."""
        return self._names[rank]

    @property
    def lock(self) -> threading.Lock:
        """The lock guarding the endpoint and its links (for a window driving its link)."""
        return self._lock

    def closed_error(self) -> BaseException:
        """The error of operations after (or cut short by) :meth:`close` or :meth:`abort`."""
        return self._closed_error() if self._aborted is None else self._aborted()

    def abort(self, error: Callable[[], BaseException]) -> None:
        """:meth:`close`, but pending and later operations fail with ``error()`` (a new one each).

        For ``Communicator.abort`` (:mod:`plait._recovery`): the calls it cuts short say that
        the communicator was aborted, not that it was closed.
        """
        self._aborted = error
        self.close()

    # -- the contract --------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has been called."""
        return self._closed

    def isend(self, peer: int, tag: int, data: memoryview, check: int) -> Op:
        """Start sending ``data`` to ``peer``; see :class:`~plait.transport.base.Transport`."""
        link = self._route[peer] if 0 <= peer < self.size else None
        if link is None:
            raise self._not_a_peer(peer)
        if not -0x8000000000000000 <= tag <= 0x7FFFFFFFFFFFFFFF:
            raise ValueError(f"tag {tag} does not fit in a signed 64-bit integer")
        if (
            data.__class__ is not memoryview
            or data.format != "B"
            or data.ndim != 1
            or not data.c_contiguous
        ):
            data = _as_bytes(data, False, "data")
        op = Op(peer, tag, data, check, True)
        with self._lock:
            if self._closed:
                self.fail(op, self.closed_error())
            else:
                # A send that fits its link completes without a wait, where peers are
                # checked: a rank that only sends learns of a dead peer here, not after a
                # ring's or a socket buffer's worth of sends that said they succeeded.
                now = time.monotonic()
                if now - self._last_check >= _LIVENESS_INTERVAL:
                    self._liveness(now)
                lost = self._lost[peer]
                if lost is not None:
                    self.fail(op, _lost_error(lost))
                else:
                    link.send(op)
            if self._completed:
                self._after_progress()
        return op

    def irecv(self, peer: int, tag: int, into: memoryview, check: int) -> Op:
        """Start receiving ``len(into)`` bytes from ``peer``; see the Transport contract."""
        link = self._route[peer] if 0 <= peer < self.size else None
        if link is None:
            raise self._not_a_peer(peer)
        if (
            into.__class__ is not memoryview
            or into.format != "B"
            or into.ndim != 1
            or not into.c_contiguous
            or into.readonly
        ):
            into = _as_bytes(into, True, "into")
        op = Op(peer, tag, into, check, False)
        key = (peer, tag)
        with self._lock:
            queue = self._unexpected.get(key)
            if self._closed:
                self.fail(op, self.closed_error())
            elif queue:
                msg = queue.popleft()
                if not queue:
                    del self._unexpected[key]
                self._take(op, msg)
            elif (lost := self._lost[peer]) is not None:
                self.fail(op, _lost_error(lost))
            else:
                op.seq = self._posts
                self._posts += 1
                posted = self._posted.get(key)
                if posted is None:
                    self._posted[key] = deque((op,))
                else:
                    posted.append(op)
                link.recv_posted(op)
            if self._completed:
                self._after_progress()
        return op

    def wait_any(self, handles: Sequence[Handle], timeout: float | None) -> bool:
        """Make progress until one of ``handles`` is done; False if ``timeout`` passes first.

        With no handles, makes progress until ``timeout`` passes (at once for None).
        """
        for h in handles:
            if h.done:
                return True
        if not handles and timeout is None:
            return False  # nothing could ever end the wait
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            try:
                return self._wait(handles, deadline)
            finally:
                if self._waiters:
                    self._cond.notify_all()  # completions, or someone must take over driving

    def wait_polled(self, handles: Sequence[Handle], deadline: float | None) -> bool:
        """:meth:`wait_any` for a caller that has just polled for ``handles`` itself.

        ``deadline`` is a :func:`time.monotonic` time (None: none). The wait skips the spin:
        once the links have nothing to move it sleeps (a window polls its counter its own way
        first, then sleeps here on the link's doorbells).
        """
        for h in handles:
            if h.done:
                return True
        with self._lock:
            try:
                return self._wait(handles, deadline, True)
            finally:
                if self._waiters:
                    self._cond.notify_all()

    def cancel(self, handle: Handle) -> None:
        """Withdraw ``handle``; it never touches its buffer after this returns."""
        if not isinstance(handle, Op):
            raise TypeError(f"rank {self._me}: {handle!r} is not a handle of this transport")
        with self._lock:
            if handle.done:
                return
            handle.done = True
            self._completed += 1  # wake a thread that waits on it, even one asleep in epoll
            try:
                self._cancel(handle)
            finally:
                self._after_progress()

    def _cancel(self, handle: Op) -> None:
        """Take a cancelled ``handle`` out of the posted queues, or out of its link's hands."""
        if not self._closed:
            if isinstance(handle, Wildcard):
                waiting = self._probes if handle.probing else self._wild
                if handle in waiting or handle.peer < 0:
                    if handle in waiting:
                        waiting.remove(handle)
                    return
            elif not handle.is_send:
                key = (handle.peer, handle.tag)
                queue = self._posted.get(key)
                if queue is not None and handle in queue:
                    queue.remove(handle)
                    if not queue:
                        del self._posted[key]
                    return
            link = self._route[handle.peer]
            if link is not None:
                link.cancel(handle)

    def fail_posted(self, owns: Callable[[int], bool], err: BaseException) -> None:
        """Fail the receives and probes still waiting whose tag ``owns`` accepts, with
        ``err``: a sub-communicator's when it closes (the endpoint stays open), so that a
        thread waiting in one hears of the close at once rather than at its timeout. A
        message that arrives for them later is filed like any unexpected one."""
        if self._leave(self.fail_posted, owns, err):
            return  # Note [close in a signal handler]
        with self._lock:
            if self._closed:
                return
            for key in [k for k in self._posted if owns(k[1])]:
                for op in self._posted.pop(key):
                    self.fail(op, err)
            for waiting in (self._wild, self._probes):
                for w in [w for w in waiting if owns(w.want)]:
                    waiting.remove(w)
                    self.fail(w, err)
            self._after_progress()

    def close(self) -> None:
        """Fail pending operations, tell peers (PeerLostError there), release everything.

        Idempotent; safe while another thread waits in :meth:`wait_any`, and from a signal handler
        over this thread's wait (Note [close in a signal handler] in docs/transport.md).
        """
        if self._closed or self._leave(self.close):
            return
        with self._lock:
            if self._closed:
                return
            self._closed = True
            err = self.closed_error()
            for queue in self._posted.values():
                for op in queue:
                    self.fail(op, err)
            self._posted.clear()
            for op in [*self._wild, *self._probes]:
                self.fail(op, err)
            self._wild.clear()
            self._probes.clear()
            for messages in self._unexpected.values():
                for msg in messages:
                    msg.link.reject(msg, err)
            self._unexpected.clear()
            if self._polling:  # let the driver leave poll() before the fds go away
                self._wake()
                if self._sleeper == _thread.get_ident():  # it sleeps under this handler
                    self._unreleased = True  # _sleep shuts the links once poll() returns
                    self._cond.notify_all()
                    return
                self._waiters += 1
                try:
                    while self._polling:
                        self._cond.wait()
                finally:
                    self._waiters -= 1
            self._shut(err)

    def _leave(self, then: Callable[..., None], *args: Any) -> bool:
        """Whether to leave ``then(*args)`` to a new thread, started here: the lock is held, and
        this thread runs the transport's code below the caller's (a signal handler's), which
        may hold it and cannot let go of it before the caller returns."""
        if not self._lock.locked():  # (code this handler interrupted cannot take it meanwhile)
            return False
        here, frame = os.path.dirname(__file__), sys._getframe(1).f_back
        while frame is not None and frame.f_code.co_filename.startswith(here):
            frame = frame.f_back  # the close being made, and its callers in the transport
        while frame is not None and not frame.f_code.co_filename.startswith(here):
            frame = frame.f_back
        if frame is None:  # another thread holds the lock, and lets go of it soon
            return False
        _thread.start_new_thread(then, args)  # Note [close in a signal handler]
        return True

    def __enter__(self) -> Endpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _shut(self, err: BaseException) -> None:
        """The end of :meth:`close` once no thread is in poll(): drive the links' output for up to
        CLOSE_FLUSH_SECONDS (others' operations fail at once meanwhile), shut and release them."""
        self._unreleased = False
        deadline = time.monotonic() + CLOSE_FLUSH_SECONDS
        while True:
            waits = [w for link in self._driven if (w := link.flush(err)) is not None]
            left = deadline - time.monotonic()
            if not waits or left <= 0 or self._poller is None:
                break
            self._progress(False)
            self._polling = True
            self._lock.release()
            try:
                events = self._poller.poll(min(*waits, left))
            finally:
                self._lock.acquire()
                self._polling = False
            self._dispatch(events)
        for link in self._links:
            link.shutdown(err)
        self._release()
        self._cond.notify_all()

    # -- for subclasses ------------------------------------------------------------------------
    def _closed_error(self) -> BaseException:
        """The error of operations after (or cut short by) :meth:`close`."""
        return ClosedError(f"rank {self._me}: the transport is closed")

    def _release(self) -> None:
        """Release the links and the endpoint's own descriptors (idempotent)."""
        for link in self._links:
            link.release()
        self._close_descriptors()

    # -- waiting (lock held) ---------------------------------------------------------------------
    def _wait(self, handles: Sequence[Handle], deadline: float | None, spun: bool = False) -> bool:
        # The first pass leaves the polled descriptors to the spin or the sleep that
        # follows at once (each polls them first): one system call less per wait.
        poll = deadline is not None and deadline <= time.monotonic()
        if not (spun or poll or self._polling or self._closed) and self._driven:
            # A thread that would drive and may spin spins at once: the first pass would
            # find what the spin's first round finds (about 0.5 µs less per wait). A handle
            # that another thread completed while this one waited for the lock needs no spin.
            spun = True
            for h in handles:
                if h.done:
                    return True
            if self.spin > 0 and may_spin():
                self._spin(deadline)  # the loop's first pass looks at the handles
        while True:
            for h in handles:  # a loop: a generator in any() costs more on this hot path
                if h.done:
                    return True
            if self._closed:
                return False
            if self._polling or not self._driven:
                # Another thread drives (or nothing needs driving): it notifies us on completions.
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._waiters += 1
                try:
                    self._cond.wait(left)
                finally:
                    self._waiters -= 1
                continue
            moved = self._progress(False, poll)
            poll = True
            if moved:
                self._after_progress()
                spun = False
            now = time.monotonic()
            if deadline is not None and now >= deadline:  # even while busy with other traffic
                # A caller polling with timeout 0 is stalled too: take messages in, so peers
                # never starve.
                if not moved and self._progress(True):
                    self._after_progress()
                return any(h.done for h in handles)
            if moved:
                continue
            if now - self._last_check >= _LIVENESS_INTERVAL:
                self._liveness(now)
                continue
            if not spun:
                spun = True
                if self.spin > 0 and may_spin() and self._spin(deadline):
                    continue
            if self._progress(True):  # stalled: take in unexpected messages
                self._after_progress()
                continue
            self._sleep(None if deadline is None else deadline - time.monotonic())

    def _progress(self, stalled: bool, poll: bool = True) -> bool:
        """One pass of every driven link; ``poll``: dispatch ready polled descriptors too."""
        moved = False
        for link in self._driven:
            if link.progress(stalled):
                moved = True
        if self._polled and poll and not stalled:  # the stalled pass follows a polling round
            direct = self._direct
            if direct is not None:  # Note [one watched descriptor] in plait.transport.descriptors
                if direct():
                    moved = True
            elif self._poll_ready():
                moved = True
        return moved

    def _spin(self, deadline: float | None) -> bool:
        """Poll the links for up to ``self.spin`` seconds; whether anything moved."""
        start = time.monotonic()
        until = start + self.spin
        if deadline is not None:
            until = min(until, deadline)
        eager = start + self.eager_spin
        # Each round's cost is the latency of noticing a message, so the common case of
        # one driven link and no polled descriptors (shared memory) calls the link directly.
        driven = self._driven
        progress = driven[0].progress if len(driven) == 1 and not self._polled else self._progress
        monotonic, sched_yield = time.monotonic, os.sched_yield
        while True:
            if progress(False):
                self._after_progress()
                return True
            now = monotonic()
            if now >= until:
                return False
            if now >= eager:
                # Let a peer that shares our CPU run: without this, a spinning rank
                # on a busy machine delays the very message it waits for.
                sched_yield()

    def _arm(self) -> float:
        """Arm every driven link; the longest sleep allowed, or 0.0 (nothing armed)."""
        limit = math.inf
        for i, link in enumerate(self._driven):
            cap = link.arm()
            if cap <= 0:
                for armed in self._driven[:i]:
                    armed.disarm()
                return 0.0
            limit = min(limit, cap)
        return limit

    def _disarm(self) -> None:
        for link in self._driven:
            link.disarm()

    def _sleep(self, timeout: float | None) -> None:
        """Block in poll() until a link's descriptor, the wake-up pipe or ``timeout``."""
        limit = self._arm()
        if limit <= 0:
            self._after_progress()
            return
        if timeout is None or timeout > limit:
            timeout = None if limit == math.inf else limit
        self._sleeper, self._polling = _thread.get_ident(), True  # Note [close in a signal handler]
        self._lock.release()
        try:
            events = self._poller.poll(-1 if timeout is None else max(timeout, 0.0))
        finally:
            self._lock.acquire()
            self._polling = False
            if self._waiters:
                self._cond.notify_all()
            if self._unreleased:  # closed by a signal handler while asleep here
                self._shut(self.closed_error())
        if self._closed:
            return
        self._disarm()
        self._dispatch(events)
        now = time.monotonic()
        for link in self._driven:
            link.check(now)
        if self._completed:
            self._after_progress()

    def _liveness(self, now: float) -> None:
        """Handle whatever the links' descriptors report, and let the links check their peers."""
        if self._poller is not None:
            self._poll_ready()
        self._last_check = now
        for link in self._driven:
            link.check(now)
        self._after_progress()

    def _after_progress(self) -> None:
        """Tell other threads about completions (called with the lock held)."""
        if self._completed:
            self._completed = 0
            if self._waiters:
                self._cond.notify_all()
            if self._polling:
                self._wake()

    #: Wake threads waiting on this endpoint about completions (for links; lock held).
    notify = _after_progress

    def _not_a_peer(self, peer: int) -> ValueError:
        return ValueError(f"rank {self._me}: peer {peer} is not in 0..{self.size - 1}")
