"""Stragglers: how late each rank arrives at the collectives, from every rank's times.

A rank's *lateness* at a call is how long after the first rank it began that
call; it is 0 for the first to arrive. Over many calls, a rank whose median
lateness stands out is a straggler: every other rank waits for it in every
collective (a slow data loader, a busier host, a larger shard).

Two ways to measure it, chosen by :func:`measure`:

- from start times (``same_clock=True``): ``start[r] - min(start)``. Exact
  when every rank reads the same clock: ranks on one host, or hosts whose
  clocks agree well enough (NTP: about a millisecond).
- from waits (``same_clock=False``): ``max(wait) - wait[r]`` where ``wait =
  end - start``, only for *synchronizing* collectives (allreduce, allgather,
  reduce_scatter, alltoall, barrier), which end at nearly the same moment on
  every rank, since no rank can finish before the last one has arrived. No
  clock is compared across ranks, so it works across hosts whatever their
  clocks say; it is off by how unevenly the call ends (a few message
  latencies).

Note [live stragglers]
    Lateness needs every rank's times, and a rank knows only its own, so
    ``comm.stragglers()`` is itself a collective, made when the user asks
    (not on every call, which would cost the recorder its 2 % budget):

    1. ``allreduce(MIN)`` of each rank's newest completed call number, ``hi``
       (8 bytes); the window is the ``window`` calls up to ``hi``, which every
       rank has completed;
    2. :func:`local_row` gives each rank's starts and waits for those calls
       (``2 * window`` float64s, NaN where a call left its ring), and one
       ``allgather`` (``2 * window * 8`` bytes per rank: 32 KiB for 2000 calls)
       brings every rank the table;
    3. :func:`from_table` computes every rank's lateness, alike on every rank.

    The two calls are recorded like any other and fall outside the window.
    Piggy-backing the start time on existing messages would cost every call
    and needs the transport; the explicit collective costs only its callers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from plait.collectives import COLLECTIVES
from plait.collectives import get as get_collective
from plait.diagnostics._words import dur
from plait.diagnostics.recorder import FlightRecorder

__all__ = [
    "OWN_CALLS",
    "SYNCHRONIZING",
    "Lateness",
    "format_lateness",
    "from_table",
    "local_collectives",
    "local_row",
    "measure",
    "newest_done",
    "stragglers",
]

#: Collectives that end at nearly the same time on every rank (see the module docstring): those
#: without a root, where every rank's result needs every rank's call (plait.collectives).
SYNCHRONIZING = frozenset(c for c in COLLECTIVES if not get_collective(c).rooted)


@dataclass(frozen=True, slots=True)
class Lateness:
    """How late one rank arrived at the calls measured, in seconds.

    ``calls`` is how many calls had a time for this rank; ``worst_seq`` is
    the call number of ``max`` (None when ``calls`` is 0).
    """

    rank: int
    calls: int
    mean: float
    median: float
    max: float
    worst_seq: int | None


def measure(
    starts: np.ndarray,
    ends: np.ndarray,
    seqs: Sequence[int],
    collectives: Sequence[str],
    *,
    same_clock: bool = True,
) -> list[Lateness]:
    """Every rank's lateness over calls ``seqs``.

    Args:
        starts: shape (calls, ranks): when each rank began each call, seconds
            (on one clock when ``same_clock``); NaN where unknown.
        ends: the same shape: when each rank ended the call; NaN where unknown.
        seqs: the call number of each row.
        collectives: the collective of each row.
        same_clock: compare starts (True) or waits of synchronizing
            collectives (False); see the module docstring.

    Returns:
        One :class:`Lateness` per rank (column), in rank order.
    """
    starts = np.asarray(starts, dtype=np.float64)
    ends = np.asarray(ends, dtype=np.float64)
    if starts.ndim != 2 or starts.shape != ends.shape:
        raise ValueError(
            f"starts and ends must be (calls, ranks); got {starts.shape}, {ends.shape}"
        )
    calls, ranks = starts.shape
    if len(seqs) != calls or len(collectives) != calls:
        raise ValueError(f"{calls} rows but {len(seqs)} seqs and {len(collectives)} collectives")
    if same_clock:
        values = starts
    else:
        keep = np.array([c in SYNCHRONIZING for c in collectives], dtype=bool).reshape(-1, 1)
        values = np.where(keep, ends - starts, np.nan)
    late = np.full((calls, ranks), np.nan)
    usable = np.isfinite(values).sum(axis=1) >= 2  # one rank alone is late to no one
    if usable.any():
        v = values[usable]
        if same_clock:
            late[usable] = v - np.nanmin(v, axis=1, keepdims=True)
        else:
            late[usable] = np.nanmax(v, axis=1, keepdims=True) - v
    out = []
    for r in range(ranks):
        col = late[:, r]
        ok = np.isfinite(col)
        n = int(ok.sum())
        if n == 0:
            out.append(Lateness(r, 0, 0.0, 0.0, 0.0, None))
            continue
        vals = col[ok]
        worst = int(np.argmax(np.where(ok, col, -np.inf)))
        out.append(
            Lateness(
                rank=r,
                calls=n,
                mean=float(vals.mean()),
                median=float(np.median(vals)),
                max=float(vals.max()),
                worst_seq=int(seqs[worst]),
            )
        )
    return out


def stragglers(lateness: Sequence[Lateness], threshold: float = 0.01) -> list[Lateness]:
    """The ranks whose median lateness is at least ``threshold`` seconds, latest first."""
    late = [x for x in lateness if x.calls and x.median >= threshold]
    return sorted(late, key=lambda x: (-x.median, x.rank))


def format_lateness(lateness: Sequence[Lateness]) -> list[str]:
    """One line per rank, e.g. ``rank 2: median 512.0 ms, mean 498.3 ms, max 1.02 s (#15)
    over 20 calls``."""
    lines = []
    for x in lateness:
        if not x.calls:
            lines.append(f"rank {x.rank}: no call to compare")
            continue
        lines.append(
            f"rank {x.rank}: median {dur(x.median, 2)}, mean {dur(x.mean, 2)}, "
            f"max {dur(x.max, 2)} (#{x.worst_seq}) over {x.calls} calls"
        )
    return lines


def newest_done(recorder: FlightRecorder) -> int:
    """The newest call number this rank completed without error (-1: none).

    Step 1 of Note [live stragglers] takes the minimum of this over the ranks.
    """
    return max((s.seq for s in recorder.slots() if _measured(s)), default=-1)


#: The purpose of the calls ``stragglers`` itself makes, which it never measures.
OWN_CALLS = "stragglers"


def _measured(slot: Any) -> bool:
    """Whether ``slot`` is a call that completed without error and is not one of
    ``stragglers``' own (their lateness is the measurement's, not the program's)."""
    return slot.end > 0 and slot.error is None and slot.shape.within != OWN_CALLS


def local_collectives(recorder: FlightRecorder, first: int, n: int) -> list[str]:
    """The collective of calls ``first .. first+n-1`` ("" where the ring no longer has it)."""
    names = [""] * n
    for slot in recorder.slots():
        k = slot.seq - first
        if 0 <= k < n:
            names[k] = slot.shape.collective
    return names


def local_row(recorder: FlightRecorder, first: int, n: int) -> np.ndarray:
    """This rank's part of the live exchange (Note [live stragglers]).

    ``2 * n`` float64s: the wall-clock starts of calls ``first .. first+n-1``,
    then their waits (end - start); NaN for a call not in the ring or not
    done.
    """
    row = np.full(2 * n, np.nan)
    for slot in recorder.slots():
        k = slot.seq - first
        if 0 <= k < n and slot.start and _measured(slot):
            row[k] = recorder.wall(slot.start)
            row[n + k] = slot.end - slot.start
    return row


def from_table(
    table: np.ndarray, first: int, collectives: Sequence[str], *, same_clock: bool
) -> list[Lateness]:
    """Every rank's lateness from the allgathered rows of :func:`local_row`.

    ``table`` has shape (ranks, 2n); ``collectives`` names calls ``first ..
    first+n-1`` (from this rank's recorder: every rank made the same calls).
    """
    table = np.asarray(table, dtype=np.float64)
    n = table.shape[1] // 2
    starts = table[:, :n].T
    ends = starts + table[:, n:].T
    return measure(starts, ends, range(first, first + n), collectives, same_clock=same_clock)
