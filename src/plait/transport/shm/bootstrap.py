"""The shared-memory rendezvous: job token, segments, doorbell sockets, handing files over.

Steps, names and cleanup rules: ``docs/transport.md`` (Note [segment names], Note
[lifetime and cleanup]). :func:`join` meets the ranks of a transport through the
store; :func:`join_window` runs the same rendezvous for the window of a split's
group, announcing through the group's messages instead (Note [split windows] in
:mod:`plait.transport.shm.window`).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import socket
import struct
import time
from collections.abc import Callable, Sequence

from plait.errors import CommError, PeerLostError, RendezvousError, TransportError
from plait.rendezvous.lost import wait_ranks
from plait.rendezvous.store import Store, StoreTimeout
from plait.transport.shm import segment
from plait.transport.shm.doorbell import (
    alive,
    described,
    peer_credentials,
    peer_pid,
    process_start,
    visible,
)
from plait.transport.shm.hellos import Hellos
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
from plait.transport.shm.sockets import connect, discard_input, last_words, listen, readable
from plait.transport.shm.window import arena_bytes, arena_ranges, check_arena
from plait.transport.shm.wire import Joined, Wire

__all__ = ["JOB_RE", "join", "join_window"]

#: Rank, job token (to reject strangers), nonce (the set-up's: to refuse another's).
_HELLO = struct.Struct("<Q16sQ")
#: Random bytes at the end of every segment and socket name (Note [segment names]).
_TAIL_BYTES = 8
_TAIL_RE = re.compile(f"[0-9a-f]{{{2 * _TAIL_BYTES}}}")
JOB_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
#: Seconds between looks at whether this rank was stopped or the ranks waited for are gone
#: (where the caller can tell: a split's rendezvous).
_CHECK_SECONDS = 0.1
#: Bytes of the error text a rank that gives up sends its peers, at most.
_REASON_BYTES = 1000
#: Seconds a rank that gives up spends telling each peer, at most.
_TELL_SECONDS = 1.0


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
    On failure everything made so far is released.

    Raises:
        RendezvousError: the ranks did not all arrive within ``timeout``, or disagree.
        TransportError: the OS refused a segment, socket or descriptor.
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
    reserved: int,
    announce: Callable[[bytes], list[bytes]],
    timeout: float,
    nonce: int,
    alive: Callable[[int], bool] | None = None,
    stopped: Callable[[], BaseException | None] | None = None,
) -> Joined | None:
    """Segments holding only a window, for a group of ranks that met already (a split's).

    The same rendezvous as :func:`join` (Note [lifetime and cleanup]): each rank
    creates a segment of a control block and an arena of ``window`` bytes per
    half, listens on a socket, and the ranks hand their segments' files to each
    other over connected sockets, which are closed again once every rank has
    mapped every segment (waiting goes through the transport the group already
    has). Only the store is replaced: ``announce(mine)`` must return every
    rank's announcement in rank order (an allgather over the group's messages).
    ``job`` starts the names. Only ``reserved`` bytes of each half are reserved now,
    no page is mapped ahead, and this rank's segment keeps its file open to reserve more
    (Note [split windows]).

    ``nonce`` names this set-up (the same on every rank of the group, and on
    no other set-up at the same time): every connection says it in its hello,
    and a connection that says another is refused, so that two set-ups of the
    same ranks can never wire to each other's segments.

    Returns None, on every rank alike, when some rank could not create its segment or
    its socket (out of memory or descriptors): it announces none. ``alive(r)`` tells
    whether rank ``r`` still runs and ``stopped()`` gives the error to raise
    once this rank's transport is closed or aborted (else None); both are
    checked every tenth of a second while this rank waits for a peer.

    Raises:
        RendezvousError, TransportError: as :func:`join` (and whatever
            ``announce`` raises); a rank that fails after it announced itself
            tells the others, who raise at once, naming it and its error.
        PeerLostError: a rank died or closed its transport meanwhile.
    """
    r = _Join(rank, size, names, nonce=nonce, alive=alive, stopped=stopped, lazy=reserved)
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
        )
    )


class _Join:
    """One rank's side of a rendezvous; see :func:`join` and :func:`join_window`."""

    def __init__(
        self,
        rank: int,
        size: int,
        names: Sequence[int],
        *,
        nonce: int = 0,
        alive: Callable[[int], bool] | None = None,
        stopped: Callable[[], BaseException | None] | None = None,
        lazy: int = 0,
    ) -> None:
        self.rank = rank
        self.size = size
        self.names = names
        self.me = names[rank]
        self.name = ""  # start of segment and socket names: plait-<job>-g<generation>
        self.seg: Segment | None = None
        self.wires: list[Wire] = []
        self.nonce = nonce
        self.alive = alive
        self.stopped = stopped
        self.lazy = lazy  # bytes of each half reserved at first (0: all, and mapped ahead)
        self.token = b""  # the job's token as the hello carries it
        self.hello = b""  # ours, once the peers' announcements are known (then failures are told)
        self.listener: socket.socket | None = None
        self.hellos: Hellos | None = None  # the listener's connections not yet identified
        self.deadline = 0.0
        self.timeout = 0.0

    def guarded(self, body: Callable[[], Joined | None]) -> Joined | None:
        """``body()``; on failure tell the peers (:meth:`break_off`) and release what it
        made."""
        try:
            return body()
        except BaseException as exc:
            error = exc
            # The OS's errors name no rank, and some come as ValueError (a descriptor a call
            # cannot take): every failure of the set-up is a CommError that names its cause.
            if isinstance(exc, (OSError, ValueError)) and not isinstance(exc, CommError):
                kind = RendezvousError if isinstance(exc, TimeoutError) else TransportError
                error = kind(f"rank {self.me}: shared-memory rendezvous failed: {exc}")
            self.break_off(error)
            self.release()
            if error is exc:
                raise
            raise error from exc

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
            try:
                wait_ranks(
                    store,
                    [prefix + "job"],
                    [self.names[0]],
                    left(),
                    me=f"rank {self.me}",
                    what="start the shared-memory rendezvous",
                )
            except StoreTimeout:
                raise _absent(self.me, [self.names[0]], "start it", timeout) from None
            token = store.get(prefix + "job").decode()
            if job is not None and job != token:
                raise RendezvousError(
                    f"rank {self.me}: job {job!r} differs from rank {self.names[0]}'s {token!r}"
                )

        def announce(mine: bytes) -> list[bytes]:
            store.set(prefix + f"ready/{rank}", mine)
            keys = [prefix + f"ready/{r}" for r in range(size)]
            try:
                wait_ranks(
                    store, keys, self.names, left(), me=f"rank {self.me}", what="announce a segment"
                )
            except StoreTimeout:
                absent = [self.names[r] for r in range(size) if not store.check([keys[r]])]
                raise _absent(self.me, absent, "announce their segment", timeout) from None
            return [store.get(k) for k in keys]

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
    ) -> Joined | None:
        """Create, announce, connect, hand over and map: the rendezvous after the namespace.

        ``slots`` 0: the segment holds no rings, only the control block and the
        window. ``optional``: a segment or socket this rank cannot make is
        announced as none (an empty announcement) instead of raising, and if
        any rank announces none, every rank returns None. Once the
        announcements are known, a rank that fails tells its peers
        (:meth:`break_off`), and a rank waiting for a peer looks every
        :data:`_CHECK_SECONDS` whether it was stopped or a peer is gone (where
        ``alive`` and ``stopped`` tell), so that no rank waits out the deadline
        for a rendezvous that cannot complete.
        """
        rank, size = self.rank, self.size
        self.deadline, self.timeout = deadline, timeout
        self.name = name
        self.token = token.encode()[:16].ljust(16, b"\0")
        tail = secrets.token_hex(_TAIL_BYTES)
        own = f"{self.name}-{rank}-{tail}"
        # The arena follows the rings (or the control block alone).
        rings = segment_bytes(size, slots, slot_bytes) if slots else CONTROL_BYTES
        nbytes = rings + arena_bytes(window)
        try:
            listener = self._prepare(own, nbytes, token, rings, slots, slot_bytes, window)
        except (TransportError, OSError):
            if not optional:
                raise
            self.release()
            announce(b"")  # the others learn at once that this group has no window
            return None
        self.listener = listener
        self.hellos = Hellos(listener, size - 1 - rank, self._is_rank)
        try:
            announced = announce(f"{tail}:{nbytes}:{described()}".encode())
            if optional and not all(announced):  # some rank has no segment
                self.release()
                return None
            for p in self.wires:  # (its process, if visible: _check sees it die)
                p.name, p.nbytes, p.pid, p.pid_start = self._announced(announced[p.rank], p.rank)
            self.hello = _HELLO.pack(rank, self.token, self.nonce)
            for p in self.wires:
                if p.rank < rank:
                    self._connect(p, self.hello, self._left())
            self._accept_all()
        except BaseException:
            if not self.hello:  # nobody will be told: the listener can go now
                self._close_listener()
            raise
        self._close_listener()
        seg = self.seg
        assert seg is not None
        fd = seg.fd
        assert fd is not None
        for p in self.wires:  # every peer gets our segment's file...
            self._send(p, lambda sock: socket.send_fds(sock, [b"S"], [fd]))
        for p in self.wires:  # ...and we map theirs
            self._attach(p, slots, slot_bytes)
            self._send(p, lambda sock: sock.sendall(b"A"))  # "I have mapped your segment"
        if not self.lazy:  # else the window reserves more through it
            seg.close_fd()
        for p in self.wires:
            got = last_words(self._await(p), 1, _TELL_SECONDS)  # b"": it hung up
            if got != b"A":
                raise self._broke_off(p, got)
        for p in self.wires:
            assert p.sock is not None
            p.sock.setblocking(False)
        return Joined(token, seg, self.wires, (rings if window else 0, window))

    def _prepare(
        self, own: str, nbytes: int, token: str, rings: int, slots: int, slot_bytes: int, arena: int
    ) -> socket.socket:
        """Create our segment (nothing in /dev/shm names it) and describe it; our listening
        socket."""
        path = os.path.join(SHM_DIR, own)
        some = arena_ranges(rings, arena, self.lazy) if self.lazy else None
        seg = self.seg = segment.create(
            path, nbytes, self.me, token, populate=not some, reserve=some, share=self.size
        )
        w = seg.words
        w[W_VERSION] = VERSION
        w[W_PID] = os.getpid()
        w[W_SIZE] = self.size
        w[W_SLOTS] = slots
        w[W_SLOT_BYTES] = slot_bytes
        w[W_WINDOW] = rings if arena else 0
        w[W_WINDOW_BYTES] = arena
        w[W_MAGIC] = MAGIC
        self.wires = [Wire(r) for r in range(self.size) if r != self.rank]
        return listen(own, self.size)

    def _accept_all(self) -> None:
        """Accept the connection of every higher rank, checking on the lower ones meanwhile.

        A lower rank we connected to writes nothing before its segment's file
        ("S"), so anything else it writes, or its hanging up, means it broke off.
        No connection is waited on alone: a stranger that connects and says nothing
        holds up nobody (Note [silent connections] in :mod:`.hellos`).
        """
        hellos = self.hellos
        assert hellos is not None
        missing = {p.rank for p in self.wires if p.rank > self.rank}
        by_rank = {p.rank: p for p in self.wires}
        watched = {p.sock: p for p in self.wires if p.sock is not None}
        while missing:
            self._check()
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise RendezvousError(
                    f"rank {self.me}: ranks {sorted(self.names[r] for r in missing)} did "
                    f"not connect to the shared-memory transport within {self.timeout:g} s"
                )
            for sock in hellos.wait(self._slice(left), watched):
                if sock in watched:
                    p = watched.pop(sock)
                    if sock.recv(1, socket.MSG_PEEK) != b"S":  # else it is ahead of us: fine
                        raise self._broke_off(p)
                elif sock is hellos.listener:
                    hellos.accept()
                elif sock in hellos:
                    got = hellos.read(sock, _HELLO.size)
                    if got is None:
                        continue
                    # Hung up before a whole hello: not one of ours (a dead peer is checked).
                    peer_rank = self._accept_hello(sock, got, missing)
                    if peer_rank is None:
                        sock.close()
                        continue
                    missing.discard(peer_rank)
                    peer = by_rank[peer_rank]
                    sock.settimeout(self._left())
                    peer.sock = sock
                    peer.pid = peer_pid(sock)
                    peer.pid_start = process_start(peer.pid) if peer.pid else None
                    watched[sock] = peer

    def _is_rank(self, pid: int) -> bool:
        """Whether process ``pid`` is this one or a peer's, as announced."""
        return pid == os.getpid() or any(p.pid == pid for p in self.wires if p.pid)

    def _left(self) -> float:
        return max(self.deadline - time.monotonic(), 0.001)

    def _slice(self, left: float) -> float:
        """How long to block before the next look at ``stopped``, ``alive`` and the peers'
        processes."""
        return min(left, _CHECK_SECONDS)

    def _check(self, only: Wire | None = None) -> None:
        """Raise if this rank was stopped (its transport closed) or a peer (``only``) is gone."""
        if self.stopped is not None:
            error = self.stopped()
            if error is not None:
                raise error
        # Also a peer whose process is seen to end: the highest rank of a host dials nobody,
        # and its death before it dialled the others left them waiting out the deadline.
        gone = sorted(
            self.names[p.rank]
            for p in (self.wires if only is None else [only])
            if (self.alive is not None and not self.alive(p.rank))
            or (p.pid and not alive(p.pid, p.pid_start))
        )
        if gone:
            who = f"rank {gone[0]} was" if len(gone) == 1 else f"ranks {gone} were"
            err = PeerLostError(
                f"rank {self.me}: {who} lost (its process ended or its transport closed) "
                "while setting up shared memory with this rank"
            )
            err.lost_rank = gone[0]
            raise err

    def _await(self, p: Wire) -> socket.socket:
        """``p``'s socket, once it has something to read (checking as :meth:`_accept_all`).

        What ``p`` wrote is read even if ``p`` is gone since: a peer that has done its part
        may finish and close before this rank reads it. Only ``p`` is checked, for the same
        reason (the others may have finished too).
        """
        sock = p.sock
        assert sock is not None
        while True:
            if readable(sock, 0):
                return sock
            self._check(p)
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise RendezvousError(
                    f"rank {self.me}: rank {self.names[p.rank]} was silent during the "
                    f"shared-memory rendezvous for {self.timeout:g} s"
                )
            if readable(sock, self._slice(left)):
                return sock

    def _send(self, p: Wire, send: Callable[[socket.socket], object]) -> None:
        """``send(p's socket)``; a peer that hung up broke off (and may have said why)."""
        assert p.sock is not None
        try:
            send(p.sock)
        except (BrokenPipeError, ConnectionResetError):
            raise self._broke_off(p) from None

    def _broke_off(self, p: Wire, got: bytes = b"") -> BaseException:
        """The error for peer ``p``, which hung up or wrote ``F`` and its error's text.

        ``got``: what was read of it already. If this rank was stopped meanwhile,
        its own error, and if a peer is gone, PeerLostError (the peer may have
        broken off because of either).
        """
        try:  # what this rank sees itself comes first: it may be why the peer broke off
            self._check()
        except CommError as exc:
            return exc
        data = got
        if p.sock is not None:
            data += last_words(p.sock, _REASON_BYTES + 1, _TELL_SECONDS)
        who = f"rank {self.names[p.rank]}"
        if data.startswith(b"F"):
            return RendezvousError(
                f"rank {self.me}: {who} broke off setting up shared memory with this rank: "
                + data[1:].decode(errors="replace")
            )
        return self._told() or RendezvousError(
            f"rank {self.me}: {who} hung up during the shared-memory rendezvous: it died or "
            "gave up (see its error)"
        )

    def _told(self) -> RendezvousError | None:
        """The error of a peer that broke off and told us on a connection not yet accepted.

        For a rank that fails because another hung up or stopped listening: the
        first to give up may have told it why, through its listener (:meth:`break_off`);
        all are read at once, for :data:`_TELL_SECONDS` at most in all.
        """
        if self.hellos is None:
            return None
        got = self.hellos.last_words(
            _HELLO.size + _REASON_BYTES + 1,
            _TELL_SECONDS,
            lambda got, whole: (
                bool(_telling(got, self.token, self.nonce))
                or (not whole and len(got) <= _HELLO.size)
            ),
        )
        told = _telling(got, self.token, self.nonce)
        if told is None:
            return None
        rank, why = told
        name = self.names[rank] if 0 <= rank < self.size else rank
        return RendezvousError(
            f"rank {self.me}: rank {name} broke off setting up shared memory with this rank: {why}"
        )

    def break_off(self, error: BaseException) -> None:
        """Tell every peer that this rank gives up, and why, so that none waits for it.

        Only once the announcements are known (before, a peer waits for ours and
        gets the announcer's error instead). A peer we are connected to gets ``F``
        and the error's text; a lower rank we have not connected to yet (it waits
        for our connection) gets a connection, our hello and the same; a higher
        rank whose connection we have not accepted yet gets the same on it. A
        higher rank that has not connected finds our socket closed. Best effort:
        a peer that is gone is not told.
        """
        if not self.hello:
            return
        reason = b"F" + str(error).encode()[:_REASON_BYTES]
        deadline, more = time.monotonic() + _TELL_SECONDS, True
        while self.hellos is not None and more and time.monotonic() < deadline:
            more = False  # higher ranks not accepted yet (other users' are closed, untold)
            with contextlib.suppress(OSError):
                more = self.hellos.accept()
            for conn in self.hellos.close():
                with conn, contextlib.suppress(OSError):
                    conn.sendall(reason)  # into an empty buffer: never blocks
                    discard_input(conn)
        self._close_listener()
        for p in self.wires:
            with contextlib.suppress(OSError):
                if p.sock is None:
                    if p.rank > self.rank or not p.name:
                        continue
                    p.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    p.sock.settimeout(_TELL_SECONDS)
                    p.sock.connect(f"\0{p.name}")
                    p.sock.sendall(self.hello)
                p.sock.settimeout(_TELL_SECONDS)
                p.sock.sendall(reason)
                discard_input(p.sock)

    def _connect(self, p: Wire, hello: bytes, timeout: float) -> None:
        """Connect to ``p``'s socket, check that its holder is of our user, say ``hello``."""
        try:
            sock = p.sock = connect(p.name, timeout, lambda: self._check(p), f"rank {self.me}")
        except ConnectionRefusedError:
            try:  # what this rank sees itself, or was told, says more than the refusal
                self._check()
            except CommError as exc:
                raise exc from None
            raise self._told() or RendezvousError(
                f"rank {self.me}: rank {self.names[p.rank]} no longer listens on @{p.name} "
                "(it gave up the shared-memory rendezvous)"
            ) from None
        pid, uid = peer_credentials(sock)
        if uid != os.geteuid():
            raise TransportError(
                f"rank {self.me}: the socket @{p.name} of rank "
                f"{self.names[p.rank]} is held by a process of uid {uid}, not "
                f"of this user ({os.geteuid()}): refusing it"
            )
        p.pid = 0 if pid == os.getpid() else pid
        p.pid_start = process_start(p.pid) if p.pid else None
        # ``p`` may give up (closing its listener) between our connect and this hello.
        self._send(p, lambda s: s.sendall(hello))

    def _announced(self, value: bytes, rank: int) -> tuple[str, int, int, str | None]:
        """(segment and socket name, segment bytes, its process's pid and start time, or 0
        and None where not visible from here) from what ``rank`` published."""
        tail, _, rest = value.decode(errors="replace").partition(":")
        nbytes, _, proc = rest.partition(":")
        if not _TAIL_RE.fullmatch(tail) or not (nbytes.isascii() and nbytes.isdigit()):
            raise RendezvousError(
                f"rank {self.me}: rank {self.names[rank]} published {value!r}, not a segment"
            )
        pid, start = visible(proc) or (0, None)
        return f"{self.name}-{rank}-{tail}", int(nbytes), pid, start

    def _accept_hello(self, conn: socket.socket, hello: bytes, missing: set[int]) -> int | None:
        """The rank of a new connection that said ``hello``, or None for a stranger (one
        that hung up before a whole hello, of another job) or a rank of another set-up of
        this job (told so, with ``F`` and why). Another user's was closed on accepting."""
        if len(hello) != _HELLO.size:
            return None
        peer_rank, peer_token, nonce = _HELLO.unpack(hello)
        if peer_token != self.token:
            return None
        if nonce != self.nonce:
            with contextlib.suppress(OSError):
                conn.sendall(
                    f"Fits connection was meant for another set-up ({nonce:#x}; the socket "
                    f"@{self.name}-{self.rank}-... is for {self.nonce:#x})".encode()
                )
            return None
        return int(peer_rank) if peer_rank in missing else None

    def _attach(self, p: Wire, slots: int, slot_bytes: int) -> None:
        path = os.path.join(SHM_DIR, p.name)
        try:
            msg, fds, flags, _ = socket.recv_fds(self._await(p), 1, 1)
        except (ConnectionResetError, BrokenPipeError):
            raise self._broke_off(p) from None
        if msg != b"S" or len(fds) != 1 or flags & socket.MSG_CTRUNC:
            for fd in fds:
                os.close(fd)
            if msg in (b"", b"F"):
                raise self._broke_off(p, msg)
            raise RendezvousError(
                f"rank {self.me}: rank {self.names[p.rank]} did not hand over its segment {path}"
            )
        seg = p.seg = segment.attach(fds[0], path, p.nbytes, self.me, populate=not self.lazy)
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

    def _close_listener(self) -> None:
        if self.hellos is not None:
            for conn in self.hellos.close():
                conn.close()
            self.hellos = None
        if self.listener is not None:
            self.listener.close()
            self.listener = None

    def release(self) -> None:
        self._close_listener()
        for p in self.wires:
            p.release()
        if self.seg is not None:
            self.seg.release()
            self.seg = None


def _absent(me: int, ranks: list[int], what: str, timeout: float) -> StoreTimeout:
    return StoreTimeout(
        f"rank {me}: rank(s) {ranks} did not {what} in the shared-memory rendezvous within "
        f"{timeout:.3g} s: they died or failed in plait.init (see their errors), or stopped"
    )


def _telling(got: bytes, token: bytes, nonce: int) -> tuple[int, str] | None:
    """(rank, why) where ``got`` is a hello of this set-up (``token``, ``nonce``) followed by
    ``F`` and why its rank broke off; else None."""
    if len(got) <= _HELLO.size or got[_HELLO.size : _HELLO.size + 1] != b"F":
        return None
    rank, their_token, their_nonce = _HELLO.unpack_from(got)
    if their_token != token or their_nonce != nonce:
        return None
    return int(rank), got[_HELLO.size + 1 :].decode(errors="replace")
