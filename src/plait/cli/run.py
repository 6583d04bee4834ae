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

With --mpi4py, ``from mpi4py import MPI`` in the ranks imports plait.mpi, so mpi4py
scripts run unchanged without MPI (docs/mpi.md, "plait.mpi").

Every word from W (or MODULE) on belongs to the rank, as with python and mpirun: give plait
run's own options before it. The script, or the command's program (and the script of a
``python X.py`` command), is checked once before any rank starts: if it is missing, plait run
says so once and exits with code 2. So are the PLAIT_* settings the ranks read (PLAIT_TIMEOUT,
PLAIT_RULES, PLAIT_SHM_WINDOW and the like): a bad one is said once, as a rank would say it,
where every rank would have raised it (plait bench and plait tune check them so too).

One launcher runs per host. The launcher of node 0 hosts the built-in TCP
store that the ranks rendezvous through; every rank gets its identity in the
environment (``PLAIT_RANK``, ``PLAIT_SIZE``, ``PLAIT_LOCAL_RANK``,
``PLAIT_LOCAL_SIZE``, ``PLAIT_NODE_RANK``, ``PLAIT_NNODES``, ``PLAIT_STORE``,
``PLAIT_JOB_ID``, ``PLAIT_SECRET``), which a bare :func:`plait.init` reads. The
secret is generated per job on one host; with several hosts every launcher
must be given the same PLAIT_SECRET.

With several hosts the launchers meet in that store before any of them starts a
rank: each claims its --node-rank, and waits (as long as a rank's plait.init
would: --timeout, PLAIT_TIMEOUT or 300 s) until a launcher of every node has
come. Launchers given different -n or --nnodes, or two given one --node-rank,
make every launcher still waiting exit within seconds with code 1 and a message
that names the launchers (host and pid) and what each was given; so does a node
that never comes, once the wait is over.

Output: the launcher relays every rank's stdout and stderr a whole line at a
time (a line ends at a newline, or at a carriage return, so progress bars still
move), so lines of different ranks never mix; a last line without a newline is
ended when the rank exits, and a line over 1 MiB is cut into lines of 1 MiB.
--tag-output prefixes every line with [rank]:; without it, a rank's stderr is
prefixed from its first Python traceback on, so
that every traceback says whose it is. Ranks run with PYTHONUNBUFFERED=1
(unless it is set), so that Python output arrives as it is printed.

If a rank exits with a non-zero code or dies from a signal, the launcher stops
the others (SIGTERM, then SIGKILL after a grace period), prints every rank's
exit status, and exits with the code of the rank that started the failure
(128 + N for signal N). Ranks that fail because a peer failed first (their
traceback starts with a plait communication error, such as PeerLostError) are
named only when no rank failed otherwise: after such a failure the launcher
waits up to 3 s for the rank that started it. Ctrl-C (SIGINT), SIGTERM or
SIGHUP to the launcher stops every rank the same way. Each rank runs in a
process group of its own, and stopping it signals the group: the processes a
rank's command starts (a wrapper script's Python, a rank's workers) stop with
it. SIGUSR1 to the launcher is passed on to every rank that catches it (a plait
rank dumps its flight recorders). A rank the launcher started directly gets
SIGTERM if the launcher is killed (SIGKILL), once it has called plait.init.
Shared-memory segments the job left in /dev/shm are removed on the way out.

Restarts: with --max-restarts K (torchrun's option), a failure as above is
reported, and then every rank is started again, up to K times; the job's exit
code is that of its last attempt. Each attempt gets a new, empty store and a new
job id (nothing of a failed attempt is reused), and its ranks read the attempt
from PLAIT_RESTART_COUNT (0, 1, ..., K; torchrun's TORCHELASTIC_RESTART_COUNT)
and K from PLAIT_MAX_RESTARTS. A signal to the launcher is never followed by a
restart. Restarts are for jobs on one host.

Recovery: with --enable-recovery (Open MPI's spelling), a rank killed by a
signal (kill -9, the OOM killer) is reported and the others go on: they can
agree and shrink (comm.agree, comm.shrink; docs/fault-tolerance.md) and finish
without it. The job then succeeds if every other rank exits with 0; a rank
that fails otherwise (an exception) stops the job as usual.

Stalls: with --stall-timeout S (PLAIT_STALL_TIMEOUT for the ranks), a rank whose
collective, or blocking send, recv or sendrecv (not a request's wait, nor a
probe), makes no progress for S seconds dumps its flight recorder and prints a line
starting with "plait: stall:"; the launcher then sends SIGUSR1 to the ranks of
its host that have a handler for it (plait.init installs one) and did not report
the stall themselves, so that every rank dumps, and prints the folder of the
dumps with the plait analyze command to read them. One stall sends each rank at
most one signal per S seconds, and the job goes on (the collectives' own timeout
still applies). See docs/debugging.md.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
from collections.abc import Callable, Collection, Sequence
from typing import NoReturn

from plait.errors import RendezvousError
from plait.launch import TRANSPORTS, Job, StartError, launch, module_command
from plait.launch.starting import CANNOT_START

__all__ = ["add_arguments", "main", "rank_command", "settings_problem"]

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
        "--mpi4py",
        action="store_true",
        help="run mpi4py scripts unchanged: `from mpi4py import MPI` imports plait.mpi "
        "(docs/mpi.md, plait.mpi)",
    )
    parser.add_argument(
        "--transport",
        choices=list(TRANSPORTS),
        default=None,
        help="force a transport (sets PLAIT_TRANSPORT)",
    )
    parser.add_argument(
        "--max-restarts",
        "--max_restarts",
        dest="max_restarts",
        type=int,
        default=0,
        metavar="K",
        help="when a rank fails, stop the ranks and start them all again, up to K times "
        "(default 0; one host only); a rank reads its attempt from PLAIT_RESTART_COUNT",
    )
    parser.add_argument(
        "--enable-recovery",
        "--enable_recovery",
        dest="enable_recovery",
        action="store_true",
        help="a rank killed by a signal does not stop the others: they may agree and shrink "
        "and go on (docs/fault-tolerance.md); the job then succeeds if the others do",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="default seconds per collective (sets PLAIT_TIMEOUT)",
    )
    parser.add_argument(
        "--stall-timeout",
        "--stall_timeout",
        dest="stall_timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="when a collective or a blocking send, recv or sendrecv makes no progress for "
        "SECONDS, every rank dumps its flight recorder "
        "and the folder to give plait analyze is printed; the job goes on "
        "(sets PLAIT_STALL_TIMEOUT)",
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
            state = "is a directory" if os.path.isdir(word) else state
            _usage_error(f"cannot run {word}: it {state}")
        if os.path.isfile(word) and os.access(word, os.X_OK):
            # As a shell runs it, a word without a / is looked for on PATH alone, never in
            # the current directory: the program here is not the one named.
            _usage_error(
                f"command not found: {word}: it is not on PATH; to run the file {word} of "
                f"this directory, give it as .{os.sep}{word}"
            )
        if os.path.isfile(word):  # here, but not a program: a script to give without --
            _usage_error(
                f"cannot run {word} as a command: it is not executable (a Python script "
                f"runs as plait run ... {word}, without -- or --no-python)"
            )
        _usage_error(f"command not found: {word}")


def _check_python_script(words: Sequence[str]) -> None:
    """For a ``python X.py ...`` command, fail once if X.py is missing rather than on every rank."""
    if len(words) < 2 or not _PYTHON.fullmatch(os.path.basename(words[0])):
        return
    rest = iter(words[1:])
    for word in rest:  # the script is the first word that is not an option or its value
        if word in ("-W", "-X"):
            next(rest, None)
        elif word in ("-", "-c", "-m"):
            return
        elif not word.startswith("-"):
            if word.endswith(".py") and not os.path.isfile(word):
                _usage_error(f"no such script: {word}")
            return


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


def _check_module(name: str) -> None:
    """Exit 2 if ``-m name``'s top-level package cannot be found where the ranks look
    (this directory, then Python's path), as ``python -m`` would say on every rank.

    Only the top level is looked up: finding ``a.b`` would import ``a``, running its code
    in the launcher. The lookup imports nothing.
    """
    import importlib.util

    top = name.partition(".")[0]
    if not top.isidentifier() or top in sys.builtin_module_names:
        return  # python -m says what is wrong with such a name
    path = sys.path[:]
    sys.path.insert(0, os.getcwd())  # as python -m puts the directory it runs in first
    try:
        found = importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        found = True  # a finder that cannot tell: the ranks will
    finally:
        sys.path[:] = path
    if not found:
        _usage_error(f"-m {name}: no module named {top!r} here or on Python's path")


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
        _check_module(module[0])
        return [*module_command(*module, *words)]
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


def main(args: argparse.Namespace) -> int:
    """Check the options, then start the ranks with :func:`plait.launch.launch`; the exit code."""
    if args.nproc < 1:
        _usage_error(f"-n must be a number of ranks >= 1, not {args.nproc}")
    if args.nnodes < 1:
        _usage_error(f"--nnodes must be a number of hosts >= 1, not {args.nnodes}")
    if not 0 <= args.node_rank < args.nnodes:
        _usage_error(
            f"--node-rank must be in 0..{args.nnodes - 1} (--nnodes {args.nnodes}), "
            f"not {args.node_rank}"
        )
    if args.nnodes > 1 and getattr(args, "standalone", False):
        _usage_error("--standalone is a job on one host: drop it or --nnodes")
    if not 0 <= args.master_port <= 65535:  # getaddrinfo would take it modulo 65536
        _usage_error(f"--master-port must be a port number in 0..65535, not {args.master_port}")
    if args.nnodes > 1 and args.master_port == 0:
        _usage_error("--nnodes > 1 needs --master-port (and --master-addr)")
    max_restarts = getattr(args, "max_restarts", 0)
    if max_restarts < 0:
        _usage_error(f"--max-restarts must be >= 0, not {max_restarts}")
    if max_restarts and args.nnodes > 1:
        _usage_error("--max-restarts is for a job on one host (--nnodes 1)")
    if max_restarts and getattr(args, "enable_recovery", False):
        _usage_error("--enable-recovery and --max-restarts exclude each other")
    if args.timeout is not None and not args.timeout > 0:  # NaN, 0 and less: every call
        _usage_error(f"--timeout must be a number of seconds > 0, not {args.timeout}")
    stall_timeout = getattr(args, "stall_timeout", None)
    if stall_timeout is not None and not stall_timeout >= 0:
        _usage_error(f"--stall-timeout must be a number of seconds >= 0, not {stall_timeout}")
    _check_settings(args)
    command = rank_command(args)
    if args.nnodes > 1 and os.environ.get("PLAIT_SECRET") is None:
        _usage_error(
            "--nnodes > 1 needs the same PLAIT_SECRET in every launcher's environment "
            "(e.g. export PLAIT_SECRET=$(openssl rand -hex 16))"
        )
    job = Job(
        command,
        nproc=args.nproc,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        transport=args.transport,
        timeout=args.timeout,
        stall_timeout=stall_timeout,
        tag_output=args.tag_output,
        max_restarts=max_restarts,
        enable_recovery=getattr(args, "enable_recovery", False),
        env=_mpi4py_env() if getattr(args, "mpi4py", False) else {},
    )
    try:
        return launch(job)
    except (RendezvousError, StartError) as exc:  # --master-port taken, a limit of the host
        raise SystemExit(f"plait run: {exc}") from None
    except OSError as exc:  # the command cannot run (a #! line's missing interpreter, ...)
        said = exc.strerror or ""
        if not said.startswith(CANNOT_START):
            raise
        _usage_error(said)


def _check_settings(args: argparse.Namespace) -> None:
    """The settings :func:`settings_problem` checks, before any rank starts (those an option
    of the launcher replaces are not read)."""
    replaced = {"PLAIT_TRANSPORT"} if args.transport is not None else set()
    if args.timeout is not None:
        replaced.add("PLAIT_TIMEOUT")
    if getattr(args, "stall_timeout", None) is not None:
        replaced.add("PLAIT_STALL_TIMEOUT")
    problem = settings_problem(replaced)
    if problem is not None:
        _usage_error(problem)


def settings_problem(replaced: Collection[str] = ()) -> str | None:
    """What is wrong with a PLAIT_* setting that a job's ranks or its launcher read, or None.

    plait run, plait bench and plait tune ask before any rank starts: a bad setting was a
    traceback of the launcher's store, or the same traceback from every rank. Each setting
    is read with the function the library reads it with, so that the message is the one a
    rank would give. ``replaced``: the settings an option of the command sets for the ranks
    instead (``PLAIT_TIMEOUT`` for ``plait run --timeout``), which are not read.
    """
    from plait._checks import debug_level, env_switch
    from plait._net import parse_ifname
    from plait.communicator import default_timeout
    from plait.diagnostics.recorder import _env_int as recorder_setting
    from plait.diagnostics.timeline import events_limit
    from plait.diagnostics.triggers import stall_timeout_from_env
    from plait.rendezvous._tcp_wire import max_value_bytes
    from plait.selection import rules_file
    from plait.selection.overrides import overrides
    from plait.transport.base import spin_seconds
    from plait.transport.shm.bootstrap import JOB_RE
    from plait.transport.shm.window import window_bytes
    from plait.transport.tcp import _streams_from

    def transport() -> None:
        name = os.environ.get("PLAIT_TRANSPORT", "").strip()
        if name and name.lower() not in TRANSPORTS:
            raise ValueError(
                f"PLAIT_TRANSPORT={name!r} is not a transport; expected one of "
                f"{', '.join(TRANSPORTS)}"
            )

    def job_id() -> None:
        job = os.environ.get("PLAIT_JOB_ID", "")
        if job and not JOB_RE.fullmatch(job):
            raise ValueError(
                f"PLAIT_JOB_ID={job!r} cannot name the job: expected 1 to 64 of A-Z, a-z, "
                "0-9, '_', '.' and '-'"
            )

    def interfaces() -> None:
        spec = os.environ.get("PLAIT_SOCKET_IFNAME")
        if spec:  # as plait.transport.tcp.interfaces reads it: empty is unset
            try:
                parse_ifname(spec)
            except ValueError as exc:
                raise ValueError(f"PLAIT_SOCKET_IFNAME: {exc}") from None

    checks: dict[str, Callable[[], object]] = {
        "PLAIT_TIMEOUT": default_timeout,
        "PLAIT_STALL_TIMEOUT": stall_timeout_from_env,
        "PLAIT_STORE_MAX_VALUE": max_value_bytes,
        "PLAIT_ALGO": overrides,
        "PLAIT_RULES": rules_file.load,
        "PLAIT_RECOVERY": lambda: env_switch(os.environ, "PLAIT_RECOVERY", True),
        "PLAIT_BIND": lambda: env_switch(os.environ, "PLAIT_BIND", True),
        "PLAIT_RECORDER_SIZE": lambda: recorder_setting("PLAIT_RECORDER_SIZE", 0),
        "PLAIT_RECORDER_STACK": lambda: recorder_setting("PLAIT_RECORDER_STACK", 0),
        "PLAIT_SHM_WINDOW": window_bytes,
        "PLAIT_SHM_SPIN": lambda: spin_seconds("PLAIT_SHM_SPIN", 0.0),
        "PLAIT_TCP_SPIN": lambda: spin_seconds("PLAIT_TCP_SPIN", 0.0),
        "PLAIT_TCP_STREAMS": lambda: _streams_from(None),
        "PLAIT_SOCKET_IFNAME": interfaces,
        "PLAIT_TRANSPORT": transport,
        "PLAIT_DEBUG": debug_level,
        "PLAIT_TIMELINE_EVENTS": events_limit,
        "PLAIT_JOB_ID": job_id,
    }
    for name, check in checks.items():
        if name in replaced:
            continue
        try:
            check()
        except ValueError as exc:
            return str(exc)
    return None


def _mpi4py_env() -> dict[str, str]:
    """PYTHONPATH with plait.mpi's ``mpi4py`` package first, so ranks import it as mpi4py."""
    from plait.mpi import mpi4py_path

    rest = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": mpi4py_path() + (os.pathsep + rest if rest else "")}
