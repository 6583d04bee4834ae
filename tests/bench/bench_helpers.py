"""Run ``plait bench`` as a user would and read its table and JSON back."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
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


#: A row printed on stderr as soon as it is measured (plait.bench.progress.row_line).
ROW_LINE = re.compile(r"busbw +[\d.]+ GB/s +wrong \d+ +\[(\d+)/(\d+)")


class Running:
    """A ``plait bench`` started in the background; a thread reads its stderr line by line.

    ``first_row`` is set when the first row appears there, so a test can act on the
    output itself (no sleeping). ``start_new_session``: its own process group, so that
    a signal can reach the bench and its ranks at once, as Ctrl-C in a terminal does.
    """

    def __init__(self, args: list[str], new_session: bool = False) -> None:
        keep = ("PLAIT_PROFILE", "PLAIT_RULES")
        env = {k: v for k, v in os.environ.items() if not k.startswith("PLAIT_") or k in keep}
        self.proc = subprocess.Popen(
            [*PLAIT, "bench", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=new_session,
        )
        self.err: list[str] = []
        self.first_row = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.err.append(line)
            if ROW_LINE.search(line):
                self.first_row.set()
        self.first_row.set()  # the bench ended: wake a waiting test either way

    def finish(self, timeout: float = 120) -> tuple[int, str, str]:
        """Wait for the end: (exit code, stdout, stderr)."""
        assert self.proc.stdout is not None
        out = self.proc.stdout.read()
        code = self.proc.wait(timeout)
        self._reader.join(timeout)
        self.proc.stdout.close()
        assert self.proc.stderr is not None
        self.proc.stderr.close()
        return code, out, "".join(self.err)
