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

    0. :func:`local_calls` copies from this rank's ring the calls it may
       measure (completed without error, not one of ``stragglers``' own),
       before ``stragglers`` makes a call of its own: its calls take places
       in the ring, and one taken first would push the oldest call out of a
       full ring before it was read;
    1. ``allreduce(MIN)`` of each rank's newest such call number, ``hi``, and
       of the window it asks for, ``n`` (16 bytes): every rank completed the
       calls up to ``hi``;
    2. :func:`local_row` gives each rank's last ``n`` of those calls up to
       ``hi``, as their numbers, starts and waits (``3 * n`` float64s), and
       one ``allgather`` (``3 * n * 8`` bytes per rank: about 47 KiB for 2000
       calls) brings every rank the table;
    3. :func:`from_table` keeps the calls whose numbers are in every rank's
       row and computes every rank's lateness at them, alike on every rank.

    The calls are listed by number, not taken as the range ``hi - n + 1 ..
    hi``: that range would hold the calls of earlier ``stragglers`` calls
    and calls that failed, which are not measured, and so measure fewer
    than ``n``. The two calls ``stragglers`` makes are recorded like any
    other and have the same numbers on every rank, so every rank leaves out
    the same ones. A call that failed on some ranks only (one whose error
    left the communicator usable) is in the others' rows but not in every
    row, so it is left out and the window holds one call fewer.

    What it can measure is what the rings hold: with a ring of ``R`` calls
    (``PLAIT_RECORDER_SIZE``), at most ``R``, and fewer where the ring holds
    fewer of the program's completed calls up to ``hi``: each earlier
    ``stragglers`` call still in it takes two places, each failed call one,
    and each call a rank completed after ``hi`` one. Each :class:`Lateness`
    says in ``calls`` how many it measured.

    Piggy-backing the start time on existing messages would cost every call
    and needs the transport; the explicit collective costs only its callers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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
    "LocalCall",
    "format_lateness",
    "from_table",
    "local_calls",
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
    # A call with one rank's time compares nothing; a one-rank job's calls are each on time.
    usable = np.isfinite(values).sum(axis=1) >= min(2, ranks)
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


#: The purpose of the calls ``stragglers`` itself makes, which it never measures.
OWN_CALLS = "stragglers"


@dataclass(frozen=True, slots=True)
class LocalCall:
    """One call of this rank's ring that ``stragglers`` may measure: its number,
    collective, wall-clock start and wait (end - start), in seconds."""

    seq: int
    collective: str
    start: float
    wait: float


def _measured(slot: Any) -> bool:
    """Whether ``slot`` is a call that completed without error and is not one of
    ``stragglers``' own (their lateness is the measurement's, not the program's)."""
    return slot.end > 0 and slot.error is None and slot.shape.within != OWN_CALLS


def local_calls(recorder: FlightRecorder) -> list[LocalCall]:
    """The calls of this rank's ring that can be measured, oldest first.

    Step 0 of Note [live stragglers]: taken before ``stragglers`` makes a
    call, so that its calls push none of these out of a full ring.
    """
    return [
        LocalCall(s.seq, s.shape.collective, recorder.wall(s.start), s.end - s.start)
        for s in recorder.slots()
        if s.start and _measured(s)
    ]


def newest_done(calls: Sequence[LocalCall]) -> int:
    """The newest call number in ``calls`` (from :func:`local_calls`; -1: none).

    Step 1 of Note [live stragglers] takes the minimum of this over the ranks.
    """
    return calls[-1].seq if calls else -1


def local_collectives(calls: Sequence[LocalCall]) -> dict[int, str]:
    """The collective of each call of ``calls``, by call number (for :func:`from_table`)."""
    return {c.seq: c.collective for c in calls}


def local_row(calls: Sequence[LocalCall], hi: int, n: int) -> np.ndarray:
    """This rank's part of the live exchange (Note [live stragglers]).

    ``3 * n`` float64s: the numbers of the last ``n`` calls of ``calls`` up to
    number ``hi``, then their wall-clock starts, then their waits (end -
    start); where there are fewer than ``n``, NaN before them.
    """
    chosen = [c for c in calls if c.seq <= hi][-n:] if n > 0 else []
    row = np.full(3 * n, np.nan)
    k = n - len(chosen)
    for i, c in enumerate(chosen, k):
        row[i] = c.seq
        row[n + i] = c.start
        row[2 * n + i] = c.wait
    return row


def from_table(
    table: np.ndarray, collectives: Mapping[int, str], *, same_clock: bool
) -> list[Lateness]:
    """Every rank's lateness from the allgathered rows of :func:`local_row`.

    ``table`` has shape (ranks, 3n). The calls measured are those whose
    number is in every rank's row: every rank completed them and still holds
    them. ``collectives`` names calls by number (this rank's, from
    :func:`local_calls`: every rank made the same calls).
    """
    table = np.asarray(table, dtype=np.float64)
    ranks, n = table.shape[0], table.shape[1] // 3
    places = [{int(q): i for i, q in enumerate(row[:n]) if np.isfinite(q)} for row in table]
    seqs = sorted(set.intersection(*map(set, places))) if places else []
    starts = np.empty((len(seqs), ranks))
    waits = np.empty((len(seqs), ranks))
    for r, (row, where) in enumerate(zip(table, places, strict=True)):
        at = [where[q] for q in seqs]
        starts[:, r] = row[n:][at]
        waits[:, r] = row[2 * n :][at]
    names = [collectives.get(q, "") for q in seqs]
    return measure(starts, starts + waits, seqs, names, same_clock=same_clock)
