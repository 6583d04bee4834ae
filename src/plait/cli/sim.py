r"""plait sim: predict a collective's time on a modelled network.

Examples, fastest first, with the time each took on a shared 2-core machine
that was busy with other work (thousands of ranks take minutes):

  3 s     plait sim -n 16 -a ring -s 1M --with-data --trace ring.json
  13 s    plait sim -n 64 --topology hosts:8 --intra-beta 1/50e9 \
              -a hierarchical,ring
  25 s    plait sim -n 1024 --topology fat-tree:32:2 --aggregation 4M \
              -a in_network,swing -s 16M
  9 min   plait sim -n 1024 --topology fat-tree:32:2 --aggregation 256K \
              -a in_network,ring

Every rank runs plait's own schedule of the collective, in virtual time. The
table has the form of plait bench's (time, algbw, busbw with the nccl-tests
factors) with one series per algorithm; the time is virtual (when
the last rank finishes), so p10 and p90 equal the median and iters is 1.
A barrier moves no data: one row of 0 bytes, without bandwidth, as there.
Progress goes to stderr once a run has taken three seconds: a line as each
simulation (an algorithm at a size) ends, with the time elapsed, and one now
and then while a long one runs (after 15 s, 30 s, then every minute or so).

Topologies (--topology; --alpha and --beta describe every cable or port):

  flat         every rank a send and a receive port into a non-blocking core
  flat-free    the contention-free alpha-beta model of Thakur et al. (2005)
  switch       one switch, a cable per rank
  fat-tree:K[:OVERSUB[:SPINES]]
               K ranks per leaf switch, uplinks oversubscribed
  hosts:K[:NICS]
               K ranks per host joined by fast ports (--intra-alpha,
               --intra-beta), hosts by NICs of --alpha and --beta
  ring, torus:AxB[xC...]
               cables between neighbours, dimension-order routing

Every rank's local work is charged at the speed of its host's memory, for
every algorithm alike: --gamma seconds per byte it reduces (a ring's receive
and reduce, a one-sided get and reduce), --delta per byte it copies (a copy
into the output or a window, a one-sided get). Both default to 1/15e9, 15 GB/s:
numpy's add and copy on one core, beyond its caches. A one-sided algorithm's
counter (a post) is seen by its peers --wait-latency seconds later (default:
what a message between the two ranks would take to arrive: --alpha on flat,
--intra-alpha within a host of hosts:K). --gamma 0 --delta 0 makes local work
free: the network alone.

--aggregation BYTES gives the switches of switch, fat-tree and hosts that much
aggregation memory, so that they reduce in flight (SHARP, SwitchML) and the
in_network allreduce can run; --algo all includes in_network only then.

--beta and the other per-byte figures accept 1/12.5e9 style values (seconds
per byte of a 12.5 GB/s link). The options plait bench has too (-n, -b, -e,
-f, -s, -d, -o, -r, -a, --json, --csv, --plot, --progress) mean the same here;
-t, the transport in plait bench, is no topology here: write --topology.
See docs/simulator.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, TextIO

import numpy as np

from plait.cli.topology import MACHINE_A_RANK, parse_topology

__all__ = ["add_arguments", "main", "parse_topology"]

_DEFAULT_ALPHA = 1e-6
_DEFAULT_BETA = 1 / 12.5e9  # a 100 Gb/s link
_DEFAULT_INTRA = (2e-7, 1 / 50e9)
#: A rank's reduction (γ) and copy (δ) cost, s/B: 15 GB/s each, numpy's add and copy of float32
#: arrays beyond the caches on one core (docs/simulator.md, "Host memory" says how measured).
_DEFAULT_GAMMA = 1 / 15e9
_DEFAULT_DELTA = 1 / 15e9
#: The defaults of the options both commands have (plait.bench.options resolves them).
_COLLECTIVE, _BEGIN, _END, _FACTOR, _RANKS = "allreduce", "1K", "64M", 4, 16
#: The most ranks -n takes (docs/simulator.md, "Scale": 16,384 take seconds to build).
MAX_RANKS = 1 << 20


def _number(text: str) -> float:
    """A float, or ``a/b`` (e.g. ``1/12.5e9``)."""
    try:
        if "/" in text:
            num, den = text.split("/", 1)
            return float(num) / float(den)
        return float(text)
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``plait sim`` (the shared ones from :mod:`plait.bench.options`)."""
    from plait.bench import options as o

    o.add_collective(parser, _COLLECTIVE)
    o.add_ranks(parser, "ranks", _RANKS)
    o.add_sizes(parser, _BEGIN, _END, _FACTOR)
    o.add_reduction(parser)
    parser.add_argument("--topology", default="flat", help="the network, see above (default flat)")
    parser.add_argument(
        "-t", dest="topology", action=o.DeprecatedAlias, instead="--topology",
        why="-t is the transport in plait bench",
    )  # fmt: skip
    o.add_algorithms(
        parser, "algorithm", "all",
        "algorithms separated by commas (listed below), or all: every one, in_network only "
        "with --aggregation, since it needs aggregating switches (default all)",
    )  # fmt: skip
    parser.add_argument("--alpha", type=_number, default=_DEFAULT_ALPHA, help="s per message")
    parser.add_argument("--beta", type=_number, default=_DEFAULT_BETA, help="s per byte")
    parser.add_argument(
        "--gamma", type=_number, default=_DEFAULT_GAMMA,
        help="s per byte a rank reduces (default 1/15e9: 15 GB/s; 0: free)",
    )  # fmt: skip
    parser.add_argument(
        "--delta", type=_number, default=_DEFAULT_DELTA,
        help="s per byte a rank copies, one-sided gets too (default 1/15e9; 0: free)",
    )  # fmt: skip
    parser.add_argument(
        "--wait-latency", type=_number, default=None, metavar="S",
        help="one-sided: s until a post is seen by the peers (default: a message's latency "
        "between the two ranks, e.g. --alpha on flat, --intra-alpha on hosts)",
    )  # fmt: skip
    parser.add_argument(
        "--intra-alpha", type=_number, default=_DEFAULT_INTRA[0], help="hosts: s per message"
    )
    parser.add_argument(
        "--intra-beta", type=_number, default=_DEFAULT_INTRA[1], help="hosts: s per byte"
    )
    parser.add_argument(
        "--segment",
        default="default",
        help="pipelining unit in bytes, with K, M, G suffixes (64K), 0 (none) or default",
    )
    parser.add_argument(
        "--aggregation",
        default="0",
        metavar="BYTES",
        help="switches reduce in flight with this much memory each (0: they do not)",
    )
    parser.add_argument("--with-data", action="store_true", help="move data; check results")
    o.add_outputs(parser)
    parser.add_argument("--trace", metavar="FILE", help="Chrome/Perfetto trace (largest size)")
    o.add_progress(
        parser,
        "a line on stderr as each simulation starts and ends (default: a line per "
        "simulation once the run has taken a few seconds; --no-progress: none)",
    )
    parser.epilog = o.algorithm_listing(
        "it runs on --topology switch, fat-tree or hosts with --aggregation BYTES, and "
        "--algo all takes it only then"
    )


class _Progress:
    """Progress of a sim on stderr, so that a run of minutes says what it is doing.

    ``mode`` None (the default): quiet for the first ``quiet`` seconds, then a line
    as each simulation (an algorithm at a size) ends, and one while a simulation
    runs on: after ``every`` seconds, then at intervals of half its running time,
    between ``every`` and four times that. True: a line as each one starts and ends.
    False: nothing. A thread calls :meth:`tick` every second while the ``with``
    block runs; ``clock`` is the time source.
    """

    def __init__(
        self,
        stream: TextIO,
        total: int,
        mode: bool | None,
        *,
        quiet: float = 3.0,
        every: float = 15.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream = stream
        self.total = total
        self.mode = mode
        self.quiet = quiet
        self.every = every
        self.clock = clock
        self.start = clock()
        self.index = 0
        self.what = ""
        self._since = self.start  # when the current simulation began
        self._said = self.start  # when its latest line was written
        self._running = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _say(self, text: str) -> None:
        from plait.bench.progress import format_duration

        elapsed = format_duration(self.clock() - self.start)
        self.stream.write(f"plait sim: {text}; {elapsed} elapsed\n")
        self.stream.flush()

    def _loud(self) -> bool:
        return self.mode is True or (self.mode is None and self.clock() - self.start >= self.quiet)

    def begin(self, algorithm: str, nbytes: int) -> None:
        """A simulation of ``algorithm`` at ``nbytes`` starts."""
        from plait.bench.sweep import format_size

        with self._lock:
            self.index += 1
            self.what = f"{algorithm}, {format_size(nbytes)} ({self.index} of {self.total})"
            self._since = self._said = self.clock()
            self._running = True
            if self.mode is True:
                self._say(f"{self.what}: started")

    def end(self, outcome: str = "") -> None:
        """The current simulation ended; ``outcome``: what to add (an error)."""
        from plait.bench.progress import format_duration

        with self._lock:
            self._running = False
            if self.mode is False or not self._loud():
                return
            took = format_duration(self.clock() - self._since)
            self._say(f"{self.what}: {outcome or 'done'} in {took}")

    def tick(self) -> None:
        """Say which simulation is running, if it is time to (see the class)."""
        from plait.bench.progress import format_duration

        with self._lock:
            if self.mode is False or not self._running:
                return
            now = self.clock()
            interval = min(4 * self.every, max(self.every, (now - self._since) / 2))
            if now - self._said >= interval and self._loud():
                self._said = now
                self._say(f"{self.what}: running for {format_duration(now - self._since)}")

    def finish(self) -> None:
        """A last line with the whole run's time, if any line was written."""
        from plait.bench.progress import format_duration

        with self._lock:
            if self.mode is not False and self._loud():
                took = format_duration(self.clock() - self.start)
                self.stream.write(f"plait sim: {self.index} simulations in {took}\n")
                self.stream.flush()

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self.tick()

    def __enter__(self) -> _Progress:
        if self.mode is not False:
            self._thread = threading.Thread(
                target=self._run, name="plait-sim-progress", daemon=True
            )
            self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def _rate(per_byte: float) -> str:
    """A per-byte cost as a rate for the header: ``15 GB/s``, or ``free`` for 0."""
    return f"{1e-9 / per_byte:.3g} GB/s" if per_byte > 0 else "free"


def _header(args: argparse.Namespace, dtype: np.dtype, net: Any) -> list[str]:
    """The comment lines above the tables: what was simulated, on what, with which costs."""
    import re

    from plait import collectives

    described = collectives.get(args.collective)
    what = [args.collective]
    if not described.synchronizes:  # the barrier moves no data: no dtype, no op
        what.append(dtype.name)
    if described.reduces:
        what.append(args.op)
    if described.rooted:
        what.append(f"root {args.root}")
    # The network's description names its ranks (``8 ranks``, ``2 hosts × 4 ranks``).
    if not re.search(r"\branks?\b", net.description):
        what.append(f"{args.ranks} rank{'' if args.ranks == 1 else 's'}")
    what.append(net.description)
    header = [f"# plait sim: {', '.join(what)}"]
    if "α=" not in net.description:
        header.append(f"# α={args.alpha:g} s, β={args.beta:g} s/B")
    wait = "a message's latency" if args.wait_latency is None else f"{args.wait_latency:g} s"
    header.append(
        f"# per rank: γ={args.gamma:g} s/B ({_rate(args.gamma)}) reduced, δ={args.delta:g} s/B "
        f"({_rate(args.delta)}) copied; a post seen {wait} later"
    )
    header.append("# virtual time: when the last rank finishes (p10 = p90 = the time)")
    return header


def _check(args: argparse.Namespace) -> tuple[list[int], tuple[str, ...], Any, Any, Any, Any]:
    """Validate the options before anything is simulated: (sizes, algorithms, dtype, op,
    segment, network). The notes on what ``--algo all`` leaves out come after every
    check has passed.

    Raises:
        ValueError: a mistake in the options (``main`` makes it a usage error).
    """
    import plait
    from plait import collectives
    from plait.algos import get
    from plait.algos.in_network import DEFAULT_WINDOW
    from plait.bench import options
    from plait.bench.loop import op_by_name
    from plait.bench.sweep import parse_size

    if args.ranks < 1:
        raise ValueError(f"-n must be at least 1, not {args.ranks}")
    if args.ranks > MAX_RANKS:  # it built for minutes, silent, then ran out of memory
        raise ValueError(
            f"-n {args.ranks} is more ranks than plait sim simulates ({MAX_RANKS:,}: a "
            "schedule of each rank is built, about 1 µs and a few hundred bytes a step)"
        )
    notes = []
    _refuse_uneven(args)
    args.collective = options.resolve_collective(args, _COLLECTIVE)
    c = args.collective
    args.begin, args.end, args.factor, sizes = options.resolve_sizes(args, _BEGIN, _END, _FACTOR)
    aggregation = parse_size(args.aggregation)
    known = plait.algorithms(c)
    every = args.algorithm == "all"
    # each named once, in the order given: "-a ring,ring" ran and printed ring twice
    names = known if every else tuple(dict.fromkeys(a.strip() for a in args.algorithm.split(",")))
    for n in names:
        if n not in known:
            raise ValueError(f"{c} has no algorithm {n!r}; expected {', '.join(known)}")
    needs = [n for n in known if get(c, n).needs_fabric]
    if every and not aggregation and needs:  # nothing to run them on
        names = tuple(n for n in names if n not in needs)
        notes.append(
            f"--algo all leaves out {', '.join(needs)}: it needs aggregating switches "
            "(--aggregation BYTES with switch, fat-tree or hosts)"
        )
    for n in names:
        if not aggregation and get(c, n).needs_fabric:
            raise ValueError(
                f"{c} algorithm {n!r} needs switches that reduce in flight: give them "
                "aggregation memory with --topology switch, fat-tree:K or hosts:K and "
                "--aggregation BYTES"
            )
    dtype = options.resolve_dtype(args, c)  # before sizes divide by its size
    least = DEFAULT_WINDOW * dtype.itemsize  # a switch holds segments of a quarter of it
    if aggregation and aggregation < least:
        raise ValueError(
            f"--aggregation {aggregation} B holds fewer than {DEFAULT_WINDOW} elements of "
            f"{dtype.name} ({least} B): a switch keeps {DEFAULT_WINDOW} segments in flight, "
            f"each of one element at least; give --aggregation {least} or more"
        )
    op = op_by_name(args.op)
    if not 0 <= args.root < args.ranks:
        raise ValueError(f"--root must be in 0..{args.ranks - 1}, not {args.root}")
    described = collectives.get(c)
    if described.reduces:
        try:
            op.check(dtype)
        except TypeError as exc:
            raise ValueError(f"{args.op} on {dtype}: {exc}") from None
    options.check_elements(args, c, sizes, dtype.itemsize, args.ranks)
    if described.synchronizes:  # the barrier moves no data: one row of 0 bytes, as in bench
        sizes = [0]
    segment = None if args.segment == "default" else _segment(args.segment)
    net = parse_topology(
        args.topology,
        args.ranks,
        args.alpha,
        args.beta,
        args.gamma,
        (args.intra_alpha, args.intra_beta),
        aggregation,
        delta=args.delta,
        wait_latency=args.wait_latency,
    )
    # The one-sided algorithms need one window for all ranks: not across hosts (those of
    # host_windows: one window a host, of `hosts:K`). A switch, a fat tree, a ring or a torus
    # joins machines, one a rank, by cables, and says no hosts: none of them runs there.
    several = net.hosts is not None and len(set(net.hosts)) > 1
    machines = net.hosts is None and net.name in MACHINE_A_RANK and args.ranks > 1
    alone = [
        n
        for n in names
        if get(c, n).needs_window and (machines or (several and not get(c, n).host_windows))
    ]
    if every and alone:
        names = tuple(n for n in names if n not in alone)
        notes.append(
            f"--algo all leaves out {', '.join(alone)}: one-sided, they run only where "
            + (
                f"ranks share a host's memory, and every rank of {args.topology} is a machine "
                "of its own (hosts:K puts several on a host)"
                if machines
                else "all ranks share one host's window"
            )
        )
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError("--plot needs matplotlib: pip install 'plait[plot]'") from None
    options.check_outputs(args, "trace")
    for note in notes:
        print(f"plait sim: {note}", file=sys.stderr)
    return sizes, names, dtype, op, segment, net


def _refuse_uneven(args: argparse.Namespace) -> None:
    """Say how to simulate an uneven collective, which ``plait algorithms`` lists but this
    command does not sweep: its rows would need per-rank counts, not one size.

    Raises:
        ValueError: the collective given is one of ``plait.collectives.UNEVEN_COLLECTIVES``.
    """
    from plait.bench.sweep import COLLECTIVES
    from plait.collectives import UNEVEN_COLLECTIVES

    for c in (getattr(args, "_collective", None), args.collective):
        if c in UNEVEN_COLLECTIVES:
            raise ValueError(
                f"plait sim sweeps sizes, and {c} takes per-rank counts: simulate it with "
                f"the Python API, plait.sim.simulate({c!r}, ALGO, 0, network, counts=[...]), "
                f"or give one of {', '.join(COLLECTIVES)}"
            )


def _segment(text: str) -> int:
    """``--segment``'s bytes: a size as ``-s`` takes them (``64K``), or 0 (unsegmented)."""
    from plait.bench.sweep import parse_size

    try:
        return parse_size(text)
    except ValueError:
        raise ValueError(
            f"--segment {text!r}: expected a size in bytes (e.g. 64K), 0 (unsegmented) or default"
        ) from None


def main(args: argparse.Namespace) -> int:
    """Run the sweep; print the table; write the requested files. Exit code 2 on bad input."""
    from plait import sim
    from plait.bench import options, report
    from plait.bench.runner import Series
    from plait.bench.sweep import bandwidths, points

    try:
        sizes, names, dtype, op, segment, net = _check(args)
    except (ValueError, TypeError) as exc:
        return options.usage(args, "plait sim", str(exc))
    series: list[Series] = []
    records: list[dict[str, Any]] = []
    last: dict[str, Any] = {}
    p = args.ranks
    # plait bench's rows: each size as the bytes its whole elements make, sizes that round
    # to the same count once, so that a row means the same in both commands.
    rows = points(args.collective, sizes, dtype.itemsize, p)
    progress = _Progress(sys.stderr, len(names) * len(rows), args.progress)
    with progress:
        for name in names:
            s = Series("plait", name, args.topology, name)
            for i, point in enumerate(rows):
                nbytes = point.nbytes
                progress.begin(name, nbytes)
                try:
                    res = sim.simulate(
                        args.collective,
                        name,
                        nbytes,
                        net,
                        dtype=dtype,
                        root=args.root,
                        op=op,
                        segment_bytes=segment,
                        with_data=args.with_data,
                        trace=bool(args.trace),
                    )
                except (ValueError, sim.SimCheckError) as exc:
                    s.error = f"{nbytes} B: {exc}"
                    progress.end("failed")
                    progress.index += len(rows) - i - 1
                    break
                progress.end()
                algbw, busbw = bandwidths(args.collective, nbytes, res.time, p)
                t_us = res.time * 1e6
                s.rows.append(
                    {
                        "bytes": nbytes,
                        "count": point.count,
                        "algorithm": name,
                        "warmup": 0,
                        "iters": 1,
                        "time_us": t_us,
                        "p10_us": t_us,
                        "p90_us": t_us,
                        "algbw_gbps": algbw,
                        "busbw_gbps": busbw,
                        "wrong": 0 if args.with_data else "-",
                    }
                )
                records.append(
                    {
                        "collective": args.collective,
                        "algorithm": name,
                        "ranks": p,
                        "topology": args.topology,
                        "bytes": nbytes,
                        "time_s": res.time,
                        "algbw_gbps": algbw,
                        "busbw_gbps": busbw,
                        "messages": res.messages,
                        "sim_seconds": res.sim_seconds,
                        "checked": bool(args.with_data),
                    }
                )
                last[name] = res
            series.append(s)
    progress.finish()
    sys.stdout.write(report.render(_header(args, dtype, net), series, None, where="topology"))
    try:
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"sim": vars_of(args), "results": records}, f, indent=1)
        if args.csv:
            report.write_csv(args.csv, series)
        if args.trace and last:
            name = next(iter(last))
            sim.write_trace(last[name], args.trace)
            print(f"# trace of {name} at {last[name].nbytes} B written to {args.trace}")
        if args.plot:
            report.plot(args.plot, f"plait sim: {args.collective} on {args.topology}", series, None)
    except OSError as exc:  # checked before the run; a disk may fill since
        print(
            f"plait sim: error: cannot write {exc.filename or 'an output'}: {exc.strerror or exc}",
            file=sys.stderr,
        )
        return 1
    return 1 if any(s.error for s in series) else 0


def vars_of(args: argparse.Namespace) -> dict[str, Any]:
    """The run's settings as JSON-ready values."""
    return {k: v for k, v in vars(args).items() if not k.startswith("_")}
