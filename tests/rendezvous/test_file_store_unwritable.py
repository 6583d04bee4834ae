"""The file store in a directory this process cannot write: a RendezvousError naming it."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from plait.errors import CommError, RendezvousError
from plait.rendezvous.file_store import FileStore
from plait.rendezvous.url import store_from_url


def _refuse_writes(monkeypatch: pytest.MonkeyPatch, under: Path, code: int) -> None:
    """os.open fails with ``code`` for a file under ``under`` opened to write (as the
    kernel would on a read-only mount, EROFS, or a directory of another user, EACCES)."""
    real = os.open

    def fake(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        writes = flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
        if writes and os.fspath(path).startswith(str(under)):
            raise OSError(code, os.strerror(code), os.fspath(path))
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", fake)


@pytest.mark.parametrize("code", [errno.EROFS, errno.EACCES])
def test_opening_a_store_in_a_directory_it_cannot_write_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    path = tmp_path / "store"
    path.mkdir()
    _refuse_writes(monkeypatch, path, code)
    with pytest.raises(RendezvousError, match="the directory cannot be written") as info:
        FileStore(path)
    assert str(path) in str(info.value)
    assert os.strerror(code) in str(info.value)
    with pytest.raises(CommError, match="cannot be written"):
        store_from_url(f"file://{path}")


def test_calls_on_a_directory_that_stopped_being_writable_say_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = FileStore(tmp_path / "store")
    store.set("k", b"v")
    _refuse_writes(monkeypatch, tmp_path / "store", errno.EROFS)
    for call in (lambda: store.set("k", b"w"), lambda: store.add("n", 1)):
        with pytest.raises(RendezvousError, match="cannot be written"):
            call()
    with pytest.raises(RendezvousError, match="delete"):
        store.delete("k")
    monkeypatch.undo()
    assert store.get("k") == b"v"


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory bind-mounted read-only onto itself (needs root and mount)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a read-only bind mount needs root and mount(8)")
    path = tmp_path / "ro"
    path.mkdir()
    done = subprocess.run(["mount", "--bind", str(path), str(path)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"mount --bind failed: {done.stderr.decode(errors='replace')}")
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(path)], check=True)
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def test_a_read_only_mount_is_refused_when_the_store_is_opened(read_only_dir: Path) -> None:
    # os.access says a read-only mount is writable to root: the store tries for real.
    with pytest.raises(RendezvousError, match="cannot be written") as info:
        FileStore(read_only_dir)
    assert "Read-only file system" in str(info.value)
