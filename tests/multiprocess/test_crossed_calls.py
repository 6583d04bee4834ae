"""Calls of different communicators that wait on each other (Note [crossed calls] in
plait.runtime.crossing): over real processes, where the stalled thread is a rank's only one."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_faults import TRANSPORTS, plait_run


def _crossed(n: int, transport: str, script: str, tmp_path: Path) -> list[str]:
    """Run ``script`` on ``n`` ranks, each of which prints ``crossed on <rank> <seconds>
    <error>``; its lines, by rank, once every rank has printed one well before the timeout."""
    res, _ = plait_run(["-n", str(n), "--tag-output", "--transport", transport], script, tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr[-2000:]
    lines = sorted(line.split(":", 1)[1].strip() for line in res.stdout.splitlines())
    assert [line.split()[2] for line in lines] == [str(r) for r in range(n)], res.stdout
    assert all(float(line.split()[3]) < 15 for line in lines), res.stdout  # not the timeout
    return lines


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_calls_crossed_between_communicators_fail_every_rank_within_seconds(
    tmp_path: Path, transport: str
) -> None:
    # Ranks 0 and 1 share a group and the world, and call them in opposite orders; rank 2
    # waits in the world's call with rank 0, and learns of the mismatch from rank 0. The
    # world's call is "direct", in which rank 0 waits on rank 1 itself: only crossings of two
    # ranks are found (in a ring, 0 would wait on 2, which waits on 1).
    script = """
        import time, numpy as np, plait
        comm = plait.init(timeout=60)
        group = comm.split(0 if comm.rank < 2 else 1)
        x = np.ones(5, np.float32)
        start = time.monotonic()
        try:
            if comm.rank == 1:
                group.allreduce(x)
                comm.allreduce(x, algorithm="direct")
            else:
                comm.allreduce(x, algorithm="direct")
                if comm.rank == 0:
                    group.allreduce(x)
        except plait.MismatchError as exc:
            print(f"crossed on {comm.rank} {time.monotonic() - start:.1f} {exc}", flush=True)
        else:
            raise SystemExit("no error")
    """
    lines = _crossed(3, transport, script, tmp_path)
    assert "calls on different communicators in different orders" in lines[0], lines[0]
    assert "calls on different communicators in different orders" in lines[1], lines[1]
    assert "job rank 0 waits in allreduce" in lines[1], lines[1]


#: The start of the threaded jobs: the world and a group of all its ranks, warnings shown.
TWO_COMMUNICATORS = """
        import logging, threading, time, numpy as np, plait
        logging.basicConfig(level=logging.WARNING)
        comm = plait.init(timeout=60)
        group = comm.split(0)
        x = np.ones(5, np.float32)
"""


def test_a_crossing_another_thread_may_undo_is_logged_and_waits(tmp_path: Path) -> None:
    # Two threads per rank drive one communicator each, and rank 0's group thread starts
    # late: for a while rank 0 waits in the world's call for rank 1, whose world thread has
    # not begun it, and rank 1 waits in the group's call for rank 0. It resolves itself.
    script = (
        TWO_COMMUNICATORS
        + """
        results = {}

        def world():
            if comm.rank == 1:
                time.sleep(4)
            results["world"] = comm.allreduce(x, out=np.empty_like(x))

        def grouped():
            if comm.rank == 0:
                time.sleep(4)
            results["group"] = group.allreduce(2 * x, out=np.empty_like(x))

        threads = [threading.Thread(target=world), threading.Thread(target=grouped)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results["world"].tolist() == [2.0] * 5, results
        assert results["group"].tolist() == [4.0] * 5, results
        print(f"done on {comm.rank}", flush=True)
    """
    )
    res, _ = plait_run(["-n", "2", "--tag-output"], script, tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr[-2000:]
    assert sorted(res.stdout.split()).count("done") == 2, res.stdout
    assert "a deadlock unless another thread of this rank or of job rank" in res.stderr, res.stderr[
        -2000:
    ]


def test_a_crossing_the_peers_other_thread_undoes_is_no_error(tmp_path: Path) -> None:
    # Rank 0 has one thread, and calls the world, then the group. Rank 1 has two: one in the
    # group's call from the start, one that joins the world's call late. Rank 0 is alone,
    # but rank 1 is not, and its late thread undoes the crossing: no rank may raise.
    script = (
        TWO_COMMUNICATORS
        + """
        if comm.rank == 0:
            world = comm.allreduce(x, out=np.empty_like(x))
            grouped = group.allreduce(2 * x, out=np.empty_like(x))
        else:
            results = {}

            def late():
                time.sleep(4)
                results["world"] = comm.allreduce(x, out=np.empty_like(x))

            t = threading.Thread(target=late)
            t.start()
            grouped = group.allreduce(2 * x, out=np.empty_like(x))
            t.join()
            world = results["world"]
        assert world.tolist() == [2.0] * 5, world
        assert grouped.tolist() == [4.0] * 5, grouped
        print(f"done on {comm.rank}", flush=True)
    """
    )
    res, _ = plait_run(["-n", "2", "--tag-output"], script, tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr[-2000:]
    assert sorted(res.stdout.split()).count("done") == 2, res.stdout
    assert "calls on different communicators in different orders" in res.stderr, res.stderr[-2000:]


def test_a_peer_whose_call_runs_on_its_worker_thread_is_no_crossing(tmp_path: Path) -> None:
    # Rank 2 queues its world call (async_op=True) and waits in the group's call with rank 0,
    # which waits for it in the world's call while rank 1 computes. Rank 0 sees a crossing,
    # but rank 2 has begun the world's call (on its worker thread): it confirms none, and
    # every call finishes once rank 1 comes. A one-sided view made rank 0 raise.
    script = """
        import time, numpy as np, plait
        comm = plait.init(timeout=60)
        group = comm.split(0 if comm.rank in (0, 2) else 1)
        x = np.ones(5, np.float32)
        if comm.rank == 0:
            world = comm.allreduce(x, algorithm="ring", out=np.empty_like(x))
            grouped = group.allreduce(2 * x, out=np.empty_like(x))
            assert grouped.tolist() == [4.0] * 5, grouped
        elif comm.rank == 2:
            work = comm.allreduce(x, algorithm="ring", out=np.empty_like(x), async_op=True)
            grouped = group.allreduce(2 * x, out=np.empty_like(x))
            assert grouped.tolist() == [4.0] * 5, grouped
            world = work.wait()
        else:
            time.sleep(4)  # computing before its world call
            world = comm.allreduce(x, algorithm="ring", out=np.empty_like(x))
        assert world.tolist() == [3.0] * 5, world
        print(f"done on {comm.rank}", flush=True)
    """
    res, _ = plait_run(["-n", "3", "--tag-output", "--transport", "tcp"], script, tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr[-2000:]
    assert sorted(res.stdout.split()).count("done") == 3, res.stdout


def test_a_notice_taken_by_an_earlier_stalled_call_serves_the_crossed_one(
    tmp_path: Path,
) -> None:
    # Rank 0's first call waits seconds for a late rank 2, and reads rank 1's notice while
    # it does; its next call is the one rank 1's crossed with. The notice used to be spent
    # on the first call, so the crossing went unseen until the timeout.
    script = """
        import time, numpy as np, plait
        comm = plait.init(timeout=30)
        g01 = comm.split(0 if comm.rank in (0, 1) else 1)
        g02 = comm.split(0 if comm.rank in (0, 2) else 1)
        x = np.ones(5, np.float32)
        start = time.monotonic()
        try:
            if comm.rank == 2:
                time.sleep(4)  # late for its call with rank 0
                g02.allreduce(x)
                comm.allreduce(x, algorithm="direct")
            elif comm.rank == 1:
                g01.allreduce(x)  # waits on rank 0, which is in the world's call next
                comm.allreduce(x, algorithm="direct")
            else:
                g02.allreduce(x)
                comm.allreduce(x, algorithm="direct")
                g01.allreduce(x)
        except plait.MismatchError as exc:
            print(f"crossed on {comm.rank} {time.monotonic() - start:.1f} {exc}", flush=True)
        else:
            raise SystemExit("no error")
    """
    res, _ = plait_run(["-n", "3", "--tag-output"], script, tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr[-2000:]
    lines = sorted(line.split(":", 1)[1].strip() for line in res.stdout.splitlines())
    assert [line.split()[2] for line in lines] == ["0", "1", "2"], res.stdout
    assert all(float(line.split()[3]) < 20 for line in lines), res.stdout  # not the timeout
    assert "job rank 1 waits in allreduce" in lines[0], lines[0]


#: How rank 1 waits for a message of rank 0, which waits for rank 1.
WAITS = {
    "recv": "comm.recv(np.zeros(4), 0)",
    "probe": "comm.probe(0)",
    "sendrecv": "comm.sendrecv(np.ones(4), 0, np.zeros(4), 0)",
}


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(
    ("waiter", "other"),
    [("recv", "barrier"), ("recv", "recv"), ("probe", "barrier"), ("sendrecv", "barrier")],
)
def test_a_receive_that_waits_for_a_rank_waiting_for_it_fails_both_within_seconds(
    tmp_path: Path, transport: str, waiter: str, other: str
) -> None:
    # Rank 1 waits for a message of rank 0, which waits for rank 1 in a barrier (or a
    # receive of its own): both waited out the timeout, and the barrier's said rank 1 "did
    # not say they wait". A blocking point-to-point wait now tells the rank it waits on
    # where it waits (Note [crossed calls]); a probe and a sendrecv's receive did not.
    script = f"""
        import time, numpy as np, plait
        comm = plait.init(timeout=60)
        start = time.monotonic()
        try:
            if comm.rank == 1:
                {WAITS[waiter]}
            elif "{other}" == "barrier":
                comm.barrier()
            else:
                comm.recv(np.zeros(4), 1)
        except plait.MismatchError as exc:
            print(f"crossed on {{comm.rank}} {{time.monotonic() - start:.1f}} {{exc}}", flush=True)
        else:
            raise SystemExit("no error")
    """
    lines = _crossed(2, transport, script, tmp_path)
    assert all("made different calls on one communicator" in line for line in lines), lines
    assert f"job rank 1 waits in {waiter} from rank 0 (tag 0)" in lines[0], lines[0]
    assert f"job rank 0 waits in {other}" in lines[1], lines[1]


def test_a_receive_with_a_timeout_of_its_own_may_outlast_a_rank_waiting_for_it(
    tmp_path: Path,
) -> None:
    # A timeout the caller gives may be a poll the program means to outlast: rank 1 polls
    # for a message that never comes, then meets rank 0 in its barrier. No crossing.
    script = """
        import numpy as np, plait
        comm = plait.init(timeout=60)
        if comm.rank == 1:
            try:
                comm.recv(np.zeros(4), 0, timeout=3)
            except plait.CommTimeout:
                print("polled", flush=True)
        comm.barrier()
        print("met", flush=True)
    """
    res, _ = plait_run(["-n", "2", "--tag-output"], script, tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr[-2000:]
    assert sorted(line.split(":", 1)[1].strip() for line in res.stdout.splitlines()) == [
        "met",
        "met",
        "polled",
    ], res.stdout


def test_a_receive_that_ended_is_no_crossing_later(tmp_path: Path) -> None:
    """Rank 0's recv stalled (and told rank 1 where it waits), then ended; later rank 1's recv
    stalled while rank 0 computed outside plait, and rank 1 logged a crossing with the recv
    rank 0 had long finished: a point-to-point wait's number never says it ended, so its
    notice stayed on rank 1's board (Note [crossed calls]). An idle thread makes a crossing a
    logged one rather than an error."""
    script = """
        import threading, time, numpy as np, plait
        comm = plait.init(timeout=60)
        idle = threading.Event()
        threading.Thread(target=idle.wait, daemon=True).start()
        if comm.rank == 0:
            comm.recv(np.empty(1), 1, tag=1)
            time.sleep(3)  # computing outside plait, past rank 1's probe period
            comm.send(np.ones(1), 1, tag=2)
        else:
            time.sleep(3)  # late for rank 0's recv, past its probe period
            comm.send(np.ones(1), 0, tag=1)
            comm.recv(np.empty(1), 0, tag=2)
        idle.set()
        comm.barrier()
        print(f"done on {comm.rank}", flush=True)
    """
    res, _ = plait_run(["-n", "2", "--tag-output"], script, tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr[-2000:]
    assert sorted(res.stdout.split()).count("done") == 2, res.stdout
    assert "waits in recv from rank 1 (tag 1)" not in res.stderr, res.stderr[-2000:]
