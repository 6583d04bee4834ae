"""``comm.close()`` from a signal handler over a call of the same communicator, in real processes
(Note [close in a signal handler] in docs/transport.md).

Python runs a handler on the main thread between two bytecodes of the code it interrupted, which
stays suspended under the handler: a close that waited for that code (a wait asleep in poll(), or
one holding the endpoint's lock) waited forever. Two ranks meet through a store served by this
process; rank 1 never joins rank 0's call, and a SIGALRM handler on rank 0 closes the
communicator while rank 0 waits in it. The close must return at once, the call must then fail
with ClosedError, and the transport's descriptors must be closed.
"""

from __future__ import annotations

import secrets
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_recovery_processes import finish

from by_hand import start_by_hand
from plait.rendezvous.tcp_store import TCPStoreServer

SECRET = secrets.token_hex(16)

#: Rank 0 blocks in CALL, which rank 1 never joins, and closes the communicator from a SIGALRM
#: handler; it reports how long the close took, how the call ended and what it left open.
SCRIPT = """
import json, os, signal, sys, time, numpy as np, plait

def report(**fields):
    print("RESULT " + json.dumps(fields), flush=True)

def descriptors():
    seen = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            seen[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, closed since
            pass
    return seen

before = descriptors()
comm = plait.init(timeout=60)
comm.allreduce(np.ones(4))
if comm.rank == 1:
    sys.stdin.readline()  # rank 0 has reported: this rank never joined its call
    comm.close()
    sys.exit(0)
ep = comm._transport
ep.spin = SPIN  # a long spin holds the endpoint's lock, as a wait's first moments do
closes = []

def on_alarm(*_):
    at = time.monotonic()
    comm.close()
    closes.append((at, time.monotonic() - at))

signal.signal(signal.SIGALRM, on_alarm)
signal.setitimer(signal.ITIMER_REAL, 0.3)
try:
    CALL
    error = message = None
except plait.CommError as exc:
    error, message = type(exc).__name__, str(exc)
failed_after = time.monotonic() - closes[0][0] if closes else None
try:
    comm.allreduce(np.ones(4))
    later = None
except plait.CommError as exc:
    later = type(exc).__name__
# A close left to a thread of its own (the lock was held) releases the links there: it
# notifies the endpoint's condition once it has.
with ep._cond:
    ep._cond.wait_for(lambda: ep._poller is None or ep._poller.closed, 30)
job = getattr(ep, "job", None)
report(
    closed_in=closes[0][1] if closes else None,
    error=error,
    message=message,
    failed_after=failed_after,
    later=later,
    opened=sorted(t for fd, t in descriptors().items() if before.get(fd) != t),
    files=[n for n in os.listdir("/dev/shm") if job and n.startswith(f"plait-{job}")],
)
"""

CALLS = {
    # on shared memory the one-sided arena allreduce, which waits on its window
    "allreduce": "comm.allreduce(np.ones(4))",
    "recv": "comm.recv(np.zeros(1), 1, tag=99)",  # nobody sends this
}


@pytest.fixture
def server() -> Iterator[TCPStoreServer]:
    s = TCPStoreServer("127.0.0.1", 0, secret=SECRET.encode())
    yield s
    s.close()


def start(script: str, tmp_path: Path, server: TCPStoreServer, transport: str) -> list[Any]:
    path = tmp_path / "rank.py"
    path.write_text(textwrap.dedent(script))
    return start_by_hand(path, 2, server, SECRET, transport, tmp_path / "dumps", stdin=True)


def run(
    tmp_path: Path, server: TCPStoreServer, transport: str, call: str, spin: float
) -> dict[str, Any]:
    """Rank 0's report; a rank 0 that hangs is killed with rank 1 when the test times out."""
    script = SCRIPT.replace("CALL", CALLS[call]).replace("SPIN", repr(spin))
    procs = start(script, tmp_path, server, transport)
    try:
        procs[0].wait()  # hung here, for good, while a close in a handler waited for its call
        procs[1].stdin.write("go\n")
        procs[1].stdin.flush()
        results = finish(procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = finish.logs  # type: ignore[attr-defined]
    assert procs[0].returncode == 0, logs
    assert procs[1].returncode == 0, logs
    res = results[0]
    assert res is not None, logs
    res["logs"] = logs
    return res


def check(res: dict[str, Any], within: float) -> None:
    logs = res["logs"]
    assert res["closed_in"] is not None, logs
    assert res["closed_in"] < 1.0, logs  # the close returned at once, in the handler
    assert res["error"] == "ClosedError", logs
    assert "closed" in res["message"], logs
    assert res["failed_after"] < within, logs  # once the handler returned (and the spin ended)
    assert res["later"] == "ClosedError", logs
    assert res["files"] == [], logs


@pytest.mark.timeout(60)
@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_close_in_a_handler_over_a_wait_in_poll_fails_the_call(
    tmp_path: Path, server: TCPStoreServer, transport: str, call: str
) -> None:
    res = run(tmp_path, server, transport, call, 50e-6)
    check(res, 2.0)
    opened = res["opened"]
    if transport == "shm" and call == "allreduce":
        # A shared-memory mapping that a one-sided call cut short still views is unmapped only
        # once those views are gone (Segment.release), as after a close from another thread.
        opened = [t for t in opened if not t.startswith("/memfd:")]
    assert opened == [], res["logs"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_close_in_a_handler_over_a_wait_that_holds_the_lock_fails_the_call(
    tmp_path: Path, server: TCPStoreServer, transport: str
) -> None:
    # A receive's first wait spins (up to 2 s) with the endpoint's lock held; the alarm comes 0.3 s
    # in, while it spins.
    res = run(tmp_path, server, transport, "recv", 2.0)
    check(res, 4.0)
    assert res["opened"] == [], res["logs"]
