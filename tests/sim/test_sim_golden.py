"""Simulated times and schedules pinned bit for bit, on cases that exercise every part.

The simulator's speed-ups (steps recorded as rows, hazards found by piece,
lists shared between ranks, max-min shares found by a scan) must change no
result: not a schedule's steps, not the last bit of a time. These values were
recorded before them; a change that moves one is a change of the model, and
must say so here. The cases cover a pipelined ring, all-to-all patterns that
contend on max-min shared ports (the scan), Bruck's packing, a torus, hosts,
a one-sided and a mixed schedule.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import pytest

from plait import sim
from plait.algos._registry import SEGMENT_BYTES, get
from plait.schedule.ir import Schedule
from plait.sim.call import WINDOW_BYTES, build_all, context_count


def network(name: str) -> sim.Network:
    link = sim.LinkParams
    if name.startswith("flat"):
        return sim.flat(int(name[4:]), 1e-6, 1 / 12.5e9, 1 / 15e9, delta=1 / 15e9)
    if name == "fat33":
        return sim.fat_tree(33, 11, link(1e-6, 1e-10), oversubscription=2)
    if name == "torus100":
        return sim.torus([10, 10], link(1e-6, 1e-10))
    assert name == "hosts3x4"
    return sim.hosts(3, 4, link(2e-7, 2e-11), link(1e-6, 1e-10), gamma=1 / 15e9)


def digest(schedules: Sequence[Schedule]) -> str:
    """Every field of every step of every rank, and the schedules' sizes, hashed."""
    h = hashlib.sha256()
    for s in schedules:
        sizes = (s.rank, s.in_count, s.out_count, s.tmp_count, s.shared_count, s.staged_count)
        h.update(repr((*sizes, s.one_sided, s.mixed, s.last_phase)).encode())
        for st in s.steps:
            h.update(
                repr((int(st.kind), st.peer, st.src, st.dst, st.first, st.tag, st.deps)).encode()
            )
    return h.hexdigest()[:16]


# (collective, algorithm, network, bytes, segment bytes or None for the default):
# (time, events, digest of every rank's finish, digest of the schedules)
CASES = {
    ("allreduce", "ring", "flat7", 64 << 20, 256 << 10): (
        0.013678425706666577,
        7777,
        "2dcf997f1df3c69d",
        "8dff750fb6bd5e3e",
    ),
    ("allreduce", "direct", "fat33", 1 << 20, None): (
        0.00028762880000000093,
        9780,
        "5c5b8d7a3b043a48",
        "4ffd35f4a1e5a9f5",
    ),
    ("alltoall", "bruck", "flat13", 1 << 20, None): (
        0.0003879225600000001,
        493,
        "90dc6a40b01990cc",
        "d04ef52d87fb34ed",
    ),
    ("allreduce", "rabenseifner", "torus100", 1 << 20, 0): (
        0.0010452501806923141,
        3935,
        "a235b0c9c7061879",
        "35912adef1a2bcaf",
    ),
    ("allgather", "bruck", "flat100", 1 << 20, None): (
        0.00011519488,
        2327,
        "0069bbe22207d3d4",
        "39d1711e44bb0a04",
    ),
    ("alltoall", "pairwise", "flat100", 1 << 20, None): (
        8.403328000000009e-05,
        72092,
        "cd28a6a439af4e1c",
        "1f36a91eb09e7e01",
    ),
    ("reduce_scatter", "ring", "hosts3x4", 12345 * 4, 4096): (
        1.3052693333333335e-05,
        816,
        "c724082dacc151b8",
        "dcc9bbf6379d3ed1",
    ),
    ("allreduce", "arena", "flat7", 1 << 20, None): (
        0.00020173066666666662,
        131,
        "7a5b3308e87cf517",
        "c69467de4c7171f3",
    ),
    ("allreduce", "cascade_arena", "hosts3x4", 1 << 20, None): (
        0.000347808237037037,
        297,
        "fc5b2dec94d1b25a",
        "ee777aa912cf628a",
    ),
    ("allreduce", "swing", "fat33", 1 << 20, None): (
        0.0007526953636574076,
        1159,
        "a610066079720688",
        "7720fb8b6731d7aa",
    ),
}


@pytest.mark.parametrize(("case", "expected"), list(CASES.items()), ids=lambda c: str(c))
def test_results_and_schedules_are_unchanged(
    case: tuple[str, str, str, int, int | None], expected: tuple[float, int, str, str]
) -> None:
    collective, algorithm, name, nbytes, segment = case
    net = network(name)
    res = sim.simulate(collective, algorithm, nbytes, net, segment_bytes=segment)
    finish = hashlib.sha256(repr([float(x) for x in res.finish]).encode()).hexdigest()[:16]
    unit = SEGMENT_BYTES if segment is None else segment
    schedules = build_all(
        collective,
        algorithm,
        net.size,
        context_count(collective, nbytes, 4, net.size),
        segment=max(1, unit // 4) if unit else 0,
        network=net,
        window=WINDOW_BYTES if get(collective, algorithm).needs_window else 0,
    )
    assert (res.time, res.events, finish, digest(schedules)) == expected
