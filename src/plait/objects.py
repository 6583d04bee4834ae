"""Python objects as frames of bytes for the object collectives, with array memory out of band.

The object collectives (``bcast_object``, ``allgather_object``, ``gather_object``,
``scatter_object``, ``alltoall_object``, ``allreduce_object``, ``send_object`` and
``recv_object``) move any picklable object. This module is the part below them that
knows nothing of ranks: :func:`dumps` turns an object into :class:`Frames` (a pickle
protocol 5 header and the raw memory of its arrays, uncopied), :func:`pack` lays frames
out as messages, :func:`unpack` and :func:`loads` undo both on the receiver, and
:func:`reduce_in_rank_order` is the fold of ``allreduce_object``.

Unpickling runs code chosen by whoever made the bytes (a pickle can call any importable
function), so an object collective must only ever load bytes that came from a rank of the
same job. The transports ensure that: a TCP peer is admitted only after proving that it
holds the job's secret (``PLAIT_SECRET``), and a shared-memory peer only if it runs as the
same user and knows the job's token. Never feed bytes from anywhere else to :func:`loads`.

Note [out-of-band buffers]
~~~~~~~~~~~~~~~~~~~~~~~~~~
Pickle protocol 5 hands every :class:`pickle.PickleBuffer` that an object's reducer
produces to a ``buffer_callback`` instead of copying it into the pickle; the receiver
passes the buffers back to :func:`pickle.loads`, which gives each to the reducer's
rebuild function as it is. numpy does this for C- or Fortran-contiguous arrays without
Python objects: ``np.frombuffer`` over the received memory rebuilds them, so an array
that arrives in writable memory (a ``bytearray``, an ndarray, or :func:`empty`'s
memory) is *that* memory, not a copy. :func:`dumps` adds what numpy and torch leave out:

* a non-contiguous ndarray, which numpy would copy into the pickle, is made contiguous
  once (one copy, on the sender) and then travels out of band like any other;
* a torch CPU tensor, which torch pickles through its storage and a byte stream inside
  the pickle (no out-of-band buffer at all, as of torch 2.13), travels as its bytes out of
  band, read without ``Tensor.numpy()`` (which would leave the sender's tensor unresizable
  for good: Note [arrays over a tensor's memory] in :mod:`plait._tensor`). Only the bytes
  of the tensor itself move (torch's own pickle carries the whole storage of a view), and
  views of one storage arrive as separate tensors. A tensor whose elements fill its
  memory without gaps keeps its strides (channels_last, a transposed matrix: sent as they
  lie, no copy); one with gaps (a slice with a step) arrives contiguous, its storage
  offset 0. Other tensors (other devices, sparse,
  quantized, subclasses, tensors with Python attributes) keep torch's own pickling;
* a received tensor gets storage of its own that torch can resize, as torch's unpickling
  gives it (FSDP frees and re-allocates its parameters' storage): memory that torch did
  not allocate never is resizable, so ``torch.from_numpy`` over the received memory will
  not do. A tensor sent as a message of its own (:data:`SEPARATE_MIN` bytes or more,
  where the call has separate messages) arrives in memory that :func:`empty` allocated
  through torch, and that storage becomes the tensor's: no copy. One that arrived inside
  a larger message (with other buffers, or in the pickle) is copied out of it once, into
  storage of its own;
* ``bytes`` and ``bytearray`` stay in the pickle (pickle writes them itself and never
  asks a reducer); a large payload travels out of band as a numpy array
  (``np.frombuffer(payload, np.uint8)``) or wrapped in :class:`pickle.PickleBuffer`, which
  arrives as a view of the received memory.

Buffers smaller than :data:`OOB_MIN` stay inside the pickle: their copy costs nothing,
while an out-of-band buffer costs a length entry and up to ``ALIGN - 1`` bytes of padding.

Note [object frames]
~~~~~~~~~~~~~~~~~~~~
A packed object is one *first message*, then one message per *separate* buffer::

    first message (length a multiple of ALIGN = 64)
    +-----------------------------------+--------------+-----+-------+-----+-------+-----+
    | length table                      | pickle       | pad | buf 0 | pad | buf 2 | pad |
    | <Q n> <Q pickle> <Q len 0..n-1>   | (the header) |     |       |     |       |     |
    +-----------------------------------+--------------+-----+-------+-----+-------+-----+
    then, as messages of their own:  buf 1  (and every other buffer >= separate_min)

The length table is ``2 + n`` little-endian unsigned 64-bit words: the number of
out-of-band buffers, the pickle's length and each buffer's length, so objects and
buffers above 2 GiB (or 4 GiB) need nothing special. Every inline buffer starts at a
multiple of :data:`ALIGN` from the start of the message, and the message is padded to a
multiple of :data:`ALIGN`, so in memory from :func:`empty` every array is aligned, even
when several ranks' messages lie end to end in one receive buffer (allgatherv, gatherv).
Where each buffer lies is a function of the lengths and ``separate_min`` alone
(:class:`Layout`), so a receiver that holds the table knows the size of every message
still to come before it arrives. With ``separate_min=None`` everything is one message
(one copy of each buffer into it, on the sender), which is what the uneven collectives
need; with :data:`SEPARATE_MIN`, large buffers are sent straight from the object's
memory and received straight into memory that becomes the array: no copy on either side.
Both sides must pass the same ``separate_min``; a receiver that did not gets a
``ValueError`` from :meth:`Layout.read` (the first message's length does not match).

Example: ``{"w": np.ones(1_000_000), "step": 7}`` pickles to a header of 138 bytes and
one 8,000,000-byte buffer. With ``separate_min=SEPARATE_MIN`` it is two messages: the
24-byte table and the header, padded to 192 bytes, then the 8,000,000 bytes of the array
itself.

Arrays loaded from a received message keep that whole message's memory alive (they are
views of it); copy an array to let the rest go. Tensors do not: each has storage of its own.
"""

from __future__ import annotations

import io
import pickle
import struct
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import numpy as np

from plait import _tensor

__all__ = [
    "ALIGN",
    "OOB_MIN",
    "PICKLE_FAILED",
    "SEPARATE_MIN",
    "Frames",
    "Layout",
    "dumps",
    "empty",
    "loads",
    "pack",
    "pack_into",
    "pack_lengths",
    "reduce_in_rank_order",
    "unpack",
    "unpack_lengths",
]

#: Byte alignment of every inline buffer within a first message, and of that message's length.
ALIGN: Final = 64
#: Buffers of fewer bytes stay inside the pickle (see Note [out-of-band buffers]).
OOB_MIN: Final = 1024
#: The ``separate_min`` where buffers may be messages of their own (bcast, send): those of at
#: least this many bytes travel uncopied. Copying 1 MiB takes about as long (30-100 us) as
#: one more collective call costs (about 40 us for an 8-byte broadcast between two thread
#: ranks), so smaller buffers are cheaper copied into the first message.
SEPARATE_MIN: Final = 1 << 20
#: A size word that no first message can have (those are multiples of ALIGN): a rank whose
#: object fails to pickle sends it where its size would go, so that its peers raise too
#: instead of waiting for a message that will never come.
PICKLE_FAILED: Final = 2**64 - 1

_WORD = struct.Struct("<Q")
_HEAD = struct.Struct("<QQ")
_MAX_WORD: Final = 2**64 - 1

#: What :func:`loads` and :func:`unpack` accept as received memory.
Bytes = bytes | bytearray | memoryview | np.ndarray

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Frames:
    """One object as a pickle protocol 5 header and its out-of-band buffers.

    Attributes:
        header: the pickle bytes (arrays' memory is not in them).
        buffers: the out-of-band buffers in the order :func:`loads` wants them: flat,
            contiguous, byte-formatted views of the object's own memory (or of the one
            contiguous copy made of a non-contiguous array), so they must stay unchanged
            until sent.
    """

    header: bytes
    buffers: tuple[memoryview, ...]

    @property
    def buffer_lens(self) -> tuple[int, ...]:
        """Each buffer's length in bytes."""
        return tuple(buf.nbytes for buf in self.buffers)

    @property
    def table(self) -> bytes:
        """The length table (see Note [object frames])."""
        return pack_lengths(len(self.header), self.buffer_lens)

    @property
    def nbytes(self) -> int:
        """Header and buffers together, without the table and padding."""
        return len(self.header) + sum(self.buffer_lens)


class _Pickler(pickle.Pickler):
    """A protocol 5 pickler that sends more memory out of band (Note [out-of-band buffers])."""

    def reducer_override(self, obj: Any) -> Any:
        kind = type(obj)
        if kind is np.ndarray:
            contiguous = obj.flags.c_contiguous or obj.flags.f_contiguous
            if not contiguous and not obj.dtype.hasobject:
                # numpy would copy it into the pickle: copy it once and send that out of band
                return np.ascontiguousarray(obj).__reduce_ex__(5)
            return NotImplemented
        torch = sys.modules.get("torch")
        if torch is not None and kind is torch.Tensor:
            return _reduce_tensor(torch, obj)
        return NotImplemented


def _reduce_tensor(torch: Any, t: Any) -> Any:
    """A dense CPU tensor as its bytes out of band, or NotImplemented for torch's own pickling."""
    if (
        t.device.type != "cpu"
        or t.layout != torch.strided
        or t.is_quantized
        or t.is_nested
        or getattr(t, "__dict__", None)
    ):
        return NotImplemented
    requires_grad = bool(t.requires_grad)
    plain = t.detach().resolve_conj().resolve_neg()
    strides = None if plain.is_contiguous() else _dense_strides(plain)
    if strides is None:
        flat = plain.contiguous().reshape(-1)
    else:  # its memory as it lies: one run of numel elements from its first
        flat = plain.as_strided((plain.numel(),), (1,))
    try:  # over its memory without .numpy(), which would leave it unresizable for good
        data = _tensor.over(flat.view(torch.uint8), "tensor").data
    except (RuntimeError, TypeError):  # a dtype of less than a byte, say
        return NotImplemented
    # The dtype argument is torch's own object: pickle imports torch on the receiver to
    # find it, exactly as for a tensor pickled by torch, so this module never has to.
    args = (pickle.PickleBuffer(data), t.dtype, tuple(t.shape), requires_grad)
    return _rebuild_tensor, args if strides is None else (*args, strides)


def _dense_strides(t: Any) -> tuple[int, ...] | None:
    """``t``'s strides where its elements fill ``numel`` elements of memory without gaps or
    overlaps in some order of its dimensions (channels_last, a transpose), else None."""
    dims = sorted((st, n) for n, st in zip(t.shape, t.stride(), strict=True) if n != 1)
    step = 1
    for st, n in dims:
        if st != step:
            return None
        step *= n
    return tuple(t.stride())


def _rebuild_tensor(
    data: Any,
    dtype: Any,
    shape: tuple[int, ...],
    requires_grad: bool,
    strides: tuple[int, ...] | None = None,
) -> Any:
    """The tensor :func:`_reduce_tensor` sent, in resizable storage of its own (with
    ``strides`` where it kept them): ``data``'s own memory where :func:`empty` allocated it
    through torch for this buffer alone, else a copy of ``data``."""
    torch = sys.modules["torch"]  # loaded by pickle to find ``dtype``
    arr = np.frombuffer(data, dtype=np.uint8)
    storage = _storage_of(torch, arr)
    if storage is None:
        memory = torch.empty(arr.nbytes, dtype=torch.uint8)
        if arr.nbytes:
            np.copyto(_tensor.over(memory, "tensor"), arr)
        storage = memory.untyped_storage()
    t = torch.empty(0, dtype=dtype)
    if strides is None:
        t.set_(storage, 0, shape)
    else:
        t.set_(storage, 0, shape, strides)
    if requires_grad:
        t.requires_grad_(True)
    return t


def _storage_of(torch: Any, arr: np.ndarray) -> Any:
    """The torch storage whose memory ``arr`` is, all of it and nothing else, or None.

    Only memory that :func:`empty` allocated through torch qualifies (numpy's, and memory
    a message shares with other buffers, do not): a tensor may then keep it as its
    storage, which torch can resize.
    """
    owner: Any = arr
    while isinstance(owner, np.ndarray):
        owner = owner.base
    if isinstance(owner, memoryview):  # what np.frombuffer(memoryview) keeps
        owner = owner.obj
        while isinstance(owner, np.ndarray):
            owner = owner.base
    held = _tensor.held(owner)
    if held is None or not isinstance(held, torch.Tensor):
        return None
    storage = held.untyped_storage()
    if storage.data_ptr() != arr.ctypes.data or storage.nbytes() != arr.nbytes:
        return None
    return storage


def dumps(obj: object) -> Frames:
    """Pickle ``obj`` with protocol 5, keeping array memory out of the pickle.

    numpy arrays, torch CPU tensors and :class:`pickle.PickleBuffer`\\ s become
    :attr:`Frames.buffers` that are views of their memory (no copy); a non-contiguous
    array or buffer is made contiguous once. Buffers under :data:`OOB_MIN` bytes stay
    in the pickle. See Note [out-of-band buffers].

    Raises:
        Whatever pickling ``obj`` raises (``pickle.PicklingError``, ``TypeError``,
        ``AttributeError`` for a lambda or a local class, ...).
    """
    buffers: list[memoryview] = []

    def out_of_band(buf: pickle.PickleBuffer) -> bool:
        try:
            raw = buf.raw()
        except BufferError:  # not contiguous: the one copy it needs, sent out of band
            buffers.append(memoryview(memoryview(buf).tobytes()))
            return False
        if raw.nbytes < OOB_MIN:
            return True  # in band: pickle copies it into the header
        buffers.append(raw)
        return False

    stream = io.BytesIO()
    _Pickler(stream, protocol=5, buffer_callback=out_of_band).dump(obj)
    return Frames(stream.getvalue(), tuple(buffers))


def loads(header: Bytes, buffers: Sequence[Bytes] = ()) -> Any:
    """The object :func:`dumps` made ``header`` and ``buffers`` from.

    A buffer in writable memory (``bytearray``, ndarray, :func:`empty`) becomes the
    memory of the array rebuilt from it, uncopied; a read-only one gives a read-only
    array (as pickle does). A tensor gets resizable storage of its own: the buffer's
    memory where :func:`empty` allocated it through torch for it alone, else a copy
    (Note [out-of-band buffers]).

    This runs code chosen by whoever pickled the object: only load what a rank of the
    same job sent (see the module docstring).
    """
    return pickle.loads(_byte_view(header), buffers=buffers)


def pack_lengths(pickle_len: int, buffer_lens: Sequence[int]) -> bytes:
    """The length table: ``<Q`` words ``len(buffer_lens)``, ``pickle_len``, each buffer's length.

    Raises:
        ValueError: a length is negative or does not fit 64 bits.
    """
    words = (len(buffer_lens), pickle_len, *buffer_lens)
    for word in words:
        if not 0 <= word <= _MAX_WORD:
            raise ValueError(f"object frame length {word} does not fit an unsigned 64-bit word")
    return struct.pack(f"<{len(words)}Q", *words)


def unpack_lengths(data: Bytes) -> tuple[int, tuple[int, ...]]:
    """``(pickle_len, buffer_lens)`` from the length table at the start of ``data``.

    ``data`` may be the table alone or a whole first message (bytes after the table are
    not read). The table describes itself: its first word is the number of buffers.

    Raises:
        ValueError: ``data`` is too short for the table it starts with, or the pickle
            length is 0 (no pickle is empty); the message gives the numbers.
    """
    view = _byte_view(data)
    if view.nbytes < _HEAD.size:
        raise ValueError(
            f"malformed object length table: {view.nbytes} bytes, fewer than the "
            f"{_HEAD.size} of its buffer count and pickle length"
        )
    count, pickle_len = _HEAD.unpack_from(view)
    room = (view.nbytes - _HEAD.size) // _WORD.size
    if count > room:
        raise ValueError(
            f"malformed object length table: it lists {count} buffers, which takes "
            f"{_HEAD.size + _WORD.size * count} bytes, but it has only {view.nbytes}"
        )
    if pickle_len == 0:
        raise ValueError("malformed object length table: a pickle length of 0")
    lens = struct.unpack_from(f"<{count}Q", view, _HEAD.size)
    return pickle_len, lens


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True, slots=True)
class Layout:
    """Where the table, the pickle and each buffer of one packed object lie.

    A function of the lengths and ``separate_min`` only (Note [object frames]), so the
    sender (:meth:`of` its frames) and a receiver (:meth:`read` from the first message)
    derive the same one.

    Attributes:
        pickle_len: the header's length.
        buffer_lens: each out-of-band buffer's length.
        header_offset: where the header starts in the first message (the table's length).
        offsets: for each buffer, its offset in the first message, or None if it is a
            message of its own.
        first_nbytes: the first message's length, a multiple of :data:`ALIGN`.
    """

    pickle_len: int
    buffer_lens: tuple[int, ...]
    header_offset: int
    offsets: tuple[int | None, ...]
    first_nbytes: int

    @classmethod
    def of(
        cls, pickle_len: int, buffer_lens: Sequence[int], *, separate_min: int | None = None
    ) -> Layout:
        """The layout of these lengths; buffers of ``separate_min`` bytes or more go alone."""
        lens = tuple(buffer_lens)
        header_offset = _HEAD.size + _WORD.size * len(lens)
        end = header_offset + pickle_len
        offsets: list[int | None] = []
        for n in lens:
            if separate_min is not None and n >= separate_min:
                offsets.append(None)
            else:
                start = _round_up(end)
                offsets.append(start)
                end = start + n
        return cls(pickle_len, lens, header_offset, tuple(offsets), _round_up(end))

    @classmethod
    def read(cls, first: Bytes, *, separate_min: int | None = None) -> Layout:
        """The layout of a received first message, checked against its length.

        Raises:
            ValueError: a malformed table, or a message whose length is not the one its
                table implies (also what a ``separate_min`` other than the sender's gives).
        """
        view = _byte_view(first)
        pickle_len, lens = unpack_lengths(view)
        layout = cls.of(pickle_len, lens, separate_min=separate_min)
        if layout.first_nbytes != view.nbytes:
            raise ValueError(
                f"malformed object message: {view.nbytes} bytes, but its length table "
                f"(pickle {pickle_len} bytes, buffers {list(lens)}) with separate_min="
                f"{separate_min} makes it {layout.first_nbytes}"
            )
        return layout

    @property
    def separate(self) -> tuple[int, ...]:
        """The indexes of the buffers sent as messages of their own, in sending order."""
        return tuple(i for i, off in enumerate(self.offsets) if off is None)

    @property
    def message_lens(self) -> tuple[int, ...]:
        """Every message's length: the first, then each separate buffer's."""
        return (self.first_nbytes, *(self.buffer_lens[i] for i in self.separate))


def empty(nbytes: int) -> memoryview:
    """``nbytes`` of writable, :data:`ALIGN`-aligned memory to receive into.

    Arrays loaded from it are views of it, aligned wherever :class:`Layout` put them.
    Where torch is loaded, :data:`SEPARATE_MIN` bytes or more are torch's memory, so
    that a tensor sent as a message of its own arrives in it uncopied and can still be
    resized (Note [out-of-band buffers]); numpy reads it without a copy too.
    """
    torch = sys.modules.get("torch")
    if torch is not None and nbytes >= SEPARATE_MIN:
        held = torch.empty(nbytes, dtype=torch.uint8)
        if held.data_ptr() % ALIGN == 0:  # torch's CPU allocator aligns to 64 bytes
            return _tensor.over(held, "memory").data
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start : start + nbytes].data


def pack_into(frames: Frames, out: memoryview, *, separate_min: int | None = None) -> Layout:
    """Write ``frames``' first message into ``out``, which has exactly its length.

    The way to lay several objects end to end without a second copy (scatterv,
    alltoallv input): size ``out`` from ``Layout.of(...).first_nbytes`` first.

    Raises:
        ValueError: ``out`` is not the first message's length.
    """
    layout = Layout.of(len(frames.header), frames.buffer_lens, separate_min=separate_min)
    view = _byte_view(out)
    if view.nbytes != layout.first_nbytes:
        raise ValueError(
            f"pack_into: out has {view.nbytes} bytes; the first message has {layout.first_nbytes}"
        )
    table = frames.table
    view[: len(table)] = table
    end = layout.header_offset + layout.pickle_len
    view[layout.header_offset : end] = frames.header
    for buf, off in zip(frames.buffers, layout.offsets, strict=True):
        if off is None:
            continue
        view[end:off] = bytes(off - end)
        end = off + buf.nbytes
        view[off:end] = buf
    view[end:] = bytes(view.nbytes - end)
    return layout


def pack(frames: Frames, *, separate_min: int | None = None) -> list[memoryview]:
    """``frames`` as messages: the first (table, header, inline buffers), then separate buffers.

    With ``separate_min=None``, one message (every buffer copied into it once); with
    :data:`SEPARATE_MIN`, buffers of that size or more follow as views of the object's
    own memory. See Note [object frames].
    """
    layout = Layout.of(len(frames.header), frames.buffer_lens, separate_min=separate_min)
    first = empty(layout.first_nbytes)
    pack_into(frames, first, separate_min=separate_min)
    return [first, *(frames.buffers[i] for i in layout.separate)]


def unpack(
    messages: Sequence[Bytes], *, separate_min: int | None = None
) -> tuple[memoryview, list[memoryview]]:
    """``(header, buffers)`` for :func:`loads`, as views of the received ``messages``.

    ``messages`` are what :func:`pack` made, received with the same ``separate_min``: the
    first message, then one per separate buffer (sized from ``Layout.read(first)``).

    Raises:
        ValueError: a malformed first message, or messages that do not match its table
            (how many, or their lengths).
    """
    if not messages:
        raise ValueError("unpack: no messages; the first one holds the length table")
    first = _byte_view(messages[0])
    layout = Layout.read(first, separate_min=separate_min)
    rest = [_byte_view(m) for m in messages[1:]]
    want = layout.message_lens[1:]
    got = tuple(m.nbytes for m in rest)
    if got != want:
        raise ValueError(
            f"malformed object messages: the length table wants separate buffers of "
            f"{list(want)} bytes after the first message, but {list(got)} arrived"
        )
    header = first[layout.header_offset : layout.header_offset + layout.pickle_len]
    separate = iter(rest)
    buffers = [
        next(separate) if off is None else first[off : off + n]
        for off, n in zip(layout.offsets, layout.buffer_lens, strict=True)
    ]
    return header, buffers


def _byte_view(data: Bytes) -> memoryview:
    """A flat byte view of ``data`` (no copy).

    ``ndarray.data`` rather than ``memoryview(ndarray)``: numpy's stubs give ndarray the
    buffer protocol only from Python 3.12 on.
    """
    if isinstance(data, np.ndarray):
        view = data.data
    else:
        view = data if isinstance(data, memoryview) else memoryview(data)
    if view.ndim == 1 and view.format in ("B", "b", "c"):
        return view if view.format == "B" else view.cast("B")
    return view.cast("B")


def _op_name(op: Callable[..., Any]) -> str:
    name = getattr(op, "__qualname__", None)
    if not isinstance(name, str):
        return repr(op)
    module = getattr(op, "__module__", None)
    if module == "_operator":
        module = "operator"
    return name if module in (None, "builtins") else f"{module}.{name}"


def reduce_in_rank_order(objs: Sequence[T], op: Callable[[T, T], T]) -> T:
    """``op(...op(op(objs[0], objs[1]), objs[2])..., objs[-1])``: the fold of ``allreduce_object``.

    ``objs[r]`` is rank r's object. The order is fixed, so a non-commutative ``op``
    (string or list concatenation) is applied as ``o0 ∘ o1 ∘ … ∘ o(p-1)``, and every
    rank that folds the same objects with a deterministic ``op`` gets an equal result.

    Raises:
        ValueError: ``objs`` is empty.
        Whatever ``op`` raises, with a note naming ``op`` and the ranks it was combining.
    """
    if not objs:
        raise ValueError("reduce_in_rank_order: no objects to reduce (a world of 0 ranks?)")
    acc = objs[0]
    for rank in range(1, len(objs)):
        try:
            acc = op(acc, objs[rank])
        except Exception as exc:
            left = "rank 0's object" if rank == 1 else f"the result of ranks 0..{rank - 1}"
            exc.add_note(
                f"allreduce_object: op {_op_name(op)} raised combining {left} with rank "
                f"{rank}'s object ({type(acc).__name__} with {type(objs[rank]).__name__})"
            )
            raise
    return acc
