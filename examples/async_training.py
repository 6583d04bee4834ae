"""Synchronous, stale-synchronous and ZeRO-sharded data-parallel training, side by side.

Run it with ``plait run -n 4 examples/async_training.py``. The MLP and data of
``train_mlp.py`` (two-dimensional spirals, 3 classes) are trained from the
same start in four ways, each printing its test accuracy, final loss and time
per step:

- ``sync``: every step applies the average of its own gradients (allreduce);
- ``stale-1``, ``stale-4``: bounded staleness (:class:`plait.sharded.StaleAverager`):
  each step starts its average in the background and applies the one from
  1 (or 4) steps earlier, so computation never waits for communication;
- ``zero``: :class:`plait.sharded.ShardedOptimizer`: reduce_scatter the gradients,
  each rank updates a quarter of the parameters (and keeps momentum for that
  quarter only), allgather the result; it must match ``sync`` with momentum.

Replicas are checked to be identical at the end of every run.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
from train_mlp import accuracy, forward_backward, init_params, spirals

import plait
from plait.sharded import ShardedOptimizer, StaleAverager


def train(
    comm: plait.Communicator, mode: str, data: tuple, steps: int, lr: float, batch: int
) -> dict[str, Any]:
    x_mine, y_mine, x_test, y_test = data
    params = init_params(np.random.default_rng(1), [2, 64, 64, 3])  # same start everywhere
    rng = np.random.default_rng(100 + comm.rank)
    mu = 0.5
    velocity = [np.zeros_like(p) for p in params]

    def momentum(p: np.ndarray, g: np.ndarray, state: dict[str, Any]) -> None:
        v = state.setdefault("v", np.zeros_like(p))
        v *= mu
        v += g
        p -= lr * v

    averager = StaleAverager(comm, int(mode.split("-")[1])) if mode.startswith("stale") else None
    zero = ShardedOptimizer(comm, params, momentum) if mode == "zero" else None
    losses = []
    start = time.perf_counter()
    for _ in range(steps):
        idx = rng.integers(0, len(y_mine), batch)
        loss, grads = forward_backward(params, x_mine[idx], y_mine[idx])
        losses.append(loss)
        if zero is not None:
            zero.step(grads)
            continue
        flat = np.concatenate([g.ravel() for g in grads])
        avg = comm.allreduce(flat, plait.AVG) if averager is None else averager.average(flat)
        if avg is None:  # the first steps of a stale run: nothing due yet
            continue
        at = 0
        for p, v in zip(params, velocity, strict=True):
            v *= mu
            v += avg[at : at + p.size].reshape(p.shape)
            p -= lr * v
            at += p.size
    if averager is not None:
        averager.drain()
    elapsed = time.perf_counter() - start
    sums = comm.allgather(np.array([sum(float(p.sum()) for p in params)]))
    return {
        "accuracy": accuracy(params, x_test, y_test),
        "loss": comm.allreduce(np.array([np.mean(losses[-50:])]), plait.AVG)[0],
        "ms_per_step": 1e3 * elapsed / steps,
        "identical": bool(np.all(sums == sums[0])),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.2)
    args = parser.parse_args()
    with plait.init() as comm:
        x, y = spirals(2000, 3, np.random.default_rng(0))
        shard = slice(comm.rank, 5000, comm.size)
        data = (x[shard], y[shard], x[5000:], y[5000:])
        results = {
            mode: train(comm, mode, data, args.steps, args.lr, args.batch)
            for mode in ("sync", "stale-1", "stale-4", "zero")
        }
        if comm.rank == 0:
            print(f"{comm.size} ranks, {args.steps} steps of {args.batch} per rank")
            print(f"{'mode':10s}{'accuracy':>10s}{'loss':>9s}{'ms/step':>9s}  replicas")
            for mode, r in results.items():
                print(
                    f"{mode:10s}{r['accuracy']:10.3f}{r['loss']:9.4f}{r['ms_per_step']:9.2f}  "
                    + ("identical" if r["identical"] else "DIFFER")
                )
        if not all(r["identical"] for r in results.values()):
            raise SystemExit("replicas diverged")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
