"""A thread asleep in a TCP transport's epoll is woken by whatever another thread does.

The waiting thread blocks in ``wait_any`` (``SelectWatch`` tells when it sleeps);
another thread then sends to itself, sends to a peer, cancels or closes. Every wait
must end because the sleeper was woken, never because it ran out of time: a missed
wake-up fails the test instead of slowing it down.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from tcp_helpers import SelectWatch, no_leaks, tcp_transports  # noqa: F401 (fixture)

from plait.errors import ClosedError
from plait.transport.base import Handle
from plait.transport.tcp import EAGER_MAX, TcpTransport

pytestmark = pytest.mark.usefixtures("no_leaks")

#: A wait that lasts this long means a wake-up was lost.
WAIT_LIMIT = 20.0


def _pattern(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def _asleep(t: TcpTransport, handles: list[Handle]) -> tuple[threading.Thread, list[bool]]:
    """A thread waiting on ``handles`` in ``t``, returned once it sleeps in epoll."""
    watch = SelectWatch(t)
    result: list[bool] = []
    waiter = threading.Thread(target=lambda: result.append(t.wait_any(handles, WAIT_LIMIT)))
    waiter.start()
    watch.wait_blocked(waiter, WAIT_LIMIT)
    return waiter, result


def test_self_send_from_another_thread_wakes_the_sleeping_waiter() -> None:
    ts = tcp_transports(2)
    try:
        t = ts[0]
        got = np.zeros(16, np.uint8)
        r = t.irecv(0, 5, got.data, 0)
        waiter, result = _asleep(t, [r])
        t.isend(0, 5, _pattern(16, 1).data, 0)  # completes r while the waiter sleeps
        waiter.join(WAIT_LIMIT)
        assert result == [True], "the completion did not wake the sleeping waiter"
        assert r.error is None
        np.testing.assert_array_equal(got, _pattern(16, 1))
    finally:
        for t in ts:
            t.close()


@pytest.mark.parametrize("nbytes", [64, EAGER_MAX + 1])
def test_send_from_another_thread_while_the_waiter_sleeps(nbytes: int) -> None:
    """A send posted while a thread of the same rank sleeps goes out, and its answer wakes it."""
    ts = tcp_transports(2)
    try:
        a, b = ts
        got = np.zeros(nbytes, np.uint8)
        echo = np.zeros(nbytes, np.uint8)
        back = a.irecv(1, 2, echo.data, 0)  # a sleeps waiting for b's echo
        waiter, result = _asleep(a, [back])
        data = _pattern(nbytes, 2)
        sent = a.isend(1, 1, data.data, 0)
        r = b.irecv(0, 1, got.data, 0)
        b.wait_any([r], WAIT_LIMIT)
        assert r.done
        assert r.error is None
        echoed = b.isend(0, 2, got.data, 0)
        while not echoed.done:
            assert b.wait_any([echoed], WAIT_LIMIT)
        waiter.join(WAIT_LIMIT)
        assert result == [True]
        while not sent.done:
            assert a.wait_any([sent], WAIT_LIMIT)
        assert sent.error is None
        assert back.error is None
        np.testing.assert_array_equal(echo, data)
    finally:
        for t in ts:
            t.close()


def test_cancel_from_another_thread_wakes_the_sleeping_waiter() -> None:
    ts = tcp_transports(2)
    try:
        t = ts[0]
        buf = np.full(8, 0xEE, np.uint8)
        r = t.irecv(1, 1, buf.data, 0)
        waiter, result = _asleep(t, [r])
        t.cancel(r)
        waiter.join(WAIT_LIMIT)
        assert result == [True]
        assert r.done
        assert r.error is None
        assert (buf == 0xEE).all()
    finally:
        for t in ts:
            t.close()


def test_close_while_the_waiter_sleeps() -> None:
    """close() wakes the sleeping waiter and waits for it to leave epoll before tearing down."""
    ts = tcp_transports(2)
    try:
        t = ts[0]
        r = t.irecv(1, 1, np.zeros(8, np.uint8).data, 0)
        waiter, result = _asleep(t, [r])
        t.close()
        waiter.join(WAIT_LIMIT)
        assert not waiter.is_alive()
        assert result == [True]
        assert isinstance(r.error, ClosedError), r.error
    finally:
        for t in ts:
            t.close()


class _CountingPoller:
    """Wraps a transport's epoll, recording the timeout of every ``poll`` call."""

    def __init__(self, t: TcpTransport) -> None:
        self._poller = t._poller
        self.timeouts: list[float] = []
        t._poller = self

    def poll(self, timeout: float = -1) -> list[tuple[int, int]]:
        self.timeouts.append(timeout)
        return self._poller.poll(timeout)  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> object:
        return getattr(self._poller, name)


def test_a_wait_without_spin_makes_one_epoll_call() -> None:
    """With nothing to spin, a wait goes straight to the blocking epoll: no ``poll(0)`` first.

    An extra non-blocking ``epoll_wait`` per wait cost an 8-byte round trip about a
    fifth of its CPU time.
    """
    ts = tcp_transports(2)
    try:
        a, b = ts
        a.spin = 0.0
        got = np.zeros(8, np.uint8)
        r = a.irecv(1, 3, got.data, 0)
        counter = _CountingPoller(a)
        watch = SelectWatch(a)  # wraps the counter: tells when the waiter blocks
        result: list[bool] = []
        waiter = threading.Thread(target=lambda: result.append(a.wait_any([r], WAIT_LIMIT)))
        waiter.start()
        watch.wait_blocked(waiter, WAIT_LIMIT)
        s = b.isend(0, 3, _pattern(8, 2).data, 0)
        waiter.join(WAIT_LIMIT)
        assert result == [True]
        assert b.wait_any([s], WAIT_LIMIT)
        assert counter.timeouts[0] != 0, counter.timeouts  # the first call blocks
        assert len(counter.timeouts) == 1, counter.timeouts
        np.testing.assert_array_equal(got, _pattern(8, 2))
    finally:
        for t in ts:
            t.close()
