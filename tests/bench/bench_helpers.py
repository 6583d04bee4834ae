"""Run ``plait bench`` as a user would and read its table and JSON back."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

PLAIT = [sys.executable, "-m", "plait"]
#: Short rows: every run of these tests is a handful of calls per size.
FAST = ["--iters", "3", "--warmup", "1", "--timeout", "30"]


def bench(
    args: str | list[str],
    tmp_path: Path,
    env: dict[str, str] | None = None,
    timeout: float = 90,
    fast: bool = True,
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any] | None]:
    """Run ``plait bench ARGS [FAST] --json FILE``; return the process and the JSON (if written).

    ``args`` is a list or a string split on white space.
    """
    args = args.split() if isinstance(args, str) else list(args)
    if fast:
        args += FAST
    out = tmp_path / "bench.json"
    # No PLAIT_* settings from outside, but keep the suite's hermetic profile and rules
    # (tests/conftest.py), or a tuned ~/.config/plait/profile.json would steer auto.
    keep = ("PLAIT_PROFILE", "PLAIT_RULES")
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("PLAIT_") or k in keep}
    full_env.update(env or {})
    res = subprocess.run(
        [*PLAIT, "bench", *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
    )
    doc = json.loads(out.read_text()) if out.exists() else None
    return res, doc


def tables(stdout: str) -> dict[str, list[list[str]]]:
    """The data rows of each series' table in the text output, by label."""
    found: dict[str, list[list[str]]] = {}
    current: list[list[str]] | None = None
    for line in stdout.splitlines():
        title = re.match(r"^# (\S+(?: \S+)?) \(transport ", line)
        if title:
            current = found.setdefault(title.group(1), [])
        elif line.startswith("# side by side"):
            current = None
        elif not line.startswith("#") and current is not None:
            current.append(line.split())
    return found


def assert_clean_table(stdout: str) -> None:
    """stdout holds comment lines and rows of the table, nothing else."""
    assert stdout.strip()
    for line in stdout.splitlines():
        assert line.startswith("#") or re.match(r"^\s+\d+\s", line), line


def series(doc: dict[str, Any], label: str) -> dict[str, Any]:
    """The series called ``label`` in the JSON document."""
    (found,) = [s for s in doc["series"] if s["label"] == label]
    return found
