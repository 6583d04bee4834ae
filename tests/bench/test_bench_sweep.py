"""Sizes, element counts, bus-bandwidth factors and the iteration policy of ``plait bench``."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

import plait
import plait.communicator
from plait.bench.sweep import (
    BLOCK_COLLECTIVES,
    COLLECTIVES,
    IterationPolicy,
    Point,
    bandwidths,
    bus_factor,
    element_count,
    format_size,
    parse_size,
    points,
    selection_bytes,
    size_range,
    summarize,
)
from plait.testing import run_ranks


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [
        ("0", 0),
        ("8", 8),
        ("64K", 64 << 10),
        ("64k", 64 << 10),
        ("256M", 256 << 20),
        ("1G", 1 << 30),
        ("1.5M", 3 << 19),
        ("4KiB", 4096),
        ("4KB", 4096),
        ("12B", 12),
        (" 2M ", 2 << 20),
    ],
)
def test_parse_size(text: str, nbytes: int) -> None:
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["", "M", "-8", "1.5", "8X", "1e3", "0.1K"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError, match=r"size|whole"):
        parse_size(text)


def test_format_size() -> None:
    assert [format_size(n) for n in (0, 8, 1023, 1024, 1536, 256 << 20, 3 << 30)] == [
        "0 B",
        "8 B",
        "1023 B",
        "1 KiB",
        "1.5 KiB",
        "256 MiB",
        "3 GiB",
    ]


def test_size_range_like_nccl_tests() -> None:
    sizes = size_range(8, 256 << 20, 2)
    assert sizes[0] == 8
    assert sizes[-1] == 256 << 20
    assert len(sizes) == 26
    assert all(b == 2 * a for a, b in itertools.pairwise(sizes))
    assert size_range(0, 16, 4) == [0, 1, 4, 16]
    assert size_range(8, 8, 2) == [8]
    assert size_range(8, 100, 3) == [8, 24, 72]


@pytest.mark.parametrize(
    ("begin", "end", "factor", "message"),
    [(16, 8, 2, "begin <= end"), (-1, 8, 2, "begin <= end"), (8, 64, 1, "factor")],
)
def test_size_range_rejects(begin: int, end: int, factor: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        size_range(begin, end, factor)


def test_element_count_rounds_blocks_to_the_ranks() -> None:
    assert element_count("allreduce", 40, 4, 3) == 10
    assert element_count("allreduce", 7, 4, 3) == 1
    for c in BLOCK_COLLECTIVES:
        assert element_count(c, 40, 4, 3) == 9
        assert element_count(c, 8, 4, 3) == 0
    assert element_count("barrier", 1 << 20, 4, 3) == 0


def test_points_drop_rows_that_round_to_the_same_count() -> None:
    sizes = [0, 1, 2, 4, 8, 16]
    assert points("allreduce", sizes, 4, 2) == [Point(0, 0), Point(4, 1), Point(8, 2), Point(16, 4)]
    assert points("allgather", sizes, 4, 3) == [Point(0, 0), Point(12, 3)]
    assert points("barrier", sizes, 4, 3) == [Point(0, 0)]


def test_bus_factors_are_nccl_tests() -> None:
    for n in (1, 2, 3, 4, 8):
        assert bus_factor("allreduce", n) == pytest.approx(2 * (n - 1) / n)
        for c in ("reduce_scatter", "allgather", "alltoall", "gather", "scatter"):
            assert bus_factor(c, n) == pytest.approx((n - 1) / n)
        assert bus_factor("broadcast", n) == bus_factor("reduce", n) == 1.0
        assert bus_factor("barrier", n) == 0.0
    assert {c for c in COLLECTIVES} == set(plait.COLLECTIVES)
    with pytest.raises(ValueError, match="unknown collective"):
        bus_factor("allreduce_v", 2)


def test_bandwidths() -> None:
    algbw, busbw = bandwidths("allreduce", 1_000_000, 1e-3, 4)
    assert algbw == pytest.approx(1.0)  # 10^6 B in 1 ms is 1 GB/s
    assert busbw == pytest.approx(1.5)
    assert bandwidths("allgather", 2_000_000, 1e-3, 2) == pytest.approx((2.0, 1.0))
    assert bandwidths("allreduce", 0, 1e-3, 4) == (0.0, 0.0)
    assert bandwidths("barrier", 0, 1e-5, 4) == (0.0, 0.0)


def test_iteration_policy_adapts_to_the_size() -> None:
    p = IterationPolicy()
    assert p.warmup_for(8) == p.max_warmup
    assert p.warmup_for(0) == p.max_warmup
    assert p.warmup_for(256 << 20) == 1
    assert 1 < p.warmup_for(8 << 20) < p.max_warmup
    warmups = [p.warmup_for(1 << e) for e in range(3, 29)]
    assert warmups == sorted(warmups, reverse=True)
    assert p.iters_for(1e-6) == p.max_iters
    assert p.iters_for(1.0) == p.min_iters
    assert p.iters_for(p.seconds / 50) == 50
    assert p.iters_for(0.0) == p.max_iters


def test_iteration_policy_fixed_counts() -> None:
    p = IterationPolicy(iters=7, warmup=0)
    assert p.iters_for(10.0) == 7
    assert p.iters_for(1e-9) == 7
    assert p.warmup_for(8) == 0
    assert p.warmup_for(1 << 30) == 0


def test_iteration_policy_keeps_the_default_sweep_short() -> None:
    """Estimated timed seconds of the default sweep at 1 GB/s plus 50 µs per call."""
    p = IterationPolicy()
    total = 0.0
    for nbytes in size_range(8, 256 << 20, 2):
        per_call = 50e-6 + nbytes / 1e9
        total += (p.warmup_for(nbytes) + p.iters_for(per_call)) * per_call
    assert total < 30


def test_summarize() -> None:
    median, p10, p90 = summarize(np.arange(1, 102) * 1e-6)
    assert (median, p10, p90) == pytest.approx((51.0, 11.0, 91.0))
    assert all(math.isnan(x) for x in summarize(np.empty(0)))


@pytest.mark.parametrize("collective", [c for c in COLLECTIVES if c != "barrier"])
def test_selection_bytes_is_what_the_communicator_selects_on(
    collective: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bench names the algorithm auto runs: it must feed the selector the same bytes."""
    seen: list[int] = []
    real = plait.communicator.choose

    def spy(c: str, size: int, nbytes: int, **kw: object) -> object:
        seen.append(nbytes)
        return real(c, size, nbytes, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(plait.communicator, "choose", spy)
    size, count = 3, 12

    def body(comm: plait.Communicator) -> None:
        x = np.ones(count, np.float64)
        block = np.ones(count // size, np.float64)
        calls = {
            "allreduce": lambda: comm.allreduce(x),
            "reduce": lambda: comm.reduce(x),
            "broadcast": lambda: comm.broadcast(x),
            "reduce_scatter": lambda: comm.reduce_scatter(x),
            "allgather": lambda: comm.allgather(block),
            "alltoall": lambda: comm.alltoall(x),
            "gather": lambda: comm.gather(block),
            "scatter": lambda: comm.scatter(x),
        }
        calls[collective]()

    run_ranks(size, body)
    assert set(seen) == {selection_bytes(collective, count, 8, size)}
