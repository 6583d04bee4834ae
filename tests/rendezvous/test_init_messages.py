"""``plait.init`` says which ranks never arrived, and keeps one deadline for all its phases."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

import plait
from plait.rendezvous.store import StoreTimeout
from plait.rendezvous.tcp_store import TCPStoreServer

RANK = """
import sys, time, plait
start = time.monotonic()
try:
    plait.init(rank=int(sys.argv[1]), size=3, store=sys.argv[2], timeout=1.5)
except plait.CommError as exc:
    print(f"{type(exc).__name__}|{time.monotonic() - start:.1f}|{exc}", flush=True)
"""


@pytest.mark.multiprocess
def test_a_rank_that_never_arrives_is_named_not_its_store_key() -> None:
    # Ranks 0 and 1 of 3 meet; rank 2 never comes (killed during start-up, say).
    with TCPStoreServer("127.0.0.1", 0) as server:
        url = f"tcp://127.0.0.1:{server.port}"
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", RANK, str(r), url], stdout=subprocess.PIPE, text=True
            )
            for r in (0, 1)
        ]
        outs = [p.communicate(timeout=60)[0] for p in procs]
    for r, out in enumerate(outs):
        kind, took, msg = out.strip().split("|", 2)
        assert kind == "StoreTimeout", out
        assert msg.startswith(
            f"rank {r} of 3: plait.init timed out after 1.5 s waiting for rank(s) [2]"
        ), out
        assert "host/" not in msg  # no raw store key
        assert float(took) < 10  # one deadline (1.5 s), not one per phase


@pytest.mark.parametrize("timeout", [0.5])
def test_init_keeps_one_deadline(timeout: float) -> None:
    # A single rank of 2 waits for its peer: init ends at its timeout, not later.
    server = TCPStoreServer("127.0.0.1", 0)
    try:
        start = time.monotonic()
        with pytest.raises(StoreTimeout, match=r"waiting for rank\(s\) \[1\]"):
            plait.init(rank=0, size=2, store=f"tcp://127.0.0.1:{server.port}", timeout=timeout)
        assert time.monotonic() - start < timeout + 5
    finally:
        server.close()


@pytest.mark.multiprocess
def test_ranks_told_different_job_sizes_say_so() -> None:
    """Two launchers given different -n numbered their ranks from different sizes (node 1's
    only rank was rank 1 of 2, node 0's ranks 0 and 1 of 4): node 1's rank failed with "the
    connection broke; is the store server still running?", node 0's waited out its timeout."""
    sized = RANK.replace("size=3", "size=int(sys.argv[3])").replace("timeout=1.5", "timeout=4")
    with TCPStoreServer("127.0.0.1", 0) as server:
        url = f"tcp://127.0.0.1:{server.port}"
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", sized, str(r), url, str(n)],
                stdout=subprocess.PIPE,
                text=True,
            )
            for r, n in ((0, 4), (1, 2))
        ]
        outs = [p.communicate(timeout=60)[0] for p in procs]
    kind, took, msg = outs[1].strip().split("|", 2)
    assert kind == "RendezvousError", outs
    assert msg.startswith(
        "rank 1 of 2: rank 0 is in a job of 4 ranks, this rank in one of 2: the ranks' "
        "launchers disagree on the job's size"
    ), outs
    assert float(took) < 3  # once rank 0 is there, not at its timeout
    assert outs[0].startswith("StoreTimeout|"), outs  # ranks 2 and 3 never came
