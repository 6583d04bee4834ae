"""Tensors and reduce ops as plait takes them: the checks at the torch edge.

A CPU tensor is handed to plait as a numpy array that shares its memory
(``tensor.detach().numpy()``), so results land in the tensor without a copy.
Everything plait cannot serve is refused here, before any byte moves, with an
error that names the call, the argument and what is wrong with it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

import plait
from plait._tensor import as_array
from plait.errors import UnsupportedError

__all__ = ["OPS", "array", "check_one", "output_array", "plait_op", "reshaped_out", "seconds"]

_T = TypeVar("_T")

# torch's stub declares RedOpType as an enum without members (SUM, ... exist at run time)
_RedOp: Any = dist.ReduceOp.RedOpType

#: torch's reduce ops and the plait op each one runs as.
OPS: dict[Any, plait.Op] = {
    _RedOp.SUM: plait.SUM,
    _RedOp.PRODUCT: plait.PROD,
    _RedOp.MIN: plait.MIN,
    _RedOp.MAX: plait.MAX,
    _RedOp.BAND: plait.BAND,
    _RedOp.BOR: plait.BOR,
    _RedOp.BXOR: plait.BXOR,
    _RedOp.AVG: plait.AVG,
}


def plait_op(op: Any, call: str) -> plait.Op:
    """The plait op for torch's ``ReduceOp`` (an options object's ``reduceOp``).

    Raises:
        UnsupportedError: PREMUL_SUM (an NCCL-only op) or anything else plait lacks.
    """
    kind = getattr(op, "op", op)
    try:
        return OPS[kind]
    except (KeyError, TypeError):
        pass
    name = getattr(kind, "name", repr(kind))
    raise UnsupportedError(
        f"{call}: the plait backend has no reduce op {name}; it supports "
        + ", ".join(k.name for k in OPS)
    )


def check_one(tensors: Sequence[_T], call: str, what: str = "tensors") -> _T:
    """The single tensor of a per-process tensor list (plait runs one tensor per process)."""
    if len(tensors) != 1:
        raise UnsupportedError(
            f"{call}: the plait backend takes exactly one tensor per process; got "
            f"{len(tensors)} in {what}"
        )
    return tensors[0]


def array(t: Any, call: str, what: str) -> np.ndarray:
    """A numpy array sharing ``t``'s memory (no copy), after checking plait can serve it.

    Raises:
        TypeError: not a tensor, or a dtype plait cannot move.
        UnsupportedError: a tensor off the CPU, or sparse, quantized or conjugated.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{call}: {what} must be a torch.Tensor; got {type(t).__name__}")
    return as_array(t, f"{call}: {what}", refuse=UnsupportedError)


def output_array(t: Any, call: str, what: str) -> np.ndarray:
    """Like :func:`array`, for a tensor plait writes into: it must not overlap itself."""
    a = array(t, call, what)
    if any(step == 0 and n > 1 for step, n in zip(a.strides, a.shape, strict=True)):
        raise UnsupportedError(
            f"{call}: {what} has overlapping memory (stride 0, as from expand()); results "
            "cannot be written into it: pass a tensor with its own memory (.clone())"
        )
    return a


def reshaped_out(a: np.ndarray, shape: tuple[int, ...]) -> tuple[np.ndarray, Callable[[], None]]:
    """An array of ``shape`` for plait to write into that ends up in ``a``.

    A contiguous ``a`` is reshaped in place (a view: plait writes straight into
    it) and a strided one of the right shape is passed as is (plait stages it);
    otherwise plait writes into a scratch array that the returned function
    copies into ``a`` once the call has succeeded.
    """
    if a.shape == shape or a.flags.c_contiguous:
        return a.reshape(shape), _nothing
    scratch = np.empty(shape, a.dtype)

    def copy_back() -> None:
        a[...] = scratch.reshape(a.shape)

    return scratch, copy_back


def _nothing() -> None:
    return None


def seconds(timeout: Any) -> float | None:
    """A torch timeout (a timedelta; zero or negative means unset) in seconds, or None."""
    if timeout is None:
        return None
    total = timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout)
    return total if total > 0 else None
