"""A store kept as one file per key in a directory on a (shared) filesystem.

Ranks on one host, or on hosts sharing an NFS/Lustre/... mount, meet through a
directory: no server to start, nothing to clean up but the directory itself.

Note [file store layout]
    Each key is the file ``k<hex of its UTF-8>`` (``h<sha256>`` for keys too
    long for a file name), so any key, ``"../x"`` included, maps to a safe name
    inside the directory. ``set`` writes a hidden temporary file and renames it
    over the key's file (:func:`os.replace` is atomic), so readers see the old
    value or the new one, never part of one. ``add`` and ``delete`` hold an
    exclusive :func:`fcntl.flock` on the directory's ``.lock`` file while they
    read-modify-write; Linux NFS clients implement ``flock`` with NFS locks, so
    this holds across hosts too.

Note [file store polling]
    A filesystem offers no portable change notification (inotify is Linux-only
    and blind to writes made by other NFS clients), so ``get`` and ``wait`` poll
    with an exponential backoff from 1 ms capped at 50 ms: a key set while a
    rank waits is seen within 50 ms, and a long wait costs at most 20 stats of
    each missing key per second.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Self

from plait.errors import RendezvousError
from plait.rendezvous.store import (
    DEFAULT_STORE_TIMEOUT,
    Store,
    StoreTimeout,
    shown_key,
    shown_keys,
)

__all__ = ["FileStore"]

#: First and largest pause between two looks at the filesystem while waiting.
_POLL_BACKOFF = (0.001, 0.05)
#: Longest hex-encoded key kept readable in its file name (names stop at 255 bytes).
_MAX_HEX_NAME = 200
_LOCK_NAME = ".lock"
_TMP_PREFIX = ".tmp-"


def _file_name(key: str) -> str:
    """The file name that holds ``key``: never empty, never a path, never hidden."""
    if not isinstance(key, str):
        raise TypeError(f"store keys are str, got {type(key).__name__}: {shown_key(key)}")
    raw = key.encode()
    if 2 * len(raw) <= _MAX_HEX_NAME:
        return "k" + raw.hex()
    return "h" + hashlib.sha256(raw).hexdigest()


class _Poll:
    """Pauses between looks at the filesystem, growing to the cap, never past the deadline."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds
        self.delay = _POLL_BACKOFF[0]

    def pause(self) -> bool:
        """Sleep before the next look; False (no sleep) when the deadline has passed."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(self.delay, left))
        self.delay = min(2 * self.delay, _POLL_BACKOFF[1])
        return True


class FileStore(Store):
    """A store in a directory, shared by every process that can see it.

    Args:
        path: The directory; created (with parents) if missing. Every rank of
            a job passes the same path; use a fresh one per job, since keys
            left by an earlier job would be seen as already set.
        timeout: Default seconds for blocking calls (``get``, ``wait``).

    Raises:
        RendezvousError: the directory cannot be created, or this process cannot
            write in it (a read-only mount, another user's directory); a later call
            raises it too where the directory stops being writable or readable.

    The data outlives the clients: :meth:`close` releases nothing, and
    :meth:`cleanup` (called once, by whoever created the job, e.g. the
    launcher, after all ranks are done) removes the directory.

    Example::

        with FileStore("/shared/jobs/42") as store:
            store.set("addr/0", b"10.0.0.1:4000")
    """

    def __init__(self, path: str | os.PathLike[str], *, timeout: float = DEFAULT_STORE_TIMEOUT):
        self.path = os.path.abspath(os.fspath(path))
        self.timeout = timeout
        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError as exc:
            raise RendezvousError(
                f"file store: cannot create the directory {self.path!r}: {exc}"
            ) from exc
        # Try what every rank does, rather than ask os.access: it says a read-only mount
        # is writable to root.
        with self._failing("open"):
            os.close(self._open_lock())
            fd, tmp = self._temp()
            os.close(fd)
            os.unlink(tmp)

    def __enter__(self) -> Self:
        return self

    def __repr__(self) -> str:
        return f"FileStore({self.path!r})"

    def cleanup(self) -> None:
        """Delete the directory and every key in it; idempotent.

        Only for the owner of the job's rendezvous, once no rank uses the store.
        """
        shutil.rmtree(self.path, ignore_errors=True)

    # ---- Store operations

    def set(self, key: str, value: bytes) -> None:
        if not isinstance(value, bytes | bytearray | memoryview):
            raise TypeError(f"store values are bytes, got {type(value).__name__}")
        with self._failing(f"set({shown_key(key)})"):
            self._write(_file_name(key), value)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        path = self._path(key)
        poll = _Poll(self._timeout(timeout))
        while True:
            value = self._read(path)
            if value is not None:
                return value
            if not poll.pause():
                raise StoreTimeout(
                    f"file store {self.path}: get: key {shown_key(key)} not set within "
                    f"{poll.seconds:g} s"
                )

    def add(self, key: str, amount: int) -> int:
        name = _file_name(key)
        with self._failing(f"add({shown_key(key)})"), self._locked():
            current = self._read(os.path.join(self.path, name))
            try:
                value = int(current if current is not None else b"0") + int(amount)
            except ValueError:
                raise ValueError(
                    f"file store {self.path}: add({shown_key(key)}): value is not an integer: "
                    f"{current!r:.80}"
                ) from None
            self._write(name, str(value).encode())
        return value

    def wait(self, keys: Sequence[str], timeout: float | None = None) -> None:
        missing = list(dict.fromkeys(keys))
        paths = {key: self._path(key) for key in missing}
        poll = _Poll(self._timeout(timeout))
        while True:
            missing = [key for key in missing if not os.path.exists(paths[key])]
            if not missing:
                return
            if not poll.pause():
                raise StoreTimeout(
                    f"file store {self.path}: keys {shown_keys(missing)} not set within "
                    f"{poll.seconds:g} s"
                )

    def check(self, keys: Sequence[str]) -> bool:
        return all(os.path.exists(self._path(key)) for key in keys)

    def delete(self, key: str) -> bool:
        path = self._path(key)
        with self._failing(f"delete({shown_key(key)})"), self._locked():
            try:
                os.unlink(path)
            except FileNotFoundError:
                return False
        return True

    # ---- files

    def _path(self, key: str) -> str:
        return os.path.join(self.path, _file_name(key))

    def _read(self, path: str) -> bytes | None:
        try:
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self._error("read", exc) from exc

    def _temp(self) -> tuple[int, str]:
        """A new hidden temporary file in the directory, open for writing."""
        return tempfile.mkstemp(prefix=_TMP_PREFIX, dir=self.path)

    def _open_lock(self) -> int:
        return os.open(os.path.join(self.path, _LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o644)

    def _error(self, what: str, exc: OSError) -> RendezvousError:
        return RendezvousError(
            f"file store {self.path}: {what} failed: the directory cannot be written (or read) "
            f"by this process ({exc}); give a directory that every rank can write in"
        )

    @contextlib.contextmanager
    def _failing(self, what: str) -> Iterator[None]:
        """Raise an OSError of the filesystem as a RendezvousError naming the store."""
        try:
            yield
        except OSError as exc:
            raise self._error(what, exc) from exc

    def _write(self, name: str, value: bytes | bytearray | memoryview) -> None:
        """Write a temporary file, then rename it over ``name`` (atomic for readers)."""
        fd, tmp = self._temp()
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(value)
            os.replace(tmp, os.path.join(self.path, name))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the directory's exclusive lock (between processes and between threads)."""
        # Every call opens the lock file anew: flock locks belong to the open
        # file description, so two threads of one process also exclude each other.
        fd = self._open_lock()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock
