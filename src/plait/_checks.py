"""The argument checks of the API edge: each returns the checked value or raises.

Every collective and point-to-point call of :class:`plait.Communicator` runs
its arguments through these before anything else happens, so a bad argument
raises TypeError or ValueError before a byte moves, and nothing below the edge
checks again. Every message names the rank and the collective (``c``) and
shows the value refused. The checks are plain functions of the rank, the size
and the value, so they hold no state of their own; the two caches they use
(dtypes and (op, dtype) pairs already accepted) only skip work on repeats.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from plait import _arrays, _tensor
from plait.ops import Op, check_dtype
from plait.runtime.work import check_timeout

__all__ = [
    "CACHE_LIMIT",
    "MAX_USER_TAG",
    "as_array",
    "as_writable",
    "check_counts",
    "check_op",
    "check_out",
    "check_own_memory",
    "check_peer",
    "check_root",
    "check_rows",
    "check_timeout",
    "check_user_tag",
    "debug_level",
    "env_switch",
    "split_rows",
]

#: The largest tag a point-to-point call may use (Note [wire tags] in plait.group).
MAX_USER_TAG = (1 << 31) - 1
#: Entries a per-communicator cache keeps (plans, auto's choices, accepted ops).
CACHE_LIMIT = 1024
#: dtypes that passed check_dtype (a handful in any program).
_GOOD_DTYPES: set[np.dtype] = set()


def env_switch(env: Mapping[str, str], name: str, default: bool) -> bool:
    """The on/off setting ``name`` of ``env``: ``1``, ``true``, ``yes``, ``on`` or ``0``,
    ``false``, ``no``, ``off`` (any case); ``default`` where unset or empty.

    Raises:
        ValueError: any other value (``PLAIT_BIND=false`` used to bind, as only ``0`` was
            read as off), naming the variable.
    """
    text = env.get(name, "").strip().lower()
    if not text:
        return default
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(
        f"{name}={env[name]!r} is not a switch; expected 0 or 1 (or false/true, no/yes, off/on)"
    )


def as_array(x: Any, what: str, rank: int, c: str) -> np.ndarray:
    """``x`` as a numpy array over the same memory, with a dtype plait can move.

    numpy arrays pass as they are; torch tensors, JAX arrays and other DLPack
    objects go through :func:`plait._arrays.read` (over their memory on the
    CPU, through a host copy from a device), ``bytes`` as its bytes (uint8, as a
    ``bytearray``), and everything else through ``np.asarray``. ``what`` names
    the argument (``"x"``, ``"out"``, ``"buf"``) in messages.
    """
    if type(x) is np.ndarray:
        a = x
    elif isinstance(x, np.ndarray):
        a = _plain(x, what, rank, c)
    elif _tensor.is_tensor(x) or hasattr(x, "__dlpack__"):
        a = _arrays.read(x, f"rank {rank}: {c}: {what}")
    elif isinstance(x, bytes):  # its buffer, as bytearray's: np.asarray makes one string of it
        a = np.frombuffer(x, np.uint8)
    elif x is None:  # np.asarray makes an object array of it: say what was passed
        raise TypeError(
            f"rank {rank}: {c}: {what} is None; expected an array (a numpy array, a tensor, "
            "or anything np.asarray reads as numbers)"
        )
    else:
        try:
            a = np.asarray(x)
        except Exception as exc:
            raise TypeError(
                f"rank {rank}: {c}: {what} must be an array-like; got {type(x).__name__} ({exc})"
            ) from None
        if a.dtype == object and isinstance(x, int):  # numpy's own words named dtype object
            raise TypeError(
                f"rank {rank}: {c}: {what} = {x} does not fit in 64 bits (int64 or uint64); "
                "pass a float, or split it into numbers that fit"
            )
    if a.dtype not in _GOOD_DTYPES:
        try:
            check_dtype(a.dtype)
        except TypeError as exc:
            raise TypeError(f"rank {rank}: {c}: {what}: {exc}") from None
        _GOOD_DTYPES.add(a.dtype)
    return a


def _plain(x: np.ndarray, what: str, rank: int, c: str) -> np.ndarray:
    """A subclass of ndarray as a plain array over the same memory (Note [array subclasses]).

    Note [array subclasses]
    ~~~~~~~~~~~~~~~~~~~~~~~
    A call moves an array's memory, element by element, through flat views of it. A subclass
    may change what reshaping or indexing means (``np.matrix`` stays 2-D under ``reshape(-1)``,
    so a flat view of one was still a matrix, and a one-sided call failed midway on one rank
    while its peer finished), so a call reads every subclass through a plain view of the same
    memory (``x.view(np.ndarray)``), writes an ``out`` or a broadcast's ``x`` through one, and
    returns a new result as a plain array, as ``np.asarray`` would. A masked array is refused:
    its mask is not data a call could move, and summing the masked values silently would be
    wrong.
    """
    if isinstance(x, np.ma.MaskedArray):
        hint = f"pass {what}.data (its values, without the mask)"
        if what == "x":  # where x is only read, a filled copy serves too
            hint += " or, where the call only reads x, x.filled(value) (0 for a sum)"
        raise TypeError(
            f"rank {rank}: {c}: {what} is a masked array; a call moves the values under the "
            f"mask too, so {hint}"
        )
    return x.view(np.ndarray)


def as_writable(x: Any, what: str, rank: int, c: str, *, contents: bool = True) -> np.ndarray:
    """``x`` as an array over its own memory, for an argument the call writes into.

    That is ``out=``, broadcast's ``x`` and recv's ``buf``: a numpy array, a
    torch CPU tensor, a DLPack object, an object with the buffer protocol
    (``bytearray``, ``array.array``, ``memoryview``) or with
    ``__array_interface__``, all of which numpy reads over their own memory.
    Anything else (a list, a tuple, an object with only ``__array__``, which
    may return a copy) would be copied by :func:`as_array`, the result
    written into the copy and the caller's object left as it was, so it is
    refused; so is a JAX array, which JAX never changes in place. Whether the
    memory is writeable is the caller's check (broadcast's root only reads
    its ``x``).

    An array in device memory (a CUDA tensor, a CuPy array) gives a host
    buffer that the call writes and the request copies back into ``x`` once
    the call has succeeded (:class:`plait._arrays.DeviceTarget`);
    ``contents``: whether the call also reads what ``x`` holds (broadcast),
    so that it must be copied to the host first.
    """
    if isinstance(x, np.ndarray):
        return as_array(x, what, rank, c)
    if isinstance(x, np.generic):
        # A numpy scalar shows __array_interface__, but over a copy: nothing written there
        # would reach it.
        raise TypeError(
            f"rank {rank}: {c}: {what} is a numpy scalar ({type(x).__name__}), which cannot "
            f"be changed in place, so the call cannot write into it; "
            f"{_SCALAR_HINT.get(what, _SCALAR_HINT['out'])}"
        )
    if _arrays.immutable(x):
        raise TypeError(
            f"rank {rank}: {c}: {what} is a {_kind(x)}, which cannot be changed in place, so "
            f"the call cannot write into it; {_IMMUTABLE_HINT.get(what, _IMMUTABLE_HINT['out'])}"
        )
    if _arrays.staged(x):
        host = _arrays.host_buffer(x, f"rank {rank}: {c}: {what}", contents)
        return as_array(host, what, rank, c)
    if not (
        _tensor.is_tensor(x)
        or hasattr(x, "__dlpack__")
        or hasattr(x, "__array_interface__")
        or _has_buffer(x)
    ):
        hint = "; pass a numpy array (np.empty(shape, dtype)) or leave out= off" * (what == "out")
        raise TypeError(
            f"rank {rank}: {c}: {what} must be memory the call can write in place: a numpy "
            f"array, a torch CPU tensor or a writeable buffer (bytearray, array.array); got "
            f"{type(x).__name__}, which would be copied and only the copy written{hint}"
        )
    return as_array(x, what, rank, c)


#: What to do instead of writing into a numpy scalar, by the argument's name.
_SCALAR_HINT = {
    "out": "pass a 0-d array (np.empty((), dtype)) or leave out= off",
    "x": "pass a 0-d array (x = np.array(value)) and read x[()] afterwards",
    "buf": "receive into a 0-d array (np.empty((), dtype)) and read buf[()] afterwards",
}


def check_own_memory(a: np.ndarray, what: str, rank: int, c: str) -> None:
    """Raise ValueError where elements of ``a``, which the call writes, share memory.

    A stride of 0 along an axis of more than one element (``np.lib.stride_tricks``,
    torch's ``expand()``) makes every element along it one memory cell, so the call's
    result could not be stored there; torch refuses such outputs too. Other strides can
    make elements overlap as well (``as_strided`` with rows closer than a row's length):
    writing a result there would lose some of its elements (:func:`_overlaps`).
    """
    for axis, (n, stride) in enumerate(zip(a.shape, a.strides, strict=True)):
        if stride == 0 and n > 1:
            raise ValueError(
                f"rank {rank}: {c}: the elements of {what} share memory (a stride of 0 along "
                f"axis {axis}, as np.broadcast_to or torch's expand() make), so the call "
                f"cannot write a result into each; pass an array with memory of its own "
                f"(np.empty(shape, dtype), or .copy() / .clone() of it)"
            )
    if _overlaps(a):
        raise ValueError(
            f"rank {rank}: {c}: the elements of {what} overlap in memory (shape "
            f"{tuple(a.shape)}, strides {tuple(a.strides)}, {a.itemsize}-byte items), so the "
            f"call cannot write a result into each; pass an array with memory of its own "
            f"(np.empty(shape, dtype), or .copy() / .clone() of it)"
        )


def _overlaps(a: np.ndarray) -> bool:
    """Whether two elements of ``a`` share a byte.

    Views made by slicing, transposing or reshaping an array of distinct elements pass a
    test of their strides alone: taken from the smallest, each axis's stride reaches past
    everything the smaller axes span. Only a layout that fails it (made by ``as_strided``)
    has every element's offset computed and compared.
    """
    axes = sorted((abs(s), n) for n, s in zip(a.shape, a.strides, strict=True) if n > 1)
    span = a.itemsize
    for stride, n in axes:
        if stride < span:
            break
        span += stride * (n - 1)
    else:
        return False
    if a.size == 0:
        return False
    offsets = np.zeros((), np.int64)
    for n, stride in zip(a.shape, a.strides, strict=True):
        offsets = np.add.outer(offsets, np.arange(n, dtype=np.int64) * stride)
    ends = np.sort(offsets, axis=None)
    return bool((np.diff(ends) < a.itemsize).any())


#: What to do instead of writing into an immutable array, by the argument's name.
_IMMUTABLE_HINT = {
    "out": "leave out= off and use the array the call returns (a new one of the same type)",
    "x": (
        "pass a numpy copy and convert what comes back: "
        "x = jnp.asarray(comm.broadcast(np.array(x), root))"
    ),
    "buf": "receive into a numpy array (np.empty(shape, dtype)) and convert it afterwards",
}


def _kind(x: Any) -> str:
    """How a message names immutable array ``x``: ``jax.Array`` or its type's name."""
    return "jax.Array" if _arrays.is_jax(x) else type(x).__name__


def _has_buffer(x: Any) -> bool:
    """Whether ``x`` exposes its memory through the buffer protocol."""
    try:
        memoryview(x)
    except TypeError:
        return False
    return True


def check_op(
    op: Any, dtype: np.dtype, rank: int, c: str, accepted: set[tuple[Op, np.dtype]]
) -> None:
    """``op`` is a :class:`plait.Op` that can reduce ``dtype``; remembered in ``accepted``."""
    try:
        if (op, dtype) in accepted:
            return
    except TypeError:  # unhashable: no Op, refused below
        pass
    if not isinstance(op, Op):
        raise TypeError(
            f"rank {rank}: {c}: op must be a plait.Op such as plait.SUM or "
            f"plait.Op(np.logaddexp); got {op!r}"
        )
    try:
        op.check(dtype)
    except TypeError as exc:
        raise TypeError(f"rank {rank}: {c}: {exc}") from None
    if len(accepted) < CACHE_LIMIT:
        accepted.add((op, dtype))


def check_root(root: Any, rank: int, size: int, c: str) -> int:
    """``root`` as a Python int, once checked to name one of the ``size`` ranks.

    A numpy integer (``np.argmax(...)``, an element of an array) is accepted and returned as
    an int: calls go on with the returned value, never the given one. Kept as given, an
    unsigned one made the builders' ``(rank - root) % size`` wrap on ranks below the root
    (those ranks built another call's schedule), and any numpy one made the flight
    recorder's dumps fail, their JSON refusing numpy scalars."""
    if isinstance(root, bool) or not isinstance(root, int | np.integer):
        raise TypeError(f"rank {rank}: {c}: root must be an int; got {root!r}")
    at = int(root)
    if not 0 <= at < size:
        raise ValueError(
            f"rank {rank}: {c}: root {at} is out of range; expected 0 <= root < {size}"
        )
    return at


def check_peer(peer: Any, rank: int, size: int, c: str, what: str) -> None:
    """``peer`` (the argument ``what``: ``"dst"`` or ``"src"``) is a rank, this one included
    (a rank may send to itself, as with ``send``)."""
    if isinstance(peer, bool) or not isinstance(peer, int | np.integer):
        raise TypeError(f"rank {rank}: {c}: {what} must be an int; got {peer!r}")
    if not 0 <= peer < size:
        from plait._p2p_status import ANY_SOURCE, PROC_NULL

        hint = {
            ANY_SOURCE: f"; {c} takes no ANY_SOURCE: probe(plait.ANY_SOURCE, tag) first, and "
            "receive from the source its Status names"
            if what == "src"
            else "; ANY_SOURCE is for receives and probes",
            PROC_NULL: f"; {c} takes no PROC_NULL: skip the call where there is no peer",
        }.get(int(peer), "")
        raise ValueError(
            f"rank {rank}: {c}: {what}={peer} is invalid; expected a rank in 0..{size - 1}{hint}"
        )


def check_user_tag(tag: Any, rank: int, c: str) -> int:
    """A point-to-point ``tag``: an int in 0..MAX_USER_TAG."""
    if isinstance(tag, bool) or not isinstance(tag, int | np.integer):
        raise TypeError(f"rank {rank}: {c}: tag must be an int; got {tag!r}")
    if not 0 <= tag <= MAX_USER_TAG:
        raise ValueError(f"rank {rank}: {c}: tag {tag} out of range 0..{MAX_USER_TAG}")
    return int(tag)


def check_count(k: Any, least: int, what: str, rank: int, c: str) -> int:
    """``k`` (the argument ``what``) as an int of at least ``least``."""
    if isinstance(k, bool) or not isinstance(k, int | np.integer):
        raise TypeError(f"rank {rank}: {c}: {what} must be an int; got {k!r}")
    if k < least:
        raise ValueError(f"rank {rank}: {c}: {what} must be >= {least}; got {k}")
    return int(k)


def split_rows(shape: tuple[int, ...], rank: int, size: int, c: str) -> int:
    """The rows of one rank's block when axis 0 of ``shape`` is cut in ``size`` parts."""
    if not shape or shape[0] % size:
        raise ValueError(
            f"rank {rank}: {c}: axis 0 of x must be a multiple of size {size} "
            f"(size*k rows); got shape {shape}"
        )
    return shape[0] // size


def check_counts(counts: Any, n: int, what: str, rank: int, c: str) -> tuple[int, ...]:
    """``counts`` as a tuple of ``n`` ints >= 0 (row counts of an uneven collective).

    A list, tuple or 1-D integer array; ``what`` names the argument
    (``"counts"``, ``"send_counts"``) in messages.
    """
    if isinstance(counts, np.ndarray):
        if counts.ndim != 1 or counts.dtype.kind not in "iu":
            raise TypeError(
                f"rank {rank}: {c}: {what} must be a 1-D integer array, a list or a tuple; "
                f"got an array of shape {counts.shape} and dtype {counts.dtype}"
            )
        counts = counts.tolist()
    if not isinstance(counts, list | tuple):
        raise TypeError(
            f"rank {rank}: {c}: {what} must be a list or tuple of ints (one per rank); "
            f"got {type(counts).__name__}"
        )
    if len(counts) != n:
        raise ValueError(
            f"rank {rank}: {c}: {what} needs {n} entries, one per rank; got {len(counts)}"
        )
    for k in counts:
        if isinstance(k, bool) or not isinstance(k, int | np.integer):  # as an array of floats
            raise TypeError(
                f"rank {rank}: {c}: {what} must be ints >= 0 (rows per rank); got {list(counts)}"
            )
        if k < 0:
            raise ValueError(
                f"rank {rank}: {c}: {what} must be ints >= 0 (rows per rank); got {list(counts)}"
            )
    return tuple(int(k) for k in counts)


def check_rows(shape: tuple[int, ...], rows: int, what: str, rank: int, c: str) -> None:
    """Axis 0 of ``shape`` (``what``'s rows, as the counts say) has ``rows`` entries."""
    if not shape:
        raise ValueError(
            f"rank {rank}: {c}: x must have at least one dimension (the counts count its rows)"
        )
    if shape[0] != rows:
        raise ValueError(
            f"rank {rank}: {c}: x has {shape[0]} rows (shape {shape}) but {what} says {rows}"
        )


def check_out(
    out: Any, shape: tuple[int, ...], dtype: np.dtype, rank: int, c: str
) -> np.ndarray | None:
    """``out`` as a writeable array of ``shape`` and ``dtype``, or None when not given.

    ``out`` must be memory the call can write in place (:func:`as_writable`;
    for an array in device memory, a host buffer that is copied back).
    Its byte order may differ from ``dtype``'s: the call computes in native
    byte order and converts on the way in and out (see
    :class:`plait._request.Stager`).
    """
    if out is None:
        return None
    o = out if type(out) is np.ndarray else as_writable(out, "out", rank, c, contents=False)
    if o.dtype != dtype and o.dtype.newbyteorder("=") != dtype.newbyteorder("="):
        raise TypeError(f"rank {rank}: {c}: out has dtype {o.dtype}; expected {dtype}")
    if o.shape != tuple(shape):
        raise ValueError(
            f"rank {rank}: {c}: out has shape {tuple(o.shape)}; expected {tuple(shape)}"
        )
    if not o.flags.writeable:
        raise ValueError(f"rank {rank}: {c}: out is read-only")
    if not o.flags.c_contiguous:
        check_own_memory(o, "out", rank, c)
    return o


def check_async(async_op: Any, where: str) -> bool:
    """``async_op`` as a bool (numpy's bools too); anything else is a TypeError, so that a
    string or a number is never taken for a choice it does not spell."""
    if isinstance(async_op, bool | np.bool_):
        return bool(async_op)
    raise TypeError(f"{where}: async_op must be True or False; got {async_op!r}")


def debug_level() -> str:
    """PLAIT_DEBUG's level: ``info``, ``detail``, or ``""`` where it is unset, 0 or off.

    Raises:
        ValueError: PLAIT_DEBUG names no level (a typo must not pass unseen).
    """
    debug = os.environ.get("PLAIT_DEBUG", "").strip().lower()
    if debug not in ("", "0", "off", "info", "detail"):
        raise ValueError(
            f"PLAIT_DEBUG={os.environ['PLAIT_DEBUG']!r} is not a level; expected info or "
            "detail (or 0, off, unset: neither)"
        )
    return debug if debug in ("info", "detail") else ""
