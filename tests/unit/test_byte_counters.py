"""What ``comm.stats()`` counts: message payloads, not what the one-sided calls of one host move.

docs/compression.md ("Byte counters") and the ``stats`` docstring say so; these
tests hold the behaviour to what they say, on the in-process fabric and on real
shared memory.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest

from on_threads import run_on
from plait.communicator import Communicator, Stats
from plait.rendezvous.store import MemoryStore
from plait.testing import run_ranks
from plait.transport.conformance import build_in_threads

# Stall probes would add their bytes to the exact counts here (conftest.no_stall_probes).
pytestmark = pytest.mark.usefixtures("no_stall_probes")

DOCS = Path(__file__).resolve().parents[2] / "docs" / "compression.md"
N = 1 << 20  # float64 elements: 8 MiB
RING = 8 * N  # what one of 2 ranks sends in a ring allreduce of 8 MiB: 2 (p - 1) / p of it


def _work(comm: Communicator) -> tuple[Stats, Stats]:
    """The bytes of an 8 MiB allreduce as ``auto`` runs it, then as a ring of messages."""
    x = np.ones(N)
    before = comm.stats()
    comm.allreduce(x)
    between = comm.stats()
    comm.allreduce(x, algorithm="ring")
    return between - before, comm.stats() - between


def test_one_sided_calls_count_nothing_and_messages_count_their_payload() -> None:
    for auto, ring in run_ranks(2, _work):
        assert auto == Stats(0, 0)  # one-sided: the peers' windows are read directly
        assert ring == Stats(RING, RING)


def test_without_a_window_every_call_is_counted() -> None:
    for auto, ring in run_ranks(2, _work, window=0):
        assert auto.bytes_sent > 0
        assert auto.bytes_sent == auto.bytes_received
        assert ring == Stats(RING, RING)


def _shm(window_bytes: int | None) -> list[Communicator]:
    from plait.transport.shm import ShmTransport

    store = MemoryStore(timeout=30)
    ts = build_in_threads(
        2, lambda r: ShmTransport(r, 2, store, timeout=30, window_bytes=window_bytes)
    )
    return [Communicator(t, timeout=60) for t in ts]


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm (Linux)")
@pytest.mark.parametrize("window", [None, 0])
def test_shared_memory_counts_its_messages_only(window: int | None) -> None:
    comms = _shm(window)
    try:
        results = run_on(comms, _work)
    finally:
        for c in comms:
            c.close()
    for auto, ring in results:
        if window is None:  # the default window: auto runs one-sided
            assert auto == Stats(0, 0)
        else:
            assert auto.bytes_sent > 0
        assert ring == Stats(RING, RING)


def test_the_docs_say_what_is_counted() -> None:
    text = DOCS.read_text()
    section = re.search(r"^## Byte counters\n(.*?)^## ", text, re.S | re.M)
    assert section is not None
    words = " ".join(section.group(1).split())
    assert "Data that moves without a message is not counted" in words
    assert "a 2-rank 8 MiB allreduce counts 0 bytes" in words
    assert "`PLAIT_SHM_WINDOW=0`" in words
    doc = " ".join((Communicator.stats.__doc__ or "").split())
    assert "one-sided algorithms of one host" in doc
