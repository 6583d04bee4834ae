"""Every store backend honours the Store contract: memory, TCP, file and Redis alike."""

from __future__ import annotations

import functools
import os
import threading
import time

import pytest
from store_backends import Backend, Background, run_python

from plait.errors import RendezvousError
from plait.rendezvous.store import PrefixStore, Store, StoreTimeout


def test_set_get_and_overwrite(store: Store) -> None:
    store.set("k", b"first")
    assert store.get("k") == b"first"
    store.set("k", b"second")
    assert store.get("k") == b"second"


def test_another_client_sees_the_value(backend: Backend) -> None:
    writer, reader = backend.client(), backend.client()
    writer.set("shared", b"hello")
    assert reader.get("shared") == b"hello"
    assert reader.check(["shared"])


def test_get_blocks_until_another_thread_sets(backend: Backend) -> None:
    writer, reader = backend.client(), backend.client()
    started = threading.Event()

    def get() -> bytes:
        started.set()
        return reader.get("late")

    getter = Background(get)
    assert started.wait(10)
    writer.set("late", b"value")
    assert getter.result() == b"value"


def test_wait_returns_once_all_keys_are_set(backend: Backend) -> None:
    writer, waiter = backend.client(), backend.client()
    started = threading.Event()

    def wait() -> None:
        started.set()
        waiter.wait(["a", "b", "c"])

    waiting = Background(wait)
    assert started.wait(10)
    writer.set("a", b"1")
    writer.add("b", 1)
    assert not waiting.done.is_set()  # "c" is still missing
    writer.set("c", b"")
    waiting.result()


def test_wait_for_nothing_returns_at_once(store: Store) -> None:
    store.wait([])
    assert store.check([])


def test_add_counts_and_reads_back_as_decimal(store: Store) -> None:
    assert store.add("n", 5) == 5
    assert store.add("n", -7) == -2
    assert store.add("n", 0) == -2
    assert store.get("n") == b"-2"
    store.set("m", b"40")
    assert store.add("m", 2) == 42


def test_add_on_a_non_integer_value_is_a_value_error(store: Store) -> None:
    store.set("text", b"not a number")
    with pytest.raises(ValueError, match=r"text|integer|invalid literal"):
        store.add("text", 1)
    assert store.get("text") == b"not a number"


@pytest.mark.parametrize("shared_client", [False, True], ids=["client_per_thread", "one_client"])
def test_add_from_threads_is_atomic(backend: Backend, shared_client: bool) -> None:
    threads, per_thread = 8, 40
    shared = backend.client()
    clients = [shared if shared_client else backend.client() for _ in range(threads)]
    barrier = threading.Barrier(threads)

    def work(client: Store) -> list[int]:
        barrier.wait(10)
        return [client.add("counter", 1) for _ in range(per_thread)]

    workers = [Background(functools.partial(work, c)) for c in clients]
    seen = [v for w in workers for v in w.result()]
    # Every add saw a distinct count: no two read-modify-writes interleaved.
    assert sorted(seen) == list(range(1, threads * per_thread + 1))
    assert shared.get("counter") == str(threads * per_thread).encode()


@pytest.mark.multiprocess
def test_add_from_processes_is_atomic(backend: Backend) -> None:
    if backend.client_code is None:
        pytest.skip(f"the {backend.name} store lives in one process")
    store = backend.client()
    procs, per_proc = 4, 25
    code = (
        f"{backend.client_code}\n"
        f"print(' '.join(str(store.add('counter', 1)) for _ in range({per_proc})))\n"
        "store.close()\n"
    )
    outputs = run_python([code] * procs)
    seen = sorted(int(v) for out in outputs for v in out.split())
    assert seen == list(range(1, procs * per_proc + 1))
    assert store.get("counter") == str(procs * per_proc).encode()


@pytest.mark.multiprocess
def test_get_across_processes(backend: Backend) -> None:
    if backend.client_code is None:
        pytest.skip(f"the {backend.name} store lives in one process")
    store = backend.client()
    # The child blocks in get("ping") until we set it, then answers on "pong".
    code = (
        f"{backend.client_code}\nstore.set('pong', store.get('ping') + b'-pong')\nstore.close()\n"
    )
    child = Background(lambda: run_python([code]))
    store.set("ping", b"ping")
    assert store.get("pong") == b"ping-pong"
    child.result(60)


def test_wait_timeout_names_only_the_missing_keys(store: Store) -> None:
    store.set("present", b"x")
    start = time.monotonic()
    with pytest.raises(StoreTimeout) as info:
        store.wait(["present", "missing-1", "missing-2"], timeout=0.2000000001)
    elapsed = time.monotonic() - start
    assert 0.15 <= elapsed < 3.0
    message = str(info.value)
    # A time left over (shrink's, init's) is said briefly: it read "within 0.2000000001 s".
    assert "within 0.2 s" in message, message
    assert "'missing-1'" in message
    assert "'missing-2'" in message
    assert "'present'" not in message
    assert isinstance(info.value, RendezvousError)
    assert isinstance(info.value, TimeoutError)


def test_get_timeout_names_the_key(store: Store) -> None:
    start = time.monotonic()
    with pytest.raises(StoreTimeout, match="'absent'"):
        store.get("absent", timeout=0.2)
    assert 0.15 <= time.monotonic() - start < 3.0


def test_zero_timeout_checks_once(store: Store) -> None:
    store.set("here", b"1")
    store.wait(["here"], timeout=0)
    assert store.get("here", timeout=0) == b"1"
    with pytest.raises(StoreTimeout):
        store.wait(["here", "not-here"], timeout=0)


def test_default_timeout_comes_from_the_store(backend: Backend) -> None:
    store = backend.client()
    store.timeout = 0.2
    start = time.monotonic()
    with pytest.raises(StoreTimeout):
        store.get("absent")
    assert time.monotonic() - start < 3.0


def test_check_and_delete(store: Store) -> None:
    assert not store.check(["k"])
    assert not store.delete("k")
    store.set("k", b"v")
    store.set("j", b"w")
    assert store.check(["k"])
    assert store.check(["k", "j"])
    assert not store.check(["k", "absent"])
    assert store.delete("k")
    assert not store.delete("k")
    assert not store.check(["k"])
    assert store.check(["j"])
    with pytest.raises(StoreTimeout):
        store.get("k", timeout=0)


def test_deleted_key_can_be_set_and_added_again(store: Store) -> None:
    store.add("n", 3)
    assert store.delete("n")
    assert store.add("n", 1) == 1


def test_prefix_stores_are_isolated(store: Store) -> None:
    group_a, group_b = PrefixStore("a", store), PrefixStore("b/", store)
    group_a.set("rank0", b"from a")
    group_b.set("rank0", b"from b")
    assert group_a.get("rank0") == b"from a"
    assert group_b.get("rank0") == b"from b"
    assert store.get("a/rank0") == b"from a"
    assert group_a.add("count", 2) == 2
    assert not group_b.check(["count"])
    with pytest.raises(StoreTimeout, match="count"):
        group_b.wait(["count"], timeout=0.05)
    assert group_b.delete("rank0")
    assert group_a.check(["rank0"])


@pytest.mark.parametrize(
    "value",
    [b"", b"\x00", bytes(range(256)), b"\xff" * 65537, os.urandom(1 << 20)],
    ids=["empty", "nul", "all_bytes", "64KiB+1", "1MiB"],
)
def test_binary_values_round_trip(backend: Backend, value: bytes) -> None:
    writer, reader = backend.client(), backend.client()
    writer.set("blob", value)
    assert reader.get("blob") == value
    # Beyond the contract's bytes, every backend also takes other buffers.
    writer.set("view", memoryview(value))  # type: ignore[arg-type]
    assert reader.get("view") == value


def test_awkward_keys(store: Store) -> None:
    keys = ["", "/", "a/b/c", "../escape", ".lock", "ünïcødé ✓", "sp ace\ttab\nnl", "x" * 500]
    for i, key in enumerate(keys):
        store.set(key, str(i).encode())
    for i, key in enumerate(keys):
        assert store.get(key) == str(i).encode()
    assert store.check(keys)


def test_many_keys(backend: Backend) -> None:
    writer, reader = backend.client(), backend.client()
    keys = [f"rank/{i}/address" for i in range(300)]
    for i, key in enumerate(keys):
        writer.set(key, f"10.0.{i // 256}.{i % 256}:4000".encode())
    reader.wait(keys)
    assert reader.check(keys)
    assert [reader.get(k) for k in keys[::37]] == [
        f"10.0.{i // 256}.{i % 256}:4000".encode() for i in range(0, 300, 37)
    ]


def test_values_are_copied_on_set(store: Store) -> None:
    buf = bytearray(b"before")
    store.set("k", buf)  # type: ignore[arg-type]
    buf[:] = b"after!"
    assert store.get("k") == b"before"
