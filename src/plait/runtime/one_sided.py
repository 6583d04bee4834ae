"""The executor of one-sided schedules: steps in order, against the transport's window.

Note [one-sided]
    The call is number ``call.epoch`` of the communicator's one-sided calls
    (numbered alike on every rank). ``Window.begin`` picks the half of the
    window that call uses and waits until no peer can still read it; a phase
    ``k`` of the schedule is the counter value ``epoch << 32 | k``, and
    ``Window.end`` marks the call done where the schedule posts nothing (a
    post of a later call says as much: Note [window reuse] in
    :mod:`plait.transport.shm.window`). Once a peer's counter says it reached
    what the call waits for, the call compares the peer's digest of its call
    with ours (at every read of that peer: the digest stays put until every
    rank has ended the call), so ranks in different one-sided calls raise
    MismatchError instead of reading each other's data.

    A rank whose call fails (a mismatch, a lost peer, a timeout) posts the
    phase ``ABANDONED`` of its epoch before it raises (``MISMATCHED``, one
    less, where it found the ranks' calls different): larger than any phase,
    it wakes every peer waiting on it, and a peer that finds it raises at once
    (MismatchError where the digests differ or the rank posted MISMATCHED,
    else PeerLostError naming the rank that gave up) instead of reading its
    window or waiting for its own timeout. A rank that posted either has a
    broken communicator and posts nothing more: a peer whose next call waits
    on it finds such a post of an earlier epoch at its first wait and raises
    too (:mod:`plait.runtime.posts`). A wait that stalls probes the call's peers like a
    message call (Note [stall probes] in :mod:`plait.runtime.stall`), and a
    call that fails tells its verdict, so one-sided calls and message calls
    find each other out as well.

Note [a second look]
    Ranks that run a loop of small calls arrive at each wait nearly together, and a
    peer's post is often a fraction of a microsecond away when a rank first reads its
    counter. The way into :meth:`~plait.transport.window.Window.wait` (probes, deadline,
    the look for a peer that gave up) costs a few microseconds of Python, and the rank
    that pays them arrives late at the next call, where its peer then waits for it: with
    2 ranks about a third of the calls waited so. So a compiled wait reads the counter
    again in place up to ``window.polls`` times before it waits the whole way; that is 0
    (wait at once) where the ranks share cores or are threads of one process, or the
    thread must not spin, since reading on there keeps the peer from running.

Note [compiled one-sided schedules]
    A small call is a few steps, and reading a step's fields, slicing the
    window and looking its views up cost more than the copies themselves. So
    each schedule is compiled once per (window, dtype) into two lists of
    operations, one per half of the window (:class:`Compiled`), whose window
    regions are numpy views made in advance. An operation names its operands
    by their place in a list the call makes once: the caller's buffers, the
    regions of them that are not a whole ``IN`` or ``OUT`` (sliced once per
    call however many operations use them), then the views. An operation on
    a peer keeps the peer's :meth:`~plait.transport.window.Window.probe`, so
    that its counter and digest word are read in place, one subscript each
    (the digest every time: that costs less than remembering which peers
    were checked). The compiled
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
from typing import Any, NamedTuple

import numpy as np

from plait.errors import CommError, InternalError, MismatchError
from plait.runtime.executor import (
    Call,
    _local_step,
    _note,
    _now,
)
from plait.runtime.posts import (
    ABANDONED,
    MISMATCHED,
    await_post,
    begin_waiting,
    check_peer,
    give_up,
    mismatch_behind,
    named,
)
from plait.runtime.stall import settle
from plait.runtime.waits import malformed, wrap
from plait.schedule.ir import SHARED, Region, Schedule, Step, StepKind
from plait.transport.base import Handle, Transport

__all__ = ["ABANDONED", "MISMATCHED", "mismatch_behind", "run_one_sided"]

# Operation codes of a compiled schedule (Note [compiled one-sided schedules]): an operation
# is (code, source, destination, first) and, for those on a peer (from _GET on), (peer, phase,
# (peer,), probe); a _FOLD is (code, left operand, destination, right operand, peer, phase,
# (peer,), probe). The one-tuple is what the flight recorder's slot says the call waits for,
# made once; the probe is where the peer's counter and digest are read (Window.probe).
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

    Its compiled operations (Note [compiled one-sided schedules]) run here, in this frame:
    a loop of small calls spends most of its time in Python around a few numpy operations.
    A wait that blocks says in the recorder's slot whom it waits for, and clears it once
    the peer posted; after a failure the slot keeps the peer for the dump.

    Raises:
        CollectiveTimeout: the deadline passed; the message names the ranks waited on.
        MismatchError: a peer is in a different call.
        PeerLostError: a peer died, closed, or gave up on the call.
    """
    window = getattr(transport, "window", None)
    epoch = call.epoch
    if window is None or epoch < 0:
        raise InternalError(
            f"rank {schedule.rank}: {call.describe} is one-sided but has no shared window"
        )
    try:
        half = window.begin(epoch, call.check, 0.0)  # peers have nearly always ended epoch - 2
        if half < 0:
            half = begin_waiting(window, transport, call, schedule, None)
    except CommError as exc:  # a peer lost, the transport closed; or a timeout, a mismatch
        rank = schedule.rank
        found = settle(transport, call, schedule, named(rank, call, "the start of the call", exc))
        give_up(window, epoch, isinstance(found, MismatchError))
        raise found from None
    try:
        if call.timeline is not None:
            _run_steps(schedule, buffers, window, transport, call, half, aliased)
        else:
            # A loop repeats one call: its operations are the window's last ones (a dtype is
            # one object per kind; another object of an equal dtype looks them up).
            dtype = buffers[1].dtype
            last = getattr(window, "last_compiled", None)
            if last is not None and last[0] is schedule and last[1] is dtype:
                compiled = last[2][half]
            else:
                try:
                    halves = _compiled(schedule, window, dtype)
                except CommError as exc:  # released meanwhile: the transport closed
                    raise wrap(schedule.rank, call, "the start of the call", exc) from None
                window.last_compiled = (schedule, dtype, halves)
                compiled = halves[half]
            ufunc, check = call.ufunc, call.check
            base = epoch << 32
            gave_up = base | MISMATCHED  # a peer's counter from gave_up to ended: it gave up
            ended = base + (1 << 32)  # and from here on it has ended this call
            # The operands: the caller's buffers, its other regions, the window's views.
            v: list[np.ndarray] = []
            if compiled.operands:
                inp, out, _ = buffers
                if inp.size != compiled.counts[0] or out.size != compiled.counts[1]:
                    raise InternalError(
                        f"rank {schedule.rank}: {call.describe}: buffers of {inp.size} and "
                        f"{out.size} elements for a schedule made for {compiled.counts[0]} "
                        f"and {compiled.counts[1]}"
                    )
                v = [*buffers]
                for b, lo, hi in compiled.regions:
                    v.append(buffers[b][lo:hi])
                v += compiled.consts
            for op in compiled.ops:
                code = op[0]
                if code == _POST:
                    window.post(base | op[1])
                    continue
                if code >= _GET:  # GET, GET_REDUCE, WAIT, FOLD: the peer's phase first
                    need = base | op[5]
                    counters, i, digests, j = op[7]  # the peer's words, read in place
                    try:
                        ready = counters[i] >= need
                        if not ready:  # a moment behind, mostly (Note [a second look])
                            for _ in range(window.polls):
                                if counters[i] >= need:
                                    ready = True
                                    break
                    except (TypeError, ValueError):  # released: the wait says why
                        ready = False
                    if not ready:
                        q = op[4]
                        slot = call.slot
                        if slot is not None:
                            slot.peers = op[6]
                        await_post(window, transport, q, need, call, schedule, q)
                        if slot is not None:
                            slot.peers = ()
                    # Its digest is that of this call from its begin until every rank has
                    # ended the call; a counter from gave_up to ended says it gave up on it.
                    try:
                        suspect = digests[j] != check or gave_up <= counters[i] < ended
                    except (TypeError, ValueError):
                        suspect = True
                    if suspect:
                        slot = call.slot
                        if slot is not None:
                            slot.peers = op[6]  # a dump of the failure names the peer
                        check_peer(window, op[4], half, call, schedule.rank)
                        if slot is not None:
                            slot.peers = ()
                    if code == _WAIT:
                        continue
                elif code == _SELF_COPY and aliased:
                    continue  # IN and OUT are one memory
                if code in _COPIES:
                    v[op[2]][...] = v[op[1]]
                elif code == _FOLD:
                    ufunc(v[op[1]], v[op[3]], out=v[op[2]])
                else:
                    dst = v[op[2]]
                    if op[3]:
                        ufunc(v[op[1]], dst, out=dst)
                    else:
                        ufunc(dst, v[op[1]], out=dst)
    except CommError as exc:
        found = settle(transport, call, schedule, exc)  # tell a mismatch, or find one told
        give_up(window, epoch, isinstance(found, MismatchError))
        if found is exc:
            raise
        raise found from None
    except BaseException:
        give_up(window, epoch, False)
        raise
    if not schedule.last_phase:  # else its posts said it (Note [window reuse])
        window.end(epoch)


# -- the compiled form ---------------------------------------------------------------------------


def _compiled(schedule: Schedule, window: Any, dtype: np.dtype) -> tuple[Compiled, Compiled]:
    """The schedule's operations for each half of ``window`` (made once, then cached)."""
    cache: dict[tuple[int, np.dtype], tuple[Schedule, tuple[Compiled, Compiled]]]
    try:
        cache = window.compiled
    except AttributeError:
        cache = window.compiled = {}
    hit = cache.get((id(schedule), dtype))
    if hit is not None and hit[0] is schedule:
        return hit[1]
    if len(cache) >= 256:
        cache.clear()
    halves = (_compile(schedule, window, dtype, 0), _compile(schedule, window, dtype, 1))
    cache[(id(schedule), dtype)] = (schedule, halves)  # keeps the schedule, so the id is its own
    return halves


class Compiled(NamedTuple):
    """One half's compiled operations (Note [compiled one-sided schedules]).

    An operand is an index into the call's operand list: first the caller's
    buffers ``IN``, ``OUT`` and ``TMP`` (a region that is all of ``IN`` or ``OUT``
    is the buffer itself), then its other regions ``regions`` (``(buf, lo,
    hi)``, sliced once per call), then ``consts``, the window's views.
    ``counts``: the sizes of ``IN`` and ``OUT`` the schedule was made for;
    ``operands``: whether any operation has one (a barrier's have none).
    """

    ops: list[tuple[Any, ...]]
    regions: tuple[tuple[int, int, int], ...]
    consts: tuple[np.ndarray, ...]
    counts: tuple[int, int]
    operands: bool


def _compile(schedule: Schedule, window: Any, dtype: np.dtype, half: int) -> Compiled:
    """One half's operations: window regions as views, caller regions resolved per call."""
    rank = schedule.rank
    mine = window.typed(rank, half, dtype)
    regions: dict[tuple[int, int, int], int] = {}
    views: list[np.ndarray] = []

    def operand(r: Region | np.ndarray) -> int:
        # A region of this rank's window or a peer's view: a constant; of IN/OUT/TMP: a
        # region of the caller's buffers. Numbered apart here, renumbered at the end.
        if isinstance(r, np.ndarray):
            views.append(r)
            return -len(views)
        if r.buf is SHARED:
            views.append(mine[r.offset : r.end])
            return -len(views)
        b = int(r.buf)
        if b < 2 and r.offset == 0 and r.count == schedule.buffer_count(r.buf):
            return b  # all of IN or OUT
        key = (b, r.offset, r.end)
        if key not in regions:
            regions[key] = 3 + len(regions)
        return regions[key]

    ops: list[tuple[Any, ...]] = []
    prev: Step | None = None  # the step of ops[-1] while it may fuse with the next
    prev_src = 0  # its source operand
    for step in schedule.steps:
        kind, s, d = step.kind, step.src, step.dst
        if kind is StepKind.POST:
            ops.append((_POST, step.tag))
        elif kind is StepKind.WAIT:
            q = step.peer
            ops.append((_WAIT, 0, 0, False, q, step.tag, (q,), window.probe(q, half)))
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
                own = operand(s)
                x, y = (own, prev_src) if step.first else (prev_src, own)
                q = prev.peer
                ops[-1] = (_FOLD, x, operand(d), y, q, prev.tag, (q,), window.probe(q, half))
                prev = None
                continue
            code = _COPY if kind is StepKind.COPY else _REDUCE
            if code == _COPY and s.buf is not SHARED and d.buf is not SHARED:
                if s.offset == d.offset and s.buf == d.buf:
                    prev = None  # a copy onto itself: nothing to do
                    continue
                if s.offset == d.offset and s.buf + d.buf == 1:
                    code = _SELF_COPY  # IN to OUT or OUT to IN: one memory in place
            prev_src = operand(s)
            ops.append((code, prev_src, operand(d), step.first))
        else:
            q = step.peer
            theirs = operand(window.typed(q, half, dtype)[s.offset : s.end])
            probe = window.probe(q, half)
            if (
                kind is StepKind.GET_REDUCE
                and prev is not None
                and prev.kind is StepKind.COPY
                and prev.dst == d
                and prev.src is not None
            ):
                # dst = src, then dst = theirs ∘ dst (first) or dst ∘ theirs: one fold.
                x, y = (theirs, prev_src) if step.first else (prev_src, theirs)
                ops[-1] = (_FOLD, x, operand(d), y, q, step.tag, (q,), probe)
                prev = None
                continue
            code = _GET if kind is StepKind.GET else _GET_REDUCE
            prev_src = theirs
            ops.append((code, theirs, operand(d), step.first, q, step.tag, (q,), probe))
        prev = step if kind is StepKind.COPY or kind is StepKind.GET else None
    # The views follow the caller's buffers and regions in a call's operand list: view -k
    # sits at n + k - 1.
    n = 3 + len(regions)

    def at(k: Any) -> Any:
        return n - 1 - k if type(k) is int and k < 0 else k

    for i, op in enumerate(ops):
        if op[0] == _FOLD:  # two operands and a destination
            ops[i] = (op[0], at(op[1]), at(op[2]), at(op[3]), *op[4:])
        elif op[0] != _POST:
            ops[i] = (op[0], at(op[1]), at(op[2]), *op[3:])
    counts = (schedule.in_count, schedule.out_count)
    operands = any(op[0] not in (_POST, _WAIT) for op in ops)
    return Compiled(ops, tuple(regions), tuple(views), counts, operands)


# -- step by step, for the timeline ----------------------------------------------------------------


def _run_steps(
    schedule: Schedule,
    buffers: tuple[np.ndarray, np.ndarray, np.ndarray],
    window: Any,
    transport: Transport,
    call: Call,
    half: int,
    aliased: bool,
) -> None:
    """The steps one by one, each reported to the timeline (Note [executor diagnostics])."""
    tl = call.timeline
    assert tl is not None
    run = WindowSteps(schedule, buffers, window, transport, call, aliased, None)
    run.use(half)
    for i, step in enumerate(schedule.steps):
        begun = _now()
        run.step(step)
        _note(tl, step, i, begun, buffers[1].dtype.itemsize, call.epoch << 32)


_WAITS = frozenset((StepKind.GET, StepKind.GET_REDUCE, StepKind.WAIT))


class WindowSteps:
    r"""A call's steps on the window, one at a time: a one-sided call's for the timeline,
    and a mixed call's, which :func:`~plait.runtime.executor.execute` hands over in the
    window's order (Note [mixed schedules] in :mod:`plait.schedule.ir`). A step that must
    wait for a peer's post gets a handle from :meth:`watch` to wait for among the call's
    messages, and runs once it is done.

    ``members``: the rank of each window rank where the window is a host's in a job
    over several (``step.peer`` is then looked up in it); None where they are equal.
    The first step begins the call's epoch (``Window.begin``); :meth:`finish` ends
    it, and :meth:`give_up` posts that the call failed.
    """

    __slots__ = (
        "_aliased",
        "_bufs",
        "_call",
        "_checked",
        "_index",
        "_last_phase",
        "_schedule",
        "_shared",
        "_transport",
        "_watches",
        "_window",
        "half",
        "rank",
    )

    def __init__(
        self,
        schedule: Schedule,
        buffers: tuple[np.ndarray, np.ndarray, np.ndarray],
        window: Any,
        transport: Transport,
        call: Call,
        aliased: bool,
        members: Sequence[int] | None,
    ) -> None:
        self._schedule = schedule
        self._transport = transport
        self.rank = schedule.rank
        self.half = -1
        self._window, self._call, self._aliased = window, call, aliased
        self._bufs: tuple[np.ndarray, ...] = buffers
        self._checked: set[int] = set()
        self._index = None if members is None else {r: i for i, r in enumerate(members)}
        self._shared = schedule.shared_count
        self._last_phase = schedule.last_phase
        self._watches: set[Handle] = set()

    def watch(self, step: Step) -> Handle | None:
        """Whether ``step`` must wait for its peer: None if it can run now, else a handle of
        the transport, done once the peer has posted its phase (a mixed call waits for it
        among its messages; Note [mixed schedules] in :mod:`plait.schedule.ir`)."""
        if step.kind not in _WAITS:
            return None
        if self.half < 0:
            self._begin()
        call = self._call
        try:
            h: Handle | None = self._window.watch(
                self._where(step.peer), (call.epoch << 32) | step.tag
            )
        except CommError as exc:
            err = wrap(self.rank, call, step, exc)
            raise settle(self._transport, call, self._schedule, err) from None
        if h is not None:
            self._watches.add(h)
        return h

    def alone(self, pending: dict[Handle, int]) -> bool:
        """Whether the one handle ``pending`` holds is a watch: nothing else can move, so the
        step waits on the window by itself (a spin on one counter, faster than the transport's
        wait on all its links). The watch is given back; the step is then run as done."""
        if len(pending) != 1:
            return False
        h = next(iter(pending))
        if h not in self._watches:
            return False
        self._watches.discard(h)
        self._window.unwatch(h)
        return True

    def drop(self, pending: dict[Handle, int]) -> None:
        """The call failed: give back its watches that are not done, out of ``pending``."""
        for h in self._watches:
            if not h.done:
                self._window.unwatch(h)
            pending.pop(h, None)
        self._watches.clear()

    def step(self, step: Step) -> None:
        """Run one step that uses the window (or a local one, in a one-sided call).

        Its failure is settled (:func:`~plait.runtime.stall.settle`): the peers that
        wait for this rank's messages in a mixed call hear of a mismatch or a loss."""
        try:
            self._step(step)
        except CommError as exc:
            raise settle(self._transport, self._call, self._schedule, exc) from None

    def _step(self, step: Step) -> None:
        window, call, rank = self._window, self._call, self.rank
        if self.half < 0:
            self._begin()
        half, bufs = self.half, self._bufs
        base = call.epoch << 32
        kind = step.kind
        if kind is StepKind.POST:
            window.post(base | step.tag)
        elif kind is StepKind.COPY or kind is StepKind.REDUCE:
            _local_step(step, bufs, call.ufunc, self._aliased, rank)
        else:
            q = step.peer
            w = self._where(q)
            slot = call.slot
            if slot is not None:
                slot.peers = (q,)  # a dump while it waits names the peer
            await_post(window, self._transport, w, base | step.tag, call, self._schedule, q)
            if slot is not None:
                slot.peers = ()
            if w not in self._checked or window.counter(w) >= base | MISMATCHED:
                check_peer(window, w, half, call, rank, q)
                self._checked.add(w)
            if kind is not StepKind.WAIT:
                view = window.typed(w, half, bufs[1].dtype)
                _get(step, bufs, view, call.ufunc, call, rank)

    def _where(self, q: int) -> int:
        if self._index is None:
            return q
        w = self._index.get(q)
        if w is None:
            raise InternalError(
                f"rank {self.rank}: {self._call.describe}: a one-sided step names rank {q}, "
                "which is not on this host"
            )
        return w

    def _begin(self) -> None:
        window, call = self._window, self._call
        try:
            half = window.begin(call.epoch, call.check, 0.0)
            if half < 0:
                members = None if self._index is None else list(self._index)
                half = begin_waiting(window, self._transport, call, self._schedule, members)
        except CommError as exc:
            err = named(self.rank, call, "the start of the call", exc)
            raise settle(self._transport, call, self._schedule, err) from None
        self.use(half)

    def use(self, half: int) -> None:
        """Run in ``half`` of the window (the call's epoch has begun)."""
        self.half = half
        mine = self._window.typed(self._where(self.rank), half, self._bufs[1].dtype)
        self._bufs = (*self._bufs[:3], mine[: self._shared])

    def finish(self) -> None:
        """The call is done: end its epoch where no post of it said so."""
        if self.half < 0:  # it never reached the window: begin, so that the epochs stay in step
            self._begin()
        if not self._last_phase:
            self._window.end(self._call.epoch)

    def give_up(self) -> None:
        """The call failed: post so (best effort), so that peers waiting on it raise too.

        Only once the epoch has begun (as :func:`run_one_sided`): before, this rank's
        digest word for the half may still be an older call's."""
        if self.half < 0:
            return
        with contextlib.suppress(Exception):
            mismatched = isinstance(sys.exc_info()[1], MismatchError)
            phase = MISMATCHED if mismatched else ABANDONED
            self._window.post((self._call.epoch << 32) | phase)


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
        raise malformed(rank, call, step)
    theirs = view[s.offset : s.offset + s.count]
    dst = bufs[d.buf][d.offset : d.offset + d.count]
    if step.kind is StepKind.GET:
        dst[...] = theirs
    elif step.first:
        ufunc(theirs, dst, out=dst)
    else:
        ufunc(dst, theirs, out=dst)
