"""``plait.launch.launch`` with a command that cannot run, or a host that cannot start more.

A command that cannot run on any rank (no such program, not executable, a ``#!`` line naming
a missing interpreter, no program at all) raises an OSError of the system's kind that names
the command and what to do; it was a StartError that blamed the host's limits ("start fewer
ranks") for a typo. StartError stays for the limits (EAGAIN, ENOMEM, EMFILE, a thread).
"""

from __future__ import annotations

import errno
import io
import os
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest

from plait.launch import Job, StartError, launch
from plait.launch import job as job_module


def _launch(command: list[str], nproc: int = 2) -> None:
    launch(Job(command, nproc=nproc), stdout=io.StringIO(), stderr=io.StringIO())


def _file(path: Path, text: str, mode: int) -> str:
    path.write_text(text)
    path.chmod(mode)
    return str(path)


def test_a_program_not_on_path_is_not_a_limit_of_the_host() -> None:
    with pytest.raises(FileNotFoundError) as caught:
        _launch(["nonexistent_prog_x"])
    assert not isinstance(caught.value, StartError)
    assert caught.value.errno == errno.ENOENT
    said = str(caught.value)
    assert "cannot start rank 0 of 2 ranks: nonexistent_prog_x: command not found on PATH" in said
    assert "check its spelling, or give its path" in said
    assert "limit" not in said
    assert "fewer ranks" not in said


@pytest.mark.parametrize(
    ("make", "kind", "number", "said"),
    [
        (lambda d: str(d / "missing"), FileNotFoundError, errno.ENOENT, "no such file: check"),
        (  # execve says ENOENT for the interpreter, not for the script
            lambda d: _file(d / "job.sh", "#!/nonexistent/interp\necho hi\n", 0o755),
            FileNotFoundError,
            errno.ENOENT,
            "the interpreter its first line names does not exist (#!/nonexistent/interp)",
        ),
        (
            lambda d: _file(d / "job.py", "print('hi')\n", 0o644),
            PermissionError,
            errno.EACCES,
            "make it executable (chmod +x",
        ),
        (lambda d: str(d), PermissionError, errno.EACCES, "is a directory, not a program"),
        (
            lambda d: _file(d / "job.txt", "echo hi\n", 0o755),  # no #! line
            OSError,
            errno.ENOEXEC,
            "not a program this host can run",
        ),
        (
            lambda d: _file(d / "plain", "x", 0o644) + "/prog",
            NotADirectoryError,
            errno.ENOTDIR,
            "a part of its path is not a directory",
        ),
    ],
    ids=["missing", "interpreter", "not-executable", "directory", "no-program", "not-a-dir"],
)
def test_a_command_that_cannot_run_names_it_and_what_to_do(
    tmp_path: Path, make: Any, kind: type[OSError], number: int, said: str
) -> None:
    program = make(tmp_path)
    t0 = time.monotonic()
    with pytest.raises(kind) as caught:
        _launch([program, "arg"])
    assert not isinstance(caught.value, StartError)
    assert caught.value.errno == number
    assert f"cannot start rank 0 of 2 ranks: {program}: " in str(caught.value)
    assert said in str(caught.value)
    assert time.monotonic() - t0 < 10


def test_a_command_line_in_one_item_says_to_split_it() -> None:
    with pytest.raises(FileNotFoundError, match=r"such as \['python', 'hello\.py'\]"):
        _launch(["python hello.py"])


def test_the_ranks_started_before_a_command_that_cannot_run_are_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The program goes away after rank 0 started: rank 1's start fails, rank 0 is stopped.
    program = _file(tmp_path / "rank.sh", "#!/bin/sh\nexec sleep 60\n", 0o755)
    real = subprocess.Popen
    started: list[subprocess.Popen[bytes]] = []

    def popen(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        proc = real(*args, **kwargs)
        started.append(proc)
        os.unlink(program)
        return proc

    monkeypatch.setattr(subprocess, "Popen", popen)
    t0 = time.monotonic()
    with pytest.raises(FileNotFoundError, match=r"cannot start rank 1 of 3 ranks: .* no such file"):
        _launch([program], nproc=3)
    assert len(started) == 1
    assert started[0].returncode is not None  # stopped and reaped
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize(
    ("number", "filename", "said"),
    [
        (errno.EAGAIN, None, "a limit of this host on processes, threads or memory"),
        (errno.ENOMEM, None, "a limit of this host on processes, threads or memory"),
        (errno.ENOMEM, "true", "a limit of this host on processes, threads or memory"),
        (errno.EMFILE, None, "raise it (ulimit -n) or start fewer ranks"),
        (errno.ENFILE, None, "start fewer ranks"),
    ],
)
def test_a_limit_of_the_host_is_still_a_start_error(
    monkeypatch: pytest.MonkeyPatch, number: int, filename: str | None, said: str
) -> None:
    def popen(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        if filename is None:  # fork or a pipe failed
            raise OSError(number, os.strerror(number))
        raise OSError(number, os.strerror(number), filename)  # the exec did

    monkeypatch.setattr(subprocess, "Popen", popen)
    with pytest.raises(StartError, match="cannot start rank 0 of 2 ranks") as caught:
        _launch(["true"])
    assert os.strerror(number) in str(caught.value)
    assert said in str(caught.value)


def test_a_thread_that_cannot_start_is_a_start_error(monkeypatch: pytest.MonkeyPatch) -> None:
    class Thread:
        def __init__(self, **kwargs: Any) -> None:
            pass

        def start(self) -> None:
            raise RuntimeError("can't start new thread")

    monkeypatch.setattr(job_module, "threading", types.SimpleNamespace(Thread=Thread))
    with pytest.raises(StartError, match=r"can't start new thread .* start fewer ranks"):
        _launch([sys.executable, "-c", "pass"])
