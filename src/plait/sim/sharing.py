"""Bandwidth sharing: the rates of the flows on the network's links, recomputed at an instant.

The engine (:mod:`plait.sim.engine`) calls :func:`shares` at every instant at
which flows started or ended, with the links whose flows changed. A flow alone
on every link it crosses runs at its slowest link's speed (or its own limit);
otherwise its rate follows from the links it shares:

* ``"maxmin"``: max-min fair sharing over each group of flows connected
  through shared links, by progressive filling: repeatedly take the link whose
  remaining capacity per unfixed flow is the smallest, fix its unfixed flows
  at that share, and take the share off the other links they cross;
* ``"equal"``: each flow gets the smallest equal share of its links (local and
  cheaper, not work-conserving).

A flow here is the engine's list ``[bytes left, at time, rate, links, latency,
send step, end, channel, rate alone]``; only ``links`` (index 3) and ``rate
alone`` (index 8) are read.

Note [exact shares]
~~~~~~~~~~~~~~~~~~~
The simulated times are compared bit for bit (a schedule's time on a network
is a fact the tests and the docs quote), and max-min shares are sums and
quotients of floats: a share computed in another order can differ in its last
bit, end a flow an instant apart from its peers and change every later event.
So the groups, the order in which links are fixed (a heap of (share, version,
link): ties broken by version, then link) and the order of every subtraction
are part of the model, and any faster way to compute them must keep all three.
What is cheap to change is the bookkeeping around them (Note [groups found by
sets], Note [the smallest share]): a link's remaining
capacity, unfixed flows and version live in one list per link, and a flow is
fixed once it has a rate in ``rates`` (which no flow of a group of several has
before its group is filled: a flow alone on its links is a group of its own).
"""

from __future__ import annotations

import heapq
import math
from operator import itemgetter
from typing import Any

__all__ = ["shares"]

_LINKS = itemgetter(3)  # a flow's links


def shares(
    dirty: set[int],
    new_flows: list[int],
    flows: list[list[Any]],
    link_flows: list[set[int]],
    cap: list[float],
    flow_cap: float,
    maxmin: bool,
) -> dict[int, float]:
    """The new rate of every flow whose share may have changed, in the order they were found.

    ``new_flows`` start now and are added to ``link_flows`` here; ``dirty`` (links
    whose flows changed, updated here with the links of new flows that share one)
    says where else to look. ``cap``: each link's bytes per second; ``flow_cap``:
    every flow's own limit.
    """
    rates: dict[int, float] = {}
    for f in new_flows:
        for i in flows[f][3]:
            link_flows[i].add(f)
    for f in new_flows:
        flow = flows[f]
        links = flow[3]
        for i in links:
            if len(link_flows[i]) != 1:
                dirty.update(links)
                break
        else:  # alone on every link it crosses: its slowest link's speed
            rates[f] = flow[8]
    if not dirty:
        return rates
    if not maxmin:
        for i in dirty:
            for f in link_flows[i]:
                if f not in rates:
                    share = min([cap[j] / len(link_flows[j]) for j in flows[f][3]])
                    rates[f] = min(share, flow_cap)
        return rates
    seen_links: set[int] = set()
    for i in dirty:
        if i in seen_links or not link_flows[i]:
            continue
        # The group of flows connected to link i through shared links.
        comp_links = [i]
        seen_links.add(i)
        comp_flows: list[int] = []
        seen_here: set[int] = set()
        k = 0
        if flow_cap == math.inf:  # Note [groups found by sets]
            while k < len(comp_links):
                fresh = link_flows[comp_links[k]] - seen_here
                k += 1
                if fresh:
                    seen_here |= fresh
                    comp_flows += fresh
                    reached = set().union(*map(_LINKS, map(flows.__getitem__, fresh)))
                    reached -= seen_links
                    seen_links |= reached
                    comp_links += reached
        while k < len(comp_links):
            for f in link_flows[comp_links[k]]:
                if f in seen_here:
                    continue
                seen_here.add(f)
                comp_flows.append(f)
                for j in flows[f][3]:
                    if j not in seen_links:
                        seen_links.add(j)
                        comp_links.append(j)
            k += 1
        if len(comp_flows) == 1:
            f = comp_flows[0]
            rates[f] = flows[f][8]
        else:
            _progressive_fill(comp_links, comp_flows, link_flows, cap, flows, flow_cap, rates)
    return rates


# Note [groups found by sets]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A group is found by a breadth-first search from a changed link: its flows, the
# links they cross, their flows, and so on; on a flat network with p - 1 messages
# per rank, a million flows one by one. The order in which the search meets the
# flows matters in one place only: flows that :func:`_progressive_fill` leaves
# at their own limit (``flow_cap``) get their rate in that order. Where flows have
# no limit of their own (``flow_cap`` infinite, every topology but a hand-made one
# with ``Network.set_message_cost``), every flow of a group is fixed by one of its
# links, so the order is never read, and the search takes each link's new flows
# and their links as sets (differences and unions in C) instead of one at a time.
# The links' order does not matter either: the next link to fix is the smallest
# (share, version, link), wherever it sits.


def _progressive_fill(
    links: list[int],
    members: list[int],
    link_flows: list[set[int]],
    cap: list[float],
    flows: list[list[Any]],
    flow_cap: float,
    rates: dict[int, float],
    scan: bool | None = None,
) -> None:
    """Max-min fair rates for ``members`` (all flows on ``links``), written into ``rates``.

    Repeatedly take the link whose remaining capacity per unfixed flow is the
    smallest, fix its unfixed flows at that share, and take the share off the
    other links they cross. Once that share reaches ``flow_cap`` (every flow's
    own limit), all flows still unfixed run at ``flow_cap`` (Note [exact shares]).
    ``scan``: find the smallest share by a scan of the links or (False) with a heap;
    None: whichever costs less here (Note [the smallest share]).

    Note [the smallest share]
    ~~~~~~~~~~~~~~~~~~~~~~~~~
    Every flow fixed changes the share of the other links it crosses. A heap of
    (share, version, link) keeps one entry per change and skips the stale ones:
    a push and a pop per flow fixed. Where a few links carry many flows (p - 1
    messages from and to every rank of a flat network: a million flows on 2,000
    ports), the heap grows to a million entries and its pushes and pops are most
    of the work; there the smallest share is found instead by a scan of every
    link's one current entry (``current``), which an update overwrites in place:
    as many scans as links, each over the links. Both take the same link next,
    the smallest (share, version, link) among the links still to fix, so they
    fix the same flows at the same shares in the same order.
    """
    # Per link: [remaining capacity, unfixed flows, version of its current entry].
    state: dict[int, list[Any]] = {i: [cap[i], len(link_flows[i]), 0] for i in links}
    entries: list[tuple[float, int, int]] = [(cap[i] / len(link_flows[i]), 0, i) for i in links]
    if scan is None:
        scan = len(links) * len(links) <= 16 * len(members)
    current = {e[2]: e for e in entries}  # scan: each link's current entry
    heap = entries
    if not scan:
        heapq.heapify(heap)
    pop, push = heapq.heappop, heapq.heappush
    while current if scan else heap:
        if scan:
            share, ver, i = min(current.values())
            del current[i]
        else:
            share, ver, i = pop(heap)
        here = state[i]
        if ver != here[2] or here[1] == 0:
            continue
        if share >= flow_cap:
            break
        for f in link_flows[i]:
            if f in rates:  # fixed already
                continue
            rates[f] = share
            for j in flows[f][3]:
                there = state[j]
                there[1] -= 1
                there[0] -= share
                if j != i and there[1]:
                    there[2] += 1
                    left = there[0] if there[0] > 0.0 else 0.0
                    if scan:
                        current[j] = (left / there[1], there[2], j)
                    else:
                        push(heap, (left / there[1], there[2], j))
                elif scan and not there[1]:
                    current.pop(j, None)
        here[1] = 0
    for f in members:
        if f not in rates:  # limited by its own cap before any link's share
            rates[f] = flow_cap
