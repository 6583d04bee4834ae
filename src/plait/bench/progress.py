"""The progress bar ``plait bench`` draws on stderr while a system's sweep runs.

Rank 0 of a worker appends a line ``done total nbytes`` to a file after each
row; a thread of the bench process reads the last line every tenth of a
second and redraws one line of stderr. The bar is only drawn on a terminal,
so stdout stays a clean table and logs stay free of carriage returns.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from types import TracebackType
from typing import TextIO

from plait.bench.sweep import format_size

__all__ = ["ProgressBar", "render"]

_WIDTH = 30


def render(label: str, done: int, total: int, nbytes: int | None, seconds: float) -> str:
    """One line of the bar: ``label [#####.....] done/total  size  seconds``."""
    filled = _WIDTH * done // total if total else _WIDTH
    bar = "#" * filled + "." * (_WIDTH - filled)
    where = f"  {format_size(nbytes)}" if nbytes is not None else ""
    return f"{label:<14} [{bar}] {done}/{total}{where}  {seconds:.1f} s"


def _last_line(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 256))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    return lines[-1] if lines else None


class ProgressBar:
    """Draw ``path``'s progress on ``stream`` while the ``with`` block runs (terminals only)."""

    def __init__(
        self,
        label: str,
        path: str,
        total: int,
        stream: TextIO | None = None,
        *,
        enabled: bool | None = None,
    ) -> None:
        self.label = label
        self.path = path
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start = time.monotonic()

    def _draw(self) -> None:
        done, nbytes = 0, None
        line = _last_line(self.path)
        if line:
            parts = line.split()
            if len(parts) == 3:
                done, nbytes = int(parts[0]), int(parts[2])
        text = render(self.label, done, self.total, nbytes, time.monotonic() - self._start)
        self.stream.write("\r\x1b[K" + text)
        self.stream.flush()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self._draw()

    def __enter__(self) -> ProgressBar:
        self._start = time.monotonic()
        if self.enabled:
            self._thread = threading.Thread(
                target=self._run, name="plait-bench-progress", daemon=True
            )
            self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self.stream.write("\r\x1b[K")
            self.stream.flush()

    @property
    def seconds(self) -> float:
        """Seconds since the block began."""
        return time.monotonic() - self._start
