"""Store URLs: each scheme builds its store; malformed URLs are clear ValueErrors."""

from __future__ import annotations

from pathlib import Path

import pytest
from store_backends import free_port, ipv6_loopback_available

from plait.rendezvous.file_store import FileStore
from plait.rendezvous.store import DEFAULT_STORE_TIMEOUT
from plait.rendezvous.tcp_store import StoreConnectError, TCPStore
from plait.rendezvous.url import store_from_url


def test_tcp_server_and_client() -> None:
    server_side = store_from_url("tcp://127.0.0.1:0", is_server=True, timeout=7)
    assert isinstance(server_side, TCPStore)
    try:
        assert server_side.server is not None
        assert server_side.timeout == 7
        port = server_side.server.port
        with store_from_url(f"tcp://127.0.0.1:{port}", rank=1) as client:
            assert isinstance(client, TCPStore)
            assert client.server is None
            assert client.timeout == DEFAULT_STORE_TIMEOUT
            client.set("k", b"v")
            assert server_side.get("k") == b"v"
    finally:
        server_side.close()


@pytest.mark.skipif(not ipv6_loopback_available(), reason="no IPv6 loopback")
def test_tcp_ipv6() -> None:
    with store_from_url("tcp://[::1]:0", is_server=True) as server_side:
        assert isinstance(server_side, TCPStore)
        assert server_side.server is not None
        port = server_side.server.port
        with store_from_url(f"tcp://[::1]:{port}") as client:
            assert isinstance(client, TCPStore)
            assert client.address == f"[::1]:{port}"


def test_tcp_connect_failure_names_the_rank() -> None:
    port = free_port()
    with pytest.raises(StoreConnectError, match=f"rank 3: .*127.0.0.1:{port}"):
        store_from_url(f"tcp://127.0.0.1:{port}", rank=3, timeout=0.2)


def test_file(tmp_path: Path) -> None:
    with store_from_url(f"file://{tmp_path}/a%20b", timeout=3) as store:
        assert isinstance(store, FileStore)
        assert store.path == str(tmp_path / "a b")
        assert store.timeout == 3
    with store_from_url(f"file://localhost{tmp_path}") as store:
        assert isinstance(store, FileStore)
        assert store.path == str(tmp_path)


def test_redis(redis_server: tuple[str, int]) -> None:
    from plait.rendezvous.redis_store import RedisStore

    host, port = redis_server
    with store_from_url(f"redis://{host}:{port}/2?prefix=job7/", timeout=4) as store:
        assert isinstance(store, RedisStore)
        assert (store.host, store.port, store.db, store.prefix) == (host, port, 2, "job7/")
        assert store.timeout == 4
    with store_from_url(f"redis://{host}:{port}") as store:
        assert isinstance(store, RedisStore)
        assert (store.db, store.prefix) == (0, "plait/")


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("tpc://127.0.0.1:29500", r"unknown store URL scheme 'tpc'.*Did you mean 'tcp://'\?"),
        ("rediss://h:1", r"supported: tcp://host:port, file:///absolute/path, redis://"),
        ("gopher://h:1", r"unknown store URL scheme 'gopher'"),
        ("127.0.0.1:29500", r"has no scheme.*Did you mean 'tcp://127.0.0.1:29500'\?"),
        ("tcp://127.0.0.1", "needs a host and a port"),
        ("tcp://:29500", "needs a host and a port"),
        ("tcp://h:99999", "out of range"),
        ("tcp://h:port", "tcp://h:port"),
        ("tcp://h:0", "port 0 only makes sense with is_server=True"),
        ("tcp://h:1/path", "parts a store does not use"),
        ("tcp://h:1?timeout=3", "takes no query"),
        ("file://relative/path", "needs an absolute path"),
        ("file:relative", "no scheme|needs an absolute path"),
        ("file:///abs?x=1", "takes no query"),
        ("redis://h:1/db", "database must be a number"),
        ("redis://h:1/0?db=2", r"takes only \?prefix="),
        ("redis://:1/0", "needs a host"),
    ],
)
def test_malformed_urls_are_value_errors(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        store_from_url(url)


def test_url_must_be_a_string() -> None:
    with pytest.raises(TypeError, match="must be a str"):
        store_from_url(Path("/tmp"))  # type: ignore[arg-type]
