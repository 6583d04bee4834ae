"""Scratch memory and numpy's float warnings: what every call needs around its schedule.

The call runner carves a call's ``TMP`` and staging memory out of a per-thread
:class:`Workspace`, and silences numpy's float warnings for the reduction with
:func:`quiet` and :func:`restore`.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["PerThread", "Workspace", "empty_of", "quiet", "restore"]


# Note [quiet reductions]
#     numpy warns (an error under -W error) when a float reduction overflows or meets
#     an invalid value; a collective silences that, as MPI does. ``np.errstate``
#     costs about a microsecond per call, most of it building its settings: numpy 2
#     keeps them in a context variable, so we build the "ignore" settings once and
#     set and reset the variable (about 0.1 µs). Where numpy lacks those internals,
#     np.errstate does it.
try:
    from numpy._core._ufunc_config import (  # type: ignore[attr-defined]
        _extobj_contextvar,
        _make_extobj,
    )

    _IGNORE = _make_extobj(all="ignore")

    # Both run on every call that reduces floats: C calls, without a Python frame each.
    #: Silence numpy's float warnings until :func:`restore` (Note [quiet reductions]).
    quiet: Callable[[], Any] = functools.partial(_extobj_contextvar.set, _IGNORE)
    #: Undo :func:`quiet`.
    restore: Callable[[Any], None] = _extobj_contextvar.reset

except (ImportError, AttributeError, TypeError):  # pragma: no cover - other numpy versions

    def quiet() -> Any:
        """Silence numpy's float warnings until :func:`restore` (Note [quiet reductions])."""
        state = np.errstate(all="ignore")
        state.__enter__()
        return state

    def restore(token: Any) -> None:
        """Undo :func:`quiet`."""
        token.__exit__(None, None, None)


_EMPTY: dict[np.dtype, np.ndarray] = {}  # zero-length arrays, one per dtype


def empty_of(dtype: np.dtype) -> np.ndarray:
    """A zero-length array of ``dtype``, one per dtype (never written: it has no elements)."""
    empty = _EMPTY.get(dtype)
    if empty is None:
        empty = _EMPTY[dtype] = np.empty(0, dtype)
    return empty


class Workspace:
    """Scratch memory reused from call to call, so a hot loop allocates nothing.

    One per thread that runs calls: the executor carves ``TMP`` and the staging
    area of ``RECV_REDUCE`` out of it. It grows to the largest call seen.
    """

    __slots__ = ("_last", "_raw")

    def __init__(self) -> None:
        self._raw = np.empty(0, np.uint8)
        # The last carve of :meth:`pair`: its key and its two arrays (a loop repeats it).
        self._last: tuple[object, np.ndarray, np.ndarray] | None = None

    def pair(self, tmp: int, staged: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
        """``TMP`` (``tmp`` elements) and the staging area after it (``staged``), of ``dtype``.

        The same arrays as the call before when it asked for the same, so a loop
        of equal calls carves nothing (growing replaces the memory, and the cache).
        """
        key = (tmp, staged, dtype)
        last = self._last
        if last is not None and last[0] == key:
            return last[1], last[2]
        size = self._raw.size
        a = self.take(tmp, dtype)
        b = self.take(staged, dtype, tmp)
        if self._raw.size != size:  # grew: the first array is in the old memory
            a = self.take(tmp, dtype)
        self._last = (key, a, b)
        return a, b

    def take(self, count: int, dtype: np.dtype, offset: int = 0) -> np.ndarray:
        """``count`` elements of ``dtype`` starting ``offset`` elements in (grows if needed)."""
        if not count:
            return empty_of(dtype)
        itemsize = dtype.itemsize
        need = (offset + count) * itemsize
        if self._raw.size < need:
            self._raw = np.empty(max(need, 2 * self._raw.size), np.uint8)
        return self._raw[offset * itemsize : need].view(dtype)


class PerThread(threading.local):
    """What a call runner keeps per thread; the class attributes are each thread's defaults
    (a missing attribute of a plain ``threading.local`` costs an exception per lookup)."""

    #: The scratch memory of the calls this thread runs (made by its first call).
    ws: Workspace | None = None
    #: The numbers reserved for the calls of a compressed async allreduce (submit_reserved).
    pinned: list[int] | None = None
    #: A blocking compressed allreduce runs its compressor's calls (CallRunner.compressing).
    compressing: bool = False
