"""The launcher's view of its ranks' output: relayed a whole line at a time, tracebacks read.

The launcher reads every rank's stdout and stderr through pipes on one thread (selectors, no
polling) and writes each complete line at once, so that lines of different ranks never mix;
with ``tag_output`` every line gets its ``[rank]: `` prefix, without it a rank's stderr gets it
from its first Python traceback on (Note [causes printed without a traceback]). While
relaying, the stderr of each rank is read for tracebacks: which exception a rank's latest
traceback starts with tells the launcher whether the rank started a failure or only suffered
it (Note [which rank started a failure] in plait.launch.watch), and for stall lines
(:data:`plait.diagnostics.triggers.STALL_MARKER`), which go to the launcher's stall handler
(:mod:`plait.launch.stall`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import os
import re
import selectors
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO

from plait.diagnostics.triggers import STALL_MARKER, parse_stall_line

__all__ = ["DRAIN_SECONDS", "Relay", "Traceback", "is_symptom", "named_ranks"]

#: Seconds to wait, once a rank has exited, for the end of its output (a child process the
#: rank left behind may hold its pipes open).
DRAIN_SECONDS = 2.0
#: Bytes read from a rank's pipe at a time (a pipe holds 64 KiB).
_READ_SIZE = 1 << 16
#: A line longer than this is written in lines of this length, so that memory stays bounded
#: and no other rank's line lands inside it (a piece written unended let one in).
_MAX_LINE = 1 << 20
#: A line and its end: a newline, a carriage return (progress bars), or both.
_RECORD = re.compile(rb"[^\r\n]*(?:\r\n|\r|\n)")
#: The last line of a Python traceback: the exception's (module-qualified) name.
#: An exception's line: its name (a Python identifier, dotted; bytes of UTF-8 past ASCII
#: count as letters, as in ``class Ошибка(Exception)``), then ``:`` or the line's end.
_EXCEPTION_LINE = re.compile(rb"([A-Za-z_\x80-\xff][\w.\x80-\xff]*)(?::|$)")
#: The first line of a SyntaxError's report, which has no "Traceback" line before it.
_SYNTAX_FILE = re.compile(rb'  File ".*", line \d+$')
#: What a rank's stall line holds (it may follow a ``[rank]: `` prefix of the rank's own).
_STALL = STALL_MARKER.encode()
_TRACEBACK = b"Traceback (most recent call last):"
#: How plait's own lines on a rank's stderr start (``plait: flight recorder dumped to ...``).
_OWN_LINE = b"plait: "
_GROUP_TRACEBACK = b"  + Exception Group Traceback (most recent call last):"
_CHAINED = (
    b"The above exception was the direct cause of the following exception:",
    b"During handling of the above exception, another exception occurred:",
)
#: A line that may be an exception's own where it has no "Traceback" line before it: its name,
#: then ``: `` and its message, or a class's name alone (``KeyboardInterrupt``).
_CAUSE_LINE = re.compile(rb"[A-Za-z_\x80-\xff][\w.\x80-\xff]*: |(?:[\w\x80-\xff]+\.)*[A-Z]\w*$")
#: How long a rank's stderr lines that may begin such a cause wait for the rest of it, and how
#: many of them at most (Note [causes printed without a traceback]).
_HOLD_SECONDS = 0.25
_HOLD_LINES = 64


@dataclass
class Traceback:
    """What a rank's stderr says about its latest traceback (Note [which rank started...])."""

    #: A traceback has appeared: from then on an untagged stderr is prefixed with the rank.
    seen: bool = False
    #: Inside the frames of a traceback, waiting for its exception line.
    in_frames: bool = False
    #: The frames are an exception group's (their lines start with ``  | ``).
    group: bool = False
    #: The last non-blank line said that the next traceback is chained to the previous one.
    chained: bool = False
    #: The first exception of the latest chain and its whole line, the last one and its line.
    first: str | None = None
    first_line: str = ""
    last: str | None = None
    last_line: str = ""
    #: time.monotonic() when the latest chain began; the relay's round (Relay.round) that
    #: read its last exception line.
    started: float = 0.0
    ended: int = 0
    #: The rank wrote more after the latest traceback: it handled the exception and went on
    #: (a logged one), so it did not raise and then hang (Note [which rank started...]).
    went_on: bool = False

    def skim(self, data: bytes) -> bool:
        """Whether ``data`` (whole lines) leaves the state as is but for ``chained``.

        Most output holds no traceback; it is then not looked at line by line.
        """
        if self.in_frames or b"Traceback (most recent call last)" in data:
            return False
        if b'  File "' in data:  # a SyntaxError's report may start here
            return False
        if b"above exception" in data:
            return False
        written = bool(data.strip())
        self.chained = self.chained and not written
        if written and self.first is not None:
            self.went_on = True
        return True

    def wrote(self, read: int) -> None:
        """The rank's stdout had a line in the relay's round ``read``: written after its
        traceback where that was read in an earlier round (what a pipe held before the
        traceback ended was ready for that round's read already)."""
        if self.first is not None and not self.in_frames and read > self.ended:
            self.went_on = True

    def feed(self, record: bytes, now: float, read: int = 0) -> None:
        """Take one line of stderr (with its line end), read at ``now`` in the relay's round
        ``read``."""
        line = record.rstrip(b"\r\n")
        syntax = not self.in_frames and _SYNTAX_FILE.match(line) is not None
        if line == _TRACEBACK or line.startswith(_GROUP_TRACEBACK) or syntax:
            if not (self.chained and self.first is not None):
                self.first, self.started = None, now
            self.seen, self.in_frames, self.chained, self.went_on = True, True, False, False
            self.group = line.startswith(_GROUP_TRACEBACK)
            return
        if self.in_frames:
            if self.group:
                if not line.startswith(b"  | ") or line[4:5].isspace():
                    return
                line = line[4:]
            elif not line or line[:1].isspace():
                return  # a frame, its source line or its carets
            match = _EXCEPTION_LINE.match(line)
            if match is None or line.startswith(_OWN_LINE):
                # another thread's line in the middle of the traceback, or plait's own (a
                # signal's dump says where it wrote, between the frames and the exception)
                return
            name, said = match.group(1).decode(errors="replace"), line.decode(errors="replace")
            if self.first is None:
                self.first, self.first_line = name, said
            self.last, self.last_line = name, said
            self.in_frames, self.ended = False, read
        elif line in _CHAINED:
            self.chained = True
        elif line.strip():
            self.chained = False
            self.went_on = self.first is not None


@dataclass
class _Stream:
    """One pipe from a rank: where it goes, its prefix, and the start of a line not yet ended."""

    rank: int
    pipe: IO[bytes]
    sink: Callable[[bytes], None]
    prefix: bytes
    tagged: bool
    traceback: Traceback | None  # stderr only
    pending: bytes = b""
    #: Whole lines not written yet: they may begin a cause printed without a "Traceback"
    #: line (Note [causes printed without a traceback]); and when they were read.
    held: bytes = b""
    held_at: float = 0.0
    #: A traceback's chain line came (its causes may have had no "Traceback" line): from then
    #: on every line gets the prefix, as from a "Traceback" line on (Note [causes printed
    #: without a traceback]).
    chained: bool = False
    at_line_start: bool = True
    ended: bool = False


def _writer(stream: IO[str] | None) -> Callable[[bytes], None]:
    """A function that writes bytes to ``stream`` at once, or drops them once it is broken.

    A closed stdout (``plait run ... | head``) must not stop the relay: the ranks would block
    on full pipes.
    """
    if stream is None:
        return lambda data: None
    with contextlib.suppress(OSError, ValueError):
        stream.flush()
    buffer = getattr(stream, "buffer", None)
    broken = False

    def write(data: bytes) -> None:
        nonlocal broken
        if broken:
            return
        try:
            if buffer is not None:
                buffer.write(data)
                buffer.flush()
            else:
                stream.write(data.decode(errors="replace"))
                stream.flush()
        except (OSError, ValueError):
            broken = True

    return write


class Relay:
    """Relays the ranks' stdout and stderr to the launcher's, whole lines at a time.

    One thread waits on every pipe with a selector (no thread per pipe, no polling) and reads
    up to 64 KiB at a time; each read's complete lines go out in one write, under a lock that
    the launcher's own messages take too, so no line is ever split between two writers. A
    rank that prints a lot costs a read, a search for the last line end and a write per
    64 KiB (plus a join with its prefix when tagged).

    Note [causes printed without a traceback]
        Without ``tag_output``, a rank's stderr gets its prefix from its first traceback on,
        which the relay knew by its "Traceback (most recent call last):" line. But Python
        prints an exception that was never raised (plait's ``err.__cause__ = why``, a
        ``raise X from Y()``) with no such line and no frames: its own line alone, then
        "The above exception was the direct cause ...", and the traceback proper only after
        the chain. Those first lines went out without the prefix. So, until a rank's first
        traceback, its stderr lines that may begin such a cause (an exception's line, then
        lines of its message or notes, at most one blank line) wait for the rest: a chain's
        line that follows has them written with the prefix, from the first such line on,
        and a line that cannot follow a cause, the end of the output, or
        :data:`_HOLD_SECONDS` has them written as they are. Python writes a traceback a
        line at a time but all at once, so what it prints comes within that time; the cost
        is that other lines of that shape (``Epoch: 3``) may come out that much later, and
        only before the rank's first traceback.
    """

    def __init__(
        self,
        tag_output: bool,
        *,
        label: str = "plait run",
        stdout: IO[str] | None = None,
        stderr: IO[str] | None = None,
        on_stall: Callable[[int, str], str | None] | None = None,
    ) -> None:
        """Relay to ``stdout`` and ``stderr`` (None: ``sys.stdout``, ``sys.stderr``).

        ``label`` starts every line of the launcher's own (:meth:`say`). ``on_stall(rank,
        description)`` is called, on the relay's thread, for every stall line of a rank's
        stderr once the line is relayed; a line it returns is said (:meth:`say`).
        """
        self._tag = tag_output
        #: What starts every line of the launcher's own: ``plait run``.
        self.label = label
        self._lock = threading.Lock()
        self._out = _writer(sys.stdout if stdout is None else stdout)
        self._err = _writer(sys.stderr if stderr is None else stderr)
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._streams: dict[int, _Stream] = {}
        self._open: dict[int, int] = {}  # rank -> its pipes not yet at their end
        self._ended = threading.Condition()
        self._tracebacks: dict[int, Traceback] = {}
        self._holding: dict[int, _Stream] = {}  # the streams with held lines, by their pipe
        self._on_stall = on_stall
        self._thread = threading.Thread(target=self._loop, name="plait-run-output", daemon=True)
        self._closed = False
        #: How many times the relay's thread has looked for output (what one look finds of
        #: two pipes may have been written in either order; Traceback.wrote).
        self.round = 0

    def add(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        """Relay the pipes of ``proc`` (started with stdout and stderr pipes); before start()."""
        assert proc.stdout is not None
        assert proc.stderr is not None
        prefix = f"[{rank}]: ".encode()
        tb = self._tracebacks[rank] = Traceback()
        for pipe, sink, parser in ((proc.stdout, self._out, None), (proc.stderr, self._err, tb)):
            os.set_blocking(pipe.fileno(), False)
            s = _Stream(rank, pipe, sink, prefix, self._tag, parser)
            self._streams[pipe.fileno()] = s
            self._selector.register(pipe.fileno(), selectors.EVENT_READ, s)
        self._open[rank] = 2

    def start(self) -> None:
        """Start relaying."""
        self._thread.start()

    def say(self, message: str) -> None:
        """Write one line of the launcher's own to stderr, never inside a rank's line."""
        with self._lock:
            self._err(f"{self.label}: {message}\n".encode())

    def drained(self, rank: int, timeout: float) -> bool:
        """Wait until all of ``rank``'s output is relayed (its pipes ended), or ``timeout``."""
        with self._ended:
            return self._ended.wait_for(lambda: self._open.get(rank, 0) == 0, timeout)

    def traceback(self, rank: int) -> Traceback:
        """What ``rank``'s stderr said about its latest traceback."""
        return self._tracebacks[rank]

    def close(self, timeout: float) -> None:
        """Relay what is left: wait ``timeout`` for the pipes to end, then take what they hold.

        Ends the relay; calling it again does nothing.
        """
        if self._closed:
            return
        self._closed = True
        if self._thread.ident is None:  # a rank failed to start before start()
            self._thread.start()
        self._thread.join(timeout)
        if self._thread.is_alive():
            os.write(self._wake_w, b"x")
            self._thread.join()
        self._selector.close()
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)

    def _loop(self) -> None:
        while self._streams:
            ready = self._selector.select(self._hold_left())
            self.round += 1
            if self._holding:
                self._release_due()
            for key, _ in ready:
                if key.data is None:  # close(): take what the pipes hold now, and stop
                    for s in list(self._streams.values()):
                        while self._read(s):
                            pass
                        if not s.ended:
                            self._end(s)
                    return
                self._read(key.data)

    def _read(self, s: _Stream) -> bool:
        """Relay what ``s`` holds now; False at its end or when it is empty."""
        try:
            data = os.read(s.pipe.fileno(), _READ_SIZE)
        except BlockingIOError:
            return False
        except OSError:
            data = b""
        if not data:
            self._end(s)
            return False
        self._feed(s, data)
        return True

    def _feed(self, s: _Stream, data: bytes) -> None:
        buf = s.pending + data if s.pending else data
        end = max(buf.rfind(b"\n"), buf.rfind(b"\r"))
        if end == len(buf) - 1 and buf[end] == 0x0D:  # may be the first half of \r\n
            end = max(buf.rfind(b"\n", 0, end), buf.rfind(b"\r", 0, end))
        if end < 0:
            *heads, s.pending = _pieces(buf)  # a huge line's start: lines of their own
            if heads:
                self._write(s, b"".join(heads), whole=True)
            return
        s.pending = buf[end + 1 :]
        lines = buf[: end + 1]
        if len(lines) > _MAX_LINE:  # a line may be too long, its end in this read
            lines = b"".join(p for line in lines.splitlines(keepends=True) for p in _pieces(line))
        self._write(s, lines, whole=True)

    def _write(self, s: _Stream, data: bytes, whole: bool) -> None:
        """Write ``data`` (whole lines if ``whole``), prefixed as the options say."""
        tb = s.traceback
        if tb is None and whole:  # stdout: after a traceback, the rank went on
            told = self._tracebacks[s.rank]
            if told.first is not None:
                told.wrote(self.round)
        if not whole:
            tag = s.tagged or s.chained or (tb is not None and tb.seen)
            out = self._unhold(s) + (s.prefix if tag and s.at_line_start else b"") + data
            s.at_line_start = False
        elif tb is not None and not (s.tagged or s.chained or tb.seen):
            out = self._before_traceback(s, tb, data)
            s.at_line_start = True
        elif tb is not None and not tb.skim(data):
            now = time.monotonic()
            parts = []
            for i, record in enumerate(_RECORD.findall(data)):
                tb.feed(record, now, self.round)
                tag = s.tagged or s.chained or tb.seen
                parts.append(s.prefix + record if tag and (i or s.at_line_start) else record)
            out = b"".join(parts)
            s.at_line_start = True
        elif s.tagged or s.chained or (tb is not None and tb.seen):
            out = (s.prefix if s.at_line_start else b"") + s.prefix.join(_RECORD.findall(data))
            s.at_line_start = True
        else:
            out = data
            s.at_line_start = True
        with self._lock:
            s.sink(out)
        if whole and tb is not None and self._on_stall is not None and _STALL in data:
            self._stalls(s.rank, data)

    def _before_traceback(self, s: _Stream, tb: Traceback, data: bytes) -> bytes:
        """What to write of ``data`` (whole lines of an untagged stderr before its first
        traceback) and of the lines held before it; holds those that may begin a cause
        printed without a "Traceback" line (Note [causes printed without a traceback])."""
        now = time.monotonic()
        held = s.held
        buf = held + data if held else data
        if tb.skim(data):  # no traceback begins here: only the last lines may be held
            return self._hold(s, buf, len(held), now)
        records = _RECORD.findall(data)
        at, i = len(held), 0
        while True:
            if i == len(records):
                return self._hold(s, buf, len(held), now)
            record = records[i]
            tb.feed(record, now, self.round)
            i += 1
            if tb.seen:
                break
            if record.rstrip(b"\r\n") in _CHAINED:
                s.chained = True
                at = _cause_start(buf, at)  # the cause printed before it, held or in data
                break
            at += len(record)
        for record in records[i:]:
            tb.feed(record, now, self.round)
        self._unhold(s)
        return buf[:at] + s.prefix + s.prefix.join(_RECORD.findall(buf[at:]))

    def _hold(self, s: _Stream, buf: bytes, old: int, now: float) -> bytes:
        """Hold the last lines of ``buf`` that may begin a cause (its first ``old`` bytes were
        held already); return the rest, to write now."""
        cut = _hold_start(buf)
        fd = s.pipe.fileno()
        if cut == len(buf):
            s.held = b""
            self._holding.pop(fd, None)
        else:
            if cut >= old:  # none of the lines held before is held still
                s.held_at = now
            s.held = buf[cut:]
            self._holding[fd] = s
        return buf[:cut]

    def _unhold(self, s: _Stream) -> bytes:
        """The lines ``s`` held, held no more."""
        held, s.held = s.held, b""
        if held:
            self._holding.pop(s.pipe.fileno(), None)
        return held

    def _hold_left(self) -> float | None:
        """Seconds until the first held lines are due to be written (None: none held)."""
        if not self._holding:
            return None
        first = min(s.held_at for s in self._holding.values())
        return max(first + _HOLD_SECONDS - time.monotonic(), 0.0)

    def _release_due(self) -> None:
        """Write, as they are, the held lines that waited :data:`_HOLD_SECONDS`."""
        now = time.monotonic()
        for s in list(self._holding.values()):
            if now - s.held_at >= _HOLD_SECONDS:
                held = self._unhold(s)
                with self._lock:
                    s.sink(held)

    def _stalls(self, rank: int, data: bytes) -> None:
        """Hand the stall lines among ``data`` (whole lines of ``rank``'s stderr) to on_stall."""
        assert self._on_stall is not None
        for record in _RECORD.findall(data):
            if _STALL in record:
                description = parse_stall_line(record.decode(errors="replace"))
                if description is None:
                    continue
                try:
                    message = self._on_stall(rank, description)
                except Exception as exc:  # the relay must go on, or the ranks block on their pipes
                    message = f"could not handle rank {rank}'s stall: {exc!r}"
                if message is not None:
                    self.say(message)

    def _end(self, s: _Stream) -> None:
        """``s`` reached its end: write its unended line, ended, and count it out."""
        fd = s.pipe.fileno()
        s.ended = True
        if s.pending or not s.at_line_start:
            self._write(s, s.pending + b"\n", whole=True)
            s.pending = b""
        if s.held:  # no cause's chain follows: as they are
            held = self._unhold(s)
            with self._lock:
                s.sink(held)
        self._selector.unregister(fd)
        del self._streams[fd]
        s.pipe.close()
        with self._ended:
            self._open[s.rank] -= 1
            self._ended.notify_all()


@functools.lru_cache(maxsize=64)
def is_symptom(name: str) -> bool:
    """Whether the exception a traceback names (``plait.errors.PeerLostError``) is a plait
    error that a rank meets because a peer failed first: a CommError, but a MismatchError
    (the ranks' calls differ: a bug found on the ranks that raise it), an UnsupportedError
    (a call plait cannot do) or a ForkedError (a communicator used after fork), which its
    rank's own code caused (Note [which rank started a failure] in plait.launch.watch)."""
    module, _, attr = name.rpartition(".")
    if module.split(".")[0] != "plait":
        return False
    from plait.errors import CommError, ForkedError, MismatchError, UnsupportedError

    try:
        cls = getattr(importlib.import_module(module), attr)
    except Exception:  # a name we cannot resolve: not one of ours
        return False
    own = (MismatchError, UnsupportedError, ForkedError)
    return isinstance(cls, type) and issubclass(cls, CommError) and not issubclass(cls, own)


#: How an error's message starts: its name, and the rank that raised it (``rank 2: ``).
_RAISER = re.compile(r"[^\s:]+: rank \d+(?: \(job rank \d+\))?: ")
#: A rank of a communicator named with its rank in the job beside (plait.group's renumber,
#: plait.runtime.waits' timeout): ``rank 1 (job rank 3)``, ``rank(s) [2] (job rank(s) [3])``.
_WITH_JOB_RANK = re.compile(
    r"\brank \d+ \(job rank (\d+)\)|\brank\(s\) \[[\d, ]*\] \(job rank\(s\) \[([\d, ]*)\]\)"
)
_RANK = re.compile(r"\brank (\d+)\b|\brank\(s\) \[([\d, ]+)\]")
#: The dump of a communicator other than the world (plait.diagnostics.places.dump_name).
_SPLIT_DUMP = re.compile(r"comm[0-9a-f]+\.rank\d+\.json")
_DUMPED = "; flight recorder dump: "


def named_ranks(line: str) -> set[int]:
    """The ranks of the job that an error's line names (``plait.errors.PeerLostError: rank
    0: allreduce (ring, call #3): rank 2 was lost ...``), but the one that raised it.

    A rank named with its rank in the job beside (``rank 1 (job rank 3)``) counts as that.
    Other numbers are the communicator's: the job's where the error is of the world
    communicator; where it is of another (its dump, the message's last note, is
    ``comm<id>.rank<r>.json``, or the message names a communicator), they are mapped by the
    members that dump records, and count not at all where it cannot be read: rank 2 of a
    communicator shrunk after a loss is not job rank 2.
    """
    text, _, dumped = line.partition(_DUMPED)
    raiser = _RAISER.match(text)
    text = text[raiser.end() :] if raiser is not None else text
    named: set[int] = set()
    for m in _WITH_JOB_RANK.finditer(text):
        named.update(_numbers(m.group(1) or m.group(2) or ""))
    plain: set[int] = set()
    for m in _RANK.finditer(_WITH_JOB_RANK.sub("", text)):
        plain.update(_numbers(m.group(1) or m.group(2) or ""))
    dump = dumped.strip()
    if not _SPLIT_DUMP.fullmatch(os.path.basename(dump)):
        if " of communicator " in text:
            return named  # another communicator's numbers, and no dump to map them
        return named | plain
    members = _members(dump)
    return named | {members[r] for r in plain if r < len(members)}


def _numbers(listed: str) -> list[int]:
    """``[2, 3]`` for ``"2, 3"``."""
    return [int(n) for n in listed.split(",") if n.strip()]


def _members(path: str) -> list[int]:
    """The job's ranks of a communicator's ranks, as the dump at ``path`` records them
    (empty where it cannot be read)."""
    try:
        with open(path, encoding="utf-8") as f:
            members = json.load(f).get("members")
    except (OSError, ValueError, AttributeError, RecursionError):
        return []
    if not isinstance(members, list) or not all(type(m) is int for m in members):
        return []
    return members


def _line_start(buf: bytes, end: int) -> int:
    """Where the line of ``buf`` that ends (its line end included) at ``end`` > 0 begins."""
    last = end - 1
    if last and buf[last] == 0x0A and buf[last - 1] == 0x0D:
        last -= 1
    return max(buf.rfind(b"\n", 0, last), buf.rfind(b"\r", 0, last)) + 1


def _may_be_cause(line: bytes) -> bool:
    """Whether ``line`` (with its end) may be an exception's own, printed without a
    "Traceback" line (not plait's own lines, ``plait: stall: ...``)."""
    return _CAUSE_LINE.match(line.rstrip(b"\r\n")) is not None and not line.startswith(_OWN_LINE)


def _hold_start(buf: bytes) -> int:
    """Where the lines at the end of ``buf`` (whole lines) that may begin a cause printed
    without a "Traceback" line begin: its last lines that are not blank, after at most one
    blank line (Python's, before "The above exception ..."), from the first that may be an
    exception's own; ``len(buf)`` where there is none (Note [causes printed without a
    traceback])."""
    end = len(buf)
    if end and buf[_line_start(buf, end) : end].isspace():
        end = _line_start(buf, end)
    _, first = _lines_before(buf, end)
    return len(buf) if first is None else first


def _cause_start(buf: bytes, at: int) -> int:
    """Where the cause printed before the chain's line at ``at`` in ``buf`` begins, as far as
    ``buf`` holds it: the first line that may be an exception's own among the lines not blank
    before it, else the first of those lines (Note [causes printed without a traceback])."""
    end = at
    while end and buf[_line_start(buf, end) : end].isspace():  # the blank line before it
        end = _line_start(buf, end)
    run, first = _lines_before(buf, end)
    return run if first is None else first


def _lines_before(buf: bytes, end: int) -> tuple[int, int | None]:
    """The lines of ``buf`` not blank that end at ``end``, at most :data:`_HOLD_LINES` of
    them: where the first begins (``end`` where there is none), and where the first that
    may be an exception's own begins (None where none may be)."""
    run, first = end, None
    for _ in range(_HOLD_LINES):
        if not end:
            break
        start = _line_start(buf, end)
        if buf[start:end].isspace():
            break
        run = start
        if _may_be_cause(buf[start:end]):
            first = start
        end = start
    return run, first


def _pieces(line: bytes) -> list[bytes]:
    """``line`` cut into lines of at most :data:`_MAX_LINE` bytes, each of the cut ones
    ended with a newline (never inside a UTF-8 character); the last piece as it was. The
    line's own end does not count: a line of exactly _MAX_LINE bytes stays whole."""
    pieces = []
    ending = 2 if line.endswith(b"\r\n") else 1 if line.endswith((b"\n", b"\r")) else 0
    while len(line) - ending > _MAX_LINE:
        cut = _MAX_LINE
        while cut > _MAX_LINE - 3 and line[cut] & 0xC0 == 0x80:
            cut -= 1  # not inside a UTF-8 character
        pieces.append(line[:cut] + b"\n")
        line = line[cut:]
    pieces.append(line)
    return pieces
