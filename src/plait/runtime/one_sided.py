"""The executor of one-sided schedules: steps in order, against the transport's window.

Note [one-sided]
    The call is number ``call.epoch`` of the communicator's one-sided calls
    (numbered alike on every rank). ``Window.begin`` picks the half of the
    window that call uses and waits until no peer can still read it; a phase
    ``k`` of the schedule is the counter value ``epoch << 32 | k``, and
    ``Window.end`` marks the call done where the schedule posts nothing (a
    post of a later call says as much: Note [window reuse] in
    :mod:`plait.transport.shm.window`). The first time the call reads a peer's
    counter it compares the peer's digest of its call with ours, so ranks in
    different one-sided calls raise MismatchError instead of reading each
    other's data.

    A rank whose call fails (a mismatch, a lost peer, a timeout) posts the
    phase ``ABANDONED`` of its epoch before it raises (``MISMATCHED``, one
    less, where it found the ranks' calls different): larger than any phase,
    it wakes every peer waiting on it, and a peer that finds it raises at once
    (MismatchError where the digests differ or the rank posted MISMATCHED,
    else PeerLostError naming the rank that gave up) instead of reading its
    window or waiting for its own timeout.

Note [compiled one-sided schedules]
    A small call is a few steps, and reading a step's fields, slicing the
    window and looking its views up cost more than the copies themselves. So
    each schedule is compiled once per (window, dtype) into two lists of
    operations, one per half of the window, whose window regions are numpy
    views made in advance; only the caller's ``IN`` and ``OUT`` are sliced per
    call, and not at all where a step covers the whole buffer. The compiled
    form is the schedule's steps in order, with nothing added or dropped but
    one thing: a copy into a region followed at once by a reduction into the
    same region from a peer (``COPY`` then ``GET_REDUCE``), or a read from a
    peer followed by a local reduction into it (``GET`` then ``REDUCE``), is
    one *fold*, ``ufunc(x, y, out=dst)`` with the operands in the steps'
    order: the same bits, one pass over the region instead of two (at 4 MiB
    on 2 ranks, a fifth of the bytes the call moves) and one operation fewer.
    Nobody sees the region between the two steps: peers read this rank's
    window only after a ``POST``, and none comes between them. With
    PLAIT_TIMELINE the steps run one by one instead, to be reported. Steps
    between the caller's buffers are compiled like the others, and skipped
    where :func:`~plait.runtime.executor.run_local` skips them: a copy of a
    region onto itself is left out, and a copy from ``IN`` to ``OUT`` at equal
    offsets is skipped by an in-place call (the two are one memory).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from plait.errors import CommError, InternalError, MismatchError, PeerLostError
from plait.runtime.executor import (
    Call,
    _local_step,
    _malformed,
    _note,
    _now,
    _timeout_for,
    _wrap,
)
from plait.schedule.ir import SHARED, Region, Schedule, Step, StepKind
from plait.transport.base import Transport

__all__ = ["ABANDONED", "MISMATCHED", "run_one_sided"]

#: The phase a rank posts when it gives up on a one-sided call (Note [one-sided]).
ABANDONED = (1 << 32) - 1
#: The phase it posts instead when it gave up because the ranks' calls differ.
MISMATCHED = (1 << 32) - 2

# Operation codes of a compiled schedule (Note [compiled one-sided schedules]): an operation
# is (code, source, destination, first) and, for those on a peer (from _GET on), (peer, phase,
# (peer,)); a _FOLD is (code, left operand, destination, right operand, peer, phase, (peer,)).
# The one-tuple is what the flight recorder's slot says the call waits for, made once.
# _SELF_COPY: a _COPY from IN to OUT at equal offsets, skipped in place.
_POST, _COPY, _SELF_COPY, _REDUCE, _GET, _GET_REDUCE, _WAIT, _FOLD = range(8)
_COPIES = (_COPY, _SELF_COPY, _GET)


def run_one_sided(
    schedule: Schedule,
    buffers: tuple[np.ndarray, np.ndarray, np.ndarray],
    transport: Transport,
    call: Call,
    aliased: bool,
) -> None:
    """Run a one-sided schedule in step order over the transport's window (Note [one-sided]).

    Raises:
        CollectiveTimeout: the deadline passed; the message names the ranks waited on.
        MismatchError: a peer is in a different call.
        PeerLostError: a peer died, closed, or gave up on the call.
    """
    window = getattr(transport, "window", None)
    rank = schedule.rank
    if window is None or call.epoch < 0:
        raise InternalError(f"rank {rank}: {call.describe} is one-sided but has no shared window")
    epoch = call.epoch
    slot = call.slot  # the flight recorder's: whom the call waits for
    try:
        half = window.begin(epoch, call.check, call.deadline)
    except CommError as exc:  # a peer lost, the transport closed
        raise _wrap(rank, call, "the start of the call", exc) from None
    if half < 0:
        behind = window.behind((epoch - 1) << 32)
        if slot is not None:
            slot.peers = behind
        raise _timeout_for(rank, call, behind)
    try:
        if call.timeline is None:
            # A loop repeats one call: its operations are the window's last ones (a dtype is
            # one object per kind; another object of an equal dtype looks them up).
            dtype = buffers[1].dtype
            last = getattr(window, "last_compiled", None)
            if last is not None and last[0] is schedule and last[1] is dtype:
                ops = last[2][half]
            else:
                halves = _compiled(schedule, window, dtype)
                window.last_compiled = (schedule, dtype, halves)
                ops = halves[half]
            _run(ops, buffers, window, call, half, aliased, rank)
        else:
            _run_steps(schedule, buffers, window, call, half, aliased)
    except BaseException:
        with contextlib.suppress(Exception):  # best effort: the transport may be gone
            mismatched = isinstance(sys.exc_info()[1], MismatchError)
            window.post((epoch << 32) | (MISMATCHED if mismatched else ABANDONED))
        raise
    if not schedule.last_phase:  # else its posts said it (Note [window reuse])
        window.end(epoch)
    if slot is not None:
        slot.peers = ()


# -- the compiled form ---------------------------------------------------------------------------


def _compiled(
    schedule: Schedule, window: Any, dtype: np.dtype
) -> tuple[list[tuple[Any, ...]], ...]:
    """The schedule's operations for each half of ``window`` (made once, then cached)."""
    cache: dict[tuple[int, np.dtype], tuple[Schedule, tuple[list[tuple[Any, ...]], ...]]]
    try:
        cache = window.compiled
    except AttributeError:
        cache = window.compiled = {}
    hit = cache.get((id(schedule), dtype))
    if hit is not None and hit[0] is schedule:
        return hit[1]
    if len(cache) >= 256:
        cache.clear()
    halves = tuple(_compile(schedule, window, dtype, h) for h in (0, 1))
    cache[(id(schedule), dtype)] = (schedule, halves)  # keeps the schedule, so the id is its own
    return halves


def _compile(schedule: Schedule, window: Any, dtype: np.dtype, half: int) -> list[tuple[Any, ...]]:
    """One half's operations: window regions as views, ``IN``/``OUT`` as (buf, lo, hi)."""
    rank = schedule.rank
    mine = window.typed(rank, half, dtype)

    def local(r: Region) -> Any:
        # A region of this rank's window: its view; of IN/OUT/TMP: where to slice per call.
        if r.buf is SHARED:
            return mine[r.offset : r.end]
        return (int(r.buf), r.offset, r.end)

    ops: list[tuple[Any, ...]] = []
    prev: Step | None = None  # the step of ops[-1] while it may fuse with the next
    for step in schedule.steps:
        kind, s, d = step.kind, step.src, step.dst
        if kind is StepKind.POST:
            ops.append((_POST, step.tag))
        elif kind is StepKind.WAIT:
            ops.append((_WAIT, None, None, False, step.peer, step.tag, (step.peer,)))
        elif s is None or d is None:
            raise InternalError(f"rank {rank}: {step!r} lacks a region a {kind.name} step needs")
        elif kind is StepKind.COPY or kind is StepKind.REDUCE:
            if (
                kind is StepKind.REDUCE
                and prev is not None
                and prev.kind is StepKind.GET
                and prev.dst == d
                and prev.src is not None
            ):
                # dst = theirs, then dst = src ∘ dst (first) or dst ∘ src: one fold.
                theirs = ops[-1][1]
                x, y = (local(s), theirs) if step.first else (theirs, local(s))
                ops[-1] = (_FOLD, x, local(d), y, prev.peer, prev.tag, (prev.peer,))
                prev = None
                continue
            code = _COPY if kind is StepKind.COPY else _REDUCE
            if code == _COPY and s.buf is not SHARED and d.buf is not SHARED:
                if s.offset == d.offset and s.buf == d.buf:
                    prev = None  # a copy onto itself: nothing to do
                    continue
                if s.offset == d.offset and s.buf + d.buf == 1:
                    code = _SELF_COPY  # IN to OUT or OUT to IN: one memory in place
            ops.append((code, local(s), local(d), step.first))
        else:
            theirs = window.typed(step.peer, half, dtype)[s.offset : s.end]
            if (
                kind is StepKind.GET_REDUCE
                and prev is not None
                and prev.kind is StepKind.COPY
                and prev.dst == d
                and prev.src is not None
            ):
                # dst = src, then dst = theirs ∘ dst (first) or dst ∘ theirs: one fold.
                own = local(prev.src)
                x, y = (theirs, own) if step.first else (own, theirs)
                ops[-1] = (_FOLD, x, local(d), y, step.peer, step.tag, (step.peer,))
                prev = None
                continue
            code = _GET if kind is StepKind.GET else _GET_REDUCE
            ops.append((code, theirs, local(d), step.first, step.peer, step.tag, (step.peer,)))
        prev = step if kind is StepKind.COPY or kind is StepKind.GET else None
    return ops


def _run(
    ops: Sequence[tuple[Any, ...]],
    buffers: tuple[np.ndarray, np.ndarray, np.ndarray],
    window: Any,
    call: Call,
    half: int,
    aliased: bool,
    rank: int,
) -> None:
    """Run compiled operations (Note [compiled one-sided schedules])."""
    ufunc, deadline, slot = call.ufunc, call.deadline, call.slot
    base = call.epoch << 32
    gave_up = base | MISMATCHED  # a peer's counter from here on: it gave up on this call
    checked = 0  # bit q: rank q's digest was compared
    for op in ops:
        code = op[0]
        if code == _POST:
            window.post(base | op[1])
            continue
        if code >= _GET:  # GET, GET_REDUCE, WAIT, FOLD: the peer's phase first
            q = op[4]
            if slot is not None:
                slot.peers = op[6]
            try:
                arrived = window.wait(q, base | op[5], deadline)
            except CommError as exc:
                raise _wrap(rank, call, f"a wait for rank {q}", exc) from None
            if not arrived:
                raise _timeout_for(rank, call, [q])
            if not checked >> q & 1 or window.counter(q) >= gave_up:
                _check_peer(window, q, half, call, rank)
                checked |= 1 << q
            if code == _WAIT:
                continue
        elif code == _SELF_COPY and aliased:
            continue  # IN and OUT are one memory
        # A caller's region (b, lo, hi) is sliced per call: the buffer itself when that is
        # all of it (_part, inlined)
        src, dst = op[1], op[2]
        if type(src) is tuple:
            b, lo, hi = src
            src = buffers[b]
            if lo or hi != src.size:
                src = src[lo:hi]
        if type(dst) is tuple:
            b, lo, hi = dst
            dst = buffers[b]
            if lo or hi != dst.size:
                dst = dst[lo:hi]
        if code in _COPIES:
            dst[...] = src
        elif code == _FOLD:
            right = op[3]
            if type(right) is tuple:
                right = _part(buffers, right)
            ufunc(src, right, out=dst)
        elif op[3]:
            ufunc(src, dst, out=dst)
        else:
            ufunc(dst, src, out=dst)


def _part(buffers: Sequence[np.ndarray], where: tuple[int, int, int]) -> np.ndarray:
    """Elements ``lo:hi`` of the caller's buffer ``b`` (the buffer itself when that is all)."""
    b, lo, hi = where
    whole = buffers[b]
    return whole if lo == 0 and hi == whole.size else whole[lo:hi]


def _check_peer(window: Any, q: int, half: int, call: Call, rank: int) -> None:
    """Raise unless rank ``q`` is in this call and has not given up on it (Note [one-sided])."""
    digest, counter = window.peer_state(q, half)
    if digest != call.check:
        raise MismatchError(
            f"rank {rank}: {call.describe}: rank {q} is in a different call "
            "(its parameters' digest differs from this rank's)"
        )
    # Only this call's: a peer that gave up on a later call has finished this one.
    if counter == (call.epoch << 32) | MISMATCHED:
        raise MismatchError(
            f"rank {rank}: {call.describe}: rank {q} found that the ranks called different "
            "collectives (its own message says what differs)"
        )
    if counter == (call.epoch << 32) | ABANDONED:
        raise PeerLostError(
            f"rank {rank}: {call.describe}: rank {q} gave up on the call after an "
            "error of its own (see its message)"
        )


# -- step by step, for the timeline ----------------------------------------------------------------


def _run_steps(
    schedule: Schedule,
    buffers: tuple[np.ndarray, np.ndarray, np.ndarray],
    window: Any,
    call: Call,
    half: int,
    aliased: bool,
) -> None:
    """The steps one by one, each reported to the timeline (Note [executor diagnostics])."""
    rank, deadline, ufunc, tl = schedule.rank, call.deadline, call.ufunc, call.timeline
    assert tl is not None
    dtype = buffers[1].dtype
    bufs = (*buffers, window.typed(rank, half, dtype)[: schedule.shared_count])
    base = call.epoch << 32
    checked: set[int] = set()
    for i, step in enumerate(schedule.steps):
        begun = _now()
        kind = step.kind
        if kind is StepKind.POST:
            window.post(base | step.tag)
        elif kind is StepKind.COPY or kind is StepKind.REDUCE:
            _local_step(step, bufs, ufunc, aliased, rank)
        else:
            q = step.peer
            try:
                arrived = window.wait(q, base | step.tag, deadline)
            except CommError as exc:
                raise _wrap(rank, call, step, exc) from None
            if not arrived:
                raise _timeout_for(rank, call, [q])
            if q not in checked or window.counter(q) >= base | MISMATCHED:
                _check_peer(window, q, half, call, rank)
                checked.add(q)
            if kind is not StepKind.WAIT:
                _get(step, bufs, window.typed(q, half, dtype), ufunc, call, rank)
        _note(tl, step, i, begun, dtype.itemsize, base)


def _get(
    step: Step,
    bufs: Sequence[np.ndarray],
    view: np.ndarray,
    ufunc: Any,
    call: Call,
    rank: int,
) -> None:
    """A GET or GET_REDUCE step from a peer's typed ``view``."""
    s, d = step.src, step.dst
    if s is None or d is None:
        raise _malformed(rank, call, step)
    theirs = view[s.offset : s.offset + s.count]
    dst = bufs[d.buf][d.offset : d.offset + d.count]
    if step.kind is StepKind.GET:
        dst[...] = theirs
    elif step.first:
        ufunc(theirs, dst, out=dst)
    else:
        ufunc(dst, theirs, out=dst)
