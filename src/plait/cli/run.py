"""``plait run``: start N ranks of a Python script or module and watch over them.

::

    plait run -n 4 train.py --epochs 3        # 4 local ranks
    plait run -n 4 -m mypkg.train             # a module, like python -m
    plait run -n 2 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29400 train.py

One launcher runs per host. The launcher of node 0 hosts the built-in TCP
store that the ranks rendezvous through; every rank gets its identity in the
environment (``PLAIT_RANK``, ``PLAIT_SIZE``, ``PLAIT_LOCAL_RANK``,
``PLAIT_LOCAL_SIZE``, ``PLAIT_NODE_RANK``, ``PLAIT_NNODES``, ``PLAIT_STORE``,
``PLAIT_JOB_ID``, ``PLAIT_SECRET``), which a bare :func:`plait.init` reads. The
secret is generated per job on one host; with several hosts every launcher
must be given the same PLAIT_SECRET.

If a rank exits with a non-zero code or dies from a signal, the launcher stops
the others (SIGTERM, then SIGKILL after a grace period) and exits non-zero,
naming the rank and its code or signal. Ctrl-C (SIGINT) or SIGTERM to the
launcher stops every rank the same way. Shared-memory segments the job left in
/dev/shm are removed on the way out.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import queue
import secrets
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO

__all__ = ["add_arguments", "main"]

#: Seconds between SIGTERM and SIGKILL when stopping ranks.
GRACE_SECONDS = 5.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``plait run``."""
    parser.add_argument(
        "-n",
        "--nproc",
        "--nproc-per-node",
        dest="nproc",
        type=int,
        default=1,
        help="ranks to start on this host (default 1)",
    )
    parser.add_argument("--nnodes", type=int, default=1, help="number of hosts (default 1)")
    parser.add_argument("--node-rank", type=int, default=0, help="this host's index, 0-based")
    parser.add_argument(
        "--master-addr",
        default="127.0.0.1",
        help="address of node 0, where the store runs (default 127.0.0.1)",
    )
    parser.add_argument(
        "--master-port",
        type=int,
        default=0,
        help="store port on node 0 (default: any free port; set it with --nnodes>1)",
    )
    parser.add_argument(
        "--tag-output", action="store_true", help="prefix every output line with [rank]"
    )
    parser.add_argument(
        "--transport",
        choices=["auto", "shm", "tcp", "hybrid"],
        default=None,
        help="force a transport (sets PLAIT_TRANSPORT)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="default seconds per collective (sets PLAIT_TIMEOUT)",
    )
    parser.add_argument("-m", dest="module", default=None, help="run a module, like python -m")
    parser.add_argument("target", nargs="?", help="the script to run (unless -m)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")


@dataclass
class _Rank:
    rank: int
    proc: subprocess.Popen[bytes]
    readers: list[threading.Thread]


def _command(args: argparse.Namespace) -> list[str]:
    if args.module:
        rest = ([args.target] if args.target else []) + list(args.args)
        return [sys.executable, "-u", "-m", args.module, *rest]
    if not args.target:
        raise SystemExit("plait run: give a script to run or -m MODULE")
    return [sys.executable, "-u", args.target, *args.args]


def _pump(stream: IO[bytes], prefix: bytes, sink: IO[bytes], lock: threading.Lock) -> None:
    for line in iter(stream.readline, b""):
        with lock:
            sink.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
            sink.flush()
    stream.close()


def _describe(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"


def _stop(ranks: Sequence[_Rank]) -> None:
    for r in ranks:
        if r.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                r.proc.terminate()
    for r in ranks:
        try:
            r.proc.wait(GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                r.proc.kill()
            r.proc.wait()


def _cleanup_shm(job: str) -> None:
    for path in glob.glob(f"/dev/shm/plait-{job}*"):
        with contextlib.suppress(OSError):
            os.unlink(path)


def main(args: argparse.Namespace) -> int:
    """Start the ranks, relay their output, and return the job's exit code."""
    if args.nproc < 1 or args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        raise SystemExit("plait run: need -n >= 1, --nnodes >= 1 and 0 <= --node-rank < --nnodes")
    if args.nnodes > 1 and args.master_port == 0:
        raise SystemExit("plait run: --nnodes > 1 needs --master-port (and --master-addr)")
    command = _command(args)
    size = args.nproc * args.nnodes

    from plait.rendezvous.tcp_store import TCPStoreServer

    # Every connection of the job proves it knows this secret (see plait._auth).
    # Hosts of one job must share it: launchers on several hosts need PLAIT_SECRET set.
    secret = os.environ.get("PLAIT_SECRET")
    if secret is None:
        if args.nnodes > 1:
            raise SystemExit(
                "plait run: --nnodes > 1 needs the same PLAIT_SECRET in every launcher's "
                "environment (e.g. export PLAIT_SECRET=$(openssl rand -hex 16))"
            )
        secret = secrets.token_hex(16)
    server = None
    if args.node_rank == 0:
        server = TCPStoreServer(args.master_addr, args.master_port, secret=secret.encode())
        port = server.port
    else:
        port = args.master_port
    host = args.master_addr
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    job = os.environ.get("PLAIT_JOB_ID") or f"{port}{secrets.token_hex(4)}"
    if args.nnodes > 1:
        job = os.environ.get("PLAIT_JOB_ID") or f"{host.replace(':', '_')}-{port}"

    events: queue.Queue[tuple[int, int]] = queue.Queue()
    lock = threading.Lock()
    ranks: list[_Rank] = []
    interrupted: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        interrupted.append(signum)
        events.put((-1, -signum))

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for local in range(args.nproc):
            rank = args.node_rank * args.nproc + local
            env = dict(os.environ)
            env.update(
                PLAIT_RANK=str(rank),
                PLAIT_SIZE=str(size),
                PLAIT_LOCAL_RANK=str(local),
                PLAIT_LOCAL_SIZE=str(args.nproc),
                PLAIT_NODE_RANK=str(args.node_rank),
                PLAIT_NNODES=str(args.nnodes),
                PLAIT_STORE=f"tcp://{address}",
                PLAIT_JOB_ID=job,
                PLAIT_SECRET=secret,
            )
            if args.nnodes > 1 and "PLAIT_HOST" not in os.environ:
                # One launcher per host: its node index names the host, so that
                # hosts emulated on one machine are told apart too.
                env["PLAIT_HOST"] = f"{socket.gethostname()}-node{args.node_rank}"
            if args.transport:
                env["PLAIT_TRANSPORT"] = args.transport
            if args.timeout:
                env["PLAIT_TIMEOUT"] = str(args.timeout)
            pipe = subprocess.PIPE if args.tag_output else None
            proc = subprocess.Popen(command, env=env, stdout=pipe, stderr=pipe)
            readers = []
            if args.tag_output:
                prefix = f"[{rank}]: ".encode()
                for stream, sink in (
                    (proc.stdout, sys.stdout.buffer),
                    (proc.stderr, sys.stderr.buffer),
                ):
                    t = threading.Thread(
                        target=_pump, args=(stream, prefix, sink, lock), daemon=True
                    )
                    t.start()
                    readers.append(t)
            ranks.append(_Rank(rank, proc, readers))
            threading.Thread(
                target=lambda r=rank, p=proc: events.put((r, p.wait())), daemon=True
            ).start()

        status = 0
        finished = 0
        while finished < len(ranks):
            rank, code = events.get()
            if rank < 0:  # a signal to the launcher
                name = signal.Signals(-code).name
                print(f"plait run: received {name}; stopping all ranks", file=sys.stderr)
                _stop(ranks)
                status = 128 + (-code)
                break
            finished += 1
            if code != 0:
                print(
                    f"plait run: rank {rank} {_describe(code)}; stopping the other ranks",
                    file=sys.stderr,
                )
                _stop(ranks)
                status = code if code > 0 else 128 - code
                break
        for r in ranks:
            for t in r.readers:
                t.join(5)
        return status
    finally:
        _stop(ranks)
        for s, handler in old.items():
            signal.signal(s, handler)
        if server is not None:
            server.close()
        _cleanup_shm(job)
