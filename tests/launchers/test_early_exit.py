"""A rank that exits before it calls ``plait.init`` (``if rank == 2: sys.exit(0)``) under
``plait run``: the ranks waiting for it in ``plait.init`` fail within about a second, naming
it, and the launcher names it as the rank that started the failure. The others waited out
their whole init timeout before (300 s by default), and the launcher blamed one of them.

A rank that exits with 0 after it joined ``plait.init`` is the normal end of a script, and
is never taken for one (Note [ranks that never joined] in plait.rendezvous.lost).
"""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import pytest
from launch_helpers import clean_env, run_job

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(90)]

PLAIT_RUN = [sys.executable, "-m", "plait", "run"]
#: The ranks' init timeout: a job that waits it out fails the test's bound on the time.
INIT_TIMEOUT = "20"

#: Rank 2 ends before plait.init; the others wait for it there.
RETURNS_EARLY = """
    import os, sys, plait
    if os.environ["PLAIT_RANK"] == "2":
        sys.exit(0)
    comm = plait.init()
    comm.barrier()
"""

#: Every rank joins; rank 0 exits as soon as its init returns, maybe before the others'
#: have; each rank checks that the launcher can see it joined (its claim in the store).
JOINS_THEN_EXITS = """
    import os, sys, plait
    from plait.rendezvous.lost import joined
    from plait.rendezvous.url import store_from_url

    comm = plait.init()
    if comm.rank == 0:
        sys.exit(0)
    store = store_from_url(os.environ["PLAIT_STORE"], rank=comm.rank, timeout=20)
    seen = joined(store, comm.rank)
    store.close()
    print(f"rank {comm.rank} joined: {seen}", flush=True)
"""


def _run(tmp_path: Path, body: str, *options: str) -> tuple[int, str, str, float]:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(body))
    env = clean_env(PLAIT_TIMEOUT=INIT_TIMEOUT)
    res = run_job([*PLAIT_RUN, "-n", "3", *options, str(script)], env, timeout=60)
    return res.returncode, res.stdout, res.stderr, res.seconds


@pytest.mark.parametrize("options", [(), ("--enable-recovery",)], ids=["plain", "recovery"])
def test_a_rank_that_exits_before_init_fails_the_others_at_once_and_is_named(
    tmp_path: Path, options: tuple[str, ...]
) -> None:
    code, out, err, seconds = _run(tmp_path, RETURNS_EARLY, *options)
    report = f"rc={code} in {seconds:.1f} s\n{out}\n{err}"
    assert seconds < float(INIT_TIMEOUT) - 5, report  # not at the init deadline
    assert code == 1, report  # the code of the ranks that failed of it
    for rank in (0, 1):
        errors = [line for line in err.splitlines() if line.startswith(f"[{rank}]: plait.")]
        assert errors, report
        assert errors[-1].startswith(f"[{rank}]: plait.errors.PeerLostError: rank {rank} of 3: "), (
            report
        )
        assert "rank(s) [2] exited before they could" in errors[-1], report
        assert "rank 2 exited with code 0 before calling plait.init" in errors[-1], report
    said = "plait run: rank 2 exited with code 0 before calling plait.init (the others waited"
    assert said in err, report
    summary = [line for line in err.splitlines() if re.match(r"plait run:   rank \d: ", line)]
    assert summary[2] == (
        "plait run:   rank 2: exit 0   <- started the failure (exited before calling plait.init)"
    ), report
    assert not any("started the failure" in line for line in summary[:2]), report
    assert err.splitlines()[-1].startswith("plait run: rank 2 exited with code 0"), report


@pytest.mark.parametrize("options", [(), ("--enable-recovery",)], ids=["plain", "recovery"])
def test_a_rank_that_exits_after_init_is_no_lost_rank(
    tmp_path: Path, options: tuple[str, ...]
) -> None:
    code, out, err, seconds = _run(tmp_path, JOINS_THEN_EXITS, *options)
    report = f"rc={code} in {seconds:.1f} s\n{out}\n{err}"
    assert code == 0, report
    assert sorted(out.splitlines()) == ["rank 1 joined: True", "rank 2 joined: True"], report
    assert "plait run" not in err, report


def test_ranks_that_never_call_init_end_the_job_as_they_would() -> None:
    """A command that is not plait's: every rank exits with 0 without a word of the
    launcher's, the first ones filed in the store where nobody looks."""
    res = run_job([*PLAIT_RUN, "-n", "3", "true"], clean_env(), timeout=60)
    assert (res.returncode, res.stdout, res.stderr) == (0, "", ""), res.describe()


#: The first init of each rank meets in a store of its own (as the torch backend meets in
#: torch's), the second in the launcher's: the launcher sees the ranks joined.
JOINS_LATER = """
    import os, plait
    from plait.rendezvous.lost import joined
    from plait.rendezvous.url import store_from_url

    rank, size = int(os.environ["PLAIT_RANK"]), int(os.environ["PLAIT_SIZE"])
    with plait.init(rank=rank, size=size, store=os.environ["OWN_STORE"]) as first:
        first.barrier()
    with plait.init() as comm:
        comm.barrier()
        store = store_from_url(os.environ["PLAIT_STORE"], rank=rank, timeout=20)
        print(f"rank {rank} joined: {joined(store, rank)}", flush=True)
        store.close()
"""


def test_a_rank_that_joined_a_later_init_of_its_process_joined(tmp_path: Path) -> None:
    # Only the claim of the first init of a process was looked at: a rank whose first init
    # met elsewhere would be filed as one that never called plait.init once it exited.
    from plait.rendezvous.tcp_store import TCPStoreServer

    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOINS_LATER))
    secret = "the job's secret, its own store's too"
    server = TCPStoreServer("127.0.0.1", 0, secret=secret.encode())
    try:
        own = f"tcp://127.0.0.1:{server.port}"
        env = clean_env(PLAIT_TIMEOUT=INIT_TIMEOUT, PLAIT_SECRET=secret, OWN_STORE=own)
        res = run_job([*PLAIT_RUN, "-n", "2", str(script)], env, timeout=60)
    finally:
        server.close()
    assert res.returncode == 0, res.describe()
    assert sorted(res.stdout.splitlines()) == ["rank 0 joined: True", "rank 1 joined: True"]
