"""A TCP transport between processes (or threads): one or more sockets per rank pair.

Bootstrap
    Each rank listens on an ephemeral port of one address (see *Addresses*),
    publishes ``host:port`` (``[v6]:port`` for IPv6) in the store under
    ``f"{prefix}/addr/{rank}"``, then rank i connects to every peer j < i and
    accepts from every peer j > i, ``streams`` connections per pair. The peers
    are all other ranks, or the ``peers`` given (a symmetric relation: a hybrid
    transport connects over TCP only to the ranks on other hosts). The
    connecting side sends a hello (magic, protocol version, stream index, its
    rank, size, streams); the accepting side checks it (garbage and strangers
    are dropped, the wait goes on) and answers with its own. Ranks that
    disagree on ``size`` or ``streams`` fail with
    :class:`~plait.errors.RendezvousError`; ranks that never show up within
    ``timeout`` fail with :class:`BootstrapTimeout`, which names them.

Wire format
    Every frame starts with a 24-byte header ``<kind u8, pad 3, check u32,
    tag u64, nbytes u64>``; what the fields hold depends on the kind::

        kind      stream  check  tag          nbytes        followed by
        DATA      0       check  tag          <= EAGER_MAX  the payload (part 0 if striped)
        PART      k >= 1  0      striped seq  n             part k of a striped payload
        BYE       0       0      0            0             -
        RTS       0       check  tag          > EAGER_MAX   the message id (u64)
        CTS       0       0      id           0             -
        REFUSE    0       0      id           0             -
        RDATA     0       check  id           1..CHUNK      a chunk of the payload (of part 0)
        WITHDRAW  0       0      id           0             -

    *Eager* messages, up to :data:`EAGER_MAX` bytes, go out at once as a
    ``DATA`` frame; the receiver buffers them if their receive is not posted
    yet. Larger messages use a *rendezvous*: the sender announces the message
    with ``RTS`` (request to send, carrying a per-pair message id); the
    receiver matches it like a ``DATA`` header, and once a receive is posted
    for it checks the length and check word against that receive and answers
    ``CTS`` (clear to send), or ``REFUSE`` when they differ (the receive fails
    with MismatchError, the send completes without sending the payload). On
    ``CTS`` the sender sends the payload as a run of ``RDATA`` frames, chunks
    of at most :data:`CHUNK` bytes in order (``RDATA`` is a kind of its own so
    that it can never be taken for an eager message); each lands straight in
    the posted receive's buffer. Between two chunks of a payload stream 0
    carries nothing but ``CTS``, ``REFUSE`` and ``WITHDRAW`` frames, which jump
    the send queue: a clear-to-send for a message coming the other way waits
    behind at most one chunk, so two ranks exchanging large messages over one
    connection send both ways at once (a payload sent as one frame held such a
    ``CTS`` back until its last byte, and the exchange ran one way, then the
    other). A sender that cancels a large send before its payload has started
    withdraws it: an ``RTS`` still in its send queue is dropped (the receiver
    never hears of the message), otherwise it sends ``WITHDRAW`` and the
    receiver forgets the message, answering ``REFUSE`` if no receive had taken
    it yet, or failing the receive that had taken it with MismatchError (a
    payload already begun, or a striped one already queued, is sent to its end
    from a private copy instead). Every ``RTS`` gets exactly one ``CTS`` or
    ``REFUSE``, so the sender knows when an id is settled. An unexpected
    rendezvous message costs the receiver a small record, nothing proportional
    to its length, so a peer can never make a rank allocate what a header
    announces, nor write beyond a posted buffer: an eager frame above
    :data:`EAGER_MAX`, an ``RDATA`` that was not cleared or whose check
    differs from its ``RTS``, an empty chunk or one longer than what is left
    of its payload, a chunk of another message or any frame but ``CTS``,
    ``REFUSE`` and ``WITHDRAW`` before a payload's last chunk, a ``WITHDRAW``
    of a payload that has begun, a ``CTS`` for an unknown id, and every other
    impossible frame are protocol errors that drop the peer
    (:class:`PeerProtocolError`; the other peers go on).

    A message of at least :data:`STRIPE_MIN` bytes on a pair with several
    streams is striped: stream k carries the contiguous part k (``PART``
    frame, whose tag field holds the per-pair sequence number of striped
    messages), stream 0 carries part 0 in the ``DATA`` frame or the ``RDATA``
    chunks. Small messages and control frames only use stream 0, and matching
    happens when stream 0 reads a ``DATA`` or ``RTS`` header, so receives
    match on (peer, tag) in send order whatever the striping and the protocol.
    ``BYE`` (sent by :meth:`TcpTransport.close`) says that the sender has
    closed; EOF or a reset without it means the peer died.

Data path
    A header that matches a posted receive sends the payload straight into the
    receive's buffer (``recv_into`` on a slice of it); small frames are read
    in batches through a 64 KiB staging buffer per stream and copied out.
    Inside a chunked payload the reader takes no more than the next header
    into the staging buffer, mostly in the same ``recvmsg_into`` call as the
    end of the chunk before it, so every chunk lands in the receive's buffer
    directly too. An eager message that arrives before its receive is posted
    is read into a ``bytearray`` of exactly its length (at most
    :data:`EAGER_MAX`), copied on match (the only extra copy); when the
    receive is posted while such a message is still arriving, the bytes so far
    are copied and the rest lands in the receive directly. Sends go out with
    ``sendmsg([header, payload])``, straight from ``isend`` when the socket
    has room; the rest waits for the socket to drain. A chunked payload is one
    entry of the send queue, handing up to 4 MiB of chunks with their headers
    to one ``sendmsg``. ``CTS``, ``REFUSE`` and ``WITHDRAW`` jump the send
    queue: they go before every frame not started yet, between two chunks of
    a payload that has started, never into a frame already started. So a large
    payload going one way delays the handshake of a message coming the other
    way by at most one :data:`CHUNK`, plus what the kernel holds already in
    the socket's buffer and the queues in front of the link (a
    ``TCP_NOTSENT_LOWAT`` to shrink the first measured slower on loopback and
    no faster on 200 Mbit/s links, where the link's queue holds more).

Progress model
    There is no background thread: bytes move only inside
    :meth:`TcpTransport.wait_any` (and opportunistically inside ``isend`` and
    ``irecv``, which try the non-blocking send or receive at once), or in the
    :class:`~plait.transport.base.Drivable` hooks when another object drives
    the transport. One ``selectors`` selector watches every socket, for
    reading always (stream 0) and for writing while a send is queued, so both
    directions progress together. Several threads may use one transport: a
    lock guards all state, and one thread at a time *drives* progress. The
    driver releases the lock only while it blocks in ``select()`` (or, for an
    outside driver, between :meth:`~TcpTransport.begin_sleep` and
    :meth:`~TcpTransport.end_sleep`); meanwhile other threads may post
    operations (sends are queued and the driver is woken through a socket
    pair, which the selector watches) but never touch sockets, and every
    completion they cause wakes the driver the same way. A thread waiting
    while another drives sleeps on a condition variable; the driver notifies
    it whenever handles complete and when it stops driving, and the waiter
    then takes over. Frames that the read path must send (``CTS``, a payload
    on ``CTS``) are queued and written without blocking at the end of the
    round, so a rank waiting for a ``CTS`` keeps reading all its sockets.
    Nothing busy-waits: with nothing to do, the driver blocks in ``select()``
    until its timeout.

Addresses
    ``host`` wins; otherwise ``ifname`` or ``PLAIT_SOCKET_IFNAME`` picks an
    interface with NCCL's syntax (``"eth0"``: names starting with eth0;
    ``"=eth0"``: exactly eth0; ``"^docker,lo"``: anything but these prefixes);
    otherwise the local address that routes to the store's host (for stores
    with a ``host`` attribute), else 127.0.0.1 (one machine). Stores without
    a host spanning several machines (a file store on a shared file system)
    need ``host`` or ``PLAIT_SOCKET_IFNAME``.

Socket buffers
    Every connection gets at least :data:`SOCKET_BUFFER` (4 MiB) of send and
    receive buffer, so a large message keeps the link busy while the
    receiving rank is between ``wait_any`` calls. Where Linux's autotuning can
    grow the buffers that far by itself (``net.ipv4.tcp_wmem``/``tcp_rmem``
    maximum >= 4 MiB, the usual case) it is left in charge, since setting
    ``SO_SNDBUF``/``SO_RCVBUF`` switches it off and measured slower on
    loopback; elsewhere both are set to 4 MiB (capped by
    ``net.core.wmem_max``/``rmem_max``). Every connection sets
    ``TCP_NODELAY`` so small messages go out at once.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hmac
import ipaddress
import logging
import math
import os
import selectors
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from plait import _auth
from plait.errors import (
    ClosedError,
    CommError,
    CommTimeout,
    MismatchError,
    PeerLostError,
    RendezvousError,
    TransportError,
)
from plait.rendezvous.store import Store, StoreTimeout
from plait.transport.base import Handle, may_spin, spin_seconds

_log = logging.getLogger("plait")

__all__ = [
    "CHUNK",
    "EAGER_MAX",
    "MAX_STREAMS",
    "SOCKET_BUFFER",
    "STRIPE_MIN",
    "BootstrapTimeout",
    "IfnameSpec",
    "PeerProtocolError",
    "TcpTransport",
    "interface_addresses",
    "match_ifnames",
    "parse_ifname",
    "select_interface_address",
]

#: Messages of at least this many bytes are striped over all streams of a pair.
STRIPE_MIN = 256 * 1024
#: Largest message sent eagerly; larger ones wait for the receiver's clear-to-send.
#:
#: This bounds what one unexpected message can make a receiver allocate (and
#: what a peer may announce in a ``DATA`` header). Below it a message costs no
#: handshake, which matters for the latency-bound small messages of
#: collectives. Above it the handshake costs about one small-message round
#: trip (0.1 ms between two Python processes on one host), which the payload
#: repays: moving 512 KiB takes longer than that, and the payload lands in the
#: posted receive instead of an unexpected-message buffer that must be
#: allocated and copied out; measured on loopback, messages from 512 KiB up
#: stream at least as fast with the handshake as without. It also stays well
#: under :data:`SOCKET_BUFFER`, so an eager send completes into the kernel's
#: buffer even while its receiver is busy elsewhere.
EAGER_MAX = 512 * 1024
#: Largest frame of a rendezvous payload on stream 0, in bytes.
#:
#: A payload (part 0 of it, if striped) goes out as ``RDATA`` frames of at most
#: this many bytes, and the frames that answer or withdraw an announcement
#: (``CTS``, ``REFUSE``, ``WITHDRAW``) may go between two of them. A clear-to-send
#: for a message coming the other way thus waits behind at most one chunk in
#: this rank's queue, instead of behind a whole payload: two ranks exchanging
#: large messages over one connection send both ways at once. Smaller chunks
#: cut that wait (one chunk at 25 MB/s is 20 ms) but cost a header, a send
#: call and a receive call each; 512 KiB measured as fast as one frame per
#: payload on loopback.
CHUNK = 512 * 1024
#: SO_SNDBUF and SO_RCVBUF asked for on every connection, in bytes.
SOCKET_BUFFER = 4 * 1024 * 1024
#: Most connections per rank pair.
MAX_STREAMS = 64
#: Seconds :meth:`TcpTransport.close` spends at most flushing queued sends and the goodbye.
CLOSE_FLUSH_SECONDS = 2.0

_MAGIC = b"PLTC"
_VERSION = 3  # 2: eager limit and rendezvous for large messages; 3: chunked RDATA
_HELLO = struct.Struct("<4sHHIII")  # magic, version, stream index, rank, size, streams
_HDR = struct.Struct("<BxxxIQQ")  # kind, check, tag (or striped sequence number), nbytes
_HDR_SIZE = _HDR.size
_ID = struct.Struct("<Q")  # the message id that follows an RTS header
_RTS_SIZE = _HDR_SIZE + _ID.size
_DATA, _PART, _BYE, _RTS, _CTS, _REFUSE, _RDATA, _WITHDRAW = 1, 2, 3, 4, 5, 6, 7, 8
_KIND_NAMES = {
    _DATA: "DATA",
    _PART: "PART",
    _BYE: "BYE",
    _RTS: "RTS",
    _CTS: "CTS",
    _REFUSE: "REFUSE",
    _RDATA: "RDATA",
    _WITHDRAW: "WITHDRAW",
}
_EMPTY = memoryview(b"")
_STAGE = 64 * 1024  # per-stream staging buffer for batched reads of small frames
_DIRECT_MIN = 16 * 1024  # payload left at least this large: recv straight into the target
_SCRATCH = 256 * 1024  # discard buffer for payloads nobody wants any more
_GATHER = 64  # most buffers handed to one sendmsg
_BATCH = 4 << 20  # most bytes of a chunked payload handed to one sendmsg
#: Seconds a waiting rank polls its sockets (select with no timeout) before it blocks.
_SPIN = 50e-6
_RETRY = 0.05  # seconds between connection attempts while a peer is not listening yet
_READ, _WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE
_TIOCOUTQ = 0x5411  # Linux: bytes in a socket's send queue not yet acknowledged
_LOST_ERRNOS = frozenset(
    {
        errno.ECONNRESET,
        errno.EPIPE,
        errno.ECONNABORTED,
        errno.ETIMEDOUT,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
        errno.ENETDOWN,
        errno.ENOTCONN,
    }
)


class BootstrapTimeout(RendezvousError, CommTimeout):
    """Ranks did not all connect within the timeout; the message names the missing ones."""


class PeerProtocolError(PeerLostError, TransportError):
    """A peer sent a frame that breaks the wire protocol; it now counts as lost.

    Both a :class:`~plait.errors.PeerLostError` (its connections are closed and
    every operation with it fails) and a :class:`~plait.errors.TransportError`
    (the cause is not a closed or dead process but a buggy or hostile peer).
    """


# -- interface selection (pure functions, tested alone) -------------------------------------


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
            raw = fcntl.ioctl(s.fileno(), 0x8915, packed)  # SIOCGIFADDR
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


def _store_host(store: Store) -> str | None:
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


def _route_to(host: str) -> str:
    """The local address the kernel would use to reach ``host``; 127.0.0.1 for a local one."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        ip = ipaddress.ip_address(sockaddr[0])
        if ip.is_loopback or ip.is_unspecified:
            return "127.0.0.1" if ip.version == 4 else "::1"
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(sockaddr)  # UDP: picks a route, sends nothing
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def _choose_host(host: str | None, ifname: str | None, store: Store) -> str:
    if host is not None:
        host = host.strip()
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        try:
            info = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise ValueError(f"cannot resolve host={host!r}: {exc}") from exc
        return str(info[0][4][0])
    spec = ifname if ifname is not None else os.environ.get("PLAIT_SOCKET_IFNAME")
    if spec:
        return select_interface_address(spec)
    store_host = _store_host(store)
    return _route_to(store_host) if store_host else "127.0.0.1"


def _format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _parse_address(text: str) -> tuple[str, int]:
    """``"h:p"`` or ``"[v6]:p"`` -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise RendezvousError(f"malformed TCP address {text!r} in the store")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


@functools.cache
def _autotune_max(opt: int) -> int:
    """Linux: the most the kernel grows a socket buffer by itself (0 if unknown)."""
    name = "tcp_wmem" if opt == socket.SO_SNDBUF else "tcp_rmem"
    try:
        with open(f"/proc/sys/net/ipv4/{name}") as f:
            return int(f.read().split()[2])
    except (OSError, ValueError, IndexError):
        return 0


def _tune(sock: socket.socket) -> None:
    """Give ``sock`` at least SOCKET_BUFFER of send and receive buffer.

    Setting a size switches Linux's buffer autotuning off, which measured
    slower on loopback, so the size is set only where autotuning cannot reach
    SOCKET_BUFFER. Called before connect/listen, so that the window scale is
    negotiated for the big buffers.
    """
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        if _autotune_max(opt) >= SOCKET_BUFFER:
            continue
        try:
            if sock.getsockopt(socket.SOL_SOCKET, opt) < SOCKET_BUFFER:
                sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
        except OSError:
            pass


def _streams_from(streams: int | None) -> int:
    if streams is None:
        text = os.environ.get("PLAIT_TCP_STREAMS", "1")
        try:
            streams = int(text)
        except ValueError:
            raise ValueError(f"PLAIT_TCP_STREAMS={text!r} is not an integer") from None
    if isinstance(streams, bool) or not isinstance(streams, int):
        raise TypeError(f"streams must be an int, got {type(streams).__name__}")
    if not 1 <= streams <= MAX_STREAMS:
        raise ValueError(f"streams must be between 1 and {MAX_STREAMS}, got {streams}")
    return streams


def _peers_from(peers: Collection[int] | None, rank: int, size: int) -> frozenset[int]:
    """The ranks to connect to: ``peers`` checked, without ``rank``; all others for None."""
    if peers is None:
        return frozenset(range(size)) - {rank}
    out = set()
    for j in peers:
        if isinstance(j, bool) or not hasattr(j, "__index__"):
            raise TypeError(f"peers must hold ints (ranks), got {j!r}")
        j = j.__index__()
        if not 0 <= j < size:
            raise ValueError(f"peers lists rank {j}; expected 0 <= rank < {size}")
        out.add(j)
    out.discard(rank)
    return frozenset(out)


def _part(nbytes: int, streams: int, k: int) -> tuple[int, int]:
    """Byte range [lo, hi) of part k when ``nbytes`` are striped over ``streams``."""
    chunk = -(-nbytes // streams)
    chunk = (chunk + 4095) & ~4095  # page-aligned parts
    lo = min(k * chunk, nbytes)
    return lo, min(lo + chunk, nbytes)


# -- bootstrap ---------------------------------------------------------------------------------


class _Dial:
    """One outgoing connection being set up (to ``peer``, stream ``stream``)."""

    __slots__ = ("addr", "buf", "error", "nonces", "peer", "retry_at", "sock", "stage", "stream")

    def __init__(self, peer: int, stream: int, addr: tuple[str, int]) -> None:
        self.peer = peer
        self.stream = stream
        self.addr = addr
        self.sock: socket.socket | None = None
        self.buf = b""
        # 0: connecting; 1: reading the challenge; 2: reading the proof and hello answer.
        self.stage = 0
        self.nonces = (b"", b"")  # (server's, ours) once the challenge is answered
        self.retry_at = 0.0
        self.error: str | None = None


class _Answer:
    """One accepted connection whose authentication and hello have not been read yet."""

    __slots__ = ("buf", "nonce", "sock")

    def __init__(self, sock: socket.socket, nonce: bytes) -> None:
        self.sock = sock
        self.buf = b""
        self.nonce = nonce  # our challenge, which the client must answer


def _bootstrap(
    rank: int,
    size: int,
    streams: int,
    store: Store,
    prefix: str,
    timeout: float,
    host: str,
    peers: frozenset[int],
) -> tuple[str, dict[tuple[int, int], socket.socket]]:
    """Connect rank ``rank`` to its ``peers``; returns (published address, {(peer, stream): sock}).

    Raises:
        BootstrapTimeout: some ranks did not publish, connect or answer in time.
        RendezvousError: ranks disagree on size or streams, or an address is malformed.
        TransportError: this rank cannot listen on ``host``.
    """
    deadline = time.monotonic() + timeout
    secret = _auth.secret()
    done: dict[tuple[int, int], socket.socket] = {}
    listener = socket.socket(_family(host), socket.SOCK_STREAM)
    sel = selectors.DefaultSelector()
    dials: list[_Dial] = []
    answers: list[_Answer] = []
    try:
        _tune(listener)
        try:
            listener.bind((host, 0))
            backlog = min(socket.SOMAXCONN, max(16, sum(j > rank for j in peers) * streams))
            listener.listen(backlog)
        except OSError as exc:
            raise TransportError(f"rank {rank}: cannot listen on {host!r}: {exc}") from exc
        listener.setblocking(False)
        address = _format_address(host, listener.getsockname()[1])
        store.set(f"{prefix}/addr/{rank}", address.encode())

        lower = sorted(j for j in peers if j < rank)
        keys = [f"{prefix}/addr/{j}" for j in lower]
        if keys:
            try:
                store.wait(keys, max(deadline - time.monotonic(), 0.0))
            except StoreTimeout as exc:
                missing = [j for j, k in zip(lower, keys, strict=True) if not store.check([k])]
                raise BootstrapTimeout(
                    f"rank {rank}: rank(s) {missing} never published their address "
                    f"(store keys {prefix}/addr/<rank>) within {timeout} s"
                ) from exc
        for j, key in zip(lower, keys, strict=True):
            addr = _parse_address(store.get(key).decode())
            dials.extend(_Dial(j, s, addr) for s in range(streams))
        expected = {(j, s) for j in peers if j > rank for s in range(streams)}
        sel.register(listener, _READ, None)

        def start(d: _Dial) -> None:
            sock = socket.socket(_family(d.addr[0]), socket.SOCK_STREAM)
            _tune(sock)
            sock.setblocking(False)
            err = sock.connect_ex(d.addr)
            if err not in (0, errno.EINPROGRESS):
                sock.close()
                retry(d, os.strerror(err))
                return
            d.sock = sock
            d.buf = b""
            d.stage = 0
            sel.register(sock, _WRITE, d)

        def retry(d: _Dial, why: str) -> None:
            if d.sock is not None:
                sel.unregister(d.sock)
                d.sock.close()
                d.sock = None
            d.error = why
            d.retry_at = time.monotonic() + _RETRY
            with contextlib.suppress(RendezvousError):  # the peer may have a new address
                d.addr = _parse_address(store.get(f"{prefix}/addr/{d.peer}", 0.0).decode())

        def check_peer(what: str, fields: tuple[Any, ...], peer: int) -> None:
            if fields[4] != size or fields[5] != streams:
                raise RendezvousError(
                    f"rank {rank}: {what} rank {peer} disagrees on the setup: it has "
                    f"size={fields[4]}, streams={fields[5]}; this rank has size={size}, "
                    f"streams={streams} (set PLAIT_TCP_STREAMS alike on every rank)"
                )

        for d in dials:
            start(d)
        waiting = list(dials)
        while waiting or len(done) < len(dials) + len(expected):
            now = time.monotonic()
            if now >= deadline:
                out = sorted({d.peer for d in dials if (d.peer, d.stream) not in done})
                inc = sorted({j for j, s in expected if (j, s) not in done})
                parts = []
                if inc:
                    parts.append(f"no connection from rank(s) {inc}")
                if out:
                    errs = sorted({d.error for d in dials if d.error})
                    parts.append(f"could not connect to rank(s) {out} (last errors: {errs})")
                raise BootstrapTimeout(
                    f"rank {rank}: TCP bootstrap did not finish within {timeout} s: "
                    + "; ".join(parts)
                )
            wake = deadline
            for d in waiting:
                if d.sock is None:
                    if d.retry_at <= now:
                        start(d)
                    if d.sock is None:
                        wake = min(wake, d.retry_at)
            for sk, _ in sel.select(max(wake - time.monotonic(), 0.0)):
                item = sk.data
                if item is None:  # the listener: accept everything pending
                    while True:
                        try:
                            sock, _ = listener.accept()
                        except BlockingIOError:
                            break
                        except OSError:
                            break
                        sock.setblocking(False)
                        hello, nonce = _auth.challenge()
                        try:
                            sock.send(hello)  # a few bytes into a fresh socket's buffer
                        except OSError:
                            sock.close()
                            continue
                        a = _Answer(sock, nonce)
                        answers.append(a)
                        sel.register(sock, _READ, a)
                elif isinstance(item, _Answer):
                    want = _auth.RESPONSE_BYTES + _HELLO.size
                    try:
                        chunk = item.sock.recv(want - len(item.buf))
                    except BlockingIOError:
                        continue
                    except OSError:
                        chunk = b""
                    item.buf += chunk
                    if chunk and len(item.buf) < want:
                        continue
                    sel.unregister(item.sock)
                    answers.remove(item)
                    proof = (
                        _auth.check_response(secret, item.nonce, item.buf[: _auth.RESPONSE_BYTES])
                        if len(item.buf) == want
                        else None
                    )
                    if proof is None:  # wrong secret or garbage: drop it and keep waiting
                        _log.warning(
                            "rank %d: dropped a connection that failed authentication", rank
                        )
                        item.sock.close()
                        continue
                    fields = _HELLO.unpack(item.buf[_auth.RESPONSE_BYTES :])
                    if fields[0] != _MAGIC or fields[1] != _VERSION:
                        item.sock.close()
                        continue
                    reply = proof + _HELLO.pack(_MAGIC, _VERSION, fields[2], rank, size, streams)
                    if fields[4] != size or fields[5] != streams:
                        with contextlib.suppress(OSError):  # tell the other side too, then fail
                            item.sock.send(reply)
                        item.sock.close()
                        check_peer("connecting", fields, fields[3])
                    src = (fields[3], fields[2])
                    if src not in expected or src in done:
                        if fields[3] not in peers and 0 <= fields[3] < size and fields[3] != rank:
                            _log.warning(
                                "rank %d: dropped a connection from rank %d, which is not "
                                "among this rank's peers (peers= must be symmetric)",
                                rank,
                                fields[3],
                            )
                        item.sock.close()  # a stranger or a duplicate
                        continue
                    try:
                        item.sock.send(reply)
                    except OSError:
                        item.sock.close()
                        continue
                    done[src] = item.sock
                else:
                    d = item
                    assert d.sock is not None
                    if d.stage == 0:  # connect finished (or failed)
                        err = d.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                        if err:
                            retry(d, os.strerror(err))
                            continue
                        d.stage = 1
                        sel.modify(d.sock, _READ, d)
                        continue
                    want = _auth.CHALLENGE_BYTES if d.stage == 1 else _auth.MAC + _HELLO.size
                    try:
                        chunk = d.sock.recv(want - len(d.buf))
                    except BlockingIOError:
                        continue
                    except OSError as exc:
                        retry(d, str(exc))
                        continue
                    if not chunk:
                        retry(
                            d,
                            "connection closed during the handshake "
                            "(did the peer reject our PLAIT_SECRET?)",
                        )
                        continue
                    d.buf += chunk
                    if len(d.buf) < want:
                        continue
                    if d.stage == 1:  # the challenge: answer it and say hello
                        if not d.buf.startswith(_auth.MAGIC):
                            retry(d, f"{d.addr} does not speak plait's protocol")
                            continue
                        server_nonce = d.buf[len(_auth.MAGIC) :]
                        ours = os.urandom(_auth.NONCE)
                        d.nonces = (server_nonce, ours)
                        try:
                            d.sock.send(
                                ours
                                + _auth.client_proof(secret, server_nonce, ours)
                                + _HELLO.pack(_MAGIC, _VERSION, d.stream, rank, size, streams)
                            )
                        except OSError as exc:
                            retry(d, str(exc))
                            continue
                        d.buf = b""
                        d.stage = 2
                        continue
                    if not hmac.compare_digest(
                        d.buf[: _auth.MAC], _auth.server_proof(secret, *d.nonces)
                    ):
                        sel.unregister(d.sock)
                        d.sock.close()
                        d.sock = None
                        raise _auth.AuthError(
                            f"rank {rank}: {d.addr}, published as rank {d.peer}, failed "
                            "authentication: it does not know this job's PLAIT_SECRET"
                        )
                    fields = _HELLO.unpack(d.buf[_auth.MAC :])
                    if (
                        fields[0] != _MAGIC
                        or fields[1] != _VERSION
                        or fields[2] != d.stream
                        or fields[3] != d.peer
                    ):
                        retry(d, f"{d.addr} answered with something other than rank {d.peer}")
                        continue
                    sel.unregister(d.sock)
                    check_peer("accepting", fields, d.peer)
                    done[(d.peer, d.stream)] = d.sock
                    d.sock = None
                    waiting.remove(d)
        return address, done
    except BaseException:
        for sock in done.values():
            sock.close()
        for d in dials:
            if d.sock is not None:
                d.sock.close()
        raise
    finally:
        for a in answers:
            a.sock.close()
        sel.close()
        listener.close()


# -- runtime state -------------------------------------------------------------------------------


class _Op:
    """A send or receive handle (see :class:`plait.transport.base.Handle`)."""

    __slots__ = ("buf", "check", "done", "error", "is_send", "left", "peer", "rec", "tag")

    def __init__(self, peer: int, tag: int, buf: memoryview, check: int, is_send: bool) -> None:
        self.peer = peer
        self.tag = tag
        self.buf = buf
        self.check = check
        self.is_send = is_send
        self.done = False
        self.error: BaseException | None = None
        self.left = 1  # sends: parts not fully written yet
        self.rec: _Inbound | None = None  # receives: the message being read into buf

    def __repr__(self) -> str:
        kind = "send to" if self.is_send else "recv from"
        state = "failed" if self.error else "done" if self.done else "pending"
        return f"<tcp {kind} rank {self.peer} tag {self.tag} {self.buf.nbytes} B {state}>"


class _Inbound:
    """A message coming from a peer: matched to a receive, unexpected, or being discarded."""

    __slots__ = ("check", "complete", "left", "nbytes", "op", "peer", "seq", "view")

    def __init__(self, peer: _Peer | None, check: int, nbytes: int) -> None:
        self.peer = peer
        self.check = check
        self.nbytes = nbytes
        self.op: _Op | None = None  # the receive it was matched to
        self.view: memoryview | None = None  # where the payload goes; None = discard
        self.left = 1  # parts still arriving
        self.seq = -1  # sequence number among the pair's striped messages
        self.complete = False  # unexpected and fully arrived


class _Rts:
    """A rendezvous message announced by a peer whose receive is not posted yet.

    All a receiver keeps for it (a few dozen bytes): the payload stays with the
    sender until a receive is posted and cleared.
    """

    __slots__ = ("check", "nbytes", "peer", "rid", "tag")

    def __init__(self, peer: _Peer, check: int, tag: int, nbytes: int, rid: int) -> None:
        self.peer = peer
        self.check = check
        self.tag = tag
        self.nbytes = nbytes
        self.rid = rid


class _Out:
    """One frame queued on a connection, or a rendezvous payload sent as a run of chunks.

    A chunked payload stays one queue entry: ``data`` is the chunk being sent
    (``hdr`` its header), ``rest`` what follows it (None for the last chunk or
    an ordinary frame); when a chunk is written the entry moves on to the next.
    """

    __slots__ = ("data", "hdr", "off", "op", "rest", "sent", "total", "urgent")

    def __init__(self, op: _Op | None, hdr: bytes, data: memoryview, off: int) -> None:
        self.op = op
        self.hdr = hdr
        self.data = data
        self.off = off  # bytes of header + data already written
        self.total = _HDR_SIZE + data.nbytes
        self.rest: memoryview | None = None  # chunked payload: the bytes after this chunk
        self.sent = 0  # chunked payload: bytes of the chunks already written
        self.urgent = False  # CTS, REFUSE, WITHDRAW: goes before every frame not started

    def started(self) -> bool:
        """Whether some of it is on the wire already (it must then go out whole)."""
        return self.off > 0 or self.sent > 0


class _Conn:
    """One socket to a peer, with its read state and send queue."""

    __slots__ = (
        "cid",
        "cont",
        "due",
        "end",
        "events",
        "greedy",
        "hi",
        "index",
        "lo",
        "peer",
        "pos",
        "rec",
        "sendq",
        "sock",
        "stage",
        "stop",
    )

    def __init__(self, peer: _Peer, index: int, sock: socket.socket) -> None:
        self.peer = peer
        self.index = index
        self.sock: socket.socket | None = sock
        self.events = 0
        self.sendq: deque[_Out] = deque()
        # Stream 0 reads greedily (many small frames per recv); the others read exactly
        # one part at a time, and only while a striped message owes them a part.
        self.greedy = index == 0
        self.stage = memoryview(bytearray(_STAGE if self.greedy else _HDR_SIZE))
        self.lo = 0
        self.hi = 0
        self.rec: _Inbound | None = None  # message whose payload is being read
        self.pos = 0  # next byte of rec to read
        self.end = 0  # end of the frame being read
        self.stop = 0  # end of the part being read (beyond end while more chunks follow)
        # Stream 0, between two chunks of a rendezvous payload: its message and id. Only
        # its next chunk or a CTS, REFUSE or WITHDRAW may come until it is complete.
        self.cont: _Inbound | None = None
        self.cid = -1
        self.due: deque[_Inbound] = deque()  # striped messages whose part comes on this stream


class _Peer:
    """Another rank: its connections and the state of the rendezvous messages with it."""

    __slots__ = (
        "cleared",
        "conns",
        "dead",
        "gone",
        "rank",
        "rid_in",
        "rid_out",
        "rts_in",
        "rts_out",
        "seq_in",
        "seq_out",
    )

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.conns: list[_Conn] = []
        self.gone: BaseException | None = None  # set once it said goodbye or was lost
        self.dead = False  # its connections are closed
        self.seq_in = 0  # striped messages: sequence numbers in PART frames
        self.seq_out = 0
        # Sending: ids of our RTS frames, and the sends waiting for their answer (CTS or
        # REFUSE) with their RTS frame; the op is None once withdrawn (a tombstone kept
        # until the answer comes, so that the answer is not taken for a protocol error).
        self.rid_out = 0
        self.rts_out: dict[int, tuple[_Op | None, _Out]] = {}
        # Receiving: the last RTS id seen (ids only grow), the announced messages that no
        # receive has taken yet, and those cleared (CTS sent) whose RDATA has not begun.
        self.rid_in = -1
        self.rts_in: dict[int, _Rts] = {}
        self.cleared: dict[int, _Inbound] = {}


def _bytes_view(data: object, writable: bool) -> memoryview:
    mv = data if isinstance(data, memoryview) else memoryview(data)  # type: ignore[arg-type]
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    if writable and mv.readonly:
        raise ValueError("the receive buffer is read-only")
    return mv


class TcpTransport:
    """Rank ``rank``'s end of a TCP mesh; see the module docstring and :mod:`plait.transport.base`.

    Construction blocks until every peer has connected (or ``timeout`` passes).
    All methods are thread-safe; bytes move only while some thread is inside
    :meth:`wait_any` (or ``isend``/``irecv``/:meth:`close`), or while another
    object drives the transport through :meth:`poll` and
    :meth:`begin_sleep`/:meth:`end_sleep` (the
    :class:`~plait.transport.base.Drivable` hooks).

    Attributes:
        rank: this rank.
        size: number of ranks.
        peers: the other ranks this one is connected to.
        streams: connections per rank pair.
        address: the address this rank listens on, as published in the store.
        bytes_sent: payload bytes handed to :meth:`isend` so far.
        bytes_received: payload bytes delivered into receives so far.
        spin: seconds a waiting thread polls its sockets before it blocks in
            select (default 50 µs, or PLAIT_TCP_SPIN microseconds; 0 blocks at
            once; background threads never poll).

    Args:
        rank: this rank, 0 <= rank < size.
        size: number of ranks.
        store: the store all ranks share; keys ``f"{prefix}/addr/{rank}"`` are written.
        timeout: seconds the bootstrap may take.
        host: address to listen on and publish (a concrete address, not a wildcard).
        ifname: NCCL-style interface selection (overrides ``PLAIT_SOCKET_IFNAME``).
        streams: connections per rank pair (default ``PLAIT_TCP_STREAMS`` or 1);
            messages of at least :data:`STRIPE_MIN` bytes are striped over them.
        prefix: store key prefix; use a fresh one per transport in a long-lived store.
        peers: the ranks to connect to (None: all others; this rank itself may be
            listed and is ignored). The relation must be symmetric: if rank a
            lists b, b lists a. Operations with other ranks (but this one) raise
            ValueError.

    Raises:
        ValueError: a bad argument, or no interface matches ``ifname``.
        TypeError: ``streams`` is not an int, or ``peers`` holds something else than ints.
        BootstrapTimeout: some ranks never showed up (they are named).
        RendezvousError: ranks disagree on ``size`` or ``streams``.
        TransportError: this rank cannot listen on the chosen address.
    """

    def __init__(
        self,
        rank: int,
        size: int,
        store: Store,
        *,
        timeout: float = 300.0,
        host: str | None = None,
        ifname: str | None = None,
        streams: int | None = None,
        prefix: str = "tcp",
        peers: Collection[int] | None = None,
    ) -> None:
        if size < 1:
            raise ValueError(f"size must be at least 1, got {size}")
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is out of range; expected 0 <= rank < {size}")
        if not timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        self.rank = rank
        self.size = size
        self.peers = _peers_from(peers, rank, size)
        self.streams = _streams_from(streams)
        self.timeout = float(timeout)
        self.bytes_sent = 0
        self.bytes_received = 0
        self.spin = _spin_from_env()
        bind = _choose_host(host, ifname, store)
        self.address, socks = _bootstrap(
            rank, size, self.streams, store, prefix, self.timeout, bind, self.peers
        )

        try:
            self._setup(socks)
        except BaseException:
            for sock in socks.values():
                sock.close()
            for name in ("_sel", "_wake_r", "_wake_w"):
                obj = getattr(self, name, None)
                if obj is not None:
                    obj.close()
            raise

    def _setup(self, socks: dict[tuple[int, int], socket.socket]) -> None:
        size = self.size
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._posted: dict[tuple[int, int], deque[_Op]] = {}
        # Messages that arrived before their receive: eager ones (buffered) and
        # announced rendezvous ones, in arrival order per (peer, tag).
        self._unexpected: dict[tuple[int, int], deque[_Inbound | _Rts]] = {}
        self._driving = False  # some thread (or an outside driver) is driving progress
        self._in_select = False  # ... and is blocked in select() without the lock
        self._closing = False
        self._closed = False
        self._notify = False  # handles completed since the last notify_all
        self._stirred = False  # something completed since the last poll() (Drivable)
        # Conns given frames that nobody has tried to write yet: sends queued while the
        # driver was in select(), frames queued by the read path (CTS, payloads).
        self._kick: list[_Conn] = []
        self._scratch = memoryview(bytearray(_SCRATCH))
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, _READ, None)
        self._peers: list[_Peer | None] = [None] * size
        for j in sorted(self.peers):
            p = _Peer(j)
            for s in range(self.streams):
                sock = socks[(j, s)]
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                p.conns.append(_Conn(p, s, sock))
            self._peers[j] = p
            self._set_events(p.conns[0], _READ)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"<TcpTransport rank {self.rank} of {self.size} at {self.address}, "
            f"{self.streams} stream(s), {state}>"
        )

    # -- contract ------------------------------------------------------------------------
    def isend(self, peer: int, tag: int, data: memoryview, check: int) -> _Op:
        """Start sending ``data`` to ``peer``; see :meth:`plait.transport.base.Transport.isend`.

        Messages of at most :data:`EAGER_MAX` bytes go out at once; larger ones
        are announced and sent once the receiver has posted their receive.

        Raises:
            ValueError: ``peer`` out of range or not among :attr:`peers`, or
                ``tag``/``check`` do not fit the header.
        """
        mv = data
        if mv.__class__ is not memoryview or mv.format != "B" or mv.ndim != 1:
            mv = _bytes_view(data, False)
        nbytes = mv.nbytes
        if not 0 <= peer < self.size:
            self._check_peer(peer)
        try:
            hdr = _HDR.pack(_DATA, check, tag, nbytes)
        except struct.error:
            raise ValueError(
                f"tag {tag} or check {check} out of range (tag < 2**64, check < 2**32)"
            ) from None
        op = _Op(peer, tag, mv, check, True)
        with self._lock:
            p = self._peers[peer]
            if p is None and peer != self.rank:
                raise self._not_a_peer(peer)
            self.bytes_sent += nbytes
            if self._closing:
                self._fail(op, self._closed_error())
            elif p is None:
                self._send_self(op)
            else:
                if p.gone is not None:
                    self._fail(op, p.gone)
                elif nbytes > EAGER_MAX:
                    self._send_rts(p, op)
                elif self.streams == 1 or nbytes < STRIPE_MIN:
                    c = p.conns[0]
                    if c.sendq or self._in_select:
                        c.sendq.append(_Out(op, hdr, mv, 0))
                        self._queued(c)
                    else:  # the fast path: straight into the socket
                        try:
                            n = c.sock.sendmsg((hdr, mv)) if nbytes else c.sock.send(hdr)  # type: ignore[union-attr]
                        except BlockingIOError:
                            n = 0
                        except OSError as exc:
                            c.sendq.append(_Out(op, hdr, mv, 0))
                            self._lose(p, exc)
                            n = -1
                        if n == _HDR_SIZE + nbytes:
                            op.done = True
                        elif n >= 0:
                            c.sendq.append(_Out(op, hdr, mv, n))
                            self._set_events(c, c.events | _WRITE)
                else:
                    self._send_striped(p, op, mv, check, tag)
            if self._notify:
                self._wake_waiters()
        return op

    def irecv(self, peer: int, tag: int, into: memoryview, check: int) -> _Op:
        """Start receiving ``len(into)`` bytes from ``peer``; see the base contract.

        Raises:
            ValueError: ``peer`` out of range or not among :attr:`peers`, or
                ``into`` read-only.
        """
        mv = into
        if mv.__class__ is not memoryview or mv.format != "B" or mv.ndim != 1 or mv.readonly:
            mv = _bytes_view(into, True)
        if not 0 <= peer < self.size:
            self._check_peer(peer)
        op = _Op(peer, tag, mv, check, False)
        key = (peer, tag)
        with self._lock:
            p = self._peers[peer]
            if p is None and peer != self.rank:
                raise self._not_a_peer(peer)
            queue = self._unexpected.get(key)
            if self._closing:
                self._fail(op, self._closed_error())
            elif queue:
                rec = queue.popleft()
                if not queue:
                    del self._unexpected[key]
                if rec.__class__ is _Rts:
                    self._match_rts(op, rec)
                else:
                    self._match_unexpected(op, rec)  # type: ignore[arg-type]
            else:
                if p is not None and p.gone is not None:
                    self._fail(op, p.gone)
                else:
                    posted = self._posted.get(key)
                    if posted is None:
                        self._posted[key] = deque((op,))
                    else:
                        posted.append(op)
                    if p is not None and not self._in_select:
                        # The message may be sitting in the socket already: read it now.
                        c = p.conns[0]
                        if c.sock is not None:
                            self._read(c)
            if self._kick and not self._in_select:
                self._do_kicks()  # a CTS for the message just matched, frames the read queued
            if self._notify:
                self._wake_waiters()
        return op

    def wait_any(self, handles: Sequence[Handle], timeout: float | None) -> bool:
        """Drive progress until one of ``handles`` is done; False if ``timeout`` passes first."""
        for h in handles:
            if h.done:
                return True
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                for h in handles:
                    if h.done:
                        return True
                left = None if deadline is None else deadline - time.monotonic()
                if self._driving or self._closing:
                    # Another thread drives (or closes); it notifies when handles complete
                    # and when it stops, and then this thread may take over.
                    if left is not None and left <= 0:
                        return False
                    self._cond.wait(left)
                    continue
                self._driving = True
                # Poll briefly before blocking in select(): a message that arrives within
                # microseconds is then read without a wake-up, which costs tens of them.
                spin_end = time.monotonic() + self.spin if self.spin and may_spin() else 0.0
                try:
                    while True:
                        if spin_end and time.monotonic() < spin_end:
                            if not self._drive(0.0):
                                self._lock.release()
                                try:
                                    os.sched_yield()  # let a peer on our CPU send it
                                finally:
                                    self._lock.acquire()
                        else:
                            self._drive(None if left is None else max(left, 0.0))
                        if self._notify:
                            self._wake_waiters()
                        for h in handles:
                            if h.done:
                                return True
                        if self._closing:
                            break
                        if deadline is not None:
                            left = deadline - time.monotonic()
                            if left <= 0:
                                return False
                finally:
                    self._driving = False
                    self._cond.notify_all()

    def cancel(self, handle: Handle) -> None:
        """Withdraw an unfinished operation; it never touches its buffer again.

        A receive whose message is partly read, or cleared to be sent, has the
        rest of the message discarded; a send already partly written finishes
        from a private copy of its remaining bytes (the frame must stay whole on
        the wire). A large send whose payload has not started is withdrawn: the
        receiver never sees its payload (a receive that had matched it fails
        with MismatchError). The handle ends ``done`` with ``error`` None.

        Raises:
            TypeError: ``handle`` does not come from a TcpTransport.
        """
        if not isinstance(handle, _Op):
            raise TypeError(f"not a TcpTransport handle: {handle!r}")
        op = handle
        with self._lock:
            if op.done:
                return
            if op.is_send:
                p = self._peers[op.peer]
                if p is not None and self._withdraw(p, op):
                    p = None  # withdrawn: nothing of it left in the send queues
                for c in p.conns if p is not None else ():
                    for item in list(c.sendq):
                        if item.op is not op:
                            continue
                        if not item.started() and op.left == 1 and c.index == 0:
                            c.sendq.remove(item)  # not a byte out yet: the peer never sees it
                        else:  # finish the frame (payload) from a private copy of what is left
                            if item.off > _HDR_SIZE:
                                item.data = memoryview(bytes(item.data[item.off - _HDR_SIZE :]))
                                item.total = _HDR_SIZE + item.data.nbytes
                                item.off = _HDR_SIZE
                            else:
                                item.data = memoryview(bytes(item.data))
                            if item.rest is not None:
                                item.rest = memoryview(bytes(item.rest))
                            item.op = None
            else:
                queue = self._posted.get((op.peer, op.tag))
                if queue is not None and op in queue:
                    queue.remove(op)
                    if not queue:
                        del self._posted[(op.peer, op.tag)]
                elif op.rec is not None:  # payload partly read or cleared: discard it
                    op.rec.op = None
                    op.rec.view = None
                    op.rec = None
            if self._kick and not self._in_select:
                self._do_kicks()
            op.done = True
            self._wake_waiters()

    def close(self) -> None:
        """Flush queued sends (for at most :data:`CLOSE_FLUSH_SECONDS`), say goodbye, close.

        Large sends still waiting for their receiver's clear-to-send get the
        same time to be cleared and sent; then they fail with ClosedError.
        Idempotent. Peers fail their operations with this rank with
        PeerLostError; this rank's unfinished operations fail with ClosedError.
        """
        with self._cond:
            if self._closing:
                while not self._closed:
                    self._cond.wait()
                return
            self._closing = True
            if self._in_select:
                self._wake()
            while self._driving:
                self._cond.wait()
            self._driving = True
            try:
                self._shutdown()
            finally:
                self._driving = False
                self._closed = True
                self._cond.notify_all()

    # -- Drivable: progress driven by another object -----------------------------------------
    def poll(self) -> bool:
        """One round of progress that never blocks; whether anything moved or completed.

        See :class:`plait.transport.base.Drivable`. Returns False at once when
        another thread drives (it makes the progress) or the transport is
        closing. "Moved" counts completions caused by other threads since the
        last call too, so that a driver checks its handles again.
        """
        with self._lock:
            if self._driving or self._closing:
                return False
            self._driving = True
            moved = False
            try:
                moved = self._drive(0) > 0
            finally:
                self._driving = False
                moved = moved or self._notify or self._stirred
                if self._notify:
                    self._wake_waiters()
                self._stirred = False
                self._cond.notify_all()
            return moved

    def sleep_fd(self) -> int:
        """The selector's descriptor: readable when a socket or the wake-up pipe is ready.

        On Linux the selector is an epoll instance, whose descriptor polls
        readable while any socket it watches is ready; the wake-up pipe is one
        of them, written whenever another thread needs the driver.
        """
        return self._sel.fileno()

    def begin_sleep(self) -> float:
        """Arm wake-ups before the driver blocks on :meth:`sleep_fd`; see ``Drivable``.

        Writes what other threads queued meanwhile, then marks the transport as
        driven and in select(), so that other threads queue their sends, and
        every send, completion, cancel or close they cause writes the wake-up
        pipe, exactly as while a thread of the transport blocks in select().
        Returns ``math.inf``, or 0.0 (nothing armed) when something completed
        since the last :meth:`poll`, another thread drives, or the transport
        is closing.
        """
        with self._lock:
            if self._driving or self._closing:
                return 0.0
            if self._kick:
                self._do_kicks()
            if self._notify or self._stirred:  # the next poll() says so too
                if self._notify:
                    self._wake_waiters()
                return 0.0
            self._driving = True
            self._in_select = True
            return math.inf

    def end_sleep(self) -> None:
        """Disarm after blocking: other threads may drive again, :meth:`close` may go on."""
        with self._lock:
            self._in_select = False
            self._driving = False
            self._cond.notify_all()

    # -- sending ----------------------------------------------------------------------------
    def _send_striped(self, p: _Peer, op: _Op, mv: memoryview, check: int, tag: int) -> None:
        nbytes = mv.nbytes
        seq = p.seq_out
        p.seq_out += 1
        op.left = self.streams
        for k, c in enumerate(p.conns):
            lo, hi = _part(nbytes, self.streams, k)
            if k == 0:
                hdr = _HDR.pack(_DATA, check, tag, nbytes)
            else:
                hdr = _HDR.pack(_PART, 0, seq, nbytes)
            c.sendq.append(_Out(op, hdr, mv[lo:hi], 0))
            self._queued(c)
            if p.dead:
                return

    def _send_rts(self, p: _Peer, op: _Op) -> None:
        """Announce a large message to ``p``; its payload waits for the receiver's CTS."""
        rid = p.rid_out
        p.rid_out += 1
        hdr = _HDR.pack(_RTS, op.check, op.tag, op.buf.nbytes)
        item = _Out(None, hdr, memoryview(_ID.pack(rid)), 0)
        p.rts_out[rid] = (op, item)
        self._push(p.conns[0], item)
        if not self._in_select:
            self._do_kicks()

    def _send_payload(self, p: _Peer, op: _Op, rid: int) -> None:
        """Queue the payload of cleared message ``rid`` (read path: written at the round's end).

        Stream 0 carries it (part 0 of it, if striped) as ``RDATA`` chunks of at
        most :data:`CHUNK` bytes, one queue entry for all of them.
        """
        mv = op.buf
        nbytes = mv.nbytes
        striped = self.streams > 1 and nbytes >= STRIPE_MIN
        op.left = self.streams if striped else 1
        lo, hi = _part(nbytes, self.streams, 0) if striped else (0, nbytes)
        first = min(hi - lo, CHUNK)
        item = _Out(op, _HDR.pack(_RDATA, op.check, rid, first), mv[lo : lo + first], 0)
        if lo + first < hi:
            item.rest = mv[lo + first : hi]
        self._push(p.conns[0], item)
        if not striped:
            return
        seq = p.seq_out
        p.seq_out += 1
        hdr = _HDR.pack(_PART, 0, seq, nbytes)
        for k in range(1, self.streams):
            lo, hi = _part(nbytes, self.streams, k)
            self._push(p.conns[k], _Out(op, hdr, mv[lo:hi], 0))

    def _withdraw(self, p: _Peer, op: _Op) -> bool:
        """Cancel rendezvous send ``op`` if its payload has not started; False otherwise.

        An RTS not written yet is simply dropped (the peer never hears of the
        message); otherwise a WITHDRAW follows, and a withdrawn RTS stays as a
        tombstone until its answer comes.
        """
        c = p.conns[0]
        for rid, (waiting, rts) in p.rts_out.items():
            if waiting is op:
                if rts.off == 0 and rts in c.sendq:
                    c.sendq.remove(rts)
                    del p.rts_out[rid]
                else:
                    p.rts_out[rid] = (None, rts)
                    self._push(c, _Out(None, _HDR.pack(_WITHDRAW, 0, rid, 0), _EMPTY, 0), True)
                return True
        if op.left == 1 and op.buf.nbytes > EAGER_MAX:  # cleared: is the payload untouched?
            for item in c.sendq:
                if item.op is op and not item.started() and item.hdr[0] == _RDATA:
                    c.sendq.remove(item)
                    rid = _HDR.unpack(item.hdr)[2]
                    self._push(c, _Out(None, _HDR.pack(_WITHDRAW, 0, rid, 0), _EMPTY, 0), True)
                    return True
        return False

    def _push(self, c: _Conn, out: _Out, urgent: bool = False) -> None:
        """Queue ``out`` on ``c`` without writing: whoever drives next writes it.

        The read path's way to send (it must never block nor re-enter itself);
        API calls follow it with :meth:`_do_kicks` when no thread is in
        select(). ``urgent`` frames (CTS, REFUSE, WITHDRAW: header only) go
        before every frame not started yet, after the urgent ones queued
        before them; a chunked payload lets them pass at its next chunk (see
        :meth:`_next_chunk`), so a long payload delays a handshake behind it
        by at most one :data:`CHUNK`.
        """
        q = c.sendq
        if urgent:
            out.urgent = True
            i = 1 if q and q[0].off else 0  # never into a frame already started
            while i < len(q) and q[i].urgent:
                i += 1
            q.insert(i, out)
        else:
            q.append(out)
        if len(q) == 1:  # otherwise c already waits for writability or a kick
            self._kick.append(c)
            if self._in_select:
                self._wake()

    def _queued(self, c: _Conn) -> None:
        """``c`` got a frame to send: write now, or hand it to the thread in select()."""
        if self._in_select:
            self._kick.append(c)
            self._wake()
        elif len(c.sendq) == 1:
            self._write(c)

    def _send_self(self, op: _Op) -> None:
        key = (self.rank, op.tag)
        queue = self._posted.get(key)
        if queue:
            recv = queue.popleft()
            if not queue:
                del self._posted[key]
            err = self._mismatch(recv, op.check, op.buf.nbytes, self.rank)
            if err is not None:
                self._fail(recv, err)
            else:
                recv.buf[:] = op.buf
                self.bytes_received += op.buf.nbytes
                self._complete(recv)
        else:
            rec = _Inbound(None, op.check, op.buf.nbytes)
            rec.view = memoryview(bytes(op.buf))
            rec.left = 0
            rec.complete = True
            self._unexpected.setdefault(key, deque()).append(rec)
        self._complete(op)

    def _write(self, c: _Conn) -> None:
        """Write queued frames of ``c`` until the socket is full (I/O role)."""
        q = c.sendq
        sock = c.sock
        assert sock is not None
        try:
            while q:
                bufs: list[bytes | memoryview] = []
                total = 0
                for i, item in enumerate(q):
                    off = item.off
                    if off < _HDR_SIZE:
                        bufs.append(item.hdr[off:] if off else item.hdr)
                        if item.data.nbytes:
                            bufs.append(item.data)
                    else:
                        bufs.append(item.data[off - _HDR_SIZE :])
                    total += item.total - off
                    if item.rest is not None:
                        # A payload with chunks to come ends the batch. Urgent frames
                        # queued behind it go out after this chunk; with none, its next
                        # chunks join the batch (those queued later wait for a later one).
                        if i + 1 == len(q) or not q[i + 1].urgent:
                            total += _more_chunks(item, bufs, total)
                        break
                    if len(bufs) >= _GATHER or total >= 1 << 20:
                        break
                n = sock.sendmsg(bufs)
                whole = n == total
                while n:
                    item = q[0]
                    rest = item.total - item.off
                    if n >= rest:
                        n -= rest
                        if item.rest is not None:  # on to its next chunk, which n may cover
                            self._next_chunk(q, item)
                            continue
                        q.popleft()
                        op = item.op
                        if op is not None and not op.done:
                            op.left -= 1
                            if op.left == 0:
                                self._complete(op)
                    else:
                        item.off += n
                        n = 0
                if not whole:
                    break
        except BlockingIOError:
            pass
        except OSError as exc:
            self._lose(c.peer, exc)
            return
        want = (c.events & _READ) | (_WRITE if q else 0)
        if want != c.events:
            self._set_events(c, want)

    @staticmethod
    def _next_chunk(q: deque[_Out], item: _Out) -> None:
        """The chunk of ``item`` (at the head of ``q``) is written: set up the next one.

        Urgent frames queued while the chunk was going out go first.
        """
        rest = item.rest
        assert rest is not None
        n = min(rest.nbytes, CHUNK)
        item.sent += item.data.nbytes
        if n < rest.nbytes:
            item.data, item.rest = rest[:n], rest[n:]
        else:
            item.data, item.rest = rest, None
        _, check, rid, _ = _HDR.unpack(item.hdr)
        item.hdr = _HDR.pack(_RDATA, check, rid, n)
        item.off = 0
        item.total = _HDR_SIZE + n
        if len(q) > 1 and q[1].urgent:
            q.popleft()
            i = 0
            while i < len(q) and q[i].urgent:
                i += 1
            q.insert(i, item)

    # -- receiving ---------------------------------------------------------------------------
    def _read(self, c: _Conn) -> None:
        """Read from ``c`` until its socket is drained (I/O role)."""
        sock = c.sock
        assert sock is not None
        stage = c.stage
        greedy = c.greedy
        drained = False
        try:
            while True:
                rec = c.rec
                if rec is not None:
                    need = c.end - c.pos
                    if need and c.hi > c.lo:
                        n = min(need, c.hi - c.lo)
                        view = rec.view
                        if view is not None:
                            view[c.pos : c.pos + n] = stage[c.lo : c.lo + n]
                        c.pos += n
                        c.lo += n
                        need -= n
                        if c.lo == c.hi:
                            c.lo = c.hi = 0
                    if not need:
                        if c.end < c.stop:  # a chunk: the next one follows (or urgent frames)
                            c.rec = None
                            c.cont = rec
                            continue
                        self._part_done(c, rec)
                        if c.sock is None:
                            return
                        continue
                    if drained:
                        return
                    if need >= _DIRECT_MIN or not greedy:
                        view = rec.view
                        if view is not None:
                            target = view[c.pos : c.end]
                        else:
                            target = self._scratch[: min(need, _SCRATCH)]
                        if c.stop > c.end and len(target) == need:
                            # The header of the next chunk comes with the rest of this one:
                            # one call reads both (the staging buffer is empty here).
                            n = sock.recvmsg_into((target, stage[:_HDR_SIZE]))[0]
                            if n > need:
                                c.hi = n - need
                                n = need
                            elif n < need:
                                drained = True
                        else:
                            n = sock.recv_into(target)
                            if n < len(target):
                                drained = True
                        if not n:
                            self._eof(c)
                            return
                        c.pos += n
                        continue
                else:
                    have = c.hi - c.lo
                    if have >= _HDR_SIZE:
                        kind, check, tag, nbytes = _HDR.unpack_from(stage, c.lo)
                        if c.cont is not None and not _CTS <= kind <= _WITHDRAW:
                            name = _KIND_NAMES.get(kind, str(kind))
                            self._protocol_error(
                                c.peer,
                                f"{name} frame in the middle of the payload of message #{c.cid}",
                            )
                            return
                        # An RTS whose id has not all arrived waits for the refill below.
                        if kind != _RTS or have >= _RTS_SIZE or not greedy:
                            c.lo += _HDR_SIZE
                            if c.lo == c.hi:
                                c.lo = c.hi = 0
                            if kind == _DATA and c.index == 0:
                                if nbytes <= c.hi - c.lo and self._small(c, check, tag, nbytes):
                                    continue
                                if nbytes > EAGER_MAX:
                                    self._protocol_error(
                                        c.peer,
                                        f"an eager message of {nbytes} B (tag {tag}); "
                                        f"eager messages are at most {EAGER_MAX} B",
                                    )
                                    return
                                self._on_data(c, check, tag, nbytes)
                            elif kind == _PART and c.index > 0 and c.due:
                                if not self._on_part(c, tag, nbytes):
                                    return
                            elif _RTS <= kind <= _WITHDRAW and c.index == 0:
                                if not self._on_control(c, kind, check, tag, nbytes):
                                    return
                            elif kind == _BYE and c.index == 0:
                                self._on_bye(c.peer)
                                return
                            else:
                                name = _KIND_NAMES.get(kind, str(kind))
                                self._protocol_error(
                                    c.peer, f"frame kind {name} on stream {c.index}"
                                )
                                return
                            continue
                    if not greedy and not c.due:  # no part owed: leave the socket alone
                        self._set_events(c, c.events & _WRITE)
                        return
                    if drained:
                        return
                    if c.lo:
                        stage[:have] = stage[c.lo : c.hi]
                        c.lo, c.hi = 0, have
                # Refill the staging buffer (just the header's worth on striping streams).
                # Inside a chunked payload read no further than the next header, so that
                # the chunk behind it lands in the receive's buffer directly.
                end = len(stage)
                if c.cont is not None:
                    end = _HDR_SIZE
                elif rec is not None and c.stop > c.end:
                    end = min(end, c.hi + c.end - c.pos + _HDR_SIZE)
                room = end - c.hi
                n = sock.recv_into(stage[c.hi : end])
                if not n:
                    self._eof(c)
                    return
                c.hi += n
                if n < room:
                    drained = True
        except BlockingIOError:
            return
        except OSError as exc:
            self._lose(c.peer, exc)

    def _small(self, c: _Conn, check: int, tag: int, nbytes: int) -> bool:
        """Fast path: a whole message in the staging buffer, its receive posted and matching.

        Copies it out and completes the receive; False (nothing done) otherwise.
        """
        key = (c.peer.rank, tag)
        queue = self._posted.get(key)
        if not queue:
            return False
        op = queue[0]
        if op.check != check or op.buf.nbytes != nbytes:
            return False
        queue.popleft()
        if not queue:
            del self._posted[key]
        lo = c.lo
        op.buf[:] = c.stage[lo : lo + nbytes]
        lo += nbytes
        if lo == c.hi:
            c.lo = c.hi = 0
        else:
            c.lo = lo
        self.bytes_received += nbytes
        op.done = True
        self._notify = True
        return True

    def _on_data(self, c: _Conn, check: int, tag: int, nbytes: int) -> None:
        p = c.peer
        key = (p.rank, tag)
        rec = _Inbound(p, check, nbytes)
        queue = self._posted.get(key)
        if queue:
            op = queue.popleft()
            if not queue:
                del self._posted[key]
            err = self._mismatch(op, check, nbytes, p.rank)
            if err is not None:
                self._fail(op, err)  # rec.view stays None: the payload is discarded
            else:
                rec.op = op
                rec.view = op.buf
                op.rec = rec
        else:
            rec.view = memoryview(bytearray(nbytes))  # nbytes <= EAGER_MAX: checked by _read
            queue2 = self._unexpected.get(key)
            if queue2 is None:
                self._unexpected[key] = deque((rec,))
            else:
                queue2.append(rec)
        self._start_payload(c, rec)

    def _start_payload(self, c: _Conn, rec: _Inbound, chunk: int = 0) -> None:
        """Stream 0 read the header of ``rec``'s payload: read it (part 0 if striped).

        ``chunk``: the length of the frame, when the part comes in chunks.
        """
        nbytes = rec.nbytes
        if self.streams > 1 and nbytes >= STRIPE_MIN:
            p = c.peer
            rec.left = self.streams
            rec.seq = p.seq_in
            p.seq_in += 1
            for k in range(1, self.streams):
                ck = p.conns[k]
                ck.due.append(rec)
                if not ck.events & _READ:
                    self._set_events(ck, ck.events | _READ)
            c.pos, c.stop = _part(nbytes, self.streams, 0)
        else:
            c.pos, c.stop = 0, nbytes
        c.end = c.pos + chunk if chunk else c.stop
        c.rec = rec

    def _on_control(self, c: _Conn, kind: int, check: int, tag: int, nbytes: int) -> bool:
        """A rendezvous frame on stream 0; False after a protocol error (the peer is lost)."""
        p = c.peer
        if kind == _RDATA:
            rec = c.cont
            if rec is not None:  # the next chunk of the payload being read
                left = c.stop - c.pos
                if tag != c.cid or check != rec.check or not 0 < nbytes <= left:
                    if tag != c.cid:
                        what = f"a chunk of message #{tag} inside the payload of #{c.cid}"
                    elif check != rec.check:
                        what = f"a chunk of message #{tag} whose check differs from its RTS"
                    else:
                        what = f"a {nbytes}-byte chunk of message #{tag}, which has {left} B left"
                    self._protocol_error(p, what)
                    return False
                c.cont = None
                c.rec = rec
                c.end = c.pos + nbytes
                return True
            rec = p.cleared.get(tag)
            if rec is None or rec.check != check:
                what = (
                    "was never cleared (or is complete already)"
                    if rec is None
                    else "differs from its RTS"
                )
                self._protocol_error(p, f"payload of message #{tag} ({nbytes} B) {what}")
                return False
            span = rec.nbytes  # what stream 0 carries: all of it, or part 0 if striped
            if self.streams > 1 and span >= STRIPE_MIN:
                span = _part(span, self.streams, 0)[1]
            if not 0 < nbytes <= span:
                self._protocol_error(
                    p, f"a {nbytes}-byte chunk of message #{tag}, whose payload here is {span} B"
                )
                return False
            del p.cleared[tag]
            self._start_payload(c, rec, nbytes)
            c.cid = tag
            return True
        if kind == _RTS:
            (rid,) = _ID.unpack_from(c.stage, c.lo)
            c.lo += _ID.size
            if c.lo == c.hi:
                c.lo = c.hi = 0
            if rid <= p.rid_in or nbytes <= EAGER_MAX:
                self._protocol_error(
                    p,
                    f"RTS #{rid} for {nbytes} B (expected an id above #{p.rid_in} "
                    f"and more than {EAGER_MAX} B)",
                )
                return False
            p.rid_in = rid
            self._on_rts(p, check, tag, nbytes, rid)
            return True
        name = _KIND_NAMES[kind]
        if check or nbytes:
            self._protocol_error(p, f"{name} frame with check {check} and length {nbytes}")
            return False
        if kind == _WITHDRAW:
            if tag > p.rid_in or (c.cont is not None and tag == c.cid):
                what = "never announced" if tag > p.rid_in else "whose payload has begun"
                self._protocol_error(p, f"WITHDRAW of message #{tag}, {what}")
                return False
            self._on_withdraw(p, tag)
            return True
        entry = p.rts_out.pop(tag, None)  # CTS or REFUSE: the answer to one of our RTS
        if entry is None:
            self._protocol_error(p, f"{name} for message #{tag}, which awaits no answer")
            return False
        op = entry[0]
        if op is not None:  # None: we withdrew it; the answer just ends the tombstone
            if kind == _CTS:
                self._send_payload(p, op, tag)
            else:  # refused: the receiver's receive failed (MismatchError); the send is done
                self._complete(op)
        return True

    def _on_rts(self, p: _Peer, check: int, tag: int, nbytes: int, rid: int) -> None:
        """A large message announced: clear it for a posted receive, or keep it as unexpected."""
        key = (p.rank, tag)
        queue = self._posted.get(key)
        if queue:
            op = queue.popleft()
            if not queue:
                del self._posted[key]
            self._clear(p, op, check, nbytes, rid)
            return
        rts = _Rts(p, check, tag, nbytes, rid)
        p.rts_in[rid] = rts
        queue2 = self._unexpected.get(key)
        if queue2 is None:
            self._unexpected[key] = deque((rts,))
        else:
            queue2.append(rts)

    def _match_rts(self, op: _Op, rts: _Rts) -> None:
        """Receive ``op`` takes announced message ``rts`` (irecv)."""
        p = rts.peer
        del p.rts_in[rts.rid]
        self._clear(p, op, rts.check, rts.nbytes, rts.rid)

    def _clear(self, p: _Peer, op: _Op, check: int, nbytes: int, rid: int) -> None:
        """Answer RTS ``rid`` for receive ``op``: CTS if they agree, else fail ``op`` and REFUSE."""
        err = self._mismatch(op, check, nbytes, p.rank)
        if err is not None:
            self._fail(op, err)
            self._answer(p, _REFUSE, rid)
            return
        rec = _Inbound(p, check, nbytes)
        rec.op = op
        rec.view = op.buf
        op.rec = rec
        p.cleared[rid] = rec
        self._answer(p, _CTS, rid)

    def _answer(self, p: _Peer, kind: int, rid: int) -> None:
        self._push(p.conns[0], _Out(None, _HDR.pack(kind, 0, rid, 0), _EMPTY, 0), urgent=True)

    def _on_withdraw(self, p: _Peer, rid: int) -> None:
        """The sender cancelled message ``rid`` before its payload: forget it."""
        rts = p.rts_in.pop(rid, None)
        if rts is not None:  # nobody took it yet: it vanishes
            key = (p.rank, rts.tag)
            queue = self._unexpected[key]
            queue.remove(rts)
            if not queue:
                del self._unexpected[key]
            self._answer(p, _REFUSE, rid)  # every RTS gets one answer
            return
        rec = p.cleared.pop(rid, None)  # cleared (our CTS was the answer), or refused before
        if rec is not None and rec.op is not None:
            op = rec.op
            rec.op = None
            op.rec = None
            self._fail(
                op,
                MismatchError(
                    f"rank {p.rank} withdrew the {rec.nbytes}-byte message (tag {op.tag}) "
                    f"that rank {self.rank} was about to receive: it cancelled the send "
                    "(its call failed or timed out)"
                ),
            )

    def _on_part(self, c: _Conn, seq: int, nbytes: int) -> bool:
        rec = c.due.popleft()
        if rec.seq != seq or rec.nbytes != nbytes:
            self._protocol_error(
                c.peer,
                f"stream {c.index} got part of striped message #{seq} "
                f"({nbytes} B) but expected #{rec.seq} ({rec.nbytes} B)",
            )
            return False
        c.rec = rec
        c.pos, c.end = _part(nbytes, self.streams, c.index)
        c.stop = c.end
        return True

    def _part_done(self, c: _Conn, rec: _Inbound) -> None:
        c.rec = None
        rec.left -= 1
        if rec.left == 0:
            op = rec.op
            if op is not None:
                rec.op = None
                op.rec = None
                if not op.done:
                    self.bytes_received += rec.nbytes
                    self._complete(op)
            elif rec.view is not None:
                rec.complete = True
        if c.index > 0 and not c.due:
            if c.peer.gone is not None:
                self._drop(c)  # the peer said goodbye and this stream owes nothing more
            elif c.hi == c.lo:
                self._set_events(c, c.events & _WRITE)

    def _match_unexpected(self, op: _Op, rec: _Inbound) -> None:
        peer = rec.peer.rank if rec.peer is not None else self.rank
        err = self._mismatch(op, rec.check, rec.nbytes, peer)
        if err is not None:
            self._fail(op, err)
            if not rec.complete:
                rec.view = None  # the rest of it is discarded
            return
        view = rec.view
        assert view is not None
        if rec.complete:
            op.buf[:] = view
            self.bytes_received += rec.nbytes
            self._complete(op)
            return
        # Still arriving: copy what is there, let the rest land in op.buf directly.
        p = rec.peer
        assert p is not None
        striped = rec.seq >= 0
        for k in range(self.streams if striped else 1):
            lo, hi = _part(rec.nbytes, self.streams, k) if striped else (0, rec.nbytes)
            ck = p.conns[k]
            if ck.rec is rec:
                upto = ck.pos
            elif k > 0 and rec in ck.due:
                upto = lo
            else:
                upto = hi
            if upto > lo:
                op.buf[lo:upto] = view[lo:upto]
        rec.view = op.buf
        rec.op = op
        op.rec = rec

    # -- peers going away -------------------------------------------------------------------
    def _eof(self, c: _Conn) -> None:
        p = c.peer
        if p.gone is not None and c.rec is None and c.cont is None and not c.due:
            self._drop(c)
            return
        self._lose(p, None, "connection closed without a goodbye (the process exited or died)")

    def _on_bye(self, p: _Peer) -> None:
        p.gone = PeerLostError(
            f"rank {p.rank} closed its transport: connection to rank {self.rank} closed"
        )
        self._fail_pending(p, p.gone, inbound=False)
        for c in p.conns:
            if c.index == 0 or (c.rec is None and not c.due):
                self._drop(c)

    def _lose(
        self, p: _Peer, exc: OSError | None, why: str | None = None, protocol: bool = False
    ) -> None:
        """Connections to ``p`` broke: fail everything pending with it and close them.

        EOF and connection errors (reset, broken pipe, unreachable) fail the
        operations with PeerLostError, protocol violations with
        PeerProtocolError, other OS errors with TransportError. The OSError is
        the ``__cause__``.
        """
        if p.dead:
            return
        if why is None:
            why = f"{type(exc).__name__}: {exc}"
        msg = f"rank {self.rank}: connection to rank {p.rank} lost: {why}"
        err: CommError
        if protocol:
            err = PeerProtocolError(msg)
        elif exc is None or exc.errno in _LOST_ERRNOS or isinstance(exc, ConnectionError):
            err = PeerLostError(msg)
        else:
            err = TransportError(msg)
        err.__cause__ = exc
        if p.gone is None:
            p.gone = err
        self._fail_pending(p, p.gone, inbound=True)
        for c in p.conns:
            self._drop(c)
        p.dead = True

    def _protocol_error(self, p: _Peer, what: str) -> None:
        """``p`` sent something impossible: drop it, log it, fail everything pending with it."""
        _log.warning("rank %d: protocol error from rank %d: %s", self.rank, p.rank, what)
        self._lose(p, None, f"protocol error: {what}", protocol=True)

    def _fail_rendezvous(self, p: _Peer, err: BaseException) -> None:
        """Fail the rendezvous messages with ``p`` that can no longer finish."""
        for op, _ in p.rts_out.values():
            if op is not None:
                self._fail(op, err)
        p.rts_out.clear()
        for rec in p.cleared.values():
            if rec.op is not None:
                self._fail(rec.op, err)
                rec.op.rec = None
                rec.op = None
        p.cleared.clear()
        for rts in p.rts_in.values():
            key = (p.rank, rts.tag)
            queue = self._unexpected.get(key)
            if queue is not None:
                queue.remove(rts)
                if not queue:
                    del self._unexpected[key]
        p.rts_in.clear()

    def _fail_pending(self, p: _Peer, err: BaseException, inbound: bool) -> None:
        """Fail what is pending with ``p``: all of it, or (``inbound`` False, after its
        goodbye) all but the payloads still arriving on its other streams."""
        for key in [k for k in self._posted if k[0] == p.rank]:
            for op in self._posted.pop(key):
                self._fail(op, err)
        self._fail_rendezvous(p, err)
        for c in p.conns:
            for item in c.sendq:
                if item.op is not None:
                    self._fail(item.op, err)
            c.sendq.clear()
            if inbound:
                for rec in (c.rec, c.cont, *c.due):
                    if rec is not None and rec.op is not None:
                        self._fail(rec.op, err)
                        rec.op.rec = None
                        rec.op = None
                    if rec is not None:
                        rec.view = None
                c.rec = c.cont = None
                c.due.clear()
        if inbound:  # unexpected messages from p that will never finish arriving
            for key in [k for k in self._unexpected if k[0] == p.rank]:
                kept: deque[_Inbound | _Rts] = deque(
                    r for r in self._unexpected[key] if r.__class__ is _Inbound and r.complete
                )
                if kept:
                    self._unexpected[key] = kept
                else:
                    del self._unexpected[key]

    def _drop(self, c: _Conn) -> None:
        if c.sock is None:
            return
        self._set_events(c, 0)
        c.sock.close()
        c.sock = None

    # -- progress ----------------------------------------------------------------------------
    def _drive(self, timeout: float | None) -> int:
        """One round of progress: select() without the lock, then read and write (lock held).

        Returns the number of ready descriptors handled (the wake-up pipe included).
        """
        if self._kick:
            self._do_kicks()
        self._in_select = True
        self._lock.release()
        try:
            events = self._sel.select(timeout)
        finally:
            self._lock.acquire()
            self._in_select = False
        for key, mask in events:
            c = key.data
            if c is None:
                self._drain_wake()
                continue
            if c.sock is None:
                continue
            if mask & _READ and c.events & _READ:
                self._read(c)
            if mask & _WRITE and c.sock is not None:
                self._write(c)  # with an empty queue (a send was cancelled): drops the interest
        if self._kick:
            self._do_kicks()
        return len(events)

    def _do_kicks(self) -> None:
        kicks, self._kick = self._kick, []
        for c in kicks:
            if c.sock is not None and c.sendq:
                self._write(c)

    def _set_events(self, c: _Conn, events: int) -> None:
        if events == c.events or c.sock is None:
            return
        if c.events == 0:
            self._sel.register(c.sock, events, c)
        elif events == 0:
            self._sel.unregister(c.sock)
        else:
            self._sel.modify(c.sock, events, c)
        c.events = events

    def _wake(self) -> None:
        # OSError: the pipe is full (a wake-up is pending anyway) or closing.
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:
            pass

    def _wake_waiters(self) -> None:
        """Handles completed: tell threads waiting on the condition, and the driver.

        A driver blocked in select() (a thread of ours, or an outside driver
        between begin_sleep() and end_sleep()) does not watch the condition:
        completions caused by other threads (a self-send, a cancel) wake it
        through the wake-up pipe.
        """
        self._notify = False
        self._stirred = True
        self._cond.notify_all()
        if self._in_select:
            self._wake()

    # -- completion helpers (lock held) ---------------------------------------------------------
    def _complete(self, op: _Op) -> None:
        op.done = True
        self._notify = True

    def _fail(self, op: _Op, err: BaseException) -> None:
        if not op.done:
            op.error = err
            op.done = True
            self._notify = True

    def _mismatch(self, op: _Op, check: int, nbytes: int, peer: int) -> MismatchError | None:
        if check != op.check:
            return MismatchError(
                f"rank {self.rank} received from rank {peer} a message of a different call "
                "(the two ranks disagree on the collective, count, dtype, op, root, algorithm or "
                "segment size; or, for a send and its recv, on the dtype)"
            )
        if nbytes != op.buf.nbytes:
            return MismatchError(
                f"rank {peer} sent {nbytes} bytes but rank {self.rank} expected "
                f"{op.buf.nbytes} bytes"
            )
        return None

    def _not_a_peer(self, peer: int) -> ValueError:
        return ValueError(
            f"rank {self.rank}: rank {peer} is not among this transport's peers "
            f"{sorted(self.peers)}"
        )

    def _check_peer(self, peer: int) -> None:
        if not 0 <= peer < self.size:
            raise ValueError(
                f"rank {self.rank}: peer {peer} is out of range; expected 0 <= peer < {self.size}"
            )

    def _closed_error(self) -> ClosedError:
        return ClosedError(f"rank {self.rank}: the transport is closed")

    # -- closing -----------------------------------------------------------------------------
    def _live(self) -> list[_Conn]:
        return [c for p in self._peers if p is not None for c in p.conns if c.sock is not None]

    def _shutdown(self) -> None:
        """The body of close(): this thread holds the I/O role."""
        deadline = time.monotonic() + CLOSE_FLUSH_SECONDS
        err = self._closed_error()

        def announced() -> bool:  # large sends still waiting for their receiver's answer
            return any(
                op is not None for p in self._peers if p is not None for op, _ in p.rts_out.values()
            )

        def flush(answers: bool) -> None:
            while any(c.sendq for c in self._live()) or (answers and announced()):
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._drive(left)

        try:
            flush(True)
            bye = _HDR.pack(_BYE, 0, 0, 0)
            for p in self._peers:
                if p is None:
                    continue
                # Unanswered now: they fail, and an answer that still comes ends a tombstone.
                for rid, (op, rts) in list(p.rts_out.items()):
                    if op is not None:
                        self._fail(op, err)
                        p.rts_out[rid] = (None, rts)
                if p.gone is None and p.conns[0].sock is not None:
                    c = p.conns[0]
                    c.sendq.append(_Out(None, bye, _EMPTY, 0))
                    if len(c.sendq) == 1:
                        self._write(c)
            flush(False)
            # Wait until the kernel has delivered what we wrote: closing a socket with
            # unread input resets the connection, which would drop unsent output.
            while time.monotonic() < deadline and any(_unsent(c) for c in self._live()):
                self._drive(0.002)
        finally:
            for queue in self._posted.values():
                for op in queue:
                    self._fail(op, err)
            self._posted.clear()
            self._unexpected.clear()
            for p in self._peers:
                if p is None:
                    continue
                self._fail_rendezvous(p, err)
                for c in p.conns:
                    for item in c.sendq:
                        if item.op is not None:
                            self._fail(item.op, err)
                    for rec in (c.rec, c.cont, *c.due):
                        if rec is not None and rec.op is not None:
                            self._fail(rec.op, err)
                    c.sendq.clear()
                    c.due.clear()
                    c.rec = c.cont = None
                    self._drop(c)
                p.dead = True
                if p.gone is None:
                    p.gone = err
            self._sel.close()
            self._wake_r.close()
            self._wake_w.close()


def _more_chunks(item: _Out, bufs: list[bytes | memoryview], total: int) -> int:
    """Append the chunks after ``item``'s current one to a batch of ``total`` bytes.

    Up to :data:`_BATCH` bytes and :data:`_GATHER` buffers in all, with the
    headers :meth:`TcpTransport._next_chunk` will give them; returns the bytes added.
    """
    rest = item.rest
    assert rest is not None
    _, check, rid, _ = _HDR.unpack(item.hdr)
    size = rest.nbytes
    at = added = 0
    while at < size and total + added < _BATCH and len(bufs) < _GATHER:
        n = min(size - at, CHUNK)
        bufs.append(_HDR.pack(_RDATA, check, rid, n))
        bufs.append(rest[at : at + n])
        at += n
        added += _HDR_SIZE + n
    return added


def _spin_from_env() -> float:
    """PLAIT_TCP_SPIN (microseconds a waiting rank polls its sockets before it blocks), else 50."""
    return spin_seconds("PLAIT_TCP_SPIN", _SPIN)


def _unsent(c: _Conn) -> bool:
    """Whether ``c``'s kernel send queue still holds unacknowledged bytes (Linux only)."""
    if c.sock is None:
        return False
    try:
        import fcntl

        raw = fcntl.ioctl(c.sock.fileno(), _TIOCOUTQ, b"\0\0\0\0")
        queued: int = struct.unpack("i", raw)[0]
        return queued > 0
    except (OSError, ImportError):
        return False
