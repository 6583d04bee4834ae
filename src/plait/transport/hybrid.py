"""The hybrid transport: shared memory to the ranks on this host, TCP to the others.

A job that spans hosts with several ranks per host wants both: the
shared-memory rings for a peer next door, sockets for a peer elsewhere. This
transport routes each peer to one of two inner transports (a
:class:`~plait.transport.shm.ShmTransport` among this host's ranks, a
:class:`~plait.transport.tcp.TcpTransport` connected only to the other hosts'
ranks) and waits on both at once from one thread.

Note [driving two transports]
    A rank waiting for a message from across the network must still move its
    shared-memory traffic (a local peer may wait for a ring slot it alone
    frees) and vice versa, so ``wait_any`` never hands the wait to just one
    inner transport. One thread at a time is the driver: it calls ``poll()``
    on each inner transport until nothing moves, spins briefly like the
    shared-memory transport (small messages arrive within microseconds when
    cores are free), then arms both (``begin_sleep``: shared-memory peers ring
    the doorbell, the TCP side reports socket readiness) and blocks in one
    ``epoll`` on both transports' descriptors and its own wake-up pipe. Every
    cross-thread event that matters (another thread's send, a completion it
    causes, ``close``) makes an armed descriptor readable, so the driver
    never sleeps through it. Other threads wait on a condition; the driver
    notifies it after arming, after every round that moved something and
    when it steps down, so a completion caused by a third thread is never
    missed. See :class:`plait.transport.base.Drivable`.
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

from plait.rendezvous.store import PrefixStore, Store
from plait.transport.base import Drivable, Handle, may_spin

__all__ = ["HybridTransport"]

_SPIN = 50e-6  # seconds the driver polls before it sleeps (as the shared-memory transport)
_EAGER_SPIN = 5e-6  # ... of which this long without yielding the CPU


class HybridTransport:
    """Rank ``rank``'s end of a job whose ranks sit on several hosts.

    The constructor is a collective rendezvous of all ``size`` ranks: first
    the ranks of each host build their shared-memory transport, then all
    ranks connect over TCP to the ranks of other hosts.

    Args:
        rank: this rank.
        size: number of ranks.
        hosts: every rank's host name (``hosts[r]`` for rank ``r``), the
            same list on every rank.
        store: the store all ranks share.
        timeout: seconds the whole rendezvous may take.
        job: job id for shared-memory segment names (see ShmTransport);
            default a random token per host.
        ifname: TCP interface selection (see TcpTransport).
        streams: TCP connections per pair (see TcpTransport).

    Attributes:
        local: this host's ranks, in rank order.
        shm: the shared-memory transport among ``local`` (None when this
            rank is alone on its host).
        tcp: the TCP transport to the other hosts' ranks (None when every
            rank is on this host).
        bytes_sent, bytes_received: payload bytes, the sums of the inner
            transports' counters.

    Raises:
        ValueError: a bad argument.
        RendezvousError, TransportError: as the inner transports.
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
    ) -> None:
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"invalid rank {rank} for size {size}; expected 0 <= rank < size")
        if len(hosts) != size:
            raise ValueError(f"hosts must name the host of each of the {size} ranks")
        if not timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        from plait.transport.shm import ShmTransport
        from plait.transport.tcp import TcpTransport

        self.rank = rank
        self.size = size
        me = hosts[rank]
        self.local = [r for r in range(size) if hosts[r] == me]
        remote = [r for r in range(size) if hosts[r] != me]
        host_index = sorted(set(hosts)).index(me)
        deadline = time.monotonic() + timeout
        self.shm: Any = None
        self.tcp: Any = None
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._driving = False  # a thread drives progress (Note [driving two transports])
        self._sleeping = False  # ... and is blocked in epoll
        self._waiters = 0
        self._closing = False
        self._closed = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._ep = select.epoll()
        try:
            self._wake_r.setblocking(False)
            self._wake_w.setblocking(False)
            self._ep.register(self._wake_r.fileno(), select.EPOLLIN)
            if len(self.local) > 1:
                self.shm = ShmTransport(
                    self.local.index(rank),
                    len(self.local),
                    PrefixStore(f"shm/{host_index}", store),
                    timeout=max(deadline - time.monotonic(), 0.001),
                    job=None if job is None else f"{job}-h{host_index}",
                    names=self.local,
                )
            if remote:
                self.tcp = TcpTransport(
                    rank,
                    size,
                    PrefixStore("tcp", store),
                    timeout=max(deadline - time.monotonic(), 0.001),
                    ifname=ifname,
                    streams=streams,
                    peers=remote,
                )
        except BaseException:
            self._release()
            raise
        self._subs: list[Drivable] = [t for t in (self.shm, self.tcp) if t is not None]
        for t in self._subs:
            self._ep.register(t.sleep_fd(), select.EPOLLIN)
        # peer -> (inner transport, its rank there); self goes to shared memory when it exists.
        self._route: list[tuple[Any, int]] = []
        for r in range(size):
            if self.shm is not None and hosts[r] == me:
                self._route.append((self.shm, self.local.index(r)))
            else:
                self._route.append((self.tcp, r))
        self._owner: dict[type, Any] = {cls: t for t, cls in self._handle_types()}
        self.spin = self.shm.spin if self.shm is not None else _SPIN

    def _handle_types(self) -> list[tuple[Any, Any]]:
        from plait.transport import link, tcp

        kinds = ((self.shm, link.Op), (self.tcp, tcp._Op))
        return [(t, cls) for t, cls in kinds if t is not None]

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"<HybridTransport rank {self.rank} of {self.size}, {len(self.local)} on this host, "
            f"{state}>"
        )

    @property
    def bytes_sent(self) -> int:
        """Payload bytes sent so far over both inner transports."""
        return sum(t.bytes_sent for t in (self.shm, self.tcp) if t is not None)

    @property
    def bytes_received(self) -> int:
        """Payload bytes received so far over both inner transports."""
        return sum(t.bytes_received for t in (self.shm, self.tcp) if t is not None)

    # -- contract ------------------------------------------------------------------------------
    def isend(self, peer: int, tag: int, data: memoryview, check: int) -> Handle:
        """Start sending ``data`` to ``peer`` over the transport that reaches it."""
        t, q = self._peer(peer)
        h: Handle = t.isend(q, tag, data, check)
        return h

    def irecv(self, peer: int, tag: int, into: memoryview, check: int) -> Handle:
        """Start receiving from ``peer`` over the transport that reaches it."""
        t, q = self._peer(peer)
        h: Handle = t.irecv(q, tag, into, check)
        return h

    def cancel(self, handle: Handle) -> None:
        """Withdraw ``handle`` in the inner transport that made it."""
        t = self._owner.get(type(handle))
        if t is None:
            raise TypeError(f"rank {self.rank}: {handle!r} is not a handle of this transport")
        t.cancel(handle)

    def wait_any(self, handles: Sequence[Handle], timeout: float | None) -> bool:
        """Drive both transports until one of ``handles`` is done; False if ``timeout`` passes."""
        for h in handles:
            if h.done:
                return True
        if not handles:
            return False
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._cond:
                while True:
                    if any(h.done for h in handles):
                        return True
                    if self._closed:
                        return False
                    if not self._driving and not self._closing:
                        self._driving = True
                        break
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    self._waiters += 1
                    try:
                        self._cond.wait(left)
                    finally:
                        self._waiters -= 1
            try:
                result = self._drive(handles, deadline)
            finally:
                with self._cond:
                    self._driving = False
                    self._cond.notify_all()
            if result is not None:
                return result
            # None: close() asked the driver to step down; wait for it as the others do.

    def close(self) -> None:
        """Close both inner transports (peers fail with PeerLostError). Idempotent."""
        with self._cond:
            if self._closing:
                while not self._closed:
                    self._cond.wait()
                return
            self._closing = True
            if self._sleeping:
                self._wake()
            while self._driving:
                self._cond.wait()
            self._driving = True  # nobody drives again
        try:
            for t in self._subs:
                t.close()  # type: ignore[attr-defined]
        finally:
            self._release()
            with self._cond:
                self._closed = True
                self._driving = False
                self._cond.notify_all()

    def __enter__(self) -> HybridTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- driving (Note [driving two transports]) ------------------------------------------------
    def _drive(self, handles: Sequence[Handle], deadline: float | None) -> bool | None:
        """Make progress as the driver; None when close() wants the driver to step down."""
        subs = self._subs
        spun = False
        while True:
            moved = False
            for t in subs:
                if t.poll():
                    moved = True
            if moved:
                self._notify()
                spun = False
            for h in handles:
                if h.done:
                    return True
            if self._closing:
                return None
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return False
            if moved:
                continue
            if not spun:
                spun = True
                if may_spin() and self._spin(deadline):
                    continue
            limit = math.inf if deadline is None else deadline - now
            armed: list[Drivable] = []
            for t in subs:
                cap = t.begin_sleep()
                if cap <= 0:
                    break
                armed.append(t)
                limit = min(limit, cap)
            try:
                if len(armed) == len(subs):
                    self._notify()  # a completion from another thread before arming is seen
                    with self._cond:
                        if self._closing:
                            return None
                        self._sleeping = True
                    try:
                        self._ep.poll(-1 if limit == math.inf else max(limit, 0.0))
                    finally:
                        with self._cond:
                            self._sleeping = False
                        _drain(self._wake_r)
            finally:
                for t in reversed(armed):
                    t.end_sleep()
            self._notify()
            spun = False

    def _spin(self, deadline: float | None) -> bool:
        """Poll for up to ``self.spin`` seconds; whether anything moved."""
        start = time.monotonic()
        until = start + self.spin
        if deadline is not None:
            until = min(until, deadline)
        eager = start + _EAGER_SPIN
        while True:
            moved = False
            for t in self._subs:
                if t.poll():
                    moved = True
            if moved:
                self._notify()
                return True
            now = time.monotonic()
            if now >= until or self._closing:
                return False
            if now >= eager:
                os.sched_yield()  # let a peer that shares our CPU run

    def _notify(self) -> None:
        with self._cond:
            if self._waiters:
                self._cond.notify_all()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full: a wake-up is pending anyway
            self._wake_w.send(b"\0")

    def _peer(self, peer: int) -> tuple[Any, int]:
        if not 0 <= peer < self.size:
            raise ValueError(f"rank {self.rank}: peer {peer} is not in 0..{self.size - 1}")
        return self._route[peer]

    def _release(self) -> None:
        for t in (self.shm, self.tcp):
            if t is not None:
                t.close()
        self._ep.close()
        self._wake_r.close()
        self._wake_w.close()


def _drain(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while sock.recv(4096):
            pass
