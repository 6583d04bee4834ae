"""plait.mpi: run mpi4py scripts on plait, without an MPI library.

A script imports it in place of ``mpi4py.MPI``::

    from plait import mpi as MPI          # or, under `plait run --mpi4py`: from mpi4py import MPI

    comm = MPI.COMM_WORLD
    total = comm.allreduce(comm.Get_rank(), op=MPI.SUM)

and runs under ``plait run -n 4 script.py`` (or mpirun, torchrun, srun: whatever
:func:`plait.init` understands). What it covers is the common subset of mpi4py: the world
communicator, ``Split``/``Dup``/``Free``/``Abort``, the lowercase object methods, the
capitalised buffer methods with mpi4py's buffer specifications and ``IN_PLACE``, the
predefined ops (MAXLOC and MINLOC included), ``Status`` and ``Request``, wildcards. The
rest raises :class:`~plait.mpi._unsupported.Unsupported` (a NotImplementedError) naming the
call and the nearest supported one. docs/mpi.md, "plait.mpi", lists it all and the
differences from MPI.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import plait
from plait.mpi._comm import Comm, Intracomm, world
from plait.mpi._datatypes import (
    DATATYPES,
    IN_PLACE,
    TYPEDICT,
    TYPEDICT_C,
    TYPEDICT_F,
    Datatype,
    InPlace,
)
from plait.mpi._errors import ERRORS, Exception, Get_error_class, Get_error_string
from plait.mpi._identity import TAG_UB
from plait.mpi._ops import OPS, Op
from plait.mpi._requests import REQUEST_NULL, UNDEFINED, Request, Status
from plait.mpi._unsupported import Unsupported, unsupported

__all__ = [
    "ANY_SOURCE",
    "ANY_TAG",
    "BAND",
    "BOR",
    "BXOR",
    "COMM_NULL",
    "COMM_SELF",
    "COMM_WORLD",
    "IN_PLACE",
    "LAND",
    "LOR",
    "LXOR",
    "MAX",
    "MAXLOC",
    "MIN",
    "MINLOC",
    "PROC_NULL",
    "PROD",
    "REQUEST_NULL",
    "SUBVERSION",
    "SUM",
    "TAG_UB",
    "THREAD_MULTIPLE",
    "THREAD_SINGLE",
    "UNDEFINED",
    "VERSION",
    "Comm",
    "Datatype",
    "Exception",
    "Finalize",
    "Get_error_class",
    "Get_error_string",
    "Get_library_version",
    "Get_processor_name",
    "Get_version",
    "InPlace",
    "Init",
    "Init_thread",
    "Intracomm",
    "Is_finalized",
    "Is_initialized",
    "Op",
    "Query_thread",
    "Request",
    "Status",
    "Unsupported",
    "Wtick",
    "Wtime",
    "mpi4py_path",
    *DATATYPES,
    *ERRORS,
]

ANY_SOURCE = plait.ANY_SOURCE
ANY_TAG = plait.ANY_TAG
PROC_NULL = plait.PROC_NULL
THREAD_SINGLE, THREAD_FUNNELED, THREAD_SERIALIZED, THREAD_MULTIPLE = 0, 1, 2, 3
#: The MPI standard whose interface this follows, as mpi4py on Open MPI 4 says: 3.1.
VERSION, SUBVERSION = 3, 1

#: The job's communicator; it joins the job on first use (Note [the world communicator]).
COMM_WORLD = world()
#: This process alone.
COMM_SELF = Intracomm(None, "MPI_COMM_SELF", join=lambda: plait.init(rank=0, size=1), number=1)
#: What ``Split`` returns for ``MPI.UNDEFINED``; false, and equal to any handle ``Free`` freed.
COMM_NULL = Comm(None, "MPI_COMM_NULL")

# MPI's error classes (Note [MPI's errors] in plait.mpi._errors).
SUCCESS = ERRORS["SUCCESS"][0]
ERR_BUFFER = ERRORS["ERR_BUFFER"][0]
ERR_COUNT = ERRORS["ERR_COUNT"][0]
ERR_TYPE = ERRORS["ERR_TYPE"][0]
ERR_TAG = ERRORS["ERR_TAG"][0]
ERR_COMM = ERRORS["ERR_COMM"][0]
ERR_RANK = ERRORS["ERR_RANK"][0]
ERR_REQUEST = ERRORS["ERR_REQUEST"][0]
ERR_ROOT = ERRORS["ERR_ROOT"][0]
ERR_GROUP = ERRORS["ERR_GROUP"][0]
ERR_OP = ERRORS["ERR_OP"][0]
ERR_ARG = ERRORS["ERR_ARG"][0]
ERR_UNKNOWN = ERRORS["ERR_UNKNOWN"][0]
ERR_TRUNCATE = ERRORS["ERR_TRUNCATE"][0]
ERR_OTHER = ERRORS["ERR_OTHER"][0]
ERR_INTERN = ERRORS["ERR_INTERN"][0]
ERR_LASTCODE = ERRORS["ERR_LASTCODE"][0]

SUM = OPS["SUM"]
PROD = OPS["PROD"]
MAX = OPS["MAX"]
MIN = OPS["MIN"]
LAND = OPS["LAND"]
LOR = OPS["LOR"]
LXOR = OPS["LXOR"]
BAND = OPS["BAND"]
BOR = OPS["BOR"]
BXOR = OPS["BXOR"]
MAXLOC = OPS["MAXLOC"]
MINLOC = OPS["MINLOC"]

BYTE = DATATYPES["BYTE"]
CHAR = DATATYPES["CHAR"]
SIGNED_CHAR = DATATYPES["SIGNED_CHAR"]
UNSIGNED_CHAR = DATATYPES["UNSIGNED_CHAR"]
SHORT = DATATYPES["SHORT"]
SIGNED_SHORT = DATATYPES["SIGNED_SHORT"]
UNSIGNED_SHORT = DATATYPES["UNSIGNED_SHORT"]
INT = DATATYPES["INT"]
SIGNED_INT = DATATYPES["SIGNED_INT"]
UNSIGNED = DATATYPES["UNSIGNED"]
UNSIGNED_INT = DATATYPES["UNSIGNED_INT"]
LONG = DATATYPES["LONG"]
SIGNED_LONG = DATATYPES["SIGNED_LONG"]
UNSIGNED_LONG = DATATYPES["UNSIGNED_LONG"]
LONG_LONG = DATATYPES["LONG_LONG"]
SIGNED_LONG_LONG = DATATYPES["SIGNED_LONG_LONG"]
UNSIGNED_LONG_LONG = DATATYPES["UNSIGNED_LONG_LONG"]
FLOAT = DATATYPES["FLOAT"]
DOUBLE = DATATYPES["DOUBLE"]
LONG_DOUBLE = DATATYPES["LONG_DOUBLE"]
C_BOOL = DATATYPES["C_BOOL"]
BOOL = DATATYPES["BOOL"]
INT8_T = DATATYPES["INT8_T"]
INT16_T = DATATYPES["INT16_T"]
INT32_T = DATATYPES["INT32_T"]
INT64_T = DATATYPES["INT64_T"]
UINT8_T = DATATYPES["UINT8_T"]
UINT16_T = DATATYPES["UINT16_T"]
UINT32_T = DATATYPES["UINT32_T"]
UINT64_T = DATATYPES["UINT64_T"]
C_COMPLEX = DATATYPES["C_COMPLEX"]
C_FLOAT_COMPLEX = DATATYPES["C_FLOAT_COMPLEX"]
C_DOUBLE_COMPLEX = DATATYPES["C_DOUBLE_COMPLEX"]
C_LONG_DOUBLE_COMPLEX = DATATYPES["C_LONG_DOUBLE_COMPLEX"]
COMPLEX = DATATYPES["COMPLEX"]
DOUBLE_COMPLEX = DATATYPES["DOUBLE_COMPLEX"]
INTEGER = DATATYPES["INTEGER"]
REAL = DATATYPES["REAL"]
DOUBLE_PRECISION = DATATYPES["DOUBLE_PRECISION"]
AINT = DATATYPES["AINT"]
OFFSET = DATATYPES["OFFSET"]
COUNT = DATATYPES["COUNT"]
FLOAT_INT = DATATYPES["FLOAT_INT"]
DOUBLE_INT = DATATYPES["DOUBLE_INT"]
LONG_INT = DATATYPES["LONG_INT"]
TWOINT = DATATYPES["TWOINT"]
INT_INT = DATATYPES["INT_INT"]
SHORT_INT = DATATYPES["SHORT_INT"]
LONG_DOUBLE_INT = DATATYPES["LONG_DOUBLE_INT"]

#: mpi4py's maps of type codes to datatypes (``MPI._typedict[a.dtype.char]`` is
#: ``MPI.DOUBLE`` for an array of float64), for the datatypes above.
_typedict = TYPEDICT
_typedict_c = TYPEDICT_C
_typedict_f = TYPEDICT_F

_finalized = False
#: Whether MPI counts as started: from import on, but for ``mpi4py.rc.initialize = False``,
#: until Init (Note [initialising later]).
_initialized = True


def Wtime() -> float:
    """Seconds on a monotonic clock; differences of two calls time what lies between."""
    return time.perf_counter()


def Wtick() -> float:
    """The resolution of :func:`Wtime`, in seconds."""
    return time.get_clock_info("perf_counter").resolution


def Get_processor_name() -> str:
    """This host's name."""
    return socket.gethostname()


def Get_version() -> tuple[int, int]:
    """The MPI standard whose interface this follows, as mpi4py reports it: (3, 1)."""
    return VERSION, SUBVERSION


def Get_library_version() -> str:
    """What runs the calls: plait, and its version."""
    return f"plait {plait.__version__} (plait.mpi)"


def Init() -> None:
    """Nothing to start: ``COMM_WORLD`` joins the job when first used. :func:`Is_initialized`
    is True from here on (Note [initialising later])."""
    global _initialized
    _initialized = True


def Init_thread(required: int = THREAD_MULTIPLE) -> int:
    """As :func:`Init`; returns ``THREAD_MULTIPLE`` (calls may come from any thread)."""
    Init()
    return THREAD_MULTIPLE


def Query_thread() -> int:
    """What :func:`Init_thread` gives: ``THREAD_MULTIPLE`` (calls may come from any thread)."""
    return THREAD_MULTIPLE


def Is_initialized() -> bool:
    """Whether MPI counts as started: True, but for a script that set
    ``mpi4py.rc.initialize = False`` before its first ``from mpi4py import MPI``, which is
    False until :func:`Init` or :func:`Init_thread`.

    Note [initialising later]
        mpi4py starts MPI when ``mpi4py.MPI`` is first imported, unless ``mpi4py.rc``
        says ``initialize = False``; such a script calls ``MPI.Init()`` itself, often
        behind ``if not MPI.Is_initialized()``. plait.mpi has nothing to start (the world
        joins the job on first use), but Is_initialized says what mpi4py's would: the
        ``mpi4py`` package of ``plait run --mpi4py`` reads ``rc.initialize`` when its
        ``MPI`` is first imported and, where it is false, sets this False until Init.
        ``from plait import mpi`` reads no rc: Is_initialized is True.
    """
    return _initialized


def Finalize() -> None:
    """Release the world communicator (if it was used); no call may follow."""
    global _finalized
    COMM_WORLD._release()
    _finalized = True


def Is_finalized() -> bool:
    """Whether :func:`Finalize` was called."""
    return _finalized


def mpi4py_path() -> str:
    """The folder to put first on PYTHONPATH so that ``from mpi4py import MPI`` is plait.mpi.

    ``plait run --mpi4py`` does it for its ranks; under another launcher::

        PYTHONPATH=$(python -c "import plait.mpi; print(plait.mpi.mpi4py_path())") mpirun ...
    """
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "_shim")


def __getattr__(name: str) -> Any:
    # A name beginning with "_" is Python's (__path__, __wrapped__, ...) or one of mpi4py's
    # internals (_addressof, _sizeof, ...), which no script's feature check looks for: a
    # plain AttributeError, as Python's for any module.
    if name.startswith("_"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    raise unsupported("MPI", name, __all__)
