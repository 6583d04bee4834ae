"""``plait run``, ``plait bench`` and ``plait tune`` refuse a bad PLAIT_* setting in one line
(exit code 2) before any rank starts, with the message the library's own reading of it gives.

plait run checked some settings and not these; plait bench and plait tune checked none. Each
bad value was a traceback from every rank, and the job failed with code 1.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

PLAIT = [sys.executable, "-m", "plait"]

#: A rank that reads its settings: plait.init and a call.
JOB = "import numpy as np, plait\nwith plait.init() as c:\n    c.allreduce(np.ones(3))\n"

#: (variable, bad value, how the refusal starts).
BAD = [
    ("PLAIT_RULES", "/nonexistent/rules.toml", "rules file /nonexistent/rules.toml (PLAIT_RULES)"),
    ("PLAIT_RECORDER_SIZE", "x", "PLAIT_RECORDER_SIZE must be an integer from 0 to"),
    ("PLAIT_RECORDER_STACK", "-1", "PLAIT_RECORDER_STACK must be an integer from 0 to"),
    ("PLAIT_SHM_WINDOW", "3Q", "PLAIT_SHM_WINDOW='3Q' is not a size in bytes"),
    ("PLAIT_SHM_SPIN", "x", "PLAIT_SHM_SPIN='x' is not a number of microseconds"),
    ("PLAIT_TCP_SPIN", "-1", "PLAIT_TCP_SPIN='-1' must be a number of microseconds >= 0"),
    ("PLAIT_TCP_STREAMS", "x", "PLAIT_TCP_STREAMS='x' is not an integer"),
    ("PLAIT_SOCKET_IFNAME", " ", "PLAIT_SOCKET_IFNAME: interface list ' ' names no interface"),
    ("PLAIT_DEBUG", "1", "PLAIT_DEBUG='1' is not a level; expected info or detail"),
    ("PLAIT_TIMELINE_EVENTS", "0", "PLAIT_TIMELINE_EVENTS must be a positive integer; got '0'"),
]


def _plait(args: list[str], name: str, value: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, name: value}
    return subprocess.run([*PLAIT, *args], capture_output=True, text=True, timeout=90, env=env)


def _refused(res: subprocess.CompletedProcess[str], prog: str, said: str) -> None:
    report = f"rc={res.returncode}\n{res.stdout}\n{res.stderr}"
    assert res.returncode == 2, report
    assert "Traceback" not in res.stderr, report
    errors = [line for line in res.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1, report  # one line, not one per rank
    assert errors[0].startswith(f"{prog}: error: {said}"), report


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("name", "value", "said"), BAD, ids=[b[0] for b in BAD])
def test_plait_run_refuses_a_bad_setting_in_one_line(
    tmp_path: Path, name: str, value: str, said: str
) -> None:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    res = _plait(["run", "-n", "2", str(script)], name, value)
    _refused(res, "plait run", said)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("name", "value", "said"),
    [
        ("PLAIT_TIMEOUT", "abc", "PLAIT_TIMEOUT='abc': timeout must be a number of seconds"),
        BAD[0],
        BAD[3],
    ],
    ids=["PLAIT_TIMEOUT", "PLAIT_RULES", "PLAIT_SHM_WINDOW"],
)
def test_plait_bench_refuses_a_bad_setting_in_one_line(name: str, value: str, said: str) -> None:
    res = _plait(["bench", "-n", "2", "-b", "8", "-e", "8", "--no-progress"], name, value)
    _refused(res, "plait bench", said)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_plait_tune_refuses_a_bad_setting_in_one_line(tmp_path: Path) -> None:
    out = str(tmp_path / "profile.json")
    res = _plait(["tune", "--no-tcp", "--output", out], *BAD[1][:2])
    _refused(res, "plait tune", BAD[1][2])
    assert not os.path.exists(out)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_plait_tune_show_starts_no_rank_and_reads_no_rank_setting() -> None:
    res = _plait(["tune", "--show", "-n", "2"], "PLAIT_TIMEOUT", "abc")
    assert res.returncode == 0, res.stderr


def test_a_setting_an_option_replaces_is_not_read(monkeypatch: pytest.MonkeyPatch) -> None:
    from plait.cli.run import settings_problem

    monkeypatch.setenv("PLAIT_TIMEOUT", "abc")
    monkeypatch.setenv("PLAIT_TRANSPORT", "bogus")
    assert settings_problem({"PLAIT_TIMEOUT", "PLAIT_TRANSPORT"}) is None
    assert (settings_problem({"PLAIT_TIMEOUT"}) or "").startswith("PLAIT_TRANSPORT='bogus'")
