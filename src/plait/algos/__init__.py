"""Every algorithm, as a schedule builder registered under its collective.

Importing this package registers them all; :func:`plait.algorithms` lists them.
"""

from plait.algos import (  # noqa: F401  (imported to register)
    arena,
    binomial,
    bruck,
    direct,
    dissemination,
    double_binary_tree,
    hierarchical,
    in_network,
    pairwise,
    rabenseifner,
    recursive_doubling,
    recursive_halving,
    ring,
    scatter_allgather,
    swing,
    uneven,
)
from plait.algos._registry import (
    COLLECTIVES,
    AlgorithmName,
    AlgorithmSpec,
    algorithms,
    get,
    specs,
)

__all__ = ["COLLECTIVES", "AlgorithmName", "AlgorithmSpec", "algorithms", "get", "specs"]
