"""Which address a rank listens on, and how its sockets are tuned.

``host`` wins; otherwise ``ifname`` or ``PLAIT_SOCKET_IFNAME`` picks an interface with
NCCL's syntax (:mod:`plait._net`); otherwise the local address that routes to the
store's host (for stores with a ``host`` attribute), else 127.0.0.1 (one machine).
"""

from __future__ import annotations

import functools
import os
import socket

from plait import _net
from plait.rendezvous.store import Store
from plait.transport.tcp.wire import SOCKET_BUFFER

__all__ = ["choose_host", "store_host", "tune"]


def store_host(store: Store) -> str | None:
    """The host of a network store (following PrefixStore wrappers), if it has one."""
    seen = 0
    s: object = store
    while s is not None and seen < 16:
        host = getattr(s, "host", None)
        if isinstance(host, str) and host:
            return host
        s = getattr(s, "store", None)
        seen += 1
    return None


def choose_host(host: str | None, ifname: str | None, store: Store) -> str:
    """The numeric address to listen on and publish (see the module docstring).

    Raises:
        ValueError: ``host`` cannot be resolved, or no interface matches the list.
    """
    if host is not None:
        return _net.resolve(host)
    spec = ifname if ifname is not None else os.environ.get("PLAIT_SOCKET_IFNAME")
    if spec:
        return _net.select_interface_address(spec)
    at = store_host(store)
    return _net.route_to(at) if at else "127.0.0.1"


@functools.cache
def _autotune_max(opt: int) -> int:
    """Linux: the most the kernel grows a socket buffer by itself (0 if unknown)."""
    name = "tcp_wmem" if opt == socket.SO_SNDBUF else "tcp_rmem"
    try:
        with open(f"/proc/sys/net/ipv4/{name}") as f:
            return int(f.read().split()[2])
    except (OSError, ValueError, IndexError):
        return 0


def tune(sock: socket.socket) -> None:
    """Give ``sock`` at least SOCKET_BUFFER of send and receive buffer.

    Setting a size switches Linux's buffer autotuning off, which measured
    slower on loopback, so the size is set only where autotuning cannot reach
    SOCKET_BUFFER (``net.ipv4.tcp_wmem``/``tcp_rmem`` maximum below 4 MiB).
    Called before connect/listen, so that the window scale is negotiated for
    the big buffers.
    """
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        if _autotune_max(opt) >= SOCKET_BUFFER:
            continue
        try:
            if sock.getsockopt(socket.SOL_SOCKET, opt) < SOCKET_BUFFER:
                sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
        except OSError:
            pass
