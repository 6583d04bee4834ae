"""The rank body of ``plait tune``: ping-pong times and this machine's γ and δ.

Run on two ranks by ``plait tune`` (``plait run -n 2 -m plait.cli.tune_rank OUT``):
ranks 0 and 1 bounce messages of growing size through the communicator's own
point-to-point calls (so α includes plait's per-message software cost, as the
executor sees it), and rank 0 times numpy's add and copy per byte. Rank 0
writes everything to the JSON file OUT, which ``plait tune`` fits α and β to
(:func:`plait.cli.tune.fit`). It lives with the command line because it is a
program that uses the public API, like any user's script, not a part of the
selector.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

import plait

__all__ = ["BUDGET", "MAX_ROUNDS", "SIZES", "main"]

#: Message sizes of the ping-pong, bytes.
SIZES = (8, 64, 512, 4 << 10, 32 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)
#: Seconds of ping-pong per size (after a warm-up), and repetitions kept at most.
BUDGET = 0.15
MAX_ROUNDS = 2000


def _one_way(comm: plait.Communicator, nbytes: int) -> float:
    """Median one-way time of ``nbytes`` between ranks 0 and 1 (half a round trip)."""
    buf = np.zeros(max(nbytes, 1), np.uint8)[:nbytes]
    peer = 1 - comm.rank
    times: list[float] = []
    for _ in range(5):  # warm-up
        _bounce(comm, buf, peer)
    start = time.perf_counter()
    while len(times) < MAX_ROUNDS:
        t = time.perf_counter()
        _bounce(comm, buf, peer)
        times.append((time.perf_counter() - t) / 2)
        done = time.perf_counter() - start > BUDGET
        # Both ranks must stop after the same round: rank 0 decides.
        flag = np.array([1 if done else 0], np.int8) if comm.rank == 0 else np.zeros(1, np.int8)
        comm.broadcast(flag, root=0)
        if flag[0]:
            break
    return statistics.median(times)


def _bounce(comm: plait.Communicator, buf: np.ndarray, peer: int) -> None:
    """One round trip of ``buf``: rank 0 sends first, the other rank answers."""
    if comm.rank == 0:
        comm.send(buf, peer)
        comm.recv(buf, peer)
    else:
        comm.recv(buf, peer)
        comm.send(buf, peer)


def _per_byte(fn: Callable[[], object], nbytes: int) -> float:
    """Best of 7 seconds per byte of ``fn``, which touches ``nbytes``."""
    best = float("inf")
    for _ in range(7):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best / nbytes


def main() -> int:
    """Measure between ranks 0 and 1; rank 0 writes the results to ``sys.argv[1]``."""
    out = sys.argv[1]
    with plait.init() as comm:
        if comm.size < 2:
            raise SystemExit("plait tune measures between two ranks; run it with -n 2")
        pairs = [(n, _one_way(comm, n)) if comm.rank < 2 else (n, 0.0) for n in SIZES]
        if comm.rank == 0:
            a = np.ones(8 << 20, np.float32)  # 32 MiB, beyond the caches
            b = np.ones_like(a)
            gamma = _per_byte(lambda: np.add(a, b, out=a), a.nbytes)
            delta = _per_byte(lambda: np.copyto(a, b), a.nbytes)
            result = {
                "transport": type(comm._transport).__name__,
                "sizes": [n for n, _ in pairs],
                "one_way_s": [t for _, t in pairs],
                "gamma": gamma,
                "delta": delta,
            }
            with open(out, "w") as f:
                json.dump(result, f)
        comm.barrier()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
