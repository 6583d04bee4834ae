"""Every algorithm, as a schedule builder registered under its collective.

Importing this package registers them all; :func:`plait.algorithms` lists them.
"""

from plait.algorithms import (  # noqa: F401  (imported to register)
    recursive_doubling,
    ring,
)
from plait.algorithms._registry import COLLECTIVES, AlgorithmSpec, algorithms, get, specs

__all__ = ["COLLECTIVES", "AlgorithmSpec", "algorithms", "get", "specs"]
