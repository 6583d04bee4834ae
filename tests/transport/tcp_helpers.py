"""Helpers for the TCP transport tests: connected transports on threads, a leak check."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from plait.rendezvous.store import MemoryStore
from plait.transport.conformance import build_in_threads
from plait.transport.tcp import TcpTransport


def tcp_transports(size: int, **kwargs: Any) -> list[TcpTransport]:
    """``size`` TCP transports on loopback joined through one in-memory store.

    Construction blocks until every rank is connected, so each rank is built on
    its own thread; ``kwargs`` go to every :class:`TcpTransport`.
    """
    store = MemoryStore(timeout=30.0)
    kwargs.setdefault("timeout", 30.0)
    return build_in_threads(size, lambda rank: TcpTransport(rank, size, store, **kwargs))


class SelectWatch:
    """Wraps a transport's epoll to tell when a thread blocks in it.

    A thread that drives a :class:`TcpTransport` without the lock sits in
    ``epoll.poll()``; tests that need another thread to act exactly then wait on
    :meth:`wait_blocked` instead of guessing with a sleep. Only calls that may
    block count (a timeout of -1 or above zero), not the spin's zero-timeout
    polls. Install it while no thread drives the transport.
    """

    def __init__(self, t: TcpTransport) -> None:
        self._poller = t._poller
        self._cond = threading.Condition()
        self._blocked: list[threading.Thread] = []
        t._poller = self

    def poll(self, timeout: float = -1) -> list[tuple[int, int]]:
        if timeout < 0 or timeout > 0:
            with self._cond:
                self._blocked.append(threading.current_thread())
                self._cond.notify_all()
        return self._poller.poll(timeout)  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._poller, name)

    def wait_blocked(self, thread: threading.Thread, timeout: float = 10.0) -> None:
        """Return once ``thread`` has entered a blocking poll; fail after ``timeout``."""
        with self._cond:
            ok = self._cond.wait_for(lambda: thread in self._blocked, timeout)
        assert ok, f"{thread.name} never blocked in the transport's epoll within {timeout} s"


def _fds() -> set[str]:
    try:
        return set(os.listdir("/proc/self/fd"))
    except OSError:  # not Linux: no descriptor check
        return set()


@pytest.fixture
def no_leaks() -> Iterator[None]:
    """Fail a test that leaves threads running or file descriptors (sockets) open.

    Modules opt in with ``pytestmark = pytest.mark.usefixtures("no_leaks")`` after
    importing this fixture.
    """
    threads, fds = set(threading.enumerate()), _fds()
    yield
    end = time.monotonic() + 5.0
    for t in threading.enumerate():  # threads the test started: give each until the deadline
        if t not in threads:
            t.join(max(end - time.monotonic(), 0.0))
    extra_threads = [t for t in threading.enumerate() if t not in threads and t.is_alive()]
    while True:
        extra_fds = _fds() - fds
        if not extra_fds or time.monotonic() > end:
            break
        # A poll, not an event: nothing signals when the last socket of a closed transport
        # is gone; the deadline turns a descriptor that stays open into a failure.
        time.sleep(0.02)
    if not extra_threads and not extra_fds:
        return
    targets = {}
    for fd in sorted(extra_fds):
        try:
            targets[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            targets[fd] = "?"
    pytest.fail(f"leaked threads {extra_threads} and/or descriptors {targets}")
