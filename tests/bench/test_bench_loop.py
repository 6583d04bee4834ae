"""The measuring loop, with plait's backend on threads and with fake backends."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import plait
from plait.bench.data import Buffers
from plait.bench.loop import (
    EXIT_FAILED,
    Prepared,
    SweepSpec,
    Unsupported,
    load_spec,
    op_by_name,
    run_sweep,
)
from plait.bench.sweep import COLLECTIVES, Point, points
from plait.bench.worker import PlaitBackend
from plait.testing import run_ranks


def make_spec(tmp_path: Path, collective: str = "allreduce", **kw: Any) -> SweepSpec:
    size = kw.pop("size", 3)
    sizes = kw.pop("sizes", [0, 4, 48, 1200])
    rows = points(collective, sizes, 4, size)
    spec = SweepSpec(
        collective=collective,
        dtype="float32",
        op="sum",
        root=kw.pop("root", 0),
        in_place=kw.pop("in_place", False),
        points=[(p.nbytes, p.count) for p in rows],
        algorithms=kw.pop("algorithms", ["auto"]),
        policy={"iters": 3, "warmup": 1, "seconds": 0.01},
        results=str(tmp_path / "results.json"),
        progress=str(tmp_path / "progress"),
        label="test",
    )
    return replace(spec, **kw)


def test_spec_round_trips_through_json(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, "gather", root=1, in_place=True, options={"port": 5})
    spec.save(str(tmp_path / "spec.json"))
    assert load_spec(str(tmp_path / "spec.json")) == spec


def test_op_by_name() -> None:
    assert op_by_name("sum") is plait.SUM
    assert op_by_name("BXOR") is plait.BXOR
    with pytest.raises(ValueError, match="unknown op"):
        op_by_name("mean")
    with pytest.raises(ValueError, match="unknown op"):
        op_by_name("check")  # an attribute of plait.ops, not an op


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("in_place", [False, True])
def test_plait_sweep_on_threads_is_right(collective: str, in_place: bool, tmp_path: Path) -> None:
    spec = make_spec(tmp_path, collective, root=1, in_place=in_place)
    codes = run_ranks(3, lambda comm: run_sweep(PlaitBackend(comm), spec))
    assert codes == [0, 0, 0]
    result = json.loads(Path(spec.results).read_text())
    assert "error" not in result
    assert "skipped" not in result
    rows = result["rows"]
    assert [(r["bytes"], r["count"]) for r in rows] == [tuple(p) for p in spec.points]
    for r in rows:
        assert r["wrong"] == 0
        assert r["iters"] == 3
        assert r["warmup"] == 1
        assert r["time_us"] > 0
        assert r["p10_us"] <= r["time_us"] <= r["p90_us"]
        assert r["algorithm"] in plait.algorithms(collective)
        assert r["requested"] == "auto"
    progress = Path(spec.progress).read_text().splitlines()  # type: ignore[arg-type]
    assert progress[-1].split()[:2] == [str(len(rows)), str(len(rows))]


def test_every_algorithm_gets_its_rows(tmp_path: Path) -> None:
    algos = list(plait.algorithms("allgather"))
    spec = make_spec(tmp_path, "allgather", algorithms=["auto", *algos])
    run_ranks(3, lambda comm: run_sweep(PlaitBackend(comm), spec))
    rows = json.loads(Path(spec.results).read_text())["rows"]
    assert len(rows) == len(spec.points) * (len(algos) + 1)
    for r in rows:
        assert r["wrong"] == 0
        if r["requested"] != "auto":
            assert r["algorithm"] == r["requested"]


class FakeBackend:
    """One real rank 0 and a made-up rank 1 whose calls take 1 ms and get 2 elements wrong."""

    rank, size = 0, 2

    def __init__(self, fail: BaseException | None = None) -> None:
        self.fail = fail

    def prepare(self, spec: SweepSpec, point: Point, bufs: Buffers, algorithm: str) -> Prepared:
        if self.fail is not None and point.count > 0:
            raise self.fail
        return Prepared(lambda: None, "fake", None)

    def broadcast_int(self, value: int) -> int:
        return value

    def gather_rows(self, row: np.ndarray) -> np.ndarray:
        other = np.full_like(row, 1e-3)
        other[0] = 2
        return np.stack([row, other])


def test_time_is_the_slowest_ranks_and_wrong_counts_add_up(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, "barrier", size=2)
    assert run_sweep(FakeBackend(), spec) == 0
    (row,) = json.loads(Path(spec.results).read_text())["rows"]
    assert row["time_us"] == pytest.approx(1000.0)
    assert row["p10_us"] == row["p90_us"] == pytest.approx(1000.0)
    assert row["wrong"] == 2
    assert row["algbw_gbps"] == row["busbw_gbps"] == 0.0


def test_unsupported_rows_end_the_sweep_with_a_message(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, size=2)
    assert run_sweep(FakeBackend(Unsupported("no float32 here")), spec) == 0
    result = json.loads(Path(spec.results).read_text())
    assert result["skipped"] == "no float32 here"
    assert [r["count"] for r in result["rows"]] == [0]


def test_errors_keep_the_rows_done_and_fail_the_worker(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, size=2)
    assert run_sweep(FakeBackend(RuntimeError("boom")), spec) == EXIT_FAILED
    result = json.loads(Path(spec.results).read_text())
    assert result["error"] == "rank 0: RuntimeError: boom"
    assert len(result["rows"]) == 1


class RecordingBackend(FakeBackend):
    """Records the order in which algorithms are prepared; ``slow`` ones take 2 ms a call."""

    def __init__(self, slow: str) -> None:
        super().__init__()
        self.order: list[tuple[int, str]] = []
        self.slow = slow
        self.current = ""

    def prepare(self, spec: SweepSpec, point: Point, bufs: Buffers, algorithm: str) -> Prepared:
        self.order.append((point.nbytes, algorithm))
        self.current = algorithm
        return Prepared(lambda: None, algorithm, None)

    def gather_rows(self, row: np.ndarray) -> np.ndarray:
        other = np.full_like(row, 2e-3 if self.current == self.slow else 1e-3)
        other[0] = 0
        return np.stack([row, other])


def test_rounds_take_turns_and_pool_their_calls(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, "barrier", size=2, algorithms=["a", "b", "c"])
    spec = replace(
        spec,
        points=[(16, 0), (64, 0)],  # nothing to check in a barrier's result
        policy={"iters": 7, "warmup": 1, "seconds": 0.01, "rounds": 3},
    )
    backend = RecordingBackend(slow="b")
    assert run_sweep(backend, spec) == 0
    # each size: three rounds, the order reversed every other round, before the next size
    turns = ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert backend.order == [(16, a) for a in turns] + [(64, a) for a in turns]
    rows = json.loads(Path(spec.results).read_text())["rows"]
    assert [(r["bytes"], r["requested"]) for r in rows] == [(n, a) for n in (16, 64) for a in "abc"]
    for r in rows:
        assert r["rounds"] == 3
        assert r["iters"] == 7  # as asked: 3, 2 and 2 (it was ceil(7 / 3) = 3 per round, 9)
        assert r["warmup"] == 3  # one per round
        want = 2000.0 if r["requested"] == "b" else 1000.0
        assert r["time_us"] == pytest.approx(want)
        assert r["round_us"] == pytest.approx([want] * 3)
    progress = Path(spec.progress).read_text().splitlines()  # type: ignore[arg-type]
    assert progress[-1].split()[:2] == ["6", "6"]


def test_per_round_policy_divides_the_budget() -> None:
    from plait.bench.sweep import IterationPolicy

    one = IterationPolicy(seconds=0.3)
    assert one.per_round() is one
    split = IterationPolicy(seconds=0.3, rounds=3).per_round()
    assert split.seconds == pytest.approx(0.1)
    assert split.rounds == 1
    assert split.min_iters == 2
    assert split.max_iters == 334
    assert split.iters_for(0.01) == 10
    with pytest.raises(ValueError, match="rounds must be at least 1"):
        IterationPolicy(rounds=0).per_round()
    with pytest.raises(ValueError, match=r"round 3 is not one of 0\.\.2"):
        IterationPolicy(rounds=3).per_round(3)


@pytest.mark.parametrize(("iters", "rounds"), [(10, 4), (7, 3), (4, 4), (9, 3), (1000, 7)])
def test_rounds_split_the_timed_calls_exactly(iters: int, rounds: int) -> None:
    # --iters 10 --rounds 4 made 12 calls a row (3 per round) where the header said 10.
    from plait.bench.sweep import IterationPolicy

    policy = IterationPolicy(iters=iters, rounds=rounds)
    counts = [policy.per_round(r).iters_for(1e-3) for r in range(rounds)]
    assert sum(counts) == iters
    assert max(counts) - min(counts) <= 1
    assert counts == sorted(counts, reverse=True)  # the first rounds take the extra calls


def test_an_algorithm_the_communicator_cannot_run_is_its_own_series_error(
    tmp_path: Path,
) -> None:
    # One-sided arena where the ranks share no window (TCP): its UnsupportedError ended the
    # whole sweep, so ring, which runs there, got no row either (and arena's error).
    spec = make_spec(tmp_path, size=2, algorithms=["ring", "arena", "recursive_doubling"])
    spec = replace(spec, policy={**spec.policy, "rounds": 2})
    codes = run_ranks(2, lambda comm: run_sweep(PlaitBackend(comm), spec), window=0)
    assert codes == [0, 0]
    result = json.loads(Path(spec.results).read_text())
    assert "error" not in result
    assert list(result["refused"]) == ["arena"]
    assert "algorithm 'arena' is one-sided" in result["refused"]["arena"]
    rows = result["rows"]
    for algorithm in ("ring", "recursive_doubling"):
        mine = [r for r in rows if r["requested"] == algorithm]
        assert [(r["bytes"], r["count"]) for r in mine] == [tuple(p) for p in spec.points]
        assert all(r["wrong"] == 0 and r["algorithm"] == algorithm for r in mine)
    progress = Path(spec.progress).read_text().splitlines()  # type: ignore[arg-type]
    assert progress[0] == "refused arena"
    n = 2 * len(spec.points)  # the rows still to come once arena was refused
    assert [line.split()[:2] for line in progress[1:]] == [
        [str(i), str(n)] for i in range(1, n + 1)
    ]


class FailingBackend(RecordingBackend):
    """A backend whose ``b`` fails at the second size, as a broken call would."""

    def prepare(self, spec: SweepSpec, point: Point, bufs: Buffers, algorithm: str) -> Prepared:
        if algorithm == "b" and point.nbytes == 64:
            raise RuntimeError("boom")
        return super().prepare(spec, point, bufs, algorithm)


def test_a_failed_call_names_its_algorithm(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, "barrier", size=2, algorithms=["a", "b", "c"])
    spec = replace(spec, points=[(16, 0), (64, 0)])
    assert run_sweep(FailingBackend(slow=""), spec) == EXIT_FAILED
    result = json.loads(Path(spec.results).read_text())
    assert result["error"] == "rank 0: RuntimeError: boom"
    assert result["failed"] == "b"
    assert [(r["bytes"], r["requested"]) for r in result["rows"]] == [(16, a) for a in "abc"]


def test_the_benchs_own_calls_keep_the_deadline_of_init() -> None:
    # Under plait bench --timeout 1e-6 a rank a moment late to the bench's broadcast of
    # the iteration count failed the series with that broadcast's CollectiveTimeout.
    import time

    def body(comm: plait.Communicator) -> tuple[int, int]:
        backend = PlaitBackend(comm)  # made before --timeout is set, as the worker makes it
        comm._runner.timeout = 0.05
        if comm.rank == 1:
            time.sleep(0.3)  # late, not synchronising: the point is a rank that is late
        iters = backend.broadcast_int(7 if comm.rank == 0 else 0)
        rows = backend.gather_rows(np.full(2, comm.rank))
        return iters, 0 if rows is None else rows.shape[0]

    assert run_ranks(2, body) == [(7, 2), (7, 0)]
