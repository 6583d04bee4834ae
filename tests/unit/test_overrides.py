"""PLAIT_ALGO: parsing (segments too), precedence over the built-in rules, and clear errors."""

from __future__ import annotations

import numpy as np
import pytest

import plait
from plait.selection.overrides import Override, parse
from plait.selection.select import SEGMENT_BYTES, choose, select
from plait.testing import run_ranks


def test_parse_the_documented_example() -> None:
    got = parse("allreduce:recursive_doubling:0-8K, ring:8K-, broadcast:binomial")
    assert got == (
        Override("allreduce", "recursive_doubling", 0, 8192),
        Override("allreduce", "ring", 8192, float("inf")),
        Override("broadcast", "binomial", 0, float("inf")),
    )


@pytest.mark.parametrize(
    ("text", "lo", "hi"),
    [("1K-2K", 1024, 2048), ("-1M", 0, 1 << 20), ("3G-", 3 << 30, float("inf")),
     ("100-4096", 100, 4096), ("1KiB-2KB", 1024, 2048)],
)  # fmt: skip
def test_ranges(text: str, lo: int, hi: float) -> None:
    (entry,) = parse(f"allgather:ring:{text}")
    assert (entry.lo, entry.hi) == (lo, hi)
    assert entry.covers(lo)
    if hi != float("inf"):
        assert not entry.covers(int(hi))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("ring", "names no collective"),
        ("allreduce:nope", "nope"),
        ("allreduce:ring:8K", "a range is lo-hi"),
        ("allreduce:ring:8K-1K", "is empty"),
        ("allreduce:ring:x-", "not a size"),
        ("allreduce:ring:1-2:3", "expected"),
        ("allreduce:", "expected"),
        ("allreduce:ring@0", "at least one byte"),
        ("allreduce:ring@x", "not a size"),
        ("allreduce:ring@1K@2K", "expected"),
        ("allreduce:ring:8K@1K", "a range is lo-hi"),
    ],
)
def test_errors_quote_the_entry(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse(text)


def test_overrides_win_over_the_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLAIT_ALGO", "allreduce:direct:0-1K,ring:1K-,broadcast:scatter_allgather")
    assert select("allreduce", 8, 100, commutative=True).name == "direct"
    assert select("allreduce", 8, 4096, commutative=True).name == "ring"
    assert select("broadcast", 4, 8, commutative=True).name == "scatter_allgather"
    assert select("reduce", 4, 8, commutative=True).name == "binomial"  # not covered: the rules


def test_an_override_the_op_forbids_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLAIT_ALGO", "allreduce:ring")  # ring needs a commutative op
    assert select("allreduce", 4, 1 << 20, commutative=False).name != "ring"
    assert select("allreduce", 4, 1 << 20, commutative=True).name == "ring"


def test_communicators_run_the_overridden_algorithm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLAIT_ALGO", "allreduce:direct")
    spied: list[str] = []

    def body(comm: plait.Communicator) -> np.ndarray:
        out = comm.allreduce(np.arange(5.0) * (comm.rank + 1))
        spied.append(comm._auto[("allreduce", 40, True, True, False)].name)
        return out

    for got in run_ranks(3, body):
        np.testing.assert_array_equal(got, np.arange(5.0) * 6)
    assert spied == ["direct"] * 3


def test_segments() -> None:
    got = parse("allreduce:ring:8K-@256K,recursive_doubling@4K,broadcast:binomial:-1M")
    assert got == (
        Override("allreduce", "ring", 8192, float("inf"), 256 << 10),
        Override("allreduce", "recursive_doubling", 0, float("inf"), 4096),
        Override("broadcast", "binomial", 0, 1 << 20),
    )
    assert [e.describe() for e in got] == [
        "allreduce:ring:8K-@256K",
        "allreduce:recursive_doubling@4K",
        "broadcast:binomial:-1M",
    ]
    assert parse(",".join(e.describe() for e in got)) == got


def test_an_override_sets_the_segment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLAIT_ALGO", "allreduce:ring:8K-@256K,direct")
    big = choose("allreduce", 4, 1 << 20, commutative=True)
    assert (big.name, big.segment_bytes, big.source) == ("ring", 256 << 10, "PLAIT_ALGO")
    small = choose("allreduce", 4, 100, commutative=True)
    assert (small.name, small.segment_bytes) == ("direct", SEGMENT_BYTES)


def test_a_bad_plait_algo_fails_when_the_communicator_is_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from plait.testing import memory_communicators

    monkeypatch.setenv("PLAIT_ALGO", "allreduce:ring:8K-@0")
    with pytest.raises(ValueError, match="PLAIT_ALGO: 'allreduce:ring:8K-@0'"):
        memory_communicators(2)
