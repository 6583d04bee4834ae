"""Start one host's ranks of a job, serve their store, relay their output, clean up after them.

A :class:`Job` says what every rank runs and how many ranks there are; :func:`launch` runs
it and returns the job's exit code. ``plait run`` (:mod:`plait.cli.run`) turns its command
line into a ``Job``; ``plait bench`` (:mod:`plait.bench.runner`) builds one per system it
times.
"""

from __future__ import annotations

import contextlib
import glob
import os
import queue
import resource
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from plait._net import format_address
from plait.diagnostics.triggers import catches_signal
from plait.errors import CommError, RendezvousError
from plait.launch.elsewhere import Elsewhere, linger
from plait.launch.relay import DRAIN_SECONDS, Relay
from plait.launch.stall import (
    StallResponder,
    dump_folder,
    folder_problem,
    send_usr1,
    stall_timeout,
)
from plait.launch.starting import StartError, start_error
from plait.launch.watch import RankProcess, adopt_orphans, group_members, stop, watch
from plait.rendezvous.lost import joined as has_joined
from plait.rendezvous.lost import report_lost, reports
from plait.rendezvous.nodes import LOOK_SECONDS, MeetingError, NodeClaim, meet_nodes
from plait.rendezvous.store import DEFAULT_STORE_TIMEOUT
from plait.rendezvous.tcp_store import StoreConnectError, TCPStore, TCPStoreServer

__all__ = ["TRANSPORTS", "Job", "StartError", "launch", "module_command"]

#: How a rank filed by :meth:`_Filer.left` ended, after its exit code.
_BEFORE_INIT = "before calling plait.init"
#: Seconds the launcher tries to file a rank in the job's store (Note [lost ranks]).
_FILE_SECONDS = 5.0
#: The transports a job can force (``PLAIT_TRANSPORT``); ``auto`` lets every rank choose.
TRANSPORTS = ("auto", "shm", "tcp", "hybrid")


def module_command(module: str, *args: str) -> tuple[str, ...]:
    """The command that runs ``module`` with this interpreter, like ``python -m``.

    ``-u``: a rank's output goes through a pipe, where Python would otherwise hold it in a
    block buffer, late and lost if the rank is killed.
    """
    return (sys.executable, "-u", "-m", module, *args)


@dataclass(frozen=True)
class Job:
    """One host's share of a job: what every rank runs, and where the ranks meet.

    Ranks ``node_rank * nproc`` to ``(node_rank + 1) * nproc - 1`` of ``nproc * nnodes`` run
    here. The launcher of node 0 serves the job's TCP store at ``master_addr:master_port``;
    with several hosts, every launcher meets the others there before it starts a rank, and
    fails if they disagree on ``nproc`` or ``nnodes`` or another holds its ``node_rank``
    (Note [launchers meet] in :mod:`plait.rendezvous.nodes`). Every rank finds its identity
    in its environment (``PLAIT_RANK``, ``PLAIT_SIZE``, ``PLAIT_LOCAL_RANK``,
    ``PLAIT_LOCAL_SIZE``, ``PLAIT_NODE_RANK``, ``PLAIT_NNODES``, ``PLAIT_STORE``,
    ``PLAIT_JOB_ID``, ``PLAIT_SECRET``, ``PLAIT_RESTART_COUNT``, ``PLAIT_MAX_RESTARTS``),
    which a bare :func:`plait.init` reads.

    With ``stall_timeout``, every rank also gets ``PLAIT_STALL_TIMEOUT``: its watchdog dumps
    its flight recorders and prints a stall line when a call makes no progress for that
    long, and the launcher then has the other ranks dump too (:mod:`plait.launch.stall`).

    Raises:
        TypeError: ``command`` is one string (or bytes), where it needs a list of the
            program and its arguments, such as ``['python', 'hello.py']``.
        ValueError: the numbers do not make a job (``nproc < 1``, ``node_rank`` outside
            ``0..nnodes-1``, a ``master_port`` outside 0..65535, several hosts without
            a fixed ``master_port``, restarts on
            several hosts or fewer than 0), ``command`` is empty, ``transport`` is not
            one of :data:`TRANSPORTS`, or ``stall_timeout`` is negative.
    """

    #: The command line every rank runs (see :func:`module_command` for a Python module).
    command: Sequence[str]
    #: Ranks on this host.
    nproc: int = 1
    #: Hosts of the job, each with its own launcher, and this host's index.
    nnodes: int = 1
    node_rank: int = 0
    #: Where node 0 serves the store; port 0: any free port (one host only).
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    #: Variables added to the launcher's environment for the ranks (``PLAIT_*`` win).
    env: Mapping[str, str] = field(default_factory=dict)
    #: ``PLAIT_TRANSPORT`` for every rank (one of :data:`TRANSPORTS`); None: left as is.
    transport: str | None = None
    #: ``PLAIT_TIMEOUT``, default seconds per collective; None or 0: left as is.
    timeout: float | None = None
    #: ``PLAIT_STALL_TIMEOUT``, seconds a call may make no progress before every rank dumps
    #: its flight recorders (:mod:`plait.launch.stall`); None or 0: left as is.
    stall_timeout: float | None = None
    #: Prefix every line of output with ``[rank]: ``.
    tag_output: bool = False
    #: The job's shared secret; None: ``PLAIT_SECRET``, or on one host a fresh one.
    secret: str | None = None
    #: What starts every line the launcher writes itself.
    label: str = "plait run"
    #: Times to start every rank again after a rank fails (Note [restarts]); one host only.
    max_restarts: int = 0
    #: A rank killed by a signal does not stop the others (PRRTE's ``--enable-recovery``):
    #: they may agree and shrink (docs/fault-tolerance.md); see :func:`~plait.launch.watch.watch`.
    enable_recovery: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.command, (str, bytes, bytearray)):  # each character an argument
            raise TypeError(
                f"command must be a list of the program and its arguments, such as "
                f"['python', 'hello.py'], not one string: {self.command!r}"
            )
        if not self.command:
            raise ValueError("a job needs a command for its ranks to run")
        if self.nproc < 1 or self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"need nproc >= 1, nnodes >= 1 and 0 <= node_rank < nnodes; got nproc="
                f"{self.nproc}, nnodes={self.nnodes}, node_rank={self.node_rank}"
            )
        if not 0 <= self.master_port <= 65535:
            raise ValueError(f"master_port must be in 0..65535, got {self.master_port}")
        if self.nnodes > 1 and self.master_port == 0:
            raise ValueError("a job on several hosts (nnodes > 1) needs a master_port")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.max_restarts and self.nnodes > 1:
            raise ValueError(
                "restarts (max_restarts) are for a job on one host: with several hosts the "
                "launchers would have to agree on when to restart"
            )
        if self.enable_recovery and self.max_restarts:
            raise ValueError(
                "enable_recovery (the others go on) and max_restarts (all start again) exclude "
                "each other"
            )
        if self.transport is not None and self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.timeout is not None and not self.timeout > 0:  # NaN too
            raise ValueError(f"timeout must be > 0 seconds, got {self.timeout}")
        if self.stall_timeout is not None and not self.stall_timeout >= 0:
            raise ValueError(f"stall_timeout must be >= 0 seconds, got {self.stall_timeout}")


def launch(job: Job, *, stdout: IO[str] | None = None, stderr: IO[str] | None = None) -> int:
    """Run ``job``'s ranks on this host until they end; return the job's exit code.

    Every rank's stdout and stderr are relayed a whole line at a time to ``stdout`` and
    ``stderr`` (None: ``sys.stdout``, ``sys.stderr``); without ``tag_output`` a rank's stderr
    is prefixed with its rank from its first Python traceback on. If a rank fails, the
    others are stopped (SIGTERM, then SIGKILL, to each rank's process group: Note [a
    rank's processes]), the rank that started the failure is named and every rank's exit
    status printed (:func:`plait.launch.watch.watch`); with ``max_restarts`` left, every
    rank is then started again (Note [restarts]). SIGINT, SIGTERM and SIGHUP to this
    process stop every rank the same way, and are never followed by a restart; SIGUSR1 is
    passed on to the ranks that catch it. Call it from the main thread. Shared-memory
    segments the job left in /dev/shm are removed after every attempt.

    Returns:
        0 if every rank exited with 0; else the exit code of the rank that started the
        last attempt's failure (128 + N for a signal N, to that rank or to this process).

    Raises:
        ValueError: several hosts and no secret (neither ``job.secret`` nor ``PLAIT_SECRET``).
        RendezvousError: node 0 cannot serve the store at ``master_addr:master_port``; or,
            on several hosts, the launchers could not meet there before starting their
            ranks: the store cannot be reached, two were given this node rank, they were
            given different ``nproc`` or ``nnodes``, or some never came (Note [launchers
            meet] in :mod:`plait.rendezvous.nodes`).
        StartError: a rank cannot be started, for a limit of this host (descriptors,
            processes, threads or memory); the ranks started before it are stopped.
        OSError: a rank's command cannot be run (:mod:`plait.launch.starting`): no such
            program (FileNotFoundError, also for a script whose ``#!`` line names a missing
            interpreter), not executable (PermissionError), not a program this host runs
            (ENOEXEC); the message names the command and what to do, and the ranks
            started before it are stopped.
    """
    base = {**os.environ, **job.env}
    # Every connection of the job proves it knows this secret (see plait._auth).
    # Hosts of one job must share it: launchers on several hosts need PLAIT_SECRET set.
    secret = job.secret if job.secret is not None else base.get("PLAIT_SECRET")
    if secret is None:
        if job.nnodes > 1:
            raise ValueError(
                "a job on several hosts needs the same secret in every launcher "
                "(PLAIT_SECRET, e.g. export PLAIT_SECRET=$(openssl rand -hex 16))"
            )
        secret = secrets.token_hex(16)
    folder = base.get("PLAIT_DUMP_DIR", "").strip()
    problem = folder_problem(Path(folder), make=True) if folder else None
    if problem is not None:  # the ranks would each say so only when they dump
        _say(job, stderr, f"PLAIT_DUMP_DIR={folder}: {problem}; flight-recorder dumps will fail")
    _enough_descriptors(job)
    signals = _Signals()
    old = {s: signal.signal(s, signals.receive) for s in _STOPPING}
    old[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, signals.forward)
    try:
        restart = 0
        while True:
            code = _attempt(job, base, secret, restart, signals, stdout, stderr)
            if code == 0 or signals.received or restart >= job.max_restarts:
                if code != 0 and restart > 0 and not signals.received:
                    _say(job, stderr, f"no restarts left ({restart} of {job.max_restarts} used)")
                return code
            restart += 1
            _say(
                job,
                stderr,
                f"restart {restart} of {job.max_restarts}: starting every rank again "
                f"(PLAIT_RESTART_COUNT={restart})",
            )
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


# Note [restarts]
#     With ``max_restarts`` K, a failed attempt (a rank exited with a non-zero code or
#     died from a signal) is followed by another, up to K times, as torchrun's elastic
#     agent does: the failure is reported as usual (the rank that started it and every
#     rank's status), every rank is stopped, and all ``nproc`` ranks start again.
#     Nothing of the failed attempt is reused: node 0 serves a new, empty store (on the
#     same port if ``master_port`` was given, else on a new free one), so no rank reads
#     an address or key of the old attempt; the job id gets an ``-rN`` suffix, so
#     shared-memory segments get new names (the old attempt's are removed, as at the
#     end of every attempt); and a rank can tell which attempt it is in from
#     PLAIT_RESTART_COUNT (0 on the first, like TORCHELASTIC_RESTART_COUNT) and
#     PLAIT_MAX_RESTARTS. A signal to the launcher ends the job without a restart.
#     Restarts are for jobs on one host: with several hosts, each launcher would have to
#     agree with the others on when to restart, which needs launchers that meet again at
#     every restart (torchrun's rendezvous); plait run's meet once, before their first
#     ranks start (Note [launchers meet] in plait.rendezvous.nodes).


#: Signals to the launcher that stop the job: Ctrl-C, kill, and a closed terminal or ssh
#: session (SIGHUP, which would otherwise end the launcher alone and leave the ranks).
_STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


# Note [a rank's processes]
#     A rank's command may start processes of its own: ``plait run -- ./train.sh`` runs a
#     shell that runs Python, a rank may start data-loading workers. Signalled alone, the
#     shell died and left Python running, with the launcher gone. So each rank is started
#     as the leader of a process group of its own, and stopping it signals the group. Ctrl-C
#     at a terminal then reaches the launcher alone (the terminal signals its foreground
#     group), which stops every rank as it does on SIGTERM. SIGUSR1 to the launcher is
#     passed on to every rank that catches it (a plait rank dumps its flight recorders, as
#     ``kill -USR1`` of the rank does), not to its group: a shell would die of it.
#     A process of a background group that reads its terminal is stopped (SIGTTIN), so
#     where the launcher reads a terminal, the first rank of the host stays in the
#     launcher's group, reading it as before (input(), a debugger's prompt: mpirun gives
#     stdin to rank 0 too), and the others read nothing (/dev/null): they would all have
#     read the one terminal by turns before. A piped stdin goes to the first rank alone
#     too: each rank read a share of it that depended on which ran first. Stopping that
#     first rank signals the processes it started too, found in ``/proc``
#     (plait.launch.watch._strays): its descendants, and those it left when it exited,
#     which come to the launcher (a child subreaper); they used to run on after the job (a
#     wrapper script's Python, a background child). Other processes of the group (a
#     pipeline's, and theirs) are never signalled. A launcher killed with SIGKILL stops
#     nothing: each rank's Python then gets SIGTERM from its kernel (its parent the launcher) or
#     from a thread that waits on the launcher's pidfd (a wrapper script between them),
#     both asked for in plait.init (die_with_launcher in plait._processes).


def _reads_a_terminal() -> bool:
    """Whether this launcher's stdin is a terminal (Note [a rank's processes])."""
    try:
        return os.isatty(sys.stdin.fileno())
    except (AttributeError, OSError, ValueError):  # no stdin, or one without a descriptor
        return False


def _event_queue() -> queue.SimpleQueue[tuple[int, int]]:
    """The queue of an attempt's events: ranks that ended, signals, failures elsewhere."""
    return queue.SimpleQueue()


class _Signals:
    """Signals to the launcher: SIGINT, SIGTERM and SIGHUP remembered and passed to the
    current attempt; SIGUSR1 passed on to its ranks."""

    def __init__(self) -> None:
        self.received = 0
        self.events: queue.SimpleQueue[tuple[int, int]] | None = None
        self.ranks: list[RankProcess] = []  # the current attempt's, as they start

    def receive(self, signum: int, _frame: object) -> None:
        self.received = signum
        if self.events is not None:
            self.events.put((-1, -signum))

    def forward(self, signum: int, _frame: object) -> None:
        for r in list(self.ranks):
            if r.proc.returncode is None and catches_signal(r.proc.pid):
                send_usr1(r.proc)


def _say(job: Job, stream: IO[str] | None, message: str) -> None:
    """One line of the launcher's own on ``stream`` (None: sys.stderr), between attempts."""
    out = stream if stream is not None else sys.stderr
    out.write(f"{job.label}: {message}\n")
    out.flush()


def _attempt(
    job: Job,
    base: Mapping[str, str],
    secret: str,
    restart: int,
    signals: _Signals,
    stdout: IO[str] | None,
    stderr: IO[str] | None,
) -> int:
    """Start every rank of this host once, with a new store on node 0; the exit code."""
    server = None
    if job.node_rank == 0:
        server = TCPStoreServer(job.master_addr, job.master_port, secret=secret.encode())
        port = server.port
    else:
        port = job.master_port
    host = job.master_addr
    job_id = base.get("PLAIT_JOB_ID") or f"{port}{secrets.token_hex(4)}"
    if job.nnodes > 1:
        job_id = base.get("PLAIT_JOB_ID") or f"{host.replace(':', '_')}-{port}"
    if restart:
        job_id = f"{job_id}-r{restart}"

    address = format_address(host, port)
    first, total = job.node_rank * job.nproc, job.nproc * job.nnodes
    envs = [
        _rank_env(job, base, first + local, local, address, job_id, secret, restart)
        for local in range(job.nproc)
    ]
    # A SimpleQueue: the signal handler puts into it (_Signals.receive), maybe while this
    # thread is inside the queue's get, and a Queue's put waited there for the lock its get
    # held: the launcher hung with its ranks running (two signals close together).
    events = _event_queue()
    ranks: list[RankProcess] = []
    # The ranks' stall lines make the others dump too; the ranks all share one dump folder.
    note = f"launcher.node{job.node_rank}.json" if job.nnodes > 1 else "launcher.json"
    stalls = StallResponder(ranks, dump_folder(envs[0]), stall_timeout(envs[0]), note=note)
    relay = Relay(
        job.tag_output, label=job.label, stdout=stdout, stderr=stderr, on_stall=stalls.report
    )
    signals.events = events
    signals.ranks = ranks
    terminal = _reads_a_terminal()
    if terminal:  # the first rank shares this group: what it leaves comes here
        adopt_orphans()
    elsewhere: Elsewhere | None = None
    filer: _Filer | None = None
    try:
        # Launchers that disagree on the job, or share a node rank, fail here, before any
        # rank starts (Note [launchers meet] in plait.rendezvous.nodes).
        if job.nnodes > 1 and not _meet_launchers(job, base, host, port, secret, signals):
            return 128 + signals.received
        for local, env in enumerate(envs):
            if signals.received:  # before, or while, starting them: start no more
                return 128 + signals.received
            rank = first + local
            own = not (terminal and local == 0)  # Note [a rank's processes]
            before = frozenset() if own else group_members()
            try:
                proc = subprocess.Popen(
                    list(job.command),
                    env=env,
                    stdin=None if local == 0 else subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    bufsize=0,
                    process_group=0 if own else None,
                )
            except OSError as exc:  # the ranks started so far are stopped (finally)
                raise start_error(job.command, env, rank, total, exc) from exc
            relay.add(rank, proc)
            ranks.append(RankProcess(rank, proc, group=own, before=before))
            try:
                threading.Thread(
                    target=lambda r=rank, p=proc: events.put((r, p.wait())), daemon=True
                ).start()
            except RuntimeError as exc:  # "can't start new thread": the limit on threads
                raise start_error(job.command, env, rank, total, exc) from exc
        relay.start()
        # A rank that exits before it joined plait.init is filed for the others, on every
        # job (Note [ranks that never joined] in plait.rendezvous.lost). Ranks of other hosts
        # still in plait.init wait on this host's: a rank lost here is filed for them, with
        # recovery or not (without, they waited out their timeout).
        filer = _Filer(host, port, secret, relay, job_id)
        lost = filer if job.enable_recovery or job.nnodes > 1 else None
        if job.nnodes > 1 and not job.enable_recovery:  # Note [a failure on another host]
            mine = range(first, first + job.nproc)
            elsewhere = Elsewhere(
                host, port, secret, job.node_rank, mine, job.nproc * job.nnodes, events
            )
            elsewhere.start()
        return watch(
            ranks,
            relay,
            events,
            recovery=job.enable_recovery,
            on_lost=lost,
            joining=filer,
            before_stop=stalls.dump_before_stop,
            elsewhere=elsewhere,
        )
    finally:
        if elsewhere is not None:
            elsewhere.close()
        if filer is not None:
            filer.close()
        signals.events = None
        stop(ranks)
        relay.close(DRAIN_SECONDS)
        if server is not None:
            settled = elsewhere is not None and elsewhere.settled
            if ((filer is not None and filer.filed) or settled) and not job.enable_recovery:
                linger(host, port, secret, job.nnodes)  # Note [a failure on another host]
            server.close()
        _cleanup_shm(job_id)


def _enough_descriptors(job: Job) -> None:
    """Raise this process's soft limit on descriptors to what the job needs, as far as the
    hard limit allows; StartError where it does not allow enough.

    The launcher holds two pipes per rank of its host and, on node 0, the store's
    connections: one per rank of the job, two for a while during ``plait.init``. A store
    out of descriptors cannot accept the ranks that would free some, so the job waited out
    its ranks' init timeout (300 s).
    """
    ranks = job.nproc * job.nnodes if job.node_rank == 0 else 0
    need = _BASE_DESCRIPTORS + 2 * job.nproc + ranks
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= need:
        return
    if hard != resource.RLIM_INFINITY and hard < need:
        raise StartError(
            f"the launcher needs about {need} file descriptors for {job.nproc} ranks here "
            f"(two pipes for each rank's output, and the store's connections), but its "
            f"limit is {hard}: raise it (ulimit -n) or start fewer ranks"
        )
    want = 4 * need if hard == resource.RLIM_INFINITY else min(hard, 4 * need)
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


#: Descriptors the launcher holds whatever the number of ranks (its store's listener and
#: poller, the relay's selector, its own standard streams, Python's), with room to spare.
_BASE_DESCRIPTORS = 32


def _meet_seconds(job: Job, base: Mapping[str, str]) -> float:
    """Seconds a launcher waits for the others: its ranks' init deadline (``timeout``, else
    PLAIT_TIMEOUT, else the store's default), at most 10^8 s as for every plait timeout."""
    seconds = job.timeout
    if seconds is None:
        try:
            seconds = float(base.get("PLAIT_TIMEOUT", "").strip() or "nan")
        except ValueError:  # the ranks say what is wrong with it, each in its plait.init
            seconds = None
    if seconds is None or not seconds > 0:  # NaN too
        return DEFAULT_STORE_TIMEOUT
    return min(seconds, 1e8)


def _meet_launchers(
    job: Job, base: Mapping[str, str], host: str, port: int, secret: str, signals: _Signals
) -> bool:
    """Meet the job's other launchers in its store before starting a rank: True once every
    node's launcher has claimed it with the same ``nproc`` and ``nnodes``, False if a signal
    came first (Note [launchers meet] in :mod:`plait.rendezvous.nodes`).

    Every wait runs in slices of at most :data:`~plait.rendezvous.nodes.LOOK_SECONDS`,
    between which a signal to the launcher is seen: its handler only records it.

    Raises:
        RendezvousError: the store cannot be reached, this node rank is taken, the launchers
            disagree on the job, another launcher failed to meet, or some never came.
    """
    seconds = _meet_seconds(job, base)
    deadline = time.monotonic() + seconds
    address = format_address(host, port)
    store = None
    while store is None:  # node 0's launcher may start after this one
        left = deadline - time.monotonic()
        try:
            store = TCPStore(
                host,
                port,
                secret=secret.encode(),
                timeout=seconds,
                connect_timeout=max(min(left, LOOK_SECONDS), 0.0),
            )
        except StoreConnectError as exc:
            # Only a server not listening yet is worth another try (not a wrong secret).
            if not isinstance(exc.__cause__, OSError) or left <= LOOK_SECONDS:
                # The whole wait, not the last try's slice of it ("within 0.98 s").
                tried = isinstance(exc.__cause__, OSError)
                waited = f" in {seconds:g} s of trying" if tried else ""
                raise StoreConnectError(
                    f"node {job.node_rank}: cannot reach the job's store, which node 0's plait "
                    f"run serves at {address}{waited}: {exc}"
                ) from exc
            if signals.received:
                return False
    claim = NodeClaim.here(job.node_rank, job.nnodes, job.nproc)
    with store:
        try:
            return meet_nodes(
                store,
                claim,
                max(deadline - time.monotonic(), 0.0),
                stopped=lambda: bool(signals.received),
            )
        except MeetingError:
            raise
        except RendezvousError as exc:
            if job.node_rank == 0:
                raise
            raise RendezvousError(
                f"node {job.node_rank}: the job's store at {address} went away before every "
                f"launcher met (node 0's plait run ended or was stopped): {exc}"
            ) from exc


class _Filer:
    """Files a rank the launcher saw end in the job's store, for ranks still in
    ``plait.init`` that wait on it (Note [lost ranks] in :mod:`plait.rendezvous.lost`):
    a rank lost (called with how it ended), or one that exited before it joined
    (:meth:`left`, Note [ranks that never joined] there). Each rank is filed once, over
    one connection kept for the attempt; ``job_id``: the ranks' ``PLAIT_JOB_ID`` (None:
    :meth:`left` and :meth:`joined` look at nothing)."""

    def __init__(
        self, host: str, port: int, secret: str, relay: Relay, job_id: str | None = None
    ) -> None:
        self.host, self.port, self.secret, self.relay = host, port, secret.encode(), relay
        self.job_id = job_id
        self.failed = False  # the store did not answer: the next ranks are not tried
        self.unseen = False  # so for the looks at ranks that exit (left, joined)
        self.filed = False  # a rank was filed lost (not one that only exited early)
        self._done: set[int] = set()  # ranks filed, either way
        self._store: TCPStore | None = None

    def _connected(self) -> TCPStore:
        if self._store is None:
            self._store = TCPStore(self.host, self.port, secret=self.secret, timeout=_FILE_SECONDS)
        return self._store

    def __call__(self, rank: int, how: str) -> None:
        if rank in self._done:  # filed as it exited (left)
            self.filed = True
            return
        if self.failed:
            return
        try:
            report_lost(self._connected(), rank, how)
        except (CommError, OSError) as exc:  # best effort: the others time out as before
            self.failed = True
            self.close()
            self.relay.say(
                f"could not tell the other ranks in the store that rank {rank} {how}: {exc}"
            )
            return
        self._done.add(rank)
        self.filed = True

    def left(self, rank: int, code: int) -> bool:
        """Rank ``rank`` exited with ``code`` while others still run: file it if it had not
        joined the job's ``plait.init``; whether it was so filed.

        Best effort and silent: the store may have ended with node 0's launcher, at the end
        of a job, and a command that never calls ``plait.init`` (``plait run hostname``)
        has each rank filed without a word, where nobody looks.
        """
        if self.failed or self.unseen or rank in self._done or self.job_id is None:
            return False
        try:
            store = self._connected()
            if has_joined(store, rank):
                return False
            report_lost(store, rank, f"exited with code {code} {_BEFORE_INIT}")
        except (CommError, OSError):
            self.unseen = True
            self.close()
            return False
        self._done.add(rank)
        return True

    def left_elsewhere(self, ranks: Collection[int]) -> dict[int, str]:
        """Which of ``ranks`` (another host's) its launcher filed as having exited before
        they joined ``plait.init`` (:meth:`left`), and how; empty where the store does not
        say."""
        if self.failed or self.unseen or self.job_id is None or not ranks:
            return {}
        try:
            found = reports(self._connected(), list(ranks))
        except (CommError, OSError):
            self.unseen = True
            self.close()
            return {}
        return {r: how for r, how in found.items() if how.endswith(_BEFORE_INIT)}

    def joined(self, rank: int) -> bool:
        """Whether rank ``rank`` joined the job's ``plait.init`` here (False where the store
        does not say): a rank that did meets the others in this store."""
        if self.failed or self.unseen or self.job_id is None:
            return False
        try:
            return has_joined(self._connected(), rank)
        except (CommError, OSError):
            self.unseen = True
            self.close()
            return False

    def close(self) -> None:
        """Let go of the store's connection (another call opens one again)."""
        if self._store is not None:
            with contextlib.suppress(CommError, OSError):
                self._store.close()
            self._store = None


def _rank_env(
    job: Job,
    base: Mapping[str, str],
    rank: int,
    local: int,
    address: str,
    job_id: str,
    secret: str,
    restart: int = 0,
) -> dict[str, str]:
    """The environment of rank ``rank`` (``local`` on this host) in attempt ``restart``."""
    env = dict(base)
    env.update(
        PLAIT_RANK=str(rank),
        PLAIT_SIZE=str(job.nproc * job.nnodes),
        PLAIT_LOCAL_RANK=str(local),
        PLAIT_LOCAL_SIZE=str(job.nproc),
        PLAIT_NODE_RANK=str(job.node_rank),
        PLAIT_NNODES=str(job.nnodes),
        PLAIT_STORE=f"tcp://{address}",
        PLAIT_JOB_ID=job_id,
        PLAIT_SECRET=secret,
        PLAIT_RESTART_COUNT=str(restart),
        PLAIT_LAUNCHER_PID=str(os.getpid()),  # the rank dies with it (plait.init)
        PLAIT_MAX_RESTARTS=str(job.max_restarts),
    )
    # Output goes through pipes: without this, a Python command would hold its stdout
    # in a block buffer, late and lost if it is killed.
    env.setdefault("PYTHONUNBUFFERED", "1")
    if job.nnodes > 1 and "PLAIT_HOST" not in base:
        # One launcher per host: its node index names the host, so that
        # hosts emulated on one machine are told apart too.
        env["PLAIT_HOST"] = f"{socket.gethostname()}-node{job.node_rank}"
    if job.transport:
        env["PLAIT_TRANSPORT"] = job.transport
    if job.timeout:
        env["PLAIT_TIMEOUT"] = str(job.timeout)
    if job.stall_timeout is not None:  # 0 too: off, whatever the launcher inherited
        env["PLAIT_STALL_TIMEOUT"] = str(job.stall_timeout)
    return env


def _cleanup_shm(job_id: str) -> None:
    """Remove the shared-memory segments of job ``job_id`` that its ranks left behind."""
    for path in glob.glob(f"/dev/shm/plait-{job_id}*"):
        with contextlib.suppress(OSError):
            os.unlink(path)
