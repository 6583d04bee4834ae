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
        ``TWOINT``: ``MPI_2INT``, ``BOOL``: ``MPI_C_BOOL``: :data:`ALIASES`)."""
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
    "UNSIGNED_SHORT": np.ushort,
    "INT": np.intc,
    "UNSIGNED": np.uintc,
    "LONG": np.dtype("l"),
    "UNSIGNED_LONG": np.dtype("L"),
    "LONG_LONG": np.longlong,
    "UNSIGNED_LONG_LONG": np.ulonglong,
    "FLOAT": np.float32,
    "DOUBLE": np.float64,
    "LONG_DOUBLE": np.longdouble,
    "C_BOOL": np.bool_,
    "INT8_T": np.int8,
    "INT16_T": np.int16,
    "INT32_T": np.int32,
    "INT64_T": np.int64,
    "UINT8_T": np.uint8,
    "UINT16_T": np.uint16,
    "UINT32_T": np.uint32,
    "UINT64_T": np.uint64,
    "C_COMPLEX": np.complex64,
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
    "SHORT_INT": np.short,
    "LONG_DOUBLE_INT": np.longdouble,
}

#: mpi4py's names that are another name for one type: on Open MPI each pair is one handle
#: (``MPI.BOOL == MPI.C_BOOL``), so here each is one Datatype object, named as
#: ``Get_name`` names it. Any other two names are two types, even of one numpy dtype
#: (``CHAR`` and ``SIGNED_CHAR``, ``INT`` and ``INT32_T``, ``COMPLEX`` and ``C_COMPLEX``),
#: unequal as mpi4py's are.
ALIASES: dict[str, str] = {
    "SIGNED_SHORT": "SHORT",
    "SIGNED_INT": "INT",
    "UNSIGNED_INT": "UNSIGNED",
    "SIGNED_LONG": "LONG",
    "SIGNED_LONG_LONG": "LONG_LONG",
    "BOOL": "C_BOOL",
    "C_FLOAT_COMPLEX": "C_COMPLEX",
    "INT_INT": "TWOINT",
}

#: What ``Get_name`` says, after ``MPI_``, where it is not the Python name: Open MPI's name
#: of the handle.
_MPI_NAMES: dict[str, str] = {"LONG_LONG": "LONG_LONG_INT", "TWOINT": "2INT"}

#: Every datatype by its mpi4py name (``DOUBLE``, ``DOUBLE_INT``, ...).
DATATYPES: dict[str, Datatype] = {name: Datatype(name, dt) for name, dt in _SCALARS.items()}
for _name, _value in _PAIRS.items():
    DATATYPES[_name] = Datatype(_name, *_pair(_value))
for _name, _value in ALIASES.items():
    DATATYPES[_name] = DATATYPES[_value]  # one type, two names, as in mpi4py

#: mpi4py's ``MPI._typedict_c``, ``MPI._typedict`` and ``MPI._typedict_f`` (scripts send
#: ``[a, MPI._typedict[a.dtype.char]]``): the datatype of each type code, as mpi4py on
#: Open MPI maps it, for every code whose datatype plait.mpi offers (not half precision's
#: ``"e"``/``"f2"``, nor ``wchar_t``'s ``"U"``/``"w"``). C's codes are numpy's
#: ``dtype.char``, ``struct``'s and numpy's kind and size (``"f8"``); the whole map adds
#: numpy's and PEP 3118's others; Fortran's are ``"i"``, ``"r"``, ``"d"``, ...
_CODES_C: dict[str, str] = {
    **{"?": "C_BOOL", "b": "SIGNED_CHAR", "h": "SHORT", "i": "INT", "l": "LONG"},
    **{"q": "LONG_LONG", "B": "UNSIGNED_CHAR", "H": "UNSIGNED_SHORT", "I": "UNSIGNED"},
    **{"L": "UNSIGNED_LONG", "Q": "UNSIGNED_LONG_LONG", "f": "FLOAT", "d": "DOUBLE"},
    **{"g": "LONG_DOUBLE", "F": "C_COMPLEX", "D": "C_DOUBLE_COMPLEX"},
    **{"G": "C_LONG_DOUBLE_COMPLEX", "b1": "C_BOOL", "i1": "INT8_T", "i2": "INT16_T"},
    **{"i4": "INT32_T", "i8": "INT64_T", "u1": "UINT8_T", "u2": "UINT16_T", "u4": "UINT32_T"},
    **{"u8": "UINT64_T", "f4": "FLOAT", "c8": "C_COMPLEX", "f8": "DOUBLE"},
    **{"c16": "C_DOUBLE_COMPLEX", "f16": "LONG_DOUBLE", "c32": "C_LONG_DOUBLE_COMPLEX"},
}
_CODES: dict[str, str] = {
    **_CODES_C,
    **{"Zf": "C_COMPLEX", "Zd": "C_DOUBLE_COMPLEX", "Zg": "C_LONG_DOUBLE_COMPLEX"},
    **{"n": "COUNT", "N": "UNSIGNED_LONG", "p": "AINT", "P": "UNSIGNED_LONG"},
    **dict.fromkeys(("c", "a", "S", "S1", "s", "1s"), "CHAR"),
    **dict.fromkeys(("u", "1u"), "UINT16_T"),
    **dict.fromkeys(("M", "M8", "m", "m8"), "INT64_T"),
}
_CODES_F: dict[str, str] = {
    **{"i": "INTEGER", "r": "REAL", "s": "REAL", "d": "DOUBLE_PRECISION"},
    **{"c": "COMPLEX", "z": "DOUBLE_COMPLEX"},
}
TYPEDICT: dict[str, Datatype] = {code: DATATYPES[name] for code, name in _CODES.items()}
TYPEDICT_C: dict[str, Datatype] = {code: DATATYPES[name] for code, name in _CODES_C.items()}
TYPEDICT_F: dict[str, Datatype] = {code: DATATYPES[name] for code, name in _CODES_F.items()}


def _typecode(code: str, call: str) -> Datatype:
    """The datatype of a typecode, as mpi4py reads one: its entry in ``MPI._typedict``
    (``"i4"`` is ``INT32_T``, ``"i"`` ``INT``, ``"b"`` ``SIGNED_CHAR``: Note [inferred
    datatypes]); another numpy code by its dtype."""
    known = TYPEDICT.get(code)
    if known is not None:
        return known
    try:
        dtype = np.dtype(code)
    except TypeError:
        raise TypeError(
            f"{call}: {code!r} is not a datatype or typecode (MPI.DOUBLE, 'd', 'i', ...)"
        ) from None
    return datatype_of(dtype)


def datatype_of(dtype: np.dtype) -> Datatype:
    """The datatype of a buffer whose specification names none, as mpi4py reads it from
    the buffer's format (Note [inferred datatypes]).

    Note [inferred datatypes]
        mpi4py looks a buffer's format up in ``MPI._typedict``, and a typecode too: an
        int8 array is ``SIGNED_CHAR``, a uint8 array, ``bytes`` and ``bytearray``
        ``UNSIGNED_CHAR`` (not ``BYTE``), an array of ``"q"`` ``LONG_LONG`` and one of
        ``"l"`` ``LONG`` (one numpy dtype, two datatypes). Which datatype it is matters
        where two must be the same (a reduction's send and receive buffers: "mismatch in
        send and receive MPI datatypes") and to what a reduction's op may do
        (MPI_ERR_OP), so plait.mpi reads it as mpi4py does. A dtype mpi4py has no code
        for (float16, structs) is a datatype of its own, named by the dtype, and so is a
        byte-swapped one (mpi4py refuses it: "non-native byte order").
    """
    known = TYPEDICT_C.get(dtype.char)
    if known is not None and known.dtype == dtype:  # not a byte-swapped twin
        return known
    return Datatype(str(dtype), dtype)


def _memory(buf: Any, call: str, what: str = "", writes: bool = False) -> np.ndarray:
    """``buf`` as a numpy array over its own memory (no copy), contiguous (in C or Fortran
    order: its elements are then taken in memory order, as mpi4py takes them) and, where
    the call ``writes`` into it, writable.

    Raises:
        TypeError: not a buffer.
        MPIBufferError: a BufferError, as mpi4py raises, and a ValueError, as plait.mpi
            raised: a strided buffer, or one the call writes into that cannot be written
            in place (read-only, a numpy scalar, a copy: Note [buffers written in place]).

    Note [buffers written in place]
        A call writes into the caller's own memory, so a buffer it writes into must be
        that memory. A numpy scalar (``np.float64(0.0)``) is a value: numpy reads it as an
        array by copying it, and plait.mpi received into that copy and returned, the
        result lost (and a Recv's message consumed). mpi4py raises BufferError, "scalar
        buffer is readonly", on the rank that passed it, before anything moves; so does
        plait.mpi, on the path of a read-only array, as does an array-like whose
        ``__array__`` gives a new copy each time. As a send buffer a scalar is read only,
        and taken, as mpi4py takes it.
    """
    if buf is None:  # where mpi4py reads None as MPI.IN_PLACE, the calls never get here
        raise TypeError(
            f"{call}: None is not a buffer here (mpi4py reads a bare None as MPI.IN_PLACE, "
            "only where the call takes IN_PLACE); for an empty message pass "
            "[None, 0, datatype] or an empty array"
        )
    if writes and isinstance(buf, np.generic):  # Note [buffers written in place]
        raise MPIBufferError(
            f"{_named(call, what)} scalar buffer is readonly: a numpy scalar "
            f"({type(buf).__name__}) is a value, not memory this call can write into; pass "
            "an array (np.zeros(1), or the 0-d np.array(0.0))"
        )
    a = _array(buf, call)
    if (
        writes
        and a.size
        and not isinstance(buf, np.ndarray | bytes | bytearray)
        and not np.may_share_memory(a, _array(buf, call))
    ):
        raise MPIBufferError(
            f"{_named(call, what)} a {type(buf).__name__} gives a new copy of its data each "
            "time it is read as an array, so what this call writes would be lost; pass a "
            "numpy array, or an object with the buffer protocol"
        )
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


def _array(buf: Any, call: str) -> np.ndarray:
    """``buf`` as a numpy array, over its own memory wherever it has memory to share."""
    if isinstance(buf, np.ndarray):
        return buf
    if isinstance(buf, bytes | bytearray):
        return np.frombuffer(buf, np.uint8)
    if any(hasattr(buf, k) for k in ("__buffer__", "__array_interface__", "__array__")):
        return np.asarray(buf)  # array-likes that share their memory (torch CPU tensors too)
    try:  # a memoryview, array.array, ...: typed by its format, as mpi4py reads it
        return np.asarray(buf if isinstance(buf, memoryview) else memoryview(buf))
    except (TypeError, ValueError):
        raise TypeError(
            f"{call}: a {type(buf).__name__} is not a buffer; pass a numpy array "
            f"(the lowercase methods take Python objects)"
        ) from None


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
    if isinstance(spec, list | tuple):
        if not 2 <= len(spec) <= 4:  # mpi4py's words
            raise ValueError(
                f"{call}: message: expecting 2 to 4 items, got {len(spec)}: a buffer "
                "specification is [buf, datatype], [buf, count, datatype] or [buf, count, "
                "displ, datatype] (or the buffer alone)"
            )
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
    if dt is None:  # the buffer's own type, as mpi4py reads it (Note [inferred datatypes])
        dt = datatype_of(a.dtype)
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
