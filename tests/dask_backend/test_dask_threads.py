"""plait.dask.run on a LocalCluster of threads (processes=False): every rank in this process."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

distributed = pytest.importorskip(
    "distributed", reason="plait.dask needs Dask's distributed: pip install 'plait[dask]'"
)

import plait  # noqa: E402
import plait.dask  # noqa: E402

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    """Two in-process workers of one thread each; PLAIT_SECRET as it was, afterwards."""
    before = os.environ.get("PLAIT_SECRET")
    try:
        with (
            distributed.LocalCluster(
                n_workers=2,
                threads_per_worker=1,
                processes=False,  # in-process transport: no host to bind
                dashboard_address="127.0.0.1:0",  # None still serves /metrics on 8787, if free
            ) as cluster,
            distributed.Client(cluster) as client,
        ):
            yield client
    finally:
        # The ranks ran in this process, which took the cluster's secret.
        if before is None:
            os.environ.pop("PLAIT_SECRET", None)
        else:
            os.environ["PLAIT_SECRET"] = before


def ring(comm: plait.Communicator) -> tuple[float, float]:
    """An allreduce, then each rank sends to the next and receives from the one before."""
    total = float(comm.allreduce(np.full(2, comm.rank + 1.0))[0])
    got = np.empty(3)
    req = comm.isend(np.full(3, float(comm.rank)), (comm.rank + 1) % comm.size)
    comm.recv(got, (comm.rank - 1) % comm.size)
    req.wait()
    return total, float(got[0])


def test_ranks_as_threads_of_one_process(client: Any) -> None:
    assert plait.dask.run(client, ring) == [(3.0, 1.0), (3.0, 0.0)]
    with pytest.raises(plait.dask.GangError, match="rank 0 of 2") as info:
        plait.dask.run(client, lambda comm: 1 / (comm.rank - 0) if comm.rank else 1 / 0)
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    assert plait.dask.run(client, ring) == [(3.0, 1.0), (3.0, 0.0)]
