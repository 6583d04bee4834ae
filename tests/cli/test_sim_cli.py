"""``plait sim``: the table, JSON, trace, topologies, bad input, progress and its options."""

from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path

import pytest

from plait.cli.__main__ import main
from plait.cli.sim import _Progress, parse_topology
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
    net = parse_topology("flat", 8, 1e-6, 1 / 12.5e9, 1 / 15e9, (2e-7, 1 / 50e9), delta=1 / 15e9)
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
    # 4 KiB of float32 on 5 ranks: 1020 elements in whole blocks, 4080 B (as plait bench says)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("4080")]
    assert lines
    assert lines[0].split()[-1] == "0"
    events = json.loads(trace.read_text())
    assert events["traceEvents"] if isinstance(events, dict) else events


def test_rows_are_plait_benchs_points(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # The rows said the bytes asked for (4, 8, 64) with bandwidth for rows of no element,
    # and kept sizes that round to one count apart; plait bench prints 0, 12, 24, 60.
    from plait.bench.sweep import points

    out, table = tmp_path / "sim.json", tmp_path / "sim.csv"
    argv = ["sim", "allgather", "-n", "3", "-s", "4:64", "-f", "2", "-a", "ring"]
    assert main([*argv, "--json", str(out), "--csv", str(table)]) == 0
    rows = [ln.split() for ln in capsys.readouterr().out.splitlines() if not ln.startswith("#")]
    want = points("allgather", [4, 8, 16, 32, 64], 4, 3)
    assert [(p.nbytes, p.count) for p in want] == [(0, 0), (12, 3), (24, 6), (60, 15)]
    assert [(int(r[0]), int(r[1])) for r in rows if r] == [(p.nbytes, p.count) for p in want]
    records = json.loads(out.read_text())["results"]
    assert [r["bytes"] for r in records] == [0, 12, 24, 60]
    assert records[0]["algbw_gbps"] == 0.0  # no element, no bandwidth
    assert records[3]["algbw_gbps"] == pytest.approx(60 / records[3]["time_s"] / 1e9)
    with table.open() as f:
        assert [(r["bytes"], r["count"]) for r in csv.DictReader(f)] == [
            ("0", "0"), ("12", "3"), ("24", "6"), ("60", "15")
        ]  # fmt: skip


@pytest.mark.parametrize(
    ("spec", "ranks"),
    [("flat", 8), ("flat-free", 8), ("switch", 8), ("fat-tree:4:2", 16), ("fat-tree:4:1:2", 16),
     ("hosts:4", 16), ("hosts:4:2", 16), ("ring", 6), ("torus:2x3", 6), ("torus:2x2x2", 8),
     ("torus:2x2x2x2", 16)],
)  # fmt: skip
def test_every_topology_runs(spec: str, ranks: int, capsys: pytest.CaptureFixture) -> None:
    assert main(["sim", "-n", str(ranks), "--topology", spec, "-a", "ring", "-s", "64K"]) == 0
    out = capsys.readouterr().out
    assert "65536" in out
    # the header names the ranks once, whatever the topology's description says
    header = out.splitlines()[0]
    assert len(re.findall(r"\branks\b", header)) == 1, header
    assert f"(topology {spec}, algorithm ring)" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--topology", "mesh"], "unknown topology"),
        (["--topology", "torus:3x3"], "has 9 ranks"),
        (["--topology", "hosts:3"], "not a multiple"),
        (["--topology", "fat-tree"], "ranks per leaf"),
        # said: invalid literal for int() with base 10: 'x'
        (["--topology", "fat-tree:x"], "--topology 'fat-tree:x': K 'x' is not a whole number; "
         "expected fat-tree:K[:OVERSUB[:SPINES]]"),
        (["--topology", "torus:2x2x"], "a dimension '' is not a whole number; expected torus"),
        (["--topology", "hosts:2:0"], "--topology 'hosts:2:0': nics must be >= 1"),  # no option
        (["--alpha", "-1"], "--alpha must be a finite number >= 0"),  # said: LinkParams.alpha
        (["-s", "1K", "-e", "2K"], "either as -s LO:HI or as -b LO -e HI"),
        (["-c", "reduce", "-r", "8"], "--root must be in 0..7"),
        (["gather", "-c", "scatter"], "two collectives given"),
        (["-a", "nope"], "no algorithm 'nope'"),
        (["-c", "allsum"], "unknown collective"),
        (["-f", "1"], "at least 2"),
        (["-n", "0"], "-n must be at least 1, not 0"),  # said: --root must be in 0..-1
        (["-n", "-3", "-a", "ring"], "-n must be at least 1, not -3"),
        # it built silently for minutes, and ran out of memory
        (["-n", "100000000"], "-n 100000000 is more ranks than plait sim simulates (1,048,576"),
        (["--segment", "-5"], "--segment '-5': expected a size in bytes (e.g. 64K), 0"),
        (["--segment", "1X"], "--segment '1X': expected a size in bytes"),
        (["-s", "3"], "-s: 3 B is below one float32 element (4 B)"),
        (["-s", "8", "-d", "longdouble"], "-s: 8 B is below one longdouble element (16 B)"),
        (["reduce_scatter", "-s", "16"], "-s: 16 B is below one float32 element per rank"),
        (["-a", "in_network", "-s", "1K"], "'in_network' needs switches that reduce in flight: "
         "give them aggregation memory with --topology switch, fat-tree:K or hosts:K and "
         "--aggregation BYTES"),
        # said nothing: a switch of 1 B held segments of 8 (its memory rounded up to one)
        (["--topology", "switch", "--aggregation", "8", "-d", "float64", "-a", "in_network"],
         "--aggregation 8 B holds fewer than 4 elements of float64 (32 B)"),
        (["--json", "/nonexistent/x.json"], "--json /nonexistent/x.json: /nonexistent does not"),
        (["--csv", "/nonexistent/x.csv"], "--csv /nonexistent/x.csv: /nonexistent does not"),
        (["--trace", "/nonexistent/t.json"], "--trace /nonexistent/t.json: /nonexistent does not"),
        # an empty file name was not written, and the run said nothing of it
        (["--trace", ""], "--trace '' is empty; expected a file name"),
        (["--json", ""], "--json '' is empty; expected a file name"),
        # dtypes of 0 bytes: a ZeroDivisionError where the collective reduces nothing
        (["-d", "str"], "-d str: dtype <U0 is not supported; expected bool"),
        (["allgather", "-d", "str"], "-d str: dtype <U0 is not supported"),
        (["alltoall", "-d", "V"], "-d V: dtype |V0 is not supported"),
    ],
)  # fmt: skip
def test_bad_input_exits_2_with_a_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture
) -> None:
    assert main(["sim", "-n", "8", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # refused before anything ran (a bad --json failed after the run)
    assert err.startswith("usage: plait sim")
    assert err.splitlines()[-1].startswith("plait sim: error: ")  # one line
    assert message in err
    assert "leaves out" not in err  # --algo all's note comes after the checks


def test_a_plot_matplotlib_cannot_save_is_refused_before_the_run(
    capsys: pytest.CaptureFixture,
) -> None:
    pytest.importorskip(
        "matplotlib", reason="matplotlib is not installed (pip install 'plait[plot]')"
    )
    assert main(["sim", "-n", "8", "-a", "ring", "-s", "1K", "--plot", "p.xyz"]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # it was a matplotlib traceback after the run
    assert "plait sim: error: --plot p.xyz: matplotlib cannot save .xyz files; expected" in err


def test_segment_takes_sizes_as_the_size_options_do(tmp_path: Path) -> None:
    # --segment 64K was "invalid literal for int()".
    times = {}
    out = tmp_path / "sim.json"
    for segment in ("64K", "65536", "0", "default"):
        argv = ["sim", "-n", "4", "-c", "broadcast", "-a", "binomial", "-s", "1M"]
        assert main([*argv, "--segment", segment, "--json", str(out)]) == 0
        times[segment] = json.loads(out.read_text())["results"][0]["time_s"]
    assert times["64K"] == times["65536"]
    assert times["64K"] != times["0"]


def test_beta_accepts_a_fraction(capsys: pytest.CaptureFixture) -> None:
    assert main(["sim", "-n", "2", "-a", "direct", "-s", "1M", "--beta", "1/1e9",
                 "--alpha", "0", "--gamma", "0", "--delta", "0"]) == 0  # fmt: skip
    row = next(
        ln for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("1048576")
    )
    # 2 ranks, direct, local work free: each sends its 1 MiB once at 1 GB/s.
    assert float(row.split()[4]) == pytest.approx(1048576 / 1e9 * 1e6, rel=1e-3)


def test_aggregation_runs_in_network(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--aggregation gives the switches memory; in_network then runs (with data) and is fastest."""
    out = tmp_path / "agg.json"
    trace = tmp_path / "t.json"
    rc = main(
        ["sim", "-n", "8", "--topology", "fat-tree:4", "--aggregation", "64K", "-a",
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
    captured = capsys.readouterr()
    assert "in_network" not in captured.out
    assert "--algo all leaves out in_network: it needs aggregating switches" in (captured.err)
    assert main(["sim", "-n", "8", "--topology", "ring", "--aggregation", "1M", "-s", "1K"]) == 2
    assert "needs switches" in capsys.readouterr().err


def test_old_t_still_names_the_topology_with_a_note(capsys: pytest.CaptureFixture) -> None:
    assert main(["sim", "-n", "6", "-t", "torus:2x3", "-a", "ring", "-s", "1K"]) == 0
    captured = capsys.readouterr()
    assert "(topology torus:2x3, algorithm ring)" in captured.out
    assert "-t is deprecated here; write --topology" in captured.err


def test_bench_spellings_work_here_too(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The collective as a positional argument, -b/-e/-f, -o, -r, --csv: as in plait bench."""
    out = tmp_path / "sim.csv"
    rc = main(["sim", "reduce", "-n", "4", "-b", "1K", "-e", "16K", "-f", "4", "-o", "max",
               "-r", "2", "--algo", "binomial", "--csv", str(out), "--with-data"])  # fmt: skip
    assert rc == 0
    text = capsys.readouterr().out
    assert text.startswith("# plait sim: reduce, float32, max, root 2, ")
    with out.open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["label"], r["bytes"], r["wrong"]) for r in rows] == [
        ("binomial", "1024", "0"), ("binomial", "4096", "0"), ("binomial", "16384", "0")
    ]  # fmt: skip
    net = parse_topology("flat", 4, 1e-6, 1 / 12.5e9, 1 / 15e9, (2e-7, 1 / 50e9), delta=1 / 15e9)
    want = simulate("reduce", "binomial", 4096, net, root=2, segment_bytes=None).time
    assert float(rows[1]["time_us"]) == pytest.approx(want * 1e6, rel=1e-12)


def test_long_algorithm_names_are_whole_and_aligned(capsys: pytest.CaptureFixture) -> None:
    assert main(["sim", "-n", "8", "-a", "ring,double_binary_tree", "-s", "1K"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(ln for ln in lines if "algorithm" in ln and "iters" in ln)
    row = next(ln for ln in lines if "double_binary_tree" in ln and not ln.startswith("#"))
    assert row.split()[2] == "double_binary_tree"
    for name in ("count", "iters", "time_us", "busbw_GB/s"):
        end = header.index(name) + len(name)
        assert row[end - 1] != " "
        assert row[end] == " "


def test_an_algorithm_named_twice_runs_once(capsys: pytest.CaptureFixture) -> None:
    # "-a ring,ring" simulated ring twice and printed each row twice
    assert main(["sim", "-n", "8", "-a", "ring, swing,ring", "-s", "1K"]) == 0
    rows = [ln.split() for ln in capsys.readouterr().out.splitlines() if not ln.startswith("#")]
    named = [row[2] for row in rows if len(row) > 2]
    assert named == ["ring", "swing"]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_progress_is_quiet_for_short_runs_then_says_what_runs() -> None:
    clock, out = Clock(), io.StringIO()
    p = _Progress(out, 3, None, quiet=3.0, every=15.0, clock=clock)
    p.begin("ring", 1024)
    clock.now = 1.0
    p.end()
    assert out.getvalue() == ""  # one second in: nothing to report
    p.begin("ring", 1 << 30)
    clock.now = 10.0
    p.tick()
    assert out.getvalue() == ""  # on it for 9 s: not yet
    clock.now = 16.2
    p.tick()
    assert out.getvalue() == "plait sim: ring, 1 GiB (2 of 3): running for 15 s; 16 s elapsed\n"
    clock.now = 20.0
    p.tick()  # said 3.8 s ago
    clock.now = 31.5
    p.tick()  # on it for 30.5 s, said 15.3 s ago
    clock.now = 62.0
    p.tick()  # on it for 61 s: lines every 30.5 s now
    clock.now = 121.0
    p.tick()  # on it for two minutes: lines every 60 s now, and it said 59 s ago
    clock.now = 122.2
    p.tick()
    clock.now = 123.0
    p.end()
    p.begin("swing", 8)
    p.end("failed")
    p.finish()
    assert out.getvalue().splitlines()[1:] == [
        "plait sim: ring, 1 GiB (2 of 3): running for 30 s; 32 s elapsed",
        "plait sim: ring, 1 GiB (2 of 3): running for 1 min 1 s; 1 min 2 s elapsed",
        "plait sim: ring, 1 GiB (2 of 3): running for 2 min 1 s; 2 min 2 s elapsed",
        "plait sim: ring, 1 GiB (2 of 3): done in 2 min 2 s; 2 min 3 s elapsed",
        "plait sim: swing, 8 B (3 of 3): failed in 0 s; 2 min 3 s elapsed",
        "plait sim: 3 simulations in 2 min 3 s",
    ]


def test_progress_forced_and_off() -> None:
    clock, out = Clock(), io.StringIO()
    p = _Progress(out, 1, True, clock=clock)
    p.begin("ring", 1024)
    clock.now = 0.5
    p.end()
    assert out.getvalue().splitlines() == [
        "plait sim: ring, 1 KiB (1 of 1): started; 0 s elapsed",
        "plait sim: ring, 1 KiB (1 of 1): done in 0 s; 0 s elapsed",
    ]
    off = _Progress(out := io.StringIO(), 1, False, clock=clock)
    off.begin("ring", 1024)
    clock.now = 100.0
    off.tick()
    off.end()
    off.finish()
    assert out.getvalue() == ""


def test_progress_on_stderr_of_a_run(capsys: pytest.CaptureFixture) -> None:
    assert main(["sim", "-n", "8", "-a", "ring,swing", "-s", "1K:4K", "--progress"]) == 0
    captured = capsys.readouterr()
    lines = [ln for ln in captured.err.splitlines() if ln.startswith("plait sim: ")]
    done = [ln for ln in lines if ": done in " in ln]
    assert [ln.split(":")[1].strip() for ln in done] == [
        "ring, 1 KiB (1 of 4)", "ring, 4 KiB (2 of 4)", "swing, 1 KiB (3 of 4)",
        "swing, 4 KiB (4 of 4)",
    ]  # fmt: skip
    assert all(ln.endswith(" elapsed") for ln in done)
    assert not re.search(r"^plait sim:", captured.out, re.MULTILINE)  # the table stays clean
    assert main(["sim", "-n", "8", "-a", "ring", "-s", "1K"]) == 0
    assert capsys.readouterr().err == ""  # a short run says nothing


def test_all_leaves_out_the_one_sided_algorithms_across_hosts(
    capsys: pytest.CaptureFixture,
) -> None:
    assert main(["sim", "-n", "6", "--topology", "hosts:2", "-a", "all", "-s", "1K"]) == 0
    captured = capsys.readouterr()
    assert "leaves out arena, arena_oneshot, arena_leader: one-sided" in captured.err
    assert "(topology hosts:2, algorithm arena)" not in captured.out
    assert "(topology hosts:2, algorithm hierarchical_arena)" in captured.out  # a window per host
    assert main(["sim", "-n", "6", "-a", "all", "-s", "1K"]) == 0  # one host: all of them
    captured = capsys.readouterr()
    assert "leaves out arena" not in captured.err
    assert "(topology flat, algorithm arena)" in captured.out


@pytest.mark.parametrize("topology", ["switch", "fat-tree:4:2", "ring", "torus:2x3"])
def test_all_leaves_out_every_window_algorithm_where_each_rank_is_a_machine(
    topology: str, capsys: pytest.CaptureFixture
) -> None:
    # These networks join a machine a rank by cables: no rank shares a window with another,
    # and an arena algorithm there crossed no cable at all, faster than any real one.
    assert main(["sim", "-n", "6", "--topology", topology, "-a", "all", "-s", "1K"]) == 0
    captured = capsys.readouterr()
    assert (
        "leaves out arena, arena_oneshot, arena_leader, hierarchical_arena, cascade_arena: "
        f"one-sided, they run only where ranks share a host's memory, and every rank of "
        f"{topology} is a machine of its own"
    ) in captured.err
    assert "arena" not in captured.out
    assert main(["sim", "-n", "6", "--topology", topology, "-a", "arena", "-s", "1K"]) == 0
    assert "algorithm arena)" in capsys.readouterr().out  # named, it still runs
