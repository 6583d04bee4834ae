"""The flight recorder: every communicator's last N calls, kept in a ring, dumped as JSON.

Like torch's flight recorder, it is always on and costs one slot per call: a
:class:`FlightRecorder` owns a ring of ``capacity`` :class:`Slot` objects,
all made with it and then reused; a call fills the slot of its number ``seq``
(place ``seq % capacity``) with its :class:`CallShape` (collective, algorithm,
count, dtype, op, root, the plait call it is part of, and where a call of that
shape was first made: one object per call shape, made once with its plan) and its start time,
and its end stamps the end time and, if it failed, the error. Nothing is
formatted on the way: objects are kept as given and turned into text only
when the ring is dumped, so a call allocates nothing but the floats of its
times. Counted with cachegrind on one rank (``OPENBLAS_NUM_THREADS=1
valgrind --tool=cachegrind`` of 3,000 and 13,000 calls, the difference per
call), recording costs about 2,000 machine instructions per call, two clock
reads of about 330 each among them, against 23,400 for the 8-byte allreduce
itself. What a dump contains is documented in
:mod:`plait.diagnostics.schema`.

Note [recorder cost]
    The recorder is always on, so its hot path is counted in nanoseconds:
    a clock read is 45-65 ns here, a method call about 40, taking the
    caller's frame about 90, and every object the call touches that has
    fallen out of the nearest caches costs more than the instructions do.
    So a call that ends well does the least that keeps the ring true:
    - the call runner fills the slot itself (four stores, no method call),
      when the slot holds a plain call (``extra`` false); otherwise, and
      for queued calls, it calls :meth:`FlightRecorder.begin`;
    - its clock read is the call's only one at the start: the deadline is
      taken from ``slot.start``; the end is one more read and a store;
    - it keeps no stack: where it was made is known from its shape's
      ``site`` (the first call of that shape; :mod:`plait.diagnostics.frames`).
    Every call that a dump is read for keeps its own caller after all, at no
    cost to calls that end well: one in flight when the ring is dumped is
    found on the stack of the thread that runs it (the frame of the call
    runner holding its slot); one that fails takes its caller in
    :meth:`FlightRecorder.end`, on its own thread; one queued to run on the
    worker thread takes it in :meth:`~FlightRecorder.begin`.
    ``PLAIT_RECORDER_STACK=N`` keeps N frames for every call (every slot is
    then ``extra`` and every call goes through :meth:`~FlightRecorder.begin`).
    ``extra`` marks a slot that holds more than a plain call (a caller, an
    error, a queued time): the next call that takes the place clears it.

Note [recorder clocks]
    Slots hold ``time.monotonic()`` values, which never jump. Each recorder
    also reads the wall clock once, when it is made, and a dump converts
    every time to wall-clock seconds with that offset, so that the dumps of
    different ranks can be compared: exactly on one host, and as well as the
    hosts' clocks agree (NTP: about a millisecond) across hosts.

Note [caller frames]
    Where a call keeps its caller (Note [recorder cost]), the caller is the
    first frame outside plait's package folder (a
    communicator's own frames, the torch backend's, a compressor's): from
    ``sys._getframe(skip)`` outwards, a string prefix test per frame; a hook
    that knows how deep it sits passes ``skip`` and the walk ends at once,
    and the last caller found is remembered, so that a loop calling from one
    line again and again skips even that test. A call made from inside plait
    (a compressor, the torch backend, plait bench's timing loop) walks out
    once per starting place: how many frames out the caller was is kept per
    starting code object, and later calls take the frame that far out at once
    (``sys._getframe(skip + hops)``) when its code is one found outside before,
    else walk again. A failed call's caller, taken in :meth:`FlightRecorder.end`
    from the call runner's frame, is a plain walk: the runner sits at different
    depths below the caller, and a failure is no hot path.
    A slot keeps that frame's code object and instruction offset (the line
    number is worked out from them only in a dump: ``f_lineno`` costs more
    than the rest of the frame capture), and with ``stack_depth`` > 1 as
    many frames further out, in two lists made with the slot (one shared
    empty pair while one frame is kept). Never the
    frame itself, which would keep the caller's local variables (tensors)
    alive. When no frame is outside plait (a compressor's calls on the
    worker thread), the outermost one is kept. A dump adds the whole stack
    of every thread of the process at that moment (``threads``): for a call
    in flight, that is where the rank is stuck, at no cost per call.

Settings, read by :meth:`FlightRecorder.from_env`:

==========================  =====================================================
``PLAIT_RECORDER_SIZE``     calls kept per communicator (default 2000, as torch's
                            ``TORCH_FR_BUFFER_SIZE`` is usually set); 0 turns the
                            recorder off
``PLAIT_RECORDER_STACK``    caller frames kept for every call (default 0: only calls
                            in flight at a dump, failed or queued keep theirs, one
                            frame, or this many; Note [recorder cost])
``PLAIT_DUMP_DIR``          where dumps go: ``<dir>/<job>/rank<r>.json``; default
                            ``plait-dumps`` in the system's temporary folder
                            (``/tmp/plait-dumps`` on Linux)
==========================  =====================================================
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import CodeType, FrameType
from typing import Any, Protocol

from plait.diagnostics.frames import (
    PLAIT_DIR,
    caller_site,
    callers_in_flight,
    first_outside,
    frame_json,
    threads,
)
from plait.diagnostics.places import (
    dump_dir,
    dump_name,
    global_rank,
    job_id,
    replace_with,
    safe_name,
)
from plait.diagnostics.schema import FORMAT, VERSION

__all__ = [
    "DEFAULT_CAPACITY",
    "DEFAULT_STACK_DEPTH",
    "CallShape",
    "FlightRecorder",
    "PendingStep",
    "Slot",
    "caller_site",
    "dump_dir",
    "job_id",
    "live_recorders",
]

#: Calls kept per communicator unless PLAIT_RECORDER_SIZE says otherwise.
DEFAULT_CAPACITY = 2000
#: Caller frames kept per call unless PLAIT_RECORDER_STACK says otherwise.
DEFAULT_STACK_DEPTH = 0

#: Starting places inside plait whose way out to the caller a recorder remembers.
_HOPS_KEPT = 256


_getframe = sys._getframe
_monotonic = time.monotonic
_wall_clock = time.time  # read once per recorder (Note [recorder clocks])

# What Slot.state reports.
QUEUED = "queued"
RUNNING = "running"
DONE = "done"
FAILED = "failed"

#: Every recorder alive in this process, for SIGUSR1 and stall dumps.
_live: weakref.WeakSet[FlightRecorder] = weakref.WeakSet()
_live_lock = threading.Lock()


class PendingStep(Protocol):
    """What :meth:`FlightRecorder.watch` reads of a schedule step: its peer."""

    @property
    def peer(self) -> int: ...


@dataclass(frozen=True, slots=True)
class CallShape:
    """What a call is, apart from its number: made once per call shape and reused.

    A communicator already caches a plan per call shape; keeping one
    ``CallShape`` beside it lets :meth:`FlightRecorder.begin` store one
    reference instead of six fields. ``dtype`` and ``op`` are kept as given
    (a numpy dtype, a :class:`plait.Op`) and formatted only in a dump.
    """

    collective: str
    algorithm: str
    count: int
    dtype: object
    op: object
    root: int = 0
    #: Where a call of this shape was first made (:func:`caller_site`), or None: a call
    #: that keeps no stack of its own is shown there in a dump (Note [recorder cost]).
    site: tuple[str, int, str] | None = None
    #: The plait call this one is part of ("" for a user's call; Note [calls within calls]
    #: in :mod:`plait._request`): dumped, and ``stragglers`` leaves its own calls out.
    within: str = ""

    @property
    def dtype_name(self) -> str:
        """The dtype's name (``float32``)."""
        return str(getattr(self.dtype, "name", self.dtype))

    @property
    def op_name(self) -> str:
        """The op's name (``SUM``), ``-`` for a collective without one."""
        return "-" if self.op is None else str(getattr(self.op, "name", self.op))

    @property
    def nbytes(self) -> int:
        """``count`` times the dtype's item size (0 if the dtype has none)."""
        itemsize = getattr(self.dtype, "itemsize", 0)
        return self.count * itemsize if isinstance(itemsize, int) else 0


_NO_SHAPE = CallShape("", "", 0, "", None)
_NO_CODES: list[CodeType | None] = []
_NO_LASTIS: list[int] = []


class Slot:
    """One recorded call; reused when the ring comes round again.

    ``seq`` is the call number (-1: never used) and ``shape`` the call's
    :class:`CallShape`. ``code`` and ``lasti`` are the caller's code object
    and instruction offset (turned into a line only when dumped); with
    ``stack_depth`` > 1 the frames further out go to ``codes`` and
    ``lastis``. ``pending`` and ``steps`` link a running call to its
    executor's table of unfinished transport handles, so that who it waits
    for is worked out only when someone looks (:meth:`FlightRecorder.watch`).
    Times are monotonic (Note [recorder clocks]): ``queued`` is 0.0 for a
    call that was not queued, ``start`` 0.0 while it is queued, ``end`` 0.0
    while it is in flight. The state is not stored but read from them
    (:attr:`state`): one store fewer per call. ``probed`` is the stall probe
    the call last sent (its number, whom it waited on; Note [stall probes]).
    """

    __slots__ = (
        "code",
        "codes",
        "depth",
        "end",
        "error",
        "extra",
        "lasti",
        "lastis",
        "peers",
        "pending",
        "probed",
        "queued",
        "seq",
        "shape",
        "start",
        "steps",
    )

    def __init__(self, frames: int) -> None:
        self.seq = -1
        self.shape = _NO_SHAPE
        self.queued = 0.0
        self.start = 0.0
        self.end = -1.0  # not in flight: the place may be taken
        self.probed: tuple[int, tuple[int, ...]] = (-1, ())
        self.error: str | None = None
        self.peers: Sequence[int] = ()
        self.pending: Mapping[Any, int] | None = None
        self.steps: Sequence[PendingStep] | None = None
        self.code: CodeType | None = None
        self.lasti = 0
        further = max(frames - 1, 0)
        # With one frame kept (the default), every slot shares two empty lists, never written.
        self.codes: list[CodeType | None] = [None] * further if further else _NO_CODES
        self.lastis: list[int] = [0] * further if further else _NO_LASTIS
        self.depth = 0  # frames in codes/lastis that belong to this call
        # Whether the slot holds more than a plain call's fields (a caller, an error, a
        # queued time): what begin must clear before reuse (Note [recorder cost]).
        self.extra = False

    @property
    def state(self) -> str:
        """``queued``, ``running``, ``done`` or ``failed`` (the dump's ``state``)."""
        if self.end == 0.0:
            return QUEUED if self.start == 0.0 else RUNNING
        return DONE if self.error is None else FAILED

    @property
    def in_flight(self) -> bool:
        """Whether the call has begun and not ended."""
        return self.end == 0.0


class FlightRecorder:
    """The last ``capacity`` calls of one communicator.

    Hooks call :meth:`begin` when a call takes its number, :meth:`started`
    when a queued (``async_op=True``) call starts running, :meth:`watch` or
    :meth:`waiting_on` when it blocks on peers, and :meth:`end` when it
    returns or fails. :meth:`begin` may be called from several threads; the
    other hooks touch only the slot they are given. :meth:`snapshot` and
    :meth:`dump` may run at any time, from any thread or a signal handler:
    they read slots as they are (a slot being filled may show some fields
    of its previous call).

    Args:
        rank: this rank within the communicator.
        size: the communicator's size.
        comm: the communicator's id (0 for the world).
        capacity: slots in the ring (at least 1).
        stack_depth: caller frames kept per call (0: none).
        job: the job id dumps are filed under (default: :func:`job_id`).
        folder: where :meth:`dump` writes (default: :func:`dump_dir`).
        timeline: an object whose ``call(slot, recorder)`` is called at each
            :meth:`end` (a :class:`plait.diagnostics.timeline.Timeline`), or None.
    """

    def __init__(
        self,
        rank: int,
        size: int,
        comm: int = 0,
        *,
        capacity: int = DEFAULT_CAPACITY,
        stack_depth: int = DEFAULT_STACK_DEPTH,
        job: str | None = None,
        folder: str | os.PathLike[str] | None = None,
        timeline: Any = None,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"flight recorder: capacity must be at least 1; got {capacity}")
        if stack_depth < 0:
            raise ValueError(f"flight recorder: stack_depth must be >= 0; got {stack_depth}")
        self.rank = rank
        self.size = size
        self.comm = comm
        self.capacity = capacity
        self.stack_depth = stack_depth
        # Frames kept where a caller is kept: at least the caller's line (Note [recorder cost]).
        self.frames = max(stack_depth, 1)
        self.job = job if job is not None else job_id()
        self.run: str | None = None  # which run of the job (plait.init draws it for every rank)
        # Each rank's rank in the world communicator (a split's or a shrunk one's), or None.
        self.members: tuple[int, ...] | None = None
        # Blocking point-to-point waits in progress, which the ring does not keep: by the
        # thread's id, the call (its ``label()`` says what it waits for: "recv from rank 1
        # (tag 0)") and since when, for the stall watchdog.
        self.p2p: dict[int, tuple[Any, float]] = {}
        # When this recorder was last dumped for an error (time.monotonic), or never: a
        # dump asked for soon after leaves that one be (triggers.KEEP_ERROR_DUMP).
        self.error_dumped = float("-inf")
        self.folder = Path(folder) if folder is not None else None
        self.timeline = timeline
        # Every slot is made now (about 0.2 µs each), not on first use: a call then
        # allocates nothing but the floats of its times (Note [recorder cost]).
        self.ring: list[Slot] = [Slot(self.frames) for _ in range(capacity)]
        if stack_depth:  # every call takes its caller: no slot is for the runner's short path
            for slot in self.ring:
                slot.extra = True
        self._mono0 = _monotonic()
        self._wall0 = _wall_clock()
        self._outside: CodeType | None = None  # the last caller's code found outside plait
        # Callers inside plait (a compressor, the torch backend, plait bench's loop): from
        # the code of the frame begin starts at, how many frames further out the caller
        # was found, and the codes found there (Note [caller frames]).
        # Keyed by id: a code object's own hash reads its whole constant table. The
        # values hold the code objects, so that no id is reused while it is a key.
        self._hops: dict[int, tuple[CodeType, int]] = {}
        self._found: dict[int, CodeType] = {}
        with _live_lock:
            _live.add(self)

    @classmethod
    def from_env(
        cls, rank: int, size: int, comm: int = 0, *, timeline: Any = None
    ) -> FlightRecorder | None:
        """A recorder configured by PLAIT_RECORDER_SIZE and PLAIT_RECORDER_STACK.

        Returns None when PLAIT_RECORDER_SIZE is 0 (the recorder is off).

        Raises:
            ValueError: a setting is not a non-negative integer.
        """
        capacity = _env_int("PLAIT_RECORDER_SIZE", DEFAULT_CAPACITY)
        depth = _env_int("PLAIT_RECORDER_STACK", DEFAULT_STACK_DEPTH)
        if capacity == 0:
            return None
        return cls(rank, size, comm, capacity=capacity, stack_depth=depth, timeline=timeline)

    # -- the hot path ------------------------------------------------------------------
    def begin(self, shape: CallShape, seq: int, skip: int = 1, queued: bool = False) -> Slot:
        """Record the start of call number ``seq`` and return its slot for :meth:`end`.

        The call goes to place ``seq % capacity`` of the ring: call numbers
        are unique per communicator and increase, so the ring holds the last
        ``capacity`` of them, in any order they began. Call it on the caller's
        thread, where the caller's frames are. ``skip``: how many frames out
        from this method's caller to start looking for the first frame outside
        plait (Note [caller frames]); a hook that knows it is called from two
        plait frames below the user passes 3 and saves the walk (positionally:
        a keyword costs more). ``queued``: an ``async_op=True`` call, which
        starts later (:meth:`started`) on another thread, so its caller is
        taken now whatever ``stack_depth`` says (Note [recorder cost]).
        """
        ring = self.ring
        i = seq % self.capacity
        slot = ring[i]
        if slot.end == 0.0:
            # Its call is still in flight (more than ``capacity`` calls in flight at
            # once): that call keeps its slot, detached, and this one takes a new one.
            slot = ring[i] = Slot(self.frames)
        slot.seq = seq
        slot.shape = shape
        if slot.extra:  # a queued or failed call, or a caller taken (Note [recorder cost])
            slot.extra = False
            slot.error = None
            slot.peers = ()
            slot.code = None
            slot.depth = 0
            slot.queued = 0.0
        if queued:
            self._caller(slot, skip + 1)
            slot.queued = _monotonic()
            slot.start = 0.0
        else:
            if self.stack_depth:
                self._caller(slot, skip + 1)
            slot.start = _monotonic()
        # In flight from here: last, so that the stall watchdog, reading from its own
        # thread, never sees this call in flight with the time of the slot's last one.
        slot.end = 0.0
        return slot

    def _caller(self, slot: Slot, skip: int) -> None:
        """Keep in ``slot`` the first frame outside plait from ``_getframe(skip)`` outwards.

        ``skip`` counts from this method's own frame, as :meth:`begin`'s does from its own.
        """
        slot.extra = True
        try:
            f = _getframe(skip)
        except ValueError:  # ``skip`` beyond the outermost frame
            return
        code = f.f_code
        # A loop calls from the same line again and again: the last caller found
        # outside plait is known to be outside without the prefix test.
        if code is not self._outside:
            f, code = self._walk(f, code, skip)
        _keep(slot, f, code)

    def _walk(self, f: FrameType, code: CodeType, skip: int) -> tuple[FrameType, CodeType]:
        """The first frame outside plait from ``f`` (``_getframe(skip)``) outwards, and its code.

        A caller inside plait calls from the same place again and again: the
        number of frames out to its caller is remembered per starting code, and
        the frame that many further out is taken at once when its code is one
        found before (Note [caller frames]).
        """
        start = code
        known = self._hops.get(id(start))
        if known is not None:
            try:
                g = _getframe(skip + 1 + known[1])  # + 1: this method's own frame
            except ValueError:
                pass
            else:
                found = g.f_code
                if id(found) in self._found:
                    return g, found
        n = 0
        while code.co_filename.startswith(PLAIT_DIR):
            outer = f.f_back
            if outer is None:
                return f, code  # no frame outside plait: keep the outermost
            f = outer
            code = f.f_code
            n += 1
        if n == 0:
            self._outside = code
        elif len(self._hops) < _HOPS_KEPT:
            self._hops[id(start)] = (start, n)
            self._found[id(code)] = code
        return f, code

    def started(self, slot: Slot) -> None:
        """A queued call starts running now (its arrival time, for lateness)."""
        slot.start = _monotonic()

    def watch(self, slot: Slot, pending: Mapping[Any, int], steps: Sequence[PendingStep]) -> None:
        """Link ``slot`` to its executor's unfinished handles.

        ``pending`` maps a handle (with a ``done`` attribute) to its step's
        index in ``steps``. Costs two stores; the peers waited for are read
        from them only when the recorder is dumped. :meth:`end` drops the links.
        """
        slot.pending = pending
        slot.steps = steps

    def unwatch(self, slot: Slot) -> None:
        """Keep who the call in ``slot`` waits for now, and drop the links of :meth:`watch`.

        The executor calls it when the call fails, before it withdraws its
        unfinished handles from the transport (which marks them done): the
        failed call's ``waiting_on`` then still names the peers it waited for.
        """
        slot.peers = waiting(slot)
        slot.pending = None
        slot.steps = None

    def waiting_on(self, slot: Slot, peers: Sequence[int]) -> None:
        """Say outright which peers the call waits for (instead of :meth:`watch`)."""
        slot.peers = peers

    def end(self, slot: Slot, error: BaseException | None = None) -> None:
        """Record the end of the call in ``slot``; ``error`` if it failed.

        The error is kept as text, not as the exception (whose traceback would
        keep frames alive), with the peers the call still waited for, and the
        caller's frames if :meth:`begin` did not take them: call it on the
        thread that made the call (as the call runner does for a blocking call;
        a queued call's caller was taken when it was queued).
        """
        if error is not None:
            slot.peers = waiting(slot)  # whom it still waited for when it failed
            slot.error = f"{type(error).__name__}: {error}"
            if slot.code is None:
                # A plain walk: the runner's frame sits at different depths below the
                # caller (through _collective, broadcast, the torch backend), so the way
                # out remembered per starting code (Note [caller frames]) does not apply.
                f = first_outside(_getframe(1))
                _keep(slot, f, f.f_code)
            slot.extra = True
        slot.end = _monotonic()
        slot.pending = None
        slot.steps = None
        timeline = self.timeline
        if timeline is not None:
            timeline.call(slot, self)

    # -- reading it ----------------------------------------------------------------------
    @property
    def recorded(self) -> int:
        """Calls numbered up to the newest recorded: its number + 1 (0 before any call)."""
        return max((s.seq + 1 for s in self.ring), default=0)

    def wall(self, t: float) -> float:
        """Monotonic time ``t`` as wall-clock seconds (see Note [recorder clocks])."""
        return self._wall0 + (t - self._mono0)

    def slots(self) -> list[Slot]:
        """The slots in use, oldest call first."""
        used = [s for s in self.ring if s.seq >= 0]
        used.sort(key=lambda s: s.seq)
        return used

    def in_flight(self) -> list[Slot]:
        """The slots of calls begun and not yet ended, oldest first."""
        return [s for s in self.slots() if s.in_flight]

    def snapshot(self) -> list[dict[str, Any]]:
        """The recorded calls as JSON-ready dicts, oldest first (the dump's ``calls``)."""
        slots = self.slots()
        found = callers_in_flight(slots, self.frames)
        return [self._call_json(s, found.get(id(s))) for s in slots]

    def _call_json(self, s: Slot, found: list[list[Any]] | None = None) -> dict[str, Any]:
        shape = s.shape
        in_flight = s.end == 0.0
        stack = []
        if s.code is not None:
            stack.append(frame_json(s.code, s.lasti))
            for k in range(min(s.depth, len(s.codes))):
                code = s.codes[k]
                if code is not None:
                    stack.append(frame_json(code, s.lastis[k]))
        elif found is not None:
            stack = found
        return {
            "seq": s.seq,
            "collective": shape.collective,
            "algorithm": shape.algorithm,
            "count": shape.count,
            "dtype": shape.dtype_name,
            "nbytes": shape.nbytes,
            "op": shape.op_name,
            "root": shape.root,
            "within": shape.within,
            "state": s.state,
            "queued": self.wall(s.queued) if s.queued else None,
            "start": self.wall(s.start) if s.start else None,
            "end": None if in_flight else self.wall(s.end),
            "waiting_on": waiting(s) if in_flight or s.error is not None else [],
            "error": s.error,
            "stack": stack,
            "site": None if shape.site is None else list(shape.site),
        }

    def describe(self, reason: str) -> dict[str, Any]:
        """The whole dump as a JSON-ready dict (schema: :mod:`plait.diagnostics.schema`)."""
        return {
            "format": FORMAT,
            "version": VERSION,
            "job": self.job,
            "run": self.run,
            "comm": self.comm,
            "rank": self.rank,
            "size": self.size,
            "global_rank": global_rank(),
            "members": None if self.members is None else list(self.members),
            "pid": os.getpid(),
            "host": os.environ.get("PLAIT_HOST") or socket.gethostname(),
            "reason": reason,
            "time": self.wall(_monotonic()),
            "capacity": self.capacity,
            "recorded": self.recorded,
            "calls": self.snapshot(),
            "threads": threads(),
        }

    def path(self) -> Path:
        """Where :meth:`dump` writes by default: ``<folder>/<job>/rank<r>.json``.

        A split communicator's file is ``comm<id>.rank<r>.json`` (id in hex).
        """
        folder = self.folder if self.folder is not None else dump_dir()
        return folder / safe_name(self.job) / dump_name(self.comm, self.rank)

    def dump(self, reason: str, path: str | os.PathLike[str] | None = None) -> Path:
        """Write the ring as JSON to ``path`` (default :meth:`path`) and return where.

        The file is written beside its place and renamed over it, so a reader
        never sees half a dump; a later dump of the same rank replaces it.

        Raises:
            OSError: the folder cannot be made or written.
        """
        target = Path(path) if path is not None else self.path()
        text = json.dumps(self.describe(reason), indent=1)
        replace_with(target, text)
        return target


def _keep(slot: Slot, f: FrameType, code: CodeType) -> None:
    """Keep frame ``f`` (whose code is ``code``) and the frames out from it in ``slot``."""
    slot.code = code
    slot.lasti = f.f_lasti
    codes, lastis = slot.codes, slot.lastis
    n = 0
    back = f.f_back
    while back is not None and n < len(codes):
        codes[n] = back.f_code
        lastis[n] = back.f_lasti
        n += 1
        back = back.f_back
    slot.depth = n


def waiting(s: Slot) -> list[int]:
    """The peers an in-flight call waits for: its explicit list (a wait on a window), and
    the peers of its executor's unfinished messages."""
    pending, steps = s.pending, s.steps
    if pending is not None and steps is not None:
        for _ in range(3):  # the executor may change the table while we read it
            try:
                return sorted(
                    {steps[i].peer for h, i in list(pending.items()) if not getattr(h, "done", 0)}
                    | set(s.peers)
                )
            except (RuntimeError, IndexError):
                continue
    return sorted(s.peers)


#: The most slots (PLAIT_RECORDER_SIZE) or frames a recorder takes: a ring is made whole with
#: its communicator (10^11 slots hung ``plait.init``; a million take a second and 160 MB).
MAX_SETTING = 1_000_000


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_SETTING:
        raise ValueError(f"{name} must be an integer from 0 to {MAX_SETTING:,}; got {text!r}")
    return value


def live_recorders(*, wait: bool = True) -> list[FlightRecorder]:
    """Every recorder alive in this process (for dumps on SIGUSR1 or a stall).

    ``wait=False`` (a signal handler): if the lock is held, perhaps by the thread the
    handler interrupted, the set is read without it (Note [dumps from a signal handler]
    in :mod:`plait.diagnostics.triggers`).
    """
    if not _live_lock.acquire(blocking=wait):
        for _ in range(8):
            with contextlib.suppress(RuntimeError):  # changed while being read: again
                return list(_live)
        return []
    try:
        return list(_live)
    finally:
        _live_lock.release()
