"""Mutual authentication of every plait connection by an HMAC challenge.

Note [threat model]
    plait authenticates, it does not encrypt. Every TCP connection (rank to
    rank, rank to store) starts with a challenge-response in both directions
    keyed by a shared secret, so a process that does not know the secret can
    neither join a job, read from the store, nor pose as a rank or a store:
    its connection is dropped (and logged) before any of its bytes are
    interpreted. The secret comes from PLAIT_SECRET; ``plait run`` generates a
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

import hashlib
import hmac
import os
import secrets
import socket
import time

from plait.errors import TransportError

__all__ = [
    "CHALLENGE_BYTES",
    "MAGIC",
    "RESPONSE_BYTES",
    "AuthError",
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


class AuthError(TransportError):
    """The other side of a connection failed the shared-secret handshake."""


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


def _recv_exactly(sock: socket.socket, n: int, deadline: float, what: str) -> bytes:
    data = bytearray()
    while len(data) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AuthError(f"{what}: no handshake within the time allowed")
        sock.settimeout(left)
        try:
            chunk = sock.recv(n - len(data))
        except TimeoutError:
            continue
        except OSError as exc:
            raise AuthError(f"{what}: connection failed during the handshake: {exc}") from exc
        if not chunk:
            raise AuthError(
                f"{what}: the other side closed the connection during the handshake "
                "(a different PLAIT_SECRET?)"
            )
        data += chunk
    return bytes(data)


def client_handshake(sock: socket.socket, key: bytes, timeout: float, what: str) -> None:
    """Run the client side on a connected blocking socket; AuthError if the server fails.

    ``what`` names the connection in messages (e.g. "rank 3 -> store 10.0.0.1:29400").
    """
    deadline = time.monotonic() + timeout
    previous = sock.gettimeout()
    try:
        hello = _recv_exactly(sock, CHALLENGE_BYTES, deadline, what)
        if not hello.startswith(MAGIC):
            raise AuthError(f"{what}: the other side does not speak plait's protocol")
        server_nonce = hello[len(MAGIC) :]
        client_nonce = secrets.token_bytes(NONCE)
        sock.sendall(client_nonce + client_proof(key, server_nonce, client_nonce))
        answer = _recv_exactly(sock, MAC, deadline, what)
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
            raise AuthError(
                f"{what}: the other side failed authentication (it does not know PLAIT_SECRET)"
            )
        sock.sendall(answer)
    finally:
        sock.settimeout(previous)
