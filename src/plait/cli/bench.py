"""plait bench: time a collective over a range of sizes, like nccl-tests.

Examples, with the time each took on a shared 2-core machine that was busy
with other work:

  15 s      plait bench -n 2 -b 8 -e 1M     (allreduce, 2 ranks, 8 B to 1 MiB)
  30 s      plait bench                     (the same up to 256 MiB)
  15 min+   plait bench -n 4 -a all --rounds 8   (every algorithm, 8 rounds)
            plait bench allgather -n 4 -b 1K -e 64M -d float64
            plait bench -n 2 -a ring,recursive_doubling -t shm,tcp --in-place
            plait bench -n 2 --compare mpi,gloo --limits --json out.json

The ranks are started on this host by the launcher of plait run. Each row is
printed on stderr as soon as it is measured, with the rows done and an
estimate of the time left; the table goes to stdout at the end. Ctrl-C stops
the ranks, prints the table of the rows measured until then, writes them to
the --json and --csv files and exits with code 130.

A row gives the median time of a call (the slowest rank's, per call) with its
10th and 90th percentile, algbw and busbw (nccl-tests' definitions), the
algorithm plait ran, and the number of wrong elements (checked against a numpy
reference outside the timed loop). --compare runs the same sweep through Open
MPI (mpi4py; shared memory and TCP) and the gloo backend of torch.distributed
where they are installed; --limits measures the machine's memory and loopback
bandwidth. The exit code is 1 if plait failed or returned a wrong element,
2 if the options, or a PLAIT_* setting the ranks read, were refused (before
any rank starts, as plait run refuses such a setting). An algorithm a
transport cannot run (a one-sided one over tcp) fails in its own series.
plait sim takes the same options for the same things. See docs/bench.md.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import platform
import signal
import sys
import tempfile
from collections.abc import Iterator
from typing import Any, NoReturn

__all__ = ["add_arguments", "main"]

_COMPARE = ("mpi", "gloo")
#: The defaults of the options both commands have (plait.bench.options resolves them).
_COLLECTIVE, _BEGIN, _END, _FACTOR, _RANKS = "allreduce", "8", "256M", 2, 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``plait bench`` (the shared ones from :mod:`plait.bench.options`)."""
    from plait.bench import options as o

    o.add_collective(parser, _COLLECTIVE)
    o.add_ranks(parser, "nproc", _RANKS)
    o.add_sizes(parser, _BEGIN, _END, _FACTOR)
    o.add_reduction(parser)
    parser.add_argument(
        "-t", "--transport", default="auto",
        help="auto, shm or tcp, as for plait run; several separated by commas give a series "
        "each (default auto)",
    )  # fmt: skip
    o.add_algorithms(
        parser, "algo", "auto",
        "auto, an algorithm of the collective (listed below), several separated by commas, "
        "or all: every one a communicator can run, which leaves out in_network (simulator "
        "only: it needs aggregating switches, plait sim --aggregation) and, over tcp, the "
        "one-sided ones (they need the window of shm) (default auto)",
    )  # fmt: skip
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
    o.add_outputs(parser)
    parser.add_argument(
        "--compare", default="", metavar="mpi,gloo", help="also run the sweep through these"
    )
    parser.add_argument("--limits", action="store_true", help="measure this machine's limits too")
    parser.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds per call before a rank gives up (60); plait.init keeps its own deadline",
    )
    o.add_progress(
        parser,
        "each row on stderr as it is measured, and a bar on a terminal (default: the rows, "
        "and the bar when stderr is a terminal; --no-progress: neither)",
    )
    parser.epilog = o.algorithm_listing(
        "plait bench cannot run it and --algo all leaves it out; try plait sim --aggregation"
    )


def _usage(args: argparse.Namespace, message: str) -> NoReturn:
    """Refuse the options as a usage error (exit code 2), before any rank starts."""
    from plait.bench.options import usage_error

    usage_error(args, "plait bench", message)


def _choices(
    args: argparse.Namespace, text: str, allowed: tuple[str, ...], what: str, none: bool = False
) -> list[str]:
    """The names of ``text`` (separated by commas), each one of ``allowed``; at least one
    unless ``none`` (an empty list then means none)."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    for item in items:
        if item not in allowed:
            _usage(args, f"unknown {what} {item!r}; expected one of {', '.join(allowed)}")
    if not items and not none:
        _usage(args, f"no {what} named in {text!r}; expected one of {', '.join(allowed)}")
    return list(dict.fromkeys(items))


def _check_numbers(args: argparse.Namespace) -> None:
    """The call counts and the seconds: whole counts, and times that are numbers > 0."""
    if args.nproc < 1:
        _usage(args, f"-n must be at least 1, not {args.nproc}")
    if args.iters is not None and args.iters < 1:  # 0 timed calls: a row with no time
        _usage(args, f"--iters must be at least 1, not {args.iters}")
    if args.warmup is not None and args.warmup < 0:
        _usage(args, f"--warmup must be at least 0, not {args.warmup}")
    if args.rounds < 1:
        _usage(args, f"--rounds must be at least 1, not {args.rounds}")
    if args.iters is not None and args.rounds > args.iters:  # a round of no call: no median
        _usage(
            args,
            f"--rounds {args.rounds} is more than --iters {args.iters}: the rounds share the "
            "timed calls and each needs one; give fewer rounds or more calls",
        )
    if not 0 < args.seconds < math.inf:  # NaN and inf too: no count of calls fits them
        _usage(args, f"--seconds must be a number of seconds > 0, not {args.seconds}")
    if not args.timeout > 0:  # NaN too
        _usage(args, f"--timeout must be a number of seconds > 0, not {args.timeout}")


def _check(args: argparse.Namespace) -> dict[str, Any]:
    """Validate the arguments before any process starts; return the parsed values.

    The collective and the sizes are resolved into ``args`` (``collective``,
    ``begin``, ``end``, ``factor``), as the header and the JSON file show them.
    A mistake is a usage error (exit code 2); the notes on what ``--algo all``
    leaves out come after every check has passed.
    """
    import plait
    from plait import collectives
    from plait.algos import get
    from plait.bench import options
    from plait.bench.loop import op_by_name
    from plait.bench.runner import transports as known_transports
    from plait.cli.run import settings_problem

    _check_numbers(args)
    problem = settings_problem({"PLAIT_TRANSPORT"})  # -t sets it for each series
    if problem is not None:  # else every rank of every series raised it
        _usage(args, problem)
    try:
        args.collective = options.resolve_collective(args, _COLLECTIVE)
        args.begin, args.end, args.factor, sizes = options.resolve_sizes(
            args, _BEGIN, _END, _FACTOR
        )
        dtype = options.resolve_dtype(args, args.collective)  # before sizes divide by it
        op = op_by_name(args.op)
        options.check_elements(args, args.collective, sizes, dtype.itemsize, args.nproc)
    except ValueError as exc:
        _usage(args, str(exc))
    if not 0 <= args.root < args.nproc:
        _usage(args, f"--root must be in 0..{args.nproc - 1}, not {args.root}")
    c = args.collective
    described = collectives.get(c)
    if described.reduces:
        try:
            op.check(dtype)
        except TypeError as exc:
            _usage(args, f"{args.op} on {dtype}: {exc}")
    known = plait.algorithms(c)
    runnable = [a for a in known if not get(c, a).needs_fabric]  # not in_network: no switches
    every = args.algo == "all"
    algos = runnable if every else _choices(args, args.algo, ("auto", *known), "algorithm")
    for a in algos:
        if a != "auto" and get(c, a).needs_fabric:
            _usage(
                args,
                f"{c} algorithm {a!r} is simulator only: it needs aggregating switches "
                "(switches that reduce in flight), which plait's transports do not have; "
                "try it in plait sim --aggregation",
            )
    for a in algos:
        if described.reduces and a != "auto" and not get(c, a).supports(commutative=op.commutative):
            _usage(args, f"{c} algorithm {a!r} needs a commutative op; {args.op} is not")
    transports = _choices(args, args.transport, known_transports(), "transport")
    compare = _choices(args, args.compare, _COMPARE, "system to compare with", none=True)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            _usage(args, "--plot needs matplotlib: pip install 'plait[plot]'")
    try:
        options.check_outputs(args)
    except ValueError as exc:
        _usage(args, str(exc))
    # Over TCP the ranks share no window: the one-sided algorithms cannot run there (a lone
    # rank's copy needs none). `all` leaves them out of those series; named, they are refused
    # in their own series (plait.bench.worker).
    one_sided = [a for a in algos if a != "auto" and get(c, a).needs_window]
    by_transport = {
        t: [a for a in algos if not (every and t == "tcp" and args.nproc > 1 and a in one_sided)]
        for t in transports
    }
    left_out = [a for a in known if a not in runnable]
    if every and left_out:
        print(
            f"plait bench: --algo all leaves out {', '.join(left_out)} (simulator only: it "
            "needs aggregating switches, plait sim --aggregation)",
            file=sys.stderr,
        )
    if every and "tcp" in transports and args.nproc > 1 and one_sided:
        print(
            f"plait bench: --algo all leaves out {', '.join(one_sided)} over tcp: one-sided, "
            "they run only where all ranks share one host's window (-t shm or auto)",
            file=sys.stderr,
        )
    return {
        "sizes": sizes,
        "dtype": dtype,
        "algos": algos,
        "by_transport": by_transport,
        "transports": transports,
        "compare": compare,
    }


def _header(args: argparse.Namespace, checked: dict[str, Any], n_rows: int) -> list[str]:
    import numpy as np

    import plait
    from plait import collectives
    from plait.bench.sweep import format_size

    c = args.collective
    described = collectives.get(c)
    what = [c]
    if not described.synchronizes:  # the barrier moves no data: no dtype, no op
        what.append(args.dtype)
        if described.reduces:
            what.append(args.op)
    what.append(f"{args.nproc} rank{'' if args.nproc == 1 else 's'}")
    if not (described.synchronizes or described.fills_x):  # broadcast is always in x
        what.append("in place" if args.in_place else "out of place")
    if described.rooted:
        what.append(f"root {args.root}")
    sizes = checked["sizes"]
    policy = (
        f"{args.iters} timed calls per row"
        if args.iters is not None
        else f"timed calls adapt to the size (about {args.seconds:g} s per row)"
    )
    if args.rounds > 1:
        policy += f" in {args.rounds} rounds, algorithms taking turns"
    if described.synchronizes:  # the barrier's one row moves nothing, whatever -s says
        rows = "no data, one row"
    elif len(sizes) == 1:
        rows = f"size {format_size(sizes[0])}, one row"
    else:
        rows = f"sizes {format_size(sizes[0])} .. {format_size(sizes[-1])} (x{args.factor}), "
        rows += f"{n_rows} rows"
    return [
        f"# plait bench: {', '.join(what)}",
        f"# {rows}; {policy}; time = median over calls of the slowest rank's",
        f"# plait {plait.__version__}, numpy {np.__version__}, Python {platform.python_version()}"
        f" on {platform.system()} {platform.machine()}, {os.cpu_count()} cores",
    ]


@contextlib.contextmanager
def _no_interrupts() -> Iterator[None]:
    """Ignore Ctrl-C while the table and the files of an interrupted run are written."""
    try:
        old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread: nothing to protect
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def _plan(
    args: argparse.Namespace, checked: dict[str, Any], sizes: list[int]
) -> list[tuple[str, list[str], list[int]]]:
    """Every system's (label, algorithms, sizes), in the order they run (for the estimate)."""
    from plait.bench import runner

    by_transport = checked["by_transport"]
    jobs = [(runner.plait_label(t), by_transport[t], sizes) for t in checked["transports"]]
    if "mpi" in checked["compare"] and runner.mpi_missing() is None:
        jobs += [(f"mpi-{t}", ["auto"], sizes) for t in ("shm", "tcp")]
    if "gloo" in checked["compare"] and runner.gloo_missing() is None:
        jobs.append(("gloo", ["auto"], sizes))
    return jobs


def main(args: argparse.Namespace) -> int:
    """Run the sweeps, print the table, write the files.

    Returns 1 if plait failed or was wrong; after Ctrl-C (or SIGTERM), the table
    and files hold the rows measured until then and the code is 130 (or 143).
    """
    from dataclasses import replace

    from plait.bench import progress, runner
    from plait.bench.limits import measure_limits
    from plait.bench.loop import SweepSpec
    from plait.bench.sweep import IterationPolicy, points

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

    plan = _plan(args, checked, [p.nbytes for p in rows])
    estimator = progress.Estimator(policy, plan)
    labels = [progress.series_label(job, a) for job, algos, _ in plan for a in algos]
    live = progress.Live(
        estimator,
        sys.stderr,
        rows=args.progress is not False,
        bar=False if args.progress is False else args.progress,
        width=max(map(len, labels), default=0),
    )
    limits = None
    series: list[runner.Series] = []
    stopped: int | None = None  # the exit code of an interrupted run
    with tempfile.TemporaryDirectory(prefix="plait-bench-") as tmp:
        opts = runner.RunOptions(args.nproc, args.timeout, tmp, live)
        jobs: list[Any] = [
            (lambda t=t, a=algos: runner.run_plait(replace(spec, algorithms=a), t, opts))
            for t, algos in checked["by_transport"].items()
        ]
        if "mpi" in checked["compare"]:
            jobs += [lambda t=t: [runner.run_mpi(spec, t, opts)] for t in ("shm", "tcp")]
        if "gloo" in checked["compare"]:
            jobs.append(lambda: [runner.run_gloo(spec, opts)])
        try:
            if args.limits:
                say("measuring this machine's limits")
                limits = measure_limits()
            for job in jobs:
                for s in job():
                    if s.skipped:
                        say(f"{s.label}: skipped: {s.skipped}")
                    elif s.error and not s.rows:
                        say(f"{s.label}: failed: {s.error}")
                    elif s.error:
                        say(f"{s.label}: {_rows(len(s.rows))}, then failed: {s.error}")
                    else:
                        say(f"{s.label}: {_rows(len(s.rows))} in {s.seconds:.1f} s")
                    series.append(s)
        except runner.Interrupted as stop:
            series.extend(stop.series)
            stopped = stop.code
        except KeyboardInterrupt:
            stopped = 130

    with _no_interrupts() if stopped is not None else contextlib.nullcontext():
        return _finish(args, checked, series, limits, len(rows), stopped, estimator.planned)


def _finish(
    args: argparse.Namespace,
    checked: dict[str, Any],
    series: list[Any],
    limits: dict[str, Any] | None,
    n_rows: int,
    stopped: int | None,
    planned: int,
) -> int:
    """Print the table and write the files of the series measured; the exit code."""
    from plait.bench import report
    from plait.bench.limits import format_limits
    from plait.bench.runner import INTERRUPT_CODES
    from plait.bench.sweep import format_size
    from plait.selection import model

    profile = model.load()
    report.annotate(series, limits, collective=args.collective, ranks=args.nproc, profile=profile)
    header = _header(args, checked, n_rows)
    measured = sum(len(s.rows) for s in series)
    if stopped is not None:
        why = INTERRUPT_CODES.get(stopped, f"code {stopped}")
        note = f"interrupted ({why}) after {measured} of {planned} rows"
        header.append(f"# {note}: the tables hold the rows measured until then")
        print(f"plait bench: {note}; writing what was measured", file=sys.stderr, flush=True)
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
    if stopped is not None:
        meta["interrupted"] = INTERRUPT_CODES.get(stopped, stopped)
    try:
        if args.json:
            import json

            with open(args.json, "w") as f:
                json.dump(report.document(meta, series, limits), f, indent=1)
        if args.csv:
            report.write_csv(args.csv, series)
        if args.plot:
            sizes = checked["sizes"]
            title = (
                header[0].lstrip("# ") + f" ({format_size(sizes[0])} .. {format_size(sizes[-1])})"
            )
            report.plot(args.plot, title, series, limits)
    except OSError as exc:  # checked before the run; a disk may fill since
        print(
            f"plait bench: error: cannot write {exc.filename or 'an output'}: "
            f"{exc.strerror or exc}",
            file=sys.stderr,
        )
        return 1
    if stopped is not None:
        return stopped
    plait_series = [s for s in series if s.system == "plait"]
    failed = any(s.error for s in plait_series)
    wrong = any(r["wrong"] for s in plait_series for r in s.rows)
    return 1 if failed or wrong else 0


def _rows(n: int) -> str:
    """``1 row`` or ``3 rows``."""
    return f"{n} row{'' if n == 1 else 's'}"
