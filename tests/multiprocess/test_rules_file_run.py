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


SETTINGS = textwrap.dedent(
    """
    import os, sys
    import plait

    rank = int(os.environ["PLAIT_RANK"])
    if rank == 0:  # rank 0 alone follows something of its own
        os.environ[sys.argv[1]] = sys.argv[2]
    try:
        plait.init(timeout=30).close()
        print(f"rank {rank} met")
    except plait.RendezvousError as exc:
        print(f"rank {rank}: {type(exc).__name__}: {exc}")
    """
)


def test_ranks_that_follow_different_settings_are_refused_at_init(tmp_path: Path) -> None:
    # A profile on one rank only (plait tune run on one host), an unreadable one, or a
    # PLAIT_ALGO of one rank: the ranks chose different algorithms for some call, well into
    # the job, and failed there with a MismatchError that broke the communicator.
    from plait.selection import model

    script = tmp_path / "rank.py"
    script.write_text(SETTINGS)
    profile = tmp_path / "profile.json"
    os.environ["PLAIT_PROFILE"], saved = str(profile), os.environ["PLAIT_PROFILE"]
    try:
        model.save(model.Profile(model.LinkCost(1.0, 1e-12)))
    finally:
        os.environ["PLAIT_PROFILE"] = saved
    cases = [
        ("PLAIT_ALGO", "allreduce:ring", "PLAIT_ALGO='allreduce:ring'"),
        ("PLAIT_PROFILE", str(profile), f"the profile {profile}"),
    ]
    for name, value, said in cases:
        res = subprocess.run(
            [sys.executable, "-m", "plait", "run", "-n", "3", str(script), name, value],
            capture_output=True,
            text=True,
            timeout=120,
        )
        for r in range(3):
            assert (
                f"rank {r}: RendezvousError: rank {r}: the ranks follow different settings for "
                f"algorithm='auto' (rank(s) [0]: {said}; rank(s) [1, 2]: plait's built-in "
                "rules alone)" in res.stdout
            ), res.stdout + res.stderr
