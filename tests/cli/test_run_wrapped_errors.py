"""``plait run`` blames the rank that started a failure where the others wrap plait's error in
their own (``raise RuntimeError(...) from exc``): their traceback starts with the plait error,
which names the rank they lost, and ends with the script's own.

The launcher read the ranks a symptom names from the chain's last exception only, so a rank
that returned early (or before ``plait.init``) went unnamed, and one of the ranks that lost it
was marked as having started the failure.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from collections.abc import Collection
from pathlib import Path

import pytest

from plait.launch.relay import Traceback
from plait.launch.watch import _left_elsewhere

PLAIT = [sys.executable, "-m", "plait"]

#: Rank 2 ends after a barrier; the others lose it in their allreduce and say so their way.
RETURNS_EARLY = """
    import os, numpy as np, plait
    with plait.init(timeout=30) as comm:
        comm.barrier()
        if comm.rank == 2:
            os._exit(0)
        try:
            comm.allreduce(np.ones(3))
        except plait.CommError as exc:
            raise RuntimeError("training step failed") from exc
"""

#: Rank 2 ends before plait.init; the others wrap the error their init raises.
NEVER_JOINS = """
    import os, sys, plait
    if os.environ["PLAIT_RANK"] == "2":
        sys.exit(0)
    try:
        comm = plait.init(timeout=30)
    except plait.CommError as exc:
        raise RuntimeError("could not join the job") from exc
"""


def _run(tmp_path: Path, body: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(body))
    res = subprocess.run(
        [*PLAIT, "run", "-n", "3", str(script)], capture_output=True, text=True, timeout=60
    )
    summary = [
        line for line in res.stderr.splitlines() if re.match(r"plait run:   rank \d: ", line)
    ]
    return res, summary


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_a_rank_that_returned_early_is_named_where_the_others_wrap_their_loss(
    tmp_path: Path,
) -> None:
    res, summary = _run(tmp_path, RETURNS_EARLY)
    assert res.returncode == 1, res.stderr
    assert summary[2] == "plait run:   rank 2: exit 0   <- exited while the others still needed it"
    assert not any("started the failure" in line for line in summary), res.stderr


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_a_rank_that_never_joined_is_named_where_the_others_wrap_their_loss(
    tmp_path: Path,
) -> None:
    res, summary = _run(tmp_path, NEVER_JOINS)
    assert res.returncode == 1, res.stderr
    assert summary[2] == (
        "plait run:   rank 2: exit 0   <- started the failure (exited before calling plait.init)"
    ), res.stderr
    assert not any("started the failure" in line for line in summary[:2]), res.stderr
    said = "plait run: rank 2 exited with code 0 before calling plait.init (the others waited"
    assert said in res.stderr, res.stderr


class _Filed:
    """The job's store as another host's launcher left it: rank 5 exited before it joined."""

    def __init__(self) -> None:
        self.asked: list[list[int]] = []

    def left(self, rank: int, code: int) -> bool:
        return False

    def joined(self, rank: int) -> bool:
        return True

    def left_elsewhere(self, ranks: Collection[int]) -> dict[int, str]:
        self.asked.append(sorted(ranks))
        return {5: "exited with code 0 before calling plait.init"} if 5 in ranks else {}


def _read(text: str) -> Traceback:
    tb = Traceback()
    for i, line in enumerate(text.splitlines(keepends=True)):
        tb.feed(line.encode(), float(i))
    return tb


def test_a_rank_of_another_host_is_read_from_the_start_of_a_wrapped_chain() -> None:
    """The path of a job on several hosts: the rank that never joined is on another host."""
    tb = _read(
        textwrap.dedent("""\
        Traceback (most recent call last):
          File "x.py", line 3, in <module>
        plait.errors.PeerLostError: rank 0 of 6: rank(s) [5] exited before they could say their host in plait.init (rank 5 exited with code 0 before calling plait.init, as plait run saw): see their output

        The above exception was the direct cause of the following exception:

        Traceback (most recent call last):
          File "x.py", line 5, in <module>
        RuntimeError: could not join the job
    """)  # noqa: E501 - the error's line as plait writes it
    )
    joining = _Filed()
    away = _left_elsewhere(joining, tb, mine=[0, 1, 2])
    assert away == (5, "exited with code 0 before calling plait.init"), joining.asked
