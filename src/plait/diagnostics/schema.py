"""The flight recorder's dump file: its JSON schema, and reading it back.

A dump is one JSON object per communicator and rank, written by
:meth:`plait.diagnostics.recorder.FlightRecorder.dump`. Version 1::

    {
      "format": "plait-flight-recorder",  always this string
      "version": 1,                       bumped on any incompatible change
      "job": "1a2b3c",                    PLAIT_JOB_ID (or the launcher's job id); "local" if none
      "run": "5e0c2a91b7d4",              drawn by plait.init for every rank of one run, so that
                                          runs of a job id used again are told apart; or null
      "comm": 0,                          communicator id: 0 for the world, else a split's id
      "rank": 2, "size": 4,               rank within that communicator, and its size
      "global_rank": 2,                   the process's rank in the job (PLAIT_RANK, RANK), or null
      "members": [0, 2, 5, 7],            each rank's rank in the world communicator (a split's
                                          or a shrunk one's ranks by the job's numbers), or null
      "pid": 4242, "host": "node1",
      "reason": "CollectiveTimeout: rank 2: allreduce (ring, call #17) timed out ...",
      "time": 1764612345.123456,          wall clock (seconds since the epoch) of the dump
      "capacity": 2000,                   slots in the ring
      "recorded": 2017,                   calls numbered so far: the newest call number + 1
      "calls": [                          the last min(recorded, capacity) calls, oldest first
        {
          "seq": 17,                      the call number (equal on every rank for one call)
          "collective": "allreduce", "algorithm": "ring",
          "count": 2, "dtype": "float32", "nbytes": 8, "op": "SUM", "root": 0,
          "within": "",                   the plait call this one is part of: "split" for
                                          split's allgather, "bcast_object" for its
                                          broadcasts, ...; "" for a call of your own (a
                                          dump without the field: "")
          "state": "running",             queued | running | done | failed
          "queued": null,                 when an async_op=True call was submitted (else null)
          "start": 1764612285.001,        when the rank began the call (wall clock seconds)
          "end": null,                    when it ended (null while in flight)
          "waiting_on": [3],              peers whose messages it still waits for (in flight), or
                                          waited for when it failed; [] once done
          "error": null,                  "ErrorType: message" of a failed call
          "stack": [["/job/train.py", 42, "step"], ...]
                                          the caller's frames, innermost first, from the first
                                          frame outside plait; [] when not captured (by
                                          default a call that ended well keeps none)
          "site": ["/job/train.py", 40, "step"]
                                          where a call of this kind (collective, algorithm,
                                          count, dtype, op, root) was first made on this rank,
                                          or null: what calls are compared by across ranks
        }
      ],
      "threads": [                        every thread's stack when the dump was written
        {"name": "MainThread", "id": 1403, "stack": [["/job/train.py", 42, "step"], ...]}
      ]                                   innermost frame first, at most 64 frames
    }

Readers accept any version up to :data:`VERSION` and ignore fields they do not
know, so a field can be added without a new version.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from plait.diagnostics.places import read_json, replace_with

__all__ = [
    "FORMAT",
    "LAUNCHER_NOTE",
    "STATES",
    "VERSION",
    "CallRecord",
    "Dump",
    "DumpError",
    "LauncherNote",
    "find_dumps",
    "is_launcher_note",
    "launcher_notes",
    "load",
    "load_all",
    "parse",
    "write_launcher_note",
]

#: The ``format`` field of every dump.
FORMAT = "plait-flight-recorder"
#: The schema version written; readers accept this and older ones.
VERSION = 1
#: The ``state`` values of a call.
STATES = ("queued", "running", "done", "failed")


class DumpError(ValueError):
    """A file is not a flight-recorder dump this version of plait can read."""


@dataclass(frozen=True, slots=True)
class CallRecord:
    """One call of a dump (see the module docstring for the fields)."""

    seq: int
    collective: str
    algorithm: str
    count: int
    dtype: str
    nbytes: int
    op: str
    root: int
    state: str
    queued: float | None
    start: float | None
    end: float | None
    waiting_on: tuple[int, ...]
    error: str | None
    stack: tuple[tuple[str, int, str], ...]
    site: tuple[str, int, str] | None = None
    within: str = ""

    @property
    def name(self) -> str:
        """``allgather``, or for a call plait makes within another ``split (its allgather)``."""
        return f"{self.within} (its {self.collective})" if self.within else self.collective

    @property
    def in_flight(self) -> bool:
        """Whether the call had not ended when the dump was written."""
        return self.state in ("queued", "running")

    @property
    def blocked(self) -> bool:
        """Whether the call is in flight or failed: the rank got no further."""
        return self.state != "done"

    @property
    def where(self) -> str:
        """The caller's line, short: ``train.py:42``.

        For a call that kept no stack, where a call of its kind was first made:
        ``first made at train.py:40``; ``?`` when neither is known.
        """
        if self.stack:
            path, line, _ = self.stack[0]
            return f"{os.path.basename(path)}:{line}"
        if self.site is not None:
            path, line, _ = self.site
            return f"first made at {os.path.basename(path)}:{line}"
        return "?"

    @property
    def line(self) -> tuple[str, int] | None:
        """(file, line) to compare calls by: where a call of its kind was first made, else
        the call's own line (a dump without sites); None if neither is known.

        The site, when there is one, for every call alike: a call that ended well has no
        line of its own, and comparing one call's own line with another's site would
        find differences that are not there.
        """
        frame = self.site if self.site is not None else self.stack[0] if self.stack else None
        return None if frame is None else (frame[0], frame[1])

    @property
    def signature(self) -> tuple[str, str, int, str, str, int]:
        """What must be equal on every rank for one call number, with :attr:`within`."""
        return (self.collective, self.algorithm, self.count, self.dtype, self.op, self.root)

    def describe(self) -> str:
        """``allreduce #17 (train.py:42)``; ``split (its allgather) #3 (train.py:9)``."""
        return f"{self.name} #{self.seq} ({self.where})"


@dataclass(frozen=True, slots=True)
class Dump:
    """One rank's dump of one communicator."""

    job: str
    comm: int
    rank: int
    size: int
    global_rank: int | None
    pid: int
    host: str
    reason: str
    time: float
    capacity: int
    recorded: int
    calls: tuple[CallRecord, ...]
    threads: tuple[tuple[str, tuple[tuple[str, int, str], ...]], ...] = ()
    path: str = ""
    run: str | None = None
    members: tuple[int, ...] | None = None

    def job_rank(self, r: int) -> int | None:
        """The world (job) rank of this communicator's rank ``r``, where the dump says."""
        if self.members is not None:  # None past its end: another dump's size was larger
            return self.members[r] if 0 <= r < len(self.members) else None
        return self.global_rank if r == self.rank else None

    def call(self, seq: int) -> CallRecord | None:
        """The record of call number ``seq``, if it is still in this dump's window."""
        for c in self.calls:
            if c.seq == seq:
                return c
        return None

    @property
    def last(self) -> CallRecord | None:
        """The newest call recorded (None for a rank that made no call)."""
        return self.calls[-1] if self.calls else None

    @property
    def stuck(self) -> CallRecord | None:
        """The oldest call not done (in flight or failed): where the rank got no further.
        Not always the newest: asynchronous calls queue behind the one that runs. None
        where every call recorded ended well."""
        return next((c for c in self.calls if c.state != "done"), None)


def parse(obj: Any, path: str = "") -> Dump:
    """A :class:`Dump` from the parsed JSON ``obj``.

    Raises:
        DumpError: ``obj`` is not a dump, or is of a newer version.
    """
    where = path or "dump"
    if not isinstance(obj, Mapping) or obj.get("format") != FORMAT:
        raise DumpError(f"{where}: not a plait flight-recorder dump (no format {FORMAT!r})")
    version = obj.get("version")
    if not isinstance(version, int) or not 1 <= version <= VERSION:
        raise DumpError(f"{where}: dump version {version!r}; this plait reads 1 to {VERSION}")
    try:
        calls = tuple(_call(c) for c in obj["calls"])
        gr = obj.get("global_rank")
        size = _within("size", obj["size"], 1, _MAX_RANKS)
        return Dump(
            job=str(obj["job"]),
            comm=_within("comm", obj["comm"], 0, _MAX_NUMBER),
            rank=_within("rank", obj["rank"], 0, size - 1),
            size=size,
            global_rank=None if gr is None else _within("global_rank", gr, 0, _MAX_RANKS - 1),
            pid=_within("pid", obj["pid"], 0, _MAX_NUMBER),
            host=str(obj["host"]),
            reason=str(obj["reason"]),
            time=_time("time", obj["time"]),
            capacity=_within("capacity", obj["capacity"], 0, _MAX_NUMBER),
            recorded=_within("recorded", obj["recorded"], 0, _MAX_NUMBER),
            calls=calls,
            threads=tuple(
                (str(t["name"]), _stack(t.get("stack", ()))) for t in obj.get("threads", ())
            ),
            path=path,
            run=None if obj.get("run") is None else str(obj["run"]),
            members=_members(obj.get("members"), size),
        )
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise DumpError(f"{where}: malformed dump: {type(exc).__name__}: {exc}") from None


def _members(value: Any, size: int) -> tuple[int, ...] | None:
    """The ``members`` field: one world rank per rank of the communicator, or None."""
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != size:
        raise ValueError(f"members must be a list of {size} world ranks; got {value!r:.80}")
    return tuple(_within("members", v, 0, _MAX_RANKS - 1) for v in value)


#: The most ranks a dump may say its communicator has: a dump is read as data from a file
#: anyone may have edited, and a reader walks every rank, so a corrupt size must not make it
#: walk for ever.
_MAX_RANKS = 1 << 24

# The largest call number, ring size or element count a dump may hold (as _MAX_RANKS).
_MAX_NUMBER = 1 << 62


def _within(name: str, value: Any, lo: int, hi: int) -> int:
    """``value`` as an int in ``lo..hi``: a ValueError naming the field otherwise (a float
    such as 1e308 included, where ``int`` would give a number no reader could walk)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{name} {value!r} is not a whole number")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name} {value!r} is not a whole number")
    number = int(value)
    if number != value and not isinstance(value, str):
        raise ValueError(f"{name} {value!r} is not a whole number")
    if not lo <= number <= hi:
        raise ValueError(f"{name} {number} is outside {lo}..{hi}")
    return number


def _time(name: str, value: Any) -> float:
    """``value`` as a clock reading (seconds since 1970, or 0 for none): a ValueError naming
    the field otherwise (a time a clock cannot give made the report fail far from here)."""
    t = float(value)
    if not math.isfinite(t):
        raise ValueError(f"{name} {value!r} is not a finite time")
    if abs(t) > _LATEST:
        raise ValueError(f"{name} {value!r} is not a time a clock gives (seconds since 1970)")
    return t


#: The latest time a dump may hold: the year 33658.
_LATEST = 1e12


def _opt(name: str, value: Any) -> float | None:
    return None if value is None else _time(name, value)


def _call(c: Mapping[str, Any]) -> CallRecord:
    state = str(c["state"])
    if state not in STATES:
        raise ValueError(f"call #{c.get('seq')}: unknown state {state!r}")
    return CallRecord(
        seq=_within("seq", c["seq"], 0, _MAX_NUMBER),
        collective=str(c["collective"]),
        algorithm=str(c["algorithm"]),
        count=_within("count", c["count"], 0, _MAX_NUMBER),
        dtype=str(c["dtype"]),
        nbytes=_within("nbytes", c.get("nbytes", 0), 0, _MAX_NUMBER),
        op=str(c["op"]),
        root=_within("root", c["root"], -1, _MAX_RANKS),
        state=state,
        queued=_opt("queued", c.get("queued")),
        start=_opt("start", c.get("start")),
        end=_opt("end", c.get("end")),
        waiting_on=tuple(
            _within("waiting_on", p, 0, _MAX_RANKS - 1) for p in c.get("waiting_on", ())
        ),
        error=None if c.get("error") is None else str(c["error"]),
        stack=_stack(c.get("stack", ())),
        site=_site(c.get("site")),
        within=str(c.get("within") or ""),
    )


def _stack(frames: Iterable[Sequence[Any]]) -> tuple[tuple[str, int, str], ...]:
    return tuple((str(f), int(n), str(fn)) for f, n, fn in frames)


def _site(frame: Sequence[Any] | None) -> tuple[str, int, str] | None:
    if frame is None:
        return None
    f, n, fn = frame
    return (str(f), int(n), str(fn))


def load(path: str | os.PathLike[str]) -> Dump:
    """Read and parse one dump file.

    Raises:
        DumpError: the file is not valid JSON or not a dump.
        OSError: it cannot be read.
    """
    p = str(path)
    return parse(read_json(p, "a dump", DumpError, cut="; was the dump cut short?"), p)


def find_dumps(paths: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """The dump files named by ``paths``: files as given, folders searched for ``*.json``
    (but a launcher's note, :data:`LAUNCHER_NOTE`)."""
    found: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found.extend(
                sorted(q for q in p.rglob("*.json") if q.is_file() and not is_launcher_note(q))
            )
        elif not is_launcher_note(p):
            found.append(p)
    return found


#: The file ``plait run`` writes beside a failed job's dumps: how its failed ranks ended
#: (``{"format": "plait-launcher-note", "version": 1, "time": ..., "ended": {"2": "was
#: killed by SIGKILL"}}``), before it has the others dump and stops them. A job on several
#: hosts writes one per launcher: ``launcher.node<k>.json``.
LAUNCHER_NOTE = "launcher.json"
_NOTE_FORMAT = "plait-launcher-note"


def is_launcher_note(path: Path) -> bool:
    """Whether ``path`` names a launcher's note (:data:`LAUNCHER_NOTE`), not a dump."""
    return path.name.startswith("launcher") and path.suffix == ".json"


class LauncherNote(NamedTuple):
    """What the launchers' notes in one folder say: when the latest was written (wall
    clock), and how each failed rank (by its rank in the job) ended."""

    time: float
    ended: dict[int, str]


def launcher_notes(paths: Iterable[str | os.PathLike[str]]) -> dict[Path, LauncherNote]:
    """The launchers' notes under ``paths``, by folder (those of one folder merged). A note
    that cannot be read is left out."""
    notes: dict[Path, LauncherNote] = {}
    for p in map(Path, paths):
        files = p.rglob("launcher*.json") if p.is_dir() else [p] if is_launcher_note(p) else []
        for f in files:
            try:
                obj = json.loads(f.read_text(encoding="utf-8"))
                if obj.get("format") != _NOTE_FORMAT:
                    continue
                ended = {int(r): str(how) for r, how in dict(obj["ended"]).items()}
                when = float(obj["time"])
            except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError):
                continue
            had = notes.get(f.parent.resolve())
            if had is not None:
                ended, when = {**had.ended, **ended}, max(when, had.time)
            notes[f.parent.resolve()] = LauncherNote(when, ended)
    return notes


def write_launcher_note(folder: Path, ended: Mapping[int, str], name: str = LAUNCHER_NOTE) -> None:
    """Write a launcher's note (``name``) in ``folder`` (made if need be). Raises OSError."""
    doc = {
        "format": _NOTE_FORMAT,
        "version": 1,
        "time": time.time(),
        "ended": {str(r): how for r, how in ended.items()},
    }
    replace_with(folder / name, json.dumps(doc))


def load_all(paths: Sequence[str | os.PathLike[str]]) -> tuple[list[Dump], list[str]]:
    """Every dump under ``paths`` (files or folders), and a line per file that was not one."""
    dumps: list[Dump] = []
    skipped: list[str] = []
    for p in find_dumps(paths):
        try:
            dumps.append(load(p))
        except (DumpError, OSError) as exc:
            skipped.append(str(exc))
    return dumps, skipped
