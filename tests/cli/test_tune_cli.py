"""``plait tune``: a real measurement writes a profile that auto then reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from plait.selection import model


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
