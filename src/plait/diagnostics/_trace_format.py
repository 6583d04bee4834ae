"""The Chrome / Perfetto trace event format that plait writes, in one place.

``plait sim --trace`` (:mod:`plait.sim.trace`) and ``PLAIT_TIMELINE``
(:mod:`plait.diagnostics.timeline`) write the same JSON: an object
``{"traceEvents": [...], "displayTimeUnit": "ns", "otherData": {...}}`` in
which every rank is a process (``pid`` = rank, named ``rank N``), a rank's
local work is thread 0 (``compute``), its sends and receives sit on threads
``net 0``, ``net 1``, … (tid 1, 2, …), each step is a complete event
(``"ph": "X"``) named ``send -> r1``, ``recv <- r0``, ``reduce <- r2``,
``copy`` or ``reduce``, with ``args`` ``step``, ``bytes`` and ``tag``, and an
arrow (flow events ``s``/``f`` named ``message``) joins a send to its
receive. Timestamps and durations are microseconds.

This module depends on nothing in plait, so any layer may use it.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "COMPUTE_TID",
    "DISPLAY_TIME_UNIT",
    "US",
    "document",
    "flow",
    "meta",
    "net_tid",
    "slice_event",
    "step_label",
]

#: Trace timestamps are microseconds: multiply seconds by this.
US = 1e6
#: What the trace viewer shows times in.
DISPLAY_TIME_UNIT = "ns"
#: The thread of a rank's local work (copies, reductions).
COMPUTE_TID = 0


def net_tid(lane: int) -> int:
    """The thread id of network lane ``lane`` (``net 0`` is tid 1)."""
    return lane + 1


def meta(what: str, pid: int, tid: int, value: Any, key: str = "name") -> dict[str, Any]:
    """A metadata event: ``process_name``, ``process_sort_index``, ``thread_name``, …"""
    return {"name": what, "ph": "M", "pid": pid, "tid": tid, "args": {key: value}}


def slice_event(
    name: str, cat: str, pid: int, tid: int, start: float, end: float, args: dict[str, Any]
) -> dict[str, Any]:
    """A complete event from ``start`` to ``end`` (seconds) on thread ``tid`` of ``pid``."""
    return {
        "name": name,
        "cat": cat,
        "ph": "X",
        "pid": pid,
        "tid": tid,
        "ts": start * US,
        "dur": (end - start) * US,
        "args": args,
    }


def flow(
    n: int, src: tuple[int, int, float], dst: tuple[int, int, float]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The two events of arrow ``n`` from ``src`` to ``dst``, each (pid, tid, seconds)."""
    common = {"name": "message", "cat": "message", "id": n}
    return (
        {**common, "ph": "s", "pid": src[0], "tid": src[1], "ts": src[2] * US},
        {**common, "ph": "f", "bp": "e", "pid": dst[0], "tid": dst[1], "ts": dst[2] * US},
    )


def step_label(kind: str, peer: int) -> str:
    """A step's slice name from its kind (``send``, ``recv``, ``recv_reduce``, …)."""
    if kind == "send":
        return f"send -> r{peer}"
    if kind == "recv":
        return f"recv <- r{peer}"
    if kind == "recv_reduce":
        return f"reduce <- r{peer}"
    return kind


def document(events: list[dict[str, Any]], name: str = "") -> dict[str, Any]:
    """The whole trace: ``{"traceEvents": events, ...}``, ready for ``json.dumps``."""
    return {
        "traceEvents": events,
        "displayTimeUnit": DISPLAY_TIME_UNIT,
        "otherData": {"name": name},
    }
