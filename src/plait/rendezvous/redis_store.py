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
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any, Self

from plait import _net
from plait.errors import RendezvousError
from plait.rendezvous.store import DEFAULT_STORE_TIMEOUT, Store, StoreTimeout

__all__ = ["RedisStore"]

_MISSING_REDIS = "RedisStore needs the redis package: pip install 'plait[redis]'"
#: Seconds to connect, and to wait for the answer to a non-blocking command.
_IO_TIMEOUT = 30.0
#: Longest single blocking read of a subscription (the loop re-arms it).
_MAX_BLOCK = 60.0


class RedisStore(Store):
    """A store in a Redis database, shared by every process that can reach it.

    Args:
        host: The Redis server's host name or address (an IPv6 literal may be bracketed).
        port: The Redis server's port.
        db: The Redis database number.
        prefix: Prepended to every key, so several jobs can share one database.
        timeout: Default seconds for blocking calls (``get``, ``wait``).

    Raises:
        ImportError: the ``redis`` package is not installed.
        RendezvousError: the server cannot be reached (checked with a PING).

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
        self._client: Any = redis.Redis(
            host=self.host,
            port=port,
            db=db,
            socket_timeout=_IO_TIMEOUT,
            socket_connect_timeout=_IO_TIMEOUT,
        )
        with self._translate("connect"):
            self._client.ping()

    def __enter__(self) -> Self:
        return self

    def __repr__(self) -> str:
        return f"RedisStore({self.address}, prefix={self.prefix!r})"

    def close(self) -> None:
        """Close this client's connections; the keys stay in Redis."""
        self._client.close()

    # ---- Store operations

    def set(self, key: str, value: bytes) -> None:
        if not isinstance(value, bytes | bytearray | memoryview):
            raise TypeError(f"store values are bytes, got {type(value).__name__}")
        name = self._name(key)
        with self._translate(f"set({key!r})"):
            pipe = self._client.pipeline(transaction=True)
            pipe.set(name, bytes(value))
            pipe.publish(self._channel(name), b"set")
            pipe.execute()

    def get(self, key: str, timeout: float | None = None) -> bytes:
        seconds = self._timeout(timeout)
        deadline = time.monotonic() + seconds
        name = self._name(key)
        with self._translate(f"get({key!r})"):
            while True:
                value = self._client.get(name)
                if value is not None:
                    return bytes(value)
                # Deleted again between the wake-up and the GET: wait once more.
                self._block_until([key], deadline, seconds)

    def add(self, key: str, amount: int) -> int:
        name = self._name(key)
        with self._translate(f"add({key!r}, {amount})"):
            pipe = self._client.pipeline(transaction=True)
            pipe.incrby(name, int(amount))
            pipe.publish(self._channel(name), b"add")
            try:
                value, _ = pipe.execute()
            except self._redis.ResponseError as exc:
                raise ValueError(f"redis store {self.address}: add({key!r}): {exc}") from exc
        return int(value)

    def wait(self, keys: Sequence[str], timeout: float | None = None) -> None:
        seconds = self._timeout(timeout)
        with self._translate(f"wait({len(keys)} keys)"):
            self._block_until(list(dict.fromkeys(keys)), time.monotonic() + seconds, seconds)

    def check(self, keys: Sequence[str]) -> bool:
        if not keys:
            return True
        with self._translate(f"check({len(keys)} keys)"):
            return bool(self._client.exists(*(self._name(k) for k in keys)) == len(keys))

    def delete(self, key: str) -> bool:
        with self._translate(f"delete({key!r})"):
            return bool(self._client.delete(self._name(key)))

    # ---- helpers

    def _name(self, key: str) -> str:
        if not isinstance(key, str):
            raise TypeError(f"store keys are str, got {type(key).__name__}: {key!r}")
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
                        f"redis store {self.address}: keys {missing} (prefix {self.prefix!r}) "
                        f"not set within {seconds:g} s"
                    )
                pubsub.get_message(timeout=min(left, _MAX_BLOCK))
        finally:
            pubsub.close()

    @contextlib.contextmanager
    def _translate(self, what: str) -> Iterator[None]:
        """Turn redis connection failures into RendezvousError naming the server."""
        try:
            yield
        except (self._redis.ConnectionError, self._redis.TimeoutError) as exc:
            raise RendezvousError(
                f"redis store {self.address}: {what} failed: {exc}; is the Redis server running?"
            ) from exc
