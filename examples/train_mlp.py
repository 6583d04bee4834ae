"""Data-parallel training of a small MLP in plain numpy, one shard of the data per rank.

Run it with ``plait run -n 4 examples/train_mlp.py``. Every rank starts from the
same weights (rank 0's, broadcast), computes gradients on its own shard, and
averages them with ``allreduce(op=plait.AVG)``, so all replicas stay identical;
the script checks that at the end. The data set is generated (two interleaved
spirals, 3 classes), so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import itertools
import time

import numpy as np

import plait


def spirals(n: int, classes: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``n`` points per class on ``classes`` noisy spiral arms in 2-D."""
    xs, ys = [], []
    for c in range(classes):
        r = np.linspace(0.05, 1.0, n)
        t = np.linspace(c * 4.0, (c + 1) * 4.0, n) + rng.normal(0, 0.2, n)
        xs.append(np.stack([r * np.sin(t), r * np.cos(t)], axis=1))
        ys.append(np.full(n, c))
    x = np.concatenate(xs).astype(np.float32)
    y = np.concatenate(ys)
    order = rng.permutation(len(y))
    return x[order], y[order]


def init_params(rng: np.random.Generator, sizes: list[int]) -> list[np.ndarray]:
    """He-initialised weights and zero biases, as one list of arrays."""
    params = []
    for fan_in, fan_out in itertools.pairwise(sizes):
        params.append((rng.normal(0, np.sqrt(2 / fan_in), (fan_in, fan_out))).astype(np.float32))
        params.append(np.zeros(fan_out, np.float32))
    return params


def forward_backward(
    params: list[np.ndarray], x: np.ndarray, y: np.ndarray
) -> tuple[float, list[np.ndarray]]:
    """Cross-entropy loss of a ReLU MLP and its gradients (mean over the batch)."""
    acts = [x]
    h = x
    n_layers = len(params) // 2
    for i in range(n_layers):
        h = h @ params[2 * i] + params[2 * i + 1]
        if i < n_layers - 1:
            h = np.maximum(h, 0)
        acts.append(h)
    logits = acts[-1] - acts[-1].max(axis=1, keepdims=True)
    probs = np.exp(logits)
    probs /= probs.sum(axis=1, keepdims=True)
    loss = float(-np.log(probs[np.arange(len(y)), y] + 1e-12).mean())
    grad = probs
    grad[np.arange(len(y)), y] -= 1
    grad /= len(y)
    grads: list[np.ndarray] = [np.empty(0)] * len(params)
    for i in reversed(range(n_layers)):
        grads[2 * i] = acts[i].T @ grad
        grads[2 * i + 1] = grad.sum(axis=0)
        if i:
            grad = (grad @ params[2 * i].T) * (acts[i] > 0)
    return loss, grads


def accuracy(params: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
    """Fraction of points whose arg-max class is right."""
    h = x
    for i in range(len(params) // 2):
        h = h @ params[2 * i] + params[2 * i + 1]
        if i < len(params) // 2 - 1:
            h = np.maximum(h, 0)
    return float((h.argmax(axis=1) == y).mean())


def main() -> None:
    """Train, report progress on rank 0, and check that the replicas agree."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=64, help="per-rank batch size")
    parser.add_argument("--lr", type=float, default=0.5)
    args = parser.parse_args()

    with plait.init() as comm:
        rng = np.random.default_rng(0)  # same data and test split everywhere
        x, y = spirals(2000, 3, rng)
        x_train, y_train, x_test, y_test = x[:5000], y[:5000], x[5000:], y[5000:]
        shard = slice(comm.rank, None, comm.size)  # each rank sees its own examples
        x_mine, y_mine = x_train[shard], y_train[shard]

        params = init_params(np.random.default_rng(1 + comm.rank), [2, 64, 64, 3])
        for p in params:  # start from rank 0's weights
            comm.broadcast(p, root=0)
        flat = np.concatenate([p.ravel() for p in params])
        views = np.split(flat, np.cumsum([p.size for p in params])[:-1])
        params = [v.reshape(p.shape) for v, p in zip(views, params, strict=True)]
        grad_flat = np.empty_like(flat)

        batch_rng = np.random.default_rng(100 + comm.rank)
        start = time.perf_counter()
        for step in range(1, args.steps + 1):
            idx = batch_rng.integers(0, len(y_mine), args.batch)
            loss, grads = forward_backward(params, x_mine[idx], y_mine[idx])
            np.concatenate([g.ravel() for g in grads], out=grad_flat)
            comm.allreduce(grad_flat, plait.AVG, out=grad_flat)  # one call for all gradients
            flat -= args.lr * grad_flat
            loss_avg = comm.allreduce(np.array([loss]), plait.AVG)[0]
            if comm.rank == 0 and (step % 50 == 0 or step == 1):
                print(
                    f"step {step:4d}  loss {loss_avg:.4f}  "
                    f"test accuracy {accuracy(params, x_test, y_test):.3f}",
                    flush=True,
                )
        elapsed = time.perf_counter() - start

        checksums = comm.allgather(np.array([flat.sum(dtype=np.float64)]))
        identical = bool(np.all(checksums == checksums[0]))
        acc = accuracy(params, x_test, y_test)
        if comm.rank == 0:
            print(
                f"done: {comm.size} rank{'s' * (comm.size != 1)}, {args.steps} steps in "
                f"{elapsed:.2f} s, "
                f"test accuracy {acc:.3f}, replicas identical: {identical}"
            )
        if not identical:
            raise SystemExit("replicas diverged")


if __name__ == "__main__":
    main()
