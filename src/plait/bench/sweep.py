"""What a sweep measures: sizes, element counts, iteration counts and bandwidths.

Pure functions, shared by the bench process and every system's worker, so that
plait, Open MPI and Gloo are measured on exactly the same points.

Sizes follow nccl-tests: a row's ``bytes`` is the whole buffer of the
collective, ``S = count * itemsize``:

=================  ==========================================================
allreduce, reduce  the vector reduced (input and output have S bytes)
broadcast          the vector broadcast
reduce_scatter     the whole input; every rank gets S/n
allgather, gather  the whole output; every rank contributes S/n
alltoall           each rank's whole input (and output)
scatter            root's whole input; every rank gets S/n
barrier            nothing (one row, 0 bytes)
=================  ==========================================================

For the block collectives the count is rounded down to a multiple of the
number of ranks, as nccl-tests does, so some small sizes collapse to the same
row (kept once).

The table of collectives (:mod:`plait.collectives`) holds which collectives
are cut in blocks and each one's bus factor; this module applies them.

Bandwidths are nccl-tests' too: ``algbw = S / t`` and ``busbw = algbw *
factor``, the factor making busbw comparable across rank counts (it is the
fraction of S that crosses the busiest link of an optimal algorithm):

==========================================  ============
allreduce                                   2(n-1)/n
reduce_scatter, allgather, alltoall         (n-1)/n
gather, scatter                             (n-1)/n  (the root's link carries all
                                            blocks but its own; nccl-tests' choice)
broadcast, reduce                           1
barrier                                     0 (no data; read the time)
==========================================  ============
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from fractions import Fraction

import numpy as np

from plait.collectives import BLOCK_COLLECTIVES, COLLECTIVES
from plait.collectives import get as _collective

__all__ = [
    "BLOCK_COLLECTIVES",
    "COLLECTIVES",
    "IterationPolicy",
    "Point",
    "bandwidths",
    "bus_factor",
    "element_count",
    "format_size",
    "parse_size",
    "points",
    "selection_bytes",
    "size_range",
    "summarize",
]

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([kmgtKMGT]?)(?:i?[bB])?\s*$")


def parse_size(text: str) -> int:
    """Bytes from ``8``, ``64K``, ``256M``, ``1G``, ``1.5M`` or ``4KiB`` (binary units).

    Raises:
        ValueError: not a size.
    """
    m = _SIZE_RE.match(text)
    if m is None:
        raise ValueError(f"not a size: {text!r}; expected e.g. 8, 64K, 256M or 1G")
    # Exact arithmetic: a float would round sizes above 2**53 (``9223372036854775807`` read
    # as 2**63), and the largest size allowed (:func:`plait.bench.options.resolve_sizes`) is
    # decided to the byte.
    value = Fraction(m.group(1)) * _UNITS[m.group(2).upper()]
    if value.denominator != 1:
        raise ValueError(f"not a whole number of bytes: {text!r}")
    return int(value)


def format_size(nbytes: int) -> str:
    """``8 B``, ``64 KiB``, ``1.5 MiB``: short and exact enough for a table or a plot axis."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.3g} {unit}"
    return f"{nbytes} B"


def size_range(begin: int, end: int, factor: int) -> list[int]:
    """``begin, begin*factor, …`` up to ``end`` inclusive (``-b/-e/-f``); 0 is followed by 1.

    Raises:
        ValueError: begin > end, a negative size, or factor < 2.
    """
    if begin < 0 or end < begin:
        raise ValueError(f"need 0 <= begin <= end; got begin={begin}, end={end}")
    if factor < 2:
        raise ValueError(f"the factor must be an integer >= 2; got {factor}")
    sizes = []
    s = begin
    while s <= end:
        sizes.append(s)
        s = s * factor if s else 1
    return sizes


def element_count(collective: str, nbytes: int, itemsize: int, size: int) -> int:
    """Elements in the collective's whole buffer S for ``nbytes`` requested (see the module doc)."""
    table = _collective(collective)
    return table.whole_count(table.unit_count(nbytes // itemsize, size), size)


@dataclass(frozen=True)
class Point:
    """One row of a sweep: the buffer S holds ``count`` elements, ``nbytes`` bytes."""

    nbytes: int
    count: int


def points(collective: str, sizes: list[int], itemsize: int, size: int) -> list[Point]:
    """The distinct rows of a sweep, in order (sizes that round to one count give one row)."""
    if _collective(collective).synchronizes:
        return [Point(0, 0)]
    seen: dict[int, Point] = {}
    for s in sizes:
        count = element_count(collective, s, itemsize, size)
        seen.setdefault(count, Point(count * itemsize, count))
    return list(seen.values())


def bus_factor(collective: str, size: int) -> float:
    """busbw / algbw for ``size`` ranks (nccl-tests' factors; see the module doc)."""
    return _collective(collective).bus_factor(size)


def bandwidths(collective: str, nbytes: int, seconds: float, size: int) -> tuple[float, float]:
    """``(algbw, busbw)`` in GB/s (10⁹ bytes per second) for S = ``nbytes`` moved in ``seconds``."""
    if seconds <= 0 or nbytes == 0:
        return 0.0, 0.0
    algbw = nbytes / seconds / 1e9
    return algbw, algbw * bus_factor(collective, size)


def selection_bytes(collective: str, count: int, itemsize: int, size: int) -> int:
    """The ``nbytes`` plait's ``algorithm="auto"`` decides on for this row.

    Mirrors the Communicator: the whole vector for allreduce, reduce and
    broadcast, one rank's block for the block collectives.
    """
    return _collective(collective).unit_count(count, size) * itemsize


@dataclass(frozen=True)
class IterationPolicy:
    """How many calls to warm up with and to time, so a sweep takes seconds, not minutes.

    Warm-up: ``warmup_bytes // nbytes`` calls, between 1 and ``max_warmup``
    (small messages need more calls to settle caches and branch predictors;
    one call of a large one suffices to touch its pages). Timed: as many calls
    as fit in ``seconds`` at the speed measured during warm-up, between
    ``min_iters`` and ``max_iters``. ``iters``/``warmup`` fix the counts.

    ``rounds`` splits each row's timed calls into that many rounds, every
    algorithm of the sweep taking its turn in each round before the next size
    (see :meth:`per_round`). Comparing algorithms then no longer means
    comparing minutes apart on a machine whose speed drifts.
    """

    # Note [rounds split the calls exactly]
    #     ``--iters N`` promises N timed calls per row, whatever ``--rounds R`` says: the
    #     first N mod R rounds take one call more than the others (7 in 3 rounds: 3, 2, 2).
    #     Every round rounded up before (ceil(N / R) each), so a row made up to R - 1 calls
    #     more than asked (10 in 4 rounds gave 12, 1 in 4 gave 4) while its header said N.
    #     A round needs a call to have a median: plait bench refuses R above N. The
    #     adaptive counts stay a budget per round (``seconds`` divided, ``min_iters`` and
    #     ``max_iters`` rounded up), as each round decides from its own warm-up.

    seconds: float = 0.2
    min_iters: int = 5
    max_iters: int = 1000
    warmup_bytes: int = 64 << 20
    max_warmup: int = 20
    iters: int | None = None
    warmup: int | None = None
    rounds: int = 1

    def per_round(self, index: int = 0) -> IterationPolicy:
        """The policy of round ``index``: ``seconds`` and ``iters`` divided among the rounds.

        ``iters`` is split exactly: the rounds' counts add up to it, the first
        ``iters % rounds`` rounds taking one call more (Note [rounds split the calls
        exactly]). Each round warms up again (``warmup`` calls, or the adaptive
        count), since other algorithms ran in between.

        Raises:
            ValueError: ``rounds`` below 1, or ``index`` not one of the rounds.
        """
        if self.rounds < 1:
            raise ValueError(f"rounds must be at least 1, not {self.rounds}")
        if not 0 <= index < self.rounds:
            raise ValueError(f"round {index} is not one of 0..{self.rounds - 1}")
        if self.rounds == 1:
            return self
        iters = None
        if self.iters is not None:
            iters = self.iters // self.rounds + (1 if index < self.iters % self.rounds else 0)
        return replace(
            self,
            seconds=self.seconds / self.rounds,
            min_iters=max(1, -(-self.min_iters // self.rounds)),
            max_iters=max(1, -(-self.max_iters // self.rounds)),
            iters=iters,
            rounds=1,
        )

    def warmup_for(self, nbytes: int) -> int:
        """Warm-up calls for a row of ``nbytes``."""
        if self.warmup is not None:
            return self.warmup
        return max(1, min(self.max_warmup, self.warmup_bytes // max(nbytes, 1)))

    def iters_for(self, seconds_per_call: float) -> int:
        """Timed calls for a row whose calls took ``seconds_per_call`` during warm-up."""
        if self.iters is not None:
            return self.iters
        if not seconds_per_call > 0:
            return self.max_iters
        wanted = math.ceil(self.seconds / seconds_per_call)
        return max(self.min_iters, min(self.max_iters, wanted))


def summarize(seconds: np.ndarray) -> tuple[float, float, float]:
    """Median, 10th and 90th percentile of per-call times, in µs."""
    if seconds.size == 0:
        return math.nan, math.nan, math.nan
    p10, p50, p90 = np.percentile(seconds, [10, 50, 90]) * 1e6
    return float(p50), float(p10), float(p90)
