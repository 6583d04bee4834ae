"""Communicators made by a test, run one thread a rank (plait.testing.run_ranks makes its own)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from plait import Communicator


def run_on(comms: Sequence[Communicator], fn: Callable[[Communicator], Any]) -> list[Any]:
    """``fn(comm)`` on one thread per communicator; their results in rank order. The first
    error raised is raised here (a rank that fails closes its communicator, so that its
    peers fail too rather than wait)."""
    results: list[Any] = [None] * len(comms)
    errors: list[BaseException] = []

    def body(r: int) -> None:
        try:
            results[r] = fn(comms[r])
        except BaseException as exc:
            errors.append(exc)
            comms[r].close()

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(len(comms))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(100)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads)
    return results
