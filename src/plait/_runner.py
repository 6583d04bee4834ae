"""The call runner: numbers a communicator's calls and runs them, now or on its worker.

Every rank numbers its calls alike (the number goes into every wire tag, Note [wire
tags] in :mod:`plait.group`), so numbers are taken on the calling thread, in program
order, under a lock. A blocking call then runs there; an ``async_op=True`` call runs on
the communicator's :class:`~plait.runtime.work.Worker` thread behind a :class:`~plait.Work`.
The first :class:`~plait.errors.CommError`, or any error that ends a call midway
(Note [errors of a rank's own] in :mod:`plait._failures`), leaves the communicator
*broken*: the ranks may disagree about what completed, so every later call refuses.

Every call is recorded by the communicator's :class:`~plait.diagnostics.recorder.FlightRecorder`
(unless PLAIT_RECORDER_SIZE=0): :meth:`CallRunner.start` fills the call's slot when it takes
its number, the executor links the slot to its unfinished handles, and :meth:`CallRunner._run`
ends it on every path out. A timeout, a lost peer or a mismatch dumps the recorder, and the
error names the file (docs/debugging.md).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from plait._checks import check_async, check_timeout
from plait._failures import gave_up
from plait._request import Plan, Request
from plait._signature import check_call, run_check, signature
from plait._turns import wait_turn
from plait.diagnostics.frames import runs_calls
from plait.diagnostics.recorder import FlightRecorder, Slot
from plait.diagnostics.triggers import dump_on_error
from plait.errors import (
    AbortedError,
    ClosedError,
    CommError,
    ForkedError,
    InternalError,
    MismatchError,
    PeerLostError,
    UnsupportedError,
)
from plait.group import collective_tag, crossings, probe_tag
from plait.runtime.executor import Call, execute, run_local
from plait.runtime.line import run_line
from plait.runtime.one_sided import mismatch_behind, run_one_sided
from plait.runtime.scratch import PerThread, Workspace, quiet, restore
from plait.runtime.work import LazyWorker, Work, let_go
from plait.transport.base import Transport

if TYPE_CHECKING:
    from plait._edge import CollectiveMethods

__all__ = ["CallRunner"]

#: plait's logger: auto's choices and, with PLAIT_DEBUG=detail, every call's signature.
_log = logging.getLogger("plait")
Label = tuple[str, str, int]  # a call's collective, algorithm and number (Call.label)
_monotonic = time.monotonic


class CallRunner:
    """Takes sequence numbers, runs requests and keeps the closed and broken state.

    One per communicator. ``seq`` is the number the next call takes; ``broken`` is the
    error that made the communicator unusable (None while it is usable); ``detail`` is
    PLAIT_DEBUG=detail (compare every call across ranks first); ``recorder`` is the
    communicator's flight recorder (None when PLAIT_RECORDER_SIZE=0) and ``timeline`` the
    rank's PLAIT_TIMELINE trace (None unless set, or without a recorder, which reports the
    calls to it). ``world_rank`` is the rank of the process in the world communicator: a
    split's calls go to its parent's timeline. Raises ValueError where a PLAIT_RECORDER_*
    or PLAIT_TIMELINE_EVENTS setting is invalid.
    """

    __slots__ = (
        "__weakref__",  # Note [crossed calls] in plait.runtime.crossing
        "_comm_id",
        "_gate",
        "_gate_waiters",
        "_lock",
        "_probe_tag",
        "_rank",
        "_reserving",
        "_size",
        "_transport",
        "_window",
        "_worker",
        "_workspaces",
        "aborted",
        "broken",
        "closed",
        "detail",
        "epoch",
        "hear",
        "plain",
        "recorder",
        "seq",
        "timeline",
        "timeout",
        "turn",
    )

    def __init__(
        self,
        transport: Transport,
        comm_id: int,
        timeout: float,
        detail: bool,
        world_rank: int | None = None,
    ) -> None:
        self._transport = transport
        # Shared by all its ranks: one-sided calls run there (Note [mixed schedules])
        self._window: Any = getattr(transport, "window", None)
        self._rank = transport.rank
        self._size = transport.size
        self._comm_id = comm_id
        self._probe_tag = probe_tag(comm_id)  # Note [stall probes] in plait.runtime.stall
        crossings(self, transport, comm_id)
        self.timeout = timeout
        self.detail = detail
        self.seq = 0
        # One-sided calls (Note [one-sided] in plait.runtime.executor) take their own
        # numbers, ``epoch``, and run in that order: ``turn`` is the next one to run, and
        # only a call that got its turn passes it on (Note [a turn given up] in plait._turns).
        self.epoch = 0
        self.turn = 0
        self._gate = threading.Condition(threading.Lock())
        self._gate_waiters = 0  # threads waiting for their turn (notified only then)
        self.closed = False
        self.broken: BaseException | None = None
        # Why it was aborted (plait._recovery sets it, with broken); ``hear``: a failed call
        # asks for an abort not yet heard (Note [an abort heard late]).
        self.aborted: str | None = None
        self.hear: Callable[[], None] | None = None
        self._lock = threading.RLock()  # Note [an interrupt under the lock] in runtime.work
        self._worker = LazyWorker(f"plait-rank{self._rank}")  # (Note [one worker])
        self._workspaces = PerThread()  # one Workspace per thread that runs calls
        self._reserving = 0  # threads running a compressor's calls now (reserved())
        world = self._rank if world_rank is None else world_rank
        from plait.diagnostics.timeline import Timeline  # here, not on import: python -m runs it

        self.recorder = FlightRecorder.from_env(
            self._rank, self._size, comm_id, timeline=Timeline.from_env(world)
        )
        self.timeline = self.recorder.timeline if self.recorder is not None else None
        self._replan()  # plain: whether a call may take a short path (as it says)

    def _replan(self) -> None:
        """Set :attr:`plain` from what it says (under the lock where that changes)."""
        self.plain = not self.detail and self.timeline is None and not self._reserving

    def short_path(self, plan: Plan) -> Callable[[Request, int], Any] | None:
        """The frame that runs a plain call of ``plan`` whole, or None: a caller that knows
        the call is blocking, with the communicator's timeout and no copy back, calls it
        while :attr:`plain` is true, with the ``skip`` it would pass :meth:`start`."""
        if plan.windowed and self._window is not None:
            return self._run_window
        if plan.line is not None:
            return self._run_straight
        return self._run_alone if plan.alone else None

    def close(self) -> None:
        """Finish queued async calls, then release the transport (call once)."""
        self._worker.close()
        self.closed = True
        self._transport.close()

    def check_usable(self, c: str) -> None:
        """Raise ClosedError after close (AbortedError if aborted), CommError after a failure."""
        if self.closed and self.aborted is None:  # aborted, then closed: why it was aborted
            raise ClosedError(f"rank {self._rank}: {c} on a closed communicator")
        if self.aborted is not None:
            raise AbortedError(f"rank {self._rank}: {c}: {self.aborted}")
        if isinstance(self.broken, ForkedError):  # (Note [communicators after fork]) as it is
            raise ForkedError(f"rank {self._rank}: {c}: {str(self.broken).partition(': ')[2]}")
        if self.broken:
            raise CommError(
                f"rank {self._rank}: {c}: this communicator is unusable after an earlier "
                f"failure ({self.broken}); create a new one"
            )

    def seconds(self, timeout: float | None, c: str) -> float:
        """A call's ``timeout=``, checked, or the communicator's default."""
        return (
            self.timeout if timeout is None else check_timeout(timeout, f"rank {self._rank}: {c}")
        )

    def start(
        self,
        req: Request,
        timeout: float | None,
        async_op: bool,
        comm: CollectiveMethods,
        skip: int = 3,
    ) -> Any:
        """Number ``req`` and run it: return its result, or a Work for ``async_op``.

        ``comm`` is the communicator the call came to: PLAIT_DEBUG=detail compares the call
        across ranks through its allgather first. ``skip`` is how far out from the recorder's
        ``begin`` the user's frame is: 3 when the collective method calls this directly
        (begin, start, the method), 4 through ``CollectiveMethods._collective``; a wrong
        guess costs the recorder a short walk, never a wrong line.
        """
        spec, plan = req.spec, req.plan
        if async_op is not False and async_op is not True:  # bad input, or numpy's bool
            async_op = check_async(async_op, f"rank {self._rank}: {spec.collective}")
        if timeout is None and not async_op and req.writeback is None and self.plain:
            go = self.short_path(plan)  # a plain call: its plan may have a short path
            if go is not None:
                return go(req, skip + 1)
        c = plan.named
        # self.seconds(timeout, c), inlined: this runs on every call
        seconds = (
            self.timeout if timeout is None else check_timeout(timeout, f"rank {self._rank}: {c}")
        )
        if self.detail and (held := getattr(self._workspaces, "checking", None)) is not None:
            return run_check(req, *held)  # the check's own allgather (plait._signature)
        # A compressed async allreduce reserved its calls' numbers (see submit_reserved).
        pinned = self._workspaces.pinned if self._reserving else None
        one_sided = plan.schedule.one_sided or plan.schedule.mixed  # it takes an epoch
        if one_sided and pinned is not None:
            # Its epoch would be taken on the worker, out of program order.
            raise UnsupportedError(
                f"rank {self._rank}: {c}: a one-sided algorithm ({spec.name}) cannot run "
                "inside a compressed asynchronous allreduce"
            )
        lock = self._lock
        try:  # Note [an interrupt under the lock]
            lock.acquire()
            if self.closed or self.broken is not None:
                self.check_usable(c)
            if pinned is None:
                seq = wire = self.seq
                self.seq += 1
                if self.detail:  # 2n for the check, 2n + 1 (Note [the detail check])
                    seq, wire = seq >> 1, self.seq
                    self.seq += 1
            elif pinned:
                seq = wire = pinned.pop()
            else:
                raise InternalError(
                    f"rank {self._rank}: {c}: a compressor made more calls than it reserved"
                )
            epoch = -1
            if one_sided:
                epoch = self.epoch
                self.epoch += 1
            lock.release()
        except BaseException:
            let_go(lock)
            raise
        describe = (c, spec.name, seq)  # formatted only when needed
        if self.detail:
            _log.debug("rank %d: %s: %s", self._rank, _describe(describe), signature(req))
        rec = self.recorder
        if not async_op:
            slot = None
            if rec is not None:
                slot = rec.ring[seq % rec.capacity]
                if slot.end == 0.0 or slot.extra:
                    slot = rec.begin(plan.shape, seq, skip)
                else:  # rec.begin for a slot of a plain call, written out (Note [recorder cost])
                    slot.seq = seq
                    slot.shape = plan.shape
                    slot.start = _monotonic()
                    slot.end = 0.0  # in flight from here (FlightRecorder.begin says why last)
            if self.detail:
                check_call(self, req, wire - 1, seconds, describe, slot, comm)
            return self._run(req, seq, seconds, describe, slot, epoch, wire)  # ends the slot
        work = Work(f"rank {self._rank}: {_describe(describe)}", comm)
        worker = self._worker.get()  # None once close() has begun
        # Nothing that can fail comes between begin and the job that ends the slot (the
        # check ends it where it fails).
        queued = rec.begin(plan.shape, seq, skip, True) if rec is not None else None
        if self.detail:
            check_call(self, req, wire - 1, seconds, describe, queued, comm)

        def job() -> None:
            try:
                if queued is not None and rec is not None:
                    rec.started(queued)
                work._finish(self._run(req, seq, seconds, describe, queued, epoch, wire))
            except BaseException as exc:
                work._finish(error=exc)

        if worker is None or not worker.submit(job, work):  # close() has begun
            exc = ClosedError(f"rank {self._rank}: {c} on a communicator being closed")
            if queued is not None and rec is not None:
                rec.end(queued, exc)
            raise exc
        return work

    def reserved(self) -> bool:
        """Whether this thread runs a compressor's calls now (:meth:`submit_reserved` or
        :meth:`compressing`): ``auto`` then picks message-passing algorithms only, so that a
        compressed call gives the same bits whether it runs blocking or on the worker."""
        if not self._reserving:  # no thread does: skip the per-thread lookup
            return False
        return self._workspaces.pinned is not None or self._workspaces.compressing

    def compressing(self, fn: Callable[[], Any]) -> Any:
        """Run a blocking compressed call's ``fn`` here, as :meth:`reserved` says."""
        w = self._workspaces
        self._reserve(1)
        w.compressing = True
        try:
            return fn()
        finally:
            w.compressing = False
            self._reserve(-1)

    def _reserve(self, threads: int) -> None:
        """Count ``threads`` more (or fewer) threads running a compressor's calls."""
        with self._lock:
            self._reserving += threads
            self._replan()

    def submit_reserved(self, work: Work, calls: int, c: str, fn: Callable[[], Any]) -> None:
        """Reserve the next ``calls`` numbers now; run ``fn`` on the worker with them.

        The calls ``fn`` makes take the reserved numbers in order (numbers
        left unused are skipped alike on every rank); ``work`` gets its result.
        """
        with self._lock:
            self.check_usable(c)
            seqs = list(range(self.seq + calls - 1, self.seq - 1, -1))  # popped from the end
            self.seq += calls
        worker = self._worker.get()

        def job() -> None:
            reserved = False
            try:
                self._reserve(1)
                reserved = True
                self._workspaces.pinned = seqs
                work._finish(fn())
            except BaseException as exc:
                work._finish(error=exc)
            finally:
                self._workspaces.pinned = None
                if reserved:
                    self._reserve(-1)

        if worker is None or not worker.submit(job, work):
            raise ClosedError(f"rank {self._rank}: {c} on a communicator being closed")

    @runs_calls  # the recorder finds a call in flight by this frame (plait.diagnostics.frames)
    def _run(
        self,
        req: Request,
        seq: int,
        seconds: float,
        describe: Label,
        slot: Slot | None,
        epoch: int = -1,
        wire: int | None = None,
    ) -> Any:
        """Run ``req`` as call number ``seq``; end its recorder ``slot`` on every way out.

        ``epoch``: its number among the one-sided calls (-1: not one), which run in
        that order (an asynchronous one may still be running on the worker); ``wire``, its
        number in its tags (None: ``seq``; Note [the detail check] in plait._signature).
        """
        if wire is None:
            wire = seq
        rec = self.recorder
        if epoch >= 0 and self.turn != epoch:  # raises where it does not come: no turn to pass on
            wait_turn(self, epoch, seconds, describe, req, slot, wire)
        try:
            if self.broken is not None or self.closed:
                self.check_usable(req.plan.named)
            plan = req.plan
            schedule = plan.schedule
            ufunc = plan.ufunc
            token = quiet() if plan.guard else None  # Note [quiet reductions]
            try:
                if req.aliased and plan.void_in_place:
                    pass
                elif plan.local and not schedule.tmp_count:  # one rank: no transport, no scratch
                    run_local(schedule.steps, (req.inp, req.out), ufunc, req.aliased, self._rank)
                else:
                    if schedule.tmp_count or schedule.staged_count:
                        workspace = self._workspaces.ws
                        if workspace is None:  # first call on this thread
                            workspace = self._workspaces.ws = Workspace()
                        tmp, staging = workspace.pair(
                            schedule.tmp_count, schedule.staged_count, req.out.dtype
                        )
                    else:
                        tmp, staging = _NO_TMP, None
                    call = _new(  # Call(...), without the keyword machinery
                        Call,
                        (
                            describe,
                            0 if schedule.one_sided else collective_tag(self._comm_id, wire),
                            plan.check,
                            ufunc,
                            # The recorder read the clock as the call began (Note [recorder
                            # cost])
                            (slot.start if slot is not None else _monotonic()) + seconds,
                            slot,
                            rec,
                            self.timeline,
                            epoch,
                            wire,
                            self._probe_tag,
                        ),
                    )
                    buffers = (req.inp, req.out, tmp)
                    if schedule.one_sided and self._window is not None:
                        run_one_sided(schedule, buffers, self._transport, call, req.aliased)
                    else:
                        execute(schedule, buffers, self._transport, call, staging, req.aliased)
                if req.average and req.out.size:
                    np.divide(req.out, self._size, out=req.out)
            except CommError as exc:
                raise self._failed(exc, req, describe, slot) from exc.__cause__
            finally:
                if token is not None:
                    restore(token)
            if req.writeback is not None:
                req.writeback[...] = req.out.reshape(req.writeback.shape)
        except BaseException as exc:
            self._left(exc, req, describe, slot)
            raise
        finally:
            if epoch >= 0:
                # A waiter counts itself under the gate's lock before it tests its turn,
                # so it either sees this store or is counted here and notified.
                self.turn = epoch + 1
                if self._gate_waiters:
                    with self._gate:
                        self._gate.notify_all()
        if slot is not None:
            # FlightRecorder.end for a call that ended well, written out (Note [recorder cost])
            slot.end = _monotonic()
            timeline = self.timeline
            if timeline is not None and rec is not None:
                timeline.call(slot, rec)
        return req.result

    def _left(self, exc: BaseException, req: Request, label: Label, slot: Slot | None) -> None:
        """End the slot of call ``label``, which raised ``exc``; an error of this rank's own
        breaks the communicator and is told (Note [errors of a rank's own] in plait._failures)."""
        rec = self.recorder
        if slot is not None and rec is not None and slot.end == 0.0:  # not ended already
            rec.end(slot, exc)
        if not (isinstance(exc, CommError) or req.plan.local or self.broken is not None):
            t, r = self._transport, self._rank
            self.broken = gave_up(t, r, self._size, self._probe_tag, req, label, exc)

    def _failed(
        self, exc: CommError, req: Request, describe: Label, slot: Slot | None, said: bool = False
    ) -> CommError:
        """What call ``req`` raises after ``exc``: the communicator broken, the slot ended and
        dumped, and the message saying what it can (``said``: it names every call already)."""
        if self.aborted is None and self.hear is not None:
            self.hear()
        if self.aborted is not None:  # every rank is marked before any closes (plait._recovery)
            exc = AbortedError(f"rank {self._rank}: {_describe(describe)}: {self.aborted}")
        elif isinstance(exc, PeerLostError) and self._window is not None:
            # The rank lost may have left over a mismatch it found first.
            found = mismatch_behind(self._window, self._rank, _describe(describe), self.epoch)
            if found is not None:
                exc = found
        self.broken = exc
        notes = []
        if isinstance(exc, MismatchError) and not said:
            # The transport knows only that the digests differ; this rank knows its call.
            notes.append(f"this rank called {signature(req)}")
            if not self.detail:
                notes.append("set PLAIT_DEBUG=detail to compare every rank's call")
        if req.writes_caller_memory:
            notes.append("the output buffer's contents are undefined")
        rec = self.recorder
        if slot is not None and rec is not None:
            rec.end(slot, exc)  # before the dump, which then shows the failure
            path = dump_on_error(rec, exc)
            if path is not None:
                notes.append(f"flight recorder dump: {path}")
        if not notes:
            return exc
        noted = type(exc)("; ".join([str(exc), *notes]))
        noted.__dict__.update(exc.__dict__)  # PeerLostError.lost_rank
        return noted

    # Note [the one-sided short path]
    #     A loop of one-sided calls (the arena algorithms of one host) spends most of its
    #     time in Python around a few numpy operations, and two frames of the call runner
    #     (start and _run) with their general cases were about a tenth of a 2-rank 8-byte
    #     allreduce (docs/performance.md). A blocking one-sided call without scratch memory
    #     or an average to take, its timeout the communicator's, with no result to copy back,
    #     on a runner that is plain (no PLAIT_DEBUG=detail, no timeline, no compressor's
    #     reserved numbers) is run by _run_window: the steps of start and _run (number and
    #     epoch under the lock, the recorder's slot, its turn among the one-sided calls, the
    #     quiet reductions, failures through _failed, the turn passed on however it ends) in
    #     one frame, which calls the schedule's generated run (Note [generated runs] in
    #     plait.runtime.compiled) directly, with _call as the maker of its Call: most
    #     calls wait for nobody and need none. short_path names such frames; start, or the
    #     edge for a kept request (Note [the short path] in plait._shortcut), calls them.

    @runs_calls  # as _run: the recorder finds a call in flight by this frame
    def _run_window(self, req: Request, skip: int) -> Any:
        """:meth:`start` and :meth:`_run` of a plain one-sided call, in one frame (Note
        [the one-sided short path])."""
        plan = req.plan
        lock = self._lock
        try:  # Note [an interrupt under the lock]
            lock.acquire()
            if self.closed or self.broken is not None:
                self.check_usable(plan.named)
            seq = self.seq
            self.seq = seq + 1
            epoch = self.epoch
            self.epoch = epoch + 1
            lock.release()
        except BaseException:
            let_go(lock)
            raise
        rec = self.recorder
        slot = None
        if rec is not None:
            slot = rec.ring[seq % rec.capacity]
            if slot.end == 0.0 or slot.extra:
                slot = rec.begin(plan.shape, seq, skip)
            else:  # as in start (Note [recorder cost])
                slot.seq = seq
                slot.shape = plan.shape
                slot.start = _monotonic()
                slot.end = 0.0
        if self.turn != epoch:  # as in _run
            wait_turn(self, epoch, self.timeout, _label(plan, seq), req, slot, seq)
        token = None
        try:
            if self.broken is not None or self.closed:
                self.check_usable(plan.named)
            token = quiet() if plan.guard else None  # Note [quiet reductions]
            schedule, out, window = plan.schedule, req.out, self._window
            last = getattr(window, "last_compiled", None)  # run_of's first look, inlined
            try:
                if last is not None and last[0] is schedule and last[1] is out.dtype:
                    last[2](
                        req.inp, out, _NO_TMP, req.aliased, epoch, seq, slot, self._call, plan,
                        window, self._transport,
                    )  # fmt: skip
                else:  # compiled first (its window may grow), and cached for the next call
                    call = self._call(plan, epoch, seq, slot)
                    run_one_sided(
                        schedule, (req.inp, out, _NO_TMP), self._transport, call, req.aliased
                    )
            except CommError as exc:
                raise self._failed(exc, req, _label(plan, seq), slot) from exc.__cause__
        except BaseException as exc:
            self._left(exc, req, _label(plan, seq), slot)
            raise
        finally:
            if token is not None:
                restore(token)
            self.turn = epoch + 1  # as in _run
            if self._gate_waiters:
                with self._gate:
                    self._gate.notify_all()
        if slot is not None:
            slot.end = _monotonic()
        return req.result

    def _call(self, plan: Plan, epoch: int, seq: int, slot: Slot | None) -> Call:
        """The :class:`Call` of a one-sided call, for a generated run's slow way (without
        a recorder's slot, its deadline counts from then)."""
        deadline = (slot.start if slot is not None else _monotonic()) + self.timeout
        rec = self.recorder if slot is not None else None
        fields = (_label(plan, seq), 0, plan.check, plan.ufunc, deadline, slot, rec, None)
        return _new(Call, (*fields, epoch, seq, self._probe_tag))

    # Note [the straight-line short path]
    #     The same for a message-passing call that runs in a straight line (the small calls
    #     between hosts, Note [straight-line schedules]): under the one-sided short path's
    #     conditions, a call whose plan has a straight-line order (no average to take) is
    #     run by _run_straight: it numbers it, opens its recorder slot, carves its scratch
    #     and hands the order to run_line, without start's general cases, _run's, and
    #     execute's choice (2 µs less per 2-rank 8-byte call over TCP: docs/performance.md).

    @runs_calls  # as _run: the recorder finds a call in flight by this frame
    def _run_straight(self, req: Request, skip: int) -> Any:
        """:meth:`start` and :meth:`_run` of a plain straight-line call, in one frame (Note
        [the straight-line short path])."""
        spec, plan = req.spec, req.plan
        seq = self._number(plan.named)
        describe = (plan.named, spec.name, seq)
        rec = self.recorder
        slot = None if rec is None else self._open(rec, plan, seq, skip)
        token = None
        try:
            schedule = plan.schedule
            token = quiet() if plan.guard else None  # Note [quiet reductions]
            workspace = self._workspaces.ws
            if workspace is None:  # first call on this thread
                workspace = self._workspaces.ws = Workspace()
            tmp, staging = workspace.pair(schedule.tmp_count, schedule.staged_count, req.out.dtype)
            start = slot.start if slot is not None else _monotonic()
            call = _new(Call, (
                describe, collective_tag(self._comm_id, seq), plan.check, plan.ufunc,
                start + self.timeout, slot, rec, None, -1, seq, self._probe_tag,
            ))  # fmt: skip
            line = plan.line
            assert line is not None  # start sends only such plans here
            try:
                run_line(line, (req.inp, req.out, tmp), self._transport, call, staging, req.aliased)
            except CommError as exc:
                raise self._failed(exc, req, describe, slot) from exc.__cause__
        except BaseException as exc:
            self._left(exc, req, describe, slot)
            raise
        finally:
            if token is not None:
                restore(token)
        if slot is not None:
            slot.end = _monotonic()
        return req.result

    # Note [a rank alone]
    #     The same for a call whose plan stays within this rank (one rank: its schedule
    #     copies within it, or does nothing in place): _run_alone numbers it, opens its slot
    #     and runs the copies, without start's and _run's general cases.

    @runs_calls  # as _run: the recorder finds a call in flight by this frame
    def _run_alone(self, req: Request, skip: int) -> Any:
        """:meth:`start` and :meth:`_run` of a plain call of a rank alone, in one frame (Note
        [a rank alone])."""
        plan = req.plan
        seq = self._number(plan.named)
        rec = self.recorder
        slot = None if rec is None else self._open(rec, plan, seq, skip)
        if not (req.aliased and plan.void_in_place):
            token = quiet() if plan.guard else None  # Note [quiet reductions]
            try:
                steps = plan.schedule.steps
                run_local(steps, (req.inp, req.out), plan.ufunc, req.aliased, self._rank)
            except BaseException as exc:
                if slot is not None and rec is not None:
                    rec.end(slot, exc)
                raise
            finally:
                if token is not None:
                    restore(token)
        if slot is not None:
            slot.end = _monotonic()
        return req.result

    def _number(self, c: str) -> int:
        """The next call's number (a blocking call's, on a usable communicator)."""
        lock = self._lock
        try:  # Note [an interrupt under the lock]
            lock.acquire()
            if self.closed or self.broken is not None:  # (aborted comes with broken)
                self.check_usable(c)
            seq = self.seq
            self.seq = seq + 1
            lock.release()
        except BaseException:
            let_go(lock)
            raise
        return seq

    @staticmethod
    def _open(rec: FlightRecorder, plan: Plan, seq: int, skip: int) -> Slot:
        """Call ``seq``'s recorder slot, opened as :meth:`start` opens it."""
        slot = rec.ring[seq % rec.capacity]
        if slot.end != 0.0 and not slot.extra:  # as in start (Note [recorder cost])
            slot.seq = seq
            slot.shape = plan.shape
            slot.start = _monotonic()
            slot.end = 0.0
            return slot
        return rec.begin(plan.shape, seq, skip + 1)


_new = tuple.__new__
_NO_TMP = np.empty(0, np.uint8)  # TMP of a schedule that uses none (nothing reads it)


def _describe(label: Label) -> str:
    return f"{label[0]} ({label[1]}, call #{label[2]})"


def _label(plan: Plan, seq: int) -> Label:
    """A call's label (:attr:`Call.label`): its collective, algorithm and number."""
    return (plan.named, plan.shape.algorithm, seq)
