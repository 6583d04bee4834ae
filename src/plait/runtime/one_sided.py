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
    window or waiting for its own timeout (a rank that gave up only because a
    peer had posts ``FOLLOWED``, so that the others name the rank that gave up
    first: Note [who gave up first] in :mod:`plait.runtime.posts`). A rank that posted any has a
    broken communicator and posts nothing more: a peer whose next call waits
    on it finds such a post of an earlier epoch at its first wait and raises
    too (:mod:`plait.runtime.posts`). A wait that stalls probes the call's peers like a
    message call (Note [stall probes] in :mod:`plait.runtime.stall`), and a
    call that fails tells its verdict, so one-sided calls and message calls
    find each other out as well.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from plait.errors import CommError, InternalError
from plait.ops import fold
from plait.runtime.compiled import run_of
from plait.runtime.executor import (
    Call,
    _local_step,
    _note,
    _now,
)
from plait.runtime.posts import (
    ABANDONED,
    GAVE_UP_FROM,
    MISMATCHED,
    await_post,
    begin_call,
    begin_waiting,
    check_peer,
    failed,
    give_up,
    mismatch_behind,
    named,
)
from plait.runtime.stall import settle
from plait.runtime.waits import job_rank, malformed, wrap
from plait.schedule.ir import Schedule, Step, StepKind
from plait.transport.base import Handle, Transport

__all__ = ["ABANDONED", "MISMATCHED", "mismatch_behind", "run_one_sided"]


def run_one_sided(
    schedule: Schedule,
    buffers: tuple[np.ndarray, np.ndarray, np.ndarray],
    transport: Transport,
    call: Call,
    aliased: bool,
) -> None:
    """Run a one-sided schedule in step order over the transport's window (Note [one-sided]).

    Its compiled operations (Note [compiled one-sided schedules] in
    :mod:`plait.runtime.compiled`) run as one generated function (Note [generated runs]):
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
    inp, out, tmp = buffers
    if call.timeline is None:
        try:
            run = run_of(schedule, window, out.dtype)
        except CommError as exc:  # a group's window could not grow, or the transport closed
            # Begun, so that the peers read that this rank gave up on the call.
            begin_call(window, transport, call, schedule)
            err = wrap(schedule.rank, call, "the start of the call", exc)
            raise failed(window, transport, call, schedule, err) from None
        except BaseException:  # out of memory, interrupted: the peers read it too
            with contextlib.suppress(CommError):  # (a failed begin told them itself)
                begin_call(window, transport, call, schedule)
                give_up(window, epoch, None)
            raise
        run(inp, out, tmp, aliased, epoch, call.seq, call.slot, given, call, window, transport)
        return
    half = begin_call(window, transport, call, schedule)
    try:
        _run_steps(schedule, buffers, window, transport, call, half, aliased)
    except CommError as exc:
        found = failed(window, transport, call, schedule, exc)  # tell a mismatch, or find one
        if found is exc:
            raise
        raise found from None
    except BaseException:
        give_up(window, epoch, None)
        raise
    if not schedule.last_phase:  # else its posts said it (Note [window reuse])
        window.end(epoch)


def given(call: Call, epoch: int, seq: int, slot: Any) -> Call:
    """The ``make`` of a generated run whose caller made the call's Call already."""
    return call


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
        _note(call, tl, step, i, begun, buffers[1].dtype.itemsize, call.epoch << 32)


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
            tl = call.timeline
            # The timeline shows a wait where the peer had not posted yet (as waits.block's).
            blocked = _now() if tl is not None and _unposted(window, w, base | step.tag) else 0.0
            await_post(window, self._transport, w, base | step.tag, call, self._schedule, q)
            if blocked:
                assert tl is not None
                tl.wait(blocked, _now(), [job_rank(call.recorder, q)])
            if slot is not None:
                slot.peers = ()
            if w not in self._checked or window.counter(w) >= base | GAVE_UP_FROM:
                names = None if self._index is None else list(self._index)
                check_peer(window, w, half, call, rank, q, names)
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
            self.use(half)  # which may reserve memory: its failure is told as any other
        except CommError as exc:
            err = named(self.rank, call, "the start of the call", exc)
            raise settle(self._transport, call, self._schedule, err) from None

    def use(self, half: int) -> None:
        """Run in ``half`` of the window (the call's epoch has begun)."""
        self.half = half
        dtype = self._bufs[1].dtype
        self._window.reserve(self._shared * dtype.itemsize)  # a group's window grows here
        mine = self._window.typed(self._where(self.rank), half, dtype)
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
        if self.half >= 0:
            give_up(self._window, self._call.epoch, sys.exc_info()[1])


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
    elif step.first:  # Note [one-element folds] in plait.ops
        fold(ufunc, theirs, dst, dst)
    else:
        fold(ufunc, dst, theirs, dst)


def _unposted(window: Any, w: int, value: int) -> bool:
    """Whether window rank ``w`` has not posted ``value`` yet (for the timeline; a released
    window says nothing here: the wait that follows raises what it should)."""
    try:
        return bool(window.counter(w) < value)
    except CommError:
        return False
