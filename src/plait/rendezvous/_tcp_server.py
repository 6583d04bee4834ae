"""The built-in store's server: one thread, a selectors loop, parked blocking requests.

:class:`TCPStoreServer` is usually run by the launcher or by rank 0; ranks talk to it
through :class:`plait.rendezvous.tcp_store.TCPStore` (both are importable from there).
The frames it reads and writes are in :mod:`plait.rendezvous._tcp_wire`.

Note [server loop]
    One thread runs a :mod:`selectors` loop over non-blocking sockets. A request
    that must wait is *parked* on its connection under its first missing key;
    each ``set``/``add`` re-examines only the requests parked on that key. The
    deadlines of parked requests sit in a heap whose head sets the selector's
    timeout, so expiry needs no timer thread and no polling.

Note [hostile peers]
    Anyone who can reach the port can connect, so nothing a peer does before it
    has authenticated may cost the server more than a bounded amount. The rules
    it shares with the TCP transport's setup are in one place,
    :mod:`plait._guard` Note [unauthenticated connections]: here a connection has
    :data:`HANDSHAKE_SECONDS` to answer the challenge, at most
    ``max_unauthenticated`` may be authenticating at once (oldest dropped first, but
    for one whose proof has come unread: it is read first, and heard),
    ``accept`` out of descriptors pauses the listener (:data:`ACCEPT_BACKOFF`,
    logged once) and failed handshakes go to an :class:`plait._auth.FailureLog`.
    Beyond those, a request larger than the value limit (PLAIT_STORE_MAX_VALUE,
    64 MiB by default) is refused from its header, before its payload is read.

Note [replies nobody reads]
    An authenticated client, too, must not make the server hold more than a
    bounded amount: a client that sends GETs of a large value and never reads
    the replies made it buffer each reply (800 MiB for a hundred of 8 MiB). So
    a connection whose unsent replies are over the request limit has its next
    request wait in its input until they leave (it is run again once a flush
    brings them under), and its input is capped as for a stream behind a parked
    request: such a client is dropped, an honest one (one request at a time)
    never waits. An ADD counts in 64 bits, as torch's store does: a value or
    an amount of thousands of digits made ``str`` of the sum raise in the
    server thread, which ended, and the store with it.

    A server that listens beyond the loopback interface with an empty key
    (no PLAIT_SECRET, as under torchrun) says once that it is open to anyone.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import math
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Self

from plait import _auth, _guard, _net
from plait.errors import RendezvousError
from plait.rendezvous._tcp_wire import (
    HEADER,
    REQUEST_OVERHEAD,
    SECONDS,
    BadRequest,
    Op,
    Status,
    frame,
    split_fields,
)
from plait.rendezvous._tcp_wire import (
    max_value_bytes as _max_value,
)

__all__ = ["ACCEPT_BACKOFF", "HANDSHAKE_SECONDS", "MAX_UNAUTHENTICATED", "TCPStoreServer"]

_log = logging.getLogger("plait")
#: Bytes the server reads from a socket per readiness event.
_RECV_CHUNK = 1 << 20
# The store's own copies of the limits of Note [unauthenticated connections], read
# when a server starts, so that the store can be tuned apart from the TCP setup.
#: Seconds a new connection has to complete the handshake (as long as a client waits).
HANDSHAKE_SECONDS = _guard.HANDSHAKE_SECONDS
#: Most connections authenticating at once, unless ``max_unauthenticated=`` says
#: otherwise; never more than a quarter of the descriptor limit (but at least
#: :data:`_MIN_UNAUTHENTICATED`).
MAX_UNAUTHENTICATED = _guard.MAX_UNAUTHENTICATED
_MIN_UNAUTHENTICATED = _guard.MIN_UNAUTHENTICATED
#: First and longest pause in accepting after running out of file descriptors.
ACCEPT_BACKOFF = _guard.ACCEPT_BACKOFF


def _unauthenticated_cap(explicit: int | None) -> int:
    """The cap on connections authenticating at once (see :data:`MAX_UNAUTHENTICATED`)."""
    cap = MAX_UNAUTHENTICATED if explicit is None else explicit
    if cap < 1:
        raise ValueError(f"max_unauthenticated must be at least 1, got {cap}")
    return _guard.unauthenticated_cap(cap, _MIN_UNAUTHENTICATED)


_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def _int64(raw: bytes) -> int | None:
    """``raw`` (ASCII digits) as the 64-bit integer an ADD counts in, else None (also for
    thousands of digits, which ``int`` refuses with a ValueError of its own, and ``str`` of
    their sum raised in the server thread, which ended it)."""
    if len(raw) > 24:
        return None
    try:
        value = int(raw)
    except ValueError:
        return None
    return value if _INT64_MIN <= value <= _INT64_MAX else None


def _shown(raw: bytes) -> str:
    """The start of a value, for a message (of its length where it is long)."""
    text = raw[:40].decode(errors="backslashreplace")
    return text if len(raw) <= 40 else f"{text}... ({len(raw)} bytes)"


def _is_live(entry: tuple[float, int, _Conn]) -> bool:
    """Whether a deadline-heap entry still belongs to a parked request."""
    parked = entry[2].parked
    return parked is not None and parked.seq == entry[1]


class _Parked:
    """A GET or WAIT the server answers later."""

    __slots__ = ("keys", "op", "seq")

    def __init__(self, op: Op, keys: list[bytes], seq: int) -> None:
        self.op = op
        self.keys = keys
        self.seq = seq


class _Conn:
    """Server-side state of one client connection."""

    __slots__ = ("closed", "inbuf", "nonce", "outbuf", "parked", "peer", "sock", "writing")

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer  # host:port, for messages
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
        secret: The key clients must prove they know; None: PLAIT_SECRET.
        max_value_bytes: Largest value accepted; None: PLAIT_STORE_MAX_VALUE or
            64 MiB. A larger request is refused from its header (see
            Note [hostile peers]).
        max_unauthenticated: Most connections authenticating at once; None:
            :data:`MAX_UNAUTHENTICATED`, bounded by a quarter of the descriptor limit.

    Raises:
        RendezvousError: the address cannot be bound (in use, not local, ...).
        ValueError: PLAIT_STORE_MAX_VALUE or a limit is not a positive number.

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
        max_value_bytes: int | None = None,
        max_unauthenticated: int | None = None,
    ) -> None:
        if secret is not None and not isinstance(secret, bytes):  # a str failed every proof
            raise TypeError(
                f"TCPStoreServer: secret must be bytes (e.g. secret.encode()); got "
                f"{type(secret).__name__}"
            )
        self.host = _net.strip_brackets(host)
        # Clients must prove they know this key before any request is read.
        self._key = _auth.secret() if secret is None else secret
        #: Largest value this server stores.
        self.max_value_bytes = _max_value(max_value_bytes)
        self._max_request = self.max_value_bytes + REQUEST_OVERHEAD
        # Connections still authenticating, oldest first, with their deadlines.
        self._pending = _guard.PendingHandshakes[_Conn](
            _unauthenticated_cap(max_unauthenticated), HANDSHAKE_SECONDS
        )
        address = _net.format_address(self.host, port)
        try:
            listener = _net.listen(self.host, port, backlog=backlog)
        except OSError as exc:
            raise RendezvousError(f"store server cannot listen on {address}: {exc}") from exc
        self.port: int = listener.getsockname()[1]
        #: ``host:port`` clients connect to (IPv6 literal bracketed).
        self.address = _net.format_address(self.host, self.port)

        self._listener = listener
        if not self._key and not _net.is_loopback(listener.getsockname()[0]):
            _log.warning(
                "store %s listens beyond this machine without a shared secret: anyone who "
                "can reach it can read and write the job's store. Set PLAIT_SECRET to the "
                "same value on every rank (plait run does this itself).",
                self.address,
            )
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._accepting = _guard.AcceptBackoff(
            listener, self._selector, f"store {self.address}", schedule=ACCEPT_BACKOFF
        )
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)

        self._data: dict[bytes, bytes] = {}
        self._conns: set[_Conn] = set()
        self._waiters: dict[bytes, set[_Conn]] = {}  # key -> connections parked on it
        self._deadlines: list[tuple[float, int, _Conn]] = []  # heap of parked deadlines
        self._parked = 0
        self._seq = itertools.count()
        self._runnable: deque[_Conn] = deque()  # unparked, may hold more requests
        self._faults = 0  # connections dropped after an error of the server's (_serve_one)
        self._refused = _auth.FailureLog(f"store {self.address}")
        self._oversized = 0  # requests refused for their size

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
                self._accepting.resume(time.monotonic())
                for key, mask in self._selector.select(self._next_timeout()):
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        self._drain_wake()
                    else:
                        self._serve_one(key.data, mask)
                self._expire()
                while self._runnable:
                    self._serve_one(self._runnable.popleft(), 0)
        finally:
            for conn in list(self._conns):
                self._drop(conn)
            self._refused.flush()
            self._selector.close()
            self._listener.close()
            self._wake_r.close()
            self._wake_w.close()

    def _next_timeout(self) -> float | None:
        if self._runnable:
            return 0.0
        due = [
            t
            for t in (
                self._deadlines[0][0] if self._deadlines else None,
                self._pending.next_deadline(),
                self._accepting.paused_until,
            )
            if t is not None
        ]
        return max(0.0, min(due) - time.monotonic()) if due else None

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(64):
                pass
        except BlockingIOError:
            pass

    def _accept(self) -> None:
        for sock, peer in self._accepting.accepted(self._pending.cap, self._make_room):
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock, peer)
            self._conns.add(conn)
            oldest = self._pending.admit(conn, time.monotonic())
            if oldest is not None:
                self._push_out(oldest)
            self._selector.register(sock, selectors.EVENT_READ, conn)
            hello, conn.nonce = _auth.challenge()
            conn.outbuf += hello
            self._flush(conn)

    def _make_room(self) -> bool:
        """Drop the oldest connection still authenticating (out of descriptors); whether
        there was one."""
        oldest = self._pending.oldest(time.monotonic() - _guard.ROOM_AFTER)
        if oldest is not None:
            self._push_out(oldest)
        return oldest is not None

    def _push_out(self, conn: _Conn) -> None:
        """Drop ``conn``, the oldest connection authenticating, to make room; unless its
        proof has come and not been read yet (it came in the same turn of the loop as a
        flood of new connections, and an honest client was pushed out with it unread)."""
        self._read(conn)
        if conn.nonce is not None:
            self._drop(conn)

    def _serve_one(self, conn: _Conn, mask: int) -> None:
        """Serve ``conn``: write for ``mask``'s EVENT_WRITE, read for its EVENT_READ, and
        with neither, run the requests it holds. A defect that raises while serving one
        connection drops that connection, logged once, never the server (whose thread
        ended, taking the store from every rank, on an add of thousands of digits)."""
        try:
            if mask & selectors.EVENT_WRITE:
                self._flush(conn)
            if mask & selectors.EVENT_READ:
                self._read(conn)
            if not mask:
                self._process(conn)
        except Exception:
            self._faults += 1
            level = logging.ERROR if self._faults == 1 else logging.DEBUG
            _log.log(
                level, "store %s: dropped %s after an error", self.address, conn.peer, exc_info=True
            )
            self._drop(conn)

    def _drop(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        self._unpark(conn)
        self._conns.discard(conn)
        self._pending.discard(conn)
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
        # An honest client sends one request at a time; a stream piling up behind a
        # parked request is not one, and must not grow without bound.
        if not conn.closed and len(conn.inbuf) > HEADER.size + self._max_request:
            self._refuse(conn, len(conn.inbuf), "unanswered requests")

    def _flush(self, conn: _Conn) -> None:
        if conn.closed:
            return
        held = len(conn.outbuf) > self._max_request  # requests wait behind it
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
        if held and conn.inbuf and len(conn.outbuf) <= self._max_request:
            self._runnable.append(conn)  # the requests that waited for its replies to leave
        if want_write != conn.writing:
            conn.writing = want_write
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if want_write else 0)
            self._selector.modify(conn.sock, events, conn)

    def _reply(self, conn: _Conn, status: Status, fields: Sequence[bytes] = ()) -> None:
        if conn.closed:
            return
        conn.outbuf += frame(status, fields)
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
                self._refused.failed(conn.peer)
                with contextlib.suppress(OSError):  # a verdict, not a drop under load
                    conn.sock.send(_auth.REFUSED)
                self._drop(conn)
                return
            del conn.inbuf[: _auth.RESPONSE_BYTES]
            conn.nonce = None
            self._pending.discard(conn)
            conn.outbuf += answer
            self._flush(conn)
        while not conn.closed and conn.parked is None:
            if len(conn.outbuf) > self._max_request:
                return  # Note [replies nobody reads]: the next request waits for the flush
            if len(conn.inbuf) < HEADER.size:
                return
            code, length = HEADER.unpack_from(conn.inbuf)
            if length > self._max_request:  # refused before its payload is read
                self._refuse(conn, length, "a request")
                return
            end = HEADER.size + length
            if len(conn.inbuf) < end:
                return
            payload = bytes(conn.inbuf[HEADER.size : end])
            del conn.inbuf[:end]
            try:
                self._handle(conn, code, split_fields(payload))
            except BadRequest as exc:
                self._reply(conn, Status.BAD_REQUEST, [str(exc).encode()])

    def _refuse(self, conn: _Conn, nbytes: int, what: str) -> None:
        """Answer that ``what`` of ``nbytes`` is over the limit, and drop ``conn``."""
        message = (
            f"{what} of {nbytes} bytes is over this store's limit of {self.max_value_bytes} "
            "bytes per value (PLAIT_STORE_MAX_VALUE)"
        )
        # Logged in full once: an authenticated peer must not be able to flood the log either.
        self._oversized += 1
        level = logging.WARNING if self._oversized == 1 else logging.DEBUG
        _log.log(level, "store %s: dropped %s: %s", self.address, conn.peer, message)
        self._reply(conn, Status.BAD_REQUEST, [message.encode()])
        self._drop(conn)

    def _handle(self, conn: _Conn, code: int, fields: list[bytes]) -> None:
        try:
            op = Op(code)
        except ValueError:
            raise BadRequest(f"unknown operation code {code}") from None
        data = self._data
        if op is Op.SET:
            key, value = self._expect(op, fields, 2)
            if len(value) > self.max_value_bytes:  # the request's limit also allows for keys
                message = (
                    f"the value of {len(value)} bytes is over this store's limit of "
                    f"{self.max_value_bytes} bytes per value (PLAIT_STORE_MAX_VALUE)"
                )
                self._reply(conn, Status.BAD_VALUE, [message.encode()])
                return
            data[key] = value
            self._reply(conn, Status.OK)
            self._notify(key)
        elif op is Op.GET:
            seconds, key = self._expect(op, fields, 2)
            if key in data:
                self._reply(conn, Status.OK, [data[key]])
            else:
                self._park(conn, op, [key], self._seconds(seconds))
        elif op is Op.ADD:
            key, amount = self._expect(op, fields, 2)
            was, step = _int64(data.get(key, b"0")), _int64(amount)
            total = None if was is None or step is None else was + step
            if total is None or not _INT64_MIN <= total <= _INT64_MAX:
                name = key.decode(errors="backslashreplace")
                if was is None:
                    message = f"value of key {name!r} is not a 64-bit integer: {_shown(data[key])}"
                elif step is None:
                    message = f"the amount added to {name!r} is not a 64-bit integer: "
                    message += _shown(amount)
                else:
                    message = f"adding {step} to {name!r} ({was}) leaves the 64 bits of a counter"
                self._reply(conn, Status.BAD_VALUE, [message.encode()])
                return
            data[key] = str(total).encode()
            self._reply(conn, Status.OK, [data[key]])
            self._notify(key)
        elif op is Op.WAIT:
            if not fields:
                raise BadRequest("WAIT needs a timeout field")
            keys = fields[1:]
            if all(k in data for k in keys):
                self._reply(conn, Status.OK)
            else:
                self._park(conn, op, keys, self._seconds(fields[0]))
        elif op is Op.CHECK:
            self._reply(conn, Status.OK, [b"1" if all(k in data for k in fields) else b"0"])
        else:  # Op.DELETE
            (key,) = self._expect(op, fields, 1)
            self._reply(conn, Status.OK, [b"1" if data.pop(key, None) is not None else b"0"])

    @staticmethod
    def _expect(op: Op, fields: list[bytes], count: int) -> list[bytes]:
        if len(fields) != count:
            raise BadRequest(f"{op.name} takes {count} fields, got {len(fields)}")
        return fields

    @staticmethod
    def _seconds(field: bytes) -> float:
        if len(field) != SECONDS.size:
            raise BadRequest(f"a timeout is {SECONDS.size} bytes, got {len(field)}")
        seconds = float(SECONDS.unpack(field)[0])
        if math.isnan(seconds):
            raise BadRequest("timeout is NaN")
        return max(0.0, seconds)

    def _park(self, conn: _Conn, op: Op, keys: list[bytes], seconds: float) -> None:
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
        if parked.op is Op.GET:
            self._reply(conn, Status.OK, [self._data[parked.keys[0]]])
        else:
            self._reply(conn, Status.OK)

    def _notify(self, key: bytes) -> None:
        for conn in self._waiters.pop(key, ()):
            if conn.parked is not None and not conn.closed:
                self._try_answer(conn)

    def _expire(self) -> None:
        now = time.monotonic()
        for conn in self._pending.overdue(now):
            self._drop(conn)  # never answered the challenge in time
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            _, seq, conn = heapq.heappop(heap)
            parked = conn.parked
            if parked is None or parked.seq != seq or conn.closed:
                continue  # answered or dropped already
            missing = [k for k in parked.keys if k not in self._data]
            self._unpark(conn)
            self._reply(conn, Status.TIMEOUT, missing)
