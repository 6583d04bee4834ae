"""Fixtures of the diagnostics tests.

Every test here writes its dumps under its own temporary folder
(PLAIT_DUMP_DIR), so a SIGUSR1 or stall test that dumps every recorder of
the process never writes outside it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from dumpkit import FakeClock

from plait.diagnostics import recorder as recorder_module


@pytest.fixture(autouse=True)
def _dump_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLAIT_DUMP_DIR", str(tmp_path / "dumps"))
    monkeypatch.setenv("PLAIT_JOB_ID", "testjob")


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(recorder_module, "_monotonic", fake)
    # The wall clock too: recorders made a few milliseconds apart would otherwise convert
    # the same fake time to different wall times, and a rank would look late.
    monkeypatch.setattr(recorder_module, "_wall_clock", lambda: 1.7e9)
    return fake
