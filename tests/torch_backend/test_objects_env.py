"""PLAIT_TORCH_OBJECTS reads as every plait switch does (``plait._checks.env_switch``, as
PLAIT_BIND and PLAIT_RECOVERY): any value that is not one of the on or off spellings is
refused, naming the variable, where every such value used to mean on."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip(
    "torch",
    reason="torch is not installed; the plait backend needs it (pip install 'plait[torch]')",
)

from plait.torch import _objects

REFUSED = "is not a switch; expected 0 or 1 (or false/true, no/yes, off/on)"


@pytest.mark.parametrize(
    ("value", "on"),
    [("", True), (" ", True), ("TRUE", True), ("on", True), ("No", False), ("off", False)],
)
def test_the_spellings_of_every_switch(value: str, on: bool) -> None:
    assert _objects.enabled({_objects.ENV: value}) is on


@pytest.mark.parametrize("value", ["maybe", "2", "disable", "none", "-1"])
def test_other_values_are_refused(value: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"PLAIT_TORCH_OBJECTS={value!r} {REFUSED}")):
        _objects.enabled({_objects.ENV: value})


@pytest.mark.multiprocess
def test_the_import_refuses_it_before_registering_anything() -> None:
    code = (
        "import torch.distributed as dist\n"
        "try:\n"
        "    import plait.torch\n"
        "except ValueError as exc:\n"
        "    print('refused:', exc)\n"
        "print('registered:', 'plait' in dist.Backend.backend_list)\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, _objects.ENV: "maybe"},
        check=False,
    )
    assert res.returncode == 0, res.stderr
    assert f"refused: PLAIT_TORCH_OBJECTS='maybe' {REFUSED}" in res.stdout
    assert "registered: False" in res.stdout
