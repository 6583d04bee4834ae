"""Creating a plait Ray group over a fake key-value store (no Ray needed): the keys an
incarnation leaves, and when they go.

Each rank runs in a thread of its own, as Ray actors would in processes; the fake
behaves as Ray's internal key-value store does (tests/ray_backend/test_ray_store.py).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from test_ray_store import FakeKV

import plait
from plait.ray._rendezvous import Meeting, create, meet
from plait.ray._store import poll_until
from plait.rendezvous.store import StoreTimeout


def run_ranks(
    kv: FakeKV, ranks: list[tuple[int, int]], timeout: float
) -> list[tuple[Meeting, plait.Communicator] | BaseException]:
    """``create`` on a thread per (rank, size); each one's result or error."""
    out: list[Any] = [None] * len(ranks)

    def one(i: int, rank: int, size: int) -> None:
        try:
            out[i] = create(kv, rank, size, "g", timeout)
        except BaseException as exc:
            out[i] = exc

    threads = [
        threading.Thread(target=one, args=(i, rank, size)) for i, (rank, size) in enumerate(ranks)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 10)
    return out


def close(results: list[Any]) -> None:
    for r in results:
        if isinstance(r, tuple):
            r[1].close()


def test_a_created_group_keeps_no_keys() -> None:
    kv = FakeKV()
    made = run_ranks(kv, [(0, 3), (1, 3), (2, 3)], 10.0)
    try:
        assert all(isinstance(r, tuple) for r in made), made
        assert kv.data == {}
    finally:
        close(made)


def test_a_failed_creation_is_swept_by_the_next_rank_0() -> None:
    kv = FakeKV()
    with pytest.raises(StoreTimeout):
        create(kv, 0, 2, "g", 0.3)  # rank 1 never comes
    failed = {k.split("/")[1] for k in kv.keys("run/")}
    assert len(failed) == 1  # rank 0's claim and host stay for the others to read
    made = run_ranks(kv, [(0, 2), (1, 2)], 10.0)
    try:
        assert all(isinstance(r, tuple) for r in made), made
        assert kv.data == {}
    finally:
        close(made)


def test_an_incarnation_begun_later_is_not_swept() -> None:
    kv = FakeKV()
    kv.put("run/before/x", b"", True)
    m = meet(kv, 0, 2, "g", 1.0)
    kv.put("run/after/x", b"", True)  # begun after this one: maybe not finished
    m.joined()
    assert kv.keys("run/") == ["run/after/x"]


def test_any_member_deletes_the_incarnation_when_it_destroys_the_group() -> None:
    kv = FakeKV()
    first = meet(kv, 0, 2, "g", 5.0)
    found: list[Meeting] = []
    t = threading.Thread(target=lambda: found.append(meet(kv, 1, 2, "g", 5.0)))
    t.start()
    assert poll_until(lambda: not t.is_alive(), time.monotonic() + 10, first.check)
    second = found[0]
    assert second.token == first.token
    first.store.set("plait/init/host/0", b"h")  # rank 0 then died without a word
    assert kv.keys("arrive/") == [f"arrive/{first.nonce}"]  # rank 1 took its own away
    assert not kv.keys("ack/")
    second.forget()
    assert not kv.keys("run/")
    # The dead rank 0's arrival is answered, and deleted, by the next rank 0.
    made = run_ranks(kv, [(0, 2), (1, 2)], 10.0)
    try:
        assert all(isinstance(r, tuple) for r in made), made
        assert kv.data == {}
    finally:
        close(made)


def test_creating_a_group_takes_at_most_its_timeout_in_all() -> None:
    # Rank 1 waits most of its time for rank 0, then both wait in plait.init for rank 2,
    # which never comes: rank 1 gives up at its timeout, not a timeout later.
    kv = FakeKV()
    timeout, late = 3.0, 2.0
    out: list[Any] = [None, None]

    def one(rank: int, delay: float) -> None:
        time.sleep(delay)
        start = time.monotonic()
        try:
            got: Any = create(kv, rank, 3, "g", timeout)
        except BaseException as exc:
            got = exc
        out[rank] = (got, time.monotonic() - start)

    threads = [threading.Thread(target=one, args=(r, d)) for r, d in ((1, 0.0), (0, late))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(3 * timeout + 10)
    for got, seconds in out:
        assert isinstance(got, StoreTimeout), got
        assert seconds < timeout + 1.0, (seconds, got)
    got, _ = out[1]
    assert f"of its {timeout:g} s" in " ".join(got.__notes__), got.__notes__


def test_a_created_group_keeps_its_whole_timeout_for_calls() -> None:
    # plait.init is given what is left of the creation's time; the calls are not.
    kv = FakeKV()
    found: list[Any] = []
    t = threading.Thread(target=lambda: found.append(create(kv, 1, 2, "g", 30.0)))
    t.start()
    time.sleep(0.5)
    made = [create(kv, 0, 2, "g", 30.0)]
    t.join(30)
    made += found
    try:
        assert len(made) == 2, made
        assert [comm.timeout for _, comm in made] == [30.0, 30.0]
    finally:
        close(made)
