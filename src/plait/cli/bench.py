"""``plait bench``: time a collective over a range of sizes, like nccl-tests; check every result.

::

    plait bench                                  # allreduce, 2 ranks, 8 B .. 256 MiB
    plait bench allgather -n 4 -b 1K -e 64M -d float64
    plait bench -n 2 --algo ring,recursive_doubling --transport shm,tcp --in-place
    plait bench -n 2 --compare mpi,gloo --limits --json out.json --plot out.png

The ranks are started on this host by ``plait run``'s launcher. Every row
prints the median time of a call (the slowest rank's, per call) with its
10th and 90th percentile, algbw and busbw (nccl-tests' definitions), the
algorithm plait ran, and the number of wrong elements (checked against a
numpy reference outside the timed loop). ``--compare`` runs the same sweep
through Open MPI (mpi4py; shared memory and TCP) and torch.distributed's gloo
where they are installed, ``--limits`` measures the machine's memory and
loopback bandwidth. See docs/bench.md. The exit code is 1 if plait failed or
returned a wrong element.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
from typing import Any

__all__ = ["add_arguments", "main"]

_COMPARE = ("mpi", "gloo")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``plait bench``."""
    from plait.bench.sweep import COLLECTIVES

    parser.add_argument(
        "collective",
        nargs="?",
        default="allreduce",
        choices=COLLECTIVES,
        help="the collective to time (default allreduce)",
    )
    parser.add_argument("-n", "--nproc", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("-b", "--begin", default="8", help="smallest size in bytes (default 8)")
    parser.add_argument("-e", "--end", default="256M", help="largest size (default 256M)")
    parser.add_argument("-f", "--factor", type=int, default=2, help="size multiplier (default 2)")
    parser.add_argument("-d", "--dtype", default="float32", help="numpy dtype (default float32)")
    parser.add_argument(
        "-o",
        "--op",
        default="sum",
        help="sum, prod, min, max, avg, band, bor or bxor (default sum)",
    )
    parser.add_argument("-r", "--root", type=int, default=0, help="root of rooted collectives")
    parser.add_argument(
        "-t",
        "--transport",
        default="auto",
        help="auto, shm, tcp (as plait run --transport); several separated by commas "
        "(default auto)",
    )
    parser.add_argument(
        "-a",
        "--algo",
        default="auto",
        help="auto, an algorithm, several separated by commas, or all (default auto)",
    )
    parser.add_argument(
        "--in-place",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="output in the input buffer, as nccl-tests' in-place (default: not)",
    )
    parser.add_argument(
        "--iters", type=int, default=None, help="timed calls per row (default: adapt)"
    )
    parser.add_argument(
        "--warmup", type=int, default=None, help="warm-up calls per row (default: adapt)"
    )
    parser.add_argument(
        "--seconds",
        type=float,
        default=0.2,
        help="timed seconds per row the call counts adapt to (default 0.2)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="split each row's calls into this many rounds, every algorithm taking a turn "
        "in each (fairer comparisons on a busy machine; default 1)",
    )
    parser.add_argument("--json", metavar="FILE", help="write every result as JSON")
    parser.add_argument("--csv", metavar="FILE", help="write one line per row as CSV")
    parser.add_argument("--plot", metavar="FILE", help="draw busbw and time against size (PNG, …)")
    parser.add_argument(
        "--compare", default="", metavar="mpi,gloo", help="also run the sweep through these"
    )
    parser.add_argument("--limits", action="store_true", help="measure this machine's limits too")
    parser.add_argument(
        "--timeout", type=float, default=60.0, help="seconds per call before a rank gives up (60)"
    )
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal)",
    )


def _fail(message: str) -> SystemExit:
    return SystemExit(f"plait bench: {message}")


def _choices(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    for item in items:
        if item not in allowed:
            raise _fail(f"unknown {what} {item!r}; expected one of {', '.join(allowed)}")
    return list(dict.fromkeys(items))


def _check(args: argparse.Namespace) -> dict[str, Any]:
    """Validate the arguments before any process starts; return the parsed values."""
    import plait
    from plait.algos import get
    from plait.bench.data import resolve_dtype
    from plait.bench.loop import op_by_name
    from plait.bench.runner import transports as known_transports
    from plait.bench.sweep import parse_size, size_range

    if args.nproc < 1:
        raise _fail("-n must be at least 1")
    if not 0 <= args.root < args.nproc:
        raise _fail(f"--root must be in 0..{args.nproc - 1}")
    try:
        sizes = size_range(parse_size(args.begin), parse_size(args.end), args.factor)
        dtype = resolve_dtype(args.dtype)
        op = op_by_name(args.op)
    except ValueError as exc:
        raise _fail(str(exc)) from None
    c = args.collective
    if c in ("allreduce", "reduce", "reduce_scatter"):
        try:
            op.check(dtype)
        except TypeError as exc:
            raise _fail(f"{args.op} on {dtype}: {exc}") from None
    known = plait.algorithms(c)
    runnable = [a for a in known if not get(c, a).needs_fabric]  # not in_network: no switches
    algos = runnable if args.algo == "all" else _choices(args.algo, ("auto", *known), "algorithm")
    for a in algos:
        if a != "auto" and get(c, a).needs_fabric:
            raise _fail(f"{c} algorithm {a!r} needs switches that reduce; try it in plait sim")
    if c == "barrier" and algos != ["auto"]:
        algos = ["auto"]  # the barrier takes no algorithm=
    reduction = c in ("allreduce", "reduce", "reduce_scatter")
    for a in algos:
        if reduction and a != "auto" and not get(c, a).supports(commutative=op.commutative):
            raise _fail(f"{c} algorithm {a!r} needs a commutative op; {args.op} is not")
    transports = _choices(args.transport, known_transports(), "transport")
    compare = _choices(args.compare, _COMPARE, "system to compare with")
    for n, what in ((args.iters, "--iters"), (args.warmup, "--warmup")):
        if n is not None and n < 0:
            raise _fail(f"{what} must be >= 0")
    if args.rounds < 1:
        raise _fail(f"--rounds must be at least 1, not {args.rounds}")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise _fail("--plot needs matplotlib: pip install 'plait[plot]'") from None
    return {
        "sizes": sizes,
        "dtype": dtype,
        "algos": algos,
        "transports": transports,
        "compare": compare,
    }


def _header(args: argparse.Namespace, checked: dict[str, Any], n_rows: int) -> list[str]:
    import numpy as np

    import plait
    from plait.bench.sweep import format_size

    c = args.collective
    what = [c]
    if c != "barrier":
        what.append(args.dtype)
        if c in ("allreduce", "reduce", "reduce_scatter"):
            what.append(args.op)
    what.append(f"{args.nproc} ranks")
    if c not in ("barrier", "broadcast"):
        what.append("in place" if args.in_place else "out of place")
    if c in ("reduce", "broadcast", "gather", "scatter"):
        what.append(f"root {args.root}")
    sizes = checked["sizes"]
    policy = (
        f"{args.iters} timed calls per row"
        if args.iters is not None
        else f"timed calls adapt to the size (about {args.seconds:g} s per row)"
    )
    if args.rounds > 1:
        policy += f" in {args.rounds} rounds, algorithms taking turns"
    return [
        f"# plait bench: {', '.join(what)}",
        f"# sizes {format_size(sizes[0])} .. {format_size(sizes[-1])} (x{args.factor}), "
        f"{n_rows} rows; {policy}; time = median over calls of the slowest rank's",
        f"# plait {plait.__version__}, numpy {np.__version__}, Python {platform.python_version()}"
        f" on {platform.system()} {platform.machine()}, {os.cpu_count()} cores",
    ]


def main(args: argparse.Namespace) -> int:
    """Run the sweeps, print the table, write the files; 1 if plait failed or was wrong."""
    from plait.bench import report, runner
    from plait.bench.limits import format_limits, measure_limits
    from plait.bench.loop import SweepSpec
    from plait.bench.sweep import IterationPolicy, format_size, points

    checked = _check(args)
    rows = points(args.collective, checked["sizes"], checked["dtype"].itemsize, args.nproc)
    policy = IterationPolicy(
        seconds=args.seconds, iters=args.iters, warmup=args.warmup, rounds=args.rounds
    )
    spec = SweepSpec(
        collective=args.collective,
        dtype=args.dtype,
        op=args.op,
        root=args.root,
        in_place=args.in_place,
        points=[(p.nbytes, p.count) for p in rows],
        algorithms=checked["algos"],
        policy={k: getattr(policy, k) for k in ("seconds", "iters", "warmup", "rounds")},
        results="",
    )

    def say(message: str) -> None:
        print(f"plait bench: {message}", file=sys.stderr, flush=True)

    limits = None
    if args.limits:
        say("measuring this machine's limits")
        limits = measure_limits()
    series: list[runner.Series] = []
    with tempfile.TemporaryDirectory(prefix="plait-bench-") as tmp:
        opts = runner.RunOptions(args.nproc, args.timeout, tmp, args.progress)
        jobs: list[Any] = [
            (lambda t=t: runner.run_plait(spec, t, opts)) for t in checked["transports"]
        ]
        if "mpi" in checked["compare"]:
            jobs += [lambda t=t: [runner.run_mpi(spec, t, opts)] for t in ("shm", "tcp")]
        if "gloo" in checked["compare"]:
            jobs.append(lambda: [runner.run_gloo(spec, opts)])
        for job in jobs:
            for s in job():
                if s.skipped:
                    say(f"{s.label}: skipped: {s.skipped}")
                elif s.error:
                    say(f"{s.label}: {len(s.rows)} rows, then failed: {s.error}")
                else:
                    say(f"{s.label}: {len(s.rows)} rows in {s.seconds:.1f} s")
                series.append(s)

    from plait.selection import model

    profile = model.load()
    report.annotate(series, limits, collective=args.collective, ranks=args.nproc, profile=profile)
    header = _header(args, checked, len(rows))
    others = []
    for s in series:
        if s.system == "mpi" and "mpi" in s.info:
            others.append(f"{s.info['mpi']} through mpi4py {s.info['mpi4py']}")
        elif s.system == "gloo" and "torch" in s.info:
            others.append(f"torch {s.info['torch']} (gloo)")
    if others:
        header.append("# compared with " + "; ".join(dict.fromkeys(others)))
    if limits:
        header += format_limits(limits)
    if profile is not None:
        header.append(
            f"# model_us: the α-β-γ time the profile {model.default_path()} predicts "
            "for the algorithm that ran (what auto and plait sim use)"
        )
    sys.stdout.write(report.render(header, series, limits))
    sys.stdout.flush()
    meta = {
        k: v
        for k, v in vars(args).items()
        if not k.startswith("_") and isinstance(v, str | int | float | bool | type(None))
    }
    meta["sizes"] = checked["sizes"]
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(report.document(meta, series, limits), f, indent=1)
    if args.csv:
        report.write_csv(args.csv, series)
    if args.plot:
        sizes = checked["sizes"]
        title = header[0].lstrip("# ") + f" ({format_size(sizes[0])} .. {format_size(sizes[-1])})"
        report.plot(args.plot, title, series, limits)
    plait_series = [s for s in series if s.system == "plait"]
    failed = any(s.error for s in plait_series)
    wrong = any(r["wrong"] for s in plait_series for r in s.rows)
    return 1 if failed or wrong else 0
