"""Fixtures for the store tests: a backend per store kind, a Redis server, leak checks."""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from store_backends import TEST_TIMEOUT, Backend, free_port

from plait.rendezvous.file_store import FileStore
from plait.rendezvous.store import MemoryStore, Store
from plait.rendezvous.tcp_store import TCPStore, TCPStoreServer

# redis starts a redis-server process, so its cases are left out of the quick loop with the rest
# of the tests that start processes.
BACKENDS = ["memory", "tcp", "file", pytest.param("redis", marks=pytest.mark.multiprocess)]


@pytest.fixture(autouse=True)
def _no_stray_store_threads() -> Iterator[None]:
    """Every test must close the servers it starts (their threads are joined on close)."""
    before = set(threading.enumerate())
    yield
    stray = [
        t for t in threading.enumerate() if t not in before and t.name.startswith("plait-tcp-store")
    ]
    assert not stray, f"store server threads left running: {stray}"


def _read_until(fd: int, marker: bytes, timeout: float, port: int) -> None:
    """Read a server's log from ``fd`` until ``marker``; fail if it exits or ``timeout`` passes."""
    seen = b""
    deadline = time.monotonic() + timeout
    while marker not in seen:
        ready, _, _ = select.select([fd], [], [], max(deadline - time.monotonic(), 0.0))
        chunk = os.read(fd, 4096) if ready else b""
        if not chunk:
            why = "exited" if ready else f"did not start within {timeout} s"
            pytest.fail(f"redis-server on port {port} {why}:\n{seen.decode(errors='replace')}")
        seen += chunk


@pytest.fixture(scope="session")
def redis_server() -> Iterator[tuple[str, int]]:
    """A throw-away redis-server on a free loopback port, killed at the end of the session."""
    redis = pytest.importorskip("redis")
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not on PATH")
    host, port = "127.0.0.1", free_port()
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", host, "--save", "", "--appendonly", "no"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        assert proc.stdout is not None
        _read_until(proc.stdout.fileno(), b"Ready to accept connections", 10.0, port)
        proc.stdout.close()  # the server ignores SIGPIPE: its later log lines go nowhere
        client = redis.Redis(host=host, port=port, socket_connect_timeout=1.0)
        assert client.ping()
        client.close()
        yield host, port
    finally:
        if proc.stdout is not None:
            proc.stdout.close()
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _tcp_backend() -> Backend:
    server = TCPStoreServer("127.0.0.1", 0)
    port = server.port
    backend = Backend(
        "tcp",
        lambda: TCPStore("127.0.0.1", port, timeout=TEST_TIMEOUT),
        "from plait.rendezvous.tcp_store import TCPStore\n"
        f"store = TCPStore('127.0.0.1', {port}, timeout={TEST_TIMEOUT})",
    )
    backend.closers.append(server.close)
    return backend


def _file_backend(path: Path) -> Backend:
    return Backend(
        "file",
        lambda: FileStore(path, timeout=TEST_TIMEOUT),
        "from plait.rendezvous.file_store import FileStore\n"
        f"store = FileStore({str(path)!r}, timeout={TEST_TIMEOUT})",
    )


def _redis_backend(host: str, port: int) -> Backend:
    from plait.rendezvous.redis_store import RedisStore

    prefix = f"test-{uuid.uuid4().hex}/"  # one server for the session: a namespace per test
    return Backend(
        "redis",
        lambda: RedisStore(host, port, prefix=prefix, timeout=TEST_TIMEOUT),
        "from plait.rendezvous.redis_store import RedisStore\n"
        f"store = RedisStore({host!r}, {port}, prefix={prefix!r}, timeout={TEST_TIMEOUT})",
    )


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    """Each store kind in turn; redis is skipped without redis-server or the redis package."""
    if request.param == "memory":
        memory = MemoryStore(timeout=TEST_TIMEOUT)
        made = Backend("memory", lambda: memory, None)
    elif request.param == "tcp":
        made = _tcp_backend()
    elif request.param == "file":
        made = _file_backend(tmp_path / "store")
    else:
        made = _redis_backend(*request.getfixturevalue("redis_server"))
    try:
        yield made
    finally:
        made.close()


@pytest.fixture
def store(backend: Backend) -> Store:
    """A client of ``backend``."""
    return backend.client()
