"""Calls of different communicators that wait on each other (Note [crossed calls] in
plait.runtime.crossing): over real processes, where the stalled thread is a rank's only one."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_faults import TRANSPORTS, plait_run


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_calls_crossed_between_communicators_fail_every_rank_within_seconds(
    tmp_path: Path, transport: str
) -> None:
    # Ranks 0 and 1 share a group and the world, and call them in opposite orders; rank 2
    # waits in the world's call with rank 0, and learns of the mismatch from rank 0.
    script = """
        import time, numpy as np, plait
        comm = plait.init(timeout=60)
        group = comm.split(0 if comm.rank < 2 else 1)
        x = np.ones(5, np.float32)
        start = time.monotonic()
        try:
            if comm.rank == 1:
                group.allreduce(x)
                comm.allreduce(x)
            else:
                comm.allreduce(x)
                if comm.rank == 0:
                    group.allreduce(x)
        except plait.MismatchError as exc:
            print(f"crossed on {comm.rank} {time.monotonic() - start:.1f} {exc}", flush=True)
        else:
            raise SystemExit("no error")
    """
    res, _ = plait_run(["-n", "3", "--tag-output", "--transport", transport], script, tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr[-2000:]
    lines = sorted(line.split(":", 1)[1].strip() for line in res.stdout.splitlines())
    assert [line.split()[2] for line in lines] == ["0", "1", "2"], res.stdout
    assert all(float(line.split()[3]) < 15 for line in lines), res.stdout  # not the timeout
    assert "calls on different communicators in different orders" in lines[0], lines[0]
    assert "calls on different communicators in different orders" in lines[1], lines[1]
    assert "job rank 0 waits in allreduce" in lines[1], lines[1]


def test_a_crossing_another_thread_may_undo_is_logged_and_waits(tmp_path: Path) -> None:
    # Two threads per rank drive one communicator each, and rank 0's group thread starts
    # late: for a while rank 0 waits in the world's call for rank 1, whose world thread has
    # not begun it, and rank 1 waits in the group's call for rank 0. It resolves itself.
    script = """
        import logging, threading, time, numpy as np, plait
        logging.basicConfig(level=logging.WARNING)
        comm = plait.init(timeout=60)
        group = comm.split(0)
        x = np.ones(5, np.float32)
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
    script = """
        import logging, threading, time, numpy as np, plait
        logging.basicConfig(level=logging.WARNING)
        comm = plait.init(timeout=60)
        group = comm.split(0)
        x = np.ones(5, np.float32)
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
    res, _ = plait_run(["-n", "2", "--tag-output"], script, tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr[-2000:]
    assert sorted(res.stdout.split()).count("done") == 2, res.stdout
    assert "calls on different communicators in different orders" in res.stderr, res.stderr[-2000:]
