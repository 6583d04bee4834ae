"""MPI's reduction ops for plait.mpi: on Python objects as mpi4py defines them, and on buffers.

An :class:`Op` carries three things: the function mpi4py applies to two Python objects in
the lowercase ``reduce``/``allreduce`` (``x + y`` for SUM, ``max`` by ``>`` for MAX, the
(value, index) rule for MAXLOC: mpi4py's definitions, so results compare equal), the
:class:`plait.Op` that runs a buffer reduction on plait's collectives (SUM, MIN, ... and
the logical ops as ufuncs), and, for MAXLOC and MINLOC, which plait's collectives cannot
reduce (their elements are structs), :func:`combine_pairs`, applied in rank order to the
gathered pairs. :func:`check_op` refuses an op on a datatype it is not defined for, as
Open MPI does (Note [ops and datatypes]).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import numpy as np

from plait import ops as plait_ops
from plait.mpi._errors import mpi_error
from plait.mpi._unsupported import Unlisted, lacking

__all__ = ["OPS", "Op", "as_function", "check_op", "combine_pairs", "fields"]


def _max(x: Any, y: Any) -> Any:
    return y if y > x else x


def _min(x: Any, y: Any) -> Any:
    return y if y < x else x


def _land(x: Any, y: Any) -> bool:
    return bool(x) and bool(y)  # a bool, as mpi4py's: not an operand (0 and 3 gave 0)


def _lor(x: Any, y: Any) -> bool:
    return bool(x) or bool(y)


def _lxor(x: Any, y: Any) -> bool:
    return bool(x) != bool(y)


def _maxloc(x: Any, y: Any) -> Any:
    (u, i), (v, j) = x, y
    if u > v:
        return u, i
    if v > u:
        return v, j
    return (v, j) if j < i else (u, i)


def _minloc(x: Any, y: Any) -> Any:
    (u, i), (v, j) = x, y
    if u < v:
        return u, i
    if v < u:
        return v, j
    return (v, j) if j < i else (u, i)


class Op(metaclass=Unlisted):
    """An MPI reduction op; calling it on two objects combines them as mpi4py does.

    Attributes:
        name: MPI's name without the prefix (``SUM``, ``MAXLOC``).
        function: the object rule of the lowercase methods.
        plait_op: what a buffer reduction runs on plait's collectives; None for MAXLOC
            and MINLOC, which reduce gathered pairs instead (:func:`combine_pairs`).
        loc: "max" or "min" for MAXLOC and MINLOC, else None.
    """

    __slots__ = ("function", "loc", "name", "plait_op")
    __getattr__ = lacking  # an mpi4py name it lacks: Unsupported, naming it

    def __init__(
        self,
        name: str,
        function: Callable[[Any, Any], Any],
        plait_op: plait_ops.Op | None,
        loc: str | None = None,
    ) -> None:
        self.name = name
        self.function = function
        self.plait_op = plait_op
        self.loc = loc

    def __call__(self, x: Any, y: Any) -> Any:
        """``x`` combined with ``y`` (mpi4py's ``op(x, y)``)."""
        return self.function(x, y)

    def Is_commutative(self) -> bool:
        """Every predefined op is commutative."""
        return True

    @property
    def is_commutative(self) -> bool:
        """Every predefined op is commutative."""
        return True

    @property
    def is_predefined(self) -> bool:
        """Every op of plait.mpi is one of MPI's predefined ones."""
        return True

    def __repr__(self) -> str:
        return f"<plait.mpi.Op {self.name}>"


def _ufunc_op(ufunc: Any, name: str) -> plait_ops.Op:
    return plait_ops.Op(ufunc, commutative=True, name=name)


#: The predefined ops, by name.
OPS: dict[str, Op] = {
    "SUM": Op("SUM", operator.add, plait_ops.SUM),
    "PROD": Op("PROD", operator.mul, plait_ops.PROD),
    "MAX": Op("MAX", _max, plait_ops.MAX),
    "MIN": Op("MIN", _min, plait_ops.MIN),
    "LAND": Op("LAND", _land, _ufunc_op(np.logical_and, "LAND")),
    "LOR": Op("LOR", _lor, _ufunc_op(np.logical_or, "LOR")),
    "LXOR": Op("LXOR", _lxor, _ufunc_op(np.logical_xor, "LXOR")),
    "BAND": Op("BAND", operator.and_, plait_ops.BAND),
    "BOR": Op("BOR", operator.or_, plait_ops.BOR),
    "BXOR": Op("BXOR", operator.xor, plait_ops.BXOR),
    "MAXLOC": Op("MAXLOC", _maxloc, None, "max"),
    "MINLOC": Op("MINLOC", _minloc, None, "min"),
}


_MIN_MAX = ("MIN", "MAX")
_SUM_PROD = ("SUM", "PROD")
_LOGICAL = ("LAND", "LOR", "LXOR")
_BITWISE = ("BAND", "BOR", "BXOR")

#: What each kind of datatype may be reduced with, and the datatypes of each kind, as Open
#: MPI defines them (Note [ops and datatypes]).
_KINDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "C integer": (
        _MIN_MAX + _SUM_PROD + _LOGICAL + _BITWISE,
        (
            *("BYTE", "CHAR", "SIGNED_CHAR", "UNSIGNED_CHAR", "SHORT", "UNSIGNED_SHORT"),
            *("INT", "UNSIGNED", "LONG", "UNSIGNED_LONG", "LONG_LONG", "UNSIGNED_LONG_LONG"),
            *("INT8_T", "INT16_T", "INT32_T", "INT64_T", "UINT8_T", "UINT16_T", "UINT32_T"),
            *("UINT64_T", "AINT", "OFFSET", "COUNT"),
        ),
    ),
    "Fortran integer": (_MIN_MAX + _SUM_PROD + _BITWISE, ("INTEGER",)),
    "floating point": (
        _MIN_MAX + _SUM_PROD,
        ("FLOAT", "DOUBLE", "LONG_DOUBLE", "REAL", "DOUBLE_PRECISION"),
    ),
    "logical": (_LOGICAL, ("C_BOOL",)),
    "complex": (
        _SUM_PROD,
        (
            *("C_COMPLEX", "C_DOUBLE_COMPLEX", "C_LONG_DOUBLE_COMPLEX"),
            *("COMPLEX", "DOUBLE_COMPLEX"),
        ),
    ),
    "pair": (
        ("MAXLOC", "MINLOC"),
        ("FLOAT_INT", "DOUBLE_INT", "LONG_INT", "TWOINT", "SHORT_INT", "LONG_DOUBLE_INT"),
    ),
}
#: The kinds whose plain arrays MAXLOC and MINLOC read as (value, index) rows.
_ROWS_OF_PAIRS = ("C integer", "Fortran integer", "floating point")
#: The kind of each datatype, by its name.
KIND_OF: dict[str, str] = {name: kind for kind, (_, names) in _KINDS.items() for name in names}


def check_op(op: Op, datatype: Any, call: str) -> None:
    """Refuse ``op`` on ``datatype`` (a :class:`plait.mpi.Datatype`) where Open MPI does:
    ``MPI.Exception`` of class ``ERR_OP`` with MPI's words, the call, op and datatype in
    a note.

    Note [ops and datatypes]
        MPI defines each predefined op on some kinds of datatype only (MPI-4.0 §6.9.2):
        MIN and MAX on C integers, Fortran integers and floating point; SUM and PROD on
        those and complex; LAND, LOR and LXOR on C integers and logical; BAND, BOR and
        BXOR on C integers, Fortran integers and bytes; MAXLOC and MINLOC on the pairs.
        Open MPI refuses any other pair before anything moves, on every rank, with
        MPI_ERR_OP ("invalid reduce operation"), for a count of 0 too, and so does
        plait.mpi, whose reductions would run numpy's ufunc on anything it takes (LAND of
        doubles, SUM of bools) or raise a TypeError that ``except MPI.Exception``
        misses. Open MPI reads ``BYTE`` and ``CHAR`` as C integers (unsigned and signed
        bytes: every op but the pairs' on them), and ``AINT``, ``OFFSET`` and ``COUNT``
        too; ``KIND_OF`` is that, each row checked against mpi4py on Open MPI. A
        datatype of a dtype MPI has none for (float16, a struct) is not checked: plait's
        reductions say what they make of it. MAXLOC and MINLOC take the pairs, and, as
        plait.mpi's own reading (mpi4py refuses it), a plain array of (value, index)
        rows of an integer or floating-point datatype.
    """
    kind = KIND_OF.get(getattr(datatype, "name", ""))
    if kind is None or op.name in _KINDS[kind][0]:
        return
    if op.loc is not None and kind in _ROWS_OF_PAIRS:
        return
    takes = [k for k, (ops, _) in _KINDS.items() if op.name in ops]
    err = mpi_error("ERR_OP", "MPI_ERR_OP: invalid reduce operation")
    err.add_note(
        f"{call}: MPI.{op.name} is not defined on {datatype.name}, a {kind} datatype; it "
        f"takes {', '.join(takes)} datatypes (MPI's rules for the predefined ops)"
    )
    raise err


def as_function(op: Any, call: str) -> Callable[[Any, Any], Any]:
    """The object rule of ``op``: an :class:`Op`, or any function of two objects (as mpi4py)."""
    if isinstance(op, Op):
        return op.function
    if callable(op):
        return op  # type: ignore[no-any-return]
    raise TypeError(f"{call}: op must be an MPI op (MPI.SUM, ...) or a function; got {op!r}")


def fields(a: np.ndarray, call: str) -> tuple[np.ndarray, np.ndarray]:
    """The values and the indices of pairs: two fields of a structured array, or a last axis
    of length 2 (value, index) of a plain one."""
    if a.dtype.names is not None:
        if len(a.dtype.names) != 2:
            raise TypeError(f"{call}: MAXLOC/MINLOC pairs need 2 fields, not {a.dtype.names}")
        return a[a.dtype.names[0]], a[a.dtype.names[1]]
    if a.ndim >= 1 and a.shape[-1] == 2:
        return a[..., 0], a[..., 1]
    raise TypeError(
        f"{call}: MAXLOC and MINLOC reduce (value, index) pairs: a structured array of two "
        f"fields with a pair datatype (MPI.DOUBLE_INT, MPI.TWOINT, ...) or an array whose "
        f"last axis has length 2; got dtype {a.dtype}, shape {a.shape}"
    )


def combine_pairs(blocks: list[np.ndarray], loc: str, out: np.ndarray, call: str) -> None:
    """MAXLOC or MINLOC of ``blocks`` (one per rank, in rank order) into ``out``, elementwise.

    The larger (MAXLOC) or smaller value wins; on equal values the smaller index, as MPI
    defines them.
    """
    acc = blocks[0].copy()
    av, ai = fields(acc, call)
    for b in blocks[1:]:
        bv, bi = fields(b, call)
        better = bv > av if loc == "max" else bv < av
        take = better | ((bv == av) & (bi < ai))
        av[take] = bv[take]
        ai[take] = bi[take]
    out[...] = acc
