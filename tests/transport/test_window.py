"""Windows: the memory transport's and the shared-memory transport's, threads and processes."""

from __future__ import annotations

import contextlib
import glob
import os
import secrets
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from functools import partial
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from shm_helpers import (  # noqa: F401 - no_leftovers: autouse fixture
    PollWatch,
    in_threads,
    no_leftovers,
)

from plait.errors import ClosedError, PeerLostError
from plait.rendezvous.store import MemoryStore
from plait.transport.endpoint import Endpoint
from plait.transport.memory import MemoryFabric
from plait.transport.shm import ShmTransport, segment
from plait.transport.shm.segment import W_SLEEPING
from plait.transport.shm.window import window_bytes
from plait.transport.window import DEFAULT_WINDOW_BYTES, Window

pytestmark = [
    pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm (Linux)"),
    pytest.mark.timeout(120),
]

KINDS = ["memory", "shm"]
#: Small rings and windows: many transports, little memory.
SMALL: dict[str, Any] = {"slot_bytes": 4096, "slots": 2, "window_bytes": 1 << 20}


@contextlib.contextmanager
def transports(kind: str, size: int, **kwargs: Any) -> Iterator[list[Endpoint]]:
    """``size`` endpoints of one transport, each with a window."""
    ts: list[Endpoint]
    if kind == "memory":
        ts = list(MemoryFabric(size, window=kwargs.get("window_bytes", 1 << 20)).endpoints)
    else:
        store = MemoryStore(timeout=20)
        kw = {**SMALL, **kwargs}
        ts = in_threads(
            [partial(ShmTransport, r, size, store, timeout=20, **kw) for r in range(size)]
        )
    try:
        yield ts
    finally:
        for t in ts:
            t.close()


def win(t: Endpoint) -> Window:
    assert t.window is not None
    return t.window


def soon(seconds: float = 20.0) -> float:
    return time.monotonic() + seconds


def pattern(nbytes: int, seed: int) -> np.ndarray:
    return (np.arange(nbytes, dtype=np.uint64) * 2654435761 + seed).astype(np.uint8)


# -- both windows, ranks as threads --------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("size", [2, 3])
def test_post_then_wait_sees_the_data(kind: str, size: int) -> None:
    with transports(kind, size) as ts:
        data = pattern(win(ts[0]).capacity, 7)

        def writer() -> None:
            w = win(ts[0])
            assert w.begin(0, 99, soon()) == 0
            w.local(0)[:] = data
            w.post(1)
            for q in range(1, size):
                assert w.wait(q, 1 << 32, soon())  # everyone has read it
            w.end(0)

        def reader(r: int) -> bool:
            w = win(ts[r])
            assert w.begin(0, 99, soon()) == 0
            assert w.wait(0, 1, soon())
            assert w.digest(0, 0) == 99
            same = bool(np.array_equal(w.peer(0, 0), data))
            w.end(0)
            return same

        results = in_threads([writer, *(partial(reader, r) for r in range(1, size))])
        assert all(results[1:])


@pytest.mark.parametrize("kind", KINDS)
def test_epochs_alternate_halves(kind: str) -> None:
    with transports(kind, 2) as ts:

        def rank(r: int) -> list[int]:
            w, q = win(ts[r]), 1 - r
            assert w.capacity > 0
            assert w.local(0) is w.local(0)
            assert w.peer(q, 1) is w.peer(q, 1)
            assert w.peer(r, 0) is w.local(0)
            halves = []
            for epoch in range(8):
                half = w.begin(epoch, (epoch << 40) + r, soon())
                halves.append(half)
                w.local(half)[:8] = epoch * 10 + r
                w.post((epoch << 32) | 1)
                assert w.wait(q, (epoch << 32) | 1, soon())
                assert w.digest(q, half) == (epoch << 40) + q
                assert (w.peer(q, half)[:8] == epoch * 10 + q).all()
                w.end(epoch)
                assert w.counter(r) == (epoch + 1) << 32
            return halves

        assert in_threads([partial(rank, 0), partial(rank, 1)]) == [[0, 1] * 4] * 2


@pytest.mark.parametrize("kind", KINDS)
def test_a_probe_reads_a_peer_in_place_until_the_window_is_released(kind: str) -> None:
    # Window.probe: a compiled one-sided schedule reads a peer's counter and digest word
    # through it; once the transport closes a read fails (or still gives the last values)
    # and counter() gives the closed error, never a crash.
    with transports(kind, 2) as (a, b):
        wa, wb = win(a), win(b)
        assert wb.begin(0, 1234, soon()) == 0
        wb.post(5)
        counters, i, digests, j = wa.probe(1, 0)
        assert (counters[i], digests[j]) == (5, 1234) == (wa.counter(1), wa.digest(1, 0))
        wb.post(6)
        assert counters[i] == 6
        a.close()
        try:
            stale = counters[i]
        except (TypeError, ValueError):
            stale = 6
        assert stale == 6
        with pytest.raises((ClosedError, PeerLostError)):
            wa.counter(1) if kind == "shm" else wa.wait(1, 7, soon())
        if kind == "shm":
            with pytest.raises(ClosedError):
                wa.probe(1, 0)


def test_the_base_class_probe_reads_through_the_methods() -> None:
    # A Window that hands out no words of its own still gives a probe.
    with transports("memory", 2) as (a, b):
        wa, wb = win(a), win(b)
        assert wb.begin(0, 77, soon()) == 0
        wb.post(3)
        counters, i, digests, j = Window.probe(wa, 1, 0)
        assert (counters[i], digests[j]) == (3, 77)
        with pytest.raises(ValueError, match="half"):
            Window.probe(wa, 1, 2)


def test_a_one_sided_call_on_a_closed_transport_raises_the_closed_error() -> None:
    # The compiled form reads peers' words in place (Window.probe): when the transport
    # closes under it, the call raises ClosedError instead of reading released memory.
    from plait.algos._registry import build_schedule, get
    from plait.runtime import one_sided
    from plait.runtime.compiled import compiled_for
    from plait.runtime.executor import Call
    from plait.schedule.builder import Context

    class ClosingWindow:
        """The window, but the transport closes as soon as the call has posted."""

        def __init__(self, w: Any, transport: Any) -> None:
            self._w, self._transport = w, transport

        def poster(self) -> None:
            return None  # every post through post, below

        def post(self, value: int) -> None:
            self._w.post(value)
            self._transport.close()

        def __getattr__(self, name: str) -> Any:
            return getattr(self._w, name)

    with transports("shm", 2) as (a, _):
        w = ClosingWindow(win(a), a)
        ctx = Context("allreduce", 0, 2, 4, 4, window=win(a).capacity)
        schedule = build_schedule(get("allreduce", "arena_oneshot"), ctx)
        f32 = np.dtype(np.float32)
        w.last_compiled = (schedule, f32, compiled_for(schedule, w, f32).run)  # in place
        x = np.ones(4, np.float32)
        call = Call("allreduce (test)", 0, 0, np.add, soon(), epoch=0)
        closing: Any = SimpleNamespace(window=w, rank=0, size=2)
        with pytest.raises(ClosedError, match="closed"):
            one_sided.run_one_sided(schedule, (x, x, x[:0]), closing, call, True)


@pytest.mark.parametrize("attr", ["polls", "yields"])
def test_a_window_reads_a_short_counter_again_as_its_ranks_share_the_cores(
    monkeypatch: pytest.MonkeyPatch, attr: str
) -> None:
    # Window.polls and Window.yields (Note [a second look] in plait.runtime.compiled):
    # shared memory, polls with a core per rank, yields with more ranks than cores; on a
    # thread that may spin; never threads of one process.
    from plait.transport.base import background_thread
    from plait.transport.shm.window import POLLS, YIELDS

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    with transports("memory", 3) as ts:
        assert getattr(win(ts[0]), attr) == 0
    expected = {2: POLLS if attr == "polls" else 0, 3: YIELDS if attr == "yields" else 0}
    assert POLLS > 0
    assert YIELDS > 0
    for size, value in expected.items():  # two ranks on two cores, then three
        with transports("shm", size) as ts:
            assert [getattr(win(t), attr) for t in ts] == [value] * size
            if not value:
                continue
            w = win(ts[0])
            on_background: list[int] = []

            def background(w: Any = w, found: list[int] = on_background) -> None:
                background_thread()
                found.append(getattr(w, attr))

            t = threading.Thread(target=background)
            t.start()
            t.join()
            assert on_background == [0]
            ts[0].spin = 0.0  # PLAIT_SHM_SPIN=0: sleep at once
            assert getattr(w, attr) == 0


@pytest.mark.parametrize("kind", KINDS)
def test_begin_waits_until_every_peer_ended_call_n_minus_2(kind: str) -> None:
    with transports(kind, 2) as (a, b):
        fast, slow = win(a), win(b)
        assert slow.begin(0, 5, soon()) == 0  # the slow rank starts call 0 and stays in it
        slow.post(1)
        assert fast.begin(0, 5, soon()) == 0
        fast.post(1)
        fast.end(0)
        assert fast.begin(1, 6, soon()) == 1  # call 1 uses the other half: no wait
        fast.post((1 << 32) | 1)
        fast.end(1)
        # Call 2 reuses half 0, which the slow rank may still read: not before it ends call 0.
        assert fast.begin(2, 7, time.monotonic() + 0.05) == -1
        assert fast.behind(1 << 32) == [1]
        started = threading.Event()

        def begin_two() -> int:
            started.set()
            return fast.begin(2, 7, soon())

        def slow_rank() -> None:
            assert started.wait(10)
            assert slow.wait(0, 1, soon())  # it reads the fast rank's half 0 of call 0 ...
            slow.end(0)  # ... and only then lets it go on

        got, _ = in_threads([begin_two, slow_rank])
        assert got == 0
        assert fast.digest(0, 0) == 7
        assert fast.behind(1 << 32) == []


@pytest.mark.parametrize("kind", KINDS)
def test_wait_times_out(kind: str) -> None:
    with transports(kind, 2) as (a, _):
        w = win(a)
        start = time.monotonic()
        assert not w.wait(1, 5, start + 0.05)
        assert time.monotonic() - start >= 0.05
        assert not w.wait(1, 5, start - 1)  # a deadline passed already: one look
        assert w.behind(5) == [1]
        assert w.wait(1, 0, None)


@pytest.mark.parametrize("kind", KINDS)
def test_misuse_is_refused(kind: str) -> None:
    with transports(kind, 2) as (a, _):
        w = win(a)
        w.post(3)
        with pytest.raises(ValueError, match="must not decrease"):
            w.post(2)
        w.post(3)  # the same value again is fine
        assert w.wait(0, 3, None)
        with pytest.raises(ValueError, match="its own counter"):
            w.wait(0, 4, soon())
        with pytest.raises(ValueError, match="half"):
            w.local(2)
        with pytest.raises(ValueError, match="read-only"):
            w.peer(1, 0)[0] = 1


@pytest.mark.parametrize("kind", KINDS)
def test_a_peer_that_closes_fails_the_waiters(kind: str) -> None:
    with transports(kind, 3) as (a, b, c):
        win(a).post(1)
        a.close()
        w = win(b)
        assert w.wait(0, 1, soon())  # what it posted before closing counts
        with pytest.raises(PeerLostError, match="rank 0 has closed"):
            w.wait(0, 2, soon())
        # A wait in progress when the peer closes fails too.
        watch = PollWatch(b) if kind == "shm" else None

        def waiter() -> None:
            with pytest.raises(PeerLostError, match="rank 2 has closed"):
                w.wait(2, 1, soon())

        def closer() -> None:
            if watch is not None:
                assert watch.asleep.wait(10)
            c.close()

        in_threads([waiter, closer])


@pytest.mark.parametrize("kind", KINDS)
def test_closing_fails_own_waits(kind: str) -> None:
    with transports(kind, 2) as (a, _):
        w = win(a)
        error = ClosedError  # this rank's own close, on either transport
        watch = PollWatch(a) if kind == "shm" else None

        def waiter() -> None:
            with pytest.raises(error):
                w.wait(1, 1, soon())

        def closer() -> None:
            if watch is not None:
                assert watch.asleep.wait(10)
            a.close()

        in_threads([waiter, closer])
        with pytest.raises(error):
            w.post(1)
        with pytest.raises(error):
            w.wait(1, 1, soon())


@pytest.mark.parametrize("kind", KINDS)
def test_a_sleeping_waiter_is_woken_by_post(kind: str) -> None:
    with transports(kind, 2) as (a, b):
        watch = PollWatch(b) if kind == "shm" else None
        posted = [0.0]

        def waiter() -> float:
            assert win(b).wait(0, 1, None)
            return time.monotonic()

        def poster() -> None:
            if watch is not None:
                assert watch.asleep.wait(10)  # b sleeps in poll(), past its spin
            posted[0] = time.monotonic()
            win(a).post(1)

        woke, _ = in_threads([waiter, poster])
        # Woken by the doorbell, not by the endpoint's 1 s check of peers.
        assert woke - posted[0] < 0.5


def test_point_to_point_traffic_beside_the_window() -> None:
    """Other threads drive the endpoint for messages while the window waits and sleeps."""
    rounds = 300
    with transports("shm", 2) as ts:

        def windows(r: int) -> None:
            w, q = win(ts[r]), 1 - r
            for epoch in range(rounds):
                half = w.begin(epoch, epoch, soon())
                w.local(half)[:8] = (epoch + r) & 0xFF
                w.post((epoch << 32) | 1)
                assert w.wait(q, (epoch << 32) | 1, soon())
                assert (w.peer(q, half)[:8] == (epoch + q) & 0xFF).all()
                w.end(epoch)

        def messages(r: int) -> None:
            t, q = ts[r], 1 - r
            for i in range(rounds):
                src = np.full(100, i & 0xFF, np.uint8)
                dst = np.zeros(100, np.uint8)
                hs = [t.isend(q, 1, memoryview(src), 0), t.irecv(q, 1, memoryview(dst), 0)]
                for h in hs:
                    assert t.wait_any([h], 20)
                    assert h.error is None
                assert (dst == i & 0xFF).all()

        in_threads([partial(f, r) for f in (windows, messages) for r in (0, 1)])


# -- the shared-memory window: configuration -----------------------------------------------------


def test_window_size_and_disabling(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PLAIT_SHM_WINDOW", raising=False)
    assert window_bytes() == DEFAULT_WINDOW_BYTES == 2 << 20
    for text, expect in (("0", 0), ("65536", 65536), ("64K", 65536), ("2M", 2 << 20)):
        monkeypatch.setenv("PLAIT_SHM_WINDOW", text)
        assert window_bytes() == expect
    assert window_bytes(4096) == 4096
    for bad in ("big", "-1", "1.5M"):
        monkeypatch.setenv("PLAIT_SHM_WINDOW", bad)
        with pytest.raises(ValueError, match="PLAIT_SHM_WINDOW"):
            window_bytes()
    with pytest.raises(ValueError, match="window_bytes"):
        window_bytes(-1)

    monkeypatch.setenv("PLAIT_SHM_WINDOW", "0")
    with transports("shm", 2, window_bytes=None) as ts:
        assert [t.window for t in ts] == [None, None]
    monkeypatch.delenv("PLAIT_SHM_WINDOW")
    store = MemoryStore(timeout=20)
    for sizes, expect in (((0, 4096), None), ((5000, 1 << 16), 5000)):
        pair = in_threads(
            [
                partial(ShmTransport, r, 2, store, timeout=20, window_bytes=n, slot_bytes=4096)
                for r, n in enumerate(sizes)
            ]
        )
        try:
            for t in pair:
                got = None if t.window is None else t.window.capacity
                assert got == expect  # every rank agrees: the smallest, or none
        finally:
            for t in pair:
                t.close()
    assert MemoryFabric(2, window=0).endpoints[0].window is None
    assert Endpoint.window is None  # TCP and hybrid endpoints have none


def test_libatomic_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """The weakly-ordered-CPU path (seq_cst atomics through libatomic), run on any CPU."""
    import ctypes.util

    if ctypes.util.find_library("atomic") is None:
        pytest.skip("no libatomic")
    monkeypatch.setattr(segment, "use_libatomic", True)
    test_epochs_alternate_halves("shm")
    test_a_sleeping_waiter_is_woken_by_post("shm")
    test_a_probe_reads_a_peer_in_place_until_the_window_is_released("shm")
    test_a_one_sided_call_on_a_closed_transport_raises_the_closed_error()


# -- real processes -----------------------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import os, sys, time
    import numpy as np
    from plait.rendezvous.tcp_store import TCPStore
    from plait.transport.shm import ShmTransport
    from plait.transport.shm.link import ShmLink
    from plait.transport.shm.segment import W_SLEEPING

    port, rank, size, job, mode = sys.argv[1:6]
    rank, size = int(rank), int(size)
    store = TCPStore("127.0.0.1", int(port), timeout=30)
    t = ShmTransport(rank, size, store, timeout=30, job=job, slot_bytes=4096, slots=2)
    w = t.window
    deadline = time.monotonic() + 60
    if mode == "rounds":  # every rank writes its half, posts, reads every peer's, ends
        for epoch in range(int(sys.argv[6])):
            half = w.begin(epoch, 77, deadline)
            assert half == epoch & 1
            w.local(half)[:8] = (epoch * 8 + rank) & 0xFF
            w.post((epoch << 32) | 1)
            for q in range(size):
                if q != rank:
                    assert w.wait(q, (epoch << 32) | 1, deadline)
                    assert w.digest(q, half) == 77
                    assert (w.peer(q, half)[:8] == (epoch * 8 + q) & 0xFF).all(), (epoch, q)
            w.end(epoch)
        print("ok", flush=True)
    elif mode == "post-when-asleep":  # post once rank 0 sleeps on its doorbell
        link = next(x for x in t._links if isinstance(x, ShmLink))
        flags = link.by_rank[0].seg.words
        w.post(1)
        print("posted", flush=True)
        sys.stdin.readline()  # rank 0 has seen phase 1 (and is awake)
        while not flags[W_SLEEPING]:
            time.sleep(0.001)
        w.post(2)
        print("posted", flush=True)
        sys.stdin.read()
    elif mode in ("idle", "close"):  # post phase 1, then idle (or close) until stdin closes
        w.post(1)
        print("posted", flush=True)
        if mode == "close":
            sys.stdin.readline()
            t.close()
            print("closed", flush=True)
        sys.stdin.read()
    t.close()
    store.close()
    """
)


@pytest.fixture
def store_server() -> Iterator[int]:
    tcp_store = pytest.importorskip("plait.rendezvous.tcp_store")
    server = tcp_store.TCPStoreServer("127.0.0.1", 0)
    try:
        yield server.port
    finally:
        server.close()


@pytest.fixture
def job() -> Iterator[str]:
    """A job id of this test alone; nothing of it may stay in /dev/shm."""
    name = f"win-{os.getpid()}-{secrets.token_hex(4)}"
    yield name
    assert glob.glob(f"/dev/shm/plait-{name}-*") == []


def _spawn(port: int, rank: int, size: int, job: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-W", "error", "-c", CHILD, str(port), str(rank), str(size), job, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@contextlib.contextmanager
def child_and_me(port: int, job: str, mode: str) -> Iterator[tuple[subprocess.Popen[str], Window]]:
    """Rank 1 in a child process running ``mode``, rank 0's transport here."""
    from plait.rendezvous.tcp_store import TCPStore

    child = _spawn(port, 1, 2, job, mode)
    store = TCPStore("127.0.0.1", port, timeout=30)
    try:
        with ShmTransport(0, 2, store, timeout=30, job=job, slot_bytes=4096, slots=2) as t:
            yield child, win(t)
    finally:
        store.close()
        if child.poll() is None:
            child.kill()
        child.communicate(timeout=10)


@pytest.mark.multiprocess
def test_four_processes_two_thousand_rounds(store_server: int, job: str) -> None:
    """More ranks than cores (on a small machine): nobody starves, every read is right."""
    procs = [_spawn(store_server, r, 4, job, "rounds", "2000") for r in range(4)]
    try:
        outs = [p.communicate(timeout=100) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
        assert out.strip() == "ok", (out, err)


@pytest.mark.multiprocess
def test_a_sleeping_waiter_is_woken_by_a_process(store_server: int, job: str) -> None:
    with child_and_me(store_server, job, "post-when-asleep") as (child, w):
        assert child.stdout is not None
        assert child.stdin is not None
        assert child.stdout.readline().strip() == "posted"
        assert w.wait(1, 1, soon())
        child.stdin.write("go\n")
        child.stdin.flush()
        start = time.monotonic()
        assert w.wait(1, 2, None)  # sleeps; the child sees its flag and posts
        assert time.monotonic() - start < 0.5  # the doorbell, not the 1 s check of peers
        assert child.stdout.readline().strip() == "posted"


@pytest.mark.multiprocess
def test_sigkill_while_waiting(store_server: int, job: str) -> None:
    with child_and_me(store_server, job, "idle") as (child, w):
        assert w.wait(1, 1, soon())
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "posted"
        killed = [0.0]
        words = w._words  # type: ignore[attr-defined]

        def kill_when_asleep() -> None:
            while not words[W_SLEEPING]:  # rank 0 sleeps in poll(), waiting on the child
                time.sleep(0.001)
            child.send_signal(signal.SIGKILL)
            killed[0] = time.monotonic()

        killer = threading.Thread(target=kill_when_asleep)
        killer.start()
        try:
            with pytest.raises(PeerLostError, match="rank 1 was lost"):
                w.wait(1, 2, soon(30))
        finally:
            killer.join(10)
        assert killed[0]
        assert time.monotonic() - killed[0] < 2.5
        assert w.wait(1, 1, soon())  # what it posted stays


@pytest.mark.multiprocess
def test_a_peer_process_that_closes(store_server: int, job: str) -> None:
    with child_and_me(store_server, job, "close") as (child, w):
        assert child.stdout is not None
        assert child.stdin is not None
        assert child.stdout.readline().strip() == "posted"
        child.stdin.write("close\n")
        child.stdin.flush()
        with pytest.raises(PeerLostError, match="rank 1 has closed"):
            w.wait(1, 2, soon())
        assert child.stdout.readline().strip() == "closed"
        assert child.poll() is None  # closed, not dead


def test_a_memory_window_watch_ends_with_the_post_or_the_peers_close() -> None:
    """``Window.watch``: a handle of the endpoint, done when the peer posts; PeerLostError
    when the peer closes first; ``unwatch`` forgets it."""
    fabric = MemoryFabric(3, window=64)
    a, b, c = (ep.window for ep in fabric.endpoints)
    assert a is not None
    assert b is not None
    assert c is not None
    assert a.watch(1, 0) is None  # posted already
    h = a.watch(1, 5)
    assert h is not None
    assert not h.done
    b.post(4)
    assert not h.done
    b.post(5)
    assert h.done
    assert h.error is None
    lost = a.watch(2, 1)
    assert lost is not None
    fabric.endpoints[2].close()
    assert lost.done
    assert isinstance(lost.error, PeerLostError)
    dropped = a.watch(1, 9)
    assert dropped is not None
    a.unwatch(dropped)
    assert dropped.done
    b.post(9)  # nobody is told any more
    with pytest.raises(ValueError, match="its own counter"):
        a.watch(0, 1)  # only this rank could post it
