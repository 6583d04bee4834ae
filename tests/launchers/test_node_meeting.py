"""Launchers of one job on several hosts (``plait run --nnodes N``) meet before any rank starts.

Each test emulates the hosts on this machine: one ``plait run`` per node, all on 127.0.0.1
with node 0 serving the store on a free port, every launcher in a session of its own so that
whatever happens its processes can be found and killed. Two mistakes in how the launchers
were started must fail every launcher within seconds, with a message that names them
(Note [launchers meet] in plait.rendezvous.nodes): launchers given different ``-n`` (or
``--nnodes``), and two launchers given one ``--node-rank``. The ranks' own timeout is a
minute, so a launcher that waits it out fails the test.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import pytest
from launch_helpers import clean_env, free_port_pair

from plait.rendezvous.tcp_store import TCPStore

pytestmark = pytest.mark.multiprocess

#: The ranks' timeout (PLAIT_TIMEOUT): far longer than any launcher here may take.
RANK_TIMEOUT = "60"
#: Seconds within which every launcher of a job that cannot start must have failed.
FAIL_SECONDS = 15.0
#: Seconds a test waits for all its launchers before it kills them and fails.
JOB_SECONDS = 40.0
HOST = socket.gethostname()

#: Every rank says it started, then meets the others and checks an allreduce.
RANK = """
    import os, sys
    import numpy as np
    import plait
    rank = os.environ["PLAIT_RANK"]
    print(f"rank {rank} started", flush=True)
    with plait.init() as comm:
        total = comm.allreduce(np.array([comm.rank + 1.0]))
        print(f"rank {comm.rank} of {comm.size} met: {total[0]:g}", flush=True)
        if os.environ.get("HOLD") == "1":  # stay in the job until the test closes stdin
            sys.stdin.read()
"""


@dataclass
class Launcher:
    node: int
    proc: subprocess.Popen[str]
    started: float
    out: str = ""
    err: str = ""
    seconds: float = 0.0

    def describe(self) -> str:
        return (
            f"--- node {self.node} (pid {self.proc.pid}) rc={self.proc.returncode} after "
            f"{self.seconds:.1f} s\n--- stdout\n{self.out[-3000:]}\n--- stderr\n{self.err[-4000:]}"
        )


def _kill(launchers: Sequence[Launcher]) -> None:
    for la in launchers:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(la.proc.pid, signal.SIGKILL)


class Job:
    """Launchers of one job, on a free port of 127.0.0.1, with the job's shared secret."""

    def __init__(self, tmp: Path, nnodes: int) -> None:
        self.port = free_port_pair()
        self.nnodes = nnodes
        self.script = tmp / "job.py"
        self.script.write_text(textwrap.dedent(RANK))
        self.env = clean_env(PLAIT_SECRET=f"node-meeting-{self.port}", PLAIT_TIMEOUT=RANK_TIMEOUT)
        self.launchers: list[Launcher] = []

    def start(
        self,
        node: int,
        nproc: int,
        *,
        hold: bool = False,
        nnodes: int = 0,
        master_addr: str = "127.0.0.1",
    ) -> Launcher:
        """Start node ``node``'s launcher with ``-n nproc``; ``hold``: its ranks stay in the job
        until :meth:`release` closes its stdin."""
        cmd = [
            *(sys.executable, "-m", "plait", "run", "--tag-output"),
            *("--nnodes", str(nnodes or self.nnodes), "--node-rank", str(node)),
            *("-n", str(nproc), "--master-addr", master_addr, "--master-port", str(self.port)),
            str(self.script),
        ]
        proc = subprocess.Popen(
            cmd,
            env={**self.env, "HOLD": "1" if hold else "0"},
            stdin=subprocess.PIPE if hold else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        launcher = Launcher(node, proc, time.monotonic())
        self.launchers.append(launcher)
        return launcher

    def finish(self, launchers: Sequence[Launcher] | None = None) -> list[Launcher]:
        """Wait for ``launchers`` (default: all) to exit; kill every launcher past JOB_SECONDS."""
        chosen = list(self.launchers if launchers is None else launchers)
        deadline = time.monotonic() + JOB_SECONDS
        for la in chosen:
            try:
                la.out, la.err = la.proc.communicate(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                _kill(self.launchers)
                for other in self.launchers:
                    other.out, other.err = other.proc.communicate()
                report = "\n".join(x.describe() for x in self.launchers)
                raise AssertionError(
                    f"launchers still running after {JOB_SECONDS} s\n{report}"
                ) from None
            la.seconds = time.monotonic() - la.started
        return chosen

    def report(self) -> str:
        return "\n".join(la.describe() for la in self.launchers)

    def close(self) -> None:
        _kill(self.launchers)
        for la in self.launchers:
            if la.proc.poll() is None:
                la.proc.wait()
            for stream in (la.proc.stdin, la.proc.stdout, la.proc.stderr):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Callable[[int], Job]]:
    """Makes a job of ``nnodes`` hosts; every launcher of it is killed after the test."""
    made: list[Job] = []

    def make(nnodes: int) -> Job:
        made.append(Job(tmp_path, nnodes))
        return made[-1]

    yield make
    for j in made:
        j.close()


def _read_until(stream: IO[str] | None, pattern: str, count: int) -> list[str]:
    """Lines of ``stream`` up to the ``count``-th that matches ``pattern``."""
    assert stream is not None
    lines: list[str] = []
    seen = 0
    while seen < count:
        line = stream.readline()
        assert line, f"the stream ended after {lines}"
        lines.append(line)
        seen += bool(re.search(pattern, line))
    return lines


def _failed_at_once(j: Job) -> None:
    for la in j.finish():
        assert la.proc.returncode not in (0, None), j.report()
        assert la.seconds < FAIL_SECONDS, j.report()
        # No rank starts: nothing of the job is written under a numbering that clashes.
        assert "started" not in la.out, j.report()


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("sizes", "order"),
    [((2, 3), (0, 1)), ((3, 2), (0, 1)), ((2, 3), (1, 0)), ((2, 2, 3), (2, 0, 1))],
    ids=["fewer-on-node0", "more-on-node0", "node1-first", "three-nodes"],
)
def test_launchers_given_different_nproc_all_fail_at_once(
    job: Callable[[int], Job], sizes: tuple[int, ...], order: tuple[int, ...]
) -> None:
    j = job(len(sizes))
    launchers = {k: j.start(k, sizes[k]) for k in order}
    _failed_at_once(j)
    pids = {k: la.proc.pid for k, la in launchers.items()}
    odd = next(k for k in range(1, len(sizes)) if sizes[k] != sizes[0])
    nn = len(sizes)
    for la in launchers.values():
        # Which launcher said how many, and what was expected: node 0's shape, everywhere.
        assert f"node 0 ({HOST} pid {pids[0]}) was given -n {sizes[0]} --nnodes {nn}" in la.err, (
            j.report()
        )
        assert f"node {odd} ({HOST} pid {pids[odd]}) -n {sizes[odd]} --nnodes {nn}" in la.err, (
            j.report()
        )
        assert f"expected -n {sizes[0]} --nnodes {nn} on every node" in la.err, j.report()


@pytest.mark.timeout(90)
def test_launchers_given_different_nnodes_all_fail_at_once(job: Callable[[int], Job]) -> None:
    j = job(2)
    node0 = j.start(0, 2)
    node1 = j.start(1, 2, nnodes=3)
    _failed_at_once(j)
    for la in (node0, node1):
        assert f"node 1 ({HOST} pid {node1.proc.pid}) -n 2 --nnodes 3" in la.err, j.report()
        assert "expected -n 2 --nnodes 2 on every node" in la.err, j.report()


def _names_both(text: str, node: int, pids: Sequence[int]) -> bool:
    """Whether a line of ``text`` says node rank ``node`` went to two launchers, naming both."""
    lines = [x for x in text.splitlines() if f"node rank {node} was given to two launchers" in x]
    return any(all(f"{HOST} pid {p}" in x for p in pids) for x in lines)


@pytest.mark.timeout(90)
def test_two_launchers_given_one_node_rank_all_fail_at_once(job: Callable[[int], Job]) -> None:
    # Node 2 never comes: without the check, node 0's ranks waited out their minute for it.
    j = job(3)
    node0 = j.start(0, 2)
    first, second = j.start(1, 2), j.start(1, 2)
    _failed_at_once(j)
    pids = (first.proc.pid, second.proc.pid)
    for la in (node0, first, second):
        assert _names_both(la.err, 1, pids), j.report()


@pytest.mark.timeout(90)
def test_a_second_launcher_of_a_running_node_fails_and_the_job_goes_on(
    job: Callable[[int], Job],
) -> None:
    j = job(2)
    node0, node1 = j.start(0, 2, hold=True), j.start(1, 2, hold=True)
    for la in (node0, node1):  # both nodes' ranks have met and hold the job open
        _read_until(la.proc.stdout, r"met: 10$", 2)
    late = j.start(1, 2)
    [late] = j.finish([late])
    assert late.proc.returncode not in (0, None), j.report()
    assert late.seconds < FAIL_SECONDS, j.report()
    assert "started" not in late.out, j.report()  # its ranks would have clashed with node 1's
    assert _names_both(late.err, 1, (node1.proc.pid, late.proc.pid)), j.report()
    for la in (node0, node1):
        assert la.proc.stdin is not None
        la.proc.stdin.close()  # EOF: every rank of the two nodes leaves the job
        la.proc.stdin = None  # communicate() has nothing left to send
    for la in j.finish([node0, node1]):
        assert la.proc.returncode == 0, j.report()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("order", [(0, 1, 2), (2, 1, 0)], ids=["node0-first", "node0-last"])
def test_launchers_that_agree_run_the_job(
    job: Callable[[int], Job], order: tuple[int, ...]
) -> None:
    j = job(3)
    for k in order:
        j.start(k, 2)
    for la in j.finish():
        assert la.proc.returncode == 0, j.report()
        met = sorted(re.findall(r"rank (\d) of 6 met: 21", la.out))
        assert met == [str(2 * la.node), str(2 * la.node + 1)], j.report()


@pytest.mark.timeout(90)
def test_launchers_given_node_0_by_other_names_run_the_job(job: Callable[[int], Job]) -> None:
    # Each launcher named the job after --master-addr as it was given, and the ranks met in
    # a namespace of that name: the two halves waited for each other until the timeout.
    j = job(2)
    j.start(0, 1, master_addr="127.0.0.1")
    j.start(1, 1, master_addr="localhost")
    for la in j.finish():
        assert la.proc.returncode == 0, j.report()
        assert f"rank {la.node} of 2 met: 3" in la.out, j.report()


@pytest.mark.timeout(60)
def test_a_launcher_waiting_for_the_others_stops_on_sigint(job: Callable[[int], Job]) -> None:
    from plait.rendezvous.nodes import claim_key

    j = job(2)
    node0 = j.start(0, 2)
    with TCPStore("127.0.0.1", j.port, secret=j.env["PLAIT_SECRET"].encode(), timeout=20) as s:
        s.get(claim_key(0), 20)  # node 0 has claimed its rank and waits for node 1
    node0.proc.send_signal(signal.SIGINT)
    [node0] = j.finish([node0])
    assert node0.proc.returncode == 128 + signal.SIGINT, j.report()
    assert node0.seconds < FAIL_SECONDS, j.report()
    assert "started" not in node0.out, j.report()


@pytest.mark.timeout(90)
def test_a_launcher_whose_node_0_never_comes_says_how_long_it_tried(
    job: Callable[[int], Job],
) -> None:
    """It tried for the whole timeout, and said "within 0.9841 s", its last try's slice."""
    j = job(2)
    j.env["PLAIT_TIMEOUT"] = "3"
    node1 = j.start(1, 1)
    [la] = j.finish([node1])
    assert la.proc.returncode not in (0, None), j.report()
    assert "cannot reach the job's store" in la.err, j.report()
    assert "in 3 s of trying" in la.err, j.report()


#: Ranks meet, then rank FAIL exits with 3 while the others compute alone for a while.
FAILS = """
    import os, sys, time
    import numpy as np
    import plait
    with plait.init() as comm:
        comm.allreduce(np.ones(1))
        if comm.rank == int(os.environ["FAIL"]):
            sys.exit(3)
        print(f"rank {comm.rank} computes alone", flush=True)
        time.sleep(30)
    print(f"rank {comm.rank} ran to its end", flush=True)
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("failing", [0, 3], ids=["on-node-0", "on-node-1"])
def test_a_failure_on_one_host_stops_the_others(job: Callable[[int], Job], failing: int) -> None:
    """Each launcher watched its own ranks only: the other host's ranks ran to their end
    and its launcher exited 0 for a job that had failed (Note [a failure on another host]
    in plait.launch.elsewhere)."""
    j = job(2)
    j.script.write_text(textwrap.dedent(FAILS))
    j.env["FAIL"] = str(failing)
    for node in (0, 1):
        j.start(node, 2)
    for la in j.finish():
        assert la.proc.returncode == 3, j.report()
        assert la.seconds < 20, j.report()
        assert "ran to its end" not in la.out, j.report()
    other = j.launchers[1 - failing // 2]
    assert f"rank {failing}, on another host, exited with code 3" in other.err, j.report()


#: Ranks meet; rank 3 exits with 9 (DIES: os._exit or sys.exit), and each other rank, as
#: ROLES says, waits for a message from rank 3 (and fails with PeerLostError once it is gone)
#: or computes alone until it is stopped.
DIES = """
    import os, sys, time
    import numpy as np
    import plait
    with plait.init() as comm:
        comm.barrier()
        if comm.rank == 3:
            os._exit(9) if os.environ["DIES"] == "os._exit" else sys.exit(9)
        if os.environ["ROLES"].split(",")[comm.rank] == "waits":
            comm.recv(np.zeros(1), 3)
        time.sleep(30)
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("dies", "roles"),
    [("os._exit", "alone,alone,waits"), ("sys.exit", "waits,waits,alone")],
    ids=["a-bystander-filed-before-it", "a-host-of-bystanders-filed-first"],
)
def test_every_host_names_the_rank_that_started_a_failure(
    job: Callable[[int], Job], dies: str, roles: str
) -> None:
    """Rank 3 (node 1) exits with 9; the other ranks that fail do so because it died.

    Node 1 filed its failed ranks in rank order, rank 2's PeerLostError before rank 3, and
    node 0's launcher named the lowest: "rank 2, on another host", exit 1. And node 1, while
    it waited a second for a cause after rank 3's exit without a traceback (rank 2 still
    running), took node 0's filing of its ranks' PeerLostErrors: "rank 0, on another
    host", exit 1. The launchers now settle on one rank (Note [which host started a
    failure] in plait.launch.elsewhere)."""
    j = job(2)
    j.script.write_text(textwrap.dedent(DIES))
    j.env.update(DIES=dies, ROLES=f"{roles},dies")
    node0, node1 = j.start(0, 2), j.start(1, 2)
    j.finish()
    for la in (node0, node1):
        assert la.proc.returncode == 9, j.report()
    assert "rank 3, on another host, exited with code 9" in node0.err, j.report()
    assert "on another host" not in node1.err, j.report()
    assert re.search(r"rank 3: exit 9 +<- started the failure", node1.err), j.report()


HANGS = """
    import threading, time
    import numpy as np
    import plait
    with plait.init() as comm:
        comm.barrier()
        if comm.rank == 3:  # a thread that is no daemon: the rank hangs on its way out
            threading.Thread(target=time.sleep, args=(20,)).start()
            raise ValueError("the cause")
        try:
            comm.recv(np.zeros(1), 3)
        finally:
            if comm.rank == 2:  # a bystander that takes a moment to end
                time.sleep(0.5)
"""


@pytest.mark.timeout(90)
def test_a_cause_found_late_on_a_later_ticket_is_named_everywhere(
    job: Callable[[int], Job],
) -> None:
    """Rank 3 (node 1) raises ValueError and hangs on its way out; node 1 names it only once
    its bystander (rank 2) has ended, after node 0 had drawn ticket 1 for rank 0's
    PeerLostError and waited for the smaller tickets only (none): both launchers named rank
    0, exit 1. A launcher whose failure is not the likeliest kind waits for every ticket
    drawn (Note [which host started a failure] in plait.launch.elsewhere)."""
    j = job(2)
    j.script.write_text(textwrap.dedent(HANGS))
    node0, node1 = j.start(0, 2), j.start(1, 2)
    j.finish()
    assert "rank 3, on another host" in node0.err, j.report()
    assert "on another host" not in node1.err, j.report()
    assert re.search(r"rank 3: .*<- started the failure", node1.err), j.report()
    for la in (node0, node1):
        assert la.proc.returncode == 1, j.report()


#: The ranks listed in EARLY exit with 0 before they call plait.init; the others wait there.
EARLY = """
    import os, sys
    import plait
    if os.environ["PLAIT_RANK"] in os.environ["EARLY"].split(","):
        sys.exit(0)
    with plait.init() as comm:
        comm.barrier()
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "early", ["2", "2,3", "0,1"], ids=["one-of-node-1", "all-of-node-1", "all-of-node-0"]
)
def test_every_host_names_a_rank_that_exited_before_init_on_another(
    job: Callable[[int], Job], early: str
) -> None:
    """Only the rank's own launcher saw it exit: the other host named one of its own ranks,
    whose PeerLostError named the early rank, as the one that started the failure; and a
    host whose ranks had all ended with 0 (the last of them not even filed for the others)
    exited 0 for a job that had failed."""
    j = job(2)
    j.script.write_text(textwrap.dedent(EARLY))
    j.env["EARLY"] = early
    node0, node1 = j.start(0, 2), j.start(1, 2)
    j.finish()
    leaving = [int(r) for r in early.split(",")]
    home, other = (node0, node1) if leaving[0] < 2 else (node1, node0)
    for la in (node0, node1):
        assert la.proc.returncode == 1, j.report()
        assert la.seconds < 20, j.report()
    said = re.search(
        r"rank (\d), on another host, exited with code 0 before calling plait.init", other.err
    )
    assert said is not None, j.report()
    named = int(said.group(1))
    assert named in leaving, j.report()
    assert f"rank {named} exited with code 0 before calling plait.init" in home.err, j.report()
    assert re.search(rf"rank {named}: exit 0 +<- started the failure", home.err), j.report()
    assert "started the failure" not in other.err, j.report()
