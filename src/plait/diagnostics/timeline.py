"""``PLAIT_TIMELINE=FILE``: a Chrome / Perfetto trace of a real run, per rank.

Each rank writes its own file: ``FILE`` with ``.rank<r>`` before its suffix
(``trace.json`` gives ``trace.rank0.json``, ``trace.rank1.json``, …), or
``FILE`` with ``{rank}`` replaced if it has one. One file per rank needs no
coordination between ranks and survives a rank that dies; to see every rank
on one time line, merge them (the merge also draws an arrow from each send to
its receive)::

    python -m plait.diagnostics.timeline merged.json trace.rank*.json

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
from plait.diagnostics.places import replace_with
from plait.diagnostics.recorder import FlightRecorder, Slot

__all__ = ["CALLS_TID", "DEFAULT_EVENTS", "Timeline", "merge", "rank_path"]

#: The thread id of the ``calls`` track (shown first).
CALLS_TID = 999
#: Events a rank keeps unless PLAIT_TIMELINE_EVENTS says otherwise.
DEFAULT_EVENTS = 1_000_000
#: Step kinds that go on the net lanes; the others go on ``compute``.
_NET_KINDS = frozenset({"send", "recv"})

_by_path: dict[tuple[str, int], Timeline] = {}
_by_path_lock = threading.Lock()


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
        text = os.environ.get("PLAIT_TIMELINE_EVENTS", "").strip()
        limit = DEFAULT_EVENTS
        if text:
            if not (text.isascii() and text.isdigit()) or int(text) < 1:
                raise ValueError(f"PLAIT_TIMELINE_EVENTS must be a positive integer; got {text!r}")
            limit = int(text)
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
            doc = document(self.events(), name=f"plait timeline, rank {self.rank}")
            doc["otherData"]["dropped_events"] = self.dropped
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
        ValueError: a file is not a trace.
    """
    events: list[dict[str, Any]] = []
    for p in paths:
        doc = json.loads(Path(p).read_text(encoding="utf-8"))
        if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
            raise ValueError(f"{p}: not a Chrome trace (no traceEvents list)")
        events.extend(doc["traceEvents"])
    sends: dict[tuple[int, int, int, int], list[tuple[int, int, float]]] = {}
    recvs: dict[tuple[int, int, int, int], list[tuple[int, int, float]]] = {}
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in ("send", "recv", "recv_reduce"):
            continue
        args = e.get("args", {})
        pid, tid, ts, dur = e["pid"], e["tid"], e["ts"] / 1e6, e["dur"] / 1e6
        comm, peer, tag = args.get("comm", 0), args["peer"], args["tag"]
        if e["cat"] == "send":
            sends.setdefault((comm, pid, peer, tag), []).append((pid, tid, ts + dur / 2))
        else:
            recvs.setdefault((comm, peer, pid, tag), []).append((pid, tid, ts + dur))
    posts: dict[tuple[int, int, int], tuple[int, int, float]] = {}
    reads: list[tuple[tuple[int, int, int], tuple[int, int, float]]] = []
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in ("post", "get", "get_reduce", "wait"):
            continue
        args = e.get("args", {})
        pid, tid, ts, dur = e["pid"], e["tid"], e["ts"] / 1e6, e["dur"] / 1e6
        comm = args.get("comm", 0)
        if e["cat"] == "post":
            posts[(comm, pid, args["tag"])] = (pid, tid, ts + dur)
        elif "peer" in args:  # not the executor's own "wait" (blocked in the transport)
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
    target = Path(out)
    target.write_text(json.dumps(document(events, name="plait timeline")), encoding="utf-8")
    return target


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m plait.diagnostics.timeline OUT IN...``: merge per-rank timelines."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2 or args[0] in ("-h", "--help"):
        print("usage: python -m plait.diagnostics.timeline OUT.json RANK.json...", file=sys.stderr)
        return 2
    out = merge(args[1:], args[0])
    print(f"merged {len(args) - 1} timelines into {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
