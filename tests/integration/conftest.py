"""Fixtures of the integration tests.

A collective that fails with a timeout, a lost peer or a mismatch dumps its
flight recorder (docs/debugging.md); every test here dumps under its own
temporary folder, never into the shared default one.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _dump_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLAIT_DUMP_DIR", str(tmp_path / "dumps"))
