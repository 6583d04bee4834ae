"""The bytes a Bucketer with PowerSGD sends, between real processes over TCP.

Threads that play ranks share their arrays without a transport's copies, so
bytes are counted here, inside ``plait run``, where every byte crosses a socket.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from test_multiprocess import plait_run

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

SCRIPT = textwrap.dedent(
    """
    import numpy as np
    import plait
    from plait.bucketing import Bucketer
    from plait.compression import PowerSGD
    from plait.runtime import stall, waits

    # A call that waits a second for its peer sends a stall probe, whose bytes count too
    stall.PROBE_SECONDS = waits.PROBE_SECONDS = 1e9

    with plait.init() as comm:
        g = np.random.default_rng(comm.rank).standard_normal((256, 256)).astype(np.float32)

        def sent(compression):
            b = Bucketer(comm, [g.copy()], compression=compression)
            before = comm.stats().bytes_sent
            b.ready(0)
            b.wait()
            return comm.stats().bytes_sent - before

        plain, bucketed = sent(None), sent(PowerSGD(1))
        before = comm.stats().bytes_sent
        comm.allreduce(g.copy(), plait.AVG, compression=PowerSGD(1))
        direct = comm.stats().bytes_sent - before
        print(f"rank {comm.rank} sent {plain} {bucketed} {direct}", flush=True)
    """
)


def test_a_bucketer_with_powersgd_sends_what_a_compressed_allreduce_sends(tmp_path: Path) -> None:
    """The Bucketer sent the full 256 x 256 gradient (262144 bytes, as without compression)
    where comm.allreduce(g, compression=PowerSGD(1)) sends 2048 (Note [PowerSGD in buckets])."""
    script = tmp_path / "bucketed_powersgd.py"
    script.write_text(SCRIPT)
    res = plait_run(["-n", "2", "--transport", "tcp", str(script)])
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    lines = sorted(line for line in res.stdout.splitlines() if line.startswith("rank "))
    assert len(lines) == 2, res.stdout
    for line in lines:
        plain, bucketed, direct = (int(w) for w in line.split()[3:])
        assert plain >= 256 * 256 * 4 // 2, line  # a ring sends at least half the buffer
        assert bucketed == direct, line
        assert bucketed * 50 < plain, line
