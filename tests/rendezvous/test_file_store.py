"""The file store: safe file names, atomic replacement, directory lifecycle."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from store_backends import Background

from plait.errors import RendezvousError
from plait.rendezvous.file_store import FileStore


def test_creates_the_directory_and_cleanup_removes_it(tmp_path: Path) -> None:
    path = tmp_path / "jobs" / "42"
    store = FileStore(path)
    assert path.is_dir()
    store.set("k", b"v")
    assert FileStore(str(path)).get("k") == b"v"
    store.cleanup()
    assert not path.exists()
    store.cleanup()  # idempotent


def test_unusable_directory_is_a_rendezvous_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with pytest.raises(RendezvousError, match="cannot create"):
        FileStore(blocker / "store")


def test_keys_map_to_plain_files_inside_the_directory(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "s")
    keys = ["../../etc/passwd", "/abs", "a/b", "", ".", "..", "é" * 300]
    for key in keys:
        store.set(key, key.encode())
    names = os.listdir(tmp_path / "s")
    assert not (tmp_path / "etc").exists()
    assert all("/" not in n and len(n.encode()) <= 255 and n not in (".", "..") for n in names)
    assert len([n for n in names if not n.startswith(".")]) == len(keys)
    assert [store.get(k) for k in keys] == [k.encode() for k in keys]


def test_readers_never_see_a_partial_value(tmp_path: Path) -> None:
    writer, reader = FileStore(tmp_path), FileStore(tmp_path)
    first, second = b"a" * (1 << 18), b"b" * (1 << 18)
    writer.set("k", first)

    def rewrite() -> None:
        for i in range(100):
            writer.set("k", second if i % 2 == 0 else first)

    rewriting = Background(rewrite)
    for _ in range(100):
        assert reader.get("k") in (first, second)
    rewriting.result()


def test_no_temporary_files_are_left_behind(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    for i in range(20):
        store.set("k", str(i).encode())
        store.add("n", 1)
    assert all(not n.startswith(".tmp-") for n in os.listdir(tmp_path))


def test_bad_arguments_are_type_errors(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    with pytest.raises(TypeError, match="keys are str"):
        store.set(b"k", b"v")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="values are bytes"):
        store.set("k", 5)  # type: ignore[arg-type]
