"""Why a rank could not be started, as the error :func:`plait.launch.launch` raises.

Two kinds of failure look alike from ``subprocess.Popen``, and call for different answers:

- the host ran out of something (processes, threads, memory, descriptors): the command is
  fine, fewer ranks would start. :class:`StartError`.
- the command itself cannot run on any rank: no such program, not executable, a script
  whose ``#!`` line names a missing interpreter, a file that is no program. An
  :class:`OSError` of the kind the system gave (:class:`FileNotFoundError`,
  :class:`PermissionError`, ...), naming the command and what to do.

A failed ``exec`` of the command is told apart by the file name ``Popen`` puts on its
error (the command's program); a failed ``fork`` or pipe carries none.
"""

from __future__ import annotations

import errno
import os
import resource
import shutil
from collections.abc import Mapping, Sequence

__all__ = ["CANNOT_START", "StartError", "start_error"]

#: The errors of a host out of something: more ranks than it can start.
_LIMITS = frozenset({errno.EAGAIN, errno.ENOMEM, errno.EMFILE, errno.ENFILE, errno.ENOBUFS})


#: How the message of every error :func:`start_error` makes begins.
CANNOT_START = "cannot start rank"


class StartError(OSError):
    """A rank of the job could not be started: the host's limit on descriptors, processes,
    threads or memory was reached. The message names the rank and the limit."""


def start_error(
    command: Sequence[str], env: Mapping[str, str], rank: int, total: int, exc: BaseException
) -> OSError:
    """The error to raise when rank ``rank`` of ``total`` cannot be started with ``command``
    (and environment ``env``) for ``exc``: a :class:`StartError` for a limit of the host,
    else an :class:`OSError` of ``exc``'s errno that says what is wrong with the command."""
    said = f"{CANNOT_START} {rank} of {total} ranks"
    if not isinstance(exc, OSError) or exc.errno in _LIMITS:  # a thread that cannot start too
        return StartError(_limit(said, exc))
    if exc.filename is None:  # not the command's exec: something else of the start failed
        return OSError(exc.errno, f"{said}: {exc.strerror or exc}")
    return OSError(exc.errno, f"{said}: {_unrunnable(str(command[0]), env, exc)}")


def _limit(said: str, exc: BaseException) -> str:
    """What to say of a limit of the host that ``exc`` reports."""
    why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    if isinstance(exc, OSError) and exc.errno == errno.EMFILE:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return (
            f"{said}: {why} (the launcher holds two pipes for each rank's output, and its "
            f"limit is {soft} descriptors): raise it (ulimit -n) or start fewer ranks"
        )
    limit = "a limit of this host on processes, threads or memory"
    return f"{said}: {why} ({limit}): start fewer ranks"


def _unrunnable(program: str, env: Mapping[str, str], exc: OSError) -> str:
    """What is wrong with ``program``, which the system would not run (``exc``), and what to do."""
    found = program if os.sep in program else shutil.which(program, path=env.get("PATH"))
    if exc.errno == errno.ENOENT:
        if found is None or not os.path.exists(found):
            if " " in program:
                return (
                    f"no program named {program!r}: give the program and each of its "
                    f"arguments as an item of its own, such as {program.split()!r}"
                )
            if os.sep in program:
                return f"{program}: no such file: check the path (from {os.getcwd()})"
            return f"{program}: command not found on PATH: check its spelling, or give its path"
        line = _first_line(found)
        if line.startswith("#!"):
            return (
                f"{program}: the interpreter its first line names does not exist ({line}): "
                f"fix that line, or run the script with its interpreter"
            )
        return f"{program}: its loader or interpreter does not exist (built for another system?)"
    if exc.errno == errno.EACCES and found is not None and os.path.isdir(found):
        return f"{program}: is a directory, not a program"
    if exc.errno == errno.EACCES and found is not None and not os.access(found, os.X_OK):
        return (
            f"{program}: permission denied: make it executable (chmod +x {program}), or run "
            f"it with its interpreter, such as ['python', {program!r}]"
        )
    if exc.errno == errno.EACCES:
        return (
            f"{program}: permission denied: a folder of its path cannot be searched, or its "
            f"file system does not allow programs to run (mounted noexec)"
        )
    if exc.errno == errno.ENOEXEC:
        return (
            f"{program}: not a program this host can run (a script without a #! line, or "
            f"built for another system): start the script with a #! line, or run it with "
            f"its interpreter, such as ['sh', {program!r}] or ['python', {program!r}]"
        )
    if exc.errno == errno.ENOTDIR:
        return f"{program}: a part of its path is not a directory: check the path"
    return f"{program}: {exc.strerror or exc}: check the command"


def _first_line(path: str) -> str:
    """The first line of file ``path`` (at most 256 bytes), or "" where it cannot be read."""
    try:
        with open(path, "rb") as f:
            return f.readline(256).strip().decode(errors="replace")
    except OSError:
        return ""
