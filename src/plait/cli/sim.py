"""``plait sim``: predict a collective's time on a modelled network with plait's own schedules.

::

    plait sim --ranks 1024 --topology fat-tree:32:2 --algorithm ring,rabenseifner --sizes 1K:1G
    plait sim --ranks 4096 --topology torus:16x16x16 --algorithm all --sizes 8:256M -f 8
    plait sim --ranks 64 --topology hosts:8 --intra-beta 1/50e9 --algorithm hierarchical,ring
    plait sim --ranks 16 --algorithm ring --sizes 1M --with-data --trace ring.json
    plait sim --ranks 1024 --topology fat-tree:32:2 --aggregation 256K --algorithm in_network,ring

The table has the form of ``plait bench``'s (time, algbw, busbw with the
nccl-tests factors) with one series per algorithm; the time is virtual (when
the last rank finishes), so p10 and p90 equal the median and ``iters`` is 1.

Topologies (``--topology``; ``--alpha``/``--beta`` describe every cable or
port, ``--gamma`` the per-byte reduction cost of a rank):

- ``flat``: every rank a send and a receive port into a non-blocking core;
- ``flat-free``: the contention-free α-β model of Thakur, Rabenseifner and Gropp;
- ``switch``: one switch, a cable per rank;
- ``fat-tree:K[:OVERSUB[:SPINES]]``: K ranks per leaf switch, uplinks oversubscribed;
- ``hosts:K[:NICS]``: K ranks per host joined by fast ports (``--intra-alpha``,
  ``--intra-beta``), hosts by NICs of ``--alpha``/``--beta``;
- ``ring``, ``torus:AxB[xC]``: cables between neighbours, dimension-order routing.

``--aggregation BYTES`` gives the switches of ``switch``, ``fat-tree`` and
``hosts`` that much aggregation memory, so that they reduce in flight (SHARP,
SwitchML) and the ``in_network`` allreduce can run; ``--algorithm all``
includes ``in_network`` only then.

``--beta`` and the other per-byte figures accept ``1/12.5e9`` style values
(seconds per byte of a 12.5 GB/s link). See docs/simulator.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np

__all__ = ["add_arguments", "main", "parse_topology"]

_DEFAULT_ALPHA = 1e-6
_DEFAULT_BETA = 1 / 12.5e9  # a 100 Gb/s link
_DEFAULT_INTRA = (2e-7, 1 / 50e9)


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
    """The options of ``plait sim``."""
    parser.add_argument("--ranks", "-n", type=int, default=16, help="number of ranks (16)")
    parser.add_argument("--topology", "-t", default="flat", help="see above (flat)")
    parser.add_argument("--collective", "-c", default="allreduce", help="(allreduce)")
    parser.add_argument(
        "--algorithm", "-a", default="all", help="names separated by commas, or all (all)"
    )
    parser.add_argument("--sizes", "-s", default="1K:64M", help="B or LO:HI bytes (1K:64M)")
    parser.add_argument("-f", "--factor", type=int, default=4, help="size multiplier (4)")
    parser.add_argument("--dtype", "-d", default="float32")
    parser.add_argument("--alpha", type=_number, default=_DEFAULT_ALPHA, help="s per message")
    parser.add_argument("--beta", type=_number, default=_DEFAULT_BETA, help="s per byte")
    parser.add_argument("--gamma", type=_number, default=0.0, help="s per byte reduced")
    parser.add_argument("--intra-alpha", type=_number, default=_DEFAULT_INTRA[0])
    parser.add_argument("--intra-beta", type=_number, default=_DEFAULT_INTRA[1])
    parser.add_argument(
        "--segment", default="default", help="pipelining unit in bytes, 0 or default"
    )
    parser.add_argument(
        "--aggregation",
        default="0",
        metavar="BYTES",
        help="switches reduce in flight with this much memory each (0: they do not)",
    )
    parser.add_argument("--with-data", action="store_true", help="move data; check results")
    parser.add_argument("--json", metavar="FILE", help="one record per algorithm and size")
    parser.add_argument("--trace", metavar="FILE", help="Chrome/Perfetto trace (largest size)")
    parser.add_argument("--plot", metavar="FILE", help="busbw and time against size (PNG, …)")


def parse_topology(
    spec: str,
    p: int,
    alpha: float,
    beta: float,
    gamma: float,
    intra: tuple[float, float],
    aggregation: int = 0,
) -> Any:
    """The :class:`plait.sim.Network` a ``--topology`` string names (see the module doc).

    ``aggregation``: bytes of aggregation memory per switch (0: switches do not reduce).

    Raises:
        ValueError: an unknown topology or bad parameters (the message says which).
    """
    from plait import sim

    name, _, rest = spec.partition(":")
    args = [a for a in rest.split(":") if a] if rest else []
    link = sim.LinkParams(alpha, beta)
    if aggregation and name not in ("switch", "fat-tree", "hosts"):
        raise ValueError(
            f"--aggregation needs switches: use it with switch, fat-tree or hosts, not {name}"
        )
    agg = {"aggregation_memory": aggregation} if aggregation else {}
    if name == "flat":
        return sim.flat(p, alpha, beta, gamma)
    if name == "flat-free":
        return sim.flat(p, alpha, beta, gamma, ports=False)
    if name == "switch":
        return sim.single_switch(p, link, gamma=gamma, **agg)
    if name == "fat-tree":
        if not args:
            raise ValueError("fat-tree needs ranks per leaf: fat-tree:K[:OVERSUB[:SPINES]]")
        k = int(args[0])
        over = float(args[1]) if len(args) > 1 else 1.0
        spines = int(args[2]) if len(args) > 2 else 1
        return sim.fat_tree(p, k, link, oversubscription=over, spines=spines, gamma=gamma, **agg)
    if name == "hosts":
        if not args:
            raise ValueError("hosts needs ranks per host: hosts:K[:NICS]")
        k = int(args[0])
        if k < 1 or p % k:
            raise ValueError(f"--ranks {p} is not a multiple of {k} ranks per host")
        nics = int(args[1]) if len(args) > 1 else 1
        return sim.hosts(p // k, k, sim.LinkParams(*intra), link, nics=nics, gamma=gamma, **agg)
    if name == "ring":
        return sim.ring(p, link, gamma=gamma)
    if name == "torus":
        if not args:
            raise ValueError("torus needs its dimensions: torus:AxB[xC]")
        dims = [int(d) for d in args[0].lower().split("x")]
        if int(np.prod(dims)) != p:
            raise ValueError(f"torus {args[0]} has {int(np.prod(dims))} ranks, not --ranks {p}")
        return sim.torus(dims, link, gamma=gamma)
    raise ValueError(
        f"unknown topology {spec!r}; expected flat, flat-free, switch, fat-tree:K, hosts:K, "
        "ring or torus:AxB"
    )


def _sizes(text: str, factor: int) -> list[int]:
    from plait.bench.sweep import parse_size, size_range

    lo, _, hi = text.partition(":")
    begin = parse_size(lo)
    end = parse_size(hi) if hi else begin
    if factor < 2:
        raise ValueError(f"-f must be at least 2, got {factor}")
    return size_range(begin, end, factor)


def main(args: argparse.Namespace) -> int:
    """Run the sweep; print the table; write the requested files. Exit code 2 on bad input."""
    import plait
    from plait import sim
    from plait.bench import report
    from plait.bench.runner import Series
    from plait.bench.sweep import bandwidths, element_count

    try:
        if args.collective not in plait.COLLECTIVES:
            raise ValueError(
                f"unknown collective {args.collective!r}; expected one of "
                + ", ".join(plait.COLLECTIVES)
            )
        from plait.bench.sweep import parse_size

        aggregation = parse_size(args.aggregation)
        known = plait.algorithms(args.collective)
        names = known if args.algorithm == "all" else tuple(args.algorithm.split(","))
        if args.algorithm == "all" and not aggregation:  # nothing to run them on
            names = tuple(
                n for n in names if not plait._algorithms.get(args.collective, n).needs_fabric
            )
        for n in names:
            if n not in known:
                raise ValueError(
                    f"{args.collective} has no algorithm {n!r}; expected {', '.join(known)}"
                )
        sizes = _sizes(args.sizes, args.factor)
        dtype = np.dtype(args.dtype)
        segment = None if args.segment == "default" else int(args.segment)
        net = parse_topology(
            args.topology,
            args.ranks,
            args.alpha,
            args.beta,
            args.gamma,
            (args.intra_alpha, args.intra_beta),
            aggregation,
        )
    except (ValueError, TypeError) as exc:
        print(f"plait sim: {exc}", file=sys.stderr)
        return 2

    series: list[Series] = []
    records: list[dict[str, Any]] = []
    last: dict[str, Any] = {}
    p = args.ranks
    for name in names:
        s = Series("plait", name, args.topology, name)
        for nbytes in sizes:
            try:
                res = sim.simulate(
                    args.collective,
                    name,
                    nbytes,
                    net,
                    dtype=dtype,
                    segment_bytes=segment,
                    with_data=args.with_data,
                    trace=bool(args.trace),
                )
            except (ValueError, sim.SimCheckError) as exc:
                s.error = f"{nbytes} B: {exc}"
                break
            algbw, busbw = bandwidths(args.collective, nbytes, res.time, p)
            t_us = res.time * 1e6
            s.rows.append(
                {
                    "bytes": nbytes,
                    "count": element_count(args.collective, nbytes, dtype.itemsize, p),
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
    header = [f"# plait sim: {args.collective}, {dtype.name}, {p} ranks, {net.description}"]
    if "α=" not in net.description:
        header.append(f"# α={args.alpha:g} s, β={args.beta:g} s/B, γ={args.gamma:g} s/B")
    header.append("# virtual time: when the last rank finishes (p10 = p90 = the time)")
    sys.stdout.write(report.render(header, series, None))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sim": vars_of(args), "results": records}, f, indent=1)
    if args.trace and last:
        name = next(iter(last))
        sim.write_trace(last[name], args.trace)
        print(f"# trace of {name} at {last[name].nbytes} B written to {args.trace}")
    if args.plot:
        report.plot(args.plot, f"plait sim: {args.collective} on {args.topology}", series, None)
    return 1 if any(s.error for s in series) else 0


def vars_of(args: argparse.Namespace) -> dict[str, Any]:
    """The run's settings as JSON-ready values."""
    return {k: v for k, v in vars(args).items() if not k.startswith("_")}
