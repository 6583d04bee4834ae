"""A store kept in a Redis server (needs the optional ``redis`` package).

Useful where a Redis server already runs next to the cluster and outlives the
job. Keys are namespaced by ``prefix``; values are plain Redis strings, and
``add`` is ``INCRBY``, so an added key reads back as decimal ASCII.

Note [redis store waiting]
    ``get`` and ``wait`` block in the server instead of polling: every ``set``
    and ``add`` also ``PUBLISH``\\es on the key's channel (in one MULTI/EXEC), and
    a waiter ``SUBSCRIBE``\\s to the channels of its missing keys, waits for the
    server to confirm the subscriptions, then checks which keys exist and
    blocks reading the subscription until a notification or the deadline.
    Checking only after the confirmation closes the race with a ``set`` landing
    between the check and the subscription. Keyspace notifications would avoid
    the extra PUBLISH but are off by default in Redis server configurations;
    BLPOP would wake only one of several waiters.

Note [redis store deadlines]
    Every command waits for its answer until the deadline of the store call it serves, as
    :class:`~plait.rendezvous.tcp_store.TCPStore`'s calls do: ``timeout`` seconds for a
    command of ``set``, ``add``, ``check``, ``delete`` and for connecting; the call's own
    deadline and ``_ANSWER_GRACE`` for the looks of ``get`` and ``wait``; never past the
    deadline :func:`~plait.rendezvous.store.answers_by` set for the thread. redis-py fixes
    a connection's socket timeouts when it is made, so the store's connections
    (``_connection_class``) set them anew from the calling thread's deadline before they
    connect and before each command, and redis-py's retries are off: a server that stopped
    answering (its process stopped) fails the call by its deadline, not after minutes of
    reconnecting.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, Self

from plait import _net
from plait.errors import RendezvousError
from plait.rendezvous.store import (
    DEFAULT_STORE_TIMEOUT,
    Store,
    StoreTimeout,
    answer_deadline,
    shown_key,
    shown_keys,
)

__all__ = ["RedisStore"]

_MISSING_REDIS = "RedisStore needs the redis package: pip install 'plait[redis]'"
#: Extra seconds a command of ``get`` or ``wait`` may wait for its answer beyond the call's
#: deadline (its last look at the keys), on a server that stopped answering.
_ANSWER_GRACE = 1.0
#: The least seconds a command waits for its answer, however near its deadline.
_LEAST_ANSWER = 0.05
#: Longest single blocking read of a subscription (the loop re-arms it).
_MAX_BLOCK = 60.0


class RedisStore(Store):
    """A store in a Redis database, shared by every process that can reach it.

    Args:
        host: The Redis server's host name or address (an IPv6 literal may be bracketed).
        port: The Redis server's port.
        db: The Redis database number.
        prefix: Prepended to every key, so several jobs can share one database.
        username: The user to authenticate as (Redis 6 ACLs); None: the default user.
        password: The password to authenticate with (``requirepass`` or the user's);
            None: none. It is never shown in messages or in the store's repr.
        timeout: Default seconds for blocking calls (``get``, ``wait``), and the most
            any other call, or connecting, waits for the server's answer (Note [redis
            store deadlines]).

    Raises:
        ImportError: the ``redis`` package is not installed.
        RendezvousError: the server cannot be reached, does not answer within
            ``timeout``, or refuses the credentials (checked with a PING).

    :meth:`close` releases the connections; the keys stay in Redis (delete them,
    or give the job a fresh ``prefix``).
    """

    def __init__(
        self,
        host: str,
        port: int = 6379,
        *,
        db: int = 0,
        prefix: str = "plait/",
        username: str | None = None,
        password: str | None = None,
        timeout: float = DEFAULT_STORE_TIMEOUT,
    ) -> None:
        try:
            import redis
        except ImportError as exc:
            raise ImportError(_MISSING_REDIS) from exc
        self._redis = redis
        self.host = _net.strip_brackets(host)
        self.port = port
        self.db = db
        self.prefix = prefix
        self.timeout = timeout
        host_part = f"[{self.host}]" if ":" in self.host else self.host
        self.address = f"redis://{host_part}:{port}/{db}"
        # The deadline of this thread's store call, read by the connections (Note [redis
        # store deadlines]).
        self._call_until = threading.local()
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        pool = redis.ConnectionPool(
            connection_class=_connection_class(redis.Connection),
            call_until=self._call_until,
            host=self.host,
            port=port,
            db=db,
            username=username,
            password=password,
            socket_timeout=_socket_seconds(timeout),
            socket_connect_timeout=_socket_seconds(timeout),
            retry=Retry(NoBackoff(), 0),
        )
        self._client: Any = redis.Redis(connection_pool=pool)
        with self._translate("connect", self._until(timeout)):
            self._client.ping()

    def __enter__(self) -> Self:
        return self

    def __repr__(self) -> str:
        return f"RedisStore({self.address}, prefix={self.prefix!r})"

    def close(self) -> None:
        """Close this client's connections; the keys stay in Redis."""
        self._client.close()
        self._client.connection_pool.disconnect()

    # ---- Store operations

    def set(self, key: str, value: bytes) -> None:
        if not isinstance(value, bytes | bytearray | memoryview):
            raise TypeError(f"store values are bytes, got {type(value).__name__}")
        name = self._name(key)
        with self._translate(f"set({shown_key(key)})", self._until(self.timeout)):
            pipe = self._client.pipeline(transaction=True)
            pipe.set(name, bytes(value))
            pipe.publish(self._channel(name), b"set")
            pipe.execute()

    def get(self, key: str, timeout: float | None = None) -> bytes:
        deadline, seconds = self._deadline(timeout)
        name = self._name(key)
        with self._translate(f"get({shown_key(key)})", deadline + _ANSWER_GRACE):
            while True:
                value = self._client.get(name)
                if value is not None:
                    return bytes(value)
                # Deleted again between the wake-up and the GET: wait once more.
                self._block_until([key], deadline, seconds)

    def add(self, key: str, amount: int) -> int:
        name = self._name(key)
        with self._translate(f"add({shown_key(key)}, {amount})", self._until(self.timeout)):
            pipe = self._client.pipeline(transaction=True)
            pipe.incrby(name, int(amount))
            pipe.publish(self._channel(name), b"add")
            try:
                value, _ = pipe.execute()
            except self._redis.ResponseError as exc:
                raise ValueError(
                    f"redis store {self.address}: add({shown_key(key)}): {exc}"
                ) from exc
        return int(value)

    def wait(self, keys: Sequence[str], timeout: float | None = None) -> None:
        deadline, seconds = self._deadline(timeout)
        with self._translate(f"wait({len(keys)} keys)", deadline + _ANSWER_GRACE):
            self._block_until(list(dict.fromkeys(keys)), deadline, seconds)

    def check(self, keys: Sequence[str]) -> bool:
        if not keys:
            return True
        with self._translate(f"check({len(keys)} keys)", self._until(self.timeout)):
            return bool(self._client.exists(*(self._name(k) for k in keys)) == len(keys))

    def delete(self, key: str) -> bool:
        with self._translate(f"delete({shown_key(key)})", self._until(self.timeout)):
            return bool(self._client.delete(self._name(key)))

    # ---- helpers

    @staticmethod
    def _until(seconds: float) -> float:
        """The deadline of a call that may wait ``seconds`` for the server."""
        return time.monotonic() + seconds

    def _deadline(self, timeout: float | None) -> tuple[float, float]:
        """The deadline of a blocking call and its seconds: its timeout, or the thread's
        :func:`~plait.rendezvous.store.answers_by` deadline where that comes first."""
        seconds = self._timeout(timeout)
        now = time.monotonic()
        bound = answer_deadline()
        if bound is not None and bound < now + seconds:
            return bound, max(bound - now, 0.0)
        return now + seconds, seconds

    def _name(self, key: str) -> str:
        if not isinstance(key, str):
            raise TypeError(f"store keys are str, got {type(key).__name__}: {shown_key(key)}")
        return self.prefix + key

    def _channel(self, name: str) -> str:
        # Pub/sub channels are shared by all databases of a server: add the db.
        return f"__plait_store__:{self.db}:{name}"

    def _missing(self, keys: list[str]) -> list[str]:
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(self._name(key))
        return [key for key, found in zip(keys, pipe.execute(), strict=True) if not found]

    def _block_until(self, keys: list[str], deadline: float, seconds: float) -> None:
        """Return once every key exists; raise StoreTimeout at ``deadline``."""
        missing = self._missing(keys)
        if not missing:
            return
        pubsub = self._client.pubsub()
        try:
            channels = [self._channel(self._name(k)) for k in missing]
            pubsub.subscribe(*channels)
            # See Note [redis store waiting]: look only once subscribed.
            confirmed = 0
            while confirmed < len(channels):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                message = pubsub.get_message(timeout=min(left, _MAX_BLOCK))
                if message is not None and message["type"] == "subscribe":
                    confirmed += 1
            while True:
                missing = self._missing(missing)
                if not missing:
                    return
                left = deadline - time.monotonic()
                if left <= 0 or confirmed < len(channels):
                    raise StoreTimeout(
                        f"redis store {self.address}: keys {shown_keys(missing)} "
                        f"(prefix {self.prefix!r}) not set within {seconds:g} s"
                    )
                pubsub.get_message(timeout=min(left, _MAX_BLOCK))
        finally:
            pubsub.close()

    @contextlib.contextmanager
    def _translate(self, what: str, until: float) -> Iterator[None]:
        """Run the commands of one call, each answered by ``until`` or the thread's
        answers_by deadline (Note [redis store deadlines]); turn redis connection
        failures into RendezvousError naming the server."""
        bound = answer_deadline()
        if bound is not None:
            until = min(until, bound)
        self._call_until.until = until
        start = time.monotonic()
        try:
            yield
        except self._redis.RedisError as exc:
            # Credentials first: redis-py's AuthenticationError is a ConnectionError.
            if _refused_credentials(self._redis, exc):
                raise RendezvousError(
                    f"redis store {self.address}: {what} failed: the server refused this "
                    f"client's credentials ({exc}); give the Redis server's user and password "
                    "in the store URL: redis://[user[:password]@]host:port"
                ) from exc
            if isinstance(exc, self._redis.TimeoutError):
                raise RendezvousError(
                    f"redis store {self.address}: {what} failed: the server did not answer "
                    f"within {max(until - start, _LEAST_ANSWER):.3g} s ({exc}); is the Redis "
                    "server still running, or stopped or overloaded?"
                ) from exc
            if isinstance(exc, self._redis.ConnectionError):
                raise RendezvousError(
                    f"redis store {self.address}: {what} failed: {exc}; is the Redis server "
                    "running?"
                ) from exc
            raise
        finally:
            self._call_until.until = None


def _refused_credentials(redis: Any, exc: Exception) -> bool:
    """Whether ``exc`` says the server wants a password, or another, or refused the user.
    redis-py raises AuthenticationError (a ConnectionError) or, in older versions, a
    ResponseError whose text starts with the server's error code."""
    errors = redis.exceptions
    refused = tuple(
        getattr(errors, name)
        for name in ("AuthenticationError", "AuthorizationError", "AuthenticationRequiredError")
        if hasattr(errors, name)
    )
    if isinstance(exc, refused):
        return True
    return isinstance(exc, redis.ResponseError) and str(exc).startswith(("NOAUTH", "WRONGPASS"))


def _socket_seconds(seconds: float) -> float | None:
    """``seconds`` as a socket timeout: None (no limit) where it is infinite."""
    return seconds if math.isfinite(seconds) else None


@functools.cache
def _connection_class(base: type) -> type:
    """A redis-py connection class whose every command waits for its answer until the
    deadline of the store call it serves (Note [redis store deadlines])."""

    class Connection(base):  # type: ignore[misc]
        def __init__(self, *args: Any, call_until: threading.local, **kwargs: Any) -> None:
            self._plait_call_until = call_until
            super().__init__(*args, **kwargs)

        def _bound(self) -> None:
            until = getattr(self._plait_call_until, "until", None)
            if until is None:  # outside a store call (closing): keep the timeouts
                return
            seconds = _socket_seconds(max(until - time.monotonic(), _LEAST_ANSWER))
            self.socket_timeout = self.socket_connect_timeout = seconds
            if self._sock is not None:
                self._sock.settimeout(seconds)

        def connect(self, *args: Any, **kwargs: Any) -> None:
            self._bound()
            super().connect(*args, **kwargs)

        def send_packed_command(self, *args: Any, **kwargs: Any) -> None:
            self._bound()
            super().send_packed_command(*args, **kwargs)

    return Connection
