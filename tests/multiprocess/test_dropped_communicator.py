"""A communicator with recovery that its program drops without ``close()`` is let go of.

``plait.init`` (recovery on, the default) gives each communicator a watcher thread over the
store it met through (Note [store lifetime] in ``plait._init``). Once the last reference to
the communicator and to the groups split from it goes away, the watcher stops and the
transport and store are let go of, as ``close()`` would (Note [dropped communicators] in
``plait._recovery``): a loop of ``init`` and ``del`` keeps no thread or descriptor, a group
still referenced keeps working after its parent is dropped, and a peer sees the dropped
rank as one that closed. The ranks are started here with a store served by this process.
"""

from __future__ import annotations

import glob
import os
import secrets
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from by_hand import collect, start_by_hand
from plait.rendezvous.tcp_store import TCPStoreServer

pytestmark = [
    pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc (Linux)"),
    pytest.mark.timeout(90),
]

SECRET = secrets.token_hex(16)

PROLOGUE = """\
import gc, json, os, threading, time
import numpy as np
import plait

def report(**fields):
    print("RESULT " + json.dumps(fields), flush=True)

def watchers():
    return [t for t in threading.enumerate() if t.name.startswith("plait-watch")]

def settle(seconds=10.0):
    # A dropped communicator's watcher lets go of everything, then ends: wait for that.
    deadline = time.monotonic() + seconds
    for t in watchers():
        t.join(max(deadline - time.monotonic(), 0.0))

def descriptors():
    return len(os.listdir("/proc/self/fd"))
"""


@pytest.fixture
def server() -> Iterator[TCPStoreServer]:
    s = TCPStoreServer("127.0.0.1", 0, secret=SECRET.encode())
    yield s
    s.close()


def run_job(
    script: str, n: int, server: TCPStoreServer, tmp_path: Path, transport: str
) -> list[dict]:
    """``n`` ranks of ``script``; each rank's RESULT. None of the job's files stay in /dev/shm."""
    job = f"dc{os.getpid()}{secrets.token_hex(3)}"
    path = tmp_path / "rank.py"
    path.write_text(PROLOGUE + textwrap.dedent(script))
    extra = {"PLAIT_JOB_ID": job, "PLAIT_RECOVERY": "1"}  # recovery on, as by default
    procs = start_by_hand(path, n, server, SECRET, transport, tmp_path / "dumps", extra)
    results, text = collect(procs, 75)
    assert all(r is not None for r in results), text
    assert glob.glob(f"/dev/shm/plait-{job}-*") == [], text
    return results


LOOP = """
before = descriptors(), threading.active_count()
rounds = []
for i in range(4):
    comm = plait.init(timeout=30)
    x = np.full(8, float(comm.rank + 1))
    assert comm.allreduce(x)[0] == 3.0
    if i == 2:
        # A group still referenced keeps the shared transport (and recovery) open.
        group = comm.split(0)
        del comm
        gc.collect()
        kept = len(watchers())
        assert group.allreduce(x)[0] == 3.0
        del group
    else:
        del comm
    gc.collect()
    settle()
    rounds.append([len(watchers()), descriptors(), threading.active_count()])
report(before=list(before), rounds=rounds, kept=kept)
"""


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_dropped_communicators_keep_no_thread_or_descriptor(
    server: TCPStoreServer, tmp_path: Path, transport: str
) -> None:
    if transport == "shm" and not os.path.isdir("/dev/shm"):
        pytest.skip("needs /dev/shm")
    for res in run_job(LOOP, 2, server, tmp_path, transport):
        fds, threads = res["before"]
        assert res["rounds"] == [[0, fds, threads]] * 4, res
        assert res["kept"] == 1, res  # the parent dropped, its group alive: not let go


PEER = """
from plait.errors import CommError
from plait.rendezvous.tcp_store import TCPStore

host, port = os.environ["PLAIT_STORE"][len("tcp://"):].rsplit(":", 1)
side = TCPStore(host, int(port), timeout=30)
comm = plait.init(timeout=30)
comm.allreduce(np.ones(4))
if comm.rank == 1:
    del comm
    gc.collect()
    settle()
    side.set("test/dropped", b"1")
    side.wait(["test/agreed"])  # this process stays alive (and running) meanwhile
    report(watchers=len(watchers()))
else:
    side.wait(["test/dropped"])
    start = time.monotonic()
    try:
        got = comm.agree(1, timeout=10)
        outcome = list(got.ranks)
    except CommError as exc:
        outcome = type(exc).__name__
    side.set("test/agreed", b"1")
    report(outcome=outcome, seconds=time.monotonic() - start)
    comm.close()
side.close()
"""


def test_a_peer_sees_a_dropped_communicator_closed(server: TCPStoreServer, tmp_path: Path) -> None:
    kept, dropped = run_job(PEER, 2, server, tmp_path, "tcp")
    assert dropped == {"watchers": 0}
    # A running rank of this machine counts as failed once it closed (Note [busy ranks]).
    assert kept["outcome"] == [0], kept
    assert kept["seconds"] < 5, kept


QUEUED = """
def start():
    comm = plait.init(timeout=30)
    x = np.full(1 << 12, comm.rank + 1.0)
    if comm.rank == 1:
        time.sleep(1)  # not synchronising: rank 0's call is queued while rank 1 is late
    return comm.allreduce(x, async_op=True)

work = start()  # its communicator dropped, the call queued
gc.collect()
try:
    report(sum=float(work.wait()[0]))
except plait.CommError as exc:
    report(sum=f"{type(exc).__name__}: {exc}")
gc.collect()
settle()
report(sum=float(work.wait()[0]), watchers=len(watchers()))
"""


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_the_calls_queued_on_a_dropped_communicator_finish_first(
    server: TCPStoreServer, tmp_path: Path, transport: str
) -> None:
    # The recovery's let-go closed the transport at once: the call failed with ClosedError,
    # where close() lets the queued calls finish first.
    for res in run_job(QUEUED, 2, server, tmp_path, transport):
        assert res == {"sum": 3.0, "watchers": 0}, res
