"""``MPI.Exception`` and MPI's error classes, for scripts that catch what mpi4py raises.

Note [MPI's errors]
    mpi4py raises ``MPI.Exception`` (a RuntimeError) with MPI's error class where the MPI
    library refuses a call: a rank, tag or root out of range (``MPI_ERR_RANK``,
    ``MPI_ERR_TAG``, ``MPI_ERR_ROOT``), a message longer than its buffer
    (``MPI_ERR_TRUNCATE``), a null communicator (``MPI_ERR_COMM``), another bad argument
    (``MPI_ERR_ARG``). plait finds these before anything is sent and raises ValueError, as
    its own API does; plait.mpi raises them as an :class:`MPIValueError`, which is both, so
    ``except MPI.Exception`` (with ``Get_error_class()``) and ``except ValueError`` both
    catch them. The checks of plait's communicator say which argument was wrong in words;
    :func:`translated` reads the argument from those words (a test keeps the two in step).
    An Irecv that a longer message fails raises :class:`TruncatedError`, which is also
    the MismatchError plait's own receive raises there. Errors mpi4py raises as
    TypeError or ValueError itself (a buffer specification it cannot read, counts that
    disagree) stay what they are; a buffer it raises BufferError for (strided, or read-only
    or a numpy scalar where the call writes) is an :class:`MPIBufferError`, a BufferError and
    a ValueError.
    The error classes have Open MPI's numbers, which mpi4py on Open MPI reports.
"""

from __future__ import annotations

import builtins
import functools
import re
from collections.abc import Callable
from typing import Any, TypeVar

from plait.errors import MismatchError

__all__ = [
    "ERRORS",
    "Exception",
    "Get_error_class",
    "Get_error_string",
    "MPIBufferError",
    "MPIValueError",
    "TruncatedError",
    "mpi_error",
    "raising_mpi_errors",
    "translated",
]

#: MPI's error classes (Open MPI's numbers) and the words MPI gives each.
ERRORS: dict[str, tuple[int, str]] = {
    "SUCCESS": (0, "MPI_SUCCESS: no errors"),
    "ERR_BUFFER": (1, "MPI_ERR_BUFFER: invalid buffer pointer"),
    "ERR_COUNT": (2, "MPI_ERR_COUNT: invalid count argument"),
    "ERR_TYPE": (3, "MPI_ERR_TYPE: invalid datatype"),
    "ERR_TAG": (4, "MPI_ERR_TAG: invalid tag"),
    "ERR_COMM": (5, "MPI_ERR_COMM: invalid communicator"),
    "ERR_RANK": (6, "MPI_ERR_RANK: invalid rank"),
    "ERR_REQUEST": (7, "MPI_ERR_REQUEST: invalid request"),
    "ERR_ROOT": (8, "MPI_ERR_ROOT: invalid root"),
    "ERR_GROUP": (9, "MPI_ERR_GROUP: invalid group"),
    "ERR_OP": (10, "MPI_ERR_OP: invalid reduce operation"),
    "ERR_ARG": (13, "MPI_ERR_ARG: invalid argument of some other kind"),
    "ERR_UNKNOWN": (14, "MPI_ERR_UNKNOWN: unknown error"),
    "ERR_TRUNCATE": (15, "MPI_ERR_TRUNCATE: message truncated"),
    "ERR_OTHER": (16, "MPI_ERR_OTHER: known error not in list"),
    "ERR_INTERN": (17, "MPI_ERR_INTERN: internal error"),
    "ERR_LASTCODE": (92, "MPI_ERR_LASTCODE: last error code"),
}
_STRINGS = {code: words for code, words in ERRORS.values()}


def Get_error_string(errorcode: int) -> str:
    """MPI's words for ``errorcode`` (``MPI_ERR_TAG: invalid tag``)."""
    return _STRINGS.get(int(errorcode), f"MPI_ERR_UNKNOWN: unknown error code {int(errorcode)}")


def Get_error_class(errorcode: int) -> int:
    """The error class of ``errorcode``: every code plait gives is its own class."""
    return int(errorcode)


class Exception(builtins.RuntimeError):
    """mpi4py's ``MPI.Exception``: an MPI error, with its class (Note [MPI's errors]).

    ``Exception(MPI.ERR_RANK)`` is one; it compares equal to its code, as mpi4py's does.
    """

    def __init__(self, ierr: int = 0, message: str | None = None) -> None:
        self.error_code = int(ierr)
        super().__init__(message if message is not None else Get_error_string(self.error_code))

    @property
    def error_class(self) -> int:
        return Get_error_class(self.error_code)

    @property
    def error_string(self) -> str:
        return Get_error_string(self.error_code)

    def Get_error_code(self) -> int:
        return self.error_code

    def Get_error_class(self) -> int:
        return self.error_class

    def Get_error_string(self) -> str:
        return self.error_string

    def __int__(self) -> int:
        return self.error_code

    def __bool__(self) -> bool:
        return self.error_code != 0

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Exception):
            return self.error_code == other.error_code
        if isinstance(other, int):
            return self.error_code == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.error_code)

    def __repr__(self) -> str:
        return f"MPI.Exception({self.error_code})"


class MPIValueError(Exception, ValueError):
    """A bad argument MPI refuses with an error class (Note [MPI's errors]): caught by
    ``except MPI.Exception`` and by ``except ValueError``."""


class MPIBufferError(builtins.BufferError, builtins.ValueError):
    """A buffer that cannot be used as it is: not contiguous, or one the call writes into
    that cannot be written in place (read-only, a numpy scalar). mpi4py raises BufferError;
    plait.mpi raised ValueError, which scripts may catch, so it is both."""


class TruncatedError(MPIValueError, MismatchError):
    """A message longer than an ``Irecv``'s buffer: MPI's truncation error
    (``MPI_ERR_TRUNCATE``), as mpi4py raises it, and the MismatchError that plait's
    receive of another size raises (Note [MPI's errors])."""

    def __init__(self, message: str) -> None:
        super().__init__(ERRORS["ERR_TRUNCATE"][0], message)


def mpi_error(name: str, message: str) -> MPIValueError:
    """The error of class ``name`` (``"ERR_RANK"``) that says ``message``."""
    return MPIValueError(ERRORS[name][0], message)


#: How plait's own checks word a bad argument (plait._p2p, plait._checks), by error class.
_WORDED = (
    (re.compile(r": (?:dst|src|dest|source)\w*=-?\d+ is invalid; expected a rank"), "ERR_RANK"),
    (re.compile(r": \w*tag -?\d+ out of range"), "ERR_TAG"),
    (re.compile(r": root -?\d+ is out of range"), "ERR_ROOT"),
)


def translated(exc: ValueError) -> ValueError:
    """``exc``, from plait's communicator, as an :class:`MPIValueError` of its class where its
    words say which argument was wrong; else ``exc`` itself."""
    if isinstance(exc, Exception):
        return exc
    text = str(exc)
    for words, name in _WORDED:
        if words.search(text):
            err = mpi_error(name, text)
            err.__cause__ = exc.__cause__
            return err
    return exc


_F = TypeVar("_F", bound=Callable[..., Any])


def raising_mpi_errors(method: _F) -> _F:
    """``method``, its bad-argument errors raised as MPI's (:func:`translated`)."""

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except ValueError as exc:
            err = translated(exc)
            if err is exc:
                raise
            raise err from exc

    return call  # type: ignore[return-value]
