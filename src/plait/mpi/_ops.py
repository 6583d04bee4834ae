"""MPI's reduction ops for plait.mpi: on Python objects as mpi4py defines them, and on buffers.

An :class:`Op` carries three things: the function mpi4py applies to two Python objects in
the lowercase ``reduce``/``allreduce`` (``x + y`` for SUM, ``max`` by ``>`` for MAX, the
(value, index) rule for MAXLOC: mpi4py's definitions, so results compare equal), the
:class:`plait.Op` that runs a buffer reduction on plait's collectives (SUM, MIN, ... and
the logical ops as ufuncs), and, for MAXLOC and MINLOC, which plait's collectives cannot
reduce (their elements are structs), :func:`combine_pairs`, applied in rank order to the
gathered pairs.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import numpy as np

from plait import ops as plait_ops
from plait.mpi._unsupported import Unlisted, lacking

__all__ = ["OPS", "Op", "as_function", "combine_pairs", "fields"]


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
