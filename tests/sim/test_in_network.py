"""In-network aggregation: the ``in_network`` allreduce on switches that reduce in flight.

The same schedules are proven on provenance sets, run by the real executor
(ranks and switches as threads over the in-memory transport) and simulated
with data; the simulated time equals the store-and-forward formula, each
rank's link carries n bytes each way, and a communicator refuses the
algorithm before any byte moves.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import plait
from plait import sim
from plait.algos import get
from plait.algos.in_network import plan
from plait.errors import UnsupportedError
from plait.runtime.executor import Call, execute
from plait.schedule.builder import MOST_SEGMENTS, Fabric
from plait.schedule.symbolic import prove
from plait.testing import reference, run_ranks
from plait.transport.memory import MemoryFabric

SPEC = get("allreduce", "in_network")
LINK = sim.LinkParams(1e-6, 1 / 12.5e9)


def _networks(p: int, memory: int) -> list[sim.Network]:
    return [
        sim.single_switch(p, LINK, aggregation_memory=memory),
        sim.fat_tree(p, 3, LINK, oversubscription=2, spines=2, aggregation_memory=memory),
        sim.hosts(
            -(-p // 2) if p % 2 == 0 else p,
            2 if p % 2 == 0 else 1,
            LINK,
            LINK,
            hosts_per_leaf=2,
            aggregation_memory=memory,
        ),
    ]


# -- the fabric a network offers ---------------------------------------------------------


def test_fat_tree_fabric_is_leaves_under_a_spine() -> None:
    net = sim.fat_tree(10, 4, LINK, spines=2, aggregation_memory=4096)
    fabric, nodes = net.aggregation_fabric()
    names = [net.nodes[n].name for n in nodes]
    assert names == ["leaf0", "leaf1", "leaf2", "spine0"]
    assert fabric.attach == (0,) * 4 + (1,) * 4 + (2,) * 2
    assert fabric.parent == (3, 3, 3, -1)
    assert fabric.memory == 4096


def test_network_without_reducing_switches_is_refused() -> None:
    with pytest.raises(ValueError, match="no switch reduces"):
        sim.fat_tree(8, 4, LINK).aggregation_fabric()
    with pytest.raises(ValueError, match="no switch reduces"):
        sim.simulate("allreduce", "in_network", 1024, sim.flat(4, 1e-6, 1e-9))


@pytest.mark.parametrize(
    ("attach", "parent", "match"),
    [
        ((0, 2), (-1, 0), "attach"),
        ((0,), (-1, -1), "exactly one"),
        ((0,), (1, 0), "exactly one|cycle"),
        ((0,), (-1, 0), "no child"),
    ],
)
def test_bad_fabric(attach: tuple[int, ...], parent: tuple[int, ...], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Fabric(attach, parent, 64)


# -- correctness -------------------------------------------------------------------------


@pytest.mark.parametrize("p", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("count", [0, 1, 7, 100])
def test_proven_on_provenance_sets(p: int, count: int) -> None:
    for net in _networks(p, memory=8):  # 8 "bytes" of itemsize 1: many small windows
        fabric = net.aggregation_fabric()[0]
        prove(SPEC, p, count, fabric=fabric, segment=3)
        prove(SPEC, p, count, fabric=fabric)


def test_more_pieces_than_other_schedules_cut_a_region_into() -> None:
    """A switch holds a piece in its memory, so its pieces cannot grow as the others' do past
    MOST_SEGMENTS: the ranks cut their vector as the switches do (they sent fewer, longer
    pieces than their switch received once the others' were capped)."""
    fabric = sim.single_switch(2, LINK, aggregation_memory=8).aggregation_fabric()[0]
    prove(SPEC, 2, MOST_SEGMENTS + 1000, fabric=fabric, segment=1)
    net = sim.single_switch(2, LINK, aggregation_memory=64)
    assert sim.simulate("allreduce", "in_network", 80_000, net, dtype="float32").time > 0


@pytest.mark.parametrize("p", [1, 3, pytest.param(6, marks=pytest.mark.slow)])
@pytest.mark.parametrize(("dtype", "op"), [("int32", plait.SUM), ("float64", plait.MAX)])
def test_simulated_with_data(p: int, dtype: str, op: plait.Op) -> None:
    for net in _networks(p, memory=64):
        for nbytes in (0, 8, 8 * 37, 8 * 1000):
            res = sim.simulate(
                "allreduce", "in_network", nbytes, net, dtype=dtype, op=op, with_data=True, seed=p
            )
            assert res.outputs is not None
            assert len(res.outputs) == p


def test_non_commutative_op_is_refused() -> None:
    sub = plait.Op(np.subtract, commutative=False)
    with pytest.raises(ValueError, match="commutative"):
        sim.simulate("allreduce", "in_network", 64, _networks(4, 64)[0], op=sub)


def test_runs_on_the_real_executor() -> None:
    """Ranks and switches as threads over the in-memory transport: the executor runs it."""
    p, count = 5, 1001
    net = sim.fat_tree(p, 2, LINK, spines=1, aggregation_memory=256)
    schedules = sim.build_all("allreduce", "in_network", p, count, itemsize=8, network=net)
    n = len(schedules)
    assert n == p + 4  # three leaves and a spine
    rng = np.random.default_rng(3)
    xs = [rng.integers(-50, 50, count).astype(np.float64) for _ in range(p)]
    outs = [np.full(count, np.nan) for _ in range(p)]
    memory = MemoryFabric(n)
    errors: list[BaseException] = []

    def run(r: int) -> None:
        s = schedules[r]
        inp = xs[r] if r < p else np.empty(0)
        out = outs[r] if r < p else np.empty(0)
        buffers = (inp, out, np.empty(s.tmp_count))
        call = Call("allreduce (in_network)", 0, 7, np.add, None)
        try:
            execute(s, buffers, memory.endpoints[r], call)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    assert not any(t.is_alive() for t in threads)
    want = reference("allreduce", xs, op=plait.SUM)[0]
    for r in range(p):
        assert np.array_equal(outs[r], want)
        assert outs[r].tobytes() == outs[0].tobytes()
    # A rank's link carries its vector once each way.
    assert memory.endpoints[0].bytes_sent == count * 8
    assert memory.endpoints[0].bytes_received == count * 8


def test_communicator_refuses_it_before_any_byte_moves() -> None:
    """plait's transports have no aggregating switches: a clear error, input untouched."""

    def body(comm: plait.Communicator) -> None:
        x = np.arange(5.0) + comm.rank
        with pytest.raises(UnsupportedError, match="switches"):
            comm.allreduce(x, algorithm="in_network")
        assert np.array_equal(x, np.arange(5.0) + comm.rank)
        # auto never picks it, and the communicator still works
        assert np.array_equal(comm.allreduce(x), 2 * np.arange(5.0) + 1)

    run_ranks(2, body)


# -- time and traffic --------------------------------------------------------------------


@pytest.mark.parametrize(("p", "per_leaf", "depth"), [(5, 8, 1), (8, 2, 2), (9, 3, 2)])
@pytest.mark.parametrize(("n", "s"), [(1 << 20, 1 << 16), (3 << 20, 1 << 18), (5000, 1 << 16)])
def test_time_is_store_and_forward_of_segments(
    p: int, per_leaf: int, depth: int, n: int, s: int
) -> None:
    """2dα + (n + (2d-1)s)β when the window covers a round trip (d switch levels)."""
    a, b = LINK.alpha, LINK.beta
    # uplinks: per_leaf cables' worth over oversubscription * spines: equal to a cable here
    net = sim.fat_tree(p, per_leaf, LINK, oversubscription=per_leaf, aggregation_memory=1 << 30)
    res = sim.simulate("allreduce", "in_network", n, net, dtype=np.uint8, segment_bytes=s)
    seg = min(s, n)
    want = 2 * depth * a + (n + (2 * depth - 1) * seg) * b
    assert res.time == pytest.approx(want, rel=1e-9)


def test_small_memory_bounds_the_window_and_slows_it() -> None:
    big = sim.fat_tree(16, 4, LINK, aggregation_memory=64 << 20)
    small = sim.fat_tree(16, 4, LINK, aggregation_memory=16 << 10)
    seg = 4 << 10  # both cut the vector alike; only the window differs (4 against 16,384)
    t_big = sim.simulate("allreduce", "in_network", 1 << 20, big, segment_bytes=seg).time
    t_small = sim.simulate("allreduce", "in_network", 1 << 20, small, segment_bytes=seg).time
    # 4 segments per round trip (4α + 2sβ + ...) against a full pipeline: about 3x slower
    assert t_small > 2 * t_big
    fabric = small.aggregation_fabric()[0]
    for sched in sim.build_all("allreduce", "in_network", 16, 1 << 16, network=small)[16:]:
        assert sched.tmp_count * 4 <= fabric.memory  # a switch never holds more than its memory
    seg, window = plan(4 << 20, 4, 1 << 20, 16 << 10)
    assert seg * 4 * window <= 16 << 10
    assert window >= 4


def test_each_rank_sends_and_receives_n_bytes_once() -> None:
    """The advantage: a host's link carries n each way; ring and Rabenseifner about 2n."""
    p, n = 64, 16 << 20
    net = sim.fat_tree(p, 16, LINK, oversubscription=2, aggregation_memory=4 << 20)
    inn = sim.simulate("allreduce", "in_network", n, net)
    ring = sim.simulate("allreduce", "ring", n, net)
    rab = sim.simulate("allreduce", "rabenseifner", n, net)
    assert inn.bytes_by_class()["port"] == pytest.approx(2 * p * n)  # n up + n down per rank
    assert ring.bytes_by_class()["port"] == pytest.approx(2 * p * 2 * (p - 1) / p * n, rel=1e-3)
    assert inn.time < 0.6 * min(ring.time, rab.time)
