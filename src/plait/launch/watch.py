"""Watching a job's ranks: who started a failure, how every rank ended, stopping the rest.

The launcher (:func:`plait.launch.launch`) hands every rank's process to :func:`watch`,
which waits for the ranks to finish, for one to fail or for a signal to the launcher.
On a failure it names the rank that started it (not one that failed because a peer had
failed first), stops the others with SIGTERM and then SIGKILL (:func:`stop`), and prints
every rank's exit status; it returns the exit code the job ends with.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import signal
import subprocess
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

from plait.launch.elsewhere import ELSEWHERE, GATHER_SECONDS, STOPPED, Elsewhere, exit_code
from plait.launch.relay import DRAIN_SECONDS, Relay, Traceback, is_symptom, named_ranks

__all__ = [
    "GRACE_SECONDS",
    "LINGER_SECONDS",
    "Joining",
    "RankProcess",
    "adopt_orphans",
    "signal_rank",
    "stop",
    "watch",
]

#: Seconds between SIGTERM and SIGKILL when stopping ranks.
GRACE_SECONDS = 5.0
#: Seconds to wait, after a rank failed of a plait communication error (a symptom: a peer is
#: gone), for a rank that failed otherwise (the cause) to exit by itself. See
#: Note [which rank started a failure].
LINGER_SECONDS = 3.0


# Note [which rank started a failure]
#     When one rank raises, say, ValueError, its communicator closes and its peers raise
#     PeerLostError, and those peers may exit before it does (its interpreter is still
#     printing the traceback and shutting down). Naming the first rank to exit would blame
#     a bystander. So the launcher reads each rank's stderr for Python tracebacks: the
#     exception a traceback starts with (the first of a chain of "During handling of..." or
#     "The above exception was the direct cause...") says why the rank failed. Failures are
#     of three kinds, from the likeliest cause to the likeliest symptom:
#
#     1. a traceback that starts with an exception other than plait's CommError, or with a
#        CommError that the rank's own calls caused (MismatchError: its call differs from
#        the others', a bug found where it is raised; UnsupportedError, ForkedError), or a
#        death by a signal: a cause;
#     2. a non-zero exit code and no traceback (sys.exit(3), a command that is not Python):
#        maybe a cause, maybe a rank that caught PeerLostError and exited;
#     3. a traceback that starts with another CommError (PeerLostError, AbortedError, a
#        timeout waiting for a peer and the like): a symptom (relay.is_symptom).
#
#     The launcher stops the job at once on a failure of kind 1. After one of kind 2 or 3 it
#     waits for one of kind 1 (at most 1 s, or LINGER_SECONDS after kind 3), or until every
#     rank has exited, then names the first failure by time of the likeliest kind: its
#     traceback's start if it printed one, else its exit. If no failure of kind 1 came, a
#     rank still running whose stderr shows a whole traceback of kind 1, begun at most
#     LINGER_SECONDS before the first failure and followed by no output of the rank (a
#     rank that logged an exception it handled goes on writing; a line of stdout read
#     together with the traceback's end may have been written before it, and does not
#     count: Traceback.wrote in plait.launch.relay), is named instead: it
#     raised and then hung on its way out (on a thread that is not a daemon, say); the job
#     exits with code 1, as Python would have. Reading tracebacks needs nothing from the
#     ranks (a command that is not Python, or that never imports plait, works the same);
#     an exception printed by a hook of the rank's own in another format counts as an exit
#     of kind 2.


@dataclass
class RankProcess:
    """One rank's process, as the launcher started it, and how it ended."""

    rank: int
    proc: subprocess.Popen[bytes]
    #: (exit code, time.monotonic()) once the rank has exited by itself.
    exit: tuple[int, float] | None = None
    #: The launcher stopped it.
    stopped: bool = False
    #: Whether it leads a process group of its own, which stopping it signals whole (Note
    #: [a rank's processes] in :mod:`plait.launch.job`).
    group: bool = False
    #: Without a group of its own: the processes of the launcher's group there were before
    #: it started (:func:`group_members`), and those found since that are its own.
    before: frozenset[int] = frozenset()
    strays: frozenset[int] = frozenset()


class Joining(Protocol):
    """What the launcher learns from the job's store about the ranks' ``plait.init``
    (Note [ranks that never joined] in :mod:`plait.rendezvous.lost`)."""

    def left(self, rank: int, code: int) -> bool:
        """Rank ``rank`` exited with ``code`` while others still run: whether it had not
        joined ``plait.init``, and was filed for the ranks that wait on it there."""
        ...

    def joined(self, rank: int) -> bool:
        """Whether rank ``rank`` joined ``plait.init`` in the job's store."""
        ...

    def left_elsewhere(self, ranks: Collection[int]) -> dict[int, str]:
        """Which of ``ranks`` (another host's) its launcher filed as having exited before
        they joined ``plait.init``, and how each ended."""
        ...


#: Kinds of failure, most to least likely to have started a job's failure.
_CAUSE, _EXIT, _SYMPTOM = 0, 1, 2
#: Seconds to wait after a failure of each kind for a _CAUSE (see Note [which rank started...]).
_LINGER = {_EXIT: 1.0, _SYMPTOM: LINGER_SECONDS}


def _kind(r: RankProcess, relay: Relay) -> int:
    """How ``r`` failed: _CAUSE (a signal, or a traceback that starts with an exception other
    than a symptom's), _EXIT (a non-zero exit code and no traceback), or _SYMPTOM (a
    traceback that starts with a CommError a rank meets when a peer failed first)."""
    assert r.exit is not None
    tb = relay.traceback(r.rank)
    if r.exit[0] < 0:
        return _CAUSE
    if tb.first is None:
        return _EXIT
    return _SYMPTOM if is_symptom(tb.first) else _CAUSE


def _first_failure(failed: Sequence[RankProcess], relay: Relay) -> RankProcess:
    """The rank that started the failure: the first by time of the likeliest kind."""

    def key(r: RankProcess) -> tuple[int, float]:
        assert r.exit is not None
        tb = relay.traceback(r.rank)
        when = tb.started if tb.first is not None and r.exit[0] > 0 else r.exit[1]
        return _kind(r, relay), when

    return min(failed, key=key)


def _chain(tb: Traceback, keep: Callable[[str], bool]) -> list[str]:
    """The lines of ``tb``'s chain, its first exception's and its last's, whose exception
    ``keep`` takes: a rank that wraps plait's error in its own (``raise RuntimeError(...)
    from exc``) failed of the first all the same, and one that raised a plait error while
    handling another still says what it met last."""
    lines = [tb.first_line] if tb.first is not None and keep(tb.first) else []
    if tb.last is not None and keep(tb.last) and tb.last_line not in lines:
        lines.append(tb.last_line)
    return lines


def _lost_named(tb: Traceback) -> set[int]:
    """The ranks of the job that a PeerLostError of ``tb`` (the first of its chain, or the
    last) names (plait.launch.relay.named_ranks): the peers it lost, where the rank failed of
    one or raised it last. Of no other error: a timeout's or an abort's may still run."""
    lines = _chain(tb, lambda name: _short(name) == "PeerLostError")
    return set().union(*map(named_ranks, lines))


def _symptom_named(tb: Traceback) -> set[int]:
    """The ranks of the job that a symptom of ``tb`` (a plait error a rank meets when a peer
    failed first, relay.is_symptom; the first of its chain, or the last) names."""
    return set().union(*map(named_ranks, _chain(tb, is_symptom)))


def _left_elsewhere(
    joining: Joining, tb: Traceback, mine: Collection[int]
) -> tuple[int, str] | None:
    """Another host's rank that a symptom of ``tb`` names (:func:`_symptom_named`) and that
    its launcher filed as having exited before it joined ``plait.init``, and how it ended;
    the lowest of them, or None. Only its own host saw it exit (Note [ranks that never
    joined] in plait.rendezvous.lost)."""
    named = _symptom_named(tb)
    away = joining.left_elsewhere(sorted(named - set(mine)))
    return min(away.items()) if away else None


def _ended_well(
    ranks: Sequence[RankProcess],
    relay: Relay,
    never: Sequence[RankProcess],
    elsewhere: Elsewhere | None,
) -> int:
    """The exit code of a job whose ranks here all ended with 0: 0, unless one of them
    exited before it joined ``plait.init`` and ranks of another host failed of it, waiting
    there for it; their failure is then this host's too, named as everywhere (Note [ranks
    that never joined] in plait.rendezvous.lost). Its launcher exited 0 before, for a job
    that had failed. It waits for the verdict at most :data:`GATHER_SECONDS`, and not at
    all once every other host's launcher said that its ranks too ended so (a command that
    never calls ``plait.init``)."""
    if not never or elsewhere is None:
        return 0
    verdict = elsewhere.outcome(GATHER_SECONDS)
    if verdict is None:
        return 0
    rank, how = verdict
    if all(r.rank != rank for r in ranks):
        return _failed_elsewhere(ranks, relay, rank, how)
    relay.say(f"rank {rank} {how}")
    relay.say("the job failed; every rank's exit status:")
    for r in ranks:
        mark = "   <- started the failure" if r.rank == rank else ""
        relay.say(f"  rank {r.rank}: {_status(r, relay)}{mark}")
    return exit_code(how)


def _left_early(
    ranks: Sequence[RankProcess], first: RankProcess, tb: Traceback
) -> list[RankProcess]:
    """Ranks that exited with 0 before ``first`` failed, where a PeerLostError of its chain
    names them (:func:`_lost_named`): a rank that returns early is a peer lost to those
    still in a call with it, and the rank that raised first was not the cause."""
    named = _lost_named(tb)
    if first.exit is None or not named:
        return []
    return [
        r
        for r in ranks
        if r.exit is not None and r.exit[0] == 0 and r.exit[1] <= first.exit[1] and r.rank in named
    ]


def _never_joined(
    never: Sequence[RankProcess], first: RankProcess, tb: Traceback, joining: Joining | None
) -> RankProcess | None:
    """The rank that started the failure where ``first`` failed of a plait error (a symptom,
    the first of its chain or the last: :func:`_symptom_named`) that names a rank of
    ``never`` (ranks that exited before they joined ``plait.init``, filed for the others):
    the first of those by time, if ``first`` itself joined ``plait.init`` in the job's
    store, else None (Note [ranks that never joined] in plait.rendezvous.lost).

    ``first`` must have joined: a rank that meets its peers through another store (the
    torch backend, in torch's) leaves no claim in the job's, and a rank of its that
    exited with 0 after its work would be taken for one that never started.
    """
    if first.exit is None or joining is None:
        return None
    said = _symptom_named(tb)
    named = [r for r in never if r.exit is not None and r.exit[1] <= first.exit[1]]
    named = [r for r in named if r.rank in said]
    if not named or not joining.joined(first.rank):
        return None
    return min(named, key=lambda r: r.exit[1] if r.exit is not None else 0.0)


def _hung_causes(
    ranks: Sequence[RankProcess], failed: Sequence[RankProcess], relay: Relay
) -> list[RankProcess]:
    """Ranks still running whose latest traceback, whole, starts with another exception than a
    CommError and began at most LINGER_SECONDS before the first failure, and that wrote
    nothing after it: ranks that raised and then hung on their way out (on a thread that is
    not a daemon, say). A traceback printed long before, or followed by more output, is one
    the rank handled."""
    since = min(r.exit[1] for r in failed if r.exit is not None) - LINGER_SECONDS

    def raised_lately(tb: Traceback) -> bool:
        first = tb.first
        whole = not tb.in_frames
        return (
            first is not None
            and whole
            and not tb.went_on
            and tb.started >= since
            and not is_symptom(first)
        )

    return [r for r in ranks if r.exit is None and raised_lately(relay.traceback(r.rank))]


def _failed_elsewhere(ranks: Sequence[RankProcess], relay: Relay, rank: int, how: str) -> int:
    """Stop this host's ranks after rank ``rank`` of another host ended ``how``; its code."""
    relay.say(f"rank {rank}, on another host, {how}; stopping the ranks of this host")
    stop(ranks)
    relay.close(DRAIN_SECONDS)
    relay.say("the job failed on another host; this host's ranks:")
    for r in ranks:
        relay.say(f"  rank {r.rank}: {_status(r, relay)}")
    return exit_code(how)


def _describe(code: int) -> str:
    """How a rank that exited by itself ended, for the launcher's first message about it."""
    if code < 0:
        return f"was killed by {_signal_name(-code)}"
    return f"exited with code {code}"


def _signal_name(number: int) -> str:
    """``SIGTERM`` for 15; a number no signal has is named as such."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _short(name: str) -> str:
    """An exception's name without its module: ``PeerLostError``."""
    return name.rpartition(".")[2]


def _status(r: RankProcess, relay: Relay) -> str:
    """How ``r`` ended, for the job's summary: ``exit 1 (ValueError)``, ``killed by SIGTERM``."""
    code = r.proc.returncode
    tb = relay.traceback(r.rank)
    text = f"killed by {_signal_name(-code)}" if code < 0 else f"exit {code}"
    stopped = r.stopped and code < 0  # else it exited by itself, in time or not
    notes = []
    if stopped:
        notes.append(f"stopped by {relay.label}")
    if code != 0 and tb.last is not None:
        notes.append(f"after {_short(tb.last)}" if stopped else _short(tb.last))
    return text + (f" ({', '.join(notes)})" if notes else "")


def signal_rank(r: RankProcess, sig: int) -> None:
    """Send ``sig`` to every process of rank ``r``: its process group if it leads one of
    its own (a wrapper script's children, a rank's workers, even once the rank exited),
    else its process while it runs and the processes it started (:func:`_strays`)."""
    if r.group:
        with contextlib.suppress(ProcessLookupError):  # nobody is left in it
            os.killpg(r.proc.pid, sig)
        return
    r.strays |= _strays(r)
    if r.proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            r.proc.send_signal(sig)
    for pid in r.strays:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def group_members() -> frozenset[int]:
    """The processes of this launcher's process group, itself included (empty where
    ``/proc`` cannot be read)."""
    return frozenset(pid for pid, (_, group) in _processes().items() if group == os.getpgrp())


def _processes() -> dict[int, tuple[int, int]]:
    """Every process's (parent, process group), from ``/proc``."""
    table: dict[int, tuple[int, int]] = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    with open(f"/proc/{name}/stat", "rb") as f:
                        fields = f.read().rpartition(b")")[2].split()
                except OSError:  # it ended meanwhile
                    continue
                table[int(name)] = (int(fields[1]), int(fields[2]))
    return table


def _strays(r: RankProcess) -> frozenset[int]:
    """The processes rank ``r`` started where it shares the launcher's process group (at a
    terminal, Note [a rank's processes] in :mod:`plait.launch.job`): its descendants, and
    those it left that were handed to this launcher (a subreaper: :func:`adopt_orphans`),
    in the launcher's group and not there before it started. Never another process of the
    group (a pipeline's other commands and theirs, ``plait run ... | tee log``)."""
    table = _processes()
    me, group = os.getpid(), os.getpgrp()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    # Orphans handed to this launcher: its children other than the rank, in its group.
    todo = [r.proc.pid]
    todo += [p for p in children.get(me, ()) if p != r.proc.pid and table[p][1] == group]
    found: set[int] = set()
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    found.update(p for p in children.get(me, ()) if p != r.proc.pid and table[p][1] == group)
    return frozenset(p for p in found if p not in r.before and table.get(p, (0, 0))[1] == group)


def adopt_orphans() -> None:
    """Make this process the parent of the processes its ranks leave behind (Linux's child
    subreaper), so that :func:`_strays` still finds those of a rank that exited first."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


#: prctl's option that makes a process the parent of its descendants' orphans.
_PR_SET_CHILD_SUBREAPER = 36


def _reap(pids: frozenset[int]) -> None:
    """Reap those of ``pids`` that are this launcher's children and have ended (adopted)."""
    for pid in pids:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)


def _group_left(r: RankProcess) -> bool:
    """Whether a process of rank ``r``'s own group, or one it started, still runs (its
    leader reaped or not)."""
    if not r.group:
        return any(_alive(pid) for pid in r.strays)
    try:
        os.killpg(r.proc.pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie counts until its parent reaps it)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def stop(ranks: Sequence[RankProcess]) -> None:
    """Stop every rank: SIGTERM to each one's processes, then SIGKILL to those left after
    GRACE_SECONDS (its process group: a wrapper script's children too); reap them all."""
    for r in ranks:
        if r.proc.poll() is None:
            r.stopped = r.exit is None
        signal_rank(r, signal.SIGTERM)  # a rank that exited may have left workers
    deadline = time.monotonic() + GRACE_SECONDS
    for r in ranks:
        with contextlib.suppress(subprocess.TimeoutExpired):
            r.proc.wait(max(deadline - time.monotonic(), 0.0))
    # A process of a rank's group that outlives its leader cannot be waited for: look
    # every 50 ms until the grace ends (Note [a rank's processes]).
    while any(_group_left(r) for r in ranks) and time.monotonic() < deadline:
        time.sleep(0.05)
    for r in ranks:
        if r.proc.poll() is None or _group_left(r):
            signal_rank(r, signal.SIGKILL)
        r.proc.wait()
        _reap(r.strays)


def _survivors(
    ranks: Sequence[RankProcess],
    relay: Relay,
    events: queue.SimpleQueue[tuple[int, int]],
    on_lost: Callable[[int, str], None] | None,
    joining: Joining | None,
    never: list[RankProcess],
) -> tuple[list[RankProcess], list[RankProcess]]:
    """``--enable-recovery``: wait while ranks exit with 0 or are killed by a signal.

    Returns the ranks still running once one exits with a non-zero code (its event is put
    back for :func:`watch`) or all have ended, and those killed by a signal. Each of these
    is passed to ``on_lost`` (its rank and how it ended) as it is seen; a rank that exits
    with 0 is passed to ``joining``, and added to ``never`` where it had not joined
    ``plait.init``.
    """
    running = list(ranks)
    lost: list[RankProcess] = []
    while running:
        rank, code = events.get()
        if rank < 0 or code > 0:  # a signal to the launcher, or a failure to report as usual
            events.put((rank, code))
            break
        r = next(p for p in running if p.rank == rank)
        running.remove(r)
        r.exit = (code, time.monotonic())
        if code == 0 and running and joining is not None and joining.left(r.rank, code):
            never.append(r)
        if code < 0:
            lost.append(r)
            how = _describe(code)
            relay.say(f"rank {r.rank} {how}; the others go on (--enable-recovery)")
            if on_lost is not None:
                on_lost(r.rank, how)
    return running, lost


def watch(
    ranks: Sequence[RankProcess],
    relay: Relay,
    events: queue.SimpleQueue[tuple[int, int]],
    *,
    recovery: bool = False,
    on_lost: Callable[[int, str], None] | None = None,
    joining: Joining | None = None,
    before_stop: Callable[[dict[int, str], float], str | None] | None = None,
    elsewhere: Elsewhere | None = None,
) -> int:
    """Wait for the ranks to finish, for a failure or for a signal; return the job's exit code.

    ``events`` carries ``(rank, exit code)`` as each rank exits, and ``(-1, -signum)`` when the
    launcher receives a signal. The exit code is 0 if every rank exited with 0, else the code
    of the rank that started the failure (128 + N for signal N, or for signal N to the
    launcher).

    After a failure that may not be the cause, wait a little for one that is (Note [which rank
    started a failure]), then stop the others and name the rank that started it.

    With ``recovery`` (``plait run --enable-recovery``) a rank killed by a signal is reported
    and the others go on, to agree and shrink (docs/fault-tolerance.md), and passed to
    ``on_lost`` (its rank and how it ended: "was killed by SIGKILL"); the job's exit code
    is then that of the first of the others to fail (0 if none did), and a failure of any
    other kind stops the job as without it. Without ``recovery``, ``on_lost`` (a job on
    several hosts) gets every rank of a failed job that did not end well, the ones about to
    be stopped included, for the other hosts' ranks still in ``plait.init``.

    ``joining``: told of every rank that exits by itself while others still run, to file it
    for them where it had not joined ``plait.init``. A job that then fails of a plait error
    naming such a rank names it as the rank that started the failure (it exited with 0,
    say, before calling ``plait.init``, while the others waited there for it: Note [ranks
    that never joined] in plait.rendezvous.lost), and exits with the code of the rank that
    failed first.

    ``before_stop``: called once a job failed, before its ranks still running, if any, are
    stopped, with how each failed rank ended and when the first did (wall clock; they dump
    their flight recorders, and a note of how the failed ranks ended goes beside the dumps,
    ranks or none), its line said.

    ``elsewhere``: for a job on several hosts, what settles with the other hosts' launchers
    which rank started a failure, and puts ``(ELSEWHERE, rank)`` on ``events`` when they
    settled on a rank of another host: this host's ranks are then stopped, and the exit code
    is that rank's (Notes [a failure on another host] and [which host started a failure] in
    plait.launch.elsewhere). A failure of this host's is settled so too before it is named.
    """
    by_rank = {r.rank: r for r in ranks}
    running = len(ranks)
    never: list[RankProcess] = []  # ranks that exited before they joined plait.init
    lost: list[RankProcess] = []  # with recovery: ranks killed, which the others went on from
    if recovery:
        survivors, lost = _survivors(ranks, relay, events, on_lost, joining, never)
        running = len(survivors)
        if not survivors:  # every rank ended: with 0, or killed
            if len(lost) < len(ranks):
                return 0  # some finished: the losses were recovered from
            ended = lost[0].exit
            return 128 - ended[0] if ended is not None else 1
    deadline = float("inf")
    failed: list[RankProcess] = []
    ticket: int | None = None  # this host's place among those that failed (plait.launch.elsewhere)
    while running:
        timeout = None if deadline == float("inf") else max(0.0, deadline - time.monotonic())
        try:
            rank, code = events.get(timeout=timeout)
        except queue.Empty:
            break  # no cause came within the linger
        if rank == ELSEWHERE and elsewhere is not None:
            elsewhere.seen()
            return _failed_elsewhere(ranks, relay, code, elsewhere.how.get(code, "failed"))
        if rank < 0:  # a signal to the launcher
            relay.say(f"received {_signal_name(-code)}; stopping all ranks")
            stop(ranks)
            return 128 - code
        r = by_rank[rank]
        r.exit = (code, time.monotonic())
        running -= 1
        # Ranks of other hosts may still run: a rank that leaves last here is filed too.
        others = running or elsewhere is not None
        if joining is not None and code >= 0 and others and joining.left(r.rank, code):
            never.append(r)
        if code == 0:
            continue
        relay.drained(r.rank, DRAIN_SECONDS)  # its traceback, if any, has been read
        failed.append(r)
        if elsewhere is not None and len(failed) == 1:  # Note [which host started a failure]
            ticket = elsewhere.ticket()
        kind = _kind(r, relay)
        if kind == _CAUSE:
            break
        deadline = min(deadline, r.exit[1] + _LINGER[kind])
    if not failed:  # with recovery: the ranks left finished, whatever was lost on the way
        return _ended_well(ranks, relay, never, elsewhere)
    first = _first_failure(failed, relay)
    hung = [] if _kind(first, relay) == _CAUSE else _hung_causes(ranks, failed, relay)
    if hung:
        first = min(hung, key=lambda r: relay.traceback(r.rank).started)
    tb = relay.traceback(first.rank)
    rest = "; stopping the other ranks" if running else ""
    if first.exit is None:
        code = 1  # what Python exits with after an uncaught exception
        said = f"raised {_short(tb.last or '?')} but has not exited"
    else:
        code = first.exit[0]
        why = f" ({_short(tb.last)})" if tb.last is not None and code > 0 else ""
        said = f"{_describe(code)}{why}"
    # The host whose rank started the failure files it, before the consequences, and every
    # host names the one the launchers settle on (Note [which host started a failure]).
    kind = _CAUSE if first.exit is None else _kind(first, relay)
    early = None if hung or kind != _SYMPTOM else _never_joined(never, first, tb, joining)
    cause = first
    if early is not None and early.exit is not None:  # it failed the others' plait.init
        cause, kind = early, _EXIT
        said = f"{_describe(early.exit[0])} before calling plait.init (the others waited there)"
    elif kind == _SYMPTOM and not hung and tb.last is not None:  # a loss the others did not
        gone = _lost_named(tb)  # recover from (--enable-recovery): their PeerLostError names it
        killed = [r for r in lost if r.exit is not None and r.rank in gone]
        if killed:
            early = cause = min(killed, key=lambda r: r.exit[1] if r.exit is not None else 0.0)
            assert cause.exit is not None
            kind, said = _EXIT, f"{_describe(cause.exit[0])} (the others failed of its loss)"
    filing = (kind, cause.rank, said)
    if early is None and kind == _SYMPTOM and not hung and elsewhere is not None:
        away = None  # the same, of a rank of another host that its launcher filed
        if joining is not None and joining.joined(first.rank):
            away = _left_elsewhere(joining, tb, by_rank)
        if away is not None:
            filing = (_EXIT, away[0], f"{away[1]} (the others waited there)")
    settle = elsewhere is not None and ticket is not None and elsewhere.file(ticket, *filing)
    if on_lost is not None and not recovery:  # for other hosts' ranks still in plait.init
        for r in ranks:
            if r.exit is not None and r.exit[0] != 0:
                on_lost(r.rank, _describe(r.exit[0]))
        for r in ranks:
            if r.exit is None:
                on_lost(r.rank, f"{STOPPED} after rank {first.rank} failed")
    if settle and elsewhere is not None and ticket is not None:
        since = min(r.exit[1] for r in failed if r.exit is not None)
        better_until = since + LINGER_SECONDS if filing[0] == _SYMPTOM else 0.0
        verdict = elsewhere.verdict(ticket, filing[0], better_until)
        if verdict is not None and verdict[0] not in by_rank:
            return _failed_elsewhere(ranks, relay, *verdict)
    relay.say(f"rank {cause.rank} {said}{rest}")
    if before_stop is not None:  # even with none left to stop: its note is written
        how = {r.rank: _describe(r.exit[0]) for r in failed if r.exit is not None}
        when = min(r.exit[1] for r in failed if r.exit is not None)
        # Wall-clock, a second early: the others may have dumped what they met just before.
        line = before_stop(how, time.time() - (time.monotonic() - when) - 1.0)
        if line is not None:
            relay.say(line)
    stop(ranks)
    relay.close(DRAIN_SECONDS)
    left = [] if early is not None else _left_early(ranks, first, tb)
    relay.say("the job failed; every rank's exit status:")
    for r in ranks:
        mark = "   <- started the failure" if r is cause and not left else ""
        if r is early and r in never:
            mark += " (exited before calling plait.init)"
        if r in left:
            mark = "   <- exited while the others still needed it"
        relay.say(f"  rank {r.rank}: {_status(r, relay)}{mark}")
    if tb.last is not None and code > 0:
        named = f"rank {cause.rank} {said}: " if early is not None else ""
        relay.say(f"{named}rank {first.rank} failed with {tb.last_line[:300]}")
    return code if code > 0 else 128 - code
