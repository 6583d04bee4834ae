"""plait on a Dask cluster: ``plait.dask.run(client, fn, *args)`` runs ``fn(comm, *args)`` on every
worker at once, with a plait communicator among them, and returns their results in rank order::

    from distributed import Client
    import plait.dask

    def step(comm, n):
        return comm.allreduce(np.ones(n) * comm.rank)

    with Client("tcp://scheduler:8786") as client:
        results = plait.dask.run(client, step, 1000)     # one per worker, rank order

The ranks meet through the Dask scheduler (its metadata tree), so nothing
else is started; each rank runs as a task pinned to its worker. See
docs/dask.md.
"""

from __future__ import annotations

from plait.dask._run import (
    DEFAULT_START_TIMEOUT,
    FAILURE_GRACE,
    GangError,
    StartTimeout,
    rank_order,
    run,
)
from plait.dask._store import DaskKeyValue

__all__ = [
    "DEFAULT_START_TIMEOUT",
    "FAILURE_GRACE",
    "DaskKeyValue",
    "GangError",
    "StartTimeout",
    "rank_order",
    "run",
]
