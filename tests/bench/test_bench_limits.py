"""The machine limits of ``plait bench --limits``, measured small and fast."""

from __future__ import annotations

import math

from plait.bench import limits


def test_memory_bandwidth_of_one_process() -> None:
    got = limits.memory_bandwidth(nbytes=1 << 20, seconds=0.01)
    assert set(got) == {"copy", "add"}
    assert all(math.isfinite(v) and v > 0 for v in got.values())


def test_memory_bandwidth_of_processes_started_together() -> None:
    got = limits._all_cores(2, 1 << 20, 0.01)
    assert set(got) == {"copy", "add"}
    assert all(math.isfinite(v) and v > 0 for v in got.values())


def test_tcp_loopback() -> None:
    got = limits.tcp_loopback(nbytes=1 << 20, pings=20)
    assert got["tcp_gbps"] > 0
    assert math.isfinite(got["tcp_gbps"])
    assert 0 < got["tcp_rtt_us"] < 1e6


def test_format_limits() -> None:
    lines = limits.format_limits(
        {
            "cores": 2,
            "copy_gbps_1core": 11.0,
            "add_gbps_1core": 8.0,
            "copy_gbps_all": 16.5,
            "add_gbps_all": 12.0,
            "tcp_gbps": 3.25,
            "tcp_rtt_us": 17.4,
        }
    )
    assert lines == [
        "# limits: memory copy 11.00 GB/s on one core, 16.50 GB/s on all 2; add 8.00 / 12.00 GB/s",
        "# limits: loopback TCP 3.25 GB/s, round trip 17.4 µs (1 byte)",
    ]
