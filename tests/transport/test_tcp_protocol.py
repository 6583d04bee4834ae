"""The TCP wire protocol: eager and rendezvous messages, cancels at every stage, bad frames.

Messages above EAGER_MAX are announced (RTS), cleared by the receiver (CTS or
REFUSE) and only then sent (RDATA). These tests check that they keep the
transport contract (order per (peer, tag), mismatches, cancel), and that a
peer which sends impossible frames is dropped without making this rank
allocate what its headers announce.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import tracemalloc
from collections.abc import Iterator

import numpy as np
import pytest
from tcp_helpers import no_leaks, tcp_transports  # noqa: F401 (fixture)

from plait import _auth
from plait.errors import ClosedError, MismatchError, PeerLostError
from plait.rendezvous.store import MemoryStore
from plait.transport import endpoint
from plait.transport.conformance import run_ranks, wait_all
from plait.transport.tcp import (
    CHUNK,
    EAGER_MAX,
    STRIPE_MIN,
    PeerProtocolError,
    TcpTransport,
    wire,
)

pytestmark = pytest.mark.usefixtures("no_leaks")

BIG = EAGER_MAX + 1  # the smallest rendezvous message


def _pattern(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def _close(ts: list[TcpTransport]) -> None:
    for t in ts:
        t.close()


def _quiet(t: TcpTransport) -> None:
    """Assert that ``t`` holds no rendezvous state and no unexpected message any more."""
    assert not t._unexpected, t._unexpected
    for p in t._link.peers:
        if p is not None:
            assert not p.rts_out, (t.rank, p.rank, p.rts_out)
            assert not p.rts_in, (t.rank, p.rank, p.rts_in)
            assert not p.cleared, (t.rank, p.rank, p.cleared)


def _small_buffers(t: TcpTransport, peer: int) -> None:
    """Shrink the kernel's buffers of ``t``'s connections to ``peer`` (to 128 KiB or so).

    Then the bytes in flight between two ranks are a few chunks, not many MiB,
    so a test can tell a frame sent between two chunks from one sent after a
    whole payload.
    """
    p = t._link.peers[peer]
    assert p is not None
    for c in p.conns:
        assert c.sock is not None
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            c.sock.setsockopt(socket.SOL_SOCKET, opt, 64 << 10)


def _step(*ts: TcpTransport) -> None:
    """One round of progress on each transport, without blocking."""
    for t in ts:
        t.wait_any([], 0)


def _left(t: TcpTransport, peer: int, h: object) -> int:
    """Bytes of send ``h`` still in ``t``'s send queue on stream 0 to ``peer``."""
    p = t._link.peers[peer]
    assert p is not None
    return sum(
        item.total - item.off + (item.rest.nbytes if item.rest is not None else 0)
        for item in p.conns[0].sendq
        if item.op is h
    )


def _settle(a: TcpTransport, b: TcpTransport) -> None:
    """Exchange one small message each way on a spare tag, so the frames before it are read."""
    one = np.zeros(1, np.uint8)
    hs_a = [a.isend(b.rank, 1 << 40, one.data, 0), a.irecv(b.rank, 1 << 40, one.copy().data, 0)]
    hs_b = [b.isend(a.rank, 1 << 40, one.data, 0), b.irecv(a.rank, 1 << 40, one.copy().data, 0)]

    def drive_b() -> None:
        wait_all(b, hs_b)

    th = threading.Thread(target=drive_b)
    th.start()
    wait_all(a, hs_a)
    th.join(30)
    assert all(h.error is None for h in hs_a + hs_b)


# -- rendezvous keeps the contract -----------------------------------------------------------------

# (tag, nbytes): large and small messages, with the same and with other tags.
MIXED = [
    (1, BIG),
    (1, 8),
    (2, 3 << 20),
    (1, EAGER_MAX),  # the largest eager message
    (1, (2 << 20) + 5),
    (2, 100),
    (3, STRIPE_MIN),
    (1, 0),
    (3, 5 << 20),
    (1, BIG + 4096),
]


@pytest.mark.parametrize("streams", [1, 3])
@pytest.mark.parametrize("posted", ["before", "after", "half"])
def test_large_and_small_messages_match_in_send_order(streams: int, posted: str) -> None:
    """Rendezvous and eager messages of one (peer, tag) match in send order, any posting order."""
    ts = tcp_transports(2, streams=streams)
    ready = threading.Event()
    sent = threading.Event()
    try:

        def body(t: TcpTransport) -> list[np.ndarray] | None:
            if t.rank == 0:
                if posted == "before":
                    assert ready.wait(30)
                hs = [t.isend(1, tag, _pattern(n, i).data, tag) for i, (tag, n) in enumerate(MIXED)]
                sent.set()
                wait_all(t, hs)
                assert [h.error for h in hs] == [None] * len(hs)
                return None
            got = [np.zeros(n, np.uint8) for _, n in MIXED]
            order = list(range(len(MIXED)))
            if posted == "after":
                assert sent.wait(30)
            first = order if posted != "half" else order[: len(order) // 2]
            hs = [t.irecv(0, MIXED[i][0], got[i].data, MIXED[i][0]) for i in first]
            ready.set()
            if posted == "half":
                assert sent.wait(30)
                hs += [
                    t.irecv(0, MIXED[i][0], got[i].data, MIXED[i][0]) for i in order[len(first) :]
                ]
            wait_all(t, hs)
            assert [h.error for h in hs] == [None] * len(hs)
            return got

        got = run_ranks(ts, body)[1]
        assert got is not None
        for i, (tag, n) in enumerate(MIXED):
            np.testing.assert_array_equal(got[i], _pattern(n, i), err_msg=f"#{i} tag {tag} {n} B")
        for t in ts:
            _quiet(t)
    finally:
        _close(ts)


@pytest.mark.parametrize("streams", [1, 3])
def test_unexpected_large_messages_cost_a_record_not_a_buffer(streams: int) -> None:
    """Announced messages whose receive is not posted are kept as small records, in order."""
    ts = tcp_transports(2, streams=streams)
    try:
        a, b = ts
        sizes = [BIG, 4 << 20, BIG + 1]
        hs = [a.isend(1, 7, _pattern(n, n).data, 0) for n in sizes]
        small = a.isend(1, 7, _pattern(16, 1).data, 0)
        _settle(a, b)
        queue = b._unexpected[(0, 7)]
        assert [type(r.source).__name__ for r in queue] == ["Rts", "Rts", "Rts", "Inbound"]
        assert all(r.data is None or r.nbytes == 16 for r in queue)
        assert not any(h.done for h in hs), "a large send finished before its receive was posted"
        got = [np.zeros(n, np.uint8) for n in [*sizes, 16]]
        rs = [b.irecv(0, 7, g.data, 0) for g in got]

        def drive_a() -> None:
            wait_all(a, [*hs, small])

        th = threading.Thread(target=drive_a)
        th.start()
        wait_all(b, rs)
        th.join(30)
        assert [r.error for r in rs] == [None] * 4
        assert [h.error for h in [*hs, small]] == [None] * 4
        for g, n in zip(got[:3], sizes, strict=True):
            np.testing.assert_array_equal(g, _pattern(n, n))
        np.testing.assert_array_equal(got[3], _pattern(16, 1))
        for t in ts:
            _quiet(t)
    finally:
        _close(ts)


@pytest.mark.parametrize("streams", [1, 3])
def test_large_tags_match_out_of_order(streams: int) -> None:
    """Large messages with other tags do not hold up the receive that is posted."""
    ts = tcp_transports(2, streams=streams)
    tags = [1, 2, 3, 4]
    try:

        def body(t: TcpTransport) -> dict[int, np.ndarray] | None:
            if t.rank == 0:
                hs = [t.isend(1, tag, _pattern(BIG * tag, tag).data, 3) for tag in tags]
                wait_all(t, hs)
                assert [h.error for h in hs] == [None] * 4
                return None
            got = {tag: np.zeros(BIG * tag, np.uint8) for tag in tags}
            h4 = t.irecv(0, 4, got[4].data, 3)
            wait_all(t, [h4])  # the last one sent, alone: must not wait for 1..3
            hs = [t.irecv(0, tag, got[tag].data, 3) for tag in (3, 1, 2)]
            wait_all(t, [h4, *hs])
            assert [h.error for h in [h4, *hs]] == [None] * 4
            return got

        got = run_ranks(ts, body)[1]
        assert got is not None
        for tag in tags:
            np.testing.assert_array_equal(got[tag], _pattern(BIG * tag, tag))
    finally:
        _close(ts)


@pytest.mark.parametrize("streams", [1, 3])
def test_large_messages_both_ways_at_once(streams: int) -> None:
    """Both ranks send several large messages first, then receive: no deadlock, full duplex."""
    ts = tcp_transports(2, streams=streams)
    sizes = [BIG, 8 << 20, 3 << 20, 100, 6 << 20]
    try:

        def body(t: TcpTransport) -> bool:
            other = 1 - t.rank
            hs = [
                t.isend(other, 5, _pattern(n, 10 * t.rank + i).data, 1) for i, n in enumerate(sizes)
            ]
            got = [np.zeros(n, np.uint8) for n in sizes]
            hs += [t.irecv(other, 5, g.data, 1) for g in got]
            wait_all(t, hs, timeout=60)
            assert [h.error for h in hs] == [None] * len(hs)
            for i, n in enumerate(sizes):
                np.testing.assert_array_equal(got[i], _pattern(n, 10 * other + i))
            return True

        assert run_ranks(ts, body) == [True, True]
    finally:
        _close(ts)


@pytest.mark.parametrize("streams", [1, 2])
def test_large_exchange_is_full_duplex(streams: int) -> None:
    """A large message answers its peer's while its own payload goes out: both ways at once.

    Rank 0's 16 MiB payload has started when rank 1 announces 2 MiB the other
    way. Rank 0's clear-to-send goes out between two chunks of its payload, so
    rank 1's payload arrives while rank 0 still has most of its own to send.
    (Sent as one frame, the payload held the clear-to-send back until its last
    byte: the exchange ran one way, then the other.) One thread steps both
    ranks, and small socket buffers keep the bytes in flight few, so the order
    of events does not depend on timing.
    """
    ts = tcp_transports(2, streams=streams)
    try:
        a, b = ts
        _small_buffers(a, 1)
        _small_buffers(b, 0)
        n_a, n_b = 16 << 20, 2 << 20
        data_a, data_b = _pattern(n_a, 1), _pattern(n_b, 2)
        got_b, got_a = np.zeros(n_a, np.uint8), np.zeros(n_b, np.uint8)
        r1 = b.irecv(0, 1, got_b.data, 0)
        h1 = a.isend(1, 1, data_a.data, 0)
        conn = a._link.peers[1].conns[0]  # type: ignore[union-attr]
        for _ in range(10000):  # until rank 0's payload has started
            if conn.sendq and conn.sendq[0].op is h1 and conn.sendq[0].started():
                break
            _step(b, a)
        assert conn.sendq, "the payload went out whole"
        assert conn.sendq[0].op is h1, "the payload never started"
        h2 = b.isend(0, 2, data_b.data, 0)
        r2 = a.irecv(1, 2, got_a.data, 0)
        left_at_r2 = None
        for _ in range(100000):
            _step(a, b)
            if r2.done and left_at_r2 is None:
                left_at_r2 = _left(a, 1, h1)
                assert not h1.done, "rank 1's payload came only after rank 0's whole payload"
            if all(h.done for h in (h1, h2, r1, r2)):
                break
        assert [h.error for h in (h1, h2, r1, r2)] == [None] * 4
        # Rank 0 had most of its payload (of part 0 on stream 0) still to send.
        part0 = n_a // streams
        assert left_at_r2 is not None
        assert left_at_r2 > part0 // 2, (left_at_r2, part0)
        np.testing.assert_array_equal(got_b, data_a)
        np.testing.assert_array_equal(got_a, data_b)
        for t in ts:
            _quiet(t)
    finally:
        _close(ts)


def test_self_send_of_a_large_message() -> None:
    ts = tcp_transports(2)
    try:
        t = ts[0]
        data = [_pattern(3 << 20, 1), _pattern(BIG, 2)]
        got = [np.zeros(3 << 20, np.uint8), np.zeros(BIG, np.uint8)]
        hs = [t.irecv(0, 1, got[0].data, 0), t.isend(0, 1, data[0].data, 0)]
        hs += [t.isend(0, 1, data[1].data, 0), t.irecv(0, 1, got[1].data, 0)]
        wait_all(t, hs)
        assert [h.error for h in hs] == [None] * 4
        for g, d in zip(got, data, strict=True):
            np.testing.assert_array_equal(g, d)
    finally:
        _close(ts)


# -- mismatches --------------------------------------------------------------------------------


@pytest.mark.parametrize("streams", [1, 3])
@pytest.mark.parametrize(
    ("send_n", "recv_n", "send_check"),
    [(2 << 20, (2 << 20) + 1, 1), (2 << 20, (2 << 20) - 1, 1), (2 << 20, 2 << 20, 2), (BIG, 8, 1)],
    ids=["shorter", "longer", "check", "large-into-small"],
)
def test_large_mismatch_fails_the_receive_and_completes_the_send(
    streams: int, send_n: int, recv_n: int, send_check: int
) -> None:
    """The receive fails with MismatchError, untouched; the sender completes all the same."""
    ts = tcp_transports(2, streams=streams)
    try:
        a, b = ts
        bad = np.full(recv_n, 0xAB, np.uint8)
        good = [np.zeros(BIG, np.uint8), np.zeros(BIG, np.uint8)]
        # Tag 3: the receive is posted first; tag 4: the announcement arrives first.
        r = b.irecv(0, 3, bad.data, 1)
        hs = [
            a.isend(1, 3, _pattern(send_n, 1).data, send_check),
            a.isend(1, 3, _pattern(BIG, 2).data, 1),
            a.isend(1, 4, _pattern(send_n, 3).data, send_check),
            a.isend(1, 4, _pattern(BIG, 4).data, 1),
        ]

        def drive_a() -> None:
            wait_all(a, hs)

        th = threading.Thread(target=drive_a)
        th.start()
        wait_all(b, [r])
        assert isinstance(r.error, MismatchError), r.error
        assert (bad == 0xAB).all(), "the failed receive was written to"
        r2 = b.irecv(0, 3, good[0].data, 1)
        wait_all(b, [r2])
        assert r2.error is None, r2.error
        r3 = b.irecv(0, 4, bad.data, 1)
        wait_all(b, [r3])
        assert isinstance(r3.error, MismatchError), r3.error
        assert (bad == 0xAB).all(), "the failed receive was written to"
        r4 = b.irecv(0, 4, good[1].data, 1)
        wait_all(b, [r4])
        assert r4.error is None, r4.error
        th.join(30)
        assert [h.error for h in hs] == [None] * 4, "a sender fails for its receiver's mismatch"
        np.testing.assert_array_equal(good[0], _pattern(BIG, 2))
        np.testing.assert_array_equal(good[1], _pattern(BIG, 4))
        assert b.bytes_received == 2 * BIG
        for t in ts:
            _quiet(t)
    finally:
        _close(ts)


# -- cancel at every stage ---------------------------------------------------------------------


def _fill(a: TcpTransport, peer: int, tag: int) -> list:
    """Eager sends to ``peer`` until ``a``'s send queue to it is backed up (peer not reading)."""
    conn = a._link.peers[peer].conns[0]  # type: ignore[union-attr]
    block = np.zeros(EAGER_MAX, np.uint8)
    hs = []
    for _ in range(4096):
        hs.append(a.isend(peer, tag, block.data, 0))
        if conn.sendq:
            return hs
    raise AssertionError("the socket never filled up")


def test_cancel_before_the_announcement_is_written() -> None:
    """A large send cancelled while its RTS still waits in the queue: the peer never hears of it."""
    ts = tcp_transports(2)
    try:
        a, b = ts
        fill = _fill(a, 1, 9)
        h = a.isend(1, 1, _pattern(BIG, 1).data, 0)
        assert a._link.peers[1].rts_out  # type: ignore[union-attr]
        a.cancel(h)
        assert h.done
        assert h.error is None
        assert not a._link.peers[1].rts_out  # type: ignore[union-attr]
        later = a.isend(1, 1, _pattern(BIG, 2).data, 0)
        sink = np.zeros(EAGER_MAX, np.uint8)
        got = np.zeros(BIG, np.uint8)
        rs = [b.irecv(0, 9, sink.data, 0) for _ in fill]
        r = b.irecv(0, 1, got.data, 0)

        def drive_a() -> None:
            wait_all(a, [*fill, later])

        th = threading.Thread(target=drive_a)
        th.start()
        wait_all(b, [*rs, r])
        th.join(30)
        assert r.error is None
        np.testing.assert_array_equal(got, _pattern(BIG, 2))
        assert later.error is None
        for t in ts:
            _quiet(t)
    finally:
        _close(ts)


def test_cancel_after_the_announcement_with_nothing_posted() -> None:
    """Withdrawn while unexpected at the receiver: the message vanishes, later ones arrive."""
    ts = tcp_transports(2)
    try:
        a, b = ts
        h = a.isend(1, 1, _pattern(BIG, 1).data, 0)
        _settle(a, b)  # b has the announcement, unexpected
        assert b._unexpected.get((0, 1))
        a.cancel(h)
        assert h.done
        assert h.error is None
        assert a._link.peers[1].rts_out  # type: ignore[union-attr] # a tombstone until the answer
        _settle(a, b)  # b reads WITHDRAW and refuses
        # b's message of that round may have left before its answer; the next one follows
        # the answer, so a has read the answer once it has that message.
        _settle(a, b)
        for t in ts:
            _quiet(t)
        later = a.isend(1, 1, _pattern(BIG, 2).data, 0)
        got = np.zeros(BIG, np.uint8)
        r = b.irecv(0, 1, got.data, 0)
        th = threading.Thread(target=lambda: wait_all(a, [later]))
        th.start()
        wait_all(b, [r])
        th.join(30)
        assert r.error is None
        np.testing.assert_array_equal(got, _pattern(BIG, 2))
    finally:
        _close(ts)


def _post(t: TcpTransport, pattern: bool, buf: np.ndarray):
    """A receive of ``buf`` from rank 0 on tag 1: plain, or a pattern from any rank."""
    if pattern:
        return t.irecv_match(None, 1, -1, buf.data, 0)
    return t.irecv(0, 1, buf.data, 0)


def _until_cleared(b: TcpTransport, r: object) -> None:
    """Drive ``b`` until it has read rank 0's announcement and answered it (CTS)."""
    p = b._link.peers[0]
    assert p is not None
    for _ in range(1000):
        if p.cleared:
            return
        b.wait_any([r], 0.005)  # type: ignore[list-item]
    raise AssertionError("b never cleared the message")


def _drive(a: TcpTransport, b: TcpTransport, sends: list, recvs: list) -> None:
    th = threading.Thread(target=lambda: wait_all(a, sends))
    th.start()
    wait_all(b, recvs)
    th.join(30)
    assert [h.error for h in sends + recvs] == [None] * len(sends + recvs)


@pytest.mark.parametrize("pattern", [False, True], ids=["plain", "pattern"])
def test_cancel_after_the_receiver_cleared_it(pattern: bool) -> None:
    """Withdrawn after the receiver answered CTS: the message never arrives (Note [withdrawn
    messages]); its receive, its buffer untouched, is put back where it was among the
    posted ones and takes the next message, before a receive posted after it. It failed
    with MismatchError, also where it had been posted after the sender withdrew and only
    read the announcement and the withdrawal together."""
    ts = tcp_transports(2)
    try:
        a, b = ts
        buf = np.full(BIG, 0xEE, np.uint8)
        behind = np.zeros(BIG, np.uint8)
        r = _post(b, pattern, buf)
        r2 = b.irecv(0, 1, behind.data, 0)  # posted after r: the next message but one
        h = a.isend(1, 1, _pattern(BIG, 1).data, 0)
        _until_cleared(b, r)
        a.cancel(h)  # a has not read the CTS: nothing of the payload goes out
        assert h.done
        assert h.error is None
        _settle(a, b)  # b reads WITHDRAW; a reads the CTS, which ends its tombstone
        assert not r.done, r.error
        assert not r2.done
        assert (buf == 0xEE).all()
        for t in ts:
            _quiet(t)
        later = [a.isend(1, 1, _pattern(BIG, k).data, 0) for k in (2, 3)]
        _drive(a, b, later, [r, r2])
        np.testing.assert_array_equal(buf, _pattern(BIG, 2))
        np.testing.assert_array_equal(behind, _pattern(BIG, 3))
        assert b.envelope(r)[:2] == (0, 1)
        assert b.bytes_received == 1 + 2 * BIG  # the settling message and the two
    finally:
        _close(ts)


@pytest.mark.parametrize("pattern", [False, True], ids=["plain", "pattern"])
def test_a_receive_put_back_takes_a_message_filed_meanwhile(pattern: bool) -> None:
    """The sender sent another message on the tag before it withdrew the one the receive
    had taken: that one, filed as unexpected meanwhile, is the receive's once it is put
    back."""
    ts = tcp_transports(2)
    try:
        a, b = ts
        buf = np.full(BIG, 0xEE, np.uint8)
        r = _post(b, pattern, buf)
        h = a.isend(1, 1, _pattern(BIG, 1).data, 0)
        _until_cleared(b, r)
        nxt = a.isend(1, 1, _pattern(BIG, 2).data, 0)
        assert not a._link.peers[1].conns[0].sendq  # type: ignore[union-attr] # announced
        a.cancel(h)  # its WITHDRAW follows the next message's announcement
        _drive(a, b, [nxt], [r])
        np.testing.assert_array_equal(buf, _pattern(BIG, 2))
        assert b.envelope(r)[:2] == (0, 1)
        _settle(a, b)
        for t in ts:
            _quiet(t)
    finally:
        _close(ts)


def test_cancel_when_the_payload_is_queued_but_not_started() -> None:
    """Cleared, its payload queued behind another one: withdrawn, the peer sees none of it,
    and its receive waits for the next message."""
    ts = tcp_transports(2)
    try:
        a, b = ts
        n = 32 << 20
        first = _pattern(n, 1)
        got_first = np.zeros(n, np.uint8)
        buf = np.full(BIG, 0xEE, np.uint8)
        h2 = a.isend(1, 5, _pattern(BIG, 2).data, 0)
        h3 = a.isend(1, 6, first.data, 0)
        r3 = b.irecv(0, 6, got_first.data, 0)
        conn = a._link.peers[1].conns[0]  # type: ignore[union-attr]
        for _ in range(1000):  # until the 32 MiB payload has started and filled the socket
            if conn.sendq and conn.sendq[0].op is h3 and conn.sendq[0].off > 0:
                break
            b.wait_any([r3], 0)
            a.wait_any([h3], 0.005)
        assert conn.sendq[0].op is h3, "the first payload never started"
        r2 = b.irecv(0, 5, buf.data, 0)  # b has the announcement: answers CTS at once
        for _ in range(1000):  # until a has read the CTS and queued the payload
            if any(item.op is h2 for item in conn.sendq):
                break
            a.wait_any([h2], 0.005)
        queued = [item for item in conn.sendq if item.op is h2]
        assert queued, "the second payload was never queued"
        assert queued[0].off == 0
        a.cancel(h2)
        assert h2.done
        assert h2.error is None
        th = threading.Thread(target=lambda: wait_all(a, [h3]))
        th.start()
        wait_all(b, [r3], timeout=30)
        th.join(30)
        assert r3.error is None
        np.testing.assert_array_equal(got_first, first)
        _settle(a, b)  # b has read the withdrawal
        assert not r2.done, r2.error
        assert (buf == 0xEE).all()
        for t in ts:
            _quiet(t)
        _drive(a, b, [a.isend(1, 5, _pattern(BIG, 4).data, 0)], [r2])
        np.testing.assert_array_equal(buf, _pattern(BIG, 4))
    finally:
        _close(ts)


def test_cancel_striped_payload_finishes_from_a_private_copy() -> None:
    """With several streams a payload queued after CTS is sent whole from a private copy."""
    ts = tcp_transports(2, streams=3)
    try:
        a, b = ts
        n = 48 << 20
        data = _pattern(n, 3)
        expected = data.copy()
        got = np.zeros(n, np.uint8)
        r = b.irecv(0, 1, got.data, 0)
        h = a.isend(1, 1, data.data, 0)
        pa = a._link.peers[1]
        assert pa is not None
        for _ in range(1000):  # until a read the CTS and queued the parts
            if not pa.rts_out:
                break
            b.wait_any([r], 0)
            a.wait_any([h], 0.005)
        assert not pa.rts_out, "the CTS never came"
        assert not h.done
        a.cancel(h)
        assert h.done
        data[:] = 0  # the caller owns the buffer again
        th = threading.Thread(
            target=lambda: wait_all(a, [a.irecv(1, 2, np.zeros(1, np.uint8).data, 0)])
        )
        th.start()
        wait_all(b, [r], timeout=30)
        wait_all(b, [b.isend(0, 2, np.zeros(1, np.uint8).data, 0)])
        th.join(30)
        assert r.error is None
        np.testing.assert_array_equal(got, expected)
    finally:
        _close(ts)


def test_cancel_in_the_middle_of_a_payload_finishes_it_from_a_private_copy() -> None:
    """A send cancelled once chunks of its payload are out sends the rest from a copy."""
    ts = tcp_transports(2)
    try:
        a, b = ts
        _small_buffers(a, 1)
        _small_buffers(b, 0)
        n = 4 << 20
        data = _pattern(n, 5)
        expected = data.copy()
        got = np.zeros(n, np.uint8)
        r = b.irecv(0, 1, got.data, 0)
        h = a.isend(1, 1, data.data, 0)
        conn = a._link.peers[1].conns[0]  # type: ignore[union-attr]
        for _ in range(10000):  # until a chunk is out and the rest waits in the queue
            if conn.sendq and conn.sendq[0].op is h and conn.sendq[0].sent:
                break
            _step(b, a)
        assert conn.sendq, "the payload went out whole"
        assert conn.sendq[0].sent, "no chunk went out"
        assert 0 < _left(a, 1, h) < n
        a.cancel(h)
        assert h.done
        assert h.error is None
        data[:] = 0  # the caller owns the buffer again
        for _ in range(10000):
            if r.done and not conn.sendq:
                break
            _step(a, b)
        assert r.error is None
        np.testing.assert_array_equal(got, expected)
        for t in ts:
            _quiet(t)
    finally:
        _close(ts)


def test_receive_cancelled_in_the_middle_of_a_payload_is_never_written_again() -> None:
    """Cancelled between two chunks, a receive stays as it was; the stream stays in step."""
    ts = tcp_transports(2)
    try:
        a, b = ts
        _small_buffers(a, 1)
        _small_buffers(b, 0)
        n = 4 << 20
        buf = np.zeros(n, np.uint8)
        r = b.irecv(0, 1, buf.data, 0)
        h = a.isend(1, 1, _pattern(n, 6).data, 0)
        conn = b._link.peers[0].conns[0]  # type: ignore[union-attr]
        for _ in range(10000):  # until b has read part of the payload
            rec = conn.rec or conn.cont
            if rec is not None and rec.op is r and conn.pos > CHUNK:
                break
            _step(a, b)
        assert conn.pos > CHUNK, "b never got into the payload"
        b.cancel(r)
        assert r.done
        assert r.error is None
        snapshot = buf.copy()
        later = _pattern(BIG, 7)
        got = np.zeros(BIG, np.uint8)
        hs = [h, a.isend(1, 1, later.data, 0)]
        r2 = b.irecv(0, 1, got.data, 0)
        for _ in range(10000):
            if r2.done and all(x.done for x in hs):
                break
            _step(a, b)
        assert [x.error for x in [*hs, r2]] == [None] * 3
        np.testing.assert_array_equal(buf, snapshot)  # not a byte after the cancel
        np.testing.assert_array_equal(got, later)
        for t in ts:
            _quiet(t)
    finally:
        _close(ts)


@pytest.mark.parametrize("streams", [1, 3])
def test_cancelled_receive_after_cts_discards_the_payload(streams: int) -> None:
    """A receive cancelled once it answered CTS is never written; the stream stays in step."""
    ts = tcp_transports(2, streams=streams)
    try:
        a, b = ts
        n = 4 << 20
        h = a.isend(1, 1, _pattern(n, 1).data, 0)
        buf = np.full(n, 0xEE, np.uint8)
        r = b.irecv(0, 1, buf.data, 0)
        p = b._link.peers[0]
        assert p is not None
        for _ in range(1000):
            if p.cleared:
                break
            b.wait_any([r], 0.005)
        assert p.cleared, "b never cleared the message"
        b.cancel(r)
        assert r.done
        assert r.error is None
        small = _pattern(10, 2)
        hs = [h, a.isend(1, 1, small.data, 0), a.isend(1, 1, _pattern(BIG, 3).data, 0)]
        got = [np.zeros(10, np.uint8), np.zeros(BIG, np.uint8)]
        rs = [b.irecv(0, 1, g.data, 0) for g in got]
        th = threading.Thread(target=lambda: wait_all(a, hs))
        th.start()
        wait_all(b, rs)
        th.join(30)
        assert [x.error for x in hs + rs] == [None] * 5
        np.testing.assert_array_equal(got[0], small)
        np.testing.assert_array_equal(got[1], _pattern(BIG, 3))
        assert (buf == 0xEE).all(), "the cancelled receive was written to"
        for t in ts:
            _quiet(t)
    finally:
        _close(ts)


def test_cancelled_posted_receive_before_the_announcement() -> None:
    ts = tcp_transports(2)
    try:
        a, b = ts
        buf = np.full(BIG, 0xEE, np.uint8)
        r = b.irecv(0, 1, buf.data, 0)
        b.cancel(r)
        got = np.zeros(BIG, np.uint8)
        r2 = b.irecv(0, 1, got.data, 0)
        h = a.isend(1, 1, _pattern(BIG, 1).data, 0)
        th = threading.Thread(target=lambda: wait_all(a, [h]))
        th.start()
        wait_all(b, [r2])
        th.join(30)
        assert r2.error is None
        np.testing.assert_array_equal(got, _pattern(BIG, 1))
        assert (buf == 0xEE).all()
    finally:
        _close(ts)


# -- close and peer loss at every stage ---------------------------------------------------------


def test_close_fails_large_sends_and_receives_at_every_stage(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Closing a rank fails its own waiting operations and its peer's, promptly."""
    monkeypatch.setattr(endpoint, "CLOSE_FLUSH_SECONDS", 0.3)  # the wait for a CTS that never comes
    ts = tcp_transports(2)
    try:
        a, b = ts
        waiting = a.isend(1, 1, _pattern(BIG, 1).data, 0)  # b never posts a receive for it
        _settle(a, b)
        cleared = np.zeros(BIG, np.uint8)
        r_cleared = a.irecv(1, 2, cleared.data, 0)
        h_cleared = b.isend(0, 2, _pattern(BIG, 2).data, 0)
        announced = b.isend(0, 3, _pattern(BIG, 3).data, 0)  # a never posts a receive either
        pa = a._link.peers[1]
        assert pa is not None
        for _ in range(1000):  # a clears the first and keeps the second as unexpected
            if pa.cleared and a._unexpected.get((1, 3)):
                break
            a.wait_any([r_cleared], 0.005)
        assert pa.cleared
        assert a._unexpected.get((1, 3))
        a.close()
        for h in (waiting, r_cleared):
            assert isinstance(h.error, ClosedError), h.error
        assert (cleared == 0).all()
        wait_all(b, [h_cleared, announced])
        assert isinstance(announced.error, PeerLostError), announced.error
        # b may have written the cleared payload before it read the goodbye.
        assert h_cleared.error is None or isinstance(h_cleared.error, PeerLostError)
        r = b.irecv(0, 1, np.zeros(BIG, np.uint8).data, 0)
        wait_all(b, [r])
        assert isinstance(r.error, PeerLostError), r.error
        _quiet(b)
    finally:
        _close(ts)


# -- a hostile peer ------------------------------------------------------------------------------

SECRET = "protocol-test-secret"


def _dial(store: MemoryStore, rank: int, size: int, target: int) -> socket.socket:
    """Connect to rank ``target`` as rank ``rank`` with the bootstrap's handshake (stream 0)."""
    host, _, port = store.get(f"tcp/addr/{target}", 30).decode().rpartition(":")
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=30)
    key = SECRET.encode()
    hello = _recv_exactly(sock, _auth.CHALLENGE_BYTES)
    assert hello.startswith(_auth.MAGIC)
    server_nonce = hello[len(_auth.MAGIC) :]
    ours = os.urandom(_auth.NONCE)
    sock.sendall(
        ours
        + _auth.client_proof(key, server_nonce, ours)
        + wire.HELLO.pack(wire.MAGIC, wire.VERSION, 0, rank, size, 1)
    )
    answer = _recv_exactly(sock, _auth.MAC + wire.HELLO.size)
    assert answer[: _auth.MAC] == _auth.server_proof(key, server_nonce, ours)
    return sock


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, "the rank closed the connection during the handshake"
        data += chunk
    return data


@pytest.fixture
def with_intruder(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[list, socket.socket]]:
    """Ranks 0 and 1 real, rank 2 a raw socket that knows the secret: (transports, its socket)."""
    monkeypatch.setenv("PLAIT_SECRET", SECRET)
    store = MemoryStore(timeout=30)
    made: dict[int, object] = {}

    def build(rank: int) -> None:
        try:
            made[rank] = TcpTransport(rank, 3, store, timeout=30)
        except BaseException as exc:
            made[rank] = exc

    threads = [threading.Thread(target=build, args=(r,)) for r in (0, 1)]
    for th in threads:
        th.start()
    socks = []
    try:
        socks = [_dial(store, 2, 3, 0), _dial(store, 2, 3, 1)]
        for th in threads:
            th.join(30)
        ts = [made[0], made[1]]
        assert all(isinstance(t, TcpTransport) for t in ts), ts
        try:
            yield ts, socks[0]
        finally:
            _close(ts)  # type: ignore[arg-type]
    finally:
        for th in threads:
            th.join(30)
        for s in socks:
            s.close()
        for t in made.values():
            if isinstance(t, TcpTransport):
                t.close()


def _hdr(kind: int, check: int = 0, tag: int = 0, nbytes: int = 0) -> bytes:
    return wire.HDR.pack(kind, check, tag, nbytes)


BAD_FRAMES = {
    "eager-2**50": _hdr(wire.DATA, 0, 4, 2**50),
    "eager-1GiB": _hdr(wire.DATA, 0, 4, 1 << 30),
    "eager-above-limit": _hdr(wire.DATA, 0, 4, EAGER_MAX + 1) + b"x" * 1000,
    "payload-never-cleared": _hdr(wire.RDATA, 0, 0, 1 << 30),
    "cts-unknown-id": _hdr(wire.CTS, 0, 7, 0),
    "refuse-unknown-id": _hdr(wire.REFUSE, 0, 0, 0),
    "withdraw-never-announced": _hdr(wire.WITHDRAW, 0, 3, 0),
    "cts-with-length": _hdr(wire.CTS, 0, 0, 100),
    "rts-small": _hdr(wire.RTS, 0, 4, 100) + wire.ID.pack(0),
    "rts-id-reused": _hdr(wire.RTS, 0, 4, 1 << 40)
    + wire.ID.pack(5)
    + _hdr(wire.RTS, 0, 4, 1 << 40)
    + wire.ID.pack(5),
    "payload-wrong-length": _hdr(wire.RTS, 0, 1, 1 << 20)
    + wire.ID.pack(0)
    + _hdr(wire.RDATA, 0, 0, 1 << 30),
    "part-on-stream-0": _hdr(wire.PART, 0, 0, 1 << 30),
    "unknown-kind": _hdr(99, 0, 0, 1 << 30),
}


@pytest.mark.parametrize("frame", list(BAD_FRAMES))
def test_impossible_frames_drop_the_peer_without_allocating(
    with_intruder: tuple[list[TcpTransport], socket.socket], frame: str
) -> None:
    """An authenticated peer breaking the protocol is lost; nothing allocated; the others go on."""
    (t0, t1), intruder = with_intruder
    # Tag 4 (the bad frames') has no receive posted. For "payload-wrong-length" an announced
    # 1 MiB message meets this one (tag 1) and is cleared, and its payload header claims 1 GiB.
    posted = t0.irecv(2, 1, np.zeros(1 << 20, np.uint8).data, 0)
    other = t0.irecv(2, 2, np.zeros(8, np.uint8).data, 0)
    tracemalloc.start()
    try:
        intruder.sendall(BAD_FRAMES[frame])
        wait_all(t0, [other], timeout=20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"rank 0 allocated {peak} B for a frame that announced more"
    for h in (posted, other):
        assert isinstance(h.error, PeerLostError), h.error
        assert isinstance(h.error, PeerProtocolError), h.error
        assert "protocol error" in str(h.error)
        assert "rank 0: connection to rank 2 lost" in str(h.error)
    later = t0.isend(2, 1, np.zeros(4, np.uint8).data, 0)
    assert isinstance(later.error, PeerLostError)
    # The rest of the job goes on: ranks 0 and 1, both ways, small and large.
    ts = [t0, t1]

    def body(t: TcpTransport) -> bool:
        peer = 1 - t.rank
        got = [np.zeros(16, np.uint8), np.zeros(BIG, np.uint8)]
        hs = [t.isend(peer, 5, _pattern(16, t.rank).data, 0)]
        hs.append(t.isend(peer, 5, _pattern(BIG, t.rank).data, 0))
        hs += [t.irecv(peer, 5, g.data, 0) for g in got]
        wait_all(t, hs)
        assert [h.error for h in hs] == [None] * 4
        np.testing.assert_array_equal(got[0], _pattern(16, peer))
        np.testing.assert_array_equal(got[1], _pattern(BIG, peer))
        return True

    assert run_ranks(ts, body) == [True, True]


def test_intruder_speaking_the_protocol_is_served(
    with_intruder: tuple[list[TcpTransport], socket.socket],
) -> None:
    """The raw peer is a faithful rank while it follows the protocol (the frames above are bad)."""
    (t0, _), intruder = with_intruder
    got = np.zeros(BIG, np.uint8)
    r = t0.irecv(2, 1, got.data, 0)
    intruder.sendall(_hdr(wire.RTS, 0, 1, BIG) + wire.ID.pack(0))
    answer = _recv_exactly_while(t0, intruder, wire.HDR.size)
    assert wire.HDR.unpack(answer) == (wire.CTS, 0, 0, 0)
    payload = _pattern(BIG, 9)
    intruder.sendall(_hdr(wire.RDATA, 0, 0, BIG) + payload.tobytes())
    wait_all(t0, [r])
    assert r.error is None
    np.testing.assert_array_equal(got, payload)


def _recv_exactly_while(t: TcpTransport, sock: socket.socket, n: int) -> bytes:
    """Read ``n`` bytes from ``sock`` while ``t`` makes progress (it writes only while driven)."""
    sock.setblocking(False)
    data = b""
    try:
        for _ in range(2000):
            with contextlib.suppress(BlockingIOError):
                data += sock.recv(n - len(data))
            if len(data) == n:
                return data
            t.wait_any([], 0.005)
    finally:
        sock.setblocking(True)
    raise AssertionError(f"got {len(data)} of {n} bytes")


# -- chunked payloads seen from the wire ---------------------------------------------------------

M = 1 << 20  # the message the intruder announces (tag 1, id 0) and rank 0 clears
C = 256 << 10  # a chunk the intruder sends
_RTS_M = _hdr(wire.RTS, 0, 1, M) + wire.ID.pack(0)
_CHUNK_C = _hdr(wire.RDATA, 0, 0, C) + bytes(C)

# Each starts with _RTS_M; rank 0 has a receive of M bytes posted for it.
BAD_CHUNKS = {
    "longer-than-the-rest": _RTS_M + _CHUNK_C + _hdr(wire.RDATA, 0, 0, M - C + 1),
    "longer-than-the-message": _RTS_M + _hdr(wire.RDATA, 0, 0, M + 1),
    "empty": _RTS_M + _hdr(wire.RDATA, 0, 0, 0),
    "unannounced": _RTS_M + _hdr(wire.RDATA, 0, 7, C),
    "of-another-message": _RTS_M
    + _hdr(wire.RTS, 0, 3, M)
    + wire.ID.pack(1)
    + _CHUNK_C
    + _hdr(wire.RDATA, 0, 1, C),
    "other-check": _RTS_M + _CHUNK_C + _hdr(wire.RDATA, 5, 0, C),
    "after-completion": _RTS_M + _hdr(wire.RDATA, 0, 0, M) + bytes(M) + _hdr(wire.RDATA, 0, 0, C),
    "eager-between-chunks": _RTS_M + _CHUNK_C + _hdr(wire.DATA, 0, 2, 8) + bytes(8),
    "rts-between-chunks": _RTS_M + _CHUNK_C + _hdr(wire.RTS, 0, 3, M) + wire.ID.pack(1),
    "withdraw-between-chunks": _RTS_M + _CHUNK_C + _hdr(wire.WITHDRAW, 0, 0, 0),
    "bye-between-chunks": _RTS_M + _CHUNK_C + _hdr(wire.BYE),
}


@pytest.mark.parametrize("frames", list(BAD_CHUNKS))
def test_impossible_chunks_drop_the_peer(
    with_intruder: tuple[list[TcpTransport], socket.socket], frames: str
) -> None:
    """A chunk that does not fit what the RTS announced, or a frame inside a payload, is fatal.

    Nothing is written beyond the posted buffer and nothing is allocated for
    the lengths the headers claim.
    """
    (t0, _), intruder = with_intruder
    got = np.full(M, 0xEE, np.uint8)
    posted = t0.irecv(2, 1, got.data, 0)
    other = t0.irecv(2, 2, np.zeros(8, np.uint8).data, 0)
    # More than the socket buffers may hold while rank 0 is not reading: send from a thread.
    sender = threading.Thread(target=_send_quietly, args=(intruder, BAD_CHUNKS[frames]))
    tracemalloc.start()
    try:
        sender.start()
        wait_all(t0, [other], timeout=20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        sender.join(30)
    assert peak < 4 << 20, f"rank 0 allocated {peak} B"
    assert isinstance(other.error, PeerProtocolError), other.error
    assert "protocol error" in str(other.error)
    if frames == "after-completion":
        assert posted.error is None
        assert (got == 0).all()
    else:
        assert isinstance(posted.error, PeerProtocolError), posted.error
    assert t0._link.peers[2].dead  # type: ignore[union-attr]


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    with contextlib.suppress(OSError):  # the rank drops the connection midway
        sock.sendall(data)


def _send_while(t: TcpTransport, sock: socket.socket, data: bytes) -> None:
    """Send ``data`` on ``sock`` while ``t`` makes progress (it reads only while driven)."""
    sock.setblocking(False)
    view = memoryview(data)
    sent = 0
    try:
        for _ in range(2000):
            with contextlib.suppress(BlockingIOError):
                sent += sock.send(view[sent:])
            if sent == len(view):
                return
            t.wait_any([], 0.005)
    finally:
        sock.setblocking(True)
    raise AssertionError(f"sent {sent} of {len(view)} bytes")


def _read_frame(t: TcpTransport, sock: socket.socket) -> tuple[int, int, int, int, bytes]:
    """The next frame rank ``t`` sends on ``sock``: header fields and what follows it."""
    kind, check, tag, nbytes = wire.HDR.unpack(_recv_exactly_while(t, sock, wire.HDR.size))
    if kind == wire.RTS:
        body = _recv_exactly_while(t, sock, wire.ID.size)
    elif kind in (wire.DATA, wire.RDATA):
        body = _recv_exactly_while(t, sock, nbytes)
    else:
        body = b""
    return kind, check, tag, nbytes, body


def test_a_cts_goes_out_between_two_chunks(
    with_intruder: tuple[list[TcpTransport], socket.socket],
) -> None:
    """On the wire: a payload in chunks of at most CHUNK, a CTS between two of them.

    The raw peer clears a 4 MiB message of rank 0, lets its payload start,
    then announces one of its own; rank 0's clear-to-send for it comes before
    the payload's last chunk. The raw peer sends its payload in uneven chunks,
    which rank 0 takes as well.
    """
    (t0, _), intruder = with_intruder
    _small_buffers(t0, 2)
    intruder.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    n = 4 << 20
    data = _pattern(n, 11)
    h = t0.isend(2, 1, data.data, 9)
    kind, check, tag, nbytes, body = _read_frame(t0, intruder)
    assert (kind, check, tag, nbytes) == (wire.RTS, 9, 1, n)
    (rid,) = wire.ID.unpack(body)
    intruder.sendall(_hdr(wire.CTS, 0, rid, 0))
    conn = t0._link.peers[2].conns[0]  # type: ignore[union-attr]
    for _ in range(2000):  # until rank 0's payload has started and filled the socket
        if conn.sendq and conn.sendq[0].op is h and conn.sendq[0].started():
            break
        t0.wait_any([h], 0.005)
    assert conn.sendq, "the payload went out whole"
    assert conn.sendq[0].op is h, "the payload never started"
    theirs = _pattern(BIG, 12)
    got = np.zeros(BIG, np.uint8)
    r = t0.irecv(2, 2, got.data, 4)
    intruder.sendall(_hdr(wire.RTS, 4, 2, BIG) + wire.ID.pack(0))
    payload = bytearray()
    cts_at = None
    while len(payload) < n:
        kind, check, tag, nbytes, body = _read_frame(t0, intruder)
        if kind == wire.CTS:
            assert cts_at is None
            assert (tag, nbytes) == (0, 0)
            cts_at = len(payload)
            chunks = [(0, 1000), (1000, 300_000), (300_000, BIG)]
            _send_while(
                t0,
                intruder,
                b"".join(
                    _hdr(wire.RDATA, 4, 0, hi - lo) + theirs[lo:hi].tobytes() for lo, hi in chunks
                ),
            )
            continue
        assert (kind, check, tag) == (wire.RDATA, 9, rid)
        assert 0 < nbytes <= CHUNK
        payload += body
    assert cts_at is not None, "no CTS before the payload's end"
    assert cts_at < n - CHUNK, f"the CTS came after {cts_at} of {n} B"
    assert bytes(payload) == data.tobytes()
    wait_all(t0, [h, r])
    assert h.error is None
    assert r.error is None
    np.testing.assert_array_equal(got, theirs)
