"""``mpi4py.MPI`` as :mod:`plait.mpi` itself: the same module object, not a copy.

Replacing this module in ``sys.modules`` while it is imported is the import system's
documented way for a module to stand for another; ``from mpi4py import MPI`` then binds
:mod:`plait.mpi`, whose ``COMM_WORLD`` is the one every import sees.
"""

from __future__ import annotations

import sys

from plait import mpi as _mpi

from . import rc

if not rc.initialize and _mpi.COMM_WORLD._comm is None:
    _mpi._initialized = False  # until MPI.Init() (Note [initialising later] in plait.mpi)
sys.modules[__name__] = _mpi
