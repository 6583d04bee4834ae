"""``comm.abort()`` in real processes: peers inside a collective, and an aborting rank that
exits at once (docs/fault-tolerance.md, Note [abort] in plait._recovery).

Three ranks meet through a store served by this process, which outlives them all. Rank 0
aborts; ranks 1 and 2 must raise AbortedError naming rank 0 and its reason, within about a
second, on the call they are in and on every later call, and never PeerLostError blaming a
rank that merely aborted (or exited after aborting). The ranks and this process coordinate
through the ranks' standard input and output.
"""

from __future__ import annotations

import secrets
import textwrap
from pathlib import Path
from typing import Any

import pytest
from test_recovery_processes import finish

from by_hand import start_by_hand
from plait.rendezvous.tcp_store import TCPStoreServer

SECRET = secrets.token_hex(16)
N = 3

#: Prepended to every rank script: one JSON line of results.
PROLOGUE = """\
import json
def report(**fields):
    print("RESULT " + json.dumps(fields), flush=True)
"""

#: What the peers (ranks 1 and 2) run: tell the test they are about to enter an allreduce
#: that rank 0 never joins, and report how it ended and how the next call fails.
PEER = """
print("ENTERING", flush=True)
try:
    comm.allreduce(np.ones(COUNT))
    error = message = None
except plait.CommError as exc:
    error, message = type(exc).__name__, str(exc)
at = time.time()
try:
    comm.allreduce(np.ones(4))
    later = later_message = None
except plait.CommError as exc:
    later, later_message = type(exc).__name__, str(exc)
report(rank=comm.rank, error=error, message=message, at=at, later=later,
       later_message=later_message)
comm.close()
"""


@pytest.fixture
def server():
    s = TCPStoreServer("127.0.0.1", 0, secret=SECRET.encode())
    yield s
    s.close()


def start(script: str, tmp_path: Path, server: TCPStoreServer, transport: str) -> list[Any]:
    """Start ``N`` ranks of ``script`` (after the prologue and ``plait.init``)."""
    path = tmp_path / "rank.py"
    head = "import os, signal, sys, threading, time, numpy as np, plait\n"
    head += "comm = plait.init(timeout=60)\ncomm.allreduce(np.ones(4))\n"
    path.write_text(PROLOGUE + head + textwrap.dedent(script))
    return start_by_hand(path, N, server, SECRET, transport, tmp_path / "dumps", stdin=True)


def await_line(proc: Any, word: str) -> str:
    """Read ``proc``'s output up to a line that starts with ``word``, and return that line
    (the rank failed if its output ends first)."""
    while True:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"the rank ended before saying {word}:\n{proc.stderr.read()}")
        if line.startswith(word):
            return line


def tell(proc: Any) -> None:
    """Send ``proc`` the line its script waits for."""
    proc.stdin.write("go\n")
    proc.stdin.flush()


def check_peers(results: list[dict | None], logs: str, aborted_at: float, reason: str) -> None:
    """Ranks 1 and 2 raised AbortedError naming rank 0 and ``reason``, within a second of the
    abort, on the call in flight and on the next one."""
    said = f"the communicator was aborted by rank 0 ({reason})"
    for r in (1, 2):
        res = results[r]
        assert res is not None, logs
        assert res["error"] == "AbortedError", logs
        assert said in res["message"], logs
        assert res["at"] - aborted_at < 1.0, logs
        assert res["later"] == "AbortedError", logs
        assert said in res["later_message"], logs


TRANSPORTS = ["shm", "tcp"]


IN_FLIGHT = """
if comm.rank == 0:
    sys.stdin.readline()  # both peers are entering an allreduce that this rank never joins
    time.sleep(0.3)  # a long computation here; the peers wait inside their allreduce
    at = time.time()
    comm.abort("giving up")
    returned = time.time() - at
    try:
        comm.allreduce(np.ones(4))
        later = None
    except plait.CommError as exc:
        later = type(exc).__name__
    report(rank=0, at=at, returned=returned, later=later)
    comm.close()
else:
""" + textwrap.indent(PEER, "    ")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("count", [4, 1 << 16], ids=["small", "large"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_peers_inside_a_collective_raise_aborted_error_naming_the_aborting_rank(
    tmp_path: Path, server: TCPStoreServer, transport: str, count: int
) -> None:
    procs = start(IN_FLIGHT.replace("COUNT", str(count)), tmp_path, server, transport)
    for p in procs[1:]:
        await_line(p, "ENTERING")
    tell(procs[0])
    results = finish(procs)
    logs = finish.logs  # type: ignore[attr-defined]
    me = results[0]
    assert me is not None, logs
    assert me["later"] == "AbortedError", logs
    assert me["returned"] < 1.0, logs  # abort waits for the peers, but not for long
    check_peers(results, logs, me["at"], "giving up")


EXIT_AFTER_ABORT = """
if comm.rank == 0:
    comm.abort("exiting")
    os._exit(0)  # at once: no close, no interpreter shutdown, no thread left to finish
sys.stdin.readline()  # rank 0 has exited
try:
    comm.allreduce(np.ones(4))
    error = message = None
except plait.CommError as exc:
    error, message = type(exc).__name__, str(exc)
report(rank=comm.rank, error=error, message=message)
comm.close()
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_an_abort_followed_at_once_by_exit_reaches_idle_peers_as_an_abort(
    tmp_path: Path, server: TCPStoreServer, transport: str
) -> None:
    procs = start(EXIT_AFTER_ABORT, tmp_path, server, transport)
    assert procs[0].wait(60) == 0
    for p in procs[1:]:
        tell(p)
    results = finish(procs)
    logs = finish.logs  # type: ignore[attr-defined]
    for r in (1, 2):
        res = results[r]
        assert res is not None, logs
        assert res["error"] == "AbortedError", logs
        assert "aborted by rank 0 (exiting)" in res["message"], logs


EXIT_WHILE_PEERS_WAIT = """
if comm.rank == 0:
    sys.stdin.readline()  # both peers are entering an allreduce that this rank never joins
    time.sleep(0.3)  # a long computation here; the peers wait inside their allreduce
    print(f"ABORTED_AT {time.time()}", flush=True)
    comm.abort("exiting")
    os._exit(0)
else:
""" + textwrap.indent(PEER, "    ")

SIGTERM_WHILE_PEERS_WAIT = """
if comm.rank == 0:
    def on_sigterm(*_):
        os.write(1, f"ABORTED_AT {time.time()}\\n".encode())  # no buffered file in a handler
        comm.abort("preempted")
        os._exit(0)
    signal.signal(signal.SIGTERM, on_sigterm)
    sys.stdin.readline()  # both peers are entering an allreduce that this rank never joins
    # The behaviour under test: SIGTERM arrives while this rank is blocked in a call.
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
    comm.recv(np.zeros(1), 1, tag=99)  # nobody sends this
else:
""" + textwrap.indent(PEER, "    ")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["exit", "sigterm"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_an_abort_followed_at_once_by_exit_reaches_peers_inside_a_collective(
    tmp_path: Path, server: TCPStoreServer, transport: str, how: str
) -> None:
    script = EXIT_WHILE_PEERS_WAIT if how == "exit" else SIGTERM_WHILE_PEERS_WAIT
    procs = start(script.replace("COUNT", "4"), tmp_path, server, transport)
    for p in procs[1:]:
        await_line(p, "ENTERING")
    tell(procs[0])
    aborted_at = float(await_line(procs[0], "ABORTED_AT").split()[1])
    results = finish(procs)
    logs = finish.logs  # type: ignore[attr-defined]
    assert procs[0].returncode == 0, logs
    check_peers(results, logs, aborted_at, "exiting" if how == "exit" else "preempted")
