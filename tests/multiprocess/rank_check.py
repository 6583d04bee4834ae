"""Run inside every rank by ``plait run``: every collective x algorithm against the numpy reference.

Each rank regenerates all ranks' inputs from their seeds, so it can compute the
reference itself; it checks its own results exactly, and all ranks compare a
digest of each replicated result to prove the bits are identical everywhere.
Exits non-zero (with the failing case named) on the first wrong result.
"""

from __future__ import annotations

import os
import sys
import zlib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: cases.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from test_collectives import REPLICATED, build_cases

import plait
from cases import bits, same
from plait.algos._registry import COLLECTIVES, specs
from plait.testing import reference


def main() -> int:
    """Check every case; return the exit code."""
    mode = sys.argv[1] if len(sys.argv) > 1 else "full"
    if len(sys.argv) > 2:  # emulated hosts, one name per rank: "a,a,b,b"
        os.environ["PLAIT_HOST"] = sys.argv[2].split(",")[int(os.environ["PLAIT_RANK"])]
    checked = 0
    with plait.init(timeout=60) as comm:
        for c in COLLECTIVES:
            for spec in specs(c):
                if spec.needs_fabric:  # no aggregating switches between processes
                    continue
                # One-sided: where all ranks share a window; host_windows: one per host.
                host_windows = getattr(comm._transport, "host_window_bytes", 0)
                if (
                    spec.needs_window
                    and not comm._window
                    and not (spec.host_windows and host_windows)
                ):
                    continue
                cases = build_cases(spec, comm.size, big=mode == "quick")
                for case in cases:
                    x = case.make(comm.rank)
                    got = case.call(comm, x)
                    inputs = [case.make(r) for r in range(comm.size)]
                    want = reference(c, inputs, op=case.op, root=case.root)[comm.rank]
                    if not same(got, want):
                        print(
                            f"rank {comm.rank}: {c}/{spec.name} {case.name}: got {got!r}, "
                            f"want {want!r}",
                            flush=True,
                        )
                        return 1
                    if c in REPLICATED:
                        digest = np.array([zlib.crc32(bits(got))], np.int64)
                        digests = comm.allgather(digest)
                        if not np.all(digests == digests[0]):
                            print(f"{c}/{spec.name} {case.name}: ranks differ in bits", flush=True)
                            return 1
                    checked += 1
        comm.barrier()
        if comm.rank == 0:
            print(f"ok: {checked} calls on {comm.size} ranks over {type(comm._transport).__name__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
