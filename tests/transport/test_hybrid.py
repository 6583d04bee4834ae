"""An endpoint with a link per peer: shared memory within a host, TCP across, one wait for both."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from types import SimpleNamespace

import numpy as np
import pytest

from plait.errors import PeerLostError, RendezvousError
from plait.rendezvous.store import MemoryStore, PrefixStore, StoreTimeout
from plait.transport import conformance
from plait.transport.endpoint import Endpoint
from plait.transport.route import LINKS, HybridTransport, choose, connect
from plait.transport.shm import ShmTransport
from plait.transport.shm.link import ShmLink
from plait.transport.tcp import TcpTransport
from plait.transport.tcp.link import TcpLink

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm (Linux)")


def split_hosts(size: int) -> list[str]:
    """The first half of the ranks on host a, the rest on host b."""
    return ["a" if r < (size + 1) // 2 else "b" for r in range(size)]


def round_robin_hosts(size: int) -> list[str]:
    """Ranks dealt to three hosts in turn (so local ranks are not contiguous)."""
    return ["abc"[r % 3] for r in range(size)]


LAYOUTS: dict[str, Callable[[int], list[str]]] = {
    "split": split_hosts,
    "round-robin": round_robin_hosts,
}


@pytest.fixture(autouse=True)
def no_leftover_segments(own_segments: list[str]) -> None:
    """Every test removes the segments its own transports created (see conftest.py)."""


def factory(layout: Callable[[int], list[str]]) -> Callable[[int], Sequence[HybridTransport]]:
    store = MemoryStore(timeout=30)  # one store for every group the check makes
    count = [0]

    def make(size: int) -> Sequence[HybridTransport]:
        count[0] += 1
        hosts = layout(size)
        prefix = f"g{count[0]}"

        return conformance.build_in_threads(
            size,
            lambda rank: HybridTransport(rank, size, hosts, PrefixStore(prefix, store), timeout=30),
        )

    return make


@pytest.mark.parametrize(
    "layout",
    # slow: the quick loop checks shared memory and TCP, which this composes, on their own
    [pytest.param(name, marks=pytest.mark.slow) for name in LAYOUTS],
)
@pytest.mark.parametrize("check", conformance.CHECKS, ids=lambda f: f.__name__)
def test_conformance(check: Callable[[conformance.Factory], None], layout: str) -> None:
    check(factory(LAYOUTS[layout]))


def test_routes_each_pair_by_host() -> None:
    ts = factory(split_hosts)(4)
    try:
        t0 = ts[0]
        assert isinstance(t0.shm, ShmLink)
        assert isinstance(t0.tcp, TcpLink)
        assert t0.local == [0, 1]
        assert [t0._route[p] for p in (1, 2, 3)] == [t0.shm, t0.tcp, t0.tcp]
        data = np.arange(1000, dtype=np.uint8)

        def body(t: HybridTransport) -> int:
            rank = t.rank
            out = [np.zeros(1000, np.uint8) for _ in range(4)]
            hs = []
            for peer in range(4):
                if peer != rank:
                    hs.append(t.isend(peer, 7, memoryview(data), 1))
                    hs.append(t.irecv(peer, 7, memoryview(out[peer]), 1))
            conformance.wait_all(t, hs)
            for peer in range(4):
                if peer != rank:
                    assert np.array_equal(out[peer], data)
            return t.bytes_sent

        sent = conformance.run_ranks(ts, body)
        # Each rank sends 1000 B to its one neighbour on the host, 2000 B across hosts.
        assert sent == [3000] * 4
    finally:
        for t in ts:
            t.close()


def test_one_rank_per_host_has_no_shared_memory() -> None:
    ts = factory(lambda size: [f"h{r}" for r in range(size)])(3)
    try:
        assert all(t.shm is None and t.tcp is not None for t in ts)
    finally:
        for t in ts:
            t.close()


def test_errors_name_ranks_of_the_job() -> None:
    """A local peer that closes is named by its rank in the job, not on its host."""
    ts = factory(lambda size: ["a", "b", "a", "b"])(4)
    try:
        buf = np.zeros(4, np.uint8)
        h = ts[0].irecv(2, 1, memoryview(buf), 0)
        ts[2].close()
        assert ts[0].wait_any([h], 20.0)
        assert isinstance(h.error, PeerLostError)
        assert "rank 2 " in str(h.error)
    finally:
        for t in ts:
            t.close()


def test_waits_on_both_transports_from_several_threads() -> None:
    """Two threads per rank, one talking across hosts, one within: both finish."""
    ts = factory(split_hosts)(4)
    n, rounds = 4096, 50
    try:

        def body(t: HybridTransport) -> None:
            rank = t.rank
            local = rank ^ 1  # 0<->1, 2<->3
            remote = (rank + 2) % 4
            errors: list[BaseException] = []

            def talk(peer: int, tag: int) -> None:
                try:
                    out = np.empty(n, np.float64)
                    for i in range(rounds):
                        src = np.full(n, rank * 1000 + i, np.float64)
                        s = t.isend(peer, tag + i, memoryview(src).cast("B"), 0)
                        r = t.irecv(peer, tag + i, memoryview(out).cast("B"), 0)
                        conformance.wait_all(t, [s, r])
                        assert out[0] == peer * 1000 + i
                except BaseException as exc:
                    errors.append(exc)

            threads = [
                threading.Thread(target=talk, args=(local, 1000)),
                threading.Thread(target=talk, args=(remote, 5000)),
            ]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            if errors:
                raise errors[0]

        conformance.run_ranks(ts, body)
    finally:
        for t in ts:
            t.close()


def test_bad_arguments() -> None:
    store = MemoryStore(timeout=5)
    with pytest.raises(ValueError, match="hosts must name"):
        HybridTransport(0, 2, ["a"], store)
    with pytest.raises(ValueError, match="invalid rank"):
        HybridTransport(2, 2, ["a", "b"], store)


def test_a_message_over_either_link_wakes_a_sleeping_waiter() -> None:
    """One wait covers both links: a thread asleep on a TCP and a shared-memory receive
    wakes for whichever comes, here the shared-memory one, then for the TCP one."""
    ts = factory(split_hosts)(4)
    try:
        t0 = ts[0]
        local_buf, remote_buf = np.zeros(64, np.uint8), np.zeros(64, np.uint8)
        from_local = t0.irecv(1, 3, memoryview(local_buf), 0)
        from_remote = t0.irecv(2, 3, memoryview(remote_buf), 0)
        done: list[bool] = []
        waiter = threading.Thread(
            target=lambda: done.append(t0.wait_any([from_local, from_remote], 20.0))
        )
        waiter.start()
        conformance.wait_all(ts[1], [ts[1].isend(0, 3, memoryview(np.full(64, 1, np.uint8)), 0)])
        waiter.join(20.0)
        assert done == [True]
        assert from_local.done
        assert not from_remote.done
        conformance.wait_all(ts[2], [ts[2].isend(0, 3, memoryview(np.full(64, 2, np.uint8)), 0)])
        assert t0.wait_any([from_remote], 20.0)
        assert (local_buf == 1).all()
        assert (remote_buf == 2).all()
    finally:
        for t in ts:
            t.close()


def test_choose_takes_the_first_link_that_reaches_each_peer() -> None:
    hosts = ["a", "b", "a", "c"]
    assert choose(0, hosts) == {"shm": [2], "tcp": [1, 3]}
    assert choose(3, hosts) == {"shm": [], "tcp": [0, 1, 2]}
    assert choose(0, hosts, ("tcp", "shm")) == {"tcp": [1, 2, 3], "shm": []}
    assert LINKS == ("shm", "tcp")
    with pytest.raises(RendezvousError, match="needs all ranks on one host"):
        choose(0, hosts, ("shm",))
    with pytest.raises(ValueError, match="unknown link"):
        choose(0, hosts, ("carrier-pigeon",))


@pytest.mark.parametrize(
    ("hosts", "kind"),
    [
        (["a", "a"], ShmTransport),
        (["a", "b"], TcpTransport),
        (["a", "a", "b"], HybridTransport),  # rank 2 is alone on b, yet every rank agrees
    ],
)
def test_connect_builds_one_class_for_the_whole_job(hosts: list[str], kind: type) -> None:
    store = MemoryStore(timeout=30)
    size = len(hosts)
    ts = conformance.build_in_threads(
        size, lambda rank: connect(rank, size, hosts, store, timeout=30)
    )
    try:
        assert all(type(t) is kind for t in ts)

        def ring(t: Endpoint) -> int:
            got = np.zeros(1, np.uint8)
            hs = [
                t.isend((t.rank + 1) % size, 1, memoryview(np.full(1, t.rank, np.uint8)), 0),
                t.irecv((t.rank - 1) % size, 1, memoryview(got), 0),
            ]
            conformance.wait_all(t, hs)
            return int(got[0])

        assert conformance.run_ranks(ts, ring) == [(r - 1) % size for r in range(size)]
    finally:
        for t in ts:
            t.close()


def test_a_host_that_never_says_its_window_is_named_by_its_first_rank() -> None:
    # Before, this timed out with the raw store key ('window/1') and no rank.
    me = SimpleNamespace(rank=0, host_window=None)  # the first rank of host "a"
    with pytest.raises(StoreTimeout) as info:
        HybridTransport._agree_windows(
            me,  # type: ignore[arg-type]
            MemoryStore(),
            ["a", "b", "a", "b"],
            time.monotonic() + 0.2,
        )
    msg = str(info.value)
    assert msg.startswith("rank 0: rank(s) [1] (the first of their host) did not say"), msg
    assert "window/" not in msg
