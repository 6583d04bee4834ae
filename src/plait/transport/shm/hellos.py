"""Connections to a rank's rendezvous socket whose hello has not come yet (:mod:`.bootstrap`).

Note [silent connections]
~~~~~~~~~~~~~~~~~~~~~~~~~
A rank's listening socket shows in /proc/net/unix, and any process of the same user may
connect to it and say nothing, or only part of a hello. A rank that read each hello
with a blocking read, under the rendezvous' whole deadline, stopped there: the real
peers waited in the queue behind the stranger, no check that a peer is gone or this
rank was stopped ran, and the rendezvous failed after its timeout ("ranks [1, 2, 3]
did not connect", though they had), or hung for as long as the stranger held on.

So nothing is read from a connection before it has something to read: :class:`Hellos`
keeps the accepted connections whose hello is not whole yet, reads each without
blocking when ``poll`` says it has bytes, and waits on all of them and the listener at
once. The rules of :mod:`plait._guard` (Note [unauthenticated connections]) bound what
strangers cost:

* a connection from another user is closed as it is accepted (``SO_PEERCRED``);
* every other one has :data:`HANDSHAKE_SECONDS` to send its hello, then it is closed,
  unless it comes from this process or from a process a peer rank announced (a peer
  that was descheduled between its connect and its hello is no stranger; it is waited
  for until the rendezvous' own deadline);
* at most a cap of them may be pending at once (:data:`MAX_UNAUTHENTICATED`, lowered
  to a quarter of the descriptor limit, never below the honest ones expected); one
  more drops the oldest, and so does ``accept`` running out of descriptors (where the
  oldest has waited :data:`plait._guard.ROOM_AFTER` or more; else the rendezvous fails
  with the OS's error).
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import socket
import time
from collections.abc import Callable, Iterable

from plait import _guard
from plait.transport.shm.doorbell import peer_credentials

__all__ = ["HANDSHAKE_SECONDS", "MAX_UNAUTHENTICATED", "Hellos"]

#: Seconds a connection has to send its whole hello (a rank sends it right after its
#: connect), unless it comes from a rank's process (Note [silent connections]).
HANDSHAKE_SECONDS = 2.0
#: Most connections waiting for their hello at once (Note [silent connections]).
MAX_UNAUTHENTICATED = _guard.MAX_UNAUTHENTICATED
#: ``accept`` errors that mean "out of descriptors or memory".
_EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class Hellos:
    """A listening socket and the connections it accepted whose hello is not whole yet.

    Args:
        listener: The rank's listening socket (made non-blocking here; closing it stays
            with the caller).
        honest: How many connections of peers this rank expects (the cap is never less).
        trusted: Whether a process id is a rank's, or this process (its connections wait
            as long as the rendezvous does, not :data:`HANDSHAKE_SECONDS`).
    """

    def __init__(
        self, listener: socket.socket, honest: int, trusted: Callable[[int], bool]
    ) -> None:
        listener.setblocking(False)
        self.listener = listener
        cap = max(_guard.unauthenticated_cap(MAX_UNAUTHENTICATED), honest, 1)
        self.pending = _guard.PendingHandshakes[socket.socket](cap, HANDSHAKE_SECONDS)
        self.got: dict[socket.socket, bytes] = {}  # what each pending one sent so far
        self._trusted = trusted
        self._patient: set[socket.socket] = set()  # the pending ones of a rank's process

    def __contains__(self, sock: object) -> bool:
        return sock in self.got

    def __len__(self) -> int:
        return len(self.got)

    def accept(self) -> bool:
        """Take what the listener's queue holds, one cap's worth at most: another user's
        connections are closed at once, the others wait for their hello. Whether it took
        a cap's worth (more may be queued)."""
        for _ in range(self.pending.cap):
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return False
            except ConnectionAbortedError:
                continue
            except OSError as exc:
                oldest = self.pending.oldest(time.monotonic() - _guard.ROOM_AFTER)
                if exc.errno not in _EXHAUSTED or oldest is None:
                    raise
                self.drop(oldest)  # makes room: the oldest goes first, as at the cap
                continue
            try:
                pid, uid = peer_credentials(conn)
            except OSError:
                conn.close()
                continue
            if uid != os.geteuid():  # another user's (Note [segment names])
                conn.close()
                continue
            conn.setblocking(False)
            self.got[conn] = b""
            if self._trusted(pid):
                self._patient.add(conn)
            oldest = self.pending.admit(conn, time.monotonic())
            if oldest is not None:
                self.drop(oldest)
        return True

    def wait(self, timeout: float, others: Iterable[socket.socket] = ()) -> list[socket.socket]:
        """The sockets with something to read (or hung up) within ``timeout`` seconds: the
        listener, pending connections and ``others``; first drops the connections whose
        time is up, and waits no longer than the next one's."""
        now = time.monotonic()
        for conn in self.pending.overdue(now):
            if conn in self._patient:
                self.pending.admit(conn, now)  # room: the overdue ones just left
            else:
                self.drop(conn)
        due = self.pending.next_deadline()
        if due is not None:
            timeout = min(timeout, max(due - now, 0.0))
        poll = select.poll()
        by_fd = {}
        for sock in (self.listener, *self.got, *others):
            by_fd[sock.fileno()] = sock
            poll.register(sock, select.POLLIN)
        return [by_fd[fd] for fd, _ in poll.poll(max(timeout, 0.0) * 1000)]

    def read(self, conn: socket.socket, upto: int) -> bytes | None:
        """Read what pending ``conn`` has, up to ``upto`` bytes in all, without blocking.

        Returns what it sent, once that is ``upto`` bytes or it hung up (then shorter):
        ``conn`` is no longer pending but still open, the caller's. None while more may
        come.
        """
        got = self.got[conn]
        try:
            chunk = conn.recv(upto - len(got))
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            chunk = b""
        got += chunk
        if chunk and len(got) < upto:
            self.got[conn] = got
            return None
        self._forget(conn)
        return got

    def last_words(
        self, limit: int, seconds: float, telling: Callable[[bytes, bool], bool]
    ) -> bytes:
        """What the first connection, of those pending or queued, that tells something
        sent: until it hung up, ``limit`` bytes at most. ``telling(words, whole)``: whether
        ``words`` tell something (``whole``: all it sent), or may yet (else it is closed).

        After ``seconds``, what one that still tells said so far, or b"". All are read at
        once, none waited on alone.
        """
        deadline = time.monotonic() + seconds
        with contextlib.suppress(OSError):
            self.accept()
            while self.got and time.monotonic() < deadline:
                for conn in self.wait(deadline - time.monotonic()):
                    if conn is self.listener:
                        self.accept()
                    elif conn in self.got:
                        got = self.read(conn, limit)
                        if got is None and not telling(self.got[conn], False):
                            self.drop(conn)
                        elif got is not None:
                            conn.close()
                            if telling(got, True):
                                return got
        for got in self.got.values():  # what one that is still telling said so far
            if telling(got, True):
                return got
        return b""

    def drop(self, conn: socket.socket) -> None:
        """Close pending ``conn``."""
        self._forget(conn)
        conn.close()

    def close(self) -> list[socket.socket]:
        """Stop waiting for hellos: the pending connections, which the caller closes."""
        every = self.pending.clear()
        self.got.clear()
        self._patient.clear()
        return every

    def _forget(self, conn: socket.socket) -> None:
        self.pending.discard(conn)
        self.got.pop(conn, None)
        self._patient.discard(conn)
