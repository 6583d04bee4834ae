"""``PLAIT_TIMELINE=FILE``: a Chrome / Perfetto trace of a real run, per rank.

Each rank writes its own file: ``FILE`` with ``.rank<r>`` before its suffix
(``trace.json`` gives ``trace.rank0.json``, ``trace.rank1.json``, …), or
``FILE`` with ``{rank}`` replaced if it has one. One file per rank needs no
coordination between ranks and survives a rank that dies; to see every rank
on one time line, merge them (the merge also draws an arrow from each send to
its receive)::

    python -m plait.diagnostics.timeline merged.json trace.rank*.json

The first argument is the output. The merge refuses, writing nothing, an
output that is also one of its inputs, or an existing file that is a rank's
own timeline (as PLAIT_TIMELINE and :meth:`Timeline.write` write them, named
``plait timeline, rank N`` in their ``otherData``). So the output forgotten,
``python -m plait.diagnostics.timeline trace.rank*.json`` does not write the
other ranks' merge over rank 0's file. The rule reads the file, not its name
(with ``{rank}``, a rank's file may have any name); a merged trace, or any
other file, is replaced. An input that is missing, unreadable or not a Chrome
trace is named on stderr with what was expected. The exit status is 0 when the
merged trace was written, 2 when nothing was (an output refused, an input not
read) and 1 when it could not be written.

Open a trace in https://ui.perfetto.dev or ``chrome://tracing``. The events
follow ``plait sim --trace`` (:mod:`plait.diagnostics._trace_format`): a
process per rank (``rank N``), local work on thread ``compute``, sends and
receives on threads ``net 0``, ``net 1``, …, each step a slice with its step
index, bytes, tag and peer. A real run adds the thread ``calls``: a slice per
collective (``allreduce #17``, with its algorithm, count, dtype, op and
root), and inside it a ``wait`` slice for each time the executor blocked,
naming the peers it waited for. Times are wall-clock microseconds, so the
files of different ranks line up (see Note [recorder clocks] in
:mod:`plait.diagnostics.recorder`).

A rank keeps its events in memory (at most ``PLAIT_TIMELINE_EVENTS``, default
1,000,000, then it counts what it drops) and writes its file when the
process exits, when a flight-recorder dump is written, and on
:meth:`Timeline.write`. Recording steps costs the executor two clock reads
per step, so the timeline is off unless PLAIT_TIMELINE is set.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from plait.diagnostics._trace_format import (
    COMPUTE_TID,
    document,
    flow,
    meta,
    net_tid,
    slice_event,
    step_label,
)
from plait.diagnostics.places import job_id, read_json, replace_with
from plait.diagnostics.recorder import FlightRecorder, Slot

__all__ = ["CALLS_TID", "DEFAULT_EVENTS", "Timeline", "merge", "rank_path"]

#: The thread id of the ``calls`` track (shown first).
CALLS_TID = 999
#: Events a rank keeps unless PLAIT_TIMELINE_EVENTS says otherwise.
DEFAULT_EVENTS = 1_000_000
#: Step kinds that go on the net lanes; the others go on ``compute``.
_NET_KINDS = frozenset({"send", "recv"})
#: How a rank's own timeline names itself (``otherData``), followed by its rank.
_RANK_NAME = "plait timeline, rank "
#: The merge command, as its usage and its messages name it.
_PROG = "python -m plait.diagnostics.timeline"
#: What the merge expects of each input, for its messages.
_EXPECTED = "expected a rank's timeline as PLAIT_TIMELINE writes it (a Chrome trace)"

_by_path: dict[tuple[str, int], Timeline] = {}
_by_path_lock = threading.Lock()


def events_limit() -> int:
    """PLAIT_TIMELINE_EVENTS: the events a timeline keeps (:data:`DEFAULT_EVENTS` if unset).

    Raises:
        ValueError: it is not a positive integer.
    """
    text = os.environ.get("PLAIT_TIMELINE_EVENTS", "").strip()
    if not text:
        return DEFAULT_EVENTS
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise ValueError(f"PLAIT_TIMELINE_EVENTS must be a positive integer; got {text!r}")
    return int(text)


def rank_path(template: str | os.PathLike[str], rank: int) -> Path:
    """Rank ``rank``'s file: ``{rank}`` replaced, else ``.rank<r>`` before the suffix."""
    text = str(template)
    if "{rank}" in text:
        return Path(text.replace("{rank}", str(rank)))
    p = Path(text)
    return p.with_name(f"{p.stem}.rank{rank}{p.suffix or '.json'}")


class Timeline:
    """One rank's trace events, written as a Chrome trace.

    The flight recorder reports each finished call (:meth:`call`, through its
    ``timeline``); the executor reports steps (:meth:`step`) and waits
    (:meth:`wait`). Times are ``time.monotonic()`` seconds. Methods may be
    called from several threads (appending to a list is atomic).

    Args:
        path: the file to write (already the rank's own: see :func:`rank_path`).
        rank: the rank, the trace's process id.
        limit: events kept at most; later ones are counted and dropped.
    """

    def __init__(self, path: str | os.PathLike[str], rank: int, *, limit: int = DEFAULT_EVENTS):
        self.path = Path(path)
        self.rank = rank
        self.limit = limit
        self.dropped = 0
        # (kind, start, end, payload): tuples, formatted only when written
        self._records: list[tuple[str, float, float, Any]] = []
        self._mono0 = time.monotonic()
        self._wall0 = time.time()
        self._lock = threading.Lock()  # one writer at a time

    @classmethod
    def from_env(cls, rank: int) -> Timeline | None:
        """The timeline of rank ``rank`` of this process if PLAIT_TIMELINE is set, else None.

        One per (file, rank) in a process, written at exit; sub-communicators
        of a rank share their parent's.

        Raises:
            ValueError: PLAIT_TIMELINE_EVENTS is not a positive integer.
        """
        template = os.environ.get("PLAIT_TIMELINE", "").strip()
        if not template:
            return None
        limit = events_limit()
        key = (template, rank)
        with _by_path_lock:
            tl = _by_path.get(key)
            if tl is None:
                tl = _by_path[key] = cls(rank_path(template, rank), rank, limit=limit)
                atexit.register(tl._write_at_exit)
        return tl

    # -- recording ---------------------------------------------------------------------
    def _add(self, record: tuple[str, float, float, Any]) -> None:
        if len(self._records) < self.limit:
            self._records.append(record)
        else:
            self.dropped += 1

    def call(self, slot: Slot, recorder: FlightRecorder) -> None:
        """A call ended (the flight recorder's ``end`` calls this)."""
        # The shape is kept, not its names: they are formatted when the trace is written.
        payload = (recorder.comm, slot.seq, slot.shape, slot.error)
        self._add(("call", slot.start or slot.queued, slot.end, payload))

    def step(
        self,
        kind: Any,
        peer: int,
        nbytes: int,
        tag: int,
        index: int,
        start: float,
        end: float,
        comm: int = 0,
    ) -> None:
        """A step ran from ``start`` to ``end``.

        ``kind`` is the step kind's lower-case name (``send``, ``recv``,
        ``recv_reduce``, ``copy``, ``reduce``), or an enum member whose name
        is that in upper case (named only when the trace is written); a send
        or receive spans from being handed to the transport to being seen done. ``peer``
        is a job rank (as the trace's processes are), ``comm`` the communicator's id.
        """
        self._add(("step", start, end, (kind, peer, nbytes, tag, index, comm)))

    def wait(self, start: float, end: float, peers: Sequence[int]) -> None:
        """The executor blocked from ``start`` to ``end`` waiting for ``peers`` (job ranks)."""
        self._add(("wait", start, end, tuple(peers)))

    # -- writing ---------------------------------------------------------------------
    def _wall(self, t: float) -> float:
        """Monotonic seconds as wall-clock seconds (the trace format scales them)."""
        return self._wall0 + (t - self._mono0)

    def events(self) -> list[dict[str, Any]]:
        """The trace events recorded so far, in the format of ``plait sim --trace``."""
        r = self.rank
        events = [
            meta("process_name", r, 0, f"rank {r}"),
            meta("process_sort_index", r, 0, r, key="sort_index"),
            meta("thread_name", r, CALLS_TID, "calls"),
            meta("thread_sort_index", r, CALLS_TID, -1, key="sort_index"),
            meta("thread_name", r, COMPUTE_TID, "compute"),
        ]
        records = sorted(self._records, key=lambda rec: (rec[1], rec[2]))
        lanes: list[float] = []  # end of the last slice on each net lane
        for what, start, end, payload in records:
            t0, t1 = self._wall(start), self._wall(max(end, start))
            if what == "call":
                comm, seq, shape, error = payload
                c = shape.collective
                name = f"{c} #{seq}" if not comm else f"{c} #{seq} (comm {comm:x})"
                args = {
                    "algorithm": shape.algorithm,
                    "count": shape.count,
                    "dtype": shape.dtype_name,
                    "op": shape.op_name,
                    "root": shape.root,
                    "seq": seq,
                }
                if error is not None:
                    args["error"] = error
                events.append(slice_event(name, "call", r, CALLS_TID, t0, t1, args))
            elif what == "wait":
                peers = list(payload)
                label = "wait " + ",".join(f"r{p}" for p in peers) if peers else "wait"
                events.append(slice_event(label, "wait", r, CALLS_TID, t0, t1, {"peers": peers}))
            else:
                kind, peer, nbytes, tag, index, comm = payload
                if not isinstance(kind, str):
                    kind = kind.name.lower()
                args = {"step": index, "bytes": nbytes, "tag": tag, "peer": peer}
                if comm:
                    args["comm"] = comm
                if kind in _NET_KINDS:
                    lane = next((i for i, e in enumerate(lanes) if e <= t0), len(lanes))
                    if lane == len(lanes):
                        lanes.append(t1)
                        events.append(meta("thread_name", r, net_tid(lane), f"net {lane}"))
                    else:
                        lanes[lane] = t1
                    tid = net_tid(lane)
                else:
                    tid = COMPUTE_TID
                events.append(slice_event(step_label(kind, peer), kind, r, tid, t0, t1, args))
        return events

    def write(
        self, path: str | os.PathLike[str] | None = None, *, wait: bool = True
    ) -> Path | None:
        """Write the trace (to ``path``, default :attr:`path`); returns where.

        ``wait=False`` (a signal handler's dump): return None at once if a write is under
        way, on another thread or on the very thread the handler interrupted, which would
        wait for itself for ever; that write writes what was recorded.

        Raises:
            OSError: the file cannot be written.
        """
        target = Path(path) if path is not None else self.path
        if not self._lock.acquire(blocking=wait):
            return None
        try:
            doc = document(self.events(), name=f"{_RANK_NAME}{self.rank}")
            doc["otherData"]["dropped_events"] = self.dropped
            doc["otherData"]["job"] = job_id()  # the merge refuses timelines of several jobs
            replace_with(target, json.dumps(doc))
        finally:
            self._lock.release()
        return target

    def _write_at_exit(self) -> None:
        try:
            self.write()
        except OSError as exc:
            print(f"plait: could not write the timeline {self.path}: {exc}", file=sys.stderr)


def merge(paths: Sequence[str | os.PathLike[str]], out: str | os.PathLike[str]) -> Path:
    """Merge per-rank timelines into one trace, with an arrow from each send to its receive.

    A send of rank ``a`` to ``b`` with tag ``t`` is joined to the receive of
    ``b`` from ``a`` with tag ``t`` of the same order among such messages
    (messages between two ranks with one tag arrive in order). A one-sided
    call's post of rank ``a`` is joined to every get or wait on ``a`` of the
    same counter value (the tag): the ranks that read what it published. Both
    within one communicator (a step's ``comm``, 0 for the world's): a group
    numbers its calls, and so its tags and counters, on its own.

    Raises:
        OSError: a file cannot be read or written.
        ValueError: a file is not a trace; ``out`` is one of ``paths`` or an existing
            rank's own timeline (see the module docstring), which the merge would lose.
    """
    return _write(_merged(paths, out), out)


def _load(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The Chrome trace in file ``path``.

    Raises:
        OSError: it cannot be read (the message names it and why, in one line).
        ValueError: it is not a Chrome trace (likewise).
    """
    doc = read_json(str(path), "a trace", ValueError, tail=f"; {_EXPECTED}")
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise ValueError(f"{path}: not a Chrome trace (no traceEvents list); {_EXPECTED}")
    return doc


def _rank_of(path: Path) -> str | None:
    """The rank whose own timeline file ``path`` is (as its ``otherData`` says), else None:
    not such a timeline (a merged trace, another file), or no file at all."""
    try:
        doc = _load(path)
    except (OSError, ValueError):
        return None
    return _rank_in(doc)


def _said(doc: dict[str, Any], key: str) -> str | None:
    """The text a trace's ``otherData`` holds under ``key``, else None."""
    other = doc.get("otherData")
    value = other.get(key) if isinstance(other, dict) else None
    return value if isinstance(value, str) else None


def _rank_in(doc: dict[str, Any]) -> str | None:
    """The rank whose own timeline ``doc`` is (its ``otherData`` name), else None."""
    name = _said(doc, "name")
    return name.removeprefix(_RANK_NAME) if name and name.startswith(_RANK_NAME) else None


def _check_output(paths: Sequence[str | os.PathLike[str]], out: Path) -> None:
    """ValueError if writing ``out`` would lose a rank's events (see the module docstring)."""
    for p in paths:
        try:
            same = Path(p).resolve() == out.resolve() or os.path.samefile(p, out)
        except OSError:  # either is missing: not the same file (a missing input says so)
            same = False
        if same:
            raise ValueError(
                f"{out} is both the output and an input, which the merge would write over; "
                f"the first argument is the output: {_PROG} OUT.json RANK.json..."
            )
    if out.is_file() and (rank := _rank_of(out)) is not None:
        raise ValueError(
            f"{out} is rank {rank}'s own timeline, which the merge would write over; "
            f"the first argument is the output (a new file): {_PROG} OUT.json RANK.json..."
        )


def _arrow_key(e: Any) -> tuple[int, int, float, float, dict[str, Any]] | None:
    """``(pid, tid, start, duration, args)`` of a slice, seconds; None for other events."""
    if not isinstance(e, dict) or e.get("ph") != "X":
        return None
    args = e.get("args", {})
    try:
        return e["pid"], e["tid"], e["ts"] / 1e6, e["dur"] / 1e6, args
    except (KeyError, TypeError):  # not a slice plait wrote: no arrow to or from it
        return None


def _merged(paths: Sequence[str | os.PathLike[str]], out: str | os.PathLike[str]) -> str:
    """The merged trace of :func:`merge`, as JSON text: reads the files, writes none."""
    _check_output(paths, Path(out))
    events: list[dict[str, Any]] = []
    ranks: dict[str, str] = {}  # rank -> the file of its timeline
    first: tuple[str, str] | None = None  # the first job named, and its file
    for p in paths:
        doc = _load(p)
        rank, job = _rank_in(doc), _said(doc, "job")
        if rank is not None:
            if rank in ranks:  # its events twice, every arrow of its doubled
                raise ValueError(
                    f"{p}: rank {rank}'s timeline, as is {ranks[rank]}; pass each rank's once"
                )
            ranks[rank] = str(p)
        if job is not None:
            if first is None:
                first = (job, str(p))
            elif job != first[0]:  # arrows drawn between two runs' messages
                raise ValueError(
                    f"{p}: a timeline of job {job!r}, and {first[1]} of job {first[0]!r}; "
                    "merge the files of one run"
                )
        events.extend(doc["traceEvents"])
    sends: dict[tuple[int, int, int, int], list[tuple[int, int, float]]] = {}
    recvs: dict[tuple[int, int, int, int], list[tuple[int, int, float]]] = {}
    posts: dict[tuple[int, int, int], tuple[int, int, float]] = {}
    reads: list[tuple[tuple[int, int, int], tuple[int, int, float]]] = []
    for e in events:
        cat = e.get("cat") if isinstance(e, dict) else None
        if (found := _arrow_key(e)) is None or not isinstance(found[4], dict):
            continue
        pid, tid, ts, dur, args = found
        comm = args.get("comm", 0)
        if cat in ("send", "recv", "recv_reduce") and "peer" in args and "tag" in args:
            peer, tag = args["peer"], args["tag"]
            if cat == "send":
                sends.setdefault((comm, pid, peer, tag), []).append((pid, tid, ts + dur / 2))
            else:
                recvs.setdefault((comm, peer, pid, tag), []).append((pid, tid, ts + dur))
        elif cat == "post" and "tag" in args:
            posts[(comm, pid, args["tag"])] = (pid, tid, ts + dur)
        elif cat in ("get", "get_reduce", "wait") and "peer" in args and "tag" in args:
            # not the executor's own "wait" (blocked in the transport), which has no peer
            reads.append(((comm, args["peer"], args["tag"]), (pid, tid, ts + dur)))
    n = 0
    for key, dsts in recvs.items():
        srcs = sorted(sends.get(key, ()), key=lambda x: x[2])
        for src, dst in zip(srcs, sorted(dsts, key=lambda x: x[2]), strict=False):
            events.extend(flow(n, src, dst))
            n += 1
    for post, dst in reads:
        if post in posts:
            events.extend(flow(n, posts[post], dst))
            n += 1
    return json.dumps(document(events, name="plait timeline"))


def _write(text: str, out: str | os.PathLike[str]) -> Path:
    """Write the merged trace ``text`` to ``out``; OSError naming it if it cannot be."""
    target = Path(out)
    try:
        target.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise OSError(f"{target}: cannot be written ({exc.strerror or exc})") from None
    return target


#: What ``--help`` says (the module's docstring in its own words for a terminal).
_HELP = """Merge the per-rank traces that PLAIT_TIMELINE writes into one Chrome trace,
with an arrow from each send to its receive; open it in https://ui.perfetto.dev.

The first argument is the output. The merge refuses, writing nothing, an output
that is also one of its inputs, or an existing file that is a rank's own timeline,
so that `python -m plait.diagnostics.timeline trace.rank*.json`, the output
forgotten, does not write the other ranks' merge over rank 0's file; a merged
trace, or any other file, is replaced. The exit status is 0 when the merged trace
was written, 2 when nothing was (an output refused, an input not read) and 1 when
it could not be written."""


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m plait.diagnostics.timeline OUT IN...``: merge per-rank timelines."""
    parser = argparse.ArgumentParser(
        prog=_PROG,
        description=_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "out",
        metavar="OUT.json",
        help="the merged trace to write: a new file or a merged trace (never an input, "
        "nor a rank's own timeline)",
    )
    parser.add_argument(
        "paths", metavar="RANK.json", nargs="+", help="the ranks' timelines to merge"
    )
    args = parser.parse_args(argv)
    try:
        text = _merged(args.paths, args.out)
    except (OSError, ValueError) as exc:
        print(f"{_PROG}: {exc}", file=sys.stderr)
        return 2
    try:
        out = _write(text, args.out)
    except OSError as exc:
        print(f"{_PROG}: {exc}", file=sys.stderr)
        return 1
    print(f"merged {len(args.paths)} timelines into {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
