"""The built-in store: a single-threaded TCP key-value server and its client.

One process (usually rank 0 or the launcher) runs a :class:`TCPStoreServer`;
every rank talks to it through a :class:`TCPStore`. Blocking calls (``get``,
``wait``) block on the *server*: it parks the request and answers when the keys
appear, or answers "timeout" when the deadline passes, so clients never poll.

Note [wire protocol]
    Every message, in both directions, is one frame::

        +--------+-----------------+------------------------------------------+
        | code B | payload bytes Q | fields: (length I, bytes) repeated ...   |
        +--------+-----------------+------------------------------------------+

    (network byte order). A request's code is an :class:`_Op`; a response's is a
    :class:`_Status`. Keys travel as UTF-8, values as raw bytes, ``add``'s
    amount and result as decimal ASCII (arbitrary size), and the timeout of a
    blocking call as one big-endian double. Requests and fields:

    ======  =========================  =====================================
    op      request fields             OK response fields
    ======  =========================  =====================================
    SET     key, value                 (none)
    GET     timeout, key               value
    ADD     key, amount                new value
    WAIT    timeout, key...            (none)
    CHECK   key...                     b"1" or b"0"
    DELETE  key                        b"1" or b"0" (whether it existed)
    ======  =========================  =====================================

    A TIMEOUT response carries the keys still missing; an ERROR response one
    message. A connection carries one request at a time (the client holds a
    pool of connections so that threads sharing a client don't queue behind
    each other's blocking calls).

Note [server loop]
    One thread runs a :mod:`selectors` loop over non-blocking sockets. A request
    that must wait is *parked* on its connection under its first missing key;
    each ``set``/``add`` re-examines only the requests parked on that key. The
    deadlines of parked requests sit in a heap whose head sets the selector's
    timeout, so expiry needs no timer thread and no polling.
"""

from __future__ import annotations

import contextlib
import enum
import heapq
import itertools
import logging
import math
import selectors
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Self

from plait import _auth
from plait.errors import ClosedError, RendezvousError
from plait.rendezvous.store import DEFAULT_STORE_TIMEOUT, Store, StoreTimeout

_log = logging.getLogger("plait")
#: Seconds a new connection has to complete the shared-secret handshake.
_HANDSHAKE_SECONDS = 10.0

__all__ = ["StoreConnectError", "TCPStore", "TCPStoreServer"]

_HEADER = struct.Struct("!BQ")  # code, payload length
_FIELD = struct.Struct("!I")  # field length
_SECONDS = struct.Struct("!d")  # timeout of a blocking call

#: Largest frame either side accepts (a frame bigger than this is a corrupt stream).
_MAX_PAYLOAD = 1 << 32
#: Bytes the server reads from a socket per readiness event.
_RECV_CHUNK = 1 << 20
#: Extra seconds a client waits for the answer to a blocking call beyond its
#: timeout: the server answers "timeout" itself, so this only bounds a server
#: that stopped answering without closing the connection.
_ANSWER_GRACE = 10.0
#: First and largest pause between connection attempts while the server is not up.
_CONNECT_BACKOFF = (0.01, 0.25)
#: Idle connections a client keeps for reuse.
_MAX_IDLE = 8


class StoreConnectError(RendezvousError):
    """The store server could not be reached at its address."""


class _Op(enum.IntEnum):
    SET = 1
    GET = 2
    ADD = 3
    WAIT = 4
    CHECK = 5
    DELETE = 6


class _Status(enum.IntEnum):
    OK = 0
    TIMEOUT = 1
    BAD_VALUE = 2  # add on a value that is not an integer
    BAD_REQUEST = 3  # a malformed request: a bug in a client


class _BadRequest(Exception):
    """A well-framed request the server cannot understand."""


def _format_address(host: str, port: int) -> str:
    """``host:port``, with an IPv6 literal in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _strip_brackets(host: str) -> str:
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def _frame(code: int, fields: Sequence[bytes]) -> bytes:
    body = b"".join(_FIELD.pack(len(f)) + f for f in fields)
    return _HEADER.pack(code, len(body)) + body


def _split_fields(payload: bytes) -> list[bytes]:
    fields = []
    pos = 0
    while pos < len(payload):
        if pos + _FIELD.size > len(payload):
            raise _BadRequest(f"truncated field header at byte {pos} of {len(payload)}")
        (length,) = _FIELD.unpack_from(payload, pos)
        pos += _FIELD.size
        if pos + length > len(payload):
            raise _BadRequest(f"field of {length} bytes overruns the {len(payload)}-byte payload")
        fields.append(payload[pos : pos + length])
        pos += length
    return fields


def _is_live(entry: tuple[float, int, _Conn]) -> bool:
    """Whether a deadline-heap entry still belongs to a parked request."""
    parked = entry[2].parked
    return parked is not None and parked.seq == entry[1]


def _key_list(keys: Sequence[bytes]) -> list[str]:
    return [k.decode("utf-8", "replace") for k in keys]


# --------------------------------------------------------------------------- server


class _Parked:
    """A GET or WAIT the server answers later."""

    __slots__ = ("keys", "op", "seq")

    def __init__(self, op: _Op, keys: list[bytes], seq: int) -> None:
        self.op = op
        self.keys = keys
        self.seq = seq


class _Conn:
    """Server-side state of one client connection."""

    __slots__ = ("closed", "inbuf", "nonce", "outbuf", "parked", "sock", "writing")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.nonce: bytes | None = None  # set until the client has authenticated
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.parked: _Parked | None = None
        self.closed = False
        self.writing = False  # registered for EVENT_WRITE


class TCPStoreServer:
    """Serves a key-value store over TCP from one background thread.

    The data lives in this process and dies with the server. Clients connect
    with :class:`TCPStore`; the server listens only on ``host``.

    Args:
        host: Address to listen on (``"127.0.0.1"``, ``"::1"``, ``"0.0.0.0"``, a
            host name; an IPv6 literal may be bracketed).
        port: Port to listen on; 0 picks a free one (read it from :attr:`port`).
        backlog: Connections the kernel queues before the server accepts them.

    Raises:
        RendezvousError: the address cannot be bound (in use, not local, ...).

    Example::

        with TCPStoreServer("127.0.0.1", 0) as server:
            store = TCPStore("127.0.0.1", server.port)
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        backlog: int = 1024,
        secret: bytes | None = None,
    ) -> None:
        self.host = _strip_brackets(host)
        # Clients must prove they know this key before any request is read.
        self._key = _auth.secret() if secret is None else secret
        address = _format_address(self.host, port)
        try:
            infos = socket.getaddrinfo(
                self.host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )
            family, kind, proto, _, sockaddr = infos[0]
            listener = socket.socket(family, kind, proto)
        except OSError as exc:
            raise RendezvousError(f"store server cannot listen on {address}: {exc}") from exc
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(sockaddr)
            listener.listen(backlog)
            listener.setblocking(False)
        except OSError as exc:
            listener.close()
            raise RendezvousError(f"store server cannot listen on {address}: {exc}") from exc
        self.port: int = listener.getsockname()[1]
        #: ``host:port`` clients connect to (IPv6 literal bracketed).
        self.address = _format_address(self.host, self.port)

        self._listener = listener
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)

        self._data: dict[bytes, bytes] = {}
        self._conns: set[_Conn] = set()
        self._waiters: dict[bytes, set[_Conn]] = {}  # key -> connections parked on it
        self._deadlines: list[tuple[float, int, _Conn]] = []  # heap of parked deadlines
        self._parked = 0
        self._seq = itertools.count()
        self._runnable: deque[_Conn] = deque()  # unparked, may hold more requests

        self._closing = False
        self._close_lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._serve, name=f"plait-tcp-store-server {self.address}", daemon=True
        )
        self._thread.start()

    def __repr__(self) -> str:
        state = "closed" if self._closing else "serving"
        return f"TCPStoreServer({self.address}, {state})"

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop serving: close every connection and the listening socket.

        Clients blocked in a call get :class:`~plait.errors.RendezvousError`.
        Calling it again does nothing.
        """
        with self._close_lock:
            if self._closing:
                return
            self._closing = True
        with contextlib.suppress(OSError):  # the loop may have ended and closed it
            self._wake_w.send(b"x")
        self._thread.join()

    # The rest runs on the server thread only.

    def _serve(self) -> None:
        try:
            while not self._closing:
                for key, mask in self._selector.select(self._next_timeout()):
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        self._drain_wake()
                    else:
                        conn: _Conn = key.data
                        if mask & selectors.EVENT_WRITE:
                            self._flush(conn)
                        if mask & selectors.EVENT_READ:
                            self._read(conn)
                self._expire()
                while self._runnable:
                    self._process(self._runnable.popleft())
        finally:
            for conn in list(self._conns):
                self._drop(conn)
            self._selector.close()
            self._listener.close()
            self._wake_r.close()
            self._wake_w.close()

    def _next_timeout(self) -> float | None:
        if self._runnable:
            return 0.0
        if not self._deadlines:
            return None
        return max(0.0, self._deadlines[0][0] - time.monotonic())

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(64):
                pass
        except BlockingIOError:
            pass

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # e.g. out of file descriptors; the client retries
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock)
            self._conns.add(conn)
            self._selector.register(sock, selectors.EVENT_READ, conn)
            hello, conn.nonce = _auth.challenge()
            conn.outbuf += hello
            self._flush(conn)

    def _drop(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        self._unpark(conn)
        self._conns.discard(conn)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn.sock)
        conn.sock.close()

    def _read(self, conn: _Conn) -> None:
        if conn.closed:
            return
        try:
            chunk = conn.sock.recv(_RECV_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn)
            return
        if not chunk:
            self._drop(conn)
            return
        conn.inbuf += chunk
        self._process(conn)

    def _flush(self, conn: _Conn) -> None:
        if conn.closed:
            return
        try:
            while conn.outbuf:
                sent = conn.sock.send(conn.outbuf)
                del conn.outbuf[:sent]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._drop(conn)
            return
        want_write = bool(conn.outbuf)
        if want_write != conn.writing:
            conn.writing = want_write
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if want_write else 0)
            self._selector.modify(conn.sock, events, conn)

    def _reply(self, conn: _Conn, status: _Status, fields: Sequence[bytes] = ()) -> None:
        if conn.closed:
            return
        conn.outbuf += _frame(status, fields)
        self._flush(conn)

    def _process(self, conn: _Conn) -> None:
        """Handle complete requests in ``conn``'s buffer until one parks."""
        if conn.nonce is not None:  # still authenticating: nothing else is read
            if len(conn.inbuf) < _auth.RESPONSE_BYTES:
                return
            answer = _auth.check_response(
                self._key, conn.nonce, bytes(conn.inbuf[: _auth.RESPONSE_BYTES])
            )
            if answer is None:
                _log.warning("store %s: dropped a client that failed authentication", self.address)
                self._drop(conn)
                return
            del conn.inbuf[: _auth.RESPONSE_BYTES]
            conn.nonce = None
            conn.outbuf += answer
            self._flush(conn)
        while not conn.closed and conn.parked is None:
            if len(conn.inbuf) < _HEADER.size:
                return
            code, length = _HEADER.unpack_from(conn.inbuf)
            if length > _MAX_PAYLOAD:  # not our protocol: stop reading this stream
                self._drop(conn)
                return
            end = _HEADER.size + length
            if len(conn.inbuf) < end:
                return
            payload = bytes(conn.inbuf[_HEADER.size : end])
            del conn.inbuf[:end]
            try:
                self._handle(conn, code, _split_fields(payload))
            except _BadRequest as exc:
                self._reply(conn, _Status.BAD_REQUEST, [str(exc).encode()])

    def _handle(self, conn: _Conn, code: int, fields: list[bytes]) -> None:
        try:
            op = _Op(code)
        except ValueError:
            raise _BadRequest(f"unknown operation code {code}") from None
        data = self._data
        if op is _Op.SET:
            key, value = self._expect(op, fields, 2)
            data[key] = value
            self._reply(conn, _Status.OK)
            self._notify(key)
        elif op is _Op.GET:
            seconds, key = self._expect(op, fields, 2)
            if key in data:
                self._reply(conn, _Status.OK, [data[key]])
            else:
                self._park(conn, op, [key], self._seconds(seconds))
        elif op is _Op.ADD:
            key, amount = self._expect(op, fields, 2)
            try:
                total = int(data.get(key, b"0")) + int(amount)
            except ValueError:
                message = f"value of key {key!r} is not an integer: {data.get(key)!r:.80}"
                self._reply(conn, _Status.BAD_VALUE, [message.encode()])
                return
            data[key] = str(total).encode()
            self._reply(conn, _Status.OK, [data[key]])
            self._notify(key)
        elif op is _Op.WAIT:
            if not fields:
                raise _BadRequest("WAIT needs a timeout field")
            keys = fields[1:]
            if all(k in data for k in keys):
                self._reply(conn, _Status.OK)
            else:
                self._park(conn, op, keys, self._seconds(fields[0]))
        elif op is _Op.CHECK:
            self._reply(conn, _Status.OK, [b"1" if all(k in data for k in fields) else b"0"])
        else:  # _Op.DELETE
            (key,) = self._expect(op, fields, 1)
            self._reply(conn, _Status.OK, [b"1" if data.pop(key, None) is not None else b"0"])

    @staticmethod
    def _expect(op: _Op, fields: list[bytes], count: int) -> list[bytes]:
        if len(fields) != count:
            raise _BadRequest(f"{op.name} takes {count} fields, got {len(fields)}")
        return fields

    @staticmethod
    def _seconds(field: bytes) -> float:
        if len(field) != _SECONDS.size:
            raise _BadRequest(f"a timeout is {_SECONDS.size} bytes, got {len(field)}")
        seconds = float(_SECONDS.unpack(field)[0])
        if math.isnan(seconds):
            raise _BadRequest("timeout is NaN")
        return max(0.0, seconds)

    def _park(self, conn: _Conn, op: _Op, keys: list[bytes], seconds: float) -> None:
        seq = next(self._seq)
        conn.parked = _Parked(op, keys, seq)
        self._parked += 1
        if math.isfinite(seconds):
            heapq.heappush(self._deadlines, (time.monotonic() + seconds, seq, conn))
        self._try_answer(conn)

    def _unpark(self, conn: _Conn) -> None:
        parked = conn.parked
        if parked is None:
            return
        conn.parked = None
        self._parked -= 1
        for key in parked.keys:  # the connection waits under at most one of them
            waiters = self._waiters.get(key)
            if waiters is not None and conn in waiters:
                waiters.discard(conn)
                if not waiters:
                    del self._waiters[key]
                break
        # Completed requests leave stale heap entries; rebuild when they dominate.
        if len(self._deadlines) > 64 and len(self._deadlines) > 4 * self._parked:
            self._deadlines = [e for e in self._deadlines if _is_live(e)]
            heapq.heapify(self._deadlines)
        if not conn.closed:
            self._runnable.append(conn)

    def _try_answer(self, conn: _Conn) -> None:
        """Answer ``conn``'s parked request if its keys are all set, else wait on one."""
        parked = conn.parked
        assert parked is not None
        missing = next((k for k in parked.keys if k not in self._data), None)
        if missing is not None:
            self._waiters.setdefault(missing, set()).add(conn)
            return
        self._unpark(conn)
        if parked.op is _Op.GET:
            self._reply(conn, _Status.OK, [self._data[parked.keys[0]]])
        else:
            self._reply(conn, _Status.OK)

    def _notify(self, key: bytes) -> None:
        for conn in self._waiters.pop(key, ()):
            if conn.parked is not None and not conn.closed:
                self._try_answer(conn)

    def _expire(self) -> None:
        now = time.monotonic()
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            _, seq, conn = heapq.heappop(heap)
            parked = conn.parked
            if parked is None or parked.seq != seq or conn.closed:
                continue  # answered or dropped already
            missing = [k for k in parked.keys if k not in self._data]
            self._unpark(conn)
            self._reply(conn, _Status.TIMEOUT, missing)


# --------------------------------------------------------------------------- client


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

    Raises:
        StoreConnectError: nothing accepted a connection at ``host:port`` in time.

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
    ) -> None:
        self.host = _strip_brackets(host)
        self.port = port
        self._key = _auth.secret() if secret is None else secret
        self.address = _format_address(self.host, port)
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
        self._call(_Op.SET, [_key(key), _value(value)], f"set({key!r})")

    def get(self, key: str, timeout: float | None = None) -> bytes:
        seconds = _seconds(self._timeout(timeout))
        status, fields = self._call(
            _Op.GET, [_SECONDS.pack(seconds), _key(key)], f"get({key!r})", seconds
        )
        if status is _Status.TIMEOUT:
            raise StoreTimeout(f"store {self.address}: get: key {key!r} not set within {seconds} s")
        return fields[0]

    def add(self, key: str, amount: int) -> int:
        status, fields = self._call(
            _Op.ADD, [_key(key), str(int(amount)).encode()], f"add({key!r}, {amount})"
        )
        if status is _Status.BAD_VALUE:
            raise ValueError(f"store {self.address}: add({key!r}): {fields[0].decode()}")
        return int(fields[0])

    def wait(self, keys: Sequence[str], timeout: float | None = None) -> None:
        seconds = _seconds(self._timeout(timeout))
        fields = [_SECONDS.pack(seconds), *(_key(k) for k in keys)]
        status, missing = self._call(_Op.WAIT, fields, f"wait({len(keys)} keys)", seconds)
        if status is _Status.TIMEOUT:
            raise StoreTimeout(
                f"store {self.address}: keys {_key_list(missing)} not set within {seconds} s"
            )

    def check(self, keys: Sequence[str]) -> bool:
        _, fields = self._call(_Op.CHECK, [_key(k) for k in keys], f"check({len(keys)} keys)")
        return fields[0] == b"1"

    def delete(self, key: str) -> bool:
        _, fields = self._call(_Op.DELETE, [_key(key)], f"delete({key!r})")
        return fields[0] == b"1"

    # ---- connections

    def _connect(self, patience: float) -> socket.socket:
        """A connection to the server, retrying refused attempts for ``patience`` seconds."""
        deadline = time.monotonic() + patience
        delay, max_delay = _CONNECT_BACKOFF
        while True:
            left = deadline - time.monotonic()
            try:
                sock = socket.create_connection((self.host, self.port), timeout=max(left, 0.05))
            except OSError as exc:
                left = deadline - time.monotonic()
                if left <= 0:
                    within = f" within {patience} s" if patience > 0 else ""
                    raise StoreConnectError(
                        f"cannot connect to the store server at {self.address}{within} "
                        f"({exc}); is it running, and is the address right?"
                    ) from exc
                # Retrying is the point here: the server may not be listening yet.
                time.sleep(min(delay, left))
                delay = min(2 * delay, max_delay)
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                _auth.client_handshake(sock, self._key, _HANDSHAKE_SECONDS, f"store {self.address}")
            except _auth.AuthError as exc:
                sock.close()
                raise StoreConnectError(f"{exc}; check PLAIT_SECRET") from exc
            return sock

    def _acquire(self, what: str) -> socket.socket:
        with self._lock:
            if self._closed:
                raise ClosedError(f"store {self.address}: {what} after close()")
            sock = self._idle.pop() if self._idle else None
        if sock is None:
            # The server was up when this client connected, so a refused
            # connection now means it is gone: no retrying.
            sock = self._connect(0.0)
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
        self, op: _Op, fields: Sequence[bytes], what: str, blocking: float | None = None
    ) -> tuple[_Status, list[bytes]]:
        """Send one request and read its answer on a pooled connection."""
        sock = self._acquire(what)
        # A blocking call may legitimately take ``blocking`` seconds: the server
        # answers "timeout" itself, the grace only covers a server gone silent.
        patience = max(0.0, self.timeout if blocking is None else blocking)
        io_timeout = patience + _ANSWER_GRACE if math.isfinite(patience) else None
        try:
            sock.settimeout(io_timeout)
            sock.sendall(_frame(op, fields))
            code, length = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
            if length > _MAX_PAYLOAD:
                raise ConnectionError(f"answer of {length} bytes is not plait's store protocol")
            payload = bytes(_recv_exact(sock, length))
            status = _Status(code)
            answer = _split_fields(payload)
        except (OSError, ValueError, _BadRequest) as exc:
            with self._lock:
                self._busy.discard(sock)
                closed = self._closed
            sock.close()
            if closed:
                raise ClosedError(f"store {self.address}: {what} interrupted by close()") from exc
            if isinstance(exc, TimeoutError):
                reason = f"the server did not answer within {io_timeout} s"
            else:
                reason = f"the connection broke ({exc})"
            raise RendezvousError(
                f"store {self.address}: {what} failed: {reason}; is the store server still running?"
            ) from exc
        self._release(sock)
        if status is _Status.BAD_REQUEST:
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
        raise TypeError(f"store keys are str, got {type(key).__name__}: {key!r}")
    return key.encode()


def _value(value: bytes) -> bytes:
    if not isinstance(value, bytes | bytearray | memoryview):
        raise TypeError(f"store values are bytes, got {type(value).__name__}")
    return bytes(value)


def _recv_exact(sock: socket.socket, nbytes: int) -> bytearray:
    buf = bytearray(nbytes)
    view = memoryview(buf)
    got = 0
    while got < nbytes:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("the server closed the connection")
        got += n
    return buf
