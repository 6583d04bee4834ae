"""``plait run``: start N ranks of a Python script, a module or a command, and watch over them.

::

    plait run -n 4 train.py --epochs 3          # a script: python train.py --epochs 3, 4 times
    plait run -n 4 -m mypkg.train --epochs 3    # a module, like python -m
    plait run -n 4 python -X dev train.py       # a command, like mpirun (torchrun --no-python)
    plait run -n 4 -- ./train.sh --fast         # everything after -- is the command, as given
    plait run --nproc_per_node=4 --standalone train.py     # torchrun's spellings; mpirun's -np 4
    plait run -n 2 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29400 train.py

What every rank runs, from the first word W after plait run's options:

    -m MODULE ARGS   python -m MODULE ARGS
    -- W ARGS        the command W ARGS, as given
    W ARGS           a script (python W ARGS) if W ends in .py, is a directory, or is a file
                     that is not executable; else a command (W ARGS) if W is an executable
                     file or a program on PATH; else an error. --no-python: always a command.

Every word from W (or MODULE) on belongs to the rank, as with python and mpirun: give plait
run's own options before it. The script, or the command's program (and the script of a
``python X.py`` command), is checked once before any rank starts: if it is missing, plait run
says so once and exits with code 2.

One launcher runs per host. The launcher of node 0 hosts the built-in TCP
store that the ranks rendezvous through; every rank gets its identity in the
environment (``PLAIT_RANK``, ``PLAIT_SIZE``, ``PLAIT_LOCAL_RANK``,
``PLAIT_LOCAL_SIZE``, ``PLAIT_NODE_RANK``, ``PLAIT_NNODES``, ``PLAIT_STORE``,
``PLAIT_JOB_ID``, ``PLAIT_SECRET``), which a bare :func:`plait.init` reads. The
secret is generated per job on one host; with several hosts every launcher
must be given the same PLAIT_SECRET.

Output: the launcher relays every rank's stdout and stderr a whole line at a
time (a line ends at a newline, or at a carriage return, so progress bars still
move), so lines of different ranks never mix; a last line without a newline is
ended when the rank exits. --tag-output prefixes every line with [rank]:;
without it, a rank's stderr is prefixed from its first Python traceback on, so
that every traceback says whose it is. Ranks run with PYTHONUNBUFFERED=1
(unless it is set), so that Python output arrives as it is printed.

If a rank exits with a non-zero code or dies from a signal, the launcher stops
the others (SIGTERM, then SIGKILL after a grace period), prints every rank's
exit status, and exits with the code of the rank that started the failure
(128 + N for signal N). Ranks that fail because a peer failed first (their
traceback starts with a plait communication error, such as PeerLostError) are
named only when no rank failed otherwise: after such a failure the launcher
waits up to 3 s for the rank that started it. Ctrl-C (SIGINT) or SIGTERM to
the launcher stops every rank the same way. Shared-memory segments the job left
in /dev/shm are removed on the way out.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import glob
import importlib
import os
import queue
import re
import secrets
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, NoReturn

__all__ = ["add_arguments", "main", "rank_command"]

#: Seconds between SIGTERM and SIGKILL when stopping ranks.
GRACE_SECONDS = 5.0
#: Seconds to wait, after a rank failed of a plait communication error (a symptom: a peer is
#: gone), for a rank that failed otherwise (the cause) to exit by itself. See
#: Note [which rank started a failure].
LINGER_SECONDS = 3.0
#: Seconds to wait, once a rank has exited, for the end of its output (a child process the
#: rank left behind may hold its pipes open).
DRAIN_SECONDS = 2.0
#: Bytes read from a rank's pipe at a time (a pipe holds 64 KiB).
_READ_SIZE = 1 << 16
#: A line longer than this is written in pieces, so that memory stays bounded.
_MAX_LINE = 1 << 20
#: A line and its end: a newline, a carriage return (progress bars), or both.
_RECORD = re.compile(rb"[^\r\n]*(?:\r\n|\r|\n)")
#: The last line of a Python traceback: the exception's (module-qualified) name.
_EXCEPTION_LINE = re.compile(rb"([A-Za-z_][\w.]*)(?::|$)")
_TRACEBACK = b"Traceback (most recent call last):"
_GROUP_TRACEBACK = b"  + Exception Group Traceback (most recent call last):"
_CHAINED = (
    b"The above exception was the direct cause of the following exception:",
    b"During handling of the above exception, another exception occurred:",
)
_PYTHON = re.compile(r"python[\d.]*")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``plait run``, with the spellings of torchrun and mpirun as aliases."""
    # argparse would show both REMAINDER arguments as "..."
    parser.usage = "%(prog)s [options] (SCRIPT | COMMAND | -- COMMAND | -m MODULE) [ARGS ...]"
    parser.add_argument(
        "-n",
        "-np",
        "--nproc",
        "--nproc-per-node",
        "--nproc_per_node",
        dest="nproc",
        type=int,
        default=1,
        metavar="N",
        help="ranks to start on this host (default 1); -np is mpirun's spelling, "
        "--nproc-per-node and --nproc_per_node torchrun's",
    )
    parser.add_argument("--nnodes", type=int, default=1, help="number of hosts (default 1)")
    parser.add_argument(
        "--node-rank", "--node_rank", type=int, default=0, help="this host's index, 0-based"
    )
    parser.add_argument(
        "--master-addr",
        "--master_addr",
        default="127.0.0.1",
        help="address of node 0, where the store runs (default 127.0.0.1)",
    )
    parser.add_argument(
        "--master-port",
        "--master_port",
        type=int,
        default=0,
        help="store port on node 0 (default: any free port; set it with --nnodes>1)",
    )
    parser.add_argument(
        "--standalone",
        action="store_true",
        help="torchrun's flag for a job on one host, accepted as is: with --nnodes 1 "
        "(the default) plait run always serves its own store on a free port",
    )
    parser.add_argument(
        "--no-python",
        "--no_python",
        dest="no_python",
        action="store_true",
        help="run the first word as a command even if it looks like a script (torchrun's flag)",
    )
    parser.add_argument(
        "--tag-output", action="store_true", help="prefix every output line with [rank]:"
    )
    parser.add_argument(
        "--transport",
        choices=["auto", "shm", "tcp", "hybrid"],
        default=None,
        help="force a transport (sets PLAIT_TRANSPORT)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="default seconds per collective (sets PLAIT_TIMEOUT)",
    )
    parser.add_argument(
        "-m",
        dest="module",
        nargs=argparse.REMAINDER,
        default=None,
        metavar="MODULE",
        help="MODULE [ARGS]: run a module, like python -m (every later word is the module's)",
    )
    parser.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        metavar="SCRIPT|COMMAND ...",
        help="the script or the command every rank runs, and its arguments (see above)",
    )


def _usage_error(message: str) -> NoReturn:
    """Report a mistake in how ``plait run`` was called, once, before any rank starts."""
    print(f"plait run: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _check_program(word: str) -> None:
    """Fail unless ``word`` names a program: an executable file, or a name found on PATH."""
    if shutil.which(word) is None:
        if os.sep in word:
            state = "is not executable" if os.path.exists(word) else "does not exist"
            _usage_error(f"cannot run {word}: it {state}")
        _usage_error(f"command not found: {word}")


def _check_python_script(words: Sequence[str]) -> None:
    """For a ``python X.py ...`` command, fail once if X.py is missing rather than on every rank."""
    if (
        len(words) > 1
        and _PYTHON.fullmatch(os.path.basename(words[0]))
        and words[1].endswith(".py")
        and not os.path.isfile(words[1])
    ):
        _usage_error(f"no such script: {words[1]}")


def _looks_like_script(word: str) -> bool:
    """Whether plait run runs ``word`` with Python rather than as a command (see the help)."""
    if word.endswith(".py") or os.path.isdir(word):
        return True
    return os.path.isfile(word) and not os.access(word, os.X_OK)


def _check_script(word: str) -> None:
    """Fail once if Python could not run ``word`` as a script on any rank."""
    if os.path.isdir(word):
        if not any(os.path.isfile(os.path.join(word, m)) for m in ("__main__.py", "__main__.pyc")):
            _usage_error(f"cannot run directory {word}: it has no __main__.py")
        return
    if not os.path.isfile(word):
        _usage_error(f"no such script: {word}")
    if word.endswith(".py"):
        return
    # A file that is not executable runs with Python; a shell script that lost its x bit would
    # only fail with a SyntaxError on every rank, so say so now.
    try:
        with open(word, "rb") as f:
            first = f.readline(256).strip()
    except OSError as exc:
        _usage_error(f"cannot read {word}: {exc.strerror}")
    if first.startswith(b"#!") and b"python" not in first:
        _usage_error(
            f"{word} is not executable and starts with {first.decode(errors='replace')!r}: "
            f"make it executable (chmod +x) to run it as a command"
        )


def rank_command(args: argparse.Namespace) -> list[str]:
    """The command line every rank runs, from ``-m``, the ``command`` words and ``--no-python``.

    The rule is the one ``plait run --help`` states. The script, or the command's program, is
    checked here, once, so that a typo fails with one message and exit code 2 instead of one
    error per rank.
    """
    words = list(args.command or [])
    if args.module is not None:
        module = [args.module] if isinstance(args.module, str) else list(args.module)
        if not module or module[0].startswith("-"):
            _usage_error("-m needs a module name")
        return [sys.executable, "-u", "-m", *module, *words]
    verbatim = bool(words) and words[0] == "--"
    if verbatim:
        words = words[1:]
    if not words:
        _usage_error("give a script, a command or -m MODULE to run (see plait run --help)")
    first = words[0]
    if verbatim or getattr(args, "no_python", False):
        _check_program(first)
        _check_python_script(words)
        return words
    if _looks_like_script(first):
        _check_script(first)
        return [sys.executable, "-u", *words]
    if shutil.which(first) is not None:
        _check_python_script(words)
        return words
    if os.path.isfile(first):  # an executable in this directory, named without ./
        return [os.path.join(os.curdir, first), *words[1:]]
    _usage_error(
        f"{first} is neither a script (a .py file, or a file that is not executable) "
        f"nor a program on PATH"
    )


# Note [which rank started a failure]
#     When one rank raises, say, ValueError, its communicator closes and its peers raise
#     PeerLostError, and those peers may exit before it does (its interpreter is still
#     printing the traceback and shutting down). Naming the first rank to exit would blame
#     a bystander. So the launcher reads each rank's stderr for Python tracebacks: the
#     exception a traceback starts with (the first of a chain of "During handling of..." or
#     "The above exception was the direct cause...") says why the rank failed. Failures are
#     of three kinds, from the likeliest cause to the likeliest symptom:
#
#     1. a traceback that starts with an exception other than plait's CommError, or a death
#        by a signal: a cause;
#     2. a non-zero exit code and no traceback (sys.exit(3), a command that is not Python):
#        maybe a cause, maybe a rank that caught PeerLostError and exited;
#     3. a traceback that starts with a CommError (PeerLostError and the like): a symptom.
#
#     The launcher stops the job at once on a failure of kind 1. After one of kind 2 or 3 it
#     waits for one of kind 1 (at most 1 s, or LINGER_SECONDS after kind 3), or until every
#     rank has exited, then names the first failure by time of the likeliest kind: its
#     traceback's start if it printed one, else its exit. If no failure of kind 1 came, a
#     rank still running whose stderr shows a whole traceback of kind 1, begun at most
#     LINGER_SECONDS before the first failure, is named instead: it raised and then hung on
#     its way out (on a thread that is not a daemon, say); the job exits with code 1, as
#     Python would have. Reading tracebacks needs nothing from the ranks (a command that is
#     not Python, or that never imports plait, works the same); an exception printed by a
#     hook of the rank's own in another format counts as an exit of kind 2.


@dataclass
class _Traceback:
    """What a rank's stderr says about its latest traceback (Note [which rank started...])."""

    #: A traceback has appeared: from then on an untagged stderr is prefixed with the rank.
    seen: bool = False
    #: Inside the frames of a traceback, waiting for its exception line.
    in_frames: bool = False
    #: The frames are an exception group's (their lines start with ``  | ``).
    group: bool = False
    #: The last non-blank line said that the next traceback is chained to the previous one.
    chained: bool = False
    #: The first exception of the latest chain, the last one, and its whole line.
    first: str | None = None
    last: str | None = None
    last_line: str = ""
    #: time.monotonic() when the latest chain began.
    started: float = 0.0

    def skim(self, data: bytes) -> bool:
        """Whether ``data`` (whole lines) leaves the state as is but for ``chained``.

        Most output holds no traceback; it is then not looked at line by line.
        """
        if self.in_frames or b"Traceback (most recent call last)" in data:
            return False
        if b"above exception" in data:
            return False
        self.chained = self.chained and not data.strip()
        return True

    def feed(self, record: bytes, now: float) -> None:
        """Take one line of stderr (with its line end)."""
        line = record.rstrip(b"\r\n")
        if line == _TRACEBACK or line.startswith(_GROUP_TRACEBACK):
            if not (self.chained and self.first is not None):
                self.first, self.started = None, now
            self.seen, self.in_frames, self.chained = True, True, False
            self.group = line != _TRACEBACK
            return
        if self.in_frames:
            if self.group:
                if not line.startswith(b"  | ") or line[4:5].isspace():
                    return
                line = line[4:]
            elif not line or line[:1].isspace():
                return  # a frame, its source line or its carets
            match = _EXCEPTION_LINE.match(line)
            if match is None:
                return  # another thread's line in the middle of the traceback
            name = match.group(1).decode("ascii")
            if self.first is None:
                self.first = name
            self.last, self.last_line = name, line.decode(errors="replace")
            self.in_frames = False
        elif line in _CHAINED:
            self.chained = True
        elif line.strip():
            self.chained = False


@dataclass
class _Stream:
    """One pipe from a rank: where it goes, its prefix, and the start of a line not yet ended."""

    rank: int
    pipe: IO[bytes]
    sink: Callable[[bytes], None]
    prefix: bytes
    tagged: bool
    traceback: _Traceback | None  # stderr only
    pending: bytes = b""
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


class _Relay:
    """Relays the ranks' stdout and stderr to the launcher's, whole lines at a time.

    One thread waits on every pipe with a selector (no thread per pipe, no polling) and reads
    up to 64 KiB at a time; each read's complete lines go out in one write, under a lock that
    the launcher's own messages take too, so no line is ever split between two writers. A
    rank that prints a lot costs a read, a search for the last line end and a write per
    64 KiB (plus a join with its prefix when tagged).
    """

    def __init__(self, tag_output: bool) -> None:
        self._tag = tag_output
        self._lock = threading.Lock()
        self._out = _writer(sys.stdout)
        self._err = _writer(sys.stderr)
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._streams: dict[int, _Stream] = {}
        self._open: dict[int, int] = {}  # rank -> its pipes not yet at their end
        self._ended = threading.Condition()
        self._tracebacks: dict[int, _Traceback] = {}
        self._thread = threading.Thread(target=self._loop, name="plait-run-output", daemon=True)
        self._closed = False

    def add(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        """Relay the pipes of ``proc`` (started with stdout and stderr pipes); before start()."""
        assert proc.stdout is not None
        assert proc.stderr is not None
        prefix = f"[{rank}]: ".encode()
        tb = self._tracebacks[rank] = _Traceback()
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
            self._err(f"plait run: {message}\n".encode())

    def drained(self, rank: int, timeout: float) -> bool:
        """Wait until all of ``rank``'s output is relayed (its pipes ended), or ``timeout``."""
        with self._ended:
            return self._ended.wait_for(lambda: self._open.get(rank, 0) == 0, timeout)

    def traceback(self, rank: int) -> _Traceback:
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
            for key, _ in self._selector.select():
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
            s.pending = buf
            if len(buf) > _MAX_LINE:  # a huge line: write its start, unended
                s.pending = b""
                self._write(s, buf, whole=False)
            return
        s.pending = buf[end + 1 :]
        self._write(s, buf[: end + 1], whole=True)

    def _write(self, s: _Stream, data: bytes, whole: bool) -> None:
        """Write ``data`` (whole lines if ``whole``), prefixed as the options say."""
        tb = s.traceback
        if not whole:
            tag = s.tagged or (tb is not None and tb.seen)
            out = (s.prefix if tag and s.at_line_start else b"") + data
            s.at_line_start = False
        elif tb is not None and not tb.skim(data):
            now = time.monotonic()
            parts = []
            for i, record in enumerate(_RECORD.findall(data)):
                tb.feed(record, now)
                tag = s.tagged or tb.seen
                parts.append(s.prefix + record if tag and (i or s.at_line_start) else record)
            out = b"".join(parts)
            s.at_line_start = True
        elif s.tagged or (tb is not None and tb.seen):
            out = (s.prefix if s.at_line_start else b"") + s.prefix.join(_RECORD.findall(data))
            s.at_line_start = True
        else:
            out = data
            s.at_line_start = True
        with self._lock:
            s.sink(out)

    def _end(self, s: _Stream) -> None:
        """``s`` reached its end: write its unended line, ended, and count it out."""
        fd = s.pipe.fileno()
        s.ended = True
        if s.pending or not s.at_line_start:
            self._write(s, s.pending + b"\n", whole=True)
            s.pending = b""
        self._selector.unregister(fd)
        del self._streams[fd]
        s.pipe.close()
        with self._ended:
            self._open[s.rank] -= 1
            self._ended.notify_all()


@functools.lru_cache(maxsize=64)
def _is_comm_error(name: str) -> bool:
    """Whether the exception a traceback names (``plait.errors.PeerLostError``) is a CommError."""
    module, _, attr = name.rpartition(".")
    if module.split(".")[0] != "plait":
        return False
    from plait.errors import CommError

    try:
        cls = getattr(importlib.import_module(module), attr)
    except Exception:  # a name we cannot resolve: not one of ours
        return False
    return isinstance(cls, type) and issubclass(cls, CommError)


@dataclass
class _Rank:
    rank: int
    proc: subprocess.Popen[bytes]
    #: (exit code, time.monotonic()) once the rank has exited by itself.
    exit: tuple[int, float] | None = None
    #: The launcher stopped it.
    stopped: bool = False


#: Kinds of failure, most to least likely to have started a job's failure.
_CAUSE, _EXIT, _SYMPTOM = 0, 1, 2
#: Seconds to wait after a failure of each kind for a _CAUSE (see Note [which rank started...]).
_LINGER = {_EXIT: 1.0, _SYMPTOM: LINGER_SECONDS}


def _kind(r: _Rank, relay: _Relay) -> int:
    """How ``r`` failed: _CAUSE (a signal, or a traceback that starts with another exception
    than plait's CommError), _EXIT (a non-zero exit code and no traceback), or _SYMPTOM (a
    traceback that starts with a CommError: a peer failed first)."""
    assert r.exit is not None
    tb = relay.traceback(r.rank)
    if r.exit[0] < 0:
        return _CAUSE
    if tb.first is None:
        return _EXIT
    return _SYMPTOM if _is_comm_error(tb.first) else _CAUSE


def _first_failure(failed: Sequence[_Rank], relay: _Relay) -> _Rank:
    """The rank that started the failure: the first by time of the likeliest kind."""

    def key(r: _Rank) -> tuple[int, float]:
        assert r.exit is not None
        tb = relay.traceback(r.rank)
        when = tb.started if tb.first is not None and r.exit[0] > 0 else r.exit[1]
        return _kind(r, relay), when

    return min(failed, key=key)


def _hung_causes(ranks: Sequence[_Rank], failed: Sequence[_Rank], relay: _Relay) -> list[_Rank]:
    """Ranks still running whose latest traceback, whole, starts with another exception than a
    CommError and began at most LINGER_SECONDS before the first failure: ranks that raised and
    then hung on their way out (on a thread that is not a daemon, say). A traceback printed
    long before is one the rank handled."""
    since = min(r.exit[1] for r in failed if r.exit is not None) - LINGER_SECONDS

    def raised_lately(tb: _Traceback) -> bool:
        first = tb.first
        whole = not tb.in_frames
        return first is not None and whole and tb.started >= since and not _is_comm_error(first)

    return [r for r in ranks if r.exit is None and raised_lately(relay.traceback(r.rank))]


def _describe(code: int) -> str:
    if code < 0:
        return f"was killed by {_signal_name(-code)}"
    return f"exited with code {code}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _short(name: str) -> str:
    return name.rpartition(".")[2]


def _status(r: _Rank, relay: _Relay) -> str:
    """How ``r`` ended, for the job's summary: ``exit 1 (ValueError)``, ``killed by SIGTERM``."""
    code = r.proc.returncode
    tb = relay.traceback(r.rank)
    text = f"killed by {_signal_name(-code)}" if code < 0 else f"exit {code}"
    stopped = r.stopped and code < 0  # else it exited by itself, in time or not
    notes = []
    if stopped:
        notes.append("stopped by plait run")
    if code != 0 and tb.last is not None:
        notes.append(f"after {_short(tb.last)}" if stopped else _short(tb.last))
    return text + (f" ({', '.join(notes)})" if notes else "")


def _stop(ranks: Sequence[_Rank]) -> None:
    for r in ranks:
        if r.proc.poll() is None:
            r.stopped = r.exit is None
            with contextlib.suppress(ProcessLookupError):
                r.proc.terminate()
    for r in ranks:
        try:
            r.proc.wait(GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                r.proc.kill()
            r.proc.wait()


def _cleanup_shm(job: str) -> None:
    for path in glob.glob(f"/dev/shm/plait-{job}*"):
        with contextlib.suppress(OSError):
            os.unlink(path)


def _watch(ranks: Sequence[_Rank], relay: _Relay, events: queue.Queue[tuple[int, int]]) -> int:
    """Wait for the ranks to finish, for a failure or for a signal; return the job's exit code.

    After a failure that may not be the cause, wait a little for one that is (Note [which rank
    started a failure]), then stop the others and name the rank that started it.
    """
    deadline = float("inf")
    running = len(ranks)
    failed: list[_Rank] = []
    while running:
        timeout = None if deadline == float("inf") else max(0.0, deadline - time.monotonic())
        try:
            rank, code = events.get(timeout=timeout)
        except queue.Empty:
            break  # no cause came within the linger
        if rank < 0:  # a signal to the launcher
            relay.say(f"received {_signal_name(-code)}; stopping all ranks")
            _stop(ranks)
            return 128 - code
        r = ranks[rank - ranks[0].rank]
        r.exit = (code, time.monotonic())
        running -= 1
        if code == 0:
            continue
        relay.drained(r.rank, DRAIN_SECONDS)  # its traceback, if any, has been read
        failed.append(r)
        kind = _kind(r, relay)
        if kind == _CAUSE:
            break
        deadline = min(deadline, r.exit[1] + _LINGER[kind])
    if not failed:
        return 0
    first = _first_failure(failed, relay)
    hung = [] if _kind(first, relay) == _CAUSE else _hung_causes(ranks, failed, relay)
    if hung:
        first = min(hung, key=lambda r: relay.traceback(r.rank).started)
    tb = relay.traceback(first.rank)
    rest = "; stopping the other ranks" if running else ""
    if first.exit is None:
        code = 1  # what Python exits with after an uncaught exception
        relay.say(f"rank {first.rank} raised {_short(tb.last or '?')} but has not exited{rest}")
    else:
        code = first.exit[0]
        why = f" ({_short(tb.last)})" if tb.last is not None and code > 0 else ""
        relay.say(f"rank {first.rank} {_describe(code)}{why}{rest}")
    _stop(ranks)
    relay.close(DRAIN_SECONDS)
    relay.say("the job failed; every rank's exit status:")
    for r in ranks:
        mark = "   <- started the failure" if r is first else ""
        relay.say(f"  rank {r.rank}: {_status(r, relay)}{mark}")
    if tb.last is not None and code > 0:
        relay.say(f"rank {first.rank} failed with {tb.last_line[:300]}")
    return code if code > 0 else 128 - code


def main(args: argparse.Namespace) -> int:
    """Start the ranks, relay their output, and return the job's exit code."""
    if args.nproc < 1 or args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        _usage_error("need -n >= 1, --nnodes >= 1 and 0 <= --node-rank < --nnodes")
    if args.nnodes > 1 and getattr(args, "standalone", False):
        _usage_error("--standalone is a job on one host: drop it or --nnodes")
    if args.nnodes > 1 and args.master_port == 0:
        _usage_error("--nnodes > 1 needs --master-port (and --master-addr)")
    command = rank_command(args)
    size = args.nproc * args.nnodes

    from plait.rendezvous.tcp_store import TCPStoreServer

    # Every connection of the job proves it knows this secret (see plait._auth).
    # Hosts of one job must share it: launchers on several hosts need PLAIT_SECRET set.
    secret = os.environ.get("PLAIT_SECRET")
    if secret is None:
        if args.nnodes > 1:
            raise SystemExit(
                "plait run: --nnodes > 1 needs the same PLAIT_SECRET in every launcher's "
                "environment (e.g. export PLAIT_SECRET=$(openssl rand -hex 16))"
            )
        secret = secrets.token_hex(16)
    server = None
    if args.node_rank == 0:
        server = TCPStoreServer(args.master_addr, args.master_port, secret=secret.encode())
        port = server.port
    else:
        port = args.master_port
    host = args.master_addr
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    job = os.environ.get("PLAIT_JOB_ID") or f"{port}{secrets.token_hex(4)}"
    if args.nnodes > 1:
        job = os.environ.get("PLAIT_JOB_ID") or f"{host.replace(':', '_')}-{port}"

    events: queue.Queue[tuple[int, int]] = queue.Queue()
    ranks: list[_Rank] = []
    relay = _Relay(args.tag_output)

    def on_signal(signum: int, _frame: object) -> None:
        events.put((-1, -signum))

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for local in range(args.nproc):
            rank = args.node_rank * args.nproc + local
            env = dict(os.environ)
            env.update(
                PLAIT_RANK=str(rank),
                PLAIT_SIZE=str(size),
                PLAIT_LOCAL_RANK=str(local),
                PLAIT_LOCAL_SIZE=str(args.nproc),
                PLAIT_NODE_RANK=str(args.node_rank),
                PLAIT_NNODES=str(args.nnodes),
                PLAIT_STORE=f"tcp://{address}",
                PLAIT_JOB_ID=job,
                PLAIT_SECRET=secret,
            )
            # Output goes through pipes: without this, a Python command would hold its stdout
            # in a block buffer, late and lost if it is killed.
            env.setdefault("PYTHONUNBUFFERED", "1")
            if args.nnodes > 1 and "PLAIT_HOST" not in os.environ:
                # One launcher per host: its node index names the host, so that
                # hosts emulated on one machine are told apart too.
                env["PLAIT_HOST"] = f"{socket.gethostname()}-node{args.node_rank}"
            if args.transport:
                env["PLAIT_TRANSPORT"] = args.transport
            if args.timeout:
                env["PLAIT_TIMEOUT"] = str(args.timeout)
            proc = subprocess.Popen(
                command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0
            )
            relay.add(rank, proc)
            ranks.append(_Rank(rank, proc))
            threading.Thread(
                target=lambda r=rank, p=proc: events.put((r, p.wait())), daemon=True
            ).start()
        relay.start()
        return _watch(ranks, relay, events)
    finally:
        _stop(ranks)
        relay.close(DRAIN_SECONDS)
        for s, handler in old.items():
            signal.signal(s, handler)
        if server is not None:
            server.close()
        _cleanup_shm(job)
