"""plait store: the built-in store served apart from the ranks, for PLAIT_STORE=tcp://..."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

PLAIT = [sys.executable, "-m", "plait"]

RANK = """
    import numpy as np, plait
    with plait.init(timeout=30) as comm:
        print(comm.rank, comm.allreduce(np.ones(3) * (comm.rank + 1)).tolist(), flush=True)
"""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PLAIT_", "OMPI_", "PMI"))}
    env["PLAIT_SECRET"] = "a secret of the test"
    return env


@contextlib.contextmanager
def _serving(env: dict[str, str]) -> Iterator[str]:
    """``plait store`` on a free port; its URL. It must stop cleanly on SIGTERM."""
    store = subprocess.Popen(
        [*PLAIT, "store", "--port", "0"], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert store.stdout is not None
        line = store.stdout.readline()
        assert line.startswith("plait store: serving tcp://127.0.0.1:"), line
        yield line.split()[3]
    finally:
        store.send_signal(signal.SIGTERM)
        rest, _ = store.communicate(timeout=30)
    assert store.returncode == 0
    assert rest == "plait store: stopped\n"


def _job(script: Path, env: dict[str, str], url: str) -> list[tuple[int, str, str]]:
    """Two ranks of ``script`` started by hand on the store at ``url``: (code, out, err)."""
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env={**env, "PLAIT_STORE": url, "PLAIT_RANK": str(r), "PLAIT_SIZE": "2"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=60) for p in ranks]
    return [(p.returncode, out, err) for p, (out, err) in zip(ranks, outs, strict=True)]


@pytest.mark.multiprocess
def test_ranks_started_by_hand_meet_through_it(tmp_path: Path) -> None:
    """`PLAIT_STORE=tcp://host:port` named a store no command of plait's served."""
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(RANK))
    env = _env()
    with _serving(env) as url:
        ranks = _job(script, env, url)
    assert [code for code, _, _ in ranks] == [0, 0], ranks
    assert sorted(out for _, out, _ in ranks) == ["0 [3.0, 3.0, 3.0]\n", "1 [3.0, 3.0, 3.0]\n"]


@pytest.mark.multiprocess
def test_jobs_of_their_own_ids_meet_through_one_store_in_turn(tmp_path: Path) -> None:
    # The second job on a store kept running failed at once: "another process has already
    # joined this job as rank 0" (the first job's claims, under the same keys).
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(RANK))
    env = _env()
    with _serving(env) as url:
        for job in ("first", "second"):
            ranks = _job(script, {**env, "PLAIT_JOB_ID": job}, url)
            assert [code for code, _, _ in ranks] == [0, 0], ranks
            assert sorted(out for _, out, _ in ranks)[0] == "0 [3.0, 3.0, 3.0]\n"
        again = _job(script, {**env, "PLAIT_JOB_ID": "first"}, url)  # an id used again
    assert [code for code, _, _ in again] == [1, 1], again
    for _, _, err in again:
        assert "an earlier job of the same id ('first') met in this store" in err, err


def test_a_port_it_cannot_listen_on_is_said_in_a_line() -> None:
    res = subprocess.run(
        [*PLAIT, "store", "--host", "192.0.2.1", "--port", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 1, res.stderr
    assert res.stderr.startswith("plait store: store server cannot listen on 192.0.2.1:1"), res
    bad = subprocess.run(
        [*PLAIT, "store", "--port", "70000"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2
    assert "--port 70000 is not a port" in bad.stderr
