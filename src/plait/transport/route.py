"""The route of each peer: shared memory to the ranks of this host, TCP to the others.

After NCCL's ``selectTransport``: :data:`LINKS` lists the kinds of link in order of
preference, and each peer pair uses the first kind that can reach it
(:func:`choose`). :func:`connect` builds one endpoint from that choice: a
:class:`~plait.transport.shm.ShmTransport` when every peer is on this host, a
:class:`~plait.transport.tcp.TcpTransport` when none is, else a
:class:`HybridTransport`, an endpoint with both links.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from plait.errors import RendezvousError
from plait.rendezvous.lost import wait_ranks
from plait.rendezvous.store import PrefixStore, Store, StoreTimeout
from plait.transport.base import spin_seconds
from plait.transport.endpoint import Endpoint
from plait.transport.loopback import Loopback

if TYPE_CHECKING:
    from plait.transport.shm.link import ShmLink
    from plait.transport.shm.window import ShmWindow
    from plait.transport.tcp.link import TcpLink

__all__ = ["LINKS", "HybridTransport", "choose", "connect"]

#: Kinds of link in order of preference; a peer pair uses the first that reaches it.
LINKS: tuple[str, ...] = ("shm", "tcp")

#: Whether a kind of link reaches rank ``b`` from rank ``a``, given every rank's host.
_REACHES: dict[str, Callable[[Sequence[str], int, int], bool]] = {
    "shm": lambda hosts, a, b: hosts[a] == hosts[b],
    "tcp": lambda hosts, a, b: True,
}


def choose(rank: int, hosts: Sequence[str], links: Sequence[str] = LINKS) -> dict[str, list[int]]:
    """The peers of ``rank`` each kind of link reaches: the first of ``links`` that can.

    Symmetric (rank a uses kind k to b exactly when b uses k to a), so both ends of
    a pair build the same link.

    Raises:
        ValueError: ``links`` names an unknown kind.
        RendezvousError: no kind in ``links`` reaches some peer.
    """
    for kind in links:
        if kind not in _REACHES:
            raise ValueError(f"unknown link {kind!r}; expected one of {sorted(_REACHES)}")
    routes: dict[str, list[int]] = {kind: [] for kind in links}
    for peer in range(len(hosts)):
        if peer == rank:
            continue
        first = next((k for k in links if _REACHES[k](hosts, rank, peer)), None)
        if first is None:
            if tuple(links) == ("shm",):
                raise RendezvousError(
                    f"rank {rank}: the shared-memory transport needs all ranks on one host; "
                    f"ranks are on {sorted(set(hosts))}"
                )
            raise RendezvousError(
                f"rank {rank}: no link reaches rank {peer} on host {hosts[peer]!r} from host "
                f"{hosts[rank]!r} (links tried: {', '.join(links)})"
            )
        routes[first].append(peer)
    return routes


def connect(
    rank: int,
    size: int,
    hosts: Sequence[str],
    store: Store,
    *,
    links: Sequence[str] = LINKS,
    timeout: float = 300.0,
    job: str | None = None,
) -> Endpoint:
    """Rank ``rank``'s endpoint, its links chosen per peer by :func:`choose`.

    A collective call: every rank passes the same ``hosts``, ``links`` and store.

    Args:
        rank: this rank.
        size: number of ranks.
        hosts: every rank's host (``hosts[r]`` for rank ``r``).
        store: the store all ranks share.
        links: the kinds of link allowed, in order of preference.
        timeout: seconds the rendezvous may take.
        job: job id for shared-memory segment names (see ShmTransport).

    Raises:
        ValueError: a bad argument.
        RendezvousError: no allowed link reaches some peer, or the rendezvous failed.
        TransportError: as the links.
    """
    if len(hosts) != size:
        raise ValueError(f"hosts must name the host of each of the {size} ranks")
    # The kinds of link the whole job uses (every rank decides alike, so all build the same
    # class and meet under the same store keys); ranks of one host route alike.
    choose(rank, hosts, links)  # this rank's own error first, if some peer is out of reach
    firsts = {h: r for r, h in reversed(list(enumerate(hosts)))}
    used = {k for r in firsts.values() for k, peers in choose(r, hosts, links).items() if peers}
    if used <= {"shm"}:
        from plait.transport.shm import ShmTransport

        return ShmTransport(rank, size, PrefixStore("shm", store), timeout=timeout, job=job)
    if used == {"tcp"}:
        from plait.transport.tcp import TcpTransport

        return TcpTransport(rank, size, PrefixStore("tcp", store), timeout=timeout)
    return HybridTransport(
        rank, size, hosts, PrefixStore("hybrid", store), timeout=timeout, job=job, links=links
    )


class HybridTransport(Endpoint):
    """An endpoint whose peers use different links: shared memory on this host, TCP across.

    The constructor is a collective rendezvous of all ``size`` ranks: first the
    ranks of each host join their shared-memory link, then all ranks connect over
    TCP to the ranks :func:`choose` routes there.

    Args:
        rank: this rank.
        size: number of ranks.
        hosts: every rank's host name (``hosts[r]`` for rank ``r``), the same list
            on every rank.
        store: the store all ranks share.
        timeout: seconds the whole rendezvous may take.
        job: job id for shared-memory segment names (see ShmTransport);
            default a random token per host.
        ifname: TCP interface selection (see TcpTransport).
        streams: TCP connections per pair (see TcpTransport).
        links: the kinds of link allowed, in order of preference.

    Attributes:
        local: this host's ranks, in rank order.
        host_window: the window this host's ranks share (window rank ``i`` is rank
            ``local[i]``), or None: alone on its host, no window
            (``PLAIT_SHM_WINDOW=0``), or some host's ranks could not set one up.
        host_window_bytes: the bytes of each half that every host's window has at
            least, the same on every rank (0: some host of several ranks has none;
            a host of one rank needs none). A schedule that reads its host's
            windows uses no more than this (Note [mixed schedules] in
            :mod:`plait.schedule.ir`).
        shm: the shared-memory link to the other ranks of ``local`` (None when
            it reaches nobody).
        tcp: the TCP link to the other hosts' ranks (None when it reaches nobody).
        address: the address the TCP link listens on (None without one).

    Raises:
        ValueError: a bad argument.
        RendezvousError, TransportError: as ShmTransport and TcpTransport.
    """

    def __init__(
        self,
        rank: int,
        size: int,
        hosts: Sequence[str],
        store: Store,
        *,
        timeout: float = 300.0,
        job: str | None = None,
        ifname: str | None = None,
        streams: int | None = None,
        links: Sequence[str] = LINKS,
    ) -> None:
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"invalid rank {rank} for size {size}; expected 0 <= rank < size")
        if len(hosts) != size:
            raise ValueError(f"hosts must name the host of each of the {size} ranks")
        if not timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        super().__init__(rank, size)
        routes = choose(rank, hosts, links)
        me = hosts[rank]
        self.local = [r for r in range(size) if hosts[r] == me]
        self.host_window: ShmWindow | None = None
        self.host_window_bytes = 0
        self.shm: ShmLink | None = None
        self.tcp: TcpLink | None = None
        self.address: str | None = None
        deadline = time.monotonic() + timeout
        self.attach(Loopback(self), [rank])
        try:
            if routes.get("shm"):
                self._join_shm(store, sorted(set(hosts)).index(me), deadline, job)
            if routes.get("tcp"):
                self._join_tcp(store, routes["tcp"], deadline, ifname, streams)
            self.host_window_bytes = self._agree_windows(store, hosts, deadline)
        except BaseException:
            self.close()
            raise
        env = "PLAIT_SHM_SPIN" if self.shm is not None else "PLAIT_TCP_SPIN"
        self.spin = spin_seconds(env, self.spin)

    def _agree_windows(self, store: Store, hosts: Sequence[str], deadline: float) -> int:
        """The bytes every host's window has at least (0: a host of several ranks has none).

        The first rank of each host of several ranks says what its host agreed on;
        everyone reads what each such host said, so all ranks get the same number.
        """
        names = sorted(set(hosts))
        firsts = {h: hosts.index(h) for h in names if hosts.count(h) > 1}
        if not firsts:
            return 0
        win = PrefixStore("window", store)
        me = hosts[self.rank]
        if firsts.get(me) == self.rank:
            have = self.host_window.capacity if self.host_window is not None else 0
            win.set(str(names.index(me)), str(have).encode())
        keys = [str(names.index(h)) for h in firsts]
        ranks = list(firsts.values())
        seconds = max(deadline - time.monotonic(), 0.001)
        try:
            wait_ranks(
                win, keys, ranks, seconds, me=f"rank {self.rank}", what="set up their host's window"
            )
        except StoreTimeout:
            absent = [r for r, k in zip(ranks, keys, strict=True) if not win.check([k])]
            raise StoreTimeout(
                f"rank {self.rank}: rank(s) {absent} (the first of their host) did not say what "
                f"their host's shared-memory window holds within {seconds:.3g} s: they died or "
                "failed in plait.init (see their errors), or stopped"
            ) from None
        return min(int(win.get(k)) for k in keys)

    def _join_shm(self, store: Store, host_index: int, deadline: float, job: str | None) -> None:
        """Join the shared-memory link of this host's ranks (they are named by job rank)."""
        from plait.transport.shm import bootstrap, segment
        from plait.transport.shm import window as shm_window
        from plait.transport.shm.link import ShmLink
        from plait.transport.shm.ring import DEFAULT_SLOTS, default_slot_bytes
        from plait.transport.shm.window import ShmWindow

        segment.check_platform()
        local = self.local
        joined = bootstrap.join(
            local.index(self.rank),
            len(local),
            PrefixStore(f"shm/{host_index}", store),
            timeout=max(deadline - time.monotonic(), 0.001),
            job=None if job is None else f"{job}-h{host_index}",
            slots=DEFAULT_SLOTS,
            slot_bytes=default_slot_bytes(len(local), DEFAULT_SLOTS),
            names=local,
            window=shm_window.window_bytes(),
        )
        for wire in joined.wires:  # the link names peers by their rank in the job
            wire.rank = local[wire.rank]
        link = ShmLink(self, joined)
        self.attach(link, link.peers)
        self.shm = link
        self.host_window = ShmWindow.build(self, link, joined, local)

    def _release(self) -> None:
        if self.host_window is not None:  # its views first, so that the segments can be unmapped
            self.host_window.release()
        super()._release()

    def _join_tcp(
        self,
        store: Store,
        peers: Sequence[int],
        deadline: float,
        ifname: str | None,
        streams: int | None,
    ) -> None:
        """Connect the TCP link to ``peers`` (the other hosts' ranks)."""
        from plait.transport.tcp import _streams_from
        from plait.transport.tcp.bootstrap import connect_mesh
        from plait.transport.tcp.interfaces import choose_host
        from plait.transport.tcp.link import TcpLink

        tcp_store = PrefixStore("tcp", store)
        n = _streams_from(streams)
        self.address, socks = connect_mesh(
            self.rank,
            self.size,
            n,
            tcp_store,
            "tcp",
            max(deadline - time.monotonic(), 0.001),
            choose_host(None, ifname, tcp_store),
            frozenset(peers),
        )
        try:
            link = TcpLink(self, socks, n, peers, self.address)
        except BaseException:
            for sock in socks.values():
                sock.close()
            raise
        self.attach(link, peers)
        self.tcp = link

    def __enter__(self) -> HybridTransport:
        return self

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return (
            f"<HybridTransport rank {self.rank} of {self.size}, {len(self.local)} on this host, "
            f"{state}>"
        )
