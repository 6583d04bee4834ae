"""mpi4py's package, served by plait: ``from mpi4py import MPI`` imports :mod:`plait.mpi`.

Only ``MPI``, ``rc``, ``__version__`` and ``python -m mpi4py`` (:mod:`mpi4py.run`) are here;
other parts of mpi4py (``mpi4py.futures``, ``mpi4py.util``) are not provided. This package is
found only when its folder is on the path (``plait run --mpi4py``, or
:func:`plait.mpi.mpi4py_path` on PYTHONPATH).

Note [the version of plait's mpi4py]
    Scripts and libraries read ``mpi4py.__version__`` to choose what to call, or to refuse
    a release too old for them. It is ``4.1.0+plait``: the mpi4py
    release whose behaviour plait.mpi follows, with a local version label that says plait
    serves it. A PEP 440 parser (``packaging.version.Version``) reads it, and compares it
    as 4.1.0 against a public version; a ``str.split(".")`` reads 4 and 1.
"""

from __future__ import annotations

from typing import Any

from plait.mpi._unsupported import unsupported

__all__ = ["__version__", "rc"]

#: mpi4py's version that plait.mpi follows, labelled as plait's (Note [the version of
#: plait's mpi4py]).
__version__ = "4.1.0+plait"


class _RuntimeConfig:
    """mpi4py's ``rc``: settings read before MPI starts; accepted, and all but one ignored.

    plait needs none of them (there is no MPI library to initialise), but scripts set
    them (``mpi4py.rc.initialize = False``, ``mpi4py.rc(threads=False)``), so they stay
    settable. ``initialize = False`` before ``MPI`` is first imported makes
    ``MPI.Is_initialized()`` False until ``MPI.Init()``, as mpi4py's (Note [initialising
    later] in plait.mpi).
    """

    def __init__(self) -> None:
        self.initialize = True
        self.threads = True
        self.thread_level = "multiple"
        self.finalize: bool | None = None
        self.fast_reduce = True
        self.recv_mprobe = True
        self.irecv_bufsz = 32768
        self.errors = "exception"

    def __call__(self, **settings: Any) -> None:
        for name, value in settings.items():
            setattr(self, name, value)


rc = _RuntimeConfig()


def __getattr__(name: str) -> Any:
    if name.startswith("_"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    raise unsupported("mpi4py", name, ["MPI", "rc", "run"])
