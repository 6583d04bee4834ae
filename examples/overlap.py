"""Overlap of gradient communication with backward computation, measured.

Run it with ``plait run -n 2 examples/overlap.py``. Each rank runs the
backward pass of a deep stack of dense layers (numpy matmuls, one BLAS thread)
and averages the gradients over all ranks in four ways, timing each step:

- ``compute``: backward only, no communication;
- ``comm``: only the allreduce of all gradients (bucketed, nothing to overlap);
- ``serial``: backward, then the bucketed allreduce: compute + comm one after the other;
- ``overlap``: a :class:`plait.bucketing.Bucketer` starts each bucket's allreduce as
  soon as backward has produced its gradients, so communication runs while
  the earlier layers' gradients are still being computed.

It prints the median step time of each and how much of the communication
the overlap hid: ``(serial - overlap) / comm``; or, where the overlapped step
was no faster than the serial one, that overlap did not help, by how much it
lost, and why that happens (:func:`summary`). Every mode's gradients are
checked against each other, so the overlap changes the timing, not the result.

Options: ``--layers``, ``--width``, ``--batch``, ``--steps``, ``--bucket-mb``.
"""

from __future__ import annotations

import os

# One BLAS thread per rank, set before numpy loads: the ranks share the machine's cores.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

import plait  # noqa: E402
from plait.bucketing import Bucketer  # noqa: E402


def backward(weights: list[np.ndarray], acts: list[np.ndarray], grad_out: np.ndarray, emit) -> None:
    """Backward through ``x -> x @ W`` layers, last first; ``emit(i, dW)`` per layer."""
    g = grad_out
    for i in reversed(range(len(weights))):
        emit(i, acts[i].T @ g)
        g = g @ weights[i].T


def summary(serial_ms: float, overlap_ms: float, comm_ms: float, ranks: int, cores: int) -> str:
    """The verdict on overlap, from the median step times; never a negative "hidden" share.

    ``ranks`` run on this host, which has ``cores`` cores. Where the overlapped
    step is faster, the verdict is the share of the communication time it hid,
    ``(serial - overlap) / comm``. Where it is not, that share would be
    negative, which reads as nonsense; the verdict then says that overlap did
    not help, by how much the overlapped step lost, and the likely reason:
    overlap needs something idle to overlap with, and the background thread
    that moves the bytes needs a core of its own.
    """
    head = f"overlap step is {overlap_ms / serial_ms:.2f} of the serial step"
    saved = serial_ms - overlap_ms
    if saved > 0:
        if comm_ms <= 0:
            return f"{head}: it saved {saved:.1f} ms"
        if saved > comm_ms:
            return (
                f"{head}: it saved {saved:.1f} ms, more than the {comm_ms:.1f} ms the "
                "communication alone takes; the timings are noisy, try more --steps"
            )
        return f"{head}: it hides {100 * saved / comm_ms:.0f} % of the communication time"
    lost = -saved
    if round(100 * lost / serial_ms) == 0:
        verdict = f"took as long as the serial one ({lost:.1f} ms longer)"
    else:
        verdict = f"took {100 * lost / serial_ms:.0f} % ({lost:.1f} ms) longer than the serial one"
    if cores < 2 * ranks:
        why = (
            f"{ranks} ranks on {cores} cores leave no core free for the background threads "
            "that move the bytes while backward runs, so they take CPU time from backward"
        )
    else:
        why = (
            "moving the bytes (copies, reductions) costs CPU time and memory bandwidth, which "
            "backward needs too"
        )
    return (
        f"{head}: overlap did not help here, the overlapped step {verdict}.\n"
        f"This happens where nothing is idle: {why}. Overlap pays where communication waits "
        "on a network."
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--bucket-mb", type=float, default=4.0)
    parser.add_argument("--transport", default=None, help="force a transport (shm, tcp)")
    args = parser.parse_args()

    with plait.init(transport=args.transport) as comm:
        rng = np.random.default_rng(0)
        w = args.width
        weights = [
            (rng.standard_normal((w, w)) / np.sqrt(w)).astype(np.float32)
            for _ in range(args.layers)
        ]
        local = np.random.default_rng(1 + comm.rank)
        acts = [local.standard_normal((args.batch, w)).astype(np.float32) for _ in weights]
        grad_out = local.standard_normal((args.batch, w)).astype(np.float32)
        grads = [np.empty((w, w), np.float32) for _ in weights]
        bucketer = Bucketer(comm, grads, bucket_bytes=int(args.bucket_mb * (1 << 20)))

        def store(i: int, dw: np.ndarray) -> None:
            grads[i][...] = dw

        def store_and_send(i: int, dw: np.ndarray) -> None:
            grads[i][...] = dw
            bucketer.ready(i)

        def compute() -> None:
            backward(weights, acts, grad_out, store)

        def comm_only() -> None:
            for i in reversed(range(len(grads))):
                bucketer.ready(i)
            bucketer.wait()

        def serial() -> None:
            backward(weights, acts, grad_out, store)
            comm_only()

        def overlap() -> None:
            backward(weights, acts, grad_out, store_and_send)
            bucketer.wait()

        modes = {"compute": compute, "comm": comm_only, "serial": serial, "overlap": overlap}
        times: dict[str, list[float]] = {m: [] for m in modes}
        results: dict[str, list[np.ndarray]] = {}
        for step in range(args.steps + 1):
            for name, fn in modes.items():
                comm.barrier()
                start = time.perf_counter()
                fn()
                elapsed = time.perf_counter() - start
                slowest = comm.allreduce(np.array([elapsed]), plait.MAX)[0]
                if step:  # the first round warms up
                    times[name].append(slowest)
                if name in ("serial", "overlap"):
                    results[name] = [g.copy() for g in grads]
        for a, b in zip(results["serial"], results["overlap"], strict=True):
            if a.tobytes() != b.tobytes():
                raise SystemExit("overlapped gradients differ from the serial ones")
        if comm.rank == 0:
            med = {m: statistics.median(t) * 1e3 for m, t in times.items()}
            mb = sum(g.nbytes for g in grads) / (1 << 20)
            print(
                f"{comm.size} ranks, {args.layers} layers of {w}x{w} ({mb:.0f} MiB of gradients), "
                f"{bucketer.num_buckets} buckets, transport {type(comm._transport).__name__}"
            )
            for m in modes:
                print(f"  {m:8s} {med[m]:8.1f} ms")
            cores = os.cpu_count() or 1
            print(summary(med["serial"], med["overlap"], med["comm"], comm.local_size, cores))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
