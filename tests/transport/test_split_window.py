"""A split's group gets a window of its own: its memory, counters and digests, set up by messages.

Ranks are threads, over the memory transport and the shared-memory transport; the real
processes (kill -9, the collectives through a communicator) are in
``tests/multiprocess/test_split_windows.py``.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from functools import partial
from typing import Any

import numpy as np
import pytest
from shm_helpers import (  # noqa: F401 - no_leftovers: autouse fixture
    PollWatch,
    Stranger,
    in_threads,
    no_leftovers,
)

import plait
from plait.errors import (
    AbortedError,
    ClosedError,
    CommError,
    MismatchError,
    PeerLostError,
    RendezvousError,
    TransportError,
)
from plait.group import GroupTransport, p2p_pattern, probe_tag, setup_tag
from plait.rendezvous.store import MemoryStore
from plait.testing import run_ranks
from plait.transport.endpoint import Endpoint
from plait.transport.memory import MemoryFabric
from plait.transport.shm import ShmTransport, bootstrap, segment
from plait.transport.shm.link import ShmLink
from plait.transport.window import GROUP_WINDOW_BYTES, Window, exchange

pytestmark = [
    pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm (Linux)"),
    pytest.mark.timeout(60),
]

KINDS = ["memory", "shm"]
WINDOW = 64 << 10
#: Communicator ids of the groups made here, one per group, as ``Communicator.split`` gives;
#: above the fixed ids (1-12) that single tests give their groups, so that a group of
#: :func:`groups` never meets the messages a failed set-up of a test left unread.
_IDS = itertools.count(100)


@contextlib.contextmanager
def world(kind: str, size: int, window: int = WINDOW) -> Iterator[list[Endpoint]]:
    """``size`` endpoints of one transport with windows of ``window`` bytes per half."""
    ts: list[Endpoint]
    if kind == "memory":
        ts = list(MemoryFabric(size, window=window).endpoints)
    else:
        store = MemoryStore(timeout=20)
        ts = in_threads(
            [
                partial(
                    ShmTransport,
                    r,
                    size,
                    store,
                    timeout=20,
                    slot_bytes=4096,
                    slots=2,
                    window_bytes=window,
                )
                for r in range(size)
            ]
        )
    try:
        yield ts
    finally:
        for t in ts:
            t.close()


def groups(parents: Sequence[Any], members: Sequence[Sequence[int]], **kw: Any) -> list[Any]:
    """Every member's GroupTransport, built at once on a thread each; indexed like ``parents``.

    ``members``: the groups, each a list of parent ranks in group order.
    """
    where = {p: (ranks, ranks.index(p)) for ranks in members for p in ranks}
    ids = {tuple(ranks): next(_IDS) for ranks in members}
    order = sorted(where)
    made = in_threads(
        [
            partial(
                GroupTransport,
                parents[p],
                where[p][0],
                where[p][1],
                comm_id=ids[tuple(where[p][0])],
                **kw,
            )
            for p in order
        ]
    )
    out: list[Any] = [None] * len(parents)
    for p, g in zip(order, made, strict=True):
        out[p] = g
    return out


def win(t: Any) -> Window:
    assert t.window is not None
    return t.window  # type: ignore[no-any-return]


def soon(seconds: float = 20.0) -> float:
    return time.monotonic() + seconds


def rounds(w: Window, start: int, n: int, seed: int) -> list[int]:
    """``n`` calls from epoch ``start``: write, post, read every peer; the sums read."""
    sums = []
    for epoch in range(start, start + n):
        half = w.begin(epoch, 1000 + epoch, soon())
        w.local(half)[:8] = (seed + epoch) & 0xFF
        w.post((epoch << 32) | 1)
        total = 0
        for q in range(w.size):
            if q != w.rank:
                assert w.wait(q, (epoch << 32) | 1, soon())
                assert w.digest(q, half) == 1000 + epoch
                total += int(w.peer(q, half)[0])
        w.end(epoch)
        sums.append(total)
    return sums


# -- the tag ---------------------------------------------------------------------------------------


def test_the_setup_tag_is_nobody_elses() -> None:
    """No user tag, probe or ANY_TAG pattern of any communicator takes a setup message."""
    ids = (1, 2, 77, (1 << 18) - 1)
    tags = {setup_tag(i) for i in ids}
    assert len(tags) == len(ids)  # one per group: two groups of the same ranks never share one
    assert all(0 < t < 1 << 63 for t in tags)
    for comm_id in (0, *ids):
        for tag in tags:
            want, mask = p2p_pattern(comm_id, None)
            assert tag & mask != want & mask
            assert tag != probe_tag(comm_id)
            assert tag != p2p_pattern(comm_id, (1 << 31) - 1)[0]


# -- windows of their own --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_groups_get_windows_of_their_own(kind: str) -> None:
    with world(kind, 4) as ts:
        gs = groups(ts, [[0, 2], [3, 1]])
        try:
            for r, g in enumerate(gs):
                w, parent = win(g), win(ts[r])
                assert (w.rank, w.size, w.capacity) == (g.rank, 2, parent.capacity)
                assert not np.shares_memory(w.local(0), parent.local(0))
                assert not np.shares_memory(w.local(1), parent.local(1))
                assert [w.counter(q) for q in range(2)] == [0, 0]

            def body(r: int) -> tuple[list[int], int]:
                # The parent's calls and the group's interleave, each with its own epochs.
                mine = rounds(win(gs[r]), 0, 3, r) + rounds(win(ts[r]), 0, 3, 10 * r)
                mine += rounds(win(gs[r]), 3, 3, r)
                return mine, win(gs[r]).counter(gs[r].rank)

            results = in_threads([partial(body, r) for r in range(4)])
            partner = {0: 2, 2: 0, 1: 3, 3: 1}
            for r, (sums, counter) in enumerate(results):
                world_sums = [
                    sum(10 * q + e for q in range(4) if q != r) & 0xFFFF for e in range(3)
                ]
                assert sums[:3] == [(partner[r] + e) & 0xFF for e in range(3)]
                assert sums[3:6] == world_sums
                assert sums[6:] == [(partner[r] + e) & 0xFF for e in range(3, 6)]
                assert counter == 6 << 32  # six calls of the group's; the parent's are apart
        finally:
            for g in gs:
                g.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_split_of_a_split(kind: str) -> None:
    with world(kind, 4) as ts:
        outer = groups(ts, [[3, 0, 2]])  # parent ranks 3, 0, 2 are group ranks 0, 1, 2
        by_rank = [outer[3], outer[0], outer[2]]
        inner = groups(by_rank, [[2, 0]])  # group ranks 2, 0: parent ranks 2 and 3
        assert inner[1] is None
        assert (inner[2].rank, inner[0].rank) == (0, 1)
        assert inner[2].window.capacity == WINDOW
        sums = in_threads([partial(rounds, win(inner[q]), 0, 4, 10 * q) for q in (2, 0)])
        assert sums == [[e & 0xFF for e in range(4)], [(20 + e) & 0xFF for e in range(4)]]
        for g in [*inner, *outer]:
            if g is not None:
                g.close()


@pytest.mark.parametrize("kind", KINDS)
def test_no_window_for_one_rank_or_without_the_parents(kind: str, own_segments: list[str]) -> None:
    with world(kind, 2) as ts:
        made = len(own_segments)
        alone = groups(ts, [[0], [1]])
        assert [g.window for g in alone] == [None, None]
        assert len(own_segments) == made  # nothing reserved for a group of one
    fabric = MemoryFabric(2, window=0)
    assert [g.window for g in groups(fabric.endpoints, [[0, 1]])] == [None, None]


def test_no_room_for_one_rank_means_no_window_on_any(
    monkeypatch: pytest.MonkeyPatch, own_segments: list[str]
) -> None:
    """/dev/shm full on one rank: the group goes without a window, on every rank alike."""
    with world("shm", 3) as ts:
        create = segment.create

        def full(path: str, nbytes: int, me: int, job: str, **kw: Any) -> segment.Segment:
            if "-split-1-" in path:
                raise TransportError(f"rank {me}: /dev/shm is full (a test)")
            return create(path, nbytes, me, job, **kw)

        monkeypatch.setattr(segment, "create", full)
        gs = groups(ts, [[0, 1, 2]])
        assert [g.window for g in gs] == [None, None, None]
        assert [p for p in own_segments if "-split-" in p] != []  # ranks 0 and 2 made theirs
        monkeypatch.setattr(segment, "create", create)
        again = groups(ts, [[0, 1, 2]])  # the parent is fine, and so is the next group
        assert all(g.window is not None for g in again)
        for g in again:
            g.close()


def test_a_group_window_reserves_memory_at_its_first_larger_call_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A group's window has its parent's capacity, but only GROUP_WINDOW_BYTES per half of
    memory until a call needs more (Note [split windows]): then it grows, once."""
    big = 4 * GROUP_WINDOW_BYTES
    with world("shm", 2, window=big) as ts:
        gs = groups(ts, [[0, 1]])
        ws = [win(g) for g in gs]
        assert [w.capacity for w in ws] == [big, big]

        def backed(w: Any) -> int:  # bytes of this rank's segment that hold memory now
            seg = w._mine[0]
            return os.fstat(seg.fd).st_blocks * 512  # type: ignore[no-any-return]

        first = backed(ws[0])
        assert 2 * GROUP_WINDOW_BYTES <= first < 2 * GROUP_WINDOW_BYTES + (64 << 10)
        grown: list[tuple[int, int]] = []
        reserve = segment.Segment.reserve

        def counted(seg: segment.Segment, offset: int, length: int, me: int) -> None:
            grown.append((offset, length))
            reserve(seg, offset, length, me)

        monkeypatch.setattr(segment.Segment, "reserve", counted)
        ws[0].reserve(GROUP_WINDOW_BYTES)  # within what it has: nothing to do
        assert grown == []
        ws[0].reserve(GROUP_WINDOW_BYTES + 1)  # more: both halves, at least twice as much
        assert [n for _, n in grown] == [2 * GROUP_WINDOW_BYTES] * 2
        assert backed(ws[0]) >= first + 2 * GROUP_WINDOW_BYTES
        ws[0].reserve(2 * GROUP_WINDOW_BYTES)
        assert len(grown) == 2
        ws[0].reserve(big)
        ws[1].reserve(big)
        assert len(grown) == 4 + 2
        ws[0].reserve(big)
        assert len(grown) == 6
        # The whole capacity now carries data both ways, to its last byte.
        for epoch in range(2):
            for r, w in enumerate(ws):
                half = w.begin(epoch, 7, soon())
                w.local(half)[-GROUP_WINDOW_BYTES:] = 10 * epoch + r + 1
                w.post((epoch << 32) | 1)
            for r, w in enumerate(ws):
                assert w.wait(1 - r, (epoch << 32) | 1, soon())
                tail = w.peer(1 - r, epoch & 1)[-GROUP_WINDOW_BYTES:]
                assert (tail == 10 * epoch + (1 - r) + 1).all()
            for w in ws:
                w.end(epoch)
        for g in gs:
            g.close()
        with pytest.raises(ClosedError):
            ws[0].reserve(big + 1)


def test_a_group_dropped_without_close_leaves_no_open_file() -> None:
    """The file a group's segment keeps open to grow its window is closed when the group's
    window is collected, as its mapping is: no descriptor or memory is held for good."""

    def open_segments() -> list[str]:  # the group segments' files this process holds
        held = []
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                held.append(os.readlink(f"/proc/self/fd/{fd}"))
        return [name for name in held if f"plait-{job}-split-" in name]

    with world("shm", 2, window=4 * GROUP_WINDOW_BYTES) as ts:
        job = ts[0].job
        gs = groups(ts, [[0, 1]])
        assert open_segments() != []  # the mappings', and each rank's own file
        for _ in range(5):
            del gs
            gc.collect()
            assert open_segments() == []
            gs = groups(ts, [[0, 1]])
        for g in gs:
            g.close()
        assert open_segments() == []


def test_a_group_window_with_no_room_to_grow_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    with world("shm", 2, window=4 * GROUP_WINDOW_BYTES) as ts:
        gs = groups(ts, [[0, 1]])

        def full(fd: int, offset: int, length: int) -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(os, "posix_fallocate", full)
        with pytest.raises(
            TransportError, match=r"rank 0: the OS has no room to reserve .*free shared memory"
        ):
            win(gs[0]).reserve(GROUP_WINDOW_BYTES + 1)
        monkeypatch.undo()
        win(gs[0]).reserve(GROUP_WINDOW_BYTES + 1)  # room again: it grows now
        assert win(gs[0])._reserved == 2 * GROUP_WINDOW_BYTES  # type: ignore[attr-defined]
        for g in gs:
            g.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_rank_that_never_comes_is_named(kind: str) -> None:
    with world(kind, 3) as ts:
        start = time.monotonic()
        with pytest.raises(RendezvousError, match=r"ranks \[2\] of the group did not take part"):
            in_threads(
                [
                    partial(GroupTransport, ts[r], [0, 1, 2], r, comm_id=1, timeout=0.3)
                    for r in (0, 1)
                ]
            )
        assert time.monotonic() - start < 10


def test_a_rank_that_dies_before_it_connects_is_lost_not_waited_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 2 announces a segment and then never connects; the others see it die."""
    with world("shm", 3) as ts:
        ranks = [0, 1, 2]
        dead = threading.Event()
        real_alive = ShmLink.alive
        monkeypatch.setattr(
            ShmLink, "alive", lambda s, r: not (r == 2 and dead.is_set()) and real_alive(s, r)
        )

        def member(r: int) -> Any:
            return GroupTransport(ts[r], ranks, r, comm_id=1, timeout=20)

        def ghost() -> None:
            # Rank 2's announcement (a segment that nobody will ever hand over), then death.
            exchange(_AsRank(ts[2], ranks, 2), b"0123456789abcdef:8192", setup_tag(1), soon())
            dead.set()

        start = time.monotonic()
        lost = r"rank 2 was lost \(its process ended or its transport closed\) while setting up"
        with pytest.raises(PeerLostError, match=lost):
            in_threads([partial(member, 0), partial(member, 1), ghost])
        assert time.monotonic() - start < 10


class _AsRank:
    """A group's view of ``parent`` for :func:`exchange` alone (no window is set up)."""

    def __init__(self, parent: Endpoint, ranks: Sequence[int], rank: int) -> None:
        self.parent, self.ranks, self.rank, self.size = parent, list(ranks), rank, len(ranks)

    def isend(self, peer: int, tag: int, data: memoryview, check: int) -> Any:
        return self.parent.isend(self.ranks[peer], tag, data, check)

    def irecv(self, peer: int, tag: int, into: memoryview, check: int) -> Any:
        return self.parent.irecv(self.ranks[peer], tag, into, check)

    def wait_any(self, handles: Sequence[Any], timeout: float | None) -> bool:
        return self.parent.wait_any(handles, timeout)

    def cancel(self, handle: Any) -> None:
        self.parent.cancel(handle)

    def close(self) -> None:
        pass


def outcomes(fns: Sequence[Any]) -> list[Any]:
    """Each function's result or the exception it raised, run at once on a thread each."""

    def catching(fn: Any) -> Any:
        try:
            return fn()
        except Exception as exc:
            return exc

    return in_threads([partial(catching, fn) for fn in fns])


def close_all(*made: Any) -> None:
    for g in made:
        if g is not None and not isinstance(g, BaseException):
            g.close()


class _Spy:
    """``parent`` for a GroupTransport, setting ``sent`` once the group's first send is out."""

    def __init__(self, parent: Endpoint) -> None:
        self._parent = parent
        self.sent = threading.Event()

    def isend(self, peer: int, tag: int, data: memoryview, check: int) -> Any:
        h = self._parent.isend(peer, tag, data, check)
        self.sent.set()
        return h

    def __getattr__(self, name: str) -> Any:
        return getattr(self._parent, name)


def wired(a: Window, b: Window) -> bool:
    """Whether ``b`` reads what ``a`` writes (``a`` is its group's rank 0, ``b`` rank 1)."""
    mark = np.frombuffer(os.urandom(8), np.uint8)
    a.local(0)[:8] = mark
    return bool(np.array_equal(b.peer(0, 0)[:8], mark))


@pytest.mark.parametrize("kind", KINDS)
def test_two_groups_of_the_same_ranks_at_once_are_not_cross_wired(kind: str) -> None:
    """Groups A and B of parent ranks 0 and 1, set up at once by two threads on each rank.

    Rank 1 starts B and rank 0 starts A first, each sending its announcement before the
    other group begins, so that A's rank 0 would take B's rank 1's if the two shared a tag.
    """
    with world(kind, 2) as ts:
        b1_spy, a0_spy = _Spy(ts[1]), _Spy(ts[0])

        def a0() -> Any:
            assert b1_spy.sent.wait(10)
            return GroupTransport(a0_spy, [0, 1], 0, comm_id=11, timeout=20)

        def b0() -> Any:
            assert a0_spy.sent.wait(10)
            return GroupTransport(ts[0], [0, 1], 0, comm_id=12, timeout=20)

        def a1() -> Any:
            assert a0_spy.sent.wait(10)
            return GroupTransport(ts[1], [0, 1], 1, comm_id=11, timeout=20)

        made = outcomes(
            [a0, b0, a1, partial(GroupTransport, b1_spy, [0, 1], 1, comm_id=12, timeout=20)]
        )
        try:
            assert not any(isinstance(g, BaseException) for g in made), made
            ga0, gb0, ga1, gb1 = made
            assert wired(win(ga0), win(ga1))
            assert wired(win(gb0), win(gb1))
        finally:
            close_all(*made)


def test_a_connection_meant_for_another_split_is_refused() -> None:
    """Two set-ups of ranks 0 and 1 whose announcements cross: none of them wires up."""
    with world("shm", 2) as ts:
        posted: dict[tuple[str, int], bytes] = {}
        met = threading.Barrier(4)
        cross = {("A", 0): ("B", 1), ("B", 0): ("A", 1), ("A", 1): ("B", 0), ("B", 1): ("A", 0)}

        def setup(which: str, rank: int) -> Any:
            def announce(mine: bytes) -> list[bytes]:
                posted[which, rank] = mine
                met.wait(10)
                other = posted[cross[which, rank]]
                return [mine, other] if rank == 0 else [other, mine]

            return bootstrap.join_window(
                rank,
                2,
                names=[0, 1],
                job=ts[0].job,
                window=WINDOW,
                reserved=WINDOW,
                announce=announce,
                timeout=3,
                nonce=1 if which == "A" else 2,
            )

        start = time.monotonic()
        made = outcomes([partial(setup, w, r) for w in "AB" for r in (0, 1)])
        for joined in made:
            if not isinstance(joined, BaseException):
                joined.seg.release()
                for w in joined.wires:
                    w.release()
        assert all(isinstance(e, CommError) for e in made), made
        assert any("another" in str(e) for e in made), made
        assert time.monotonic() - start < 10


def test_a_failed_split_leaves_nothing_that_breaks_the_next() -> None:
    """Ranks 1 and 2 give up on a group before rank 0 comes; the next group is fine."""
    with world("shm", 3) as ts:
        with pytest.raises(RendezvousError):
            in_threads(
                [
                    partial(GroupTransport, ts[r], [0, 1, 2], r, comm_id=5, timeout=0.3)
                    for r in (1, 2)
                ]
            )
        # Rank 0 comes late, takes the others' announcements, and fails (they are gone);
        # its own stay unread with ranks 1 and 2, where the next group must not take them.
        late = outcomes([partial(GroupTransport, ts[0], [0, 1, 2], 0, comm_id=5, timeout=0.5)])
        assert isinstance(late[0], CommError), late
        gs = groups(ts, [[0, 1, 2]], timeout=20)
        try:
            sums = in_threads([partial(rounds, win(g), 0, 2, 10 * r) for r, g in enumerate(gs)])
            assert sums[0] == [(10 + 20 + 2 * e) & 0xFF for e in range(2)]
        finally:
            close_all(*gs)


def _failing_listener(rank: int) -> Any:
    listen = bootstrap.listen

    def failing(name: str, backlog: int) -> Any:
        if f"-split-{rank}-" in name:
            raise OSError(24, "Too many open files (a test)")
        return listen(name, backlog)

    return failing


@pytest.mark.parametrize("junk", [b"", b"\x01\x02"])
def test_a_connection_that_hangs_up_before_its_hello_is_ignored(
    monkeypatch: pytest.MonkeyPatch, junk: bytes
) -> None:
    """A process of this user connects to rank 0's socket and hangs up (after ``junk``)
    before a whole hello: rank 0 drops it and the group forms as if it had never come."""
    listen = bootstrap.listen

    def listen_and_knock(name: str, backlog: int) -> Any:
        listener = listen(name, backlog)
        if "-split-0-" in name:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as knock:
                knock.connect(f"\0{name}")
                knock.sendall(junk)
        return listener

    with world("shm", 3) as ts:
        monkeypatch.setattr(bootstrap, "listen", listen_and_knock)
        gs = groups(ts, [[0, 1, 2]], timeout=20)
        try:
            assert all(g.window is not None for g in gs)
        finally:
            close_all(*gs)


@pytest.mark.parametrize("junk", [b"", b"\x01\x00\x00\x00\x00\x00\x00\x00plait"])
@pytest.mark.parametrize("where", ["another process", "this process"])
def test_a_connection_that_says_nothing_holds_up_no_split(
    monkeypatch: pytest.MonkeyPatch, where: str, junk: bytes
) -> None:
    """A process of this user connects to rank 0's socket ahead of the group's ranks and
    falls silent (after ``junk``): rank 0 waited on it alone, under the whole deadline,
    and the split failed after its timeout ("rank 0 was silent") instead of forming."""
    listen = bootstrap.listen
    stranger = Stranger(where, junk)

    def listen_and_knock(name: str, backlog: int) -> Any:
        listener = listen(name, backlog)
        if "-split-0-" in name:
            stranger.connect(name)  # queued ahead of the other ranks' connections
        return listener

    try:
        with world("shm", 3) as ts:
            monkeypatch.setattr(bootstrap, "listen", listen_and_knock)
            start = time.monotonic()
            gs = groups(ts, [[0, 1, 2]], timeout=30)
            took = time.monotonic() - start
            try:
                assert all(g.window is not None for g in gs)
                sums = in_threads([partial(rounds, win(g), 0, 2, 10 * r) for r, g in enumerate(gs)])
                assert sums[0] == [(10 + 20 + 2 * e) & 0xFF for e in range(2)]
            finally:
                close_all(*gs)
            assert took < 15  # not the timeout's 30 s
            assert stranger.dropped()
    finally:
        stranger.close()


def test_a_rank_that_fails_before_announcing_leaves_every_rank_without_a_window_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with world("shm", 3) as ts:
        monkeypatch.setattr(bootstrap, "listen", _failing_listener(1))
        start = time.monotonic()
        gs = groups(ts, [[0, 1, 2]], timeout=20)
        assert time.monotonic() - start < 5
        assert [g.window for g in gs] == [None, None, None]
        # The group still works, through messages.
        out = [bytearray(3) for _ in gs]

        def ring(r: int) -> None:
            hs = [
                gs[r].irecv((r + 1) % 3, 7, memoryview(out[r]), 0),
                gs[r].isend((r + 2) % 3, 7, memoryview(bytes([r] * 3)), 0),
            ]
            deadline = soon()
            while not all(h.done for h in hs) and time.monotonic() < deadline:
                gs[r].wait_any([h for h in hs if not h.done], 1.0)
            assert all(h.done and h.error is None for h in hs)

        in_threads([partial(ring, r) for r in range(3)])
        assert [bytes(b) for b in out] == [bytes([(r + 1) % 3] * 3) for r in range(3)]
        monkeypatch.undo()
        again = groups(ts, [[0, 1, 2]], timeout=20)
        assert all(g.window is not None for g in again)
        close_all(*gs, *again)


def test_a_rank_that_fails_after_announcing_fails_the_others_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 2 cannot connect to rank 0: rank 1, waiting for rank 2 to connect, hears it."""
    connect = bootstrap._Join._connect

    def failing(self: Any, p: Any, hello: bytes, timeout: float) -> None:
        if "-split" in self.name and self.me == 2 and p.rank == 0:
            raise TransportError("rank 2: cannot connect (a test)")
        connect(self, p, hello, timeout)

    with world("shm", 3) as ts:
        monkeypatch.setattr(bootstrap._Join, "_connect", failing)
        start = time.monotonic()
        made = outcomes(
            [partial(GroupTransport, ts[r], [0, 1, 2], r, comm_id=3, timeout=20) for r in range(3)]
        )
        assert time.monotonic() - start < 5
        close_all(*made)
        assert all(isinstance(e, CommError) for e in made), made
        assert "cannot connect (a test)" in str(made[2])
        # Ranks 0 and 1 hear it from rank 2, or one of them from the other, which passes
        # it on; at least one names rank 2's error (the other may see only a hang-up).
        assert any("rank 2 broke off" in str(e) for e in made[:2]), made
        assert any("cannot connect (a test)" in str(e) for e in made[:2]), made


def _ghost(
    parent: Endpoint, ranks: list[int], rank: int, comm_id: int, done: threading.Event
) -> None:
    """Rank ``rank`` of a group announces a segment that it never hands over."""
    try:
        exchange(_AsRank(parent, ranks, rank), b"0123456789abcdef:8192", setup_tag(comm_id), soon())
    finally:
        done.set()


@pytest.mark.parametrize("how", ["abort", "close"])
def test_closing_the_parent_during_setup_fails_every_rank_at_once(how: str) -> None:
    """Rank 0's transport closes while its group waits for rank 2 to connect."""
    with world("shm", 3) as ts:
        announced = threading.Event()

        def closer() -> None:
            assert announced.wait(10)
            if how == "abort":
                ts[0].abort(lambda: AbortedError("rank 0: the communicator was aborted (a test)"))
            else:
                ts[0].close()

        start = time.monotonic()
        made = outcomes(
            [
                partial(GroupTransport, ts[0], [0, 1, 2], 0, comm_id=4, timeout=20),
                partial(GroupTransport, ts[1], [0, 1, 2], 1, comm_id=4, timeout=20),
                partial(_ghost, ts[2], [0, 1, 2], 2, 4, announced),
                closer,
            ]
        )
        assert time.monotonic() - start < 5
        close_all(*made[:2])
        expected = AbortedError if how == "abort" else ClosedError
        assert isinstance(made[0], expected), made
        assert isinstance(made[1], CommError), made


def test_a_member_whose_transport_closes_during_setup_is_lost_at_once() -> None:
    """Rank 2 announces, then its transport closes before it connects: the others see it."""
    with world("shm", 3) as ts:
        announced = threading.Event()

        def closer() -> None:
            assert announced.wait(10)
            ts[2].close()

        start = time.monotonic()
        made = outcomes(
            [
                partial(GroupTransport, ts[0], [0, 1, 2], 0, comm_id=6, timeout=20),
                partial(GroupTransport, ts[1], [0, 1, 2], 1, comm_id=6, timeout=20),
                partial(_ghost, ts[2], [0, 1, 2], 2, 6, announced),
                closer,
            ]
        )
        assert time.monotonic() - start < 5
        close_all(*made[:2])
        for e in made[:2]:
            assert isinstance(e, PeerLostError), made
            assert "rank 2" in str(e), made


def test_a_lower_rank_that_gives_up_between_connect_and_hello_is_explained(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 1's connection to rank 0 is made, then rank 0 gives up (rank 2 is lost) before
    rank 1 says its hello: rank 1's write finds the connection broken, and it raises what
    rank 0 raised (rank 2 lost), not a bare "Broken pipe"."""
    mine = threading.local()
    told, connected, first_done = threading.Event(), threading.Event(), threading.Event()
    credentials, connect, close_listener = (
        bootstrap.peer_credentials,
        bootstrap._Join._connect,
        bootstrap._Join._close_listener,
    )

    def late_close(self: Any) -> None:
        if self.me == 0 and self.listener is not None:
            # Rank 0 gives up and has told whom it could; rank 1 connects only now.
            told.set()
            assert connected.wait(10)
        close_listener(self)

    def late_connect(self: Any, p: Any, hello: bytes, timeout: float) -> None:
        assert told.wait(10)
        connect(self, p, hello, timeout)

    def late_credentials(sock: Any) -> Any:
        got = credentials(sock)
        if getattr(mine, "rank", None) == 1:  # rank 1's only call: its connect to rank 0
            connected.set()
            assert first_done.wait(10)  # rank 0's listener, and the connection, are gone
        return got

    def rank(ts: list[Endpoint], r: int) -> Any:
        mine.rank = r
        try:
            return GroupTransport(ts[r], [0, 1, 2], r, comm_id=9, timeout=20)
        finally:
            if r == 0:
                first_done.set()

    with world("shm", 3) as ts:
        monkeypatch.setattr(bootstrap, "peer_credentials", late_credentials)
        monkeypatch.setattr(bootstrap._Join, "_connect", late_connect)
        monkeypatch.setattr(bootstrap._Join, "_close_listener", late_close)
        announced = threading.Event()

        def closer() -> None:
            assert announced.wait(10)
            ts[2].close()

        made = outcomes(
            [
                partial(rank, ts, 0),
                partial(rank, ts, 1),
                partial(_ghost, ts[2], [0, 1, 2], 2, 9, announced),
                closer,
            ]
        )
        close_all(*made[:2])
        for e in made[:2]:
            assert isinstance(e, PeerLostError), made
            assert "rank 2" in str(e), made


def test_a_peer_that_finished_and_closed_is_not_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 has done its part and closes before rank 1 reads its last word: no error.

    Rank 1 has sent its own "mapped" word, so rank 0 may finish the set-up and close its
    transport (a job that ends after ``split_by_host``) while rank 1 has yet to read rank 0's;
    what rank 0 wrote is still there to read.
    """
    closed = threading.Event()
    original = bootstrap._Join._await
    awaits = [0]

    def late_await(self: Any, p: Any) -> Any:
        if self.me == 1 and p.rank == 0 and self.nonce:  # the split's, not the world's
            awaits[0] += 1
            if awaits[0] == 2:  # the first is rank 0's segment; the second its last word
                assert closed.wait(10)
        return original(self, p)

    with world("shm", 2) as ts:
        monkeypatch.setattr(bootstrap._Join, "_await", late_await)

        def first() -> Any:
            g = GroupTransport(ts[0], [0, 1], 0, comm_id=8, timeout=20)
            g.close()
            ts[0].close()
            closed.set()
            return g

        made = outcomes([first, partial(GroupTransport, ts[1], [0, 1], 1, comm_id=8, timeout=20)])
        assert not any(isinstance(g, BaseException) for g in made), made
        assert made[1].window is not None
        close_all(*made)


# -- waiting, losing peers, closing ---------------------------------------------------------------


def test_a_sleeping_group_waiter_is_woken_by_a_post_on_the_parents_doorbell() -> None:
    with world("shm", 3) as ts:
        gs = groups(ts, [[2, 0]])
        watch = PollWatch(ts[0])
        posted = [0.0]

        def waiter() -> float:
            assert win(gs[0]).wait(0, 1, None)  # group rank 0 is parent rank 2
            return time.monotonic()

        def poster() -> None:
            assert watch.asleep.wait(10)  # parent rank 0 sleeps in poll(), past its spin
            posted[0] = time.monotonic()
            win(gs[2]).post(1)

        woke, _ = in_threads([waiter, poster])
        assert woke - posted[0] < 0.5  # the doorbell, not the 1 s check of peers
        for g in gs:
            if g is not None:
                g.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_member_whose_transport_closes_fails_the_groups_waiters(kind: str) -> None:
    with world(kind, 3) as ts:
        gs = groups(ts, [[0, 1, 2]])
        win(gs[1]).post(1)
        watch = PollWatch(ts[0]) if kind == "shm" else None

        def waiter() -> None:
            w = win(gs[0])
            assert w.wait(1, 1, soon())
            with pytest.raises(PeerLostError, match="rank 1 has closed"):
                w.wait(1, 2, soon())

        def closer() -> None:
            if watch is not None:
                assert watch.asleep.wait(10)
            ts[1].close()

        in_threads([waiter, closer])


def test_a_member_whose_transport_closes_fails_the_watches_on_the_groups_window() -> None:
    """A watch of a split's window (what a mixed schedule waits on among its messages) ends
    with PeerLostError when the member it waits for closes its transport, in a group of a
    group too, where window ranks are neither the parent's nor the world's."""
    with world("memory", 4) as ts:
        gs = groups(ts, [[3, 1, 2]])  # group ranks 0, 1, 2 are parent ranks 3, 1, 2
        inner = groups(gs, [[2, 1]])  # group ranks 2 and 1 (parent ranks 2 and 1), in that order
        outer_watch = win(gs[3]).watch(1, 1)  # group rank 0 waits for group rank 1
        inner_watch = win(inner[2]).watch(1, 1)  # inner rank 0 waits for inner rank 1
        assert outer_watch is not None
        assert inner_watch is not None
        assert not outer_watch.done
        assert not inner_watch.done
        ts[1].close()
        for handle in (outer_watch, inner_watch):
            assert handle.done
            assert isinstance(handle.error, PeerLostError), handle.error
        close_all(*inner, *gs)


@pytest.mark.parametrize("kind", KINDS)
def test_closing_the_group_or_the_parent_releases_the_window(kind: str) -> None:
    error = ClosedError  # this rank's own close, on either transport
    with world(kind, 2) as ts:
        gs = groups(ts, [[0, 1]])
        gs[0].close()
        gs[0].close()  # idempotent
        with pytest.raises(error):
            win(gs[0]).post(1)
        assert win(ts[0]).begin(0, 1, soon()) == 0  # the parent's stays
        win(gs[1]).post(1)  # the peer's own is untouched
        ts[1].close()  # the parent closes: its groups' windows go too
        with pytest.raises(error):
            win(gs[1]).post(2)
        with pytest.raises(error):
            win(gs[1]).wait(0, 1, soon())


# -- through communicators -------------------------------------------------------------------------


def test_group_calls_run_one_sided_and_mismatches_fail_every_rank() -> None:
    def body(comm: plait.Communicator) -> Any:
        sub = comm.split(comm.rank % 2)
        assert sub.window_bytes == comm.window_bytes > 0  # reserved as it is needed
        x = np.arange(4, dtype=np.float32) + comm.rank
        got = [sub.allreduce(x), comm.allreduce(x), sub.allreduce(x, plait.MAX)]
        algorithms = [c["algorithm"] for c in sub._runner.recorder.snapshot()]
        try:
            sub.allreduce(np.ones(2 + sub.rank, np.float32))
        except MismatchError as exc:
            error = str(exc)
        return got, algorithms, error

    results = run_ranks(4, body)
    x = [np.arange(4, dtype=np.float32) + r for r in range(4)]
    for r, (got, algorithms, error) in enumerate(results):
        group = [q for q in range(4) if q % 2 == r % 2]
        np.testing.assert_array_equal(got[0], sum(x[q] for q in group))
        np.testing.assert_array_equal(got[1], sum(x))
        np.testing.assert_array_equal(got[2], np.maximum(*(x[q] for q in group)))
        assert algorithms, algorithms
        assert all(a.startswith("arena") for a in algorithms), algorithms
        assert "different call" in error or "different collectives" in error, error


def test_a_segment_larger_than_the_memory_available_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Note [room for a segment]: PLAIT_SHM_WINDOW=99999G had the out-of-memory killer take
    processes across the host; a segment is refused where it is more than a process's share
    of the memory available, and a window's growth where it is more than all of it."""
    from plait.errors import TransportError

    monkeypatch.setattr(segment, "_available_memory", lambda: 1 << 20)
    path = os.path.join(segment.SHM_DIR, f"plait-room-{secrets.token_hex(4)}")
    with pytest.raises(TransportError, match="lower PLAIT_SHM_WINDOW") as info:
        segment.create(path, 600 << 10, 0, "room", share=2)
    assert "its share: 2 processes" in str(info.value)
    seg = segment.create(path, 600 << 10, 0, "room", reserve=[(0, 4096)])
    try:
        with pytest.raises(TransportError, match="is more than this host has available"):
            seg.reserve(0, 2 << 20, 0)
        seg.reserve(4096, 8192, 0)  # what fits is reserved
    finally:
        seg.release()
