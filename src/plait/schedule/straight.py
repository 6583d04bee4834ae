"""Straight-line orders: a schedule's steps in one fixed order, where that is safe.

The executor runs a schedule as a dataflow (:mod:`plait.runtime.executor`); a short
schedule of small messages it can instead run as the list of operations worked out
here once per schedule, with far less bookkeeping per step.

Note [straight-line schedules]
    Most small calls run a short schedule whose steps could as well run in one
    fixed order: post the staged receives, then each step as soon as what it
    needs is there, and wait for one handle at a time. Such an order is found by
    running the executor's dataflow on paper, waiting, whenever nothing is ready,
    for the first handle issued that all that is not issued yet depends on (see
    below); the call then runs that list without the dependency counts, the ready
    queue and the scan of every pending handle after each wake-up.

    The order may wait for a handle while the dataflow would have gone on with
    something else. It is safe when every send and receive not yet issued at each
    wait depends, directly or not, on the handle waited for. Suppose such orders
    deadlocked: each blocked rank waits for a message whose send its peer has not
    issued, so that send depends on what the peer waits for, and following the
    waits from rank to rank closes a cycle of steps each of which needs the one
    before it. The dataflow would then be stuck on the same cycle whatever the
    timing; but the dataflow of every registered algorithm is deadlock-free (the
    prover checks it), so such an order is too. Messages are matched the same way
    (by peer and tag, in the order each sender sends them).

    Left to the dataflow: a schedule where the condition fails, a long one (more
    than LINE_STEPS steps), one with a message above LINE_BYTES bytes (there,
    combining each arrival as it comes matters more than the bookkeeping), and a
    call traced by the timeline (which reports each step as the dataflow runs it).
"""

from __future__ import annotations

from collections import deque

from plait.schedule.ir import Buf, Schedule, Step, StepKind

__all__ = [
    "LINE_BYTES",
    "LINE_STEPS",
    "L_COMBINE",
    "L_LOCAL",
    "L_POST",
    "L_RECV",
    "L_SEND",
    "L_WAIT",
    "Line",
    "straight_line",
]

#: Longest schedule, in steps, given a straight-line order.
LINE_STEPS = 64
#: Largest message, in bytes, of a schedule given a straight-line order.
LINE_BYTES = 64 * 1024

# The operations, by their first field:
#   (L_SEND | L_RECV, i, peer, tag, buffer, first byte, end byte): issue step i;
#   (L_WAIT, i): wait for step i's handle;
#   (L_COMBINE, i): fold staged receive i into its destination;
#   (L_POST, i, peer, tag, first element, end element, first byte, end byte): post
#       staged receive i into the staging pool;
#   (L_LOCAL, i, in_place_void): run COPY or REDUCE step i, unless ``in_place_void`` is 1
#       and the call is in place (a copy between IN and OUT at equal offsets). A copy of a
#       region onto itself has no operation.
L_SEND, L_RECV, L_WAIT, L_COMBINE, L_POST, L_LOCAL = range(6)
#: A straight-line order: its operations, as above.
Line = tuple[tuple[int, ...], ...]

_SEND, _RECV, _RECV_REDUCE = StepKind.SEND, StepKind.RECV, StepKind.RECV_REDUCE


def straight_line(schedule: Schedule, itemsize: int) -> Line | None:
    """Work out a straight-line order for ``schedule`` (Note [straight-line schedules]).

    Returns None when the schedule is not eligible or no such order is safe;
    also for a malformed schedule, which the dataflow then reports.
    """
    steps = schedule.steps
    n = len(steps)
    if n > LINE_STEPS or len(schedule.n_deps) != n or len(schedule.dependents) != n:
        return None
    for step in steps:
        kind = step.kind
        r = step.src if kind is _SEND else step.dst
        if kind is _SEND or kind is _RECV or kind is _RECV_REDUCE:
            if r is None or r.count * itemsize > LINE_BYTES:
                return None
        elif step.src is None or step.dst is None:
            return None
    dependents = schedule.dependents
    remaining = list(schedule.n_deps)
    ready: deque[int] = deque(schedule.roots or [i for i, k in enumerate(remaining) if k == 0])
    # ancestors[j]: bit i set when step j depends on step i, directly or not.
    ancestors = [0] * n
    order = list(ready)
    counts = list(remaining)
    for i in order:  # topological: each step after all it depends on
        for j in dependents[i]:
            ancestors[j] |= ancestors[i] | (1 << i)
            counts[j] -= 1
            if not counts[j]:
                order.append(j)
    if len(order) != n:
        return None  # a cycle
    unissued = 0  # the sends and receives not issued yet, as bits
    for i, step in enumerate(steps):
        if step.kind is _SEND or step.kind is _RECV:
            unissued |= 1 << i
    ops: list[tuple[int, ...]] = []
    issued: list[int] = []  # handles not waited for yet, first issued first
    pos = 0
    for i in (i for i, s in enumerate(steps) if s.kind is _RECV_REDUCE):
        step = steps[i]
        d = step.dst
        assert d is not None
        end = pos + d.count
        ops.append((L_POST, i, step.peer, step.tag, pos, end, pos * itemsize, end * itemsize))
        issued.append(i)
        pos = end
    arrived: set[int] = set()
    deps_met: set[int] = set()
    left = n
    done: list[int] = []  # done, their dependents not released yet
    while True:
        while ready:
            i = ready.popleft()
            step = steps[i]
            kind = step.kind
            if kind is _SEND or kind is _RECV:
                r = step.src if kind is _SEND else step.dst
                assert r is not None
                lo, hi = r.offset * itemsize, (r.offset + r.count) * itemsize
                code = L_SEND if kind is _SEND else L_RECV
                ops.append((code, i, step.peer, step.tag, int(r.buf), lo, hi))
                unissued &= ~(1 << i)
                issued.append(i)
                continue
            if kind is _RECV_REDUCE:
                deps_met.add(i)
                if i not in arrived:
                    continue
                ops.append((L_COMBINE, i))
            else:
                local = _local(step)
                if local >= 0:
                    ops.append((L_LOCAL, i, local))
            done.append(i)
        for i in done:
            left -= 1
            for j in dependents[i]:
                remaining[j] -= 1
                if not remaining[j]:
                    ready.append(j)
        done.clear()
        if ready:
            continue
        if left == 0:
            return tuple(ops)
        if not issued:
            return None  # nothing to wait for and nothing ready: malformed
        i = _safe_wait(issued, unissued, ancestors)
        if i < 0:
            return None
        ops.append((L_WAIT, i))
        if steps[i].kind is _RECV_REDUCE:
            arrived.add(i)
            if i not in deps_met:
                continue
            ops.append((L_COMBINE, i))
        done.append(i)


def _local(step: Step) -> int:
    """For local ``step``: -1 if it does nothing, 1 if it does nothing in place, else 0."""
    s, d = step.src, step.dst
    assert s is not None
    assert d is not None
    if step.kind is not StepKind.COPY or s.offset != d.offset:
        return 0
    if s.buf == d.buf:
        return -1
    return 1 if {s.buf, d.buf} == {Buf.IN, Buf.OUT} else 0


def _safe_wait(issued: list[int], unissued: int, ancestors: list[int]) -> int:
    """The first handle in ``issued`` that every step in ``unissued`` (bits) depends on,
    removed from ``issued``; -1 if none is (then no straight line is safe from here)."""
    for k, i in enumerate(issued):
        rest = unissued
        while rest:
            j = (rest & -rest).bit_length() - 1
            if not ancestors[j] >> i & 1:
                break
            rest &= rest - 1
        else:
            del issued[k]
            return i
    return -1
