"""The envelope of a point-to-point message: :class:`Status`, the wildcards, the check word.

Who sent a message, with which tag, how large it is and of which dtype, as
``recv``, ``probe`` and a :class:`plait._p2p_request.Request` report it; the
constants ``ANY_SOURCE``, ``ANY_TAG`` and ``PROC_NULL``; and the check word that
names a message's dtype on the wire (Note [p2p on the wire] in :mod:`plait._p2p`).
"""

from __future__ import annotations

import zlib
from typing import Any, Final

import numpy as np

from plait._checks import CACHE_LIMIT

__all__ = ["ANY_SOURCE", "ANY_TAG", "PROC_NULL", "Status", "check_word"]

#: ``src`` of a receive or probe that takes a message from any rank (MPI_ANY_SOURCE).
ANY_SOURCE: Final = -1
#: ``tag`` of a receive or probe that takes a message with any tag (MPI_ANY_TAG).
ANY_TAG: Final = -1
#: A peer that is no rank: a send to it or a receive from it completes at once, moving
#: nothing (MPI_PROC_NULL), for the edges of a non-periodic shift.
PROC_NULL: Final = -2


def check_word(dtype: np.dtype) -> int:
    """The check word of a point-to-point message: its dtype (the lengths are checked apart)."""
    word = _CHECK_WORDS.get(dtype)
    if word is None:
        word = zlib.crc32(f"p2p|{dtype.name}".encode())
        if len(_CHECK_WORDS) < CACHE_LIMIT:
            _CHECK_WORDS[dtype] = word
    return word


#: check_word's answers so far, by dtype (``dtype.name`` is slow to compute).
_CHECK_WORDS: dict[np.dtype, int] = {}


_BY_CHECK: dict[int, np.dtype] = {}


def _dtype_of(check: int) -> np.dtype | None:
    """The dtype whose check word is ``check``, among numpy's numeric ones; None if other."""
    if not _BY_CHECK:
        for code in np.typecodes["All"]:
            try:
                dt = np.dtype(code)
            except TypeError:
                continue
            if dt.kind not in "OSUVMm":
                _BY_CHECK[check_word(dt)] = dt
    return _BY_CHECK.get(check)


class Status:
    """Who sent a message, with which tag, and how large it is.

    Filled by ``recv``, ``probe``, ``iprobe``, ``sendrecv`` and a request's
    ``wait``/``test`` when passed as ``status=`` (mpi4py's way), and kept by
    every request as :attr:`Request.status`. Before it is filled: source
    ``ANY_SOURCE``, tag ``ANY_TAG``, no bytes.

    Attributes:
        source: the sender's rank in the communicator (``PROC_NULL`` for a
            receive from ``PROC_NULL``; for a send's request, this rank).
        tag: the message's tag (``ANY_TAG`` for ``PROC_NULL``).
        nbytes: the payload's size in bytes.
        dtype: the dtype of its elements: the receive's (the sender's is the
            same, or the receive fails); for a probe, the sender's, when it is
            one of numpy's numeric dtypes (else None).
        cancelled: whether the request was cancelled before it matched.
    """

    __slots__ = ("cancelled", "dtype", "nbytes", "source", "tag")

    def __init__(self) -> None:
        self.source: int = ANY_SOURCE
        self.tag: int = ANY_TAG
        self.nbytes = 0
        self.dtype: np.dtype | None = None
        self.cancelled = False

    @property
    def count(self) -> int | None:
        """Number of elements of :attr:`dtype` in the message; None if the dtype is unknown."""
        if self.dtype is None:
            return 0 if self.nbytes == 0 else None
        return self.nbytes // self.dtype.itemsize

    def get_count(self, dtype: Any = None) -> int:
        """Number of elements of ``dtype`` (default :attr:`dtype`) in the message.

        Raises:
            ValueError: the message's dtype is unknown and none was given, or the
                message is not a whole number of ``dtype`` elements.
        """
        dt = self.dtype if dtype is None else np.dtype(dtype)
        if dt is None:
            if self.nbytes == 0:
                return 0
            raise ValueError(
                f"the message's dtype is not a numpy numeric one; pass get_count(dtype) "
                f"({self.nbytes} bytes)"
            )
        if dt.itemsize == 0 or self.nbytes % dt.itemsize:
            raise ValueError(
                f"a message of {self.nbytes} bytes is not a whole number of {dt.name} elements"
            )
        return self.nbytes // dt.itemsize

    def _set(
        self, source: int, tag: int, nbytes: int, dtype: np.dtype | None, cancelled: bool = False
    ) -> None:
        self.source, self.tag, self.nbytes, self.dtype = source, tag, nbytes, dtype
        self.cancelled = cancelled

    def _copy_to(self, other: Status | None) -> None:
        if other is not None:
            other._set(self.source, self.tag, self.nbytes, self.dtype, self.cancelled)

    def __repr__(self) -> str:
        dtype = self.dtype.name if self.dtype is not None else None
        extra = ", cancelled" if self.cancelled else ""
        return (
            f"<plait.Status source={self.source} tag={self.tag} count={self.count} "
            f"dtype={dtype} nbytes={self.nbytes}{extra}>"
        )
