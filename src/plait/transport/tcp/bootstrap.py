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
from typing import Any

from plait import _auth, _net
from plait.errors import CommTimeout, RendezvousError, TransportError
from plait.rendezvous.store import Store, StoreTimeout
from plait.transport.tcp.interfaces import tune
from plait.transport.tcp.wire import HELLO, MAGIC, VERSION

__all__ = ["BootstrapTimeout", "connect_mesh"]

_log = logging.getLogger("plait")
_RETRY = 0.05  # seconds between connection attempts while a peer is not listening yet
_READ, _WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE


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
        BootstrapTimeout: some ranks did not publish, connect or answer in time.
        RendezvousError: ranks disagree on size or streams, or an address is malformed.
        TransportError: this rank cannot listen on ``host``.
    """
    deadline = time.monotonic() + timeout
    secret = _auth.secret()
    done: dict[tuple[int, int], socket.socket] = {}
    listener = socket.socket(_net.family(host), socket.SOCK_STREAM)
    sel = selectors.DefaultSelector()
    dials: list[_Dial] = []
    answers: list[_Answer] = []
    try:
        tune(listener)
        try:
            listener.bind((host, 0))
            backlog = min(socket.SOMAXCONN, max(16, sum(j > rank for j in peers) * streams))
            listener.listen(backlog)
        except OSError as exc:
            raise TransportError(f"rank {rank}: cannot listen on {host!r}: {exc}") from exc
        listener.setblocking(False)
        address = _net.format_address(host, listener.getsockname()[1])
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
            addr = _address(store.get(key).decode())
            dials.extend(_Dial(j, s, addr) for s in range(streams))
        expected = {(j, s) for j in peers if j > rank for s in range(streams)}
        sel.register(listener, _READ, None)

        def start(d: _Dial) -> None:
            sock = socket.socket(_net.family(d.addr[0]), socket.SOCK_STREAM)
            tune(sock)
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
                d.addr = _address(store.get(f"{prefix}/addr/{d.peer}", 0.0).decode())

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
                    fields = HELLO.unpack(item.buf[_auth.RESPONSE_BYTES :])
                    if fields[0] != MAGIC or fields[1] != VERSION:
                        item.sock.close()
                        continue
                    reply = proof + HELLO.pack(MAGIC, VERSION, fields[2], rank, size, streams)
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
                    want = _auth.CHALLENGE_BYTES if d.stage == 1 else _auth.MAC + HELLO.size
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
                                + HELLO.pack(MAGIC, VERSION, d.stream, rank, size, streams)
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
                    fields = HELLO.unpack(d.buf[_auth.MAC :])
                    if (
                        fields[0] != MAGIC
                        or fields[1] != VERSION
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
