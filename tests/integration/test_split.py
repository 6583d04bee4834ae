"""Sub-communicators: MPI_Comm_split semantics, independence from the parent, host info."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

import plait
from plait.testing import run_ranks


def test_split_by_parity_orders_by_key_then_rank() -> None:
    def body(comm: plait.Communicator) -> Any:
        sub = comm.split(comm.rank % 2, key=-comm.rank)  # reversed order inside each group
        total = sub.allreduce(np.array([comm.rank]))
        ranks = sub.allgather(np.array([comm.rank]))
        # The parent keeps working, interleaved with the group's calls.
        world = comm.allreduce(np.ones(1))
        sub.close()
        again = comm.allreduce(np.ones(1))
        return sub.rank, sub.size, total[0], ranks.ravel().tolist(), world[0], again[0]

    results = run_ranks(5, body)
    evens, odds = [4, 2, 0], [3, 1]
    for r, (sub_rank, sub_size, total, ranks, world, again) in enumerate(results):
        group = evens if r % 2 == 0 else odds
        assert (sub_rank, sub_size) == (group.index(r), len(group))
        assert total == sum(group)
        assert ranks == group
        assert world == again == 5


def test_split_with_none_color_and_nested_groups() -> None:
    def body(comm: plait.Communicator) -> Any:
        sub = comm.split(None if comm.rank == 0 else 1)
        if sub is None:
            return None
        inner = sub.split(sub.rank // 2)
        res = inner.allreduce(np.array([comm.rank], np.int64), algorithm="ring")
        return int(res[0]), inner.size

    results = run_ranks(6, body)
    assert results[0] is None
    # ranks 1..5 -> sub ranks 0..4 -> inner groups {1,2}, {3,4}, {5}
    assert [r for r in results[1:]] == [(3, 2), (3, 2), (7, 2), (7, 2), (5, 1)]


def test_groups_with_the_same_color_in_different_calls_do_not_mix() -> None:
    def body(comm: plait.Communicator) -> Any:
        a = comm.split(0)
        b = comm.split(0)  # same members, a different communicator
        wa = a.allreduce(np.full(3, 1.0), async_op=True)
        rb = b.allreduce(np.full(3, 10.0))
        return wa.wait()[0], rb[0]

    for a, b in run_ranks(3, body):
        assert (a, b) == (3.0, 30.0)


def test_split_by_host_and_host_info() -> None:
    from plait.transport.memory import MemoryFabric

    hosts = ["a", "b", "a", "b", "b"]
    fabric = MemoryFabric(5)
    comms = [plait.Communicator(t, hosts=hosts) for t in fabric.endpoints]
    info = [(c.local_rank, c.local_size, c.cross_rank, c.cross_size, c.host) for c in comms]
    assert info == [
        (0, 2, 0, 2, "a"),
        (0, 3, 1, 2, "b"),
        (1, 2, 0, 2, "a"),
        (1, 3, 1, 2, "b"),
        (2, 3, 1, 2, "b"),
    ]

    import threading

    out: list[Any] = [None] * 5

    def body(c: plait.Communicator) -> None:
        local = c.split_by_host()
        out[c.rank] = (local.size, local.rank, local.hosts)
        local.barrier()

    threads = [threading.Thread(target=body, args=(c,)) for c in comms]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out[4] == (3, 2, ("b", "b", "b"))
    assert out[2] == (2, 1, ("a", "a"))


def test_bad_split_arguments() -> None:
    def body(comm: plait.Communicator) -> Any:
        with pytest.raises(ValueError, match="color must be >= 0 or None"):
            comm.split(-3)
        with pytest.raises(TypeError, match="key must be an int"):
            comm.split(0, key="x")  # type: ignore[arg-type]
        # Past 64 bits: a raw OverflowError naming neither the rank nor the argument.
        for color, key in ((1 << 63, 0), (np.uint64(2**64 - 1), 0), (0, 1 << 63), (0, -(1 << 64))):
            with pytest.raises(ValueError, match="must fit in 64 signed bits"):
                comm.split(color, key=key)
        return comm.allreduce(np.ones(1))[0]

    assert run_ranks(2, body) == [2.0, 2.0]


def test_closing_the_parent_closes_its_groups_after_their_queued_calls() -> None:
    # A group shares its parent's transport: its next call said "rank 0 has closed its
    # communicator" (PeerLostError) on rank 0 itself, its closed flag False.
    def body(comm: plait.Communicator) -> Any:
        sub = comm.split(0)
        queued = sub.allreduce(np.full(3, comm.rank + 1.0), async_op=True)
        comm.close()
        with pytest.raises(plait.ClosedError, match="allreduce on a closed communicator"):
            sub.allreduce(np.ones(1))
        return sub.closed, queued.wait().tolist()

    assert run_ranks(2, body) == [(True, [3.0, 3.0, 3.0])] * 2


def test_closing_a_group_fails_its_waiting_receives_at_once() -> None:
    # As closing the world does: a receive posted on a group, and another thread's receive
    # blocked in it, waited until their timeout (10 s here) after the group was closed.
    def body(comm: plait.Communicator) -> Any:
        sub = comm.split(0)
        if comm.rank == 0:
            comm.recv(np.zeros(1), 1, tag=9)  # until rank 1 has closed its group
            sub.close()
            return None
        posted = sub.irecv(np.zeros(1), 0, tag=1)
        failed: list[BaseException] = []

        def blocked() -> None:
            try:
                sub.recv(np.zeros(1), plait.ANY_SOURCE, tag=2)
            except plait.CommError as exc:
                failed.append(exc)

        thread = threading.Thread(target=blocked)
        thread.start()
        endpoint = sub._runner._transport.parent  # the group's view's: the world's
        deadline = time.monotonic() + 5
        while not endpoint._wild and time.monotonic() < deadline:  # its receive is posted
            threading.Event().wait(0.005)
        assert endpoint._wild
        start = time.monotonic()
        sub.close()
        with pytest.raises(plait.ClosedError, match="closed"):
            posted.wait(timeout=5)
        thread.join(5)
        assert [type(e) for e in failed] == [plait.ClosedError], failed
        assert time.monotonic() - start < 5
        comm.send(np.zeros(1), 0, tag=9)
        comm.send(np.ones(1), 1, tag=3)  # the parent goes on
        return comm.recv(np.zeros(1), 1, tag=3).tolist()

    assert run_ranks(2, body, timeout=10) == [None, [1.0]]


def test_a_lone_rank_group_runs_the_one_sided_algorithms_asked_for() -> None:
    """A group of one rank has no window; asking it for ``arena`` was refused as if its
    ranks did not share a host, where a one-rank world ran it (it copies its input)."""

    def body(comm: plait.Communicator) -> Any:
        group = comm.split(comm.rank)
        assert group.size == 1
        x = np.arange(5.0) + comm.rank
        try:
            for algorithm in ("arena", "arena_oneshot", "arena_leader"):
                np.testing.assert_array_equal(group.allreduce(x, algorithm=algorithm), x)
            np.testing.assert_array_equal(group.allgather(x, algorithm="arena"), x[None])
            np.testing.assert_array_equal(group.broadcast(x.copy(), 0, algorithm="arena"), x)
        finally:
            group.close()

    run_ranks(2, body)


def _colliding_splits() -> tuple[int, int]:
    """Two call numbers of the world whose splits of color 0 hash to one first candidate."""
    from plait.group import child_comm_id

    seen: dict[int, int] = {}
    for seq in range(5000):
        first = child_comm_id(0, seq, 0)
        if first in seen:
            return seen[first], seq
        seen[first] = seq
    raise AssertionError("no two splits of the first 5000 calls share a candidate")


def test_two_live_groups_never_share_an_id() -> None:
    """Splits at calls #137 and #338 of a world hashed to one 18-bit id: a send on the first
    group was received on the second, and a ring allreduce on each mixed their sums."""
    s1, s2 = _colliding_splits()

    def body(comm: plait.Communicator) -> Any:
        while comm._runner.seq < s1:
            comm.barrier()
        a = comm.split(0)
        while comm._runner.seq < s2:
            comm.barrier()
        b = comm.split(0)
        if comm.rank == 0:
            a.send(np.full(4, 1.0), 1)
            b.send(np.full(4, 2.0), 1)
            got = None
        else:
            got = (b.recv(np.empty(4), 0)[0], a.recv(np.empty(4), 0)[0])
        sums = []
        for _ in range(5):
            wa = a.allreduce(np.full(8, 1.0), algorithm="ring", async_op=True)
            wb = b.allreduce(np.full(8, 100.0), algorithm="ring", async_op=True)
            sums.append((wb.wait()[0], wa.wait()[0]))
        return a._comm_id != b._comm_id, got, sums

    results = run_ranks(2, body)
    assert all(differ for differ, _, _ in results)
    assert results[1][1] == (2.0, 1.0)
    assert all(s == (200.0, 2.0) for _, _, sums in results for s in sums)


def test_a_group_takes_the_first_id_none_of_its_ranks_has_used() -> None:
    """Note [communicator ids]: each rank marks the candidates it has used; the group ORs
    its members' marks."""
    from plait.group import ID_TRIES, free_candidate

    assert free_candidate([0, 0]) == 0
    assert free_candidate([0b001, 0b100]) == 1
    assert free_candidate([0b011, 0b100]) == 3
    assert free_candidate([(1 << ID_TRIES) - 1]) is None
