"""Modelled networks: nodes, full-duplex links, where the ranks sit and how messages are routed.

A :class:`Network` is a directed graph. Every *cable* is two directed links (full
duplex: traffic one way does not slow the other), each with a latency and an
inverse bandwidth β; a link with β = 0 has unlimited bandwidth (a wire that is
not modelled, such as a rank's path to its NIC). Ranks are nodes; switches,
NICs and host-internal fabrics are nodes too. A message from rank ``a`` to rank
``b`` is a *flow* over the links that :meth:`Network.route` returns; its
latency is the sum of theirs, and the engine shares every link's bandwidth
among the flows crossing it (:mod:`plait.sim.engine`). Every rank also has a
reduction cost γ and a copy cost δ, in seconds per byte, and ranks that share a
window see each other's posts (counters in host memory) after a *wait latency*:
:attr:`Network.wait_latency` seconds where set, else what a message between
them would take to arrive (its route's latency).

Topologies (in :mod:`plait.sim.topologies`; all return a finished :class:`Network`)::

    flat(p, alpha, beta)            every rank has a send and a receive port of 1/β
                                    into a non-blocking core; a message costs α + nβ
    single_switch(p, link)          one switch, one cable per rank, optional backplane limit
    fat_tree(p, ranks_per_leaf, link, oversubscription=2)
                                    two levels: leaves and spines, D-mod-k routing
    hosts(H, L, intra, inter, nics=2)
                                    L ranks per host on a fast host fabric, hosts joined
                                    by NICs (optionally through a fat tree)
    ring(p, link), torus((4, 4, 4), link)
                                    direct networks, dimension-order routing

In-network aggregation: switches built with ``aggregation_memory`` (on
:func:`single_switch`, :func:`fat_tree` and :func:`hosts`, or ``reduce=True``
on :meth:`Network.add_node`) can reduce data in flight, as SHARP and SwitchML
switches do. :meth:`Network.aggregation_fabric` arranges them into a tree
(each rank under the first such switch on its way to the root), and
:meth:`Network.with_agents` gives each one a rank of its own, so algorithms
that need a :class:`~plait.schedule.builder.Fabric` (``in_network``) run on
it like any other schedule. A switch reduces at line rate (γ = δ = 0).

Build your own with :meth:`Network.add_node`, :meth:`Network.add_rank`,
:meth:`Network.add_cable` and, for anything but shortest paths,
:meth:`Network.set_router`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from plait.schedule.builder import Fabric, HostLayout
from plait.sim.model import LinkParams

__all__ = ["Network", "Node"]

Router = Callable[[int, int], Sequence[int]]


@dataclass(frozen=True, slots=True)
class Node:
    """A vertex of the network.

    Attributes:
        name: unique, shown in traces and link names.
        kind: ``"rank"``, ``"switch"``, ``"nic"`` or ``"fabric"`` (a host's internal fabric).
        reduce: whether this switch can reduce data in flight (in-network aggregation).
        memory: bytes of aggregation memory such a switch has (0: none).
    """

    name: str
    kind: str
    reduce: bool = False
    memory: int = 0


class Network:
    """A directed graph of nodes and links with ranks placed on it; see the module docstring."""

    def __init__(
        self,
        name: str = "custom",
        *,
        gamma: float = 0.0,
        delta: float | None = None,
        wait_latency: float | None = None,
    ):
        self.name = name
        self.description = name
        self.nodes: list[Node] = []
        self._node_index: dict[str, int] = {}
        self.link_src: list[int] = []
        self.link_dst: list[int] = []
        self.link_beta: list[float] = []
        self.link_latency: list[float] = []
        self.link_class: list[str] = []
        self._link_of: dict[tuple[int, int], int] = {}
        self.rank_node: list[int] = []
        self.gamma: list[float] = []
        self.delta: list[float] = []
        self.hosts: tuple[int, ...] | None = None
        # Per message, on top of the links: a fixed latency (software overhead) and a
        # bandwidth no message exceeds however idle the links are (1/message_beta).
        self.message_alpha = 0.0
        self.message_beta = 0.0
        # Seconds from a post until a peer sharing the window sees it; None: a message's latency.
        self.wait_latency: float | None = None
        self.set_wait_latency(wait_latency)
        self._default_gamma = _nonneg("gamma", gamma)
        self._default_delta = self._default_gamma if delta is None else _nonneg("delta", delta)
        self._router: Router | None = None
        self._bfs: dict[int, dict[int, int]] = {}

    # -- building ----------------------------------------------------------------------
    def add_node(
        self, name: str, kind: str = "switch", *, reduce: bool = False, memory: int = 0
    ) -> int:
        """Add a node; returns its index. Names must be unique."""
        if name in self._node_index:
            raise ValueError(f"{self.name}: node {name!r} already exists")
        self._node_index[name] = len(self.nodes)
        self.nodes.append(Node(name, kind, reduce, memory))
        return len(self.nodes) - 1

    def add_rank(self, name: str | None = None, *, node: int | None = None) -> int:
        """Add a rank (numbered in order of addition); returns the rank.

        It gets a new node of its own, or sits on ``node`` (e.g. a switch that
        reduces, so that an in-network algorithm can give it a schedule).
        """
        rank = len(self.rank_node)
        self.rank_node.append(self.add_node(name or f"r{rank}", "rank") if node is None else node)
        self.gamma.append(self._default_gamma)
        self.delta.append(self._default_delta)
        return rank

    def add_link(self, a: int, b: int, params: LinkParams, klass: str = "link") -> int:
        """Add the directed link ``a -> b`` between nodes; returns its index."""
        if (a, b) in self._link_of:
            raise ValueError(f"{self.name}: link {self.nodes[a].name}->{self.nodes[b].name} exists")
        if a == b:
            raise ValueError(f"{self.name}: a link from {self.nodes[a].name} to itself")
        index = len(self.link_src)
        self._link_of[(a, b)] = index
        self.link_src.append(a)
        self.link_dst.append(b)
        self.link_beta.append(params.beta)
        self.link_latency.append(params.alpha)
        self.link_class.append(klass)
        self._bfs.clear()
        return index

    def add_cable(self, a: int, b: int, params: LinkParams, klass: str = "link") -> tuple[int, int]:
        """A full-duplex cable: the links ``a -> b`` and ``b -> a``, each with ``params``."""
        return self.add_link(a, b, params, klass), self.add_link(b, a, params, klass)

    def set_router(self, router: Router) -> None:
        """Route rank ``src`` to rank ``dst`` by ``router(src, dst)`` (link indices)."""
        self._router = router

    def set_message_cost(self, alpha: float = 0.0, beta: float = 0.0) -> None:
        """Add ``alpha`` seconds to every message and cap every message at ``1/beta`` bytes/s.

        The cap is per message: a message alone on idle links still takes at
        least ``n·beta``, and messages that share no link do not slow each
        other. With no links at all, every message costs exactly ``alpha + n·beta``.
        """
        self.message_alpha = _nonneg("message alpha", alpha, "seconds")
        self.message_beta = _nonneg("message beta", beta)

    def set_wait_latency(self, seconds: float | None) -> None:
        """Seconds from a rank's post until a peer that waits for it sees it.

        A post is a counter stored in the memory of the host whose ranks share a
        window, so its latency is the host's, not the network's: one figure for
        every pair of ranks. None (the default): the latency a message from the
        poster to the peer would have (on :func:`plait.sim.hosts`, the intra-host
        α; on :func:`plait.sim.flat`, α).
        """
        self.wait_latency = None if seconds is None else _nonneg("wait latency", seconds, "seconds")

    def set_compute(
        self, gamma: float, delta: float | None = None, ranks: Sequence[int] | None = None
    ) -> None:
        """Set γ (and δ, default γ) for ``ranks`` (default all), in seconds per byte."""
        g = _nonneg("gamma", gamma)
        d = g if delta is None else _nonneg("delta", delta)
        for r in range(self.size) if ranks is None else ranks:
            self.gamma[r] = g
            self.delta[r] = d

    # -- queries -----------------------------------------------------------------------
    @property
    def size(self) -> int:
        """Number of ranks."""
        return len(self.rank_node)

    @property
    def n_links(self) -> int:
        """Number of directed links."""
        return len(self.link_src)

    def link(self, a: int, b: int) -> int:
        """Index of the link ``a -> b`` between nodes; KeyError if there is none."""
        return self._link_of[(a, b)]

    def link_name(self, index: int) -> str:
        """``"src->dst"`` by node names."""
        return f"{self.nodes[self.link_src[index]].name}->{self.nodes[self.link_dst[index]].name}"

    def host_layout(self) -> HostLayout | None:
        """The host of every rank, for host-aware algorithms; None when all share one host."""
        if self.hosts is None or len(set(self.hosts)) <= 1:
            return None
        return HostLayout(self.hosts)

    def reducing_switches(self) -> list[int]:
        """Nodes that can reduce in flight (the in-network aggregation hook)."""
        return [i for i, n in enumerate(self.nodes) if n.reduce]

    def aggregation_fabric(self) -> tuple[Fabric, list[int]]:
        """The tree of switches that reduce (:class:`Fabric`), and each switch's node.

        The root is the reducing switch nearest to the farthest rank (ties: the
        first added). Each rank attaches to the first reducing switch on its
        shortest path to the root, and each other reducing switch to the next
        one on its own path; switches that no rank reaches are left out. The
        fabric's memory is the smallest of theirs.

        Raises:
            ValueError: no switch reduces, or a rank cannot reach the root.
        """
        reducing = self.reducing_switches()
        if not reducing:
            raise ValueError(
                f"{self.name}: no switch reduces in flight; build the network with "
                "aggregation_memory=... (or add_node(..., reduce=True, memory=...))"
            )
        rank_nodes = set(self.rank_node)
        best: tuple[int, int] | None = None
        for node in reducing:
            hops = self._hops_to(node)
            if any(n not in hops for n in rank_nodes):
                continue
            far = max(hops[n] for n in rank_nodes)
            if best is None or far < best[0]:
                best = (far, node)
        if best is None:
            raise ValueError(f"{self.name}: no reducing switch is reachable from every rank")
        root = best[1]
        toward = self._next_hop_to(root)
        is_reducing = set(reducing)

        def first_above(node: int) -> int:
            while node != root:
                node = self.link_dst[toward[node]]
                if node in is_reducing:
                    return node
            return root

        attach_node = [first_above(n) for n in self.rank_node]
        used: list[int] = []  # switches in the tree: every attach point and everything above
        parent_node: dict[int, int] = {}
        for node in attach_node:
            while node not in parent_node:
                up = first_above(node) if node != root else -1
                parent_node[node] = up
                used.append(node)
                if up == -1:
                    break
                node = up
        used.sort()
        index = {node: i for i, node in enumerate(used)}
        memory = min(self.nodes[n].memory for n in used)
        fabric = Fabric(
            [index[n] for n in attach_node],
            [index[parent_node[n]] if parent_node[n] >= 0 else -1 for n in used],
            max(1, memory),
        )
        return fabric, used

    def with_agents(self, nodes: Sequence[int]) -> Network:
        """A copy with one more rank on each of ``nodes`` (a fabric's switches), after the ranks.

        Messages among the original ranks take their usual routes; messages to
        or from the new ranks take shortest paths.
        """
        net = Network.__new__(Network)
        net.__dict__.update(self.__dict__)
        net.rank_node = [*self.rank_node, *nodes]
        net.gamma = [*self.gamma, *(0.0 for _ in nodes)]
        net.delta = [*self.delta, *(0.0 for _ in nodes)]
        p, inner = self.size, self._router
        toward: dict[int, dict[int, int]] = {}

        def router(s: int, d: int) -> Sequence[int]:
            if s < p and d < p and inner is not None:
                return inner(s, d)
            a, b = net.rank_node[s], net.rank_node[d]
            if s < p:  # a rank to a switch above it: walk toward that switch
                hop = toward.get(b)
                if hop is None:
                    hop = toward[b] = self._next_hop_to(b)
                path = []
                while a != b and a in hop:
                    path.append(hop[a])
                    a = self.link_dst[hop[a]]
                if a == b:
                    return tuple(path)
                a = net.rank_node[s]
            return self._shortest(a, b)

        net._router = router
        net.description = f"{self.description}, {len(nodes)} aggregating switch(es)"
        return net

    def _hops_to(self, node: int) -> dict[int, int]:
        """Hops to ``node`` from every node that can reach it."""
        return {v: hops for v, (hops, _) in self._toward(node).items()}

    def _next_hop_to(self, node: int) -> dict[int, int]:
        """Per node that can reach ``node`` (but itself): the first link of a shortest path."""
        return {v: link for v, (_, link) in self._toward(node).items() if link >= 0}

    def _toward(self, node: int) -> dict[int, tuple[int, int]]:
        """BFS over reversed links: per node that reaches ``node``, (hops, first link; -1 at it)."""
        into = self._links_into()
        found = {node: (0, -1)}
        queue = deque([node])
        while queue:
            u = queue.popleft()
            hops = found[u][0] + 1
            for i in into.get(u, ()):
                v = self.link_src[i]
                if v not in found:
                    found[v] = (hops, i)
                    queue.append(v)
        return found

    def _links_into(self) -> dict[int, list[int]]:
        """Per node, the links that end there (rebuilt when links were added)."""
        cached = self.__dict__.get("_into")
        if cached is not None and cached[0] == len(self.link_dst):
            hit: dict[int, list[int]] = cached[1]
            return hit
        into: dict[int, list[int]] = {}
        for i, d in enumerate(self.link_dst):
            into.setdefault(d, []).append(i)
        self._into = (len(self.link_dst), into)
        return into

    def route(self, src: int, dst: int) -> tuple[int, ...]:
        """Links a message from rank ``src`` to rank ``dst`` crosses, in order."""
        if self._router is not None:
            path = self._router(src, dst)
            return path if type(path) is tuple else tuple(path)
        return self._shortest(self.rank_node[src], self.rank_node[dst])

    def latency(self, path: Sequence[int]) -> float:
        """Latency of a message along ``path``: its links' plus the per-message latency."""
        return self.message_alpha + sum(self.link_latency[i] for i in path)

    def _shortest(self, a: int, b: int) -> tuple[int, ...]:
        """Fewest hops from node ``a`` to ``b`` (ties: the link added first), by BFS per source."""
        parent = self._bfs.get(a)
        if parent is None:
            out: dict[int, list[int]] = {}
            for i, s in enumerate(self.link_src):
                out.setdefault(s, []).append(i)
            parent = {a: -1}
            queue = deque([a])
            while queue:
                u = queue.popleft()
                for i in out.get(u, ()):
                    v = self.link_dst[i]
                    if v not in parent:
                        parent[v] = i
                        queue.append(v)
            self._bfs[a] = parent
        if b not in parent:
            raise ValueError(
                f"{self.name}: no route from {self.nodes[a].name} to {self.nodes[b].name}"
            )
        path = []
        while b != a:
            i = parent[b]
            path.append(i)
            b = self.link_src[i]
        return tuple(reversed(path))

    def __repr__(self) -> str:
        return (
            f"<Network {self.description}: {self.size} ranks, {len(self.nodes)} nodes, "
            f"{self.n_links} links>"
        )


def _nonneg(name: str, value: float, unit: str = "seconds per byte") -> float:
    if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0 ({unit}); got {value!r}")
    return float(value)


def __getattr__(name: str) -> object:
    # The topologies lived here before plait.sim.topologies; keep their old address.
    if name in _MOVED:
        from plait.sim import topologies

        return getattr(topologies, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_MOVED = frozenset({"fat_tree", "flat", "hosts", "ring", "single_switch", "torus"})
