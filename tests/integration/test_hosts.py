"""Host-aware algorithms on real data, with hosts emulated by a layout over threads."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import plait
from cases import bits
from plait.transport.memory import MemoryFabric

LAYOUTS = [
    ["a", "a", "b", "b"],
    ["a", "b", "c", "a", "b", "c"],  # interleaved
    ["a", "a", "a", "b", "b"],  # unequal
    ["a", "b", "b", "b", "c", "c", "c"],
]


def run_on_hosts(hosts: list[str], fn: Any, window: int | None = None) -> list[Any]:
    fabric = MemoryFabric(len(hosts)) if window is None else MemoryFabric(len(hosts), window=window)
    comms = [plait.Communicator(t, hosts=hosts, timeout=30) for t in fabric.endpoints]
    out: list[Any] = [None] * len(hosts)
    errors: list[BaseException] = []

    def body(c: plait.Communicator) -> None:
        try:
            out[c.rank] = fn(c)
        except BaseException as exc:
            errors.append(exc)
        finally:
            c.close()

    threads = [threading.Thread(target=body, args=(c,)) for c in comms]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return out


@pytest.mark.parametrize("hosts", LAYOUTS, ids=lambda h: "".join(h))
@pytest.mark.parametrize("algorithm", ["hierarchical", "cascade", "auto"])
def test_host_aware_allreduce(hosts: list[str], algorithm: str) -> None:
    p = len(hosts)

    def body(comm: plait.Communicator) -> Any:
        rng = np.random.default_rng(comm.rank)
        results = []
        for count in (0, 1, p - 1, 1000, 300_001):
            x = rng.standard_normal(count).astype(np.float32)
            results.append((x, comm.allreduce(x, algorithm=algorithm)))
        return results

    results = run_on_hosts(hosts, body)
    for i in range(len(results[0])):
        inputs = [results[r][i][0] for r in range(p)]
        want = np.sum(np.stack(inputs).astype(np.float64), axis=0)
        first = results[0][i][1]
        np.testing.assert_allclose(first, want, rtol=1e-4, atol=1e-4)
        for r in range(p):
            assert bits(results[r][i][1]) == bits(first), f"rank {r} differs"


def test_an_algorithm_needing_a_window_per_host_is_refused_over_one_shared_window() -> None:
    """Emulated hosts over the in-process fabric share one window: a host's window is not
    there to read, and the call says so before anything moves."""

    def body(comm: plait.Communicator) -> Any:
        x = np.ones(5, np.float32)
        with pytest.raises(plait.UnsupportedError, match="needs a window per host"):
            comm.allreduce(x, algorithm="hierarchical_arena")
        assert np.array_equal(x, np.ones(5, np.float32))
        return comm.allreduce(x, algorithm="hierarchical")

    for got in run_on_hosts(["a", "a", "b", "b"], body):
        assert np.array_equal(got, np.full(5, 4, np.float32))


def test_an_algorithm_needing_a_window_per_host_is_refused_without_one() -> None:
    def body(comm: plait.Communicator) -> Any:
        x = np.ones(5, np.float32)
        with pytest.raises(plait.UnsupportedError, match="needs a shared-memory window on each"):
            comm.allreduce(x, algorithm="hierarchical_arena")
        return comm.allreduce(x, algorithm="hierarchical")

    for got in run_on_hosts(["a", "a", "b", "b"], body, window=0):
        assert np.array_equal(got, np.full(5, 4, np.float32))

    # One rank per host needs no window: only the inter-host stage runs.
    def alone(comm: plait.Communicator) -> Any:
        return comm.allreduce(np.arange(7.0) + comm.rank, algorithm="hierarchical_arena")

    for got in run_on_hosts(["a", "b", "c"], alone, window=0):
        assert np.array_equal(got, 3 * np.arange(7.0) + 3)
