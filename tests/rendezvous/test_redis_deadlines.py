"""The Redis store against a server of its own: one that stops answering, one with a password."""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator

import pytest
from store_backends import free_port

from plait.errors import RendezvousError
from plait.rendezvous.redis_store import RedisStore
from plait.rendezvous.store import answers_by
from plait.rendezvous.url import store_from_url

#: Seconds within which a call whose deadline is 1 s must have failed (1 s, the grace, and load).
_WITHIN = 6.0


class RedisServer:
    """A redis-server process on a free loopback port."""

    def __init__(self, exe: str, *extra: str) -> None:
        self.host, self.port = "127.0.0.1", free_port()
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", self.host, "--save", "", *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        self.stopped = False
        assert self.proc.stdout is not None
        seen, deadline = b"", time.monotonic() + 10.0
        while b"Ready to accept connections" not in seen:
            fd = self.proc.stdout.fileno()
            ready, _, _ = select.select([fd], [], [], max(deadline - time.monotonic(), 0.0))
            chunk = os.read(fd, 4096) if ready else b""
            if not chunk:
                self.close()
                pytest.fail(f"redis-server did not start:\n{seen.decode(errors='replace')}")
            seen += chunk
        self.proc.stdout.close()  # the server ignores SIGPIPE: its later log lines go nowhere

    def stop(self) -> None:
        """Stop the process (SIGSTOP): it keeps its port, and accepts, but never answers."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.stopped = True
        os.waitpid(self.proc.pid, os.WUNTRACED)  # returns once it has stopped

    def close(self) -> None:
        if self.stopped:
            os.kill(self.proc.pid, signal.SIGCONT)
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def redis_server_of_its_own() -> Iterator[Callable[..., RedisServer]]:
    """Starts a redis-server with the given extra arguments; all are ended at teardown."""
    pytest.importorskip("redis")
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not on PATH")
    started: list[RedisServer] = []

    def start(*extra: str) -> RedisServer:
        started.append(RedisServer(exe, *extra))
        return started[-1]

    try:
        yield start
    finally:
        for server in started:
            server.close()


def _fails_within(seconds: float, call: Callable[[], object], match: str) -> None:
    start = time.monotonic()
    with pytest.raises(RendezvousError, match=match):
        call()
    took = time.monotonic() - start
    assert took < seconds, f"took {took:.1f} s"


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_stopped_server_fails_connecting_within_the_store_timeout(
    redis_server_of_its_own: Callable[..., RedisServer],
) -> None:
    server = redis_server_of_its_own()
    server.stop()
    _fails_within(_WITHIN, lambda: RedisStore(server.host, server.port, timeout=1), "connect")


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_stopped_server_fails_each_call_by_its_deadline(
    redis_server_of_its_own: Callable[..., RedisServer],
) -> None:
    server = redis_server_of_its_own()
    store = RedisStore(server.host, server.port, timeout=1)
    patient = RedisStore(server.host, server.port, timeout=300)
    try:
        patient.set("k", b"v")  # connected before the server stops
        server.stop()
        _fails_within(_WITHIN, lambda: store.set("k", b"v"), "did not answer")
        _fails_within(_WITHIN, lambda: store.add("n", 1), "did not answer")
        _fails_within(_WITHIN, lambda: store.get("missing"), "did not answer")
        # A call with a deadline of its own (agree(timeout=...)) raises by then, whatever
        # the store's own timeout.
        with answers_by(time.monotonic() + 1):
            _fails_within(_WITHIN, lambda: patient.set("k", b"v"), "did not answer")
        with answers_by(time.monotonic() + 1):
            _fails_within(_WITHIN, lambda: patient.wait(["missing"]), "did not answer")
        with answers_by(time.monotonic() + 1):
            _fails_within(_WITHIN, lambda: patient.check(["k"]), "did not answer")
    finally:
        store.close()
        patient.close()


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_server_with_a_password_takes_it_from_the_url_and_says_when_it_refuses(
    redis_server_of_its_own: Callable[..., RedisServer],
) -> None:
    server = redis_server_of_its_own("--requirepass", "s3cr@t")
    where = f"{server.host}:{server.port}"
    with store_from_url(f"redis://:s3cr%40t@{where}/0?prefix=pw/", timeout=5) as store:
        store.set("k", b"v")
        assert store.get("k") == b"v"
        assert "s3cr" not in repr(store)
    # A user of the server's ACLs: "default" is the one requirepass sets.
    with store_from_url(f"redis://default:s3cr%40t@{where}", timeout=5) as store:
        assert store.check([])
    for url in (f"redis://{where}", f"redis://:wrong@{where}", f"redis://nobody:s3cr%40t@{where}"):
        with pytest.raises(RendezvousError) as info:
            store_from_url(url, timeout=5)
        text = str(info.value)
        assert "refused this client's credentials" in text, text
        assert "is the Redis server running" not in text
        assert "s3cr" not in text
        assert "wrong" not in text


def test_a_malformed_url_never_shows_its_password() -> None:
    pytest.importorskip("redis")
    for url in ("redis://:s3cret@h:99999", "redis://u:s3cret@h/x", "tcp://u:s3cret@h:1"):
        with pytest.raises(ValueError, match=r":\*\*\*@") as info:
            store_from_url(url)
        assert "s3cret" not in str(info.value)
