"""One vocabulary for ``plait bench`` and ``plait sim``: same flags, same meaning, plain help."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

import pytest

from plait.bench import options
from plait.cli import bench as bench_cli
from plait.cli import sim as sim_cli
from plait.cli.__main__ import main

SHARED = [
    "-n", "8", "-b", "1K", "-e", "1M", "-f", "4", "-d", "float64", "-o", "max", "-r", "1",
    "-a", "ring", "-c", "reduce", "--json", "j", "--csv", "c", "--plot", "p", "--progress",
]  # fmt: skip


def parse(command: str, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"plait {command}", allow_abbrev=False)
    (bench_cli if command == "bench" else sim_cli).add_arguments(parser)
    return parser.parse_args(argv)


def shared(args: argparse.Namespace, command: str) -> dict[str, object]:
    """The shared concepts' values, whatever each command calls them inside."""
    ranks, algo = ("nproc", "algo") if command == "bench" else ("ranks", "algorithm")
    keys = ("dtype", "op", "root", "json", "csv", "plot", "progress")
    values = {k: getattr(args, k) for k in keys}
    values["sizes"] = options.resolve_sizes(args, "8", "8", 2)
    values["collective"] = options.resolve_collective(args, "allreduce")
    values["ranks"] = getattr(args, ranks)
    values["algo"] = getattr(args, algo)
    return values


def test_both_commands_take_the_same_flags_for_the_same_things() -> None:
    bench, sim = parse("bench", SHARED), parse("sim", SHARED)
    assert shared(bench, "bench") == shared(sim, "sim")
    assert shared(bench, "bench")["ranks"] == 8
    assert shared(sim, "sim")["collective"] == "reduce"


@pytest.mark.parametrize("command", ["bench", "sim"])
@pytest.mark.parametrize(
    ("argv", "same_as"),
    [
        (["--nproc", "8"], ["-n", "8"]),  # plait bench's and plait run's old spelling
        (["--ranks", "8"], ["-n", "8"]),  # plait sim's
        (["--algorithm", "ring,swing"], ["-a", "ring,swing"]),  # plait sim's old spelling
        (["--algo", "ring,swing"], ["-a", "ring,swing"]),
        (["reduce"], ["-c", "reduce"]),  # plait bench's positional, plait sim's -c
        (["--collective", "reduce"], ["-c", "reduce"]),
        (["-s", "1K:1M"], ["-b", "1K", "-e", "1M"]),  # plait sim's --sizes
        (["--sizes", "4K"], ["-b", "4K", "-e", "4K"]),
        (["--begin", "1K", "--end", "2K", "--factor", "8"], ["-b", "1K", "-e", "2K", "-f", "8"]),
    ],
)
def test_old_and_new_spellings_agree(command: str, argv: list[str], same_as: list[str]) -> None:
    assert shared(parse(command, argv), command) == shared(parse(command, same_as), command)


def test_sizes_resolve_with_each_commands_defaults() -> None:
    args = parse("sim", [])
    assert options.resolve_sizes(args, "1K", "64M", 4)[:3] == (1024, 64 << 20, 4)
    args = parse("bench", ["-e", "64"])
    assert options.resolve_sizes(args, "8", "256M", 2) == (8, 64, 2, [8, 16, 32, 64])
    args = parse("bench", ["-s", "0:8"])
    assert options.resolve_sizes(args, "8", "256M", 2)[3] == [0, 1, 2, 4, 8]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-s", "1K:1M", "-b", "8"], "either as -s LO:HI or as -b LO -e HI"),
        (["-f", "1"], "-f must be at least 2"),
        (["-b", "1M", "-e", "1K"], "begin <= end"),
        (["-b", "1X"], "not a size"),
        # Passed the checks, then failed in the ranks (exit 1).
        (
            ["-s", "99999999999999999999G"],
            "-s: 99999999999999999999G is "
            "107374182399999999998926258176 B, above the largest size, 2**63 - 1 B",
        ),
        (["-e", "9223372036854775808"], "-e: 9223372036854775808 is 9223372036854775808 B"),
    ],
)
def test_bad_sizes_say_why(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        options.resolve_sizes(parse("bench", argv), "8", "256M", 2)


def test_the_largest_size_is_exact_and_the_same_in_both_commands() -> None:
    # parse_size read digits through a float, so 2**63 - 1 became 2**63.
    largest = str(2**63 - 1)
    for command in ("bench", "sim"):
        args = parse(command, ["-s", largest])
        assert options.resolve_sizes(args, "8", "256M", 2)[3] == [2**63 - 1]
        with pytest.raises(ValueError, match=r"above the largest size, 2\*\*63 - 1 B"):
            options.resolve_sizes(parse(command, ["-s", "8589934592G"]), "8", "1", 2)


@pytest.mark.parametrize("command", ["bench", "sim"])
def test_a_size_beyond_int64_is_a_usage_error(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:  # plait bench exits from its checks, plait sim returns the code
        rc = main([command, "-n", "2", "-s", "99999999999999999999G", "--no-progress"])
    except SystemExit as exc:
        rc = exc.code
    assert rc == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines()[-1] == (
        f"plait {command}: error: -s: 99999999999999999999G is 107374182399999999998926258176 "
        "B, above the largest size, 2**63 - 1 B (int64's largest, as numpy addresses memory); "
        "expected a smaller size"
    )


def test_the_collective_is_given_once() -> None:
    assert options.resolve_collective(parse("sim", []), "allreduce") == "allreduce"
    assert options.resolve_collective(parse("sim", ["gather", "-c", "gather"]), "x") == "gather"
    with pytest.raises(ValueError, match="two collectives given"):
        options.resolve_collective(parse("bench", ["gather", "-c", "scatter"]), "allreduce")
    with pytest.raises(ValueError, match="unknown collective 'allsum'"):
        options.resolve_collective(parse("bench", ["allsum"]), "allreduce")


def test_t_is_the_transport_and_sims_old_t_still_names_the_topology(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert parse("bench", ["-t", "shm,tcp"]).transport == "shm,tcp"
    assert parse("sim", ["--topology", "ring"]).topology == "ring"
    assert capsys.readouterr().err == ""
    assert parse("sim", ["-t", "fat-tree:4"]).topology == "fat-tree:4"
    err = capsys.readouterr().err
    assert "plait sim: -t is deprecated here; write --topology" in err
    assert "-t is the transport in plait bench" in err
    assert parse("sim", []).topology == "flat"


@pytest.mark.parametrize("command", ["bench", "sim"])
def test_help_is_plain_text(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert f"plait {command}:" in text
    # no reStructuredText: ``literals``, :func:`roles`, literal-block markers
    assert "``" not in text
    assert not re.search(r":[a-z]+:`", text)
    assert not re.search(r"(^|\s)::\s*$", text, re.MULTILINE)
    assert "-n N, --ranks N" in text
    assert "-a ALGO, --algo ALGO" in text
    assert "-b SIZE, --begin SIZE" in text
    assert "--nproc" not in text.split("options:")[1]  # aliases are accepted, not listed


@pytest.mark.parametrize("command", ["bench", "sim"])
def test_help_lists_algorithms_and_marks_the_ones_that_need_switches(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = capsys.readouterr().out
    listing = text[text.index("algorithms (-a) of each collective:") :]
    assert "in_network*" in listing
    footnote = " ".join(listing[listing.index("* ") :].split())
    assert footnote.startswith("* simulator only: needs aggregating switches")
    assert all(len(line) <= 79 for line in listing.splitlines())
    algo_help = " ".join(text[text.index("-a ALGO, --algo ALGO") :].split()[:60])
    assert "in_network" in algo_help
    assert "aggregating switches" in algo_help


def test_bench_algo_all_says_it_leaves_in_network_out(capsys: pytest.CaptureFixture[str]) -> None:
    checked = bench_cli._check(parse("bench", ["-a", "all", "-e", "8"]))
    assert "in_network" not in checked["algos"]
    assert "ring" in checked["algos"]
    err = capsys.readouterr().err
    assert "--algo all leaves out in_network (simulator only: it needs aggregating switches" in err
    bench_cli._check(parse("bench", ["allgather", "-a", "all", "-e", "8"]))
    assert capsys.readouterr().err == ""  # nothing left out


def test_outputs_are_checked_before_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ok = ["--json", str(tmp_path / "a.json"), "--csv", str(tmp_path / "a.csv")]
    options.check_outputs(parse("sim", [*ok, "--plot", str(tmp_path / "a.PNG")]))
    options.check_outputs(parse("sim", ["--plot", "plot"]))  # no extension: matplotlib's PNG
    with pytest.raises(ValueError, match=re.escape(f"--json {tmp_path} is a folder")):
        options.check_outputs(parse("bench", ["--json", str(tmp_path)]))
    missing = tmp_path / "no" / "x.json"
    with pytest.raises(ValueError, match=re.escape(f"--trace {missing}: {missing.parent} does")):
        options.check_outputs(parse("sim", ["--trace", str(missing)]), "trace")
    file = tmp_path / "file"
    file.write_text("")
    with pytest.raises(ValueError, match=re.escape(f"{file} is not a folder")):
        options.check_outputs(parse("bench", ["--csv", str(file / "x.csv")]))
    # A folder whose modes allow writing may still refuse a file (/proc, a read-only mount):
    # the run went on, and its output crashed with a traceback at the end.
    if os.path.isdir("/proc"):
        with pytest.raises(ValueError, match=r"--json /proc/x\.json: cannot be written"):
            options.check_outputs(parse("bench", ["--json", "/proc/x.json"]))
    kept = tmp_path / "kept.json"
    kept.write_text("old")
    options.check_outputs(parse("bench", ["--json", str(kept)]))
    assert kept.read_text() == "old"  # looked at, not touched
    assert not (tmp_path / "a.json").exists()  # the file a check made is gone again
    # without matplotlib: its usual formats, and it is not imported to ask
    monkeypatch.setattr(options.importlib.util, "find_spec", lambda name: None)
    assert options.plot_formats() == ("png", "pdf", "svg", "jpg", "jpeg", "eps", "ps")
    with pytest.raises(ValueError, match=r"cannot save \.xyz files; expected .*\.png, \.pdf"):
        options.check_outputs(parse("bench", ["--plot", "p.xyz"]))


@pytest.mark.parametrize(
    ("collective", "sizes", "message"),
    [
        ("allreduce", [0], None),  # an empty row, asked for
        ("allreduce", [1, 2, 4], None),  # the smaller sizes collapse onto the 0-byte row
        ("barrier", [8], None),  # no data to size
        ("allreduce", [3], "-e: 3 B is below one float32 element (4 B)"),
        ("allgather", [8], "-e: 8 B is below one float32 element per rank (3 ranks of 4 B: 12 B)"),
    ],
)
def test_a_sweep_that_would_hold_no_element_is_refused(
    collective: str, sizes: list[int], message: str | None
) -> None:
    args = parse("bench", [])
    if message is None:
        options.check_elements(args, collective, sizes, 4, 3)
    else:
        with pytest.raises(ValueError, match=re.escape(message)):
            options.check_elements(args, collective, sizes, 4, 3)
