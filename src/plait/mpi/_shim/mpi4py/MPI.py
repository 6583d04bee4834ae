"""``mpi4py.MPI`` as :mod:`plait.mpi` itself: the same module object, not a copy.

Replacing this module in ``sys.modules`` while it is imported is the import system's
documented way for a module to stand for another; ``from mpi4py import MPI`` then binds
:mod:`plait.mpi`, whose ``COMM_WORLD`` is the one every import sees.
"""

from __future__ import annotations

import sys

from plait import mpi as _mpi

sys.modules[__name__] = _mpi
