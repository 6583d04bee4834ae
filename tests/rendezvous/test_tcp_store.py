"""The TCP store: server lifecycle, late servers, dead servers, IPv6, concurrency, bad clients."""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest
from store_backends import TEST_TIMEOUT, Background, free_port, ipv6_loopback_available

from plait import _auth
from plait.errors import ClosedError, RendezvousError
from plait.rendezvous.store import StoreTimeout
from plait.rendezvous.tcp_store import StoreConnectError, TCPStore, TCPStoreServer

needs_ipv6 = pytest.mark.skipif(not ipv6_loopback_available(), reason="no IPv6 loopback")


def test_server_reports_its_real_port_and_closes_idempotently() -> None:
    server = TCPStoreServer("127.0.0.1", 0)
    try:
        assert server.port > 0
        assert server.address == f"127.0.0.1:{server.port}"
        assert "serving" in repr(server)
    finally:
        server.close()
    server.close()
    assert "closed" in repr(server)
    with pytest.raises(StoreConnectError, match=f"127.0.0.1:{server.port}"):
        TCPStore("127.0.0.1", server.port, connect_timeout=0)


def test_server_on_a_taken_port_is_a_rendezvous_error() -> None:
    with TCPStoreServer("127.0.0.1", 0) as server:
        taken = f"cannot listen on 127.0.0.1:{server.port}"
        with pytest.raises(RendezvousError, match=taken):
            TCPStoreServer("127.0.0.1", server.port)


def test_client_started_before_the_server_connects_when_it_comes_up() -> None:
    port = free_port()
    connecting = threading.Event()

    def start_server() -> TCPStoreServer:
        assert connecting.wait(TEST_TIMEOUT)
        return TCPStoreServer("127.0.0.1", port)

    starter = Background(start_server)
    connecting.set()
    client = TCPStore("127.0.0.1", port, timeout=TEST_TIMEOUT)
    server = starter.result()
    try:
        client.set("k", b"v")
        assert client.get("k") == b"v"
    finally:
        client.close()
        server.close()


def test_server_that_never_comes_up_is_a_connect_error_naming_it() -> None:
    port = free_port()
    start = time.monotonic()
    with pytest.raises(StoreConnectError, match=f"127.0.0.1:{port}") as info:
        TCPStore("127.0.0.1", port, timeout=60, connect_timeout=0.3)
    assert 0.25 <= time.monotonic() - start < 3.0
    assert isinstance(info.value, RendezvousError)


def test_timeout_message_names_the_store_and_the_keys() -> None:
    with TCPStoreServer() as server, TCPStore("127.0.0.1", server.port) as client:
        with pytest.raises(StoreTimeout) as info:
            client.wait(["alpha", "beta"], timeout=0.1)
        assert server.address in str(info.value)
        assert "'alpha'" in str(info.value)
        assert "'beta'" in str(info.value)


def test_server_closing_during_a_wait_raises_instead_of_hanging() -> None:
    server = TCPStoreServer()
    client = TCPStore("127.0.0.1", server.port, timeout=60)
    try:
        waiting = threading.Event()

        def close_server() -> None:
            assert waiting.wait(TEST_TIMEOUT)
            server.close()

        closer = Background(close_server)
        waiting.set()
        start = time.monotonic()
        with pytest.raises(RendezvousError) as info:
            client.wait(["never"], timeout=60)
        assert not isinstance(info.value, StoreTimeout)
        assert server.address in str(info.value)
        assert time.monotonic() - start < 5.0
        closer.result()
        # Later calls fail at once: the server is gone, nothing to retry.
        with pytest.raises(RendezvousError):
            client.set("k", b"v")
    finally:
        client.close()
        server.close()


@pytest.mark.multiprocess
def test_server_process_killed_during_a_get_raises_instead_of_hanging() -> None:
    code = (
        "import sys\n"
        "from plait.rendezvous.tcp_store import TCPStoreServer\n"
        "server = TCPStoreServer('127.0.0.1', 0)\n"
        "print(server.port, flush=True)\n"
        "sys.stdin.read()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        client = TCPStore("127.0.0.1", port, timeout=60)
        client.set("alive", b"yes")
        getting = threading.Event()

        def get() -> bytes:
            getting.set()
            return client.get("never", timeout=60)

        getter = Background(get)
        assert getting.wait(TEST_TIMEOUT)
        proc.kill()
        with pytest.raises(RendezvousError) as info:
            getter.result()
        assert not isinstance(info.value, StoreTimeout)
        client.close()
    finally:
        proc.kill()
        proc.communicate()


def test_waiting_clients_do_not_block_other_clients() -> None:
    waiters = 16
    with TCPStoreServer() as server:
        clients = [TCPStore("127.0.0.1", server.port, timeout=TEST_TIMEOUT) for _ in range(waiters)]
        other = TCPStore("127.0.0.1", server.port, timeout=TEST_TIMEOUT)
        try:
            barrier = threading.Barrier(waiters + 1)

            def wait(client: TCPStore) -> bytes:
                barrier.wait(TEST_TIMEOUT)
                return client.get("go")

            running = [Background(functools.partial(wait, c)) for c in clients]
            barrier.wait(TEST_TIMEOUT)
            # All 16 are (or are about to be) parked on the server; it still serves.
            for i in range(50):
                other.set(f"k{i}", b"v")
                assert other.get(f"k{i}") == b"v"
                assert other.add("n", 1) == i + 1
            with pytest.raises(StoreTimeout):
                other.get("go", timeout=0.05)
            other.set("go", b"now")
            assert [r.result() for r in running] == [b"now"] * waiters
        finally:
            for client in [*clients, other]:
                client.close()


def test_one_client_shared_by_a_blocked_thread_and_a_setter() -> None:
    with TCPStore.create("127.0.0.1", 0, is_server=True, timeout=TEST_TIMEOUT) as client:
        started = threading.Event()

        def get() -> bytes:
            started.set()
            return client.get("k")

        getter = Background(get)
        assert started.wait(TEST_TIMEOUT)
        client.set("k", b"through the same client")  # must not queue behind the get
        assert getter.result() == b"through the same client"


def test_deadlines_of_parked_requests_are_independent() -> None:
    with TCPStoreServer() as server:
        short = TCPStore("127.0.0.1", server.port)
        long = TCPStore("127.0.0.1", server.port)
        try:
            long_get = Background(lambda: long.get("k", timeout=TEST_TIMEOUT))
            start = time.monotonic()
            with pytest.raises(StoreTimeout):
                short.get("k", timeout=0.1)
            assert time.monotonic() - start < 3.0
            assert not long_get.done.is_set()
            short.set("k", b"late")
            assert long_get.result() == b"late"
        finally:
            short.close()
            long.close()


def test_close_interrupts_a_blocked_call() -> None:
    with TCPStoreServer() as server:
        client = TCPStore("127.0.0.1", server.port, timeout=60)
        getting = threading.Event()

        def get() -> bytes:
            getting.set()
            return client.get("never")

        getter = Background(get)
        assert getting.wait(TEST_TIMEOUT)
        client.close()
        with pytest.raises(ClosedError):
            getter.result()
        with pytest.raises(ClosedError, match="after close"):
            client.set("k", b"v")


def test_create_owns_the_server() -> None:
    client = TCPStore.create("127.0.0.1", 0, is_server=True, timeout=TEST_TIMEOUT)
    assert client.server is not None
    port = client.server.port
    assert client.port == port
    other = TCPStore.create("127.0.0.1", port, is_server=False)
    try:
        other.set("k", b"v")
        assert client.get("k") == b"v"
        assert other.server is None
    finally:
        other.close()
        client.close()
    with pytest.raises(StoreConnectError):
        TCPStore("127.0.0.1", port, connect_timeout=0)


@needs_ipv6
@pytest.mark.parametrize("host", ["::1", "[::1]"])
def test_ipv6_loopback(host: str) -> None:
    with TCPStoreServer(host, 0) as server:
        assert server.address == f"[::1]:{server.port}"
        with TCPStore(host, server.port, timeout=TEST_TIMEOUT) as client:
            assert client.address == server.address
            client.set("v6", b"yes")
            assert client.get("v6") == b"yes"
            with pytest.raises(StoreTimeout, match=r"\[::1\]"):
                client.get("absent", timeout=0.05)


def test_server_listens_only_on_its_host() -> None:
    if not ipv6_loopback_available():
        pytest.skip("no IPv6 loopback")
    with TCPStoreServer("::1", 0) as server, pytest.raises(StoreConnectError):
        TCPStore("127.0.0.1", server.port, connect_timeout=0)


def test_bad_arguments_are_type_errors() -> None:
    with TCPStore.create("127.0.0.1", 0, is_server=True) as client:
        with pytest.raises(TypeError, match="keys are str"):
            client.set(b"bytes-key", b"v")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="values are bytes"):
            client.set("k", "text")  # type: ignore[arg-type]


def _raw_request(sock: socket.socket, code: int, fields: list[bytes]) -> None:
    body = b"".join(struct.pack("!I", len(f)) + f for f in fields)
    sock.sendall(struct.pack("!BQ", code, len(body)) + body)


def _raw_response(sock: socket.socket) -> tuple[int, bytes]:
    header = b""
    while len(header) < 9:
        chunk = sock.recv(9 - len(header))
        assert chunk, "server closed the connection"
        header += chunk
    code, length = struct.unpack("!BQ", header)
    body = b""
    while len(body) < length:
        body += sock.recv(length - len(body))
    return code, body


def _authenticated(port: int, key: bytes = b"") -> socket.socket:
    """A raw connection to the server that has passed the shared-secret handshake."""
    raw = socket.create_connection(("127.0.0.1", port), timeout=TEST_TIMEOUT)
    try:
        _auth.client_handshake(raw, key, TEST_TIMEOUT, "test")
    except BaseException:
        raw.close()
        raise
    return raw


def _until_closed(raw: socket.socket) -> bytes:
    """What the server sends before it closes (a reset, when our bytes were left unread,
    may come in place of what it sent)."""
    got = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := raw.recv(4096):
            got += chunk
    return got


def test_wrong_secret_is_refused_and_the_store_unaffected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLAIT_SECRET", "right")
    with TCPStoreServer() as server, TCPStore("127.0.0.1", server.port) as good:
        good.set("k", b"v")
        with pytest.raises(RendezvousError, match=r"does not accept our PLAIT_SECRET"):
            TCPStore("127.0.0.1", server.port, secret=b"wrong", connect_timeout=2)
        with pytest.raises(_auth.AuthError):
            _authenticated(server.port, b"wrong")
        # Random bytes instead of a handshake: refused and dropped, nothing stored, server fine.
        for junk in (b"\x00" * 48, os.urandom(4096), b"GET / HTTP/1.1\r\n\r\n" * 10):
            with socket.create_connection(("127.0.0.1", server.port), timeout=TEST_TIMEOUT) as raw:
                raw.recv(_auth.CHALLENGE_BYTES)
                raw.sendall(junk)
                assert _until_closed(raw) in (b"", _auth.REFUSED)
        assert good.get("k") == b"v"
        assert good.add("n", 1) == 1


def test_malformed_requests_do_not_disturb_the_server() -> None:
    with TCPStoreServer() as server, TCPStore("127.0.0.1", server.port) as good:
        with _authenticated(server.port) as raw:
            _raw_request(raw, 99, [])  # unknown operation: answered with an error
            code, body = _raw_response(raw)
            assert code == 3
            assert b"unknown operation" in body
            _raw_request(raw, 1, [b"only-a-key"])  # SET without a value
            code, body = _raw_response(raw)
            assert code == 3
            assert b"SET takes 2 fields" in body
            raw.sendall(struct.pack("!BQ", 1, 1 << 60))  # absurd length: refused, dropped
            code, body = _raw_response(raw)
            assert code == 3
            assert b"over this store's limit" in body
            assert raw.recv(1) == b""
        with _authenticated(server.port) as raw:
            # A client that parks a wait and vanishes.
            _raw_request(raw, 4, [struct.pack("!d", 60.0), b"ghost"])
        good.set("ghost", b"boo")
        assert good.get("ghost") == b"boo"
        assert good.add("n", 2) == 2


def test_pipelined_requests_behind_a_parked_one_are_answered_in_order() -> None:
    with (
        TCPStoreServer() as server,
        TCPStore("127.0.0.1", server.port) as setter,
        _authenticated(server.port) as raw,
    ):
        _raw_request(raw, 2, [struct.pack("!d", 60.0), b"first"])  # parks
        _raw_request(raw, 5, [b"first"])  # CHECK, must wait its turn
        setter.set("first", b"1")
        assert _raw_response(raw) == (0, struct.pack("!I", 1) + b"1")
        assert _raw_response(raw) == (0, struct.pack("!I", 1) + b"1")


def test_a_secret_that_is_not_bytes_is_refused_by_the_server() -> None:
    """secret="s" was taken: every proof then failed inside the server (a TypeError in its
    log), and every client waited a minute to hear that the server was "overloaded"."""
    with pytest.raises(TypeError, match="secret must be bytes"):
        TCPStoreServer("127.0.0.1", 0, secret="s")  # type: ignore[arg-type]


def test_the_launcher_says_how_a_rank_it_could_not_file_ended() -> None:
    """It said the rank "died" where the rank had exited with an error."""
    from plait.launch.job import _Filer

    said: list[str] = []
    relay = type("Relay", (), {"say": lambda self, text: said.append(text)})()
    _Filer("127.0.0.1", free_port(), "s", relay)(2, "exited with code 1")  # type: ignore[arg-type]
    assert said
    assert said[0].startswith("could not tell the other ranks in the store that rank 2 exited")
