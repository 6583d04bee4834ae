"""``hierarchical_arena`` and ``cascade_arena`` over emulated hosts: each host's window,
messages across; faults.

Ranks get a host from PLAIT_HOST (set per rank by the script's prologue), so
that one machine runs a hybrid transport: shared memory and a window within each
emulated host, TCP across. The results of every collective are checked in
test_multiprocess.py (rank_check.py runs every algorithm); here what can go wrong.
"""

from __future__ import annotations

import pytest
from test_faults import plait_run

#: Ranks 0 and 2 on host a, 1 and 3 on host b, 4 alone on host c (a job of 5).
HOSTS = "import os\nos.environ['PLAIT_HOST'] = 'ababc'[int(os.environ['PLAIT_RANK'])]\n"


def run(script: str, tmp_path, n: int = 4, timeout: float = 90, args=()):  # type: ignore[no-untyped-def]
    return plait_run(["-n", str(n), "--tag-output", *args], HOSTS + script, tmp_path, timeout)


def test_the_job_runs_over_a_window_per_host(tmp_path) -> None:  # type: ignore[no-untyped-def]
    script = """
import os, numpy as np, plait
os.environ["PLAIT_ALGO"] = "allreduce:hierarchical_arena:0-1K"
with plait.init(timeout=60) as comm:
    t = comm._transport
    n = (3 << 20) // 4 + 5  # a few pieces of the 2 MiB window
    x = np.arange(n, dtype=np.float32) * (comm.rank + 1)
    y = comm.allreduce(x, algorithm="hierarchical_arena")
    want = np.arange(n, dtype=np.float32) * sum(r + 1 for r in range(comm.size))
    assert np.array_equal(y, want)
    comm.allreduce(x, out=x, algorithm="hierarchical_arena")
    assert np.array_equal(x, want)
    # Pipelined: two pieces in the window at once, so twice as many pieces.
    x = np.arange(n, dtype=np.float32) * (comm.rank + 1)
    assert np.array_equal(comm.allreduce(x, algorithm="cascade_arena"), want)
    comm.allreduce(x, out=x, algorithm="cascade_arena")
    assert np.array_equal(x, want)
    # Named in PLAIT_ALGO, auto runs it where every host of several ranks has a window.
    z = comm.allreduce(np.arange(9.0))
    assert np.array_equal(z, np.arange(9.0) * comm.size)
    assert comm._auto[("allreduce", 72, True, False, True)].name == "hierarchical_arena"
    window = t.host_window
    print("ok", type(t).__name__, window is not None and window.members, comm._runner.epoch,
          flush=True)
"""
    res, _ = run(script, tmp_path, n=5)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    lines = sorted(res.stdout.splitlines())
    assert lines == [
        "[0]: ok HybridTransport (0, 2) 5",
        "[1]: ok HybridTransport (1, 3) 5",
        "[2]: ok HybridTransport (0, 2) 5",
        "[3]: ok HybridTransport (1, 3) 5",
        "[4]: ok HybridTransport False 0",  # alone on its host: no window, no epochs
    ], res.stdout + res.stderr[-2000:]


@pytest.mark.parametrize("algo", ["hierarchical_arena", "cascade_arena"])
def test_kill_9_mid_call_fails_the_others_fast(tmp_path, algo: str) -> None:  # type: ignore[no-untyped-def]
    script = f"""
import os, signal, threading, time, numpy as np, plait
comm = plait.init(timeout=120)
x = np.ones(1 << 20, np.float32)
comm.allreduce(x, algorithm="{algo}")
if comm.rank == 2:  # die in the middle of a later call, from another thread
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
start = time.monotonic()
try:
    while True:
        comm.allreduce(x, algorithm="{algo}")
except plait.PeerLostError as exc:
    print(f"lost a peer after {{time.monotonic() - start:.1f}}s: {{exc}}", flush=True)
    raise SystemExit(9)
"""
    # With recovery on, the launcher leaves the others running: they must find out themselves.
    res, elapsed = run(script, tmp_path, args=["--enable-recovery"])
    assert res.returncode != 0
    assert "rank 2 was killed by SIGKILL" in res.stderr, res.stderr[-2000:]
    lost = sorted(line.split(":")[0] for line in res.stdout.splitlines() if "lost a peer" in line)
    assert lost == ["[0]", "[1]", "[3]"], res.stdout + res.stderr[-2000:]
    assert elapsed < 40


def test_a_skipped_call_times_out_naming_the_absent_rank(tmp_path) -> None:  # type: ignore[no-untyped-def]
    script = """
import time, numpy as np, plait
comm = plait.init()
comm.allreduce(np.ones(8), algorithm="hierarchical_arena")
if comm.rank == 2:
    # Behaviour under test, not synchronisation: rank 2 skips the next call and stays
    # alive and silent well past the others' 2 s timeout.
    time.sleep(8)
    raise SystemExit(0)
try:
    comm.allreduce(np.ones(8), algorithm="hierarchical_arena", timeout=2)
except plait.CollectiveTimeout as exc:
    print("timeout:", exc, flush=True)
    raise SystemExit(4)
"""
    res, _ = run(script, tmp_path)
    assert res.returncode == 4, res.stdout + res.stderr[-2000:]
    # Rank 0 shares host a with rank 2: it waits on rank 2's window.
    assert (
        "[0]: timeout: rank 0: allreduce (hierarchical_arena, call #1) timed out waiting for "
        "rank(s) [2]" in res.stdout
    ), res.stdout


def test_mismatched_counts_fail_on_every_rank(tmp_path) -> None:  # type: ignore[no-untyped-def]
    script = """
import numpy as np, plait
comm = plait.init(timeout=30)
try:
    comm.allreduce(np.ones(10 + comm.rank), algorithm="hierarchical_arena")
except plait.MismatchError as exc:
    print(f"mismatch on {comm.rank}", flush=True)
else:
    raise SystemExit("no error")
comm.close()
"""
    res, _ = run(script, tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr[-2000:]
    assert sorted(res.stdout.splitlines()) == [f"[{r}]: mismatch on {r}" for r in range(4)]


def test_a_mismatch_found_in_a_host_window_reaches_the_other_host(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # Rank 2 (host a) calls with float32, the others with float64: ranks 0 and 2 find it in
    # host a's window; host b's ranks wait for their messages and hear of it from them.
    # No rank exits before every rank has raised (an exit would say enough by itself).
    flags = tmp_path / "flags"
    flags.mkdir()
    script = f"""
import os, time, numpy as np, plait
comm = plait.init(timeout=60)
x = np.ones(1000, np.float32 if comm.rank == 2 else np.float64)
start = time.monotonic()
try:
    comm.allreduce(x, algorithm="hierarchical_arena")
except plait.MismatchError:
    print(f"mismatch after {{time.monotonic() - start:.1f}}", flush=True)
open(os.path.join({str(flags)!r}, str(comm.rank)), "w").close()
deadline = time.monotonic() + 60  # alive until every rank has raised
while len(os.listdir({str(flags)!r})) < comm.size and time.monotonic() < deadline:
    time.sleep(0.05)
"""
    res, _ = run(script, tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr[-2000:]
    found = sorted(line.split(":", 1) for line in res.stdout.splitlines() if "mismatch" in line)
    assert [f[0] for f in found] == ["[0]", "[1]", "[2]", "[3]"], res.stdout
    assert all(float(f[1].split()[-1]) < 10 for f in found), res.stdout  # not the 60 s timeout
