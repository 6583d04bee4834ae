"""The code base stays ruff-clean (lint and format), checked like any other test."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ["src", "tests", "examples"]


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is not installed")
def test_ruff_check() -> None:
    res = subprocess.run(["ruff", "check", *TARGETS], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is not installed")
def test_ruff_format() -> None:
    res = subprocess.run(
        ["ruff", "format", "--check", *TARGETS], cwd=ROOT, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_python_version() -> None:
    assert sys.version_info >= (3, 11)
