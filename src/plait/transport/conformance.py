"""A conformance suite every transport runs: plain functions that assert the contract.

Each ``check_*`` function takes ``make``, a factory such that ``make(size)``
returns ``size`` connected transports (index = rank), exercises them and
closes them. A check raises AssertionError (with the values involved) when the
transport breaks :mod:`plait.transport.base`'s contract. Ranks run on threads
(:func:`run_ranks`), because transports such as TCP move bytes only while their
own rank waits.

Use it from a test module::

    @pytest.mark.parametrize("check", conformance.CHECKS, ids=lambda f: f.__name__)
    def test_conformance(check):
        check(lambda size: MemoryFabric(size).endpoints)

:data:`BUFFERED_CHECKS` need a transport that buffers small messages (a send
completes before its receive is posted); a zero-buffer transport (the memory
transport's lockstep mode) skips them. :func:`build_in_threads` builds
transports whose constructors block until all ranks are there (TCP, shared
memory) on one thread per rank; it and the other helpers live in
:mod:`plait.transport.harness`.

The ``check_pattern_*`` and ``check_probe``/``check_withdraw`` checks cover
matching patterns (:class:`~plait.transport.base.Matching`: any of several
peers, tags agreeing under a mask, probes, withdrawing); every endpoint-based
transport must pass them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np

from plait.errors import ClosedError, MismatchError, PeerLostError
from plait.transport import harness
from plait.transport.base import Transport, peer_closed
from plait.transport.harness import WAIT, Factory, build_in_threads, run_ranks, wait_all
from plait.transport.pattern_checks import (
    check_pattern_any_peer_takes_the_earliest,
    check_pattern_keeps_mpi_order,
    check_pattern_lost_peers,
    check_probe,
    check_withdraw,
)

__all__ = [
    "BUFFERED_CHECKS",
    "CHECKS",
    "Factory",
    "build_in_threads",
    "check_cancel",
    "check_cancel_completed",
    "check_check_mismatch",
    "check_close_fails_own_pending",
    "check_close_while_waiting",
    "check_concurrent_threads",
    "check_counters",
    "check_fifo_per_tag",
    "check_large_message",
    "check_length_mismatch",
    "check_many_peers",
    "check_pattern_any_peer_takes_the_earliest",
    "check_pattern_keeps_mpi_order",
    "check_pattern_lost_peers",
    "check_peer_close",
    "check_probe",
    "check_self_send",
    "check_send_completes_without_recv",
    "check_send_recv",
    "check_send_then_close",
    "check_tags_match_out_of_order",
    "check_unexpected_then_posted",
    "check_wait_any_timeout",
    "check_withdraw",
    "check_zero_length",
    "run_ranks",
    "wait_all",
]

# -- checks -----------------------------------------------------------------------------------


def check_send_recv(make: Factory) -> None:
    """One message each way between two ranks arrives intact, with error None."""
    ts = harness.made(make, 2)
    try:

        def body(t: Transport) -> np.ndarray:
            other = 1 - t.rank
            data = harness.pattern(100, t.rank)
            got = np.zeros(100, np.uint8)
            hs = t.isend(other, 5, harness.mv(data), 7), t.irecv(other, 5, harness.mv(got), 7)
            harness.ok(t, hs)
            assert all(h.peer == other for h in hs), [h.peer for h in hs]
            return got

        got = run_ranks(ts, body)
        for r in range(2):
            np.testing.assert_array_equal(got[r], harness.pattern(100, 1 - r))
    finally:
        harness.close_all(ts)


def check_fifo_per_tag(make: Factory) -> None:
    """Messages with one (peer, tag) match receives in send order, whatever their sizes.

    Receives are posted before the messages arrive (first half) and after
    (second half); sizes mix small messages with large ones.
    """
    sizes = [8, 1, 300_000, 16, 0, 1 << 20, 3, 70_000, 8, 2_000_000, 5, 8]
    ts = harness.made(make, 2)
    try:

        def body(t: Transport) -> list[np.ndarray] | None:
            if t.rank == 0:
                hs = [
                    t.isend(1, 9, harness.mv(harness.pattern(n, i)), 1) for i, n in enumerate(sizes)
                ]
                harness.ok(t, hs)
                return None
            got = [np.zeros(n, np.uint8) for n in sizes]
            half = len(sizes) // 2
            hs = [t.irecv(0, 9, harness.mv(got[i]), 1) for i in range(half)]
            harness.ok(t, hs)
            hs = [t.irecv(0, 9, harness.mv(got[i]), 1) for i in range(half, len(sizes))]
            harness.ok(t, hs)
            return got

        got = run_ranks(ts, body)[1]
        assert got is not None
        for i, n in enumerate(sizes):
            np.testing.assert_array_equal(
                got[i], harness.pattern(n, i), err_msg=f"message {i} ({n} B)"
            )
    finally:
        harness.close_all(ts)


def check_tags_match_out_of_order(make: Factory) -> None:
    """Receives with different tags match their own messages, in any posting order."""
    ts = harness.made(make, 2)
    try:

        def body(t: Transport) -> dict[int, np.ndarray] | None:
            if t.rank == 0:
                hs = [
                    t.isend(1, tag, harness.mv(harness.pattern(64, tag)), 3) for tag in (1, 2, 3, 4)
                ]
                harness.ok(t, hs)
                return None
            got = {tag: np.zeros(64, np.uint8) for tag in (1, 2, 3, 4)}
            # Tag 4 first and alone: it must complete although 1..3 were sent before it.
            h4 = t.irecv(0, 4, harness.mv(got[4]), 3)
            harness.ok(t, [h4])
            hs = [t.irecv(0, tag, harness.mv(got[tag]), 3) for tag in (3, 1, 2)]
            harness.ok(t, hs)
            return got

        got = run_ranks(ts, body)[1]
        assert got is not None
        for tag, arr in got.items():
            np.testing.assert_array_equal(arr, harness.pattern(64, tag), err_msg=f"tag {tag}")
    finally:
        harness.close_all(ts)


def check_unexpected_then_posted(make: Factory) -> None:
    """Messages that arrive before their receive is posted are kept and delivered intact.

    Includes a large one that is likely still arriving when its receive is posted.
    """
    sizes = [24, 5_000_000]
    ts = harness.made(make, 2)
    posted = threading.Event()
    try:

        def body(t: Transport) -> list[np.ndarray] | None:
            if t.rank == 0:
                hs = [t.isend(1, 11, harness.mv(harness.pattern(n, n)), 2) for n in sizes]
                harness.ok(t, hs)
                return None
            time.sleep(0.2)  # let the messages arrive (or start to) with nothing posted
            got = [np.zeros(n, np.uint8) for n in sizes]
            hs = [t.irecv(0, 11, harness.mv(g), 2) for g in got]
            posted.set()
            harness.ok(t, hs)
            return got

        got = run_ranks(ts, body)[1]
        assert got is not None
        for g, n in zip(got, sizes, strict=True):
            np.testing.assert_array_equal(g, harness.pattern(n, n), err_msg=f"{n} B")
    finally:
        harness.close_all(ts)


def check_zero_length(make: Factory) -> None:
    """Zero-byte messages are allowed, complete, and keep their place in the (peer, tag) order."""
    ts = harness.made(make, 2)
    try:

        def body(t: Transport) -> np.ndarray | None:
            empty = np.zeros(0, np.uint8)
            if t.rank == 0:
                hs = [
                    t.isend(1, 2, harness.mv(empty), 4),
                    t.isend(1, 2, harness.mv(harness.pattern(10, 1)), 4),
                    t.isend(1, 2, harness.mv(empty), 4),
                ]
                harness.ok(t, hs)
                return None
            got = np.zeros(10, np.uint8)
            sink = np.zeros(0, np.uint8)
            hs = [
                t.irecv(0, 2, harness.mv(sink), 4),
                t.irecv(0, 2, harness.mv(got), 4),
                t.irecv(0, 2, harness.mv(sink), 4),
            ]
            harness.ok(t, hs)
            return got

        got = run_ranks(ts, body)[1]
        np.testing.assert_array_equal(got, harness.pattern(10, 1))
    finally:
        harness.close_all(ts)


def check_large_message(make: Factory, nbytes: int = 64 << 20) -> None:
    """A large message each way at once (both ranks send first): full duplex, no deadlock."""
    ts = harness.made(make, 2)
    try:

        def body(t: Transport) -> bool:
            other = 1 - t.rank
            data = harness.pattern(nbytes, t.rank)
            got = np.zeros(nbytes, np.uint8)
            hs = [t.isend(other, 1, harness.mv(data), 5), t.irecv(other, 1, harness.mv(got), 5)]
            harness.ok(t, hs, timeout=60.0)
            expected = harness.pattern(nbytes, other)
            bad = np.flatnonzero(got != expected)
            first = bad[0] if bad.size else 0
            assert bad.size == 0, f"rank {t.rank}: {bad.size} wrong bytes, first at {first}"
            return True

        assert run_ranks(ts, body, timeout=90.0) == [True, True]
    finally:
        harness.close_all(ts)


def check_many_peers(make: Factory, size: int = 5) -> None:
    """All-to-all among ``size`` ranks at once, small and large messages, two tags."""
    ts = harness.made(make, size)

    def nbytes(src: int, dst: int) -> int:
        return 400_000 if (src + dst) % 3 == 0 else 10 + src * size + dst

    try:

        def body(t: Transport) -> dict[tuple[int, int], np.ndarray]:
            r = t.rank
            hs = []
            got: dict[tuple[int, int], np.ndarray] = {}
            for other in range(size):
                if other == r:
                    continue
                for tag in (0, 1):
                    got[other, tag] = np.zeros(nbytes(other, r), np.uint8)
                    hs.append(t.irecv(other, tag, harness.mv(got[other, tag]), 6))
                    data = harness.pattern(nbytes(r, other), 1000 * r + 10 * other + tag)
                    hs.append(t.isend(other, tag, harness.mv(data), 6))
            harness.ok(t, hs)
            return got

        results = run_ranks(ts, body)
        for dst, got in enumerate(results):
            for (src, tag), arr in got.items():
                np.testing.assert_array_equal(
                    arr,
                    harness.pattern(nbytes(src, dst), 1000 * src + 10 * dst + tag),
                    err_msg=f"{src} -> {dst} tag {tag}",
                )
    finally:
        harness.close_all(ts)


def _check_mismatch(make: Factory, send_n: int, send_check: int, what: str) -> None:
    ts = harness.made(make, 2)
    try:

        def body(t: Transport) -> None:
            if t.rank == 0:
                hs = [
                    t.isend(
                        1, 3, harness.mv(harness.pattern(send_n, 1)), send_check
                    ),  # posted-first case
                    t.isend(1, 3, harness.mv(harness.pattern(8, 2)), 1),
                    t.isend(
                        1, 4, harness.mv(harness.pattern(send_n, 3)), send_check
                    ),  # arrives-first case
                    t.isend(1, 4, harness.mv(harness.pattern(8, 4)), 1),
                ]
                wait_all(t, hs)  # a transport may fail the bad sends too
                assert hs[1].error is None, hs[1].error
                assert hs[3].error is None, hs[3].error
                return
            bad = np.full(8, 0xAB, np.uint8)
            good = np.zeros(8, np.uint8)
            h = t.irecv(0, 3, harness.mv(bad), 1)
            wait_all(t, [h])
            assert isinstance(h.error, MismatchError), f"{what}: got {h.error!r}"
            assert (bad == 0xAB).all(), f"{what}: the failed receive wrote into its buffer"
            h = t.irecv(0, 3, harness.mv(good), 1)  # the stream is still in step
            harness.ok(t, [h])
            np.testing.assert_array_equal(good, harness.pattern(8, 2))
            time.sleep(0.1)
            h = t.irecv(0, 4, harness.mv(bad), 1)
            wait_all(t, [h])
            assert isinstance(h.error, MismatchError), f"{what} (unexpected): got {h.error!r}"
            assert (bad == 0xAB).all(), f"{what}: the failed receive wrote into its buffer"
            h = t.irecv(0, 4, harness.mv(good), 1)
            harness.ok(t, [h])
            np.testing.assert_array_equal(good, harness.pattern(8, 4))

        run_ranks(ts, body)
    finally:
        harness.close_all(ts)


def check_length_mismatch(make: Factory) -> None:
    """A message longer or shorter than its receive fails it with MismatchError, cleanly."""
    _check_mismatch(make, 10, 1, "longer")
    _check_mismatch(make, 6, 1, "shorter")


def check_check_mismatch(make: Factory) -> None:
    """A message whose check word differs fails its receive with MismatchError, cleanly."""
    _check_mismatch(make, 8, 2, "check word")


def check_peer_close(make: Factory) -> None:
    """When a peer closes, pending and later operations with it fail with PeerLostError, promptly.

    Operations with the other peers keep working.
    """
    ts = harness.made(make, 3)
    try:
        closed = threading.Event()
        closed_at: list[float] = []

        def body(t: Transport) -> float | None:
            if t.rank == 0:
                time.sleep(0.2)
                closed_at.append(time.monotonic())
                closed.set()
                t.close()
                return None
            if t.rank == 2:
                got = np.zeros(4, np.uint8)
                h = t.irecv(1, 1, harness.mv(got), 0)
                harness.ok(t, [h])
                assert got.tolist() == [1, 2, 3, 4], got
                return None
            buf = np.zeros(4, np.uint8)
            h = t.irecv(0, 1, harness.mv(buf), 0)
            wait_all(t, [h], timeout=10.0)
            seen = time.monotonic()
            assert closed.is_set(), "the receive finished before its peer closed"
            assert isinstance(h.error, PeerLostError), f"got {h.error!r}"
            delay = seen - closed_at[0]
            assert delay < 2.0, f"the lost peer was noticed only after {delay:.2f} s"
            later = [t.irecv(0, 2, harness.mv(buf), 0), t.isend(0, 2, harness.mv(buf), 0)]
            wait_all(t, later, timeout=10.0)
            for x in later:
                assert isinstance(x.error, PeerLostError), f"after close: {x.error!r}"
            harness.ok(t, [t.isend(2, 1, harness.mv(np.array([1, 2, 3, 4], np.uint8)), 0)])
            return seen

        run_ranks(ts, body)
    finally:
        harness.close_all(ts)


def check_send_then_close(make: Factory) -> None:
    """Messages sent before a close are still delivered (needs buffering)."""
    ts = harness.made(make, 2)
    try:
        data = harness.pattern(1000, 9)
        h = ts[0].isend(1, 1, harness.mv(data), 0)
        wait_all(ts[0], [h])
        ts[0].close()
        got = np.zeros(1000, np.uint8)
        r = ts[1].irecv(0, 1, harness.mv(got), 0)
        harness.ok(ts[1], [r])
        np.testing.assert_array_equal(got, data)
        r = ts[1].irecv(0, 1, harness.mv(got), 0)
        wait_all(ts[1], [r])
        assert isinstance(r.error, PeerLostError), f"got {r.error!r}"
    finally:
        harness.close_all(ts)


def check_close_fails_own_pending(make: Factory) -> None:
    """close() completes this rank's pending receives with ClosedError; close is idempotent."""
    ts = harness.made(make, 2)
    try:
        buf = np.full(4, 7, np.uint8)
        h = ts[0].irecv(1, 1, harness.mv(buf), 0)
        ts[0].close()
        ts[0].close()
        assert h.done, "a pending receive is still pending after close()"
        assert isinstance(h.error, ClosedError), f"got {h.error!r}"
        assert (buf == 7).all()
    finally:
        harness.close_all(ts)


def check_close_while_waiting(make: Factory) -> None:
    """A close from another thread ends this rank's blocked wait with ClosedError (its own
    close, not a lost peer), and a peer's receive from it with a PeerLostError that says the
    rank closed rather than died (``peer_closed``: Note [peers that close] in
    :mod:`plait.transport.base`)."""
    ts = harness.made(make, 2)
    try:
        mine, theirs = np.full(4, 7, np.uint8), np.zeros(4, np.uint8)
        h = ts[0].irecv(1, 1, harness.mv(mine), 0)
        peer = ts[1].irecv(0, 1, harness.mv(theirs), 0)
        closer = threading.Timer(0.2, ts[0].close)
        closer.start()
        try:
            assert ts[0].wait_any([h], WAIT), f"the wait outlived the close: {h.error!r}"
        finally:
            closer.join()
        assert isinstance(h.error, ClosedError), f"own close: got {h.error!r}"
        assert (mine == 7).all()
        wait_all(ts[1], [peer])
        assert isinstance(peer.error, PeerLostError), f"peer's close: got {peer.error!r}"
        assert peer_closed(peer.error), f"a close taken for a death: {peer.error!r}"
    finally:
        harness.close_all(ts)


def check_wait_any_timeout(make: Factory) -> None:
    """wait_any returns False after about ``timeout`` seconds, without burning the CPU."""
    ts = harness.made(make, 2)
    try:
        t = ts[0]
        h = t.irecv(1, 1, harness.mv(np.zeros(4, np.uint8)), 0)
        assert t.wait_any([h], 0) is False
        cpu, start = time.thread_time(), time.monotonic()
        assert t.wait_any([h], 0.3) is False
        elapsed, used = time.monotonic() - start, time.thread_time() - cpu
        assert 0.28 <= elapsed < 2.0, f"wait_any(0.3) took {elapsed:.3f} s"
        assert used < 0.1, f"wait_any(0.3) used {used:.3f} s of CPU: busy waiting"
        assert not h.done
        t.cancel(h)
    finally:
        harness.close_all(ts)


def check_cancel(make: Factory) -> None:
    """A cancelled receive is done, never written to, and does not consume a message."""
    ts = harness.made(make, 2)
    cancelled = threading.Event()
    try:

        def body(t: Transport) -> None:
            if t.rank == 0:
                assert cancelled.wait(WAIT)
                harness.ok(t, [t.isend(1, 1, harness.mv(harness.pattern(32, 1)), 0)])
                return
            first = np.full(32, 0xEE, np.uint8)
            h = t.irecv(0, 1, harness.mv(first), 0)
            t.cancel(h)
            assert h.done, "a cancelled handle must be done"
            cancelled.set()
            second = np.zeros(32, np.uint8)
            h2 = t.irecv(0, 1, harness.mv(second), 0)
            harness.ok(t, [h2])
            np.testing.assert_array_equal(second, harness.pattern(32, 1))
            assert (first == 0xEE).all(), "the cancelled receive was written to"

        run_ranks(ts, body)
    finally:
        harness.close_all(ts)


def check_cancel_completed(make: Factory) -> None:
    """Cancelling a finished handle changes nothing."""
    ts = harness.made(make, 2)
    try:

        def body(t: Transport) -> None:
            other = 1 - t.rank
            got = np.zeros(8, np.uint8)
            hs = [
                t.isend(other, 1, harness.mv(harness.pattern(8, t.rank)), 0),
                t.irecv(other, 1, harness.mv(got), 0),
            ]
            harness.ok(t, hs)
            for h in hs:
                t.cancel(h)
                assert h.done
                assert h.error is None
            np.testing.assert_array_equal(got, harness.pattern(8, other))

        run_ranks(ts, body)
    finally:
        harness.close_all(ts)


def check_send_completes_without_recv(make: Factory) -> None:
    """A small send completes before its receive is posted (needs buffering)."""
    ts = harness.made(make, 2)
    try:
        data = harness.pattern(64, 3)
        h = ts[0].isend(1, 1, harness.mv(data), 0)
        wait_all(ts[0], [h], timeout=5.0)
        assert h.error is None, h.error
        got = np.zeros(64, np.uint8)
        harness.ok(ts[1], [ts[1].irecv(0, 1, harness.mv(got), 0)])
        np.testing.assert_array_equal(got, data)
    finally:
        harness.close_all(ts)


def check_self_send(make: Factory) -> None:
    """A rank may send to itself; (peer, tag) order holds there too."""
    ts = harness.made(make, 2)
    try:
        t = ts[1]
        a, b = harness.pattern(16, 1), harness.pattern(16, 2)
        got = [np.zeros(16, np.uint8), np.zeros(16, np.uint8)]
        h0 = t.irecv(1, 4, harness.mv(got[0]), 0)
        hs = [h0, t.isend(1, 4, harness.mv(a), 0), t.isend(1, 4, harness.mv(b), 0)]
        hs.append(t.irecv(1, 4, harness.mv(got[1]), 0))
        harness.ok(t, hs)
        np.testing.assert_array_equal(got[0], a)
        np.testing.assert_array_equal(got[1], b)
    finally:
        harness.close_all(ts)


def check_counters(make: Factory) -> None:
    """``bytes_sent``/``bytes_received`` (where present) count payload bytes."""
    ts = harness.made(make, 2)
    try:
        if not all(hasattr(t, "bytes_sent") and hasattr(t, "bytes_received") for t in ts):
            return
        base = [(t.bytes_sent, t.bytes_received) for t in ts]  # type: ignore[attr-defined]

        def body(t: Transport) -> None:
            other = 1 - t.rank
            n = 1000 + 500_000 * t.rank
            got = np.zeros(1000 + 500_000 * other, np.uint8)
            harness.ok(
                t,
                [
                    t.isend(other, 1, harness.mv(harness.pattern(n, 0)), 0),
                    t.irecv(other, 1, harness.mv(got), 0),
                ],
            )

        run_ranks(ts, body)
        for r, t in enumerate(ts):
            sent = t.bytes_sent - base[r][0]  # type: ignore[attr-defined]
            received = t.bytes_received - base[r][1]  # type: ignore[attr-defined]
            assert sent == 1000 + 500_000 * r, f"rank {r} bytes_sent grew by {sent}"
            assert received == 1000 + 500_000 * (1 - r), (
                f"rank {r} bytes_received grew by {received}"
            )
    finally:
        harness.close_all(ts)


def check_concurrent_threads(make: Factory, rounds: int = 200) -> None:
    """Two threads of each rank use one transport at once (distinct tags), correctly."""
    ts = harness.made(make, 2)
    try:

        def body(t: Transport) -> None:
            other = 1 - t.rank
            errors: list[BaseException] = []

            def worker(tag: int) -> None:
                try:
                    for i in range(rounds):
                        n = 300_000 if i % 50 == 7 else 8 + i % 13
                        data = harness.pattern(n, (t.rank << 20) + (tag << 16) + i)
                        got = np.zeros(n, np.uint8)
                        hs = [
                            t.isend(other, tag, harness.mv(data), tag),
                            t.irecv(other, tag, harness.mv(got), tag),
                        ]
                        harness.ok(t, hs)
                        expected = harness.pattern(n, (other << 20) + (tag << 16) + i)
                        assert np.array_equal(got, expected), f"tag {tag} round {i}: wrong data"
                except BaseException as exc:
                    errors.append(exc)

            threads = [threading.Thread(target=worker, args=(tag,)) for tag in (1, 2)]
            for th in threads:
                th.start()
            for th in threads:
                th.join(60.0)
            assert not any(th.is_alive() for th in threads), "a worker thread hung"
            if errors:
                raise errors[0]

        run_ranks(ts, body, timeout=90.0)
    finally:
        harness.close_all(ts)


#: Every check, in a sensible order.
CHECKS: tuple[Callable[[Factory], None], ...] = (
    check_send_recv,
    check_fifo_per_tag,
    check_tags_match_out_of_order,
    check_unexpected_then_posted,
    check_zero_length,
    check_large_message,
    check_many_peers,
    check_length_mismatch,
    check_check_mismatch,
    check_peer_close,
    check_send_then_close,
    check_close_fails_own_pending,
    check_close_while_waiting,
    check_wait_any_timeout,
    check_cancel,
    check_cancel_completed,
    check_send_completes_without_recv,
    check_self_send,
    check_counters,
    check_concurrent_threads,
    check_pattern_any_peer_takes_the_earliest,
    check_pattern_keeps_mpi_order,
    check_probe,
    check_withdraw,
    check_pattern_lost_peers,
)

#: Checks that need sends to complete before their receives are posted.
BUFFERED_CHECKS: frozenset[Callable[[Factory], None]] = frozenset(
    {check_send_completes_without_recv, check_send_then_close}
)
