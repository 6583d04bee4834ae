"""What store errors say: URLs that name no usable store, and keys listed without flooding."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from plait.rendezvous.file_store import FileStore
from plait.rendezvous.store import MemoryStore, Store, StoreTimeout
from plait.rendezvous.tcp_store import TCPStore, TCPStoreServer
from plait.rendezvous.url import store_from_url


def test_the_root_directory_is_no_file_store() -> None:
    for url in ("file:///", "file://localhost/", "file:///./"):
        with pytest.raises(ValueError, match="root directory"):
            store_from_url(url)


def test_a_file_url_without_slashes_is_told_the_file_form() -> None:
    with pytest.raises(ValueError, match="Did you mean 'file:///absolute/jobs/42'") as info:
        store_from_url("file:jobs/42")
    assert "tcp://" + "file:" not in str(info.value)


def _many_keys_missing(store: Store) -> str:
    with pytest.raises(StoreTimeout) as info:
        store.wait([f"key/{i}" for i in range(2000)], timeout=0.05)
    return str(info.value)


def test_a_wait_on_many_keys_lists_a_few(tmp_path: Path) -> None:
    server = TCPStoreServer("127.0.0.1", 0)
    stores = [MemoryStore(), FileStore(tmp_path / "s"), TCPStore("127.0.0.1", server.port)]
    try:
        for store in stores:
            text = _many_keys_missing(store)
            assert "'key/0'" in text
            assert "'key/1999'" not in text
            assert "and 1995 more" in text
            assert len(text) < 500, text
    finally:
        stores[2].close()
        server.close()


def test_an_oversized_key_is_cut_in_the_error() -> None:
    with (
        TCPStoreServer("127.0.0.1", 0) as server,
        TCPStore("127.0.0.1", server.port, max_value_bytes=1024) as store,
    ):
        with pytest.raises(ValueError, match="over the store") as info:
            store.set("a" * (2 << 20), b"1")
        assert len(str(info.value)) < 1000
        assert f"({2 << 20} characters)" in str(info.value)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_plait_store_on_every_interface_says_to_use_this_hosts_address() -> None:
    store = subprocess.Popen(
        [sys.executable, "-m", "plait", "store", "--host", "0.0.0.0", "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert store.stdout is not None
        line = store.stdout.readline()
    finally:
        store.send_signal(signal.SIGTERM)
        store.communicate(timeout=30)
    assert line.startswith("plait store: serving tcp://0.0.0.0:"), line
    assert "PLAIT_STORE=tcp://<this host's address>:" in line
