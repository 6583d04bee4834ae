"""Host, port and interface helpers for everything in plait that speaks TCP.

The store (:mod:`plait.rendezvous.tcp_store`), the TCP transport and the launcher all
write, read and resolve ``host:port`` addresses, pick a local address, listen and connect.
These helpers do it one way for all of them: an IPv6 literal is written in brackets
(``[::1]:29400``) and accepted with or without them, an interface list has NCCL's syntax
(``PLAIT_SOCKET_IFNAME``), and a connection to a server that may not be up yet is retried
until a deadline. They raise ``OSError`` and ``ValueError`` only; each caller translates
them into its own errors (a store's ``RendezvousError``, a transport's ``TransportError``),
which know what was being done.

Note [one address, three spellings]
    ``"::1"`` is the address, ``"[::1]"`` the host of a URL or a command line, and
    ``"[::1]:29400"`` the address with its port. :func:`strip_brackets` takes the second
    to the first, :func:`format_address` the first to the third, :func:`parse_address`
    the third back to the first and the port. A host name is never bracketed.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = [
    "CONNECT_BACKOFF",
    "IfnameSpec",
    "connect",
    "family",
    "format_address",
    "interface_addresses",
    "is_loopback",
    "listen",
    "match_ifnames",
    "parse_address",
    "parse_ifname",
    "resolve",
    "route_to",
    "select_interface_address",
    "strip_brackets",
]

#: First and largest pause between connection attempts while nothing listens yet.
CONNECT_BACKOFF = (0.01, 0.25)
#: The least time one connection attempt is given, even with the deadline about to pass.
_MIN_ATTEMPT = 0.05
#: The most time one attempt is given: a server flooded with connections drops SYNs, and
#: the kernel resends a dropped one only after 1, 3, 7, ... s, so one attempt given the whole
#: patience lost it all to one dropped SYN; a new attempt starts afresh.
_MAX_ATTEMPT = 2.0
#: Linux ioctl that reads an interface's IPv4 address.
_SIOCGIFADDR = 0x8915


# -- addresses as text -------------------------------------------------------------------


def strip_brackets(host: str) -> str:
    """``host`` without the brackets of an IPv6 literal: ``"[::1]"`` -> ``"::1"``."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def format_address(host: str, port: int) -> str:
    """``host:port``, with an IPv6 literal in brackets: ``("::1", 80)`` -> ``"[::1]:80"``.

    A host already in brackets keeps them (it is not bracketed twice).
    """
    host = strip_brackets(host)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_address(text: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` -> ``(host, port)``, the brackets removed.

    Raises:
        ValueError: ``text`` has no ``:port`` or the port is not a number.
    """
    host, sep, port = text.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()):
        raise ValueError(f"malformed TCP address {text!r}: expected host:port or [v6]:port")
    return strip_brackets(host), int(port)


def family(host: str) -> socket.AddressFamily:
    """The socket family of a numeric address: IPv6 if it has a colon, else IPv4."""
    return socket.AF_INET6 if ":" in host else socket.AF_INET


# -- resolving and choosing a local address ---------------------------------------------


def resolve(host: str) -> str:
    """The numeric address ``host`` (a name, or a literal with or without brackets) names.

    Raises:
        ValueError: ``host`` cannot be resolved.
    """
    host = strip_brackets(host.strip())
    try:
        info = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ValueError(f"cannot resolve host {host!r}: {exc}") from exc
    return str(info[0][4][0])


def route_to(host: str) -> str:
    """The local address the kernel would use to reach ``host``; loopback for a local one.

    Nothing is sent (a UDP socket is connected only to pick the route). An unresolvable
    or unreachable host gives 127.0.0.1: the caller then listens where local peers reach it.
    """
    try:
        fam, _, _, _, sockaddr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        ip = ipaddress.ip_address(sockaddr[0])
        if ip.is_loopback or ip.is_unspecified:
            return "127.0.0.1" if ip.version == 4 else "::1"
        with socket.socket(fam, socket.SOCK_DGRAM) as s:
            s.connect(sockaddr)  # UDP: picks a route, sends nothing
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


@dataclass(frozen=True, slots=True)
class IfnameSpec:
    """A parsed NCCL-style interface list, e.g. ``"^docker,lo"``."""

    names: tuple[str, ...]  #: name prefixes (exact names when ``exact``)
    exclude: bool  #: the list says which interfaces *not* to use
    exact: bool  #: names must match exactly instead of by prefix


def parse_ifname(spec: str) -> IfnameSpec:
    """Parse ``PLAIT_SOCKET_IFNAME`` syntax: ``[^][=]name[,name...]``.

    ``"eth"`` selects interfaces whose names start with eth, ``"=eth0"`` only
    eth0, ``"^docker,lo"`` every interface except those starting with docker
    or lo.

    Raises:
        ValueError: the list names no interface.
    """
    text = spec.strip()
    exclude = text.startswith("^")
    if exclude:
        text = text[1:]
    exact = text.startswith("=")
    if exact:
        text = text[1:]
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise ValueError(f"interface list {spec!r} names no interface")
    return IfnameSpec(names, exclude, exact)


def match_ifnames(spec: str | IfnameSpec, names: Sequence[str]) -> list[str]:
    """The interfaces of ``names`` (in order) that ``spec`` selects."""
    s = parse_ifname(spec) if isinstance(spec, str) else spec

    def listed(name: str) -> bool:
        return any(name == n if s.exact else name.startswith(n) for n in s.names)

    return [n for n in names if listed(n) != s.exclude]


def interface_addresses(name: str) -> list[str]:
    """The usable addresses of interface ``name``: IPv4 first, then global/loopback IPv6.

    IPv4 comes from the ``SIOCGIFADDR`` ioctl, IPv6 from ``/proc/net/if_inet6``
    (Linux); link-local IPv6 addresses are left out (they need a scope id).
    """
    found: list[str] = []
    try:
        import fcntl

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = struct.pack("256s", name.encode()[:15])
            raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, packed)
            found.append(socket.inet_ntoa(raw[20:24]))
    except (OSError, ImportError):
        pass
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 6 and fields[5] == name and int(fields[3], 16) & 0x20 == 0:
                    found.append(str(ipaddress.IPv6Address(bytes.fromhex(fields[0]))))
    except OSError:
        pass
    return found


def select_interface_address(spec: str) -> str:
    """The first address of the first interface that ``spec`` selects and that has one.

    Raises:
        ValueError: no selected interface has a usable address (the message
            lists the machine's interfaces).
    """
    names = [n for _, n in socket.if_nameindex()]
    for name in match_ifnames(spec, names):
        addrs = interface_addresses(name)
        if addrs:
            return addrs[0]
    raise ValueError(
        f"no network interface with an address matches {spec!r} (interfaces here: {names}); "
        "set PLAIT_SOCKET_IFNAME or pass ifname= or host="
    )


# -- sockets -----------------------------------------------------------------------------


def listen(
    host: str,
    port: int,
    *,
    backlog: int,
    prepare: Callable[[socket.socket], None] | None = None,
) -> socket.socket:
    """A non-blocking socket listening on ``host:port`` (port 0: a free one).

    ``host`` may be a name, a literal in brackets or a wildcard (``0.0.0.0``, ``::``).
    ``prepare`` is called on the socket before it is bound (to size its buffers, say,
    which must happen before ``listen`` for the window scale to follow). The address
    is reusable at once after a previous listener on it closed (``SO_REUSEADDR``).

    Raises:
        OSError: the host cannot be resolved, or the address cannot be bound.
    """
    infos = socket.getaddrinfo(
        strip_brackets(host), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    fam, kind, proto, _, sockaddr = infos[0]
    sock = socket.socket(fam, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if prepare is not None:
            prepare(sock)
        sock.bind(sockaddr)
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def connect(host: str, port: int, patience: float) -> socket.socket:
    """A blocking TCP connection to ``host:port`` with ``TCP_NODELAY`` set.

    Refused or failed attempts are retried with a growing pause (``CONNECT_BACKOFF``)
    for ``patience`` seconds, because the server may start after its clients, and no
    attempt is given more than ``_MAX_ATTEMPT`` (a flooded server drops connections);
    with ``patience`` 0 there is one attempt. Retrying is the point here, so the pauses are
    sleeps: there is nothing to wait on until something listens.

    Raises:
        OSError: the last attempt's error, once ``patience`` has run out.
    """
    host = strip_brackets(host)
    deadline = time.monotonic() + patience
    delay, max_delay = CONNECT_BACKOFF
    while True:
        left = deadline - time.monotonic()
        try:
            attempt = max(min(left, _MAX_ATTEMPT), _MIN_ATTEMPT)
            sock = socket.create_connection((host, port), timeout=attempt)
        except OSError:
            left = deadline - time.monotonic()
            if left <= 0:
                raise
            time.sleep(min(delay, left))
            delay = min(2 * delay, max_delay)
            continue
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock


def is_loopback(address: str) -> bool:
    """Whether ``address`` (an IP literal, maybe bracketed) reaches only this machine.

    Wildcards (``0.0.0.0``, ``::``) are not loopback: they listen on every interface.
    An IPv4 address mapped into IPv6 (``::ffff:127.0.0.1``) counts as its IPv4 self;
    a string that is not an IP literal counts as not loopback.
    """
    try:
        ip = ipaddress.ip_address(strip_brackets(address).split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped.is_loopback
    return ip.is_loopback
