"""TCP transport specifics: striping, addresses, bootstrap, threads, processes, Communicator."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from tcp_helpers import SelectWatch, no_leaks, tcp_transports  # noqa: F401 (fixture)

from plait._net import route_to
from plait.communicator import Communicator
from plait.errors import (
    ClosedError,
    CommTimeout,
    PeerLostError,
    RendezvousError,
    TransportError,
)
from plait.rendezvous.store import MemoryStore, PrefixStore
from plait.transport.conformance import build_in_threads, run_ranks, wait_all
from plait.transport.tcp import (
    SOCKET_BUFFER,
    STRIPE_MIN,
    BootstrapTimeout,
    IfnameSpec,
    PeerProtocolError,
    TcpTransport,
    interface_addresses,
    interfaces,
    match_ifnames,
    parse_ifname,
    select_interface_address,
)

pytestmark = pytest.mark.usefixtures("no_leaks")


def _pattern(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def _build_each(size: int, kwargs_of: dict[int, dict], store: MemoryStore | None = None) -> dict:
    """Build ranks ``kwargs_of`` on threads; {rank: transport or exception}."""
    store = store or MemoryStore(timeout=30.0)
    out: dict[int, object] = {}

    def body(rank: int) -> None:
        try:
            out[rank] = TcpTransport(rank, size, store, **kwargs_of[rank])
        except BaseException as exc:
            out[rank] = exc

    threads = [threading.Thread(target=body, args=(r,)) for r in kwargs_of]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30.0)
    return out


def _drive_until(
    t: TcpTransport, cond: Callable[[], bool], what: str, timeout: float = 10.0
) -> None:
    """Drive ``t`` from this thread until ``cond()`` holds; fail saying ``what`` never happened.

    Each round waits in the transport for at most 10 ms (in its epoll, so bytes that
    arrive are handled at once), then looks at ``cond()`` again.
    """
    deadline = time.monotonic() + timeout
    while not cond():
        left = deadline - time.monotonic()
        assert left > 0, f"rank {t.rank}: {what} within {timeout} s"
        t.wait_any([], min(left, 0.01))


def _close(objs: object) -> None:
    for x in objs.values() if isinstance(objs, dict) else objs:  # type: ignore[attr-defined]
        if isinstance(x, TcpTransport):
            x.close()


# -- striping --------------------------------------------------------------------------------------

STRIPED_SIZES = [
    8,
    STRIPE_MIN - 1,
    STRIPE_MIN,
    0,
    STRIPE_MIN + 1,
    1_000_003,
    5,
    (8 << 20) + 5,
    64,
]


@pytest.mark.parametrize("streams", [2, 3])
def test_striped_messages_arrive_intact_and_in_order(streams: int) -> None:
    ts = tcp_transports(2, streams=streams)
    try:
        assert all(t.streams == streams for t in ts)

        def body(t: TcpTransport) -> list[np.ndarray]:
            other = 1 - t.rank
            got = [np.zeros(n, np.uint8) for n in STRIPED_SIZES]
            hs = []
            # Half the receives posted before the data comes, half after.
            hs += [t.irecv(other, 7, g.data, 1) for g in got[:4]]
            hs += [
                t.isend(other, 7, _pattern(n, 10 * t.rank + i).data, 1)
                for i, n in enumerate(STRIPED_SIZES)
            ]
            # The rest only once the peer's messages (eager ones or announcements of large
            # ones) wait unmatched here.
            _drive_until(
                t,
                lambda: len(t._unexpected.get((other, 7), ())) == len(got) - 4,
                f"the unmatched messages from rank {other} did not arrive",
            )
            hs += [t.irecv(other, 7, g.data, 1) for g in got[4:]]
            wait_all(t, hs)
            assert all(h.error is None for h in hs), [h.error for h in hs]
            return got

        results = run_ranks(ts, body)
        for r in range(2):
            for i, n in enumerate(STRIPED_SIZES):
                np.testing.assert_array_equal(
                    results[r][i], _pattern(n, 10 * (1 - r) + i), err_msg=f"rank {r} msg {i}"
                )
        striped = sum(n >= STRIPE_MIN for n in STRIPED_SIZES)
        for t in ts:
            peer = t._link.peers[1 - t.rank]
            assert peer is not None
            assert len(peer.conns) == streams
            assert (peer.seq_out, peer.seq_in) == (striped, striped)
    finally:
        _close(ts)


def test_streams_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLAIT_TCP_STREAMS", "3")
    ts = tcp_transports(2)
    try:
        assert [t.streams for t in ts] == [3, 3]
        data = _pattern(3 << 20, 1)
        got = np.zeros_like(data)

        def body(t: TcpTransport) -> None:
            h = t.isend(1, 0, data.data, 0) if t.rank == 0 else t.irecv(0, 0, got.data, 0)
            wait_all(t, [h])
            assert h.error is None

        run_ranks(ts, body)
        np.testing.assert_array_equal(got, data)
    finally:
        _close(ts)


@pytest.mark.parametrize("value", ["0", "x", "65"])
def test_bad_streams_setting(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("PLAIT_TCP_STREAMS", value)
    with pytest.raises(ValueError, match=r"PLAIT_TCP_STREAMS|streams"):
        TcpTransport(0, 1, MemoryStore())


def test_ranks_that_disagree_on_streams_fail_fast() -> None:
    start = time.monotonic()
    out = _build_each(2, {0: {"streams": 1, "timeout": 20}, 1: {"streams": 2, "timeout": 20}})
    try:
        assert time.monotonic() - start < 10
        for r in (0, 1):
            assert isinstance(out[r], RendezvousError), out[r]
            assert not isinstance(out[r], CommTimeout), out[r]
            assert "streams" in str(out[r])
    finally:
        _close(out)


# -- bootstrap -------------------------------------------------------------------------------------


def test_bootstrap_timeout_names_the_missing_ranks() -> None:
    out = _build_each(3, {0: {"timeout": 0.5}, 1: {"timeout": 0.5}})
    try:
        for r in (0, 1):
            err = out[r]
            assert isinstance(err, BootstrapTimeout), err
            assert isinstance(err, RendezvousError)
            assert isinstance(err, CommTimeout)
            assert f"rank {r}" in str(err)
            assert "[2]" in str(err), str(err)
    finally:
        _close(out)
    with pytest.raises(BootstrapTimeout, match=r"rank 2: rank\(s\) \[0, 1\] never published"):
        TcpTransport(2, 3, MemoryStore(), timeout=0.3)


def _assert_hung_up(s: socket.socket) -> None:
    """Read ``s`` until the other side closes it (EOF or reset); fail on its timeout."""
    try:
        while s.recv(4096):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        pytest.fail("rank 0 never dropped the connection that sent garbage")


def test_garbage_connections_are_ignored() -> None:
    store = MemoryStore(timeout=10)
    result: dict[int, object] = {}

    def rank0() -> None:
        try:
            result[0] = TcpTransport(0, 2, store, timeout=10)
        except BaseException as exc:
            result[0] = exc

    th = threading.Thread(target=rank0)
    th.start()
    try:
        host, _, port = store.get("tcp/addr/0", 5).decode().rpartition(":")
        junk = []
        for payload in (b"GET / HTTP/1.0\r\n\r\n" * 4, b"", b"PLTC"):
            s = socket.create_connection((host, int(port)), timeout=5)
            if payload:
                s.sendall(payload)
            junk.append(s)
        junk[1].close()  # connects and leaves at once
        # Rank 0 has taken in the junk before rank 1 comes: it greets every connection it
        # accepts (in order, so junk[1] too), and hangs up on the one that fails the handshake.
        assert junk[2].recv(1), "rank 0 never accepted the connections"
        _assert_hung_up(junk[0])
        result[1] = TcpTransport(1, 2, store, timeout=10)
        th.join(10)
        assert isinstance(result[0], TcpTransport), result[0]
        a, b = result[0], result[1]
        assert isinstance(b, TcpTransport)
        got = np.zeros(4, np.uint8)
        hs = [b.irecv(0, 1, got.data, 0)]
        a.isend(1, 1, np.arange(4, dtype=np.uint8).data, 0)
        wait_all(b, hs)
        assert got.tolist() == [0, 1, 2, 3]
    finally:
        th.join(10)
        for s in junk:
            s.close()
        _close(result)


def test_size_one_needs_no_peers() -> None:
    t = TcpTransport(0, 1, MemoryStore(), timeout=5)
    try:
        got = np.zeros(3, np.uint8)
        hs = [t.isend(0, 1, np.array([1, 2, 3], np.uint8).data, 0)]
        hs.append(t.irecv(0, 1, got.data, 0))
        wait_all(t, hs)
        assert got.tolist() == [1, 2, 3]
    finally:
        t.close()


def test_bad_arguments() -> None:
    store = MemoryStore()
    with pytest.raises(ValueError, match="size"):
        TcpTransport(0, 0, store)
    with pytest.raises(ValueError, match="rank 2 is out of range"):
        TcpTransport(2, 2, store)
    with pytest.raises(ValueError, match="timeout"):
        TcpTransport(0, 1, store, timeout=0)
    ts = tcp_transports(2)
    try:
        buf = np.zeros(4, np.uint8).data
        with pytest.raises(ValueError, match="peer 2 is out of range"):
            ts[0].isend(2, 0, buf, 0)
        with pytest.raises(ValueError, match="peer -1 is out of range"):
            ts[0].irecv(-1, 0, buf, 0)
        with pytest.raises(ValueError, match="tag"):
            ts[0].isend(1, 1 << 64, buf, 0)
        with pytest.raises(ValueError, match="read-only"):
            ts[0].irecv(1, 0, memoryview(b"abcd"), 0)
    finally:
        _close(ts)


# -- addresses -------------------------------------------------------------------------------------


def test_parse_ifname() -> None:
    assert parse_ifname("eth0") == IfnameSpec(("eth0",), exclude=False, exact=False)
    assert parse_ifname("^docker,lo") == IfnameSpec(("docker", "lo"), exclude=True, exact=False)
    assert parse_ifname("=eth0,ib0") == IfnameSpec(("eth0", "ib0"), exclude=False, exact=True)
    assert parse_ifname(" ^=lo ") == IfnameSpec(("lo",), exclude=True, exact=True)
    for bad in ("", "^", "=", " , "):
        with pytest.raises(ValueError, match="names no interface"):
            parse_ifname(bad)


def test_match_ifnames() -> None:
    names = ["lo", "eth0", "eth1", "docker0", "veth12", "ens3", "eth00"]
    assert match_ifnames("eth", names) == ["eth0", "eth1", "eth00"]
    assert match_ifnames("=eth0", names) == ["eth0"]
    assert match_ifnames("^docker,lo", names) == ["eth0", "eth1", "veth12", "ens3", "eth00"]
    assert match_ifnames("^=eth0,lo", names) == ["eth1", "docker0", "veth12", "ens3", "eth00"]
    assert match_ifnames("ib", names) == []
    assert match_ifnames(parse_ifname("ens,veth"), names) == ["veth12", "ens3"]


def test_loopback_interface_address() -> None:
    if "lo" not in [n for _, n in socket.if_nameindex()]:
        pytest.skip("no interface named lo")
    assert "127.0.0.1" in interface_addresses("lo")
    assert select_interface_address("=lo") == "127.0.0.1"
    with pytest.raises(ValueError, match="no network interface"):
        select_interface_address("=no-such-interface0")


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_ifname_selects_the_listening_address(how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if "lo" not in [n for _, n in socket.if_nameindex()]:
        pytest.skip("no interface named lo")
    if how == "environment":
        monkeypatch.setenv("PLAIT_SOCKET_IFNAME", "=lo")
        ts = tcp_transports(2)
    else:
        monkeypatch.setenv("PLAIT_SOCKET_IFNAME", "=no-such-interface0")  # the argument wins
        ts = tcp_transports(2, ifname="lo")
    try:
        assert all(t.address.startswith("127.0.0.1:") for t in ts), [t.address for t in ts]
    finally:
        _close(ts)


def test_default_address_follows_the_store_host() -> None:
    class HostStore(MemoryStore):
        host = "localhost"

    assert interfaces.store_host(MemoryStore()) is None
    assert interfaces.store_host(PrefixStore("group", HostStore())) == "localhost"
    assert route_to("localhost") in ("127.0.0.1", "::1")
    assert route_to("127.0.0.5") == "127.0.0.1"
    t = TcpTransport(0, 1, HostStore(), timeout=5)
    try:
        assert t.address.startswith(("127.0.0.1:", "[::1]:"))
    finally:
        t.close()


@pytest.mark.parametrize("autotune", [0, 64 << 20])
def test_socket_buffers(monkeypatch: pytest.MonkeyPatch, autotune: int) -> None:
    """Buffers are raised to SOCKET_BUFFER only where kernel autotuning cannot get there."""
    monkeypatch.setattr(interfaces, "_autotune_max", lambda opt: autotune)
    with socket.socket() as s:
        before = [s.getsockopt(socket.SOL_SOCKET, o) for o in (socket.SO_SNDBUF, socket.SO_RCVBUF)]
        interfaces.tune(s)
        after = [s.getsockopt(socket.SOL_SOCKET, o) for o in (socket.SO_SNDBUF, socket.SO_RCVBUF)]
    if autotune:
        assert after == before
    else:
        for b, a in zip(before, after, strict=True):
            assert a >= min(b, SOCKET_BUFFER)
            assert a > b or b >= SOCKET_BUFFER


def _ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
def test_ipv6_loopback() -> None:
    store = MemoryStore(timeout=10)
    ts = build_in_threads(2, lambda r: TcpTransport(r, 2, store, host="::1", timeout=10))
    try:
        assert store.get("tcp/addr/0").decode().startswith("[::1]:")
        assert all(t.address.startswith("[::1]:") for t in ts)
        data = _pattern(1 << 20, 3)
        got = np.zeros_like(data)

        def body(t: TcpTransport) -> None:
            h = t.isend(1, 0, data.data, 0) if t.rank == 0 else t.irecv(0, 0, got.data, 0)
            wait_all(t, [h])
            assert h.error is None

        run_ranks(ts, body)
        np.testing.assert_array_equal(got, data)
    finally:
        _close(ts)


# -- threads sharing a transport -------------------------------------------------------------------


def test_waiting_thread_takes_over_driving() -> None:
    """When the driving thread's handle completes, a thread still waiting must drive on."""
    ts = tcp_transports(2)
    try:
        a, b = ts
        watch = SelectWatch(b)
        waiting = threading.Event()  # set by a thread that waits for b's driver

        class Watched(threading.Condition):
            def wait(self, timeout: float | None = None) -> bool:
                waiting.set()  # b's lock stays held until wait() lets go of it
                return super().wait(timeout)

        b._cond = Watched(b._lock)
        got = {1: np.zeros(8, np.uint8), 2: np.zeros(8, np.uint8)}
        done_at: dict[int, float] = {}
        cpu: dict[int, float] = {}

        def waiter(tag: int) -> None:
            h = b.irecv(0, tag, got[tag].data, 0)
            start = time.thread_time()
            wait_all(b, [h], timeout=10)
            cpu[tag] = time.thread_time() - start
            done_at[tag] = time.monotonic()

        first = threading.Thread(target=waiter, args=(1,))
        first.start()
        watch.wait_blocked(first)  # the first thread drives, blocked in select()
        second = threading.Thread(target=waiter, args=(2,))
        second.start()
        assert waiting.wait(10), "the second thread never waited for the driver"
        wait_all(a, [a.isend(1, 1, np.full(8, 1, np.uint8).data, 0)])
        first.join(10)  # the first thread returns; the second must take over
        assert not first.is_alive()
        watch.wait_blocked(second)
        sent = time.monotonic()
        wait_all(a, [a.isend(1, 2, np.full(8, 2, np.uint8).data, 0)])
        first.join(10)
        second.join(10)
        assert set(done_at) == {1, 2}
        assert done_at[2] - sent < 1.0
        assert got[1].tolist() == [1] * 8
        assert got[2].tolist() == [2] * 8
        assert max(cpu.values()) < 0.2, f"waiting threads burnt CPU: {cpu}"
    finally:
        _close(ts)


@pytest.mark.parametrize("nbytes", [16, 2 << 20])
def test_send_from_a_thread_while_another_drives(nbytes: int) -> None:
    """A send posted while another thread blocks in select() goes out without delay."""
    ts = tcp_transports(2, streams=2)
    try:
        a, b = ts
        reply = np.zeros(1, np.uint8)
        driver_done = threading.Event()

        def driver() -> None:  # waits for the reply that comes after b got the data
            wait_all(a, [a.irecv(1, 9, reply.data, 0)], timeout=10)
            driver_done.set()

        watch = SelectWatch(a)
        th = threading.Thread(target=driver)
        th.start()
        watch.wait_blocked(th)
        data = _pattern(nbytes, 5)
        got = np.zeros_like(data)
        h = a.isend(1, 1, data.data, 0)  # the driver is in select() now
        r = b.irecv(0, 1, got.data, 0)
        start = time.monotonic()
        wait_all(b, [r], timeout=10)
        assert time.monotonic() - start < 2.0
        wait_all(a, [h], timeout=10)
        assert h.error is None
        assert r.error is None
        np.testing.assert_array_equal(got, data)
        wait_all(b, [b.isend(0, 9, np.ones(1, np.uint8).data, 0)])
        th.join(10)
        assert driver_done.is_set()
    finally:
        _close(ts)


# -- cancel and close ------------------------------------------------------------------------------


@pytest.mark.slow  # 32 MiB, cancelled midway
def test_cancel_partially_received_message() -> None:
    """A receive cancelled mid-payload is never written again; the stream stays in step."""
    ts = tcp_transports(2)
    try:
        a, b = ts
        n = 32 << 20
        big = (np.arange(n, dtype=np.uint64) % 251).astype(np.uint8)  # never 0xFF
        small = _pattern(100, 1)
        hs = [a.isend(1, 3, big.data, 0)]  # announced; a drives only in short bursts below
        buf = np.full(n, 0xFF, np.uint8)
        r = b.irecv(0, 3, buf.data, 0)
        written = 0
        for _ in range(500):  # the handshake, then a socket buffer's worth of payload
            a.wait_any(hs, 0.005)
            b.wait_any([r], 0.005)
            written = int(np.count_nonzero(buf != 0xFF))
            if written:
                break
        assert not r.done, "the whole message arrived; the test needs a partial one"
        assert 0 < written < n, written
        b.cancel(r)
        assert r.done
        assert r.error is None
        snapshot = buf.copy()
        hs.append(a.isend(1, 3, small.data, 0))
        got = np.zeros(100, np.uint8)
        r2 = b.irecv(0, 3, got.data, 0)

        def drive_a() -> None:
            wait_all(a, hs)

        th = threading.Thread(target=drive_a)
        th.start()
        wait_all(b, [r2])
        th.join(10)
        assert r2.error is None
        np.testing.assert_array_equal(got, small)
        np.testing.assert_array_equal(buf, snapshot)
    finally:
        _close(ts)


def test_cancel_partially_written_send() -> None:
    """Cancelling a half-written send frees its buffer; the peer still gets a whole frame."""
    ts = tcp_transports(2)
    try:
        a, b = ts
        n = 32 << 20
        data = _pattern(n, 2)
        expected = data.copy()
        got = np.zeros(n, np.uint8)
        r = b.irecv(0, 3, got.data, 0)
        h = a.isend(1, 3, data.data, 0)
        conn = a._link.peers[1].conns[0]  # type: ignore[union-attr]
        for _ in range(500):  # until the payload has started (b reads nothing of it yet)
            if conn.sendq and conn.sendq[0].op is h and conn.sendq[0].off > 0:
                break
            b.wait_any([r], 0)  # reads the announcement and answers it
            a.wait_any([h], 0.005)
        assert not h.done
        assert conn.sendq[0].op is h, "the payload never started"
        a.cancel(h)
        assert h.done
        data[:] = 0  # the caller owns the buffer again

        def drive_a() -> None:
            dummy = a.irecv(1, 50, np.zeros(1, np.uint8).data, 0)
            wait_all(a, [dummy])

        ta = threading.Thread(target=drive_a)
        ta.start()
        wait_all(b, [r], timeout=20)
        wait_all(b, [b.isend(0, 50, np.zeros(1, np.uint8).data, 0)])
        ta.join(10)
        assert r.error is None
        np.testing.assert_array_equal(got, expected)
    finally:
        _close(ts)


def test_operations_after_close() -> None:
    ts = tcp_transports(2)
    try:
        a, b = ts
        pending = a.irecv(1, 1, np.zeros(4, np.uint8).data, 0)
        a.close()
        a.close()
        assert isinstance(pending.error, ClosedError)
        assert "rank 0" in str(pending.error)
        for h in (
            a.isend(1, 1, np.zeros(4, np.uint8).data, 0),
            a.irecv(1, 1, np.zeros(4, np.uint8).data, 0),
        ):
            assert h.done
            assert isinstance(h.error, ClosedError)
        assert a.wait_any([pending], 0.1) is True
        r = b.irecv(0, 1, np.zeros(4, np.uint8).data, 0)
        wait_all(b, [r], timeout=5)
        assert isinstance(r.error, PeerLostError)
        assert "rank 0 has closed its communicator" in str(r.error)
    finally:
        _close(ts)


def test_close_while_another_thread_waits() -> None:
    ts = tcp_transports(2)
    try:
        a = ts[0]
        h = a.irecv(1, 1, np.zeros(4, np.uint8).data, 0)
        result: list[bool] = []
        watch = SelectWatch(a)
        th = threading.Thread(target=lambda: result.append(a.wait_any([h], 10)))
        th.start()
        watch.wait_blocked(th)  # close() must wake it from select()
        start = time.monotonic()
        a.close()
        th.join(5)
        assert result == [True]
        assert time.monotonic() - start < 3
        assert isinstance(h.error, ClosedError)
    finally:
        _close(ts)


def test_a_wait_for_a_handle_done_meanwhile_does_not_spin() -> None:
    """A waiter that gets the lock after another thread completed its handle returns at
    once: before, it spun first (the whole spin, up to PLAIT_TCP_SPIN, lock held)."""
    ts = tcp_transports(2)
    try:
        a, b = ts
        got = np.zeros(8, np.uint8)
        h = b.irecv(0, 5, got.data, 0)
        wait_all(a, [a.isend(1, 5, np.full(8, 5, np.uint8).data, 0)])
        spins: list[float | None] = []
        spin = b._spin

        def counted(deadline: float | None) -> bool:
            spins.append(deadline)
            return spin(deadline)

        b._spin = counted  # type: ignore[method-assign]
        b.spin = 5.0
        with b._lock:  # as another thread would: drive until the message is in
            deadline = time.monotonic() + 10
            while not h.done and time.monotonic() < deadline:
                b._progress(False)
            assert h.done
            # ... and then the waiter, which found h running before it took the lock
            assert b._wait([h], time.monotonic() + 10)
        assert spins == []
        assert got.tolist() == [5] * 8
    finally:
        _close(ts)


def test_connection_reset_fails_with_peer_lost_and_the_os_error_as_cause() -> None:
    ts = tcp_transports(2)
    try:
        a, b = ts
        h = a.irecv(1, 1, np.zeros(4, np.uint8).data, 0)
        conn = b._link.peers[0].conns[0]  # type: ignore[union-attr]
        assert conn.sock is not None
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        b._link.drop(conn)  # closing with linger 0 resets the connection
        wait_all(a, [h], timeout=5)
        assert isinstance(h.error, PeerLostError), h.error
        assert "rank 0: connection to rank 1 lost" in str(h.error)
        assert isinstance(h.error.__cause__, ConnectionResetError), h.error.__cause__
    finally:
        _close(ts)


def test_protocol_garbage_fails_with_peer_protocol_error() -> None:
    ts = tcp_transports(2)
    try:
        a, b = ts
        h = a.irecv(1, 1, np.zeros(4, np.uint8).data, 0)
        conn = b._link.peers[0].conns[0]  # type: ignore[union-attr]
        assert conn.sock is not None
        conn.sock.send(b"\x09" + b"\0" * 23)  # a frame kind that does not exist
        wait_all(a, [h], timeout=5)
        # The peer counts as lost, and the error says it broke the protocol.
        assert isinstance(h.error, PeerProtocolError), h.error
        assert isinstance(h.error, PeerLostError)
        assert isinstance(h.error, TransportError)
        assert "protocol error" in str(h.error)
        later = a.isend(1, 1, np.zeros(4, np.uint8).data, 0)
        assert isinstance(later.error, TransportError)
    finally:
        _close(ts)


# -- processes -------------------------------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import sys, numpy as np
    from plait.rendezvous.tcp_store import TCPStore
    from plait.transport.tcp import TcpTransport

    port, mode = int(sys.argv[1]), sys.argv[2]
    store = TCPStore("127.0.0.1", port, timeout=30)
    t = TcpTransport(1, 2, store, timeout=30)

    def wait(h):
        while not h.done:
            t.wait_any([h], 30)
        if h.error is not None:
            raise h.error

    if mode == "echo":
        buf = np.zeros(3 << 20, np.uint8)
        wait(t.irecv(0, 1, buf.data, 7))
        buf += 1
        wait(t.isend(0, 2, buf.data, 7))
    else:  # flood: big messages until killed
        data = np.full(32 << 20, 7, np.uint8)
        while True:
            wait(t.isend(0, 1, data.data, 0))
    t.close()
    store.close()
    """
)


@pytest.fixture
def store_server():
    tcp_store = pytest.importorskip("plait.rendezvous.tcp_store")
    server = tcp_store.TCPStoreServer("127.0.0.1", 0)
    client = tcp_store.TCPStore("127.0.0.1", server.port, timeout=30)
    try:
        yield server.port, client
    finally:
        client.close()
        server.close()


@contextlib.contextmanager
def _child(port: int, mode: str) -> Iterator[subprocess.Popen]:
    """Rank 1 in a child process; killed (if still running) and reaped on exit."""
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(port), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        yield child
    finally:
        if child.poll() is None:
            child.kill()
        child.communicate(timeout=30)


def _rank0(store: object, child: subprocess.Popen) -> TcpTransport:
    try:
        return TcpTransport(0, 2, store, timeout=30)  # type: ignore[arg-type]
    except BootstrapTimeout as exc:
        if child.poll() is None:
            child.kill()
        _, err = child.communicate(timeout=30)
        raise AssertionError(f"the child never connected; its stderr:\n{err.decode()}") from exc


def test_peer_in_another_process(store_server) -> None:
    port, store = store_server
    with _child(port, "echo") as child:
        t = _rank0(store, child)
        try:
            data = _pattern(3 << 20, 4)
            got = np.zeros_like(data)
            hs = [t.isend(1, 1, data.data, 7), t.irecv(1, 2, got.data, 7)]
            wait_all(t, hs, timeout=30)
            assert [h.error for h in hs] == [None, None]
            np.testing.assert_array_equal(got, data + 1)
        finally:
            t.close()
        assert child.wait(30) == 0, child.stderr.read().decode()  # type: ignore[union-attr]


def test_killed_peer_process_fails_the_survivor_promptly(store_server) -> None:
    port, store = store_server
    with _child(port, "flood") as child:
        t = _rank0(store, child)
        try:
            buf = np.zeros(32 << 20, np.uint8)
            first = t.irecv(1, 1, buf.data, 0)
            wait_all(t, [first], timeout=30)
            assert first.error is None
            assert (buf == 7).all()
            second = t.irecv(1, 1, buf.data, 0)
            t.wait_any([second], 0.005)  # the next message is on its way
            os.kill(child.pid, signal.SIGKILL)
            killed = time.monotonic()
            # Messages that arrived whole before the kill may still complete; the first
            # one that cannot must fail, promptly.
            h = second
            for _ in range(20):
                wait_all(t, [h], timeout=10)
                if h.error is not None:
                    break
                assert (buf == 7).all()
                h = t.irecv(1, 1, buf.data, 0)
            assert time.monotonic() - killed < 2.0
            assert isinstance(h.error, PeerLostError), h.error
            assert "rank 0: connection to rank 1 lost" in str(h.error)
            h = t.irecv(1, 1, buf.data, 0)
            assert isinstance(h.error, PeerLostError), h.error
            h = t.isend(1, 5, buf[:10].data, 0)
            wait_all(t, [h])
            assert isinstance(h.error, PeerLostError)
        finally:
            t.close()


# -- the Communicator over TCP ---------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
def test_communicator_allreduce_over_tcp(size: int) -> None:
    comms = [Communicator(t, timeout=30) for t in tcp_transports(size)]
    inputs = {
        n: [np.random.default_rng(100 * r + n).standard_normal(n) for r in range(size)]
        for n in (1, 7, 1000, 300_000)
    }
    try:

        def body(comm: Communicator) -> dict[int, np.ndarray]:
            r = comm.rank
            out = {}
            work = comm.allreduce(inputs[7][r], async_op=True)  # runs on the worker thread
            for n, xs in inputs.items():
                if n != 7:
                    out[n] = comm.allreduce(xs[r])  # meanwhile, from this thread
            out[7] = work.wait(30)
            return out

        results = run_ranks(comms, body)  # type: ignore[arg-type]
        for n, xs in inputs.items():
            expected = np.sum(xs, axis=0)
            for r in range(size):
                np.testing.assert_allclose(results[r][n], expected, rtol=1e-12, atol=1e-12)
            for r in range(1, size):  # every rank holds bit-identical results
                np.testing.assert_array_equal(results[r][n], results[0][n])
    finally:
        for c in comms:
            c.close()


@pytest.mark.slow
def test_strangers_and_wrong_secrets_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Junk and a client without the secret are dropped; the job goes on unaffected."""
    import os as _os
    import socket as _socket
    import threading as _threading

    import numpy as _np

    from plait import _auth
    from plait.rendezvous.store import MemoryStore
    from plait.transport.tcp import TcpTransport

    monkeypatch.setenv("PLAIT_SECRET", "the-job-secret")
    store = MemoryStore(timeout=30)
    made: dict[int, TcpTransport] = {}
    errors: list[BaseException] = []

    def build(rank: int) -> None:
        try:
            made[rank] = TcpTransport(rank, 2, store, timeout=30)
        except BaseException as exc:
            errors.append(exc)

    t1 = _threading.Thread(target=build, args=(1,))  # rank 1 dials rank 0, which accepts
    t0 = _threading.Thread(target=build, args=(0,))
    t0.start()
    host, port = store.get("tcp/addr/0", 30).decode().rsplit(":", 1)
    addr = (host.strip("[]"), int(port))
    for junk in (_os.urandom(4096), b"\0" * 100, b"GET / HTTP/1.0\r\n\r\n" * 5):
        with _socket.create_connection(addr, timeout=10) as raw:
            raw.recv(_auth.CHALLENGE_BYTES)
            raw.sendall(junk)
            raw.settimeout(10)
            # Refused, then dropped: end of file, or a reset when our junk was left unread.
            got = b""
            with contextlib.suppress(ConnectionResetError):
                while chunk := raw.recv(4096):
                    got += chunk
            assert got in (b"", _auth.REFUSED)
    with _socket.create_connection(addr, timeout=10) as raw, pytest.raises(_auth.AuthError):
        _auth.client_handshake(raw, b"not-the-secret", 10, "intruder")
    t1.start()
    t0.join(60)
    t1.join(60)
    assert not errors, errors
    a, b = made[0], made[1]
    try:
        src = _np.arange(10, dtype=_np.int64)
        dst = _np.zeros(10, _np.int64)
        s = a.isend(1, 5, memoryview(src).cast("B"), 0)
        r = b.irecv(0, 5, memoryview(dst).cast("B"), 0)
        while not (s.done and r.done):
            a.wait_any([s], 1)
            b.wait_any([r], 1)
        assert _np.array_equal(dst, src)
    finally:
        a.close()
        b.close()


def test_spin_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from plait.transport.tcp import _spin_from_env

    monkeypatch.delenv("PLAIT_TCP_SPIN", raising=False)
    assert _spin_from_env() == pytest.approx(50e-6)
    monkeypatch.setenv("PLAIT_TCP_SPIN", "0")
    assert _spin_from_env() == 0.0
    monkeypatch.setenv("PLAIT_TCP_SPIN", "250")
    assert _spin_from_env() == pytest.approx(250e-6)
    for bad in ("soon", "-5"):
        monkeypatch.setenv("PLAIT_TCP_SPIN", bad)
        with pytest.raises(ValueError, match="PLAIT_TCP_SPIN"):
            _spin_from_env()


# -- one watched socket: the polling rounds look at it without epoll ------------------------------


class _CountingPoller:
    """Wraps a transport's epoll and counts the polls that do not block (the polling rounds')."""

    def __init__(self, t: TcpTransport) -> None:
        self._poller = t._poller
        self.rounds = 0
        t._poller = self

    def poll(self, timeout: float = -1) -> list[tuple[int, int]]:
        if timeout == 0:
            self.rounds += 1
        return self._poller.poll(timeout)  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._poller, name)


def test_one_watched_socket_is_read_without_epoll() -> None:
    """Two ranks, one stream: a waiting rank's polling rounds read the socket itself."""
    ts = tcp_transports(2)
    try:
        a, b = ts
        assert a._direct is not None
        assert b._direct is not None
        counter = _CountingPoller(b)
        got = np.zeros(8, np.uint8)
        for i in range(20):
            h = b.irecv(0, i, got.data, 7)
            wait_all(a, [a.isend(1, i, np.full(8, i, np.uint8).data, 7)])
            wait_all(b, [h], timeout=10)
            assert got.tolist() == [i] * 8
        assert counter.rounds == 0, f"{counter.rounds} epoll rounds for one socket"
        # A rendezvous message larger than the socket's buffers needs both ways of the one
        # socket while the rounds look at it directly: the sender's queue and the receiver's
        # CTS.
        big = _pattern(8 << 20, 3)
        into = np.zeros_like(big)
        results: list[BaseException | None] = []

        def receive() -> None:
            try:
                wait_all(b, [b.irecv(0, 99, into.data, 7)], timeout=30)
                results.append(None)
            except BaseException as exc:
                results.append(exc)

        receiver = threading.Thread(target=receive)
        receiver.start()
        wait_all(a, [a.isend(1, 99, big.data, 7)], timeout=30)
        receiver.join(30)
        assert results == [None]
        assert np.array_equal(into, big)
    finally:
        _close(ts)


def test_a_look_that_moves_nothing_lets_the_waiting_rank_sleep() -> None:
    """Nothing arriving: the direct look says so, and a wait sleeps instead of spinning on."""
    ts = tcp_transports(2)
    try:
        a, b = ts
        direct = b._direct
        assert direct is not None
        with b._lock:
            assert direct() is False  # nothing was sent
        h = b.irecv(0, 5, np.zeros(8, np.uint8).data, 0)
        start, cpu = time.monotonic(), time.thread_time()
        assert not b.wait_any([h], 0.4)
        cpu, wall = time.thread_time() - cpu, time.monotonic() - start
        assert cpu < 0.5 * wall, f"a wait of {wall:.2f} s used {cpu:.2f} s of CPU"
        wait_all(a, [a.isend(1, 5, np.full(8, 5, np.uint8).data, 0)])
        with b._lock:
            assert direct() is True  # the message moved, and completed the receive
        assert h.done
        assert h.error is None
    finally:
        _close(ts)


def test_a_second_socket_ends_the_direct_look() -> None:
    """With more than one socket watched the rounds must ask epoll which ones are ready."""
    ts = tcp_transports(3)
    try:
        assert all(t._direct is None for t in ts)
    finally:
        _close(ts)
    ts = tcp_transports(2, streams=2)
    try:
        a, b = ts
        assert b._direct is not None  # stream 1 is watched only while a part is owed on it
        big = _pattern(2 * STRIPE_MIN, 4)
        into = np.zeros_like(big)
        h = b.irecv(0, 1, into.data, 0)
        wait_all(a, [a.isend(1, 1, big.data, 0)], timeout=30)
        seen: list[bool] = []
        original = b._pick_direct

        def spy() -> None:
            original()
            seen.append(b._direct is None)

        b._pick_direct = spy  # type: ignore[method-assign]
        wait_all(b, [h], timeout=30)
        assert np.array_equal(into, big)
        assert True in seen, "stream 1 was never watched with stream 0"
        assert b._direct is not None  # back to one socket once the part arrived
    finally:
        _close(ts)
