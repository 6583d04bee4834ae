"""Helpers for the store tests: backends under test, free ports, threads and child processes."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from plait.rendezvous.store import Store
from ports import free_port  # noqa: F401 - the store tests' import of it

#: Default timeout of test stores: long enough for a slow CI machine, short
#: enough that a bug fails the test well before pytest-timeout kills it.
TEST_TIMEOUT = 10.0


def ipv6_loopback_available() -> bool:
    """Whether this machine can listen on ``::1``."""
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


@dataclass
class Backend:
    """One store under test: ``client()`` makes another client of the same data.

    ``client_code`` is Python source that, run in a fresh interpreter, binds
    ``store`` to a client of the same data (None: the store lives only in this
    process).
    """

    name: str
    make: Callable[[], Store]
    client_code: str | None
    closers: list[Callable[[], None]] = field(default_factory=list)

    def client(self) -> Store:
        store = self.make()
        self.closers.append(store.close)
        return store

    def close(self) -> None:
        for close in reversed(self.closers):
            close()
        self.closers.clear()


class Background:
    """Runs ``fn`` on a thread; :meth:`result` joins it and re-raises its exception."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._fn = fn
        self._value: Any = None
        self._error: BaseException | None = None
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._value = self._fn()
        except BaseException as exc:
            self._error = exc
        finally:
            self.done.set()

    def result(self, timeout: float = TEST_TIMEOUT) -> Any:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise AssertionError(f"background call still running after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._value


def run_python(codes: list[str], timeout: float = 60.0) -> list[str]:
    """Run each source in its own interpreter, all at once; their stdouts, in order.

    Raises AssertionError with the child's stderr if one fails.
    """
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for code in codes
    ]
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, f"child failed with {proc.returncode}:\n{err}"
            outputs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return outputs
