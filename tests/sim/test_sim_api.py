"""The public surface of plait.sim: sizes, arguments, results, the cost model."""

from __future__ import annotations

import numpy as np
import pytest

import plait
from plait import sim
from plait.selection.model import LinkCost, Profile
from plait.selection.select import SEGMENT_BYTES
from plait.sim import formulas


def test_context_count_follows_the_bench_convention() -> None:
    assert sim.context_count("allreduce", 4096, 4, 8) == 1024
    assert sim.context_count("broadcast", 4096, 4, 8) == 1024
    for c in ("reduce_scatter", "allgather", "alltoall", "gather", "scatter"):
        assert sim.context_count(c, 4096, 4, 8) == 128  # per-rank block
    assert sim.context_count("allgather", 4100, 4, 8) == 128  # rounded down
    assert sim.context_count("barrier", 4096, 4, 8) == 0


def test_result_fields() -> None:
    net = sim.hosts(2, 2, sim.LinkParams(1e-7, 1e-10), sim.LinkParams(1e-5, 1e-9))
    res = sim.simulate("allgather", "ring", 4 * 4 * 100, net)
    assert res.size == 4
    assert res.count == 100
    assert res.nbytes == 1600
    assert res.time == max(res.finish)
    assert res.messages == 4 * 3
    assert res.steps > res.messages
    top = res.busiest_links(2)
    assert len(top) == 2
    assert top[0][1] >= top[1][1] > 0
    assert set(res.bytes_by_class()) == {"intra", "inter", "pcie"}


def test_every_collective_runs_timing_only() -> None:
    net = sim.flat(5, 1e-6, 1e-9, 1e-10)
    for c in plait.COLLECTIVES:
        for name in plait.algorithms(c):
            if plait.algos.get(c, name).needs_fabric:  # tests/sim/test_in_network.py
                continue
            window = 1 << 20 if plait.algos.get(c, name).needs_window else 0
            res = sim.simulate(c, name, 4 * 5 * 64, net, window=window)
            assert res.time > 0 or (c == "barrier" and res.messages == 0)


def test_segments() -> None:
    net = sim.flat(8, 1e-6, 1e-9, 1e-10)
    one = sim.simulate("broadcast", "binomial", 1 << 20, net)
    piped = sim.simulate("broadcast", "binomial", 1 << 20, net, segment_bytes=64 << 10)
    # The data messages are per segment; the witness's one message to the root is per call
    # (Note [rooted calls agree on the root]).
    data = one.messages - 1
    assert piped.messages == 16 * data + 1
    assert piped.time < one.time  # pipelining pays for a deep tree
    default = sim.simulate("broadcast", "binomial", 4 << 20, net, segment_bytes=None)
    assert default.messages == (4 << 20) // SEGMENT_BYTES * data + 1


def test_arguments_are_checked() -> None:
    net = sim.flat(4, 1e-6, 1e-9)
    with pytest.raises(ValueError, match="unknown algorithm"):
        sim.simulate("allreduce", "nope", 64, net)
    # It said "unknown algorithm 'auto' ...; expected 'auto' or one of: ...".
    with pytest.raises(ValueError, match="'auto' is plait's choice among the algorithms") as e:
        sim.simulate("allreduce", "auto", 64, net)
    assert "expected 'auto'" not in str(e.value)
    with pytest.raises(ValueError, match="unknown collective"):
        sim.simulate("allsum", "ring", 64, net)
    with pytest.raises(ValueError, match="commutative"):
        sim.simulate("allreduce", "ring", 64, net, op=plait.Op(np.subtract, commutative=False))
    with pytest.raises(ValueError, match="sharing"):
        sim.simulate("allreduce", "ring", 64, net, sharing="fair")


def test_heterogeneous_ranks() -> None:
    net = sim.flat(4, 1e-6, 1e-9, 1e-10)
    base = sim.simulate("allreduce", "ring", 1 << 20, net).time
    net.set_compute(1e-8, ranks=[2])  # one slow rank holds everyone up
    assert sim.simulate("allreduce", "ring", 1 << 20, net).time > base


def test_message_cost_on_top_of_links() -> None:
    net = sim.single_switch(2, sim.LinkParams(1e-6, 1e-9))
    net.set_message_cost(5e-6, 4e-9)  # software overhead and a per-message rate limit
    res = sim.simulate("broadcast", "binomial", 1000, net)
    assert res.time == pytest.approx(2e-6 + 5e-6 + 1000 * 4e-9)


def test_simulate_schedules() -> None:
    scheds = sim.build_all("allreduce", "ring", 4, 64)
    res = sim.simulate_schedules(scheds, sim.flat(4, 1e-6, 1e-9), 4)
    assert res.time == sim.simulate("allreduce", "ring", 256, sim.flat(4, 1e-6, 1e-9)).time


def test_link_params() -> None:
    assert sim.LinkParams.from_bandwidth(1e-6, 1e9).time(1000) == pytest.approx(2e-6)
    assert sim.LinkParams(1e-6, 0.0).bandwidth == float("inf")
    with pytest.raises(ValueError, match="bandwidth"):
        sim.LinkParams.from_bandwidth(1e-6, 0)


def test_network_from_a_measured_profile() -> None:
    prof = Profile(LinkCost(2e-6, 1e-10), LinkCost(2e-5, 1e-9), gamma=3e-10, delta=1e-10)
    one = sim.from_profile(prof, 8)
    res = sim.simulate("allreduce", "ring", 8 << 20, sim.from_profile(prof, 8, ports=False))
    want = formulas.predict("allreduce", "ring", 8, 8 << 20, 2e-6, 1e-10, 3e-10, 1e-10)
    assert res.time == pytest.approx(want, rel=1e-12)
    assert one.size == 8
    assert one.host_layout() is None
    two = sim.from_profile(prof, 8, ranks_per_host=4, nics=2)
    assert two.host_layout() is not None
    assert two.gamma == [3e-10] * 8
    with pytest.raises(ValueError, match="split"):
        sim.from_profile(prof, 8, ranks_per_host=3)
    with pytest.raises(ValueError, match="inter-host"):
        sim.from_profile(Profile(LinkCost(1e-6, 1e-10)), 8, ranks_per_host=4)
