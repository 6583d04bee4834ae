"""``plait tune``: a real measurement writes a profile that auto then reads."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from plait.selection import model


@pytest.mark.multiprocess
def test_tune_measures_and_show_prints_the_table(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    env_cmd = [sys.executable, "-m", "plait", "tune"]
    res = subprocess.run(
        [*env_cmd, "--no-tcp", "--output", str(path)], capture_output=True, text=True, timeout=110
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"profile written to {path}" in res.stdout
    prof = model.Profile.from_json(json.loads(path.read_text()))
    assert prof.intra.alpha > 0
    assert prof.intra.beta > 0
    assert prof.gamma > 0
    assert prof.inter is None
    show = subprocess.run(
        [*env_cmd, "--show", "-n", "8"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PLAIT_PROFILE": str(path)},
    )
    assert show.returncode == 0, show.stderr
    assert f"profile: {path}" in show.stdout
    rows = {line.split()[0] for line in show.stdout.splitlines() if not line.startswith("#")}
    assert {"allreduce", "reduce", "broadcast", "allgather"} <= rows


@pytest.mark.parametrize(("sizes", "times"), [([8, 16, 32], [1.0, 1.0, 1.0])])
def test_fit_never_gives_a_negative_slope(sizes: list[int], times: list[float]) -> None:
    from plait.cli.tune import fit

    assert fit(sizes, times) == (1.0, 0.0)


def _show(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Run ``plait tune --show ARGS`` in this process: (exit code, stdout, stderr)."""
    import argparse

    from plait.cli.tune import add_arguments, main

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    code = main(parser.parse_args(["--show", *args]))
    out, err = capsys.readouterr()
    return code, out, err


def _cells(out: str) -> dict[str, list[str]]:
    """The table's rows: collective -> cells (split on two or more spaces)."""
    import re

    rows = {}
    for line in out.splitlines():
        if not line.startswith("#") and line.strip():
            name, *cells = re.split(r"\s{2,}", line.strip())
            rows[name] = cells
    return rows


def test_show_prints_every_setting_and_who_decided(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    rules = tmp_path / "rules.toml"
    rules.write_text('[[broadcast]]\nalgorithm = "binomial"\nsegment = "256K"\n')
    profile = tmp_path / "profile.json"
    model.save(
        model.Profile(model.LinkCost(20e-6, 1 / 3e9), model.LinkCost(50e-6, 1e-9), 1e-10, 1e-10),
        profile,
    )
    monkeypatch.setenv("PLAIT_RULES", str(rules))
    monkeypatch.setenv("PLAIT_PROFILE", str(profile))
    monkeypatch.setenv("PLAIT_ALGO", "allreduce:ring:8K-@64K")
    code, out, _ = _show(["-n", "4", "--hosts", "2"], capsys)
    assert code == 0
    assert "4 ranks on 2 hosts of 2" in out
    assert "#   allreduce:ring:8K-@64K" in out
    assert f"# rules file: {rules} (1 entry)" in out
    assert "#   [[broadcast]] entry 1: algorithm=binomial segment=256K" in out
    assert f"# profile: {profile}" in out
    rows = _cells(out)
    assert rows["allreduce"][:5] == ["recursive_doubling [S]"] * 4 + ["ring@64K [A]"]
    assert set(rows["broadcast"]) == {"binomial@256K [F]"}
    assert rows["reduce"][0] == "binomial [S]"


def test_show_refuses_a_bad_rules_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    rules = tmp_path / "rules.toml"
    rules.write_text('[[broadcast]]\nalgorithm = "binomial"\nhosts = "many"\n')
    monkeypatch.setenv("PLAIT_RULES", str(rules))
    code, _, err = _show([], capsys)
    assert code == 1
    assert f"rules file {rules}: [[broadcast]] entry 1: hosts = 'many'" in err
    code, _, err = _show(["-n", "3", "--hosts", "2"], capsys)
    assert code == 2
    assert "--hosts 2 must divide -n 3" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--show", "-n", "0"], "-n must be at least 1, not 0"),
        (["--show", "-n", "-3"], "-n must be at least 1, not -3"),
        (["--show", "--hosts", "0"], "--hosts must be at least 1, not 0"),
        (["--timeout", "0"], "--timeout must be a number of seconds > 0, not 0.0"),
        (["--timeout", "-3"], "--timeout must be a number of seconds > 0, not -3.0"),
        (["--timeout", "nan"], "--timeout must be a number of seconds > 0, not nan"),
        # They measured for a minute, ignoring the option, and wrote the profile.
        (["-n", "3"], "-n is for --show; the measurement always runs 2 ranks on this host"),
        (["--hosts", "2", "--transport", "tcp"], "--hosts, --transport are for --show"),
        # It made the folder, after measuring for a minute.
        (
            ["--output", "/nonexistent-plait-folder/p.json"],
            "--output /nonexistent-plait-folder/p.json: /nonexistent-plait-folder does not exist",
        ),
        (["--output", ""], "--output '' is empty; expected a file name"),  # said: "--output ."
    ],
)
def test_bad_options_are_usage_errors(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # -n 0 said "--hosts 1 must divide -n 0", and --timeout 0 printed subprocess's exception.
    from plait.cli.__main__ import main

    assert main(["tune", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: plait tune")
    assert f"plait tune: error: {message}" in err


def test_show_gives_the_one_sided_choices_where_the_ranks_share_a_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # It showed the message-passing choices only, while a job over shared memory on one host
    # (plait run's default) runs the one-sided ones.
    monkeypatch.delenv("PLAIT_ALGO", raising=False)
    (tmp_path / "empty.toml").write_text("")
    monkeypatch.setenv("PLAIT_RULES", str(tmp_path / "empty.toml"))
    monkeypatch.setenv("PLAIT_PROFILE", str(tmp_path / "none.json"))
    code, out, err = _show(["-n", "3"], capsys)
    assert code == 0, err
    assert code == 0
    assert "# transport: shm" in out
    rows = _cells(out)
    assert rows["allreduce"][0] == "arena_oneshot"
    assert set(rows["broadcast"]) == {"arena"}
    code, out, _ = _show(["-n", "3", "--transport", "tcp"], capsys)
    assert code == 0
    assert "# transport: tcp" in out
    rows = _cells(out)
    assert not [cell for cells in rows.values() for cell in cells if "arena" in cell]


def test_fit_keeps_a_positive_slope_when_one_large_size_was_slowed() -> None:
    # The profile of a busy machine: 4 MiB slowed to 2.4 ms, 16 MiB at 1.8 ms. The slope of
    # the two largest alone was negative, so β came out 0 (and auto's model lost its bytes).
    from plait.cli.tune import fit

    sizes = [8, 64, 512, 4 << 10, 32 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]
    times = [5e-6 + n * 1e-10 for n in sizes]
    times[-2] = 2.4e-3
    alpha, beta = fit(sizes, times)
    assert alpha == times[0]
    assert 0 < beta < 2.4e-3 / (4 << 20)


def _run_of(tmp: Path) -> dict[int, list[str]]:
    """The processes of a measurement whose folder is under ``tmp``: its launcher (``plait
    run ... -m plait.cli.tune_rank``) and its ranks, by pid, with their command lines."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            words = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:  # it exited meanwhile
            continue
        if "plait.cli.tune_rank" in words and any(str(tmp) in w for w in words):
            found[int(entry.name)] = words
    return found


def _ranks_of(tmp: Path) -> list[int]:
    """The pids of the measurement's ranks (not its launcher)."""
    return [pid for pid, words in _run_of(tmp).items() if "run" not in words]


def _start_tune(tmp_path: Path, timeout: float) -> tuple[subprocess.Popen[str], Path]:
    """``plait tune`` whose ranks hang before they meet; its temporary folders under a
    folder of this test (returned), so that its ranks can be told from any other run's."""
    site = tmp_path / "site"
    site.mkdir()
    # A rank (it alone has PLAIT_LOCAL_RANK) sleeps before plait.init: an orphan would live on.
    (site / "sitecustomize.py").write_text(
        "import os, time\nif 'PLAIT_LOCAL_RANK' in os.environ:\n    time.sleep(60)\n"
    )
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLAIT_")}
    env.update(PYTHONPATH=os.pathsep.join([str(site), env.get("PYTHONPATH", "")]), TMPDIR=str(tmp))
    cmd = [sys.executable, "-m", "plait", "tune", "--no-tcp", "--timeout", str(timeout)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, tmp


def _end(proc: subprocess.Popen[str], tmp: Path) -> list[int]:
    """Kill what is left of a run (by pid); the launcher and ranks that were still alive."""
    if proc.poll() is None:
        proc.kill()
    proc.communicate()
    left = list(_run_of(tmp))
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return left


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_timeout_stops_the_ranks_of_the_measurement(tmp_path: Path) -> None:
    # The launcher was killed with SIGKILL at the timeout, which left its ranks running.
    proc, tmp = _start_tune(tmp_path, 4)
    try:
        _, err = proc.communicate(timeout=40)
        assert proc.returncode == 1, err
        assert "measuring over shm took more than --timeout 4 s; stopped" in err
        assert _run_of(tmp) == {}
        assert list(tmp.iterdir()) == []  # its temporary folder is gone
    finally:
        assert _end(proc, tmp) == []


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_sigterm_stops_the_ranks_of_the_measurement(tmp_path: Path) -> None:
    proc, tmp = _start_tune(tmp_path, 40)
    try:
        deadline = time.monotonic() + 20
        while len(_ranks_of(tmp)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(_ranks_of(tmp)) == 2, "the ranks did not start"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 128 + signal.SIGTERM, err
        assert "plait tune: interrupted (SIGTERM); the measurement was stopped" in err
        assert _run_of(tmp) == {}
        assert list(tmp.iterdir()) == []
    finally:
        assert _end(proc, tmp) == []


def test_show_keeps_long_cells_apart_and_under_their_sizes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A cell wider than the fixed 24 columns ran into the next one, and the cells no longer
    # stood under their sizes.
    (tmp_path / "empty.toml").write_text("")
    monkeypatch.setenv("PLAIT_RULES", str(tmp_path / "empty.toml"))
    monkeypatch.setenv("PLAIT_PROFILE", str(tmp_path / "none.json"))
    algo = "allreduce:double_binary_tree:0-4K@256K,recursive_doubling:4K-"
    monkeypatch.setenv("PLAIT_ALGO", algo)
    code, out, err = _show(["-n", "4", "--transport", "tcp"], capsys)
    assert code == 0, err
    assert _cells(out)["allreduce"][:4] == ["double_binary_tree@256K [A]"] * 3 + [
        "recursive_doubling [A]"
    ]
    lines = out.splitlines()
    header = next(ln for ln in lines if ln.startswith("# collective"))
    row = next(ln for ln in lines if ln.startswith("  allreduce"))
    ends = [m.end() for m in re.finditer(r"\S+(?: \S+)*", header)][1:]  # each size's last column
    assert ends == [m.end() for m in re.finditer(r"\S+(?: \S+)*", row)][1:]
