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
import glob
import os
import queue
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn

from plait.cli.relay import DRAIN_SECONDS, Relay, Traceback, is_comm_error

__all__ = ["add_arguments", "main", "rank_command"]

#: Seconds between SIGTERM and SIGKILL when stopping ranks.
GRACE_SECONDS = 5.0
#: Seconds to wait, after a rank failed of a plait communication error (a symptom: a peer is
#: gone), for a rank that failed otherwise (the cause) to exit by itself. See
#: Note [which rank started a failure].
LINGER_SECONDS = 3.0
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


def _kind(r: _Rank, relay: Relay) -> int:
    """How ``r`` failed: _CAUSE (a signal, or a traceback that starts with another exception
    than plait's CommError), _EXIT (a non-zero exit code and no traceback), or _SYMPTOM (a
    traceback that starts with a CommError: a peer failed first)."""
    assert r.exit is not None
    tb = relay.traceback(r.rank)
    if r.exit[0] < 0:
        return _CAUSE
    if tb.first is None:
        return _EXIT
    return _SYMPTOM if is_comm_error(tb.first) else _CAUSE


def _first_failure(failed: Sequence[_Rank], relay: Relay) -> _Rank:
    """The rank that started the failure: the first by time of the likeliest kind."""

    def key(r: _Rank) -> tuple[int, float]:
        assert r.exit is not None
        tb = relay.traceback(r.rank)
        when = tb.started if tb.first is not None and r.exit[0] > 0 else r.exit[1]
        return _kind(r, relay), when

    return min(failed, key=key)


def _hung_causes(ranks: Sequence[_Rank], failed: Sequence[_Rank], relay: Relay) -> list[_Rank]:
    """Ranks still running whose latest traceback, whole, starts with another exception than a
    CommError and began at most LINGER_SECONDS before the first failure: ranks that raised and
    then hung on their way out (on a thread that is not a daemon, say). A traceback printed
    long before is one the rank handled."""
    since = min(r.exit[1] for r in failed if r.exit is not None) - LINGER_SECONDS

    def raised_lately(tb: Traceback) -> bool:
        first = tb.first
        whole = not tb.in_frames
        return first is not None and whole and tb.started >= since and not is_comm_error(first)

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


def _status(r: _Rank, relay: Relay) -> str:
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


def _watch(ranks: Sequence[_Rank], relay: Relay, events: queue.Queue[tuple[int, int]]) -> int:
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
    relay = Relay(args.tag_output)

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
