"""Helpers for the shared-memory transport tests: ranks on threads, a leak check, a sleep watch."""

from __future__ import annotations

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
