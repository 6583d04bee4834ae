"""A TCP transport between processes (or threads): one or more sockets per rank pair.

:class:`TcpTransport` is an :class:`~plait.transport.endpoint.Endpoint` with a
:class:`~plait.transport.loopback.Loopback` to itself and one
:class:`~plait.transport.tcp.link.TcpLink` to its peers. The modules, one noun each:
:mod:`~plait.transport.tcp.wire` (frame format), :mod:`~plait.transport.tcp.interfaces`
(address choice, socket buffers), :mod:`~plait.transport.tcp.bootstrap` (the
rendezvous), :mod:`~plait.transport.tcp.pair` (per-peer state),
:mod:`~plait.transport.tcp.reader`, :mod:`~plait.transport.tcp.writer`,
:mod:`~plait.transport.tcp.rendezvous` (large messages) and
:mod:`~plait.transport.tcp.link`. The protocol is described in ``docs/transport.md``.
"""

from __future__ import annotations

import os
from collections.abc import Collection

from plait._net import (
    IfnameSpec,
    interface_addresses,
    match_ifnames,
    parse_ifname,
    select_interface_address,
)
from plait.rendezvous.store import Store
from plait.transport.base import spin_seconds
from plait.transport.endpoint import CLOSE_FLUSH_SECONDS, Endpoint
from plait.transport.loopback import Loopback
from plait.transport.tcp.bootstrap import BootstrapTimeout, connect_mesh
from plait.transport.tcp.interfaces import choose_host
from plait.transport.tcp.link import TcpLink
from plait.transport.tcp.wire import (
    CHUNK,
    EAGER_MAX,
    MAX_STREAMS,
    SOCKET_BUFFER,
    STRIPE_MIN,
    PeerProtocolError,
)

__all__ = [
    "CHUNK",
    "CLOSE_FLUSH_SECONDS",
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

#: Seconds a waiting rank polls its sockets before it blocks (PLAIT_TCP_SPIN overrides it).
_SPIN = 50e-6


def _spin_from_env() -> float:
    """PLAIT_TCP_SPIN (microseconds a waiting rank polls its sockets before it blocks), else 50."""
    return spin_seconds("PLAIT_TCP_SPIN", _SPIN)


def _streams_from(streams: int | None) -> int:
    what = "streams"
    if streams is None:
        text = os.environ.get("PLAIT_TCP_STREAMS", "")
        what = f"PLAIT_TCP_STREAMS={text!r}"
        try:
            streams = int(text.strip() or "1")  # unset or empty: one, as for every setting
        except ValueError:
            raise ValueError(f"{what} is not an integer") from None
    if isinstance(streams, bool) or not isinstance(streams, int):
        raise TypeError(f"streams must be an int, got {type(streams).__name__}")
    if not 1 <= streams <= MAX_STREAMS:
        raise ValueError(f"{what}: must be between 1 and {MAX_STREAMS}, got {streams}")
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


class TcpTransport(Endpoint):
    """Rank ``rank``'s end of a TCP mesh; see :mod:`plait.transport.base`.

    Construction blocks until every peer has connected (or ``timeout`` passes).
    All methods are thread-safe; bytes move while some thread is inside
    :meth:`wait_any` (or ``isend``/``irecv``/:meth:`close`).

    Attributes:
        rank: this rank.
        size: number of ranks.
        peers: the other ranks this one is connected to.
        streams: connections per rank pair.
        address: the address this rank listens on, as published in the store.
        bytes_sent: payload bytes handed to :meth:`isend` so far.
        bytes_received: payload bytes delivered into receives so far.
        spin: seconds a waiting thread polls its sockets before it blocks in
            epoll (default 50 µs, or PLAIT_TCP_SPIN microseconds; 0 blocks at
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
        super().__init__(rank, size)
        self.peers = _peers_from(peers, rank, size)
        self.streams = _streams_from(streams)
        self.timeout = float(timeout)
        self.spin = _spin_from_env()
        # Yield the CPU from the first idle poll: a socket poll is a system call, and on a
        # loaded 2-core machine a flat-out start delayed the peer's answer (8-byte round
        # trips 10-15% slower than yielding at once).
        self.eager_spin = 0.0
        bind = choose_host(host, ifname, store)
        self.address, socks = connect_mesh(
            rank, size, self.streams, store, prefix, self.timeout, bind, self.peers
        )
        try:
            self.attach(Loopback(self), [rank])
            self._link = TcpLink(self, socks, self.streams, sorted(self.peers), self.address)
            self.attach(self._link, sorted(self.peers))
        except BaseException:
            for sock in socks.values():
                sock.close()
            self._release()
            raise

    def __enter__(self) -> TcpTransport:
        return self

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return (
            f"<TcpTransport rank {self.rank} of {self.size} at {self.address}, "
            f"{self.streams} stream(s), {state}>"
        )

    def _not_a_peer(self, peer: int) -> ValueError:
        if 0 <= peer < self.size:
            return ValueError(
                f"rank {self.rank}: rank {peer} is not among this transport's peers "
                f"{sorted(self.peers)}"
            )
        return ValueError(
            f"rank {self.rank}: peer {peer} is out of range; expected 0 <= peer < {self.size}"
        )
