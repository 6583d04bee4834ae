"""Rank VICTIM dies at its start; the others report what their ``plait.init`` raised.

``python dies_in_init.py VICTIM``: rank VICTIM SIGKILLs itself before it calls
``plait.init``; every other rank prints ``rank R: lost L in init: <message>``
for the :class:`plait.PeerLostError` its ``plait.init`` raises (and exits 0),
or ``rank R: init ended without noticing`` (and exits 5).
"""

from __future__ import annotations

import os
import signal
import sys

import plait


def main() -> int:
    rank = int(os.environ["PLAIT_RANK"])
    if rank == int(sys.argv[1]):
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        plait.init(timeout=300)  # longer than the test may run: the loss must end it
    except plait.PeerLostError as exc:
        print(f"rank {rank}: lost {exc.lost_rank} in init: {exc}", flush=True)
        return 0
    print(f"rank {rank}: init ended without noticing", flush=True)
    return 5


if __name__ == "__main__":
    sys.exit(main())
