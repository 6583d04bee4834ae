"""Loop a few-MB allreduce; one rank SIGKILLs itself partway through.

``python allreduce_until_killed.py VICTIM ITERATIONS [ALGORITHM]``: rank
VICTIM prints ``victim rank V dies at <time.time()>`` and kills itself with
SIGKILL before iteration ITERATIONS. The other ranks report the error their
allreduce raises (``rank R: PeerLostError: ...``) and exit 3 (4 for another
CommError); a rank that finishes the loop without noticing exits 5.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

import plait


def main() -> int:
    victim, die_at = int(sys.argv[1]), int(sys.argv[2])
    algorithm = sys.argv[3] if len(sys.argv) > 3 else "auto"
    comm = plait.init(timeout=30)
    x = np.ones(1 << 20, np.float32)  # 4 MB
    for i in range(die_at + 1000):
        if comm.rank == victim and i == die_at:
            # Behaviour under test, not synchronisation: the victim lingers so that the others
            # are already blocked in this iteration's allreduce, waiting for it, when it dies.
            time.sleep(1.0)
            print(f"victim rank {comm.rank} dies at {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            y = comm.allreduce(x, algorithm=algorithm)
        except plait.PeerLostError as exc:
            print(f"rank {comm.rank}: PeerLostError: {exc}", flush=True)
            return 3
        except plait.CommError as exc:
            print(f"rank {comm.rank}: {type(exc).__name__}: {exc}", flush=True)
            return 4
        if y[0] != comm.size:
            print(f"rank {comm.rank}: iteration {i}: wrong sum {y[0]}", flush=True)
            return 6
    print(f"rank {comm.rank}: finished without noticing the victim", flush=True)
    return 5


if __name__ == "__main__":
    sys.exit(main())
