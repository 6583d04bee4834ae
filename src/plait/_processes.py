"""Where a rank's process runs, and whether it still does (Note [agree] in :mod:`plait._recovery`).

A pid names the same process only on the same machine (boot id) and in the same pid
namespace, and only as long as the process it named lives: a new one may get the pid
again. So a process is its machine, its pid and its start time (field 22 of
``/proc/<pid>/stat``), and it is alive while a process of that pid with that start time
runs and is not a zombie.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import sys
import threading
from typing import NamedTuple

from plait.transport.shm.doorbell import machine

__all__ = [
    "Process",
    "alive",
    "die_with_launcher",
    "host_name",
    "machine",
    "stopped",
    "this_process",
]


def host_name() -> str:
    """The name of the host this rank runs on: ``PLAIT_HOST``, or the machine's."""
    return os.environ.get("PLAIT_HOST") or socket.gethostname()


class Process(NamedTuple):
    """Where a rank runs: its machine (boot id and pid namespace), pid and start time."""

    machine: str
    pid: int
    start: str


def _stat(pid: int) -> tuple[str, str] | None:
    """Fields 3 and 22 of ``/proc/<pid>/stat`` (state, start time), or None: no such
    process, or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # the name (field 2) may hold spaces
    if fields[0] in ("Z", "X"):
        return None
    return fields[0], fields[19]


def _start_time(pid: int) -> str | None:
    """Field 22 of ``/proc/<pid>/stat`` (start time), or None: no such process, or a zombie."""
    stat = _stat(pid)
    return None if stat is None else stat[1]


_PROCESS: Process | None = None


def this_process() -> Process:
    """This process (made again after a fork: the child is another process)."""
    global _PROCESS
    pid = os.getpid()
    if _PROCESS is None or _PROCESS.pid != pid:
        _PROCESS = Process(machine(), pid, _start_time(pid) or "")
    return _PROCESS


def alive(proc: Process) -> bool:
    """Whether ``proc`` (on this machine) still runs: same pid, same start time, no zombie."""
    if not proc.machine:
        return True
    return _start_time(proc.pid) == proc.start


def stopped(proc: Process) -> bool | None:
    """Whether ``proc`` (on this machine) is stopped (SIGSTOP, a debugger: state T or t);
    None if it no longer runs."""
    stat = _stat(proc.pid)
    if stat is None or stat[1] != proc.start:
        return None
    return stat[0] in ("T", "t")


def _parent(pid: int) -> int:
    """Field 4 of ``/proc/<pid>/stat`` (the parent's pid), or 0 where unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return 0
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def _ancestor(pid: int) -> bool:
    """Whether process ``pid`` is this process's parent, or its parent's, and so on."""
    at = os.getppid()
    for _ in range(64):  # a chain of wrappers, never a cycle: pid 1's parent is 0
        if at == pid:
            return True
        if at <= 1:
            return False
        at = _parent(at)
    return False


_WATCHING: int | None = None  # the pid whose launcher this process watches (one thread)


def die_with_launcher(launcher: str | None) -> bool:
    """Have this process get SIGTERM when the launcher whose pid is ``launcher`` dies
    (``plait run`` sets PLAIT_LAUNCHER_PID), if the launcher is its parent or a further
    ancestor; whether that is arranged.

    A launcher killed with SIGKILL cannot stop its ranks, and they ran on, orphaned, until
    their timeout or for ever. Where the launcher is the parent, the kernel sends the signal
    (prctl's PR_SET_PDEATHSIG); where a wrapper script stands between (the rank's Python is
    the script's child), a daemon thread waits on a pidfd of the launcher, which becomes
    readable when it exits (blocked in ``select``: no polling). Linux only.
    """
    global _WATCHING
    if not launcher or not (launcher.isascii() and launcher.isdigit()):
        return False
    pid = int(launcher)
    if pid != os.getppid():
        if os.getpid() == _WATCHING:  # a second init in this process: watched already
            return True
        if not _ancestor(pid):
            if not _gone_since(pid):
                return False  # someone else's launcher (a variable inherited from afar)
            _end_without(pid)  # it died before this rank asked: as if now
            return True
        if not _watch(pid):
            return False
        _WATCHING = os.getpid()
        return True
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, int(signal.SIGTERM), 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != pid:  # it died before the request: as if just now
        _end_without(pid)
    return True


def _end_without(pid: int) -> None:
    """End this process with SIGTERM, as the end of its launcher ``pid`` would have, where
    the launcher had gone before the process asked to die with it; say so first, for
    otherwise it ends without a word (a PLAIT_LAUNCHER_PID left in the environment of a
    process no launcher started, say)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):  # stderr closed, or None
        sys.stderr.write(
            f"plait: the launcher that PLAIT_LAUNCHER_PID names (pid {pid}) is gone, so this "
            "process ends (SIGTERM), as its ranks do; unset PLAIT_LAUNCHER_PID if plait run "
            "did not start it\n"
        )
        sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGTERM)


def _gone_since(pid: int) -> bool:
    """Whether the launcher ``pid``, not an ancestor of this process, has exited since it
    started this process: no such process, or one that started after this one (the pid
    taken again). A process that started before this one is someone else's launcher whose
    variable this process inherited from afar, not this rank's."""
    theirs, mine = _start_time(pid), _start_time(os.getpid())
    if mine is None:  # no /proc: nothing to go by
        return False
    return theirs is None or int(theirs) > int(mine)  # (a zombie is gone too)


def _watch(pid: int) -> bool:
    """Start the thread that sends this process SIGTERM when process ``pid`` (an
    ancestor) exits; whether it runs."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:  # it died (and was reaped) since: as if just now
        _end_without(pid)
        return True
    except (AttributeError, OSError):  # no pidfd (Linux < 5.3)
        return False
    if not _ancestor(pid):  # it exited, and another process took its pid, before the open
        os.close(fd)
        _end_without(pid)
        return True
    me = os.getpid()

    def wait() -> None:
        try:
            poller = select.poll()  # not select(): a descriptor may be past 1023
            poller.register(fd, select.POLLIN)
            while not poller.poll():
                pass  # (poll without a timeout returns only with an event)
        except OSError:
            return
        finally:
            os.close(fd)
        if os.getpid() == me:
            os.kill(me, signal.SIGTERM)

    threading.Thread(target=wait, name="plait-launcher-watch", daemon=True).start()
    return True
