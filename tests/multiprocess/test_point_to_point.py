"""Point to point between real processes, over shared memory, TCP and both at once.

``p2p_check.py`` runs inside ``plait run`` (master-worker with ANY_SOURCE,
ordering, probe, sendrecv rings, cancel, sub-communicators); a second job
shows that a rank that dies fails only the requests that need it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_faults import plait_run as run_script
from test_multiprocess import plait_run

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.multiprocess


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("transport", "nproc"), [("shm", 3), ("shm", 4), ("tcp", 2), ("tcp", 5)])
def test_point_to_point(transport: str, nproc: int) -> None:
    res = plait_run(["-n", str(nproc), "--transport", transport, str(HERE / "p2p_check.py")])
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"p2p ok on {nproc} ranks over" in res.stdout


DEAD_PEER = """
    import os, numpy as np, plait
    comm = plait.init(timeout=60)
    r = comm.rank
    if r == 2:  # wait for the word, then die without closing anything
        comm.recv(np.empty(1), 0, tag=9)
        os._exit(0)
    if r == 1:
        comm.recv(np.empty(1), 0, tag=9)
        comm.send(np.array([11.0]), 0, tag=1)
        comm.send(np.array([12.0]), 0, tag=2)
        comm.recv(np.empty(1), 0, tag=9)
        comm.close()
        raise SystemExit(0)
    from_two = comm.irecv(np.empty(1), 2, tag=1)
    from_one = comm.irecv(np.empty(1), 1, tag=1)
    from_any = comm.irecv(np.empty(1), plait.ANY_SOURCE, tag=2)
    comm.send(np.zeros(1), 2, tag=9)
    try:
        from_two.wait()
        raise SystemExit("the receive from the dead rank completed")
    except plait.PeerLostError as exc:
        print("from_two failed:", exc, flush=True)
    assert not from_any.done(), from_any
    comm.send(np.zeros(1), 1, tag=9)
    assert from_one.wait()[0] == 11.0
    assert from_any.wait()[0] == 12.0 and from_any.status.source == 1, from_any.status
    comm.send(np.zeros(1), 1, tag=9)
    try:
        comm.recv(np.empty(1), plait.ANY_SOURCE, plait.ANY_TAG)
        raise SystemExit("a receive from nobody completed")
    except plait.PeerLostError as exc:
        print("any source failed:", exc, flush=True)
    print("dead peer ok", flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["shm", "tcp", "hybrid"])
def test_a_dead_peer_fails_only_the_requests_that_need_it(tmp_path: Path, transport: str) -> None:
    res, elapsed = run_script(["-n", "3", "--transport", transport], DEAD_PEER, tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert "dead peer ok" in res.stdout, out[-3000:]
    assert "from_two failed: rank 0: irecv from rank 2 (tag 1):" in res.stdout, out[-3000:]
    assert "any source failed:" in res.stdout, out[-3000:]
    assert elapsed < 50, f"took {elapsed:.1f} s: a lost peer was noticed late"
