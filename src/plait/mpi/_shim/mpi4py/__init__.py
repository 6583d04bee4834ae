"""mpi4py's package, served by plait: ``from mpi4py import MPI`` imports :mod:`plait.mpi`.

Only ``MPI`` and ``rc`` are here; other parts of mpi4py (``mpi4py.futures``, ``mpi4py.util``)
are not provided. This package is found only when its folder is on the path
(``plait run --mpi4py``, or :func:`plait.mpi.mpi4py_path` on PYTHONPATH).
"""

from __future__ import annotations

from typing import Any

from plait.mpi._unsupported import unsupported

__all__ = ["rc"]


class _RuntimeConfig:
    """mpi4py's ``rc``: settings read before MPI starts; accepted and ignored here.

    plait needs none of them (there is no MPI library to initialise), but scripts set
    them (``mpi4py.rc.initialize = False``, ``mpi4py.rc(threads=False)``), so they stay
    settable.
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
    raise unsupported("mpi4py", name, ["MPI", "rc"])
