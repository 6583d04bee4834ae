"""abort and close on a store that stopped answering (SIGSTOP) since the watcher last
heard it: Note [a store that stalls] in plait._recovery. The store is a ``plait store``
process of its own, which the test stops; the ranks are started here, not by ``plait run``.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from by_hand import collect

ROOT = Path(__file__).resolve().parents[2]

#: A rank: init, say it is ready, wait until the test stopped the store, then abort (rank 0)
#: or wait in an allreduce that only the abort ends (the others); or agree (every rank).
#: Then close; report how long each took.
RANK = """
import json, os, sys, time, numpy as np, plait
rank, url, folder, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
comm = plait.init(rank=rank, size=3, store=url, timeout=60, transport="tcp")
comm.barrier()
open(os.path.join(folder, f"ready{rank}"), "w").close()
while not os.path.exists(os.path.join(folder, "stopped")):  # the test stops the store
    time.sleep(0.05)
got = {}
start = time.monotonic()
try:
    if mode == "agree":
        comm.agree(1, timeout=3)
    elif rank == 0:  # once the others are (about to be) in their allreduce
        while not all(os.path.exists(os.path.join(folder, f"in{r}")) for r in (1, 2)):
            time.sleep(0.01)
        start = time.monotonic()
        comm.abort("test")
    else:
        open(os.path.join(folder, f"in{rank}"), "w").close()
        comm.allreduce(np.ones(3), timeout=30)
except plait.CommError as exc:
    got.update(kind=type(exc).__name__, text=str(exc))
got["took"] = time.monotonic() - start
start = time.monotonic()
comm.close()
got["close"] = time.monotonic() - start
print("RESULT " + json.dumps(got), flush=True)
"""


@pytest.fixture
def stopped_store() -> Iterator[tuple[subprocess.Popen[str], str, dict[str, str]]]:
    """A ``plait store`` process, its URL and the ranks' environment; resumed (the test
    stops it) and ended after the test."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLAIT_")}
    env["PLAIT_SECRET"] = secrets.token_hex(8)
    env["PYTHONUNBUFFERED"] = "1"
    store = subprocess.Popen(
        [sys.executable, "-m", "plait", "store"], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert store.stdout is not None
        yield store, store.stdout.readline().split()[3], env
    finally:
        store.send_signal(signal.SIGCONT)
        store.terminate()
        store.communicate(timeout=30)


def run_stalled(
    mode: str, store: tuple[subprocess.Popen[str], str, dict[str, str]], folder: Path
) -> list[dict | None]:
    """Run the three ranks of RANK in ``mode``, stopping the store once all are ready."""
    server, url, env = store
    script = folder / "rank.py"
    script.write_text(RANK)
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), url, str(folder), mode],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(3)
    ]
    try:
        deadline = time.monotonic() + 60
        while not all((folder / f"ready{r}").exists() for r in range(3)):
            assert time.monotonic() < deadline
            assert all(p.poll() is None for p in ranks)
            time.sleep(0.05)
        server.send_signal(signal.SIGSTOP)
        (folder / "stopped").touch()
        results, logs = collect(ranks, 50)
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
    run_stalled.logs = logs  # type: ignore[attr-defined]
    return results


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_an_abort_on_a_store_that_just_stalled_reaches_the_peers_by_the_transport(
    stopped_store: tuple[subprocess.Popen[str], str, dict[str, str]], tmp_path: Path
) -> None:
    """The store stopped before the watcher noticed: the abort's store calls waited for
    it until the client gave up, so the peers heard nothing until their own timeout and
    close() took 14 s. Each ask is answered within half a second or the store counts as
    gone: the abort closes the transport, and the peers see rank 0 leave."""
    results = run_stalled("abort", stopped_store, tmp_path)
    logs = run_stalled.logs  # type: ignore[attr-defined]
    assert all(r is not None for r in results), logs
    aborting = results[0]
    assert aborting is not None
    assert aborting["took"] < 1.5, results  # abort() returns after _TELL_SECONDS at most
    for r in (1, 2):
        res = results[r]
        assert res is not None
        assert res["kind"] in ("AbortedError", "PeerLostError"), results
        assert "rank 0" in res["text"], results
        assert res["took"] < 4, results
    for res in results:
        assert res is not None
        assert res["close"] < 2.5, results


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_close_after_an_agree_on_a_stopped_store_returns_promptly(
    stopped_store: tuple[subprocess.Popen[str], str, dict[str, str]], tmp_path: Path
) -> None:
    """agree raised by its timeout, and then close() waited for the stopped store to
    answer its own calls (10 s)."""
    results = run_stalled("agree", stopped_store, tmp_path)
    logs = run_stalled.logs  # type: ignore[attr-defined]
    assert all(r is not None for r in results), logs
    for res in results:
        assert res is not None
        assert res["kind"] == "RendezvousError", results
        assert res["took"] < 6, results  # its 3 s, the last look and a second's slack
        assert res["close"] < 2.5, results
