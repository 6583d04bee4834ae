"""A shared-memory transport for ranks on one host: one ring of slots per ordered pair.

:class:`ShmTransport` moves messages between processes (or threads) of one
machine through files in ``/dev/shm``: the sender copies a message into slots
of a ring that lives in the receiver's segment, the receiver copies it out
into the posted buffer (two copies in all; large messages stream through the
ring, so both copies run at once). Progress is made by the calling thread
inside :meth:`~ShmTransport.wait_any` (and opportunistically in ``isend`` /
``irecv``); there is no background thread. Semantics are those of
:mod:`plait.transport.memory`: messages match on (peer, tag) in FIFO order, a
different check word or length fails the receive with
:class:`~plait.errors.MismatchError`, a closed or dead peer fails pending
operations with :class:`~plait.errors.PeerLostError`.

Note [segment layout]
    Every rank owns one segment, ``/dev/shm/plait-<job>-g<n>-<rank>``, holding a
    control block and the rings of the messages it *receives*, one per source
    rank. All words are little-endian unsigned 64-bit integers::

        offset 0      control block (4096 bytes)
                      0 magic   8 version   16 pid   24 size
                      32 slots  40 slot_bytes  48 closed (owner sets at close)
                      64 sleeping (own cache line; owner writes, peers read)
        4096 + k*R    ring from source s, k = s if s < rank else s - 1
                      0   head: slots published (written by the sender only)
                      64  tail: slots consumed (written by the receiver only)
                      128 + i*stride: slot i = 64-byte header + slot_bytes payload
                          header: tag (int64), check, nbytes (whole message),
                                  offset (of this chunk in the message)

    ``R`` and ``stride`` are rounded to 4096 and 64 bytes. The geometry is
    recorded in the control block and senders read it from there, so ranks
    may even pass different ``slot_bytes``/``slots``. Space is reserved with
    ``posix_fallocate`` (a full ``/dev/shm`` fails the constructor with
    :class:`~plait.errors.TransportError` rather than killing the process with
    SIGBUS later) and mapped with ``MAP_POPULATE``. We use plain ``mmap`` of
    files we open ourselves, not :mod:`multiprocessing.shared_memory`, so the
    resource tracker never sees, warns about or unlinks our segments.

Note [slot protocol]
    Ring ``s -> r`` is a single-producer single-consumer queue of chunks.
    Slot ``i`` lives at index ``i % slots``; it is free when
    ``head - tail < slots``. The sender writes the chunk header and payload
    into slot ``head % slots`` and then publishes ``head + 1``; the receiver
    reads ``head``, copies slot ``tail % slots`` out and then publishes
    ``tail + 1``. Messages are sent whole, one after another, as
    ``ceil(nbytes / slot_bytes)`` chunks (one empty chunk for zero bytes); a
    send completes when its last chunk is published, i.e. when the caller's
    buffer is no longer needed. Head and tail are publish-once counters
    written by exactly one side each, so no atomic read-modify-write is needed.

Note [memory ordering]
    Publication is "payload, then counter" on the writing side and "counter,
    then payload" on the reading side (and the reader frees a slot, "copy out,
    then tail", only after copying out). On x86-64 (TSO) stores become visible
    in program order, loads are not reordered with older loads, and stores
    are not reordered with older loads, so the hardware keeps all three
    orders. The compiler cannot reorder them either: in CPython each access is
    a separate C call behind opaque calls (``memcpy`` in numpy or memoryview;
    memoryview's ``Q`` item access, one aligned 8-byte ``mov``, hence never
    torn). The one order TSO does *not* keep is a store followed by a load of
    another address (StoreLoad), which the doorbell protocol needs; there we
    execute a ``lock``-prefixed instruction, a full fence on x86: an
    uncontended ``threading.Lock`` acquire/release (glibc's ``sem_trywait``
    and ``sem_post`` are atomic compare-and-swap / add), about 70 ns.
    On weakly ordered CPUs (ARM, POWER) none of this holds, so there every
    counter and flag access goes through libatomic's ``__atomic_load_8`` /
    ``__atomic_store_8`` with sequential consistency (via ctypes; slower, but
    correct by the C11 model: the seq_cst store releases the payload, the
    seq_cst load acquires it, and seq_cst orders StoreLoad). Without libatomic
    such machines are refused with UnsupportedError. The tests run that path
    on x86 too.

Note [doorbells and waiting]
    A waiting rank polls the counters for :attr:`ShmTransport.spin` seconds
    (default 50 µs): the first 5 µs flat out, then calling ``sched_yield()``
    between polls, so that a peer sharing its CPU can run and send what it
    waits for (measured on a busy 2-core machine: a pure 50 µs spin lost that
    race and fell asleep almost every time, ~80 µs per 8-byte hop; yielding,
    ~13 µs). Then it sleeps in ``poll(2)`` on one connected Unix stream socket
    per peer (abstract namespace, so nothing to clean up). To sleep it sets
    its ``sleeping`` flag, fences, re-checks every counter and only then
    blocks; a rank that publishes a counter fences and then rings the peer's
    doorbell (one byte, non-blocking; a full socket buffer means a wake-up is
    pending anyway) if the peer's flag is set. Both sides store-fence-load,
    so at least one sees the other's store: either the sleeper notices the new
    counter, or the publisher notices the flag and rings (Dekker's argument;
    no lost wake-ups, no sleeps as synchronisation). The same sockets detect
    failure: when a peer process dies, however abruptly, the kernel closes its
    ends and ``poll`` reports end-of-file at once; the peer's ``closed`` flag
    tells a clean close from a crash, and is also read directly by ``isend``
    and ``irecv``. A rank that keeps busy without sleeping still checks the
    sockets every 100 ms of waiting. As a backup (end-of-file never comes
    while a child that the peer forked still holds the socket), a rank that
    waits also checks every second that each peer's process still exists
    (its pid comes from ``SO_PEERCRED``, translated into our pid namespace,
    or 0 when the peer is not visible there; ``/proc/<pid>/stat`` must show
    the same start time and not a zombie; without ``/proc``, ``kill(pid, 0)``).

Note [unexpected messages]
    A message whose receive is not posted stays in the ring: it costs no
    memory, and its sender simply stalls when the ring is full. Only a rank
    that is *stalled* in ``wait_any`` (its spin found nothing to do, or its
    timeout ran out, as when polling with timeout 0) drains such messages into
    private buffers ("unexpected" messages), so two ranks that both send before
    receiving, or a posted receive stuck behind an unmatched message, never
    deadlock, while a receive posted a little late (the executor posts the
    next step's receive when the current step ends) costs no extra copy. A
    receive posted while its message is half drained copies what has arrived
    and takes the rest straight from the ring. Hence a send larger than the
    ring's free space completes only once the receiver takes part (posts the
    receive or waits on anything), as with a rendezvous protocol.

    Default geometry: 4 slots of 1 MiB per ordered pair (measured on 2 cores:
    64 KiB to 4 MiB slots and 2 to 8 slots all stream 64 MiB messages at about
    the same 4-7 GB/s; noise dominated), so a rank reserves ``(size - 1) * 4``
    MiB; the slots shrink for more than 64 peers to stay within 256 MiB.

Note [why two copies]
    Single-copy designs were weighed and measured on a 2-core x86 machine:
    ``process_vm_readv`` (the receiver copies straight out of the sender's
    buffer) moved 32 MiB at 3.5-5.8 GB/s after warm-up, about half of what a
    numpy copy does (10-11 GB/s), because the kernel pins the remote pages
    first; and reading a peer's array in place needs the array to live in
    shared memory from the start (a registered-buffer API). Two pipelined
    copies through the ring run on both cores at once (the sender fills slot
    ``i + 1`` while the receiver empties slot ``i``), which keeps up with one
    kernel copy, needs no ptrace permission, and works for any array.

Note [lifetime and cleanup]
    Rank 0 draws a random job token (or uses ``job=``) and publishes it in
    the store; each rank creates its segment and a listening socket, announces
    itself in the store, connects to every lower rank and accepts every
    higher one, maps every peer's segment, tells each peer so over the
    socket, and unlinks its own segment as soon as every peer has said so.
    From then on nothing in ``/dev/shm`` refers to the job (the mappings live
    on until the processes close or exit). Only a crash in the middle of the
    rendezvous can leave a ``plait-*`` file behind; :meth:`close` and every
    failure path of the constructor unlink it.

Note [threads]
    All state is guarded by one lock. One thread at a time *drives* progress
    (spins, then sleeps in ``poll`` with the lock released); other threads in
    ``wait_any`` wait on a condition, are notified when operations complete,
    and one of them takes over when the driver leaves. A thread that completes
    operations while the driver sleeps wakes it through a socket pair of its
    own; :meth:`~ShmTransport.close` wakes it the same way and waits for it
    to leave ``poll`` before closing the sockets it polls.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import math
import mmap
import os
import platform
import re
import secrets
import select
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from plait.errors import (
    ClosedError,
    CommError,
    MismatchError,
    PeerLostError,
    RendezvousError,
    TransportError,
    UnsupportedError,
)
from plait.rendezvous.store import Store
from plait.transport.base import Handle, may_spin, spin_seconds

__all__ = ["DEFAULT_SLOTS", "DEFAULT_SLOT_BYTES", "SHM_DIR", "ShmTransport"]

#: Where segments live (a tmpfs on Linux).
SHM_DIR = "/dev/shm"
#: Payload bytes per slot by default (see :func:`_default_slot_bytes` for many ranks).
DEFAULT_SLOT_BYTES = 1 << 20
#: Slots per ring by default.
DEFAULT_SLOTS = 4
#: Inbound ring memory a rank reserves at most when ``slot_bytes`` is not given.
_DEFAULT_INBOUND_BUDGET = 256 << 20
_MIN_DEFAULT_SLOT_BYTES = 64 << 10

_MAGIC = 0x68732D7469616C70  # b"plait-sh" little-endian
_VERSION = 1
_CONTROL_BYTES = 4096
_PAGE = 4096
_LINE = 64
_SLOT_HEADER = 64
_RING_HEADER = 128
# Word indexes (8-byte units) into the control block and a ring.
_W_MAGIC, _W_VERSION, _W_PID, _W_SIZE, _W_SLOTS, _W_SLOT_BYTES, _W_CLOSED = range(7)
_W_SLEEPING = 64 // 8
_W_HEAD, _W_TAIL = 0, 64 // 8
_HDR = struct.Struct("<QQQQ")  # tag, check, nbytes, offset
_HELLO = struct.Struct("<Q16s")  # rank, job token (to reject strangers)
_MASK64 = (1 << 64) - 1
_INT64 = (-(1 << 63), (1 << 63) - 1)
#: Copies of at least this many bytes go through numpy, which releases the GIL.
_NUMPY_COPY_MIN = 64 << 10
#: Seconds a waiting rank polls before it sleeps, and of those, how many without yielding.
_SPIN = 50e-6
_EAGER_SPIN = 5e-6
#: Seconds of waiting without sleeping after which the sockets are checked anyway.
_LIVENESS_INTERVAL = 0.1
#: Seconds between checks that peer processes still exist (a backup for end-of-file, which
#: never comes while a child the peer forked still holds its socket); also the longest poll.
_PID_INTERVAL = 1.0
#: send() flags of a doorbell, as a plain int (or-ing the enum costs microseconds per call).
_RING_FLAGS = int(socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
_JOB_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")


# -- counters: plain aligned access on x86, libatomic elsewhere (Note [memory ordering]) --------


class _AtomicWords:
    """``words[i]`` / ``words[i] = v`` as seq_cst 8-byte atomics through libatomic."""

    _SEQ_CST = 5
    _lib: Any = None

    def __init__(self, buffer: mmap.mmap) -> None:
        lib = _AtomicWords._load_lib()
        self._anchor: Any = ctypes.c_char.from_buffer(buffer)  # keeps an export; see release()
        self._base = ctypes.addressof(self._anchor)
        self._load = getattr(lib, "__atomic_load_8")
        self._store = getattr(lib, "__atomic_store_8")

    @classmethod
    def _load_lib(cls) -> Any:
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
        self._anchor = None


#: Whether counters go through libatomic (tests may set it to exercise that path).
_use_libatomic = not _X86


class _Segment:
    """One mapped segment: raw views plus the counter words."""

    def __init__(self, mm: mmap.mmap) -> None:
        self.mm = mm
        self.mv = memoryview(mm)
        self.arr = np.frombuffer(mm, dtype=np.uint8)
        self.words: Any = _AtomicWords(mm) if _use_libatomic else self.mv.cast("Q")

    def release(self) -> None:
        self.words.release()
        self.words = None
        self.arr = None  # type: ignore[assignment]
        self.mv.release()
        # A view still referenced somewhere keeps the mapping until it dies.
        with contextlib.suppress(BufferError):
            self.mm.close()


# -- operations -------------------------------------------------------------------------------


class _Op:
    """A posted send or receive; the :class:`~plait.transport.base.Handle` we return."""

    __slots__ = (
        "arr",
        "buf",
        "check",
        "done",
        "error",
        "is_send",
        "nbytes",
        "offset",
        "peer",
        "tag",
    )

    def __init__(self, peer: int, tag: int, buf: memoryview, check: int, is_send: bool) -> None:
        self.peer = peer
        self.tag = tag
        self.buf = buf
        self.nbytes = buf.nbytes
        self.arr: np.ndarray | None = (
            np.frombuffer(buf, dtype=np.uint8) if self.nbytes >= _NUMPY_COPY_MIN else None
        )
        self.check = check & _MASK64
        self.is_send = is_send
        self.offset = 0  # bytes published (send) or delivered (receive)
        self.done = False
        self.error: BaseException | None = None

    def __repr__(self) -> str:
        kind = "send to" if self.is_send else "recv from"
        state = "failed" if self.error else "done" if self.done else "pending"
        return f"<shm {kind} rank {self.peer} tag {self.tag} {self.nbytes} B {state}>"


class _Buffered:
    """An unexpected message drained out of its ring (possibly still arriving)."""

    __slots__ = ("check", "complete", "data", "nbytes", "received")

    def __init__(self, check: int, nbytes: int) -> None:
        self.check = check
        self.nbytes = nbytes
        self.data = np.empty(nbytes, dtype=np.uint8)
        self.received = 0
        self.complete = False


class _Peer:
    """Everything about one peer: its socket, its segment, both rings."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.sock: socket.socket | None = None
        self.pid = 0  # its process id, if another process visible from here
        self.pid_start: str | None = None  # and its start time, if /proc tells
        self.seg: _Segment | None = None
        self.lost: str | None = None
        # Outbound ring (in the peer's segment).
        self.out_head = 0  # our copy of the head we publish
        self.out_tail = 0  # the tail we last read
        self.out_head_word = 0  # word indexes and first slot's byte offset in its segment
        self.out_tail_word = 0
        self.out_slot0 = 0
        self.out_slots = 0
        self.out_slot_bytes = 0
        self.out_stride = 0
        self.sendq: deque[_Op] = deque()
        # Inbound ring (in our segment).
        self.in_head = 0  # the head we last read
        self.in_tail = 0  # our copy of the tail we publish
        self.in_head_word = 0
        self.in_tail_word = 0
        self.in_slot0 = 0
        self.in_slots = 0
        self.in_slot_bytes = 0
        self.in_stride = 0
        # The message being received from this peer, if any.
        self.cur_active = False
        self.cur_nbytes = 0
        self.cur_got = 0
        self.cur_op: _Op | None = None
        self.cur_entry: _Buffered | None = None


def _spin_from_env() -> float:
    """PLAIT_SHM_SPIN (microseconds a waiting rank polls before it sleeps), else the default."""
    return spin_seconds("PLAIT_SHM_SPIN", _SPIN)


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def _ring_geometry(slots: int, slot_bytes: int) -> tuple[int, int]:
    """(stride, ring_bytes) of a ring."""
    stride = _SLOT_HEADER + _round_up(slot_bytes, _LINE)
    return stride, _round_up(_RING_HEADER + slots * stride, _PAGE)


def _default_slot_bytes(size: int, slots: int) -> int:
    """1 MiB slots, shrunk so the inbound rings of one rank stay within 256 MiB."""
    peers = max(size - 1, 1)
    fit = _DEFAULT_INBOUND_BUDGET // (peers * slots)
    fit = max(_MIN_DEFAULT_SLOT_BYTES, 1 << max(fit.bit_length() - 1, 0))
    return min(DEFAULT_SLOT_BYTES, fit)


def _as_bytes(data: Any, writable: bool, what: str) -> memoryview:
    mv = data if isinstance(data, memoryview) else memoryview(data)
    if not mv.c_contiguous:
        raise ValueError(f"{what} must be a contiguous buffer")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    if writable and mv.readonly:
        raise ValueError(f"{what} must be writable")
    return mv


def _copy(
    dst_mv: memoryview,
    dst_arr: np.ndarray | None,
    d0: int,
    src_mv: memoryview,
    src_arr: np.ndarray | None,
    s0: int,
    n: int,
) -> None:
    """memcpy ``n`` bytes; numpy for large copies because it releases the GIL."""
    if n >= _NUMPY_COPY_MIN and dst_arr is not None and src_arr is not None:
        dst_arr[d0 : d0 + n] = src_arr[s0 : s0 + n]
    elif n:
        dst_mv[d0 : d0 + n] = src_mv[s0 : s0 + n]


class _Fence:
    """A full memory fence on x86: an atomic read-modify-write (uncontended lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._needed = not _use_libatomic  # seq_cst atomics need no separate fence

    def __call__(self) -> None:
        if self._needed:
            self._lock.acquire()
            self._lock.release()


# -- the transport ----------------------------------------------------------------------------


class ShmTransport:
    """Rank ``rank``'s end of a shared-memory transport among ``size`` ranks on one host.

    The constructor is a collective rendezvous: every rank must construct its
    transport with the same store (threads of one process may, too). See the
    module docstring for the protocol.

    Args:
        rank: this rank, ``0 <= rank < size``.
        size: number of ranks, all on this host.
        store: rendezvous store shared by the ranks; keys go under ``plait-shm/``.
        timeout: seconds the rendezvous may take.
        job: job id used in segment and socket names (``[A-Za-z0-9_.-]``, at
            most 64 characters); default: a random token drawn by rank 0. Two
            live jobs must not share one.
        slot_bytes: payload bytes per ring slot (default 1 MiB, less for many
            ranks so that a rank's inbound rings stay within 256 MiB).
        slots: slots per ring (default 4).
        names: how messages name the ranks (default: their numbers here);
            a transport among some ranks of a larger job passes their ranks
            in the job, so that errors name the ranks the user knows.

    Raises:
        RendezvousError: the ranks did not all arrive within ``timeout``.
        TransportError: the OS refused a segment or socket (e.g. ``/dev/shm`` full).
        UnsupportedError: no ``/dev/shm``, or a weakly ordered CPU without libatomic.

    Attributes:
        bytes_sent: payload bytes copied into peers' rings so far.
        bytes_received: payload bytes delivered into posted receives so far
            (messages set aside as unexpected count once a receive takes them).
        spin: seconds a waiting rank polls before it sleeps (default 50 µs, or
            PLAIT_SHM_SPIN microseconds; 0 sleeps at once, which saves CPU
            when messages are rare).
    """

    def __init__(
        self,
        rank: int,
        size: int,
        store: Store,
        *,
        timeout: float = 300.0,
        job: str | None = None,
        slot_bytes: int | None = None,
        slots: int | None = None,
        names: Sequence[int] | None = None,
    ) -> None:
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"invalid rank {rank} for size {size}; expected 0 <= rank < size")
        if job is not None and not _JOB_RE.fullmatch(job):
            raise ValueError(f"job must match [A-Za-z0-9_.-]{{1,64}}, got {job!r}")
        slots = DEFAULT_SLOTS if slots is None else slots
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        slot_bytes = _default_slot_bytes(size, slots) if slot_bytes is None else slot_bytes
        if slot_bytes < 1:
            raise ValueError(f"slot_bytes must be at least 1, got {slot_bytes}")
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        if names is not None and len(names) != size:
            raise ValueError(f"names must name {size} ranks, got {len(names)}")
        if not os.path.isdir(SHM_DIR):
            raise UnsupportedError(f"the shared-memory transport needs {SHM_DIR} (Linux)")
        if _use_libatomic:
            _AtomicWords._load_lib()
        self.rank = rank
        self.size = size
        self._names = list(range(size)) if names is None else [int(n) for n in names]
        self._me = self._names[rank]
        self.bytes_sent = 0
        self.bytes_received = 0
        self.spin = _spin_from_env()
        self.job = ""
        self._name = ""  # base of segment and socket names: plait-<job>-g<generation>
        self._slots = slots
        self._slot_bytes = slot_bytes
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._fence = _Fence()
        self._closed = False
        self._polling = False  # a thread sleeps in poll() without the lock
        self._waiters = 0  # threads waiting on _cond
        self._completed = 0  # bumped by every completion (wakes other threads)
        self._seg: _Segment | None = None
        self._words: Any = None  # our segment's counters, raw bytes and numpy view
        self._mv: Any = None
        self._arr: Any = None
        self._path: str | None = None  # our segment's file until unlinked
        self._peers: list[_Peer] = []
        self._by_rank: dict[int, _Peer] = {}
        self._by_fd: dict[int, _Peer] = {}
        self._posted: dict[tuple[int, int], deque[_Op]] = {}
        self._unexpected: dict[tuple[int, int], deque[_Buffered]] = {}
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._poller = select.epoll()
        self._poller.register(self._wake_r.fileno(), select.EPOLLIN)
        self._last_check = self._last_pid_check = time.monotonic()
        try:
            self._rendezvous(store, timeout, job)
        except (CommError, ValueError):
            self._teardown()
            raise
        except OSError as exc:
            self._teardown()
            kind = RendezvousError if isinstance(exc, TimeoutError) else TransportError
            raise kind(f"rank {self._me}: shared-memory rendezvous failed: {exc}") from exc
        except BaseException:
            self._teardown()
            raise

    # -- rendezvous -------------------------------------------------------------------------
    def _rendezvous(self, store: Store, timeout: float, job: str | None) -> None:
        deadline = time.monotonic() + timeout
        rank, size = self.rank, self.size

        def left() -> float:
            return max(deadline - time.monotonic(), 0.001)

        # One namespace per transport built on this store (every rank counts the same way).
        generation = store.add(f"plait-shm/generation/{rank}", 1)
        prefix = f"plait-shm/{generation}/"
        if rank == 0:
            token = job if job is not None else secrets.token_hex(8)
            store.set(prefix + "job", token.encode())
        else:
            token = store.get(prefix + "job", left()).decode()
            if job is not None and job != token:
                raise RendezvousError(
                    f"rank {self._me}: job {job!r} differs from rank {self._names[0]}'s {token!r}"
                )
        self.job = token
        # Several transports of one job (one per group) must not collide either.
        self._name = f"plait-{token}-g{generation}"
        self._create_segment()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(self._address(rank))
            listener.listen(size)
            store.set(prefix + f"ready/{rank}", b"1")
            store.wait([prefix + f"ready/{r}" for r in range(size)], left())
            self._peers = [_Peer(r) for r in range(size) if r != rank]
            self._by_rank = {p.rank: p for p in self._peers}
            hello_token = token.encode()[:16].ljust(16, b"\0")
            for p in self._peers:
                if p.rank < rank:
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    p.sock = sock
                    sock.settimeout(left())
                    sock.connect(self._address(p.rank))
                    p.pid = self._peer_pid(sock)
                    p.pid_start = _process_start(p.pid) if p.pid else None
                    sock.sendall(_HELLO.pack(rank, hello_token))
            missing = {p.rank for p in self._peers if p.rank > rank}
            while missing:
                listener.settimeout(left())
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    raise RendezvousError(
                        f"rank {self._me}: ranks {sorted(self._names[r] for r in missing)} did "
                        "not connect to the "
                        f"shared-memory transport within {timeout} s"
                    ) from None
                conn.settimeout(left())
                peer_rank = self._accept_hello(conn, hello_token, missing)
                if peer_rank is None:
                    conn.close()
                    continue
                missing.discard(peer_rank)
                self._by_rank[peer_rank].sock = conn
                peer = self._by_rank[peer_rank]
                peer.pid = self._peer_pid(conn)
                peer.pid_start = _process_start(peer.pid) if peer.pid else None
        finally:
            listener.close()
        for p in self._peers:
            self._attach(p)
            assert p.sock is not None
            p.sock.sendall(b"A")  # "I have mapped your segment"
        for p in self._peers:
            assert p.sock is not None
            p.sock.settimeout(left())
            if _recv_exact(p.sock, 1) != b"A":
                raise RendezvousError(
                    f"rank {self._me}: rank {self._names[p.rank]} broke off the rendezvous"
                )
        self._unlink()
        for p in self._peers:
            assert p.sock is not None
            p.sock.setblocking(False)
            self._by_fd[p.sock.fileno()] = p
            self._poller.register(p.sock.fileno(), select.EPOLLIN)

    def _address(self, rank: int) -> str:
        return f"\0{self._name}-{rank}"

    @staticmethod
    def _peer_pid(sock: socket.socket) -> int:
        """The peer's pid as seen from here: 0 when it is this process or not visible."""
        pid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
        return 0 if pid == os.getpid() else int(pid)

    def _accept_hello(self, conn: socket.socket, token: bytes, missing: set[int]) -> int | None:
        """The rank of a new connection, or None for a stranger."""
        uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
        if uid != os.getuid():
            return None
        peer_rank, peer_token = _HELLO.unpack(_recv_exact(conn, _HELLO.size))
        if peer_token != token or peer_rank not in missing:
            return None
        return int(peer_rank)

    def _create_segment(self) -> None:
        slots, slot_bytes = self._slots, self._slot_bytes
        _, ring_bytes = _ring_geometry(slots, slot_bytes)
        nbytes = _CONTROL_BYTES + (self.size - 1) * ring_bytes
        path = os.path.join(SHM_DIR, f"{self._name}-{self.rank}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            raise TransportError(
                f"rank {self._me}: {path} already exists: another job uses job id "
                f"{self.job!r}, or a crashed one left it behind (then delete it)"
            ) from None
        except OSError as exc:
            raise TransportError(f"rank {self._me}: cannot create {path}: {exc}") from exc
        self._path = path
        try:
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as exc:
                if exc.errno == errno.ENOSPC:
                    free = os.statvfs(SHM_DIR)
                    raise TransportError(
                        f"rank {self._me}: {SHM_DIR} has {free.f_bavail * free.f_frsize} bytes "
                        f"free, the segment needs {nbytes} (lower slot_bytes or slots)"
                    ) from exc
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                os.ftruncate(fd, nbytes)
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        except OSError as exc:
            raise TransportError(f"rank {self._me}: cannot allocate {path}: {exc}") from exc
        finally:
            os.close(fd)
        seg = self._seg = _Segment(mm)
        self._words, self._mv, self._arr = seg.words, seg.mv, seg.arr
        w = seg.words
        w[_W_VERSION] = _VERSION
        w[_W_PID] = os.getpid()
        w[_W_SIZE] = self.size
        w[_W_SLOTS] = slots
        w[_W_SLOT_BYTES] = slot_bytes
        w[_W_MAGIC] = _MAGIC
        stride, ring_bytes = _ring_geometry(slots, slot_bytes)
        self._in_geometry = (slots, slot_bytes, stride, ring_bytes)

    def _attach(self, p: _Peer) -> None:
        path = os.path.join(SHM_DIR, f"{self._name}-{p.rank}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise TransportError(f"rank {self._me}: cannot open {path}: {exc}") from exc
        try:
            nbytes = os.fstat(fd).st_size
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        except OSError as exc:
            raise TransportError(f"rank {self._me}: cannot map {path}: {exc}") from exc
        finally:
            os.close(fd)
        seg = p.seg = _Segment(mm)
        w = seg.words
        if w[_W_MAGIC] != _MAGIC or w[_W_VERSION] != _VERSION or w[_W_SIZE] != self.size:
            raise RendezvousError(
                f"rank {self._me}: {path} is not a plait segment of this job "
                f"(size {w[_W_SIZE]}, expected {self.size})"
            )
        slots, slot_bytes = w[_W_SLOTS], w[_W_SLOT_BYTES]
        stride, ring_bytes = _ring_geometry(slots, slot_bytes)
        k = self.rank if self.rank < p.rank else self.rank - 1
        ring = _CONTROL_BYTES + k * ring_bytes
        p.out_head_word, p.out_tail_word = ring // 8 + _W_HEAD, ring // 8 + _W_TAIL
        p.out_slot0 = ring + _RING_HEADER
        p.out_slots, p.out_slot_bytes, p.out_stride = slots, slot_bytes, stride
        slots, slot_bytes, stride, ring_bytes = self._in_geometry
        k = p.rank if p.rank < self.rank else p.rank - 1
        ring = _CONTROL_BYTES + k * ring_bytes
        p.in_head_word, p.in_tail_word = ring // 8 + _W_HEAD, ring // 8 + _W_TAIL
        p.in_slot0 = ring + _RING_HEADER
        p.in_slots, p.in_slot_bytes, p.in_stride = slots, slot_bytes, stride

    def _unlink(self) -> None:
        if self._path is not None:
            path, self._path = self._path, None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    # -- contract ---------------------------------------------------------------------------
    def isend(self, peer: int, tag: int, data: memoryview, check: int) -> _Op:
        """Start sending ``data`` to ``peer``; see :class:`~plait.transport.base.Transport`."""
        self._check_peer(peer)
        if not _INT64[0] <= tag <= _INT64[1]:
            raise ValueError(f"tag {tag} does not fit in a signed 64-bit integer")
        op = _Op(peer, tag, _as_bytes(data, False, "data"), check, True)
        with self._lock:
            if self._closed:
                self._fail(op, self._closed_error())
            elif peer == self.rank:
                self._send_self(op)
            else:
                p = self._by_rank[peer]
                self._check_closed(p)
                if p.lost is not None:
                    self._fail(op, PeerLostError(p.lost))
                else:
                    p.sendq.append(op)
                    self._push(p)
            self._after_progress()
        return op

    def irecv(self, peer: int, tag: int, into: memoryview, check: int) -> _Op:
        """Start receiving ``len(into)`` bytes from ``peer``; see the Transport contract."""
        self._check_peer(peer)
        op = _Op(peer, tag, _as_bytes(into, True, "into"), check, False)
        key = (peer, tag)
        with self._lock:
            if peer != self.rank and not self._closed:
                self._check_closed(self._by_rank[peer])
            queue = self._unexpected.get(key)
            if self._closed:
                self._fail(op, self._closed_error())
            elif queue:
                entry = queue.popleft()
                if not queue:
                    del self._unexpected[key]
                self._match_buffered(op, entry)
            elif peer == self.rank:
                self._posted.setdefault(key, deque()).append(op)
            else:
                p = self._by_rank[peer]
                if p.lost is not None:
                    self._fail(op, PeerLostError(p.lost))
                else:
                    self._posted.setdefault(key, deque()).append(op)
                    self._pull(p, False)
            self._after_progress()
        return op

    def wait_any(self, handles: Sequence[Handle], timeout: float | None) -> bool:
        """Make progress until one of ``handles`` is done; False if ``timeout`` passes first."""
        for h in handles:
            if h.done:
                return True
        if not handles:
            return False
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            try:
                return self._wait(handles, deadline)
            finally:
                if self._waiters:
                    self._cond.notify_all()  # completions, or someone must take over driving

    def cancel(self, handle: Handle) -> None:
        """Withdraw ``handle``; it never touches its buffer after this returns.

        A send whose first chunks are already in the ring is finished from a
        private copy of its data, so the receiver still gets a whole message.
        """
        if not isinstance(handle, _Op):
            raise TypeError(f"rank {self._me}: {handle!r} is not a shared-memory transport handle")
        with self._lock:
            if handle.done:
                return
            handle.done = True
            if self._closed:
                return
            if handle.is_send:
                if handle.peer == self.rank:
                    return
                p = self._by_rank[handle.peer]
                if handle in p.sendq:
                    if handle.offset == 0:
                        p.sendq.remove(handle)
                    else:  # partly published: must finish, from our own copy
                        clone = _Op(handle.peer, handle.tag, memoryview(bytes(handle.buf)), 0, True)
                        clone.check, clone.offset = handle.check, handle.offset
                        p.sendq[p.sendq.index(handle)] = clone
                return
            queue = self._posted.get((handle.peer, handle.tag))
            if queue is not None and handle in queue:
                queue.remove(handle)
                if not queue:
                    del self._posted[(handle.peer, handle.tag)]
                return
            ring = self._by_rank.get(handle.peer)
            if ring is not None and ring.cur_op is handle:
                ring.cur_op = None  # discard the rest of this message

    def close(self) -> None:
        """Fail pending operations, tell peers (PeerLostError there), release everything.

        Idempotent; safe to call while another thread waits in :meth:`wait_any`.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            err = self._closed_error()
            for p in self._peers:
                for op in p.sendq:
                    self._fail(op, err)
                p.sendq.clear()
                if p.cur_op is not None:
                    self._fail(p.cur_op, err)
                    p.cur_op = None
            for queue in self._posted.values():
                for op in queue:
                    self._fail(op, err)
            self._posted.clear()
            self._unexpected.clear()
            if self._seg is not None:
                self._seg.words[_W_CLOSED] = 1
                self._fence()
            if self._polling:  # let the driver leave poll() before its fds go away
                self._wake_self()
                self._waiters += 1
                try:
                    while self._polling:
                        self._cond.wait()
                finally:
                    self._waiters -= 1
            self._teardown()
            self._cond.notify_all()

    def __enter__(self) -> ShmTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<ShmTransport rank {self.rank} of {self.size}, job {self.job!r}, {state}>"

    # -- driven from outside (plait.transport.base.Drivable) -------------------------------------
    def poll(self) -> bool:
        """One pass over the rings (and, now and then, the liveness checks); never blocks."""
        with self._lock:
            if self._closed or self._polling:
                return False
            moved = self._progress(False)
            now = time.monotonic()
            if not moved and now - self._last_check >= _LIVENESS_INTERVAL:
                self._handle_events(self._poller.poll(0))
                self._check_pids(now)
            completed = self._completed > 0
            self._after_progress()
            return moved or completed

    def sleep_fd(self) -> int:
        """The epoll descriptor of the doorbells, peers' sockets and the wake-up pipe."""
        return self._poller.fileno()

    def begin_sleep(self) -> float:
        """Raise the sleeping flag (peers ring the doorbell) unless something can move now.

        A stalled driver drains unmatched messages here, as :meth:`wait_any`
        does (Note [unexpected messages]).
        """
        with self._lock:
            if self._closed or self._polling or self._seg is None:
                return 0.0
            words = self._seg.words
            words[_W_SLEEPING] = 1
            self._fence()
            # Re-check after raising the flag: a publisher that missed it published before it.
            if self._progress(True) or self._completed:
                words[_W_SLEEPING] = 0
                self._after_progress()
                return 0.0
            self._polling = True  # other threads now write the wake-up pipe
            if any(p.pid and p.lost is None for p in self._peers):
                return _PID_INTERVAL
            return math.inf

    def end_sleep(self) -> None:
        """Lower the sleeping flag and handle whatever woke the driver."""
        with self._lock:
            self._polling = False
            if self._waiters:
                self._cond.notify_all()  # close() may wait for the driver to leave
            if self._closed or self._seg is None:
                return
            self._seg.words[_W_SLEEPING] = 0
            self._handle_events(self._poller.poll(0))
            self._check_pids(time.monotonic())

    # -- waiting ----------------------------------------------------------------------------
    def _wait(self, handles: Sequence[Handle], deadline: float | None) -> bool:
        spun = False
        while True:
            if any(h.done for h in handles):
                return True
            if self._closed:
                return any(h.done for h in handles)
            if self._polling:  # another thread drives; it notifies us on completions
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._waiters += 1
                try:
                    self._cond.wait(left)
                finally:
                    self._waiters -= 1
                continue
            moved = self._progress(False)
            if moved:
                self._after_progress()
                spun = False
            now = time.monotonic()
            if deadline is not None and now >= deadline:  # even while busy with other traffic
                # A caller polling with timeout 0 is stalled too: drain, so peers never starve.
                if not moved and self._progress(True):
                    self._after_progress()
                return any(h.done for h in handles)
            if moved:
                continue
            if now - self._last_check >= _LIVENESS_INTERVAL:
                self._handle_events(self._poller.poll(0))
                self._check_pids(now)
                continue
            if not spun:
                spun = True
                if may_spin() and self._spin(deadline):
                    continue
            if self._progress(True):  # stalled: drain unexpected messages (Note [unexpected])
                self._after_progress()
                continue
            self._sleep(None if deadline is None else deadline - time.monotonic())

    def _spin(self, deadline: float | None) -> bool:
        """Poll the rings for up to ``self.spin`` seconds; whether anything moved."""
        start = time.monotonic()
        until = start + self.spin
        if deadline is not None:
            until = min(until, deadline)
        eager = start + _EAGER_SPIN
        while True:
            if self._progress(False):
                self._after_progress()
                return True
            now = time.monotonic()
            if now >= until:
                return False
            if now >= eager:
                # Let a peer that shares our CPU run: without this, a spinning rank
                # on a busy machine delays the very message it waits for.
                os.sched_yield()

    def _sleep(self, timeout: float | None) -> None:
        """Block in poll() until a doorbell, a peer's end-of-file or ``timeout``."""
        assert self._seg is not None
        words = self._seg.words
        words[_W_SLEEPING] = 1
        self._fence()
        # Re-check after raising the flag: a publisher that missed the flag published before it.
        if self._progress(True):
            words[_W_SLEEPING] = 0
            self._after_progress()
            return
        if any(p.pid and p.lost is None for p in self._peers):
            timeout = _PID_INTERVAL if timeout is None else min(timeout, _PID_INTERVAL)
        self._polling = True
        self._lock.release()
        try:
            events = self._poller.poll(-1 if timeout is None else max(timeout, 0.0))
        finally:
            self._lock.acquire()
            self._polling = False
            if self._waiters:
                self._cond.notify_all()
        if self._closed:
            return
        words[_W_SLEEPING] = 0
        self._handle_events(events)
        self._check_pids(time.monotonic())

    def _check_pids(self, now: float) -> None:
        """Every _PID_INTERVAL: lose peers whose process is gone (see _PID_INTERVAL)."""
        if now - self._last_pid_check < _PID_INTERVAL:
            return
        self._last_pid_check = now
        for p in self._peers:
            if p.pid and p.lost is None and not _alive(p.pid, p.pid_start):
                self._lose(p)
        self._after_progress()

    def _handle_events(self, events: list[tuple[int, int]]) -> None:
        self._last_check = time.monotonic()
        for fd, _ in events:
            if fd == self._wake_r.fileno():
                _drain(self._wake_r)
                continue
            p = self._by_fd.get(fd)
            if p is None or p.sock is None:
                continue
            if not _drain(p.sock):
                self._lose(p)
        self._after_progress()

    def _wake_self(self) -> None:
        with contextlib.suppress(OSError):  # full: a wake-up is pending anyway
            self._wake_w.send(b"\0")

    def _after_progress(self) -> None:
        """Tell other threads about completions (called with the lock held)."""
        if self._completed:
            self._completed = 0
            if self._waiters:
                self._cond.notify_all()
            if self._polling:
                self._wake_self()

    # -- progress (lock held) -----------------------------------------------------------------
    def _progress(self, stalled: bool) -> bool:
        """One pass over every ring; whether any chunk moved.

        ``stalled``: the caller has nothing else to do, so unmatched messages
        are drained into private buffers (Note [unexpected messages]).
        """
        moved = False
        for p in self._peers:
            if p.sendq and self._push(p):
                moved = True
            if self._pull(p, stalled):
                moved = True
        return moved

    def _push(self, p: _Peer) -> bool:
        """Copy queued sends to ``p`` into free slots; whether any chunk was published."""
        queue = p.sendq
        if not queue or p.lost is not None or p.seg is None:
            return False
        seg = p.seg
        words, mv, arr = seg.words, seg.mv, seg.arr
        slots, slot_bytes, stride = p.out_slots, p.out_slot_bytes, p.out_stride
        head, tail = p.out_head, p.out_tail
        moved = False
        while queue:
            if head - tail >= slots:
                tail = words[p.out_tail_word]
                if head - tail >= slots:
                    break
            op = queue[0]
            off = p.out_slot0 + (head % slots) * stride
            offset = op.offset
            n = min(slot_bytes, op.nbytes - offset)
            _HDR.pack_into(mv, off, op.tag, op.check, op.nbytes, offset)
            _copy(mv, arr, off + _SLOT_HEADER, op.buf, op.arr, offset, n)
            op.offset = offset + n
            head += 1
            words[p.out_head_word] = head  # publish after the payload (Note [memory ordering])
            self.bytes_sent += n
            moved = True
            if offset + n >= op.nbytes:
                queue.popleft()
                if not op.done:  # else cancelled
                    self._complete(op)
        p.out_head, p.out_tail = head, tail
        if moved:
            self._fence()
            if words[_W_SLEEPING]:
                self._ring(p)
        return moved

    def _pull(self, p: _Peer, stalled: bool) -> bool:
        """Copy published chunks from ``p`` out of our ring; whether any slot was freed."""
        words = self._words
        head, tail = p.in_head, p.in_tail
        if tail == head:
            head = p.in_head = words[p.in_head_word]
            if tail == head:
                return False  # the common case while polling: nothing new
        mv, arr = self._mv, self._arr
        slots, slot_bytes, stride = p.in_slots, p.in_slot_bytes, p.in_stride
        moved = False
        while True:
            if tail == head:
                head = words[p.in_head_word]
                if tail == head:
                    break
            off = p.in_slot0 + (tail % slots) * stride
            if not p.cur_active:
                tag, check, nbytes, _ = _HDR.unpack_from(mv, off)
                key = (p.rank, tag)
                queue = self._posted.get(key)
                if queue:
                    op: _Op | None = queue.popleft()
                    if not queue:
                        del self._posted[key]
                    err = self._mismatch(op, check, nbytes)  # type: ignore[arg-type]
                    if err is not None:
                        self._fail(op, err)  # type: ignore[arg-type]
                        op = None  # the message is consumed and dropped
                    p.cur_op, p.cur_entry = op, None
                elif stalled or p.lost is not None:
                    entry = _Buffered(check, nbytes)
                    self._unexpected.setdefault(key, deque()).append(entry)
                    p.cur_op, p.cur_entry = None, entry
                else:
                    break  # leave it in the ring until its receive is posted
                p.cur_active, p.cur_nbytes, p.cur_got = True, nbytes, 0
            got = p.cur_got
            n = min(slot_bytes, p.cur_nbytes - got)
            op = p.cur_op
            if op is not None:
                _copy(op.buf, op.arr, got, mv, arr, off + _SLOT_HEADER, n)
                self.bytes_received += n
            elif p.cur_entry is not None:
                data = p.cur_entry.data
                data[got : got + n] = arr[off + _SLOT_HEADER : off + _SLOT_HEADER + n]
                p.cur_entry.received = got + n
            got += n
            p.cur_got = got
            tail += 1
            words[p.in_tail_word] = tail  # free the slot only after copying out
            moved = True
            if got >= p.cur_nbytes:
                p.cur_active = False
                if op is not None:
                    self._complete(op)
                    p.cur_op = None
                elif p.cur_entry is not None:
                    p.cur_entry.complete = True
                    p.cur_entry = None
        p.in_head, p.in_tail = head, tail
        if moved and p.seg is not None and p.lost is None:
            self._fence()
            if p.seg.words[_W_SLEEPING]:
                self._ring(p)
        return moved

    def _ring(self, p: _Peer) -> None:
        """Ring ``p``'s doorbell (it is asleep in poll)."""
        if p.sock is None:
            return
        # BlockingIOError: its buffer is full of unread wake-ups already; other
        # OSErrors: it is gone, and its end-of-file reaches our poll().
        with contextlib.suppress(OSError):
            p.sock.send(b"\0", _RING_FLAGS)

    # -- matching and completion (lock held) -----------------------------------------------------
    def _mismatch(self, op: _Op, check: int, nbytes: int) -> MismatchError | None:
        if check != op.check:
            return MismatchError(
                f"rank {self._me} received from rank {self._names[op.peer]} a message of a "
                "different call "
                "(the two ranks disagree on the collective, count, dtype, op, root, algorithm or "
                "segment size; or, for a send and its recv, on the dtype)"
            )
        if nbytes != op.nbytes:
            return MismatchError(
                f"rank {self._names[op.peer]} sent {nbytes} bytes but rank {self._me} expected "
                f"{op.nbytes} bytes"
            )
        return None

    def _match_buffered(self, op: _Op, entry: _Buffered) -> None:
        """Give ``entry`` (the oldest unexpected message for ``op``'s key) to ``op``."""
        p = self._by_rank.get(op.peer)
        ring = p if p is not None and p.cur_entry is entry else None  # still arriving
        err = self._mismatch(op, entry.check, entry.nbytes)
        if err is not None:
            self._fail(op, err)
            if ring is not None:
                ring.cur_entry = None  # the rest is dropped
            return
        _copy(op.buf, op.arr, 0, entry.data.data, entry.data, 0, entry.received)
        self.bytes_received += entry.received
        if entry.complete:
            self._complete(op)
        elif ring is not None:  # the rest goes straight from the ring into op's buffer
            ring.cur_entry, ring.cur_op = None, op

    def _send_self(self, op: _Op) -> None:
        key = (self.rank, op.tag)
        queue = self._posted.get(key)
        if queue:
            recv = queue.popleft()
            if not queue:
                del self._posted[key]
            err = self._mismatch(recv, op.check, op.nbytes)
            if err is not None:
                self._fail(recv, err)
            else:
                _copy(recv.buf, recv.arr, 0, op.buf, op.arr, 0, op.nbytes)
                self.bytes_received += op.nbytes
                self._complete(recv)
        else:
            entry = _Buffered(op.check, op.nbytes)
            entry.data[:] = np.frombuffer(op.buf, dtype=np.uint8)
            entry.received, entry.complete = op.nbytes, True
            self._unexpected.setdefault(key, deque()).append(entry)
        self.bytes_sent += op.nbytes
        self._complete(op)

    def _complete(self, op: _Op) -> None:
        op.done = True
        self._completed += 1

    def _fail(self, op: _Op, err: BaseException) -> None:
        if not op.done:
            op.error = err
            op.done = True
            self._completed += 1

    def _check_closed(self, p: _Peer) -> None:
        """Notice at once that ``p`` has closed (its flag), before its end-of-file arrives."""
        if p.lost is None and p.seg is not None and p.seg.words[_W_CLOSED]:
            self._lose(p)

    def _lose(self, p: _Peer) -> None:
        """``p`` closed or died: keep its whole messages, fail everything else involving it."""
        if p.lost is not None:
            return
        closed = p.seg is not None and p.seg.words[_W_CLOSED] == 1
        p.lost = (
            f"rank {self._names[p.rank]} has closed its transport"
            if closed
            else f"rank {self._names[p.rank]} was lost: its process exited or was killed"
        )
        err = PeerLostError(p.lost)
        if p.sock is not None:
            self._poller.unregister(p.sock.fileno())
            del self._by_fd[p.sock.fileno()]
            p.sock.close()
            p.sock = None
        self._pull(p, True)  # whole messages it published stay receivable
        if p.cur_active:  # it died mid-message
            if p.cur_op is not None:
                self._fail(p.cur_op, err)
            elif p.cur_entry is not None:  # a partial unexpected message is worthless
                for key, entries in list(self._unexpected.items()):
                    if p.cur_entry in entries:
                        entries.remove(p.cur_entry)
                        if not entries:
                            del self._unexpected[key]
            p.cur_active, p.cur_op, p.cur_entry = False, None, None
        for op in p.sendq:
            self._fail(op, err)
        p.sendq.clear()
        for (src, _), queue in list(self._posted.items()):
            if src == p.rank:
                for op in queue:
                    self._fail(op, err)
                del self._posted[(src, _)]

    # -- helpers ------------------------------------------------------------------------------
    def _check_peer(self, peer: int) -> None:
        if not 0 <= peer < self.size:
            raise ValueError(f"rank {self._me}: peer {peer} is not in 0..{self.size - 1}")

    def _closed_error(self) -> ClosedError:
        return ClosedError(f"rank {self._me}: the shared-memory transport is closed")

    def _teardown(self) -> None:
        """Release sockets, mappings and our segment file (idempotent)."""
        self._unlink()
        for p in self._peers:
            if p.sock is not None:
                p.sock.close()
                p.sock = None
            if p.seg is not None:
                p.seg.release()
                p.seg = None
        self._by_fd.clear()
        if self._seg is not None:
            self._words = self._mv = self._arr = None
            self._seg.release()
            self._seg = None
        self._wake_r.close()
        self._wake_w.close()
        self._poller.close()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        try:
            chunk = sock.recv(n - len(data))
        except TimeoutError:
            raise RendezvousError("a peer was silent during the shared-memory rendezvous") from None
        if not chunk:
            raise RendezvousError("a peer hung up during the shared-memory rendezvous")
        data += chunk
    return data


def _process_start(pid: int) -> str | None:
    """``pid``'s start time (tells it from a later process reusing the pid), or None.

    A zombie (dead, not yet reaped by its parent) counts as gone: None.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()  # after "pid (comm) ": state ppid ...
    if not fields or fields[0] in (b"Z", b"X"):
        return None
    return fields[19].decode() if len(fields) > 19 else ""


def _alive(pid: int, start: str | None) -> bool:
    """Whether process ``pid`` (started at ``start``, if known) still runs."""
    if start is not None:
        return _process_start(pid) == start
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _drain(sock: socket.socket) -> bool:
    """Read pending doorbell bytes; False if the peer's end is closed."""
    try:
        while True:
            if not sock.recv(4096):
                return False
    except BlockingIOError:
        return True
    except OSError:
        return False
