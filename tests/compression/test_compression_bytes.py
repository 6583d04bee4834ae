"""Bytes on the wire: each method's reduction on fixed cases, counted by every transport.

Every allreduce involved, compressed or not, is pinned to the ring algorithm
(PLAIT_ALGO; 4 ranks, sizes divisible by 4), whose bytes per rank are exactly
``2 (p - 1) / p * nbytes``; so the ratios are exact and match the formulas in
docs/compression.md.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import plait
from on_threads import run_on
from plait.communicator import Communicator, Stats
from plait.compression import BF16, FP16, Compressor, Int8, PowerSGD, TopK
from plait.rendezvous.store import MemoryStore, PrefixStore
from plait.testing import run_ranks
from plait.transport.conformance import build_in_threads

# Stall probes would add their bytes to the exact counts here (conftest.no_stall_probes).
pytestmark = pytest.mark.usefixtures("no_stall_probes")

P = 4


@pytest.fixture(autouse=True)
def ring_allreduce(monkeypatch: pytest.MonkeyPatch) -> None:
    """The byte counts below are those of the ring algorithm: pin it whatever auto's rules say."""
    monkeypatch.setenv("PLAIT_ALGO", "allreduce:ring")


def ring_bytes(nbytes: int, p: int = P) -> int:
    """Bytes one rank sends in a ring allreduce of ``nbytes`` (divisible by p)."""
    return 2 * (p - 1) * nbytes // p


def measure(shape: tuple[int, ...], make: Callable[[], Compressor | None]) -> list[Stats]:
    """Per rank: what one allreduce of a float32 array of ``shape`` sent and received."""
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(shape).astype(np.float32) for _ in range(P)]

    def body(comm: plait.Communicator) -> Stats:
        c = make()
        before = comm.stats()
        comm.allreduce(xs[comm.rank], compression=c)
        return comm.stats() - before

    return run_ranks(P, body, window=0)  # messages only: bytes on the wire to count


def sent(stats: list[Stats]) -> int:
    values = {s.bytes_sent for s in stats}
    assert len(values) == 1, f"ranks sent different amounts: {stats}"
    assert {s.bytes_received for s in stats} == values
    return values.pop()


# (name, shape, compressor, expected bytes sent per rank, expected ratio to float32)
N = 256 * 256
SHARD = N // P
TOPK = math.ceil(0.01 * N)
CASES: list[tuple[str, tuple[int, ...], Callable[[], Compressor], int, float]] = [
    ("fp16", (256, 256), FP16, ring_bytes(2 * N), 1 / 2),
    ("bf16", (256, 256), BF16, ring_bytes(2 * N), 1 / 2),
    # alltoall + allgather, each (p-1) parts of shard int8 codes + shard/256 float32 scales, and
    # the allgather's rows start with the call's 16-byte header (Note [call headers])
    (
        "int8",
        (256, 256),
        Int8,
        2 * (P - 1) * (SHARD + 4 * SHARD // 256) + 16 * (P - 1),
        (1 + 4 / 256) / 4 + 2 * P / N,
    ),
    # an allgather of the 16-byte header and k (uint32 index, float32 value) pairs
    ("topk", (256, 256), lambda: TopK(0.01), (P - 1) * (16 + TOPK * 8), P * TOPK / N + 2 * P / N),
    # allreduces of P (n x r) and Q (m x r)
    (
        "powersgd",
        (1024, 1024),
        lambda: PowerSGD(4),
        ring_bytes(4 * 1024 * 4) * 2,
        (1024 + 1024) * 4 / 1024**2,
    ),
]


@pytest.mark.parametrize(
    ("name", "shape", "make", "expected", "ratio"), CASES, ids=[c[0] for c in CASES]
)
def test_bytes_on_the_wire(
    name: str, shape: tuple[int, ...], make: Callable[[], Compressor], expected: int, ratio: float
) -> None:
    baseline = sent(measure(shape, lambda: None))
    assert baseline == ring_bytes(4 * math.prod(shape))
    got = sent(measure(shape, make))
    assert got == expected, f"{name}: {got} bytes, expected {expected}"
    assert got / baseline == pytest.approx(ratio, rel=1e-9)
    assert got < baseline


def test_powersgd_fallback_sends_what_allreduce_sends() -> None:
    assert sent(measure((100,), lambda: PowerSGD(4))) == sent(measure((100,), lambda: None))


# -- every transport counts the same bytes --------------------------------------------------------
def _transports(kind: str) -> list[Any]:
    store = MemoryStore(timeout=30)
    if kind == "shm":
        from plait.transport.shm import ShmTransport

        return build_in_threads(
            P, lambda r: ShmTransport(r, P, store, timeout=30, window_bytes=0)
        )  # messages only, as the others
    if kind == "tcp":
        from plait.transport.tcp import TcpTransport

        return build_in_threads(P, lambda r: TcpTransport(r, P, store, timeout=30))
    from plait.transport.route import HybridTransport

    hosts = ["a", "a", "b", "b"]
    return build_in_threads(
        P, lambda r: HybridTransport(r, P, hosts, PrefixStore("h", store), timeout=30)
    )


def _workload(comm: Communicator) -> tuple[list[np.ndarray], Stats]:
    rng = np.random.default_rng(comm.rank)
    x = rng.standard_normal((128, 96)).astype(np.float32)
    before = comm.stats()
    out = [
        comm.allreduce(x, compression=c.with_key("x"))
        for c in (FP16(), BF16(), Int8(64), TopK(0.05), PowerSGD(2))
    ]
    out.append(comm.allreduce(x))
    sub = comm.split(comm.rank % 2)  # a group's traffic shows on its parent's counters
    out.append(sub.allreduce(x, compression=Int8(64)))
    return out, comm.stats() - before


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm (Linux)")
@pytest.mark.parametrize("kind", ["shm", "tcp", "hybrid"])
def test_every_transport_counts_the_same_bytes(kind: str) -> None:
    want = run_ranks(P, _workload, window=0)  # as over TCP: messages only
    comms = [Communicator(t, timeout=60) for t in _transports(kind)]
    try:
        got = run_on(comms, _workload)
    finally:
        for c in comms:
            c.close()
    for r in range(P):
        for a, b in zip(got[r][0], want[r][0], strict=True):
            assert a.tobytes() == b.tobytes()
        assert got[r][1] == want[r][1], f"rank {r} over {kind}: {got[r][1]} vs {want[r][1]}"
        assert got[r][1].bytes_sent > 0
