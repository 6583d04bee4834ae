"""The bench's table, ratios, limit fractions, JSON, CSV and plot."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import pytest

from plait.bench import report
from plait.bench.runner import Series

LIMITS = {
    "cores": 2,
    "copy_gbps_1core": 10.0,
    "add_gbps_1core": 8.0,
    "copy_gbps_all": 16.0,
    "add_gbps_all": 12.0,
    "tcp_gbps": 4.0,
    "tcp_rtt_us": 20.0,
}


def row(nbytes: int, time_us: float, busbw: float, algorithm: str = "ring", **kw: Any) -> dict:
    return {
        "bytes": nbytes,
        "count": nbytes // 4,
        "algorithm": algorithm,
        "warmup": 1,
        "iters": 10,
        "time_us": time_us,
        "p10_us": time_us * 0.9,
        "p90_us": time_us * 1.1,
        "algbw_gbps": busbw,
        "busbw_gbps": busbw,
        "wrong": 0,
        **kw,
    }


def sample() -> list[Series]:
    return [
        Series("plait", "plait-shm", "shm", "auto", [row(8, 10.0, 0.001), row(1024, 20.0, 2.0)]),
        Series(
            "plait", "plait-shm ring", "shm", "ring", [row(8, 12.0, 0.001), row(1024, 15.0, 3.0)]
        ),
        Series(
            "mpi",
            "mpi-tcp",
            "tcp",
            "auto",
            [row(8, 30.0, 0.0005, "ompi"), row(1024, 45.0, 1.0, "ompi")],
        ),
        Series("gloo", "gloo", "tcp", "auto", skipped="torch is not installed"),
    ]


def test_ratios_use_plaits_fastest_series_per_size() -> None:
    series = sample()
    report.annotate(series, None)
    mpi = series[2].rows
    assert mpi[0]["plait_ratio"] == pytest.approx(3.0)  # 30 / min(10, 12)
    assert mpi[1]["plait_ratio"] == pytest.approx(3.0)  # 45 / min(20, 15)
    assert all("plait_ratio" not in r for s in series[:2] for r in s.rows)
    assert all(r["limit_fraction"] is None for s in series for r in s.rows)


def test_limit_fractions_pick_the_transports_limit() -> None:
    series = sample()
    report.annotate(series, LIMITS)
    assert series[0].rows[1]["limit_fraction"] == pytest.approx(0.2)  # 2 / 10 (memory copy)
    assert series[2].rows[1]["limit_fraction"] == pytest.approx(0.25)  # 1 / 4 (TCP)
    assert report.limit_for(series[3], LIMITS) == ("loopback TCP", 4.0)
    assert report.limit_for(series[0], None) is None


def test_render_shows_every_series_and_the_side_by_side_table() -> None:
    series = sample()
    series[1].error = "the ranks exited with code 3"
    report.annotate(series, LIMITS)
    text = report.render(["# header"], series, LIMITS)
    lines = text.splitlines()
    assert lines[0] == "# header"
    assert "# skipped: torch is not installed" in lines
    assert "# error: the ranks exited with code 3" in lines
    headers = [line for line in lines if line.startswith("#") and "busbw_GB/s" in line]
    assert len(headers) == 3
    assert "%limit" in headers[0]
    assert "plait/other" not in headers[0]
    assert "plait/other" in headers[2]
    data = [line.split() for line in lines if not line.startswith("#")]
    mpi_rows = [d for d in data if "ompi" in d]
    assert [d[0] for d in mpi_rows] == ["8", "1024"]
    assert mpi_rows[1][-3:] == ["25%", "3.00", "0"]  # %limit, plait/other, wrong
    side = lines[lines.index(next(x for x in lines if x.startswith("# side by side"))) :]
    assert "plait/mpi-tcp" in side[2]
    assert side[3].split() == ["8", "10.0", "12.0", "30.0", "3.00"]


def test_render_without_comparisons_has_no_side_by_side() -> None:
    series = sample()[:2]
    report.annotate(series, None)
    text = report.render([], series, None)
    assert "side by side" not in text
    assert "%limit" not in text


def test_json_document_holds_everything(tmp_path: Path) -> None:
    series = sample()
    report.annotate(series, LIMITS)
    doc = report.document({"collective": "allreduce"}, series, LIMITS)
    back = json.loads(json.dumps(doc))
    assert back["bench"] == {"collective": "allreduce"}
    assert back["limits"] == LIMITS
    assert [s["label"] for s in back["series"]] == [
        "plait-shm",
        "plait-shm ring",
        "mpi-tcp",
        "gloo",
    ]
    assert back["series"][3]["skipped"] == "torch is not installed"
    assert back["series"][2]["rows"][0]["plait_ratio"] == pytest.approx(3.0)


def test_csv_has_one_line_per_row(tmp_path: Path) -> None:
    series = sample()
    report.annotate(series, None)
    path = tmp_path / "out.csv"
    report.write_csv(str(path), series)
    with path.open() as f:
        lines = list(csv.DictReader(f))
    assert list(lines[0]) == report.CSV_FIELDS
    assert len(lines) == 6
    assert [(x["label"], x["bytes"]) for x in lines[-2:]] == [("mpi-tcp", "8"), ("mpi-tcp", "1024")]
    assert math.isclose(float(lines[-1]["plait_ratio"]), 3.0)
    assert lines[0]["plait_ratio"] == ""


@pytest.mark.slow  # imports matplotlib
def test_plot_writes_an_image(tmp_path: Path) -> None:
    pytest.importorskip(
        "matplotlib", reason="matplotlib is not installed (pip install 'plait[plot]')"
    )
    series = sample()
    path = tmp_path / "bench.png"
    report.plot(str(path), "allreduce", series, LIMITS)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_columns_are_as_wide_as_their_content() -> None:
    """A long algorithm name or a long time widens its column: nothing cut, all aligned."""
    long_name = "a_very_long_algorithm_name_indeed"
    s = Series(
        "plait", "x", "shm", "auto", [row(8, 12345678901.0, 1.0, long_name), row(64, 5.0, 2.0)]
    )
    lines = report.render([], [s], None).splitlines()
    header = next(line for line in lines if "busbw_GB/s" in line)
    data = [line for line in lines if not line.startswith("#")]
    assert long_name in data[0]
    assert data[0].split()[2] == long_name
    assert "12345678901" in data[0].split()
    # every column ends where its header ends
    for name in ("iters", "time_us", "busbw_GB/s", "wrong"):
        end = header.index(name) + len(name)
        for line in data:
            assert line[end - 1] != " ", (name, line)
            assert end == len(line) or line[end] == " ", (name, line)
    # a short table keeps the usual widths
    short = report.render([], [Series("plait", "y", "shm", "auto", [row(8, 5.0, 1.0)])], None)
    assert "#      bytes      count  algorithm          iters   time_us" in short


def test_titles_name_what_the_series_ran_over() -> None:
    s = Series("plait", "ring", "fat-tree:4", "ring", [row(8, 5.0, 1.0)])
    assert "# ring (topology fat-tree:4, algorithm ring)" in report.render(
        [], [s], None, where="topology"
    )
    assert "# ring (transport fat-tree:4, algorithm ring)" in report.render([], [s], None)
