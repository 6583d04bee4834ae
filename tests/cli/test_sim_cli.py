"""``plait sim``: the table, JSON, trace, topologies and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plait.cli.__main__ import main
from plait.cli.sim import parse_topology
from plait.sim import simulate


def test_table_and_json_match_the_simulator(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "sim.json"
    rc = main(
        ["sim", "--ranks", "8", "--algorithm", "ring,recursive_doubling", "--sizes", "1K:1M",
         "-f", "32", "--json", str(out)]
    )  # fmt: skip
    assert rc == 0
    text = capsys.readouterr().out
    assert "# ring " in text
    assert "# recursive_doubling " in text
    records = json.loads(out.read_text())["results"]
    assert [(r["algorithm"], r["bytes"]) for r in records] == [
        ("ring", 1024), ("ring", 32768), ("ring", 1048576),
        ("recursive_doubling", 1024), ("recursive_doubling", 32768),
        ("recursive_doubling", 1048576),
    ]  # fmt: skip
    net = parse_topology("flat", 8, 1e-6, 1 / 12.5e9, 0.0, (2e-7, 1 / 50e9))
    for r in records:
        want = simulate("allreduce", r["algorithm"], r["bytes"], net, segment_bytes=None).time
        assert r["time_s"] == pytest.approx(want, rel=1e-12)


def test_with_data_checks_results_and_writes_a_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    trace = tmp_path / "t.json"
    rc = main(
        ["sim", "-n", "5", "-c", "reduce_scatter", "-a", "ring", "-s", "4K", "--with-data",
         "--trace", str(trace)]
    )  # fmt: skip
    assert rc == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("4096")]
    assert lines
    assert lines[0].split()[-1] == "0"
    events = json.loads(trace.read_text())
    assert events["traceEvents"] if isinstance(events, dict) else events


@pytest.mark.parametrize(
    ("spec", "ranks"),
    [("flat", 8), ("flat-free", 8), ("switch", 8), ("fat-tree:4:2", 16), ("fat-tree:4:1:2", 16),
     ("hosts:4", 16), ("hosts:4:2", 16), ("ring", 6), ("torus:2x3", 6), ("torus:2x2x2", 8)],
)  # fmt: skip
def test_every_topology_runs(spec: str, ranks: int, capsys: pytest.CaptureFixture) -> None:
    assert main(["sim", "-n", str(ranks), "-t", spec, "-a", "ring", "-s", "64K"]) == 0
    assert "65536" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-t", "mesh"], "unknown topology"),
        (["-t", "torus:3x3"], "has 9 ranks"),
        (["-t", "hosts:3"], "not a multiple"),
        (["-t", "fat-tree"], "ranks per leaf"),
        (["-a", "nope"], "no algorithm 'nope'"),
        (["-c", "allsum"], "unknown collective"),
        (["-f", "1"], "at least 2"),
    ],
)
def test_bad_input_exits_2_with_a_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture
) -> None:
    assert main(["sim", "-n", "8", *argv]) == 2
    assert message in capsys.readouterr().err


def test_beta_accepts_a_fraction(capsys: pytest.CaptureFixture) -> None:
    assert main(["sim", "-n", "2", "-a", "direct", "-s", "1M", "--beta", "1/1e9",
                 "--alpha", "0"]) == 0  # fmt: skip
    row = next(
        ln for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("1048576")
    )
    # 2 ranks, direct: each sends its 1 MiB once at 1 GB/s.
    assert float(row.split()[4]) == pytest.approx(1048576 / 1e9 * 1e6, rel=1e-3)


def test_aggregation_runs_in_network(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--aggregation gives the switches memory; in_network then runs (with data) and is fastest."""
    out = tmp_path / "agg.json"
    trace = tmp_path / "t.json"
    rc = main(
        ["sim", "-n", "8", "-t", "fat-tree:4", "--aggregation", "64K", "-a",
         "in_network,ring", "-s", "1M", "--with-data", "--json", str(out), "--trace", str(trace)]
    )  # fmt: skip
    assert rc == 0
    times = {r["algorithm"]: r["time_s"] for r in json.loads(out.read_text())["results"]}
    assert times["in_network"] < times["ring"]
    names = [e["args"]["name"] for e in json.loads(trace.read_text())["traceEvents"]
             if e.get("name") == "process_name"]  # fmt: skip
    assert names[-3:] == ["switch 0", "switch 1", "switch 2"]
    capsys.readouterr()
    assert main(["sim", "-n", "8", "-a", "all", "-s", "1K"]) == 0  # all without switches: skipped
    assert "in_network" not in capsys.readouterr().out
    assert main(["sim", "-n", "8", "-t", "ring", "--aggregation", "1M", "-s", "1K"]) == 2
    assert "needs switches" in capsys.readouterr().err
