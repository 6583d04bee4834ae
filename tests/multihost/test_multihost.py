"""plait across emulated hosts: Linux network namespaces on this machine.

Topology (made by the module fixture, always torn down)::

    namespace plait-<pid>-sw:   bridges br0 (10.77.0.0/24) and br1 (10.77.1.0/24)
    namespace plait-<pid>-h<k>: lo, eth0 = 10.77.0.<k+1>/24 on br0, eth1 = 10.77.1.<k+1>/24 on br1

Nothing is added to the root namespace and no namespace has a route out of the
two private subnets. One ``plait run`` launcher per host namespace (``ip netns
exec``), node 0's serving the store on 10.77.0.1; ``plait run`` sets a
different PLAIT_HOST per node, so ``plait.init`` picks TCP across hosts (and
shared memory between the ranks of one host: the hybrid transport).

The module is skipped when namespaces cannot be made (not root, no ``ip``,
``ip netns add`` refused). Speed is never asserted; the bandwidth-capped case
checks only that the job completes correctly through the caps.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RANK_CHECK = ROOT / "tests" / "multiprocess" / "rank_check.py"
HOST_CHECK = HERE / "host_check.py"
UNTIL_KILLED = HERE / "allreduce_until_killed.py"
DIES_IN_INIT = HERE / "dies_in_init.py"

#: Allreduce algorithms run across hosts (whole job, and one rank per host after
#: split_by_host). A new algorithm is one more name here.
CROSS_HOST_ALLREDUCE = [
    "ring",
    "recursive_doubling",
    "rabenseifner",
    "swing",
    "double_binary_tree",
    "direct",
    "hierarchical",
    "cascade",
    "hierarchical_arena",
    "cascade_arena",
]

HOSTS = 3  # host namespaces made; a job uses the first few
NETS = (0, 1)  # eth0 on 10.77.0.0/24 (store and default traffic), eth1 on 10.77.1.0/24
MASTER = "10.77.0.1"  # h0's eth0
JOB_SECONDS = 60.0
TBF = ["tbf", "rate", "200mbit", "burst", "64kb", "latency", "50ms"]
_NAME = re.compile(r"^plait-(\d+)-(?:sw|h\d+)$")


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({res.returncode}): {res.stderr.strip()}")
    return res


def _netns_pids(ns: str) -> list[int]:
    res = _sh("ip", "netns", "pids", ns, check=False)
    return [int(p) for p in res.stdout.split()] if res.returncode == 0 else []


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return "?"


def _kill_all_in(namespaces: Sequence[str]) -> dict[int, str]:
    """SIGKILL every process in ``namespaces`` (ours: only our jobs run there); wait for them.

    Returns {pid: command line} of the processes that were still there.
    """
    found: dict[int, str] = {}
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        pids = [p for ns in namespaces for p in _netns_pids(ns)]
        if not pids:
            break
        for pid in pids:
            found.setdefault(pid, _cmdline(pid))
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        # A poll, not an event: these processes are not our children (they run under
        # `ip netns exec`), so nothing here can wait on them; the loop rechecks the namespaces.
        time.sleep(0.05)
    return found


#: Prefix of this module's job ids, so that the leak check ignores other plait jobs' segments.
JOB_PREFIX = f"mh{os.getpid()}"


def _shm() -> set[str]:
    """This module's jobs' shared-memory segments now."""
    return {p for p in os.listdir("/dev/shm") if p.startswith(f"plait-{JOB_PREFIX}x")}


@dataclass
class Node:
    """One host's launcher."""

    ns: str
    proc: subprocess.Popen[bytes]
    out: Path
    err: Path
    ended: float | None = None  # time.time() when it was seen to exit

    @property
    def rc(self) -> int | None:
        return self.proc.returncode

    @property
    def stdout(self) -> str:
        return self.out.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self.err.read_text(errors="replace")


@dataclass
class Job:
    nodes: list[Node]

    @property
    def rcs(self) -> list[int | None]:
        return [n.rc for n in self.nodes]

    @property
    def stdout(self) -> str:
        return "".join(n.stdout for n in self.nodes)

    def report(self) -> str:
        parts = []
        for k, n in enumerate(self.nodes):
            parts.append(
                f"--- node {k} ({n.ns}) exit {n.rc}\n[stdout]\n{n.stdout[-3000:]}"
                f"\n[stderr]\n{n.stderr[-3000:]}"
            )
        return "\n".join(parts)


class Network:
    """Host namespaces joined by two bridges in a switch namespace; see the module docstring."""

    def __init__(self, hosts: int) -> None:
        self.tag = f"plait-{os.getpid()}"
        self.switch = f"{self.tag}-sw"
        self.hosts = [f"{self.tag}-h{k}" for k in range(hosts)]
        self.created: list[str] = []
        self._ports = itertools.count(29400)

    @staticmethod
    def address(host: int, net: int = 0) -> str:
        return f"10.77.{net}.{host + 1}"

    def up(self) -> None:
        for ns in (self.switch, *self.hosts):
            _sh("ip", "netns", "add", ns)
            self.created.append(ns)
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        sw = ("ip", "-n", self.switch)
        for net in NETS:
            _sh(*sw, "link", "add", f"br{net}", "type", "bridge")
            _sh(*sw, "link", "set", f"br{net}", "up")
        for k, ns in enumerate(self.hosts):
            for net in NETS:
                # Both ends are made inside our namespaces: the root namespace never sees them.
                port = f"h{k}n{net}"
                peer = ("peer", "name", f"eth{net}", "netns", ns)
                _sh(*sw, "link", "add", port, "type", "veth", *peer)
                _sh(*sw, "link", "set", port, "master", f"br{net}")
                _sh(*sw, "link", "set", port, "up")
                _sh("ip", "-n", ns, "addr", "add", f"{self.address(k, net)}/24", "dev", f"eth{net}")
                _sh("ip", "-n", ns, "link", "set", f"eth{net}", "up")

    def down(self) -> dict[int, str]:
        """Kill whatever still runs in our namespaces, delete them; returns what was killed."""
        killed = _kill_all_in(self.created)
        for ns in reversed(self.created):
            _sh("ip", "netns", "del", ns, check=False)
        return killed

    def start(
        self,
        hosts: int,
        nproc: int,
        script: Path,
        args: Sequence[str],
        tmp: Path,
        env: dict[str, str] | None = None,
        flags: Sequence[str] = (),
    ) -> Job:
        """One ``plait run`` per host namespace h0..h<hosts-1>, ``nproc`` ranks each; ``flags``
        go to every launcher."""
        port = next(self._ports)
        environ = {
            k: v for k, v in os.environ.items() if not k.startswith(("PLAIT_", "MULTIHOST_"))
        }
        # Launchers on several hosts must share the job's secret.
        environ["PLAIT_SECRET"] = f"multihost-test-{port}"
        # Job ids of this module's jobs share a prefix: the leak check sees only their segments.
        environ["PLAIT_JOB_ID"] = f"{JOB_PREFIX}x{port}"
        environ.update(env or {})
        nodes = []
        try:
            for k in range(hosts):
                ns = self.hosts[k]
                out, err = tmp / f"node{k}-{port}.out", tmp / f"node{k}-{port}.err"
                cmd = [
                    *("ip", "netns", "exec", ns, sys.executable, "-m", "plait", "run"),
                    *("--nnodes", str(hosts), "--node-rank", str(k), "-n", str(nproc)),
                    *("--master-addr", MASTER, "--master-port", str(port), "--tag-output"),
                    *flags,
                    str(script),
                    *args,
                ]
                with out.open("wb") as fo, err.open("wb") as fe:
                    proc = subprocess.Popen(
                        cmd, stdout=fo, stderr=fe, cwd=ROOT, env=environ, start_new_session=True
                    )
                nodes.append(Node(ns, proc, out, err))
        except BaseException:
            self.reap(Job(nodes))
            raise
        return Job(nodes)

    def wait(self, job: Job, timeout: float = JOB_SECONDS) -> Job:
        """Wait for every launcher (recording when each exits); kill the job past ``timeout``."""
        deadline = time.monotonic() + timeout

        def await_exit(n: Node) -> None:  # one thread per launcher: each exit time is exact
            n.proc.wait()
            n.ended = time.time()

        waiters = [threading.Thread(target=await_exit, args=(n,)) for n in job.nodes]
        try:
            for w in waiters:
                w.start()
            for w in waiters:
                w.join(max(deadline - time.monotonic(), 0.0))
            if any(w.is_alive() for w in waiters):
                self.reap(job)  # kills the launchers: their waiting threads return
                pytest.fail(f"job still running after {timeout} s\n{job.report()}")
        except BaseException:
            self.reap(job)
            raise
        # Every launcher waits for its ranks: nothing may be left running.
        stragglers = self.reap(job)
        assert not stragglers, f"processes outlived their launchers: {stragglers}"
        return job

    def run(
        self,
        hosts: int,
        nproc: int,
        script: Path,
        args: Sequence[str],
        tmp: Path,
        env: dict[str, str] | None = None,
        timeout: float = JOB_SECONDS,
        flags: Sequence[str] = (),
    ) -> Job:
        return self.wait(self.start(hosts, nproc, script, args, tmp, env, flags), timeout)

    def reap(self, job: Job) -> dict[int, str]:
        """Kill the job's process groups and anything left in the host namespaces."""
        for n in job.nodes:
            if n.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(n.proc.pid, signal.SIGKILL)
                n.proc.wait()
        return _kill_all_in(self.hosts)


def _remove_stale() -> None:
    """Delete namespaces an earlier, killed run of this module left (its pid is gone)."""
    res = _sh("ip", "netns", "list", check=False)
    for line in res.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _NAME.match(name)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            _kill_all_in([name])
            _sh("ip", "netns", "del", name, check=False)


def _why_no_namespaces() -> str | None:
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    return None


@pytest.fixture(scope="module")
def net() -> Iterator[Network]:
    why = _why_no_namespaces()
    if why:
        pytest.skip(why)
    _remove_stale()
    shm = _shm()
    network = Network(HOSTS)
    try:
        try:
            network.up()
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            pytest.skip(f"cannot build the emulated hosts with network namespaces: {exc}")
        yield network
    finally:
        killed = network.down()
        listed = _sh("ip", "netns", "list", check=False).stdout.split()
        left = [ns for ns in network.created if ns in listed]
        assert not left, f"namespaces left behind: {left}"
        assert not killed, f"processes were still running in the namespaces: {killed}"
        assert _shm() <= shm, f"shared memory left behind: {sorted(_shm() - shm)}"


@pytest.fixture
def tbf_caps(net: Network) -> Iterator[list[str]]:
    """A 200 Mbit/s token bucket on every host's eth0 (each host's egress); removed after."""
    if shutil.which("tc") is None:
        pytest.skip("the `tc` command is not installed")
    capped = []
    try:
        for ns in net.hosts:
            res = _sh("tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", *TBF, check=False)
            if res.returncode != 0:
                pytest.skip(f"cannot add a tbf qdisc: {res.stderr.strip()}")
            capped.append(ns)
        yield capped
    finally:
        for ns in capped:
            _sh("tc", "-n", ns, "qdisc", "del", "dev", "eth0", "root", check=False)


def _tbf_bytes(ns: str) -> int:
    """Bytes sent through the tbf qdisc on ``ns``'s eth0."""
    res = _sh("tc", "-s", "-n", ns, "qdisc", "show", "dev", "eth0")
    m = re.search(r"qdisc tbf .*?Sent (\d+) bytes", res.stdout, re.S)
    assert m, f"no tbf qdisc on {ns} eth0:\n{res.stdout}"
    return int(m.group(1))


def _check_host_check(job: Job, hosts: int, nproc: int, prefix: str = "10.77.0.") -> None:
    assert job.rcs == [0] * hosts, job.report()
    out = job.stdout
    size = hosts * nproc
    for r in range(size):
        assert f"rank {r}: world allreduce ok: {','.join(CROSS_HOST_ALLREDUCE)}" in out, out
        assert f"rank {r}: split_by_host ok: local {nproc} cross {hosts}" in out, out
    kind = "HybridTransport" if nproc > 1 else "TcpTransport"
    lines = re.findall(rf"rank (\d+): transport={kind} address=(\S+) host=(\S+) ", out)
    assert len(lines) == size, out
    for r, address, host in lines:
        node = int(r) // nproc
        assert address.startswith(prefix + str(node + 1) + ":"), (r, address)
        assert host.endswith(f"-node{node}"), (r, host)


# -- 1. every collective and algorithm, cross-host ----------------------------------------------


@pytest.mark.parametrize(("hosts", "nproc"), [(2, 2), (3, 1)], ids=["2x2", "3x1"])
def test_every_collective_across_hosts(
    net: Network, tmp_path: Path, hosts: int, nproc: int
) -> None:
    job = net.run(hosts, nproc, RANK_CHECK, ["full"], tmp_path)
    assert job.rcs == [0] * hosts, job.report()
    kind = "HybridTransport" if nproc > 1 else "TcpTransport"
    assert f"on {hosts * nproc} ranks over {kind}" in job.nodes[0].stdout, job.report()


# -- 1 and 2. topology, the cross-host algorithms, split_by_host --------------------------------


@pytest.mark.parametrize(("hosts", "nproc"), [(2, 2), (3, 1), (3, 2)], ids=["2x2", "3x1", "3x2"])
def test_allreduce_algorithms_and_split_by_host(
    net: Network, tmp_path: Path, hosts: int, nproc: int
) -> None:
    args = [str(hosts), str(nproc), ",".join(CROSS_HOST_ALLREDUCE)]
    job = net.run(hosts, nproc, HOST_CHECK, args, tmp_path)
    _check_host_check(job, hosts, nproc)


# -- 3. bandwidth caps ----------------------------------------------------------------------


def test_completes_through_bandwidth_caps(
    net: Network, tmp_path: Path, tbf_caps: list[str]
) -> None:
    before = [_tbf_bytes(ns) for ns in tbf_caps[:2]]
    args = ["2", "2", ",".join(CROSS_HOST_ALLREDUCE)]
    job = net.run(2, 2, HOST_CHECK, args, tmp_path)
    _check_host_check(job, 2, 2)
    sent = [_tbf_bytes(ns) - b for ns, b in zip(tbf_caps[:2], before, strict=True)]
    # The cross-host traffic really went through the capped links.
    assert all(s > 10 << 20 for s in sent), sent


# -- 4. a rank dies on another host -----------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["direct", "auto"])  # auto: cascade across hosts
def test_rank_killed_on_another_host_fails_both_launchers(
    net: Network, tmp_path: Path, algorithm: str
) -> None:
    victim = 3  # host 1, local rank 1
    job = net.run(2, 2, UNTIL_KILLED, [str(victim), "5", algorithm], tmp_path)
    died = re.search(rf"victim rank {victim} dies at ([0-9.]+)", job.stdout)
    assert died, job.report()
    assert all(rc not in (0, None) for rc in job.rcs), job.report()
    for n in job.nodes:
        assert n.ended is not None
        assert n.ended - float(died.group(1)) < 15.0, job.report()
    assert f"rank {victim} was killed by SIGKILL" in job.nodes[1].stderr, job.report()
    # Survivors on the other host see the loss, naming the dead rank: on their own
    # connection to it, or told by a rank that saw it first; or their launcher, which looks
    # for a failure on another host in the job's store, stops them first, naming it (Note
    # [a failure on another host] in plait.launch.elsewhere).
    lost = re.findall(r"rank (\d+): PeerLostError: (.*)", job.nodes[0].stdout)
    told = f"plait run: rank {victim}, on another host, was killed by SIGKILL"
    assert lost or told in job.nodes[0].stderr, job.report()
    named = (f"connection to rank {victim} lost", f"rank {victim} was lost (rank ")
    # Host 1's launcher stops the victim's neighbours at once: a survivor waiting on one of
    # them may lose it before it hears of the victim.
    stopped = re.findall(
        r"rank (\d+): killed by SIGTERM \(stopped by plait run\)", job.nodes[1].stderr
    )
    named += tuple(f"connection to rank {r} lost" for r in stopped)
    assert all(any(n in msg for n in named) for _, msg in lost), job.report()
    assert "finished without noticing" not in job.stdout, job.report()


def test_a_rank_killed_in_init_on_another_host_is_named_at_once_with_recovery(
    net: Network, tmp_path: Path
) -> None:
    # Rank 3's launcher (host 1) files its death in the store that host 0's launcher serves;
    # every other rank's init raises on it instead of waiting out its 300 s.
    job = net.run(2, 2, DIES_IN_INIT, ["3"], tmp_path, flags=["--enable-recovery"])
    assert job.rcs == [0, 0], job.report()
    for r in (0, 1, 2):
        assert f"rank {r}: lost 3 in init: " in job.stdout, job.report()
    assert "rank 3 was killed by SIGKILL, as plait run saw" in job.stdout, job.report()


def test_a_rank_killed_in_init_on_another_host_is_named_at_once_without_recovery(
    net: Network, tmp_path: Path
) -> None:
    # Without --enable-recovery host 1's launcher stops its other rank and exits; it filed
    # nothing, and host 0's ranks waited out their 300 s in plait.init for ranks 2 and 3.
    # Now it files them, and host 0's launcher, which looks for them, ends the job there
    # too, naming rank 3 and exiting with its code (Note [a failure on another host]); a
    # rank of host 0 that heard of the loss first names it as well.
    job = net.run(2, 2, DIES_IN_INIT, ["3", "2"], tmp_path)
    assert job.rcs == [137, 137], job.report()
    said = "plait run: rank 3, on another host, was killed by SIGKILL; stopping the ranks"
    assert said in job.nodes[0].stderr, job.report()
    for n in job.nodes:
        assert n.ended is not None
    assert "finished without noticing" not in job.stdout, job.report()


# -- 5. PLAIT_SOCKET_IFNAME ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ifname", "prefix"),
    [("eth1", "10.77.1."), ("^eth0,lo", "10.77.1."), ("=eth0", "10.77.0."), (None, "10.77.0.")],
    ids=["name", "exclude", "exact", "default-route-to-store"],
)
def test_socket_ifname_selects_the_interface(
    net: Network, tmp_path: Path, ifname: str | None, prefix: str
) -> None:
    env = {"MULTIHOST_EXPECT_ADDR": prefix}
    if ifname is not None:
        env["PLAIT_SOCKET_IFNAME"] = ifname
    job = net.run(2, 1, HOST_CHECK, ["2", "1", ",".join(CROSS_HOST_ALLREDUCE)], tmp_path, env)
    _check_host_check(job, 2, 1, prefix)


def test_socket_ifname_without_a_match_fails_clearly(net: Network, tmp_path: Path) -> None:
    env = {"PLAIT_SOCKET_IFNAME": "ib"}
    job = net.run(2, 1, HOST_CHECK, ["2", "1", "ring"], tmp_path, env)
    assert all(rc not in (0, None) for rc in job.rcs), job.report()
    said = "no network interface with an address matches 'ib'"
    assert any(said in node.stderr for node in job.nodes), job.report()
    # A host whose rank was stopped because the other's failed first names that one (which of
    # the two fails first is the kernel's choice: this test read host 0's own error only)
    for node in job.nodes:
        elsewhere = re.search(
            r"rank \d, on another host, exited with code 1 \(ValueError\)", node.stderr
        )
        assert said in node.stderr or elsewhere, job.report()


# -- 5. overlap of communication with computation, through a capped link ------------------------


def test_overlap_example_across_capped_hosts(
    net: Network, tmp_path: Path, tbf_caps: list[str]
) -> None:
    """examples/overlap.py on two hosts behind 200 Mbit/s links: results equal, timings printed.

    Speed is not asserted (the machine is shared); the printed table is what
    docs/training.md quotes.
    """
    example = ROOT / "examples" / "overlap.py"
    args = [
        "--layers",
        "6",
        "--width",
        "512",
        "--batch",
        "1024",
        "--steps",
        "3",
        "--bucket-mb",
        "1",
    ]
    job = net.run(2, 1, example, args, tmp_path)
    assert job.rcs == [0, 0], job.report()
    out = job.nodes[0].stdout
    assert "overlap step is" in out, job.report()
    print(out)
