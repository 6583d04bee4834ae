"""Gradient compression compared: test accuracy and bytes sent per method, on 4 ranks.

Run it with ``plait run -n 4 examples/compression.py`` (add ``--plot cmp.png`` for a
plot; needs matplotlib). Every method trains the same MLP (64-128-10, ReLU) on
scikit-learn's handwritten digits (shipped with scikit-learn: nothing is
downloaded), data-parallel: each rank takes batches from its own shard, and
the gradients are averaged with ``comm.allreduce(g, plait.AVG, compression=...)``,
one call per parameter. The table reports each method's test accuracy, its
difference to the uncompressed run, and the bytes this rank's transport sent
during training (``comm.stats()``), which tells the methods apart even where
the accuracy does not.

Every run with the same number of ranks (and the same PLAIT_ALGO, rules file
and ``plait tune`` profile, which choose the algorithms) prints the same
table, bit for bit, except the time column: the data split, the initial
weights, each rank's batches and the compressors' random draws are all
seeded, and each rank uses one BLAS thread. The ``params`` column is the start of a SHA-256 of the
trained weights (identical on every rank; the example fails otherwise), so
two runs can be compared at a glance. docs/compression.md shows this table;
``python examples/check_compression_doc.py`` reruns the example and checks it.
"""

from __future__ import annotations

import os

# One BLAS thread per rank, set before numpy loads: the ranks share the machine's cores, and a
# fixed thread count keeps the matrix products' rounding the same from run to run.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import hashlib  # noqa: E402
import itertools  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import numpy as np  # noqa: E402

import plait  # noqa: E402
from plait.compression import BF16, FP16, Compressor, Int8, PowerSGD, TopK  # noqa: E402

#: The methods compared, in table order: name -> a fresh compressor (None: plain allreduce).
METHODS: dict[str, Callable[[], Compressor | None]] = {
    "none": lambda: None,
    "fp16": FP16,
    "bf16": BF16,
    "int8": lambda: Int8(block_size=256),
    "int8-stochastic": lambda: Int8(block_size=256, stochastic=True, seed=0),
    "topk-10%": lambda: TopK(0.1),
    "topk-1%": lambda: TopK(0.01),
    "powersgd-r2": lambda: PowerSGD(2),
    "powersgd-r1": lambda: PowerSGD(1),
}


@dataclass
class Result:
    """One method's outcome on this rank."""

    method: str
    accuracy: float
    bytes_sent: int
    seconds: float
    identical: bool
    #: SHA-256 of the trained parameters, hex: equal across runs iff the weights are bit-identical.
    digest: str


def load_digits(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """scikit-learn's 8x8 digits scaled to [0, 1]: 1437 training and 360 test images."""
    try:
        from sklearn.datasets import load_digits as sk_load_digits
    except ImportError:
        raise SystemExit(
            "this example needs scikit-learn for its digits data set: pip install scikit-learn"
        ) from None
    data = sk_load_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    x, y = x[order], y[order]
    return x[:1437], y[:1437], x[1437:], y[1437:]


def init_params(sizes: list[int], seed: int = 1) -> list[np.ndarray]:
    """He-initialised weights and zero biases (the same on every rank: same seed)."""
    rng = np.random.default_rng(seed)
    params = []
    for fan_in, fan_out in itertools.pairwise(sizes):
        params.append(rng.normal(0, np.sqrt(2 / fan_in), (fan_in, fan_out)).astype(np.float32))
        params.append(np.zeros(fan_out, np.float32))
    return params


def gradients(
    params: list[np.ndarray], x: np.ndarray, y: np.ndarray, grads: list[np.ndarray]
) -> None:
    """Mean cross-entropy gradients of the ReLU MLP, written into ``grads``."""
    acts = [x]
    h = x
    layers = len(params) // 2
    for i in range(layers):
        h = h @ params[2 * i] + params[2 * i + 1]
        if i < layers - 1:
            h = np.maximum(h, 0)
        acts.append(h)
    logits = acts[-1] - acts[-1].max(axis=1, keepdims=True)
    probs = np.exp(logits)
    probs /= probs.sum(axis=1, keepdims=True)
    delta = probs
    delta[np.arange(len(y)), y] -= 1
    delta /= len(y)
    for i in reversed(range(layers)):
        grads[2 * i][...] = acts[i].T @ delta
        grads[2 * i + 1][...] = delta.sum(axis=0)
        if i:
            delta = (delta @ params[2 * i].T) * (acts[i] > 0)


def accuracy(params: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
    """Fraction of images classified right."""
    h = x
    layers = len(params) // 2
    for i in range(layers):
        h = h @ params[2 * i] + params[2 * i + 1]
        if i < layers - 1:
            h = np.maximum(h, 0)
    return float((h.argmax(axis=1) == y).mean())


def train(
    comm: plait.Communicator,
    method: str,
    *,
    steps: int = 600,
    batch: int = 16,
    lr: float = 0.1,
    momentum: float = 0.9,
    hidden: int = 128,
) -> Result:
    """Train the MLP with one method; every rank returns its Result (the same on all).

    SGD with momentum on the averaged (compressed) gradients; rank r draws its
    batches from training images r, r + size, ... with its own seeded generator.
    """
    x_train, y_train, x_test, y_test = load_digits()
    shard = slice(comm.rank, None, comm.size)
    x_mine, y_mine = x_train[shard], y_train[shard]
    params = init_params([64, hidden, 10])
    grads = [np.empty_like(p) for p in params]
    velocity = [np.zeros_like(p) for p in params]
    compressor = METHODS[method]()
    batches = np.random.default_rng(100 + comm.rank)

    before = comm.stats()
    start = time.perf_counter()
    for _ in range(steps):
        idx = batches.integers(0, len(y_mine), batch)
        gradients(params, x_mine[idx], y_mine[idx], grads)
        for i, g in enumerate(grads):
            c = compressor.with_key(i) if compressor is not None else None
            comm.allreduce(g, plait.AVG, out=g, compression=c)
            velocity[i] *= momentum
            velocity[i] += g
            params[i] -= lr * velocity[i]
    seconds = time.perf_counter() - start
    sent = (comm.stats() - before).bytes_sent

    flat = np.concatenate([p.ravel() for p in params])
    digest = hashlib.sha256(flat.tobytes()).digest()
    digests = comm.allgather(np.frombuffer(digest, np.uint8))
    identical = bool((digests == digests[0]).all())
    return Result(method, accuracy(params, x_test, y_test), sent, seconds, identical, digest.hex())


#: The first line of :func:`table`'s output (examples/check_compression_doc.py looks for it).
TABLE_HEADER = (
    f"{'method':<16} {'test acc':>8} {'vs none':>9} {'bytes sent':>11} {'vs none':>7} "
    f"{'time':>7}  identical  params"
)


def table(results: list[Result]) -> str:
    """The comparison as a text table (accuracy difference and bytes relative to 'none').

    Bytes are this rank's exact count; ``params`` is the first 12 hex digits of
    the trained weights' SHA-256. Every column but ``time`` is deterministic.
    """
    base = next((r for r in results if r.method == "none"), results[0])
    lines = [TABLE_HEADER]
    lines.extend(
        f"{r.method:<16} {r.accuracy:8.2%} {100 * (r.accuracy - base.accuracy):+7.2f}pp "
        f"{r.bytes_sent:11,} {r.bytes_sent / base.bytes_sent:7.4f} "
        f"{r.seconds:6.2f}s  {r.identical!s:<9}  {r.digest[:12]}"
        for r in results
    )
    return "\n".join(lines)


def plot(results: list[Result], path: str) -> None:
    """Accuracy and bytes sent per method, side by side (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib: pip install matplotlib", flush=True)
        return
    base = next((r for r in results if r.method == "none"), results[0])
    names = [r.method for r in results][::-1]
    rows = range(len(names))
    fig, (acc_ax, bytes_ax) = plt.subplots(1, 2, figsize=(10, 0.45 * len(names) + 1.5))
    acc = [100 * r.accuracy for r in results][::-1]
    acc_ax.barh(rows, acc, color="tab:blue")
    acc_ax.axvline(100 * base.accuracy - 1, color="tab:red", linestyle="--", label="none - 1 pp")
    acc_ax.set_xlim(min([*acc, 100 * base.accuracy - 1]) - 1, 100)
    acc_ax.set_yticks(list(rows), names)
    acc_ax.set_xlabel("test accuracy (%)")
    acc_ax.legend(loc="lower left", fontsize=8)
    ratio = [r.bytes_sent / base.bytes_sent for r in results][::-1]
    bytes_ax.barh(rows, ratio, color="tab:green")
    bytes_ax.set_xscale("log")
    bytes_ax.set_yticks(list(rows), [])
    bytes_ax.set_xlabel("bytes sent, relative to no compression (log)")
    for y, v in zip(rows, ratio, strict=True):
        bytes_ax.annotate(
            f"{v:.3f}", (v, y), xytext=(3, -3), textcoords="offset points", fontsize=8
        )
    fig.suptitle("Gradient compression: digits, MLP 64-128-10, data-parallel")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}", flush=True)


def main() -> None:
    """Train once per method and print the table on rank 0."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated names")
    parser.add_argument("--plot", metavar="FILE.png", help="write a plot of accuracy vs bytes")
    args = parser.parse_args()
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise SystemExit(f"unknown methods {unknown}; choose from {list(METHODS)}")

    # Bytes on the wire are what this example compares: the one-sided collectives of ranks that
    # share a host's memory send none (they read each other's windows), so the uncompressed run
    # would count 0. Every call goes through messages here, as between hosts.
    os.environ.setdefault("PLAIT_SHM_WINDOW", "0")
    with plait.init() as comm:
        results = []
        for method in methods:
            res = train(comm, method, steps=args.steps)
            results.append(res)
            if comm.rank == 0:
                print(
                    f"{method:<16} test accuracy {res.accuracy:.2%}, "
                    f"{res.bytes_sent / 1e6:.3f} MB sent, {res.seconds:.2f} s",
                    flush=True,
                )
        if comm.rank == 0:
            print(f"\n{comm.size} ranks, {args.steps} steps of 16 images per rank\n")
            print(table(results))
            if args.plot:
                plot(results, args.plot)
        if not all(r.identical for r in results):
            raise SystemExit("replicas diverged")


if __name__ == "__main__":
    main()
