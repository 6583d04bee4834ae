"""Frames after a striped message wait for its parts on the other streams (Note [striped
order] in plait.transport.tcp.reader).

Rank 1 is a raw peer with two streams to rank 0, so each test decides what has arrived on
which stream: stream 0 carries a striped message's part 0 and what follows it, and stream 1
holds its part back, as a slow stream does. Before, stream 0 went on: a small message sent
after the striped one completed first (a stall probe of the next call, read that way, made
identical calls a MismatchError), and the end of a peer that exited after its last send
failed the striped message's receive as a lost peer while its bytes were still coming.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import threading
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from tcp_helpers import no_leaks  # noqa: F401 (fixture)

from plait import _auth
from plait.errors import PeerLostError
from plait.rendezvous.store import MemoryStore
from plait.transport.conformance import wait_all
from plait.transport.tcp import CHUNK, STRIPE_MIN, TcpTransport, wire
from plait.transport.tcp.link import TcpLink
from plait.transport.tcp.pair import Conn

pytestmark = [pytest.mark.usefixtures("no_leaks"), pytest.mark.timeout(60)]

SECRET = "striped-order-secret"
STREAMS = 2


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, "rank 0 closed the connection"
        data += chunk
    return data


def _dial(store: MemoryStore, stream: int) -> socket.socket:
    """Connect to rank 0 as stream ``stream`` of rank 1, through the bootstrap's handshake."""
    host, _, port = store.get("tcp/addr/0", 30).decode().rpartition(":")
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=30)
    key = SECRET.encode()
    hello = _recv_exactly(sock, _auth.CHALLENGE_BYTES)
    server_nonce = hello[len(_auth.MAGIC) :]
    ours = os.urandom(_auth.NONCE)
    sock.sendall(
        ours
        + _auth.client_proof(key, server_nonce, ours)
        + wire.HELLO.pack(wire.MAGIC, wire.VERSION, stream, 1, 2, STREAMS)
    )
    answer = _recv_exactly(sock, _auth.MAC + wire.HELLO.size)
    assert answer[: _auth.MAC] == _auth.server_proof(key, server_nonce, ours)
    return sock


@pytest.fixture
def raw_peer(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[TcpTransport, list[socket.socket]]]:
    """Rank 0 with two streams per pair, and rank 1's two sockets to it (stream 0, stream 1)."""
    monkeypatch.setenv("PLAIT_SECRET", SECRET)
    store = MemoryStore(timeout=30)
    made: list[object] = []

    def build() -> None:
        try:
            made.append(TcpTransport(0, 2, store, timeout=30, streams=STREAMS))
        except BaseException as exc:
            made.append(exc)

    th = threading.Thread(target=build)
    th.start()
    socks: list[socket.socket] = []
    try:
        socks = [_dial(store, k) for k in range(STREAMS)]
        th.join(30)
        (t,) = made
        assert isinstance(t, TcpTransport), t
        try:
            yield t, socks
        finally:
            t.close()
    finally:
        th.join(30)
        for s in socks:
            s.close()


def _hdr(kind: int, check: int = 0, tag: int = 0, nbytes: int = 0) -> bytes:
    return wire.HDR.pack(kind, check, tag, nbytes)


def _in_thread(fn: Callable[[], None]) -> threading.Thread:
    """Run ``fn`` (a send that may outgrow the socket buffers while rank 0 reads nothing)."""
    th = threading.Thread(target=fn)
    th.start()
    return th


def _stream0(t: TcpTransport) -> Conn:
    link = t._link
    assert isinstance(link, TcpLink)
    peer = link.peers[1]
    assert peer is not None
    return peer.conns[0]


def _until_stream0_waits(t: TcpTransport, ahead: object) -> None:
    """Drive rank 0 until stream 0 stops reading (it waits for stream 1), or until ``ahead``
    (a handle that must not finish before stream 1's part arrives) is done."""
    c0 = _stream0(t)
    for _ in range(2000):
        if ahead.done or not c0.events & select.EPOLLIN:  # type: ignore[attr-defined]
            return
        t.wait_any([ahead], 0.01)  # type: ignore[list-item]
    raise AssertionError("rank 0 neither waited on stream 0 nor finished the handle")


def _answer(t: TcpTransport, s0: socket.socket) -> bytes:
    """The header rank 0 answers with on stream 0, read while rank 0 is driven (it writes
    only then)."""
    s0.setblocking(False)
    data = b""
    try:
        for _ in range(2000):
            with contextlib.suppress(BlockingIOError):
                data += s0.recv(wire.HDR.size - len(data))
            if len(data) == wire.HDR.size:
                return data
            t.wait_any([], 0.01)
    finally:
        s0.setblocking(True)
    raise AssertionError(f"rank 0 answered {len(data)} bytes of a header")


def _striped(t: TcpTransport, s0: socket.socket, nbytes: int, payload: bytes, how: str) -> bytes:
    """Announce or send a striped message (tag 1) on stream 0 up to the end of its part 0;
    what comes after that on stream 0 is the caller's."""
    end0 = wire.part(nbytes, STREAMS, 0)[1]
    if how == "eager":
        return _hdr(wire.DATA, 0, 1, nbytes) + payload[:end0]
    s0.sendall(_hdr(wire.RTS, 0, 1, nbytes) + wire.ID.pack(0))
    answer = wire.HDR.unpack(_answer(t, s0))
    assert answer == (wire.CTS, 0, 0, 0), answer
    frames = b""
    for lo in range(0, end0, CHUNK):  # part 0 in chunks: stream 0 reads on between them
        hi = min(lo + CHUNK, end0)
        frames += _hdr(wire.RDATA, 0, 0, hi - lo) + payload[lo:hi]
    return frames


def _part1(nbytes: int, payload: bytes) -> bytes:
    lo = wire.part(nbytes, STREAMS, 1)[0]
    return _hdr(wire.PART, 0, 0, nbytes) + payload[lo:]


SIZES = {"eager": STRIPE_MIN, "rendezvous": 3 * CHUNK + 4096}


@pytest.mark.parametrize("how", list(SIZES))
def test_a_message_after_a_striped_one_waits_for_its_other_parts(
    raw_peer: tuple[TcpTransport, list[socket.socket]], how: str
) -> None:
    """A small message (a stall probe of the next call, say) sent after a striped one is not
    delivered while the striped one's part on stream 1 is still on its way."""
    t, (s0, s1) = raw_peer
    nbytes = SIZES[how]
    payload = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    big, small = np.zeros(nbytes, np.uint8), np.zeros(8, np.uint8)
    rb = t.irecv(1, 1, big.data, 0)
    rs = t.irecv(1, 2, small.data, 0)
    rest = _striped(t, s0, nbytes, payload, how) + _hdr(wire.DATA, 0, 2, 8) + b"after it"
    sender = _in_thread(lambda: s0.sendall(rest))
    try:
        _until_stream0_waits(t, rs)
        assert not rs.done, "a message sent after a striped one overtook its part on stream 1"
        assert not rb.done
        s1.sendall(_part1(nbytes, payload))
        wait_all(t, [rb, rs])
    finally:
        sender.join(30)
    assert (rb.error, rs.error) == (None, None)
    assert big.tobytes() == payload
    assert small.tobytes() == b"after it"


@pytest.mark.parametrize("how", list(SIZES))
def test_a_peer_that_ended_after_a_striped_message_delivers_all_of_it(
    raw_peer: tuple[TcpTransport, list[socket.socket]], how: str
) -> None:
    """A peer that exits without closing its transport, its last striped message in the
    kernel, ends stream 0 before its part on stream 1 has arrived: the message arrives whole,
    and only then is the peer lost."""
    t, (s0, s1) = raw_peer
    nbytes = SIZES[how]
    payload = np.random.default_rng(2).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    big = np.zeros(nbytes, np.uint8)
    rb = t.irecv(1, 1, big.data, 0)
    later = t.irecv(1, 3, np.zeros(8, np.uint8).data, 0)
    rest = _striped(t, s0, nbytes, payload, how)

    def send_and_end() -> None:
        s0.sendall(rest)
        s0.shutdown(socket.SHUT_WR)  # the end of the connection, without a goodbye

    sender = _in_thread(send_and_end)
    try:
        _until_stream0_waits(t, rb)
        assert not rb.done, f"the end of stream 0 failed the message: {rb.error!r}"
        s1.sendall(_part1(nbytes, payload))
        s1.shutdown(socket.SHUT_WR)
        wait_all(t, [rb, later])
    finally:
        sender.join(30)
    assert rb.error is None
    assert big.tobytes() == payload
    assert isinstance(later.error, PeerLostError), later.error
    assert "connection closed without a goodbye" in str(later.error)
