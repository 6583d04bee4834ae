"""Running a schedule in its straight-line order (Note [straight-line schedules]).

The executor hands a short schedule of small messages here when it has such an
order (:mod:`plait.schedule.straight` works it out): its operations run one
after the other, with the views of the call's buffers they use made once for a
loop of equal calls (Note [bound lines]).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from plait.errors import InternalError
from plait.ops import fold_one
from plait.runtime.stall import Prober, settle
from plait.runtime.waits import block, malformed, withdraw, wrap
from plait.schedule.ir import Schedule, StepKind
from plait.schedule.straight import (
    L_COMBINE,
    L_LOCAL,
    L_POST,
    L_RECV,
    L_SEND,
    L_WAIT,
    Line,
    straight_line,
)
from plait.transport.base import Handle, Transport, renumbered

if TYPE_CHECKING:
    from plait.runtime.executor import Call

__all__ = ["BIND_BYTES", "line_of", "remember", "run_line"]


# Note [bound lines]
#     A straight-line order names each region by buffer and element or byte range, and
#     running it made the views of those regions anew on every call: a byte view, a slice
#     and a memoryview for each send and receive, a slice of the staging pool and one of
#     the destination for each combine, eight numpy objects in a 2-rank allreduce. Cheap in
#     a tight loop (about 1.5 µs), they cost about 7 µs of a 2-rank 8-byte call over TCP,
#     where Python runs between system calls with cold caches (both ways run by turns in
#     the same processes; docs/performance.md). A loop passes the same arrays call after
#     call (the caller's, and TMP and the staging pool, which the call runner's workspace
#     hands out again while a call asks for the same), so the operations bound to a call's
#     views are kept with its line and used again while the next call's IN, OUT, TMP,
#     staging pool, dtype and aliasing are the same objects; any other call binds its own.
#     Threads that run one schedule share its line: each reads the kept binding once and
#     checks it against its own arrays, so none uses another's views.
#
#     The views hold their arrays. Only a call whose IN and OUT take at most BIND_BYTES
#     keeps them (so at most that much memory per line outlives its call, until a call on
#     other arrays replaces it), and an array a line holds cannot be resized in place
#     (``ndarray.resize`` refuses an array another object refers to) meanwhile.

#: A call whose IN and OUT take at most this many bytes keeps its views (Note [bound lines]).
BIND_BYTES = 256 * 1024


class _Line:
    """A schedule's straight-line order for one item size, and the views of its last call."""

    __slots__ = ("bound", "ops", "schedule")

    def __init__(self, schedule: Schedule, ops: Line) -> None:
        self.schedule = schedule
        self.ops = ops
        #: IN, OUT, TMP, the staging pool, OUT's dtype, aliased, and the operations bound
        #: to them, of the last small call (Note [bound lines]); None before one.
        self.bound: tuple[Any, ...] | None = None


# schedule id, item size -> (the schedule, its straight-line order or None)
_LINES: dict[tuple[int, int], tuple[Schedule, _Line | None]] = {}


def line_of(schedule: Schedule, itemsize: int) -> _Line | None:
    """``schedule``'s straight-line order for items of ``itemsize`` bytes, or None if it
    runs as a dataflow (Note [straight-line schedules] in :mod:`plait.schedule.straight`);
    worked out once per schedule."""
    key = (id(schedule), itemsize)
    hit = _LINES.get(key)
    if hit is not None and hit[0] is schedule:
        return hit[1]
    order = straight_line(schedule, itemsize)
    line = None if order is None else _Line(schedule, order)
    remember(_LINES, key, schedule, line)
    return line


def _bind(
    line: _Line,
    buffers: tuple[np.ndarray, np.ndarray, np.ndarray],
    staging: np.ndarray | None,
    aliased: bool,
    call: Call,
) -> tuple[tuple[Any, ...], ...]:
    """``line``'s operations with the views of ``buffers`` they use (Note [bound lines]).

    Sends and receives get their memoryview, a staged receive its slice of the staging
    pool; a combine, a copy and a reduction get their destination, their source (a
    combine's staged data) and what to do (-1: copy; else reduce, 1 with the source first;
    2 or 3 for that of one element, through fresh memory: Note [one-element folds] in
    plait.ops). A copy that is no copy in this call (a region onto itself) is left out.
    """
    schedule = line.schedule
    steps, rank = schedule.steps, schedule.rank
    raw = [b.view(np.uint8) for b in buffers]
    pool = staging
    if pool is None:  # made for this call alone: the call keeps no views (see run_line)
        pool = np.empty(schedule.staged_count, buffers[1].dtype)
    pool_raw = pool.view(np.uint8)
    staged: dict[int, np.ndarray] = {}
    ops: list[tuple[Any, ...]] = []
    for op in line.ops:
        code = op[0]
        if code <= L_RECV:  # L_SEND or L_RECV
            _, i, peer, tag, b, lo, hi = op
            ops.append((code, i, peer, tag, raw[b][lo:hi].data))
        elif code == L_POST:
            _, i, peer, tag, elo, ehi, lo, hi = op
            staged[i] = pool[elo:ehi]
            ops.append((code, i, peer, tag, pool_raw[lo:hi].data))
        elif code == L_COMBINE:
            step = steps[op[1]]
            d = step.dst
            if d is None:
                raise malformed(rank, call, step)
            dst = buffers[d.buf][d.offset : d.offset + d.count]
            kind = int(step.first) + (2 if d.count == 1 else 0)
            ops.append((code, op[1], dst, staged[op[1]], kind))  # as a REDUCE
        elif code == L_LOCAL:
            step = steps[op[1]]
            s, d = step.src, step.dst
            if s is None or d is None or step.kind > StepKind.REDUCE:
                raise InternalError(f"rank {rank}: {step!r} is not a local step with two regions")
            kind = -1 if step.kind is StepKind.COPY else int(step.first)
            if kind >= 0 and d.count == 1:  # Note [one-element folds] in plait.ops
                kind += 2
            # A copy onto itself has nothing to do (IN and OUT are one memory in place).
            if (
                kind < 0
                and d.offset == s.offset
                and (d.buf == s.buf or (aliased and d.buf + s.buf == 1))
            ):
                continue
            src = buffers[s.buf][s.offset : s.offset + s.count]
            ops.append((code, op[1], buffers[d.buf][d.offset : d.offset + d.count], src, kind))
        else:  # L_WAIT
            ops.append(op)
    return tuple(ops)


def run_line(
    line: _Line,
    buffers: tuple[np.ndarray, np.ndarray, np.ndarray],
    transport: Transport,
    call: Call,
    staging: np.ndarray | None,
    aliased: bool,
) -> None:
    """Run ``line``'s schedule in its straight-line order; as :func:`execute`."""
    schedule = line.schedule
    inp, out, tmp = buffers
    last = line.bound
    if (
        last is not None
        and last[0] is inp
        and last[1] is out
        and last[2] is tmp
        and last[3] is staging
        and last[4] is out.dtype
        and last[5] == aliased
    ):
        ops = last[6]
    else:
        ops = _bind(line, buffers, staging, aliased, call)
        small = out.nbytes + (0 if inp is out else inp.nbytes) <= BIND_BYTES
        if small and (staging is not None or not schedule.staged_count):
            line.bound = (inp, out, tmp, staging, out.dtype, aliased, ops)
    steps = schedule.steps
    ufunc = call.ufunc
    tag_base, check = call.tag_base, call.check
    rec, slot = call.recorder, call.slot
    pending: dict[Handle, int] = {}
    if rec is not None and slot is not None:
        rec.watch(slot, pending, steps)  # as execute (Note [executor diagnostics])
    held: list[Any] = [None] * len(steps)  # step i's handle
    probe_at = 0.0
    prober: Prober | None = None
    try:
        for op in ops:
            code = op[0]
            if code == L_WAIT:
                i = op[1]
                h = held[i]
                while not h.done:
                    # Before blocking, as the dataflow would: fail at once on any handle that
                    # failed meanwhile (a lost peer must not wait out a late one's deadline).
                    waiting = []
                    for g in pending:
                        if not g.done:
                            waiting.append(g)
                        elif g.error is not None:
                            err = renumbered(transport, g.error)
                            err = wrap(schedule.rank, call, steps[pending[g]], err)
                            raise settle(transport, call, schedule, err, prober)
                    probe_at, prober = block(
                        transport, call, schedule, pending, waiting, probe_at, prober
                    )
                del pending[h]
                if h.error is not None:
                    err = wrap(schedule.rank, call, steps[i], renumbered(transport, h.error))
                    raise settle(transport, call, schedule, err, prober)
            elif code == L_SEND:
                h = transport.isend(op[2], tag_base + op[3], op[4], check)
                pending[h] = op[1]
                held[op[1]] = h
            elif code in (L_RECV, L_POST):
                h = transport.irecv(op[2], tag_base + op[3], op[4], check)
                pending[h] = op[1]
                held[op[1]] = h
            else:  # L_COMBINE or L_LOCAL: a copy (-1), or a reduction with its operand order
                dst, kind = op[2], op[4]
                if kind < 0:
                    dst[...] = op[3]  # numpy copies overlapping regions through a temporary
                elif kind == 1:
                    ufunc(op[3], dst, out=dst)
                elif kind == 0:
                    ufunc(dst, op[3], out=dst)
                else:  # one element (bind): Note [one-element folds] in plait.ops
                    fold_one(ufunc, *((op[3], dst) if kind == 3 else (dst, op[3])), dst)
        if slot is not None:
            slot.pending = slot.steps = None  # all done: the links of watch go with the call
    except BaseException:
        withdraw(transport, call, pending)
        raise
    finally:
        if prober is not None:
            prober.close()


def remember(
    table: dict[Any, tuple[Schedule, Any]], key: Any, schedule: Schedule, found: Any
) -> None:
    """Keep ``found``, worked out for ``schedule``, in ``table`` under ``key``."""
    if len(table) >= 4096:  # as many as the schedule cache holds
        table.clear()
    table[key] = (schedule, found)
