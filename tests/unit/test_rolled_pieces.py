"""A large one-sided call's generated run loops over its pieces (Note [rolled pieces] in
plait.runtime.operations): its source does not grow with them, calls of one kind share one
compiled function whatever their size, the loop gives the bits of the operations written
out, and a window keeps compiled calls of a bounded number of steps."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import plait
from cases import AFFINE, values
from plait.algos._registry import (
    COLLECTIVES,
    REDUCING,
    AlgorithmSpec,
    build_schedule,
    get,
    specs,
)
from plait.runtime import compiled
from plait.schedule.builder import Context
from plait.testing import reference, run_ranks

#: The one-sided algorithms whose calls come in pieces (a barrier moves nothing).
PIECED = [s for c in COLLECTIVES for s in specs(c) if s.needs_window and c != "barrier"]


class _Window:
    """What compiling a schedule reads of a window: each rank's halves and its words, the
    same words at every look (Window.probe)."""

    def __init__(self, size: int, nbytes: int) -> None:
        self.halves = [np.zeros(2 * nbytes, np.uint8) for _ in range(size)]
        self.nbytes = nbytes
        self.words: dict[tuple[int, int], Any] = {}

    def typed(self, q: int, half: int, dtype: np.dtype) -> np.ndarray:
        return self.halves[q][half * self.nbytes : (half + 1) * self.nbytes].view(dtype)

    def reserve(self, nbytes: int) -> None:
        assert nbytes <= self.nbytes

    def probe(self, q: int, half: int) -> tuple[list[int], int, list[int], int]:
        return self.words.setdefault((q, half), ([0], 0, [0, 0], half))


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("spec", PIECED, ids=lambda s: f"{s.collective}-{s.name}")
def test_the_source_of_a_large_call_does_not_grow_with_its_pieces(
    spec: AlgorithmSpec, size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Written out piece by piece, each size compiled a source of its own, as long as its
    # pieces (half a megabyte and 0.35 s for a 64 MiB allreduce on 2 ranks).
    sources: list[str] = []

    def spy(source: str, *args: Any) -> Any:
        sources.append(source)
        return compile(source, *args)

    monkeypatch.setattr(compiled, "compile", spy, raising=False)
    compiled._CODE.clear()
    window = 256  # bytes: pieces of some hundred bytes, tens of them to a call
    for rank in range(size):
        runs, made = [], []
        for count in (3000, 6000, 12000):
            ctx = Context(spec.collective, rank, size, count, 1, window=window)
            schedule = build_schedule(spec, ctx)
            sources.clear()
            runs.append(compiled._compile(schedule, _Window(size, window), np.dtype(np.uint8)))
            made.append(len(sources))
        assert len(runs[2].ops[0]) > 3 * len(runs[0].ops[0]) > 60  # many pieces, more each time
        assert made[1:] == [0, 0], (rank, made)  # nothing compiled for the larger sizes
        assert runs[0].run.__code__ is runs[1].run.__code__ is runs[2].run.__code__


def _call(spec: AlgorithmSpec, op: plait.Op | None) -> Any:
    c, name = spec.collective, spec.name
    if c in ("allreduce", "reduce_scatter"):
        return lambda comm, x: getattr(comm, c)(x, op, algorithm=name)
    if c == "reduce":
        return lambda comm, x: comm.reduce(x, 1, op, algorithm=name)
    if c == "broadcast":
        return lambda comm, x: comm.broadcast(x.copy(), 1, algorithm=name)
    if c in ("gather", "scatter"):
        return lambda comm, x: getattr(comm, c)(x, 1, algorithm=name)
    return lambda comm, x: getattr(comm, c)(x, algorithm=name)


@pytest.mark.parametrize("spec", PIECED, ids=lambda s: f"{s.collective}-{s.name}")
def test_a_large_call_loops_over_its_pieces_with_the_bits_of_the_operations_written_out(
    spec: AlgorithmSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A reduction that does not commute, where the algorithm takes one: every fold's order
    # shows in the bits.
    size = 3
    op = None
    if spec.collective in REDUCING:
        op = plait.SUM if spec.commutative_only else AFFINE
    dtype = np.dtype(np.complex128 if op is AFFINE else np.float64)
    count = 3 * 301  # every rank's block of 301 elements, in pieces of a few
    inputs = [values(np.random.default_rng([7, r]), dtype, op, (count,), size) for r in range(size)]
    call = _call(spec, op)
    rolled: list[int] = []
    rows = compiled.rows

    def counted(*args: Any) -> Any:
        rolled.append(1)
        return rows(*args)

    monkeypatch.setattr(compiled, "rows", counted, raising=False)

    def body(comm: plait.Communicator) -> Any:
        return call(comm, inputs[comm.rank].copy())

    looped = run_ranks(size, body, window=1024)
    assert rolled  # the runs looped
    monkeypatch.setattr(compiled, "WRITTEN_OUT", 1 << 30, raising=False)
    rolled.clear()
    written = run_ranks(size, body, window=1024)
    assert not rolled

    want = reference(spec.collective, inputs, op=op, root=1)
    for r in range(size):
        if want[r] is None:
            assert looped[r] is None
            assert written[r] is None
            continue
        got = np.asarray(looped[r])
        assert got.tobytes() == np.asarray(written[r]).tobytes(), r
        np.testing.assert_array_equal(got, want[r])


def test_a_windows_cache_of_compiled_calls_keeps_a_bounded_number_of_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The cache kept 256 compiled calls whatever their size: megabytes each for large ones.
    monkeypatch.setattr(compiled, "KEPT_STEPS", 1000, raising=False)
    window = _Window(2, 256)
    schedules = []
    for count in range(20000, 20040):
        ctx = Context("allreduce", 0, 2, count, 1, window=256)
        schedule = build_schedule(get("allreduce", "arena"), ctx)
        compiled.compiled_for(schedule, window, np.dtype(np.uint8))
        schedules.append(schedule)
        kept = [s for s, _ in window.compiled.values()]
        assert schedule in kept  # the latest is always kept
        assert sum(len(s.steps) for s in kept) <= max(1000, len(schedule.steps))
    assert 300 < len(schedules[0].steps) < 1000  # so some calls were forgotten, some kept
