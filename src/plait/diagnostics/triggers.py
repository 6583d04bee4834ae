"""When the flight recorders dump: on a communication error, on SIGUSR1, on a stall.

- :func:`dump_on_error` is what a communicator calls when a collective fails
  with a timeout, a lost peer or a mismatch: it dumps that communicator's
  recorder (at most once per recorder and error) and never raises.
- :func:`install_signal_handler` makes SIGUSR1 dump every recorder in the
  process (``kill -USR1 <pid>``, or ``plait run`` on a stall), then run the
  handler that was there before, if any.
- :class:`Watchdog` is a thread that notices a call in flight for longer
  than the stall timeout (PLAIT_STALL_TIMEOUT, which ``plait run
  --stall-timeout`` sets), dumps every recorder of its process and prints
  one line starting with :data:`STALL_MARKER` on stderr, so that the launcher
  can send SIGUSR1 to the other ranks: a rank stuck outside any collective
  then dumps too. :func:`start_watchdog` starts one per process when
  PLAIT_STALL_TIMEOUT is set; :func:`plait.init` calls it, and
  :func:`install_signal_handler`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import IO, Any

from plait.diagnostics.places import global_rank
from plait.diagnostics.recorder import CallShape, FlightRecorder, live_recorders, waiting
from plait.errors import CollectiveTimeout, CommTimeout, MismatchError, PeerLostError

__all__ = [
    "DUMP_ERRORS",
    "STALL_MARKER",
    "Watchdog",
    "catches_signal",
    "dump_all",
    "dump_on_error",
    "dumped_line",
    "install_signal_handler",
    "parse_stall_line",
    "stall_timeout_from_env",
    "start_watchdog",
]

_log = logging.getLogger("plait")

#: Errors that make a communicator dump its recorder.
DUMP_ERRORS: tuple[type[BaseException], ...] = (CommTimeout, PeerLostError, MismatchError)
#: The start of the line a rank prints on stderr when its watchdog sees a stall.
STALL_MARKER = "plait: stall:"

_installed = False
_install_lock = threading.Lock()
_watchdog: Watchdog | None = None  # the process's, from start_watchdog


#: Seconds after an error's dump in which a dump asked for (a signal, a stall) leaves it be:
#: the launcher has the ranks dump when one fails, just as they dump the error they met.
KEEP_ERROR_DUMP = 10.0


def named(shape: CallShape) -> str:
    """A call's collective as errors say it: ``allgather``, or for a call plait makes within
    another ``split (its allgather)`` (as :attr:`plait.diagnostics.schema.CallRecord.name`)."""
    return f"{shape.within} (its {shape.collective})" if shape.within else shape.collective


def dump_all(reason: str, recorders: list[FlightRecorder] | None = None) -> list[Path]:
    """Dump every recorder of this process (or ``recorders``), asked for (a signal, a
    stall); the files written. A recorder dumped for an error in the last
    :data:`KEEP_ERROR_DUMP` seconds keeps that dump (its file is listed all the same).

    A recorder that cannot be written is logged and skipped: this runs while
    something already went wrong, and must not add an error of its own.
    """
    return [path for path, _ in _dump_each(reason, recorders)]


def _dump_each(
    reason: str, recorders: list[FlightRecorder] | None
) -> list[tuple[Path, float | None]]:
    """:func:`dump_all`'s work: each recorder's file, with None where it was written now,
    or how many seconds ago its error's dump was written where that dump was kept (so that
    the line a signal prints says which files it rewrote)."""
    done: list[tuple[Path, float | None]] = []
    # Without waiting on a lock: this runs in a signal handler, on the main thread, which
    # may hold it (Note [dumps from a signal handler]).
    for rec in live_recorders(wait=False) if recorders is None else recorders:
        try:
            ago = time.monotonic() - rec.error_dumped
            if ago < KEEP_ERROR_DUMP:
                done.append((rec.path(), ago))  # its error's dump says more: left as it is
                continue
            done.append((rec.dump(reason), None))
            if rec.timeline is not None:
                rec.timeline.write(wait=False)  # what led here, in case the process dies next
        except Exception as exc:  # a dump never takes the place of what it reports
            _log.warning("rank %d: flight recorder dump failed: %r", rec.rank, exc)
    return done


def dumped_line(done: list[tuple[Path, float | None]]) -> str | None:
    """The line a signal's dump prints on stderr (None: no file): the files written, and
    those that kept an error's dump, which a signal soon after the error leaves as they are
    (``plait run`` signals the ranks when one fails, just as they dump the error they met):
    it used to say that those too were dumped to."""
    written = [str(path) for path, ago in done if ago is None]
    kept = [
        f"{path} keeps the dump of the error met {ago:.1f} s ago"
        for path, ago in done
        if ago is not None
    ]
    parts = []
    if written:
        parts.append(f"dumped to {', '.join(written)}")
    if kept:
        parts.append(f"not dumped again: {', '.join(kept)}")
    return f"plait: flight recorder {'; '.join(parts)}" if parts else None


# Note [dumps from a signal handler]
#     SIGUSR1's handler runs on the main thread, between two of its bytecodes, wherever it
#     is: inside a lock the dump would take too (the timeline's, while it writes its file
#     at exit; the set of live recorders', while a communicator is made), the handler
#     waited for the thread it interrupted, for ever, and the rank never exited. So a dump
#     takes no lock it could wait on: the recorders are listed without the lock if it is
#     held, and a timeline being written is left to the write under way.


def dump_on_error(recorder: FlightRecorder | None, error: BaseException) -> Path | None:
    """Dump ``recorder`` if ``error`` is one of :data:`DUMP_ERRORS`; where it went, or None.

    Never raises (a failed dump is logged). The path is worth adding to the
    error's message: ``flight recorder dump: /tmp/plait-dumps/JOB/rank2.json``.
    """
    if recorder is None or not isinstance(error, DUMP_ERRORS):
        return None
    try:
        path = recorder.dump(f"{type(error).__name__}: {error}")
        recorder.error_dumped = time.monotonic()
        if recorder.timeline is not None:
            recorder.timeline.write()
        return path
    except Exception as exc:  # not only OSError: the error it reports is what the caller raises
        _log.warning("rank %d: flight recorder dump failed: %r", recorder.rank, exc)
        return None


def stuck_behind(
    recorder: FlightRecorder | None, rank: int, call: str, seq: int, seconds: float
) -> CommTimeout:
    """The error of ``call`` (number ``seq``), queued behind a one-sided call (an
    ``async_op`` one) that did not finish within ``seconds``: that call, and whom it waits
    for, as its own timeout would name them (a CollectiveTimeout), with the recorder dumped.
    It used to say only that the call before did not finish: no rank, no dump."""
    text = f"rank {rank}: {call}: the one-sided call before it"
    before = [s for s in recorder.in_flight() if s.seq < seq] if recorder is not None else []
    peers = waiting(before[-1]) if before else []
    if before:
        shape = before[-1].shape
        text += f", {named(shape)} ({shape.algorithm}, call #{before[-1].seq}),"
    text += f" did not finish within {seconds:g} s"
    if not peers:
        return CommTimeout(text)
    exc = CollectiveTimeout(f"{text}: it waits for rank(s) {peers}")
    path = dump_on_error(recorder, exc)
    return exc if path is None else CollectiveTimeout(f"{exc}; flight recorder dump: {path}")


def _say(stream: IO[str], line: str) -> None:
    """Write ``line`` and its newline to ``stream`` in one write, and flush: ``print``
    writes the newline apart, so another thread's line (a stall's, a dump's) could come
    between them, two lines joined into one that the launcher would not read as a stall."""
    with contextlib.suppress(OSError, ValueError):
        stream.write(line + "\n")
        stream.flush()


def install_signal_handler(signum: int = signal.SIGUSR1) -> bool:
    """Make ``signum`` dump every recorder of the process; True if installed now.

    Only the main thread can install a handler, and only once: elsewhere, or
    a second time, this does nothing and returns False. A handler installed
    before is called after the dump; if the signal was ignored it stays
    ignored apart from the dump. Python runs the handler on the main thread
    as soon as that thread gets control back; a thread blocked on a lock or
    in ``select`` is woken for it (PEP 475), so a rank blocked in a
    collective dumps at once.
    """
    global _installed
    if threading.current_thread() is not threading.main_thread():
        return False
    with _install_lock:
        if _installed:
            return False
        previous = signal.getsignal(signum)

        def handler(sig: int, frame: FrameType | None) -> None:
            line = dumped_line(_dump_each(f"signal {signal.Signals(sig).name}", None))
            if line is not None:
                _say(sys.stderr, line)
            if callable(previous):
                previous(sig, frame)

        signal.signal(signum, handler)
        _installed = True
        return True


def catches_signal(pid: int, signum: int = signal.SIGUSR1) -> bool | None:
    """Whether process ``pid`` has a handler for ``signum`` (None: cannot tell).

    The launcher asks before it sends SIGUSR1 to a rank: a process without a
    handler (a rank that never made a communicator, a command that is not
    Python) would be killed by it. Reads the ``SigCgt`` mask of
    ``/proc/<pid>/status`` (Linux).
    """
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (int(signum) - 1) & 1)
    except (OSError, ValueError, IndexError):
        return None
    return None


def stall_timeout_from_env() -> float | None:
    """PLAIT_STALL_TIMEOUT in seconds, or None when unset or 0.

    Raises:
        ValueError: it is not a non-negative number.
    """
    text = os.environ.get("PLAIT_STALL_TIMEOUT", "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(f"PLAIT_STALL_TIMEOUT must be a number of seconds >= 0; got {text!r}")
    return value or None


def parse_stall_line(line: str) -> str | None:
    """The description after :data:`STALL_MARKER` if ``line`` is a stall line, else None.

    For the launcher, which reads every rank's stderr.
    """
    text = line.strip()
    # The launcher may prefix lines with ``[rank]: ``.
    at = text.find(STALL_MARKER)
    if at < 0:
        return None
    return text[at + len(STALL_MARKER) :].strip()


class Watchdog:
    """A daemon thread that dumps when a call stays in flight ``stall_timeout`` seconds.

    It looks every ``interval`` seconds (default: a quarter of the timeout, at
    most 5 s) at the recorders' in-flight calls; reading them costs the calls
    nothing. It reports each stalled call once: it dumps every recorder of
    the process (:func:`dump_all`) and calls ``on_stall(line)`` with a line
    that starts with :data:`STALL_MARKER` (default: print it on ``stream``,
    stderr). :meth:`check` does one look, for tests and for callers with
    their own thread.
    """

    def __init__(
        self,
        stall_timeout: float,
        *,
        interval: float | None = None,
        recorders: Callable[[], list[FlightRecorder]] = live_recorders,
        on_stall: Callable[[str], Any] | None = None,
        stream: IO[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not stall_timeout > 0:
            raise ValueError(f"stall timeout must be > 0 seconds; got {stall_timeout!r}")
        self.stall_timeout = stall_timeout
        self.interval = interval if interval is not None else min(stall_timeout / 4, 5.0)
        self._recorders = recorders
        self._on_stall = on_stall
        self._stream = stream
        self._clock = clock
        self._reported: set[tuple[int, int]] = set()  # (id of recorder, call number)
        self._reported_p2p: set[tuple[int, int, float]] = set()  # (recorder, -thread, since)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Watchdog:
        """Start the thread (once); returns self."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="plait-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread and wait for it."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.check()

    def check(self) -> str | None:
        """Look once; the stall line if a new stall was found (and reported), else None."""
        now = self._clock()
        stalled: tuple[FlightRecorder, Any, float] | None = None
        for rec in self._recorders():
            for slot in rec.in_flight():
                since = slot.start or slot.queued
                key = (id(rec), slot.seq)
                if since and now - since >= self.stall_timeout and key not in self._reported:
                    self._reported.add(key)
                    if stalled is None:
                        stalled = (rec, slot, now - since)
            for thread, (req, since) in list(rec.p2p.items()):  # blocking point to point
                key2 = (id(rec), -thread, since)
                if now - since >= self.stall_timeout and key2 not in self._reported_p2p:
                    self._reported_p2p.add(key2)
                    if stalled is None:
                        stalled = (rec, str(req.label()), now - since)
        if stalled is None:
            return None
        rec, slot, waited = stalled
        if isinstance(slot, str):  # a point-to-point wait
            what = call = slot
        else:
            call = f"{named(slot.shape)} #{slot.seq}"
            what = f"{call} ({slot.shape.algorithm})"
        paths = dump_all(f"stall: {call} in flight for {waited:.0f} s")
        where = paths[0].parent if paths else "nowhere (dump failed)"
        line = (
            f"{STALL_MARKER} {_who(rec)}: {what} "
            f"in flight for {waited:.0f} s; flight recorder dumped to {where}"
        )
        if self._on_stall is not None:
            self._on_stall(line)
        else:
            _say(self._stream if self._stream is not None else sys.stderr, line)
        return line


def _who(rec: FlightRecorder) -> str:
    """The rank a stall line names: the job's (``rank 3``), and a split communicator's rank
    beside it (``rank 3 (rank 1 of communicator 36b73)``), whose number alone named another
    process of the job."""
    job = global_rank()
    if rec.comm == 0:
        return f"rank {rec.rank if job is None else job}"
    mine = f"rank {rec.rank} of communicator {rec.comm:x}"
    return mine if job is None else f"rank {job} ({mine})"


def start_watchdog() -> Watchdog | None:
    """The process's stall watchdog, started on the first call if PLAIT_STALL_TIMEOUT is set.

    One per process, whatever the number of communicators (it watches every
    live recorder); None when the variable is unset or 0.

    Raises:
        ValueError: PLAIT_STALL_TIMEOUT is not a number of seconds.
    """
    global _watchdog
    seconds = stall_timeout_from_env()
    with _install_lock:
        if _watchdog is None and seconds is not None:
            _watchdog = Watchdog(seconds).start()
        return _watchdog
