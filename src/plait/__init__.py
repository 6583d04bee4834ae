"""plait: collective communication for Python.

Layers, bottom up: ``transport`` moves bytes between ranks; ``schedule`` and
``algorithms`` describe each collective as per-rank steps (data, not I/O);
``runtime`` executes a schedule over a transport; ``selection`` picks the
algorithm per call; :class:`Communicator` is the public face.

::

    import numpy as np, plait
    with plait.init() as comm:
        total = comm.allreduce(np.ones(4) * comm.rank)
"""

from typing import TYPE_CHECKING

from plait import algos as _algorithms  # registers every algorithm
from plait._init import init as init
from plait._p2p import ANY_SOURCE as ANY_SOURCE
from plait._p2p import ANY_TAG as ANY_TAG
from plait._p2p import PROC_NULL as PROC_NULL
from plait._p2p import Request as Request
from plait._p2p import Status as Status
from plait._p2p import wait_all as wait_all
from plait._p2p import wait_any as wait_any
from plait._recovery import Agreement as Agreement
from plait.communicator import Communicator as Communicator
from plait.communicator import Stats as Stats
from plait.errors import AbortedError as AbortedError
from plait.errors import ClosedError as ClosedError
from plait.errors import CollectiveTimeout as CollectiveTimeout
from plait.errors import CommError as CommError
from plait.errors import CommTimeout as CommTimeout
from plait.errors import ExcludedError as ExcludedError
from plait.errors import ForkedError as ForkedError
from plait.errors import InternalError as InternalError
from plait.errors import MismatchError as MismatchError
from plait.errors import PeerLostError as PeerLostError
from plait.errors import RendezvousError as RendezvousError
from plait.errors import TransportError as TransportError
from plait.errors import UnsupportedError as UnsupportedError
from plait.ops import AVG as AVG
from plait.ops import BAND as BAND
from plait.ops import BOR as BOR
from plait.ops import BXOR as BXOR
from plait.ops import MAX as MAX
from plait.ops import MIN as MIN
from plait.ops import PROD as PROD
from plait.ops import SUM as SUM
from plait.ops import Op as Op
from plait.runtime.work import Work as Work

#: The version, as in pyproject.toml (a test keeps the two equal); `plait --version` prints it.
__version__ = "0.1.0"

COLLECTIVES = _algorithms.COLLECTIVES


def restart_count() -> int:
    """Which attempt of the job this process belongs to: 0 on the first, 1 after a restart, ...

    ``plait run --max-restarts K`` starts every rank again when one fails, up
    to K times, and tells each attempt its number in PLAIT_RESTART_COUNT (as
    torchrun does in TORCHELASTIC_RESTART_COUNT); a script reads it here to
    resume from its last checkpoint rather than start over. 0 when the job
    was not restarted or PLAIT_RESTART_COUNT is unset.

    Raises:
        ValueError: PLAIT_RESTART_COUNT is set but not a non-negative integer.
    """
    import os

    text = os.environ.get("PLAIT_RESTART_COUNT", "").strip()
    if not text:
        return 0
    if not (text.isascii() and text.isdigit()):
        raise ValueError(f"PLAIT_RESTART_COUNT must be a non-negative integer; got {text!r}")
    return int(text)


def algorithms(collective: str) -> tuple[_algorithms.AlgorithmName, ...]:
    """Names of ``collective``'s algorithms, for ``algorithm=`` (which also takes ``"auto"``).

    The names are strings. Those that only the simulator can run (``in_network``,
    which needs switches that reduce in flight) have ``simulator_only`` set and
    say so in their repr; a communicator refuses them with UnsupportedError.
    """
    return _algorithms.algorithms(collective)


#: The subpackages ``plait.<name>`` reaches after a bare ``import plait`` (imported on first
#: use, as numpy's are). Those that need an extra (torch, ray, dask) are imported by name.
_SUBPACKAGES = frozenset(
    (
        "bench",
        "bucketing",
        "compression",
        "diagnostics",
        "launch",
        "mpi",
        "rendezvous",
        "sharded",
        "sim",
        "testing",
    )
)

if not TYPE_CHECKING:  # type checkers see the subpackages only where they are imported

    def __getattr__(name: str) -> object:
        """``plait.compression.Int8()`` and the like after ``import plait`` alone."""
        if name in _SUBPACKAGES:
            import importlib

            return importlib.import_module(f"plait.{name}")
        raise AttributeError(f"module 'plait' has no attribute {name!r}")


__all__ = [
    "ANY_SOURCE",
    "ANY_TAG",
    "AVG",
    "BAND",
    "BOR",
    "BXOR",
    "COLLECTIVES",
    "MAX",
    "MIN",
    "PROC_NULL",
    "PROD",
    "SUM",
    "AbortedError",
    "Agreement",
    "ClosedError",
    "CollectiveTimeout",
    "CommError",
    "CommTimeout",
    "Communicator",
    "ExcludedError",
    "ForkedError",
    "InternalError",
    "MismatchError",
    "Op",
    "PeerLostError",
    "RendezvousError",
    "Request",
    "Stats",
    "Status",
    "TransportError",
    "UnsupportedError",
    "Work",
    "__version__",
    "algorithms",
    "init",
    "restart_count",
    "wait_all",
    "wait_any",
]
