"""Mutual authentication of every plait connection by an HMAC challenge.

Note [threat model]
    plait authenticates, it does not encrypt. Every TCP connection (rank to
    rank, rank to store) starts with a challenge-response in both directions
    keyed by a shared secret, so a process that does not know the secret can
    neither join a job, read from the store, nor pose as a rank or a store:
    its connection is dropped (and logged, see :class:`FailureLog`) before any
    of its bytes are interpreted. The secret comes from PLAIT_SECRET; ``plait run`` generates a
    fresh one per job and hands it to its ranks. Other launchers must set
    PLAIT_SECRET themselves on every rank; without it the key is empty and the
    handshake only protects against accidental cross-talk between jobs, not
    against an attacker. Traffic is in the clear: someone who can watch or
    alter packets on the network can read or tamper with data. Run jobs on
    networks you trust, as with MPI and NCCL.

The exchange (server = the accepting side)::

    server -> client   MAGIC (8 bytes) + server nonce (16)
    client -> server   client nonce (16) + HMAC-SHA256(secret, "C" + server nonce + client nonce)
    server -> client   HMAC-SHA256(secret, "S" + client nonce + server nonce)
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable

from plait.errors import TransportError

__all__ = [
    "CHALLENGE_BYTES",
    "FAILURE_SUMMARY_SECONDS",
    "MAGIC",
    "RESPONSE_BYTES",
    "AuthError",
    "FailureLog",
    "HandshakeUnanswered",
    "challenge",
    "client_handshake",
    "client_proof",
    "secret",
    "server_proof",
]

MAGIC = b"PLAITAU1"
NONCE = 16
MAC = 32
CHALLENGE_BYTES = len(MAGIC) + NONCE
RESPONSE_BYTES = NONCE + MAC
#: What a server sends in place of its proof to a client whose proof failed, before it
#: closes: the client can tell a wrong secret from a connection dropped under load.
REFUSED = b"plait: refused".ljust(MAC, b"\0")


#: Seconds between two summaries of failed authentications (see :class:`FailureLog`).
FAILURE_SUMMARY_SECONDS = 60.0

_log = logging.getLogger("plait")


class AuthError(TransportError):
    """The other side of a connection failed the shared-secret handshake."""


class ForeignProtocol(AuthError):
    """The other side's first bytes are not plait's challenge: something other than a
    plait server listens there (never a wrong PLAIT_SECRET)."""


class HandshakeUnanswered(AuthError):
    """The server closed the connection or stayed silent before its challenge, or closed
    it after the client's proof without a verdict (:data:`REFUSED`).

    Never a wrong PLAIT_SECRET (a server refuses that in words): the server is
    overloaded (out of file descriptors, or over its cap of connections still
    authenticating, which drops the oldest first) or is not a plait server at all.
    A client may retry.
    """


class FailureLog:
    """Warnings about connections that failed authentication, at a bounded rate.

    Anyone who can reach a port can fail the handshake as often as they like; a
    warning per failure would let them flood the job's output. The first failure
    is logged at once (with the peer and the likely cause), later ones are counted
    and summarised in one line at most every ``interval`` seconds, and
    :meth:`flush` (call it when the listener closes) reports what is still
    counted. Safe to call from several threads.

    Args:
        where: Who is listening, for the messages ("store 10.0.0.1:29400", "rank 3").
        interval: Least seconds between two summaries.
        clock: The time source (tests pass a fake one).
        emit: Where a line goes; None: a warning on the ``plait`` logger.

    Example::

        refused = FailureLog(f"rank {rank}")
        ...
        if _auth.check_response(key, nonce, response) is None:
            refused.failed(peer)  # then drop the connection
        ...
        refused.flush()  # on close
    """

    def __init__(
        self,
        where: str,
        *,
        interval: float = FAILURE_SUMMARY_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        emit: Callable[[str], None] | None = None,
    ) -> None:
        self.where = where
        self.interval = interval
        self._clock = clock
        self._emit = emit if emit is not None else _log.warning
        self._lock = threading.Lock()
        self._total = 0
        self._unreported = 0
        self._latest: str | None = None
        self._since = 0.0  # when the last line was written

    @property
    def total(self) -> int:
        """Failures seen so far, reported or not."""
        return self._total

    def failed(self, peer: str | None = None) -> None:
        """Count one failed authentication from ``peer`` (``host:port``), logging as due."""
        now = self._clock()
        with self._lock:
            self._total += 1
            self._latest = peer
            if self._total == 1:
                self._since = now
                line = (
                    f"{self.where}: dropped a connection{_from(peer)} that failed "
                    "authentication (it does not know this job's PLAIT_SECRET); further "
                    f"failures are counted and reported at most every {self.interval:g} s"
                )
            else:
                self._unreported += 1
                if now - self._since < self.interval:
                    return
                line = self._summary(now)
        self._emit(line)

    def flush(self) -> None:
        """Report the failures not reported yet, if any."""
        with self._lock:
            if not self._unreported:
                return
            line = self._summary(self._clock())
        self._emit(line)

    def _summary(self, now: float) -> str:
        count, self._unreported = self._unreported, 0
        seconds, self._since = now - self._since, now
        return (
            f"{self.where}: {count} more connection{'s' if count != 1 else ''} failed "
            f"authentication in the last {seconds:.0f} s (latest{_from(self._latest)}; "
            f"{self._total} in all)"
        )


def _from(peer: str | None) -> str:
    return f" from {peer}" if peer else ""


def secret() -> bytes:
    """This process's shared secret (PLAIT_SECRET; empty if unset)."""
    return os.environ.get("PLAIT_SECRET", "").encode()


def challenge() -> tuple[bytes, bytes]:
    """(bytes to send, server nonce) for a new incoming connection."""
    nonce = secrets.token_bytes(NONCE)
    return MAGIC + nonce, nonce


def client_proof(key: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """What a client sends to prove it knows ``key``."""
    return hmac.new(key, b"C" + server_nonce + client_nonce, hashlib.sha256).digest()


def server_proof(key: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """What a server sends back to prove it knows ``key`` too."""
    return hmac.new(key, b"S" + client_nonce + server_nonce, hashlib.sha256).digest()


def check_response(key: bytes, server_nonce: bytes, response: bytes) -> bytes | None:
    """The server's answer to a client's ``response``, or None if the client failed."""
    client_nonce, mac = response[:NONCE], response[NONCE:]
    if len(response) != RESPONSE_BYTES or not hmac.compare_digest(
        mac, client_proof(key, server_nonce, client_nonce)
    ):
        return None
    return server_proof(key, server_nonce, client_nonce)


#: Why a server may close a connection or stay silent before its challenge.
_OVERLOADED = (
    "it may be stopped or hung, out of file descriptors, or holding too many connections "
    "that are still authenticating; no secret was exchanged yet, so the secret is not the "
    "cause"
)
_DROPPED = (
    "the server closed the connection after our proof without a verdict: it is overloaded "
    "and dropped it as one of too many connections still authenticating (a wrong secret it "
    "refuses in words)"
)


def _recv_exactly(
    sock: socket.socket,
    n: int,
    deadline: float,
    what: str,
    *,
    answered: bool = True,
    verdict: bool = False,
) -> bytes:
    """``n`` bytes before ``deadline``; ``answered``: the other side has spoken already.

    Before the other side's first byte (``answered`` False) a closed or silent
    connection is :class:`HandshakeUnanswered`: it cannot be about the secret.
    So is one closed before the first byte of the server's ``verdict`` (its proof, or
    :data:`REFUSED`): it dropped the connection, and said nothing of the secret.
    """
    data = bytearray()
    started = time.monotonic()
    while len(data) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            if not answered and not data:
                raise HandshakeUnanswered(
                    f"{what}: the server accepted the connection but did not start the "
                    f"handshake within {deadline - started:.3g} s ({_OVERLOADED})"
                )
            raise AuthError(f"{what}: no handshake within the time allowed")
        sock.settimeout(left)
        try:
            chunk = sock.recv(n - len(data))
        except TimeoutError:
            continue
        except OSError as exc:
            if not answered and not data:
                raise HandshakeUnanswered(
                    f"{what}: the connection failed before the handshake: {exc} ({_OVERLOADED})"
                ) from exc
            if verdict and not data:
                raise HandshakeUnanswered(f"{what}: {_DROPPED}: {exc}") from exc
            raise AuthError(f"{what}: connection failed during the handshake: {exc}") from exc
        if not chunk:
            if not answered and not data:
                raise HandshakeUnanswered(
                    f"{what}: the server closed the connection before the handshake ({_OVERLOADED})"
                )
            if verdict and not data:
                raise HandshakeUnanswered(f"{what}: {_DROPPED}")
            raise AuthError(
                f"{what}: the other side closed the connection during the handshake: it "
                "does not accept our PLAIT_SECRET (or it dropped us as one of too many "
                "connections still authenticating)"
            )
        data += chunk
    return bytes(data)


def client_handshake(sock: socket.socket, key: bytes, timeout: float, what: str) -> None:
    """Run the client side on a connected blocking socket; AuthError if the server fails.

    ``what`` names the connection in messages (e.g. "rank 3 -> store 10.0.0.1:29400").

    Raises:
        HandshakeUnanswered: the server closed the connection or stayed silent
            before its challenge (overloaded; worth retrying).
        AuthError: the server refused our proof or failed its own.
    """
    deadline = time.monotonic() + timeout
    previous = sock.gettimeout()
    try:
        hello = _recv_exactly(sock, CHALLENGE_BYTES, deadline, what, answered=False)
        if not hello.startswith(MAGIC):
            raise ForeignProtocol(f"{what}: the other side does not speak plait's protocol")
        server_nonce = hello[len(MAGIC) :]
        client_nonce = secrets.token_bytes(NONCE)
        sock.sendall(client_nonce + client_proof(key, server_nonce, client_nonce))
        answer = _recv_exactly(sock, MAC, deadline, what, verdict=True)
        if answer == REFUSED:
            raise AuthError(f"{what}: the other side does not accept our PLAIT_SECRET")
        if not hmac.compare_digest(answer, server_proof(key, server_nonce, client_nonce)):
            raise AuthError(
                f"{what}: the other side failed authentication (it does not know PLAIT_SECRET)"
            )
    finally:
        sock.settimeout(previous)


def server_handshake(sock: socket.socket, key: bytes, timeout: float, what: str) -> None:
    """Run the server side on an accepted blocking socket; AuthError if the client fails."""
    deadline = time.monotonic() + timeout
    previous = sock.gettimeout()
    try:
        hello, server_nonce = challenge()
        sock.sendall(hello)
        response = _recv_exactly(sock, RESPONSE_BYTES, deadline, what)
        answer = check_response(key, server_nonce, response)
        if answer is None:
            with contextlib.suppress(OSError):
                sock.sendall(REFUSED)
            raise AuthError(
                f"{what}: the other side failed authentication (it does not know PLAIT_SECRET)"
            )
        sock.sendall(answer)
    finally:
        sock.settimeout(previous)
