"""The measuring loop every system's worker runs, and the sweep description it is given.

A worker (plait, mpi4py, gloo) wraps its library in a small :class:`Backend`
and hands it to :func:`run_sweep`, so every system is measured the same way.
For each row and algorithm:

1. make the buffers and write the input pattern (:mod:`plait.bench.data`);
2. warm up (the policy's count), timing each call;
3. rank 0 picks the number of timed calls from the warm-up speed and
   broadcasts it (the ranks must make the same number of calls);
4. time each call alone with ``perf_counter``;
5. outside the timed loop: write the inputs again, make one more call and
   count the wrong elements of this rank's result;
6. gather ``[wrong, t_1 … t_iters]`` to rank 0, which keeps per call the
   slowest rank's time and sums the wrong counts.

With ``rounds`` above 1 in the policy, steps 1-6 run that many times per size
with a share of the calls each, every algorithm taking its turn in each round
(the order reversed every other round); a row pools its rounds' calls.

Rank 0 writes the rows to ``spec.results`` as JSON at the end, and each row as
soon as it is measured to ``spec.progress``, one line ``done total nbytes
{row as JSON}``: the bench process prints the rows from there as they come and
keeps them if the run is interrupted (:mod:`plait.bench.progress`).

A backend that cannot run a row at all (a dtype or op its library lacks)
raises :class:`Unsupported` from ``prepare``, on every rank alike: the sweep
stops there with that message and the worker exits 0. A backend that cannot
run one algorithm here (a one-sided one where the ranks share no window)
raises :class:`Refused` from ``prepare``, on every rank alike and before any
call: that algorithm is left out of the rest of the sweep, its reason is its
series' error (``refused`` in the results, a ``refused ALGORITHM`` line in the
progress file), and the other algorithms go on. Any other error stops the
sweep, since a failed call may leave the ranks disagreeing on what was
exchanged (a plait communicator is then broken); rank 0 still writes the rows
done so far, with the error and the algorithm that failed (``failed``), and
the worker exits non-zero.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np

from plait import ops
from plait.bench.data import Buffers, count_wrong, make_buffers, resolve_dtype
from plait.bench.sweep import IterationPolicy, Point, bandwidths, summarize

__all__ = [
    "EXIT_FAILED",
    "Backend",
    "Prepared",
    "Refused",
    "SweepSpec",
    "Unsupported",
    "load_spec",
    "op_by_name",
    "run_sweep",
    "worker_main",
]

#: Exit code of a worker whose sweep failed (rank 0 still wrote what it had).
EXIT_FAILED = 3


class Unsupported(Exception):
    """This system cannot run the row (raised alike on every rank, before any communication)."""


class Refused(Exception):
    """This system cannot run one algorithm of the sweep here; the others can.

    Raised from ``prepare`` alike on every rank, before any communication, so the
    ranks leave the algorithm out together and go on with the others.
    """


@dataclass
class SweepSpec:
    """Everything a worker needs, written by the bench process as JSON."""

    collective: str
    dtype: str
    op: str
    root: int
    in_place: bool
    points: list[tuple[int, int]]  # (nbytes, count)
    algorithms: list[str]
    policy: dict[str, Any]
    results: str
    progress: str | None = None
    label: str = ""
    options: dict[str, Any] = field(default_factory=dict)

    def save(self, path: str) -> None:
        """Write as JSON to ``path``."""
        with open(path, "w") as f:
            json.dump(asdict(self), f)


def load_spec(path: str) -> SweepSpec:
    """Read a :class:`SweepSpec` written by :meth:`SweepSpec.save`."""
    with open(path) as f:
        raw = json.load(f)
    raw["points"] = [tuple(p) for p in raw["points"]]
    return SweepSpec(**raw)


def op_by_name(name: str) -> ops.Op:
    """plait's op for ``sum``, ``prod``, ``min``, ``max``, ``avg``, ``band``, ``bor``, ``bxor``."""
    op = getattr(ops, name.upper(), None)
    if not isinstance(op, ops.Op):
        raise ValueError(f"unknown op {name!r}; expected sum, prod, min, max, avg, band, bor, bxor")
    return op


@dataclass
class Prepared:
    """One row made ready: ``call()`` runs the collective once; ``out`` is what to check."""

    call: Callable[[], object]
    algorithm: str
    out: np.ndarray | None


class Backend(Protocol):
    """What :func:`run_sweep` needs from a communication library."""

    rank: int
    size: int

    def prepare(
        self, spec: SweepSpec, point: Point, bufs: Buffers, algorithm: str
    ) -> Prepared:  # pragma: no cover - protocol
        """Bind the row's call to ``bufs``.

        Raise :class:`Unsupported` if no row can run, :class:`Refused` if ``algorithm`` cannot.
        """
        ...

    def broadcast_int(self, value: int) -> int:  # pragma: no cover - protocol
        """Rank 0's ``value``, on every rank."""
        ...

    def gather_rows(self, row: np.ndarray) -> np.ndarray | None:  # pragma: no cover - protocol
        """Every rank's float64 ``row`` (same length everywhere) stacked on rank 0, else None."""
        ...


@dataclass
class _Round:
    """One round of one (row, algorithm): what ran, and each call's time on the slowest rank."""

    algorithm: str
    warmup: int
    slowest: np.ndarray
    wrong: int


def _time_round(
    backend: Backend, spec: SweepSpec, point: Point, algorithm: str, policy: IterationPolicy
) -> _Round | None:
    """Warm up, time the calls, check one result; rank 0 gets the round, the others None."""
    dtype = resolve_dtype(spec.dtype)
    op = op_by_name(spec.op)
    rank, size = backend.rank, backend.size
    bufs = make_buffers(spec.collective, rank, size, spec.root, point.count, dtype, spec.in_place)
    prepared = backend.prepare(spec, point, bufs, algorithm)
    call = prepared.call
    bufs.reset(spec.collective, rank, spec.root)
    warmup = policy.warmup_for(point.nbytes)
    warm = np.empty(warmup)
    for i in range(warmup):
        t0 = time.perf_counter()
        call()
        warm[i] = time.perf_counter() - t0
    guess = float(np.median(warm)) if warmup else 0.0
    iters = backend.broadcast_int(policy.iters_for(guess) if rank == 0 else 0)
    times = np.empty(iters)
    clock = time.perf_counter
    for i in range(iters):
        t0 = clock()
        call()
        times[i] = clock() - t0
    bufs.reset(spec.collective, rank, spec.root)
    call()
    wrong = count_wrong(
        spec.collective, rank, size, spec.root, op, point.count, prepared.out, dtype
    )
    table = backend.gather_rows(np.concatenate(([float(wrong)], times)))
    if table is None:
        return None
    slowest = table[:, 1:].max(axis=0) if iters else np.empty(0)
    return _Round(prepared.algorithm, warmup, slowest, int(table[:, 0].sum()))


def _row(spec: SweepSpec, point: Point, rounds: list[_Round], size: int) -> dict[str, Any]:
    """The row of one (size, algorithm) from its rounds: every timed call counts alike."""
    slowest = np.concatenate([r.slowest for r in rounds])
    median, p10, p90 = summarize(slowest)
    algbw, busbw = bandwidths(spec.collective, point.nbytes, median * 1e-6, size)
    return {
        "bytes": point.nbytes,
        "count": point.count,
        "algorithm": rounds[0].algorithm,
        "warmup": sum(r.warmup for r in rounds),
        "iters": int(slowest.size),
        "rounds": len(rounds),
        # each round's own median: adjacent in time across algorithms, for paired comparisons
        "round_us": [summarize(r.slowest)[0] for r in rounds],
        "time_us": median,
        "p10_us": p10,
        "p90_us": p90,
        "algbw_gbps": algbw,
        "busbw_gbps": busbw,
        "wrong": sum(r.wrong for r in rounds),
    }


def _write_results(spec: SweepSpec, result: dict[str, Any]) -> None:
    tmp = f"{spec.results}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, spec.results)  # the bench never reads a half-written file


def run_sweep(backend: Backend, spec: SweepSpec, info: dict[str, Any] | None = None) -> int:
    """Measure every row of ``spec`` for every algorithm; return the worker's exit code."""
    policy = IterationPolicy(**spec.policy)
    per_round = [policy.per_round(r) for r in range(policy.rounds)]
    rows: list[dict[str, Any]] = []
    refused: dict[str, str] = {}  # algorithm -> why this system cannot run it here
    result: dict[str, Any] = {"label": spec.label, "size": backend.size, "info": info or {}}
    total = len(spec.points) * len(spec.algorithms)
    progress = open(spec.progress, "a") if spec.progress and backend.rank == 0 else None  # noqa: SIM115
    status = 0
    algorithm = ""
    try:
        for nbytes, count in spec.points:
            point = Point(nbytes, count)
            done: dict[str, list[_Round]] = {a: [] for a in spec.algorithms}
            for r in range(policy.rounds):
                # Every algorithm once per round, the order reversed every other round:
                # a slow drift of the machine then falls on all of them alike.
                order = spec.algorithms if r % 2 == 0 else spec.algorithms[::-1]
                for algorithm in order:
                    if algorithm in refused:
                        continue
                    try:
                        measured = _time_round(backend, spec, point, algorithm, per_round[r])
                    except Refused as exc:
                        refused[algorithm] = str(exc)
                        measured_rows = sum(r["requested"] == algorithm for r in rows)
                        total -= len(spec.points) - measured_rows
                        if progress is not None:
                            progress.write(f"refused {algorithm}\n")
                            progress.flush()
                        continue
                    if measured is not None:
                        done[algorithm].append(measured)
            for algorithm in spec.algorithms:
                if not done[algorithm] or algorithm in refused:
                    continue
                row = _row(spec, point, done[algorithm], backend.size)
                row["requested"] = algorithm
                rows.append(row)
                if progress is not None:
                    progress.write(f"{len(rows)} {total} {nbytes} {json.dumps(row)}\n")
                    progress.flush()
    except Unsupported as exc:
        result["skipped"] = str(exc)
    except Exception as exc:
        traceback.print_exc()
        result["error"] = f"rank {backend.rank}: {type(exc).__name__}: {exc}"
        result["failed"] = algorithm
        status = EXIT_FAILED
    finally:
        if progress is not None:
            progress.close()
    result["rows"] = rows
    result["refused"] = refused
    if backend.rank == 0:
        _write_results(spec, result)
    return status


def worker_main(
    make: Callable[[SweepSpec], tuple[Backend, dict[str, Any], Callable[[], None]]],
) -> None:
    """Entry point of a worker module: ``python -m … SPEC.json``.

    ``make(spec)`` connects the ranks and returns the backend, the library's
    version information and a function that disconnects.
    """
    spec = load_spec(sys.argv[1])
    try:
        backend, info, close = make(spec)
    except Unsupported as exc:
        # Every rank reaches this alike (a missing library); each writes the same file.
        _write_results(spec, {"label": spec.label, "skipped": str(exc), "rows": []})
        sys.exit(0)
    try:
        status = run_sweep(backend, spec, info)
    finally:
        close()
    sys.exit(status)
