"""A one-sided call that gives up waiting for its turn, in a real job of two processes.

Note [a turn given up] in plait._turns; the same on threads: tests/integration/test_turns.py.
Rank 0's blocking call, queued behind its async one-sided call that waits for a late rank 1,
timed out and left the communicator usable there, its turn counter going backwards: its next
call waited its whole timeout though nothing was in flight, and rank 1, never told, would wait
out its own timeout in the call rank 0 gave up.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_arena_faults import plait_run

pytestmark = pytest.mark.timeout(120)


def test_a_call_that_gives_up_its_turn_breaks_the_communicator_on_every_rank(
    tmp_path: Path,
) -> None:
    script = """
        ALG = "arena_oneshot"
        comm = plait.init(timeout=1)
        x = np.full(4, comm.rank + 1.0)
        if comm.rank == 1:
            wait_for("gave_up", 1)  # late to call #0 until rank 0's call #1 has given up
            first = comm.allreduce(x, algorithm=ALG, async_op=True, timeout=30).wait().tolist()
            start = time.monotonic()
            try:
                comm.allreduce(x, algorithm=ALG, timeout=30)  # call #1, which rank 0 gave up
            except plait.CommError as exc:
                error, message = type(exc).__name__, str(exc)
            seconds = time.monotonic() - start
            arrived("raised", 1)
            comm.close()
            report(first=first, error=error, message=message[:300], seconds=seconds,
                   left=leftovers())
            raise SystemExit(0)
        a = comm.allreduce(x, algorithm=ALG, async_op=True, timeout=30)  # call #0
        try:
            comm.allreduce(x, algorithm=ALG)  # call #1: the communicator's 1 s, the short path
        except plait.CommError as exc:
            gave_up = [type(exc).__name__, str(exc)]
        turn = comm._runner.turn  # call #0 still runs: rank 1 comes once told below
        arrived("gave_up", 0)
        first = a.wait().tolist()
        refused = []
        for algorithm in (ALG, "ring"):
            start = time.monotonic()
            try:
                comm.allreduce(x, algorithm=algorithm, timeout=10)
            except plait.CommError as exc:
                refused.append([str(exc)[:200], time.monotonic() - start])
        wait_for("raised", 1)  # open until rank 1 has its error, which must not be a close
        comm.close()
        report(gave_up=gave_up, turn=turn, first=first, refused=refused, left=leftovers())
    """
    res, results = plait_run(["-n", "2"], script, tmp_path)
    logs = res.stdout[-3000:] + res.stderr[-3000:]
    assert res.returncode == 0, logs
    assert sorted(results) == [0, 1], logs
    (zero,), (one,) = results[0], results[1]
    assert zero["turn"] == 0, zero  # not passed on by the call that never had it
    assert zero["first"] == one["first"] == [3.0] * 4
    assert len(zero["refused"]) == 2, zero  # a one-sided call, then a message call
    for said, seconds in zero["refused"]:
        assert "this communicator is unusable after an earlier failure (rank 0: " in said, said
        assert seconds < 5, zero  # at once, not after a turn's or a peer's timeout
    error, message = zero["gave_up"]
    assert error == "CollectiveTimeout", message
    assert "allreduce (arena_oneshot, call #1): the one-sided call before it" in message
    assert "did not finish within 1 s: it waits for rank(s) [1]" in message
    assert "this rank gave up on the call; its peers were told, and this communicator " in message
    assert one["error"] == "PeerLostError", one
    told = "rank 0 gave up on the call after an error of its own, CollectiveTimeout"
    assert told in one["message"], one
    assert one["seconds"] < 15, one  # within a probe period or two, not its 30 s
    assert zero["left"] == one["left"] == [], (zero, one)
