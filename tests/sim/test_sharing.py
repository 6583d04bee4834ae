"""Max-min shares (plait.sim.sharing): the faster ways to find them give the same bits.

Note [exact shares] in :mod:`plait.sim.sharing`: the order in which links are
fixed and every subtraction are part of the model. The scan and the heap of
Note [the smallest share], and the two searches of Note [groups found by sets],
are held to each other here on random groups, value and order; and the scan is
held to what it is for: an all-to-all on a flat network is filled without a heap.
"""

from __future__ import annotations

import heapq
import math
import random
from typing import Any

import pytest

from plait import sim
from plait.sim import sharing


def random_flows(seed: int, n_links: int, n_flows: int) -> tuple[list[list[Any]], list[float]]:
    """Flows (the engine's lists: links at 3, rate alone at 8) over links of a few speeds."""
    rng = random.Random(seed)
    cap = [rng.choice((1e9, 2.5e9, 1e10, 1 / 3 * 1e10)) for _ in range(n_links)]
    flows = []
    for _ in range(n_flows):
        links = tuple(rng.sample(range(n_links), rng.randint(1, 3)))
        alone = min(cap[i] for i in links)
        flows.append([1000.0, 0.0, 0.0, links, 1e-6, 0, 0.0, 0, alone])
    return flows, cap


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("flow_cap", [math.inf, 4e9])
def test_the_scan_and_the_heap_fix_the_same_flows_at_the_same_shares(
    seed: int, flow_cap: float
) -> None:
    flows, cap = random_flows(seed, 3 + seed, 5 + 7 * seed)
    link_flows: list[set[int]] = [set() for _ in cap]
    for f, flow in enumerate(flows):
        for i in flow[3]:
            link_flows[i].add(f)
    links = [i for i in range(len(cap)) if link_flows[i]]
    members = list(range(len(flows)))
    by = {}
    for scan in (True, False):
        rates: dict[int, float] = {}
        sharing._progressive_fill(links, members, link_flows, cap, flows, flow_cap, rates, scan)
        by[scan] = list(rates.items())
    assert by[True] == by[False]
    assert len(by[True]) == len(flows)


@pytest.mark.parametrize("seed", range(8))
def test_groups_found_by_sets_and_one_by_one_agree(seed: int) -> None:
    """With no limit of its own (inf) a group is found by sets; with a limit no flow
    reaches (1e30) one flow at a time: the same rates, in the same order."""
    got = []
    for flow_cap in (math.inf, 1e30):
        flows, cap = random_flows(100 + seed, 4 + seed, 3 + 9 * seed)
        link_flows: list[set[int]] = [set() for _ in cap]
        new = list(range(len(flows)))
        rates = sharing.shares(set(), new, flows, link_flows, cap, flow_cap, True)
        got.append(list(rates.items()))
    assert got[0] == got[1]


def test_an_all_to_all_on_a_flat_network_is_filled_without_a_heap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """p - 1 messages from and to each of 64 ranks: 4,032 flows on 128 ports. The scan
    selects a port 128 times; a heap would push and pop once per flow fixed."""
    pushes = []

    class Counting:
        heapify, heappop = staticmethod(heapq.heapify), staticmethod(heapq.heappop)

        @staticmethod
        def heappush(heap: list[Any], item: Any) -> None:
            pushes.append(item)
            heapq.heappush(heap, item)

    monkeypatch.setattr(sharing, "heapq", Counting)
    res = sim.simulate("alltoall", "pairwise", 64 << 10, sim.flat(64, 1e-6, 1e-10))
    assert res.messages == 64 * 63
    assert pushes == []
    # The same flows on a fat tree's few uplinks and many ports: the heap, which pushes.
    tree = sim.fat_tree(64, 4, sim.LinkParams(1e-6, 1e-10))
    assert sim.simulate("alltoall", "pairwise", 64 << 10, tree).time > res.time
    assert pushes
