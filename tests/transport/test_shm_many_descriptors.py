"""Shared memory is set up in a process that holds more than 1024 open descriptors.

The rendezvous waited on its sockets with ``select``, which takes no descriptor past
FD_SETSIZE (1024): a rank whose application held many files (``plait run`` raises the
descriptor limit as far as the job needs) failed ``plait.init`` or ``split`` with a bare
``ValueError: filedescriptor out of range in select()``, and its peers said only that it
hung up. That is tested in real processes, as every descriptor of a rank counts; what
the OS refuses during the set-up otherwise is a plait error naming the cause (ranks on
threads).
"""

from __future__ import annotations

import errno
import json
import os
import resource
import select
import socket
import subprocess
import sys
import textwrap
import threading
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from shm_helpers import in_threads, no_leftovers  # noqa: F401 - no_leftovers: autouse fixture

from plait.errors import CommError, TransportError
from plait.rendezvous.store import MemoryStore
from plait.transport import descriptors
from plait.transport.shm import ShmTransport

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm (Linux)"),
    pytest.mark.timeout(120),
]

#: Descriptors each rank opens besides its own: enough that every later one is past 1024.
OPENED = 1100
#: The soft limit a rank needs: the files, plus plait's and Python's own.
NEEDED = OPENED + 400

#: Opens OPENED files before plait.init (its segments and sockets come after them), splits,
#: opens as many again and splits again (the group's window is set up past them too).
JOB = f"""
    import json, resource, numpy as np, plait
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < {2 * NEEDED}:
        resource.setrlimit(resource.RLIMIT_NOFILE, ({2 * NEEDED}, hard))
    keep = [open("/dev/null") for _ in range({OPENED})]
    with plait.init(timeout=60) as comm:
        said = {{"first": keep[-1].fileno(), "world": comm.allreduce(np.ones(2)).tolist()}}
        g = comm.split(0)
        said["split"] = g.allreduce(np.ones(2)).tolist()
        keep += [open("/dev/null") for _ in range({OPENED})]
        h = comm.split(0)
        said["second"] = keep[-1].fileno()
        said["split again"] = h.allreduce(np.ones(2)).tolist()
        said["windows"] = [x._transport.window is not None for x in (g, h)]
        h.close()
        g.close()
        print(json.dumps(said), flush=True)
"""


@pytest.mark.multiprocess
def test_init_and_split_with_more_than_1024_descriptors_open(tmp_path: Path) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2 * NEEDED:
        pytest.skip(f"the hard limit on open files ({hard}) leaves no room past 1024")
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(JOB))
    res = subprocess.run(
        [sys.executable, "-m", "plait", "run", "-n", "2", "--transport", "shm", str(path)],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=ROOT,
    )
    said = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    tail = (res.stdout + res.stderr)[-3000:]
    assert res.returncode == 0, tail
    assert len(said) == 2, tail
    for one in said:
        assert min(one["first"], one["second"]) >= 1024, one
        assert one["world"] == one["split"] == one["split again"] == [2.0, 2.0], one
        assert one["windows"] == [True, True], one


def _open_fds() -> int:
    return len(os.listdir(f"/proc/{os.getpid()}/fd"))


def _outcomes(size: int) -> list[Any]:
    """Each rank's ShmTransport, or what its constructor raised (ranks on threads named r0..)."""
    store = MemoryStore(timeout=20)

    def rank(r: int) -> Any:
        threading.current_thread().name = f"r{r}"
        try:
            return ShmTransport(r, size, store, timeout=20, slots=2, slot_bytes=4096)
        except CommError as exc:
            return exc

    return in_threads([partial(rank, r) for r in range(size)])


def test_a_value_error_of_the_os_in_the_rendezvous_is_a_transport_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 1's receive of a segment's file raises ValueError, as the OS's calls may for a
    descriptor they cannot take: a TransportError naming it, told to rank 0 (it was raised
    bare, and rank 0 said only that rank 1 hung up)."""
    recv_fds = socket.recv_fds

    def failing(*args: Any) -> Any:
        if threading.current_thread().name == "r1":
            raise ValueError("filedescriptor out of range (a test)")
        return recv_fds(*args)

    monkeypatch.setattr(socket, "recv_fds", failing)
    before = _open_fds()
    made = _outcomes(2)
    for t in made:
        if isinstance(t, ShmTransport):
            t.close()
    assert isinstance(made[1], TransportError), made
    assert "filedescriptor out of range (a test)" in str(made[1]), made
    assert isinstance(made[0], CommError), made
    assert "filedescriptor out of range (a test)" in str(made[0]), made
    assert _open_fds() == before


def test_no_descriptor_left_for_the_endpoint_is_a_transport_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 1 has no descriptor left for its endpoint's epoll once the rendezvous is done: a
    TransportError naming the OS's error, and what the rendezvous set up is released (the
    OSError came bare, and its peer's socket and segment stayed open)."""
    epoll = select.epoll

    class Select:
        def __getattr__(self, name: str) -> Any:
            return getattr(select, name)

        def epoll(self, *args: Any) -> Any:
            if threading.current_thread().name == "r1":
                raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
            return epoll(*args)

    monkeypatch.setattr(descriptors, "select", Select())
    before = _open_fds()
    made = _outcomes(2)
    for t in made:
        if isinstance(t, ShmTransport):
            t.close()
    assert isinstance(made[1], TransportError), made
    assert "Too many open files" in str(made[1]), made
    assert _open_fds() == before
