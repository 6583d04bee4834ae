"""The launchers of a job meet in its store before they start ranks (Note [launchers meet]).

Threads play the launchers here, over one in-memory store; tests/launchers/test_node_meeting.py
runs real ``plait run`` launchers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import pytest

from plait.errors import RendezvousError
from plait.rendezvous import nodes
from plait.rendezvous.nodes import MeetingError, NodeClaim, claim_key, meet_nodes
from plait.rendezvous.store import MemoryStore, Store


@pytest.fixture(autouse=True)
def _short_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nodes, "LOOK_SECONDS", 0.05)
    monkeypatch.setattr(nodes, "GRACE_SECONDS", 2.0)


def claim(node: int, nproc: int = 2, nnodes: int = 2, pid: int = 0) -> NodeClaim:
    return NodeClaim(node, nnodes, nproc, "hostA", pid or 100 + node)


def meet_all(
    store: Store,
    claims: Sequence[NodeClaim],
    timeout: float = 10.0,
    stopped: Callable[[], bool] = lambda: False,
) -> list[bool | BaseException]:
    """Every claim's launcher meets the others at once, on a thread each; what each got."""
    out: list[bool | BaseException] = [False] * len(claims)

    def one(i: int) -> None:
        try:
            out[i] = meet_nodes(store, claims[i], timeout, stopped=stopped)
        except BaseException as exc:
            out[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(claims))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    return out


def test_launchers_that_agree_meet() -> None:
    store = MemoryStore()
    claims = [claim(k, nnodes=3) for k in (2, 0, 1)]
    assert meet_all(store, claims) == [True, True, True]
    for c in claims:
        assert NodeClaim.decode(c.node, store.get(claim_key(c.node), 0)) == c


def test_a_claim_reads_back_as_it_was_made() -> None:
    c = NodeClaim.here(1, 4, 8)
    assert NodeClaim.decode(1, c.encode()) == c
    assert c.shape == "-n 8 --nnodes 4"
    with pytest.raises(RendezvousError, match="not a plait run launcher's"):
        NodeClaim.decode(1, b"garbage")


@pytest.mark.parametrize("order", ["node0-first", "node1-first"])
def test_launchers_given_different_nproc_all_fail_naming_them(order: str) -> None:
    store = MemoryStore()
    claims = [claim(0, nproc=2), claim(1, nproc=3)]
    if order == "node1-first":
        claims.reverse()
    got = meet_all(store, claims)
    why = (
        "node 0 (hostA pid 100) was given -n 2 --nnodes 2, but node 1 (hostA pid 101) -n 3 "
        "--nnodes 2; every launcher of one job must be given the same -n (ranks per host) and "
        "--nnodes: expected -n 2 --nnodes 2 on every node, as on node 0"
    )
    for c, res in zip(claims, got, strict=True):
        assert isinstance(res, MeetingError), got
        assert str(res) == f"node {c.node} ({c.launcher}) cannot start its ranks: " + (
            f"the launchers disagree on the job's shape: {why}"
        )


def test_launchers_given_different_nnodes_fail() -> None:
    got = meet_all(MemoryStore(), [claim(0), claim(1, nnodes=3)])
    for res in got:
        assert isinstance(res, MeetingError), got
        assert "node 1 (hostA pid 101) -n 2 --nnodes 3" in str(res)


def test_a_second_launcher_of_a_node_fails_and_so_do_those_that_wait() -> None:
    # Node 2 never comes: without the notice, the others would wait out their timeout.
    store = MemoryStore()
    first, second = claim(1, nnodes=3, pid=7), claim(1, nnodes=3, pid=8)
    got: list[BaseException | bool] = []
    start = time.monotonic()
    waiting = threading.Thread(
        target=lambda: got.extend(meet_all(store, [claim(0, nnodes=3), first], timeout=60))
    )
    waiting.start()
    store.wait([claim_key(0), claim_key(1)], 10)
    pair = "node rank 1 was given to two launchers: hostA pid 7 claimed it first, and hostA pid 8"
    with pytest.raises(MeetingError, match=pair) as info:
        meet_nodes(store, second, 60)
    assert str(info.value).startswith("node 1 (hostA pid 8) cannot start its ranks: ")
    assert "give each of the job's 3 launchers its own --node-rank in 0..2" in str(info.value)
    waiting.join(10)
    assert time.monotonic() - start < 10
    for res in got:
        assert isinstance(res, MeetingError), got
        assert pair in str(res)
    # The second wrote nothing of its own: node 1's claim is the first's.
    assert NodeClaim.decode(1, store.get(claim_key(1), 0)) == first


def test_a_late_second_launcher_of_a_node_fails_alone() -> None:
    store = MemoryStore()
    assert meet_all(store, [claim(0), claim(1, pid=7)]) == [True, True]
    with pytest.raises(MeetingError, match="hostA pid 7 claimed it first, and hostA pid 9"):
        meet_nodes(store, claim(1, pid=9), 1)


def test_nodes_that_never_come_are_named_and_the_others_stop_waiting() -> None:
    store = MemoryStore()
    start = time.monotonic()
    node0, node1 = claim(0, nnodes=3), claim(1, nnodes=3)
    got: list[BaseException | bool] = []
    waiter = threading.Thread(target=lambda: got.extend(meet_all(store, [node1], timeout=60)))
    waiter.start()
    with pytest.raises(MeetingError, match=r"node\(s\) \[2\] did not join within 0.5 s"):
        meet_nodes(store, node0, 0.5)
    # Node 0 serves the store: it ends only once node 1 has read why.
    assert store.check(["plait/nodes/1/done"])
    waiter.join(10)
    assert isinstance(got[0], MeetingError), got
    assert "node(s) [2] did not join" in str(got[0])
    assert time.monotonic() - start < 10


def test_a_stopped_launcher_says_so_to_the_others() -> None:
    store = MemoryStore()
    assert meet_all(store, [claim(1, nnodes=3)], stopped=lambda: True) == [False]
    with pytest.raises(MeetingError, match=r"node 1's launcher \(hostA pid 101\) was stopped"):
        meet_nodes(store, claim(0, nnodes=3), 10)


def test_once_node_0_has_met_everyone_a_later_notice_fails_its_filer_alone() -> None:
    # Node 1 waits; between two of its slices node 0 comes and finds the job whole, and then
    # a second launcher of node 1 files its notice: node 1 starts its ranks as node 0 does.
    store = MemoryStore()
    late: list[BaseException] = []

    def meanwhile() -> bool:
        if not late:
            assert meet_nodes(store, claim(0), 10)
            with pytest.raises(MeetingError) as info:
                meet_nodes(store, claim(1, pid=9), 10)
            late.append(info.value)
        return False

    assert meet_nodes(store, claim(1), 10, stopped=meanwhile)
    assert "hostA pid 101 claimed it first, and hostA pid 9 is a second" in str(late[0])
