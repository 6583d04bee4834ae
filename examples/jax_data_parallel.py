"""Data-parallel training in JAX, gradients averaged across processes with plait.

Run it with ``plait run -n 2 examples/jax_data_parallel.py`` (``pip install jax``).
Every rank starts from rank 0's parameters (a broadcast), computes
``jax.grad`` of a small MLP's loss on its own shard of the data, and averages
the gradients with one ``allreduce(op=plait.AVG)`` of a ``jax.Array``, which
plait reads without a copy and returns as a ``jax.Array``. All replicas
therefore take the same steps; the script checks at the end that their
parameters are bit-identical.

``--in-jit`` makes the allreduce from inside the jitted step instead, through
``jax.experimental.io_callback(..., ordered=True)`` (see docs/arrays.md, "JAX
inside jit", for why ordered and not ``pure_callback``).
"""

from __future__ import annotations

import argparse
import itertools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback
from jax.flatten_util import ravel_pytree

import plait

Params = list[tuple[jax.Array, jax.Array]]


def blobs(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``n`` points of two Gaussian blobs in 2-D and their labels (0 or 1)."""
    y = rng.integers(0, 2, n)
    x = rng.normal(0.0, 0.7, (n, 2)) + np.where(y[:, None] == 1, 1.0, -1.0)
    return x.astype(np.float32), y.astype(np.int32)


def init_params(key: jax.Array, sizes: list[int]) -> Params:
    """Weights scaled by 1/sqrt(fan in) and zero biases, one pair per layer."""
    params = []
    for fan_in, fan_out in itertools.pairwise(sizes):
        key, sub = jax.random.split(key)
        w = jax.random.normal(sub, (fan_in, fan_out), jnp.float32) / np.sqrt(fan_in)
        params.append((w, jnp.zeros(fan_out, jnp.float32)))
    return params


def loss_fn(params: Params, x: jax.Array, y: jax.Array) -> jax.Array:
    """Mean cross-entropy of a tanh MLP."""
    h = x
    for w, b in params[:-1]:
        h = jnp.tanh(h @ w + b)
    w, b = params[-1]
    logits = h @ w + b
    return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(y.shape[0]), y])


@jax.jit
def accuracy(params: Params, x: jax.Array, y: jax.Array) -> jax.Array:
    """Fraction of points classified right."""
    h = x
    for w, b in params[:-1]:
        h = jnp.tanh(h @ w + b)
    w, b = params[-1]
    return jnp.mean(jnp.argmax(h @ w + b, axis=1) == y)


def train(comm: plait.Communicator, steps: int, batch: int, lr: float, in_jit: bool) -> bool:
    """Train on ``comm``'s ranks; rank 0 reports; whether the replicas end bit-identical."""
    x, y = blobs(4000, np.random.default_rng(0))  # the same data everywhere
    x_mine, y_mine = x[comm.rank :: comm.size], y[comm.rank :: comm.size]  # this rank's shard

    # Different on every rank on purpose; the broadcast makes rank 0's the start.
    params = init_params(jax.random.PRNGKey(1 + comm.rank), [2, 32, 32, 2])
    flat, unravel = ravel_pytree(params)
    # broadcast writes in place and JAX arrays are immutable: send a numpy copy
    params = unravel(jnp.asarray(comm.broadcast(np.array(flat), root=0)))

    def average(g: Any) -> np.ndarray:
        """The host side of ``in_jit``: average a flat gradient over the ranks."""
        out: np.ndarray = comm.allreduce(np.asarray(g), plait.AVG)
        return out

    @jax.jit
    def grads(params: Params, xb: jax.Array, yb: jax.Array) -> tuple[jax.Array, jax.Array]:
        loss, g = jax.value_and_grad(loss_fn)(params, xb, yb)
        return loss, ravel_pytree(g)[0]

    @jax.jit
    def update(params: Params, g: jax.Array) -> Params:
        flat, unravel = ravel_pytree(params)
        return unravel(flat - lr * g)

    @jax.jit
    def step_in_jit(params: Params, xb: jax.Array, yb: jax.Array) -> tuple[jax.Array, Params]:
        loss, g = grads(params, xb, yb)
        shape = jax.ShapeDtypeStruct(g.shape, g.dtype)
        g = io_callback(average, shape, g, ordered=True)  # in program order on every rank
        return loss, update(params, g)

    rng = np.random.default_rng(100 + comm.rank)
    start = time.perf_counter()
    for step in range(1, steps + 1):
        idx = rng.integers(0, len(y_mine), batch)
        xb, yb = jnp.asarray(x_mine[idx]), jnp.asarray(y_mine[idx])
        if in_jit:
            loss, params = step_in_jit(params, xb, yb)
        else:
            loss, g = grads(params, xb, yb)
            g = comm.allreduce(g, plait.AVG)  # a jax.Array in, a jax.Array out
            params = update(params, g)
        if comm.rank == 0 and (step % 50 == 0 or step == 1):
            acc = float(accuracy(params, jnp.asarray(x), jnp.asarray(y)))
            print(f"step {step:4d}  loss {float(loss):.4f}  accuracy {acc:.3f}", flush=True)
    elapsed = time.perf_counter() - start

    every = comm.allgather(np.asarray(ravel_pytree(params)[0]))
    identical = all(np.array_equal(every[0], row) for row in every)
    if comm.rank == 0:
        print(f"{steps} steps on {comm.size} ranks in {elapsed:.2f} s", flush=True)
        print(f"replicas identical: {identical}", flush=True)
    return identical


def main() -> None:
    """Parse the options, train, and fail if the replicas differ."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=64, help="per-rank batch size")
    parser.add_argument("--lr", type=float, default=0.3)
    parser.add_argument("--in-jit", action="store_true", help="allreduce inside the jitted step")
    args = parser.parse_args()
    with plait.init() as comm:
        if not train(comm, args.steps, args.batch, args.lr, args.in_jit):
            raise SystemExit(f"rank {comm.rank}: replicas differ")


if __name__ == "__main__":
    main()
