"""The compressor contract, per-tensor state and the helpers every compressor shares.

A compressor turns one rank's float array into fewer bytes, exchanges them with
the communicator's own public collectives and turns what came back into the
reduced array. Every rank must end with the same bits, so each compressor
arranges its exchange such that every number of the result is computed once
from identical inputs in an order that does not depend on the rank (a plain
allreduce, or an allgather followed by a sum in rank order).

Note [compressor state]
    Error feedback (top-k, PowerSGD) and PowerSGD's warm-started ``Q`` must
    carry over from one step to the next *for the same tensor*. State lives
    in the compressor object, in one table per communicator (so threads that
    play ranks may share one compressor), keyed by

    - a name the caller gives: ``comm.allreduce(g, compression=c.with_key("fc1.weight"))``
      (any hashable: a parameter name, a bucket index), or
    - without a name, the identity of the array passed (the state is dropped
      when that array is garbage collected). This suits a gradient buffer that
      lives across steps; a fresh array every step would start from empty
      state each time, so name such tensors.

    ``reset()`` forgets all state (between experiments). State is never
    exchanged: every rank keeps its own, and only what every rank computes
    identically (PowerSGD's ``Q``) stays identical across ranks.
"""

from __future__ import annotations

import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from plait.communicator import Communicator

__all__ = ["Compressor", "Keyed", "work_dtype"]


def work_dtype(dtype: np.dtype) -> np.dtype:
    """The precision compressors compute in: float64 for float64 data, float32 otherwise."""
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


class _Table(dict):  # type: ignore[type-arg]
    """One communicator's state (a dict subclass so finalizers can refer to it weakly)."""


class _Identity:
    """A state key standing for one live object (compared by identity)."""

    __slots__ = ("ident",)

    def __init__(self, ident: int) -> None:
        self.ident = ident

    def __hash__(self) -> int:
        return hash(("plait.compression.identity", self.ident))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Identity) and other.ident == self.ident

    def __repr__(self) -> str:
        return f"<array at {self.ident:#x}>"


def _forget(table_ref: weakref.ref[_Table], key: Hashable) -> None:
    table = table_ref()
    if table is not None:
        table.pop(key, None)


class Compressor(ABC):
    """Base of every compressor: ``comm.allreduce(x, compression=c)`` calls :meth:`allreduce`.

    Subclasses implement :meth:`allreduce` (compress, exchange through the
    communicator's public collectives, decompress), :meth:`collectives` (how
    many collective calls it makes for ``x``, so that an ``async_op=True``
    call can reserve their sequence numbers up front) and, when they keep
    state, set ``stateful``. See Note [compressor state].
    """

    #: Short name used in messages and tables.
    name: str = "compressor"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tables: weakref.WeakKeyDictionary[Any, _Table] = weakref.WeakKeyDictionary()

    # -- the contract ------------------------------------------------------------------------
    @property
    def stateful(self) -> bool:
        """Whether results depend on earlier calls for the same tensor (error feedback, warm Q)."""
        return False

    @property
    def keyed(self) -> bool:
        """Whether the state is keyed by a name (:meth:`with_key`) rather than by the array."""
        return False

    def check(self, x: np.ndarray, comm: Communicator, key: Hashable | None = None) -> None:
        """Raise ValueError/TypeError if this call cannot be served; runs before any byte moves.

        The base class checks the state kept for ``key`` (or ``x``'s identity)
        against ``x``. Subclasses add their own checks and call this.
        """
        if not self.stateful:
            return
        if key is None:
            try:
                weakref.ref(x)
            except TypeError:
                raise TypeError(
                    f"rank {comm.rank}: allreduce: {self.name} keeps state per tensor; "
                    f"{type(x).__name__} cannot be tracked by identity, so name it: "
                    "compression=c.with_key(name)"
                ) from None
        table = self._table(comm)
        state = table.get(self._key(key, x))
        if state is not None:
            self._check_state(state, x, comm, key)

    def collectives(self, x: np.ndarray, comm: Communicator) -> int:
        """How many collective calls :meth:`allreduce` makes on ``comm`` for ``x``."""
        return 1

    @abstractmethod
    def allreduce(
        self,
        comm: Communicator,
        x: np.ndarray,
        *,
        average: bool = False,
        key: Hashable | None = None,
        timeout: float | None = None,
    ) -> np.ndarray:
        """The compressed sum (or mean, with ``average``) of ``x`` over ``comm``'s ranks.

        Args:
            comm: the communicator; the compressor uses its public collectives.
            x: this rank's array (float16/32/64, any shape); never modified.
            average: divide by the number of ranks (``plait.AVG``).
            key: names the tensor for stateful compressors; None keys the
                state by ``x``'s identity (Note [compressor state]).
            timeout: seconds for each collective call it makes.

        Returns:
            A new array of ``x``'s shape and dtype, identical bit for bit on every rank.
        """

    # -- conveniences ---------------------------------------------------------------------------
    def with_key(self, key: Hashable) -> Keyed:
        """This compressor with its state keyed by ``key`` (a parameter's name, a bucket index)."""
        return Keyed(self, key)

    def reset(self) -> None:
        """Forget all state (residuals, PowerSGD's Q, random generators) on every communicator."""
        with self._lock:
            for table in self._tables.values():
                table.clear()

    def __repr__(self) -> str:
        return f"plait.compression.{type(self).__name__}()"

    # -- state (Note [compressor state]) ---------------------------------------------------------
    def _table(self, comm: Communicator) -> _Table:
        with self._lock:
            table = self._tables.get(comm)
            if table is None:
                table = self._tables[comm] = _Table()
            return table

    @staticmethod
    def _key(key: Hashable | None, x: np.ndarray) -> Hashable:
        return _Identity(id(x)) if key is None else ("name", key)

    def _state(self, comm: Communicator, key: Hashable | None, x: np.ndarray) -> Any:
        """The state of this tensor on ``comm`` (None on its first call); see :meth:`_store`."""
        return self._table(comm).get(self._key(key, x))

    def _store(self, comm: Communicator, key: Hashable | None, x: np.ndarray, state: Any) -> None:
        table = self._table(comm)
        k = self._key(key, x)
        if key is None and k not in table:
            weakref.finalize(x, _forget, weakref.ref(table), k)
        table[k] = state

    def _check_state(
        self, state: Any, x: np.ndarray, comm: Communicator, key: Hashable | None
    ) -> None:
        """Raise ValueError if ``state`` does not fit ``x`` (subclasses say what fits)."""
        return None

    def _shared(self, comm: Communicator, name: str, make: Any) -> Any:
        """Per-communicator state that is not per tensor (random generators), made on first use."""
        table = self._table(comm)
        k = ("shared", name)
        value = table.get(k)
        if value is None:
            value = table[k] = make()
        return value


class Keyed(Compressor):
    """A compressor whose state is keyed by a fixed name: ``c.with_key("fc1.weight")``.

    Cheap to make per call; the state stays in the wrapped compressor.
    """

    inner: Compressor

    def __init__(self, inner: Compressor, key: Hashable) -> None:
        if isinstance(inner, Keyed):
            inner = inner.inner
        if key is None:
            raise ValueError("with_key: key must not be None")
        hash(key)  # TypeError for unhashable keys, now rather than mid-call
        self.inner = inner
        self.key = key
        self.name = inner.name

    @property
    def stateful(self) -> bool:
        """Whether the wrapped compressor keeps state."""
        return self.inner.stateful

    @property
    def keyed(self) -> bool:
        """Always: the state is kept under :attr:`key`."""
        return True

    def check(self, x: np.ndarray, comm: Communicator, key: Hashable | None = None) -> None:
        """The wrapped compressor's checks, with this key."""
        self.inner.check(x, comm, self.key)

    def collectives(self, x: np.ndarray, comm: Communicator) -> int:
        """As the wrapped compressor."""
        return self.inner.collectives(x, comm)

    def allreduce(
        self,
        comm: Communicator,
        x: np.ndarray,
        *,
        average: bool = False,
        key: Hashable | None = None,
        timeout: float | None = None,
    ) -> np.ndarray:
        """The wrapped compressor's allreduce with this key (``key`` is ignored)."""
        return self.inner.allreduce(comm, x, average=average, key=self.key, timeout=timeout)

    def with_key(self, key: Hashable) -> Keyed:
        """The wrapped compressor with another key."""
        return Keyed(self.inner, key)

    def reset(self) -> None:
        """Forget the wrapped compressor's state (all keys)."""
        self.inner.reset()

    def __repr__(self) -> str:
        return f"{self.inner!r}.with_key({self.key!r})"
