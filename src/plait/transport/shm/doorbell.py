"""Doorbells and liveness: one connected Unix socket per peer wakes a sleeper and reports death.

Protocol: ``docs/transport.md`` (Note [doorbells and waiting]).
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct

__all__ = [
    "alive",
    "described",
    "drain",
    "machine",
    "peer_pid",
    "process_start",
    "ring",
    "visible",
]

#: send() flags of a doorbell, as a plain int (or-ing the enum costs microseconds per call).
_RING_FLAGS = int(socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)


def ring(sock: socket.socket) -> None:
    """Ring a sleeping peer's doorbell: one byte, never blocking."""
    # BlockingIOError: its buffer is full of unread wake-ups already; other
    # OSErrors: it is gone, and its end-of-file reaches our poll().
    with contextlib.suppress(OSError):
        sock.send(b"\0", _RING_FLAGS)


def drain(sock: socket.socket) -> bool:
    """Read pending doorbell bytes; False if the peer's end is closed."""
    try:
        while True:
            if not sock.recv(4096):
                return False
    except BlockingIOError:
        return True
    except OSError:
        return False


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a Unix socket."""
    pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return int(pid), int(uid)


def peer_pid(sock: socket.socket) -> int:
    """The peer's pid as seen from here: 0 when it is this process or not visible."""
    pid = peer_credentials(sock)[0]
    return 0 if pid == os.getpid() else pid


def process_start(pid: int) -> str | None:
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


def alive(pid: int, start: str | None) -> bool:
    """Whether process ``pid`` (started at ``start``, if known) still runs."""
    if start is not None:
        return process_start(pid) == start
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def machine() -> str:
    """This machine and pid namespace: a pid means the same process only within both."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""  # no /proc: never compare pids
    return f"{boot}:{ns}"


def described() -> str:
    """This process as text another process can read back (:func:`visible`)."""
    pid = os.getpid()
    return f"{machine()}/{pid}/{process_start(pid) or ''}"


def visible(text: str) -> tuple[int, str | None] | None:
    """(pid, start time) of the process :func:`described` wrote ``text`` for, where this
    process can see it (the same machine and pid namespace: the pid names it here) and it
    is another; else None."""
    where, _, start = text.rpartition("/")
    where, _, pid = where.rpartition("/")
    here = machine()
    if not here or where != here or not (pid.isascii() and pid.isdigit()):
        return None
    if int(pid) == os.getpid():
        return None
    return int(pid), start or None
