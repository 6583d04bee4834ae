"""Ensemble averaging: every rank trains its own model, one allreduce averages their predictions.

Run it with ``plait run -n 4 examples/ensemble.py``. Each rank trains the MLP of
``train_mlp.py`` on the spirals data from its own random start and its own
sample order (no communication while training), predicts class probabilities
for the test set, and ``allreduce(op=plait.AVG)`` averages the predictions of
all ranks. Rank 0 prints every member's test accuracy and the ensemble's; the
ensemble's predictions are checked to be identical on every rank.
"""

from __future__ import annotations

import argparse
import zlib

import numpy as np
from train_mlp import forward_backward, init_params, spirals

import plait


def probabilities(params: list[np.ndarray], x: np.ndarray) -> np.ndarray:
    h = x
    n = len(params) // 2
    for i in range(n):
        h = h @ params[2 * i] + params[2 * i + 1]
        if i < n - 1:
            h = np.maximum(h, 0)
    h = np.exp(h - h.max(axis=1, keepdims=True))
    return h / h.sum(axis=1, keepdims=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--lr", type=float, default=0.5)
    args = parser.parse_args()
    with plait.init() as comm:
        x, y = spirals(2000, 3, np.random.default_rng(0))
        x_train, y_train, x_test, y_test = x[:5000], y[:5000], x[5000:], y[5000:]
        rng = np.random.default_rng(10 + comm.rank)  # each member differs
        params = init_params(rng, [2, 32, 32, 3])
        for _ in range(args.steps):
            idx = rng.integers(0, len(y_train), 64)
            _, grads = forward_backward(params, x_train[idx], y_train[idx])
            for p, g in zip(params, grads, strict=True):
                p -= args.lr * g
        mine = probabilities(params, x_test)
        ensemble = comm.allreduce(mine, plait.AVG)
        members = comm.allgather(np.array([(mine.argmax(axis=1) == y_test).mean()]))
        digests = comm.allgather(np.array([zlib.crc32(ensemble.tobytes())], np.int64))
        same = bool(np.all(digests == digests[0]))
        if comm.rank == 0:
            acc = float((ensemble.argmax(axis=1) == y_test).mean())
            print("member accuracies: " + ", ".join(f"{a:.3f}" for a in members.ravel()))
            print(
                f"ensemble of {comm.size}: accuracy {acc:.3f} "
                f"(best member {members.max():.3f}); identical on every rank: {same}"
            )
        if not same:
            raise SystemExit("ensemble predictions differ between ranks")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
