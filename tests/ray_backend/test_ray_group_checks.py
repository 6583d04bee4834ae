"""Badly configured plait Ray groups fail at once, naming what the members disagree on.

Over the fake key-value store (no Ray needed), each member creating the group in a
thread of its own: a rank given to two actors, members given different world sizes.
Each would otherwise wait out its timeout, blaming a rank that never came.

The ranks other than 0 arrive first, so that rank 0 answers them all before any
can find the disagreement: a member that arrives after rank 0 gave up is answered
by nobody and waits out its timeout (Note [members that disagree] in
plait.ray._rendezvous), so starting them all at once made these tests depend on
which thread ran first.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from test_ray_store import FakeKV

import plait
from plait.errors import RendezvousError
from plait.ray._rendezvous import create
from plait.ray._store import poll_until

#: Every member's timeout: what a check that does not work would wait.
TIMEOUT = 5.0
#: A member that can tell fails within this (the store is polled every 50 ms at most).
AT_ONCE = 3.0


def run_members(kv: FakeKV, members: list[tuple[int, int]]) -> list[tuple[Any, float]]:
    """``create`` on a thread per (rank, world size): each one's result or error, and
    the seconds it took."""
    out: list[Any] = [None] * len(members)

    def one(i: int, rank: int, size: int) -> None:
        start = time.monotonic()
        try:
            got: Any = create(kv, rank, size, "g", TIMEOUT)
        except BaseException as exc:
            got = exc
        out[i] = (got, time.monotonic() - start)

    threads = {
        i: threading.Thread(target=one, args=(i, rank, size))
        for i, (rank, size) in enumerate(members)
    }
    before = set(kv.keys("arrive/"))
    others = [i for i, (rank, _) in enumerate(members) if rank != 0]
    for i in others:
        threads[i].start()
    arrived = poll_until(
        lambda: len(set(kv.keys("arrive/")) - before) >= len(others), time.monotonic() + TIMEOUT
    )
    assert arrived, "the members other than rank 0 never arrived"
    for i, t in threads.items():
        if i not in others:
            t.start()
    for t in threads.values():
        t.join(TIMEOUT + 10)
    for got, _ in out:
        if isinstance(got, tuple):
            got[1].close()
    return out


def all_fail_at_once(results: list[tuple[Any, float]], match: str) -> None:
    for got, seconds in results:
        assert isinstance(got, RendezvousError), got
        assert match in str(got), got
        assert seconds < AT_ONCE, (seconds, got)


def test_two_actors_given_rank_0() -> None:
    results = run_members(FakeKV(), [(0, 2), (0, 2)])
    all_fail_at_once(results, "Ray group 'g': rank 0 was given to two actors")


def test_two_actors_given_rank_1() -> None:
    results = run_members(FakeKV(), [(0, 3), (1, 3), (1, 3)])
    all_fail_at_once(results, "Ray group 'g': rank 1 was given to two actors")


@pytest.mark.parametrize(
    ("members", "said"),
    [
        ([(0, 3), (1, 2)], "rank 0: 3, rank 1: 2"),
        ([(0, 2), (1, 3), (2, 3)], "rank 0: 2"),
        ([(0, 3), (1, 3), (2, 2)], "rank 2: 2"),
    ],
)
def test_members_given_different_world_sizes(members: list[tuple[int, int]], said: str) -> None:
    results = run_members(FakeKV(), members)
    all_fail_at_once(results, "its members were given different world sizes (")
    assert any(said in str(got) for got, _ in results)
    for got, _ in results:
        assert "every member must pass the same world_size" in str(got)


def test_a_group_made_right_after_a_bad_one_works_and_leaves_no_keys() -> None:
    kv = FakeKV()
    all_fail_at_once(run_members(kv, [(0, 3), (1, 2)]), "different world sizes")
    results = run_members(kv, [(0, 2), (1, 2)])
    for got, _ in results:
        assert isinstance(got, tuple), got
        assert isinstance(got[1], plait.Communicator)
    assert kv.data == {}
