"""A large message withdrawn over TCP never arrives, also at a receive posted afterwards.

Note [withdrawn messages] in plait/transport/tcp/rendezvous.py: TCP reads frames only
while a call waits, so a receive posted after the sender had withdrawn its message read
the announcement and the withdrawal together, took the message and then failed with
MismatchError ("rank 0 withdrew the 8000000-byte message (tag 4611686018427387904)"),
naming an internal tag; only a second receive got the next message.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

#: Rank 1 is in no call of plait's until rank 0's send has timed out and been withdrawn.
WITHDRAWN_BEFORE_THE_RECV = """
    import os, numpy as np, plait
    fifo = os.path.join(os.path.dirname(os.path.abspath(__file__)), "withdrawn")
    if os.environ["PLAIT_RANK"] == "1":
        os.mkfifo(fifo)  # before init: rank 0 opens it after init
    comm = plait.init(timeout=60)
    n = 1_000_000  # 8 MB: announced, sent once the receiver clears it
    if comm.rank == 0:
        try:
            comm.send(np.full(n, 1.0), 1, timeout=0.5)
            raise SystemExit("the send completed while rank 1 was in no call")
        except plait.CommTimeout:
            pass  # withdrawn: none of it had left
        req = comm.isend(np.full(n, 2.0), 1)
        req.test()  # a round of progress: out go the withdrawal and this announcement
        with open(fifo, "w") as f:
            f.write("withdrawn")
        req.wait()
    else:
        with open(fifo) as f:  # blocks until rank 0 has withdrawn its first message
            f.read()
        buf = np.zeros(n)
        st = plait.Status()
        try:
            comm.recv(buf, 0, status=st)
        except plait.CommError as exc:
            raise SystemExit(f"the receive failed: {type(exc).__name__}: {exc}")
        assert (buf == 2.0).all(), np.unique(buf)
        assert (st.source, st.tag, st.count) == (0, 0, n), st
        print("the receive took the message sent after the withdrawn one", flush=True)
    comm.barrier()
"""


def test_a_receive_posted_after_the_sender_withdrew_takes_the_next_message(
    tmp_path: Path,
) -> None:
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(WITHDRAWN_BEFORE_THE_RECV))
    res = subprocess.run(
        [sys.executable, "-m", "plait", "run", "-n", "2", "--transport", "tcp", str(path)],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=ROOT,
    )
    out = (res.stdout + res.stderr)[-3000:]
    assert res.returncode == 0, out
    assert "the receive took the message sent after the withdrawn one" in res.stdout, out
    assert "withdrew" not in out, out
