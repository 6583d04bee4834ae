"""plait.dask's store over the scheduler's metadata, its secret and rank order, with a fake client.

The fake does what a Dask scheduler does with ``set_metadata``/``get_metadata``
(a tree of values indexed by a list of keys) and with published datasets
(``override=False`` refuses a name that exists), without Dask: these tests
always run.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import plait
from plait.dask._run import _scheduler_host, rank_order
from plait.dask._store import SECRET_DATASET, DaskKeyValue, adopt_secret, ensure_secret
from plait.rendezvous.kv_store import KVStore
from plait.rendezvous.store import StoreTimeout

_NO_DEFAULT = object()


class FakeClient:
    """The parts of ``distributed.Client`` plait.dask uses, kept in memory as a scheduler would."""

    def __init__(self, workers: dict[str, dict[str, Any]] | None = None) -> None:
        self.metadata: dict[Any, Any] = {}
        self.datasets: dict[str, Any] = {}
        self.workers = workers or {}
        self.lock = threading.Lock()

    def set_metadata(self, keys: list[str], value: Any) -> None:
        with self.lock:
            node = self.metadata
            for key in keys[:-1]:
                if not isinstance(node.get(key), dict):
                    node[key] = {}
                node = node[key]
            node[keys[-1]] = value

    def get_metadata(self, keys: list[str], default: Any = _NO_DEFAULT) -> Any:
        with self.lock:
            node: Any = self.metadata
            try:
                for key in keys:
                    node = node[key]
            except KeyError:
                if default is _NO_DEFAULT:
                    raise
                return default
            return node

    def publish_dataset(self, value: Any, *, name: str, override: bool = False) -> None:
        with self.lock:
            if name in self.datasets and not override:
                raise KeyError(f"Dataset {name} already exists")
            self.datasets[name] = value

    def get_dataset(self, name: str, default: Any = _NO_DEFAULT) -> Any:
        with self.lock:
            if name not in self.datasets and default is not _NO_DEFAULT:
                return default
            return self.datasets[name]

    def list_datasets(self) -> list[str]:
        with self.lock:
            return sorted(self.datasets)

    def scheduler_info(self, n_workers: int = -1) -> dict[str, Any]:
        return {"workers": self.workers}


def test_keys_live_in_one_branch_and_deletes_read_as_unset() -> None:
    client = FakeClient()
    kv = DaskKeyValue(client, "plait-dask-abc-0")
    assert kv.get("a") is None
    assert not kv.put("a", b"1", True)
    assert client.metadata == {"plait-dask-abc-0": {"plait": {"a": b"1"}}}
    assert kv.put("a", b"2", False)  # put-if-absent: the key exists, nothing changes
    assert kv.get("a") == b"1"
    assert kv.put("a", b"3", True)
    assert kv.get("a") == b"3"
    kv.put("b/1", b"", True)
    kv.put("b/2", b"", True)
    assert sorted(kv.keys("b/")) == ["b/1", "b/2"]
    assert kv.delete("a") == 1
    assert kv.delete("a") == 0
    assert not kv.exists("a")
    assert kv.delete("b/", by_prefix=True) == 2
    assert kv.keys("") == []
    kv.put("c", b"", True)
    assert kv.delete("", by_prefix=True) == 1
    assert client.metadata == {"plait-dask-abc-0": {"plait": {}}}
    other = DaskKeyValue(client, "plait-dask-def-0")  # another run: another branch
    assert other.get("c") is None


def test_kv_store_over_the_metadata_serves_plait_init() -> None:
    client = FakeClient()
    store = KVStore(DaskKeyValue(client, "root"), timeout=2.0)
    store.set("plait/init3/host/0", b"h")
    assert store.get("plait/init7/host/0") == b"h"  # the count of init calls is dropped
    assert store.add("n", 2) == 2
    assert store.add("n", 3) == 5
    assert store.get("n") == b"5"
    with pytest.raises(StoreTimeout, match=r"\['missing'\]"):
        store.wait(["n", "missing"], 0.05)
    assert DaskKeyValue(client, "root").delete("", by_prefix=True) == 3  # what run does
    assert not store.check(["n"])


def test_ranks_in_threads_meet_and_reduce_through_the_fake_scheduler() -> None:
    client = FakeClient()
    size = 3
    out: list[Any] = [None] * size
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            store = KVStore(DaskKeyValue(client, "run"), timeout=10.0)
            with plait.init(rank=r, size=size, store=store, timeout=10.0) as comm:
                out[r] = comm.allreduce(np.full(3, r + 1.0))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not errors, errors
    for o in out:
        np.testing.assert_array_equal(o, np.full(3, 6.0))


def test_the_secret_is_drawn_once_and_a_process_keeps_its_own() -> None:
    client = FakeClient()
    with pytest.raises(RuntimeError, match="no plait secret"):
        adopt_secret(client, {})
    ensure_secret(client)
    first = client.datasets[SECRET_DATASET]
    ensure_secret(client)  # a second run, or another client, keeps it
    assert client.datasets[SECRET_DATASET] == first
    a: dict[str, str] = {}
    b: dict[str, str] = {}
    assert adopt_secret(client, a) == adopt_secret(client, b) == first
    assert len(first) == 64
    assert adopt_secret(client, {"PLAIT_SECRET": "mine"}) == "mine"


def test_a_secret_published_meanwhile_by_another_client_wins() -> None:
    client = FakeClient()

    def racing_list() -> list[str]:
        # another client publishes between this client's check and its publish
        client.datasets.setdefault(SECRET_DATASET, "theirs")
        return []

    client.list_datasets = racing_list  # type: ignore[method-assign]
    ensure_secret(client)
    assert adopt_secret(client, {}) == "theirs"


def test_the_secret_is_published_under_the_lock_and_checked_again_there() -> None:
    client = FakeClient()
    entered: list[bool] = []

    @contextlib.contextmanager
    def lock() -> Iterator[None]:
        # another client publishes while this one waits for the lock
        client.datasets.setdefault(SECRET_DATASET, "theirs")
        entered.append(True)
        yield

    publish = client.publish_dataset

    def no_second_publish(value: Any, *, name: str, override: bool = False) -> None:
        raise AssertionError("published although the secret was there")

    client.publish_dataset = no_second_publish  # type: ignore[method-assign]
    ensure_secret(client, lock())
    assert entered == [True]
    assert adopt_secret(client, {}) == "theirs"
    ensure_secret(client, lock())  # there: the lock is not taken
    assert entered == [True]
    client.publish_dataset = publish  # type: ignore[method-assign]


def test_rank_order_groups_hosts_then_names_and_follows_workers() -> None:
    workers = {
        "tcp://10.0.0.2:4000": {"host": "10.0.0.2", "name": 0},
        "tcp://10.0.0.1:5000": {"host": "10.0.0.1", "name": 10},
        "tcp://10.0.0.1:3000": {"host": "10.0.0.1", "name": 2},
        "tcp://10.0.0.1:6000": {"host": "10.0.0.1", "name": "gpu"},
    }
    client = FakeClient(workers)
    assert rank_order(client) == [
        "tcp://10.0.0.1:3000",
        "tcp://10.0.0.1:5000",
        "tcp://10.0.0.1:6000",
        "tcp://10.0.0.2:4000",
    ]
    assert rank_order(client, ["gpu", "tcp://10.0.0.2:4000", 2]) == [  # type: ignore[list-item]
        "tcp://10.0.0.1:6000",
        "tcp://10.0.0.2:4000",
        "tcp://10.0.0.1:3000",
    ]
    with pytest.raises(ValueError, match="no worker of the cluster"):
        rank_order(client, ["nope"])
    with pytest.raises(ValueError, match="a second time"):
        rank_order(client, ["gpu", "tcp://10.0.0.1:6000"])
    with pytest.raises(ValueError, match="empty"):
        rank_order(client, [])
    with pytest.raises(TypeError, match="list"):
        rank_order(client, "gpu")
    with pytest.raises(ValueError, match="no workers"):
        rank_order(FakeClient())


def test_scheduler_host() -> None:
    assert _scheduler_host("tcp://127.0.0.1:8786") == "127.0.0.1"
    assert _scheduler_host("tls://[::1]:8786") == "::1"
    assert _scheduler_host("inproc://192.0.2.2/3832/1") is None
