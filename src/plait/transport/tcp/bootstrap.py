"""The TCP rendezvous: listen, publish the address, connect every pair, authenticate, say hello.

Each rank listens on an ephemeral port of one address (:mod:`.interfaces`), publishes
``host:port`` (``[v6]:port`` for IPv6) in the store under ``f"{prefix}/addr/{rank}"``,
then rank i connects to every peer j < i and accepts from every peer j > i, ``streams``
connections per pair. The connecting side answers the listener's challenge
(:mod:`plait._auth`) and sends a hello (magic, protocol version, stream index, its rank,
size, streams); the accepting side checks both (garbage and strangers are dropped, the
wait goes on) and answers with its own. Ranks that disagree on ``size`` or ``streams``
fail with :class:`~plait.errors.RendezvousError`; ranks that never show up within
``timeout`` fail with :class:`BootstrapTimeout`, which names them.

Note [hostile connections during setup]
    A rank's listening port is open to anyone who can reach it while the mesh is
    being set up, so nothing a stranger does may block or exhaust the setup. The
    rules it shares with the store server are in one place, :mod:`plait._guard`
    Note [unauthenticated connections]: here an accepted connection has
    :data:`HANDSHAKE_SECONDS` to answer the challenge and say hello, at most
    :data:`MAX_UNAUTHENTICATED` may be pending at once (oldest dropped first),
    ``accept`` out of descriptors pauses the listener (:data:`ACCEPT_BACKOFF`,
    logged once) and failed authentications go to an
    :class:`plait._auth.FailureLog`. Beyond those:

    * the cap is never fewer than the honest connections this rank expects;
    * on the dialling side, a peer that closes the connection or stays silent
      before its challenge is dialled again, and is reported as unanswered
      (:class:`plait._auth.HandshakeUnanswered`: overloaded, or not a plait
      rank), never as a wrong secret: no secret was exchanged yet.
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import logging
import os
import selectors
import socket
import time
from typing import Any, NoReturn

from plait import _auth, _guard, _net
from plait.errors import CommTimeout, RendezvousError, TransportError
from plait.rendezvous.lost import LOOK_SECONDS, filed, lost_error, wait_ranks
from plait.rendezvous.store import Store, StoreTimeout
from plait.transport.tcp.interfaces import tune
from plait.transport.tcp.wire import HELLO, MAGIC, VERSION

__all__ = [
    "ACCEPT_BACKOFF",
    "HANDSHAKE_SECONDS",
    "MAX_UNAUTHENTICATED",
    "BootstrapTimeout",
    "connect_mesh",
]

_log = logging.getLogger("plait")
_RETRY = 0.05  # seconds between connection attempts while a peer is not listening yet
_READ, _WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE
# The setup's own copies of the limits of Note [unauthenticated connections], read
# when a rank starts listening, so that the setup can be tuned apart from the store.
#: Seconds an accepted connection has to authenticate and say hello, and a dialled
#: peer to send its challenge (then it is dialled again).
HANDSHAKE_SECONDS = _guard.HANDSHAKE_SECONDS
#: Most accepted connections authenticating at once (see Note [hostile connections
#: during setup]); a quarter of the descriptor limit at most, but at least
#: :data:`_MIN_UNAUTHENTICATED` and the honest connections this rank expects.
MAX_UNAUTHENTICATED = _guard.MAX_UNAUTHENTICATED
_MIN_UNAUTHENTICATED = _guard.MIN_UNAUTHENTICATED
#: First and longest pause in accepting after running out of file descriptors.
ACCEPT_BACKOFF = _guard.ACCEPT_BACKOFF
#: Why a dialled peer may close or stay silent before its challenge.
_UNANSWERED = "overloaded, or not a plait rank; no secret was exchanged, so not PLAIT_SECRET"


class BootstrapTimeout(RendezvousError, CommTimeout):
    """Ranks did not all connect within the timeout; the message names the missing ones."""


def _address(text: str) -> tuple[str, int]:
    """A published ``host:port`` -> (host, port).

    Raises:
        RendezvousError: ``text`` is not an address.
    """
    try:
        return _net.parse_address(text)
    except ValueError:
        raise RendezvousError(f"malformed TCP address {text!r} in the store") from None


def _unauthenticated_cap(honest: int) -> int:
    """The cap on accepted connections still authenticating, for ``honest`` expected ones."""
    return max(_guard.unauthenticated_cap(MAX_UNAUTHENTICATED, _MIN_UNAUTHENTICATED), honest, 1)


class _Dial:
    """One outgoing connection being set up (to ``peer``, stream ``stream``)."""

    __slots__ = (
        "addr",
        "buf",
        "error",
        "nonces",
        "peer",
        "retry_at",
        "silent_until",
        "sock",
        "stage",
        "stream",
        "unanswered",
    )

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
        self.silent_until = 0.0  # in stage 1: when a silent peer is dialled again
        self.error: str | None = None
        self.unanswered = False  # the last failure came before the peer's challenge


class _Answer:
    """One accepted connection whose authentication and hello have not been read yet."""

    __slots__ = ("buf", "nonce", "peer", "sock")

    def __init__(self, sock: socket.socket, nonce: bytes, peer: str) -> None:
        self.sock = sock
        self.buf = b""
        self.nonce = nonce  # our challenge, which the client must answer
        self.peer = peer  # host:port, for the failure log


class _Listener:
    """The listening socket during setup: accepts and greets, bounding what strangers cost.

    See Note [hostile connections during setup]. ``pending`` holds the accepted
    connections still authenticating, oldest first, with their deadlines.
    """

    def __init__(
        self, sock: socket.socket, sel: selectors.BaseSelector, rank: int, honest: int
    ) -> None:
        self.sock = sock
        self.sel = sel
        self.refused = _auth.FailureLog(f"rank {rank}")
        self.pending = _guard.PendingHandshakes[_Answer](
            _unauthenticated_cap(honest), HANDSHAKE_SECONDS
        )
        self.accepting = _guard.AcceptBackoff(
            sock, sel, f"rank {rank}", during="during the TCP setup", schedule=ACCEPT_BACKOFF
        )

    def accept(self) -> None:
        """Accept and greet what is queued (at most one cap's worth per call)."""
        for sock, peer in self.accepting.accepted(self.pending.cap, self._make_room):
            sock.setblocking(False)
            hello, nonce = _auth.challenge()
            try:
                sock.send(hello)  # a few bytes into a fresh socket's buffer
            except OSError:
                sock.close()
                continue
            a = _Answer(sock, nonce, peer)
            oldest = self.pending.admit(a, time.monotonic())
            if oldest is not None:
                self.drop(oldest)
            self.sel.register(sock, _READ, a)

    def _make_room(self) -> bool:
        """Drop the oldest pending connection (out of descriptors); whether there was one."""
        oldest = self.pending.oldest(time.monotonic() - _guard.ROOM_AFTER)
        if oldest is not None:
            self.drop(oldest)
        return oldest is not None

    def tick(self, now: float) -> float | None:
        """Resume accepting after a pause, drop overdue handshakes; the next time to act."""
        self.accepting.resume(now)
        for a in self.pending.overdue(now):
            self.drop(a)
        due = (self.pending.next_deadline(), self.accepting.paused_until)
        return min((t for t in due if t is not None), default=None)

    def take(self, a: _Answer) -> None:
        """``a`` has answered: it leaves the selector and the pending connections."""
        self.sel.unregister(a.sock)
        self.pending.discard(a)

    def drop(self, a: _Answer) -> None:
        """Close a pending connection."""
        self.take(a)
        a.sock.close()

    def close(self) -> None:
        """Close the pending connections and the listener; report uncounted failures."""
        for a in self.pending.clear():
            self.drop(a)
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(self.sock)
        self.sock.close()
        self.refused.flush()


def connect_mesh(
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
        BootstrapTimeout: some ranks did not publish, connect or answer in time (its
            cause is a :class:`plait._auth.HandshakeUnanswered` when a peer closed or
            stayed silent before its challenge).
        RendezvousError: ranks disagree on size or streams, or an address is malformed.
        TransportError: this rank cannot listen on ``host``.
    """
    deadline = time.monotonic() + timeout
    secret = _auth.secret()
    done: dict[tuple[int, int], socket.socket] = {}
    sel = selectors.DefaultSelector()
    dials: list[_Dial] = []
    expected = {(j, s) for j in peers if j > rank for s in range(streams)}
    sock = socket.socket(_net.family(host), socket.SOCK_STREAM)
    try:
        tune(sock)
        try:
            sock.bind((host, 0))
            sock.listen(min(socket.SOMAXCONN, max(16, len(expected))))
        except OSError as exc:
            raise TransportError(f"rank {rank}: cannot listen on {host!r}: {exc}") from exc
        sock.setblocking(False)
    except BaseException:
        sock.close()
        sel.close()
        raise
    listener = _Listener(sock, sel, rank, len(expected))
    try:
        address = _net.format_address(host, sock.getsockname()[1])
        store.set(f"{prefix}/addr/{rank}", address.encode())

        lower = sorted(j for j in peers if j < rank)
        keys = [f"{prefix}/addr/{j}" for j in lower]
        if keys:
            try:
                wait_ranks(
                    store,
                    keys,
                    lower,
                    max(deadline - time.monotonic(), 0.0),
                    me=f"rank {rank}",
                    what="publish their address",
                )
            except StoreTimeout as exc:
                missing = [j for j, k in zip(lower, keys, strict=True) if not store.check([k])]
                raise BootstrapTimeout(
                    f"rank {rank}: rank(s) {missing} never published their address "
                    f"(store keys {prefix}/addr/<rank>) within {timeout:g} s"
                ) from exc
        for j, key in zip(lower, keys, strict=True):
            addr = _address(store.get(key).decode())
            dials.extend(_Dial(j, s, addr) for s in range(streams))

        def start(d: _Dial) -> None:
            s = socket.socket(_net.family(d.addr[0]), socket.SOCK_STREAM)
            tune(s)
            s.setblocking(False)
            err = s.connect_ex(d.addr)
            if err not in (0, errno.EINPROGRESS):
                s.close()
                retry(d, os.strerror(err))
                return
            d.sock = s
            d.buf = b""
            d.stage = 0
            sel.register(s, _WRITE, d)

        def retry(d: _Dial, why: str, *, unanswered: bool = False) -> None:
            if d.sock is not None:
                sel.unregister(d.sock)
                d.sock.close()
                d.sock = None
            d.error = why
            d.unanswered = unanswered
            d.retry_at = time.monotonic() + _RETRY
            with contextlib.suppress(RendezvousError):  # the peer may have a new address
                d.addr = _address(store.get(f"{prefix}/addr/{d.peer}", 0.0).decode())

        def check_peer(what: str, fields: tuple[Any, ...], peer: int) -> None:
            if fields[4] != size or fields[5] != streams:
                raise RendezvousError(
                    f"rank {rank}: {what} rank {peer} disagrees on the setup: it has "
                    f"size={fields[4]}, streams={fields[5]}; this rank has size={size}, "
                    f"streams={streams} (set PLAIT_TCP_STREAMS alike on every rank)"
                )

        def timed_out() -> BootstrapTimeout:
            out = sorted({d.peer for d in dials if (d.peer, d.stream) not in done})
            inc = sorted({j for j, s in expected if (j, s) not in done})
            parts = []
            if inc:
                parts.append(f"no connection from rank(s) {inc}")
            if out:
                errs = sorted({d.error for d in dials if d.error})
                parts.append(f"could not connect to rank(s) {out} (last errors: {errs})")
                if os.strerror(errno.ECONNREFUSED) in errs:
                    parts.append(
                        "a rank that published its address and then refuses connections has "
                        "died or given up (see its error)"
                    )
            return BootstrapTimeout(
                f"rank {rank}: TCP bootstrap did not finish within {timeout:g} s: "
                + "; ".join(parts)
            )

        def answered(a: _Answer) -> None:
            """``a`` sent its proof and hello (or hung up): keep it or drop it."""
            listener.take(a)
            want = _auth.RESPONSE_BYTES + HELLO.size
            proof = (
                _auth.check_response(secret, a.nonce, a.buf[: _auth.RESPONSE_BYTES])
                if len(a.buf) == want
                else None
            )
            if proof is None:  # wrong secret or garbage: drop it and keep waiting
                # A proof's worth of bytes that is not one failed authentication; fewer (a
                # port scan, junk, a reset) tried nothing, as the store counts them.
                if len(a.buf) >= _auth.RESPONSE_BYTES:
                    listener.refused.failed(a.peer)
                    with contextlib.suppress(OSError):  # a verdict, not a drop under load
                        a.sock.send(_auth.REFUSED)
                a.sock.close()
                return
            fields = HELLO.unpack(a.buf[_auth.RESPONSE_BYTES :])
            if fields[0] != MAGIC or fields[1] != VERSION:
                a.sock.close()
                return
            reply = proof + HELLO.pack(MAGIC, VERSION, fields[2], rank, size, streams)
            if fields[4] != size or fields[5] != streams:
                with contextlib.suppress(OSError):  # tell the other side too, then fail
                    a.sock.send(reply)
                a.sock.close()
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
                a.sock.close()  # a stranger or a duplicate
                return
            try:
                a.sock.send(reply)
            except OSError:
                a.sock.close()
                return
            done[src] = a.sock

        def refused(d: _Dial, why: str) -> NoReturn:
            """End ``d``: it and this rank do not share the secret (``why``, then
            PLAIT_SECRET)."""
            assert d.sock is not None
            sel.unregister(d.sock)
            d.sock.close()
            d.sock = None
            raise _auth.AuthError(
                f"rank {rank}: {d.addr}, published as rank {d.peer}, {why} PLAIT_SECRET"
            )

        def dialled(d: _Dial) -> None:
            """Bytes (or an end) arrived on an outgoing connection in stage 1 or 2."""
            assert d.sock is not None
            want = _auth.CHALLENGE_BYTES if d.stage == 1 else _auth.MAC + HELLO.size
            try:
                chunk = d.sock.recv(want - len(d.buf))
            except BlockingIOError:
                return
            except OSError as exc:
                if d.stage == 1 and not d.buf:
                    retry(
                        d,
                        f"{d.addr} failed before its challenge: {exc} ({_UNANSWERED})",
                        unanswered=True,
                    )
                else:
                    retry(d, str(exc))
                return
            if not chunk:
                if d.stage == 1:
                    retry(
                        d,
                        f"{d.addr} closed the connection before its challenge ({_UNANSWERED})",
                        unanswered=not d.buf,
                    )
                elif d.buf.startswith(_auth.REFUSED):  # its verdict on our proof
                    refused(d, "refused this rank's proof: the ranks were not given the same")
                else:
                    retry(
                        d,
                        "connection closed during the handshake (dropped as one of too many "
                        "connections authenticating?)",
                    )
                return
            d.buf += chunk
            if len(d.buf) < want:
                return
            if d.stage == 1:  # the challenge: answer it and say hello
                if not d.buf.startswith(_auth.MAGIC):
                    retry(d, f"{d.addr} does not speak plait's protocol")
                    return
                server_nonce = d.buf[len(_auth.MAGIC) :]
                ours = os.urandom(_auth.NONCE)
                d.nonces = (server_nonce, ours)
                try:
                    d.sock.send(
                        ours
                        + _auth.client_proof(secret, server_nonce, ours)
                        + HELLO.pack(MAGIC, VERSION, d.stream, rank, size, streams)
                    )
                except OSError as exc:
                    retry(d, str(exc))
                    return
                d.buf = b""
                d.stage = 2
                return
            if not hmac.compare_digest(d.buf[: _auth.MAC], _auth.server_proof(secret, *d.nonces)):
                refused(d, "failed authentication: it does not know this job's")
            fields = HELLO.unpack(d.buf[_auth.MAC :])
            if (
                fields[0] != MAGIC
                or fields[1] != VERSION
                or fields[2] != d.stream
                or fields[3] != d.peer
            ):
                retry(d, f"{d.addr} answered with something other than rank {d.peer}")
                return
            sel.unregister(d.sock)
            check_peer("accepting", fields, d.peer)
            done[(d.peer, d.stream)] = d.sock
            d.sock = None
            waiting.remove(d)

        next_look = time.monotonic() + LOOK_SECONDS

        def look(now: float) -> float:
            """Fail if a launcher filed a rank not yet connected as dead (Note [lost
            ranks]); when to look next."""
            nonlocal next_look
            if now >= next_look:
                behind = {d.peer for d in waiting} | {j for j, s in expected if (j, s) not in done}
                lost = filed(store, sorted(behind))
                if lost:
                    raise lost_error(f"rank {rank}", lost, "connect over TCP", store)
                next_look = now + LOOK_SECONDS
            return next_look

        for d in dials:
            start(d)
        waiting = list(dials)
        while waiting or len(done) < len(dials) + len(expected):
            now = time.monotonic()
            if now >= deadline:
                late = timed_out()
                silent = [d.error for d in waiting if d.unanswered]
                if silent:
                    raise late from _auth.HandshakeUnanswered(f"rank {rank}: {silent[0]}")
                raise late
            wake = min(deadline, look(now))
            for d in waiting:
                if d.sock is None:
                    if d.retry_at <= now:
                        start(d)
                    if d.sock is None:
                        wake = min(wake, d.retry_at)
                elif d.stage == 1 and not d.buf:
                    if now >= d.silent_until:
                        retry(
                            d,
                            f"{d.addr} stayed silent for {HANDSHAKE_SECONDS:g} s instead of "
                            f"sending its challenge ({_UNANSWERED})",
                            unanswered=True,
                        )
                        wake = min(wake, d.retry_at)
                    else:
                        wake = min(wake, d.silent_until)
            due = listener.tick(now)
            if due is not None:
                wake = min(wake, due)
            for sk, _ in sel.select(max(wake - time.monotonic(), 0.0)):
                item = sk.data
                if item is None:
                    listener.accept()
                elif isinstance(item, _Answer):
                    if item not in listener.pending:
                        continue  # dropped by an accept earlier in this round
                    want = _auth.RESPONSE_BYTES + HELLO.size
                    try:
                        chunk = item.sock.recv(want - len(item.buf))
                    except BlockingIOError:
                        continue
                    except OSError:
                        chunk = b""
                    item.buf += chunk
                    if chunk and len(item.buf) < want:
                        continue
                    answered(item)
                else:
                    d = item
                    if d.sock is None:
                        continue
                    if d.stage == 0:  # connect finished (or failed)
                        err = d.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                        if err:
                            retry(d, os.strerror(err))
                            continue
                        d.stage = 1
                        d.silent_until = time.monotonic() + HANDSHAKE_SECONDS
                        sel.modify(d.sock, _READ, d)
                        continue
                    dialled(d)
        return address, done
    except BaseException:
        for s in done.values():
            s.close()
        for d in dials:
            if d.sock is not None:
                d.sock.close()
        raise
    finally:
        listener.close()
        sel.close()
