"""A plait Store over a plain key-value store that has neither blocking reads nor increments.

Ray's internal key-value store (:mod:`plait.ray`) and a Dask scheduler's
metadata tree (:mod:`plait.dask`) both give the five operations of
:class:`KeyValue`: get, put (with put-if-absent), exists, delete (by prefix
too) and a key listing. :class:`KVStore` builds plait's
:class:`~plait.rendezvous.store.Store` on them, so that ranks meet through the
cluster's own control plane and no server is started.

Note [waiting on a store without blocking reads]
    Neither store can block until a key appears. ``wait`` therefore checks
    the missing keys, and between checks waits on an event for a back-off
    that grows from 1 ms to 50 ms, under the call's deadline
    (:func:`poll_until`): a rendezvous takes a few round trips more than with
    a blocking store, and an idle waiter asks the server at most 20 times a
    second. Waiting happens only while ranks meet: once they are connected
    the store is not used.

Note [adding without compare-and-swap]
    The key-value store has no atomic increment, but its put-if-absent is
    atomic. ``add(key, n)`` therefore claims the first free entry of the
    key's log (``key#0``, ``key#1``, …) with put-if-absent, writing ``n``
    there; the key's value is the sum of the log. Entries are claimed in
    order and never change, so the sum of entries 0..i is the value right
    after the add that claimed entry i, which is what ``add`` returns. A key
    is either set or added to, never both (plait's keys are).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from plait.errors import RendezvousError
from plait.rendezvous.store import DEFAULT_STORE_TIMEOUT, Store, StoreTimeout

__all__ = ["KVStore", "KeyValue", "poll_until"]

#: plait.init's keys start with ``plait/init<n>/``, n counting the process's init calls.
_INIT_GENERATION = re.compile(r"^plait/init\d+/")
#: Separates a key from the entries of its add log (Note [adding without compare-and-swap]).
_LOG = "#"
#: First and longest wait between two checks of the store
#: (Note [waiting on a store without blocking reads]).
_FIRST_BACKOFF = 0.001
_MAX_BACKOFF = 0.05


class KeyValue(Protocol):
    """What :class:`KVStore` needs of a key-value store: Ray's, Dask's, or a fake in tests."""

    def get(self, key: str) -> bytes | None:
        """The value of ``key``, or None when it is not set."""

    def put(self, key: str, value: bytes, overwrite: bool) -> bool:
        """Store ``value`` (if ``overwrite`` or the key is unset); whether the key existed."""

    def exists(self, key: str) -> bool:
        """Whether ``key`` is set."""

    def delete(self, key: str, by_prefix: bool = False) -> int:
        """Remove ``key`` (or every key starting with it); how many were removed."""

    def keys(self, prefix: str) -> list[str]:
        """The keys starting with ``prefix``."""


def poll_until(
    ready: Callable[[], bool],
    deadline: float,
    on_poll: Callable[[], None] | None = None,
) -> bool:
    """Check ``ready`` until it holds (True) or ``deadline`` (``time.monotonic``) passes (False).

    Between checks it waits on an event that nothing sets, for a back-off
    from 1 ms to 50 ms (Note [waiting on a store without blocking reads]);
    ``on_poll`` runs before each wait (a Ray group's rank 0 answers arrivals
    there).
    """
    pause = threading.Event()
    backoff = _FIRST_BACKOFF
    while True:
        if ready():
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        if on_poll is not None:
            on_poll()
        pause.wait(min(backoff, left))
        backoff = min(backoff * 2, _MAX_BACKOFF)


class KVStore(Store):
    """A plait :class:`~plait.rendezvous.store.Store` over a :class:`KeyValue`.

    plait.init numbers its keys with the count of ``init`` calls made by this
    process; the members of one group may have made different counts (a
    process can belong to several groups), while every group has a prefix of
    its own here. So the count is dropped from the keys.

    Args:
        kv: the key-value store.
        prefix: prepended to every key (one per group, or per incarnation of one).
        timeout: default seconds of blocking calls.
        host: the host of the key-value store's server: plait's TCP transport
            listens on the interface that reaches it.
        on_poll: called while a blocking call waits.
    """

    def __init__(
        self,
        kv: KeyValue,
        prefix: str = "",
        *,
        timeout: float = DEFAULT_STORE_TIMEOUT,
        host: str | None = None,
        on_poll: Callable[[], None] | None = None,
    ) -> None:
        self.kv = kv
        self.prefix = prefix
        self.timeout = timeout
        if host:
            self.host = host
        self.on_poll = on_poll
        self._next: dict[str, int] = {}  # first log entry of a key that may still be free
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(prefix={self.prefix!r})"

    def _k(self, key: str) -> str:
        if not isinstance(key, str):
            raise TypeError(f"store keys are str, got {type(key).__name__}: {key!r}")
        if _LOG in key:
            raise ValueError(f"store key {key!r}: {_LOG!r} is reserved for add's log")
        return self.prefix + _INIT_GENERATION.sub("plait/init/", key, count=1)

    def _read(self, name: str) -> bytes | None:
        """The value under the full key ``name``: the sum of its add log, if it has one."""
        first = self.kv.get(f"{name}{_LOG}0")
        if first is None:
            return self.kv.get(name)
        total, i = int(first), 1
        while (entry := self.kv.get(f"{name}{_LOG}{i}")) is not None:
            total, i = total + int(entry), i + 1
        return str(total).encode()

    def _exists(self, name: str) -> bool:
        return self.kv.exists(name) or self.kv.exists(f"{name}{_LOG}0")

    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key``."""
        if not isinstance(value, bytes | bytearray | memoryview):
            raise TypeError(f"store values are bytes, got {type(value).__name__}")
        self.kv.put(self._k(key), bytes(value), True)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """The value of ``key``, waiting until some rank sets it."""
        seconds = self._timeout(timeout)
        deadline = time.monotonic() + seconds
        name = self._k(key)
        while True:
            self._wait([name], [key], deadline, seconds)
            value = self._read(name)
            if value is not None:
                return value  # else deleted between the check and the read: wait again

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` atomically (Note [adding without compare-and-swap]); the new value."""
        name = self._k(key)
        with self._lock:
            i = self._next.get(name, 0)
            if i and not self.kv.exists(f"{name}{_LOG}{i - 1}"):
                i = 0  # the key was deleted (by any client) since this one last added
            while self.kv.put(f"{name}{_LOG}{i}", str(int(amount)).encode(), False):
                i += 1
            self._next[name] = i + 1
        total = 0
        for j in range(i + 1):
            entry = self.kv.get(f"{name}{_LOG}{j}")
            if entry is None:
                raise RendezvousError(f"{self!r}: add({key!r}): the key was deleted meanwhile")
            total += int(entry)
        return total

    def wait(self, keys: Sequence[str], timeout: float | None = None) -> None:
        """Block until every key in ``keys`` is set (or raise StoreTimeout naming the rest)."""
        seconds = self._timeout(timeout)
        self._wait([self._k(k) for k in keys], list(keys), time.monotonic() + seconds, seconds)

    def _wait(self, names: list[str], keys: list[str], deadline: float, seconds: float) -> None:
        missing = dict(zip(names, keys, strict=True))

        def ready() -> bool:
            for name in list(missing):
                if self._exists(name):
                    del missing[name]
            return not missing

        if not poll_until(ready, deadline, self.on_poll):
            raise StoreTimeout(
                f"{self!r}: keys {list(missing.values())} not set within {seconds:g} s"
            )

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key in ``keys`` is set."""
        return all(self._exists(self._k(k)) for k in keys)

    def delete(self, key: str) -> bool:
        """Remove ``key`` (and its add log)."""
        name = self._k(key)
        removed = self.kv.delete(name) + self.kv.delete(f"{name}{_LOG}", by_prefix=True)
        with self._lock:
            self._next.pop(name, None)
        return removed > 0

    def clear(self) -> None:
        """Remove every key under this store's prefix (the whole group)."""
        if self.prefix:
            self.kv.delete(self.prefix, by_prefix=True)
