"""Ranks started by hand, as a user's own launcher would: PLAIT_RANK, PLAIT_SIZE and
PLAIT_STORE set per process, with a store served by the test's process (not ``plait run``,
whose launcher stops every rank when one fails and removes the job's files from /dev/shm
on the way out, which would hide what a test looks for)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from plait.rendezvous.tcp_store import TCPStoreServer

ROOT = Path(__file__).resolve().parents[1]


def rank_env(
    rank: int,
    size: int,
    server: TCPStoreServer,
    secret: str,
    transport: str,
    dumps: Path,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of rank ``rank`` of ``size``: this process's, plus plait's variables
    (flight recorder dumps into ``dumps``) and ``extra``."""
    return {
        **os.environ,
        "PLAIT_SECRET": secret,
        "PYTHONUNBUFFERED": "1",
        "PLAIT_RANK": str(rank),
        "PLAIT_SIZE": str(size),
        "PLAIT_LOCAL_RANK": str(rank),
        "PLAIT_STORE": f"tcp://127.0.0.1:{server.port}",
        "PLAIT_TRANSPORT": transport,
        "PLAIT_DUMP_DIR": str(dumps),
        **(extra or {}),
    }


def start_by_hand(
    script: Path,
    size: int,
    server: TCPStoreServer,
    secret: str,
    transport: str,
    dumps: Path,
    extra: Mapping[str, str] | None = None,
    *,
    stdin: bool = False,
) -> list[subprocess.Popen[str]]:
    """Start ``size`` ranks of ``script`` (text pipes for output; for input where ``stdin``)."""
    return [
        subprocess.Popen(
            [sys.executable, str(script)],
            cwd=ROOT,
            env=rank_env(r, size, server, secret, transport, dumps, extra),
            stdin=subprocess.PIPE if stdin else None,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(size)
    ]


def collect(
    procs: Sequence[subprocess.Popen[str]], timeout: float
) -> tuple[list[dict[str, Any] | None], str]:
    """Wait for every rank, killing all once ``timeout`` seconds have passed; each rank's last
    ``RESULT {json}`` line (None where it printed none), and every rank's exit code and output.

    Every rank's pipes are read at once, on a thread each: read one rank after another, a rank
    that wrote more than a pipe holds while an earlier one waited for it in a call stopped both
    until the timeout, and the timeouts added up, one per rank.
    """
    outputs: list[tuple[str, str]] = [("", "")] * len(procs)

    def drain(i: int) -> None:
        outputs[i] = procs[i].communicate()

    readers = [threading.Thread(target=drain, args=(i,), daemon=True) for i in range(len(procs))]
    for t in readers:
        t.start()
    deadline = time.monotonic() + timeout
    try:
        for t in readers:
            t.join(max(0.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for t in readers:
            t.join()  # a killed rank's pipes close
    results: list[dict[str, Any] | None] = []
    logs = []
    for p, (out, err) in zip(procs, outputs, strict=True):
        logs.append(f"--- rc {p.returncode}\n{out[-3000:]}\n{err[-3000:]}")
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        results.append(json.loads(lines[-1][7:]) if lines else None)
    return results, "\n".join(logs)
