"""The Store contract: a small key-value store that ranks use to find each other.

Every backend (built-in TCP store, file store, Redis store, in-memory store for
tests) implements these six operations. Keys are str, values are bytes.
Blocking operations take ``timeout`` in seconds (None: the store's default)
and raise :class:`~plait.errors.RendezvousError` subclasses with the keys
still missing, never hang forever.
"""

from __future__ import annotations

import abc
import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from plait.errors import CommTimeout, RendezvousError

__all__ = [
    "DEFAULT_STORE_TIMEOUT",
    "MemoryStore",
    "PrefixStore",
    "Store",
    "StoreOwner",
    "StoreTimeout",
    "answer_deadline",
    "answers_by",
    "shown_key",
    "shown_keys",
]

#: Seconds a blocking store call waits by default.
DEFAULT_STORE_TIMEOUT = 300.0
#: Keys a message lists, and characters of each, at most (a wait on 200,000 keys, or a key
#: of a megabyte, must not put them all in the error).
_SHOWN_KEYS = 5
_SHOWN_KEY_CHARS = 100


def shown_key(key: object) -> str:
    """``repr(key)`` for a message, cut to a hundred characters or so."""
    text = repr(key)
    if len(text) <= _SHOWN_KEY_CHARS:
        return text
    size = len(key) if isinstance(key, str | bytes) else len(text)
    return f"{text[:_SHOWN_KEY_CHARS]}... ({size} characters)"


def shown_keys(keys: Sequence[object]) -> str:
    """A list of keys for a message: the first few, each cut (:func:`shown_key`), and how
    many more there are."""
    listed = ", ".join(shown_key(key) for key in keys[:_SHOWN_KEYS])
    more = f" and {len(keys) - _SHOWN_KEYS} more" if len(keys) > _SHOWN_KEYS else ""
    return f"[{listed}]{more}"


_bound = threading.local()


@contextlib.contextmanager
def answers_by(deadline: float) -> Iterator[None]:
    """Within the block, a call of this thread to a store over the network waits for its
    server until ``deadline`` (``time.monotonic()``) at most, whatever the store's own
    timeout: a call with a deadline of its own (``agree(timeout=5)``) on a store that
    stopped answering raises by then, not after the store's 300 s (Note [a store that
    stalls] in plait._recovery). Blocks nest; the earliest deadline holds."""
    before = getattr(_bound, "deadline", None)
    _bound.deadline = deadline if before is None else min(before, deadline)
    try:
        yield
    finally:
        _bound.deadline = before


def answer_deadline() -> float | None:
    """The deadline :func:`answers_by` set for this thread, or None."""
    deadline: float | None = getattr(_bound, "deadline", None)
    return deadline


class StoreTimeout(RendezvousError, CommTimeout):
    """A blocking store call ran out of time; the message lists the missing keys."""


class Store(abc.ABC):
    """A key-value store shared by all ranks of a job."""

    timeout: float = DEFAULT_STORE_TIMEOUT

    @abc.abstractmethod
    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key``, replacing any previous value."""

    @abc.abstractmethod
    def get(self, key: str, timeout: float | None = None) -> bytes:
        """The value of ``key``, waiting until some rank sets it.

        Raises:
            StoreTimeout: ``key`` was not set within ``timeout``.
        """

    @abc.abstractmethod
    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the integer at ``key`` (0 if unset); returns the new value.

        The value is stored as its decimal ASCII text, so ``get`` returns e.g. b"3".
        """

    @abc.abstractmethod
    def wait(self, keys: Sequence[str], timeout: float | None = None) -> None:
        """Block until every key in ``keys`` is set.

        Raises:
            StoreTimeout: some keys were still missing after ``timeout``; they are named.
        """

    @abc.abstractmethod
    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key in ``keys`` is set (never blocks)."""

    @abc.abstractmethod
    def delete(self, key: str) -> bool:
        """Remove ``key``; whether it existed."""

    def close(self) -> None:  # noqa: B027 - optional for backends without resources
        """Release connections or files; the store's data outlives the client."""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _timeout(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else timeout


class PrefixStore(Store):
    """A view of another store with every key prefixed (one namespace per group)."""

    def __init__(self, prefix: str, store: Store) -> None:
        self.prefix = prefix.rstrip("/") + "/"
        self.store = store
        self.timeout = store.timeout

    def _k(self, key: str) -> str:
        return self.prefix + key

    def set(self, key: str, value: bytes) -> None:
        self.store.set(self._k(key), value)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        return self.store.get(self._k(key), timeout)

    def add(self, key: str, amount: int) -> int:
        return self.store.add(self._k(key), amount)

    def wait(self, keys: Sequence[str], timeout: float | None = None) -> None:
        self.store.wait([self._k(k) for k in keys], timeout)

    def check(self, keys: Sequence[str]) -> bool:
        return self.store.check([self._k(k) for k in keys])

    def delete(self, key: str) -> bool:
        return self.store.delete(self._k(key))


class MemoryStore(Store):
    """An in-process store, for threads playing ranks and for tests."""

    def __init__(self, timeout: float = DEFAULT_STORE_TIMEOUT) -> None:
        self.timeout = timeout
        self._data: dict[str, bytes] = {}
        self._cv = threading.Condition()

    def set(self, key: str, value: bytes) -> None:
        with self._cv:
            self._data[key] = bytes(value)
            self._cv.notify_all()

    def get(self, key: str, timeout: float | None = None) -> bytes:
        self.wait([key], timeout)
        with self._cv:
            return self._data[key]

    def add(self, key: str, amount: int) -> int:
        with self._cv:
            value = int(self._data.get(key, b"0")) + amount
            self._data[key] = str(value).encode()
            self._cv.notify_all()
            return value

    def wait(self, keys: Sequence[str], timeout: float | None = None) -> None:
        seconds = self._timeout(timeout)
        deadline = time.monotonic() + seconds
        with self._cv:
            while True:
                missing = [k for k in keys if k not in self._data]
                if not missing:
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StoreTimeout(
                        f"store: keys {shown_keys(missing)} not set within {seconds:g} s"
                    )
                self._cv.wait(left)

    def check(self, keys: Sequence[str]) -> bool:
        with self._cv:
            return all(k in self._data for k in keys)

    def delete(self, key: str) -> bool:
        with self._cv:
            return self._data.pop(key, None) is not None


class StoreOwner:
    """The store ``plait.init`` met through, shared by a communicator and those shrunk from it.

    ``release`` (if any) runs when the last of them lets go: it closes a store
    ``init`` opened (Note [store lifetime] in :mod:`plait._init`). ``count_out``
    (if any) counts ranks that will never let go (they failed) as gone, for a
    store that the last rank deletes.
    """

    def __init__(
        self,
        store: Store,
        release: Callable[[], None] | None = None,
        count_out: Callable[[int], None] | None = None,
    ) -> None:
        self.store = store
        self.count_out = count_out
        self._release = release
        self._refs = 0
        self._lock = threading.Lock()

    def acquire(self) -> None:
        """One more communicator uses the store."""
        with self._lock:
            self._refs += 1

    def release(self) -> None:
        """One communicator less; the last one runs ``release``."""
        with self._lock:
            self._refs -= 1
            last = self._refs == 0
        if last and self._release is not None:
            self._release()
