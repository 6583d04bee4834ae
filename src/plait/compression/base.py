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

Note [state claims]
    A key's state must keep its tensor's shape, and a call with another
    shape is refused at the call, before any byte moves. The state itself is
    made by the compressor's run, which for an ``async_op=True`` call happens
    later, on the worker thread. So :meth:`Compressor.check` records, at the
    call and on the calling thread, the shape and working dtype the key is
    claimed for (a ``_Slot`` with no state yet), and checks later calls
    against that claim whether or not the state exists yet. Only calls that
    will keep state claim a key (a PowerSGD tensor small enough to fall back
    does not); ``reset()`` forgets claims with the state.

Note [call headers]
    A plain allreduce compares every rank's call (count, dtype, op) and
    raises MismatchError on every rank where they differ. A compressor's
    collectives carry bytes of its own making, whose sizes need not follow
    the call's: int8 pads ``x`` to ``size`` equal shards, so ranks passing 10
    and 9 elements sent alltoalls and allgathers of one size and returned
    arrays of different shapes, and top-k's ``k`` is the same for 100 and 99
    elements, where one rank indexed past the end of its result. So int8
    and top-k start the row each rank sends in their allgather with a
    16-byte header (:func:`call_header`): the element count (uint64), the
    itemsize of ``x`` (uint32) and whether the call averages (uint32), little
    endian, which keeps the 8-byte alignment of what follows. Every rank
    receives every rank's header, so :func:`check_headers` raises the same
    MismatchError on every rank, naming what each passed, before any of the
    data is used. The casts and PowerSGD reduce through the plain allreduce,
    which compares the calls itself (a count the plain allreduce would
    compare differently, PowerSGD's ``P`` and ``Q``, differs with the shape).

Note [byte order]
    Ranks may pass the same values in different byte orders, and a
    compressor receives the caller's array as it is (its identity keys the
    state). Everything a compressor computes and puts on the wire is in
    native byte order: :func:`native` converts at the edge, and only the
    result goes back to ``x``'s dtype. Bytes viewed with a non-native dtype
    on one rank and a native one on another would be read as other numbers.
"""

from __future__ import annotations

import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

import numpy as np

from plait.errors import MismatchError

if TYPE_CHECKING:
    from plait.communicator import Communicator

__all__ = [
    "HEADER_BYTES",
    "Compressor",
    "Keyed",
    "call_header",
    "check_headers",
    "check_seed",
    "native",
    "work_dtype",
]

#: Bytes of the header that starts each rank's allgathered row (Note [call headers]).
HEADER_BYTES = 16


def work_dtype(dtype: np.dtype) -> np.dtype:
    """The precision compressors compute in: float64 for float64 data (either byte order),
    float32 otherwise."""
    dtype = np.dtype(dtype)
    wide = dtype.kind == "f" and dtype.itemsize == 8
    return np.dtype(np.float64) if wide else np.dtype(np.float32)


def check_seed(seed: Any, who: str) -> int:
    """``seed`` as an int, or ValueError/TypeError naming ``who``: a non-negative integer (a
    numpy integer too), as ``np.random.default_rng`` takes it; checked when the compressor
    is made, not at its first call."""
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer):
        raise TypeError(f"{who}: seed must be a non-negative int; got {seed!r}")
    if seed < 0:
        raise ValueError(f"{who}: seed must be a non-negative int; got {seed!r}")
    return int(seed)


def native(x: np.ndarray) -> np.ndarray:
    """``x`` in native byte order: ``x`` itself when it already is, else a converted copy.

    See Note [byte order].
    """
    if x.dtype.isnative:
        return x
    return x.astype(x.dtype.newbyteorder("="))


def call_header(x: np.ndarray, average: bool) -> np.ndarray:
    """The 16 bytes (uint8) that say this rank's call in its allgathered row: ``x``'s element
    count, its itemsize and whether it averages (Note [call headers])."""
    head = np.zeros(HEADER_BYTES, np.uint8)
    head[:8] = np.array([x.size], "<u8").view(np.uint8)
    head[8:] = np.array([x.dtype.itemsize, int(average)], "<u4").view(np.uint8)
    return head


def check_headers(rows: np.ndarray, comm: Communicator, name: str) -> None:
    """Raise MismatchError if the headers starting ``rows`` (one allgathered row per rank,
    uint8) say different calls; every rank sees the same rows, so all raise alike."""
    heads = np.ascontiguousarray(rows[:, :HEADER_BYTES])
    counts = heads[:, :8].copy().view("<u8")[:, 0]
    rest = heads[:, 8:].copy().view("<u4")
    said = [(int(counts[q]), int(rest[q, 0]), int(rest[q, 1])) for q in range(len(heads))]
    if len(set(said)) == 1:
        return
    ranks: dict[tuple[int, int, int], list[int]] = {}
    for q, call in enumerate(said):
        ranks.setdefault(call, []).append(q)
    parts = []
    for (count, itemsize, avg), who in ranks.items():
        label = f"rank {who[0]}" if len(who) == 1 else "ranks " + ", ".join(map(str, who))
        op = "AVG" if avg else "SUM"
        parts.append(f"{label} passed {count} float{8 * itemsize} elements with {op}")
    raise MismatchError(
        f"rank {comm.rank}: allreduce ({name} compression): the ranks' calls do not match: "
        + "; ".join(parts)
    )


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


class _Slot:
    """What a table keeps per tensor: the claimed shape and working dtype, and the state.

    ``state`` is None between the call that claimed the key and the run that
    makes it (Note [state claims]).
    """

    __slots__ = ("dtype", "shape", "state")

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype, state: Any = None) -> None:
        self.shape = shape
        self.dtype = dtype
        self.state = state


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
        k = self._key(key, x)
        slot = table.get(k)
        if slot is not None:
            if slot.state is not None:
                self._check_state(slot.state, x, comm, key)
            if (slot.shape, slot.dtype) != (x.shape, work_dtype(x.dtype)):
                raise ValueError(
                    f"rank {comm.rank}: allreduce: {self.name}: "
                    f"{'key ' + repr(key) if key is not None else 'this array'} is in use "
                    f"for a tensor of shape {slot.shape} (computed in {slot.dtype}); x has "
                    f"{x.shape} and {x.dtype}. Give each tensor its own key "
                    "(c.with_key(name)) or call reset()"
                )
        elif self._keeps_state(x):
            self._claim(table, k, key, x)

    def collectives(self, x: np.ndarray, comm: Communicator) -> int:
        """How many collective calls :meth:`allreduce` makes on ``comm`` for ``x``."""
        return 1

    def _keeps_state(self, x: np.ndarray) -> bool:
        """Whether a call for ``x`` keeps state, and so claims its key (Note [state claims])."""
        return self.stateful

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
        slot = self._table(comm).get(self._key(key, x))
        return None if slot is None else slot.state

    def _claim(self, table: _Table, k: Hashable, key: Hashable | None, x: np.ndarray) -> _Slot:
        """A new slot for ``x`` under ``k``, dropped with ``x`` when keyed by its identity."""
        slot = _Slot(x.shape, work_dtype(x.dtype))
        if key is None:
            weakref.finalize(x, _forget, weakref.ref(table), k)
        table[k] = slot
        return slot

    def _store(self, comm: Communicator, key: Hashable | None, x: np.ndarray, state: Any) -> None:
        table = self._table(comm)
        k = self._key(key, x)
        slot = table.get(k)
        if slot is None:  # a direct call, without check(): claim the key now
            slot = self._claim(table, k, key, x)
        slot.state = state

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
