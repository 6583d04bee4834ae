"""Topologies: routes are connected paths, have the right lengths and classes, and contend."""

from __future__ import annotations

import itertools

import pytest

from plait import sim
from plait.sim import formulas

LINK = sim.LinkParams(1e-6, 1e-9)


def assert_path(net: sim.Network, src: int, dst: int) -> tuple[int, ...]:
    path = net.route(src, dst)
    assert path, f"{net.description}: empty route {src}->{dst}"
    assert net.link_src[path[0]] == net.rank_node[src]
    assert net.link_dst[path[-1]] == net.rank_node[dst]
    for a, b in itertools.pairwise(path):
        assert net.link_dst[a] == net.link_src[b], f"{src}->{dst}: {path} is not connected"
    return path


NETWORKS = {
    "flat": lambda: sim.flat(7, 1e-6, 1e-9),
    "switch": lambda: sim.single_switch(5, LINK, switch_latency=1e-7, backplane=LINK),
    "fat_tree": lambda: sim.fat_tree(10, 3, LINK, oversubscription=2, spines=2),
    "hosts": lambda: sim.hosts(3, 4, LINK, LINK, nics=2),
    "hosts_tree": lambda: sim.hosts(5, 2, LINK, LINK, hosts_per_leaf=2, spines=3),
    "ring": lambda: sim.ring(6, LINK),
    "torus2": lambda: sim.torus((4, 3), LINK),
    "torus3": lambda: sim.torus((2, 3, 4), LINK),
}


@pytest.mark.parametrize("name", sorted(NETWORKS))
def test_routes_are_connected(name: str) -> None:
    net = NETWORKS[name]()
    for s, d in itertools.permutations(range(net.size), 2):
        assert_path(net, s, d)


def test_torus_dimension_order_routes_take_the_short_way() -> None:
    dims = (4, 3, 5)
    net = sim.torus(dims, LINK)
    for s, d in itertools.permutations(range(net.size), 2):
        hops = 0
        for k, size in enumerate(dims):
            stride = 1 if k == 0 else dims[0] if k == 1 else dims[0] * dims[1]
            delta = abs(s // stride % size - d // stride % size)
            hops += min(delta, size - delta)
        assert len(assert_path(net, s, d)) == hops
        assert net.latency(net.route(s, d)) == pytest.approx(hops * LINK.alpha)


def test_fat_tree_shape() -> None:
    net = sim.fat_tree(12, 4, LINK, oversubscription=2, spines=2)
    assert len(net.route(0, 3)) == 2  # same leaf
    path = net.route(0, 4)
    assert len(path) == 4
    # A leaf's two uplinks carry 4 ports' worth / 2 = 2 ports' worth, 1 each.
    assert net.link_beta[path[1]] == pytest.approx(LINK.beta)
    assert {net.link_class[i] for i in path} == {"port", "uplink"}


def test_hosts_classes_and_layout() -> None:
    net = sim.hosts(2, 3, sim.LinkParams(1e-7, 1e-10), sim.LinkParams(1e-5, 1e-9), nics=3)
    assert net.host_layout() is not None
    assert net.host_layout().hosts == (0, 0, 0, 1, 1, 1)
    assert {net.link_class[i] for i in net.route(0, 2)} == {"intra"}
    assert net.latency(net.route(0, 2)) == pytest.approx(1e-7)
    cross = net.route(1, 4)
    assert "inter" in {net.link_class[i] for i in cross}
    assert net.latency(cross) == pytest.approx(1e-5)
    # Local rank j uses NIC j: the two routes out of host 0 share no NIC link.
    a = {i for i in net.route(0, 3) if net.link_class[i] == "inter"}
    b = {i for i in net.route(1, 4) if net.link_class[i] == "inter"}
    assert not a & b
    assert sim.hosts(1, 4, LINK, LINK).host_layout() is None


def test_custom_network_routes_by_shortest_path() -> None:
    net = sim.Network("line")
    for _ in range(3):
        net.add_rank()
    net.add_cable(net.rank_node[0], net.rank_node[1], LINK)
    net.add_cable(net.rank_node[1], net.rank_node[2], LINK)
    assert len(assert_path(net, 0, 2)) == 2
    with pytest.raises(ValueError, match="exists"):
        net.add_cable(net.rank_node[0], net.rank_node[1], LINK)
    with pytest.raises(ValueError, match="already exists"):
        net.add_node("r0")
    lone = sim.Network("apart")
    lone.add_rank()
    lone.add_rank()
    with pytest.raises(ValueError, match="no route"):
        lone.route(0, 1)


def test_reducing_switch_hook() -> None:
    net = sim.Network("agg")
    net.add_rank()
    sw = net.add_node("sw", reduce=True, memory=1 << 20)
    assert net.reducing_switches() == [sw]
    assert net.nodes[sw].memory == 1 << 20


def test_ring_allreduce_on_a_ring_is_the_flat_formula() -> None:
    # Every ring step goes one hop to the next rank: no two messages share a link.
    for p in (2, 5, 8):
        n = p * 4 * 16
        got = sim.simulate("allreduce", "ring", n, sim.ring(p, LINK, gamma=2e-10)).time
        want = formulas.predict("allreduce", "ring", p, n, LINK.alpha, LINK.beta, 2e-10)
        assert got == pytest.approx(want, rel=1e-12)


def test_oversubscription_slows_cross_leaf_traffic() -> None:
    times = [
        sim.simulate(
            "allreduce",
            "recursive_doubling",
            1 << 20,
            sim.fat_tree(16, 4, LINK, oversubscription=o),
        ).time
        for o in (1, 2, 4)
    ]
    assert times[0] < times[1] < times[2]


def test_swing_takes_fewer_torus_hops_than_recursive_doubling() -> None:
    net = sim.torus((16,), LINK)
    rd = sim.simulate("allreduce", "recursive_doubling", 1 << 16, net)
    rab = sim.simulate("allreduce", "rabenseifner", 1 << 16, net)
    swing = sim.simulate("allreduce", "swing", 1 << 16, net)
    assert swing.time < rab.time  # same bytes, nearer peers
    assert swing.link_bytes.sum() < rab.link_bytes.sum()
    assert rd.time > 0


def test_link_bytes_count_every_hop() -> None:
    net = sim.torus((3, 4), LINK)
    res = sim.simulate("allgather", "ring", 12 * 48, net)
    # Ring neighbours r, r+1 are one hop apart except where x wraps into the next row.
    per_message = 48 * 4 // 4
    hops = sum(len(net.route(r, (r + 1) % 12)) for r in range(12))
    assert res.link_bytes.sum() == pytest.approx(11 * per_message * hops)


def test_bad_parameters() -> None:
    with pytest.raises(ValueError, match="ranks"):
        sim.flat(0, 1e-6, 1e-9)
    with pytest.raises(ValueError, match="torus"):
        sim.torus((4, 0), LINK)
    with pytest.raises(ValueError, match="beta"):
        sim.LinkParams(1e-6, -1.0)
    with pytest.raises(ValueError, match="gamma"):
        sim.flat(2, 1e-6, 1e-9, gamma=float("nan"))
    with pytest.raises(ValueError, match="fat tree"):
        sim.fat_tree(8, 0, LINK)


def test_a_rank_can_sit_on_a_switch() -> None:
    # The hook for in-network aggregation: a switch that reduces runs a schedule of its own.
    net = sim.Network("agg")
    sw = net.add_node("sw", reduce=True, memory=1 << 20)
    for _ in range(2):
        r = net.add_rank()
        net.add_cable(net.rank_node[r], sw, LINK)
    assert net.add_rank("sw.rank", node=sw) == 2
    assert net.rank_node[2] == sw
    assert len(net.route(0, 2)) == 1
    res = sim.simulate("reduce", "binomial", 400, net, root=2, with_data=True, dtype="int32")
    assert res.time > 0


def test_two_clusters_joined_by_a_slow_link() -> None:
    # Heterogeneous links in one job: 2 clusters of 4 ranks, their switches joined by a WAN.
    net = sim.Network("two clusters")
    fast, wan = sim.LinkParams(1e-6, 1e-10), sim.LinkParams(5e-3, 1e-8)
    switches = [net.add_node(f"sw{c}") for c in range(2)]
    for c in range(2):
        for _ in range(4):
            r = net.add_rank()
            net.add_cable(net.rank_node[r], switches[c], fast)
    net.add_cable(switches[0], switches[1], wan, "wan")
    net.hosts = tuple(r // 4 for r in range(8))  # host-aware algorithms see the clusters
    assert [net.link_class[i] for i in net.route(1, 6)].count("wan") == 1
    times = {
        name: sim.simulate("allreduce", name, 1 << 20, net, with_data=True, dtype="int32").time
        for name in ("ring", "hierarchical")
    }
    # The ring crosses the WAN in 2(p-1) sequential steps; hierarchical in few, with 1/4 of it.
    assert times["hierarchical"] < times["ring"]
