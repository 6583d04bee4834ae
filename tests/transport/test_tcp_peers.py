"""TcpTransport(peers=...): a mesh over some pairs only, as a hybrid transport builds it."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from tcp_helpers import no_leaks  # noqa: F401 (fixture)

from plait.rendezvous.store import MemoryStore
from plait.transport.conformance import build_in_threads, run_ranks, wait_all
from plait.transport.tcp import BootstrapTimeout, TcpTransport

pytestmark = pytest.mark.usefixtures("no_leaks")

# Four ranks on two "hosts": {0, 1} and {2, 3}; TCP connects only across them.
HOSTS = [[0, 1], [2, 3]]


def _across(rank: int) -> list[int]:
    return [j for host in HOSTS if rank not in host for j in host]


def _pattern(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


@pytest.mark.parametrize("streams", [1, 3])
def test_mesh_across_hosts_only(streams: int) -> None:
    store = MemoryStore(timeout=30)
    ts = build_in_threads(
        4,
        lambda r: TcpTransport(r, 4, store, timeout=30, streams=streams, peers=_across(r)),
    )
    try:
        for t in ts:
            assert t.peers == frozenset(_across(t.rank))
            connected = [j for j, p in enumerate(t._link.peers) if p is not None]
            assert connected == _across(t.rank)
            assert all(len(p.conns) == streams for p in t._link.peers if p is not None)
        sizes = [8, 600_000, 3 << 20]

        def body(t: TcpTransport) -> dict[tuple[int, int], np.ndarray]:
            hs = []
            got = {}
            for j in _across(t.rank):
                for i, n in enumerate(sizes):
                    got[j, i] = np.zeros(n, np.uint8)
                    hs.append(t.irecv(j, i, got[j, i].data, 0))
                    hs.append(t.isend(j, i, _pattern(n, 100 * t.rank + 10 * j + i).data, 0))
            self_got = np.zeros(4, np.uint8)  # self-sends need no connection
            hs += [t.isend(t.rank, 9, _pattern(4, t.rank).data, 0)]
            hs += [t.irecv(t.rank, 9, self_got.data, 0)]
            wait_all(t, hs)
            assert [h.error for h in hs] == [None] * len(hs)
            np.testing.assert_array_equal(self_got, _pattern(4, t.rank))
            return got

        results = run_ranks(ts, body)
        for r, got in enumerate(results):
            for (j, i), arr in got.items():
                np.testing.assert_array_equal(arr, _pattern(sizes[i], 100 * j + 10 * r + i))
    finally:
        for t in ts:
            t.close()


def test_ranks_outside_peers_are_refused() -> None:
    store = MemoryStore(timeout=30)
    ts = build_in_threads(
        4, lambda r: TcpTransport(r, 4, store, timeout=30, peers=[*_across(r), r])
    )
    try:
        buf = np.zeros(4, np.uint8)
        with pytest.raises(ValueError, match=r"rank 0: rank 1 is not among .* peers \[2, 3\]"):
            ts[0].isend(1, 0, buf.data, 0)
        with pytest.raises(ValueError, match=r"rank 3: rank 2 is not among"):
            ts[3].irecv(2, 0, buf.data, 0)
        assert ts[0].bytes_sent == 0
        assert not ts[3]._posted
    finally:
        for t in ts:
            t.close()


def test_bad_peers_arguments() -> None:
    store = MemoryStore()
    with pytest.raises(ValueError, match="peers lists rank 5"):
        TcpTransport(0, 2, store, peers=[1, 5])
    with pytest.raises(ValueError, match="peers lists rank -1"):
        TcpTransport(0, 2, store, peers=[-1])
    with pytest.raises(TypeError, match="peers must hold ints"):
        TcpTransport(0, 2, store, peers=["1"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="peers must hold ints"):
        TcpTransport(0, 2, store, peers=[True])
    alone = TcpTransport(0, 3, store, peers=[np.int64(0)], timeout=5)  # only itself: no peers
    try:
        assert alone.peers == frozenset()
        got = np.zeros(2, np.uint8)
        hs = [alone.isend(0, 1, np.ones(2, np.uint8).data, 0), alone.irecv(0, 1, got.data, 0)]
        wait_all(alone, hs)
        assert got.tolist() == [1, 1]
    finally:
        alone.close()


def test_asymmetric_peers_time_out_naming_the_rank() -> None:
    """Rank 1 lists rank 0 but not the other way round: rank 1 never gets through."""
    store = MemoryStore(timeout=10)
    out: dict[int, object] = {}

    def build(rank: int, peers: list[int]) -> None:
        try:
            out[rank] = TcpTransport(rank, 2, store, timeout=1.0, peers=peers)
        except BaseException as exc:
            out[rank] = exc

    threads = [
        threading.Thread(target=build, args=(0, [])),
        threading.Thread(target=build, args=(1, [0])),
    ]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    try:
        assert isinstance(out[1], BootstrapTimeout), out[1]
        assert "could not connect to rank(s) [0]" in str(out[1])
        assert isinstance(out[0], TcpTransport), out[0]
    finally:
        for t in out.values():
            if isinstance(t, TcpTransport):
                t.close()
