"""Without ``--tag-output``, every line of a rank's traceback carries its ``[rank]: `` prefix,
the causes Python prints without a "Traceback" line before them included (an exception that
was never raised, plait's ``err.__cause__ = why``): they came out bare, as the relay began
prefixing only at the first "Traceback" line (Note [causes printed without a traceback] in
plait.launch.relay)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from plait.launch.relay import Relay

pytestmark = pytest.mark.timeout(60)

#: What Python prints for an error whose causes were never raised, as the probe of a plait
#: CommError chain showed it (a cause's message of two lines and a note, too).
CHAIN = [
    "plait.errors.CommError: rank 2 cancelled its send\n",
    "\n",
    "The above exception was the direct cause of the following exception:\n",
    "\n",
    "plait.errors.MismatchError: rank 2 withdrew the message\n",
    "it was about to receive\n",
    "a note on it\n",
    "\n",
    "The above exception was the direct cause of the following exception:\n",
    "\n",
    "Traceback (most recent call last):\n",
    '  File "job.py", line 10, in <module>\n',
    "    comm.allreduce(x)\n",
    "plait.errors.PeerLostError: rank 0: allreduce (direct, call #1): rank 2 gave up\n",
]


class _Pipes:
    """A rank's pipes as the relay takes them from a Popen, and their write ends."""

    def __init__(self) -> None:
        (out, self.out_w), (err, self.err_w) = os.pipe(), os.pipe()
        self.stdout, self.stderr = os.fdopen(out, "rb"), os.fdopen(err, "rb")


@pytest.fixture
def relay() -> Iterator[tuple[Relay, Any, io.StringIO]]:
    """A relay of rank 3's stderr, fed by the test a read at a time (its thread not started)."""
    err = io.StringIO()
    r = Relay(False, stdout=io.StringIO(), stderr=err)
    pipes = _Pipes()
    r.add(3, pipes)  # type: ignore[arg-type]
    yield r, r._streams[pipes.stderr.fileno()], err
    for fd in (pipes.out_w, pipes.err_w):
        os.close(fd)
    r.close(10)  # the pipes at their end: the relay's thread ends at once


@pytest.mark.parametrize("reads", ["a line at a time", "all at once"])
def test_every_line_of_a_chain_of_causes_gets_the_prefix(
    relay: tuple[Relay, Any, io.StringIO], reads: str
) -> None:
    r, stream, err = relay
    before = ["step 1 done\n", "loss 0.25\n"]
    lines = before + CHAIN
    for data in lines if reads == "a line at a time" else ["".join(lines)]:
        r._feed(stream, data.encode())
    assert err.getvalue() == "".join(before) + "".join(f"[3]: {line}" for line in CHAIN)
    tb = r.traceback(3)
    assert tb.first == "plait.errors.PeerLostError"  # what the launcher reads is as before
    assert not r._holding


def test_a_line_that_only_looks_like_a_cause_is_written_as_it_is(
    relay: tuple[Relay, Any, io.StringIO],
) -> None:
    """A line of an exception's shape waits for what follows, no longer than it must: a line
    that no cause has after it, the end of the output, or its time has it written bare."""
    r, stream, err = relay
    r._feed(stream, b"Epoch: 1\n")
    assert err.getvalue() == ""  # it may be a cause: held
    r._feed(stream, b"\n")
    r._feed(stream, b"next\n")  # not "The above exception ...": no cause
    assert err.getvalue() == "Epoch: 1\n\nnext\n"
    r._feed(stream, b"Epoch: 2\n")
    assert r._hold_left() is not None
    stream.held_at -= 1.0  # as if it had waited its time
    r._release_due()
    assert err.getvalue() == "Epoch: 1\n\nnext\nEpoch: 2\n"
    assert r._hold_left() is None
    r._feed(stream, b"KeyboardInterrupt\n")
    r._end(stream)  # the rank's output ended
    assert err.getvalue() == "Epoch: 1\n\nnext\nEpoch: 2\nKeyboardInterrupt\n"


@pytest.mark.multiprocess
def test_plait_run_prefixes_the_causes_printed_without_a_traceback(tmp_path: Path) -> None:
    path = tmp_path / "job.py"
    path.write_text(
        textwrap.dedent(
            """
            import os
            if os.environ["PLAIT_RANK"] == "1":
                why = ConnectionError("rank 2 cancelled its send")
                mid = ValueError("withdrew the message")
                mid.__cause__ = why
                err = RuntimeError("rank 1 gave up")
                err.__cause__ = mid
                raise err
            """
        )
    )
    res = subprocess.run(
        [sys.executable, "-m", "plait", "run", "-n", "2", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 1, res.stderr
    mine = [line for line in res.stderr.splitlines() if line.startswith("[1]: ")]
    assert mine[:3] == [
        "[1]: ConnectionError: rank 2 cancelled its send",
        "[1]: ",
        "[1]: The above exception was the direct cause of the following exception:",
    ]
    assert mine[-1] == "[1]: RuntimeError: rank 1 gave up"
    for line in res.stderr.splitlines():
        assert line.startswith(("plait run: ", "[1]: ")), line
