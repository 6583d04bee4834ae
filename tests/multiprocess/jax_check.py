"""Rank script: JAX arrays through the main collectives between processes, against numpy.

Run by ``test_jax_arrays.py`` under ``plait run``. Every collective gets a
``jax.Array`` and must return one holding what the same call on numpy arrays
returns; then a few steps of ``examples/jax_data_parallel.py`` must leave
bit-identical replicas.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import plait

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples_loader import load_example


def same(got: Any, want: Any, what: str) -> None:
    """``got`` is a jax.Array equal to numpy's ``want``."""
    assert isinstance(got, jax.Array), f"{what}: got {type(got).__name__}"
    np.testing.assert_array_equal(np.asarray(got), want, err_msg=what)


def main() -> None:
    with plait.init() as comm:
        r, n = comm.rank, comm.size
        base = np.arange(n * 6, dtype=np.float32).reshape(n * 2, 3) * (r + 1)
        x = jnp.asarray(base)
        same(comm.allreduce(x, plait.MAX), comm.allreduce(base, plait.MAX), "allreduce")
        same(comm.reduce_scatter(x), comm.reduce_scatter(base), "reduce_scatter")
        same(comm.allgather(x), comm.allgather(base), "allgather")
        same(comm.alltoall(x), comm.alltoall(base), "alltoall")
        rows = base[: r + 1]
        same(comm.allgatherv(jnp.asarray(rows)), comm.allgatherv(rows), "allgatherv")
        same(comm.scatter(x, root=0), comm.scatter(base, root=0), "scatter")
        got, want = comm.gather(x, root=1), comm.gather(base, root=1)
        assert (got is None) == (r != 1), "gather off root"
        if r == 1:
            same(got, want, "gather")
        same(comm.allreduce(x, async_op=True).wait(), comm.allreduce(base), "async allreduce")
        if r == 0:
            comm.send(x, 1)
        elif r == 1:
            np.testing.assert_array_equal(comm.recv(np.empty_like(base), 0), base / 2)
        assert load_example("jax_data_parallel").train(comm, 10, 32, 0.3, False)
        if r == 0:
            print(f"jax ok on {n} ranks", flush=True)


if __name__ == "__main__":
    main()
