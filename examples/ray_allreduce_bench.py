"""Ray all-reduce through plait against the same through Ray's gloo group, side by side.

Starts a local Ray (loopback, no dashboard) with ``--ranks`` actors; every
actor joins a ``backend="plait"`` group and a ``backend="gloo"`` group (Ray's
CPU backend, torch.distributed's gloo underneath) and times
``ray.util.collective.allreduce`` of float32 arrays from 8 B to 64 MiB,
in place, as Ray users call it. Each size runs a few warm-up calls, then
``--reps`` timed calls (fewer for the large sizes, to bound the run); the
table shows rank 0's median per call, in microseconds.

Run (needs ``pip install 'plait[ray]'`` and torch)::

    python examples/ray_allreduce_bench.py --ranks 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np
import ray

SIZES = [8 << (3 * i) for i in range(8)] + [64 << 20]  # 8 B, 64 B, ..., 16 MiB, 64 MiB


@ray.remote(num_cpus=0)
class Rank:
    """One member of both groups."""

    def __init__(self, rank: int, size: int) -> None:
        import ray.util.collective as col

        import plait.ray  # noqa: F401 - registers backend "plait"

        self.rank = rank
        col.init_collective_group(size, rank, backend="plait", group_name="plait")
        col.init_collective_group(size, rank, backend="gloo", group_name="gloo")

    def median_us(self, group: str, nbytes: int, reps: int) -> float:
        """Median microseconds of one in-place all-reduce of ``nbytes`` bytes."""
        import ray.util.collective as col

        x = np.ones(max(nbytes // 4, 1), np.float32)
        if group == "gloo":
            import torch

            x = torch.from_numpy(x)  # what Ray's gloo group runs on (numpy is converted too)
        for _ in range(3):
            col.allreduce(x, group_name=group)
        times = []
        for _ in range(reps):
            col.barrier(group_name=group)
            start = time.perf_counter()
            col.allreduce(x, group_name=group)
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e6


def _size(nbytes: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def main(argv: list[str] | None = None) -> None:
    """Print the side-by-side table (markdown)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2, help="actors in each group")
    parser.add_argument("--reps", type=int, default=50, help="timed calls per size (at most)")
    args = parser.parse_args(argv)
    ray.init(num_cpus=2, _node_ip_address="127.0.0.1", include_dashboard=False)
    try:
        actors = [Rank.remote(r, args.ranks) for r in range(args.ranks)]
        print(f"| size | plait (µs) | gloo (µs) | gloo / plait |  ({args.ranks} actors, median)")
        print("|---:|---:|---:|---:|")
        for nbytes in SIZES:
            reps = max(5, min(args.reps, (256 << 20) // max(nbytes, 1)))
            got: dict[str, Any] = {}
            for group in ("plait", "gloo"):
                calls = [a.median_us.remote(group, nbytes, reps) for a in actors]
                got[group] = ray.get(calls, timeout=600)[0]
            ratio = got["gloo"] / got["plait"]
            print(f"| {_size(nbytes)} | {got['plait']:.0f} | {got['gloo']:.0f} | {ratio:.2f} |")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
