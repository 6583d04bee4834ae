"""Large messages over TCP withdrawn by a survivor that gave up: the receivers name the cause.

Note [withdrawn messages] in plait/transport/tcp/rendezvous.py: a survivor whose call failed
because a rank was lost (or closed its communicator) withdraws its large sends; a rank that
had taken one of them raised MismatchError ("rank 3 withdrew the 1048576-byte message"), or,
where it then told its verdict, made others raise "found that the ranks called different
collectives", instead of PeerLostError naming the rank the survivor lost.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(120)


def plait_run(args: list[str], script: str, tmp_path: Path, timeout: float = 90):
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(script))
    return subprocess.run(
        [sys.executable, "-m", "plait", "run", *args, str(path)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def _errors(res: subprocess.CompletedProcess[str]) -> dict[int, dict[str, object]]:
    found = {}
    for line in res.stdout.splitlines():
        if line.startswith("{"):
            got = json.loads(line)
            found[got["rank"]] = got
    return found


#: What each rank's failed call raised, as one line of JSON.
REPORT = """
    import json


    def report(comm, exc):
        print(json.dumps({"rank": comm.rank, "type": type(exc).__name__,
                          "lost": getattr(exc, "lost_rank", None), "text": str(exc)}), flush=True)
"""


@pytest.mark.parametrize("algorithm", ["direct", "ring", "recursive_doubling"])
def test_survivors_of_a_kill_name_the_lost_rank_not_a_withdrawal(
    tmp_path: Path, algorithm: str
) -> None:
    """Rank 1 dies; the others then call an allreduce of 8 MB: every one raises
    PeerLostError naming rank 1, also the rank whose peer withdrew a message it had taken."""
    script = textwrap.dedent(REPORT) + textwrap.dedent(f"""
        import os, signal, time, numpy as np, plait
        comm = plait.init(timeout=20)
        comm.barrier()
        if comm.rank == 1:
            time.sleep(1)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(3)  # the survivors call after the death: some see it first, some later
        try:
            comm.allreduce(np.ones(1_000_000), algorithm={algorithm!r})
        except plait.CommError as exc:
            report(comm, exc)
    """)
    res = plait_run(
        ["-n", "4", "--transport", "tcp", "--enable-recovery"], script, tmp_path, timeout=100
    )
    errors = _errors(res)
    assert sorted(errors) == [0, 2, 3], res.stdout[-3000:] + res.stderr[-3000:]
    for rank, err in errors.items():
        assert err["type"] == "PeerLostError", (rank, err)
        assert err["lost"] == 1, (rank, err)
        assert "withdrew" not in str(err["text"]), (rank, err)


def test_a_rank_that_closes_mid_call_is_named_as_closed_by_every_peer(tmp_path: Path) -> None:
    """Rank 3 closes its communicator from another thread during a run of 8 MB allreduces:
    every peer raises PeerLostError naming rank 3, also one whose peer, having seen the
    close, withdrew a message it had taken."""
    script = textwrap.dedent(REPORT) + textwrap.dedent("""
        import threading, numpy as np, plait
        comm = plait.init(timeout=20)
        comm.barrier()
        if comm.rank == 3:
            threading.Timer(0.05, comm.close).start()
        try:
            for _ in range(50):
                comm.allreduce(np.ones(1_000_000), algorithm="direct")
        except plait.CommError as exc:
            report(comm, exc)
    """)
    res = plait_run(["-n", "4", "--transport", "tcp"], script, tmp_path, timeout=100)
    errors = _errors(res)
    assert sorted(errors) == [0, 1, 2, 3], res.stdout[-3000:] + res.stderr[-3000:]
    for rank in (0, 1, 2):
        err = errors[rank]
        assert err["type"] == "PeerLostError", (rank, err)
        assert err["lost"] == 3, (rank, err)
        assert "closed its" in str(err["text"]), (rank, err)
