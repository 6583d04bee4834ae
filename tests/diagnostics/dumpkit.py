"""Helpers for the diagnostics tests: a fake clock, and dumps built by hand."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: A wall-clock time for hand-made dumps: 2026-12-01 12:00:00 UTC.
T0 = 1_796_126_400.0


class FakeClock:
    """Stands in for ``time.monotonic`` in the recorder: moves only when told."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def call(
    seq: int,
    collective: str = "allreduce",
    *,
    start: float | None = None,
    end: float | None = None,
    state: str = "done",
    line: int = 42,
    file: str = "/job/train.py",
    count: int = 1024,
    dtype: str = "float32",
    op: str = "SUM",
    root: int = 0,
    algorithm: str = "ring",
    waiting_on: tuple[int, ...] = (),
    error: str | None = None,
) -> dict[str, Any]:
    """One call of a hand-made dump; by default call ``seq`` ran from T0+seq to T0+seq+0.01."""
    start = T0 + seq if start is None else start
    if end is None and state == "done":
        end = start + 0.01
    return {
        "seq": seq,
        "collective": collective,
        "algorithm": algorithm,
        "count": count,
        "dtype": dtype,
        "nbytes": count * 4,
        "op": op,
        "root": root,
        "state": state,
        "queued": None,
        "start": start,
        "end": end,
        "waiting_on": list(waiting_on),
        "error": error,
        "stack": [[file, line, "train_step"], [file, 90, "main"]],
    }


def dump(
    rank: int,
    size: int,
    calls: list[dict[str, Any]],
    *,
    job: str = "job1",
    comm: int = 0,
    host: str = "node1",
    reason: str = "signal SIGUSR1",
    time: float | None = None,
) -> dict[str, Any]:
    """A hand-made dump of ``calls``, in the schema the recorder writes."""
    return {
        "format": "plait-flight-recorder",
        "version": 1,
        "job": job,
        "comm": comm,
        "rank": rank,
        "size": size,
        "global_rank": rank,
        "pid": 1000 + rank,
        "host": host,
        "reason": reason,
        "time": T0 + 100 if time is None else time,
        "capacity": 2000,
        "recorded": len(calls),
        "calls": calls,
        "threads": [],
    }


def write(folder: Path, dumps: list[dict[str, Any]]) -> list[Path]:
    """Write hand-made dumps as ``rank<r>.json`` files in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for d in dumps:
        p = folder / f"comm{d['comm']:x}.rank{d['rank']}.json"
        p.write_text(json.dumps(d))
        paths.append(p)
    return paths
