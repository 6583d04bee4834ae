"""Is ``algorithm="auto"`` as fast as the best forced algorithm? A repeated plait bench sweep.

Run it with ``python examples/auto_vs_best.py --out autocheck/``. For each
configuration (ranks and transport; default 2 and 4 ranks over shared memory
and TCP) it runs ``plait bench --algo auto,<every allreduce algorithm> --rounds R``
over 8 B .. 256 MiB ``--reps`` times (in each run, every algorithm takes its
turn R times at each size before the next size, so all of them meet the same
moments of a drifting machine), takes each (algorithm, size)'s median over
the runs, and prints per size:

- the fastest forced algorithm and its time;
- what ``auto`` ran, its time, and ``auto / best``: auto's time in each round
  over the best's in the same round, the median of those ratios;
- ``chosen / best``: the same for the forced runs of the algorithm ``auto``
  chose, which is free of the bias of comparing one series against the
  minimum of many (on a noisy machine the minimum of eight algorithms' times
  is below what any one of them usually takes).

Set PLAIT_PROFILE (``plait tune``) or PLAIT_RULES before running it to check
``auto`` with a measured profile or a rules file instead of the built-in rules.
Writes ``runs.json`` (every bench result) and ``summary.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import plait
from plait.algos import get
from plait.bench.sweep import format_size


def forced() -> list[str]:
    """Every allreduce algorithm a communicator can run."""
    return [a for a in plait.algorithms("allreduce") if not get("allreduce", a).needs_fabric]


def bench(
    nproc: int, transport: str, sizes: tuple[str, str, int], path: Path, seconds: float, rounds: int
) -> dict:
    """One ``plait bench`` sweep of auto and every forced algorithm; its JSON document."""
    cmd = [
        sys.executable, "-m", "plait", "bench", "-n", str(nproc), "-t", transport,
        "-b", sizes[0], "-e", sizes[1], "-f", str(sizes[2]), "--seconds", str(seconds),
        "--rounds", str(rounds), "--no-progress",
        "--algo", ",".join(["auto", *forced()]), "--json", str(path),
    ]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=os.environ.copy())
    return json.loads(path.read_text())


def summarize(runs: list[dict]) -> list[dict]:
    """Per size: the best forced algorithm, auto's choice, and ratios paired round by round.

    Each run's rows carry their rounds' medians (``round_us``); round k of every
    algorithm ran within about a second of round k of the others. The best forced
    algorithm has the lowest median over its rounds (of all runs); ``auto/best``
    is the median over rounds of auto's round time over the best's same round, so
    that a moment when the whole machine was slow counts against neither.
    """
    rounds: dict[tuple[str, int], list[list[float]]] = {}
    chosen: dict[int, list[str]] = {}
    for doc in runs:
        for series in doc["series"]:
            for row in series["rows"]:
                key = (series["requested"], row["bytes"])
                rounds.setdefault(key, []).append(row.get("round_us", [row["time_us"]]))
                if series["requested"] == "auto":
                    chosen.setdefault(row["bytes"], []).append(row["algorithm"])

    def pooled(a: str, nbytes: int) -> float:
        return statistics.median(t for run in rounds[(a, nbytes)] for t in run)

    def paired(a: str, b: str, nbytes: int) -> float:
        pairs = zip(rounds[(a, nbytes)], rounds[(b, nbytes)], strict=True)
        return statistics.median(x / y for ra, rb in pairs for x, y in zip(ra, rb, strict=True))

    out = []
    for nbytes in sorted(chosen):
        med = {a: pooled(a, nbytes) for a in forced() if (a, nbytes) in rounds}
        best = min(med, key=med.__getitem__)
        pick = max(set(chosen[nbytes]), key=chosen[nbytes].count)
        out.append(
            {
                "bytes": nbytes,
                "best": best,
                "best_us": med[best],
                "auto": pick,
                "auto_us": pooled("auto", nbytes),
                "auto_over_best": paired("auto", best, nbytes),
                "chosen_over_best": paired(pick, best, nbytes),
                "forced_us": med,
            }
        )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="2:shm,4:shm,2:tcp,4:tcp", help="ranks:transport,…")
    parser.add_argument("--reps", type=int, default=1, help="plait bench runs per config")
    parser.add_argument("--rounds", type=int, default=8, help="rounds inside each run")
    parser.add_argument("--begin", default="8")
    parser.add_argument("--end", default="256M")
    parser.add_argument("--factor", type=int, default=2, help="size multiplier")
    parser.add_argument("--seconds", type=float, default=0.4, help="timed seconds per row")
    parser.add_argument("--out", type=Path, default=Path("autocheck"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    configs = [(int(n), t) for n, t in (c.split(":") for c in args.configs.split(","))]
    runs: dict[str, list[dict]] = {f"{n}:{t}": [] for n, t in configs}
    for rep in range(args.reps):  # repetitions interleaved, so slow drifts hit every config
        for n, t in configs:
            start = time.perf_counter()
            sizes = (args.begin, args.end, args.factor)
            doc = bench(n, t, sizes, args.out / f"bench-{n}-{t}-{rep}.json",
                        args.seconds, args.rounds)  # fmt: skip
            runs[f"{n}:{t}"].append(doc)
            print(f"# run {rep + 1}/{args.reps}: {n} ranks, {t}: "
                  f"{time.perf_counter() - start:.0f} s", flush=True)  # fmt: skip
    summary = {}
    for key, docs in runs.items():
        rows = summarize(docs)
        summary[key] = rows
        n, t = key.split(":")
        print(f"\n# allreduce, {n} ranks, {t}: medians of {len(docs)} runs (µs)")
        print(f"{'bytes':>8}  {'best forced':<20}{'µs':>10}  {'auto ran':<20}{'µs':>10}"
              f"{'auto/best':>10}{'chosen/best':>12}")  # fmt: skip
        for r in rows:
            print(f"{format_size(r['bytes']):>8}  {r['best']:<20}{r['best_us']:>10.1f}  "
                  f"{r['auto']:<20}{r['auto_us']:>10.1f}{r['auto_over_best']:>10.2f}"
                  f"{r['chosen_over_best']:>12.2f}")  # fmt: skip
    (args.out / "runs.json").write_text(json.dumps(runs))
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
