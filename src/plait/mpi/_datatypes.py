"""MPI datatypes and mpi4py's buffer specifications, read into numpy views of the caller's memory.

mpi4py's buffer methods take a *buffer specification*: the buffer alone (its datatype read
from the array), ``[buf, datatype]``, ``[buf, count, datatype]``, ``[buf, (count, displ),
datatype]`` and, for the ``v`` collectives, ``[buf, counts, displs, datatype]`` (counts and
displacements in elements of the datatype). :func:`message` and :func:`vector` turn one into
a :class:`Message`: the buffer's bytes as a flat ``uint8`` view (no copy) plus the datatype,
counts and displacements, so that data-moving calls move bytes whatever the element type
(structured pairs included) and reductions view the same bytes as the datatype's numpy dtype.

Note [datatypes]
    A :class:`Datatype` is a numpy dtype with MPI's name, size and extent. The pair types
    of MAXLOC and MINLOC (``DOUBLE_INT``, ``TWOINT``, ...) are numpy structured dtypes with
    two fields, value then index, laid out as C lays out the struct (``align=True``): so
    ``DOUBLE_INT`` has size 12 and extent 16, as in MPI. A structured array of two fields
    passed with a pair type keeps its own layout (``align=False`` arrays included).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import numpy as np

from plait.mpi._errors import MPIBufferError
from plait.mpi._unsupported import Unlisted, unsupported

__all__ = [
    "IN_PLACE",
    "Datatype",
    "InPlace",
    "Message",
    "datatype_of",
    "ints",
    "message",
    "vector",
]


class InPlace:
    """The type of :data:`IN_PLACE`: "the send data is already where the result goes"."""

    _instance: InPlace | None = None

    def __new__(cls) -> InPlace:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "IN_PLACE"


#: mpi4py's ``MPI.IN_PLACE``, for the send buffer of the collectives that accept it.
IN_PLACE = InPlace()


class Datatype(metaclass=Unlisted):
    """An MPI datatype: a numpy dtype with MPI's name, size (bytes of data) and extent.

    The extent is the stride between elements (the dtype's itemsize); the size differs from
    it only for the pair types, whose C struct has padding (Note [datatypes]). A name
    mpi4py's has and this lacks raises Unsupported, on an instance (``MPI.INT.Commit``)
    and on the class (``MPI.Datatype.Create_struct``) alike.
    """

    __slots__ = ("dtype", "name", "size")

    def __init__(self, name: str, dtype: Any, size: int | None = None) -> None:
        self.name = name
        self.dtype = np.dtype(dtype)
        self.size = self.dtype.itemsize if size is None else size

    @property
    def extent(self) -> int:
        """Bytes from one element to the next."""
        return int(self.dtype.itemsize)

    @property
    def lb(self) -> int:
        """The lower bound: always 0 (no derived datatypes)."""
        return 0

    @property
    def ub(self) -> int:
        """The upper bound: the extent."""
        return self.extent

    @property
    def is_pair(self) -> bool:
        """Whether this is a (value, index) pair type of MAXLOC and MINLOC."""
        return self.dtype.names is not None and len(self.dtype.names) == 2

    def Get_size(self) -> int:
        """Bytes of data in one element, as ``MPI_Type_size``."""
        return self.size

    def Get_extent(self) -> tuple[int, int]:
        """``(lb, extent)``, as ``MPI_Type_get_extent``."""
        return 0, self.extent

    def Get_name(self) -> str:
        """MPI's name of the type, e.g. ``MPI_DOUBLE``: the C name that mpi4py gives, where
        its Python name is another for the same type (``LONG_LONG``: ``MPI_LONG_LONG_INT``,
        ``TWOINT``: ``MPI_2INT``, ``BOOL``: ``MPI_C_BOOL``)."""
        return f"MPI_{_MPI_NAMES.get(self.name, self.name)}"

    def __repr__(self) -> str:
        return f"<plait.mpi.Datatype {self.name} ({self.dtype})>"

    def __getattr__(self, name: str) -> Any:
        # mpi4py's Datatype methods plait.mpi lacks (Create_contiguous, Commit, ...): no
        # derived datatypes; Unsupported, as for MPI and Comm.
        if name.startswith("_"):
            raise AttributeError(name)
        return _raise(unsupported("Datatype", name, ()))


def _raise(error: Exception) -> Any:
    raise error


def _pair(value: Any) -> tuple[np.dtype, int]:
    """The structured dtype of a (value, int) C struct, and the bytes of data in it."""
    v = np.dtype(value)
    dt = np.dtype([("value", v), ("index", np.intc)], align=True)
    return dt, v.itemsize + np.dtype(np.intc).itemsize


_SCALARS: dict[str, Any] = {
    "BYTE": np.uint8,
    "CHAR": np.int8,
    "SIGNED_CHAR": np.int8,
    "UNSIGNED_CHAR": np.uint8,
    "SHORT": np.short,
    "SIGNED_SHORT": np.short,
    "UNSIGNED_SHORT": np.ushort,
    "INT": np.intc,
    "SIGNED_INT": np.intc,
    "UNSIGNED": np.uintc,
    "UNSIGNED_INT": np.uintc,
    "LONG": np.dtype("l"),
    "SIGNED_LONG": np.dtype("l"),
    "UNSIGNED_LONG": np.dtype("L"),
    "LONG_LONG": np.longlong,
    "SIGNED_LONG_LONG": np.longlong,
    "UNSIGNED_LONG_LONG": np.ulonglong,
    "FLOAT": np.float32,
    "DOUBLE": np.float64,
    "LONG_DOUBLE": np.longdouble,
    "C_BOOL": np.bool_,
    "BOOL": np.bool_,
    "INT8_T": np.int8,
    "INT16_T": np.int16,
    "INT32_T": np.int32,
    "INT64_T": np.int64,
    "UINT8_T": np.uint8,
    "UINT16_T": np.uint16,
    "UINT32_T": np.uint32,
    "UINT64_T": np.uint64,
    "C_COMPLEX": np.complex64,
    "C_FLOAT_COMPLEX": np.complex64,
    "C_DOUBLE_COMPLEX": np.complex128,
    "C_LONG_DOUBLE_COMPLEX": np.clongdouble,
    "COMPLEX": np.complex64,
    "DOUBLE_COMPLEX": np.complex128,
    "INTEGER": np.int32,
    "REAL": np.float32,
    "DOUBLE_PRECISION": np.float64,
    "AINT": np.int64,
    "OFFSET": np.int64,
    "COUNT": np.int64,
}

_PAIRS: dict[str, Any] = {
    "FLOAT_INT": np.float32,
    "DOUBLE_INT": np.float64,
    "LONG_INT": np.dtype("l"),
    "TWOINT": np.intc,
    "INT_INT": np.intc,
    "SHORT_INT": np.short,
    "LONG_DOUBLE_INT": np.longdouble,
}

#: What ``Get_name`` says, after ``MPI_``, where it is not the Python name: mpi4py's names
#: for one type share its handle, and Open MPI names the handle so.
_MPI_NAMES: dict[str, str] = {
    "SIGNED_SHORT": "SHORT",
    "SIGNED_INT": "INT",
    "UNSIGNED_INT": "UNSIGNED",
    "SIGNED_LONG": "LONG",
    "LONG_LONG": "LONG_LONG_INT",
    "SIGNED_LONG_LONG": "LONG_LONG_INT",
    "BOOL": "C_BOOL",
    "C_FLOAT_COMPLEX": "C_COMPLEX",
    "TWOINT": "2INT",
}

#: Every datatype by its mpi4py name (``DOUBLE``, ``DOUBLE_INT``, ...).
DATATYPES: dict[str, Datatype] = {name: Datatype(name, dt) for name, dt in _SCALARS.items()}
for _name, _value in _PAIRS.items():
    DATATYPES[_name] = Datatype(_name, *_pair(_value))
DATATYPES["INT_INT"] = DATATYPES["TWOINT"]  # one type, two names, as in mpi4py

#: The datatype a buffer of each numpy dtype gets when the specification names none.
_BY_DTYPE: dict[np.dtype, Datatype] = {}
for _name in ("BYTE", "INT8_T", "SHORT", "INT", "LONG", "LONG_LONG", "UNSIGNED_SHORT"):
    _BY_DTYPE.setdefault(DATATYPES[_name].dtype, DATATYPES[_name])
for _name in ("UNSIGNED", "UNSIGNED_LONG", "UNSIGNED_LONG_LONG", "FLOAT", "DOUBLE"):
    _BY_DTYPE.setdefault(DATATYPES[_name].dtype, DATATYPES[_name])
for _name in ("LONG_DOUBLE", "C_BOOL", "C_FLOAT_COMPLEX", "C_DOUBLE_COMPLEX"):
    _BY_DTYPE.setdefault(DATATYPES[_name].dtype, DATATYPES[_name])
_BY_DTYPE.setdefault(DATATYPES["C_LONG_DOUBLE_COMPLEX"].dtype, DATATYPES["C_LONG_DOUBLE_COMPLEX"])


def _typecode(code: str, call: str) -> Datatype:
    """The datatype of a typecode (``"d"``, ``"i"``, ``"f8"``), as mpi4py reads one."""
    try:
        dtype = np.dtype(code)
    except TypeError:
        raise TypeError(
            f"{call}: {code!r} is not a datatype or typecode (MPI.DOUBLE, 'd', 'i', ...)"
        ) from None
    return datatype_of(dtype)


def datatype_of(dtype: np.dtype) -> Datatype:
    """The datatype of a buffer whose specification names none: from its numpy dtype."""
    known = _BY_DTYPE.get(dtype)
    if known is not None:
        return known
    return Datatype(str(dtype), dtype)


def _memory(buf: Any, call: str, what: str = "", writes: bool = False) -> np.ndarray:
    """``buf`` as a numpy array over its own memory (no copy), contiguous (in C or Fortran
    order: its elements are then taken in memory order, as mpi4py takes them) and, where
    the call ``writes`` into it, writable.

    Raises:
        TypeError: not a buffer.
        MPIBufferError: a BufferError, as mpi4py raises, and a ValueError, as plait.mpi
            raised: a strided buffer, or a read-only one the call writes into.
    """
    if buf is None:  # where mpi4py reads None as MPI.IN_PLACE, the calls never get here
        raise TypeError(
            f"{call}: None is not a buffer here (mpi4py reads a bare None as MPI.IN_PLACE, "
            "only where the call takes IN_PLACE); for an empty message pass "
            "[None, 0, datatype] or an empty array"
        )
    if isinstance(buf, np.ndarray):
        a = buf
    elif isinstance(buf, bytes | bytearray):
        a = np.frombuffer(buf, np.uint8)
    elif any(hasattr(buf, k) for k in ("__buffer__", "__array_interface__", "__array__")):
        a = np.asarray(buf)  # array-likes that share their memory (torch CPU tensors too)
    else:
        try:  # a memoryview, array.array, ...: typed by its format, as mpi4py reads it
            a = np.asarray(buf if isinstance(buf, memoryview) else memoryview(buf))
        except (TypeError, ValueError):
            raise TypeError(
                f"{call}: a {type(buf).__name__} is not a buffer; pass a numpy array "
                f"(the lowercase methods take Python objects)"
            ) from None
    if not (a.flags.c_contiguous or a.flags.f_contiguous):
        raise MPIBufferError(
            f"{_named(call, what)} the buffer is not contiguous (a strided view, such as "
            "x[:, 0] or x[::2]); pass np.ascontiguousarray(x), and copy back what is received"
        )
    if writes and not a.flags.writeable:
        raise MPIBufferError(
            f"{_named(call, what)} the buffer is read-only, but this call writes into it; "
            "pass a writable array"
        )
    return a


@dataclass
class Message:
    """One buffer specification, read: the bytes, the datatype, and where the data is.

    ``counts``/``displs`` hold one entry for a plain specification and one per rank for a
    ``v`` one; both count elements of ``datatype`` (extent bytes each).
    """

    raw: np.ndarray  #: the whole buffer's bytes, flat uint8, over the caller's memory
    datatype: Datatype
    counts: list[int]
    displs: list[int]

    @property
    def count(self) -> int:
        """The element count of a plain specification."""
        return self.counts[0]

    @property
    def extent(self) -> int:
        """Bytes per element."""
        return self.datatype.extent

    def bytes(self, displ: int | None = None, count: int | None = None) -> np.ndarray:
        """The bytes of ``count`` elements from element ``displ`` (default: the message's)."""
        d = self.displs[0] if displ is None else displ
        n = self.counts[0] if count is None else count
        e = self.extent
        return self.raw[d * e : (d + n) * e]

    def typed(self, displ: int | None = None, count: int | None = None) -> np.ndarray:
        """The same elements as an array of the datatype's numpy dtype (a view)."""
        return self.bytes(displ, count).view(self.datatype.dtype)

    def block_bytes(self) -> list[int]:
        """Bytes of each block of a ``v`` specification."""
        return [c * self.extent for c in self.counts]

    def packed(self) -> bool:
        """Whether the blocks lie back to back from element 0 in rank order (no copy needed)."""
        at = 0
        for c, d in zip(self.counts, self.displs, strict=True):
            if d != at:
                return False
            at += c
        return True


def _split(spec: Any, call: str) -> tuple[Any, list[Any], Datatype | None]:
    """A specification's buffer, its middle items (counts, displacements) and datatype."""
    if isinstance(spec, list | tuple) and spec and not isinstance(spec, bytes | bytearray):
        items = list(spec)
        buf, rest = items[0], items[1:]
        dt = None
        if rest and isinstance(rest[-1], Datatype):
            dt = rest.pop()
        elif rest and isinstance(rest[-1], str):  # a typecode, as mpi4py takes: "d", "i"
            dt = _typecode(rest.pop(), call)
        elif rest and rest[-1] is None:
            rest.pop()
        for item in rest:
            if isinstance(item, Datatype):
                raise TypeError(f"{call}: the datatype goes last in a buffer specification")
        return buf, rest, dt
    return spec, [], None


def _resolve(
    buf: Any, dt: Datatype | None, call: str, what: str, writes: bool
) -> tuple[np.ndarray, Datatype]:
    """The buffer's bytes and its datatype (given, or read from the array).

    ``[None, 0, datatype]`` is mpi4py's empty message (MPI_BOTTOM with no elements): no
    bytes; a count above 0 with it is refused by :func:`_none_holds_nothing`.
    """
    if buf is None and dt is not None:
        return np.empty(0, np.uint8), dt
    a = _memory(buf, call, what, writes)
    if dt is None:  # the buffer's own type (it was bytes for all but numpy arrays)
        dt = DATATYPES["BYTE"] if isinstance(buf, bytes | bytearray) else datatype_of(a.dtype)
    elif dt.is_pair and a.dtype.names is not None and len(a.dtype.names) == 2:
        dt = Datatype(dt.name, a.dtype, dt.size)  # the array's own layout (Note [datatypes])
    return a.reshape(-1, order="A").view(np.uint8), dt  # "A": in memory order, no copy


def _int(value: Any, what: str, call: str) -> int:
    """``value`` as an int, as MPI takes a count: an integer of any kind (``operator.index``),
    never a float (2.5 elements used to be taken as 2)."""
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{call}: {what} must be an int; got {value!r}") from None


def ints(value: Any, what: str, call: str) -> list[int]:
    try:
        out = [operator.index(v) for v in value]
    except TypeError:
        raise TypeError(f"{call}: {what} must be a sequence of ints; got {value!r}") from None
    if any(v < 0 for v in out):
        raise ValueError(f"{call}: {what} must be >= 0; got {out}")
    return out


def _whole(raw: np.ndarray, dt: Datatype, call: str) -> int:
    if dt.extent == 0 or raw.size % dt.extent:
        raise ValueError(
            f"{call}: a buffer of {raw.size} bytes is not a whole number of "
            f"{dt.name} elements ({dt.extent} bytes each)"
        )
    return raw.size // dt.extent


def _named(call: str, what: str) -> str:
    """The head of an error: the call, and the buffer (``sendbuf``, ``recvbuf``) if named."""
    return f"{call}: {what}:" if what else f"{call}:"


def _none_holds_nothing(buf: Any, m: Message, call: str, what: str) -> None:
    """Refuse ``[None, count, datatype]`` with a count above 0, as mpi4py does: None is an
    empty message, not memory to read or write."""
    if buf is None and any(m.counts):
        raise ValueError(
            f"{_named(call, what)} the buffer is None, but the specification counts "
            f"{sum(m.counts)} element(s) of {m.datatype.name}; None holds no element "
            "(pass an array)"
        )


def _check_fits(m: Message, call: str, what: str = "", blocks: int = 1) -> Message:
    """Refuse, before any byte moves, a specification that reaches past its buffer's end:
    ``blocks`` blocks of the count from the displacement (a plain one), or each block at
    its displacement (a ``v`` one)."""
    if blocks > 1:
        end = m.displs[0] + m.counts[0] * blocks
        shape = f" ({blocks} blocks of {m.counts[0]}" + (
            f" from element {m.displs[0]})" if m.displs[0] else ")"
        )
    else:
        end = max((d + c for c, d in zip(m.counts, m.displs, strict=True)), default=0)
        shape = ""
    if end * m.extent > m.raw.size:
        raise ValueError(
            f"{_named(call, what)} the specification reaches element {end} of "
            f"{m.datatype.name}{shape} but the buffer holds {m.raw.size // max(m.extent, 1)}"
        )
    return m


def message(
    spec: Any, call: str, *, blocks: int = 1, what: str = "", writes: bool = False
) -> Message:
    """Read a plain specification: ``buf``, ``[buf, datatype]``, ``[buf, count, datatype]``,
    ``[buf, (count, displ), datatype]`` or ``[buf, count, displ, datatype]``. A count of
    None is the whole buffer from the displacement on, as mpi4py reads it.

    With ``blocks`` > 1 (the receive buffer of Gather, Allgather and Alltoall, the send
    buffer of Scatter and Alltoall) the count is per block and defaults to the buffer's
    elements from the displacement on divided by ``blocks`` (mpi4py's ``(n - displ) //
    blocks``); every block must lie within the buffer. ``what`` names the buffer in errors
    (``sendbuf``, ``recvbuf``). The call writes into a ``recvbuf``, and into a buffer read
    with ``writes`` (Bcast's off root, a receive's): it must be writable.

    Raises:
        TypeError: not a buffer, or a misplaced datatype.
        MPIBufferError: a BufferError and a ValueError: a strided buffer, or a read-only
            one the call writes into.
        ValueError: counts past the buffer's end.
    """
    buf, rest, dt = _split(spec, call)
    raw, dt = _resolve(buf, dt, call, what, writes or what == "recvbuf")
    if len(rest) == 1 and isinstance(rest[0], list | tuple):
        rest = list(rest[0])
    if len(rest) > 2:
        raise TypeError(f"{call}: a buffer specification has at most a count and a displacement")
    displ = _int(rest[1], "displacement", call) if len(rest) > 1 else 0
    if rest and rest[0] is not None:
        count = _int(rest[0], "count", call)
    else:  # none given, or None (mpi4py's too): the whole buffer, from the displacement on
        total = _whole(raw, dt, call)
        left = total - displ  # per block with blocks > 1, as mpi4py: (n - displ) // blocks
        if left < 0:
            raise ValueError(
                f"{_named(call, what)} the displacement {displ} is past the buffer's end "
                f"({total} elements of {dt.name})"
            )
        if left % blocks:
            after = f" after the displacement {displ}" if displ else ""
            raise ValueError(
                f"{_named(call, what)} {left} elements of {dt.name}{after} do not split into "
                f"{blocks} blocks"
            )
        count = left // blocks
    if count < 0 or displ < 0:
        raise ValueError(f"{call}: counts and displacements must be >= 0")
    m = Message(raw, dt, [count], [displ])
    _none_holds_nothing(buf, m, call, what)
    return _check_fits(m, call, what, blocks)


def vector(spec: Any, size: int, call: str, what: str = "") -> Message:
    """Read a ``v`` specification: ``[buf, counts, displs, datatype]``, ``[buf, counts,
    datatype]`` (blocks back to back), ``[buf, (counts, displs), datatype]``; a single int
    count is every rank's, and no counts (none given, or None) split the buffer as mpi4py
    does (Note [counts of a buffer alone]). ``what`` names the buffer in errors; a
    ``recvbuf`` must be writable, as in :func:`message`.

    Raises:
        TypeError, ValueError: as :func:`message`, and counts that are not ``size`` long.

    Note [counts of a buffer alone]
        A ``v`` buffer given without counts holds ``n`` elements; mpi4py gives rank ``i``
        ``n // size`` of them, and one more to each of the first ``n % size`` ranks, back
        to back: 5 elements on 2 ranks are blocks of 3 and 2. A script that sizes each
        rank's part so (``n // size + (n % size > rank)``) passes the whole buffer alone.
        plait.mpi refused any ``n`` that ``size`` does not divide.
    """
    buf, rest, dt = _split(spec, call)
    raw, dt = _resolve(buf, dt, call, what, what == "recvbuf")
    if len(rest) == 1 and isinstance(rest[0], tuple) and len(rest[0]) == 2:
        rest = list(rest[0])  # (counts, displs), as mpi4py reads a pair: (2, None) too
    if len(rest) > 2:
        raise TypeError(f"{call}: a vector specification is [buf, counts, displs, datatype]")
    if not rest or rest[0] is None:  # Note [counts of a buffer alone]
        total = _whole(raw, dt, call)
        counts = [total // size + (total % size > i) for i in range(size)]
    elif isinstance(rest[0], int | np.integer):
        counts = [int(rest[0])] * size
    else:
        counts = ints(rest[0], "counts", call)
    if len(rest) > 1 and rest[1] is not None:
        displs = (
            [int(rest[1]) * i for i in range(size)]
            if isinstance(rest[1], int | np.integer)
            else ints(rest[1], "displacements", call)
        )
    else:
        displs = [int(v) for v in np.concatenate([[0], np.cumsum(counts)[:-1]])] if counts else []
    if len(counts) != size or len(displs) != size:
        raise ValueError(
            f"{call}: need {size} counts and displacements (one per rank); "
            f"got {len(counts)} and {len(displs)}"
        )
    m = Message(raw, dt, counts, displs)
    _none_holds_nothing(buf, m, call, what)
    return _check_fits(m, call, what)
