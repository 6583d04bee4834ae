"""Average a vector over every worker of a Dask cluster with plait, in one gang of tasks.

    pip install 'plait[dask]'
    python examples/dask_allreduce.py              # a LocalCluster of 3 worker processes
    python examples/dask_allreduce.py tcp://scheduler:8786

Each worker computes its own vector, the ranks average them with one
allreduce, and every rank returns the same mean; see docs/dask.md.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

import plait
import plait.dask


def mean_of_workers(comm: plait.Communicator, n: int) -> tuple[int, np.ndarray[Any, Any]]:
    """Rank r contributes r + 1 everywhere; every rank gets the mean over ranks."""
    mine = np.full(n, comm.rank + 1.0)
    return comm.rank, comm.allreduce(mine, plait.AVG)


def main(client: Any, n: int = 4) -> list[tuple[int, np.ndarray[Any, Any]]]:
    """Run the gang on ``client``'s cluster; print and return each rank's result."""
    results = plait.dask.run(client, mean_of_workers, n)
    for (rank, mean), worker in zip(results, plait.dask.rank_order(client), strict=True):
        print(f"rank {rank} on {worker}: mean {mean}")
    return results


if __name__ == "__main__":
    from distributed import Client, LocalCluster

    if len(sys.argv) > 1:
        with Client(sys.argv[1]) as client:
            main(client)
    else:
        with (
            LocalCluster(
                n_workers=3, threads_per_worker=1, host="127.0.0.1", dashboard_address="127.0.0.1:0"
            ) as cluster,
            Client(cluster) as client,
        ):
            main(client)
