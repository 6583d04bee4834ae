"""A shared-memory segment: the file in ``/dev/shm``, its mapping, its counter words.

Layout, memory ordering and cleanup rules: ``docs/transport.md`` (Note [segment
layout], Note [memory ordering], Note [segment names], Note [lifetime and cleanup]).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import mmap
import os
import platform
import stat
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from plait.errors import TransportError, UnsupportedError

__all__ = [
    "CONTROL_BYTES",
    "MAGIC",
    "SHM_DIR",
    "VERSION",
    "W_CLOSED",
    "W_MAGIC",
    "W_PID",
    "W_SIZE",
    "W_SLEEPING",
    "W_SLOTS",
    "W_SLOT_BYTES",
    "W_VERSION",
    "W_WINDOW",
    "W_WINDOW_BYTES",
    "Fence",
    "Segment",
    "attach",
    "check_platform",
    "create",
    "unlink",
]

#: Where segments live (a tmpfs on Linux).
SHM_DIR = "/dev/shm"

MAGIC = 0x68732D7469616C70  # b"plait-sh" little-endian
VERSION = 2  # 2: the window (W_WINDOW, W_WINDOW_BYTES and the arena after the rings)
#: Bytes of the control block at the start of every segment.
CONTROL_BYTES = 4096
# Word indexes (8-byte units) into the control block.
W_MAGIC, W_VERSION, W_PID, W_SIZE, W_SLOTS, W_SLOT_BYTES, W_CLOSED = range(7)
#: The owner's "asleep in poll" flag, on a cache line of its own.
W_SLEEPING = 64 // 8
#: The window's geometry (read once by peers): the arena's byte offset (0: no window)
#: and the bytes of one half (Note [segment layout], Note [windows]).
W_WINDOW, W_WINDOW_BYTES = 128 // 8, 128 // 8 + 1

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")
#: Whether counters go through libatomic (tests may set it to exercise that path).
use_libatomic = not _X86


class _AtomicWords:
    """``words[i]`` / ``words[i] = v`` as seq_cst 8-byte atomics through libatomic."""

    _SEQ_CST = 5
    _lib: Any = None

    def __init__(self, buffer: mmap.mmap) -> None:
        lib = _AtomicWords.load_lib()
        self._anchor: Any = ctypes.c_char.from_buffer(buffer)  # keeps an export; see release()
        self._base: Any = ctypes.addressof(self._anchor)
        self._load = getattr(lib, "__atomic_load_8")
        self._store = getattr(lib, "__atomic_store_8")

    @classmethod
    def load_lib(cls) -> Any:
        if cls._lib is None:
            name = ctypes.util.find_library("atomic")
            if name is None:
                raise UnsupportedError(
                    f"the shared-memory transport needs libatomic on {platform.machine()} "
                    "(weakly ordered memory); install it (e.g. the libatomic1 package)"
                )
            lib = ctypes.CDLL(name)
            # getattr: written as attributes inside a class, the names would be mangled.
            load = getattr(lib, "__atomic_load_8")
            load.restype = ctypes.c_uint64
            load.argtypes = [ctypes.c_void_p, ctypes.c_int]
            store = getattr(lib, "__atomic_store_8")
            store.restype = None
            store.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int]
            cls._lib = lib
        return cls._lib

    def __getitem__(self, index: int) -> int:
        return int(self._load(self._base + 8 * index, self._SEQ_CST))

    def __setitem__(self, index: int, value: int) -> None:
        self._store(self._base + 8 * index, value, self._SEQ_CST)

    def release(self) -> None:
        # A later read or store raises TypeError (as a released memoryview raises
        # ValueError) instead of touching memory that may be unmapped.
        self._base = None
        self._anchor = None


def check_platform() -> None:
    """Refuse machines the transport cannot run on.

    Raises:
        UnsupportedError: no ``/dev/shm``, or a weakly ordered CPU without libatomic.
    """
    if not os.path.isdir(SHM_DIR):
        raise UnsupportedError(f"the shared-memory transport needs {SHM_DIR} (Linux)")
    if use_libatomic:
        _AtomicWords.load_lib()


class Segment:
    """One mapped segment: raw views plus the counter words.

    ``fd`` is the open file of a segment this process created, kept until the
    rendezvous has handed it to every peer (:meth:`close_fd`), or for as long as the
    segment lives where its window reserves memory on demand (a group's: :meth:`reserve`);
    None otherwise. A segment dropped without :meth:`release` closes it when collected.
    """

    def __init__(self, mm: mmap.mmap, fd: int | None = None) -> None:
        self.mm = mm
        self.fd = fd
        self._close = weakref.finalize(self, os.close, fd) if fd is not None else None
        self.mv = memoryview(mm)
        self.arr = np.frombuffer(mm, dtype=np.uint8)
        self.words: Any = _AtomicWords(mm) if use_libatomic else self.mv.cast("Q")

    def reserve(self, offset: int, length: int, me: int) -> None:
        """Back ``length`` bytes from ``offset`` with memory now (``posix_fallocate``), so
        that the first write there cannot fault for want of it (a SIGBUS); needs ``fd``.

        Raises:
            TransportError: the OS has no room left (shared memory is full), or no file is open.
        """
        if self.fd is None:
            raise TransportError(f"rank {me}: cannot reserve memory in a segment handed over")
        _check_room(length, 1, me)
        try:
            os.posix_fallocate(self.fd, offset, length)
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                return  # no reservation on this file system: pages come at the first touch
            raise TransportError(
                f"rank {me}: the OS has no room to reserve {length} bytes of shared memory "
                f"({exc.strerror}; free shared memory, /dev/shm, or lower PLAIT_SHM_WINDOW)"
            ) from exc

    def close_fd(self) -> None:
        """Close the file descriptor (the mapping stays)."""
        if self.fd is not None:
            self.fd = None
            if self._close is not None:
                self._close()

    def release(self) -> None:
        self.close_fd()
        self.words.release()
        self.words = None
        self.arr = None  # type: ignore[assignment]
        self.mv.release()
        # A view still referenced somewhere keeps the mapping until it dies.
        with contextlib.suppress(BufferError):
            self.mm.close()


class Fence:
    """A full memory fence on x86: an atomic read-modify-write (uncontended lock).

    ``lock`` is that lock, or None where the counters are seq_cst atomics, which need
    no separate fence: the hottest caller (a window's post) runs ``lock.acquire();
    lock.release()`` itself, at half the cost of calling the fence.
    """

    __slots__ = ("lock",)

    def __init__(self) -> None:
        self.lock = None if use_libatomic else threading.Lock()

    def __call__(self) -> None:
        lock = self.lock
        if lock is not None:
            lock.acquire()
            lock.release()


def create(
    path: str,
    nbytes: int,
    me: int,
    job: str,
    *,
    populate: bool = True,
    reserve: Sequence[tuple[int, int]] | None = None,
    share: int = 1,
) -> Segment:
    """Create, reserve and map a segment of ``nbytes`` bytes named after ``path``.

    It is an anonymous file that no name in ``/dev/shm`` refers to, ever, so
    that nothing is left there whenever the process dies (Note [lifetime and
    cleanup]): a ``memfd`` named after ``path``'s last part, or, where the OS
    has none, the file ``path`` unlinked as soon as it is open. The segment
    keeps the file open (``fd``) so that it can be handed to peers.
    ``populate``: map every page now (``MAP_POPULATE``) rather than at its first
    touch; the memory is reserved either way. ``reserve``: the ``(offset, length)``
    ranges to reserve now, where not all of it (the rest with :meth:`Segment.reserve`
    before its first write: a window that grows on demand). ``share``: how many
    processes of this host make one at once (each may take that share of the memory
    available; Note [room for a segment]).

    Raises:
        TransportError: the file ``path`` exists already, the memory to reserve is more
            than this process's share of what the host has available, or the OS refused
            it (e.g. out of shared memory: reserved now rather than a SIGBUS later).
    """
    needed = nbytes if reserve is None else sum(length for _, length in reserve)
    _check_room(needed, share, me)
    fd = _anonymous(path, me, job)
    try:
        try:
            if reserve is None:
                os.posix_fallocate(fd, 0, nbytes)
            else:
                os.ftruncate(fd, nbytes)
                for offset, length in reserve:
                    os.posix_fallocate(fd, offset, length)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                raise TransportError(
                    f"rank {me}: the OS has no room for a shared-memory segment of {nbytes} "
                    "bytes (lower slot_bytes, slots or PLAIT_SHM_WINDOW)"
                ) from exc
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes, flags=_flags(populate))
    except OSError as exc:
        os.close(fd)
        raise TransportError(f"rank {me}: cannot allocate {path}: {exc}") from exc
    except BaseException:
        os.close(fd)
        raise
    return Segment(mm, fd)


# Note [room for a segment]
#     A segment's memory is reserved with posix_fallocate so that a write never faults
#     for want of it (a SIGBUS); but on a memfd (as on tmpfs without a size limit) the
#     kernel grants whatever is asked and finds out later that it cannot back it: a
#     PLAIT_SHM_WINDOW of 99999G had the out-of-memory killer kill processes across the
#     host, the launcher among them, with no word of why. So a reservation larger than the
#     memory the host has available (MemAvailable in /proc/meminfo), or than a process's
#     share of it where the host's ranks make their segments at once, is refused with the
#     settings to lower. Where /proc/meminfo cannot be read, nothing is checked.


def _check_room(nbytes: int, share: int, me: int) -> None:
    """Raise TransportError where ``nbytes`` is more than 1/``share`` of the memory this
    host has available (Note [room for a segment])."""
    available = _available_memory()
    if available is None or nbytes <= available // max(share, 1):
        return
    of = f" (its share: {share} processes reserve at once)" if share > 1 else ""
    raise TransportError(
        f"rank {me}: a shared-memory segment of {nbytes} bytes is more than this host has "
        f"available, {available} bytes{of}; lower PLAIT_SHM_WINDOW (or slot_bytes, slots)"
    )


def _available_memory() -> int | None:
    """Bytes of memory this host has available (MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _anonymous(path: str, me: int, job: str) -> int:
    """An open file of this user's alone, mode 0600, that no name refers to (see
    :func:`create`)."""
    memfd = getattr(os, "memfd_create", None)
    if memfd is not None:
        try:
            fd: int = memfd(os.path.basename(path), os.MFD_CLOEXEC)
        except OSError as exc:
            if exc.errno not in (errno.ENOSYS, errno.EINVAL):
                raise TransportError(f"rank {me}: cannot create {path}: {exc}") from exc
        else:
            try:
                os.fchmod(fd, 0o600)  # a memfd starts as 0777: only its holders reach it
            except BaseException:
                os.close(fd)
                raise
            return fd
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        raise TransportError(
            f"rank {me}: {path} already exists: another process of job {job!r} made it "
            "first (segment names end in a random part, so this is no accident)"
        ) from None
    except OSError as exc:
        raise TransportError(f"rank {me}: cannot create {path}: {exc}") from exc
    unlink(path)
    return fd


def attach(fd: int, name: str, nbytes: int, me: int, *, populate: bool = True) -> Segment:
    """Map a peer's segment from the descriptor ``fd`` it handed over (closed here).

    The file must be what the peer announced and nothing else can be: a regular
    file of ``nbytes`` bytes, owned by our user and accessible by it alone
    (see Note [segment names]). ``populate``: as in :func:`create`.

    Raises:
        TransportError: the file is not such a segment, or cannot be mapped; the
            message names the segment.
    """
    try:
        st = os.fstat(fd)
        why = None
        if not stat.S_ISREG(st.st_mode):
            why = "is not a regular file"
        elif st.st_uid != os.geteuid():
            why = f"belongs to uid {st.st_uid}, not to this user ({os.geteuid()})"
        elif st.st_mode & 0o077:
            why = f"is accessible by other users (mode {stat.S_IMODE(st.st_mode):o})"
        elif st.st_size != nbytes or nbytes < CONTROL_BYTES:
            why = f"has {st.st_size} bytes, its rank announced {nbytes}"
        if why is not None:
            raise TransportError(f"rank {me}: refusing segment {name}: it {why}")
        mm = mmap.mmap(fd, nbytes, flags=_flags(populate))
    except OSError as exc:
        raise TransportError(f"rank {me}: cannot map segment {name}: {exc}") from exc
    finally:
        os.close(fd)
    return Segment(mm)


def _flags(populate: bool) -> int:
    """The mapping's flags: shared, and with every page mapped at once if ``populate``."""
    return mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)


def unlink(path: str) -> None:
    """Remove a segment file (gone already is fine)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
