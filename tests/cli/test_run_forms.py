"""``plait run`` as people type it: scripts, modules and commands, torchrun's and mpirun's option
spellings, and mistakes reported once, before any rank starts."""

from __future__ import annotations

import argparse
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from plait.cli import run as run_cli
from plait.cli.__main__ import main as plait_main

PLAIT = [sys.executable, "-m", "plait"]
#: Prints the rank, its size and its arguments: "0/2 ['a']".
SHOW = (
    "import os, sys; "
    "print(f\"{os.environ['PLAIT_RANK']}/{os.environ['PLAIT_SIZE']}\", sys.argv[1:])"
)


def run(args: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*PLAIT, *args], capture_output=True, text=True, timeout=60, **kw)  # type: ignore[call-overload]


def parse(argv: list[str]) -> argparse.Namespace:
    """``plait run``'s options, parsed as the ``plait`` command parses them."""
    parser = argparse.ArgumentParser(prog="plait run", allow_abbrev=False)
    run_cli.add_arguments(parser)
    return parser.parse_args(argv)


def write(path: Path, text: str, executable: bool = False) -> str:
    path.write_text(textwrap.dedent(text))
    if executable:
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def python_on_path(tmp_path: Path) -> dict[str, str]:
    """An environment where ``python`` on PATH is this interpreter (with plait installed)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


# What each rank runs: the rule of `plait run --help`, without starting anything.


def test_a_py_file_is_a_script_run_by_this_python(tmp_path: Path) -> None:
    s = write(tmp_path / "train.py", "print(1)\n", executable=True)  # even when executable
    assert run_cli.rank_command(parse([s, "--n", "3"])) == [sys.executable, "-u", s, "--n", "3"]


def test_a_file_that_is_not_executable_is_a_script(tmp_path: Path) -> None:
    s = write(tmp_path / "train", "print(1)\n")
    assert run_cli.rank_command(parse([s])) == [sys.executable, "-u", s]


def test_a_directory_with_main_is_a_script(tmp_path: Path) -> None:
    (tmp_path / "app").mkdir()
    write(tmp_path / "app" / "__main__.py", "print(1)\n")
    app = str(tmp_path / "app")
    assert run_cli.rank_command(parse([app, "x"])) == [sys.executable, "-u", app, "x"]


def test_an_executable_file_is_a_command(tmp_path: Path) -> None:
    s = write(tmp_path / "train.sh", "#!/bin/sh\necho hi\n", executable=True)
    assert run_cli.rank_command(parse([s, "a.py"])) == [s, "a.py"]


def test_an_executable_in_this_directory_is_a_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "tool", "#!/bin/sh\necho hi\n", executable=True)
    assert run_cli.rank_command(parse(["tool", "a"])) == ["./tool", "a"]  # as mpirun finds it


def test_a_program_on_path_is_a_command() -> None:
    assert run_cli.rank_command(parse(["-n", "4", "sh", "-c", "x"])) == ["sh", "-c", "x"]


def test_everything_after_double_dash_is_the_command_as_given(tmp_path: Path) -> None:
    s = write(tmp_path / "tool.py", "print(1)\n", executable=True)
    ns = parse(["-n", "2", "--", s, "-n", "3", "--", "x.py"])
    assert ns.nproc == 2
    assert run_cli.rank_command(ns) == [s, "-n", "3", "--", "x.py"]


def test_no_python_makes_a_script_a_command(tmp_path: Path) -> None:
    s = write(tmp_path / "tool.py", "#!/bin/sh\necho hi\n", executable=True)
    assert run_cli.rank_command(parse(["--no-python", s, "a"])) == [s, "a"]


def test_every_word_after_the_module_is_the_modules() -> None:
    ns = parse(["-n", "2", "-m", "json.tool", "--epochs", "3", "-n", "5"])
    assert ns.nproc == 2
    expected = [sys.executable, "-u", "-m", "json.tool", "--epochs", "3", "-n", "5"]
    assert run_cli.rank_command(ns) == expected


@pytest.mark.parametrize(
    "argv",
    [
        ["-n", "2", "x.py"],
        ["-np", "2", "x.py"],
        ["--nproc", "2", "x.py"],
        ["--nproc-per-node", "2", "x.py"],
        ["--nproc_per_node=2", "x.py"],
        ["--nproc_per_node", "2", "--standalone", "x.py"],
        ["--standalone", "--nproc-per-node=2", "x.py"],
    ],
)
def test_torchrun_and_mpirun_spellings_of_the_rank_count(argv: list[str]) -> None:
    ns = parse(argv)
    assert ns.nproc == 2
    assert ns.command == ["x.py"]


def test_torchrun_spellings_of_the_host_options() -> None:
    ns = parse(["--node_rank", "1", "--nnodes", "2", "--master_addr", "h", "--master_port", "9"])
    assert (ns.node_rank, ns.nnodes, ns.master_addr, ns.master_port) == (1, 2, "h", 9)


# Mistakes: one message, exit code 2, no rank started.


def fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``plait`` in this process, expecting exit code 2; return its stderr."""
    with pytest.raises(SystemExit) as exc:
        plait_main(argv)
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    return captured.err


def test_unknown_options_get_plait_runs_usage(capsys: pytest.CaptureFixture[str]) -> None:
    err = fails(["run", "-n", "2", "--bogus", "x.py"], capsys)
    assert err.startswith("usage: plait run ")
    assert "plait run: error: unrecognized arguments: --bogus" in err


def test_a_command_that_cannot_run_is_reported_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # It passes the check before any rank starts (it exists and is executable), and its
    # start failed with a traceback.
    monkeypatch.chdir(tmp_path)
    job = tmp_path / "job"
    job.write_text("#!/no/such/interpreter\n")
    job.chmod(0o755)
    err = fails(["run", "-n", "2", "--", "./job"], capsys)
    assert err.startswith("plait run: error: cannot start rank 0 of 2 ranks: ./job: "), err
    assert err.count("\n") == 1, err


def test_a_missing_script_is_reported_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    err = fails(["run", "-n", "4", "missing.py", "a"], capsys)
    assert err == "plait run: error: no such script: missing.py\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["no-such-program-xyz", "a"], "no-such-program-xyz is neither a script"),
        (["--", "no-such-program-xyz"], "command not found: no-such-program-xyz"),
        (["--", "./no-such-file"], "cannot run ./no-such-file: it does not exist"),
        (["python3", "missing.py"], "no such script: missing.py"),
        # the script after python's own options (it was looked for only right after python)
        (["python3", "-u", "missing.py"], "no such script: missing.py"),
        (["python3", "-X", "dev", "-W", "error", "missing.py"], "no such script: missing.py"),
        # a script named as a command ("command not found: job.py")
        (["--", "job.py"], "cannot run job.py as a command: it is not executable"),
        (["--nnodes", "2", "--master-port", "9", "job.py"], "needs the same PLAIT_SECRET"),
        (["app"], "cannot run directory app: it has no __main__.py"),
        (["job.sh"], "job.sh is not executable and starts with '#!/bin/sh'"),
        (["-m"], "-m needs a module name"),
        # one traceback per rank, ModuleNotFoundError, exit code 1
        (["-m", "no_such_module_xyz.sub"], "no module named 'no_such_module_xyz' here"),
        ([], "give a script, a command or -m MODULE"),
        (["--standalone", "--nnodes", "2", "--master-port", "9", "x.py"], "--standalone"),
    ],
)
def test_mistakes_are_reported_once(
    argv: list[str],
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "app").mkdir()
    write(tmp_path / "job.sh", "#!/bin/sh\necho hi\n")  # lost its x bit
    write(tmp_path / "job.py", "print('hi')\n")
    monkeypatch.delenv("PLAIT_SECRET", raising=False)
    err = fails(["run", "-n", "3", *argv], capsys)
    assert err.count("\n") == 1, err
    assert err.startswith("plait run: error: ")
    assert message in err


# The forms end to end.


@pytest.mark.multiprocess
def test_python_command_as_with_mpirun(tmp_path: Path) -> None:
    res = run(
        ["run", "-n", "2", "--tag-output", "python", "-c", SHOW, "a"], env=python_on_path(tmp_path)
    )
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == ["[0]: 0/2 ['a']", "[1]: 1/2 ['a']"]


@pytest.mark.multiprocess
def test_command_after_double_dash_with_torchrun_spellings(tmp_path: Path) -> None:
    launcher = ["--nproc_per_node=2", "--standalone", "--tag-output"]
    command = ["python", "-c", SHOW, "x.py", "--n", "1"]
    res = run(["run", *launcher, "--", *command], env=python_on_path(tmp_path))
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == [
        "[0]: 0/2 ['x.py', '--n', '1']",
        "[1]: 1/2 ['x.py', '--n', '1']",
    ]


@pytest.mark.multiprocess
def test_executable_script_and_mpirun_spelling(tmp_path: Path) -> None:
    s = write(tmp_path / "job.sh", '#!/bin/sh\necho "rank $PLAIT_RANK of $PLAIT_SIZE: $1"\n', True)
    res = run(["run", "-np", "3", "--tag-output", s, "hi"])
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == [f"[{r}]: rank {r} of 3: hi" for r in range(3)]


@pytest.mark.multiprocess
def test_module_gets_every_later_word(tmp_path: Path) -> None:
    write(tmp_path / "mymod.py", SHOW.replace("; ", "\n") + "\n")
    res = run(
        ["run", "-n", "2", "--tag-output", "-m", "mymod", "--epochs", "3"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == [f"[{r}]: {r}/2 ['--epochs', '3']" for r in (0, 1)]


@pytest.mark.multiprocess
def test_missing_script_fails_once_before_any_rank(tmp_path: Path) -> None:
    res = run(["run", "-n", "4", "missing.py"], cwd=tmp_path)
    assert res.returncode == 2
    assert res.stderr == "plait run: error: no such script: missing.py\n"
    assert "can't open file" not in res.stderr


@pytest.mark.parametrize("port", ["70000", "-1"])
def test_a_master_port_out_of_range_is_a_usage_error(port: str, tmp_path: Path) -> None:
    """70000 was taken as 4464 (getaddrinfo takes it modulo 65536), silently on one host and,
    on two, with node 0 serving 4464 while node 1 failed with a traceback."""
    script = tmp_path / "ok.py"
    script.write_text("pass\n")
    res = subprocess.run(
        [sys.executable, "-m", "plait", "run", "-n", "1", "--master-port", port, str(script)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2
    assert f"--master-port must be a port number in 0..65535, not {port}" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize(
    ("options", "said"),
    [
        (["-n", "0"], "-n must be a number of ranks >= 1, not 0"),
        (["-n", "1", "--nnodes", "0"], "--nnodes must be a number of hosts >= 1, not 0"),
        (
            ["-n", "1", "--nnodes", "2", "--node-rank", "5"],
            "--node-rank must be in 0..1 (--nnodes 2), not 5",
        ),
    ],
)
def test_each_bad_count_is_named(options: list[str], said: str, tmp_path: Path) -> None:
    """All three said "need -n >= 1, --nnodes >= 1 and 0 <= --node-rank < --nnodes"."""
    res = run(["run", *options, "ok.py"], cwd=tmp_path)
    assert res.returncode == 2
    assert res.stderr == f"plait run: error: {said}\n"
