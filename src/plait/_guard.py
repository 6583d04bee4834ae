"""What connections that have not authenticated yet may cost a listening socket.

plait has two listeners that anyone who can reach their port may connect to: the
store server (:mod:`plait.rendezvous._tcp_server`, Note [hostile peers]) and a rank's
listener while the TCP mesh is set up (:mod:`plait.transport.tcp.bootstrap`, Note
[hostile connections during setup]). Both follow the one policy kept here:
:class:`PendingHandshakes` bounds the connections still authenticating,
:class:`AcceptBackoff` keeps a listener out of descriptors from spinning, and
:func:`unauthenticated_cap` sizes the bound. Neither class closes a socket or reads
one: each user keeps its own connections and loop, and drops what these return.

Note [unauthenticated connections]
    Nothing a peer does before it has authenticated may cost a listener more than a
    bounded amount:

    * a connection has a handshake deadline (:data:`HANDSHAKE_SECONDS` by default)
      to authenticate, and at most a cap of connections may be authenticating at
      once; accepting one more drops the oldest, whose honest owner would dial again.
      The cap is :data:`MAX_UNAUTHENTICATED` unless its user says otherwise, never
      more than a quarter of the descriptor limit (but at least
      :data:`MIN_UNAUTHENTICATED`), so idle connections cannot pile up until the
      process runs out of file descriptors. An honest client authenticates within
      one round trip, so only a burst that large within one round trip could push
      one out;
    * a listener accepts at most one cap's worth of connections per round, so that
      the handshakes of a burst of honest clients are read before their own burst
      pushes them out;
    * when ``accept`` fails for want of descriptors (``EMFILE``, ``ENFILE``, ...)
      while a connection has been authenticating for :data:`ROOM_AFTER` seconds or
      more, the oldest is dropped to make room and ``accept`` tried again, as at the
      cap (only such: an honest client answers within a round trip, and dropping the
      ones just accepted, before their answers could be read, would only churn);
      where none is, the listener leaves the selector for a pause of ``ACCEPT_BACKOFF[0]`` seconds
      that doubles up to ``ACCEPT_BACKOFF[1]``, instead of being reported readable
      again at once (the failed connection stays in the kernel's queue), which
      would spin a core. The first time is logged as a warning; accepting resumes
      by itself, and a successful ``accept`` starts the schedule over;
    * failed handshakes are logged by an :class:`plait._auth.FailureLog`: the first
      one, then a count at most every minute.

    Each user keeps the numbers as attributes of its own module and passes them in,
    so that the store and the TCP setup can be tuned (and tested) apart.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import resource
import selectors
import socket
import time
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from plait import _net

__all__ = [
    "ACCEPT_BACKOFF",
    "HANDSHAKE_SECONDS",
    "MAX_UNAUTHENTICATED",
    "MIN_UNAUTHENTICATED",
    "ROOM_AFTER",
    "AcceptBackoff",
    "PendingHandshakes",
    "unauthenticated_cap",
]

_log = logging.getLogger("plait")

#: Seconds a new connection has to authenticate (as long as a client waits for it).
HANDSHAKE_SECONDS = 10.0
#: How long a connection must have been authenticating before it is dropped to make room
#: for another where ``accept`` runs out of descriptors (Note [unauthenticated connections]).
ROOM_AFTER = 0.5
#: Most connections authenticating at once, unless the listener's user says otherwise.
MAX_UNAUTHENTICATED = 256
#: The least cap the descriptor limit may bring :data:`MAX_UNAUTHENTICATED` down to.
MIN_UNAUTHENTICATED = 16
#: First and longest pause in accepting after running out of file descriptors.
ACCEPT_BACKOFF = (0.05, 1.0)
#: ``accept`` errors that mean "out of resources": retrying at once would spin.
_EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})

_C = TypeVar("_C")


def unauthenticated_cap(cap: int, minimum: int = MIN_UNAUTHENTICATED) -> int:
    """``cap``, lowered to a quarter of the descriptor limit but not below ``minimum``.

    A quarter leaves the rest of the descriptors to the connections that did
    authenticate and to everything else the process opens.
    """
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY:
        cap = min(cap, max(minimum, soft // 4))
    return cap


class PendingHandshakes(Generic[_C]):
    """The connections still authenticating, oldest first, each with its deadline.

    Every deadline is the time of admission plus the same ``seconds``, so admission
    order is deadline order: one insertion-ordered dict answers both "which is
    oldest" (dropped at the cap) and "which is due next" (the selector's timeout).
    It keeps the books only; the caller closes what :meth:`admit` and
    :meth:`overdue` hand back.

    Args:
        cap: Most connections authenticating at once (at least 1).
        seconds: How long each has to authenticate.

    Example::

        pending = PendingHandshakes[Conn](unauthenticated_cap(MAX_UNAUTHENTICATED), 10.0)
        oldest = pending.admit(conn, time.monotonic())
        if oldest is not None:
            drop(oldest)
        ...
        for conn in pending.overdue(time.monotonic()):
            drop(conn)
    """

    __slots__ = ("_deadlines", "cap", "seconds")

    def __init__(self, cap: int, seconds: float) -> None:
        if cap < 1:
            raise ValueError(f"the cap on connections authenticating must be at least 1, got {cap}")
        self.cap = cap
        self.seconds = seconds
        self._deadlines: dict[_C, float] = {}

    def __len__(self) -> int:
        return len(self._deadlines)

    def __contains__(self, conn: object) -> bool:
        return conn in self._deadlines

    def admit(self, conn: _C, now: float) -> _C | None:
        """Start ``conn``'s handshake clock at ``now``; the oldest it pushes out at the cap."""
        oldest = None
        if len(self._deadlines) >= self.cap:
            oldest = next(iter(self._deadlines))
            del self._deadlines[oldest]
        self._deadlines[conn] = now + self.seconds
        return oldest

    def oldest(self, admitted_by: float) -> _C | None:
        """Remove and return the oldest connection if it was admitted at ``admitted_by`` or
        before (None if none is pending, or it came later)."""
        conn = next(iter(self._deadlines), None)
        if conn is None or self._deadlines[conn] - self.seconds > admitted_by:
            return None
        del self._deadlines[conn]
        return conn

    def discard(self, conn: _C) -> None:
        """Forget ``conn`` (it authenticated, or is being dropped); nothing if unknown."""
        self._deadlines.pop(conn, None)

    def overdue(self, now: float) -> list[_C]:
        """Remove and return the connections whose deadline has passed at ``now``."""
        late: list[_C] = []
        for conn, deadline in self._deadlines.items():  # in deadline order
            if deadline > now:
                break
            late.append(conn)
        for conn in late:
            del self._deadlines[conn]
        return late

    def clear(self) -> list[_C]:
        """Remove and return every connection, oldest first (when the listener closes)."""
        every = list(self._deadlines)
        self._deadlines.clear()
        return every

    def next_deadline(self) -> float | None:
        """When the oldest connection's time runs out; None if none is pending."""
        return next(iter(self._deadlines.values()), None)


class AcceptBackoff:
    """Accepts from a listener in a selector loop, pausing it while descriptors run out.

    A failed ``accept`` leaves the connection in the kernel's queue, so the listener
    would be reported readable again at once and the loop would spin a core; instead
    the listener leaves the selector until :attr:`paused_until`, and the loop calls
    :meth:`resume` each round to put it back when the pause is over. The listener is
    registered in ``selector`` here, with data None; closing it stays with the caller.

    Args:
        listener: A non-blocking listening socket.
        selector: The selector of the loop that serves it.
        where: Who is listening, for the messages ("store 10.0.0.1:29400", "rank 3").
        during: What for, added to the warning ("during the TCP setup"); may be empty.
        schedule: First and longest pause, in seconds.
    """

    __slots__ = (
        "_during",
        "_listener",
        "_logged",
        "_pause",
        "_schedule",
        "_selector",
        "_until",
        "where",
    )

    def __init__(
        self,
        listener: socket.socket,
        selector: selectors.BaseSelector,
        where: str,
        *,
        during: str = "",
        schedule: tuple[float, float] = ACCEPT_BACKOFF,
    ) -> None:
        self._listener = listener
        self._selector = selector
        self.where = where
        self._during = f" {during}" if during else ""
        self._schedule = schedule
        self._pause = schedule[0]
        self._until: float | None = None  # out of descriptors until then
        self._logged = False
        selector.register(listener, selectors.EVENT_READ, None)

    @property
    def paused_until(self) -> float | None:
        """When the listener goes back into the selector; None while it is there."""
        return self._until

    def accepted(
        self, most: int, make_room: Callable[[], bool] | None = None
    ) -> Iterator[tuple[socket.socket, str]]:
        """Accept up to ``most`` queued connections: (socket, peer ``host:port``) each.

        Stops early when the queue is empty, and after a failure that pauses the
        listener. A connection that was gone or filtered before it could be taken
        is skipped. The sockets are the caller's, blocking as ``accept`` made them.
        ``make_room``: where ``accept`` runs out of descriptors, drop the oldest
        connection still authenticating (True if there was one), and accept again
        instead of pausing: the oldest goes first at the descriptor limit as at the cap.
        """
        for _ in range(most):
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except (ConnectionAbortedError, PermissionError):
                continue  # that one connection is gone or was filtered: take the next
            except OSError as exc:
                if exc.errno in _EXHAUSTED and make_room is not None and make_room():
                    continue
                self._stop(exc)
                return
            self._pause = self._schedule[0]
            yield sock, _net.format_address(str(addr[0]), int(addr[1]))

    def resume(self, now: float) -> None:
        """Put the listener back into the selector if its pause is over at ``now``."""
        if self._until is None or now < self._until:
            return
        self._until = None
        self._selector.register(self._listener, selectors.EVENT_READ, None)

    def _stop(self, exc: OSError) -> None:
        """Take the listener out of the selector for the next pause after ``exc``."""
        if exc.errno in _EXHAUSTED and not self._logged:
            self._logged = True
            _log.warning(
                "%s: out of file descriptors%s (%s): not accepting connections for now, "
                "retrying every %g s at most; raise the limit (ulimit -n) if this is not "
                "an attack",
                self.where,
                self._during,
                exc.strerror or exc,
                self._schedule[1],
            )
        elif exc.errno not in _EXHAUSTED:
            _log.debug("%s: accept failed: %s", self.where, exc)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(self._listener)
        self._until = time.monotonic() + self._pause
        self._pause = min(2 * self._pause, self._schedule[1])
