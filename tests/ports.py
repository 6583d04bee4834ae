"""Free TCP ports for tests that must name one before a job binds it."""

from __future__ import annotations

import random
import socket

__all__ = ["free_port", "free_port_pair"]


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing is bound to on ``host`` right now, drawn below the kernel's range of
    ephemeral ports (see :func:`free_port_pair`)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    lo = _ephemeral_low()
    for _ in range(200):
        port = random.randrange(max(1024, lo - 20000), lo - 1)
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port on {host}")


def free_port_pair() -> int:
    """A port p such that p and p + 1 are both free on 127.0.0.1 (just now).

    Drawn below the kernel's range of ephemeral ports: a port from that range (what
    ``bind(0)`` gives) could be taken, between this look and the job's bind, as the local
    port of any connection another test opens (the store's port, p + 1, was taken so).
    """
    lo = _ephemeral_low()
    for _ in range(200):
        port = random.randrange(max(1024, lo - 20000), lo - 1)
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two consecutive free ports")


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
