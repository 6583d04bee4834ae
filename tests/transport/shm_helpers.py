"""Helpers for the shared-memory transport tests: ranks on threads, a leak check, a sleep watch,
a stranger that connects to a rank's socket and says nothing."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from plait.transport.endpoint import Endpoint


@pytest.fixture(autouse=True)
def no_leftovers(own_segments: list[str]) -> Iterator[None]:
    """Every test leaves none of its segments in /dev/shm (see conftest.py) and no thread.

    Autouse in the modules that import it.
    """
    threads = set(threading.enumerate())
    yield
    extra = [t for t in threading.enumerate() if t not in threads and t.is_alive()]
    assert extra == []


def in_threads(fns: Sequence[Callable[[], Any]], timeout: float = 60.0) -> list[Any]:
    """Run each function on its own thread; return the results, re-raising the first error."""
    results: list[Any] = [None] * len(fns)
    errors: list[BaseException | None] = [None] * len(fns)

    def body(i: int) -> None:
        try:
            results[i] = fns[i]()
        except BaseException as exc:
            errors[i] = exc

    threads = [threading.Thread(target=body, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a rank thread hung"
    for err in errors:
        if err is not None:
            raise err
    return results


class PollWatch:
    """Wraps a shared-memory transport's epoll object; ``asleep`` is set once a thread sleeps."""

    def __init__(self, t: Endpoint) -> None:
        self._poller = t._poller
        self.asleep = threading.Event()
        t._poller = self

    def poll(self, timeout: float = -1) -> list[tuple[int, int]]:
        if timeout != 0:
            self.asleep.set()
        return self._poller.poll(timeout)  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._poller, name)


_STRANGER = """
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect("\\0" + sys.argv[1])
s.sendall(bytes.fromhex(sys.argv[2]))
print("connected", flush=True)
sys.stdin.readline()
s.settimeout(30)
print("dropped" if s.recv(1) == b"" else "not dropped", flush=True)
"""


class Stranger:
    """A process of this user (another one, or this one) that connects to a rank's socket,
    sends ``junk`` (part of a hello, or nothing) and then holds the connection silently."""

    def __init__(self, where: str, junk: bytes) -> None:
        self.where = where
        self.junk = junk
        self.child: subprocess.Popen[str] | None = None
        self.sock: socket.socket | None = None

    def connect(self, name: str) -> None:
        """Connect to abstract socket ``name``; returns once the connection is queued."""
        if self.where == "another process":
            self.child = subprocess.Popen(
                [sys.executable, "-c", _STRANGER, name, self.junk.hex()],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert self.child.stdout is not None
            assert self.child.stdout.readline() == "connected\n"
        else:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.connect("\0" + name)
            self.sock.sendall(self.junk)

    def dropped(self) -> bool:
        """Whether the rank closed the connection (waits for that, 30 s at most)."""
        if self.child is not None:
            out, _ = self.child.communicate("\n", timeout=60)
            return out == "dropped\n"
        assert self.sock is not None
        self.sock.settimeout(30)
        return self.sock.recv(1) == b""

    def close(self) -> None:
        if self.child is not None:
            if self.child.poll() is None:
                self.child.kill()
            with contextlib.suppress(OSError, ValueError):
                self.child.communicate(timeout=30)
        if self.sock is not None:
            self.sock.close()
