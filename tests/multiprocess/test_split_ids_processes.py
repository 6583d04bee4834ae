"""Communicator ids of splits that run at once on threads of each rank, over real processes
(Note [communicator ids] in plait.group): two communicators of a rank never share one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_faults import plait_run

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_splits_on_threads_at_once_never_give_two_communicators_one_id(
    tmp_path: Path, transport: str
) -> None:
    # Each rank splits two communicators of the same ranks on two threads, the groups
    # hashing to one first candidate, rank 0 beginning A's split first and rank 1 B's, and
    # each sending its word only once the other has begun. Both groups took that id, and
    # their allreduces of 1 and 100 gave 101 on both, their sends crossed.
    script = """
        import json, threading, numpy as np, plait
        from plait.group import child_comm_id

        comm = plait.init(timeout=30)
        a, b = comm.split(0), comm.split(0)
        target = child_comm_id(a._comm_id, a._runner.seq, 0)
        color_b = next(
            c for c in range(1 << 24) if child_comm_id(b._comm_id, b._runner.seq, c) == target
        )
        first = a if comm.rank == 0 else b
        both, first_in, out = threading.Barrier(2, timeout=20), threading.Event(), {}

        def gated(c):
            inner = c._within
            def within(*args, **kwargs):  # the split's exchange
                if c is first:
                    first_in.set()
                both.wait()
                return inner(*args, **kwargs)
            c._within = within

        def run(name, c, color):
            if c is not first:
                assert first_in.wait(20)
            out[name] = c.split(color)

        gated(a)
        gated(b)
        threads = [
            threading.Thread(target=run, args=("a", a, 0)),
            threading.Thread(target=run, args=("b", b, color_b)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        a2, b2 = out["a"], out["b"]
        got = None
        if comm.rank == 0:
            a2.send(np.full(4, 1.0), 1)
            b2.send(np.full(4, 2.0), 1)
        else:
            got = [b2.recv(np.empty(4), 0)[0], a2.recv(np.empty(4), 0)[0]]
        xa, xb = np.full(4, 1.0), np.full(4, 100.0)
        if comm.rank == 0:
            wa, wb = a2.allreduce(xa, async_op=True), b2.allreduce(xb, async_op=True)
        else:
            wb, wa = b2.allreduce(xb, async_op=True), a2.allreduce(xa, async_op=True)
        sums = [wa.wait(timeout=20)[0], wb.wait(timeout=20)[0]]
        ids = [a2._comm_id, b2._comm_id]
        print("RESULT " + json.dumps([comm.rank, ids, got, sums]), flush=True)
        comm.close()
    """
    res, _ = plait_run(["-n", "2", "--transport", transport], script, tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    rows = sorted(
        json.loads(line.split("RESULT ", 1)[1])
        for line in res.stdout.splitlines()
        if "RESULT " in line
    )
    assert [r for r, _, _, _ in rows] == [0, 1], res.stdout
    (_, ids0, _, sums0), (_, ids1, got, sums1) = rows
    assert ids0 == ids1, rows  # the ranks agree on each id
    assert ids0[0] != ids0[1], rows
    assert got == [2.0, 1.0], rows
    assert sums0 == sums1 == [2.0, 200.0], rows
