"""The flight recorder: every communicator's last N calls, kept in a ring, dumped as JSON.

Like torch's flight recorder, it is always on and costs one slot per call: a
:class:`FlightRecorder` owns a ring of ``capacity`` :class:`Slot` objects,
each made on first use and then reused; :meth:`FlightRecorder.begin` fills
the slot of call number ``seq`` (place ``seq % capacity``) with the call's
:class:`CallShape` (collective, algorithm, count, dtype, op, root: one object
per call shape, made once), the time and the caller's place in the program,
and :meth:`~FlightRecorder.end` stamps the end and the error. Nothing is
formatted on the way: objects are kept as given (the shape, the code object
of the caller's frame) and turned into text only when the ring is dumped, so
a call allocates nothing that outlives the next use of its slot (the floats
of its times, nothing else). Counted with cachegrind on one rank, recording
costs about 4,200 machine instructions per call from user code (1,300 of
them the caller's line, about 250 a clock read) and about 9,300 from a
caller inside plait (plait bench's loop), against 36,000 and 25,000 for the
8-byte allreduce itself: 0.7 to 1 µs per call on this machine, where a
clock read inside a call costs 100 to 300 ns. What a dump contains is
documented in :mod:`plait.diagnostics.schema`.

Note [recorder cost]
    The recorder is always on, so its hot path is counted in nanoseconds
    (a clock read is 50-70 ns here, a frame attribute 25-30, a method call
    about 40). Per call it pays one method call (:meth:`begin`), the stores
    of one slot, the walk to the caller's frame and one clock read of its
    own: :meth:`begin` reads the clock as the call begins and the runner
    takes the call's deadline from that reading (``slot.start``) instead of
    reading it again; a call that ends well is stamped by the runner itself
    (a clock read and a store, what :meth:`end` does without an error); the
    executor drops the links of :meth:`watch` as it finishes, and only
    when it made them; a failed call's error and peers are cleared by the
    next call that takes its slot, so a call that ends well clears nothing.

Note [recorder clocks]
    Slots hold ``time.monotonic()`` values, which never jump. Each recorder
    also reads the wall clock once, when it is made, and a dump converts
    every time to wall-clock seconds with that offset, so that the dumps of
    different ranks can be compared: exactly on one host, and as well as the
    hosts' clocks agree (NTP: about a millisecond) across hosts.

Note [caller frames]
    The caller is the first frame outside plait's package folder (a
    communicator's own frames, the torch backend's, a compressor's): from
    ``sys._getframe(skip)`` outwards, a string prefix test per frame; a hook
    that knows how deep it sits passes ``skip`` and the walk ends at once,
    and the last caller found is remembered, so that a loop calling from one
    line again and again skips even that test. A call made from inside plait
    (a compressor, the torch backend, plait bench's timing loop) walks out
    once per starting place: how many frames out the caller was is kept per
    starting code object, and later calls take the frame that far out at once
    (``sys._getframe(skip + hops)``) when its code is one found outside before,
    else walk again.
    A slot keeps that frame's code object and instruction offset (the line
    number is worked out from them only in a dump: ``f_lineno`` costs more
    than the rest of the frame capture), and with ``stack_depth`` > 1 as
    many frames further out, in two lists made with the slot. Never the
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
``PLAIT_RECORDER_STACK``    caller frames kept per call (default 1: the line that
                            made the call; each further frame costs about 0.1 µs)
``PLAIT_DUMP_DIR``          where dumps go: ``<dir>/<job>/rank<r>.json``; default
                            ``plait-dumps`` in the system's temporary folder
                            (``/tmp/plait-dumps`` on Linux)
==========================  =====================================================
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import CodeType, FrameType
from typing import Any, Protocol

from plait.diagnostics.schema import FORMAT, VERSION

__all__ = [
    "DEFAULT_CAPACITY",
    "DEFAULT_STACK_DEPTH",
    "CallShape",
    "FlightRecorder",
    "PendingStep",
    "Slot",
    "dump_dir",
    "job_id",
    "live_recorders",
]

#: Calls kept per communicator unless PLAIT_RECORDER_SIZE says otherwise.
DEFAULT_CAPACITY = 2000
#: Caller frames kept per call unless PLAIT_RECORDER_STACK says otherwise.
DEFAULT_STACK_DEPTH = 1

#: Starting places inside plait whose way out to the caller a recorder remembers.
_HOPS_KEPT = 256
#: Frames kept per thread in a dump's ``threads``.
_THREAD_FRAMES = 64

#: plait's package folder, with a separator: frames from files under it are plait's own.
_PLAIT_DIR = str(Path(__file__).resolve().parent.parent) + os.sep

_getframe = sys._getframe
_monotonic = time.monotonic

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
    (:attr:`state`): one store fewer per call.
    """

    __slots__ = (
        "code",
        "codes",
        "depth",
        "end",
        "error",
        "lasti",
        "lastis",
        "peers",
        "pending",
        "queued",
        "seq",
        "shape",
        "start",
        "steps",
    )

    def __init__(self, stack_depth: int) -> None:
        self.seq = -1
        self.shape = _NO_SHAPE
        self.queued = 0.0
        self.start = 0.0
        self.end = -1.0  # not in flight: the place may be taken
        self.error: str | None = None
        self.peers: Sequence[int] = ()
        self.pending: Mapping[Any, int] | None = None
        self.steps: Sequence[PendingStep] | None = None
        self.code: CodeType | None = None
        self.lasti = 0
        extra = max(stack_depth - 1, 0)
        self.codes: list[CodeType | None] = [None] * extra
        self.lastis: list[int] = [0] * extra
        self.depth = 0  # frames in codes/lastis that belong to this call

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
        self.job = job if job is not None else job_id()
        self.folder = Path(folder) if folder is not None else None
        self.timeline = timeline
        # Slots are made when first used: a communicator that makes few calls stays small.
        self._ring: list[Slot | None] = [None] * capacity
        self._mono0 = _monotonic()
        self._wall0 = time.time()
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
        starts later (:meth:`started`).
        """
        ring = self._ring
        i = seq % self.capacity
        slot = ring[i]
        if slot is None or slot.end == 0.0:
            # First use of this place, or its call is still in flight (more than
            # ``capacity`` calls in flight at once): that call keeps its slot, detached.
            slot = ring[i] = Slot(self.stack_depth)
        slot.seq = seq
        slot.shape = shape
        slot.end = 0.0
        if slot.error is not None:  # only a failed call leaves these (Note [recorder cost])
            slot.error = None
            slot.peers = ()
        if queued:
            slot.queued = _monotonic()
            slot.start = 0.0
        else:
            slot.queued = 0.0
            slot.start = _monotonic()
        if self.stack_depth:
            try:
                f = _getframe(skip)
            except ValueError:  # ``skip`` beyond the outermost frame
                slot.code = None
                slot.depth = 0
                return slot
            code = f.f_code
            # A loop calls from the same line again and again: the last caller found
            # outside plait is known to be outside without the prefix test.
            if code is not self._outside:
                f, code = self._walk(f, code, skip)
            slot.code = code
            slot.lasti = f.f_lasti
            if self.stack_depth > 1:
                codes, lastis = slot.codes, slot.lastis
                n = 0
                back = f.f_back
                while back is not None and n < len(codes):
                    codes[n] = back.f_code
                    lastis[n] = back.f_lasti
                    n += 1
                    back = back.f_back
                slot.depth = n
        return slot

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
        while code.co_filename.startswith(_PLAIT_DIR):
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
        slot.peers = _waiting(slot)
        slot.pending = None
        slot.steps = None

    def waiting_on(self, slot: Slot, peers: Sequence[int]) -> None:
        """Say outright which peers the call waits for (instead of :meth:`watch`)."""
        slot.peers = peers

    def end(self, slot: Slot, error: BaseException | None = None) -> None:
        """Record the end of the call in ``slot``; ``error`` if it failed.

        The error is kept as text, not as the exception (whose traceback would
        keep frames alive), with the peers the call still waited for.
        """
        if error is not None:
            slot.peers = _waiting(slot)  # whom it still waited for when it failed
            slot.error = f"{type(error).__name__}: {error}"
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
        return max((s.seq + 1 for s in self._ring if s is not None), default=0)

    def wall(self, t: float) -> float:
        """Monotonic time ``t`` as wall-clock seconds (see Note [recorder clocks])."""
        return self._wall0 + (t - self._mono0)

    def slots(self) -> list[Slot]:
        """The slots in use, oldest call first."""
        used = [s for s in self._ring if s is not None and s.seq >= 0]
        used.sort(key=lambda s: s.seq)
        return used

    def in_flight(self) -> list[Slot]:
        """The slots of calls begun and not yet ended, oldest first."""
        return [s for s in self.slots() if s.in_flight]

    def snapshot(self) -> list[dict[str, Any]]:
        """The recorded calls as JSON-ready dicts, oldest first (the dump's ``calls``)."""
        return [self._call_json(s) for s in self.slots()]

    def _call_json(self, s: Slot) -> dict[str, Any]:
        shape = s.shape
        in_flight = s.end == 0.0
        stack = []
        if s.code is not None:
            stack.append(_frame_json(s.code, s.lasti))
            for k in range(min(s.depth, len(s.codes))):
                code = s.codes[k]
                if code is not None:
                    stack.append(_frame_json(code, s.lastis[k]))
        return {
            "seq": s.seq,
            "collective": shape.collective,
            "algorithm": shape.algorithm,
            "count": shape.count,
            "dtype": shape.dtype_name,
            "nbytes": shape.nbytes,
            "op": shape.op_name,
            "root": shape.root,
            "state": s.state,
            "queued": self.wall(s.queued) if s.queued else None,
            "start": self.wall(s.start) if s.start else None,
            "end": None if in_flight else self.wall(s.end),
            "waiting_on": _waiting(s) if in_flight or s.error is not None else [],
            "error": s.error,
            "stack": stack,
        }

    def describe(self, reason: str) -> dict[str, Any]:
        """The whole dump as a JSON-ready dict (schema: :mod:`plait.diagnostics.schema`)."""
        return {
            "format": FORMAT,
            "version": VERSION,
            "job": self.job,
            "comm": self.comm,
            "rank": self.rank,
            "size": self.size,
            "global_rank": _global_rank(),
            "pid": os.getpid(),
            "host": os.environ.get("PLAIT_HOST") or socket.gethostname(),
            "reason": reason,
            "time": self.wall(_monotonic()),
            "capacity": self.capacity,
            "recorded": self.recorded,
            "calls": self.snapshot(),
            "threads": _threads(),
        }

    def path(self) -> Path:
        """Where :meth:`dump` writes by default: ``<folder>/<job>/rank<r>.json``.

        A split communicator's file is ``comm<id>.rank<r>.json`` (id in hex).
        """
        folder = self.folder if self.folder is not None else dump_dir()
        name = (
            f"rank{self.rank}.json" if self.comm == 0 else f"comm{self.comm:x}.rank{self.rank}.json"
        )
        return folder / _safe(self.job) / name

    def dump(self, reason: str, path: str | os.PathLike[str] | None = None) -> Path:
        """Write the ring as JSON to ``path`` (default :meth:`path`) and return where.

        The file is written beside its place and renamed over it, so a reader
        never sees half a dump; a later dump of the same rank replaces it.

        Raises:
            OSError: the folder cannot be made or written.
        """
        target = Path(path) if path is not None else self.path()
        target.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.describe(reason), indent=1)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, target)
        return target


def _waiting(s: Slot) -> list[int]:
    """The peers an in-flight call waits for, from its explicit list or its executor's table."""
    pending, steps = s.pending, s.steps
    if pending is not None and steps is not None:
        for _ in range(3):  # the executor may change the table while we read it
            try:
                return sorted(
                    {steps[i].peer for h, i in list(pending.items()) if not getattr(h, "done", 0)}
                )
            except (RuntimeError, IndexError):
                continue
    return sorted(s.peers)


def _line(code: CodeType, lasti: int) -> int:
    """The source line of instruction offset ``lasti`` in ``code``."""
    for start, end, line in code.co_lines():
        if start <= lasti < end and line is not None:
            return line
    return code.co_firstlineno


def _frame_json(code: CodeType, lasti: int) -> list[Any]:
    return [code.co_filename, _line(code, lasti), code.co_name]


def _threads() -> list[dict[str, Any]]:
    """Every thread's stack now, innermost frame first (where a stuck rank is stuck)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    out = []
    for ident, frame in sys._current_frames().items():
        if ident == me:
            frame = frame.f_back or frame  # not the dump's own frames
            while frame.f_back is not None and frame.f_code.co_filename == __file__:
                frame = frame.f_back
        stack: list[list[Any]] = []
        f: FrameType | None = frame
        while f is not None and len(stack) < _THREAD_FRAMES:
            stack.append([f.f_code.co_filename, f.f_lineno, f.f_code.co_name])
            f = f.f_back
        out.append({"name": names.get(ident, str(ident)), "id": ident, "stack": stack})
    return out


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{name} must be a non-negative integer; got {text!r}")
    return value


def _global_rank() -> int | None:
    for name in ("PLAIT_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        text = os.environ.get(name)
        if text is not None and text.strip().isdigit():
            return int(text)
    return None


def _safe(name: str) -> str:
    """``name`` as one path component."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "job"


def job_id() -> str:
    """The id dumps are filed under: the launcher's job id, else ``local``.

    PLAIT_JOB_ID (set by ``plait run``), then torchrun's TORCHELASTIC_RUN_ID,
    then Slurm's SLURM_JOB_ID.
    """
    for name in ("PLAIT_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        text = os.environ.get(name, "").strip()
        if text:
            return text
    return "local"


def dump_dir() -> Path:
    """The dump folder: PLAIT_DUMP_DIR, else ``plait-dumps`` in the temporary folder."""
    text = os.environ.get("PLAIT_DUMP_DIR", "").strip()
    return Path(text) if text else Path(tempfile.gettempdir()) / "plait-dumps"


def live_recorders() -> list[FlightRecorder]:
    """Every recorder alive in this process (for dumps on SIGUSR1 or a stall)."""
    with _live_lock:
        return list(_live)
