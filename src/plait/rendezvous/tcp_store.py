"""The built-in store: a single-threaded TCP key-value server and its client.

One process (usually rank 0 or the launcher) runs a :class:`TCPStoreServer`;
every rank talks to it through a :class:`TCPStore`. Blocking calls (``get``,
``wait``) block on the *server*: it parks the request and answers when the keys
appear, or answers "timeout" when the deadline passes, so clients never poll.

The server is :mod:`plait.rendezvous._tcp_server` (Note [server loop]), the frames both
sides exchange :mod:`plait.rendezvous._tcp_wire` (Note [wire protocol]); this module is
the client, and the place to import both classes from.
"""

from __future__ import annotations

import contextlib
import math
import socket
import threading
import time
from collections.abc import Sequence
from typing import Self

from plait import _auth, _net
from plait.errors import ClosedError, RendezvousError
from plait.rendezvous._tcp_server import TCPStoreServer
from plait.rendezvous._tcp_wire import (
    HEADER,
    MAX_PAYLOAD,
    REQUEST_OVERHEAD,
    SECONDS,
    BadRequest,
    Op,
    Status,
    frame,
    key_list,
    recv_exact,
    split_fields,
)
from plait.rendezvous._tcp_wire import max_value_bytes as _max_value
from plait.rendezvous.store import (
    DEFAULT_STORE_TIMEOUT,
    Store,
    StoreTimeout,
    answer_deadline,
    shown_key,
    shown_keys,
)

__all__ = ["StoreConnectError", "TCPStore", "TCPStoreServer"]

#: Seconds a new connection has to complete the shared-secret handshake, at most: never
#: past the deadline of the connect or call it serves.
_HANDSHAKE_SECONDS = 10.0
#: Seconds a new pooled connection that the server dropped under load is tried again.
_SHED_SECONDS = 1.0
#: Extra seconds a client waits for the answer to a call beyond its timeout, at most:
#: the server answers "timeout" itself, so this only bounds a server that stopped
#: answering without closing the connection. A short call gets a fifth of its time, and
#: _LEAST_GRACE at least, so that a 5 s timeout is not overshot by 10 s.
_ANSWER_GRACE = 10.0
_LEAST_GRACE = 1.0
#: The least seconds a call under a caller's deadline waits for its answer (answers_by).
_LEAST_ANSWER = 0.05
#: Idle connections a client keeps for reuse.
_MAX_IDLE = 8


class StoreConnectError(RendezvousError):
    """The store server could not be reached at its address."""


class TCPStore(Store):
    """A client of a :class:`TCPStoreServer`; safe to share between threads.

    The constructor connects, retrying with a short backoff until
    ``connect_timeout`` because the server may start after its clients. Each
    thread's call uses its own pooled connection, so one thread blocked in
    ``get`` never delays another's ``set``.

    Args:
        host: The server's host name or address (an IPv6 literal may be bracketed).
        port: The server's port.
        timeout: Default seconds for blocking calls (``get``, ``wait``).
        connect_timeout: Seconds to keep trying to connect; None: ``timeout``.
            A server that closes a connection before its challenge (overloaded)
            is retried within this time too.
        secret: The shared secret; None: PLAIT_SECRET.
        max_value_bytes: Largest value :meth:`set` sends; None:
            PLAIT_STORE_MAX_VALUE or 64 MiB, as the server (see
            :func:`plait.rendezvous._tcp_wire.max_value_bytes`).

    Raises:
        StoreConnectError: nothing accepted a connection at ``host:port`` in
            time, the server never started the handshake (its message says it is
            overloaded, not a secret problem), or the secrets differ.
        ValueError: PLAIT_STORE_MAX_VALUE is not a size.

    Every call raises :class:`~plait.errors.RendezvousError` if the server dies
    or closes the connection; blocking calls raise
    :class:`~plait.rendezvous.store.StoreTimeout` naming the missing keys.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        timeout: float = DEFAULT_STORE_TIMEOUT,
        connect_timeout: float | None = None,
        secret: bytes | None = None,
        max_value_bytes: int | None = None,
    ) -> None:
        self.host = _net.strip_brackets(host)
        self.port = port
        self._key = _auth.secret() if secret is None else secret
        #: Largest value :meth:`set` sends.
        self.max_value_bytes = _max_value(max_value_bytes)
        self.address = _net.format_address(self.host, port)
        self.timeout = timeout
        self.connect_timeout = timeout if connect_timeout is None else connect_timeout
        #: The server this client started and closes (see :meth:`create`), else None.
        self.server: TCPStoreServer | None = None
        self._lock = threading.Lock()
        self._idle: list[socket.socket] = []  # connections free for the next call
        self._busy: set[socket.socket] = set()  # connections carrying a call now
        self._closed = False
        self._idle.append(self._connect(self.connect_timeout))

    @classmethod
    def create(
        cls,
        host: str,
        port: int,
        *,
        is_server: bool,
        timeout: float = DEFAULT_STORE_TIMEOUT,
        connect_timeout: float | None = None,
        secret: bytes | None = None,
    ) -> TCPStore:
        """A client, after starting the server in this process if ``is_server``.

        Args:
            host: Address the server listens on and clients connect to.
            port: The server's port; with ``is_server`` 0 picks a free one (the
                result's ``port`` and ``server.port`` tell which).
            is_server: Start a :class:`TCPStoreServer` here; the returned client
                owns it and closes it in :meth:`close`.
            timeout: Default seconds for blocking calls.
            connect_timeout: Seconds to keep trying to connect; None: ``timeout``.
            secret: The shared secret; None: PLAIT_SECRET.
        """
        if not is_server:
            return cls(host, port, timeout=timeout, connect_timeout=connect_timeout, secret=secret)
        server = TCPStoreServer(host, port, secret=secret)
        try:
            client = cls(
                host, server.port, timeout=timeout, connect_timeout=connect_timeout, secret=secret
            )
        except BaseException:
            server.close()
            raise
        client.server = server
        return client

    def __enter__(self) -> Self:
        return self

    def __repr__(self) -> str:
        owner = ", owns server" if self.server is not None else ""
        return f"TCPStore({self.address}{owner})"

    def close(self) -> None:
        """Close the connections (and the server, if this client owns it); idempotent."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            busy = list(self._busy)
        for sock in idle:
            sock.close()
        for sock in busy:  # wakes threads blocked in a call; they raise ClosedError
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        if self.server is not None:
            self.server.close()

    # ---- Store operations

    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key``.

        Raises:
            ValueError: ``value`` is over :attr:`max_value_bytes` (nothing is sent), or
                over the server's limit (the server refuses it and stores nothing).
        """
        data = _value(value)
        if len(data) > self.max_value_bytes:
            raise ValueError(
                f"store {self.address}: set({shown_key(key)}): the value of {len(data)} bytes is "
                f"over the store's limit of {self.max_value_bytes} bytes per value; keep large "
                "data out of the store, or raise PLAIT_STORE_MAX_VALUE on every process "
                "(server and clients)"
            )
        status, fields = self._call(Op.SET, [_key(key), data], f"set({shown_key(key)})")
        if status is Status.BAD_VALUE:  # over the server's limit, where it is lower than ours
            raise ValueError(
                f"store {self.address}: set({shown_key(key)}): {fields[0].decode()}; raise "
                "PLAIT_STORE_MAX_VALUE on every process (server and clients) alike"
            )

    def get(self, key: str, timeout: float | None = None) -> bytes:
        seconds = _seconds(self._timeout(timeout))
        status, fields = self._call(
            Op.GET, [SECONDS.pack(seconds), _key(key)], f"get({shown_key(key)})", seconds
        )
        if status is Status.TIMEOUT:
            raise StoreTimeout(
                f"store {self.address}: get: key {shown_key(key)} not set within {seconds:g} s"
            )
        return fields[0]

    def add(self, key: str, amount: int) -> int:
        status, fields = self._call(
            Op.ADD, [_key(key), str(int(amount)).encode()], f"add({shown_key(key)}, {amount})"
        )
        if status is Status.BAD_VALUE:
            raise ValueError(f"store {self.address}: add({shown_key(key)}): {fields[0].decode()}")
        return int(fields[0])

    def wait(self, keys: Sequence[str], timeout: float | None = None) -> None:
        seconds = _seconds(self._timeout(timeout))
        fields = [SECONDS.pack(seconds), *(_key(k) for k in keys)]
        status, missing = self._call(Op.WAIT, fields, f"wait({len(keys)} keys)", seconds)
        if status is Status.TIMEOUT:
            raise StoreTimeout(
                f"store {self.address}: keys {shown_keys(key_list(missing))} not set within "
                f"{seconds:g} s"
            )

    def check(self, keys: Sequence[str]) -> bool:
        _, fields = self._call(Op.CHECK, [_key(k) for k in keys], f"check({len(keys)} keys)")
        return fields[0] == b"1"

    def delete(self, key: str) -> bool:
        _, fields = self._call(Op.DELETE, [_key(key)], f"delete({shown_key(key)})")
        return fields[0] == b"1"

    # ---- connections

    def _connect(
        self, patience: float, shed: float = 0.0, until: float | None = None
    ) -> socket.socket:
        """An authenticated connection, retrying for ``patience`` seconds.

        Each handshake waits until ``until`` (the deadline of the call it serves) or,
        without one, the end of ``patience`` at most.

        Retried: refused connections (the server may not be up yet) and, for
        ``shed`` seconds if longer, connections the server drops without a
        verdict, before its challenge or after our proof (it is overloaded and
        sheds load; see Note [hostile peers] in :mod:`._tcp_server`). Not
        retried: a handshake that fails on the secret.
        """
        start = time.monotonic()
        deadline = start + patience
        shed_until = start + max(patience, shed)
        delay, max_delay = _net.CONNECT_BACKOFF
        while True:
            try:
                sock = _net.connect(self.host, self.port, max(0.0, deadline - time.monotonic()))
            except OSError as exc:
                within = f" within {patience:.4g} s" if patience > 0 else ""
                if isinstance(exc, TimeoutError):  # nothing refused it: nothing answered
                    hint = (
                        "nothing answered: it may be flooded with connections or overloaded, "
                        "or the address may not reach it (a firewall)"
                    )
                else:
                    hint = "is it running, and is the address right?"
                raise StoreConnectError(
                    f"cannot connect to the store server at {self.address}{within} ({exc}); {hint}"
                ) from exc
            last = until if until is not None else deadline if patience > 0 else math.inf
            bound = answer_deadline()  # a caller's own deadline (answers_by)
            if bound is not None:
                last = min(last, bound)
            handshake = min(_HANDSHAKE_SECONDS, max(last - time.monotonic(), _LEAST_ANSWER))
            try:
                _auth.client_handshake(sock, self._key, handshake, f"store {self.address}")
            except _auth.HandshakeUnanswered as exc:
                sock.close()
                left = shed_until - time.monotonic()
                if left <= 0:
                    raise StoreConnectError(str(exc)) from exc
                time.sleep(min(delay, left))  # nothing to wait on: the server shed us
                delay = min(2 * delay, max_delay)
                continue
            except _auth.ForeignProtocol as exc:
                sock.close()
                raise StoreConnectError(
                    f"{exc}: is the address right? Something other than plait's store listens there"
                ) from exc
            except _auth.AuthError as exc:
                sock.close()
                raise StoreConnectError(f"{exc}; check PLAIT_SECRET") from exc
            return sock

    def _acquire(self, what: str, until: float | None) -> socket.socket:
        with self._lock:
            if self._closed:
                raise ClosedError(f"store {self.address}: {what} after close()")
            sock = self._idle.pop() if self._idle else None
        if sock is None:
            # The server was up when this client connected, so a refused
            # connection now means it is gone: no retrying (but for a drop under load, for
            # a moment: a call with a short timeout must not wait on the store's patience).
            sock = self._connect(0.0, min(self.connect_timeout, _SHED_SECONDS), until)
        with self._lock:
            if self._closed:
                sock.close()
                raise ClosedError(f"store {self.address}: {what} after close()")
            self._busy.add(sock)
        return sock

    def _release(self, sock: socket.socket) -> None:
        with self._lock:
            self._busy.discard(sock)
            if not self._closed and len(self._idle) < _MAX_IDLE:
                self._idle.append(sock)
                return
        sock.close()

    def _call(
        self, op: Op, fields: Sequence[bytes], what: str, blocking: float | None = None
    ) -> tuple[Status, list[bytes]]:
        """Send one request and read its answer on a pooled connection."""
        request = frame(op, fields)
        if len(request) - HEADER.size > self.max_value_bytes + REQUEST_OVERHEAD:
            raise ValueError(
                f"store {self.address}: {what}: a request of {len(request)} bytes is over the "
                f"store's limit ({self.max_value_bytes} bytes per value and "
                f"{REQUEST_OVERHEAD} bytes of keys)"
            )
        # A blocking call may legitimately take ``blocking`` seconds: the server
        # answers "timeout" itself, the grace only covers a server gone silent.
        patience = max(0.0, self.timeout if blocking is None else blocking)
        grace = min(_ANSWER_GRACE, max(_LEAST_GRACE, patience / 5))
        io_timeout = patience + grace if math.isfinite(patience) else None
        bound = answer_deadline()  # a caller's own deadline (answers_by)
        if bound is not None:
            left = max(bound - time.monotonic(), _LEAST_ANSWER)
            io_timeout = left if io_timeout is None else min(io_timeout, left)
        until = None if io_timeout is None else time.monotonic() + io_timeout
        sock = self._acquire(what, until)
        if until is not None:  # what a new connection's handshake took is gone
            io_timeout = max(until - time.monotonic(), _LEAST_ANSWER)
        try:
            sock.settimeout(io_timeout)
            sock.sendall(request)
            code, length = HEADER.unpack(recv_exact(sock, HEADER.size))
            if length > MAX_PAYLOAD:
                raise ConnectionError(f"answer of {length} bytes is not plait's store protocol")
            payload = bytes(recv_exact(sock, length))
            status = Status(code)
            answer = split_fields(payload)
        except (OSError, ValueError, BadRequest) as exc:
            with self._lock:
                self._busy.discard(sock)
                closed = self._closed
            sock.close()
            if closed:
                raise ClosedError(f"store {self.address}: {what} interrupted by close()") from exc
            if isinstance(exc, TimeoutError):
                reason = f"the server did not answer within {io_timeout:.3g} s"
            else:
                reason = f"the connection broke ({exc})"
            raise RendezvousError(
                f"store {self.address}: {what} failed: {reason}; is the store server still running?"
            ) from exc
        self._release(sock)
        if status is Status.BAD_REQUEST:
            raise RendezvousError(
                f"store {self.address}: server rejected {what}: {answer[0].decode()}"
            )
        return status, answer


def _seconds(timeout: float) -> float:
    if math.isnan(timeout):
        raise ValueError("store timeout must be a number of seconds, got NaN")
    return float(timeout)


def _key(key: str) -> bytes:
    if not isinstance(key, str):
        raise TypeError(f"store keys are str, got {type(key).__name__}: {shown_key(key)}")
    return key.encode()


def _value(value: bytes) -> bytes:
    if not isinstance(value, bytes | bytearray | memoryview):
        raise TypeError(f"store values are bytes, got {type(value).__name__}")
    return bytes(value)
