"""``plait tune``: a real measurement writes a profile that auto then reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
    assert code == 1
    assert "--hosts 2 must divide -n 3" in err


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
