"""The package type-checks under ``mypy --strict`` (configured in pyproject.toml)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_mypy_strict() -> None:
    pytest.importorskip("mypy", reason="mypy is not installed (pip install '.[test]')")
    if importlib.util.find_spec("torch") is None:
        # plait.torch is checked against torch's own annotations
        pytest.skip("torch is not installed (pip install '.[torch]')")
    res = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
