"""Rank VICTIM dies at its start; the others report what their ``plait.init`` raised.

``python dies_in_init.py VICTIM [REPORTERS]``: rank VICTIM SIGKILLs itself before it calls
``plait.init``; every other rank prints ``rank R: lost L in init: <message>``
for the :class:`plait.PeerLostError` its ``plait.init`` raises (and exits 0),
or ``rank R: init ended without noticing`` (and exits 5), once every other
rank has printed its line.
"""

from __future__ import annotations

import os
import signal
import sys

import plait
from plait.rendezvous.url import store_from_url


def main() -> int:
    rank = int(os.environ["PLAIT_RANK"])
    if rank == int(sys.argv[1]):
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        plait.init(timeout=300)  # longer than the test may run: the loss must end it
    except plait.PeerLostError as exc:
        print(f"rank {rank}: lost {exc.lost_rank} in init: {exc}", flush=True)
        code = 0
    else:
        print(f"rank {rank}: init ended without noticing", flush=True)
        code = 5
    # The store lives as long as host 0's launcher, which ends with its ranks: they stay
    # until every survivor has reported, so that none loses the store before it looks.
    # (argv[2]: how many report, where the victim's host stops its other ranks)
    survivors = int(sys.argv[2]) if len(sys.argv) > 2 else int(os.environ["PLAIT_SIZE"]) - 1
    with store_from_url(os.environ["PLAIT_STORE"], rank=rank, timeout=60) as store:
        if store.add("test/reported", 1) == survivors:
            store.set("test/all-reported", b"1")
        store.wait(["test/all-reported"])
    return code


if __name__ == "__main__":
    sys.exit(main())
