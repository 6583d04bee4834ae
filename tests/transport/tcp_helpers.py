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
    while True:
        extra_threads = [t for t in threading.enumerate() if t not in threads and t.is_alive()]
        extra_fds = _fds() - fds
        if not extra_threads and not extra_fds:
            return
        if time.monotonic() > end:
            break
        time.sleep(0.02)
    targets = {}
    for fd in sorted(extra_fds):
        try:
            targets[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            targets[fd] = "?"
    pytest.fail(f"leaked threads {extra_threads} and/or descriptors {targets}")
