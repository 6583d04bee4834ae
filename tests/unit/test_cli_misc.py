"""The plait command's small parts: --version, plain-text help, the algorithms listing."""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path

import pytest

import plait
from plait.cli import plain
from plait.cli.__main__ import main

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
#: reStructuredText a terminal shows raw: inline literals, roles, a literal-block marker.
MARKUP = re.compile(r"``|:[a-z]+:`|^\s*::\s*$", re.MULTILINE)


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """Exit status and stdout of ``plait ARGV``, run in this process."""
    try:
        status = main(argv)
    except SystemExit as stop:
        status = int(stop.code or 0)
    return status, capsys.readouterr().out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    status, out = run(["--version"], capsys)
    assert status == 0
    assert out == f"plait {importlib.metadata.version('plait')}\n"


def test_version_of_a_source_tree_that_is_not_installed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    monkeypatch.setattr(plait, "__version__", "9.8.7")
    assert run(["--version"], capsys) == (0, "plait 9.8.7\n")


def test_dunder_version_is_the_projects() -> None:
    """plait.__version__ is the version in pyproject.toml (it is written in both places)."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    assert plait.__version__ == project["version"]


@pytest.mark.parametrize(
    "argv",
    [["--help"], *([name, "--help"] for name in ("run", "bench", "sim", "tune", "algorithms"))],
)
def test_help_is_plain_text(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    status, out = run(argv, capsys)
    assert status == 0
    assert "usage: plait" in out
    assert not MARKUP.findall(out), out


def test_help_mentions_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--version" in run(["--help"], capsys)[1]


def test_plain_removes_inline_markup() -> None:
    text = "see :func:`plait.init` and :mod:`~plait.sim`, set ``PLAIT_ALGO``; keep `one`"
    assert plain(text) == "see plait.init and plait.sim, set PLAIT_ALGO; keep `one`"


def test_plain_drops_literal_block_markers() -> None:
    text = "Examples::\n\n    plait run -n 2 x.py\n\nMore:\n\n::\n\n    plait sim\n"
    assert plain(text) == "Examples:\n\n    plait run -n 2 x.py\n\nMore:\n\n    plait sim\n"


def test_algorithms_listing_marks_simulator_only(capsys: pytest.CaptureFixture[str]) -> None:
    status, out = run(["algorithms"], capsys)
    assert status == 0
    marked = [line.split()[:2] for line in out.splitlines() if "simulator only" in line]
    assert marked == [["allreduce", "in_network"]]
    (line,) = [ln for ln in out.splitlines() if ln.split()[:2] == ["allreduce", "in_network"]]
    assert line.endswith("(simulator only: needs aggregating switches; commutative ops only)")
    assert not MARKUP.findall(out)


def test_algorithms_listing_of_one_collective(capsys: pytest.CaptureFixture[str]) -> None:
    status, out = run(["algorithms", "gather"], capsys)
    assert status == 0
    assert [line.split()[:2] for line in out.splitlines()] == [
        ["gather", "arena"],
        ["gather", "binomial"],
    ]
    assert out.splitlines()[0].endswith("(one host: a shared-memory window)")


def test_algorithms_listing_has_the_uneven_collectives(capsys: pytest.CaptureFixture[str]) -> None:
    # The catalogue README points to lists allgatherv and the other uneven collectives too.
    import plait

    status, out = run(["algorithms", "allgatherv"], capsys)
    assert status == 0
    assert [line.split()[1] for line in out.splitlines()] == list(plait.algorithms("allgatherv"))
    status, out = run(["algorithms"], capsys)
    listed = {line.split()[0] for line in out.splitlines()}
    assert {"allgatherv", "gatherv", "scatterv", "alltoallv", "reduce_scatterv"} <= listed


def test_algorithms_listing_refuses_an_unknown_collective(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["algorithms", "allreduse"])
    assert stop.value.code == 2
    assert "invalid choice: 'allreduse'" in capsys.readouterr().err


def test_a_reader_that_goes_away_ends_the_output_quietly() -> None:
    # `plait tune --show | head -3` printed a BrokenPipeError traceback once head exited.
    import subprocess
    import sys

    with subprocess.Popen(
        [sys.executable, "-m", "plait", "tune", "--show", "-n", "3"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    ) as proc:
        assert proc.stdout is not None
        assert proc.stderr is not None
        proc.stdout.close()  # the reader is gone before the table is written
        err = proc.stderr.read().decode()
        code = proc.wait(timeout=60)
    assert code == 141, err
    assert "Traceback" not in err, err


def test_a_stdout_that_cannot_take_the_output_is_said_in_a_line() -> None:
    # `plait algorithms > /dev/full` ended in an OSError traceback, and `plait run ... >&-`
    # (no stdout at all) in an AttributeError after every rank had succeeded, exit 1.
    import subprocess
    import sys

    plait = f"{sys.executable} -m plait"
    full = subprocess.run(
        f"{plait} algorithms > /dev/full", shell=True, capture_output=True, text=True, timeout=60
    )
    assert full.returncode == 1, full.stderr
    assert full.stderr == "plait algorithms: cannot write the output: No space left on device\n"
    closed = subprocess.run(
        f"{plait} run -n 1 -- {sys.executable} -c 'print(1)' >&-",
        shell=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert closed.returncode == 0, closed.stderr
    assert "Traceback" not in closed.stderr, closed.stderr


def test_ctrl_c_in_a_subcommand_without_its_own_answer_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # `plait sim` printed a KeyboardInterrupt traceback on Ctrl-C.
    import plait.cli.sim

    def interrupted(_args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(plait.cli.sim, "main", interrupted)
    assert main(["sim", "-n", "4"]) == 130
    assert capsys.readouterr().err == "plait sim: interrupted\n"
