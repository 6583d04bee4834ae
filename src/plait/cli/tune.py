"""``plait tune``: measure α, β, γ on this machine and write the profile ``auto`` uses.

::

    plait tune                       # measure over shared memory (and TCP), write the profile
    plait tune --show -n 8           # the decision table auto follows for 8 ranks
    plait tune --output prof.json    # somewhere else (point PLAIT_PROFILE at it)

Two ranks bounce messages of 8 B to 16 MiB through plait's own point-to-point
calls, over shared memory (the ``intra`` link class) and over TCP (``inter``;
on one machine that is loopback, a stand-in until it is run across hosts); a
straight line through the one-way times gives α (the 8-byte time) and β (the
slope between the largest sizes). γ and δ are numpy's add and copy per byte.
The profile is written to PLAIT_PROFILE or ``~/.config/plait/profile.json``;
with it, ``algorithm="auto"`` picks per call the algorithm whose closed-form
α-β-γ time is lowest (see :mod:`plait.selection.model`). Every rank of a job
must load the same profile.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["add_arguments", "fit", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``plait tune``."""
    parser.add_argument("--output", "-o", type=Path, help="profile file (default: see above)")
    parser.add_argument(
        "--no-tcp", action="store_true", help="skip the TCP (inter-host class) measurement"
    )
    parser.add_argument(
        "--show", action="store_true", help="print the decision table instead of measuring"
    )
    parser.add_argument("-n", "--nproc", type=int, default=2, help="ranks for --show (2)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per measurement")


def fit(sizes: list[int], one_way: list[float]) -> tuple[float, float]:
    """(α, β) from one-way times: the smallest message's time, the slope of the two largest."""
    pairs = sorted(zip(sizes, one_way, strict=True))
    alpha = pairs[0][1]
    (n1, t1), (n2, t2) = pairs[-2], pairs[-1]
    beta = max((t2 - t1) / (n2 - n1), 0.0) if n2 > n1 else 0.0
    return alpha, beta


def _measure(transport: str, timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="plait-tune-") as tmp:
        out = os.path.join(tmp, "measure.json")
        cmd = [sys.executable, "-m", "plait", "run", "-n", "2", "--transport", transport]
        cmd += ["-m", "plait.selection.measure", out]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if res.returncode != 0:
            raise RuntimeError(
                f"measuring over {transport} failed (exit {res.returncode}): "
                + (res.stderr or res.stdout)[-2000:]
            )
        with open(out) as f:
            return json.load(f)


def _show(nproc: int) -> int:
    from plait import algorithms
    from plait.bench.sweep import format_size
    from plait.selection import model
    from plait.selection.select import select

    profile = model.load()
    where = model.default_path()
    print(
        f"# auto's choices for {nproc} ranks on one host; profile: "
        + (f"{where}" if profile else f"none at {where} (built-in rules)")
    )
    sizes = [8 << (3 * k) for k in range(9)]  # 8 B .. 128 MiB
    print("# " + "collective".ljust(16) + "".join(format_size(s).rjust(20) for s in sizes))
    from plait import COLLECTIVES

    for c in COLLECTIVES:
        if c == "barrier" or len(algorithms(c)) < 2:
            continue
        row = [select(c, nproc, s, commutative=True).name for s in sizes]
        print("  " + c.ljust(16) + "".join(name.rjust(20) for name in row))
    return 0


def main(args: argparse.Namespace) -> int:
    """Measure and write the profile, or show the decision table."""
    from plait.selection import model

    if args.show:
        return _show(args.nproc)
    try:
        shm = _measure("shm", args.timeout)
        tcp = None if args.no_tcp else _measure("tcp", args.timeout)
    except (RuntimeError, subprocess.TimeoutExpired, OSError) as exc:
        print(f"plait tune: {exc}", file=sys.stderr)
        return 1
    intra = model.LinkCost(*fit(shm["sizes"], shm["one_way_s"]))
    inter = model.LinkCost(*fit(tcp["sizes"], tcp["one_way_s"])) if tcp else None
    profile = model.Profile(
        intra, inter, shm["gamma"], shm["delta"], {"shm": shm, **({"tcp": tcp} if tcp else {})}
    )
    path = model.save(profile, args.output)
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
