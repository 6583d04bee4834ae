"""A rank that closed is named the same way over every transport: as one that closed its
communicator (docs/fault-tolerance.md), the words the in-process transport and the window
use. Shared memory said "rank 1 has closed its transport", TCP "rank 1 closed its
transport: connection to rank 0 closed", naming what a user never sees.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

#: Rank 1 closes its communicator as rank 0 calls CALL (the same words whether the close
#: comes before or during the call).
CLOSES = """
    import json, numpy as np, plait
    comm = plait.init(timeout=30)
    comm.barrier()
    if comm.rank == 1:
        comm.close()
    else:
        try:
            CALL
            said = {"type": None}
        except plait.CommError as exc:
            said = {"type": type(exc).__name__, "text": str(exc),
                    "lost": getattr(exc, "lost_rank", None)}
        print(json.dumps(said), flush=True)
"""


@pytest.mark.parametrize(
    "call", ["comm.allreduce(np.ones(10))", "comm.recv(np.zeros(3), 1)"], ids=["allreduce", "recv"]
)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_rank_that_closed_is_named_as_one_that_closed_its_communicator(
    tmp_path: Path, transport: str, call: str
) -> None:
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(CLOSES).replace("CALL", call))
    res = subprocess.run(
        [sys.executable, "-m", "plait", "run", "-n", "2", "--transport", transport, str(path)],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=ROOT,
    )
    said = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert len(said) == 1, (res.stdout + res.stderr)[-3000:]
    assert said[0]["type"] == "PeerLostError", said
    assert said[0]["lost"] == 1, said
    # A call that saw the close itself says so as a peer's notice would (docs/fault-tolerance.md)
    words = "closed its communicator during the call" if "allreduce" in call else "has closed"
    assert f"rank 1 {words}" in said[0]["text"], said
    assert "transport" not in said[0]["text"], said
