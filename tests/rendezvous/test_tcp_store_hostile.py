"""The TCP store against hostile or broken peers: idle and unauthenticated connections,
descriptor exhaustion, floods of failed handshakes, an open store, oversized values.

Each test reproduces a defect a probe found (issue 15, section 1). Every socket and child
process a test opens is closed by the test, so a failure leaks nothing into the next one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import select
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from store_backends import TEST_TIMEOUT, Background

from plait import _auth
from plait.errors import RendezvousError
from plait.rendezvous import _tcp_server, tcp_store
from plait.rendezvous._tcp_wire import REQUEST_OVERHEAD, SECONDS, Op, frame
from plait.rendezvous.tcp_store import StoreConnectError, TCPStore, TCPStoreServer


def _raw(port: int) -> socket.socket:
    """A raw connection that has read the server's challenge and then says nothing."""
    raw = socket.create_connection(("127.0.0.1", port), timeout=TEST_TIMEOUT)
    try:
        got = b""
        while len(got) < _auth.CHALLENGE_BYTES:
            chunk = raw.recv(_auth.CHALLENGE_BYTES - len(got))
            assert chunk, "the server closed a fresh connection"
            got += chunk
    except BaseException:
        raw.close()
        raise
    return raw


def _closed_by_server(sock: socket.socket) -> bool:
    """Whether the server has closed ``sock`` (blocks up to the socket's timeout)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def _still_open(sock: socket.socket) -> bool:
    """Whether ``sock`` is open with nothing to read, without blocking."""
    sock.setblocking(False)
    try:
        sock.recv(1)
    except BlockingIOError:
        return True
    except ConnectionResetError:
        return False
    finally:
        sock.settimeout(TEST_TIMEOUT)
    return False


@contextlib.contextmanager
def _sockets() -> Iterator[list[socket.socket]]:
    """A list whose sockets are all closed on exit, whatever happens."""
    opened: list[socket.socket] = []
    try:
        yield opened
    finally:
        for sock in opened:
            sock.close()


def _authenticated(port: int, key: bytes = b"") -> socket.socket:
    raw = socket.create_connection(("127.0.0.1", port), timeout=TEST_TIMEOUT)
    try:
        _auth.client_handshake(raw, key, TEST_TIMEOUT, "test")
    except BaseException:
        raw.close()
        raise
    return raw


# -- connections that never authenticate -------------------------------------------------


def test_idle_unauthenticated_connections_are_dropped_at_the_handshake_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The probe: 500 connections that never answered the challenge stayed open for good.
    monkeypatch.setattr(_tcp_server, "HANDSHAKE_SECONDS", 0.3, raising=False)
    with TCPStoreServer() as server, _sockets() as idle:
        idle += [_raw(server.port) for _ in range(20)]
        assert all(_closed_by_server(sock) for sock in idle)
        with TCPStore("127.0.0.1", server.port) as good:
            good.set("k", b"v")
            assert good.get("k") == b"v"


def test_unauthenticated_connections_are_capped_oldest_dropped_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_tcp_server, "MAX_UNAUTHENTICATED", 4, raising=False)
    with TCPStoreServer() as server, _sockets() as idle:
        idle += [_raw(server.port) for _ in range(4)]
        idle.append(_raw(server.port))  # the fifth pushes out the first
        assert _closed_by_server(idle[0])
        idle.append(_raw(server.port))  # the sixth the second
        assert _closed_by_server(idle[1])
        assert all(_still_open(sock) for sock in idle[2:])
        # An honest client authenticates in one round trip and is not counted after.
        with TCPStore("127.0.0.1", server.port) as good:
            good.set("k", b"v")
            assert good.get("k") == b"v"


def test_a_server_that_closes_before_the_handshake_is_not_blamed_on_the_secret() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        client = Background(lambda: TCPStore("127.0.0.1", port, connect_timeout=0))
        conn, _ = listener.accept()
        conn.close()  # as a store out of descriptors or over its cap would
        with pytest.raises(StoreConnectError) as info:
            client.result()
    message = str(info.value)
    assert "before the handshake" in message
    assert "descriptors" in message
    assert "PLAIT_SECRET" not in message


def test_a_silent_server_is_not_blamed_on_the_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    # A store that stopped accepting (out of descriptors): the kernel completes the TCP
    # connection, then nothing happens.
    monkeypatch.setattr(tcp_store, "_HANDSHAKE_SECONDS", 0.3)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        with pytest.raises(StoreConnectError) as info:
            TCPStore("127.0.0.1", port, connect_timeout=0)
    message = str(info.value)
    assert "did not start the handshake" in message
    assert "descriptors" in message
    assert "PLAIT_SECRET" not in message


def test_a_connection_dropped_after_our_proof_is_retried_not_blamed_on_the_secret(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A server over its cap of connections still authenticating drops the oldest, which
    may be an honest client that already sent its proof: that client was told "check
    PLAIT_SECRET" and not retried. A wrong proof is now refused in words (REFUSED), so a
    close without a verdict is a drop, retried while the client's patience lasts."""
    monkeypatch.setenv("PLAIT_SECRET", "right")
    key = _auth.secret()
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        client = Background(lambda: TCPStore("127.0.0.1", port, connect_timeout=TEST_TIMEOUT))
        first, _ = listener.accept()
        hello, _ = _auth.challenge()
        first.sendall(hello)
        first.recv(_auth.RESPONSE_BYTES)
        first.close()  # dropped after its proof, as the oldest of too many
        listener.settimeout(TEST_TIMEOUT)
        try:
            second, _ = listener.accept()  # the client came back
        except TimeoutError:
            client.result()  # raises what the client raised instead
            raise
        with second:
            _auth.server_handshake(second, key, TEST_TIMEOUT, "store")
            client.result().close()


def test_a_wrong_secret_still_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLAIT_SECRET", "right")
    with TCPStoreServer() as server:
        with pytest.raises(StoreConnectError, match="PLAIT_SECRET") as info:
            TCPStore("127.0.0.1", server.port, secret=b"wrong", connect_timeout=0)
        assert "before the handshake" not in str(info.value)


# -- out of descriptors --------------------------------------------------------------------

_EMFILE_SERVER = textwrap.dedent(
    """
    import os, resource, sys
    from plait.rendezvous.tcp_store import TCPStoreServer

    server = TCPStoreServer("127.0.0.1", 0)
    room = int(sys.argv[1])
    in_use = len(os.listdir("/proc/self/fd")) - 1  # listdir's own descriptor
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (in_use + room, hard))
    print(server.port, flush=True)
    sys.stdin.read()  # until the test closes our stdin
    server.close()
    """
)


def _cpu_seconds(pid: int) -> float:
    """User plus system CPU time of process ``pid`` so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _read_until(fd: int, marker: bytes) -> bytes:
    """Bytes from ``fd`` until ``marker`` has been read; fails at EOF or after TEST_TIMEOUT."""
    seen = b""
    deadline = time.monotonic() + TEST_TIMEOUT
    while marker not in seen:
        ready, _, _ = select.select([fd], [], [], max(deadline - time.monotonic(), 0.0))
        chunk = os.read(fd, 4096) if ready else b""
        if not chunk:
            why = "exited" if ready else f"did not within {TEST_TIMEOUT} s"
            pytest.fail(f"the server {why} log {marker!r}:\n{seen.decode(errors='replace')}")
        seen += chunk
    return seen


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.timeout(60)
@pytest.mark.multiprocess  # the store runs in a child process with few descriptors
def test_out_of_descriptors_backs_off_logs_once_and_recovers() -> None:
    room = 6
    proc = subprocess.Popen(
        [sys.executable, "-c", _EMFILE_SERVER, str(room)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    clients: list[Background] = []
    try:
        assert proc.stdout is not None
        assert proc.stderr is not None
        port = int(proc.stdout.readline())
        # More clients than the server has descriptors for: the extra ones wait, accepted
        # by the kernel but not by the server.
        clients = [
            Background(lambda: TCPStore("127.0.0.1", port, connect_timeout=TEST_TIMEOUT))
            for _ in range(room + 3)
        ]
        _read_until(proc.stderr.fileno(), b"out of file descriptors")
        before = _cpu_seconds(proc.pid)
        window = threading.Event()
        window.wait(1.0)  # a measurement window, not a synchronisation
        spent = _cpu_seconds(proc.pid) - before
        assert spent < 0.3, f"the store burned {spent:.2f} s of CPU in 1 s out of descriptors"
        # Free descriptors: close the clients that got in; the rest then get in too.
        done = [c for c in clients if c.done.is_set()]
        waiting = [c for c in clients if c not in done]
        assert 0 < len(done) <= room
        assert waiting
        for c in done:
            c.result().close()
        for c in waiting:
            store = c.result()
            store.set("k", b"v")
            assert store.get("k") == b"v"
            store.close()
        clients = []
    finally:
        for c in clients:
            with contextlib.suppress(BaseException):
                c.result().close()
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(TEST_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        stderr = proc.stderr.read() if proc.stderr is not None else b""
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    assert b"out of file descriptors" not in stderr  # logged once, not once per attempt


# -- floods of failed handshakes -----------------------------------------------------------


def test_failed_authentications_are_summarised_not_logged_one_by_one(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The probe: 713 warning lines per rank from one port scanner.
    monkeypatch.setenv("PLAIT_SECRET", "right")
    caplog.set_level(logging.WARNING, logger="plait")
    with TCPStoreServer() as server:
        for _ in range(30):
            with pytest.raises(_auth.AuthError):
                _authenticated(server.port, b"wrong").close()
    failed = [r.getMessage() for r in caplog.records if "failed authentication" in r.getMessage()]
    assert len(failed) == 2, failed  # the first, and the summary of the rest at close
    assert "29 more" in failed[1]


def test_failure_log_reports_the_first_then_a_count_per_interval() -> None:
    now = [0.0]
    lines: list[str] = []
    log = _auth.FailureLog("store h:1", interval=10.0, clock=lambda: now[0], emit=lines.append)
    log.failed("10.0.0.9:5000")
    assert len(lines) == 1
    assert "10.0.0.9:5000" in lines[0]
    assert "PLAIT_SECRET" in lines[0]
    for t in range(1, 10):
        now[0] = float(t)
        log.failed("10.0.0.9:5001")
    assert len(lines) == 1
    now[0] = 10.5
    log.failed("10.0.0.9:5002")
    assert len(lines) == 2
    assert "10 more" in lines[1]
    log.flush()  # nothing since the last summary
    assert len(lines) == 2
    now[0] = 11.0
    log.failed("10.0.0.9:5003")
    log.flush()
    assert len(lines) == 3
    assert "1 more" in lines[2]


# -- an open store -------------------------------------------------------------------------


def test_a_store_open_to_the_network_without_a_secret_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="plait")
    with TCPStoreServer("127.0.0.1", 0, secret=b""):
        pass
    with TCPStoreServer("0.0.0.0", 0, secret=b"key"):
        pass
    assert not [r for r in caplog.records if "PLAIT_SECRET" in r.getMessage()]
    with TCPStoreServer("0.0.0.0", 0, secret=b""):
        pass
    warned = [r.getMessage() for r in caplog.records if "PLAIT_SECRET" in r.getMessage()]
    assert len(warned) == 1
    assert "anyone" in warned[0]


# -- oversized values ----------------------------------------------------------------------


def test_a_value_over_the_limit_is_refused_by_the_client_naming_key_size_and_limit() -> None:
    with (
        TCPStoreServer(max_value_bytes=1024) as server,
        TCPStore("127.0.0.1", server.port, max_value_bytes=1024) as client,
    ):
        client.set("fits", b"x" * 1024)
        with pytest.raises(ValueError, match=r"'big'.*1025 bytes.*1024") as info:
            client.set("big", b"x" * 1025)
        assert "PLAIT_STORE_MAX_VALUE" in str(info.value)
        assert client.get("fits") == b"x" * 1024


def test_the_server_refuses_an_oversized_request_without_buffering_it() -> None:
    # The probe: an authenticated client announced a 4 GiB frame and the server waited to
    # buffer all of it. Now the header alone is answered, and the connection dropped.
    with TCPStoreServer(max_value_bytes=1024) as server, _authenticated(server.port) as raw:
        raw.sendall(struct.pack("!BQ", 1, 1 << 31))  # SET, 2 GiB to follow
        header = raw.recv(9)
        assert len(header) == 9
        code, length = struct.unpack("!BQ", header)
        body = b""
        while len(body) < length:
            chunk = raw.recv(length - len(body))
            assert chunk
            body += chunk
        assert code == 3  # BAD_REQUEST
        assert b"limit" in body
        assert _closed_by_server(raw)
        with TCPStore("127.0.0.1", server.port) as good:
            good.set("k", b"v")


def test_the_server_refuses_a_value_over_its_limit_that_fits_in_a_request() -> None:
    # A request may be up to the value limit plus REQUEST_OVERHEAD (for keys), so a value
    # between the two got past the header check and was stored. A client whose own limit is
    # larger than the server's is what sends one.
    with (
        TCPStoreServer(max_value_bytes=1024) as server,
        TCPStore("127.0.0.1", server.port, max_value_bytes=1 << 20) as client,
    ):
        with pytest.raises(ValueError, match=r"'big'.*4096 bytes.*limit of 1024") as info:
            client.set("big", b"x" * 4096)
        assert "PLAIT_STORE_MAX_VALUE" in str(info.value)
        assert client.check(["big"]) is False
        client.set("fits", b"x" * 1024)  # the connection is still good
        assert client.get("fits") == b"x" * 1024


def test_the_limit_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLAIT_STORE_MAX_VALUE", "2K")
    with TCPStoreServer() as server, TCPStore("127.0.0.1", server.port) as client:
        client.set("ok", b"x" * 2048)
        with pytest.raises(ValueError, match="2049 bytes"):
            client.set("big", b"x" * 2049)
    monkeypatch.setenv("PLAIT_STORE_MAX_VALUE", "lots")
    with pytest.raises(ValueError, match="PLAIT_STORE_MAX_VALUE"):
        TCPStoreServer()


def test_a_server_that_is_not_plaits_is_not_blamed_on_the_secret() -> None:
    """A port held by something else (24 random bytes for a greeting) read "the other side
    does not speak plait's protocol; check PLAIT_SECRET"."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]

        def greet() -> None:
            conn, _ = other.accept()
            with conn:
                conn.sendall(os.urandom(24))
                conn.recv(1024)

        thread = threading.Thread(target=greet, daemon=True)
        thread.start()
        with pytest.raises(StoreConnectError) as info:
            TCPStore("127.0.0.1", port, secret=b"s", connect_timeout=5)
        thread.join(10)
    message = str(info.value)
    assert "does not speak plait's protocol: is the address right?" in message
    assert "PLAIT_SECRET" not in message


# -- authenticated clients ---------------------------------------------------------------


def test_an_add_of_thousands_of_digits_is_refused_and_the_store_goes_on() -> None:
    """Note [replies nobody reads]: two adds of a 4,300-digit amount made ``str`` of the sum
    raise in the server thread, which ended: every client lost the store."""
    huge = int("9" * 4300)
    with TCPStoreServer() as server, TCPStore("127.0.0.1", server.port) as client:
        with pytest.raises(ValueError, match="amount added to 'n' is not a 64-bit integer"):
            client.add("n", huge)
        assert client.add("n", (1 << 63) - 1) == (1 << 63) - 1
        with pytest.raises(ValueError, match="leaves the 64 bits of a counter"):
            client.add("n", 1)
        client.set("text", b"9" * 5000)
        with pytest.raises(ValueError, match="value of key 'text' is not a 64-bit integer"):
            client.add("text", 1)
        assert client.add("m", -5) == -5
        with TCPStore("127.0.0.1", server.port) as other:
            assert other.get("n") == str((1 << 63) - 1).encode()


def test_replies_a_client_never_reads_are_not_buffered_without_bound() -> None:
    """Note [replies nobody reads]: a hundred pipelined GETs of an 8 MiB value, never read,
    made the server hold 800 MiB. The requests now wait while a request limit's worth of
    replies is unsent, and every reply still comes once the client reads."""
    limit = 1 << 20
    value = b"v" * limit
    request = frame(Op.GET, [SECONDS.pack(5.0), b"big"])
    reply = len(frame(0, [value]))
    with TCPStoreServer(max_value_bytes=limit) as server:
        with TCPStore("127.0.0.1", server.port) as client:
            client.set("big", value)
        with _authenticated(server.port) as raw:
            raw.sendall(request * 100)
            deadline = time.monotonic() + TEST_TIMEOUT
            held: list[int] = []
            while time.monotonic() < deadline:  # until the server holds requests back
                held = [len(c.outbuf) for c in list(server._conns) if c.nonce is None and c.inbuf]
                if held:
                    break
                select.select([], [], [], 0.01)
            assert held, "the server answered every request, buffering the replies"
            assert max(held) <= limit + REQUEST_OVERHEAD + reply, held
            got = 0
            while got < 100 * reply:
                chunk = raw.recv(1 << 20)
                assert chunk, "the server dropped the client"
                got += len(chunk)
            assert got == 100 * reply
        with TCPStore("127.0.0.1", server.port) as good:
            assert good.get("big") == value


def test_an_error_while_serving_one_client_drops_that_client_not_the_store(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A defect that raised while the server handled one request ended its thread, and every
    rank lost the store (the add of thousands of digits above was one)."""
    real = _tcp_server.TCPStoreServer._handle

    def handle(self: TCPStoreServer, conn: object, code: int, fields: list[bytes]) -> None:
        if b"boom" in fields:
            raise RuntimeError("a defect")
        real(self, conn, code, fields)  # type: ignore[arg-type]

    monkeypatch.setattr(_tcp_server.TCPStoreServer, "_handle", handle)
    with (
        caplog.at_level(logging.DEBUG, logger="plait"),
        TCPStoreServer() as server,
        TCPStore("127.0.0.1", server.port, timeout=5) as good,
    ):
        good.set("k", b"v")
        for _ in range(2):
            with (
                TCPStore("127.0.0.1", server.port, timeout=5) as bad,
                pytest.raises(RendezvousError, match="connection broke"),
            ):
                bad.set("boom", b"x")
        assert good.get("k") == b"v"
        with TCPStore("127.0.0.1", server.port) as late:
            assert late.get("k") == b"v"
    errors = [r for r in caplog.records if "after an error" in r.getMessage()]
    assert [r.levelno for r in errors] == [logging.ERROR, logging.DEBUG]


def test_a_proof_that_came_with_a_flood_is_heard_before_its_connection_is_pushed_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under a flood of connections that never authenticate, an honest client's proof came
    in the same turn of the server's loop as the connections that pushed it out, oldest
    first, unread: the client failed after its whole connect timeout."""
    monkeypatch.setattr(_tcp_server, "MAX_UNAUTHENTICATED", 4, raising=False)
    held: set[object] = set()
    real = _tcp_server.TCPStoreServer._serve_one

    def serve_one(self: TCPStoreServer, conn: Any, mask: int) -> None:
        if conn.peer not in held:  # the honest proof waits, as behind a flood's accepts
            real(self, conn, mask)

    monkeypatch.setattr(_tcp_server.TCPStoreServer, "_serve_one", serve_one)
    with TCPStoreServer() as server, _sockets() as socks:
        honest = socket.socket()
        socks.append(honest)
        honest.settimeout(TEST_TIMEOUT)
        honest.bind(("127.0.0.1", 0))
        held.add(f"127.0.0.1:{honest.getsockname()[1]}")
        honest.connect(("127.0.0.1", server.port))
        hello = b""
        while len(hello) < _auth.CHALLENGE_BYTES:
            hello += honest.recv(_auth.CHALLENGE_BYTES - len(hello))
        nonce = secrets.token_bytes(_auth.NONCE)
        honest.sendall(nonce + _auth.client_proof(b"", hello[len(_auth.MAGIC) :], nonce))
        socks += [_raw(server.port) for _ in range(4)]  # the fourth pushes the honest one out
        held.clear()
        answer = b""
        while len(answer) < _auth.MAC:
            chunk = honest.recv(_auth.MAC - len(answer))
            assert chunk, "the server dropped the honest client with its proof unread"
            answer += chunk
        assert answer == _auth.server_proof(b"", hello[len(_auth.MAGIC) :], nonce)
