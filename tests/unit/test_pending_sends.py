"""The sends a rank keeps in flight per peer (plait.runtime.crossing.pending_sends): kept
and dropped at a cost that grows with their number, not its square."""

from __future__ import annotations

from typing import Any

from plait.runtime import crossing


class _Send:
    """A send handle that counts how often its state is read."""

    reads = 0

    def __init__(self) -> None:
        self._done = False

    @property
    def done(self) -> bool:
        _Send.reads += 1
        return self._done


def test_many_sends_in_flight_are_kept_in_linear_time() -> None:
    """A loop of 4,000 isends ahead of their receives read every kept send at each post
    (8 million reads; 6.7 s to post 16,000 over shared memory)."""
    transport: Any = object()
    sends = [_Send() for _ in range(4000)]
    _Send.reads = 0
    try:
        for s in sends:
            crossing.sending(transport, 1, s)
        assert len(crossing.pending_sends[(id(transport), 1)]) == 4000
        assert _Send.reads <= 4 * len(sends), _Send.reads
    finally:
        crossing.pending_sends.pop((id(transport), 1), None)


def test_ended_sends_are_dropped() -> None:
    transport: Any = object()
    kept = []
    try:
        for _ in range(1000):
            s = _Send()
            crossing.sending(transport, 0, s)
            s._done = True  # ends at once
            kept.append(s)
        assert len(crossing.pending_sends[(id(transport), 0)]) <= 64
        live = _Send()
        crossing.sending(transport, 0, live)
        assert any(r() is live for r in crossing.pending_sends[(id(transport), 0)])
    finally:
        crossing.pending_sends.pop((id(transport), 0), None)
