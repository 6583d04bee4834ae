"""This machine's limits, measured with numpy and loopback sockets (``plait bench --limits``).

- ``copy_gbps_1core`` / ``add_gbps_1core``: one process copying 64 MiB arrays
  (``np.copyto``) / adding two into a third (``np.add(a, b, out=c)``), counted
  as bytes of result per second (10⁹ B/s). A shared-memory transport copies
  every byte at least once, so this is the roof of a rank's busbw there.
- ``copy_gbps_all`` / ``add_gbps_all``: the same in one process per core at
  once, summed: what all ranks of a host can reach together.
- ``tcp_gbps``: one loopback TCP connection to another process, bytes per
  second received; the roof of busbw over TCP on one host.
- ``tcp_rtt_us``: median round trip of a 1-byte message over loopback TCP
  between two processes (TCP_NODELAY); the floor of a small message's time.

Helper processes are started with ``python -m plait.bench.limits``; they
start together on a line written to their stdin, never after a sleep.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from typing import Any

import numpy as np

__all__ = ["format_limits", "measure_limits", "memory_bandwidth", "tcp_loopback"]

_ARRAY_BYTES = 64 << 20
_SECONDS = 0.25


def _rate(fn: Any, nbytes: int, seconds: float) -> float:
    """GB/s of ``fn()`` (``nbytes`` each) called back to back for about ``seconds``.

    An average over the whole period, not the best call: processes measured
    together then overlap for the whole of their periods.
    """
    fn()  # touch the pages
    calls = 0
    t0 = time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            return calls * nbytes / elapsed / 1e9


def memory_bandwidth(nbytes: int = _ARRAY_BYTES, seconds: float = _SECONDS) -> dict[str, float]:
    """Copy and add bandwidth of this process, GB/s of result."""
    n = nbytes // 4
    a = np.ones(n, np.float32)
    b = np.ones(n, np.float32)
    c = np.empty(n, np.float32)
    copy = _rate(lambda: np.copyto(b, a), nbytes, seconds)
    add = _rate(lambda: np.add(a, b, out=c), nbytes, seconds)
    return {"copy": copy, "add": add}


def _all_cores(processes: int, nbytes: int, seconds: float) -> dict[str, float]:
    cmd = [sys.executable, "-m", "plait.bench.limits", "memory", str(nbytes), str(seconds)]
    procs = [
        subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for _ in range(processes)
    ]
    try:
        for p in procs:  # each has allocated and touched its arrays
            assert p.stdout is not None
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("a memory helper process failed to start")
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        results = []
        for p in procs:
            out, _ = p.communicate(timeout=60)
            results.append(json.loads(out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return {k: sum(r[k] for r in results) for k in ("copy", "add")}


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("peer closed")
        data += chunk
    return bytes(data)


def _tcp_peer(port: int) -> None:
    """The helper's end: echo pings, swallow data blocks, until told to quit."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = memoryview(bytearray(1 << 20))
    while True:
        cmd = sock.recv(1)
        if cmd == b"p":
            sock.sendall(b"p")
        elif cmd == b"d":
            left = int.from_bytes(_recv_exact(sock, 8), "little")
            while left:
                got = sock.recv_into(buf, min(left, len(buf)))
                if not got:
                    return
                left -= got
            sock.sendall(b"k")
        else:
            return


def tcp_loopback(nbytes: int = 256 << 20, pings: int = 2000) -> dict[str, float]:
    """Loopback TCP throughput (GB/s, best of 3) and 1-byte round trip (µs, median)."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(60)
    port = server.getsockname()[1]
    peer = subprocess.Popen([sys.executable, "-m", "plait.bench.limits", "tcp", str(port)])
    try:
        sock, _ = server.accept()
        sock.settimeout(60)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rtts = np.empty(pings)
        for i in range(pings + 200):
            t0 = time.perf_counter()
            sock.sendall(b"p")
            _recv_exact(sock, 1)
            if i >= 200:
                rtts[i - 200] = time.perf_counter() - t0
        block = memoryview(bytearray(4 << 20))
        best = 0.0
        for _ in range(3):
            t0 = time.perf_counter()
            sock.sendall(b"d" + nbytes.to_bytes(8, "little"))
            left = nbytes
            while left:
                n = min(left, len(block))
                sock.sendall(block[:n])
                left -= n
            _recv_exact(sock, 1)
            best = max(best, nbytes / (time.perf_counter() - t0))
        sock.sendall(b"q")
        sock.close()
        peer.wait(timeout=30)
    finally:
        server.close()
        if peer.poll() is None:
            peer.kill()
            peer.wait()
    return {"tcp_gbps": best / 1e9, "tcp_rtt_us": float(np.median(rtts)) * 1e6}


def measure_limits(processes: int | None = None) -> dict[str, Any]:
    """Every limit of the module doc, as one JSON-ready dict."""
    cores = processes or len(os.sched_getaffinity(0))
    one = memory_bandwidth()
    everyone = _all_cores(cores, _ARRAY_BYTES, _SECONDS)
    return {
        "cores": cores,
        "copy_gbps_1core": one["copy"],
        "add_gbps_1core": one["add"],
        "copy_gbps_all": everyone["copy"],
        "add_gbps_all": everyone["add"],
        **tcp_loopback(),
    }


def format_limits(limits: dict[str, Any]) -> list[str]:
    """The limits as comment lines for the table."""
    return [
        f"# limits: memory copy {limits['copy_gbps_1core']:.2f} GB/s on one core, "
        f"{limits['copy_gbps_all']:.2f} GB/s on all {limits['cores']}; "
        f"add {limits['add_gbps_1core']:.2f} / {limits['add_gbps_all']:.2f} GB/s",
        f"# limits: loopback TCP {limits['tcp_gbps']:.2f} GB/s, "
        f"round trip {limits['tcp_rtt_us']:.1f} µs (1 byte)",
    ]


def _helper(argv: list[str]) -> None:
    if argv[0] == "memory":
        nbytes, seconds = int(argv[1]), float(argv[2])
        n = nbytes // 4
        a, b, c = np.ones(n, np.float32), np.ones(n, np.float32), np.ones(n, np.float32)
        print("ready", flush=True)
        sys.stdin.readline()
        copy = _rate(lambda: np.copyto(b, a), nbytes, seconds)
        add = _rate(lambda: np.add(a, b, out=c), nbytes, seconds)
        print(json.dumps({"copy": copy, "add": add}), flush=True)
    elif argv[0] == "tcp":
        _tcp_peer(int(argv[1]))


if __name__ == "__main__":
    _helper(sys.argv[1:])
