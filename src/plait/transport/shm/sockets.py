"""Reading and writing the Unix sockets of the shared-memory rendezvous (:mod:`.bootstrap`).

A rank that gives up a rendezvous writes ``F`` and its error's text to its peers
(:meth:`~plait.transport.shm.bootstrap._Join.break_off`); :func:`last_words` reads
that, and :func:`discard_input` keeps it from being lost when the socket closes.
"""

from __future__ import annotations

import contextlib
import socket

from plait.errors import RendezvousError

__all__ = ["discard_input", "last_words", "listen", "recv_exact"]


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes from ``sock``.

    Raises:
        RendezvousError: the peer was silent past the socket's timeout, or hung up.
    """
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
    """A Unix socket listening on ``name`` in the abstract namespace (nothing to clean up)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(f"\0{name}")
        listener.listen(backlog)
    except BaseException:
        listener.close()
        raise
    return listener
