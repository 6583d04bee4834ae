"""What ``plait bench`` shows while it runs: rows as they come, the time left, the bar."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from plait.bench.progress import (
    Estimator,
    Follower,
    Live,
    format_duration,
    format_time,
    parse_line,
    render,
    row_line,
    series_label,
)
from plait.bench.sweep import IterationPolicy


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def row(nbytes: int, time_us: float, requested: str = "ring", **kw: Any) -> dict[str, Any]:
    return {
        "bytes": nbytes,
        "count": nbytes // 4,
        "algorithm": requested,
        "requested": requested,
        "warmup": 1,
        "iters": 3,
        "rounds": 1,
        "time_us": time_us,
        "p10_us": time_us,
        "p90_us": time_us,
        "algbw_gbps": 0.5,
        "busbw_gbps": 1.25,
        "wrong": 0,
        **kw,
    }


def test_durations_and_times_read_well() -> None:
    assert format_duration(0.4) == "0 s"
    assert format_duration(59.6) == "1 min 0 s"
    assert format_duration(400) == "6 min 40 s"
    assert format_duration(3900) == "1 h 5 min"
    assert format_time(478.54) == "478.5 µs"
    assert format_time(12_345.0) == "12.3 ms"
    assert format_time(1.2e6) == "1.20 s"
    assert format_time(float("nan")) == "-"


def test_progress_bar_line() -> None:
    assert render("plait", 3, 12, 1 << 20, 2.54) == (
        "plait          [#######.......................] 3/12  1 MiB  2.5 s"
    )
    assert render("gloo", 0, 4, None, 0.0).endswith("0/4  0.0 s")
    assert "[" + "#" * 30 + "]" in render("x", 0, 0, None, 0.0)
    assert render("x", 1, 2, 8, 1.0, 400.0).endswith("1/2  8 B  1.0 s, about 6 min 40 s left")
    assert render("x", 1, 2, 8, 1.0, 0.2).endswith(", under a second left")


def test_row_line_and_labels() -> None:
    line = row_line("plait-shm ring", 16, row(1 << 20, 478.5), 37, 234, ", about 6 min 40 s left")
    assert line == (
        "plait-shm ring        1 MiB    478.5 µs  busbw    1.250 GB/s  wrong 0"
        "  [37/234, about 6 min 40 s left]"
    )
    assert series_label("plait-shm", "auto") == "plait-shm"
    assert series_label("plait-shm", "ring") == "plait-shm ring"


def test_worker_lines_parse_with_and_without_a_row() -> None:
    r = row(64, 5.0)
    assert parse_line(f"3 10 64 {json.dumps(r)}") == (3, 10, 64, r)
    assert parse_line("3 10 64") == (3, 10, 64, None)
    assert parse_line("3 10") is None
    assert parse_line("x y z") is None
    assert parse_line('3 10 64 {"cut') is None


def test_estimate_scales_each_row_by_its_calls() -> None:
    """Fixed call counts: a row left costs (warm-up + timed + check) calls at its size's time."""
    clock = Clock()
    policy = IterationPolicy(iters=3, warmup=1)
    est = Estimator(policy, [("plait", ["ring"], [1 << 20, 2 << 20, 4 << 20])])
    assert est.total == 3
    assert est.left(clock()) is None  # nothing measured: no estimate
    est.begin("plait", clock())
    clock.now += 2.0
    est.add("plait", row(1 << 20, 1000.0), clock())  # 1 ms a call at 1 MiB
    # Rows left: 2 MiB and 4 MiB at 1 ms + 1 ns/B beyond 1 MiB (no slope measured yet).
    calls = 1 + 3 + 1
    want = calls * (1e-3 + (1 << 20) * 1e-9) + calls * (1e-3 + (3 << 20) * 1e-9)
    assert est.left(clock()) == pytest.approx(want)
    clock.now += 0.01  # 10 ms into the next row
    assert est.left(clock()) == pytest.approx(want - 0.01)
    clock.now += 1.0  # late: no time left, not a negative one
    assert est.left(clock()) == 0.0


def test_estimate_learns_the_slope_and_how_slow_rows_really_are() -> None:
    clock = Clock()
    policy = IterationPolicy(iters=10, warmup=0)
    sizes = [64 << 10, 128 << 10, 256 << 10]
    est = Estimator(policy, [("plait", ["ring"], sizes)])
    est.begin("plait", clock())
    clock.now += 1.0
    est.add("plait", row(sizes[0], 100.0, warmup=0, iters=10), clock())
    clock.now += 2 * 11 * 200e-6  # the row took twice what its 11 calls add up to
    est.add("plait", row(sizes[1], 200.0, warmup=0, iters=10), clock())
    # slope: 100 µs per 64 KiB, so 256 KiB costs 400 µs a call, 11 calls; and a row takes
    # what its calls do plus the 11 * 200 µs the second row took beyond its calls
    assert est.left(clock()) == pytest.approx(11 * 400e-6 + 11 * 200e-6)
    assert est.done == 2


def test_estimate_counts_the_start_of_systems_not_started_and_drops_skipped_ones() -> None:
    clock = Clock()
    policy = IterationPolicy(iters=1, warmup=0)
    est = Estimator(
        policy, [("plait", ["auto"], [8]), ("mpi-shm", ["auto"], [8]), ("gloo", ["auto"], [8])]
    )
    est.begin("plait", clock())
    clock.now += 3.0  # three seconds to start the ranks, then a row of two 1 µs calls
    est.add("plait", row(8, 1.0, "auto", warmup=0, iters=1), clock())
    est.end("plait")
    left = est.left(clock())
    assert left == pytest.approx(2 * (3.0 - 2e-6) + 2 * 2e-6)
    est.end("mpi-shm")  # skipped: Open MPI is missing
    assert est.total == 2
    assert est.planned == 3
    assert est.left(clock()) == pytest.approx((3.0 - 2e-6) + 2e-6)


def test_rounds_count_a_warm_up_and_a_check_per_round() -> None:
    clock = Clock()
    policy = IterationPolicy(iters=8, warmup=2, rounds=4)
    est = Estimator(policy, [("plait", ["a", "b"], [1024, 2048])])
    est.begin("plait", clock())
    est.add("plait", row(1024, 10.0, "a", warmup=8, iters=8, rounds=4), clock())
    # b has no row yet: its calls are predicted from a's curve
    per_round = 2 + 2 + 1
    want = 4 * per_round * 10e-6 + 2 * 4 * per_round * (10e-6 + 1024 * 1e-9)
    assert est.left(clock()) == pytest.approx(want)


def test_live_prints_each_row_as_it_comes_and_keeps_it() -> None:
    clock = Clock()
    est = Estimator(IterationPolicy(iters=3, warmup=1), [("plait", ["ring", "bruck"], [8, 64])])
    out = io.StringIO()
    live = Live(est, out, width=11, clock=clock, bar=False)
    live.begin("plait")
    clock.now += 1
    live.add("plait", row(8, 5.0, "ring"))
    live.add("plait", row(8, 6.0, "bruck"))
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("plait ring         8 B      5.0 µs  busbw")
    assert lines[0].endswith("[1/4, under a second left]")
    assert lines[1].startswith("plait bruck        8 B")
    assert "\r" not in out.getvalue()  # no bar off a terminal
    assert [r["bytes"] for r in live.series_rows("plait", "ring")] == [8]
    quiet = Live(est, io.StringIO(), rows=False, bar=False)
    quiet.add("plait", row(64, 5.0, "ring"))
    assert quiet.stream.getvalue() == ""  # type: ignore[attr-defined]
    assert len(quiet.series_rows("plait", "ring")) == 1


def test_live_bar_is_redrawn_under_the_rows() -> None:
    out = io.StringIO()
    live = Live(None, out, bar=True)
    live.begin("gloo")
    live.tick()
    live.add("gloo", row(8, 5.0, "auto"))
    text = out.getvalue()
    assert text.startswith("\r\x1b[Kgloo")
    assert "0/0  0.0 s" in text.split("\n")[0]
    # the bar is cleared, the row written on its own line, then the bar drawn again
    assert "\r\x1b[Kgloo" in text.split("\n")[-1]
    assert "1/1  8 B" in text.split("\n")[-1]
    live.end("gloo")
    assert out.getvalue().endswith("\r\x1b[K")


def test_follower_reads_whole_lines_only(tmp_path: Path) -> None:
    path = tmp_path / "progress"
    out = io.StringIO()
    live = Live(None, out, bar=False)
    follower = Follower("plait", str(path), live, interval=60.0)  # polled by hand below
    follower.poll()  # no file yet
    r1, r2 = json.dumps(row(8, 5.0)), json.dumps(row(64, 6.0))
    with path.open("w") as f:
        f.write(f"1 2 8 {r1}\n2 2 64 {r2[:10]}")
    assert follower.poll() == 1
    with path.open("a") as f:
        f.write(r2[10:] + "\n")
    assert follower.poll() == 1
    assert [r["bytes"] for r in live.series_rows("plait", "ring")] == [8, 64]


def test_follower_hands_over_every_row_by_the_end_of_the_block(tmp_path: Path) -> None:
    path = tmp_path / "progress"
    path.write_text("stale\n")  # a file left from before is not read
    live = Live(None, io.StringIO(), bar=False)
    with Follower("plait", str(path), live, interval=60.0), path.open("w") as f:
        for i, n in enumerate((8, 64, 512)):
            f.write(f"{i + 1} 3 {n} {json.dumps(row(n, 1.0))}\n")
    assert [r["bytes"] for r in live.series_rows("plait", "ring")] == [8, 64, 512]


def test_a_refused_algorithm_leaves_the_estimate(tmp_path: Path) -> None:
    # Its rows would never come: the count and the time left went on waiting for them.
    path = tmp_path / "progress"
    est = Estimator(IterationPolicy(iters=3, warmup=1), [("plait-tcp", ["ring", "arena"], [8, 64])])
    out = io.StringIO()
    live = Live(est, out, bar=False)
    follower = Follower("plait-tcp", str(path), live, interval=60.0)  # polled by hand below
    live.begin("plait-tcp")
    with path.open("w") as f:
        f.write(f"refused arena\n1 2 8 {json.dumps(row(8, 5.0))}\n")
    assert follower.poll() == 1
    assert (est.done, est.total, est.planned) == (1, 2, 4)
    assert est.jobs["plait-tcp"].pending == [("ring", 64)]
    assert out.getvalue().splitlines()[0].endswith("[1/2, under a second left]")
