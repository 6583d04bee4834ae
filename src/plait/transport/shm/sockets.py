"""Reading and writing the Unix sockets of the shared-memory rendezvous (:mod:`.bootstrap`).

A rank that gives up a rendezvous writes ``F`` and its error's text to its peers
(:meth:`~plait.transport.shm.bootstrap._Join.break_off`); :func:`last_words` reads
that, and :func:`discard_input` keeps it from being lost when the socket closes.
"""

from __future__ import annotations

import contextlib
import select
import socket
import time
from collections.abc import Callable

from plait.errors import TransportError

__all__ = ["connect", "discard_input", "last_words", "listen", "readable"]

#: Longest pause between two tries of a connect whose listener's queue is full.
_MOST_PAUSE = 0.005


def last_words(sock: socket.socket, limit: int, timeout: float) -> bytes:
    """What ``sock`` has left to read before it ends, up to ``limit`` bytes (errors: what
    was read until then); for a peer that broke off, ``F`` and its error's text."""
    data = b""
    with contextlib.suppress(OSError):
        sock.settimeout(timeout)
        while len(data) < limit:
            chunk = sock.recv(limit - len(data))
            if not chunk:
                break
            data += chunk
    return data


def readable(sock: socket.socket, timeout: float) -> bool:
    """Whether ``sock`` has something to read, or hung up or failed, within ``timeout`` seconds.

    ``poll``, not ``select``: ``select`` takes no descriptor past FD_SETSIZE (1024), and a
    rank whose application holds many files has its sockets past it (``plait run`` raises
    the limit as far as the job needs).
    """
    poll = select.poll()
    poll.register(sock, select.POLLIN)
    return bool(poll.poll(max(timeout, 0.0) * 1000))


def discard_input(sock: socket.socket) -> None:
    """Read and drop what ``sock`` has received (files handed over are closed).

    A Unix socket closed with unread input resets its peer's end (ECONNRESET),
    which would lose what we sent it last: why this rank broke off.
    """
    with contextlib.suppress(OSError):
        sock.setblocking(False)
        while sock.recv(4096):
            pass


def listen(name: str, backlog: int) -> socket.socket:
    """A Unix socket listening on ``name`` in the abstract namespace (nothing to clean up),
    its queue at least the system's usual one (Note [a queue others fill])."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(f"\0{name}")
        listener.listen(max(backlog, socket.SOMAXCONN))
    except BaseException:
        listener.close()
        raise
    return listener


def connect(name: str, timeout: float, check: Callable[[], None], me: str) -> socket.socket:
    """A socket connected to ``name`` in the abstract namespace within ``timeout`` seconds,
    trying again while the listener's queue is full (Note [a queue others fill]); ``check``
    raises where waiting on is pointless (this rank stopped, the peer died).

    Note [a queue others fill]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~
    An abstract name shows in /proc/net/unix to every user while it is bound, and anyone
    may connect to it: the listener drops a connection of another user at once
    (SO_PEERCRED), but one who connects without pause keeps its queue full, and a connect
    with a timeout to a full queue fails at once with EAGAIN: every job of the host
    failed its shared-memory set-up ("Resource temporarily unavailable"). So the queue is
    the system's usual length (SOMAXCONN), not the ranks', and a connect that finds it
    full tries again, pausing 1 ms, then twice as long up to 5 ms, until its deadline:
    the listener drains the strangers, and a try finds room. A queue that stays full to
    the deadline is named as the cause.

    Raises:
        ConnectionRefusedError: nothing listens on ``name``.
        TransportError: the queue stayed full until the deadline.
    """
    deadline = time.monotonic() + timeout
    pause = 0.001
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            sock.connect(f"\0{name}")
            return sock
        except BlockingIOError:  # the queue is full
            sock.close()
        except BaseException:
            sock.close()
            raise
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransportError(
                f"{me}: the queue of @{name} stayed full for {timeout:g} s: processes that "
                "connect to it without pause (another user's, maybe) keep this rank out; "
                "the processes connected to it show in `ss -xp`"
            )
        check()
        time.sleep(min(pause, left))
        pause = min(2 * pause, _MOST_PAUSE)
