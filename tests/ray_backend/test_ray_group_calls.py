"""PlaitGroup's calls as Ray makes them, on threads that play ranks: no Ray cluster is started.

Ray's ``ray.util.collective`` calls a group's methods with each tensor in a
list and an options class (Note [how Ray calls a collective group] in
``plait.ray._group``); these tests call them the same way on a group whose
communicator comes from :func:`plait.testing.run_ranks`, so the conversions
and options handling are checked in milliseconds. ``test_ray_groups.py``
runs the same calls through a real Ray.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import numpy as np
import pytest

pytest.importorskip("ray", reason="plait.ray needs Ray: pip install 'plait[ray]'")

import plait
from plait.testing import run_ranks

pytestmark = [
    pytest.mark.timeout(60),
    # Ray's own modules warn about deprecated APIs of their dependencies on import
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


def group(comm: plait.Communicator) -> Any:
    """A PlaitGroup over ``comm``, as Ray's rendezvous would have made it."""
    from ray.util.collective.collective_group.base_collective_group import BaseGroup

    from plait.ray._group import PlaitGroup

    g = PlaitGroup.__new__(PlaitGroup)
    BaseGroup.__init__(g, comm.size, comm.rank, "calls")
    g.communicator = comm
    return g


def options(cls: Any, **values: Any) -> Any:
    """An instance of Ray's options class ``cls`` with ``values`` set."""
    o = cls()
    for name, value in values.items():
        setattr(o, name, value)
    return o


def test_bfloat16_tensors_pass_every_call() -> None:
    """bfloat16 tensors are read as allreduce reads them (ml_dtypes' bfloat16), in every call."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("ml_dtypes")
    from ray.util.collective import types

    bf16 = torch.bfloat16

    def body(comm: plait.Communicator) -> dict[str, list[float]]:
        g = group(comm)
        x = torch.full((3,), comm.rank + 1.0, dtype=bf16)
        gathered = [torch.zeros(3, dtype=bf16) for _ in range(comm.size)]
        g.allgather([gathered], [x], types.AllGatherOptions)
        mine = torch.zeros(3, dtype=bf16)
        g.reducescatter(
            [mine], [[x.clone() * (r + 1) for r in range(comm.size)]], types.ReduceScatterOptions
        )
        got = {
            "allgather": torch.cat(gathered).float().tolist(),
            "reducescatter": mine.float().tolist(),
        }
        if comm.rank == 0:
            g.send(
                [torch.arange(6, dtype=bf16)], options(types.SendOptions, dst_rank=1, n_elements=4)
            )
        else:
            buf = torch.zeros(6, dtype=bf16)
            g.recv([buf], options(types.RecvOptions, src_rank=0, n_elements=4))
            got["recv"] = buf.float().tolist()
        return got

    first, second = run_ranks(2, body)
    for got, rank in ((first, 0), (second, 1)):
        assert got["allgather"] == [1.0] * 3 + [2.0] * 3
        assert got["reducescatter"] == [3.0 * (rank + 1)] * 3  # (1 + 2) * (rank + 1)
    assert second["recv"] == [0.0, 1.0, 2.0, 3.0, 0.0, 0.0]


def test_recv_of_n_elements_into_a_non_contiguous_tensor_lands_in_it() -> None:
    """The first n elements (in C order) of a transposed array: not of a flat copy of it."""
    torch = pytest.importorskip("torch")
    from ray.util.collective import types

    def body(comm: plait.Communicator) -> list[np.ndarray]:
        g = group(comm)
        if comm.rank == 0:
            g.send([np.arange(6.0)], options(types.SendOptions, dst_rank=1, n_elements=4))
            g.send([np.arange(6.0)], options(types.SendOptions, dst_rank=1, n_elements=4))
            return []
        a = np.zeros((2, 3)).T
        g.recv([a], options(types.RecvOptions, src_rank=0, n_elements=4))
        t = torch.zeros(2, 3, dtype=torch.float64).T
        g.recv([t], options(types.RecvOptions, src_rank=0, n_elements=4))
        return [a, t.numpy()]

    want = np.array([[0.0, 1.0], [2.0, 3.0], [0.0, 0.0]])
    for got in run_ranks(2, body)[1]:
        np.testing.assert_array_equal(got, want)


def test_barrier_honours_ray_barrier_options(monkeypatch: pytest.MonkeyPatch) -> None:
    """``col.barrier`` passes no options: the timeout_ms of ``types.BarrierOptions`` applies."""
    from ray.util.collective import types

    monkeypatch.setattr(types.BarrierOptions, "timeout_ms", timedelta(milliseconds=200))
    done = threading.Event()

    def body(comm: plait.Communicator) -> float | None:
        if comm.rank == 1:  # never arrives (until rank 0 has given up)
            done.wait(30)
            return None
        start = time.monotonic()
        try:
            with pytest.raises(plait.CommTimeout):
                group(comm).barrier()  # as ray.util.collective.barrier calls it
            return time.monotonic() - start
        finally:
            done.set()

    waited = run_ranks(2, body)[0]
    assert waited is not None
    assert waited < 5  # 0.2 s: not PLAIT_TIMEOUT, nor run_ranks' 30 s
