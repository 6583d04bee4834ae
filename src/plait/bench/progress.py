"""What ``plait bench`` shows on stderr while its sweeps run, and the rows it keeps meanwhile.

Rank 0 of a worker appends a line to a file after each row:
``done total nbytes {row as JSON}`` (and ``refused ALGORITHM`` for an algorithm
it cannot run, whose rows will not come). A thread of the bench process
(:class:`Follower`) reads the new lines every tenth of a second and hands each
row to :class:`Live`, which

- keeps it, so that the rows measured so far survive an interrupted run
  (Ctrl-C: the bench prints and saves them);
- prints it as one line on stderr as soon as it is measured, with the rows done
  and an estimate of the time left (:class:`Estimator`);
- on a terminal, redraws a progress bar under those lines.

stdout stays the clean table, printed at the end; logs get whole lines, and
carriage returns only when stderr is a terminal (or ``--progress``).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, TextIO

from plait.bench.sweep import IterationPolicy, format_size

__all__ = [
    "Estimator",
    "Follower",
    "Live",
    "format_duration",
    "format_time",
    "parse_line",
    "render",
    "row_line",
    "series_label",
]

_WIDTH = 30

#: Seconds per byte of S assumed for sizes beyond the ones measured until sizes of at
#: least :data:`_SLOPE_FROM` bytes have been measured (about 1 GB/s: an allreduce of two
#: ranks over shared memory on the 2-core machine the project is tested on). Below that,
#: a row's time is latency and says nothing about how time grows with the size.
_PRIOR_S_PER_BYTE = 1e-9
_SLOPE_FROM = 64 << 10


def format_duration(seconds: float) -> str:
    """``12 s``, ``6 min 40 s``, ``1 h 5 min``: a duration for people, to the second."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"


def format_time(us: float) -> str:
    """A call's time with a unit that keeps it short: ``478.5 µs``, ``12.3 ms``, ``1.20 s``."""
    if us != us:
        return "-"
    if us >= 1e6:
        return f"{us / 1e6:.2f} s"
    if us >= 1e3:
        return f"{us / 1e3:.1f} ms"
    return f"{us:.1f} µs"


def series_label(job: str, requested: str) -> str:
    """The series a row belongs to: ``plait-shm ring``, or the job alone for ``auto``."""
    return job if requested == "auto" else f"{job} {requested}"


def _left(seconds: float | None) -> str:
    """``, about 6 min 40 s left`` (nothing without an estimate)."""
    if seconds is None:
        return ""
    if seconds < 1:
        return ", under a second left"
    return f", about {format_duration(seconds)} left"


def render(
    label: str,
    done: int,
    total: int,
    nbytes: int | None,
    seconds: float,
    left: float | None = None,
) -> str:
    """One line of the bar: ``label [#####.....] done/total  size  seconds  [about … left]``."""
    filled = _WIDTH * done // total if total else _WIDTH
    bar = "#" * filled + "." * (_WIDTH - filled)
    where = f"  {format_size(nbytes)}" if nbytes is not None else ""
    return f"{label:<14} [{bar}] {done}/{total}{where}  {seconds:.1f} s{_left(left)}"


def row_line(label: str, width: int, row: dict[str, Any], done: int, total: int, left: str) -> str:
    """A measured row as one line of stderr, with the rows done and the time left."""
    return (
        f"{label:<{width}}  {format_size(row['bytes']):>9}  {format_time(row['time_us']):>10}"
        f"  busbw {row['busbw_gbps']:8.3f} GB/s  wrong {row['wrong']}  [{done}/{total}{left}]"
    )


def parse_line(line: str) -> tuple[int, int, int, dict[str, Any] | None] | None:
    """``(done, total, nbytes, row)`` of a line of the workers' file; None if it is not one."""
    parts = line.split(maxsplit=3)
    if len(parts) < 3:
        return None
    try:
        done, total, nbytes = int(parts[0]), int(parts[1]), int(parts[2])
        row = json.loads(parts[3]) if len(parts) == 4 else None
    except ValueError:
        return None
    return done, total, nbytes, row if isinstance(row, dict) else None


def _row_cost(policy: IterationPolicy, nbytes: int, call: float) -> float:
    """Seconds a row of ``nbytes`` takes when a call takes ``call`` seconds (calls × call).

    Per round: the warm-up, the timed calls (as many as fit in the round's share of
    ``--seconds`` at that speed, or ``--iters``) and the checked call.
    """
    rounds = (policy.per_round(r) for r in range(policy.rounds))
    return sum(per.warmup_for(nbytes) + per.iters_for(call) + 1 for per in rounds) * call


@dataclass
class _Job:
    label: str
    pending: list[tuple[str, int]]  # (requested algorithm, nbytes) not measured yet
    begun: float | None = None
    first: float | None = None  # when its first row arrived
    last: float | None = None  # when its latest row arrived
    startup: float | None = None  # from its start to its first row, less that row's calls
    curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)


class Estimator:
    """The time a bench run has left, from the rows measured so far.

    Every row still to come costs :func:`_row_cost` at a predicted call time: the
    latest size measured for its algorithm (in its system, else in any), plus the
    bytes beyond it at the per-byte slope between the two largest sizes measured
    (``_PRIOR_S_PER_BYTE`` until sizes of 64 KiB have been). Each row also costs
    what the rows measured so far took on average beyond their calls (buffers,
    checks, gathers), and each system not started yet the start-up time the
    first one took. None until a row has been measured.
    """

    def __init__(
        self,
        policy: IterationPolicy,
        jobs: Sequence[tuple[str, Sequence[str], Sequence[int]]],
    ) -> None:
        self.policy = policy
        self.jobs = {
            label: _Job(label, [(a, n) for n in sizes for a in algos])
            for label, algos, sizes in jobs
        }
        self.total = sum(len(j.pending) for j in self.jobs.values())
        self.planned = self.total  # before any system was skipped or stopped
        self.done = 0
        self._spent = 0.0  # wall seconds between rows of one job
        self._modelled = 0.0  # what those rows' calls add up to
        self._gaps = 0  # how many such rows

    def begin(self, job: str, now: float) -> None:
        """The job's ranks are being started."""
        self.jobs[job].begun = now

    def end(self, job: str) -> None:
        """The job is over: rows it did not measure (skipped, failed) will not come."""
        j = self.jobs[job]
        self.total -= len(j.pending)
        j.pending.clear()

    def drop(self, job: str, requested: str) -> None:
        """The rows of ``job`` for the ``requested`` algorithm will not come (it was refused)."""
        j = self.jobs[job]
        kept = [p for p in j.pending if p[0] != requested]
        self.total -= len(j.pending) - len(kept)
        j.pending = kept

    def add(self, job: str, row: dict[str, Any], now: float) -> None:
        """A row of ``job`` was measured (its ``requested`` algorithm, ``bytes``, times)."""
        j = self.jobs[job]
        key = (row.get("requested", "auto"), int(row["bytes"]))
        if key in j.pending:
            j.pending.remove(key)
        else:  # not planned (a size that collapsed): count it anyway
            self.total += 1
        self.done += 1
        call = row["time_us"] * 1e-6 if row["time_us"] == row["time_us"] else 0.0
        # Its cost as the rows to come are predicted (not its own call count, which follows
        # the warm-up's speed: on a busy machine that can be far from the median's).
        cost = _row_cost(self.policy, key[1], call)
        if j.first is None:
            j.first = now
            if j.begun is not None:
                j.startup = max(0.0, now - j.begun - cost)
        elif j.last is not None:
            self._spent += now - j.last
            self._modelled += cost
            self._gaps += 1
        j.last = now
        j.curves.setdefault(key[0], []).append((key[1], call))

    def _call(self, job: _Job, algo: str, nbytes: int) -> float | None:
        curve = job.curves.get(algo)
        if not curve:
            curve = next((j.curves[algo] for j in self.jobs.values() if j.curves.get(algo)), None)
        if not curve:
            curve = max(
                (c for j in self.jobs.values() for c in j.curves.values()),
                key=lambda c: c[-1][0],
                default=None,
            )
        if not curve:
            return None
        b_m, t_m = max(curve)
        if nbytes <= b_m:
            return t_m
        slope = _PRIOR_S_PER_BYTE
        big = sorted(p for p in curve if p[0] >= _SLOPE_FROM)
        if len(big) >= 2 and big[-1][0] > big[-2][0]:
            slope = max(0.0, (big[-1][1] - big[-2][1]) / (big[-1][0] - big[-2][0]))
        return t_m + slope * (nbytes - b_m)

    def left(self, now: float) -> float | None:
        """Seconds left, or None before the first row."""
        if self.done == 0:
            return None
        rows = 0.0
        pending = 0
        for j in self.jobs.values():
            for algo, nbytes in j.pending:
                call = self._call(j, algo, nbytes)
                rows += _row_cost(self.policy, nbytes, call) if call is not None else 0.0
                pending += 1
        # what a row costs beyond its calls: buffers, the check, the gather of the times
        extra = max(0.0, self._spent - self._modelled) / self._gaps if self._gaps else 0.0
        startups = [j.startup for j in self.jobs.values() if j.startup is not None]
        startup = sum(startups) / len(startups) if startups else 0.0
        unstarted = sum(1 for j in self.jobs.values() if j.begun is None and j.pending)
        # the row under way has been running since the latest row arrived
        lasts = [j.last for j in self.jobs.values() if j.pending and j.last is not None]
        since = now - max(lasts) if lasts else 0.0
        return max(0.0, rows + pending * extra + unstarted * startup - since)


class Live:
    """The rows measured so far, shown on stderr as they come (thread-safe).

    ``rows``: print each row as a line (default on). ``bar``: redraw a progress
    bar under them (default: when ``stream`` is a terminal).
    """

    def __init__(
        self,
        estimator: Estimator | None = None,
        stream: TextIO | None = None,
        *,
        rows: bool = True,
        bar: bool | None = None,
        width: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.estimator = estimator
        self.stream = stream if stream is not None else sys.stderr
        self.show_rows = rows
        self.bar = self._isatty() if bar is None else bar
        self.width = width
        self.clock = clock
        self.start = clock()
        self.rows: dict[str, list[dict[str, Any]]] = {}  # by job, in the order measured
        self._lock = threading.Lock()
        self._job = ""
        self._nbytes: int | None = None
        self._drawn = False

    def _isatty(self) -> bool:
        try:
            return self.stream.isatty()
        except (AttributeError, ValueError):
            return False

    def begin(self, job: str) -> None:
        """The ranks of ``job`` are being started."""
        with self._lock:
            self._job = job
            self._nbytes = None
            self.rows.setdefault(job, [])
            if self.estimator is not None and job in self.estimator.jobs:
                self.estimator.begin(job, self.clock())

    def end(self, job: str) -> None:
        """``job`` is over; clear the bar."""
        with self._lock:
            if self.estimator is not None and job in self.estimator.jobs:
                self.estimator.end(job)
            self._clear()

    def refuse(self, job: str, requested: str) -> None:
        """The ranks of ``job`` cannot run ``requested``: its rows will not come."""
        with self._lock:
            if self.estimator is not None and job in self.estimator.jobs:
                self.estimator.drop(job, requested)

    def left(self) -> float | None:
        """The estimated seconds left (None before the first row or without an estimator)."""
        return None if self.estimator is None else self.estimator.left(self.clock())

    def add(self, job: str, row: dict[str, Any]) -> None:
        """A row of ``job`` arrived: keep it, print it."""
        with self._lock:
            self.rows.setdefault(job, []).append(row)
            self._nbytes = int(row["bytes"])
            est = self.estimator
            if est is not None and job in est.jobs:
                est.add(job, row, self.clock())
            if not self.show_rows:
                return
            done = est.done if est is not None else len(self.rows[job])
            total = est.total if est is not None else 0
            left = est.left(self.clock()) if est is not None and done < total else None
            label = series_label(job, row.get("requested", "auto"))
            self._clear()
            self.stream.write(row_line(label, self.width, row, done, total or done, _left(left)))
            self.stream.write("\n")
            self._draw()
            self.stream.flush()

    def tick(self) -> None:
        """Redraw the bar (its clock moves on)."""
        with self._lock:
            if self.bar:
                self._draw()
                self.stream.flush()

    def _clear(self) -> None:
        if self._drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._drawn = False

    def _draw(self) -> None:
        if not self.bar or not self._job:
            return
        est = self.estimator
        done = est.done if est is not None else len(self.rows.get(self._job, []))
        total = est.total if est is not None else done
        left = est.left(self.clock()) if est is not None else None
        text = render(self._job, done, total, self._nbytes, self.clock() - self.start, left)
        self.stream.write("\r\x1b[K" + text)
        self._drawn = True

    def series_rows(self, job: str, requested: str) -> list[dict[str, Any]]:
        """The rows of ``job`` for one requested algorithm, measured so far."""
        with self._lock:
            return [r for r in self.rows.get(job, []) if r.get("requested", "auto") == requested]


class Follower:
    """Hand the rows a worker appends to ``path`` to ``live`` while the ``with`` block runs.

    A thread reads the new lines every ``interval`` seconds; leaving the block
    reads what is left, so every row the worker wrote reaches ``live``.
    """

    def __init__(self, job: str, path: str, live: Live, interval: float = 0.1) -> None:
        self.job = job
        self.path = path
        self.live = live
        self.interval = interval
        self._offset = 0
        self._partial = b""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start = time.monotonic()
        self._read_lock = threading.Lock()

    def poll(self) -> int:
        """Read the lines added since the last call; hand over their rows; how many."""
        with self._read_lock:
            try:
                with open(self.path, "rb") as f:
                    f.seek(self._offset)
                    data = f.read()
            except OSError:
                return 0
            self._offset += len(data)
            lines = (self._partial + data).split(b"\n")
            self._partial = lines.pop()  # an unfinished line waits for the rest
            n = 0
            for raw in lines:
                line = raw.decode(errors="replace")
                words = line.split()
                if len(words) == 2 and words[0] == "refused":
                    self.live.refuse(self.job, words[1])
                    continue
                parsed = parse_line(line)
                if parsed is not None and parsed[3] is not None:
                    self.live.add(self.job, parsed[3])
                    n += 1
            return n

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.poll()
            self.live.tick()

    def __enter__(self) -> Follower:
        self._start = time.monotonic()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self.live.begin(self.job)
        self._thread = threading.Thread(target=self._run, name="plait-bench-rows", daemon=True)
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
        self.poll()
        self.live.end(self.job)

    @property
    def seconds(self) -> float:
        """Seconds since the block began."""
        return time.monotonic() - self._start
