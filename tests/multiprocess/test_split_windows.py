"""Split communicators over shared memory in real processes: their own windows, one-sided calls.

A group made by ``comm.split`` gets a window of its own (Note [split windows] in
``plait.transport.shm.window``), so its small calls take the arena algorithms as the
world's do. The ranks are started here with a store served by this process, not by
``plait run``: its launcher stops every rank when one is killed, and removes the job's
files from ``/dev/shm`` on the way out, which would hide a leak.
"""

from __future__ import annotations

import glob
import os
import secrets
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from by_hand import collect
from plait.rendezvous.tcp_store import TCPStoreServer
from plait.transport.window import GROUP_WINDOW_BYTES

pytestmark = [
    pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm (Linux)"),
    pytest.mark.timeout(60),
]

ROOT = Path(__file__).resolve().parents[2]
SECRET = secrets.token_hex(16)

PROLOGUE = """\
import glob, json, os, signal, threading, time
import numpy as np
import plait

JOB = os.environ["PLAIT_JOB_ID"]

def report(**fields):
    print("RESULT " + json.dumps(fields), flush=True)

def leftovers():
    return glob.glob(f"/dev/shm/plait-{JOB}-*")
"""


@pytest.fixture
def server() -> Iterator[TCPStoreServer]:
    s = TCPStoreServer("127.0.0.1", 0, secret=SECRET.encode())
    yield s
    s.close()


def run_job(script: str, n: int, server: TCPStoreServer, tmp_path: Path) -> list[dict | None]:
    """``n`` ranks of ``script`` over shared memory; each rank's RESULT (None if none).

    Afterwards none of the job's files may be in /dev/shm, whatever became of the ranks.
    """
    job = f"sw{os.getpid()}{secrets.token_hex(3)}"
    path = tmp_path / "rank.py"
    path.write_text(PROLOGUE + textwrap.dedent(script))
    procs = []
    for r in range(n):
        env = {
            **os.environ,
            "PLAIT_SECRET": SECRET,
            "PLAIT_RANK": str(r),
            "PLAIT_SIZE": str(n),
            "PLAIT_LOCAL_RANK": str(r),
            "PLAIT_STORE": f"tcp://127.0.0.1:{server.port}",
            "PLAIT_TRANSPORT": "shm",
            "PLAIT_JOB_ID": job,
            "PLAIT_DUMP_DIR": str(tmp_path / "dumps"),  # the failures' flight recorder dumps
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(path)],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results, logs = collect(procs, 45)
    assert glob.glob(f"/dev/shm/plait-{job}-*") == [], logs
    run_job.logs = logs  # type: ignore[attr-defined]
    return results


COLLECTIVES = """
comm = plait.init(timeout=30)
rank = comm.rank
pair = comm.split(rank // 2)                      # {0, 1} and {2, 3}
trio = comm.split(0 if rank < 3 else None)        # {0, 1, 2}; rank 3 in none
inner = trio.split(trio.rank % 2) if trio else None   # a split of a split: {0, 2} and {1}
groups = [("pair", pair)] + ([("trio", trio)] if trio else [])
if inner is not None and inner.size > 1:
    groups.append(("inner", inner))
windows = {name: g.window_bytes for name, g in groups}
windows["alone"] = inner.window_bytes if inner is not None and inner.size == 1 else None
comm.barrier()  # every rank has made and mapped its groups' segments
after_split = leftovers()

def data(r, count, salt):  # small integers: sums are exact whatever the order
    return np.random.default_rng(1000 * r + salt).integers(-50, 50, count).astype(np.float32)

checked = 0
for count in (2, 1024):                           # 8 B and 4 KiB of float32
    for salt, name in enumerate(("pair", "trio", "inner")):
        x = data(rank, count, salt)
        g = dict(groups).get(name)
        if g is not None:
            members = g.allgather(np.array([rank], np.int64)).ravel().tolist()
            xs = [data(q, count, salt) for q in members]
            np.testing.assert_array_equal(g.allreduce(x), sum(xs))
        # The parent's calls interleave with the group's, each with its own epochs.
        np.testing.assert_array_equal(
            comm.allreduce(x), sum(data(q, count, salt) for q in range(comm.size)))
        if g is not None:
            b = x.copy()
            g.broadcast(b, root=g.size - 1)
            np.testing.assert_array_equal(b, xs[-1])
            np.testing.assert_array_equal(g.allgather(x), np.stack(xs))
        comm.barrier()
        if g is not None:
            y = np.concatenate([x] * g.size)
            np.testing.assert_array_equal(g.reduce_scatter(y), sum(xs))
            g.barrier()
            checked += 5
algorithms = sorted({c["algorithm"] for _, g in groups for c in g._runner.recorder.snapshot()})

# Calls larger than the memory a group's window reserved at first run one-sided too: it
# grows at the first (Note [split windows]), and a call larger than it goes in pieces.
reserved = [pair._transport.window._reserved]
big_algorithm = []
for count in (1 << 18, 1 << 20, 1 << 18):  # 1 MiB, 4 MiB, 1 MiB
    big = pair.allreduce(np.full(count, float(rank), np.float32))
    np.testing.assert_array_equal(big, np.full(count, float(4 * (rank // 2) + 1), np.float32))
    big_algorithm.append(pair._runner.recorder.snapshot()[-1]["algorithm"])
    reserved.append(pair._transport.window._reserved)

# Ranks in different calls: MismatchError on both, from the digests in the window.
try:
    pair.allreduce(np.ones(2 + pair.rank, np.float32))
    mismatch = None
except plait.MismatchError as exc:
    mismatch = "MismatchError"
for _, g in groups:
    g.close()
comm.barrier()
report(rank=rank, windows=windows, world=comm.window_bytes, checked=checked,
       algorithms=algorithms, big_algorithm=big_algorithm, reserved=reserved, mismatch=mismatch,
       after_split=after_split, after_close=leftovers())
comm.close()
"""


def test_groups_of_two_and_three_run_one_sided_and_match_numpy(
    server: TCPStoreServer, tmp_path: Path
) -> None:
    results = run_job(COLLECTIVES, 4, server, tmp_path)
    assert all(r is not None for r in results), run_job.logs  # type: ignore[attr-defined]
    for r, res in enumerate(results):
        assert res is not None
        world = res["world"]
        assert world > 0
        group = world  # a group's window is as large as the world's, reserved as needed
        expected = {"pair": group, "alone": None}
        if r < 3:
            expected["trio"] = group
            expected.update({"inner": group} if r in (0, 2) else {"alone": 0})
        assert res["windows"] == expected, res
        assert res["checked"] == 5 * 2 * (len(expected) - 1)
        assert res["algorithms"], res
        assert all(a.startswith("arena") for a in res["algorithms"]), res
        assert res["big_algorithm"] == ["arena"] * 3, res
        # Reserved at first, grown by the first large call only, within the world's size.
        first, grown, *later = res["reserved"]
        assert first == GROUP_WINDOW_BYTES < grown <= world, res
        assert later == [grown] * 2, res
        assert res["mismatch"] == "MismatchError"
        assert res["after_split"] == []
        assert res["after_close"] == []


KILL = """
comm = plait.init(timeout=30)
rank = comm.rank
trio = comm.split(0 if rank < 3 else None)
if trio is None:  # rank 3: nothing to do with it
    report(rank=rank)
    comm.close()
    raise SystemExit(0)
x = np.ones(2, np.float32)
for _ in range(50):
    assert trio.allreduce(x)[0] == 3
algorithm = trio._runner.recorder.snapshot()[-1]["algorithm"]
trio.barrier()
if rank == 1:  # die in the middle of the next calls, from another thread
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGKILL)).start()
start = time.monotonic()
try:
    while True:
        trio.allreduce(x)
except plait.CommError as exc:
    error, message = type(exc).__name__, str(exc)
report(rank=rank, algorithm=algorithm, error=error, message=message[:300],
       seconds=time.monotonic() - start, left=leftovers())
comm.close()
"""


def test_kill_9_of_a_group_member_fails_the_others_fast(
    server: TCPStoreServer, tmp_path: Path
) -> None:
    results = run_job(KILL, 4, server, tmp_path)
    logs = run_job.logs  # type: ignore[attr-defined]
    assert results[1] is None, logs
    assert results[3] == {"rank": 3}, logs
    for res in (results[0], results[2]):
        assert res is not None, logs
        assert res["algorithm"].startswith("arena"), res
        assert res["error"] == "PeerLostError", res
        assert res["seconds"] < 10, res
        assert res["left"] == [], res


NO_ROOM = """
comm = plait.init(timeout=30)
rank = comm.rank
pair = comm.split(0)
x = np.full(1 << 18, float(rank), np.float32)  # 1 MiB: more than the group reserved at first
if rank == 1:  # /dev/shm is full for this rank from now on
    def full(fd, offset, length):
        raise OSError(28, "No space left on device")
    os.posix_fallocate = full
start = time.monotonic()
try:
    pair.allreduce(x)
    error = message = None
except plait.CommError as exc:
    error, message = type(exc).__name__, str(exc)
report(rank=rank, error=error, message=message[:400], seconds=time.monotonic() - start,
       world=comm.allreduce(np.ones(2, np.float32)).tolist())
comm.close()
"""


def test_a_rank_with_no_room_to_grow_its_group_window_fails_the_call_everywhere(
    server: TCPStoreServer, tmp_path: Path
) -> None:
    """The growth is local (Note [split windows]): where the OS refuses it, that rank raises
    why, and its peer raises at once rather than waiting out the timeout."""
    results = run_job(NO_ROOM, 2, server, tmp_path)
    logs = run_job.logs  # type: ignore[attr-defined]
    assert all(r is not None for r in results), logs
    mine, peer = results[1], results[0]
    assert mine["error"] == "TransportError", mine
    assert "no room to reserve" in mine["message"], mine
    assert "free shared memory" in mine["message"], mine
    assert peer["error"] is not None, peer
    assert "rank 1" in peer["message"], peer
    assert peer["seconds"] < 10, peer
    assert peer["world"] == mine["world"] == [2.0, 2.0]  # the world is unharmed
