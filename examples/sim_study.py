"""Which allreduce wins at 4,096 ranks? A study with plait's simulator.

Run it with ``python examples/sim_study.py --out study/`` (no ranks to start:
the simulator runs every rank's schedule in one process). It simulates
allreduce algorithms on two 4,096-rank networks, over a range of sizes:

- a two-level fat tree: 32 ranks per leaf switch, 2:1 oversubscribed uplinks,
  100 Gb/s cables (α = 1 µs per cable, β = 1/12.5e9 s/B);
- a 16×16×16 torus of the same cables (dimension-order routing).

On the fat tree the switches can also reduce in flight (``--aggregation``
bytes of memory each, 4 MiB by default; 0 turns it off), which adds the
``in_network`` allreduce (SHARP/SwitchML-style) to its table.

It prints one table per network (time in µs, the winner marked) and writes
``study.json`` and, with matplotlib, ``fat_tree.png`` and ``torus.png``
(busbw against size) into ``--out``. ``--ranks`` and ``--sizes`` shrink it for
a quick look; ring is left out above 1,024 ranks by default because its
2(p-1) steps per rank make it the slowest to simulate (``--ring`` adds it).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from plait import sim
from plait.bench.sweep import bandwidths, format_size, parse_size

ALGORITHMS = [
    "recursive_doubling",
    "rabenseifner",
    "swing",
    "double_binary_tree",
    "in_network",
    "ring",
]


def networks(p: int, aggregation: int) -> dict[str, sim.Network]:
    link = sim.LinkParams(1e-6, 1 / 12.5e9)
    side = round(p ** (1 / 3))
    nets = {
        "fat_tree": sim.fat_tree(p, 32, link, oversubscription=2.0, aggregation_memory=aggregation)
    }
    if side**3 == p:
        nets["torus"] = sim.torus((side, side, side), link)
    return nets


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4096)
    parser.add_argument("--sizes", default="1K,64K,4M,256M")
    parser.add_argument("--ring", action="store_true", help="include ring above 1,024 ranks")
    parser.add_argument("--aggregation", default="4M", help="fat-tree switch memory (0: none)")
    parser.add_argument("--algorithms", help="comma-separated subset of the algorithms")
    parser.add_argument("--out", type=Path, default=Path("study"))
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    algos = [a for a in ALGORITHMS if a != "ring" or args.ring or args.ranks <= 1024]
    if args.algorithms:
        algos = args.algorithms.split(",")
    aggregation = parse_size(args.aggregation)
    args.out.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    w = max(12, 2 + max(map(len, algos)))  # a column holds the fastest algorithm's name
    for name, net in networks(args.ranks, aggregation).items():
        print(f"# {net.description}")
        print("# " + "algorithm".ljust(20) + "".join(format_size(s).rjust(w) for s in sizes))
        table: dict[str, list[float]] = {}
        for algo in algos:
            if algo == "in_network" and not net.reducing_switches():
                continue
            row = []
            for nbytes in sizes:
                start = time.perf_counter()
                res = sim.simulate("allreduce", algo, nbytes, net, segment_bytes=0)
                _, busbw = bandwidths("allreduce", nbytes, res.time, args.ranks)
                results.append(
                    {
                        "network": name,
                        "algorithm": algo,
                        "bytes": nbytes,
                        "time_s": res.time,
                        "busbw_gbps": busbw,
                        "wall_s": time.perf_counter() - start,
                    }
                )
                row.append(res.time)
            table[algo] = row
            print("  " + algo.ljust(20) + "".join(f"{t * 1e6:{w}.1f}" for t in row), flush=True)
        if not table:
            continue
        best = [min(table, key=lambda a, i=i: table[a][i]) for i in range(len(sizes))]
        print("  " + "fastest".ljust(20) + "".join(b.rjust(w) for b in best))
        _plot(args.out / f"{name}.png", net.description, results, name)
    (args.out / "study.json").write_text(json.dumps(results, indent=1))
    return 0


def _plot(path: Path, title: str, results: list[dict], network: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for algo in dict.fromkeys(r["algorithm"] for r in results if r["network"] == network):
        rows = [r for r in results if r["network"] == network and r["algorithm"] == algo]
        ax.plot([r["bytes"] for r in rows], [r["busbw_gbps"] for r in rows], marker="o", label=algo)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bytes")
    ax.set_ylabel("busbw (GB/s), simulated")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
