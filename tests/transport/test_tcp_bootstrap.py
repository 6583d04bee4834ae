"""TCP setup against hostile or broken connections (Note [hostile connections during setup]).

Each test plays a stranger at a rank's listening port (or a broken peer at the other
end of a dial) while the mesh is being set up, and checks that the setup still
finishes (or fails for the right reason) without leaking sockets or threads.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from tcp_helpers import no_leaks  # noqa: F401 (fixture)

from plait import _auth
from plait.rendezvous.store import MemoryStore
from plait.transport.tcp import BootstrapTimeout, TcpTransport
from plait.transport.tcp import bootstrap as tcp_bootstrap
from plait.transport.tcp.wire import HELLO

pytestmark = pytest.mark.usefixtures("no_leaks")


class _Rank0:
    """Rank 0 of a job of two, set up on a thread; rank 1 joins when the test says."""

    def __init__(self, store: MemoryStore) -> None:
        self.store = store
        self.result: dict[int, object] = {}
        self.thread = threading.Thread(target=self._build, args=(0,))
        self.thread.start()
        host, port = store.get("tcp/addr/0", 10).decode().rsplit(":", 1)
        self.addr = (host.strip("[]"), int(port))

    def _build(self, rank: int) -> None:
        try:
            self.result[rank] = TcpTransport(rank, 2, self.store, timeout=20)
        except BaseException as exc:
            self.result[rank] = exc

    def join_rank1(self) -> None:
        """Build rank 1 here and check that both ranks are connected."""
        self._build(1)
        self.thread.join(30)
        assert isinstance(self.result[0], TcpTransport), self.result[0]
        assert isinstance(self.result[1], TcpTransport), self.result[1]

    def close(self) -> None:
        self.thread.join(30)
        for t in self.result.values():
            if isinstance(t, TcpTransport):
                t.close()


@pytest.fixture
def rank0() -> Iterator[Callable[[MemoryStore], _Rank0]]:
    made: list[_Rank0] = []

    def make(store: MemoryStore) -> _Rank0:
        made.append(_Rank0(store))
        return made[-1]

    yield make
    for r in made:
        r.close()


def _greeted(addr: tuple[str, int]) -> socket.socket:
    """A connection to ``addr`` whose challenge has arrived (so the rank accepted it)."""
    s = socket.create_connection(addr, timeout=10)
    got = b""
    while len(got) < _auth.CHALLENGE_BYTES:
        chunk = s.recv(_auth.CHALLENGE_BYTES - len(got))
        assert chunk, "the rank closed the connection before its challenge"
        got += chunk
    return s


def _hung_up(s: socket.socket) -> bool:
    """Whether the rank closes ``s`` within its 10 s timeout (EOF or reset)."""
    try:
        while s.recv(4096):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


def test_failed_authentications_are_logged_once_then_counted(
    rank0: Callable[[MemoryStore], _Rank0], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="plait")
    r = rank0(MemoryStore(timeout=20))
    for _ in range(3):
        with _greeted(r.addr) as s:
            s.sendall(b"\0" * (_auth.RESPONSE_BYTES + HELLO.size))  # a wrong proof
            assert _hung_up(s)
    for junk in (b"x", b"GET / HTTP/1.0\r\n\r\n"):  # less than a proof: no attempt
        with _greeted(r.addr) as s:
            s.sendall(junk)
            s.shutdown(socket.SHUT_WR)
            assert _hung_up(s)
    r.join_rank1()
    lines = [rec.getMessage() for rec in caplog.records if "authentication" in rec.getMessage()]
    # The first at once, with the peer; the rest in one summary when the listener closes.
    assert len(lines) == 2, lines
    assert lines[0].startswith("rank 0: dropped a connection from 127.0.0.1:"), lines
    assert "2 more connections failed authentication" in lines[1], lines


def test_idle_connections_are_dropped_at_the_handshake_deadline(
    rank0: Callable[[MemoryStore], _Rank0], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tcp_bootstrap, "HANDSHAKE_SECONDS", 0.2, raising=False)
    r = rank0(MemoryStore(timeout=20))
    with _greeted(r.addr) as idle, socket.create_connection(r.addr, timeout=10) as mute:
        assert _hung_up(idle), "an idle connection outlived the handshake deadline"
        assert _hung_up(mute), "a connection that never read its challenge stayed open"
    r.join_rank1()


def test_oldest_unauthenticated_connection_is_dropped_at_the_cap(
    rank0: Callable[[MemoryStore], _Rank0], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tcp_bootstrap, "MAX_UNAUTHENTICATED", 2, raising=False)
    monkeypatch.setattr(tcp_bootstrap, "_MIN_UNAUTHENTICATED", 1, raising=False)
    r = rank0(MemoryStore(timeout=20))
    junk = [_greeted(r.addr), _greeted(r.addr)]
    try:
        junk.append(_greeted(r.addr))  # one over the cap: the oldest goes
        assert _hung_up(junk[0]), "the oldest idle connection was kept beyond the cap"
        junk[1].settimeout(0)
        with pytest.raises(BlockingIOError):  # the younger ones are still waited for
            junk[1].recv(1)
        r.join_rank1()  # honest connections push idle ones out as well
    finally:
        for s in junk:
            s.close()


def test_accept_out_of_descriptors_backs_off(
    rank0: Callable[[MemoryStore], _Rank0],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``accept`` failing with EMFILE pauses the listener rather than spinning on it."""
    caplog.set_level(logging.WARNING, logger="plait")
    real_accept = socket.socket.accept
    calls: list[float] = []
    gate = threading.Event()  # set: descriptors are back

    def accept(self: socket.socket) -> tuple[socket.socket, object]:
        calls.append(time.monotonic())
        if not gate.is_set():
            if len(calls) == 1:
                threading.Timer(0.4, gate.set).start()
            raise OSError(errno.EMFILE, "Too many open files")
        return real_accept(self)

    monkeypatch.setattr(socket.socket, "accept", accept)
    r = rank0(MemoryStore(timeout=20))
    with socket.create_connection(r.addr, timeout=10):  # makes the listener readable
        gate.wait(10)
    r.join_rank1()
    # 0.4 s of EMFILE: pauses of 0.05, 0.1, 0.2, 0.4 s; a spin calls accept thousands of times.
    assert len(calls) < 20, f"accept called {len(calls)} times while out of descriptors"
    warned = [rec for rec in caplog.records if "out of file descriptors" in rec.getMessage()]
    assert len(warned) == 1, [rec.getMessage() for rec in caplog.records]


@contextlib.contextmanager
def _fake_rank0(store: MemoryStore, *, hang_up: bool) -> Iterator[None]:
    """Publish a listener as rank 0 that hangs up on every connection, or never speaks."""
    listener = socket.create_server(("127.0.0.1", 0))
    store.set("tcp/addr/0", f"127.0.0.1:{listener.getsockname()[1]}".encode())
    stop = threading.Event()
    held: list[socket.socket] = []

    def serve() -> None:
        listener.settimeout(0.05)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                conn, _ = listener.accept()
                if hang_up:
                    conn.close()
                else:
                    held.append(conn)

    th = threading.Thread(target=serve)
    th.start()
    try:
        yield
    finally:
        stop.set()
        th.join(10)
        for s in held:
            s.close()
        listener.close()


@pytest.mark.parametrize("hang_up", [True, False], ids=["closes", "silent"])
def test_a_peer_that_never_challenges_is_not_blamed_on_the_secret(
    hang_up: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tcp_bootstrap, "HANDSHAKE_SECONDS", 0.2, raising=False)
    store = MemoryStore(timeout=10)
    with _fake_rank0(store, hang_up=hang_up), pytest.raises(BootstrapTimeout) as info:
        TcpTransport(1, 2, store, timeout=1.0)
    text = str(info.value)
    assert "reject our PLAIT_SECRET" not in text, text
    assert "before its challenge" in text if hang_up else "stayed silent" in text, text
    assert isinstance(info.value.__cause__, _auth.HandshakeUnanswered), info.value.__cause__


def test_a_peer_that_refuses_connections_is_said_to_have_died() -> None:
    # Rank 0 published its address, then its process died: its port refuses connections.
    listener = socket.create_server(("127.0.0.1", 0))
    store = MemoryStore(timeout=10)
    store.set("tcp/addr/0", f"127.0.0.1:{listener.getsockname()[1]}".encode())
    listener.close()
    with pytest.raises(BootstrapTimeout) as info:
        TcpTransport(1, 2, store, timeout=0.5)
    text = str(info.value)
    assert "could not connect to rank(s) [0]" in text, text
    assert "refuses connections has died or given up" in text, text
