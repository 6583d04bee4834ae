"""The engine's rules on hand-made schedules: timing, sharing, staging, local work, faults."""

from __future__ import annotations

import pytest

from plait import sim
from plait.schedule.builder import Builder, Context
from plait.schedule.ir import Schedule
from plait.sim.engine import run_schedules


def builders(p: int, count: int = 1000) -> list[Builder]:
    """One empty builder per rank, with IN, OUT of ``count`` one-byte elements."""
    return [Builder(Context("allreduce", r, p, count), count, count) for r in range(p)]


def built(bs: list[Builder]) -> list[Schedule]:
    return [b.build() for b in bs]


def test_one_message_costs_alpha_plus_n_beta() -> None:
    bs = builders(2)
    bs[0].send(1, bs[0].inp.sub(0, 100))
    bs[1].recv(0, bs[1].out.sub(0, 100))
    for ports in (True, False):
        out = run_schedules(built(bs), sim.flat(2, 1e-6, 1e-9, ports=ports), 1)
        assert out.time == pytest.approx(1e-6 + 100e-9, rel=1e-12)
        assert out.finish == [out.time, out.time]  # the send completes on delivery


def test_messages_from_one_rank_share_its_port() -> None:
    bs = builders(3)
    bs[0].send(1, bs[0].inp.sub(0, 100))
    bs[0].send(2, bs[0].inp.sub(100, 100))
    bs[1].recv(0, bs[1].out.sub(0, 100))
    bs[2].recv(0, bs[2].out.sub(0, 100))
    shared = run_schedules(built(bs), sim.flat(3, 1e-6, 1e-9), 1)
    assert shared.time == pytest.approx(1e-6 + 200e-9, rel=1e-12)
    alone = run_schedules(built(bs), sim.flat(3, 1e-6, 1e-9, ports=False), 1)
    assert alone.time == pytest.approx(1e-6 + 100e-9, rel=1e-12)


def two_bottlenecks() -> sim.Network:
    """Rank 0 -> switch (10 B/s) -> rank 1 (10 B/s) or rank 2 (2 B/s); no latency."""
    net = sim.Network("test")
    for _ in range(3):
        net.add_rank()
    x = net.add_node("x")
    net.add_cable(net.rank_node[0], x, sim.LinkParams(0.0, 0.1))
    net.add_cable(x, net.rank_node[1], sim.LinkParams(0.0, 0.1))
    net.add_cable(x, net.rank_node[2], sim.LinkParams(0.0, 0.5))
    return net


def test_max_min_fair_sharing_gives_the_spare_capacity_away() -> None:
    # Both flows cross 0 -> x; the one to rank 2 is held at 2 B/s by its last link,
    # so max-min gives the one to rank 1 the other 8 B/s; equal shares give it 5.
    bs = builders(3)
    bs[0].send(1, bs[0].inp.sub(0, 40))
    bs[0].send(2, bs[0].inp.sub(40, 4))
    bs[1].recv(0, bs[1].out.sub(0, 40))
    bs[2].recv(0, bs[2].out.sub(0, 4))
    maxmin = run_schedules(built(bs), two_bottlenecks(), 1)
    assert maxmin.finish[2] == pytest.approx(2.0)
    assert maxmin.finish[1] == pytest.approx(2.0 + (40 - 16) / 10)  # 8 B/s for 2 s, then 10
    equal = run_schedules(built(bs), two_bottlenecks(), 1, sharing="equal")
    assert equal.finish[1] == pytest.approx(2.0 + (40 - 10) / 10)  # 5 B/s for 2 s, then 10
    with pytest.raises(ValueError, match="sharing"):
        run_schedules(built(bs), two_bottlenecks(), 1, sharing="fifo")


def test_receive_reduce_takes_early_data_and_reduces_when_ready() -> None:
    # Rank 1 copies (slow) before it may reduce; the message arrives during the copy.
    bs = builders(2)
    bs[0].send(1, bs[0].inp)
    bs[1].copy(bs[1].inp, bs[1].out)
    bs[1].recv_reduce(0, bs[1].out, recv_first=True)
    net = sim.flat(2, 1e-6, 1e-9, gamma=1e-8, delta=1e-8)  # copy 10 µs, message 2 µs
    out = run_schedules(built(bs), net, 1)
    assert out.finish[1] == pytest.approx(1000 * 1e-8 + 1000 * 1e-8)  # copy, then reduce
    assert out.finish[0] == pytest.approx(1e-6 + 1000e-9)


def test_receive_waits_for_its_dependencies_but_not_its_data() -> None:
    # A plain receive that is posted late completes when posted if the data came early.
    bs = builders(2)
    bs[0].send(1, bs[0].inp)
    bs[1].copy(bs[1].inp, bs[1].out)
    bs[1].recv(0, bs[1].out)  # writes what the copy wrote: waits for it
    out = run_schedules(built(bs), sim.flat(2, 1e-6, 1e-9, delta=1e-8), 1)
    assert out.finish[1] == pytest.approx(1e-5)


def test_local_work_runs_one_at_a_time_per_rank() -> None:
    bs = builders(2)
    for b in bs:
        b.copy(b.inp.sub(0, 500), b.out.sub(0, 500))  # independent copies
        b.copy(b.inp.sub(500, 500), b.out.sub(500, 500))
        b.reduce(b.inp.sub(0, 100), b.out.sub(0, 100), src_first=True)
    out = run_schedules(built(bs), sim.flat(2, 1e-6, 1e-9, gamma=2e-9, delta=1e-9), 1)
    assert out.finish == pytest.approx([1000e-9 + 200e-9] * 2)


def test_deadlock_is_reported() -> None:
    bs = builders(2)
    for r, b in enumerate(bs):
        b.recv(1 - r, b.out)
        b.send(1 - r, b.out)  # needs the receive first: nobody sends
    with pytest.raises(RuntimeError, match="deadlock"):
        run_schedules(built(bs), sim.flat(2, 1e-6, 1e-9), 1)


def test_unmatched_messages_are_reported() -> None:
    bs = builders(2)
    bs[0].send(1, bs[0].inp)
    with pytest.raises(RuntimeError, match="no receive"):
        run_schedules(built(bs), sim.flat(2, 1e-6, 1e-9), 1)
    bs = builders(2)
    bs[0].send(1, bs[0].inp.sub(0, 10))
    bs[1].recv(0, bs[1].out.sub(0, 20))
    with pytest.raises(RuntimeError, match="expects 20"):
        run_schedules(built(bs), sim.flat(2, 1e-6, 1e-9), 1)


def test_size_mismatch_is_refused() -> None:
    with pytest.raises(ValueError, match="network of 3"):
        run_schedules(built(builders(2)), sim.flat(3, 1e-6, 1e-9), 1)


def test_deterministic() -> None:
    net = sim.fat_tree(24, 4, sim.LinkParams(1e-6, 1e-9), oversubscription=3, spines=2)
    a = sim.simulate("allreduce", "cascade", 1 << 16, net, segment_bytes=4096)
    b = sim.simulate("allreduce", "cascade", 1 << 16, net, segment_bytes=4096)
    assert a.time == b.time
    assert list(a.finish) == list(b.finish)
    assert list(a.link_bytes) == list(b.link_bytes)
