"""Where each rank is, as ``plait analyze`` lists it: in which call, since when, or past
its last call and where its main thread is."""

from __future__ import annotations

import os
import sysconfig

from plait.diagnostics._words import clock as _clock
from plait.diagnostics._words import dur as _dur
from plait.diagnostics._words import plural as _plural
from plait.diagnostics._words import ranks as _ranks
from plait.diagnostics.schema import Dump

__all__ = ["ERROR_CHARS", "where"]

#: An error message in the list of where each rank is is cut to this length.
ERROR_CHARS = 160


def where(rank: int, d: Dump | None) -> str:
    """Where rank ``rank`` is, as its dump ``d`` says (None: it left none)."""
    if d is None:
        return f"rank {rank}: no dump"
    last = d.stuck or d.last
    if last is None:
        return f"rank {rank}: no call recorded"
    peers = f" for {_ranks(last.waiting_on)}" if last.waiting_on else ""
    if last.in_flight:
        since = last.start or last.queued
        waited = f" ({_dur(d.time - since)} before its dump)" if since else ""
        verb = "queued behind" if last.state == "queued" else "waiting in"
        queue = [c for c in d.calls if c.seq > last.seq and c.state == "queued"]
        behind = (
            f"; {_plural(len(queue), 'call')} queued behind it (#{queue[0].seq}"
            + (f" to #{queue[-1].seq})" if len(queue) > 1 else ")")
            if queue
            else ""
        )
        return f"rank {rank}: {verb} {last.describe()}{peers} since {_clock(since)}{waited}{behind}"
    if last.state == "failed":
        error = last.error or "?"
        if len(error) > ERROR_CHARS:
            error = error[: ERROR_CHARS - 3] + "..."
        return f"rank {rank}: failed in {last.describe()}{peers} at {_clock(last.end)}: {error}"
    return (
        f"rank {rank}: done with {last.describe()} at {_clock(last.end)}; no call since"
        + _main_thread(d)
    )


def _main_thread(d: Dump) -> str:
    """Where the dump found the rank's main thread, when it was in no recorded call: in a
    point-to-point call (which the recorder does not keep) or outside plait."""
    stack = next((s for name, s in d.threads if name == "MainThread"), ())
    inside = ""  # the plait function the program called, where the thread is in plait
    library = ""  # the innermost frame of Python's own library, if the program's is further
    for path, line, function in stack:  # innermost first
        if f"{os.sep}plait{os.sep}" in path or "/plait/" in path:
            inside = function
            continue
        where = f"{os.path.basename(path)}:{line}"
        if _in_library(path):  # threading.py of a Thread.join: the caller's line says more
            library = library or f"{where} ({function})"
            continue
        said = f", in plait's {inside}" if inside else f", in {library}" if library else ""
        return f"; its main thread is at {where}{said}"
    return f"; its main thread is at {library}" if library else ""


def _in_library(path: str) -> bool:
    """Whether ``path`` is a module of Python's own library (not site-packages)."""
    return path.startswith(_STDLIB) and "site-packages" not in path


_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep
