"""The shared-memory transport: threads and real processes as ranks, failures, cleanup."""

from __future__ import annotations

import contextlib
import gc
import glob
import os
import secrets
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator, Sequence
from functools import partial
from typing import Any

import numpy as np
import pytest
from shm_helpers import in_threads, no_leftovers  # noqa: F401 - no_leftovers: autouse fixture

import plait
from plait.errors import ClosedError, MismatchError, PeerLostError, RendezvousError
from plait.rendezvous.store import MemoryStore, Store
from plait.transport.base import Handle, Transport
from plait.transport.shm import ShmTransport, segment

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm (Linux)")

SMALL = {"slot_bytes": 4096, "slots": 2}  # many chunks per message, cheaply


def _make(size: int, store: Store | None = None, **kwargs: Any) -> list[ShmTransport]:
    store = MemoryStore(timeout=20) if store is None else store
    kwargs.setdefault("timeout", 20.0)
    return in_threads([partial(ShmTransport, r, size, store, **kwargs) for r in range(size)])


@contextlib.contextmanager
def transports(size: int, **kwargs: Any) -> Iterator[list[ShmTransport]]:
    ts = _make(size, **kwargs)
    try:
        yield ts
    finally:
        for t in ts:
            t.close()


def wait(t: Transport, h: Handle, timeout: float = 20.0) -> Handle:
    assert t.wait_any([h], timeout), f"{h!r} did not finish within {timeout} s"
    return h


def ok(t: Transport, h: Handle) -> None:
    wait(t, h)
    assert h.error is None, h.error


def ok_all(t: Transport, hs: Sequence[Handle]) -> None:
    for h in hs:
        ok(t, h)


def payload(nbytes: int, seed: int = 0) -> np.ndarray:
    """Random bytes repeating with a prime period, so shifted or swapped data shows."""
    block = np.random.default_rng(seed).integers(0, 256, 65537, dtype=np.uint8)
    return np.resize(block, nbytes)


def mv(a: np.ndarray) -> memoryview:
    return a.data.cast("B")


# -- messages ----------------------------------------------------------------------------------


@pytest.mark.parametrize("nbytes", [0, 1, 8, 4095, 4096, 4097, 3 * 4096, 10 * 4096 + 7])
def test_message_sizes(nbytes: int) -> None:
    with transports(2, **SMALL) as (a, b):
        src, dst = payload(nbytes), np.zeros(nbytes, np.uint8)
        r = b.irecv(0, 3, mv(dst), 11)
        s = a.isend(1, 3, mv(src), 11)
        in_threads([lambda: ok(a, s), lambda: ok(b, r)])
        assert np.array_equal(src, dst)
        assert a.bytes_sent == b.bytes_received == nbytes


def test_typed_buffers_and_self_send() -> None:
    with transports(2) as (a, _):
        assert isinstance(a, Transport)
        x, y = np.arange(6.0).reshape(2, 3), np.zeros((2, 3))
        h = a.isend(0, 1, x.data, 0)  # float64 memoryview, 2-D: cast to bytes
        ok(a, a.irecv(0, 1, y.data, 0))
        ok(a, h)
        assert np.array_equal(x, y)
        with pytest.raises(ValueError, match="writable"):
            a.irecv(1, 1, memoryview(b"abc"), 0)
        with pytest.raises(ValueError, match="peer 2"):
            a.isend(2, 1, memoryview(b"abc"), 0)


@pytest.mark.slow
def test_256_mib_message() -> None:
    nbytes = 256 << 20
    with transports(2) as (a, b):
        src = np.arange(nbytes // 8, dtype=np.uint64)
        dst = np.zeros_like(src)
        s, r = a.isend(1, 0, mv(src), 1), b.irecv(0, 0, mv(dst), 1)
        in_threads([lambda: ok(a, s), lambda: ok(b, r)])
        assert np.array_equal(src, dst)


def test_fifo_per_tag_and_out_of_order_tags() -> None:
    with transports(2, **SMALL) as (a, b):
        msgs = [(tag, payload(5000, seed)) for seed in range(3) for tag in (1, 2, 3)]
        sends = [a.isend(1, tag, mv(m), tag) for tag, m in msgs]
        got = {}

        def receive() -> None:  # tag 3 first, then 2, then 1: earlier ones are set aside
            for tag in (3, 2, 1):
                for seed in range(3):
                    got[tag, seed] = np.zeros(5000, np.uint8)
                    ok(b, b.irecv(0, tag, mv(got[tag, seed]), tag))

        in_threads([partial(ok_all, a, sends), receive])
        for tag, seed in got:
            assert np.array_equal(got[tag, seed], payload(5000, seed))


def test_unexpected_messages_are_buffered() -> None:
    with transports(2, **SMALL) as (a, b):
        msgs = [payload(3000 + i, i) for i in range(10)]  # more than the ring holds
        sends = [a.isend(1, 100 + i, mv(m), 0) for i, m in enumerate(msgs)]
        last = np.zeros(1, np.uint8)
        sends.append(a.isend(1, 7, mv(np.ones(1, np.uint8)), 0))
        # b waits for the last message only: it must drain the earlier ones to get there.
        r = b.irecv(0, 7, mv(last), 0)
        in_threads([partial(ok_all, a, sends), partial(ok, b, r)])
        assert last[0] == 1
        for i, m in reversed(list(enumerate(msgs))):  # all already here; any order
            dst = np.zeros_like(m)
            h = b.irecv(0, 100 + i, mv(dst), 0)
            assert h.done
            assert h.error is None
            assert np.array_equal(dst, m)


def test_polling_with_zero_timeout_drains() -> None:
    with transports(2, **SMALL) as (a, b):
        ok(a, a.isend(1, 1, mv(payload(100)), 0))  # unmatched, at the head of the ring
        ok(a, a.isend(1, 2, mv(payload(50)), 0))
        dst = np.zeros(50, np.uint8)
        r = b.irecv(0, 2, mv(dst), 0)
        for _ in range(1000):  # a caller that only ever polls must get past the head
            if b.wait_any([r], 0):
                break
        assert r.done
        assert r.error is None
        assert np.array_equal(dst, payload(50))


def test_receive_posted_while_message_is_half_buffered() -> None:
    with transports(2, **SMALL) as (a, b):
        src, dst = payload(40 * 4096), np.zeros(40 * 4096, np.uint8)
        s = a.isend(1, 5, mv(src), 0)
        stop = threading.Event()

        def drain() -> None:  # b waits on something else, so it drains tag 5 as unexpected
            other = b.irecv(0, 6, mv(np.zeros(1, np.uint8)), 0)
            while not stop.is_set():
                b.wait_any([other], 0.001)
            b.cancel(other)

        t = threading.Thread(target=drain)
        t.start()
        try:
            while a.bytes_sent == 0 and not s.done:  # let part of it move
                a.wait_any([s], 0.001)
        finally:
            stop.set()
            t.join()
        r = b.irecv(0, 5, mv(dst), 0)
        in_threads([lambda: ok(a, s), lambda: ok(b, r)])
        assert np.array_equal(src, dst)


@pytest.mark.parametrize("nbytes", [16, 5 * 4096])
def test_check_and_length_mismatch(nbytes: int) -> None:
    with transports(2, **SMALL) as (a, b):
        src = payload(nbytes)
        s1 = a.isend(1, 1, mv(src), 42)
        s2 = a.isend(1, 1, mv(src), 42)
        s3 = a.isend(1, 1, mv(src), 42)
        dst = np.zeros(nbytes, np.uint8)

        def receive() -> list[Handle]:
            return [
                wait(b, b.irecv(0, 1, mv(np.zeros(nbytes, np.uint8)), 43)),
                wait(b, b.irecv(0, 1, mv(np.zeros(nbytes + 1, np.uint8)), 42)),
                wait(b, b.irecv(0, 1, mv(dst), 42)),  # the channel still works afterwards
            ]

        _, (r1, r2, r3) = in_threads([partial(ok_all, a, [s1, s2, s3]), receive])
        assert isinstance(r1.error, MismatchError)
        assert "different call" in str(r1.error)
        assert isinstance(r2.error, MismatchError)
        assert f"sent {nbytes} bytes" in str(r2.error)
        assert r3.error is None
        assert np.array_equal(dst, src)


def test_full_duplex_64_mib_both_send_first() -> None:
    nbytes = 64 << 20
    with transports(2) as ts:
        srcs = [payload(nbytes, r) for r in range(2)]
        dsts = [np.zeros(nbytes, np.uint8) for _ in range(2)]

        def rank(r: int) -> None:
            t = ts[r]
            s = t.isend(1 - r, 9, mv(srcs[r]), 0)
            ok(t, s)  # both wait on their send before posting the receive
            ok(t, t.irecv(1 - r, 9, mv(dsts[r]), 0))

        in_threads([lambda: rank(0), lambda: rank(1)])
        assert np.array_equal(dsts[0], srcs[1])
        assert np.array_equal(dsts[1], srcs[0])


def test_four_ranks_all_to_all_at_once() -> None:
    size, nbytes = 4, 300_000
    with transports(size, slot_bytes=65536, slots=3) as ts:

        def rank(r: int) -> list[np.ndarray]:
            t = ts[r]
            dsts = [np.zeros(nbytes, np.uint8) for _ in range(size)]
            hs = [t.isend(p, 1, mv(payload(nbytes, 10 * r + p)), 0) for p in range(size)]
            hs += [t.irecv(p, 1, mv(dsts[p]), 0) for p in range(size)]
            for h in hs:
                ok(t, h)
            return dsts

        results = in_threads([partial(rank, r) for r in range(size)])
        for r in range(size):
            for p in range(size):
                assert np.array_equal(results[r][p], payload(nbytes, 10 * p + r))


def test_two_threads_share_one_rank() -> None:
    with transports(2, **SMALL) as (a, b):
        n = 200

        def pingpong(tag: int, t: ShmTransport, first: bool) -> None:
            buf = np.zeros(700, np.uint8)
            for i in range(n):
                if first:
                    buf[:] = i % 251
                    ok(t, t.isend(1 - t.rank, tag, mv(buf), 0))
                    ok(t, t.irecv(1 - t.rank, tag, mv(buf), 0))
                    assert buf[0] == (i + 1) % 251
                else:
                    ok(t, t.irecv(1 - t.rank, tag, mv(buf), 0))
                    buf[:] = (buf[0] + 1) % 251
                    ok(t, t.isend(1 - t.rank, tag, mv(buf), 0))

        in_threads([partial(pingpong, tag, t, t is a) for tag in (1, 2) for t in (a, b)])


# -- waiting, cancelling, closing ----------------------------------------------------------------


def test_wait_any_timeout() -> None:
    with transports(2) as (a, _):
        h = a.irecv(1, 1, mv(np.zeros(4, np.uint8)), 0)
        start = time.monotonic()
        assert not a.wait_any([h], 0.2)
        assert 0.19 <= time.monotonic() - start < 2.0
        assert not a.wait_any([h], 0)
        assert not h.done
        a.cancel(h)
        assert h.done


def test_cancel() -> None:
    with transports(2, **SMALL) as (a, b):
        first = np.zeros(8, np.uint8)
        r1 = b.irecv(0, 1, mv(first), 0)
        b.cancel(r1)
        b.cancel(r1)  # idempotent
        assert r1.done
        assert r1.error is None
        dst = np.zeros(8, np.uint8)
        r2 = b.irecv(0, 1, mv(dst), 0)
        ok(a, a.isend(1, 1, mv(np.full(8, 5, np.uint8)), 0))
        ok(b, r2)
        assert dst[0] == 5
        assert first[0] == 0  # the cancelled receive never got it


def test_cancel_sends() -> None:
    with transports(2, **SMALL) as (a, b):
        big = payload(20 * 4096)
        s1 = a.isend(1, 1, mv(big), 0)  # two chunks fit; the rest waits for b
        s2 = a.isend(1, 2, mv(payload(10)), 0)  # not started at all
        assert not s1.done
        a.cancel(s1)
        a.cancel(s2)
        big[:] = 0  # the caller may reuse the buffer at once: the message is unharmed
        dst = np.zeros(20 * 4096, np.uint8)
        r = b.irecv(0, 1, mv(dst), 0)

        def push_rest() -> None:  # a's progress sends the rest from its private copy
            while not r.done:
                a.wait_any([r], 0.01)

        in_threads([lambda: ok(b, r), push_rest])
        assert np.array_equal(dst, payload(20 * 4096))
        late = b.irecv(0, 2, mv(np.zeros(10, np.uint8)), 0)
        assert not b.wait_any([late], 0.1)  # the cancelled send never arrives
        b.cancel(late)


def test_peer_close() -> None:
    with transports(3) as (a, b, c):
        ok(a, a.isend(1, 1, mv(payload(100)), 0))  # sent before closing: still receivable
        pending = b.irecv(0, 2, mv(np.zeros(4, np.uint8)), 0)
        other = b.irecv(2, 2, mv(np.zeros(4, np.uint8)), 0)
        a.close()
        a.close()  # idempotent
        assert b.wait_any([pending], 5)
        assert isinstance(pending.error, PeerLostError)
        assert "rank 0 has closed" in str(pending.error)
        assert not other.done  # rank 2 is fine
        b.cancel(other)
        dst = np.zeros(100, np.uint8)
        ok(b, b.irecv(0, 1, mv(dst), 0))
        assert np.array_equal(dst, payload(100))
        late = b.irecv(0, 3, mv(np.zeros(4, np.uint8)), 0)
        assert isinstance(late.error, PeerLostError)
        send = c.isend(0, 1, mv(payload(10)), 0)
        assert c.wait_any([send], 5)
        assert isinstance(send.error, PeerLostError)
        closed = a.isend(1, 1, mv(payload(1)), 0)
        assert isinstance(closed.error, ClosedError)


class _PollWatch:
    """Wraps a transport's epoll object; ``asleep`` is set once a thread blocks in poll().

    Calls with timeout 0 (checks between rounds of progress) do not count.
    """

    def __init__(self, t: ShmTransport) -> None:
        self._poller = t._poller
        self.asleep = threading.Event()
        t._poller = self  # type: ignore[assignment]

    def poll(self, timeout: float = -1) -> list[tuple[int, int]]:
        if timeout != 0:
            self.asleep.set()
        return self._poller.poll(timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._poller, name)


def test_close_while_another_thread_waits() -> None:
    with transports(2) as (a, _):
        h = a.irecv(1, 1, mv(np.zeros(4, np.uint8)), 0)
        result: list[bool] = []
        watch = _PollWatch(a)
        t = threading.Thread(target=lambda: result.append(a.wait_any([h], 20)))
        t.start()
        # The thread is asleep in poll(); the test checks that close() wakes it.
        assert watch.asleep.wait(10), "the waiting thread never blocked in poll()"
        a.close()
        t.join(5)
        assert result == [True]
        assert isinstance(h.error, ClosedError)


# -- rendezvous --------------------------------------------------------------------------------


def test_rendezvous_details() -> None:
    store = MemoryStore(timeout=20)
    job = f"test-{os.getpid()}-{secrets.token_hex(4)}"  # unique: other runs may be going on
    # Ranks may choose different geometries: senders follow the receiver's.
    ts = in_threads(
        [
            lambda: ShmTransport(0, 2, store, timeout=20, job=job, slot_bytes=4096, slots=2),
            lambda: ShmTransport(1, 2, store, timeout=20, slot_bytes=10000, slots=3),
        ]
    )
    try:
        assert [t.job for t in ts] == [job, job]
        assert not glob.glob(f"/dev/shm/plait-{job}-*")  # unlinked once both attached
        for nbytes in (0, 5000, 50_000):
            for r in (0, 1):
                src, dst = payload(nbytes, r), np.zeros(nbytes, np.uint8)
                h = ts[1 - r].irecv(r, 1, mv(dst), 0)
                s = ts[r].isend(1 - r, 1, mv(src), 0)
                in_threads([partial(ok, ts[r], s), partial(ok, ts[1 - r], h)])
                assert np.array_equal(src, dst)
    finally:
        for t in ts:
            t.close()
    # More transports on the same store, even with one job id, get fresh names.
    first = _make(2, store, job=job)
    second = _make(2, store, job=job)
    for t in first + second:
        t.close()


def test_rendezvous_timeout_cleans_up() -> None:
    with pytest.raises(RendezvousError):
        ShmTransport(0, 2, MemoryStore(), timeout=0.3)


def test_a_rank_that_never_announces_is_named() -> None:
    # Rank 1 never comes (it died or failed in its plait.init before announcing): the others
    # name it, not a store key.
    store = MemoryStore(timeout=5)

    def rank(r: int) -> str:
        with pytest.raises(RendezvousError) as info:
            ShmTransport(r, 3, store, timeout=1)
        return str(info.value)

    for text in in_threads([lambda: rank(0), lambda: rank(2)]):
        assert "rank(s) [1] did not announce their segment" in text, text
        assert "ready/" not in text, text


_DIES_WHILE_ATTACHING = textwrap.dedent(
    """
    import os, signal, sys
    from plait.rendezvous.tcp_store import TCPStore
    from plait.transport.shm import ShmTransport, bootstrap

    def attach(self, p, slots, slot_bytes):  # announced and connected; then it dies
        os.kill(os.getpid(), signal.SIGKILL)

    bootstrap._Join._attach = attach
    ShmTransport(1, 3, TCPStore("127.0.0.1", int(sys.argv[1]), timeout=30), timeout=30)
    """
)


@pytest.mark.multiprocess
def test_a_rank_killed_during_the_rendezvous_is_named_at_once(store_server: int) -> None:
    from plait.rendezvous.tcp_store import TCPStore

    child = subprocess.Popen(
        [sys.executable, "-c", _DIES_WHILE_ATTACHING, str(store_server)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    stores = [TCPStore("127.0.0.1", store_server, timeout=30) for _ in range(2)]
    try:

        def rank(r: int, store: Store) -> tuple[str, float]:
            start = time.monotonic()
            with pytest.raises((RendezvousError, PeerLostError)) as info:
                ShmTransport(r, 3, store, timeout=30)
            return str(info.value), time.monotonic() - start

        results = in_threads([lambda: rank(0, stores[0]), lambda: rank(2, stores[1])])
        # The first to notice names rank 1 (its socket hung up, or its process is seen to
        # have ended); the other may see that one give up first.
        texts = [text for text, _ in results]
        named = ("rank 1 hung up during the shared-memory rendezvous", "rank 1 was lost")
        assert any(n in t for t in texts for n in named), texts
        for text, seconds in results:  # the other: rank 1, or the first that gave up
            said = (*named, "broke off setting up")
            assert any(s in text for s in said), text
            assert seconds < 10, seconds  # not the 30 s timeout
    finally:
        for store in stores:
            store.close()
        if child.poll() is None:
            child.kill()
        child.communicate(timeout=10)
    assert child.returncode == -signal.SIGKILL


def test_job_must_agree() -> None:
    store = MemoryStore(timeout=5)
    unique = f"{os.getpid()}-{secrets.token_hex(4)}"
    first = None

    def rank0() -> None:
        nonlocal first
        with contextlib.suppress(RendezvousError):
            first = ShmTransport(0, 2, store, timeout=1, job=f"left-{unique}")

    def rank1() -> None:
        with pytest.raises(RendezvousError, match="differs"):
            ShmTransport(1, 2, store, timeout=1, job=f"right-{unique}")

    in_threads([rank0, rank1])
    assert first is None
    with pytest.raises(ValueError, match="job"):
        ShmTransport(0, 1, store, job="no/slash")


def test_libatomic_counters(monkeypatch: pytest.MonkeyPatch) -> None:
    """The weakly-ordered-CPU path (seq_cst atomics through libatomic), run on any CPU."""
    import ctypes.util

    if ctypes.util.find_library("atomic") is None:
        pytest.skip("no libatomic")
    monkeypatch.setattr(segment, "use_libatomic", True)
    with transports(2, **SMALL) as (a, b):
        src, dst = payload(50_000), np.zeros(50_000, np.uint8)
        s, r = a.isend(1, 1, mv(src), 0), b.irecv(0, 1, mv(dst), 0)
        in_threads([lambda: ok(a, s), lambda: ok(b, r)])
        assert np.array_equal(src, dst)


# -- a Communicator over the transport ------------------------------------------------------


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
def test_communicator_allreducein_threads(size: int) -> None:
    ts = _make(size, slot_bytes=16384)
    comms = [plait.init(transport=t, timeout=30) for t in ts]
    counts = [0, 1, 7, 1000, 50_000]

    def rank(r: int) -> list[np.ndarray]:
        with comms[r] as comm:
            return [comm.allreduce(np.arange(n, dtype=np.float64) * (r + 1)) for n in counts]

    results = in_threads([partial(rank, r) for r in range(size)])
    factor = size * (size + 1) // 2
    for got in results:
        for n, y in zip(counts, got, strict=True):
            np.testing.assert_allclose(y, np.arange(n, dtype=np.float64) * factor)


def _plait_mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum("memfd:plait" in line or "/dev/shm/plait" in line for line in f)


def test_closing_unmaps_the_segments_without_the_collector() -> None:
    """A one-sided call's generated run sat in its own globals (a function in the dict it
    reads: a cycle), which held views of the window: a closed communicator's segments stayed
    mapped until the cycle collector ran (16 MiB per init and close of 2 ranks)."""
    gc.collect()
    before = _plait_mappings()
    gc.disable()
    try:
        ts = _make(2)
        comms = [plait.init(transport=t, timeout=30) for t in ts]

        def rank(r: int) -> tuple[float, bool]:
            with comms[r] as comm:
                total = float(comm.allreduce(np.ones(4), algorithm="arena_oneshot")[0])
                return total, _plait_mappings() > before

        assert in_threads([partial(rank, r) for r in range(2)]) == [(2.0, True)] * 2
        comms.clear()  # the last references (a closed communicator keeps its transport)
        ts.clear()
        assert _plait_mappings() == before
    finally:
        gc.enable()


# -- real processes --------------------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import os, sys
    import numpy as np
    import plait
    from plait.rendezvous.tcp_store import TCPStore
    from plait.transport.shm import ShmTransport

    port, rank, size, mode = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    store = TCPStore("127.0.0.1", port, timeout=30)
    transport = None
    if mode == "expect-lost":  # a peer dies in the set-up: how long, and what is said
        import time
        start = time.monotonic()
        try:
            ShmTransport(rank, size, store, timeout=30)
        except plait.PeerLostError as exc:
            print(f"{time.monotonic() - start:.2f}|{exc.lost_rank}|{exc}", flush=True)
    elif mode != "dies-before-dialling":
        transport = ShmTransport(rank, size, store, timeout=30)
    if mode == "allreduce":
        with plait.init(transport=transport, timeout=30) as comm:
            for n in (1, 1000, 1 << 20):
                y = comm.allreduce(np.arange(n, dtype=np.float64) + rank)
                expect = np.arange(n, dtype=np.float64) * size + size * (size - 1) / 2
                assert np.array_equal(y, expect), n
        print("ok", transport.bytes_sent, transport.bytes_received)
    elif mode == "dies-before-dialling":  # announced itself, then dies before it dials
        import signal
        from plait.transport.shm import bootstrap

        bootstrap._Join._connect = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
        ShmTransport(rank, size, store, timeout=30)
    elif mode in ("stream", "fork-stream"):  # send forever until killed
        if mode == "fork-stream":  # a grandchild keeps our sockets open after we die
            child = os.fork()
            if child == 0:
                sys.stdin.read()  # until the test closes our stdin (or dies)
                os._exit(0)
            print(child, flush=True)
        data = np.ones(16 << 20, np.uint8)
        print("streaming", flush=True)
        while True:
            h = transport.isend(0, 1, memoryview(data), 0)
            while not transport.wait_any([h], 30):
                pass
    store.close()
    """
)


def _spawn(port: int, rank: int, size: int, mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-W", "error", "-c", CHILD, str(port), str(rank), str(size), mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _outputs(procs: list[subprocess.Popen[str]]) -> list[tuple[str, str]]:
    """Each process's (stdout, stderr) once it ends; those still running after 60 s killed."""
    try:
        return [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture
def store_server() -> Iterator[int]:
    tcp_store = pytest.importorskip("plait.rendezvous.tcp_store")
    server = tcp_store.TCPStoreServer("127.0.0.1", 0)
    try:
        yield server.port
    finally:
        server.close()


@pytest.mark.multiprocess
def test_the_highest_rank_dying_in_the_set_up_fails_the_others_at_once(store_server: int) -> None:
    """The highest rank of a host dials nobody: where it died after announcing its segment and
    before dialling the others, they waited out the whole timeout for its connection (the
    30 s here, 300 by default) and said only that it "did not connect"."""
    procs = [_spawn(store_server, r, 3, "expect-lost") for r in range(2)]
    procs.append(_spawn(store_server, 2, 3, "dies-before-dialling"))
    outs = _outputs(procs)
    for r in range(2):
        took, lost, said = outs[r][0].strip().split("|", 2)
        assert float(took) < 5, outs[r]
        assert lost == "2", outs[r]
        assert "rank 2 was lost" in said, outs[r]


@pytest.mark.multiprocess
def test_two_processes_allreduce(store_server: int) -> None:
    procs = [_spawn(store_server, r, 2, "allreduce") for r in range(2)]
    outs = _outputs(procs)
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
        assert out.startswith("ok"), (out, err)


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["stream", "fork-stream"])
def test_sigkill_mid_transfer(store_server: int, mode: str) -> None:
    """A killed peer is noticed at once (end-of-file), or within ~1 s by its pid when a
    process it forked keeps its sockets open."""
    from plait.rendezvous.tcp_store import TCPStore

    child = _spawn(store_server, 1, 2, mode)
    grandchild = 0
    store = TCPStore("127.0.0.1", store_server, timeout=30)
    try:
        t = ShmTransport(0, 2, store, timeout=30)
        with t:
            assert child.stdout is not None
            if mode == "fork-stream":
                grandchild = int(child.stdout.readline())
            assert child.stdout.readline().strip() == "streaming"
            dst = np.zeros(16 << 20, np.uint8)
            ok(t, t.irecv(1, 1, mv(dst), 0))  # a whole message first
            for _ in range(50):  # then kill it in the middle of a message
                h = t.irecv(1, 1, mv(dst), 0)
                target = t.bytes_received + (8 << 20)
                while t.bytes_received < target and not h.done:
                    t.wait_any([h], 0.0001)
                if not h.done:  # (if the whole message slipped through, try the next)
                    break
            if h.done:  # on a busy machine every message may slip through whole: kill between
                h = t.irecv(1, 1, mv(dst), 0)
            child.send_signal(signal.SIGKILL)
            start = time.monotonic()
            assert t.wait_any([h], 10)
            if h.error is None:
                # The rest of the message was already in the shared ring when the kill landed:
                # those bytes are delivered. A whole next message cannot fit in the ring, so
                # the loss shows on it.
                h = t.irecv(1, 1, mv(dst), 0)
                assert t.wait_any([h], 10)
            assert time.monotonic() - start < 2.5
            assert isinstance(h.error, PeerLostError)
            assert "rank 1 was lost" in str(h.error)
            late = t.isend(1, 2, mv(np.zeros(1, np.uint8)), 0)
            assert isinstance(late.error, PeerLostError)
    finally:
        store.close()
        if child.poll() is None:
            child.kill()
        if grandchild:  # it holds the child's stdout open, too
            os.kill(grandchild, signal.SIGKILL)
        child.communicate(timeout=10)


def test_spin_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from plait.transport.shm import _spin_from_env

    monkeypatch.delenv("PLAIT_SHM_SPIN", raising=False)
    assert _spin_from_env() == pytest.approx(50e-6)
    monkeypatch.setenv("PLAIT_SHM_SPIN", "1000")
    assert _spin_from_env() == pytest.approx(1e-3)
    monkeypatch.setenv("PLAIT_SHM_SPIN", "0")
    assert _spin_from_env() == 0.0
    for bad in ("fast", "-1", "nan"):
        monkeypatch.setenv("PLAIT_SHM_SPIN", bad)
        with pytest.raises(ValueError, match="PLAIT_SHM_SPIN"):
            _spin_from_env()
