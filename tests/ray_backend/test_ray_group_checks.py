"""Badly configured plait Ray groups fail at once, naming what the members disagree on.

Over the fake key-value store (no Ray needed), each member creating the group in a
thread of its own: a rank given to two actors, members given different world sizes.
Each would otherwise wait out its timeout, blaming a rank that never came.

The ranks other than 0 arrive first, so that rank 0 answers them all before any
can find the disagreement, and each learns why from the incarnation's mark. A
member that arrives after rank 0 gave up learns it from rank 0's verdict instead
(Note [members that disagree] in plait.ray._rendezvous), which the last tests check.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from test_ray_store import FakeKV

import plait
from plait.errors import RendezvousError
from plait.ray._rendezvous import VERDICT_GRACE, create
from plait.ray._store import poll_until

#: Every member's timeout: what a check that does not work would wait.
TIMEOUT = 5.0
#: A member that can tell fails within this (the store is polled every 50 ms at most; one
#: that arrives after the others failed gives a new rank 0 VERDICT_GRACE first).
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


@pytest.mark.parametrize(
    ("members", "late", "match"),
    [
        ([(0, 2), (1, 3)], (2, 3), "its members were given different world sizes (rank 0: 2"),
        ([(0, 3), (0, 3)], (1, 3), "rank 0 was given to two actors"),
        ([(0, 3), (1, 3), (1, 3)], (2, 3), "rank 1 was given to two actors"),
    ],
)
def test_a_member_that_arrives_after_the_others_failed_fails_at_once_too(
    members: list[tuple[int, int]], late: tuple[int, int], match: str
) -> None:
    # The late member is configured right; nobody answers it any more, but rank 0 left
    # its verdict, where the late member would otherwise wait out its timeout and blame
    # rank 0 for not creating the group.
    kv = FakeKV()
    all_fail_at_once(run_members(kv, members), match)
    results = run_members(kv, [late])
    all_fail_at_once(results, match)
    ((got, seconds),) = results
    assert seconds >= VERDICT_GRACE, seconds  # a new rank 0 had its chance to answer
    assert any("arrived after the other members had failed" in n for n in got.__notes__)
    assert not kv.keys("arrive/")
    assert not kv.keys("ack/")
    # Created again, right this time: the verdict does not reach the new incarnation, and
    # nothing is left.
    made = run_members(kv, [(0, 3), (1, 3), (2, 3)])
    for got, _ in made:
        assert isinstance(got, tuple), got
    assert kv.data == {}
