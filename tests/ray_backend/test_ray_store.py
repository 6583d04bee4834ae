"""plait.ray's key-value adapter and group rendezvous, over a fake key-value store (no Ray needed).

The fake behaves as Ray's internal key-value store does: put-if-absent
reports whether the key existed, delete works by prefix, and nothing blocks.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import plait
from plait.ray._rendezvous import adopt_secret, create, group_namespace, meet
from plait.ray._store import RayKVStore
from plait.rendezvous.store import StoreTimeout


class FakeKV:
    """An in-memory stand-in for Ray's internal key-value store (one namespace)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.lock = threading.Lock()

    def get(self, key: str) -> bytes | None:
        with self.lock:
            return self.data.get(key)

    def put(self, key: str, value: bytes, overwrite: bool) -> bool:
        with self.lock:
            existed = key in self.data
            if overwrite or not existed:
                self.data[key] = bytes(value)
            return existed

    def exists(self, key: str) -> bool:
        with self.lock:
            return key in self.data

    def delete(self, key: str, by_prefix: bool = False) -> int:
        with self.lock:
            gone = [k for k in self.data if (k.startswith(key) if by_prefix else k == key)]
            for k in gone:
                del self.data[k]
            return len(gone)

    def keys(self, prefix: str) -> list[str]:
        with self.lock:
            return [k for k in self.data if k.startswith(prefix)]


def test_set_get_check_delete_and_prefix() -> None:
    kv = FakeKV()
    s = RayKVStore(kv, "run/t/", timeout=1.0)
    s.set("a", b"1")
    assert kv.data == {"run/t/a": b"1"}
    assert s.get("a") == b"1"
    assert s.check(["a"])
    assert not s.check(["a", "b"])
    assert s.delete("a")
    assert not s.delete("a")
    # plait.init's per-process count of init calls is dropped from its keys
    s.set("plait/init7/host/0", b"h")
    assert "run/t/plait/init/host/0" in kv.data
    assert RayKVStore(kv, "run/t/").get("plait/init2/host/0", 1.0) == b"h"
    with pytest.raises(TypeError):
        s.set("a", "text")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reserved"):
        s.set("a#1", b"")


def test_wait_times_out_naming_the_missing_keys() -> None:
    s = RayKVStore(FakeKV(), timeout=5.0)
    s.set("here", b"")
    start = time.monotonic()
    with pytest.raises(StoreTimeout, match=r"\['gone'\]"):
        s.wait(["here", "gone"], 0.1)
    assert time.monotonic() - start < 2.0


def test_get_waits_for_a_later_set() -> None:
    s = RayKVStore(FakeKV())
    t = threading.Timer(0.05, s.set, ("late", b"x"))
    t.start()
    try:
        assert s.get("late", 5.0) == b"x"
    finally:
        t.join()


def test_add_is_atomic_across_threads() -> None:
    kv = FakeKV()
    stores = [RayKVStore(kv) for _ in range(4)]  # one client per "process"
    seen: list[int] = []
    lock = threading.Lock()

    def work(s: RayKVStore) -> None:
        for _ in range(50):
            v = s.add("n", 1)
            with lock:
                seen.append(v)

    threads = [threading.Thread(target=work, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(seen) == list(range(1, 201))
    assert stores[0].get("n") == b"200"
    assert stores[1].add("n", -5) == 195
    assert stores[2].delete("n")
    assert not stores[2].check(["n"])
    assert stores[3].add("n", 2) == 2  # a deleted counter starts again at 0


def test_secret_is_shared_through_the_store() -> None:
    kv = FakeKV()
    a: dict[str, str] = {}
    b: dict[str, str] = {}
    assert adopt_secret(kv, a) == adopt_secret(kv, b) == a["PLAIT_SECRET"] == b["PLAIT_SECRET"]
    assert len(a["PLAIT_SECRET"]) == 64
    own = {"PLAIT_SECRET": "mine"}
    assert adopt_secret(kv, own) == "mine"  # a secret given to the process is kept


def _create(
    kv: FakeKV, size: int, timeout: float = 10.0, tokens: list[str] | None = None
) -> list[plait.Communicator]:
    """Every rank of a group creates it in a thread of its own, as Ray actors would."""
    comms: list[plait.Communicator | None] = [None] * size
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            m, comms[r] = create(kv, r, size, "g", timeout)
            if tokens is not None and r == 0:
                tokens.append(m.token)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in reversed(range(size))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    if errors:
        raise errors[0]
    return [c for c in comms if c is not None]


def test_incarnations_meet_under_fresh_tokens_and_leave_nothing_stale() -> None:
    kv = FakeKV()
    # What a dead earlier incarnation left: an unanswered arrival and keys of its run.
    kv.put("arrive/deadbeef", b"1", True)
    kv.put("run/old/plait/init/host/0", b"ghost", True)
    tokens: list[str] = []
    comms = _create(kv, 3, tokens=tokens)
    try:
        out = [np.empty(0)] * 3

        def call(c: plait.Communicator) -> None:
            out[c.rank] = c.allreduce(np.full(4, c.rank + 1.0))

        ts = [threading.Thread(target=call, args=(c,)) for c in comms]
        for t in ts:
            t.start()
        for t in ts:
            t.join(10)
        for o in out:
            np.testing.assert_array_equal(o, np.full(4, 6.0))
    finally:
        for c in comms:
            c.close()
    # Once created, the group keeps nothing in the store: not its own run, not the
    # arrivals and answers, not what the dead incarnation left.
    assert kv.data == {}
    comms = _create(kv, 2, tokens=tokens)  # created again under the same name
    for c in comms:
        c.close()
    assert kv.data == {}
    assert len(set(tokens)) == 2
    assert "old" not in tokens


def test_forget_deletes_the_incarnation_and_a_missing_rank_0_times_out() -> None:
    kv = FakeKV()
    m = meet(kv, 0, 2, "g", 1.0)
    m.store.set("x", b"1")
    m.forget()
    assert not kv.keys("run/")
    with pytest.raises(StoreTimeout, match="rank 0 did not create the group"):
        meet(FakeKV(), 1, 2, "g", 0.1)


def test_group_namespace_is_per_job_and_name() -> None:
    assert group_namespace("01000000", "g") != group_namespace("02000000", "g")
    assert group_namespace("01000000", "g") != group_namespace("01000000", "h")
