"""``plait bench`` end to end: real ranks, small sweeps, the table, JSON and CSV it writes."""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import signal
import sys
from pathlib import Path

import pytest
from bench_helpers import FAST, ROW_LINE, Running, assert_clean_table, bench, series, tables

import plait
from plait.algos import get
from plait.bench import runner
from plait.bench.runner import Series
from plait.cli import bench as bench_cli


def test_allreduce_two_ranks_table_json_and_csv(tmp_path: Path) -> None:
    csv_path = tmp_path / "bench.csv"
    res, doc = bench(
        ["-n", "2", "-b", "0", "-e", "4K", "-f", "4", "--csv", str(csv_path)], tmp_path
    )
    assert res.returncode == 0, res.stderr
    assert_clean_table(res.stdout)
    assert res.stdout.startswith("# plait bench: allreduce, float32, sum, 2 ranks, out of place")
    # 1 byte holds no float32: it collapses onto the 0-byte row.
    sizes = [0, 4, 16, 64, 256, 1024, 4096]
    rows = tables(res.stdout)["plait"]
    assert [int(r[0]) for r in rows] == sizes
    assert [int(r[1]) for r in rows] == [s // 4 for s in sizes]
    assert all(r[-1] == "0" for r in rows)  # wrong elements
    assert doc is not None
    assert doc["bench"]["collective"] == "allreduce"
    assert doc["limits"] is None
    (s,) = doc["series"]
    assert s["system"] == "plait"
    assert s["transport"] == "auto"
    assert s["error"] is None
    assert [r["bytes"] for r in s["rows"]] == sizes
    for r in s["rows"]:
        assert r["wrong"] == 0
        assert r["iters"] == 3
        assert r["algorithm"] in plait.algorithms("allreduce")
        assert r["p10_us"] <= r["time_us"] <= r["p90_us"]
        factor = 2 * (2 - 1) / 2
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * factor)
        if r["bytes"]:
            assert r["algbw_gbps"] == pytest.approx(r["bytes"] / r["time_us"] / 1e3)
    with csv_path.open() as f:
        lines = list(csv.DictReader(f))
    assert [int(x["bytes"]) for x in lines] == sizes
    assert "plait: 7 rows" in res.stderr
    # each row was printed on stderr as it was measured, counted, with the time left
    streamed = [ln for ln in res.stderr.splitlines() if ROW_LINE.search(ln)]
    assert [ROW_LINE.search(ln).groups() for ln in streamed] == [  # type: ignore[union-attr]
        (str(i), "7") for i in range(1, 8)
    ]
    assert all(ln.startswith("plait ") for ln in streamed)
    assert "left]" in streamed[0]
    assert "\r" not in res.stderr  # no bar when stderr is not a terminal


def test_no_progress_prints_no_rows(tmp_path: Path) -> None:
    res, _ = bench("-n 2 -b 8 -e 64 -f 8 --no-progress", tmp_path)
    assert res.returncode == 0, res.stderr
    assert not ROW_LINE.search(res.stderr)
    assert "plait: 2 rows" in res.stderr


@pytest.mark.parametrize("group", [False, True], ids=["to-the-bench", "to-the-process-group"])
def test_ctrl_c_prints_and_saves_the_rows_measured_so_far(group: bool, tmp_path: Path) -> None:
    """SIGINT once the first row is out: the partial table, the files, exit code 130.

    ``to-the-process-group`` sends it to the ranks too, as Ctrl-C in a terminal does.
    """
    out_json, out_csv = tmp_path / "out.json", tmp_path / "out.csv"
    run = Running(
        ["-n", "2", "-b", "8", "-e", "64M", "-a", "ring,recursive_doubling", *FAST,
         "--json", str(out_json), "--csv", str(out_csv)],
        new_session=group,
    )  # fmt: skip
    assert run.first_row.wait(90)
    assert any(ROW_LINE.search(line) for line in run.err), run.err
    assert run.proc.poll() is None, "the sweep ended before it could be interrupted"
    if group:
        os.killpg(run.proc.pid, signal.SIGINT)
    else:
        os.kill(run.proc.pid, signal.SIGINT)
    code, out, err = run.finish()
    assert code == 130, err
    m = re.search(r"^# interrupted \(SIGINT\) after (\d+) of (\d+) rows", out, re.MULTILINE)
    assert m is not None, out
    done, planned = int(m.group(1)), int(m.group(2))
    assert planned == 2 * 24  # two algorithms, 8 B .. 64 MiB
    assert 1 <= done < planned
    assert "plait bench: interrupted (SIGINT)" in err
    # the table holds the rows measured, from the smallest size on
    text = tables(out)
    assert set(text) == {"plait ring", "plait recursive_doubling"}
    assert sum(len(rows) for rows in text.values()) == done
    assert text["plait ring"][0][0] == "8"
    doc = json.loads(out_json.read_text())
    assert doc["bench"]["interrupted"] == "SIGINT"
    for s in doc["series"]:
        assert s["error"] == f"interrupted (SIGINT) after {len(s['rows'])} rows"
        sizes = [r["bytes"] for r in s["rows"]]
        assert sizes == [8 << i for i in range(len(sizes))]
        assert all(r["wrong"] == 0 for r in s["rows"])
    assert sum(len(s["rows"]) for s in doc["series"]) == done
    with out_csv.open() as f:
        assert len(list(csv.DictReader(f))) == done


def test_three_ranks_every_allgather_algorithm_in_place(tmp_path: Path) -> None:
    algos = plait.algorithms("allgather")
    res, doc = bench("allgather -n 3 -b 8 -e 1K -f 8 --in-place --algo all", tmp_path)
    assert res.returncode == 0, res.stderr
    assert_clean_table(res.stdout)
    assert "3 ranks, in place" in res.stdout.splitlines()[0]
    assert doc is not None
    assert [s["label"] for s in doc["series"]] == [f"plait {a}" for a in algos]
    for s in doc["series"]:
        # 8 B = 2 floats: no whole block per rank; 64 B = 16 floats -> 15; 512 B -> 126.
        assert [r["count"] for r in s["rows"]] == [0, 15, 126]
        assert all(r["wrong"] == 0 and r["algorithm"] == s["requested"] for r in s["rows"])
        bus = [r["busbw_gbps"] / r["algbw_gbps"] for r in s["rows"] if r["algbw_gbps"]]
        assert bus == pytest.approx([2 / 3] * len(bus))


def test_rooted_collective_over_both_transports(tmp_path: Path) -> None:
    res, doc = bench("reduce_scatter -n 3 -b 48 -e 3K -f 8 -t shm,tcp", tmp_path)
    assert res.returncode == 0, res.stderr
    assert doc is not None
    assert [s["label"] for s in doc["series"]] == ["plait-shm", "plait-tcp"]
    for s in doc["series"]:
        assert [r["bytes"] for r in s["rows"]] == [48, 384, 3072]
        assert all(r["wrong"] == 0 for r in s["rows"])


@pytest.mark.parametrize(
    ("collective", "extra"),
    [("scatter", ["-r", "2", "--in-place"]), ("barrier", []), ("barrier", ["-a", "dissemination"])],
)
def test_scatter_and_barrier_three_ranks(collective: str, extra: list[str], tmp_path: Path) -> None:
    res, doc = bench([collective, "-n", "3", "-b", "0", "-e", "512", "-f", "8", *extra], tmp_path)
    assert res.returncode == 0, res.stderr
    assert doc is not None
    (s,) = doc["series"]
    if collective == "barrier":  # one row: no data to size; one host: the one-sided barrier
        name = extra[1] if extra else "arena"  # or the one asked for (it ran auto's before)
        assert [(r["bytes"], r["algorithm"], r["busbw_gbps"]) for r in s["rows"]] == [
            (0, name, 0.0)
        ]
    else:
        assert "root 2" in res.stdout.splitlines()[0]
        # sizes 0, 1, 8, 64, 512 B: 0, 0, 2, 16, 128 floats, whole blocks of 3 ranks
        assert [r["count"] for r in s["rows"]] == [0, 15, 126]
    assert all(r["wrong"] == 0 for r in s["rows"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--algo", "ring,bogus"], "unknown algorithm 'bogus'"),
        (["-d", "int32", "-o", "avg"], "avg on int32"),
        (["-d", "float99"], "unknown dtype"),
        (["-b", "1M", "-e", "1K"], "begin <= end"),
        (["-n", "2", "-r", "2", "reduce"], "--root must be in 0..1"),
        (["--compare", "nccl"], "unknown system to compare with 'nccl'"),
        (["-t", "rdma"], "unknown transport 'rdma'"),
        (["--algo", "in_network"], "'in_network' is simulator only: it needs aggregating"),
        # These measured nothing and exited 0.
        (["--algo", ","], "no algorithm named in ','"),
        (["-t", ""], "no transport named in ''"),
    ],
)
def test_bad_arguments_fail_before_any_rank_starts(
    args: list[str], message: str, tmp_path: Path
) -> None:
    res, doc = bench(args, tmp_path, timeout=30, fast=False)
    assert res.returncode == 2  # a usage error, as argparse's own
    assert message in res.stderr
    assert res.stdout == ""
    assert doc is None


def test_plot_without_matplotlib_says_what_to_install(tmp_path: Path) -> None:
    fake = tmp_path / "fake" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('hidden for this test')\n")
    pythonpath = str(fake.parent)
    res, _ = bench(["--plot", str(tmp_path / "x.png")], tmp_path, {"PYTHONPATH": pythonpath}, 30)
    assert res.stdout == ""
    assert res.returncode != 0
    assert "--plot needs matplotlib: pip install 'plait[plot]'" in res.stderr


def test_plot_file(tmp_path: Path) -> None:
    pytest.importorskip(
        "matplotlib", reason="matplotlib is not installed (pip install 'plait[plot]')"
    )
    png = tmp_path / "bench.png"
    res, _ = bench(["-n", "2", "-b", "8", "-e", "1K", "-f", "32", "--plot", str(png)], tmp_path)
    assert res.returncode == 0, res.stderr
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_limits_are_measured_and_read_against(tmp_path: Path) -> None:
    res, doc = bench("-n 2 -b 1M -e 1M --limits", tmp_path)
    assert res.returncode == 0, res.stderr
    assert doc is not None
    limits = doc["limits"]
    assert set(limits) >= {"copy_gbps_1core", "copy_gbps_all", "add_gbps_1core", "tcp_gbps"}
    assert all(v > 0 for v in limits.values())
    assert "# limits: memory copy" in res.stdout
    assert "%limit" in res.stdout
    (r,) = series(doc, "plait")["rows"]
    assert r["limit_fraction"] == pytest.approx(r["busbw_gbps"] / limits["copy_gbps_1core"])


def _args(**kw: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    ns = parser.parse_args(["-b", "8", "-e", "8"])
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


def test_exit_code_is_1_when_plait_returns_a_wrong_element(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def fake_plait(spec: object, transport: str, opts: object) -> list[Series]:
        rows = [{"bytes": 8, "count": 2, "algorithm": "ring", "warmup": 1, "iters": 3,
                 "time_us": 5.0, "p10_us": 4.0, "p90_us": 6.0, "algbw_gbps": 0.0016,
                 "busbw_gbps": 0.0016, "wrong": wrong}]  # fmt: skip
        return [Series("plait", "plait", transport, "auto", rows)]

    monkeypatch.setattr(runner, "run_plait", fake_plait)
    wrong = 0
    assert bench_cli.main(_args()) == 0
    wrong = 1
    assert bench_cli.main(_args()) == 1
    assert capsys.readouterr().out.count("# plait (transport auto") == 2


def test_runner_reports_ranks_that_wrote_nothing() -> None:
    s = runner._series(Series("plait", "plait", "shm", "auto"), 1, None, 0.5)
    assert s.error == "the ranks exited with code 1 and reported nothing"
    s = runner._series(Series("plait", "plait", "shm", "auto"), 3, {"rows": [], "error": "x"}, 0.5)
    assert s.error == "x"
    assert sys.executable  # the helpers run the bench with this interpreter


def test_runner_gives_each_algorithm_its_own_error() -> None:
    # The error of one algorithm (arena's, over TCP) was copied onto every series.
    live = runner.Live(rows=False, bar=False)
    bases = [Series("plait", f"plait-tcp {a}", "tcp", a) for a in ("ring", "arena")]
    rows = [{"requested": "ring", "bytes": 8}]
    result = {"rows": rows, "refused": {"arena": "arena is one-sided"}}
    ring, arena = runner._collect(bases, "plait-tcp", 0, result, 0.5, live)
    assert (ring.error, ring.rows) == (None, rows)
    assert (arena.error, arena.rows) == ("arena is one-sided", [])
    result = {"rows": rows, "error": "rank 0: CommTimeout: late", "failed": "arena"}
    ring, arena = runner._collect(bases, "plait-tcp", 3, result, 0.5, live)
    assert ring.error == "stopped after 1 rows, when arena failed"
    assert arena.error == "rank 0: CommTimeout: late"


def test_one_sided_algorithms_over_tcp(tmp_path: Path) -> None:
    """Named, arena fails in its own series and ring is measured; all leaves arena out."""
    res, doc = bench("-n 2 -s 1K -a ring,arena -t tcp", tmp_path)
    assert res.returncode == 1, res.stderr
    assert doc is not None
    ring, arena = doc["series"]
    assert ring["error"] is None
    assert [(r["bytes"], r["algorithm"], r["wrong"]) for r in ring["rows"]] == [(1024, "ring", 0)]
    assert "algorithm 'arena' is one-sided" in arena["error"]
    assert arena["rows"] == []
    assert "Traceback" not in res.stderr  # refused before any call, on every rank alike
    res, doc = bench("-n 2 -s 1K -a all -t tcp", tmp_path)
    assert res.returncode == 0, res.stderr
    assert doc is not None
    one_sided = [a for a in plait.algorithms("allreduce") if get("allreduce", a).needs_window]
    assert one_sided
    note = f"plait bench: --algo all leaves out {', '.join(one_sided)} over tcp: one-sided"
    assert note in res.stderr
    labels = [s["label"] for s in doc["series"]]
    assert labels == [
        f"plait-tcp {a}"
        for a in plait.algorithms("allreduce")
        if a not in one_sided and not get("allreduce", a).needs_fabric
    ]
    assert all(s["error"] is None and len(s["rows"]) == 1 for s in doc["series"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--timeout", "0"], "--timeout must be a number of seconds > 0, not 0.0"),
        (["--timeout", "-3"], "--timeout must be a number of seconds > 0, not -3.0"),
        (["--timeout", "nan"], "--timeout must be a number of seconds > 0, not nan"),
        (["--seconds", "nan"], "--seconds must be a number of seconds > 0, not nan"),
        (["--seconds", "-1"], "--seconds must be a number of seconds > 0, not -1.0"),
        (["--seconds", "inf"], "--seconds must be a number of seconds > 0, not inf"),
        (["--iters", "0"], "--iters must be at least 1, not 0"),
        (["--warmup", "-1"], "--warmup must be at least 0, not -1"),
        (["--rounds", "0"], "--rounds must be at least 1, not 0"),
        # every round made a call: the row had 4 where the header said 1
        (["--iters", "1", "--rounds", "4"], "--rounds 4 is more than --iters 1: the rounds "
         "share the timed calls and each needs one"),
        (["-n", "0"], "-n must be at least 1, not 0"),
        (["-s", "3"], "-s: 3 B is below one float32 element (4 B)"),
        (["-s", "8", "-d", "longdouble"], "-s: 8 B is below one longdouble element (16 B)"),
        (["allgather", "-n", "4", "-b", "2", "-e", "8"], "-e: 8 B is below one float32 element "
         "per rank (4 ranks of 4 B: 16 B)"),
        (["--json", "/nonexistent/dir/x.json"], "--json /nonexistent/dir/x.json: "
         "/nonexistent/dir does not exist"),
        (["--csv", "/nonexistent/x.csv"], "--csv /nonexistent/x.csv: /nonexistent does not exist"),
        # dtypes of 0 bytes: a ZeroDivisionError in the sizes' arithmetic, exit 1
        (["-d", "str", "-s", "64"], "-d str: dtype <U0 is not supported; expected bool"),
        (["-d", "U", "-s", "64"], "-d U: dtype <U0 is not supported"),
        (["-d", "S", "-s", "64"], "-d S: dtype |S0 is not supported"),
        (["-d", "V", "-s", "64"], "-d V: dtype |V0 is not supported"),
        pytest.param(["-d", "a0", "-s", "64"], "-d a0: dtype |S0 is not supported",
                     marks=pytest.mark.filterwarnings("ignore:Data type alias 'a'")),
        # a collective that reduces nothing never checked the dtype: every call failed
        (["allgather", "-d", "U4", "-s", "64"], "-d U4: dtype <U4 is not supported"),
        # an empty file name was not written, and the run said nothing of it
        (["--json", ""], "--json '' is empty; expected a file name"),
        (["--csv", ""], "--csv '' is empty; expected a file name"),
        (["--plot", ""], "--plot '' is empty; expected a file name"),
    ],
)  # fmt: skip
def test_usage_errors_exit_2_before_any_rank_starts(
    args: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # --timeout 0 was a traceback, --seconds nan crashed the ranks, --seconds -1 and --iters 0
    # ran (rows of no time), -s 3 measured 0 bytes, a --json in no folder failed after the run.
    from plait.cli.__main__ import main

    def no_run(*args: object) -> list[Series]:
        raise AssertionError("a rank was started")

    monkeypatch.setattr(runner, "run_plait", no_run)
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *args])
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("usage: plait bench")
    assert err.splitlines()[-1].startswith(f"plait bench: error: {message}")  # one line


def test_a_plot_matplotlib_cannot_save_is_refused_before_the_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip(
        "matplotlib", reason="matplotlib is not installed (pip install 'plait[plot]')"
    )
    from plait.cli.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--plot", "p.xyz"])
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""  # it was a matplotlib traceback after the whole run
    assert "plait bench: error: --plot p.xyz: matplotlib cannot save .xyz files; expected" in err


def test_model_column_with_a_profile(tmp_path: Path) -> None:
    """With a plait tune profile, each plait row carries the model's time for its algorithm."""
    from plait.selection.model import LinkCost, Profile, save
    from plait.sim import formulas

    prof = Profile(LinkCost(2e-5, 1e-9), None, 3e-10, 2e-10)
    path = save(prof, tmp_path / "profile.json")
    res, doc = bench(
        "-n 2 -b 1K -e 4K -f 4 --algo ring,recursive_doubling", tmp_path,
        env={"PLAIT_PROFILE": str(path)},
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "model_us" in res.stdout
    assert doc is not None
    rows = [r for s in doc["series"] for r in s["rows"]]
    assert len(rows) == 4
    for r in rows:
        want = formulas.predict(
            "allreduce", r["algorithm"], 2, r["bytes"], 2e-5, 1e-9, 3e-10, 2e-10
        )
        assert r["model_us"] == pytest.approx(want * 1e6, rel=1e-9)


def test_the_header_says_what_the_rows_are() -> None:
    """A barrier's header gave the sizes of -s (4 MiB) though its one row moves nothing, a
    single size came with its factor (x2), and one rank or row was said in the plural."""
    import argparse

    base = dict(dtype="float32", op="sum", in_place=False, root=0, iters=None, seconds=0.1,
                rounds=1, factor=2)  # fmt: skip
    barrier = argparse.Namespace(collective="barrier", nproc=2, **base)
    assert bench_cli._header(barrier, {"sizes": [4 << 20]}, 1)[1].startswith("# no data, one row; ")
    one = argparse.Namespace(collective="allreduce", nproc=1, **base)
    head = bench_cli._header(one, {"sizes": [8]}, 1)
    assert head[0] == "# plait bench: allreduce, float32, sum, 1 rank, out of place"
    assert head[1].startswith("# size 8 B, one row; ")
    many = bench_cli._header(one, {"sizes": [8, 16, 32]}, 3)[1]
    assert many.startswith("# sizes 8 B .. 32 B (x2), 3 rows; ")
