"""A rank whose launcher (PLAIT_LAUNCHER_PID) is gone by the time it calls ``plait.init`` ends
with SIGTERM, as the launcher's end would have ended it, and says why on stderr first: it
ended without a word (exit code 143 and nothing else), where the variable was only a stale
one left in the environment of a process no launcher started."""

from __future__ import annotations

import signal
import sys

import pytest
from launch_helpers import clean_env, run_job

pytestmark = pytest.mark.timeout(60)

#: A single rank's plait.init, as ``python one.py`` runs it.
ONE_RANK = "import plait\nplait.init().close()\nprint('init returned')\n"


def _no_such_pid() -> int:
    """A pid no process can have: one past the kernel's highest."""
    with open("/proc/sys/kernel/pid_max") as f:
        return int(f.read()) + 1


def test_a_gone_launcher_is_said_before_the_rank_ends() -> None:
    pid = _no_such_pid()
    env = clean_env(PLAIT_LAUNCHER_PID=str(pid))
    res = run_job([sys.executable, "-c", ONE_RANK], env, timeout=40)
    report = res.describe()
    assert res.returncode == -signal.SIGTERM, report
    assert "init returned" not in res.stdout, report
    assert res.stderr.splitlines() == [
        f"plait: the launcher that PLAIT_LAUNCHER_PID names (pid {pid}) is gone, so this "
        "process ends (SIGTERM), as its ranks do; unset PLAIT_LAUNCHER_PID if plait run "
        "did not start it"
    ], report
