"""The shared-memory rendezvous: job token, segments, doorbell sockets, unlinking.

Steps, names and cleanup rules: ``docs/transport.md`` (Note [segment names], Note
[lifetime and cleanup]). :func:`join` meets the ranks of a transport through the
store; :func:`join_window` runs the same rendezvous for the window of a split's
group, announcing through the group's messages instead (Note [split windows] in
:mod:`plait.transport.shm.window`).
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import struct
import time
from collections.abc import Callable, Sequence

from plait.errors import CommError, PeerLostError, RendezvousError, TransportError
from plait.rendezvous.store import Store
from plait.transport.shm import segment
from plait.transport.shm.doorbell import peer_credentials, peer_pid, process_start
from plait.transport.shm.ring import RingEnd, segment_bytes
from plait.transport.shm.segment import (
    CONTROL_BYTES,
    MAGIC,
    SHM_DIR,
    VERSION,
    W_MAGIC,
    W_PID,
    W_SIZE,
    W_SLOT_BYTES,
    W_SLOTS,
    W_VERSION,
    W_WINDOW,
    W_WINDOW_BYTES,
    Segment,
)
from plait.transport.shm.window import arena_bytes, check_arena

__all__ = ["JOB_RE", "Joined", "Wire", "join", "join_window"]

_HELLO = struct.Struct("<Q16s")  # rank, job token (to reject strangers)
#: Random bytes at the end of every segment and socket name (Note [segment names]).
_TAIL_BYTES = 8
_TAIL_RE = re.compile(f"[0-9a-f]{{{2 * _TAIL_BYTES}}}")
JOB_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
#: Seconds between looks at whether the ranks waited for still run (where the caller can tell).
_ALIVE_SECONDS = 1.0


class Wire:
    """What the rendezvous set up with one peer: its socket, process, segment and both rings."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.name = ""  # its segment's and socket's name (announced in the store)
        self.nbytes = 0  # its segment's size (announced in the store)
        self.sock: socket.socket | None = None
        self.pid = 0  # its process id, if another process visible from here
        self.pid_start: str | None = None  # and its start time, if /proc tells
        self.seg: Segment | None = None
        self.out: RingEnd | None = None  # our ring in its segment
        self.inbound: RingEnd | None = None  # its ring in ours
        self.window = (0, 0)  # its arena: byte offset in its segment, bytes per half

    def release(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.seg is not None:
            self.seg.release()
            self.seg = None


class Joined:
    """The result of :func:`join`: the job, this rank's segment and a :class:`Wire` per peer.

    ``window`` is this rank's arena: (byte offset in its segment, bytes per half),
    (0, 0) without one.
    """

    def __init__(self, job: str, seg: Segment, wires: list[Wire], window: tuple[int, int]) -> None:
        self.job = job
        self.seg = seg
        self.wires = wires
        self.window = window


def join(
    rank: int,
    size: int,
    store: Store,
    *,
    timeout: float,
    job: str | None,
    slots: int,
    slot_bytes: int,
    names: Sequence[int],
    window: int = 0,
) -> Joined:
    """Meet the other ranks of this host through ``store``; see Note [lifetime and cleanup].

    ``window``: bytes of each half of this rank's window (0: no arena in the segment).
    On failure everything made so far is released and this rank's segment unlinked.

    Raises:
        RendezvousError: the ranks did not all arrive within ``timeout``, or disagree.
        TransportError: the OS refused a segment or socket.
    """
    r = _Join(rank, size, names)
    joined = r.guarded(lambda: r.run(store, timeout, job, slots, slot_bytes, window))
    assert joined is not None
    return joined


def join_window(
    rank: int,
    size: int,
    *,
    names: Sequence[int],
    job: str,
    window: int,
    announce: Callable[[bytes], list[bytes]],
    timeout: float,
    alive: Callable[[int], bool] | None = None,
) -> Joined | None:
    """Segments holding only a window, for a group of ranks that met already (a split's).

    The same rendezvous as :func:`join` (Note [lifetime and cleanup]): each rank
    creates a segment of a control block and an arena of ``window`` bytes per
    half and unlinks it at once, listens on a socket, and the ranks hand their
    segments' files to each other over connected sockets, which are closed
    again once every rank has mapped every segment (waiting goes through the
    transport the group already has). Only the store is replaced:
    ``announce(mine)`` must return every rank's announcement in rank order
    (an allgather over the group's messages). ``job`` starts the names, so
    that ``plait run`` and the leak checks find them as the job's.

    Returns None, on every rank alike, when some rank could not create its
    segment (``/dev/shm`` full): the group then has no window. ``alive(r)``
    tells whether rank ``r`` still runs (checked every second while waiting
    for it to connect).

    Raises:
        RendezvousError, TransportError: as :func:`join` (and whatever
            ``announce`` raises).
        PeerLostError: a rank died before it connected.
    """
    r = _Join(rank, size, names)
    deadline = time.monotonic() + timeout
    return r.guarded(
        lambda: r.meet(
            job,
            f"plait-{job}-split",
            0,
            0,
            window,
            announce,
            deadline,
            timeout,
            optional=True,
            alive=alive,
        )
    )


class _Join:
    def __init__(self, rank: int, size: int, names: Sequence[int]) -> None:
        self.rank = rank
        self.size = size
        self.names = names
        self.me = names[rank]
        self.name = ""  # start of segment and socket names: plait-<job>-g<generation>
        self.path: str | None = None  # our segment's file until unlinked
        self.seg: Segment | None = None
        self.wires: list[Wire] = []

    def guarded(self, body: Callable[[], Joined | None]) -> Joined | None:
        """``body()``; on failure release what it made; in any case unlink our segment's file."""
        try:
            return body()
        except (CommError, ValueError):
            self.release()
            raise
        except OSError as exc:
            self.release()
            kind = RendezvousError if isinstance(exc, TimeoutError) else TransportError
            raise kind(f"rank {self.me}: shared-memory rendezvous failed: {exc}") from exc
        except BaseException:
            self.release()
            raise
        finally:
            self.unlink()

    def run(
        self,
        store: Store,
        timeout: float,
        job: str | None,
        slots: int,
        slot_bytes: int,
        window: int,
    ) -> Joined:
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
                    f"rank {self.me}: job {job!r} differs from rank {self.names[0]}'s {token!r}"
                )

        def announce(mine: bytes) -> list[bytes]:
            store.set(prefix + f"ready/{rank}", mine)
            store.wait([prefix + f"ready/{r}" for r in range(size)], left())
            return [store.get(prefix + f"ready/{r}") for r in range(size)]

        # Several transports of one job (one per group) must not collide either, and
        # no other process may squat a name: see Note [segment names].
        joined = self.meet(
            token,
            f"plait-{token}-g{generation}",
            slots,
            slot_bytes,
            window,
            announce,
            deadline,
            timeout,
        )
        assert joined is not None
        return joined

    def meet(
        self,
        token: str,
        name: str,
        slots: int,
        slot_bytes: int,
        window: int,
        announce: Callable[[bytes], list[bytes]],
        deadline: float,
        timeout: float,
        *,
        optional: bool = False,
        alive: Callable[[int], bool] | None = None,
    ) -> Joined | None:
        """Create, announce, connect, hand over and map: the rendezvous after the namespace.

        ``slots`` 0: the segment holds no rings, only the control block and the
        window. ``optional``: a segment this rank cannot create is announced as
        none (an empty announcement) instead of raising, and if any rank
        announces none, every rank returns None. ``alive(r)``: whether rank
        ``r`` still runs, for ranks that already share a transport: one that
        dies before it connects fails the wait for it (PeerLostError) instead
        of letting it run to the deadline.
        """
        rank, size = self.rank, self.size

        def left() -> float:
            return max(deadline - time.monotonic(), 0.001)

        self.name = name
        tail = secrets.token_hex(_TAIL_BYTES)
        own = f"{self.name}-{rank}-{tail}"
        self.path = os.path.join(SHM_DIR, own)
        # The arena follows the rings (or the control block alone).
        rings = segment_bytes(size, slots, slot_bytes) if slots else CONTROL_BYTES
        nbytes = rings + arena_bytes(window)
        try:
            seg = self.seg = segment.create(self.path, nbytes, self.me, token)
        except TransportError:
            self.path = None  # create() removed it
            if not optional:
                raise
            announce(b"")  # the others learn that this group has no window
            return None
        except BaseException:
            self.path = None
            raise
        w = seg.words
        w[W_VERSION] = VERSION
        w[W_PID] = os.getpid()
        w[W_SIZE] = size
        w[W_SLOTS] = slots
        w[W_SLOT_BYTES] = slot_bytes
        w[W_WINDOW] = rings if window else 0
        w[W_WINDOW_BYTES] = window
        w[W_MAGIC] = MAGIC
        # Peers receive the open file over their socket: from here on nothing in
        # /dev/shm refers to this rank, whatever happens to it.
        self.unlink()
        self.wires = [Wire(r) for r in range(size) if r != rank]
        by_rank = {p.rank: p for p in self.wires}
        listener = _listen(own, size)
        try:
            announced = announce(f"{tail}:{nbytes}".encode())
            if optional and not all(announced):  # some rank has no segment
                self.release()
                return None
            for p in self.wires:
                p.name, p.nbytes = self._announced(announced[p.rank], p.rank)
            hello_token = token.encode()[:16].ljust(16, b"\0")
            for p in self.wires:
                if p.rank < rank:
                    self._connect(p, _HELLO.pack(rank, hello_token), left())
            missing = {p.rank for p in self.wires if p.rank > rank}
            while missing:
                # With a way to tell, look every second whether a rank waited for is gone.
                listener.settimeout(left() if alive is None else min(left(), _ALIVE_SECONDS))
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    gone = sorted(self.names[r] for r in missing if alive and not alive(r))
                    if gone:
                        raise PeerLostError(
                            f"rank {self.me}: ranks {gone} were lost while setting up "
                            "shared memory with this rank"
                        ) from None
                    if time.monotonic() < deadline:
                        continue
                    raise RendezvousError(
                        f"rank {self.me}: ranks {sorted(self.names[r] for r in missing)} did "
                        "not connect to the "
                        f"shared-memory transport within {timeout} s"
                    ) from None
                conn.settimeout(left())
                peer_rank = self._accept_hello(conn, hello_token, missing)
                if peer_rank is None:
                    conn.close()
                    continue
                missing.discard(peer_rank)
                peer = by_rank[peer_rank]
                peer.sock = conn
                peer.pid = peer_pid(conn)
                peer.pid_start = process_start(peer.pid) if peer.pid else None
        finally:
            listener.close()
        assert seg.fd is not None
        for p in self.wires:  # every peer gets our segment's file...
            assert p.sock is not None
            socket.send_fds(p.sock, [b"S"], [seg.fd])
        for p in self.wires:  # ...and we map theirs
            self._attach(p, slots, slot_bytes)
            assert p.sock is not None
            p.sock.sendall(b"A")  # "I have mapped your segment"
        seg.close_fd()
        for p in self.wires:
            assert p.sock is not None
            p.sock.settimeout(left())
            if _recv_exact(p.sock, 1) != b"A":
                raise RendezvousError(
                    f"rank {self.me}: rank {self.names[p.rank]} broke off the rendezvous"
                )
        for p in self.wires:
            assert p.sock is not None
            p.sock.setblocking(False)
        return Joined(token, seg, self.wires, (rings if window else 0, window))

    def _connect(self, p: Wire, hello: bytes, timeout: float) -> None:
        """Connect to ``p``'s socket, check that its holder is of our user, say ``hello``."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        p.sock = sock
        sock.settimeout(timeout)
        sock.connect(f"\0{p.name}")
        pid, uid = peer_credentials(sock)
        if uid != os.geteuid():
            raise TransportError(
                f"rank {self.me}: the socket @{p.name} of rank "
                f"{self.names[p.rank]} is held by a process of uid {uid}, not "
                f"of this user ({os.geteuid()}): refusing it"
            )
        p.pid = 0 if pid == os.getpid() else pid
        p.pid_start = process_start(p.pid) if p.pid else None
        sock.sendall(hello)

    def _announced(self, value: bytes, rank: int) -> tuple[str, int]:
        """(segment and socket name, segment bytes) from what ``rank`` published."""
        tail, _, nbytes = value.decode(errors="replace").partition(":")
        if not _TAIL_RE.fullmatch(tail) or not nbytes.isdigit():
            raise RendezvousError(
                f"rank {self.me}: rank {self.names[rank]} published {value!r}, not a segment"
            )
        return f"{self.name}-{rank}-{tail}", int(nbytes)

    def _accept_hello(self, conn: socket.socket, token: bytes, missing: set[int]) -> int | None:
        """The rank of a new connection, or None for a stranger (another user, another job)."""
        if peer_credentials(conn)[1] != os.geteuid():
            return None
        peer_rank, peer_token = _HELLO.unpack(_recv_exact(conn, _HELLO.size))
        if peer_token != token or peer_rank not in missing:
            return None
        return int(peer_rank)

    def _attach(self, p: Wire, slots: int, slot_bytes: int) -> None:
        assert p.sock is not None
        path = os.path.join(SHM_DIR, p.name)
        msg, fds, flags, _ = socket.recv_fds(p.sock, 1, 1)
        if msg != b"S" or len(fds) != 1 or flags & socket.MSG_CTRUNC:
            for fd in fds:
                os.close(fd)
            if not msg:
                raise RendezvousError(
                    f"rank {self.me}: rank {self.names[p.rank]} hung up during the "
                    "shared-memory rendezvous"
                )
            raise RendezvousError(
                f"rank {self.me}: rank {self.names[p.rank]} did not hand over its segment {path}"
            )
        seg = p.seg = segment.attach(fds[0], path, p.nbytes, self.me)
        w = seg.words
        if w[W_MAGIC] != MAGIC or w[W_VERSION] != VERSION or w[W_SIZE] != self.size:
            raise RendezvousError(
                f"rank {self.me}: {path} is not a plait segment of this job "
                f"(size {w[W_SIZE]}, expected {self.size})"
            )
        if (w[W_SLOTS] == 0) != (slots == 0):  # a window's segment where rings are due, or not
            raise RendezvousError(
                f"rank {self.me}: {path} is not a segment of the kind this rendezvous makes "
                f"({w[W_SLOTS]} slots per ring, expected {slots})"
            )
        p.window = (int(w[W_WINDOW]), int(w[W_WINDOW_BYTES]))
        check_arena(*p.window, p.nbytes, self.me, path)
        if slots:
            # Senders follow the geometry the receiver recorded in its control block.
            p.out = RingEnd(self.rank, p.rank, w[W_SLOTS], w[W_SLOT_BYTES])
            p.inbound = RingEnd(p.rank, self.rank, slots, slot_bytes)

    def unlink(self) -> None:
        if self.path is not None:
            path, self.path = self.path, None
            segment.unlink(path)

    def release(self) -> None:
        for p in self.wires:
            p.release()
        if self.seg is not None:
            self.seg.release()
            self.seg = None


def _listen(name: str, backlog: int) -> socket.socket:
    """A Unix socket listening on ``name`` in the abstract namespace (nothing to clean up)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(f"\0{name}")
        listener.listen(backlog)
    except BaseException:
        listener.close()
        raise
    return listener


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
