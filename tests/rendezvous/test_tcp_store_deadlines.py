"""The TCP store client against a server that stopped answering: no call overshoots a short
timeout by the handshake's or the answer's fixed allowance."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest

from plait.errors import RendezvousError
from plait.rendezvous.tcp_store import TCPStore

#: Seconds within which a call of a 1 s store must have failed (1 s, its grace, and load);
#: the fixed allowances were 10 s.
_WITHIN = 5.0


def _fails_within(seconds: float, call: Callable[[], object]) -> None:
    start = time.monotonic()
    with pytest.raises(RendezvousError):
        call()
    took = time.monotonic() - start
    assert took < seconds, f"took {took:.1f} s"


def test_a_server_that_never_starts_the_handshake_fails_the_connect_by_its_timeout() -> None:
    # Listening but never accepting: the kernel completes the connection, nothing answers.
    with socket.create_server(("127.0.0.1", 0)) as silent:
        port = silent.getsockname()[1]
        _fails_within(_WITHIN, lambda: TCPStore("127.0.0.1", port, timeout=1))


@pytest.fixture
def stoppable_server() -> Iterator[tuple[int, subprocess.Popen[str]]]:
    """A store server in a child process, resumed and ended at teardown."""
    code = (
        "from plait.rendezvous.tcp_store import TCPStoreServer\n"
        "import sys\n"
        "server = TCPStoreServer('127.0.0.1', 0)\n"
        "print(server.port, flush=True)\n"
        "sys.stdin.read()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        yield int(proc.stdout.readline()), proc
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.communicate()  # waits, and closes its pipes


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_calls_to_a_stopped_server_fail_by_their_timeout(
    stoppable_server: tuple[int, subprocess.Popen[str]],
) -> None:
    port, proc = stoppable_server
    store = TCPStore("127.0.0.1", port, timeout=1)
    try:
        store.set("k", b"v")
        os.kill(proc.pid, signal.SIGSTOP)
        os.waitpid(proc.pid, os.WUNTRACED)  # returns once it has stopped
        _fails_within(_WITHIN, lambda: store.set("k", b"w"))
        _fails_within(_WITHIN, lambda: store.get("missing"))
        _fails_within(_WITHIN, lambda: store.wait(["missing"], timeout=0.5))
        # A new connection (the last calls closed theirs): the handshake is bounded too.
        _fails_within(_WITHIN, lambda: store.check(["k"]))
    finally:
        store.close()
