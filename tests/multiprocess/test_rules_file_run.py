"""Real ranks started by ``plait run`` follow the rules file they inherit: algorithm and segment."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

RANK = textwrap.dedent(
    """
    import numpy as np

    import plait

    n = 10_000  # 40,000 bytes: ten 4 KiB segments per message
    with plait.init() as comm:
        out = comm.allreduce(np.arange(n, dtype=np.float32) * (comm.rank + 1))
        assert np.array_equal(out, np.arange(n, dtype=np.float32) * 3), out[:8]
        choice = comm._auto[("allreduce", n * 4, True, True, False)]
        print(f"rank {comm.rank} ran {choice.name} in {choice.segment_bytes}-byte segments")
    """
)


def test_ranks_follow_the_rules_file(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    rules = tmp_path / "rules.toml"
    rules.write_text('[[allreduce]]\nalgorithm = "ring"\nbytes = "1K-"\nsegment = "4K"\n')
    env = {**os.environ, "PLAIT_RULES": str(rules), "PLAIT_DEBUG": "info"}
    res = subprocess.run(
        [sys.executable, "-m", "plait", "run", "-n", "2", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for r in (0, 1):
        assert f"rank {r} ran ring in 4096-byte segments" in res.stdout
        assert (
            f"rank {r}: allreduce of 40000 bytes on 2 ranks: auto chose ring, "
            "segment 4 KiB (rules file)" in res.stderr
        )
