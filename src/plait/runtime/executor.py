"""The executor: runs one rank's :class:`~plait.schedule.ir.Schedule` over a transport.

It keeps the schedule's dependency counts, starts every step whose
dependencies are done (sends and receives go to the transport at once, so a
step's sends and receives proceed together), and waits on the transport only
when nothing is ready. ``RECV_REDUCE`` receives are posted up front into
staging memory, so data can arrive while earlier steps still use the target
region; the combine runs when both the data and the dependencies are there.
Reductions are numpy ufuncs writing into the destination (no temporaries).

On any failure it withdraws every unfinished operation from the transport, so
nothing writes into the caller's buffers after the call has returned.

Note [step fields]
    A :class:`~plait.schedule.ir.Step` has the fields of every kind, so its
    ``src`` and ``dst`` are ``Region | None``. For each step the executor
    reads the regions its kind uses into locals and compares them with None
    once: the same attribute loads as before plus one comparison, nothing
    allocated, and the locals are narrowed to ``Region`` for the type
    checker. A step lacking one (never recorded by the builder; a hand-made
    schedule can have it) raises InternalError naming the step.

Note [executor diagnostics]
    A call may carry its flight-recorder slot (:mod:`plait.diagnostics`):
    the executor links the slot to its table of unfinished handles once
    (``FlightRecorder.watch``, two stores), so that a dump can say whom a
    blocked call waits for without the executor doing anything per step; on
    a failure it has the recorder keep those peers before withdrawing the
    handles (``unwatch``). With PLAIT_TIMELINE set the call also carries the
    rank's :class:`~plait.diagnostics.timeline.Timeline`, and the executor
    reports every step (from being started, or handed to the transport, to
    being seen done) and every time it blocks in ``wait_any``: two clock
    reads per step, paid only then.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from plait.errors import InternalError
from plait.ops import fold
from plait.runtime.line import line_of, remember, run_line
from plait.runtime.stall import Prober, settle
from plait.runtime.waits import block, job_rank, malformed, withdraw, wrap
from plait.schedule.ir import Schedule, Step, StepKind, uses_window
from plait.transport.base import Handle, Transport, renumbered

if TYPE_CHECKING:
    from plait.diagnostics.recorder import FlightRecorder, Slot
    from plait.diagnostics.timeline import Timeline
    from plait.runtime.one_sided import WindowSteps

__all__ = ["Call", "execute", "run_local"]


_now = time.monotonic  # the timeline's clock (Note [executor diagnostics])
_NOTHING_ISSUED: dict[int, float] = {}  # stands in for the timeline's table when it is off


class Call(NamedTuple):
    """What the executor needs to know about the call besides the schedule.

    A named tuple, made by the call runner with ``tuple.__new__`` from one tuple of
    its fields (half the time of a class's ``__init__`` with eleven stores, on a path
    taken by every call).
    """

    #: A string, or (collective, algorithm, seq) formatted on demand (:attr:`describe`).
    label: str | tuple[str, str, int]
    #: Tag of message 0 (see Note [wire tags] in plait.group).
    tag_base: int
    #: Digest of the call's parameters, compared by the transport.
    check: int
    #: The reduction. Only schedules that reduce call it; for the others the
    #: communicator passes np.bitwise_or, so it is never None.
    ufunc: np.ufunc
    #: time.monotonic() deadline; None waits forever.
    deadline: float | None
    #: The call's flight-recorder slot, its recorder and the rank's timeline, or None
    #: (Note [executor diagnostics]); slot and recorder are both set or both None.
    slot: Slot | None = None
    recorder: FlightRecorder | None = None
    timeline: Timeline | None = None
    #: The call's number among the communicator's one-sided calls (-1: not one).
    epoch: int = -1
    #: The call's number, and the tag of its communicator's stall probes (-1: it sends
    #: none; Note [stall probes] in plait.runtime.stall).
    seq: int = -1
    probe_tag: int = -1

    @property
    def describe(self) -> str:
        """E.g. ``"allreduce (ring, call #7)"``, used in messages."""
        label = self.label
        if isinstance(label, str):
            return label
        return f"{label[0]} ({label[1]}, call #{label[2]})"


def execute(
    schedule: Schedule,
    buffers: tuple[np.ndarray, np.ndarray, np.ndarray],
    transport: Transport,
    call: Call,
    staging: np.ndarray | None = None,
    aliased: bool = False,
) -> None:
    """Run ``schedule`` with ``buffers`` = flat (IN, OUT, TMP) arrays of one dtype.

    ``staging`` (same dtype, at least the total length of the schedule's
    ``RECV_REDUCE`` steps) holds arriving data until it is combined; allocated
    per call if not given. ``aliased``: IN and OUT are the same memory (an
    in-place call), so a copy between equal regions of the two is skipped;
    otherwise IN and OUT must not overlap.

    Raises:
        CommTimeout: the deadline passed; the message names the ranks waited on.
        CommError: a transport reported a failure (lost peer, mismatched call).
    """
    steps = schedule.steps
    if not steps:
        return
    if schedule.one_sided and getattr(transport, "window", None) is not None:
        from plait.runtime.one_sided import run_one_sided  # it builds on this module

        run_one_sided(schedule, buffers, transport, call, aliased)
        return
    itemsize = buffers[1].itemsize
    # A mixed schedule's window steps, or a one-sided one's across hosts (a rank sending
    # nothing in a mixed call), run on the host's window (Note [mixed schedules]).
    on = schedule.mixed or schedule.one_sided
    wsteps = _window_steps(schedule, buffers, transport, call, aliased) if on else None
    if call.timeline is None and wsteps is None:
        line = line_of(schedule, itemsize)
        if line is not None:
            run_line(line, buffers, transport, call, staging, aliased)
            return
    ufunc = call.ufunc
    remaining = list(schedule.n_deps)
    dependents = schedule.dependents
    ready: deque[int] = deque(schedule.roots or [i for i, n in enumerate(remaining) if n == 0])
    pending: dict[Handle, int] = {}
    # RECV_REDUCE bookkeeping: step -> staging array; arrived, and dependencies met.
    staged: dict[int, np.ndarray] = {}
    arrived: set[int] = set()
    deps_met: set[int] = set()
    left = len(steps)
    tag_base, check = call.tag_base, call.check
    rec, slot, tl = call.recorder, call.slot, call.timeline
    if rec is not None and slot is not None:
        rec.watch(slot, pending, steps)  # read only when dumped (Note [executor diagnostics])
    # step -> when it was started; filled only for the timeline (nothing made per call without)
    issued: dict[int, float] = {} if tl is not None else _NOTHING_ISSUED
    raw: list[np.ndarray | None] = [None, None, None]  # byte views, made when first needed
    probe_at = 0.0  # when the call probes its peers (0.0: not blocked yet)
    prober: Prober | None = None
    try:
        # Post every staged receive now: they touch no caller memory until combined.
        if schedule.staged_count:
            pool = (
                staging
                if staging is not None
                else np.empty(schedule.staged_count, buffers[1].dtype)
            )
            pool_raw = pool.view(np.uint8)
            offset = 0
            for i in _staged_steps(schedule):
                step = steps[i]
                d = step.dst
                if d is None:
                    raise malformed(schedule.rank, call, step)
                n = d.count
                staged[i] = pool[offset : offset + n]
                mv = pool_raw[offset * itemsize : (offset + n) * itemsize].data
                pending[transport.irecv(step.peer, tag_base + step.tag, mv, check)] = i
                if tl is not None:
                    issued[i] = _now()
                offset += n
        while True:
            while ready:
                i = ready.popleft()
                step = steps[i]
                kind = step.kind
                # Each kind reads the Region fields it uses into locals once, checked
                # against None (see Note [step fields]); no allocation per step.
                if kind is _SEND or kind is _RECV:
                    r = step.src if kind is _SEND else step.dst
                    if r is None:
                        raise malformed(schedule.rank, call, step)
                    # ``.data`` is memoryview(...) typed as one (numpy's stubs give ndarray
                    # the buffer protocol only from Python 3.12 on), and a little cheaper.
                    b = raw[r.buf]
                    if b is None:
                        b = raw[r.buf] = buffers[r.buf].view(np.uint8)
                    mv = b[r.offset * itemsize : (r.offset + r.count) * itemsize].data
                    if tl is not None:  # before: a send may leave within isend itself
                        issued[i] = _now()
                    if kind is _SEND:
                        h = transport.isend(step.peer, tag_base + step.tag, mv, check)
                    else:
                        h = transport.irecv(step.peer, tag_base + step.tag, mv, check)
                    pending[h] = i
                    continue
                if kind is _RECV_REDUCE:
                    deps_met.add(i)
                    if i not in arrived:
                        continue
                    _combine(step, buffers, staged.pop(i), ufunc, schedule.rank, call)
                    if tl is not None:
                        _note(call, tl, step, i, issued.pop(i), itemsize, tag_base)
                elif wsteps is not None and uses_window(step):
                    # Nothing else to move (no step ready, only staged receives): it waits alone.
                    busy = ready or any(j not in staged or j in deps_met for j in pending.values())
                    watch = wsteps.watch(step) if busy else None
                    if watch is not None:
                        pending[watch] = i
                        if tl is not None:
                            issued[i] = _now()
                        continue
                    start = _now() if tl is not None else 0.0
                    wsteps.step(step)
                    if tl is not None:
                        _note(call, tl, step, i, start, itemsize, tag_base)
                else:
                    if step.src is None or step.dst is None:
                        raise malformed(schedule.rank, call, step)
                    start = _now() if tl is not None else 0.0
                    _local_step(step, buffers, ufunc, aliased, schedule.rank)
                    if tl is not None:
                        _note(call, tl, step, i, start, itemsize, tag_base)
                left -= 1  # step i is done: release the steps that waited for it
                for j in dependents[i]:
                    remaining[j] -= 1
                    if not remaining[j]:
                        ready.append(j)
            if left == 0:
                if wsteps is not None:
                    wsteps.finish()
                return
            done = [h for h in pending if h.done]
            if not done and wsteps is not None and wsteps.alone(pending):
                done = list(pending)  # only a window step waits: by itself, it waits faster
            elif not done:
                probe_at, prober = block(
                    transport, call, schedule, pending, list(pending), probe_at, prober
                )
                done = [h for h in pending if h.done]
            for h in done:
                i = pending.pop(h)
                if h.error is not None:
                    err = wrap(schedule.rank, call, steps[i], renumbered(transport, h.error))
                    raise settle(transport, call, schedule, err, prober)
                step = steps[i]
                if step.kind is _RECV_REDUCE:
                    arrived.add(i)
                    if i not in deps_met:
                        continue
                    _combine(step, buffers, staged.pop(i), ufunc, schedule.rank, call)
                elif wsteps is not None and uses_window(step):
                    wsteps.step(step)  # its peer has posted: it runs at once
                if tl is not None:
                    _note(call, tl, step, i, issued.pop(i), itemsize, tag_base)
                left -= 1
                for j in dependents[i]:
                    remaining[j] -= 1
                    if not remaining[j]:
                        ready.append(j)
        if slot is not None:
            slot.pending = slot.steps = None  # all done: the links of watch go with the call
    except BaseException:
        withdraw(transport, call, pending, wsteps)
        if wsteps is not None:
            wsteps.give_up()
        raise
    finally:
        if prober is not None:
            prober.close()


def _window_steps(
    schedule: Schedule,
    buffers: tuple[np.ndarray, np.ndarray, np.ndarray],
    transport: Transport,
    call: Call,
    aliased: bool,
) -> WindowSteps:
    """What runs a mixed schedule's steps on its host's window (Note [mixed schedules]): the
    ``host_window``, or the ``window`` all ranks share (hosts emulated over one machine's)."""
    from plait.runtime.one_sided import WindowSteps  # it builds on this module

    window = getattr(transport, "host_window", None)
    members = None if window is None else window.members  # a host's: by local rank
    if window is None:
        window = getattr(transport, "window", None)  # all ranks': by rank
    if window is None or call.epoch < 0:
        raise InternalError(
            f"rank {schedule.rank}: {call.describe} reads its host's windows, but there are none"
        )
    return WindowSteps(schedule, buffers, window, transport, call, aliased, members)


_SEND, _RECV, _RECV_REDUCE = StepKind.SEND, StepKind.RECV, StepKind.RECV_REDUCE
# schedule id -> (the schedule, its RECV_REDUCE steps); holding the schedule keeps the id its own
_STAGED: dict[int, tuple[Schedule, tuple[int, ...]]] = {}


def _staged_steps(schedule: Schedule) -> tuple[int, ...]:
    """The ``RECV_REDUCE`` steps of ``schedule``, in order (found once per schedule)."""
    hit = _STAGED.get(id(schedule))
    if hit is not None and hit[0] is schedule:
        return hit[1]
    found = tuple(i for i, s in enumerate(schedule.steps) if s.kind is StepKind.RECV_REDUCE)
    remember(_STAGED, id(schedule), schedule, found)
    return found


def _combine(
    step: Step,
    buffers: Sequence[np.ndarray],
    data: np.ndarray,
    ufunc: np.ufunc,
    rank: int,
    call: Call,
) -> None:
    """Fold the staged ``data`` of ``RECV_REDUCE`` ``step`` into its destination."""
    r = step.dst
    if r is None:
        raise malformed(rank, call, step)
    dst = buffers[r.buf][r.offset : r.offset + r.count]
    if step.first:  # Note [one-element folds] in plait.ops
        fold(ufunc, data, dst, dst)
    else:
        fold(ufunc, dst, data, dst)


def run_local(
    steps: Sequence[Step],
    buffers: Sequence[np.ndarray],
    ufunc: np.ufunc,
    aliased: bool,
    rank: int = -1,
) -> None:
    """Run the COPY and REDUCE ``steps`` of a schedule that stays within this rank, in order.

    ``buffers`` as for :func:`execute` (a one-sided schedule's ``SHARED`` after
    them). Any other step raises InternalError.
    """
    for step in steps:
        _local_step(step, buffers, ufunc, aliased, rank)


def _local_step(
    step: Step, buffers: Sequence[np.ndarray], ufunc: np.ufunc, aliased: bool, rank: int
) -> None:
    """One COPY or REDUCE step (see :func:`run_local`)."""
    s, d = step.src, step.dst
    if s is None or d is None or step.kind > StepKind.REDUCE:
        raise InternalError(f"rank {rank}: {step!r} is not a local step with two regions")
    if step.kind is StepKind.COPY:
        # Skipped onto itself (IN and OUT are one memory in place); numpy copies
        # overlapping regions through a temporary.
        if d.offset != s.offset or (d.buf != s.buf and not (aliased and d.buf + s.buf == 1)):
            buffers[d.buf][d.offset : d.offset + d.count] = buffers[s.buf][
                s.offset : s.offset + s.count
            ]
    else:
        src = buffers[s.buf][s.offset : s.offset + s.count]
        dst = buffers[d.buf][d.offset : d.offset + d.count]
        if step.first:  # Note [one-element folds] in plait.ops
            fold(ufunc, src, dst, dst)
        else:
            fold(ufunc, dst, src, dst)


def _note(
    call: Call, tl: Timeline, step: Step, i: int, start: float, itemsize: int, tag_base: int
) -> None:
    """Report step ``i``, from ``start`` to now, to the timeline: its peer by job rank, and
    its communicator, so that a merge joins a group's steps with their own."""
    r = step.dst if step.dst is not None else step.src
    nbytes = r.count * itemsize if r is not None else 0
    rec = call.recorder
    peer = job_rank(rec, step.peer)
    comm = rec.comm if rec is not None else 0
    tl.step(step.kind, peer, nbytes, tag_base + step.tag, i, start, _now(), comm)
