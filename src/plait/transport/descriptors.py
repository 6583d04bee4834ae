"""Descriptors: the part of the endpoint that watches the links' sockets with epoll.

:class:`Descriptors` is a mixin of :class:`~plait.transport.endpoint.Endpoint`:
links that have no counters of their own to poll (sockets) hand it their
descriptors with a handler, and a waiting thread sleeps in its ``epoll`` until
one is ready, the wake-up pipe is written or its time is up. Its polling rounds
look at the polled descriptors without sleeping: with one ``epoll`` call of
timeout 0, or, while one descriptor is all that is watched, with that
descriptor's own look (Note [one watched descriptor]). See ``docs/transport.md``.

Note [one watched descriptor]
    A waiting rank's polling rounds ask epoll, with timeout 0, which watched
    descriptors are ready, and hand those to their handlers. Where one
    descriptor is all the endpoint watches (two ranks over TCP with one
    stream: one socket), the answer can only name that one, and its link can
    look at it itself. A read that finds a message saves epoll's call and the
    dispatch; a read that finds nothing costs more than epoll's empty answer
    (about 1.3 µs against 0.3: Python raises and catches the EAGAIN), and a
    look with output queued on a full socket tries the write again. In a loop
    of small calls the first wins: 1.5-2 µs less per 2-rank 8-byte allreduce
    over TCP, and an epoll(0) asked first, to spare the empty reads, gave
    1.3-1.9 µs of that back (docs/performance.md). So the rounds call that
    descriptor's ``direct`` look instead, while it is the only one. A look
    says whether a byte moved, as epoll says whether anything was ready, so
    a wait that finds nothing still goes to sleep. The liveness check and the
    sleep still go through epoll, and a second descriptor (another peer, a
    second stream, a shared-memory link's socket) ends the shortcut until it
    is unwatched again.
"""

from __future__ import annotations

import contextlib
import select
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

__all__ = ["Descriptors"]


class Descriptors:
    """The endpoint's epoll over its links' descriptors, and its wake-up pipe.

    Every method but :meth:`_wake` must be called with the endpoint's lock held.
    """

    if TYPE_CHECKING:
        _completed: int

        def _after_progress(self) -> None: ...

    def _init_descriptors(self) -> None:
        self._poller: Any = None  # epoll over the links' descriptors, made by watch()
        self._handlers: dict[int, Callable[[int, int], None]] = {}
        # Descriptors the polling rounds check too, each with its look without epoll (or None).
        self._polled: dict[int, Callable[[], bool] | None] = {}
        self._direct: Callable[[], bool] | None = None  # Note [one watched descriptor]
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._last_check = time.monotonic()  # when the descriptors were last looked at

    def watch(
        self,
        fd: int,
        handler: Callable[[int, int], None],
        events: int = select.EPOLLIN,
        *,
        polled: bool = False,
        direct: Callable[[], bool] | None = None,
    ) -> None:
        """Wake the endpoint when ``fd`` is ready for ``events``; then ``handler(fd, ready)``.

        ``ready`` is the epoll mask that fired; the handler runs with the lock
        held, and must not block (the descriptor may be ready no more).
        ``polled``: the polling rounds of a waiting thread check ``fd`` too
        (one ``epoll`` call with timeout 0 for all such descriptors), for links
        that have no counters of their own to poll, such as sockets.
        ``direct``: for a polled ``fd``, what the handler would do for whatever
        ``fd`` is ready for, done without asking epoll (a read or write that
        finds nothing to move leaves everything as it was); returns whether
        anything moved. Polling rounds call it in place of ``epoll`` while
        ``fd`` is the only descriptor watched (Note [one watched descriptor]).
        """
        if self._poller is None:
            self._poller = select.epoll()
            self._wake_r, self._wake_w = socket.socketpair()
            self._wake_r.setblocking(False)
            self._wake_w.setblocking(False)
            self._poller.register(self._wake_r.fileno(), select.EPOLLIN)
        self._poller.register(fd, events)
        self._handlers[fd] = handler
        if polled:
            self._polled[fd] = direct
        self._pick_direct()

    def rewatch(self, fd: int, events: int) -> None:
        """Change what ``fd`` is watched for (a link with bytes queued adds ``EPOLLOUT``).

        Takes effect at once, also for a thread asleep in epoll.
        """
        self._poller.modify(fd, events)

    def unwatch(self, fd: int) -> None:
        """Stop watching ``fd`` (before it is closed)."""
        if self._handlers.pop(fd, None) is not None:
            self._poller.unregister(fd)
            self._polled.pop(fd, None)
            self._pick_direct()

    def _pick_direct(self) -> None:
        """The polling rounds' look without epoll, if one descriptor is all that is watched."""
        one = len(self._handlers) == 1 and len(self._polled) == 1
        self._direct = next(iter(self._polled.values())) if one else None

    def _poll_ready(self) -> bool:
        """Hand whatever descriptors are ready now to their handlers; whether any was."""
        events = self._poller.poll(0)
        if events:
            self._dispatch(events)
            return True
        return False

    def _dispatch(self, events: list[tuple[int, int]]) -> None:
        self._last_check = time.monotonic()
        for fd, ready in events:
            handler = self._handlers.get(fd)
            if handler is not None:
                handler(fd, ready)
            elif self._wake_r is not None and fd == self._wake_r.fileno():
                _drain(self._wake_r)
        if self._completed:
            self._after_progress()

    def _wake(self) -> None:
        """Wake the thread asleep in epoll, if any (with or without the lock)."""
        if self._wake_w is not None:
            with contextlib.suppress(OSError):  # full: a wake-up is pending anyway
                self._wake_w.send(b"\0")

    def _close_descriptors(self) -> None:
        """Forget the watched descriptors; close the epoll and the wake-up pipe (idempotent)."""
        self._handlers.clear()
        self._polled.clear()
        self._direct = None
        if self._poller is not None:
            assert self._wake_r is not None
            assert self._wake_w is not None
            self._wake_r.close()
            self._wake_w.close()
            self._poller.close()


def _drain(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while sock.recv(4096):
            pass
