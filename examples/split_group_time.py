"""Time allreduce on a group made by ``comm.split`` next to the same call on the world.

A split's group has a shared-memory window of its own (docs/transport.md, Note [split
windows]); this prints, per size, the slowest rank's median time of an in-place
float32 SUM allreduce on the group and on the world, taken in turns, and then what a
split costs (split, one 8-byte allreduce, close)::

    plait run -n 2 python examples/split_group_time.py

Numbers and what they showed: docs/performance.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

import numpy as np

import plait


def main() -> None:
    """Time the calls and print a table on rank 0."""
    comm = plait.init()

    def slowest_median(fn: Callable[[], object], n: int) -> float:
        times = []
        for _ in range(n):
            comm.barrier()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return float(comm.allreduce(np.array([np.median(times)]), plait.MAX)[0])

    group = comm.split(0)
    rows = []
    for nbytes in (256 << 10, 1 << 20, 4 << 20, 16 << 20):
        x = np.ones(nbytes // 4, np.float32)
        calls = 200 if nbytes <= 1 << 20 else 50
        for name, c in (("group", group), ("world", comm)):
            for _ in range(3):  # the group's first large call reserves its memory
                c.allreduce(x, out=x)
            call = partial(c.allreduce, x, out=x)
            rows.append((name, nbytes, slowest_median(call, calls)))
    group.close()

    def split_once() -> None:
        g = comm.split(0)
        g.allreduce(np.ones(2, np.float32))
        g.close()

    for _ in range(3):
        split_once()
    split = slowest_median(split_once, 30)
    if comm.rank == 0:
        for name, nbytes, t in rows:
            print(f"{name:6s} {nbytes >> 10:6d} KiB {t * 1e6:9.1f} us")
        print(f"split, allreduce, close: {split * 1e3:.2f} ms")
    comm.close()


if __name__ == "__main__":
    main()
