"""What a rank says about its own call when calls differ, and one unit for segments everywhere.

The default check (a digest in every message header) can only tell that two
ranks' calls differ; the communicator adds what this rank called and how to
see every rank's call (PLAIT_DEBUG=detail). Segments are shown in bytes,
formatted alike (``1 MiB``), in the signature and in the log of auto's choices.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
from typing import Any

import numpy as np
import pytest

import plait
from plait.testing import run_ranks

HINT = "set PLAIT_DEBUG=detail to compare every rank's call"


def test_mismatch_names_this_ranks_call_and_the_hint() -> None:
    def body(comm: plait.Communicator) -> str:
        x = np.ones(5 + comm.rank)
        with pytest.raises(plait.MismatchError) as info:
            comm.allreduce(x, algorithm="recursive_doubling", timeout=10)
        return str(info.value)

    for r, msg in enumerate(run_ranks(2, body)):
        assert "different call" in msg
        assert (
            f"; this rank called allreduce(count={5 + r}, dtype=float64, op=SUM, root=0, "
            "algorithm=recursive_doubling, segment=1 MiB)" in msg
        )
        # then where this rank's flight recorder was dumped (docs/debugging.md)
        assert f"; {HINT}; flight recorder dump: " in msg
        assert msg.endswith(f"rank{r}.json")


def test_mismatch_of_collectives_names_each_ranks_own() -> None:
    """Two calls that exchange with each other: each rank receives the other's message."""

    def body(comm: plait.Communicator) -> str:
        x = np.ones(8, np.int32)
        out = np.empty((2, 8), np.int32)
        if comm.rank == 0:
            call = lambda: comm.allreduce(x, plait.MAX, algorithm="recursive_doubling")  # noqa: E731
        else:
            call = lambda: comm.allgather(x, out=out, algorithm="recursive_doubling")  # noqa: E731
        with pytest.raises(plait.MismatchError) as info:
            call()
        return str(info.value)

    first, second = run_ranks(2, body)
    assert "this rank called allreduce(count=8, dtype=int32, op=MAX, root=0, " in first
    assert f"; {HINT}; flight recorder dump: " in first
    assert "this rank called allgather(count=8, dtype=int32, op=-, root=0, " in second
    # allgather wrote into out: the error says so, after the call's description.
    assert f"{HINT}; the output buffer's contents are undefined; flight recorder dump: " in second


def test_mismatched_send_and_recv_name_the_receivers_call() -> None:
    done = threading.Event()

    def body(comm: plait.Communicator) -> Any:
        if comm.rank == 0:
            # Whether the sender hears of the mismatch too depends on which call came first.
            with contextlib.suppress(plait.MismatchError):
                comm.send(np.ones(3), dst=1)
            done.wait(30)  # stay open until rank 1 has its error
            return None
        with pytest.raises(plait.MismatchError, match="different call") as info:
            comm.recv(np.empty(3, np.int64), src=0)
        done.set()
        return str(info.value)

    _, msg = run_ranks(2, body)
    said, _, dump = msg.partition("; flight recorder dump: ")
    assert said.endswith(
        "this rank's recv: 3 elements of int64; the message: 3 elements of float64"
    )
    assert dump.endswith("rank1.json")  # a failed receive dumps, as a failed collective does


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_segments_are_bytes_in_the_log_and_the_signature(
    dtype: type, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """PLAIT_DEBUG=detail: auto's choice and the call's signature give the same segment."""
    monkeypatch.setenv("PLAIT_DEBUG", "detail")
    monkeypatch.setenv("PLAIT_ALGO", "allreduce:ring@4K")
    caplog.set_level(logging.DEBUG, logger="plait")

    def body(comm: plait.Communicator) -> Any:
        return comm.allreduce(np.ones(3000, dtype))

    for res in run_ranks(2, body):
        np.testing.assert_array_equal(res, np.full(3000, 2, dtype))
    text = caplog.text
    chosen = re.findall(r"auto chose ring, segment ([^(]+) \(PLAIT_ALGO\)", text)
    signed = re.findall(r"allreduce\(count=3000, [^)]*algorithm=ring, segment=([^)]+)\)", text)
    assert chosen, text
    assert signed, text
    assert {s.strip() for s in chosen} == set(signed) == {"4 KiB"}
