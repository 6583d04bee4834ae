"""Check plait's simulator against measured allreduce times on emulated, bandwidth-capped hosts.

Run it as root on Linux (it needs ``ip`` and ``tc`` from iproute2)::

    python examples/sim_validate.py                      # 2x2 and 3x1 hosts, 200 Mbit/s, ~6 min
    python examples/sim_validate.py --layouts 2x2,3x1,2x1 --json out.json
    python examples/sim_validate.py --layouts 2x2 --sizes 4M --check   # exit 1 beyond 25 %

What it does:

1. **Hosts.** Network namespaces ``plait-sv-<pid>-h<k>`` (one per host) hang on
   one bridge in a switch namespace ``plait-sv-<pid>-sw`` through veth pairs
   (``eth0`` = 10.77.0.<k+1>/24 in each host). Every veth end gets a ``tbf``
   qdisc at ``--rate``: the host's ``eth0`` caps what the host sends, the
   switch's port to the host what it receives, so each host has a full-duplex
   NIC of that rate, as in :func:`plait.sim.hosts`. Nothing is added to the
   root namespace, no namespace has a route anywhere else, and everything is
   deleted on the way out (also on Ctrl-C or SIGTERM).
2. **Calibration.** ``plait tune --no-tcp`` (run inside a host namespace)
   measures the shared-memory link (α, β) and the per-byte reduce and copy
   costs (γ, δ). The inter-host link's β is the tbf rate in payload bytes:
   tbf counts whole Ethernet frames, so of every 1514 bytes it lets through
   1448 are TCP payload (MTU 1500, TCP timestamps). Its α is measured in every
   job: the median one-way time of an 8-byte ping-pong between rank 0 and the
   first rank of host 1. The same ping-pong with 4 MiB messages is reported
   as a check of the payload rate.
3. **Measurement.** One ``plait run`` launcher per host namespace (``ip netns
   exec``), node 0's serving the store, runs this file with ``--worker``: for
   every algorithm and size, warm-up calls, then timed calls, each after a
   barrier; a call's time is its slowest rank's, a row's time the median over
   calls.
4. **Prediction.** :func:`plait.sim.simulate` runs the same algorithm, size and
   segment size (``segment_bytes=None``: the communicator's) on
   ``sim.hosts(H, L, intra, inter)`` with the calibrated parameters.

It prints one table (measured median and fastest call, predicted,
predicted/measured) and, with ``--json``, writes every row and the
calibration. ``--check`` exits 1 when a ratio is off by more than
``--tolerance`` (25 %). Exit code 3: the emulated hosts could not be made (not
root, no iproute2, namespaces refused).

The simulator sends every message eagerly; the TCP transport hands messages
above ``EAGER_MAX`` (512 KiB) over by rendezvous (a request, a clear-to-send,
then the payload in chunks of at most ``CHUNK`` bytes, between which a
clear-to-send for the other direction may go). ``--eager-max 1G`` raises the
limit in every rank (a diagnostic: it measures the same schedules without the
handshake).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
PREFIX = "plait-sv"
SUBNET = "10.77.0"
MASTER = f"{SUBNET}.1"
#: TCP payload per full frame, and the frame as tbf counts it (MTU 1500: 20 B of IP,
#: 20 B of TCP, 12 B of timestamps; 14 B of Ethernet header on top).
PAYLOAD, FRAME = 1448, 1514
ALGORITHMS = "ring,recursive_doubling,rabenseifner,hierarchical,cascade"
NO_HOSTS = 3  # exit code when the emulated hosts cannot be made
_NAME = re.compile(rf"^{PREFIX}-(\d+)-(?:sw|h\d+)$")
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(kbit|mbit|gbit)$")


# -- sizes and rates ---------------------------------------------------------------------------


def parse_size(text: str) -> int:
    """``4M`` -> 4194304 (binary K, M, G suffixes)."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def format_size(n: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}iB"
    return f"{n} B"


def rate_bits(text: str) -> float:
    """A tc rate (``200mbit``, ``1gbit``; SI prefixes, as tc reads them) in bits per second."""
    m = _RATE.match(text.strip().lower())
    if not m:
        raise argparse.ArgumentTypeError(f"rate {text!r}: use e.g. 200mbit, 50000kbit or 1gbit")
    return float(m.group(1)) * {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}[m.group(2)]


def parse_layout(text: str) -> tuple[int, int]:
    """``2x2`` -> (hosts, ranks per host)."""
    m = re.fullmatch(r"(\d+)x(\d+)", text.strip())
    if not m or int(m.group(1)) < 2 or int(m.group(2)) < 1:
        raise argparse.ArgumentTypeError(f"layout {text!r}: HOSTSxRANKS with at least 2 hosts")
    return int(m.group(1)), int(m.group(2))


# -- emulated hosts ----------------------------------------------------------------------------


def _sh(*cmd: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({res.returncode}): {res.stderr.strip()}")
    return res


def _netns_pids(ns: str) -> list[int]:
    res = _sh("ip", "netns", "pids", ns, check=False)
    return [int(p) for p in res.stdout.split()] if res.returncode == 0 else []


def _kill_all_in(namespaces: list[str]) -> None:
    """SIGKILL every process in ``namespaces`` (only this script's jobs run there)."""
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        pids = [p for ns in namespaces for p in _netns_pids(ns)]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def why_no_namespaces() -> str | None:
    """Why emulated hosts cannot be made here, or None."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the `{tool}` command (iproute2) is not installed"
    return None


def remove_stale() -> None:
    """Delete namespaces that an earlier, killed run of this script left (its pid is gone)."""
    for line in _sh("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _NAME.match(name)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            _kill_all_in([name])
            _sh("ip", "netns", "del", name, check=False)


class Hosts:
    """``n`` host namespaces on one bridge, each NIC capped by tbf both ways."""

    def __init__(self, n: int, rate: str, burst: str, limit: str) -> None:
        self.tag = f"{PREFIX}-{os.getpid()}"
        self.switch = f"{self.tag}-sw"
        self.hosts = [f"{self.tag}-h{k}" for k in range(n)]
        self.tbf = ["tbf", "rate", rate, "burst", burst, "limit", limit]
        self.created: list[str] = []

    @staticmethod
    def address(host: int) -> str:
        return f"{SUBNET}.{host + 1}"

    def up(self) -> None:
        for ns in (self.switch, *self.hosts):
            _sh("ip", "netns", "add", ns)
            self.created.append(ns)
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        sw = ("ip", "-n", self.switch)
        _sh(*sw, "link", "add", "br0", "type", "bridge")
        _sh(*sw, "link", "set", "br0", "up")
        for k, ns in enumerate(self.hosts):
            port = f"h{k}"
            # Both ends are made inside our namespaces: the root namespace never sees them.
            _sh(*sw, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _sh(*sw, "link", "set", port, "master", "br0")
            _sh(*sw, "link", "set", port, "up")
            _sh("ip", "-n", ns, "addr", "add", f"{self.address(k)}/24", "dev", "eth0")
            _sh("ip", "-n", ns, "link", "set", "eth0", "up")
            _sh("tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", *self.tbf)
            _sh("tc", "-n", self.switch, "qdisc", "add", "dev", port, "root", *self.tbf)

    def down(self) -> None:
        _kill_all_in(self.created)
        for ns in reversed(self.created):
            _sh("ip", "netns", "del", ns, check=False)
        self.created.clear()

    def tbf_bytes(self) -> list[int]:
        """Bytes each host's tbf let out (its egress), host by host."""
        out = []
        for ns in self.hosts:
            res = _sh("tc", "-s", "-n", ns, "qdisc", "show", "dev", "eth0")
            m = re.search(r"qdisc tbf .*?Sent (\d+) bytes", res.stdout, re.S)
            out.append(int(m.group(1)) if m else 0)
        return out

    def run_job(
        self,
        hosts: int,
        nproc: int,
        args: list[str],
        port: int,
        timeout: float,
        tmp: Path,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        """One ``plait run`` launcher per host namespace, this file with ``--worker args``."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("PLAIT_")}
        env["PLAIT_SECRET"] = f"sim-validate-{os.getpid()}-{port}"
        env["PLAIT_PROFILE"] = str(tmp / "no-profile.json")  # auto is never used; be hermetic
        env.update(extra_env or {})
        procs: list[tuple[subprocess.Popen[bytes], Path]] = []
        try:
            for k in range(hosts):
                err = tmp / f"node{k}-{port}.log"
                cmd = [
                    *("ip", "netns", "exec", self.hosts[k], sys.executable, "-m", "plait", "run"),
                    *("--nnodes", str(hosts), "--node-rank", str(k), "-n", str(nproc)),
                    *("--master-addr", MASTER, "--master-port", str(port), "--tag-output"),
                    *(str(HERE), "--worker", *args),
                ]
                with err.open("wb") as f:
                    proc = subprocess.Popen(
                        cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
                    )
                procs.append((proc, err))
            deadline = time.monotonic() + timeout
            while any(p.poll() is None for p, _ in procs):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the {hosts}x{nproc} job ran past {timeout:.0f} s")
                time.sleep(0.05)
            if any(p.returncode for p, _ in procs):
                logs = "\n".join(
                    f"--- node {k}\n{e.read_text()[-3000:]}" for k, (_, e) in enumerate(procs)
                )
                raise RuntimeError(f"the {hosts}x{nproc} job failed:\n{logs}")
        finally:
            for p, _ in procs:
                if p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
            _kill_all_in(self.hosts)


# -- the ranks -----------------------------------------------------------------------------------


def worker(argv: list[str]) -> int:
    """One rank of a measuring job (started by ``plait run`` in a host namespace)."""
    import numpy as np

    import plait

    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--algorithms", required=True)
    p.add_argument("--sizes", required=True)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--min-iters", type=int, default=3)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--eager-max", type=int, default=0)
    a = p.parse_args(argv)
    if a.eager_max:
        import plait.transport.tcp

        plait.transport.tcp.EAGER_MAX = a.eager_max
    with plait.init(timeout=600) as comm:
        peer = comm.local_size  # the first rank of host 1
        result: dict[str, Any] = {"size": comm.size, "local_size": comm.local_size}
        result["transport"] = type(comm._transport).__name__
        for nbytes in (8, 4 << 20):
            buf = np.zeros(nbytes, np.uint8)
            times = []
            for k in range(3 + (9 if nbytes < 4096 else 3)):
                comm.barrier()
                t = time.perf_counter()
                if comm.rank == 0:
                    comm.send(buf, peer)
                    comm.recv(buf, peer)
                elif comm.rank == peer:
                    comm.recv(buf, 0)
                    comm.send(buf, 0)
                if k >= 3:
                    times.append((time.perf_counter() - t) / 2)
            result[f"one_way_{nbytes}"] = statistics.median(times) if comm.rank == 0 else 0.0
        rows = []
        for algo in a.algorithms.split(","):
            for nbytes in (int(s) for s in a.sizes.split(",")):
                x = np.ones(nbytes // 4, np.float32)
                out = np.empty_like(x)
                warm = 0.0
                for _ in range(a.warmup):
                    comm.barrier()
                    t = time.perf_counter()
                    comm.allreduce(x, out=out, algorithm=algo)
                    warm = max(warm, time.perf_counter() - t)
                slowest = comm.allreduce(np.array([warm]), plait.MAX)[0]  # same on every rank
                iters = max(a.min_iters, min(a.iters, round(a.seconds / max(slowest, 1e-9))))
                mine = []
                for _ in range(iters):
                    comm.barrier()
                    t = time.perf_counter()
                    comm.allreduce(x, out=out, algorithm=algo)
                    mine.append(time.perf_counter() - t)
                if out.size and (out[0] != comm.size or out[-1] != comm.size):
                    raise SystemExit(f"{algo} {nbytes} B: wrong result {out[0]}, {out[-1]}")
                per_call = comm.allgather(np.array(mine)).max(axis=0)  # slowest rank per call
                rows.append(
                    {
                        "algorithm": algo,
                        "bytes": nbytes,
                        "iters": iters,
                        "measured_s": float(np.median(per_call)),
                        "fastest_s": float(per_call.min()),
                        "calls_s": [float(v) for v in per_call],
                    }
                )
        result["rows"] = rows
        if comm.rank == 0:
            a.out.write_text(json.dumps(result))
        comm.barrier()
    return 0


# -- the model -----------------------------------------------------------------------------------


@dataclass
class Calibration:
    """Every parameter of the modelled network, and where it came from."""

    rate_bits: float
    intra_alpha: float
    intra_beta: float
    gamma: float
    delta: float
    inter_alpha: float = 0.0
    measured: dict[str, Any] = field(default_factory=dict)

    @property
    def inter_beta(self) -> float:
        """Seconds per payload byte through a tbf of ``rate_bits`` (it counts whole frames)."""
        return 8.0 / self.rate_bits * FRAME / PAYLOAD


def measure_intra(ns: str, tmp: Path) -> Calibration:
    """``plait tune --no-tcp`` inside namespace ``ns``: shared memory's α, β and γ, δ."""
    from plait.selection.model import Profile

    path = tmp / "shm-profile.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLAIT_")}
    cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "plait", "tune", "--no-tcp"]
    res = subprocess.run(
        [*cmd, "-o", str(path)], capture_output=True, text=True, timeout=300, env=env
    )
    if res.returncode != 0:
        raise RuntimeError(f"plait tune failed: {res.stderr[-2000:]}")
    prof = Profile.from_json(json.loads(path.read_text()))
    return Calibration(0.0, prof.intra.alpha, prof.intra.beta, prof.gamma, prof.delta)


def predict(cal: Calibration, hosts: int, nproc: int, algo: str, nbytes: int) -> float:
    """Simulated time of one allreduce, as the communicator runs it, on the modelled hosts."""
    from plait import sim

    net = sim.hosts(
        hosts,
        nproc,
        sim.LinkParams(cal.intra_alpha, cal.intra_beta),
        sim.LinkParams(cal.inter_alpha, cal.inter_beta),
        gamma=cal.gamma,
        delta=cal.delta,
    )
    return sim.simulate("allreduce", algo, nbytes, net, segment_bytes=None).time


# -- main ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(argv[1:])
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rate", default="200mbit", help="tbf rate per NIC direction (200mbit)")
    parser.add_argument("--burst", default="32kb", help="tbf bucket size (32kb)")
    parser.add_argument("--limit", default="4mb", help="tbf queue length in bytes (4mb)")
    parser.add_argument(
        "--layouts", default="2x2,3x1", help="HOSTSxRANKS, comma-separated (2x2,3x1)"
    )
    parser.add_argument("--algorithms", default=ALGORITHMS, help=f"({ALGORITHMS})")
    parser.add_argument("--sizes", default="4M,16M,64M", help="allreduce bytes (4M,16M,64M)")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up calls per row (1)")
    parser.add_argument("--iters", type=int, default=15, help="timed calls per row, at most (15)")
    parser.add_argument("--min-iters", type=int, default=3, help="timed calls, at least (3)")
    parser.add_argument(
        "--seconds", type=float, default=3.0, help="timed seconds a row aims at (3)"
    )
    parser.add_argument("--tolerance", type=float, default=0.25, help="for --check (0.25)")
    parser.add_argument("--check", action="store_true", help="exit 1 if a row is off by more")
    parser.add_argument("--json", type=Path, help="write every row and the calibration here")
    parser.add_argument(
        "--eager-max",
        type=parse_size,
        default=0,
        help="diagnostic: set the TCP transport's EAGER_MAX in every rank (e.g. 1G: no "
        "rendezvous handshake for any message); default: the transport's own",
    )
    args = parser.parse_args(argv)
    bits = rate_bits(args.rate)
    layouts = [parse_layout(s) for s in args.layouts.split(",")]
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    algos = [s.strip() for s in args.algorithms.split(",") if s.strip()]
    why = why_no_namespaces()
    if why:
        print(f"sim_validate: cannot emulate hosts: {why}", file=sys.stderr)
        return NO_HOSTS

    def _stop(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _stop)
    remove_stale()
    net = Hosts(max(h for h, _ in layouts), args.rate, args.burst, args.limit)
    results: list[dict[str, Any]] = []
    jobs: list[dict[str, Any]] = []
    try:
        try:
            net.up()
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            print(f"sim_validate: cannot emulate hosts: {exc}", file=sys.stderr)
            return NO_HOSTS
        with tempfile.TemporaryDirectory(prefix="plait-sv-") as tmpdir:
            tmp = Path(tmpdir)
            base = measure_intra(net.hosts[0], tmp)
            base.rate_bits = bits
            print(
                f"# tbf {args.rate} (burst {args.burst}) per NIC direction: payload "
                f"{1e-6 / base.inter_beta:.2f} MB/s; shared memory α = "
                f"{base.intra_alpha * 1e6:.1f} µs, {1e-9 / base.intra_beta:.2f} GB/s; "
                f"γ {1e-9 / base.gamma:.1f} GB/s, δ {1e-9 / base.delta:.1f} GB/s",
                flush=True,
            )
            for n_job, (hosts, nproc) in enumerate(layouts):
                out = tmp / f"job{n_job}.json"
                worker_args = [
                    str(out),
                    *("--algorithms", ",".join(algos)),
                    *("--sizes", ",".join(map(str, sizes))),
                    *("--warmup", str(args.warmup), "--iters", str(args.iters)),
                    *("--min-iters", str(args.min_iters), "--seconds", str(args.seconds)),
                    *("--eager-max", str(args.eager_max)),
                ]
                # Generous: every call at a quarter of the rate, moving 2·nproc vectors per NIC.
                per_call = sum(8 * 2 * nproc * n * 4 / bits for n in sizes) * len(algos)
                timeout = 120 + per_call * (args.warmup + args.iters)
                before = net.tbf_bytes()
                load = os.getloadavg()[0]
                started = time.perf_counter()
                net.run_job(hosts, nproc, worker_args, 29500 + n_job, timeout, tmp)
                wall = time.perf_counter() - started
                load = max(load, os.getloadavg()[0])
                sent = [b - a for a, b in zip(before, net.tbf_bytes(), strict=True)][:hosts]
                got = json.loads(out.read_text())
                cal = Calibration(**{**base.__dict__, "measured": {}})
                cal.inter_alpha = got["one_way_8"]
                big = got[f"one_way_{4 << 20}"]
                cal.measured = {
                    "one_way_8_s": got["one_way_8"],
                    "one_way_4MiB_s": big,
                    "p2p_payload_MBps": (4 << 20) / max(big - cal.inter_alpha, 1e-9) / 1e6,
                }
                jobs.append(
                    {
                        "layout": f"{hosts}x{nproc}",
                        "transport": got["transport"],
                        "wall_s": wall,
                        "load_average": load,
                        "tbf_bytes_sent": sent,
                        "inter_alpha_s": cal.inter_alpha,
                        "inter_beta_s_per_byte": cal.inter_beta,
                        "intra_alpha_s": cal.intra_alpha,
                        "intra_beta_s_per_byte": cal.intra_beta,
                        "gamma": cal.gamma,
                        "delta": cal.delta,
                        **cal.measured,
                    }
                )
                print(
                    f"# {hosts} hosts x {nproc} ranks ({got['transport']}, {wall:.0f} s, "
                    f"load average up to {load:.1f}): "
                    f"inter α = {cal.inter_alpha * 1e6:.0f} µs (8 B one-way); 4 MiB one-way at "
                    f"{cal.measured['p2p_payload_MBps']:.2f} MB/s; "
                    f"tbf sent {', '.join(f'{s / 2**20:.0f}' for s in sent)} MiB",
                    flush=True,
                )
                for row in got["rows"]:
                    pred = predict(cal, hosts, nproc, row["algorithm"], row["bytes"])
                    results.append(
                        {
                            "layout": f"{hosts}x{nproc}",
                            **row,
                            "predicted_s": pred,
                            "ratio": pred / row["measured_s"],
                        }
                    )
    finally:
        net.down()
    print(
        f"{'layout':<7}{'algorithm':<20}{'size':>9}{'iters':>6}"
        f"{'measured_ms':>13}{'fastest_ms':>12}{'predicted_ms':>14}{'pred/meas':>11}"
    )
    bad = 0
    for r in results:
        off = abs(r["ratio"] - 1) > args.tolerance
        bad += off
        print(
            f"{r['layout']:<7}{r['algorithm']:<20}{format_size(r['bytes']):>9}{r['iters']:>6}"
            f"{r['measured_s'] * 1e3:>13.1f}{r['fastest_s'] * 1e3:>12.1f}"
            f"{r['predicted_s'] * 1e3:>14.1f}"
            f"{r['ratio']:>11.3f}{'  <-- off' if off else ''}"
        )
    print(f"# {len(results) - bad} of {len(results)} rows within {args.tolerance:.0%}")
    if args.json:
        doc = {
            "rate": args.rate,
            "burst": args.burst,
            "limit": args.limit,
            "eager_max": args.eager_max or None,
            "tolerance": args.tolerance,
            "jobs": jobs,
            "rows": results,
        }
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 1 if args.check and bad else 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except KeyboardInterrupt:
        print("sim_validate: interrupted; the emulated hosts are gone", file=sys.stderr)
        raise SystemExit(130) from None
