"""The simulator on mixed schedules: messages between hosts, one-sided steps within each."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pytest

from plait import sim
from plait.cli.__main__ import main
from plait.ops import SUM
from plait.schedule.builder import Builder, Context, HostLayout, record
from plait.schedule.ir import Schedule, StepKind
from plait.schedule.verify import check_static, run_joint
from plait.sim.data import check, start_buffers
from plait.sim.engine import run_schedules
from plait.sim.program import compile_schedules

# Seconds per message or post; per byte sent, copied, reduced.
ALPHA, BETA, DELTA, GAMMA = 1e-6, 1e-9, 1e-10, 2e-10
ITEM = 4  # bytes per element
INTRA, INTER = sim.LinkParams(1e-7, 1e-10), sim.LinkParams(1e-6, 1e-9)


def pairs(b: Builder) -> None:
    """Two hosts of two ranks: each host's leader (its first rank) folds its partner's window
    into ``OUT``, exchanges that with the other host's leader, and publishes the sum, which
    the partner reads."""
    partner, other = b.rank ^ 1, b.rank ^ 2
    win = b.shared(b.out.count)
    if b.rank % 2:
        b.copy(b.inp, win)
        b.post(1)
        b.get(partner, win, b.out, 2)
        return
    b.copy(b.inp, b.out)
    b.get_reduce(partner, win, b.out, 1, get_first=False)
    theirs = b.scratch(b.out.count)
    b.send(other, b.out)
    b.recv(other, theirs)
    b.reduce(theirs, b.out, src_first=b.rank > other)
    b.copy(b.out, win)
    b.post(2)


def schedules(build: object, hosts: Sequence[int], count: int) -> list[Schedule]:
    p = len(hosts)
    layout = HostLayout(hosts)
    ctx = Context("allreduce", 0, p, count, ITEM, hosts=layout, window=count * ITEM)
    return [record(build, ctx.with_rank(r)) for r in range(p)]  # type: ignore[arg-type]


def flat(hosts: Sequence[int]) -> sim.Network:
    """No links: every message ALPHA + n BETA, every post ALPHA later, whatever the host."""
    net = sim.flat(len(hosts), ALPHA, BETA, GAMMA, delta=DELTA, ports=False)
    net.hosts = tuple(hosts)
    return net


def hosts_of(sizes: Sequence[int], inter: sim.LinkParams = INTER) -> sim.Network:
    """Hosts of ``sizes`` ranks: each rank a cable (``intra``) to its host's switch, each
    host's switch a cable (``inter``) to one core switch; messages take shortest paths."""
    net = sim.Network("unequal hosts", gamma=GAMMA, delta=DELTA)
    core = net.add_node("core")
    host_of = []
    for h, n in enumerate(sizes):
        switch = net.add_node(f"h{h}")
        net.add_cable(switch, core, inter, "inter")
        for _ in range(n):
            net.add_cable(net.rank_node[net.add_rank()], switch, INTRA, "intra")
            host_of.append(h)
    net.hosts = tuple(host_of)
    return net


def test_a_mixed_program_has_both_kinds() -> None:
    mixed = compile_schedules(schedules(pairs, [0, 0, 1, 1], 8), ITEM)
    assert mixed.one_sided
    assert mixed.mixed
    # Leaders mix messages and window steps; partners send nothing (one-sided).
    assert [s.mixed for s in mixed.schedules or ()] == [True, False, True, False]
    assert [s.one_sided for s in mixed.schedules or ()] == [False, True, False, True]
    alone = sim.build_all("allreduce", "hierarchical_arena", 4, 8, window=1 << 10)
    assert not any(s.mixed for s in alone)  # one host: one-sided only
    one_host = compile_schedules(alone, ITEM)
    assert one_host.one_sided
    assert not one_host.mixed
    plain = compile_schedules(sim.build_all("allreduce", "ring", 4, 8), ITEM)
    assert not plain.one_sided
    assert not plain.mixed


def test_messages_and_window_steps_are_each_charged() -> None:
    scheds = schedules(pairs, [0, 0, 1, 1], 1 << 12)
    check_static(scheds)
    run_joint(scheds)
    for count in (1, 1 << 10, 1 << 16):
        nb = count * ITEM
        out = run_schedules(schedules(pairs, [0, 0, 1, 1], count), flat([0, 0, 1, 1]), ITEM)
        # A partner copies into its window (DELTA) and posts; its leader, having copied its
        # own input (DELTA), sees the post ALPHA later and folds the window in (GAMMA),
        # exchanges with the other leader (ALPHA + nb BETA), adds (GAMMA), copies the sum
        # into its window (DELTA) and posts; the partner sees that ALPHA later and reads
        # it (DELTA).
        leader = DELTA * nb + ALPHA + GAMMA * nb + ALPHA + BETA * nb + GAMMA * nb + DELTA * nb
        assert out.finish[0] == out.finish[2] == pytest.approx(leader, rel=1e-12)
        assert out.finish[1] == out.finish[3] == pytest.approx(leader + ALPHA + DELTA * nb)
        assert out.time == pytest.approx(3 * ALPHA + 3 * DELTA * nb + 2 * GAMMA * nb + BETA * nb)
        assert out.messages == 2


def test_mixed_data_reaches_the_reference() -> None:
    p, count = 4, 7
    scheds = schedules(pairs, [0, 0, 1, 1], count)
    dt = np.dtype(np.int32)
    xs: list[np.ndarray | None] = [np.arange(count, dtype=dt) * (r + 1) for r in range(p)]
    data = start_buffers("allreduce", scheds, xs, dt, 0, SUM)
    out = run_schedules(scheds, flat([0, 0, 1, 1]), ITEM, data=data, record=True)
    results = check("allreduce", out, xs, SUM, 0, p)
    np.testing.assert_array_equal(results[3], sum(xs))  # type: ignore[arg-type]
    assert out.records is not None
    kinds = {r.kind for r in out.records}
    assert {StepKind.SEND, StepKind.RECV, StepKind.POST, StepKind.GET_REDUCE} <= kinds


def test_a_window_on_another_host_is_refused() -> None:
    def far(b: Builder) -> None:
        win = b.shared(b.out.count)
        b.copy(b.inp, win)
        b.post(1)
        if b.rank == 2:  # rank 0's window is on the other host
            b.get(0, win, b.out, 1)
        b.send(b.rank ^ 2, b.inp)
        b.recv(b.rank ^ 2, b.scratch(b.inp.count))

    scheds = schedules(far, [0, 0, 1, 1], 3)
    with pytest.raises(ValueError, match=r"rank 2 step \d+ \(get from rank 0 phase 1.*host 0"):
        run_schedules(scheds, flat([0, 0, 1, 1]), ITEM)
    run_schedules(scheds, flat([0, 0, 0, 0]), ITEM)  # one host: its window is there


LAYOUTS = [
    ("2x2", lambda: sim.hosts(2, 2, INTRA, INTER, gamma=GAMMA, delta=DELTA)),
    ("2x3, 2 NICs", lambda: sim.hosts(2, 3, INTRA, INTER, nics=2, delta=DELTA)),
    ("2+3+1", lambda: hosts_of([2, 3, 1])),
    ("1+4+2", lambda: hosts_of([1, 4, 2])),
    ("3x1", lambda: sim.hosts(3, 1, INTRA, INTER)),
    ("one host of 5", lambda: sim.hosts(1, 5, INTRA, INTER, delta=DELTA)),
    ("flat [0,0,1,1,1,2]", lambda: flat([0, 0, 1, 1, 1, 2])),
]


SPECS_BOTH = ("hierarchical_arena", "cascade_arena")


@pytest.mark.parametrize("algo", SPECS_BOTH)
@pytest.mark.parametrize("make", [m for _, m in LAYOUTS], ids=[n for n, _ in LAYOUTS])
def test_hierarchical_arena_matches_the_reference(make: object, algo: str) -> None:
    net = make()  # type: ignore[operator]
    p = net.size
    for count, window in ((0, None), (1, None), (37, None), (1001, 256), (4 * p + 3, 64)):
        for segment in (0, 64):
            res = sim.simulate(
                "allreduce",
                algo,
                count * ITEM,
                net,
                dtype=np.int32,
                with_data=True,
                window=window,
                segment_bytes=segment,
                seed=count + segment,
            )
            assert res.outputs is not None
            assert len(res.outputs) == p
            assert math.isfinite(res.time)
            assert res.time > 0  # an empty call meets its peers too (Note [empty calls meet])
            assert res.time == max(res.finish)


def test_a_small_window_makes_several_pieces() -> None:
    net = sim.hosts(2, 2, INTRA, INTER)
    posts = {}
    for window in (None, 256):
        res = sim.simulate(
            "allreduce", "hierarchical_arena", 4001 * ITEM, net, window=window, trace=True
        )
        assert res.records is not None
        posts[window] = sum(r.kind is StepKind.POST for r in res.records)
    assert posts[None] == 4 * 2  # one piece: two posts per rank
    assert posts[256] > 4 * 2 * 10


@pytest.mark.parametrize("window", [None, 128])
def test_hierarchical_arena_charges_the_inter_host_links(window: int | None) -> None:
    nb = 1 << 16
    net = sim.hosts(2, 2, INTRA, INTER, gamma=GAMMA, delta=DELTA)
    arena = sim.simulate("allreduce", "hierarchical_arena", nb, net, window=window, trace=True)
    by_class = arena.bytes_by_class()
    # Each leader (two per host) exchanges its half with the other host's leader of it:
    # 2 nb bytes of messages, each over its host's NIC cable and the other's.
    assert by_class["inter"] == 4 * nb
    assert by_class["intra"] == 0  # within a host, windows: no message
    assert arena.records is not None
    hosts = net.hosts
    assert hosts is not None
    sends = [r for r in arena.records if r.kind is StepKind.SEND]
    assert sends
    assert all(hosts[r.rank] != hosts[r.peer] for r in sends)
    assert sum(r.nbytes for r in sends) == 2 * nb
    # A host's NIC sends nb bytes: that takes nb INTER.beta at least.
    assert math.isfinite(arena.time)
    assert arena.time > nb * INTER.beta
    # hierarchical moves the same bytes between hosts, and more within them.
    msgs = sim.simulate("allreduce", "hierarchical", nb, net).bytes_by_class()
    assert msgs["inter"] == by_class["inter"]
    assert msgs["intra"] > 0
    # On one host the same ranks exchange no message at all, and finish sooner.
    one = sim.simulate("allreduce", "hierarchical_arena", nb, sim.hosts(1, 4, INTRA, INTER))
    assert one.messages == 0
    assert not one.link_bytes.any()
    assert 0 < one.time < arena.time


def test_slower_inter_host_links_cost_the_mixed_schedule_more() -> None:
    nb = 1 << 18
    times = []
    for beta in (1e-10, 1e-9, 1e-8):
        net = hosts_of([2, 3, 1], sim.LinkParams(INTER.alpha, beta))
        res = sim.simulate("allreduce", "hierarchical_arena", nb, net, window=1 << 14)
        assert res.bytes_by_class()["inter"] > 0
        times.append(res.time)
    assert times[0] < times[1] < times[2]
    # Every host sends at least half the vector across: the time grows with the inter β.
    assert times[2] - times[1] > 0.5 * nb * (1e-8 - 1e-9)


def test_the_trace_of_a_mixed_call_shows_messages_and_posts() -> None:
    net = sim.hosts(2, 2, INTRA, INTER)
    res = sim.simulate("allreduce", "hierarchical_arena", 1 << 12, net, trace=True)
    events = sim.trace_events(res.records or [], name="mixed")["traceEvents"]
    threads = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {"compute", "sync", "net 0"} <= threads
    arrows = {e["cat"] for e in events if e["ph"] in "sf"}
    assert arrows == {"message", "post"}


def test_built_in_worker_processes_the_same() -> None:
    net = hosts_of([3, 4, 2, 3])
    here = sim.simulate("allreduce", "hierarchical_arena", 4 * 999, net, window=512, workers=1)
    there = sim.simulate("allreduce", "hierarchical_arena", 4 * 999, net, window=512, workers=2)
    assert here.time == there.time
    assert here.steps == there.steps
    assert here.messages == there.messages > 0


def test_plait_sim_runs_it(capsys: pytest.CaptureFixture) -> None:
    argv = ["sim", "-n", "6", "--topology", "hosts:2", "-a", "hierarchical_arena,hierarchical"]
    assert main([*argv, "-s", "4K:64K", "-f", "16", "--with-data"]) == 0
    out = capsys.readouterr().out
    rows = [ln.split() for ln in out.splitlines() if ln.strip().startswith(("4096", "65536"))]
    assert [r[2] for r in rows] == ["hierarchical_arena"] * 2 + ["hierarchical"] * 2
    assert all(r[-1] == "0" for r in rows)  # checked against the reference: nothing wrong


@pytest.mark.parametrize("beta", [1e-10, 1e-9])
def test_pipelined_pieces_overlap_the_inter_host_stage(beta: float) -> None:
    """``cascade_arena`` moves the same bytes as ``hierarchical_arena`` but sends piece k
    across hosts while the hosts reduce piece k+1: with several pieces it finishes first."""
    net = sim.hosts(2, 2, INTRA, sim.LinkParams(INTER.alpha, beta), gamma=GAMMA, delta=DELTA)
    nb = 1 << 20
    seq = sim.simulate("allreduce", "hierarchical_arena", nb, net, window=1 << 16)
    pipe = sim.simulate("allreduce", "cascade_arena", nb, net, window=1 << 16)
    assert pipe.bytes_by_class() == seq.bytes_by_class()
    assert pipe.time < 0.9 * seq.time
    # One piece (the whole vector fits the window): nothing to overlap, the same schedule.
    one = {a: sim.simulate("allreduce", a, 1 << 12, net).time for a in SPECS_BOTH}
    assert one["cascade_arena"] == one["hierarchical_arena"]
