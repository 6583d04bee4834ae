"""The Redis store: optional dependency, namespaces, databases, unreachable servers."""

from __future__ import annotations

import sys
import uuid

import pytest
from store_backends import free_port

from plait.errors import RendezvousError
from plait.rendezvous.redis_store import RedisStore


def test_missing_redis_package_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "redis", None)  # makes "import redis" fail
    with pytest.raises(ImportError) as info:
        RedisStore("127.0.0.1", 6379)
    assert str(info.value) == "RedisStore needs the redis package: pip install 'plait[redis]'"


def test_unreachable_server_is_a_rendezvous_error_naming_it() -> None:
    pytest.importorskip("redis")
    port = free_port()
    with pytest.raises(RendezvousError, match=f"redis://127.0.0.1:{port}/0"):
        RedisStore("127.0.0.1", port)


def test_prefixes_and_databases_are_namespaces(redis_server: tuple[str, int]) -> None:
    host, port = redis_server
    job = uuid.uuid4().hex
    a = RedisStore(host, port, prefix=f"{job}/a/", timeout=1)
    b = RedisStore(host, port, prefix=f"{job}/b/", timeout=1)
    other_db = RedisStore(host, port, db=1, prefix=f"{job}/a/", timeout=1)
    try:
        a.set("k", b"a")
        b.set("k", b"b")
        assert (a.get("k"), b.get("k")) == (b"a", b"b")
        assert not other_db.check(["k"])
        assert "prefix" in repr(a)
        # A set in another database must not wake a waiter in this one.
        other_db.set("w", b"elsewhere")
        assert not a.check(["w"])
    finally:
        for store in (a, b, other_db):
            store.delete("k")
            store.delete("w")
            store.close()
