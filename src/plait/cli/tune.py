"""plait tune: measure α, β, γ on this machine and write the profile auto uses.

Examples:

    plait tune                       # measure over shared memory (and TCP), write the profile
    plait tune --show -n 8           # the decision table auto follows for 8 ranks
    plait tune --show -n 16 --hosts 2   # ... for 16 ranks on 2 hosts of 8
    plait tune --show -n 8 --transport tcp   # ... where the ranks share no window
    plait tune --output prof.json    # somewhere else (point PLAIT_PROFILE at it)

Two ranks bounce messages of 8 B to 16 MiB through plait's own point-to-point
calls, over shared memory (the "intra" link class) and over TCP ("inter"; on
one machine that is loopback, a stand-in until it is run across hosts); a
straight line through the one-way times gives α (the 8-byte time) and β (the
least-squares slope over the larger half of the sizes). γ and δ are numpy's add and copy per byte.
The profile is written to PLAIT_PROFILE or ~/.config/plait/profile.json; with
it, algorithm="auto" picks per call the algorithm and segment size with the
lowest predicted time (see the module plait.selection.model). Every rank of a
job must load the same profile.

--show prints what auto would run, per collective and size, after everything
that decides it (plait.selection.select): PLAIT_ALGO, the rules file
(plait.selection.rules_file), the one-sided rules where the ranks share a
window (one host over shared memory, plait run's default; --transport tcp
shows a job without one), the profile and the built-in rules, with the
entries of the first two and, per call, the algorithm, its segment size and
who decided.

A PLAIT_* setting the measurement's ranks could not read (PLAIT_TIMEOUT=abc) is
refused before they start, as plait run refuses it: one line, exit code 2.
"""

# The docstring above is `plait tune --help`: plain text, no reStructuredText markup.

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from plait.launch.watch import GRACE_SECONDS

__all__ = ["add_arguments", "fit", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``plait tune``."""
    # a string, not a Path: Path('') is '.', and an empty name was refused as the folder '.'
    parser.add_argument("--output", "-o", help="profile file (default: see above)")
    parser.add_argument(
        "--no-tcp", action="store_true", help="skip the TCP (inter-host class) measurement"
    )
    parser.add_argument(
        "--show", action="store_true", help="print the decision table instead of measuring"
    )
    parser.add_argument("-n", "--nproc", type=int, help="ranks for --show (2)")
    parser.add_argument(
        "--hosts",
        type=int,
        help="for --show: the ranks split evenly over this many hosts, numbered host by host (1)",
    )
    parser.add_argument(
        "--transport",
        choices=("shm", "tcp"),
        help="for --show: shm (the default of plait run: ranks on one host share a window, so "
        "the one-sided algorithms can run) or tcp (messages only)",
    )
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per measurement")


def fit(sizes: list[int], one_way: list[float]) -> tuple[float, float]:
    """(α, β) from one-way times: the smallest message's time, and the least-squares slope
    over the larger half of the sizes (at least 0). The slope of the two largest alone
    came out 0 where a busy machine slowed the second largest (4 MiB 2.4 ms, 16 MiB 1.8)."""
    pairs = sorted(zip(sizes, one_way, strict=True))
    alpha = pairs[0][1]
    big = pairs[len(pairs) // 2 :] if len(pairs) > 2 else pairs
    mean_n = sum(n for n, _ in big) / len(big)
    mean_t = sum(t for _, t in big) / len(big)
    spread = sum((n - mean_n) ** 2 for n, _ in big)
    if spread == 0:
        return alpha, 0.0
    slope = sum((n - mean_n) * (t - mean_t) for n, t in big) / spread
    return alpha, max(slope, 0.0)


#: Seconds the launcher of a measurement has after SIGTERM to stop its ranks (it gives them
#: GRACE_SECONDS before SIGKILL) and clean up, before it is killed itself.
_STOP_SECONDS = GRACE_SECONDS + 5.0


class _Stopped(Exception):
    """SIGTERM to ``plait tune`` while it measures (SIGINT is KeyboardInterrupt)."""


def _stopped(signum: int, frame: object) -> None:
    raise _Stopped(signum)


def _stop(proc: subprocess.Popen[str]) -> None:
    """Stop the launcher of a measurement as Ctrl-C would stop ``plait run``.

    SIGTERM, which it passes on to its ranks before it removes what they left; then
    SIGKILL if it is still there after ``_STOP_SECONDS``. Killed at once, it would
    leave the ranks running, orphaned. Its output is read meanwhile, so that a full
    pipe does not keep it from exiting.
    """
    if proc.poll() is None:
        proc.terminate()
    try:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=_STOP_SECONDS)
    finally:  # (a second Ctrl-C while it stops: kill it now)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _measure(transport: str, timeout: float) -> dict[str, Any]:
    """Run the two ranks of :mod:`plait.cli.tune_rank` over ``transport``; what they measured.

    ``plait run``'s launcher runs in a session of its own, so that a Ctrl-C at a terminal
    reaches this process alone, which stops the launcher (:func:`_stop`), as it does after
    ``timeout`` seconds or on any exception; the temporary folder goes with it.
    """
    with tempfile.TemporaryDirectory(prefix="plait-tune-") as tmp:
        out = os.path.join(tmp, "measure.json")
        cmd = [sys.executable, "-m", "plait", "run", "-n", "2", "--transport", transport]
        cmd += ["-m", "plait.cli.tune_rank", out]
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop(proc)
            raise RuntimeError(
                f"measuring over {transport} took more than --timeout {timeout:g} s; stopped"
            ) from None
        except BaseException:
            _stop(proc)
            raise
        if proc.returncode != 0:
            raise RuntimeError(
                f"measuring over {transport} failed (exit {proc.returncode}): "
                + (stderr or stdout)[-2000:]
            )
        with open(out) as f:
            measured: dict[str, Any] = json.load(f)
            return measured


#: Sources of a choice, as --show marks them.
_MARKS = {
    "PLAIT_ALGO": "A",
    "rules file": "F",
    "profile": "P",
    "profile, simulated": "S",
    "built-in rules": "",
}


def _show(nproc: int, n_hosts: int = 1, transport: str = "shm") -> int:
    """Print the decision table; 1 (with the reason on stderr) if the settings are invalid.

    ``nproc`` and ``n_hosts`` are at least 1, and ``n_hosts`` divides ``nproc`` (``main``).
    """
    from plait import COLLECTIVES, algorithms, collectives
    from plait.bench.sweep import format_size
    from plait.schedule.builder import HostLayout
    from plait.selection import model, overrides, rules_file
    from plait.selection.select import SEGMENT_BYTES, choose, settings

    try:
        config = settings()
    except ValueError as exc:
        print(f"plait tune: {exc}", file=sys.stderr)
        return 1
    hosts = None
    where_hosts = "one host"
    if n_hosts > 1:
        per = nproc // n_hosts
        hosts = HostLayout([r // per for r in range(nproc)])
        where_hosts = f"{n_hosts} hosts of {per}"
    print(f"# auto's choices for {nproc} ranks on {where_hosts}, commutative ops")
    # As a job's communicator sees it (Communicator._choose): over shared memory the ranks of
    # one host share a window, and across hosts each host of several ranks has one.
    windows = transport == "shm"
    shared = windows and n_hosts == 1
    host_windows = windows and n_hosts > 1 and nproc // n_hosts > 1
    if not windows:
        print("# transport: tcp (messages only)")
    elif shared:
        print("# transport: shm (the ranks share a window: one-sided algorithms where faster)")
    else:
        print("# transport: shm within each host, tcp between hosts")
    algo = os.environ.get("PLAIT_ALGO", "").strip()
    print(f"# PLAIT_ALGO: {algo}" if algo else "# PLAIT_ALGO: not set")
    for entry in config.overrides:
        print(f"#   {entry.describe()}")
    path, _ = rules_file.default_path()
    if config.rules is None:
        print(f"# rules file: none at {path}")
    else:
        n = len(config.rules.entries)
        print(f"# rules file: {config.rules.path} ({n} {'entry' if n == 1 else 'entries'})")
        for rule in config.rules.entries:
            print(f"#   {rule.describe()}")
    where = model.default_path()
    print("# profile: " + (f"{where}" if config.profile else f"none at {where} (built-in rules)"))
    print(f"# cell: algorithm[@segment where not the default {format_size(SEGMENT_BYTES)}]")
    print(
        "#   and who decided: [A] PLAIT_ALGO, [F] rules file, [P] profile (formulas),"
        " [S] profile (simulator), no mark: built-in rules"
    )
    print("# bytes: the whole vector; one rank's block for block collectives")
    sizes = [8 << (3 * k) for k in range(9)]  # 8 B .. 128 MiB
    rows: list[tuple[str, list[str]]] = []
    for c in COLLECTIVES:
        if collectives.get(c).synchronizes or len(algorithms(c)) < 2:
            continue
        cells = []
        for nbytes in sizes:
            ch = choose(
                c,
                nproc,
                nbytes,
                commutative=True,
                hosts=hosts,
                config=config,
                shared=shared,
                host_windows=host_windows,
            )
            cell = ch.name
            if ch.segment_bytes != SEGMENT_BYTES:
                cell += "@" + overrides.format_size(ch.segment_bytes)
            mark = _MARKS.get(ch.source, "?")
            cells.append(cell + (f" [{mark}]" if mark else ""))
        rows.append((c, cells))
    # every cell at least two spaces from the one before: a long one shifts its column only
    width = max([24, *(len(cell) + 2 for _, cells in rows for cell in cells)])
    print("# " + "collective".ljust(16) + "".join(format_size(s).rjust(width) for s in sizes))
    for c, cells in rows:
        print("  " + c.ljust(16) + "".join(cell.rjust(width) for cell in cells))
    return 0


def _problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the options, or None (the --show options' defaults filled in)."""
    given = [o for o, v in (("-n", args.nproc), ("--hosts", args.hosts)) if v is not None]
    if args.transport is not None:
        given.append("--transport")
    if given and not args.show:  # a measurement would run and ignore them
        return (
            f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for --show; the "
            "measurement always runs 2 ranks on this host, over shared memory and TCP"
        )
    args.nproc = 2 if args.nproc is None else args.nproc
    args.hosts = 1 if args.hosts is None else args.hosts
    args.transport = args.transport or "shm"
    if args.nproc < 1:
        return f"-n must be at least 1, not {args.nproc}"
    if args.hosts < 1:
        return f"--hosts must be at least 1, not {args.hosts}"
    if args.nproc % args.hosts:
        return f"--hosts {args.hosts} must divide -n {args.nproc}"
    if not args.timeout > 0:  # NaN too
        return f"--timeout must be a number of seconds > 0, not {args.timeout}"
    if not args.show:  # its plait run would refuse them, below a line of its own
        from plait.cli.run import settings_problem

        problem = settings_problem({"PLAIT_TRANSPORT"})  # each measurement sets it
        if problem is not None:
            return problem
    if args.output is not None and not args.show:  # refused before the measurement, as bench's
        from plait.bench.options import check_outputs

        try:
            check_outputs(args, "output")
        except ValueError as exc:
            return str(exc)
    return None


def main(args: argparse.Namespace) -> int:
    """Measure and write the profile, or show the decision table.

    Exit code 2 for a usage error, 1 if a measurement failed; 130 after Ctrl-C and 143
    after SIGTERM, with the measurement's ranks stopped.
    """
    from plait.bench.options import usage
    from plait.selection import model

    problem = _problem(args)
    if problem is not None:
        return usage(args, "plait tune", problem)
    if args.show:
        return _show(args.nproc, args.hosts, args.transport)
    # SIGTERM stops the measurement's ranks, as Ctrl-C does (only the main thread can catch it).
    handled = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGTERM, _stopped) if handled else None
    try:
        shm = _measure("shm", args.timeout)
        tcp = None if args.no_tcp else _measure("tcp", args.timeout)
    except (RuntimeError, OSError) as exc:
        print(f"plait tune: {exc}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, _Stopped) as exc:
        signum = exc.args[0] if isinstance(exc, _Stopped) else signal.SIGINT
        name = signal.Signals(signum).name
        print(f"plait tune: interrupted ({name}); the measurement was stopped", file=sys.stderr)
        return 128 + signum
    finally:
        if handled:
            signal.signal(signal.SIGTERM, old if old is not None else signal.SIG_DFL)
    intra = model.LinkCost(*fit(shm["sizes"], shm["one_way_s"]))
    inter = model.LinkCost(*fit(tcp["sizes"], tcp["one_way_s"])) if tcp else None
    profile = model.Profile(
        intra, inter, shm["gamma"], shm["delta"], {"shm": shm, **({"tcp": tcp} if tcp else {})}
    )
    path = model.save(profile, None if args.output is None else Path(args.output))
    print(f"# profile written to {path}")
    bw = f"{1e-9 / intra.beta:.2f} GB/s" if intra.beta else "-"
    print(f"intra (shared memory): α = {intra.alpha * 1e6:.1f} µs, 1/β = {bw}")
    if inter is not None:
        bw = f"{1e-9 / inter.beta:.2f} GB/s" if inter.beta else "-"
        print(f"inter (TCP):           α = {inter.alpha * 1e6:.1f} µs, 1/β = {bw}")
    print(
        f"γ (add) = {1e-9 / profile.gamma:.2f} GB/s, δ (copy) = {1e-9 / profile.delta:.2f} GB/s"
        if profile.gamma and profile.delta
        else ""
    )
    return 0
