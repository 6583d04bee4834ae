"""TcpTransport driven from outside through the Drivable hooks, as the hybrid transport does.

A small loop plays the driver: ``poll()`` every transport until nothing moves,
then ``begin_sleep()`` them all, block in ``select()`` on their ``sleep_fd()``
and ``end_sleep()``. Every sleep must end because a descriptor became ready,
never because ``select()`` ran out of time: a missed wake-up fails the test
instead of slowing it down.
"""

from __future__ import annotations

import math
import select
import threading
from collections.abc import Callable, Sequence

import numpy as np
import pytest
from tcp_helpers import SelectWatch, no_leaks, tcp_transports  # noqa: F401 (fixture)

from plait.errors import ClosedError
from plait.transport.base import Drivable, Handle
from plait.transport.tcp import EAGER_MAX, TcpTransport

pytestmark = pytest.mark.usefixtures("no_leaks")

#: A sleep that lasts this long means a wake-up was lost.
SLEEP_LIMIT = 20.0


def _pattern(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def _sleep(ts: Sequence[TcpTransport], on_armed: Callable[[], None] | None = None) -> bool:
    """Arm every transport and block on their descriptors; False if one refused to arm.

    ``on_armed`` runs once all are armed, just before blocking.
    """
    armed = []
    try:
        for t in ts:
            if t.begin_sleep() == 0.0:
                return False
            armed.append(t)
        if on_armed is not None:
            on_armed()
        ready, _, _ = select.select([t.sleep_fd() for t in ts], [], [], SLEEP_LIMIT)
        assert ready, f"no descriptor became ready within {SLEEP_LIMIT} s: a lost wake-up"
        return True
    finally:
        for t in armed:
            t.end_sleep()


def drive(
    ts: Sequence[TcpTransport],
    handles: Sequence[Handle],
    on_sleep: Callable[[], None] | None = None,
) -> int:
    """Drive ``ts`` from this thread until every handle is done; the number of sleeps.

    ``on_sleep`` runs once, when the driver is first armed and about to block.
    """
    sleeps = 0
    for _ in range(100_000):
        if all(h.done for h in handles):
            return sleeps
        if any([t.poll() for t in ts]):  # a list: poll every one of them
            continue
        sleeps += _sleep(ts, on_sleep if sleeps == 0 else None)
    raise AssertionError("the handles never completed")


def test_tcp_transport_is_drivable() -> None:
    ts = tcp_transports(2)
    try:
        assert all(isinstance(t, Drivable) for t in ts)
        assert ts[0].sleep_fd() != ts[1].sleep_fd()
    finally:
        for t in ts:
            t.close()


@pytest.mark.parametrize("streams", [1, 3])
def test_one_thread_drives_two_ranks(streams: int) -> None:
    """One loop moves small, eager and rendezvous messages both ways between two ranks."""
    ts = tcp_transports(2, streams=streams)
    sizes = [8, 0, EAGER_MAX, EAGER_MAX + 1, 6 << 20, 100]
    try:
        got = {(r, i): np.zeros(n, np.uint8) for r in (0, 1) for i, n in enumerate(sizes)}
        hs = []
        for t in ts:
            other = 1 - t.rank
            hs += [
                t.isend(other, i % 2, _pattern(n, 10 * t.rank + i).data, 0)
                for i, n in enumerate(sizes)
            ]
            hs += [t.irecv(other, i % 2, got[t.rank, i].data, 0) for i in range(len(sizes))]
        drive(ts, hs)
        assert [h.error for h in hs] == [None] * len(hs)
        for (r, i), arr in got.items():
            np.testing.assert_array_equal(arr, _pattern(sizes[i], 10 * (1 - r) + i))
    finally:
        for t in ts:
            t.close()


def test_self_send_from_another_thread_wakes_the_sleeping_driver() -> None:
    ts = tcp_transports(2)
    try:
        t = ts[0]
        got = np.zeros(16, np.uint8)
        r = t.irecv(0, 5, got.data, 0)
        armed = threading.Event()
        sender = threading.Thread(
            target=lambda: armed.wait(30) and t.isend(0, 5, _pattern(16, 1).data, 0)
        )
        sender.start()
        assert t.poll() is False
        assert t.begin_sleep() == math.inf
        try:
            armed.set()  # the other thread sends to itself while this one sleeps
            ready, _, _ = select.select([t.sleep_fd()], [], [], SLEEP_LIMIT)
        finally:
            t.end_sleep()
        sender.join(30)
        assert ready, "the completion did not wake the sleeping driver"
        assert r.done
        assert r.error is None
        np.testing.assert_array_equal(got, _pattern(16, 1))
        assert t.poll() is True  # it moved: the driver should look at its handles
        assert t.poll() is False
    finally:
        for t in ts:
            t.close()


@pytest.mark.parametrize("nbytes", [64, EAGER_MAX + 1])
def test_send_from_another_thread_while_the_driver_sleeps(nbytes: int) -> None:
    """A send posted while the driver sleeps is handed to it through the wake-up pipe."""
    ts = tcp_transports(2)
    try:
        a, b = ts
        got = np.zeros(nbytes, np.uint8)
        r = b.irecv(0, 1, got.data, 0)
        data = _pattern(nbytes, 2)
        sent: list[Handle] = []
        go = threading.Event()

        def send() -> None:
            assert go.wait(30)
            sent.append(a.isend(1, 1, data.data, 0))

        th = threading.Thread(target=send)
        th.start()
        sleeps = drive(ts, [r], on_sleep=go.set)
        th.join(30)
        assert sleeps >= 1
        drive(ts, sent)
        assert r.error is None
        assert sent[0].error is None
        np.testing.assert_array_equal(got, data)
    finally:
        for t in ts:
            t.close()


def test_cancel_from_another_thread_wakes_the_sleeping_driver() -> None:
    ts = tcp_transports(2)
    try:
        t = ts[0]
        buf = np.full(8, 0xEE, np.uint8)
        r = t.irecv(1, 1, buf.data, 0)
        canceller = threading.Thread(target=t.cancel, args=(r,))
        drive(ts, [r], on_sleep=canceller.start)
        canceller.join(30)
        assert r.done
        assert r.error is None
        assert (buf == 0xEE).all()
    finally:
        for t in ts:
            t.close()


def test_close_while_the_driver_sleeps() -> None:
    """close() wakes the sleeping driver and waits for end_sleep() before tearing down."""
    ts = tcp_transports(2)
    try:
        t = ts[0]
        r = t.irecv(1, 1, np.zeros(8, np.uint8).data, 0)
        assert t.poll() is False
        assert t.begin_sleep() == math.inf
        closer = threading.Thread(target=t.close)
        try:
            closer.start()
            ready, _, _ = select.select([t.sleep_fd()], [], [], SLEEP_LIMIT)
            assert ready, "close() did not wake the sleeping driver"
            assert closer.is_alive(), "close() tore down while the driver slept"
            assert not r.done
        finally:
            t.end_sleep()
        closer.join(30)
        assert not closer.is_alive()
        assert isinstance(r.error, ClosedError), r.error
        assert t.poll() is False
        assert t.begin_sleep() == 0.0
    finally:
        for t in ts:
            t.close()


def test_begin_sleep_refuses_after_progress_since_the_last_poll() -> None:
    ts = tcp_transports(2)
    try:
        t = ts[0]
        got = np.zeros(4, np.uint8)
        r = t.irecv(0, 1, got.data, 0)
        while t.poll():
            pass
        t.isend(0, 1, np.ones(4, np.uint8).data, 0)  # completes r: progress the driver missed
        assert r.done
        assert t.begin_sleep() == 0.0  # nothing armed: no end_sleep()
        assert t.poll() is True
        assert t.poll() is False
        assert t.begin_sleep() == math.inf
        t.end_sleep()
    finally:
        for t in ts:
            t.close()


def test_poll_leaves_progress_to_a_thread_that_drives() -> None:
    """While a thread drives the transport in wait_any, poll() and begin_sleep() stand by."""
    ts = tcp_transports(2)
    try:
        a, b = ts
        got = np.zeros(4, np.uint8)
        r = a.irecv(1, 1, got.data, 0)
        watch = SelectWatch(a)
        waiter = threading.Thread(target=a.wait_any, args=([r], 30))
        waiter.start()
        watch.wait_blocked(waiter, 30)  # the waiter has taken the I/O role, blocks in select()
        assert a.poll() is False
        assert a.begin_sleep() == 0.0
        sent = b.isend(0, 1, np.ones(4, np.uint8).data, 0)
        waiter.join(30)
        assert not waiter.is_alive()
        assert r.done
        assert sent.done
        assert got.tolist() == [1, 1, 1, 1]
    finally:
        for t in ts:
            t.close()
