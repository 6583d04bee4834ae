"""Fixtures of the integration tests.

A collective that fails with a timeout, a lost peer or a mismatch dumps its
flight recorder (docs/debugging.md); every test here dumps under its own
temporary folder, never into the shared default one. The folder's path leaves out the
test's name: errors quote the dump's path, and a check that an error names a collective must
not pass on the strength of a test called after it.
"""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _dump_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLAIT_DUMP_DIR", str(tmp_path_factory.mktemp("dumps")))
