"""Chrome / Perfetto trace of a simulated call: every rank's steps on a time line.

Open the JSON in https://ui.perfetto.dev or ``chrome://tracing``. Each rank is a
process; its local work (copies, reductions, the reduction of every
receive-and-reduce, and the gets of one-sided schedules) is the thread
``compute``, and its sends and receives sit on threads ``net 0``, ``net 1``,
… (as many as it had messages in flight at once). One-sided schedules add a
thread ``sync`` with each post (an instant) and each wait. An arrow joins each
send to its receive, and each post to the gets and waits that waited for it.
Times are the simulated ones.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from plait.schedule.ir import StepKind
from plait.sim.engine import StepRecord

__all__ = ["trace_events", "write_trace"]

_US = 1e6  # trace timestamps are microseconds
_LOCAL = (StepKind.COPY, StepKind.REDUCE, StepKind.RECV_REDUCE, StepKind.GET, StepKind.GET_REDUCE)
_SYNC = (StepKind.POST, StepKind.WAIT)


def trace_events(
    records: Sequence[StepRecord], *, name: str = "", ranks: int | None = None
) -> dict[str, Any]:
    """The trace as a dict (``{"traceEvents": [...], ...}``) from per-step records.

    ``ranks``: participants from this number on are a fabric's switches (named so).
    """
    events: list[dict[str, Any]] = []
    by_rank: dict[int, list[StepRecord]] = {}
    for rec in records:
        by_rank.setdefault(rec.rank, []).append(rec)
    where: dict[tuple[int, int, int], tuple[int, int, float]] = {}  # message -> (pid, tid, ts)
    arrows: list[tuple[tuple[int, int, int], int, int, float]] = []
    posts: dict[int, tuple[list[int], list[tuple[int, int, float]]]] = {}  # rank -> phases, where
    waits: list[tuple[StepRecord, int, int]] = []  # gets and waits, with their pid and tid
    for rank in sorted(by_rank):
        who = f"rank {rank}" if ranks is None or rank < ranks else f"switch {rank - ranks}"
        events.append(_meta("process_name", rank, 0, who))
        events.append(_meta("process_sort_index", rank, 0, rank, key="sort_index"))
        events.append(_meta("thread_name", rank, 0, "compute"))
        lanes: list[float] = []  # end time of the last slice on each net lane
        comm = sorted(
            (r for r in by_rank[rank] if r.kind in (StepKind.SEND, StepKind.RECV)),
            key=lambda r: (r.ready, r.index),
        )
        for rec in comm:
            lane = next((i for i, end in enumerate(lanes) if end <= rec.ready), len(lanes))
            if lane == len(lanes):
                lanes.append(rec.end)
                events.append(_meta("thread_name", rank, lane + 1, f"net {lane}"))
            else:
                lanes[lane] = rec.end
            events.append(_slice(rec, rank, lane + 1, rec.ready, rec.end))
            mid = (rec.ready + rec.end) / 2
            if rec.kind is StepKind.SEND:
                where[(rank, rec.peer, rec.tag)] = (rank, lane + 1, mid)
            else:
                arrows.append(((rec.peer, rank, rec.tag), rank, lane + 1, rec.end))
        sync = len(lanes) + 1
        if any(r.kind in _SYNC for r in by_rank[rank]):
            events.append(_meta("thread_name", rank, sync, "sync"))
        for rec in by_rank[rank]:
            if rec.kind in _LOCAL:
                events.append(_slice(rec, rank, 0, rec.start, rec.end))
                if rec.kind is StepKind.RECV_REDUCE:
                    arrows.append(((rec.peer, rank, rec.tag), rank, 0, rec.end))
                elif rec.kind is not StepKind.COPY and rec.kind is not StepKind.REDUCE:
                    waits.append((rec, rank, 0))
            elif rec.kind in _SYNC:
                events.append(_slice(rec, rank, sync, rec.ready, rec.end))
                if rec.kind is StepKind.WAIT:
                    waits.append((rec, rank, sync))
                else:
                    phases, at = posts.setdefault(rank, ([], []))
                    phases.append(rec.tag)
                    at.append((rank, sync, rec.end))
    for n, (rec, pid, tid) in enumerate(waits):  # each get and wait from the post it waited for
        phases, at = posts.get(rec.peer, ([], []))
        i = bisect.bisect_left(phases, rec.tag)
        if i < len(phases):
            common = {"name": "post", "cat": "post", "id": len(arrows) + n}
            q, qt, ts = at[i]
            events.append({**common, "ph": "s", "pid": q, "tid": qt, "ts": ts * _US})
            events.append(
                {**common, "ph": "f", "bp": "e", "pid": pid, "tid": tid, "ts": rec.start * _US}
            )
    for n, (key, pid, tid, ts) in enumerate(arrows):
        src = where.get(key)
        if src is None:
            continue
        common = {"name": "message", "cat": "message", "id": n}
        events.append({**common, "ph": "s", "pid": src[0], "tid": src[1], "ts": src[2] * _US})
        events.append({**common, "ph": "f", "bp": "e", "pid": pid, "tid": tid, "ts": ts * _US})
    return {"traceEvents": events, "displayTimeUnit": "ns", "otherData": {"name": name}}


def write_trace(result: Any, path: str | Path) -> None:
    """Write the trace of ``result`` (a :class:`plait.sim.Result` of ``trace=True``) to ``path``."""
    records = getattr(result, "records", None)
    if records is None:
        raise ValueError("no step records: run simulate(..., trace=True) to write a trace")
    name = f"{result.collective}/{result.algorithm} on {result.network.description}"
    events = trace_events(records, name=name, ranks=getattr(result, "size", None))
    Path(path).write_text(json.dumps(events))


def _meta(what: str, pid: int, tid: int, value: Any, key: str = "name") -> dict[str, Any]:
    return {"name": what, "ph": "M", "pid": pid, "tid": tid, "args": {key: value}}


def _slice(rec: StepRecord, pid: int, tid: int, start: float, end: float) -> dict[str, Any]:
    kind = rec.kind
    if kind is StepKind.SEND:
        label = f"send -> r{rec.peer}"
    elif kind is StepKind.RECV:
        label = f"recv <- r{rec.peer}"
    elif kind is StepKind.RECV_REDUCE:
        label = f"reduce <- r{rec.peer}"
    elif kind in (StepKind.GET, StepKind.GET_REDUCE):
        label = f"{kind.name.lower()} <- r{rec.peer} @{rec.tag}"
    elif kind is StepKind.POST:
        label = f"post {rec.tag}"
    elif kind is StepKind.WAIT:
        label = f"wait r{rec.peer} @{rec.tag}"
    else:
        label = kind.name.lower()
    return {
        "name": label,
        "cat": kind.name.lower(),
        "ph": "X",
        "pid": pid,
        "tid": tid,
        "ts": start * _US,
        "dur": (end - start) * _US,
        "args": {"step": rec.index, "bytes": rec.nbytes, "tag": rec.tag},
    }
