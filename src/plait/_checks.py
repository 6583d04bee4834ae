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

from typing import Any

import numpy as np

from plait import _tensor
from plait.ops import Op, check_dtype

__all__ = [
    "CACHE_LIMIT",
    "MAX_USER_TAG",
    "as_array",
    "check_op",
    "check_out",
    "check_peer",
    "check_root",
    "check_timeout",
    "check_user_tag",
    "split_rows",
]

#: The largest tag a point-to-point call may use (Note [wire tags] in plait.group).
MAX_USER_TAG = (1 << 31) - 1
#: Entries a per-communicator cache keeps (plans, auto's choices, accepted ops).
CACHE_LIMIT = 1024
#: dtypes that passed check_dtype (a handful in any program).
_GOOD_DTYPES: set[np.dtype] = set()


def as_array(x: Any, what: str, rank: int, c: str) -> np.ndarray:
    """``x`` as a numpy array over the same memory, with a dtype plait can move.

    numpy arrays pass as they are; torch tensors go through
    :func:`plait._tensor.as_array`, DLPack objects through ``np.from_dlpack``
    and everything else through ``np.asarray``. ``what`` names the argument
    (``"x"``, ``"out"``, ``"buf"``) in messages.
    """
    if isinstance(x, np.ndarray):
        a = x
    elif _tensor.is_tensor(x):
        a = _tensor.as_array(x, f"rank {rank}: {c}: {what}")
    elif hasattr(x, "__dlpack__"):
        try:
            a = np.from_dlpack(x)
        except (TypeError, RuntimeError, BufferError, ValueError) as exc:
            raise TypeError(
                f"rank {rank}: {c}: cannot read {what} ({type(x).__name__}) without "
                f"a copy: {exc}; pass an array in CPU memory, such as a numpy array"
            ) from None
    else:
        try:
            a = np.asarray(x)
        except Exception as exc:
            raise TypeError(
                f"rank {rank}: {c}: {what} must be an array-like; got {type(x).__name__} ({exc})"
            ) from None
    if a.dtype not in _GOOD_DTYPES:
        try:
            check_dtype(a.dtype)
        except TypeError as exc:
            raise TypeError(f"rank {rank}: {c}: {what}: {exc}") from None
        _GOOD_DTYPES.add(a.dtype)
    return a


def check_op(
    op: Any, dtype: np.dtype, rank: int, c: str, accepted: set[tuple[Op, np.dtype]]
) -> None:
    """``op`` is a :class:`plait.Op` that can reduce ``dtype``; remembered in ``accepted``."""
    if (op, dtype) in accepted:
        return
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


def check_root(root: Any, rank: int, size: int, c: str) -> None:
    """``root`` is an int naming one of the ``size`` ranks."""
    if isinstance(root, bool) or not isinstance(root, int | np.integer):
        raise TypeError(f"rank {rank}: {c}: root must be an int; got {root!r}")
    if not 0 <= root < size:
        raise ValueError(
            f"rank {rank}: {c}: root {root} is out of range; expected 0 <= root < {size}"
        )


def check_peer(peer: Any, rank: int, size: int, c: str, what: str) -> None:
    """``peer`` (the argument ``what``: ``"dst"`` or ``"src"``) is another rank."""
    if isinstance(peer, bool) or not isinstance(peer, int | np.integer):
        raise TypeError(f"rank {rank}: {c}: {what} must be an int; got {peer!r}")
    if not 0 <= peer < size or peer == rank:
        raise ValueError(
            f"rank {rank}: {c}: {what}={peer} is invalid; expected another rank in 0..{size - 1}"
        )


def check_user_tag(tag: Any, rank: int, c: str) -> int:
    """A point-to-point ``tag``: an int in 0..MAX_USER_TAG."""
    if isinstance(tag, bool) or not isinstance(tag, int | np.integer):
        raise TypeError(f"rank {rank}: {c}: tag must be an int; got {tag!r}")
    if not 0 <= tag <= MAX_USER_TAG:
        raise ValueError(f"rank {rank}: {c}: tag {tag} out of range 0..{MAX_USER_TAG}")
    return int(tag)


def split_rows(shape: tuple[int, ...], rank: int, size: int, c: str) -> int:
    """The rows of one rank's block when axis 0 of ``shape`` is cut in ``size`` parts."""
    if not shape or shape[0] % size:
        raise ValueError(
            f"rank {rank}: {c}: axis 0 of x must be a multiple of size {size} "
            f"(size*k rows); got shape {shape}"
        )
    return shape[0] // size


def check_out(
    out: Any, shape: tuple[int, ...], dtype: np.dtype, rank: int, c: str
) -> np.ndarray | None:
    """``out`` as a writeable array of ``shape`` and ``dtype``, or None when not given."""
    if out is None:
        return None
    o = out if isinstance(out, np.ndarray) else as_array(out, "out", rank, c)
    if o.dtype != dtype:
        raise TypeError(f"rank {rank}: {c}: out has dtype {o.dtype}; expected {dtype}")
    if tuple(o.shape) != tuple(shape):
        raise ValueError(
            f"rank {rank}: {c}: out has shape {tuple(o.shape)}; expected {tuple(shape)}"
        )
    if not o.flags.writeable:
        raise ValueError(f"rank {rank}: {c}: out is read-only")
    return o


def check_timeout(timeout: Any, where: str) -> float:
    """``timeout`` as positive float seconds; ``where`` prefixes the message."""
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise TypeError(f"{where}: timeout must be a number of seconds; got {timeout!r}")
    if not timeout > 0:
        raise ValueError(f"{where}: timeout must be positive; got {timeout}")
    return float(timeout)
