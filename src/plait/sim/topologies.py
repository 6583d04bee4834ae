"""Ready-made networks: star, flat α-β, two-level fat tree, hosts with NICs, ring and torus.

Every constructor returns a finished :class:`~plait.sim.network.Network` (see
:mod:`plait.sim.network` for the model) with its ranks placed, its links
classed (``port``, ``intra``, ``inter``, ...) for :meth:`Result.bytes_by_class
<plait.sim.Result.bytes_by_class>`, and a router set. :func:`from_profile`
builds the network a measured ``plait tune`` profile describes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from plait.sim.model import LinkParams
from plait.sim.network import Network

__all__ = ["fat_tree", "flat", "from_profile", "hosts", "ring", "single_switch", "torus"]


def _check_size(p: int) -> None:
    if not isinstance(p, int) or p < 1:
        raise ValueError(f"the number of ranks must be an int >= 1; got {p!r}")


_FREE = LinkParams(0.0, 0.0)


def _aggregating(memory: int) -> int:
    """``memory`` checked: bytes of aggregation memory of each switch (0: they do not reduce)."""
    if not isinstance(memory, int) or memory < 0:
        raise ValueError(f"aggregation_memory must be an int >= 0 (bytes); got {memory!r}")
    return memory


# -- star-shaped networks ----------------------------------------------------------------


def single_switch(
    p: int,
    link: LinkParams,
    *,
    switch_latency: float = 0.0,
    backplane: LinkParams | None = None,
    aggregation_memory: int = 0,
    gamma: float = 0.0,
    delta: float | None = None,
) -> Network:
    """``p`` ranks on one switch, one cable each (``link`` per direction).

    A message crosses the sender's cable, the switch and the receiver's cable:
    ``2·link.alpha + switch_latency`` of latency, and the sender's and receiver's
    cable bandwidths. ``backplane`` (optional) is a switching capacity that all
    traffic through the switch shares (its ``alpha`` adds to the latency).
    ``aggregation_memory`` (bytes, > 0) makes the switch reduce in flight.
    """
    _check_size(p)
    net = Network("single_switch", gamma=gamma, delta=delta)
    for _ in range(p):
        net.add_rank()
    agg = _aggregating(aggregation_memory)
    sw_in = net.add_node("switch", "switch", reduce=agg > 0, memory=agg)
    sw_out = sw_in
    core = None
    if backplane is not None or switch_latency:
        sw_out = net.add_node("switch.out", "switch")
        core = net.add_link(
            sw_in, sw_out, backplane or LinkParams(switch_latency, 0.0), "backplane"
        )
        if backplane is not None:
            net.link_latency[core] += switch_latency
    up = [net.add_link(net.rank_node[r], sw_in, link, "port") for r in range(p)]
    down = [net.add_link(sw_out, net.rank_node[r], link, "port") for r in range(p)]
    if core is None:
        net.set_router(lambda s, d: (up[s], down[d]))
    else:
        net.set_router(lambda s, d: (up[s], core, down[d]))
    net.description = f"single switch, {_ranks(p)}"
    return net


def flat(
    p: int,
    alpha: float,
    beta: float,
    gamma: float = 0.0,
    *,
    delta: float | None = None,
    ports: bool = True,
) -> Network:
    """The flat α-β model: a message of n bytes alone on the network takes ``α + nβ``.

    With ``ports`` (the default) every rank has its own send port and receive
    port of bandwidth ``1/β`` into a non-blocking core, so messages contend
    only where they share a sender or a receiver; the latency is split evenly
    between the two ports (``α/2`` each, which adds back up to ``α`` exactly).

    ``ports=False`` is the contention-free model of Thakur, Rabenseifner and
    Gropp: every message costs ``α + nβ`` however many others are in flight,
    even from the same rank. The closed forms of :mod:`plait.sim.formulas` hold
    on it for every p.
    """
    if ports:
        net = single_switch(p, LinkParams(alpha / 2, beta), gamma=gamma, delta=delta)
    else:
        _check_size(p)
        net = Network("flat", gamma=gamma, delta=delta)
        for _ in range(p):
            net.add_rank()
        net.set_router(lambda s, d: ())
        net.set_message_cost(alpha, beta)
    net.name = "flat"
    net.description = (
        f"flat α-β{'' if ports else ', contention-free'}, {_ranks(p)}, "
        f"α={alpha:g} s, β={beta:g} s/B, γ={gamma:g} s/B"
        + ("" if delta is None or delta == gamma else f", δ={delta:g} s/B")
    )
    return net


def _two_level(
    net: Network,
    endpoints: Sequence[int],
    per_leaf: int,
    link: LinkParams,
    oversubscription: float,
    spines: int,
    klass: str,
    aggregation_memory: int = 0,
) -> Callable[[int, int], list[int]]:
    """Hang ``endpoints`` (nodes) on leaves of ``per_leaf``, leaves on ``spines`` spines.

    Each leaf's uplink capacity is ``per_leaf`` cables' worth divided by
    ``oversubscription``, spread over ``spines`` cables. Returns a router from
    endpoint index to endpoint index (D-mod-k: the spine is the destination's
    index mod ``spines``, so traffic to one endpoint always takes one spine).
    """
    if per_leaf < 1 or spines < 1 or not oversubscription > 0:
        raise ValueError(
            f"fat tree needs per-leaf >= 1, spines >= 1, oversubscription > 0; got "
            f"{per_leaf}, {spines}, {oversubscription}"
        )
    n = len(endpoints)
    n_leaves = -(-n // per_leaf)
    agg = _aggregating(aggregation_memory)
    leaves = [
        net.add_node(f"leaf{i}", "switch", reduce=agg > 0, memory=agg) for i in range(n_leaves)
    ]
    up = []
    down = []
    for e, node in enumerate(endpoints):
        a, b = net.add_cable(node, leaves[e // per_leaf], link, klass)
        up.append(a)
        down.append(b)
    uplink = LinkParams(link.alpha, link.beta * oversubscription * spines / per_leaf)
    spine_up: list[list[int]] = []
    spine_down: list[list[int]] = []
    if n_leaves > 1:
        spine_nodes = [
            net.add_node(f"spine{j}", "switch", reduce=agg > 0, memory=agg) for j in range(spines)
        ]
        for leaf in leaves:
            cables = [net.add_cable(leaf, s, uplink, "uplink") for s in spine_nodes]
            spine_up.append([c[0] for c in cables])
            spine_down.append([c[1] for c in cables])

    def router(s: int, d: int) -> list[int]:
        ls, ld = s // per_leaf, d // per_leaf
        if ls == ld:
            return [up[s], down[d]]
        j = d % spines
        return [up[s], spine_up[ls][j], spine_down[ld][j], down[d]]

    return router


def fat_tree(
    p: int,
    ranks_per_leaf: int,
    link: LinkParams,
    *,
    oversubscription: float = 1.0,
    spines: int = 1,
    aggregation_memory: int = 0,
    gamma: float = 0.0,
    delta: float | None = None,
) -> Network:
    """A two-level fat tree: ``ranks_per_leaf`` ranks per leaf switch, leaves joined by spines.

    Every rank has one cable (``link``) to its leaf. A leaf's uplinks together
    carry ``ranks_per_leaf / oversubscription`` cables' worth of bandwidth (1:
    full bisection, 2: half, …), split over ``spines`` cables, one per spine.
    Ranks are placed in order (ranks 0..k-1 on leaf 0, …). Latency: 2·α within
    a leaf, 4·α across leaves. ``aggregation_memory`` (bytes, > 0) makes every
    switch reduce in flight (the aggregation tree is leaves under spine 0).
    """
    _check_size(p)
    net = Network("fat_tree", gamma=gamma, delta=delta)
    for _ in range(p):
        net.add_rank()
    router = _two_level(
        net,
        net.rank_node,
        ranks_per_leaf,
        link,
        oversubscription,
        spines,
        "port",
        aggregation_memory,
    )
    net.set_router(router)
    net.description = (
        f"fat tree, {_ranks(p)}, {ranks_per_leaf} per leaf, {spines} spine(s), "
        f"oversubscription {oversubscription:g}"
    )
    return net


def hosts(
    n_hosts: int,
    ranks_per_host: int,
    intra: LinkParams,
    inter: LinkParams,
    *,
    nics: int = 1,
    hosts_per_leaf: int | None = None,
    oversubscription: float = 1.0,
    spines: int = 1,
    aggregation_memory: int = 0,
    gamma: float = 0.0,
    delta: float | None = None,
) -> Network:
    """Hosts of several ranks: a fast fabric inside each host, NICs between hosts.

    Inside a host every rank has a send and a receive port of ``intra`` (latency
    split between them, like :func:`flat`). Each host has ``nics`` NICs, each
    with one cable of ``inter`` into the network (latency split between the
    NIC's cable and the receiving one); local rank ``j`` uses NIC ``j % nics``.
    The network is one non-blocking switch, or with ``hosts_per_leaf`` a
    two-level fat tree of NICs (see :func:`fat_tree`). Ranks are numbered host
    by host, and host-aware algorithms see the layout. ``aggregation_memory``
    (bytes, > 0) makes the switches between hosts reduce in flight.
    """
    _check_size(n_hosts)
    _check_size(ranks_per_host)
    if nics < 1:
        raise ValueError(f"nics must be >= 1; got {nics}")
    net = Network("hosts", gamma=gamma, delta=delta)
    half_intra = LinkParams(intra.alpha / 2, intra.beta)
    half_inter = LinkParams(inter.alpha / 2, inter.beta)
    intra_up: list[int] = []
    intra_down: list[int] = []
    nic_of: list[int] = []  # endpoint index of each rank's NIC
    nic_nodes: list[int] = []
    host_of: list[int] = []
    for h in range(n_hosts):
        fabric = net.add_node(f"h{h}.fabric", "fabric")
        host_nics = []
        for j in range(nics):
            host_nics.append(len(nic_nodes))
            nic_nodes.append(net.add_node(f"h{h}.nic{j}", "nic"))
        for j in range(ranks_per_host):
            r = net.add_rank(f"h{h}.r{j}")
            node = net.rank_node[r]
            a, b = net.add_cable(node, fabric, half_intra, "intra")
            intra_up.append(a)
            intra_down.append(b)
            nic = host_nics[j % nics]
            net.add_cable(node, nic_nodes[nic], _FREE, "pcie")
            nic_of.append(nic)
            host_of.append(h)
    net.hosts = tuple(host_of)
    rank_to_nic = [net.link(net.rank_node[r], nic_nodes[nic_of[r]]) for r in range(net.size)]
    nic_to_rank = [net.link(nic_nodes[nic_of[r]], net.rank_node[r]) for r in range(net.size)]
    between: Callable[[int, int], list[int]]
    if hosts_per_leaf is None:
        agg = _aggregating(aggregation_memory)
        core = net.add_node("switch", "switch", reduce=agg > 0, memory=agg)
        nic_up = []
        nic_down = []
        for node in nic_nodes:
            a, b = net.add_cable(node, core, half_inter, "inter")
            nic_up.append(a)
            nic_down.append(b)

        def between(s: int, d: int) -> list[int]:  # NIC index to NIC index
            return [nic_up[s], nic_down[d]]

        where = "one switch"
    else:
        between = _two_level(
            net,
            nic_nodes,
            hosts_per_leaf * nics,
            half_inter,
            oversubscription,
            spines,
            "inter",
            aggregation_memory,
        )
        where = (
            f"fat tree of {hosts_per_leaf} hosts per leaf, oversubscription {oversubscription:g}"
        )

    def router(s: int, d: int) -> list[int]:
        if host_of[s] == host_of[d]:
            return [intra_up[s], intra_down[d]]
        return [rank_to_nic[s], *between(nic_of[s], nic_of[d]), nic_to_rank[d]]

    net.set_router(router)
    net.description = f"{n_hosts} hosts × {_ranks(ranks_per_host)}, {nics} NIC(s) per host, {where}"
    return net


# -- direct networks -------------------------------------------------------------------


def torus(
    dims: Sequence[int],
    link: LinkParams,
    *,
    gamma: float = 0.0,
    delta: float | None = None,
) -> Network:
    """A k-ary n-cube: ranks on a grid with wrap-around cables, dimension-order routing.

    Rank ``r`` sits at coordinates ``(x0, x1, …)`` with ``x0`` varying fastest
    (``r = x0 + d0·(x1 + d1·(x2 + …))``). A message first travels dimension 0,
    then 1, and so on, each the shorter way round (ties go up); every hop
    crosses one cable (``link``) and adds its latency. A dimension of size 2 has
    one cable between its two ranks; size 1 has none.
    """
    dims = tuple(dims)
    if not dims or any(not isinstance(d, int) or d < 1 for d in dims):
        raise ValueError(f"torus dimensions must be ints >= 1; got {dims!r}")
    p = math.prod(dims)
    net = Network("torus" if len(dims) > 1 else "ring", gamma=gamma, delta=delta)
    for _ in range(p):
        net.add_rank()
    strides = [math.prod(dims[:i]) for i in range(len(dims))]
    for r in range(p):
        for k, (d, st) in enumerate(zip(dims, strides, strict=True)):
            if d == 1:
                continue
            x = r // st % d
            nb = r + ((x + 1) % d - x) * st
            if (r, nb) not in net._link_of:
                net.add_cable(r, nb, link, f"dim{k}")
    links = net._link_of

    def router(s: int, d: int) -> list[int]:
        path = []
        cur = s
        for size, st in zip(dims, strides, strict=True):
            if size == 1:
                continue
            x, y = cur // st % size, d // st % size
            ahead = (y - x) % size
            step = 1 if ahead <= size - ahead else -1
            for _ in range(ahead if step == 1 else size - ahead):
                x2 = (x + step) % size
                nxt = cur + (x2 - x) * st
                path.append(links[(cur, nxt)])
                cur, x = nxt, x2
        return path

    net.set_router(router)
    shape = "×".join(map(str, dims))
    net.description = f"{'torus ' + shape if len(dims) > 1 else f'ring of {p}'} ranks"
    return net


def ring(p: int, link: LinkParams, *, gamma: float = 0.0, delta: float | None = None) -> Network:
    """``p`` ranks on a bidirectional ring (a 1-D torus); messages take the shorter way."""
    _check_size(p)
    return torus((p,), link, gamma=gamma, delta=delta)


# -- from a measured profile ----------------------------------------------------------------


def from_profile(
    profile: Any,
    size: int,
    *,
    ranks_per_host: int | None = None,
    nics: int = 1,
    ports: bool = True,
) -> Network:
    """The network a measured profile describes (:class:`plait.selection.model.Profile`).

    ``size`` ranks on one host (:func:`flat` with the profile's ``intra`` link),
    or, with ``ranks_per_host`` dividing ``size`` into several hosts and a
    profile that measured an ``inter`` link, :func:`hosts` joined by ``nics``
    NICs each. γ and δ are the profile's.
    """
    intra = LinkParams(profile.intra.alpha, profile.intra.beta)
    gamma, delta = profile.gamma, profile.delta
    if ranks_per_host is None or ranks_per_host >= size:
        return flat(size, intra.alpha, intra.beta, gamma, delta=delta, ports=ports)
    if profile.inter is None:
        raise ValueError("the profile has no inter-host link: measure one with plait tune")
    if size % ranks_per_host:
        raise ValueError(f"{size} ranks do not split into hosts of {ranks_per_host}")
    inter = LinkParams(profile.inter.alpha, profile.inter.beta)
    return hosts(
        size // ranks_per_host, ranks_per_host, intra, inter, nics=nics, gamma=gamma, delta=delta
    )


def _ranks(n: int) -> str:
    """``1 rank`` or ``8 ranks``, for a network's description."""
    return f"{n} rank{'' if n == 1 else 's'}"
