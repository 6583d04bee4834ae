"""JAX arrays in, JAX arrays out (Note [JAX arrays] in plait._arrays), in one process.

Two ranks played by threads; every call is compared with the same call on
numpy arrays. The example ``examples/jax_data_parallel.py`` trains a few steps
on one rank with the allreduce inside the jitted step.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import plait
from examples_loader import load_example
from plait._checks import as_array
from plait.compression import FP16
from plait.testing import memory_communicators, run_ranks

jax = pytest.importorskip("jax", reason="JAX arrays need jax: pip install jax")
jnp = pytest.importorskip("jax.numpy", reason="JAX arrays need jax: pip install jax")

pytestmark = pytest.mark.timeout(60)


def test_a_cpu_jax_array_is_read_without_a_copy() -> None:
    x = jnp.arange(6.0, dtype=jnp.float32)
    a = as_array(x, "x", 0, "allreduce")
    assert a.ctypes.data == x.unsafe_buffer_pointer()
    assert not a.flags.writeable
    assert as_array(x.astype(jnp.bfloat16), "x", 0, "allreduce").dtype.name == "bfloat16"


def test_every_collective_returns_a_jax_array() -> None:
    def body(comm: plait.Communicator) -> Any:
        base = np.arange(12, dtype=np.float32).reshape(4, 3) * (comm.rank + 1)
        x = jnp.asarray(base)
        pairs = {
            "allreduce": (comm.allreduce(x), comm.allreduce(base)),
            "reduce": (comm.reduce(x, root=0), comm.reduce(base, root=0)),
            "reduce_scatter": (comm.reduce_scatter(x), comm.reduce_scatter(base)),
            "allgather": (comm.allgather(x), comm.allgather(base)),
            "alltoall": (comm.alltoall(x), comm.alltoall(base)),
            "gatherv": (comm.gatherv(x, root=1), comm.gatherv(base, root=1)),
            "scatterv": (comm.scatterv(x, [1, 3], root=0), comm.scatterv(base, [1, 3], root=0)),
            "alltoallv": (comm.alltoallv(x, [2, 2]), comm.alltoallv(base, [2, 2])),
            "async": (comm.allgather(x, async_op=True).wait(), comm.allgather(base)),
            "compressed": (
                comm.allreduce(x, plait.AVG, compression=FP16()),
                comm.allreduce(base, plait.AVG, compression=FP16()),
            ),
            "broadcast root": (comm.broadcast(x if comm.rank == 0 else np.zeros_like(base), 0), x),
        }
        bf = comm.allreduce(x.astype(jnp.bfloat16))
        if comm.rank == 0:
            comm.send(x, 1)
        else:
            pairs["recv"] = (comm.recv(np.empty((4, 3), np.float32), 0), base / 2)
        return pairs, bf, x

    for pairs, bf, _x in run_ranks(2, body):
        for name, (got, want) in pairs.items():
            if want is None:
                assert got is None, name
            elif name == "broadcast root":
                assert got is want or isinstance(got, np.ndarray)  # root returns x itself
            elif name == "recv":
                np.testing.assert_array_equal(got, want)
            else:
                assert isinstance(got, jax.Array), name
                np.testing.assert_array_equal(np.asarray(got), want, err_msg=name)
        assert isinstance(bf, jax.Array)
        assert bf.dtype == jnp.bfloat16


def test_writing_into_a_jax_array_is_refused_before_anything_moves() -> None:
    comms = memory_communicators(2, timeout=5)
    try:
        x = jnp.ones(3)
        with pytest.raises(TypeError, match=r"out is a jax.Array.*use the array the call returns"):
            comms[0].allreduce(x, out=x)
        with pytest.raises(TypeError, match=r"x is a jax.Array.*np.array\(x\)"):
            comms[1].broadcast(x, root=0)
        with pytest.raises(TypeError, match=r"buf is a jax.Array.*receive into a numpy"):
            comms[1].recv(x, 0)
        # nothing was sent: both ranks can still make a call together
        assert run_both(comms, lambda c: c.allreduce(np.ones(1))) == [2.0, 2.0]
    finally:
        for comm in comms:
            comm.close()


def run_both(comms: list[plait.Communicator], fn: Any) -> list[float]:
    """``fn(comm)`` on each of ``comms`` at once (threads); the first element of each result."""
    import threading

    out: list[float] = [0.0] * len(comms)

    def one(i: int) -> None:
        out[i] = float(fn(comms[i])[0])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(comms))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return out


def test_the_example_trains_with_the_allreduce_inside_jit() -> None:
    """io_callback(ordered=True) runs the allreduce from the jitted step (one rank here;
    tests/multiprocess/jax_check.py trains on two, with the allreduce outside jit)."""
    example = load_example("jax_data_parallel")
    [comm] = memory_communicators(1)
    with comm:
        assert example.train(comm, 3, 16, 0.3, True)
